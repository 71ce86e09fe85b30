"""A mixture of experts against a dense model of the same active size, on this machine: random weights at
Qwen3-30B-A3B's layer shape (128 experts of 768, 8 a token) for a few layers, and a dense Qwen3 whose MLP
is those 8 experts' width (6144), loaded through the engine's own loader from no file. Each in bf16, and
as a Q4_0 GGUF is served on the CPU (w4a8): every decoder linear, experts included, random Q4_0 blocks
kept as they are (engine/models/quant.py install_gguf_groups), the head int8 groups.

Prints, for each: the weight bytes a one-token forward reads (attention, the MLP or the chosen experts,
the head), forward times of 1 and 8 rows (a decode step and an 8-token verification: the tokens of a
verification choose up to 8 x 8 experts, whose union the MoE reads), and decode tokens/s at batch 1.
Random weights route tokens about uniformly; a trained router's choices overlap more within a text.

    python benchmarks/bench_moe.py --layers 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
             rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=1)
EXPERTS, TOP_K, EXPERT_SIZE = 128, 8, 768
# Weight bytes a weight under w4a8 as the kernel holds them: a Q4_0 linear's nibbles and fp16 scale and min
# per 32, the head's int8 and fp16 scale and min per 32; norms and routers stay bf16.
Q4_0_BYTES, HEAD_BYTES = 20 / 32, 36 / 32


def configs(layers: int) -> dict[str, dict]:
    common = {**SHAPE, "num_hidden_layers": layers}
    return {"moe": {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                    "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_SIZE,
                    "intermediate_size": 6144, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
            "dense": {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                      "intermediate_size": TOP_K * EXPERT_SIZE}}


def shapes(config: dict):
    h, d, v = config["hidden_size"], config["head_dim"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from ((f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                    (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                    (f"{p}.self_attn.q_norm.weight", (d,)), (f"{p}.self_attn.k_norm.weight", (d,)),
                    (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)))
        if config["model_type"] == "qwen3_moe":
            yield f"{p}.mlp.gate.weight", (EXPERTS, h)
            for e in range(EXPERTS):
                yield from mlp(f"{p}.mlp.experts.{e}", h, EXPERT_SIZE)
        else:
            yield from mlp(f"{p}.mlp", h, config["intermediate_size"])
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def mlp(prefix: str, h: int, inter: int):
    yield from ((f"{prefix}.gate_proj.weight", (inter, h)), (f"{prefix}.up_proj.weight", (inter, h)),
                (f"{prefix}.down_proj.weight", (h, inter)))


def quantized(name: str) -> bool:
    """Whether w4a8 serves this tensor from Q4_0 blocks: the decoder's linears (an MoE's router stays)."""
    return name.endswith("_proj.weight")


def bytes_a_token(config: dict, w4a8: bool) -> float:
    """Weight bytes one token's forward reads: every tensor but the embedding's unread rows and, in the MoE,
    the experts it did not choose; in bf16, or under w4a8 as the kernel holds them."""
    total = 0.0
    for name, shape in shapes(config):
        if name == "model.embed_tokens.weight":
            continue
        n = 1
        for s in shape:
            n *= s
        if ".experts." in name:
            n = n * TOP_K // EXPERTS
        total += n * weight_bytes(name, w4a8)
    return total


def weight_bytes(name: str, w4a8: bool) -> float:
    if not w4a8:
        return 2
    return Q4_0_BYTES if quantized(name) else HEAD_BYTES if name == "lm_head.weight" else 2


def q4_0_blocks(config: dict):
    """name -> random Q4_0 blocks (gguf_quant.Groups: nibbles, scale d, min -8 d) of each decoder linear,
    made when asked for; None for the other tensors, as a converted GGUF's gguf_groups answers."""
    import torch

    from engine.loader.gguf_quant import Groups

    sizes = {name: shape for name, shape in shapes(config) if quantized(name)}

    def lookup(name: str):
        if name not in sizes:
            return None
        (rows, columns), g = sizes[name], torch.Generator().manual_seed(zlib.crc32(name.encode()))
        scale = torch.rand(rows, columns // 32, generator=g) * 2e-3 + 1e-3
        return Groups(4, torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8, generator=g), scale, -8 * scale)

    return lookup


@contextlib.contextmanager
def gguf_files(lookups: dict):
    """Make the loader find lookups[model_dir] as the directory's GGUF blocks (gguf_quant.gguf_groups)."""
    from engine.loader import gguf_quant

    real = gguf_quant.gguf_groups
    gguf_quant.gguf_groups = lambda model_dir: lookups.get(Path(model_dir).resolve()) or real(model_dir)
    try:
        yield
    finally:
        gguf_quant.gguf_groups = real


def measure(name: str, config: dict, root: Path, new_tokens: int, w4a8: bool) -> dict:
    import torch
    from safetensors.torch import save_file

    from benchmarks.gpu_model import random_checkpoints, random_tensors
    from engine import Engine
    from tests.tiny import make_tokenizer

    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({}, str(path / "model.safetensors"))
    make_tokenizer(path)
    # Under w4a8 the linears come as blocks only: no float copy of them is made.
    floats = [(n, shape) for n, shape in shapes(config) if not (w4a8 and quantized(n))]
    with random_checkpoints({path.resolve(): lambda: random_tensors(floats, torch.bfloat16, "cpu")}), \
            gguf_files({path.resolve(): q4_0_blocks(config)} if w4a8 else {}):
        eng = Engine(model_path=str(path), dtype="bfloat16", max_total_tokens=8192, context_length=4096,
                     max_running_requests=8, quantization="w4a8" if w4a8 else "none")
    times = {r: forward_seconds(eng, r) for r in (1, 8)}
    start = time.perf_counter()
    eng.generate(input_ids=list(range(3, 35)), sampling_params={"temperature": 0, "max_new_tokens": new_tokens,
                                                               "ignore_eos": True})
    seconds = time.perf_counter() - start
    eng.shutdown()
    return {"model": name, "bytes_a_token_mb": bytes_a_token(config, w4a8) / 1e6, "forward_1_ms": times[1] * 1e3,
            "forward_8_ms": times[8] * 1e3, "verify8_over_step": times[8] / times[1],
            "decode_tok_s": new_tokens / seconds}


def forward_seconds(eng, rows: int, repeats: int = 3) -> float:
    """The fastest of `repeats` forwards of `rows` one-token rows of different tokens (the same token in
    every row would choose the same experts in every row)."""
    import torch

    from engine.core.forward_batch import make_batch

    kv, runner = eng.debug.kv, eng.debug.target
    slots = kv.alloc(rows)
    ids = torch.randint(3, SHAPE["vocab_size"], (rows,), generator=torch.Generator().manual_seed(rows)).tolist()
    best = float("inf")
    try:
        with torch.inference_mode():
            batch = make_batch(kv.table, [kv.pad_row] * rows, [0] * rows, ids, slots, [1] * rows)
            for _ in range(repeats + 1):
                start = time.perf_counter()
                runner.forward(batch, all_logits=True)
                best = min(best, time.perf_counter() - start)
    finally:
        kv.free(slots)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of each model (default 4)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded at batch 1 (default 32)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(f"{name}-w4a8" if w4a8 else name, config, Path(tmp), args.new_tokens, w4a8)
                for w4a8 in (False, True) for name, config in configs(args.layers).items()]
    print(f"{'model':10} {'MB a token':>10} {'1 row ms':>9} {'8 rows ms':>9} {'8/1':>5} {'tok/s':>7}")
    for r in rows:
        print(f"{r['model']:10} {r['bytes_a_token_mb']:10.1f} {r['forward_1_ms']:9.1f} {r['forward_8_ms']:9.1f} "
              f"{r['verify8_over_step']:5.2f} {r['decode_tok_s']:7.2f}")


if __name__ == "__main__":
    main()
