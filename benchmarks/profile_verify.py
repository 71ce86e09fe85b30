"""Where a verify forward's time goes: each C kernel's share of a 1-token and an n-token forward.

    python benchmarks/profile_verify.py --model smollm2-135m [--tokens 8] [--cached 512] [--fused]

The target with spec's defaults (a GGUF's w4a8 layers on a CPU with VNNI, bf16), one request's chain
of --tokens after --cached tokens (the padding row, as bench_llamacpp.py's verify cost), logits for
every token, as the worker verifies. The layers run eager, one kernel call at a time, so each call can
be timed; they are the kernels the fused layer (kernels/cpu_decoder.c) calls, in the same order, so
the shares hold for it, without the per-call costs it removes. Medians of 12 forwards. Run it alone.
With --fused, the forwards run as spec serves them (each layer one C call) and only their totals are
printed: what to compare between two commits.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llamacpp import chain_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--cached", type=int, default=512)
    ap.add_argument("--fused", action="store_true", help="time the served forwards, totals only")
    a = ap.parse_args()

    import engine.models.fused_decode as fused_decode
    from engine import Engine
    from spec_kernels import cpu_attention, cpu_elementwise, cpu_w4a8

    spent: collections.Counter = collections.Counter()
    if not a.fused:
        fused_decode.plan = lambda *args, **kw: None          # eager layers: one timed call per kernel

    class Timed:
        def __init__(self, lib):
            self.lib = lib

        def __getattr__(self, name):
            fn = getattr(self.lib, name)

            def timed(*args):
                t = time.perf_counter()
                out = fn(*args)
                spent[name] += time.perf_counter() - t
                return out
            return timed

    for mod in () if a.fused else (cpu_w4a8, cpu_attention, cpu_elementwise):
        wrapped = Timed(mod.library())
        mod.library = lambda wrapped=wrapped: wrapped
    eng = Engine(model_path=a.model, max_total_tokens=a.cached + 2 * a.tokens + 64, context_length=a.cached + 64)

    def profile(n: int) -> float:
        runs = []
        with torch.inference_mode():
            for i in range(15):
                spent.clear()
                batch = chain_batch(eng, n, a.cached)
                t = time.perf_counter()
                eng.debug.target.forward(batch, all_logits=True, decode=True)
                if i >= 3:
                    runs.append((time.perf_counter() - t, dict(spent)))
        total = statistics.median(r[0] for r in runs)
        print(f"{n} token(s): {total * 1e3:.2f} ms")
        if a.fused:
            return total
        kernels = {name: statistics.median(r[1].get(name, 0.0) for r in runs) for name in runs[0][1]}
        for name, spent_ms in sorted(kernels.items(), key=lambda item: -item[1]):
            print(f"  {name}: {spent_ms * 1e3:.3f} ms")
        print(f"  everything else (torch ops, logits, Python): {(total - sum(kernels.values())) * 1e3:.3f} ms")
        return total

    one, many = profile(1), profile(a.tokens)
    print(f"{a.tokens}-token forward / 1-token forward: {many / one:.2f}")


if __name__ == "__main__":
    main()
