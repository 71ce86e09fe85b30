"""Helpers for the attention backends' tests: the torch backend's two paths one at a time, and
attention problems whose keys have known positions, with a dense float64 reference that the variants
(sliding windows, soft-caps, sinks; engine/attention/base.py) are tested against. A request is a prefix
of cached keys at positions 0..prefix-1, then a tail (a draft tree's scratch keys, then the new tokens)
with positions and visibility of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.forward_batch import ForwardBatch, make_batch
from engine.memory.kv_pool import KVPool

H, HKV, D, SLOTS = 4, 2, 16, 800


class Gathering(TorchAttentionBackend):
    """The torch backend always by gather + SDPA."""

    def uses_key_lists(self, batch, max_new):
        return False


class ThroughKernel(TorchAttentionBackend):
    """The torch backend always through kernels/cpu_attention.c."""

    def uses_key_lists(self, batch, max_new):
        return True


@dataclass
class Request:
    prefix: int
    positions: list[int]          # the tail keys' positions, scratch keys then new tokens
    seen: torch.Tensor            # [new, tail] bool: new token i sees tail key j
    tree: bool = False            # its visibility needs a mask (not causal)

    @property
    def new(self) -> int:
        return self.seen.shape[0]


def extend(prefix: int, new: int) -> Request:
    """Prefill of `new` tokens after a cached prefix (a chunk of a prompt), or a decode (new = 1)."""
    return Request(prefix, list(range(prefix, prefix + new)), torch.ones(new, new, dtype=torch.bool).tril())


def tree(prefix: int, parents: Sequence[int]) -> Request:
    """Tree verification: node i (parent parents[i], -1 for the root) at position prefix + its depth,
    seeing its ancestors and itself."""
    n = len(parents)
    seen, depth = torch.eye(n, dtype=torch.bool), [0] * n
    for i in range(1, n):
        seen[i] |= seen[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return Request(prefix, [prefix + d for d in depth], seen, tree=True)


def draft_frontier(prefix: int, k: int, depth: int) -> Request:
    """A draft tree's expansion at `depth` (as a STANDALONE draft runs it): scratch keys of the root at
    position prefix, then k a depth for depths 1..depth-1 (key i of each depth the parent of key i of the
    next), then k new nodes at position prefix + depth, node i seeing the root, chain i and itself."""
    chains = torch.cat([torch.ones(k, 1, dtype=torch.bool), torch.eye(k, dtype=torch.bool).repeat(1, depth)], 1)
    positions = [prefix] + [prefix + d for d in range(1, depth + 1) for _ in range(k)]
    return Request(prefix, positions, chains, tree=True)


def build(requests: Sequence[Request], seed: int = 0, dtype=torch.float32):
    """(pool, batch, q, k, v): the requests over a random pool of scattered slots, new tokens' K/V
    not yet stored."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, SLOTS, HKV, D, dtype)
    pool.k[0][1:SLOTS + 1] = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
    pool.v[0][1:SLOTS + 1] = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
    perm = (torch.randperm(SLOTS - 1, generator=g) + 1).tolist()
    table = torch.zeros((len(requests), max(r.prefix for r in requests) + 1), dtype=torch.long)
    extra_slots, out_slots, positions = [], [], []
    for b, r in enumerate(requests):
        table[b, :r.prefix] = torch.tensor(perm[:r.prefix], dtype=torch.long)
        tail, perm = perm[r.prefix:r.prefix + len(r.positions)], perm[r.prefix + len(r.positions):]
        extra_slots += tail[:len(r.positions) - r.new]
        out_slots += tail[len(r.positions) - r.new:]
        positions += r.positions[len(r.positions) - r.new:]
    extra = [len(r.positions) - r.new for r in requests]
    T = sum(r.new for r in requests)
    batch = make_batch(table, range(len(requests)), [r.prefix for r in requests], torch.zeros(T, dtype=torch.long),
                       torch.tensor(out_slots), [r.new for r in requests], positions=torch.tensor(positions),
                       extra_slots=torch.tensor(extra_slots, dtype=torch.long) if any(extra) else None,
                       extra_lens=extra if any(extra) else None, masks=_masks(requests))
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k, v = torch.randn(T, HKV, D, generator=g).to(dtype), torch.randn(T, HKV, D, generator=g).to(dtype)
    return pool, batch, q, k, v


def _masks(requests: Sequence[Request]) -> Optional[torch.Tensor]:
    if not any(r.tree for r in requests):
        return None
    out = torch.zeros((len(requests), max(r.new for r in requests), max(len(r.positions) for r in requests)),
                      dtype=torch.bool)
    for b, r in enumerate(requests):
        out[b, :r.new, :len(r.positions)] = _tail_seen(r)
    return out


def _tail_seen(r: Request) -> torch.Tensor:
    """[new, tail]: the scratch keys (all, or a tree's own choice) and the new tokens' visibility."""
    extra = len(r.positions) - r.new
    if r.tree:
        return r.seen if r.seen.shape[1] == len(r.positions) else torch.cat(
            [r.seen, torch.eye(r.new, dtype=torch.bool)], 1)
    return torch.cat([torch.ones(r.new, extra, dtype=torch.bool), r.seen], 1)


def dense_reference(requests: Sequence[Request], pool: KVPool, batch: ForwardBatch, q, k, v, scale: float, *,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention in float64, token by token, from the keys' positions: a query at position p sees
    the prefix and its visible tail keys at positions j with p - window < j <= p."""
    keys, values = pool.k[0].double().clone(), pool.v[0].double().clone()
    keys[batch.out_slots], values[batch.out_slots] = k.double(), v.double()
    tails = batch.tail_slots.split(batch.tail_lens)
    out, t, G = torch.empty(q.shape, dtype=torch.float64), 0, H // HKV
    for b, r in enumerate(requests):
        slots = torch.cat([batch.table[b, :r.prefix], tails[b]])
        key_pos = torch.tensor(list(range(r.prefix)) + r.positions)
        for i, seen in enumerate(_tail_seen(r)):
            p = r.positions[len(r.positions) - r.new + i]
            visible = torch.cat([torch.ones(r.prefix, dtype=torch.bool), seen])
            if window is not None:
                visible &= key_pos > p - window
            kk = keys[slots[visible]].repeat_interleave(G, 1)           # [n, H, D]
            vv = values[slots[visible]].repeat_interleave(G, 1)
            s = torch.einsum("hd,nhd->hn", q[t].double(), kk) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], 1)
            w = s.softmax(-1)[:, :len(kk)]
            out[t] = torch.einsum("hn,nhd->hd", w, vv)
            t += 1
    return out
