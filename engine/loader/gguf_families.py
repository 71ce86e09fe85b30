"""What a GGUF file of each family llama.cpp writes means, where transformers' GGUF reader (which gives
gguf_convert.py the config and the tensor names) stops short, read as llama.cpp reads the file; and
which files the engine serves at all (`check_served`: the others are refused by their architecture):

- `readable`: header keys the reader leaves out (Qwen2-MoE's and Qwen3-MoE's expert sizes), OLMoE,
  which it does not read at all, and GPT-OSS's RoPE scaling keys, which it misreads (it takes each
  key's length for its value) and `settle` reads;
- `settle`: a "llama" file with experts is Mixtral; Phi-3's window (0 for none) and LongRoPE, whose
  factors the file stores as tensors; Gemma 2/3's attention scale, soft-caps and global RoPE scaling;
  GPT-OSS's head size, window and yarn RoPE;
- `experts` and `checkpoint_names`: a layer's experts, which the file stacks into one tensor per
  projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps: [experts, rows, columns], and GPT-OSS's biases
  [experts, rows]; Mixtral files written before April 2024 hold one tensor per expert, ffn_gate.{e}),
  are written one tensor per expert, as checkpoints name them
  (model.layers.{i}.mlp.experts.{e}.gate_proj.weight), so that each expert's quantized blocks (GPT-OSS's
  MXFP4 among them, gguf_quant.py) are kept as a linear of their own.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

# Header keys (after "{arch}.") -> config fields, added to what transformers' reader maps, per model type.
_MORE_KEYS = {
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}
# Families the reader lacks, read as the family whose keys they share.
_LIKE = {"olmoe": "qwen2_moe"}          # expert_count and expert_used_count as num_experts, num_experts_per_tok

_STACKED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
_SINGLE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")     # Mixtral files before April 2024

# The architectures (general.architecture) of the GGUF files the engine serves, and what they hold.
SERVED = {"llama": "Llama, Mistral; with experts Mixtral", "qwen2": "Qwen2/2.5", "qwen3": "Qwen3",
          "qwen2moe": "Qwen2-MoE", "qwen3moe": "Qwen3-MoE", "olmoe": "OLMoE", "phi3": "Phi-3/3.5/4",
          "gemma2": "Gemma 2", "gemma3": "Gemma 3 text", "gpt-oss": "GPT-OSS"}
# Header keys transformers' reader misreads; settle() reads them instead.
_MISREAD = ("gpt-oss.rope.scaling.",)


def check_served(path: Path) -> None:
    """Refuse, by its architecture and before any conversion, a file the engine does not serve."""
    import gguf

    from engine.errors import ModelLoadError

    field = gguf.GGUFReader(path).fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SERVED:
        raise ModelLoadError(
            f"{path} is a GGUF file of architecture {arch!r}, which spec does not serve. GGUF architectures it "
            f"serves: {', '.join(f'{a} ({what})' for a, what in SERVED.items())}. Pass one of these, or a Hugging "
            f"Face directory of a supported model.")


@contextmanager
def readable():
    """transformers' GGUF reader, within this block, maps the keys above, reads OLMoE files and does not
    see the keys it misreads."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING as mapping

    saved, supported, opened = dict(mapping), list(reader.GGUF_SUPPORTED_ARCHITECTURES), gguf.GGUFReader
    gguf.GGUFReader = lambda *args, **kwargs: _Without(opened(*args, **kwargs), _MISREAD)
    for arch, like in _LIKE.items():
        mapping[arch] = mapping[like]
    for arch, keys in _MORE_KEYS.items():
        mapping[arch] = {**mapping[arch], **keys}
    reader.GGUF_SUPPORTED_ARCHITECTURES[:] = list(mapping)
    try:
        yield
    finally:
        gguf.GGUFReader = opened
        mapping.clear()
        mapping.update(saved)
        reader.GGUF_SUPPORTED_ARCHITECTURES[:] = supported


class _Without:
    """A GGUF reader whose header lacks the keys that start with `prefixes`."""

    def __init__(self, reader, prefixes: tuple[str, ...]):
        self._reader = reader
        self.fields = {key: field for key, field in reader.fields.items() if not key.startswith(prefixes)}

    def __getattr__(self, name: str):
        return getattr(self._reader, name)


def settle(path: Path, config):
    """The config `path` means, from the one transformers' reader gave: a new one for a "llama" file with
    experts (Mixtral), else `config` with what its family's header and tensors say set."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def value(key: str):
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    if arch == "llama" and value("expert_count"):
        from transformers import MixtralConfig

        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        return MixtralConfig(**fields, num_local_experts=value("expert_count"),
                             num_experts_per_tok=value("expert_used_count"))
    if arch == "phi3":
        _phi3(reader, config, value)
    elif arch in ("gemma2", "gemma3"):
        _gemma(arch, config, value)
    elif arch == "gpt-oss":
        _gpt_oss(config, value)
    return config


def _phi3(reader, config, value) -> None:
    """Phi-3's sliding window (0: none, as Phi-4's files say) and its LongRoPE: the original context from the
    header, the short and long factors from the rope_factors_* tensors (llama.cpp writes both or neither)."""
    config.sliding_window = value("attention.sliding_window") or None
    factors = {t.name: t.data.tolist() for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        original = value("rope.scaling.original_context_length")
        config.original_max_position_embeddings = original
        config.rope_parameters = {**config.rope_parameters, "rope_type": "longrope",
                                  "original_max_position_embeddings": original,
                                  "short_factor": factors["rope_factors_short.weight"],
                                  "long_factor": factors["rope_factors_long.weight"]}


def _gemma(arch: str, config, value) -> None:
    """The attention scale 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B models, which llama.cpp
    knows by their layer count (no key says it); Gemma 2's soft-caps; Gemma 3's global RoPE scaling
    (linear, on the 4B and larger)."""
    big = config.num_hidden_layers == {"gemma2": 46, "gemma3": 62}[arch]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else config.head_dim
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if value(key) is not None:
            setattr(config, key, value(key))
    kind = value("rope.scaling.type")
    if arch == "gemma3" and kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"Gemma 3 with RoPE scaling {kind!r} (llama.cpp writes only linear scaling for it)")
        config.rope_parameters["full_attention"].update(rope_type="linear", factor=value("rope.scaling.factor"))


def _gpt_oss(config, value) -> None:
    """The head size and window, which transformers' reader leaves out, and yarn RoPE as llama.cpp reads
    it: no key says to leave the correction range unrounded (the released checkpoints' configs do), so
    it is rounded outwards, transformers' default. The experts' SwiGLU limit and gain are no keys
    either: llama.cpp's constants, GptOssConfig's defaults."""
    config.head_dim = value("attention.key_length")
    config.sliding_window = value("attention.sliding_window")
    kind = value("rope.scaling.type")
    rope = {"rope_type": "default", "rope_theta": value("rope.freq_base")}
    if kind == "yarn":
        rope.update(rope_type="yarn", factor=value("rope.scaling.factor"),
                    original_max_position_embeddings=value("rope.scaling.original_context_length"),
                    beta_fast=value("rope.scaling.yarn_beta_fast") or 32.0,
                    beta_slow=value("rope.scaling.yarn_beta_slow") or 1.0)
    elif kind not in (None, "none"):
        raise ValueError(f"GPT-OSS with RoPE scaling {kind!r} (llama.cpp writes only yarn for it)")
    config.rope_parameters = rope


def experts(gguf_name: str, data):
    """A layer's experts' tensors [(name, data)], named as checkpoints name them: a stacked tensor's
    ([experts, rows, ...]) one per expert, an older Mixtral file's tensor of one expert as it is; None for
    any other tensor."""
    if found := _STACKED.fullmatch(gguf_name):
        return [(f"model.layers.{found[1]}.mlp.experts.{e}.{found[2]}_proj.{found[3]}", part)
                for e, part in enumerate(data)]
    if found := _SINGLE.fullmatch(gguf_name):
        return [(f"model.layers.{found[1]}.mlp.experts.{found[3]}.{found[2]}_proj.weight", data)]
    return None


def checkpoint_names(model) -> set[str]:
    """The weight names a checkpoint of transformers' `model` holds: its stacked experts ([experts, ...]
    gate_up_proj and down_proj parameters, GPT-OSS's biases too) one tensor per expert and projection."""
    names = set()
    for name, param in model.named_parameters():
        prefix, _, last = name.rpartition(".")
        proj = last.removesuffix("_bias")
        if prefix.endswith(".experts") and proj in ("gate_up_proj", "down_proj"):
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            leaf = "weight" if proj == last else "bias"
            names.update(f"{prefix}.{e}.{part}.{leaf}" for e in range(param.shape[0]) for part in parts)
        else:
            names.add(name)
    return names
