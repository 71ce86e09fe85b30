"""Tiny EAGLE drafts for a tiny target (tests/tiny.py), saved in the exact published layouts:

- EAGLE repo (yuhuili/EAGLE-*): config.json Llama-like with num_hidden_layers 1 and architectures
  ["LlamaForCausalLM"]; pytorch_model.bin with fc.weight [H, 2H], fc.bias, layers.0.self_attn.
  {q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.
  weight and a copy of the target's embed_tokens.weight (no input_layernorm, no final norm).
- SGLang's copies (lmsys/sglang-EAGLE-*): the same tensors under `model.` plus the target's
  lm_head.weight, architectures ["LlamaForCausalLMEagle"], in model.safetensors.
- EAGLE-3 (yuhuili/EAGLE3-*, SpecForge): architectures ["LlamaForCausalLMEagle3"], draft_vocab_size;
  fc.weight [H, 3H], midlayer.self_attn.{q,k,v}_proj.weight [., 2H], midlayer.{input_layernorm,
  hidden_norm,post_attention_layernorm}.weight, midlayer.mlp.*, norm.weight, lm_head.weight
  [draft_vocab, H], d2t (int64: target id = draft id + d2t[draft id]) and t2d (bool [vocab]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

_STD = 0.08


def _target(target_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((Path(target_dir) / "config.json").read_text()), load_file(Path(target_dir) / "model.safetensors")


def _head(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The target's lm_head weight: its embedding where the two are tied (Gemma's, a tied Llama's)."""
    return weights.get("lm_head.weight", weights["model.embed_tokens.weight"])


def _draft_config(target: dict, architecture: str, hidden: Optional[int] = None, **extra) -> dict:
    hidden = hidden or target["hidden_size"]
    return {
        "architectures": [architecture], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 1,
        "num_attention_heads": target["num_attention_heads"], "num_key_value_heads": target["num_key_value_heads"],
        "vocab_size": target["vocab_size"], "max_position_embeddings": 2048, "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "float32", **extra,
    }


def _attention_mlp(prefix: str, config: dict, in_features: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * _STD

    return {
        f"{prefix}.self_attn.q_proj.weight": rand(q, in_features),
        f"{prefix}.self_attn.k_proj.weight": rand(kv, in_features),
        f"{prefix}.self_attn.v_proj.weight": rand(kv, in_features),
        f"{prefix}.self_attn.o_proj.weight": rand(hidden, q),
        f"{prefix}.mlp.gate_proj.weight": rand(inter, hidden),
        f"{prefix}.mlp.up_proj.weight": rand(inter, hidden),
        f"{prefix}.mlp.down_proj.weight": rand(hidden, inter),
        f"{prefix}.post_attention_layernorm.weight": 1 + rand(hidden),
    }


def eagle_tensors(target_dir: Path, seed: int = 0,
                  hidden: Optional[int] = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a random EAGLE-1/2 draft, named as in the EAGLE repo."""
    target, weights = _target(target_dir)
    config = _draft_config(target, "LlamaForCausalLM", hidden)
    gen = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    tensors = {"fc.weight": torch.randn(h, 2 * h, generator=gen) * _STD,
               "fc.bias": torch.randn(h, generator=gen) * _STD,
               **_attention_mlp("layers.0", config, h, gen)}
    if h == target["hidden_size"]:
        tensors["embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    return config, tensors


def save_eagle_repo(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """The EAGLE repo's layout: pytorch_model.bin, bare names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(tensors, path / "pytorch_model.bin")
    return path


def save_sglang_eagle(path: Path, target_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """SGLang's renamed copy: LlamaForCausalLMEagle, names under `model.`, the target's lm_head added."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _, weights = _target(target_dir)
    renamed = {f"model.{name}": t.contiguous() for name, t in tensors.items()}
    renamed["lm_head.weight"] = _head(weights).clone()
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLMEagle"]}, indent=2))
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def save_eagle3(path: Path, target_dir: Path, seed: int = 0, draft_vocab: int = 200,
                aux_layer_ids: Optional[list[int]] = None, d2t: Optional[torch.Tensor] = None) -> Path:
    """A random EAGLE-3 draft whose vocabulary is `draft_vocab` target tokens (sorted), with d2t/t2d.
    `aux_layer_ids` go under eagle_config as SpecForge writes them; `d2t` overrides the mapping."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target, weights = _target(target_dir)
    extra = {"draft_vocab_size": draft_vocab}
    if aux_layer_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    config = _draft_config(target, "LlamaForCausalLMEagle3", **extra)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = config["hidden_size"], config["vocab_size"]
    ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": torch.randn(h, 3 * h, generator=gen) * _STD,
        **_attention_mlp("midlayer", config, 2 * h, gen),
        "midlayer.input_layernorm.weight": 1 + torch.randn(h, generator=gen) * _STD,
        "midlayer.hidden_norm.weight": 1 + torch.randn(h, generator=gen) * _STD,
        "norm.weight": 1 + torch.randn(h, generator=gen) * _STD,
        # Rows copied from the target's head: the draft then tends to agree with the target somewhat.
        "lm_head.weight": _head(weights)[ids].clone(),
        "d2t": ids - torch.arange(draft_vocab) if d2t is None else d2t,
        "t2d": t2d,
        "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(tensors, path / "pytorch_model.bin")
    return path


# ------------------------------------------------------------------------------------------------
# A target the draft can predict exactly: with every layer's o_proj and down_proj zero, the target's
# hidden state is its input embedding, so its next token depends on the current token only:
# argmax lm_head(norm(embed(x))) = argmax lm_head(embed(x)) (the norm only rescales; its weight is 1).
# An EAGLE draft whose fc passes the embedding through ([I | 0]) and whose layer adds nothing
# (o_proj = down_proj = 0) outputs embed(x_{t+1}): exactly the target's choice, at every depth.
def make_bigram_target(target_dir: Path) -> Path:
    """Zero the o_proj and down_proj of a tiny target saved by tests/tiny.py, in place."""
    from safetensors.torch import save_file

    _, weights = _target(target_dir)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(weights, str(Path(target_dir) / "model.safetensors"), metadata={"format": "pt"})
    return Path(target_dir)


def exact_eagle_tensors(target_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of an EAGLE draft that predicts a bigram target (make_bigram_target) exactly."""
    config, tensors = eagle_tensors(target_dir)
    h = config["hidden_size"]
    tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors["fc.bias"] = torch.zeros(h)
    tensors["layers.0.self_attn.o_proj.weight"].zero_()
    tensors["layers.0.mlp.down_proj.weight"].zero_()
    return config, tensors


# ------------------------------------------------------------------------------------------------
# Targets carrying their own MTP layer (engine/models/mtp.py), as copies of a tiny target:
# - MiMo: config architectures ["MiMoForCausalLM"], model_type "mimo", attention_bias true (Qwen2
#   attention still: q/k/v biases only), num_nextn_predict_layers; weights model.mtp_layers.0.
#   {token_layernorm, hidden_layernorm, input_proj, input_layernorm, self_attn.{q,k,v,o}_proj (+ q/k/v
#   biases), post_attention_layernorm, mlp.*, final_layernorm}.
# - DeepSeek-style nextn on a Llama or a DeepSeek-V3 (its decoder layer MLA + MoE): num_nextn_predict_layers;
#   weights model.layers.{L}.{enorm, hnorm, eh_proj, <decoder layer>, shared_head.norm} plus copies of
#   embed_tokens and shared_head.head.
# Names of (token norm, feature norm, projection, final norm); the projection reads [feature; token]
# for MiMo and [token; feature] for nextn.
MTP_NAMES = {"mimo": ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
              "nextn": ("enorm", "hnorm", "eh_proj", "shared_head.norm")}


def mtp_layer_tensors(config: dict, prefix: str, layout: str, seed: int = 0,
                      exact: bool = False) -> dict[str, torch.Tensor]:
    """A random MTP layer; `exact`: one that predicts a bigram target (make_bigram_target) exactly: the
    projection passes the token half through, the decoder layer adds nothing, norms are 1."""
    gen = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    token_norm, feature_norm, proj, final_norm = MTP_NAMES[layout]
    deepseek = config.get("model_type") == "deepseek_v3"
    tensors = _deepseek_layer(config, prefix, seed) if deepseek else _attention_mlp(prefix, config, h, gen)
    for name in ("input_layernorm", token_norm, feature_norm, final_norm):
        tensors[f"{prefix}.{name}.weight"] = 1 + torch.randn(h, generator=gen) * _STD
    tensors[f"{prefix}.{proj}.weight"] = torch.randn(h, 2 * h, generator=gen) * _STD
    if layout == "mimo":
        for p in "qkv":
            rows = tensors[f"{prefix}.self_attn.{p}_proj.weight"].shape[0]
            tensors[f"{prefix}.self_attn.{p}_proj.bias"] = torch.randn(rows, generator=gen) * _STD
    if exact:
        halves = [torch.zeros(h, h), torch.eye(h)] if layout == "mimo" else [torch.eye(h), torch.zeros(h, h)]
        tensors[f"{prefix}.{proj}.weight"] = torch.cat(halves, dim=1)
        for name, tensor in tensors.items():
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()
    return tensors


def _deepseek_layer(config: dict, prefix: str, seed: int) -> dict[str, torch.Tensor]:
    """A random DeepSeek-V3 decoder layer of index num_hidden_layers (MLA; MoE past first_k_dense_replace),
    one tensor per expert as checkpoints store them (transformers keeps them stacked in memory)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(DeepseekV3Config.from_dict(config), config["num_hidden_layers"])
    tensors = {}
    for name, t in layer.state_dict().items():
        t = t.detach().clone()
        if t.dim() >= 2:
            t.normal_(0.0, _STD)
        if name == "mlp.experts.gate_up_proj":
            for e, w in enumerate(t):
                tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"] = w.chunk(2)
        elif name == "mlp.experts.down_proj":
            tensors.update({f"mlp.experts.{e}.down_proj.weight": w for e, w in enumerate(t)})
        else:
            tensors[name] = t.normal_(0.0, 0.1) if name.endswith("e_score_correction_bias") else t
    return {f"{prefix}.{name}": t.contiguous() for name, t in tensors.items()}


def save_mtp_target(path: Path, base_dir: Path, layout: str, seed: int = 0,
                    exact: bool | tuple[bool, ...] = False) -> Path:
    """A copy of the tiny target `base_dir` (qwen2 for "mimo", llama or deepseek_v3 for "nextn") with one MTP
    layer, or one per flag of an `exact` tuple (layer k exact when exact[k]; seeds seed + k)."""
    import shutil

    from safetensors.torch import save_file

    path = Path(path)
    shutil.copytree(base_dir, path)
    config, weights = _target(path)
    flags = exact if isinstance(exact, tuple) else (exact,)
    if layout == "mimo":
        config.update(architectures=["MiMoForCausalLM"], model_type="mimo", attention_bias=True)
    config["num_nextn_predict_layers"] = len(flags)
    for k, flag in enumerate(flags):
        if layout == "mimo":
            prefix = f"model.mtp_layers.{k}"
        else:
            prefix = f"model.layers.{config['num_hidden_layers'] + k}"
            weights[f"{prefix}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
            weights[f"{prefix}.shared_head.head.weight"] = _head(weights).clone()
        weights.update(mtp_layer_tensors(config, prefix, layout, seed + k, flag))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def save_nextn_export(path: Path, target_dir: Path, mla: bool = False) -> Path:
    """SGLang's export_deepseek_nextn.py layout of a nextn target's layer: config num_hidden_layers 1, the
    layer renamed model.layers.0 without its embed_tokens and shared_head.head, in
    nextn_layer_parameters.safetensors listed by model.safetensors.index.json. `mla`: k/v projections
    replaced by DeepSeek's MLA ones (kv_a_proj_with_mqa, kv_b_proj): weights of another family than the
    config says."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True)
    config, weights = _target(target_dir)
    prefix = f"model.layers.{config['num_hidden_layers']}."
    layer = {"model.layers.0." + name[len(prefix):]: t for name, t in weights.items()
             if name.startswith(prefix) and "embed_tokens" not in name and "shared_head.head" not in name}
    if mla:
        del layer["model.layers.0.self_attn.k_proj.weight"], layer["model.layers.0.self_attn.v_proj.weight"]
        layer["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(24, config["hidden_size"])
        layer["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(64, 16)
    config.update(num_hidden_layers=1, architectures=[config["architectures"][0] + "NextN"])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(layer, str(path / "nextn_layer_parameters.safetensors"), metadata={"format": "pt"})
    index = {"weight_map": {name: "nextn_layer_parameters.safetensors" for name in layer}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path
