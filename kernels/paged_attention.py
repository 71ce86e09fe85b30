"""Paged attention over a token-level KV cache, in Triton: prefill, decode, tree verification and draft
trees with one kernel, each query reading its keys in place through a list of slots (no gather).

Layout (as the engine's attention backends see it):
- q [T, H, D]: the new tokens of all requests, request after request (qo_indptr [B + 1]);
- k_cache, v_cache [S, Hkv, D]: one model layer's K/V, indexed by slot;
- request b's keys, in order: its cached prefix, the first prefix_lens[b] slots of row rows[b] of the
  request-to-token table (read in place), then its tail: tails[b, :tail_lens[b]] (scratch keys of a
  draft tree, then its new tokens, whose K/V are stored already);
- visibility: the prefix is seen by all queries of its request; query i sees tail key j where
  tail_mask[b, i, j], or, without a mask, causally: keys up to kv_len - n + i, n being its number of
  queries.
- variants (engine/attention/base.py): a sliding window keeps, of the keys a query sees, the last `window`
  (without a mask those from index kv_len - n + i + 1 - window; with one, the host windows the mask and
  gives each query the first prefix key it keeps, and the kernel skips whole blocks before them); a
  soft-cap maps scores s to cap * tanh(s / cap); sinks [H] start each row's online softmax at the sink's
  logit with a sum of 1 (its exp), weighing no value.
- a layer whose K/V live in a window pool (engine/memory/window_pool.py) reads each key's slot through
  `slot_map` (the slots above number the full pool).
Online softmax in fp32 (Flash-Attention style), one program per (request, head, block of queries).
`attention_reference` computes the same in plain torch; tests compare the two (on CPU under
TRITON_INTERPRET=1, where Triton runs the kernel in numpy).
"""

from __future__ import annotations

from typing import Optional

import torch

from spec_kernels.sliding_window import last_seen

try:
    import triton
    import triton.language as tl
except ImportError:                         # optional: the torch backend needs none of this
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _paged_attention_kernel(
            q, k_cache, v_cache, out, qo_indptr, table, rows, prefix_lens, tails, tail_lens, tail_mask, key_lo,
            sinks, slot_map, scale, window, softcap, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
            stride_ot, stride_oh, stride_table, stride_tail, stride_mb, stride_mi, stride_lo, group: tl.constexpr,
            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
            HAS_MAP: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        m_block = tl.program_id(2)
        q_start = tl.load(qo_indptr + b)
        n_q = tl.load(qo_indptr + b + 1) - q_start
        if m_block * BLOCK_M >= n_q:
            return
        row = tl.load(rows + b)
        prefix = tl.load(prefix_lens + b)
        kv_len = prefix + tl.load(tail_lens + b)
        kv_head = h // group

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_valid = offs_m < n_q
        d_valid = offs_d < D
        q_ptrs = q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        qb = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)

        if HAS_SINKS:
            m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks + h).to(tl.float32)
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        start = 0
        if HAS_WINDOW:
            if HAS_MASK:
                lo = tl.load(key_lo + b * stride_lo + offs_m, mask=m_valid, other=0)
            else:
                lo = kv_len - n_q + offs_m + 1 - window
            start = tl.maximum(tl.min(tl.where(m_valid, lo, kv_len), 0), 0) // BLOCK_N * BLOCK_N
        for n_start in range(start, kv_len, BLOCK_N):
            offs_n = n_start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < kv_len
            tail = offs_n - prefix
            in_prefix = offs_n < prefix
            slots = tl.where(in_prefix, tl.load(table + row * stride_table + offs_n, mask=in_prefix, other=0),
                             tl.load(tails + b * stride_tail + tail, mask=n_valid & (tail >= 0), other=0))
            if HAS_MAP:
                slots = tl.load(slot_map + slots, mask=n_valid, other=0)
            kb = tl.load(k_cache + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                         mask=n_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)
            s = tl.dot(qb, tl.trans(kb)) * scale                                      # [BLOCK_M, BLOCK_N]
            if HAS_SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)             # tanh
            if HAS_MASK:
                seen = tl.load(tail_mask + b * stride_mb + offs_m[:, None] * stride_mi + tail[None, :],
                               mask=m_valid[:, None] & (tail >= 0)[None, :] & n_valid[None, :], other=0)
                ok = in_prefix[None, :] | (seen != 0)
            else:
                ok = offs_n[None, :] <= kv_len - n_q + offs_m[:, None]
            ok = ok & n_valid[None, :] & m_valid[:, None]
            if HAS_WINDOW:
                ok = ok & (offs_n[None, :] >= lo[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v_cache + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                         mask=n_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, vb)
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                    table: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor, tails: torch.Tensor,
                    tail_lens: torch.Tensor, tail_mask: Optional[torch.Tensor], scale: float,
                    max_queries: int, *, window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None, slot_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention output [T, H, D] (see the module doc); max_queries: the most queries of one request."""
    T, H, D = q.shape
    B = rows.shape[0]
    out = torch.empty_like(q)
    block_m = max(16, triton.next_power_of_2(min(max_queries, 64)))     # tl.dot wants 16 rows or more
    key_lo = tails                                                       # any tensor where unread
    if window is not None and tail_mask is not None:
        tail_mask, key_lo = windowed_mask(tail_mask, prefix_lens, window)
    mask = tail_mask if tail_mask is not None else tails
    grid = (B, H, triton.cdiv(max_queries, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, qo_indptr, table, rows, prefix_lens, tails, tail_lens, mask, key_lo,
        sinks if sinks is not None else q, slot_map if slot_map is not None else tails, scale, window or 0,
        softcap or 0.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), table.stride(0), tails.stride(0),
        mask.stride(0) if tail_mask is not None else 0, mask.stride(1) if tail_mask is not None else 0,
        key_lo.stride(0), group=H // k_cache.shape[1], D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=block_m,
        BLOCK_N=32, HAS_MASK=tail_mask is not None, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, HAS_MAP=slot_map is not None)
    return out


def windowed_mask(tail_mask: torch.Tensor, prefix_lens: torch.Tensor, window: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sliding window under a tail mask [B, n, tail]: the mask keeping the last `window` tail keys each
    query sees, and [B, n] the first prefix key each keeps (its visible keys number prefix + its tail
    keys; the window holds the last `window`)."""
    seen = tail_mask.bool()
    return last_seen(seen, window), prefix_lens[:, None] + seen.sum(-1) - window


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                        table: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor, tails: torch.Tensor,
                        tail_lens: torch.Tensor, tail_mask: Optional[torch.Tensor], scale: float, *,
                        window: Optional[int] = None, softcap: Optional[float] = None,
                        sinks: Optional[torch.Tensor] = None, slot_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same attention, request by request in plain torch (fp32)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(rows.shape[0]):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        prefix, n_tail = int(prefix_lens[b]), int(tail_lens[b])
        slots = torch.cat([table[int(rows[b]), :prefix], tails[b, :n_tail]]).long()
        if slot_map is not None:
            slots = slot_map[slots]
        n, kv_len = q1 - q0, prefix + n_tail
        keys = k_cache[slots].float().repeat_interleave(group, 1)           # [kv_len, H, D]
        values = v_cache[slots].float().repeat_interleave(group, 1)
        j = torch.arange(kv_len)[None, :]
        if tail_mask is not None:
            seen = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tail_mask[b, :n, :n_tail].bool()], 1)
        else:
            seen = j <= kv_len - n + torch.arange(n)[:, None]
        if window is not None:
            seen = last_seen(seen, window)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~seen[None], float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, n, 1)], -1)
        weights = scores.softmax(-1)[..., :kv_len]
        out[q0:q1] = torch.einsum("hqk,khd->qhd", weights, values).to(q.dtype)
    return out
