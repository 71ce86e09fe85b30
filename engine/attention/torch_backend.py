"""Reference attention over the paged KV cache with torch's scaled_dot_product_attention.

Runs on CPU and GPU. Requests are padded to one [B, max_new, max_kv] problem with an explicit boolean
mask, so one SDPA call serves prefill, decode, tree verification and draft-tree expansion alike. A
request's keys are its table row's first prefix_len slots, then its tail: extra (scratch) slots and
its new tokens' slots. All of it is built with tensor ops, whatever the batch size.

On a CPU, decode steps (decode and tree verification), every one-token forward and a draft model's
forwards of a few tokens per request go through kernels/cpu_attention.c instead: each token attends
over the list of its visible keys where they lie in the pool, by a fixed sequence of operations, so a
token's result is bit for bit the same alone
or verified among others. Speculative decoding then repeats plain decoding exactly, also where bf16
or int8 rounding downstream would amplify a last-bit difference between SDPA's decode and extend
paths into a different token. It is also faster than gather + SDPA for decode
(benchmarks/bench_attention.py); SDPA's GEMMs are faster for several queries per request, so prefill keeps them unless --enable-deterministic-inference asks for the kernel there too.
Otherwise every layer of a forward gathers into the same two buffers: a fresh padded copy per layer,
once over glibc's 32 MB mmap threshold, is mapped and page-faulted again each time (which slows
attention at large batches of long contexts), and no two layers' copies are alive together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.core.forward_batch import ForwardBatch
from engine.memory.kv_pool import KVPool
from engine.core.to_device import ragged_index, to_device
from spec_kernels import cpu_attention
from spec_kernels.sliding_window import last_seen


@dataclass
class _Metadata:
    kv_index: torch.Tensor                 # [B, max_kv] slots to gather (0 pads: slot 0 stays zero)
    mask: torch.Tensor                     # [B, 1, max_new, max_kv] bool
    pad_index: Optional[torch.Tensor]      # [B * max_new] flat token per padded query row (T = a zero row)
    unpad_index: Optional[torch.Tensor]    # [T] padded row of each flat token
    max_new: int
    buffers: Optional[tuple[torch.Tensor, torch.Tensor]]   # K and V, gathered into by each layer in turn


@dataclass
class KeyLists:
    """Per token, the slots of the keys it sees, in position order: kernels/cpu_attention.c reads them."""
    slots: torch.Tensor                    # [T, max_kv] int64 (the first `lens[t]` count)
    lens: torch.Tensor                     # [T] int64
    starts: torch.Tensor                   # [B + 1] each request's first token (its tokens share its prefix)
    shared: torch.Tensor                   # [B] prefix lengths: the leading keys all of a request's tokens see
    window_slots: Optional[torch.Tensor] = None    # `slots` in the window pool, for its layers (window_pool.py)


# Most new tokens per request a draft model's forward sends through the kernel outside decode steps:
# its catch-up after a verify (the accepted tokens) and its tree frontiers. Only acceptance depends on
# a draft's bits, and the kernel skips SDPA's per-layer gather of every request's whole cache.
DRAFT_KEY_LIST_QUERIES = 16


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, batch_invariant_prefill: bool = False, key_lists_up_to: int = 1):
        self.kv_pool, self.batch_invariant_prefill = kv_pool, batch_invariant_prefill
        self.key_lists_up_to = key_lists_up_to
        if kv_pool.k[0].device.type == "cpu":
            cpu_attention.library()     # built (or loaded) at start-up, not in the first request

    def prepare(self, batch: ForwardBatch) -> None:
        B, device = batch.batch_size, batch.table.device
        kv_lens = [p + t for p, t in zip(batch.prefix_lens, batch.tail_lens)]
        max_kv, max_new, max_prefix = max(kv_lens), max(batch.extend_lens), max(batch.prefix_lens)
        prefix = to_device(batch.prefix_lens, device)
        tails, tail = batch.padded_tails()
        kv_index = torch.zeros((B, max_kv), dtype=torch.long, device=device)
        kv_index[:, :max_prefix] = batch.table[batch.rows, :max_prefix]
        # Each request's tail goes right after its prefix; slot 0 (zeros) pads.
        key_pos = torch.arange(max_kv, device=device)
        j = key_pos[None, :] - prefix[:, None]
        kv_index = torch.where(j < 0, kv_index, tails.gather(1, j.clamp(0, tails.shape[1] - 1)))
        kv_len = prefix + tail
        kv_index = torch.where(key_pos[None, :] < kv_len[:, None], kv_index, 0)
        key_lists = self.uses_key_lists(batch, max_new)

        if max_new == 1 and batch.masks is None:
            # Decode: one query per request, which sees all its keys; only the padding needs masking
            # (always a mask, even when nothing is padded: a compiled forward then has one graph).
            if key_lists:
                batch.attn = self._key_lists(kv_index, kv_len, torch.arange(B + 1, device=device), kv_len)
                return
            mask = (key_pos[None, :] < kv_len[:, None])[:, None, None, :]
            batch.attn = _Metadata(kv_index, mask, None, None, 1, self._buffers(kv_index))
            return

        new = to_device(batch.extend_lens, device)
        q_pos = torch.arange(max_new, device=device)
        j = key_pos[None, None, :] - prefix[:, None, None]                           # tail index of a key
        if batch.masks is None:
            extra = tail - new
            seen = j <= extra[:, None, None] + q_pos[None, :, None]                 # extra, then causal
        else:
            index = j.clamp(0, batch.masks.shape[-1] - 1).expand(B, max_new, max_kv)
            seen = batch.masks.to(device).gather(2, index)
        mask = (j < 0) | ((j < tail[:, None, None]) & seen)
        valid = q_pos[None, :] < new[:, None]                                        # [B, max_new]
        unpad_index = ragged_index(batch.extend_lens, max_new, device)
        if key_lists:
            slots, lens = _key_lists(kv_index, mask.view(B * max_new, max_kv)[unpad_index], unpad_index // max_new)
            starts = torch.cat([new.new_zeros(1), new.cumsum(0)])
            batch.attn = self._key_lists(slots, lens, starts, prefix)
            return
        mask[:, :, 0] |= ~valid                 # padded query rows attend somewhere finite; dropped after
        offsets = new.cumsum(0) - new
        T = sum(batch.extend_lens)
        pad_index = torch.where(valid, offsets[:, None] + q_pos[None, :], T)
        batch.attn = _Metadata(kv_index, mask[:, None], pad_index.flatten(), unpad_index, max_new,
                               self._buffers(kv_index))

    def _key_lists(self, slots, lens, starts, shared) -> KeyLists:
        # Translated once a forward, for every windowed layer.
        window = self.kv_pool.translate(slots) if self.kv_pool.window else None
        return KeyLists(slots, lens, starts, shared, window)

    def _buffers(self, kv_index: torch.Tensor):
        return self.kv_pool.gather_buffers(kv_index.numel())

    def uses_key_lists(self, batch: ForwardBatch, max_new: int) -> bool:
        """Whether this forward attends through kernels/cpu_attention.c: on a CPU, in decode steps
        (decode and tree verification alike, so that they agree bit for bit), forwards of at most
        `key_lists_up_to` tokens per request (one, or a draft's few), and prefill too with
        --enable-deterministic-inference."""
        pool = self.kv_pool.k[0]
        wanted = batch.decode_step or max_new <= self.key_lists_up_to or self.batch_invariant_prefill
        return (wanted and cpu_attention.supports(pool.dtype, pool.device, pool.shape[-1])
                and cpu_attention.library() is not None)

    def forward(self, q, k, v, layer, batch, scale, *, window=None, softcap=None, sinks=None):
        self.kv_pool.store(layer, batch.out_slots, k, v)
        meta = batch.attn
        if isinstance(meta, KeyLists):
            slots = meta.window_slots if self.kv_pool.windowed(layer) else meta.slots
            return cpu_attention.attend(q, self.kv_pool.k[layer], self.kv_pool.v[layer], slots, meta.lens, scale,
                                        meta.starts, meta.shared, window=window, softcap=softcap, sinks=sinks)
        B = meta.kv_index.shape[0]          # a tensor's size, not a list's length: symbolic when compiled
        T, H, D = q.shape
        if meta.max_new == 1:
            qp = q.view(B, 1, H, D)
        else:
            qp = torch.cat([q, q.new_zeros(1, H, D)])[meta.pad_index].view(B, meta.max_new, H, D)
        out = self._gather_and_attend(qp, layer, meta, scale, window, softcap, sinks).reshape(B, meta.max_new, H, D)
        if meta.max_new == 1:
            return out.reshape(T, H, D)
        return out.reshape(B * meta.max_new, H, D)[meta.unpad_index]

    def _gather_and_attend(self, qp, layer, meta: _Metadata, scale, window, softcap, sinks) -> torch.Tensor:
        """qp [B, max_new, H, D] -> [B, max_new, H, D], by SDPA over K/V gathered into a padded batch (or
        the same in torch ops where SDPA has no soft-cap or sinks)."""
        # Compiled, the buffers would be graph inputs written in place; inductor plans its own memory.
        buffers = None if torch.compiler.is_compiling() else meta.buffers
        keys, values = self.kv_pool.gather(layer, meta.kv_index, buffers)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)      # [B, Hkv, max_kv, D]
        mask = meta.mask if window is None else last_seen(meta.mask, window)
        if softcap is not None or sinks is not None:
            return _eager_attention(qp.transpose(1, 2), keys, values, mask, scale, softcap, sinks).transpose(1, 2)
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=keys.shape[1] != qp.shape[2])
        return out.transpose(1, 2)


def _eager_attention(q, keys, values, mask, scale, softcap, sinks) -> torch.Tensor:
    """Attention with soft-capped scores and/or sinks, in fp32: q [B, H, n, D] over keys and values
    [B, Hkv, kv, D] where mask [B, 1, n, kv]; [B, H, n, D] in q's dtype."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float()
    scores = q.float() @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    weights = scores.softmax(-1)[..., :keys.shape[2]]
    return (weights @ values).to(q.dtype)


def _key_lists(kv_index: torch.Tensor, seen: torch.Tensor, request: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's visible slots moved to the front of its row, in order: the slots of request
    `request[t]`'s keys kv_index that `seen[t]` [T, max_kv] marks; and their counts."""
    T, max_kv = seen.shape
    column = torch.where(seen, seen.cumsum(1) - 1, max_kv)       # hidden keys go to a dropped last column
    slots = torch.zeros((T, max_kv + 1), dtype=torch.long, device=seen.device)
    slots.scatter_(1, column, kv_index[request])
    return slots[:, :max_kv].contiguous(), seen.sum(1)
