"""The w4a8 kernel (kernels/cpu_w4a8.c) in each weight form a GGUF gives it: time for 1 and 8 rows.

    python benchmarks/bench_w4a8_forms.py [--shape 8960x1536] [--threads 2]

Random weights in each form (Q4_0/Q4_1's fp16 scale and min, Q4_K's and Q5_K's own scales, 5-bit groups
with a scale and min as from Q5_0/Q5_1/MXFP4, Q6_K, 8-bit groups as from Q8_0), built through the engine's own layer classes; activations in
bf16. The same layer runs again and again, so its weights come from the caches (the default shape,
Qwen2.5-1.5B's up projection, from L3 on a CPU with 32 MB of it): one row shows the kernel's own
streaming rate (GB/s), not DRAM's, and 8 rows how many int8 products a second it does (a 512-bit
`vpdpbusd` does 64). Medians of interleaved rounds; run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.loader.gguf_quant import Groups, pack
from engine.models.quant import Int8GroupLinear, Q5Linear, Q6KLinear, W4A8Linear
from spec_kernels import cpu_w4a8


def layer(form: str, n: int, k: int) -> tuple[torch.nn.Module, float]:
    """A layer of `form` with random weights, and its bytes a weight."""
    g = torch.Generator().manual_seed(0)

    def ints(top: int, *shape: int, dtype=torch.uint8) -> torch.Tensor:
        return torch.randint(0, top, shape, generator=g).to(dtype)

    small = (torch.rand(n, k // 32, generator=g) * 1e-2, -torch.rand(n, k // 32, generator=g) * 1e-2)
    k_scales = (ints(64, n, k // 32), ints(64, n, k // 32), (torch.rand(n, k // 256, 2, generator=g) * 1e-3).half())
    built = {"Q4_0/Q4_1": lambda: W4A8Linear.from_groups(Groups(4, pack(ints(16, n, k).numpy()), *small), None),
             "Q4_K": lambda: W4A8Linear.from_groups(Groups(4, pack(ints(16, n, k).numpy()), *k_scales), None),
             "Q5_K": lambda: Q5Linear.from_groups(Groups(5, ints(32, n, k), *k_scales), None),
             "5-bit (Q5_0/Q5_1/MXFP4)": lambda: Q5Linear.from_groups(Groups(5, ints(32, n, k), *small), None),
             "Q6_K": lambda: Q6KLinear.from_groups(Groups(6, ints(64, n, k), ints(256, n, k // 16, dtype=torch.int8),
                                                          None, k_scales[2][..., :1]), None),
             "8-bit (Q8_0)": lambda: Int8GroupLinear.from_groups(Groups(8, ints(256, n, k), *small), None)}[form]()
    size = sum(t.numel() * t.element_size() for t in built.buffers())
    return built, size / (n * k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8960x1536", help="output x input features")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    n, k = map(int, a.shape.split("x"))
    torch.set_num_threads(a.threads)
    forms = ["Q4_0/Q4_1", "Q4_K", "Q5_K", "5-bit (Q5_0/Q5_1/MXFP4)", "Q6_K", "8-bit (Q8_0)"]
    layers = {f: layer(f, n, k) for f in forms}
    inputs = {m: torch.randn(m, k).bfloat16() for m in (1, 8)}
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for f in forms:
                for m, x in inputs.items():
                    module = layers[f][0]
                    for _ in range(5):
                        module(x)
                    reps = 50
                    t = time.perf_counter()
                    for _ in range(reps):
                        module(x)
                    times.setdefault((f, m), []).append((time.perf_counter() - t) / reps)
    print(f"# kernel: {cpu_w4a8.kernel_name()}; {a.threads} threads; {n}x{k}; medians of {a.rounds} rounds")
    print("| form | bytes a weight | 1 row us | 1 row GB/s | 8 rows us | 8 rows G products/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for f in forms:
        one, eight = (statistics.median(times[(f, m)]) for m in (1, 8))
        per = layers[f][1]
        print(f"| {f} | {per:.3f} | {one * 1e6:.0f} | {n * k * per / one / 1e9:.1f} | {eight * 1e6:.0f} | "
              f"{8 * n * k / eight / 1e9:.0f} |")


if __name__ == "__main__":
    main()
