"""Attention with the Triton paged kernel (kernels/paged_attention.py): each query reads its keys in
place, the prefix straight from the request-to-token table, so nothing is gathered or padded per layer.
Prefill, decode, tree verification and draft trees all run the one kernel. GPU; on a CPU it runs only
in Triton's interpreter (TRITON_INTERPRET=1), for checking, not for speed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.attention.base import AttentionBackend
from engine.core.forward_batch import ForwardBatch
from engine.memory.kv_pool import KVPool
from engine.core.to_device import to_device


@dataclass
class _Metadata:
    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    tails: torch.Tensor
    tail_lens: torch.Tensor
    mask: Optional[torch.Tensor]
    max_queries: int


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool):
        from spec_kernels.paged_attention import paged_attention

        self.kv_pool, self.kernel = kv_pool, paged_attention

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.table.device
        new = to_device(batch.extend_lens, device)
        tails, tail_lens = batch.padded_tails()
        batch.attn = _Metadata(torch.nn.functional.pad(new.cumsum(0), (1, 0)),
                               to_device(batch.prefix_lens, device), tails, tail_lens,
                               None if batch.masks is None else batch.masks.to(device), max(batch.extend_lens))

    def forward(self, q, k, v, layer, batch, scale, *, window=None, softcap=None, sinks=None):
        self.kv_pool.store(layer, batch.out_slots, k, v)
        meta: _Metadata = batch.attn
        return self.kernel(q, self.kv_pool.k[layer], self.kv_pool.v[layer], meta.qo_indptr, batch.table, batch.rows,
                           meta.prefix_lens, meta.tails, meta.tail_lens, meta.mask, scale, meta.max_queries,
                           window=window, softcap=softcap, sinks=sinks,
                           slot_map=self.kv_pool.window.slot_map if self.kv_pool.windowed(layer) else None)
