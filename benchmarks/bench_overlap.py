"""The overlap scheduler (--enable-overlap-schedule) on and off: decode tokens/s, paired and interleaved.

    python benchmarks/bench_overlap.py [--model smollm2-135m] [--batch-sizes 1,8] [--rounds 5] [--algo NGRAM --tree 4,1,5]

Two engines on the same model, one without and one with the overlap scheduler. Each round runs the same
batch of MT-Bench first turns (greedy, `--max-new-tokens` each, all admitted together) on both, in
alternating order, streamed (`generate(stream=True)`, every update read as a server reads it) and not.
Decode tokens/s: tokens after each request's first, over the time from the last first token to the
last finish. Printed per case: the median of each side over rounds, and the median of the per-round
ratios on/off (the paired figure). Outputs are checked identical. Run it alone: a second busy process on
2 cores skews every number.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llamacpp import cpu_flags  # noqa: E402
from bench_step_overhead import prompts_for  # noqa: E402


def decode_rate(eng, prompts: list[list[int]], params: dict, stream: bool) -> tuple[float, list]:
    """Decode tokens/s of one batch, and its outputs."""
    if stream:
        finals = {}
        for out in eng.generate(input_ids=prompts, sampling_params=params, stream=True):
            if out["meta_info"]["finish_reason"]:
                finals[out["index"]] = out
        outs = [finals[i] for i in range(len(prompts))]
    else:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        outs = outs if isinstance(outs, list) else [outs]
    meta = [o["meta_info"] for o in outs]
    span = max(m["e2e_latency"] for m in meta) - max(m["ttft"] for m in meta)
    return sum(m["completion_tokens"] - 1 for m in meta) / span, [o["output_ids"] for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--algo", default=None, help="a speculative algorithm (default: plain decoding)")
    ap.add_argument("--tree", default="4,1,5", help="its steps,topk,draft tokens: a chain, as overlap takes")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch

    from engine import Engine

    torch.set_num_threads(a.threads)
    spec = {"speculative_algorithm": a.algo, **dict(zip(
        ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"),
        map(int, a.tree.split(","))))} if a.algo else {}
    engines = {overlap: Engine(model_path=a.model, dtype=a.dtype, max_total_tokens=32 * 1024,
                               enable_overlap_schedule=overlap, **spec) for overlap in (False, True)}
    args = engines[True].args
    print(f"# {platform.processor() or platform.machine()}, {a.threads} threads, flags: {cpu_flags()}")
    print(f"# {a.model}, --dtype {a.dtype}, {args.speculative_algorithm or 'plain decoding'} "
          f"{args.speculative_tree or ''}, greedy, {a.max_new_tokens} new tokens, {a.rounds} rounds")
    print("| batch | streamed | off tok/s | on tok/s | paired on/off | same outputs |")
    print("| --- | --- | --- | --- | --- | --- |")
    params = {"temperature": 0, "max_new_tokens": a.max_new_tokens, "ignore_eos": True}
    for batch in map(int, a.batch_sizes.split(",")):
        prompts = prompts_for(engines[False].tokenizer, batch)
        for eng in engines.values():                    # warm-up
            eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 8})
        for stream in (False, True):
            rates, outputs = {False: [], True: []}, {False: [], True: []}
            for r in range(a.rounds):
                for overlap in ((False, True) if r % 2 == 0 else (True, False)):
                    engines[overlap].flush_cache()      # every round prefills alike
                    rate, outs = decode_rate(engines[overlap], prompts, params, stream)
                    rates[overlap].append(rate)
                    outputs[overlap].append(outs)
            ratio = statistics.median(on / off for on, off in zip(rates[True], rates[False]))
            same = outputs[True] == outputs[False]
            print(f"| {batch} | {'yes' if stream else 'no'} | {statistics.median(rates[False]):.1f} | "
                  f"{statistics.median(rates[True]):.1f} | {ratio:.3f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
