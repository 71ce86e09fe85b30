"""What determinism by default costs, and which rule verifies sampled requests best.

    python benchmarks/bench_determinism.py speed [--model qwen2.5-coder-1.5b] [--prompts 4] [--max-new-tokens 128]
                                                 [--prefill 512,2048] [--flags '{"dtype": "float32"}']
    python benchmarks/bench_determinism.py rules [--model qwen2.5-coder-1.5b] [--prompts 8] [--temperatures 0.7,1.0]

speed: two Engines in one process, the defaults (deterministic) and --disable-deterministic-inference
(plus --flags, a JSON dict of Engine options, for both), batch 1, MT-Bench first turns through the chat
template, the two interleaved prompt by prompt: decode tokens/s (new tokens - 1 over the time after the
first token), greedy and sampled (temperature 0.7, a seed per prompt), plain and with NGRAM (and
STANDALONE with the 0.5B draft for Qwen2.5-Coder-1.5B); then prefill time of fresh random prompts of
each --prefill length (one output token; no cache hit). Ratios are medians of per-prompt ratios.
rules: requests without a seed verified by each --speculative-sampling rule (NGRAM: coupled against
tree; STANDALONE, a chain of 2 drafts: coupled against rejection), accept length and decode tokens/s at
each temperature,
the rules interleaved prompt by prompt.
Run it alone: a second busy process on 2 cores skews every number.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench_engine import first_turns  # noqa: E402  (benchmarks/ is run as a script folder)
from bench_llamacpp import cpu_flags

DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def decode_rate(engine, ids: list[int], params: dict) -> tuple[float, float]:
    """(decode tokens/s, accept length or 1) of one request."""
    meta = engine.generate(input_ids=ids, sampling_params=params)["meta_info"]
    n = meta["completion_tokens"]
    return (n - 1) / (meta["e2e_latency"] - meta["ttft"]), meta.get("spec_accept_length") or 1.0


def _order(engines: dict, i: int) -> list:
    """The engines' names, reversed every other prompt: neither side always runs first."""
    names = list(engines)
    return names if i % 2 == 0 else names[::-1]


def speed(a, Engine) -> None:
    flags = json.loads(a.flags)
    configs = {"plain": {}, "NGRAM": {"speculative_algorithm": "NGRAM"}}
    if a.model in DRAFTS:
        configs["STANDALONE"] = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": DRAFTS[a.model]}
    sides = {"deterministic": {}, "off": {"disable_deterministic_inference": True}}
    for name, spec in configs.items():
        engines = {side: Engine(model_path=a.model, **flags, **extra, **spec) for side, extra in sides.items()}
        prompts = first_turns(engines["off"].tokenizer, a.prompts)
        for engine in engines.values():
            engine.generate(input_ids=prompts[0][:16], sampling_params={"max_new_tokens": 4})     # warm-up
        for kind in ("greedy", "sampled"):
            rates = {side: [] for side in engines}
            for i, p in enumerate(prompts):
                params = {"max_new_tokens": a.max_new_tokens, "ignore_eos": True, "temperature": 0.0}
                if kind == "sampled":
                    params.update(temperature=0.7, seed=i)
                for side in _order(engines, i):               # interleaved prompt by prompt
                    rates[side].append(decode_rate(engines[side], p, params)[0])
            ratio = statistics.median(a / b for a, b in zip(rates["deterministic"], rates["off"]))
            print(f"{name:10s} {kind:7s} decode tok/s " + "  ".join(
                f"{side} {statistics.median(r):6.1f}" for side, r in rates.items()) + f"  ratio {ratio:.3f}", flush=True)
        if name == "plain" and a.prefill:
            vocab = engines["off"].model_config.vocab_size
            for length in map(int, a.prefill.split(",")):
                times = {side: [] for side in engines}
                for r in range(3):
                    ids = random.Random(length * 10 + r).choices(range(100, vocab - 100), k=length)
                    for side in _order(engines, r):
                        meta = engines[side].generate(input_ids=ids, sampling_params={"max_new_tokens": 1})["meta_info"]
                        times[side].append(meta["ttft"])
                print(f"{name:10s} prefill {length:5d} tokens ms " + "  ".join(
                    f"{side} {statistics.median(t) * 1e3:8.1f}" for side, t in times.items()) +
                    f"  ratio {statistics.median(times['deterministic']) / statistics.median(times['off']):.3f}",
                    flush=True)
        for engine in engines.values():
            engine.shutdown()


def rules(a, Engine) -> None:
    pairs = {"NGRAM": ({}, ("coupled", "tree"))}
    if a.model in DRAFTS:
        # A chain: rejection sampling takes chains only (the CPU's auto tree has topk 2).
        pairs["STANDALONE"] = ({"speculative_draft_model_path": DRAFTS[a.model], "speculative_num_steps": 2,
                                "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3}, ("coupled", "rejection"))
    for algo, (extra, names) in pairs.items():
        engines = {rule: Engine(model_path=a.model, speculative_algorithm=algo, speculative_sampling=rule, **extra)
                   for rule in names}
        prompts = first_turns(next(iter(engines.values())).tokenizer, a.prompts)
        for temperature in map(float, a.temperatures.split(",")):
            got = {rule: ([], []) for rule in names}
            for i, p in enumerate(prompts):
                for rule in _order(engines, i):
                    rate, accept = decode_rate(engines[rule], p, {"max_new_tokens": a.max_new_tokens,
                                                                  "ignore_eos": True, "temperature": temperature})
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
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--flags", default="{}")
    ap.add_argument("--temperatures", default="0.7,1.0")
    a = ap.parse_args()
    from engine import Engine

    print(f"# {a.model}, {cpu_flags()}", flush=True)
    (speed if a.part == "speed" else rules)(a, Engine)


if __name__ == "__main__":
    main()
