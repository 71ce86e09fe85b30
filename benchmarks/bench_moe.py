"""A mixture of experts against a dense model of the same active size, on this machine: random bf16 weights
at Qwen3-30B-A3B's layer shape (128 experts of 768, 8 a token) for a few layers, and a dense Qwen3 whose MLP
is those 8 experts' width (6144), loaded through the engine's own loader from no file.

Prints, for each: the weight bytes a one-token forward reads (attention, the MLP or the chosen experts,
the head), forward times of 1 and 8 rows (a decode step and an 8-token verification: the tokens of a
verification choose up to 8 x 8 experts, whose union the MoE reads), and decode tokens/s at batch 1.
Random weights route tokens about uniformly; a trained router's choices overlap more within a text.

    python benchmarks/bench_moe.py --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
             rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=1)
EXPERTS, TOP_K, EXPERT_SIZE = 128, 8, 768


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


def bytes_a_token(config: dict) -> int:
    """Weight bytes (bf16) one token's forward reads: every tensor but the embedding's unread rows and,
    in the MoE, the experts it did not choose."""
    total = 0
    for name, shape in shapes(config):
        if name == "model.embed_tokens.weight":
            continue
        n = 1
        for s in shape:
            n *= s
        if ".experts." in name:
            n = n * TOP_K // EXPERTS
        total += 2 * n
    return total


def measure(name: str, config: dict, root: Path, new_tokens: int) -> dict:
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
    with random_checkpoints({path.resolve(): lambda: random_tensors(shapes(config), torch.bfloat16, "cpu")}):
        eng = Engine(model_path=str(path), dtype="bfloat16", max_total_tokens=4096, context_length=4096,
                     max_running_requests=8)
    times = {r: forward_seconds(eng, r) for r in (1, 8)}
    start = time.perf_counter()
    eng.generate(input_ids=list(range(3, 35)), sampling_params={"temperature": 0, "max_new_tokens": new_tokens,
                                                               "ignore_eos": True})
    seconds = time.perf_counter() - start
    eng.shutdown()
    return {"model": name, "bytes_a_token_mb": bytes_a_token(config) / 1e6, "forward_1_ms": times[1] * 1e3,
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
        rows = [measure(name, config, Path(tmp), args.new_tokens) for name, config in configs(args.layers).items()]
    print(f"{'model':6} {'MB a token':>10} {'1 row ms':>9} {'8 rows ms':>9} {'8/1':>5} {'tok/s':>7}")
    for r in rows:
        print(f"{r['model']:6} {r['bytes_a_token_mb']:10.1f} {r['forward_1_ms']:9.1f} {r['forward_8_ms']:9.1f} "
              f"{r['verify8_over_step']:5.2f} {r['decode_tok_s']:7.2f}")


if __name__ == "__main__":
    main()
