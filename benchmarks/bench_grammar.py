"""The cost of grammar masks per decode step, with and without speculation.

    python benchmarks/bench_grammar.py [--model smollm2-135m] [--batch-sizes 1,8] [--algos plain,NGRAM]

Greedy, fp32, MT-Bench first turns through the chat template, each request held to a JSON schema
(an object of a few typed fields, --constrained-json-disable-any-whitespace so that a small model
finishes it). Per (algorithm, batch): the schema's compile time, the median decode step, and inside it
the host time spent building the rows' bitmasks (xgrammar's matcher walk over each draft tree) and
applying them to the logits; then the same requests unconstrained, for the step time without masks.
Run it alone: a second busy process on 2 cores skews every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_overhead import _timed, decode_step_times, prompts_for  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "rating": {"type": "integer", "minimum": 1, "maximum": 10},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "done": {"type": "boolean"}}, "required": ["title", "rating", "tags", "done"]}


def measure(model: str, algo: str, batch: int, max_new: int, constrained: bool) -> dict:
    import engine.core.grammar
    import engine.core.worker
    from engine import Engine
    from engine.core.sampling_params import SamplingParams

    kw = {"speculative_algorithm": algo} if algo != "plain" else {}
    eng = Engine(model_path=model, dtype="float32", max_total_tokens=64 * 1024, max_running_requests=batch,
                 constrained_json_disable_any_whitespace=True, **kw)
    mask_time = [0.0]
    engine.core.worker.row_bitmask = _timed(engine.core.worker.row_bitmask, mask_time)
    engine.core.grammar.apply_bitmask = _timed(engine.core.grammar.apply_bitmask, mask_time)
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new} |
                                      ({"json_schema": json.dumps(SCHEMA)} if constrained else {"ignore_eos": True}))
    t = time.perf_counter()
    grammar = eng.compile_grammar(params)
    compile_ms = 1e3 * (time.perf_counter() - t)
    reqs = [eng.make_request(p, params, grammar=grammar) for p in prompts_for(eng.tokenizer, batch)]
    steps, masks = decode_step_times(eng, reqs, mask_time)
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"compile_ms": compile_ms, "steps": len(steps), "tokens_per_step": tokens / max(1, len(steps)),
            "step_ms": 1e3 * statistics.median(steps), "mask_ms": 1e3 * statistics.median(masks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--algos", default="plain,NGRAM")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    print("| algo | batch | schema compile ms | tokens/step | step ms | masks ms/step | step ms unconstrained |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for algo in a.algos.split(","):
        for batch in map(int, a.batch_sizes.split(",")):
            on = measure(a.model, algo, batch, a.max_new_tokens, True)
            off = measure(a.model, algo, batch, a.max_new_tokens, False)
            print(f"| {algo} | {batch} | {on['compile_ms']:.0f} | {on['tokens_per_step']:.2f} | {on['step_ms']:.1f} | "
                  f"{on['mask_ms']:.2f} | {off['step_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
