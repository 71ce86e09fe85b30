"""Plain decoding: spec's engine vs transformers `generate`, same weights, same dtype, one process.

    python benchmarks/bench_engine.py [--model smollm2-135m] [--dtype float32] [--prompts 8] [--max-new-tokens 128]

Greedy, MT-Bench first turns through the chat template. Prints, side by side:
- batch 1: tokens/s of transformers and of spec over the same prompts, runs interleaved per prompt
  (a busy machine slows both alike), the ratio of the medians, and whether outputs are identical;
- spec at batch 1/4/16: aggregate tokens/s and the ratio to batch 1;
- peak RSS of the process.
Run it alone: a second busy process on 2 cores skews every number.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mt_bench" / "question.jsonl"


def first_turns(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    out = []
    for row in rows[:n]:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,16")
    a = ap.parse_args()

    from engine import Engine
    from engine.loader import transformers_model

    eng = Engine(model_path=a.model, dtype=a.dtype, max_total_tokens=64 * 1024)
    dtype = getattr(torch, a.dtype)
    hf = transformers_model(eng.model_dir, dtype)
    prompts = first_turns(eng.tokenizer, a.prompts)
    params = {"temperature": 0, "max_new_tokens": a.max_new_tokens, "ignore_eos": True}

    # Warm up both (first calls allocate and pick kernels).
    eng.generate(input_ids=prompts[0], sampling_params={**params, "max_new_tokens": 8})
    hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)

    hf_rates, our_rates, same = [], [], 0
    for p in prompts:
        t = time.perf_counter()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens,
                              do_sample=False)[0, len(p):].tolist()
        hf_rates.append(len(ref) / (time.perf_counter() - t))
        t = time.perf_counter()
        ours = eng.generate(input_ids=p, sampling_params=params)["output_ids"]
        our_rates.append(len(ours) / (time.perf_counter() - t))
        same += ours == ref
    hf_med, our_med = statistics.median(hf_rates), statistics.median(our_rates)
    print(f"model {eng.model_dir.name}  dtype {a.dtype}  {len(prompts)} MT-Bench first turns  {a.max_new_tokens} new tokens, greedy")
    print(f"batch 1   transformers {hf_med:7.1f} tok/s   spec {our_med:7.1f} tok/s   ratio {our_med / hf_med:5.2f}x   "
          f"identical outputs {same}/{len(prompts)} (min_new_tokens masks EOS in transformers; a difference can come from that)")

    base = None
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        t = time.perf_counter()
        outs = eng.generate(input_ids=batch, sampling_params=params)
        rate = sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t)
        base = base or rate
        print(f"batch {bs:<3} spec aggregate {rate:8.1f} tok/s   {rate / base:5.2f}x batch 1")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB (both models loaded)")


if __name__ == "__main__":
    main()
