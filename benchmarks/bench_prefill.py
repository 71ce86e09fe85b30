"""Prefill speed per weight format: one prompt of `--tokens` tokens, one new token, radix cache off.

    python benchmarks/bench_prefill.py [--model qwen2.5-coder-1.5b] [--formats w4a8,w8a8_int8] [--tokens 512]

Each format loads in turn; after a short warm-up prompt, the long one runs `--rounds` times and the
median time is printed with tokens/s (time to first token of a batch-1 request with nothing cached).
llama.cpp's figure for the same file: `llama-bench -m FILE -p 512 -n 0 -t 2`. Run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llamacpp import cpu_flags  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--formats", default="w4a8,w8a8_int8", help="--quantization values, comma-separated")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from engine import Engine

    print(f"# CPU flags: {cpu_flags()}")
    print("| format | prefill s | tokens/s |\n| --- | --- | --- |")
    for fmt in a.formats.split(","):
        with Engine(model_path=a.model, quantization=fmt, disable_radix_cache=True,
                    max_total_tokens=max(4096, 2 * a.tokens)) as eng:
            text = "The quick brown fox jumps over the lazy dog near the river bank. " * (a.tokens // 8)
            ids = eng.tokenizer(text).input_ids[:a.tokens]
            params = {"temperature": 0, "max_new_tokens": 1}
            eng.generate(input_ids=[ids[:64]], sampling_params=params)
            times = []
            for _ in range(a.rounds):
                start = time.perf_counter()
                eng.generate(input_ids=[ids], sampling_params=params)
                times.append(time.perf_counter() - start)
            s = statistics.median(times)
            print(f"| {fmt} | {s:.2f} | {len(ids) / s:.0f} |", flush=True)


if __name__ == "__main__":
    main()
