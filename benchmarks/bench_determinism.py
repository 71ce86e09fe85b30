"""What determinism by default costs, and which rule verifies sampled requests best.

    python benchmarks/bench_determinism.py speed [--model qwen2.5-coder-1.5b] [--prompts 4] [--max-new-tokens 128]
                                                 [--prefill 128,512,2048] [--flags '{"disable_deterministic_inference": true}']
    python benchmarks/bench_determinism.py rules [--model qwen2.5-coder-1.5b] [--prompts 8] [--temperatures 0.7,1.0]

speed: one Engine with the defaults (plus --flags, a JSON dict of Engine options), batch 1, MT-Bench
first turns through the chat template: decode tokens/s (new tokens - 1 over the time after the first
token), greedy and sampled (temperature 0.7, a seed per prompt), plain and with NGRAM (and STANDALONE
with the 0.5B draft for Qwen2.5-Coder-1.5B); then prefill time of fresh random prompts of each
--prefill length (one output token; no cache hit). It uses only the Engine API, so the same file runs
in an older checkout: run it in each in turn, as whole processes, and compare medians
(`PYTHONPATH=OTHER_CHECKOUT python benchmarks/bench_determinism.py speed`).
rules: requests without a seed verified by each --speculative-sampling rule (NGRAM: coupled against
tree; STANDALONE: coupled against rejection), accept length and decode tokens/s at each temperature,
the rules interleaved prompt by prompt.
Run it alone: a second busy process on 2 cores skews every number.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from bench_engine import first_turns  # noqa: E402  (benchmarks/ is run as a script folder)

DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    keep = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni")]
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return f"{model}: {' '.join(keep)}"


def decode_rate(engine, ids: list[int], params: dict) -> tuple[float, float]:
    """(decode tokens/s, accept length or 1) of one request."""
    meta = engine.generate(input_ids=ids, sampling_params=params)["meta_info"]
    n = meta["completion_tokens"]
    return (n - 1) / (meta["e2e_latency"] - meta["ttft"]), meta.get("spec_accept_length") or 1.0


def speed(a, Engine) -> None:
    flags = json.loads(a.flags)
    configs = {"plain": {}, "NGRAM": {"speculative_algorithm": "NGRAM"}}
    if a.model in DRAFTS:
        configs["STANDALONE"] = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": DRAFTS[a.model]}
    for name, spec in configs.items():
        engine = Engine(model_path=a.model, **flags, **spec)
        prompts = first_turns(engine.tokenizer, a.prompts)
        engine.generate(input_ids=prompts[0][:16], sampling_params={"max_new_tokens": 4})     # warm-up
        for kind in ("greedy", "sampled"):
            rates = []
            for i, p in enumerate(prompts):
                params = {"max_new_tokens": a.max_new_tokens, "ignore_eos": True, "temperature": 0.0}
                if kind == "sampled":
                    params.update(temperature=0.7, seed=i)
                rates.append(decode_rate(engine, p, params)[0])
            print(f"{name:10s} {kind:7s} decode {statistics.median(rates):6.1f} tok/s "
                  f"(min {min(rates):.1f}, max {max(rates):.1f})", flush=True)
        if name == "plain":
            vocab = engine.model_config.vocab_size
            for length in map(int, a.prefill.split(",")):
                times = []
                for r in range(3):
                    ids = random.Random(length * 10 + r).choices(range(100, vocab - 100), k=length)
                    meta = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})["meta_info"]
                    times.append(meta["ttft"])
                print(f"{name:10s} prefill {length:5d} tokens {statistics.median(times) * 1e3:8.1f} ms "
                      f"(min {min(times) * 1e3:.1f})", flush=True)
        engine.shutdown()


def rules(a, Engine) -> None:
    pairs = {"NGRAM": ({}, ("coupled", "tree"))}
    if a.model in DRAFTS:
        pairs["STANDALONE"] = ({"speculative_draft_model_path": DRAFTS[a.model]}, ("coupled", "rejection"))
    for algo, (extra, names) in pairs.items():
        engines = {rule: Engine(model_path=a.model, speculative_algorithm=algo, speculative_sampling=rule, **extra)
                   for rule in names}
        prompts = first_turns(next(iter(engines.values())).tokenizer, a.prompts)
        for temperature in map(float, a.temperatures.split(",")):
            got = {rule: ([], []) for rule in names}
            for p in prompts:
                for rule, engine in engines.items():
                    rate, accept = decode_rate(engine, p, {"max_new_tokens": a.max_new_tokens, "ignore_eos": True,
                                                           "temperature": temperature})
                    got[rule][0].append(rate)
                    got[rule][1].append(accept)
            for rule, (rates, accepts) in got.items():
                print(f"{algo:10s} T={temperature:.1f} {rule:9s} accept {statistics.median(accepts):.2f} "
                      f"decode {statistics.median(rates):6.1f} tok/s", flush=True)
        for engine in engines.values():
            engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("speed", "rules"))
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prefill", default="128,512,2048")
    ap.add_argument("--flags", default="{}")
    ap.add_argument("--temperatures", default="0.7,1.0")
    a = ap.parse_args()
    from engine import Engine

    print(f"# {a.model}, {cpu_flags()}", flush=True)
    (speed if a.part == "speed" else rules)(a, Engine)


if __name__ == "__main__":
    main()
