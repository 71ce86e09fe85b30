"""Forward times measured at start-up: the step cost model's curve before any request has run
(engine/speculative/cost.py), so that the first steps under load are sized by this machine and not by a
guess. A forward of R rows is R one-token rows of the padding table row, every row's logits computed,
as a decode or verify step computes them; it runs the kernels the first request would otherwise warm.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from engine.core.forward_batch import make_batch
from engine.memory.kv_manager import KVManager
from engine.core.model_runner import ModelRunner

ROWS = (1, 2, 4, 8, 16, 32)
REPEATS = 2         # the fastest of these, after one forward that warms each shape


def forward_times(runner: ModelRunner, kv: KVManager, rows: Sequence[int] = ROWS) -> dict[int, float]:
    """Seconds of a forward of R rows, for each R in `rows` (fewer where the pool is smaller)."""
    rows = [r for r in rows if r <= kv.unused()]
    if not rows:
        return {}
    slots = kv.alloc(max(rows))
    times = {}
    try:
        for r in rows:
            batch = make_batch(kv.table, [kv.pad_row] * r, [0] * r, [0] * r, slots[:r], [1] * r)
            best = float("inf")
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                out = runner.forward(batch, all_logits=True)
                if out.logits.is_cuda:
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
            times[r] = best
    finally:
        kv.free(slots)
    return times
