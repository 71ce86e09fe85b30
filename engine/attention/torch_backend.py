"""Reference attention over the paged KV cache with torch's scaled_dot_product_attention.

Runs on CPU and GPU. Requests are padded to one [B, max_new, max_kv] problem with an explicit boolean
mask, so one SDPA call serves prefill, decode and tree verification alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch
from engine.memory.kv_pool import KVPool, ReqToTokenPool


@dataclass
class _Metadata:
    kv_index: torch.Tensor                 # [B, max_kv] slots to gather (0 pads)
    mask: Optional[torch.Tensor]           # [B, 1, max_new, max_kv] bool, None when nothing is masked
    pad_index: Optional[torch.Tensor]      # [B * max_new] flat token per padded query row (T = a zero row)
    unpad_index: Optional[torch.Tensor]    # [T] padded row of each flat token
    max_new: int


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def prepare(self, batch: ForwardBatch) -> None:
        B = batch.batch_size
        new, prefix = batch.extend_lens, batch.prefix_lens
        kv_lens = [p + n for p, n in zip(prefix, new)]
        max_kv, max_new = max(kv_lens), max(new)
        table = self.req_to_token.table
        rows = batch.req_rows.to(table.device)
        kv_index = table[rows, :max_kv].clone()
        device = kv_index.device
        key_pos = torch.arange(max_kv, device=device)
        kv_len_t = torch.tensor(kv_lens, device=device)
        kv_index[key_pos[None, :] >= kv_len_t[:, None]] = 0

        if max_new == 1:
            # Decode: one query per request; only the key padding needs masking.
            mask = None if min(kv_lens) == max_kv else (key_pos[None, :] < kv_len_t[:, None])[:, None, None, :]
            batch.attn = _Metadata(kv_index, mask, None, None, 1)
            return

        mask = torch.zeros((B, max_new, max_kv), dtype=torch.bool, device=device)
        for b in range(B):
            p, n = prefix[b], new[b]
            mask[b, :n, :p] = True
            custom = batch.custom_masks[b] if batch.custom_masks else None
            block = custom.to(device) if custom is not None else torch.ones((n, n), dtype=torch.bool, device=device).tril_()
            mask[b, :n, p:p + n] = block
            mask[b, n:, 0] = True  # padded query rows attend somewhere finite; their output is dropped
        offsets = torch.tensor([0] + new, device=device).cumsum(0)
        T = int(offsets[-1])
        q_pos = torch.arange(max_new, device=device)
        valid = q_pos[None, :] < torch.tensor(new, device=device)[:, None]        # [B, max_new]
        pad_index = torch.where(valid, offsets[:-1, None] + q_pos[None, :], torch.full_like(valid, T, dtype=torch.long))
        unpad_index = (torch.arange(B, device=device)[:, None] * max_new + q_pos[None, :])[valid]
        batch.attn = _Metadata(kv_index, mask[:, None], pad_index.flatten(), unpad_index, max_new)

    def forward(self, q, k, v, layer, batch, scale):
        self.kv_pool.store(layer, batch.out_slots, k, v)
        meta: _Metadata = batch.attn
        B = batch.batch_size
        T, H, D = q.shape
        keys, values = self.kv_pool.gather(layer, meta.kv_index)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)      # [B, Hkv, max_kv, D]
        if meta.max_new == 1:
            qp = q.view(B, 1, H, D).transpose(1, 2)
        else:
            q_ext = torch.cat([q, q.new_zeros(1, H, D)])
            qp = q_ext[meta.pad_index].view(B, meta.max_new, H, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=meta.mask, scale=scale,
                                             enable_gqa=keys.shape[1] != H)
        out = out.transpose(1, 2)                                        # [B, max_new, H, D]
        if meta.max_new == 1:
            return out.reshape(T, H, D)
        return out.reshape(B * meta.max_new, H, D)[meta.unpad_index]
