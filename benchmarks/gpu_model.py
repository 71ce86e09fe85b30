"""The GPU check's model: a Llama checkpoint's tensors with random values made on the device, and an
EAGLE-3 head's, loaded by the engine through its own loader from no file (benchmarks/gpu_stages.py)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, rope_theta=500000.0)
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=320, rope_theta=10000.0)


def tensor_shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Llama checkpoint with this config, as Hugging Face names them."""
    h, v = config["hidden_size"], config["vocab_size"]
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(config["num_hidden_layers"]):
        yield from decoder_layer_shapes(f"model.layers.{layer}", config, h)
        yield f"model.layers.{layer}.input_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def decoder_layer_shapes(prefix: str, config: dict, in_features: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Attention and MLP of one layer whose q/k/v read `in_features` (EAGLE-3's read twice the hidden)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    yield from ((f"{prefix}.self_attn.q_proj.weight", (q, in_features)),
                (f"{prefix}.self_attn.k_proj.weight", (kv, in_features)),
                (f"{prefix}.self_attn.v_proj.weight", (kv, in_features)),
                (f"{prefix}.self_attn.o_proj.weight", (h, q)),
                (f"{prefix}.mlp.gate_proj.weight", (inter, h)), (f"{prefix}.mlp.up_proj.weight", (inter, h)),
                (f"{prefix}.mlp.down_proj.weight", (h, inter)),
                (f"{prefix}.post_attention_layernorm.weight", (h,)))


def eagle3_shapes(config: dict, draft_vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """An EAGLE-3 head's float tensors, named as SpecForge saves them (d2t comes separately)."""
    h = config["hidden_size"]
    yield "fc.weight", (h, 3 * h)
    yield from decoder_layer_shapes("midlayer", config, 2 * h)
    yield from ((f"midlayer.{n}.weight", (h,)) for n in ("input_layernorm", "hidden_norm"))
    yield "norm.weight", (h,)
    yield "lm_head.weight", (draft_vocab, h)


def random_tensors(shapes, dtype, device) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Random weights made on the device, one at a time: norms 1, matrices N(0, 0.02). Decode speed does
    not depend on the values."""
    import torch

    for name, shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        yield name, t.fill_(1.0) if len(shape) == 1 else t.normal_(0.0, 0.02)


@contextlib.contextmanager
def random_checkpoints(weights: dict):
    """Make engine.loader.iter_weights yield weights[model_dir]() for the given directories: the engine
    loads these models through its own loader, from no file."""
    import engine.loader as loader

    real = loader.iter_weights

    def iter_weights(model_dir, select=None, **options):       # options: the loader's, for real files
        make = weights.get(Path(model_dir).resolve())
        if make is None:
            yield from real(model_dir, select, **options)
            return
        yield from ((name, t) for name, t in make() if select is None or select(name))

    loader.iter_weights = iter_weights
    try:
        yield
    finally:
        loader.iter_weights = real


def write_model_dirs(root: Path, config: dict, draft_vocab: int) -> tuple[Path, Path]:
    """The target's and the EAGLE-3 head's directories: config.json, the tiny test tokenizer (the
    benchmark feeds token ids) and an empty model.safetensors, so the loader accepts them."""
    from safetensors.torch import save_file

    from tests.tiny import make_tokenizer

    target, draft = root / "target", root / "eagle3"
    common = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
              "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}
    configs = {target: {**common, **config, "architectures": ["LlamaForCausalLM"]},
               draft: {**common, **config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                       "draft_vocab_size": draft_vocab}}
    for path, cfg in configs.items():
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({}, str(path / "model.safetensors"))
    make_tokenizer(target)
    return target, draft


def checkpoint_makers(target: Path, draft: Path, config: dict, draft_vocab: int, dtype, device) -> dict:
    import torch

    def eagle3():
        yield from random_tensors(eagle3_shapes(config, draft_vocab), dtype, device)
        ids = torch.randperm(config["vocab_size"])[:draft_vocab].sort().values
        yield "d2t", ids - torch.arange(draft_vocab)        # on the CPU, as read from a file

    return {target.resolve(): lambda: random_tensors(tensor_shapes(config), dtype, device),
            draft.resolve(): eagle3}
