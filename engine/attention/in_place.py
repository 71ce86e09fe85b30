"""Attention that reads K/V where they lie in the pool, for the torch backend on a CPU.

The torch backend gathers each request's cached K/V into a padded batch every layer, and SDPA then
reads that copy again. Written instead as broadcast products and sums over keys indexed straight from
the pool, attention compiles (inductor, dynamic shapes: one compile for every batch size and context
length) to loops that fuse the indexing into their loads: nothing is copied. Measured on a 2-core
AVX-512 Xeon (benchmarks/bench_attention.py, docs/benchmarking.md) it is 1.2-1.7x faster than gather +
SDPA for float32 decode from batch 8 up, and slower at batch 1, in bfloat16 (SDPA's bf16 kernel reads
half the bytes) and with several queries per request (SDPA's GEMMs win): `wanted` says where it serves.
Not inside a model compiled whole (--enable-torch-compile): that graph keeps gather + SDPA.
A row's result does not depend on the other rows (nor does SDPA's beyond fp32 rounding).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

log = logging.getLogger(__name__)

MIN_BATCH = 8


def wanted(dtype: torch.dtype, device: torch.device, batch_size: int, max_new: int) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and max_new == 1 and batch_size >= MIN_BATCH


def _attend(q, k_pool, v_pool, kv_index, mask, scale):
    """q [B, n, Hkv, G, D] (G query heads per KV head) over the keys of slots kv_index [B, L], mask
    [B, n, L]: [B, n, Hkv, G, D]."""
    k = k_pool[kv_index][:, None, :, :, None, :]                              # [B, 1, L, Hkv, 1, D]
    s = (q[:, :, None].float() * k.float()).sum(-1) * scale                   # [B, n, L, Hkv, G]
    p = torch.softmax(s.masked_fill(~mask[:, :, :, None, None], float("-inf")), 2)
    v = v_pool[kv_index][:, None, :, :, None, :]
    return (p[..., None] * v.float()).sum(2).to(q.dtype)


class InPlaceAttention:
    """`_attend`, compiled in a background thread from its first call: compiling takes ~12 s on a cold
    cache, which would stall every running request. Until it is ready, and for good if compiling fails
    (no C++ compiler, say), a call returns None and the caller gathers instead."""

    def __init__(self):
        self._fn = torch.compile(_attend, dynamic=True)
        self.ready, self.broken = False, False
        self._thread: Optional[threading.Thread] = None

    def __call__(self, q, k_pool, v_pool, kv_index, mask, scale) -> Optional[torch.Tensor]:
        if self.ready:
            try:
                return self._fn(q, k_pool, v_pool, kv_index, mask, scale)
            except Exception as e:      # a shape it recompiles for and fails on
                self._give_up(e)
                return None
        if self._thread is None and not self.broken:
            # Its own copies of the small inputs; the pools are only read (a value written meanwhile
            # changes nothing but the discarded warm-up result).
            args = (q.clone(), k_pool, v_pool, kv_index.clone(), mask.clone(), scale)
            # Under the caller's grad and inference modes: compiled code is guarded on them.
            modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
            self._thread = threading.Thread(target=self._compile, args=(modes, *args), name="in-place-attention",
                                            daemon=True)
            self._thread.start()
        return None

    def join(self) -> None:
        """Wait for the compile started by the first call (tests)."""
        if self._thread is not None:
            self._thread.join()

    def _compile(self, modes: tuple[bool, bool], *args) -> None:
        try:
            with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
                self._fn(*args)
            self.ready = True
        except Exception as e:          # inductor's errors have no common base worth naming
            self._give_up(e)

    def _give_up(self, e: Exception) -> None:
        log.warning("in-place CPU attention could not be compiled (%s); gathering K/V instead", e)
        self.ready, self.broken = False, True
