"""Predicted Outputs on the code-edit workload: tokens/s with each prompt's prediction against the same
requests without it, and with an unrelated prediction (another function), for plain decoding and NGRAM;
beside llama.cpp's plain decode speed on the same GGUF file.

    python benchmarks/bench_prediction.py [--model qwen2.5-coder-1.5b] [-n 6] [--max-new-tokens 1024]
                                          [--algos none,NGRAM] [--llama-bin DIR]

Greedy, batch 1, the defaults otherwise. Each case is one `spec bench --use-prediction` run (the two
passes interleaved in chunks, one Engine); the code-edit prompts are edits of Python standard-library
functions of 30-150 lines (spec_tools/bench/code_edit.py), the prediction the function as it stands.
llama.cpp: `llama-bench -p 0 -n 256`, decode after an empty prompt (its speed only falls as the context
grows, so this flatters llama.cpp against edits of 30-150 lines; its `-d` depth option died with SIGILL
on the AMX Xeon VM), built as benchmarks/bench_llamacpp.py builds it. Run it alone: a second busy process on 2
cores skews every number.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench_llamacpp import build_llama_cpp, cpu_flags, llama_bench  # noqa: E402  (benchmarks/ is run as a script folder)

from spec_tools.bench.code_edit import code_edit_rows


def write_rows(path: Path, rows, unrelated: bool) -> None:
    """A question.jsonl of the edits; `unrelated`: each prediction is the next edit's function."""
    with path.open("w") as f:
        for i, (ident, prompt, prediction) in enumerate(rows):
            if unrelated:
                prediction = rows[(i + 1) % len(rows)][2]
            f.write(json.dumps({"id": ident, "category": "code-edit", "turns": [prompt], "prediction": prediction}) + "\n")


def spec_case(model: str, algo: str, dataset: Path, max_new: int) -> dict:
    from spec_tools.bench.options import BenchOptions
    from spec_tools.bench.run import run_bench
    from engine.config import ServerArgs

    args = ServerArgs(model_path=model, speculative_algorithm=None if algo == "none" else algo)
    result = run_bench(args, BenchOptions(dataset_path=str(dataset), max_new_tokens=max_new, use_prediction=True))
    base = result["baseline"]
    return {"with": result["output_tokens_per_s"], "without": base["output_tokens_per_s"],
            "speedup": result["speedup"], "decode_with": result["decode_tokens_per_s"],
            "decode_without": base["decode_tokens_per_s"], "differing": result["differing_outputs"],
            "tokens": result["completion_tokens"], **result["prediction_tokens"]}


def llama_decode(bin_dir: Path, gguf: Path) -> float:
    return llama_bench(bin_dir, gguf, "-p", "0", "-n", "256", "-r", "2")[0]["avg_ts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-n", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--algos", default="none,NGRAM")
    ap.add_argument("--llama-bin", type=Path)
    a = ap.parse_args()
    from engine.loader.fetch import fetch_model

    print(f"# {a.model}, {cpu_flags()}", flush=True)
    rows = code_edit_rows(a.n)
    llama = llama_decode(a.llama_bin or build_llama_cpp(Path.home() / ".cache" / "spec" / "llama.cpp"),
                         fetch_model(a.model))
    print(f"llama.cpp plain decode (llama-bench -p 0 -n 256): {llama:.1f} tok/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("matching", "unrelated"):
            path = Path(tmp) / f"{kind}.jsonl"
            write_rows(path, rows, kind == "unrelated")
            for algo in a.algos.split(","):
                r = spec_case(a.model, algo, path, a.max_new_tokens)
                print(f"{kind:9s} {algo:6s} with {r['with']:6.1f} tok/s  without {r['without']:6.1f}  "
                      f"x{r['speedup']:.2f}  ({r['with'] / llama:.2f}x llama.cpp plain)  accepted {r['accepted']} "
                      f"rejected {r['rejected']} of {r['tokens']} tokens  differing {r['differing']}", flush=True)
                print(f"{'':16s} decode (after the first token): with {r['decode_with']:6.1f} tok/s  without "
                      f"{r['decode_without']:6.1f}  x{r['decode_with'] / r['decode_without']:.2f}  "
                      f"({r['decode_with'] / llama:.2f}x llama.cpp plain)", flush=True)


if __name__ == "__main__":
    main()
