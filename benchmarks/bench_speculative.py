"""Speculative decoding vs plain decoding, side by side in one process, greedy, MT-Bench first turns.

    python benchmarks/bench_speculative.py ngram       [--model smollm2-135m] [--prompts 8] [--max-new-tokens 128]
    python benchmarks/bench_speculative.py standalone  [--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b]

ngram: spec plain vs spec NGRAM on the same engine weights (two engines, one process).
standalone: spec plain vs spec STANDALONE vs transformers `generate` and transformers assisted
generation (its defaults: 20 assistant tokens, confidence threshold 0.4) on the same pair and dtype.
Every configuration runs each prompt in turn (interleaved, so load on the machine hits all alike);
tokens/s are medians over prompts and speedups are ratios of those medians to spec plain. Outputs are
compared token for token with spec plain (exact in float32; bf16 may break argmax ties differently).
Run it alone: a second busy process on 2 cores skews every number.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from bench_engine import first_turns  # noqa: E402  (benchmarks/ is run as a script folder)

PARAMS = {"temperature": 0, "ignore_eos": True}


def spec_runner(engine, max_new: int) -> Callable[[list[int]], list[int]]:
    def run(ids):
        return engine.generate(input_ids=ids, sampling_params={**PARAMS, "max_new_tokens": max_new})["output_ids"]
    return run


def hf_runner(model, max_new: int, assistant=None) -> Callable[[list[int]], list[int]]:
    def run(ids):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, assistant_model=assistant)
        return out[0, len(ids):].tolist()
    return run


def compare(runners: dict[str, Callable], prompts: list[list[int]], accept: dict[str, Callable[[], float]]) -> None:
    rates = {name: [] for name in runners}
    outputs = {name: [] for name in runners}
    for name, run in runners.items():                       # warm-up
        run(prompts[0][:16])
    for p in prompts:
        for name, run in runners.items():
            t = time.perf_counter()
            out = run(p)
            rates[name].append(len(out) / (time.perf_counter() - t))
            outputs[name].append(out)
    base_name = next(iter(runners))
    base = statistics.median(rates[base_name])
    print(f"{'config':<34}{'tok/s':>9}{'speedup':>9}{'accept len':>12}{'same as plain':>15}")
    for name in runners:
        med = statistics.median(rates[name])
        same = sum(a == b for a, b in zip(outputs[name], outputs[base_name]))
        acc = accept.get(name)
        acc_s = f"{acc():.2f}" if acc else "-"
        print(f"{name:<34}{med:9.2f}{med / base:8.2f}x{acc_s:>12}{same:>10}/{len(prompts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["ngram", "standalone"])
    ap.add_argument("--model", default="smollm2-135m", help="ngram: the target")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default=None, help="default: float32 for ngram, bfloat16 for standalone")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default=None, help="steps,topk,draft_tokens (default: the auto choice)")
    a = ap.parse_args()

    from engine import Engine

    dtype = a.dtype or ("float32" if a.mode == "ngram" else "bfloat16")
    tree = {}
    if a.tree:
        s, k, n = (int(x) for x in a.tree.split(","))
        tree = {"speculative_num_steps": s, "speculative_eagle_topk": k, "speculative_num_draft_tokens": n}
    common = {"dtype": dtype, "max_total_tokens": 32 * 1024}
    target = a.model if a.mode == "ngram" else a.target
    plain = Engine(model_path=target, **common)
    prompts = first_turns(plain.tokenizer, a.prompts)
    runners = {"spec plain": spec_runner(plain, a.max_new_tokens)}
    accept = {}
    if a.mode == "ngram":
        spec = Engine(model_path=target, speculative_algorithm="NGRAM", **tree, **common)
    else:
        spec = Engine(model_path=target, speculative_algorithm="STANDALONE", speculative_draft_model_path=a.draft,
                      **tree, **common)
    label = f"spec {spec.args.speculative_algorithm} {spec.args.speculative_tree}"
    runners[label] = spec_runner(spec, a.max_new_tokens)
    accept[label] = lambda: spec.stats()["avg_spec_accept_length"]
    if a.mode == "standalone":
        from engine.loader import resolve_model_path, transformers_model

        hf_t = transformers_model(plain.model_dir, getattr(torch, dtype))
        hf_d = transformers_model(resolve_model_path(a.draft), getattr(torch, dtype))
        runners["transformers generate"] = hf_runner(hf_t, a.max_new_tokens)
        runners["transformers assisted (defaults)"] = hf_runner(hf_t, a.max_new_tokens, hf_d)
    print(f"{a.mode}: target {target}  dtype {dtype}  {len(prompts)} MT-Bench first turns  "
          f"{a.max_new_tokens} new tokens, greedy")
    compare(runners, prompts, accept)


if __name__ == "__main__":
    main()
