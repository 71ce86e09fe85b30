"""Host time per decode step outside the model forward: what the engine itself costs per step.

    python benchmarks/bench_step_overhead.py [--model smollm2-135m] [--batch-sizes 1,32] [--algos plain,NGRAM]
    python benchmarks/bench_step_overhead.py --other-checkout ../old    # side by side with another commit

Greedy, fp32, MT-Bench first turns through the chat template, `--max-new-tokens` each, all requests
of a batch admitted together. Every decode step is timed as a whole (`Engine.step`) and, inside it, the
time spent in the target model's forward and lm_head (the draft model's too, for model-based drafts);
the rest is host time, split in two: the worker's (batch building, drafting bookkeeping, sampling,
verification, the host copy: inside `Worker.forward`) and the scheduler's (applying the previous step,
scheduling, slot allocation). Printed per (algorithm, batch size): median step ms, median model
ms, median worker and scheduler host ms, and the host share of all steps' time.

With --other-checkout DIR the same measurement runs in a subprocess on DIR's engine (another commit's
worktree), interleaved with this checkout's, case by case, so both see the same machine state.
Run it alone: a second busy process on 2 cores skews every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MT_BENCH = HERE.parent / "shared" / "datasets" / "mt_bench" / "question.jsonl"


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    out = []
    for k in range(n):
        msg = [{"role": "user", "content": rows[k % len(rows)]["turns"][0]}]
        enc = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def _timed(fn, acc: list):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[0] += time.perf_counter() - t
    return wrapper


def _models(eng) -> list:
    """The target model, and a draft model where the algorithm has one, read through `Engine.debug`
    (so --other-checkout needs a checkout that has it)."""
    view = eng.debug
    draft = getattr(view.drafter, "model", None)
    return [view.target.model] + ([draft] if draft is not None else [])


def _decode_steps(eng) -> int:
    return eng.stats()["decode_steps"]


def decode_step_times(eng, reqs, accs: list[list]) -> tuple[list[float], list[list[float]]]:
    """Run `reqs` to the end, step by step: the wall time of every decode step, and per `_timed`
    accumulator in `accs`, what it gathered during each."""
    for r in reqs:
        eng.add_request(r)
    steps, inner = [], [[] for _ in accs]
    while not all(r.finished for r in reqs):
        before = _decode_steps(eng)
        for acc in accs:
            acc[0] = 0.0
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        if _decode_steps(eng) > before:
            steps.append(dt)
            for acc, times in zip(accs, inner):
                times.append(acc[0])
    return steps, inner


def measure(model: str, algo: str, batch: int, max_new: int, threads: int, tree: list) -> dict:
    import torch

    from engine import Engine
    from engine.core.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    kw = {} if algo == "plain" else {"speculative_algorithm": algo, **dict(zip(
        ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"), tree))}
    eng = Engine(model_path=model, dtype="float32", max_total_tokens=64 * 1024, max_running_requests=max(batch, 1),
                 context_length=4096, **kw)
    model_time, worker_time = [0.0], [0.0]
    worker = eng.debug.worker
    worker.forward = _timed(worker.forward, worker_time)
    for m in _models(eng):
        m.forward = _timed(m.forward, model_time)
        if hasattr(m, "compute_logits"):
            m.compute_logits = _timed(m.compute_logits, model_time)
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    prompts = prompts_for(eng.tokenizer, batch)
    eng.generate(input_ids=prompts[0], sampling_params={**params, "max_new_tokens": 8})     # warm-up
    reqs = [eng.make_request(p, SamplingParams.from_dict(params)) for p in prompts]
    steps, (models, workers) = decode_step_times(eng, reqs, [model_time, worker_time])
    host = [s - m for s, m in zip(steps, models)]
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"algo": algo, "batch": batch, "steps": len(steps), "tokens": tokens,
            "step_ms": 1e3 * statistics.median(steps), "model_ms": 1e3 * statistics.median(models),
            "worker_ms": 1e3 * statistics.median(w - m for w, m in zip(workers, models)),
            "scheduler_ms": 1e3 * statistics.median(s - w for s, w in zip(steps, workers)),
            "host_share": sum(host) / sum(steps)}


def _run_child(checkout: Path, case: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(case)]
    out = subprocess.run(cmd, env=env, cwd=checkout, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--algos", default="plain,NGRAM")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", default="5,4,8", help="steps,topk,draft tokens of speculative runs (the same "
                    "for both checkouts: their defaults may differ)")
    ap.add_argument("--other-checkout", type=Path, help="another commit's worktree, measured interleaved")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(**json.loads(a.child))))
        return
    import platform

    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith(("avx512", "amx"))}) \
        if Path("/proc/cpuinfo").exists() else []
    print(f"# {platform.processor() or platform.machine()}, {a.threads} threads, flags: {' '.join(flags)}")
    print("| checkout | algo | batch | decode steps | step ms | model ms | worker host ms | scheduler ms "
          "| host share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for algo in a.algos.split(","):
        for batch in map(int, a.batch_sizes.split(",")):
            case = {"model": a.model, "algo": algo, "batch": batch, "max_new": a.max_new_tokens, "threads": a.threads,
                    "tree": [int(x) for x in a.tree.split(",")]}
            runs = [("this", HERE)] + ([("other", a.other_checkout.resolve())] if a.other_checkout else [])
            for name, checkout in runs:
                r = _run_child(checkout, case)
                print(f"| {name} | {algo} | {batch} | {r['steps']} | {r['step_ms']:.1f} | {r['model_ms']:.1f} | "
                      f"{r['worker_ms']:.2f} | {r['scheduler_ms']:.2f} | {100 * r['host_share']:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
