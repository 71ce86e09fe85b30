"""Triton kernels against their torch references (on CPU in Triton's interpreter), and the references
against the engine's torch attention backend: the same attention for prefill, decode, tree masks and
draft-tree scratch keys."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.forward_batch import make_batch
from engine.memory.kv_pool import KVPool

paged = pytest.importorskip("spec_kernels.paged_attention")
if not paged.available():
    pytest.skip("triton is not installed", allow_module_level=True)

H, HKV, D, SLOTS = 4, 2, 16, 400


def case(seed: int, kinds: list[str]):
    """A batch of requests of the given kinds over a random cache: returns the engine's ForwardBatch
    pieces and the kernels' ragged layout."""
    g = torch.Generator().manual_seed(seed)
    table = torch.zeros((len(kinds), 128), dtype=torch.long)
    perm = torch.randperm(SLOTS - 1, generator=g) + 1
    used, prefix, extra, new, masks, extra_slots, out_slots = 0, [], [], [], [], [], []
    for b, kind in enumerate(kinds):
        p = int(torch.randint(0, 40, (1,), generator=g))
        e = 3 if kind == "draft" else 0
        n = {"decode": 1, "prefill": int(torch.randint(2, 9, (1,), generator=g)), "tree": 6, "draft": 2}[kind]
        table[b, :p] = perm[used:used + p]
        extra_slots.append(perm[used + p:used + p + e])
        out_slots.append(perm[used + p + e:used + p + e + n])
        used += p + e + n
        prefix.append(p), extra.append(e), new.append(n)
        if kind == "tree":        # node i sees itself and its ancestors: parents 0,0,1,1,2
            parents = [-1, 0, 0, 1, 1, 2]
            m = torch.eye(n, dtype=torch.bool)
            for i in range(1, n):
                m[i] |= m[parents[i]]
            masks.append(m)
        elif kind == "draft":     # each new node sees one chain of the extra keys, and itself
            masks.append(torch.tensor([[1, 0, 1, 1, 0], [0, 1, 0, 0, 1]], dtype=torch.bool))
        else:
            masks.append(None)
    return table, prefix, extra, new, masks, extra_slots, out_slots


def padded_masks(new, extra, masks):
    if all(m is None for m in masks):
        return None
    out = torch.zeros((len(new), max(new), max(e + n for e, n in zip(extra, new))), dtype=torch.bool)
    for b, (e, n, m) in enumerate(zip(extra, new, masks)):
        out[b, :n, :e + n] = m if m is not None else torch.ones(n, e + n, dtype=torch.bool).tril(e)
    return out


@pytest.mark.parametrize("kinds", [["decode", "decode", "decode"], ["prefill", "prefill"], ["tree", "tree"],
                                   ["draft", "draft", "draft"], ["decode", "tree", "prefill"]])
def test_kernel_and_reference_match_the_torch_backend(kinds):
    table, prefix, extra, new, masks, extra_slots, out_slots = case(len(kinds) * 7 + len(kinds[0]), kinds)
    g = torch.Generator().manual_seed(1)
    pool = KVPool(1, SLOTS, HKV, D, torch.float32)
    pool.k[0][1:SLOTS + 1] = torch.randn(SLOTS, HKV, D, generator=g)
    pool.v[0][1:SLOTS + 1] = torch.randn(SLOTS, HKV, D, generator=g)
    T = sum(new)
    q = torch.randn(T, H, D, generator=g)
    k_new, v_new = pool.k[0][torch.cat(out_slots)].clone(), pool.v[0][torch.cat(out_slots)].clone()
    mask = padded_masks(new, extra, masks)
    batch = make_batch(table, list(range(len(kinds))), prefix, torch.zeros(T, dtype=torch.long), torch.cat(out_slots),
                       new, extra_slots=torch.cat(extra_slots) if any(extra) else None,
                       extra_lens=extra if any(extra) else None, masks=mask)
    backend = TorchAttentionBackend(pool)
    backend.prepare(batch)
    expected = backend.forward(q, k_new, v_new, 0, batch, D ** -0.5)

    tail_lens = torch.tensor([e + n for e, n in zip(extra, new)])
    tails = torch.zeros((len(kinds), int(tail_lens.max())), dtype=torch.long)
    for b in range(len(kinds)):
        tails[b, :tail_lens[b]] = torch.cat([extra_slots[b], out_slots[b]])
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(new).cumsum(0)])
    args = (q, pool.k[0], pool.v[0], qo_indptr, table, torch.arange(len(kinds)), torch.tensor(prefix), tails,
            tail_lens, mask, D ** -0.5)
    torch.testing.assert_close(paged.attention_reference(*args), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged.paged_attention(*args, max(new)), expected, atol=1e-4, rtol=1e-4)
