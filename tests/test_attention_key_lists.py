"""The torch backend's CPU attention over per-token key lists (kernels/cpu_attention.c) against its
gather + SDPA path: the same outputs within rounding for decode, extend over a prefix, tree masks and
draft scratch keys in padded batches; a token's result bit for bit the same whatever else is in the
batch, and whether its tree is verified in one extend or node by node as decode rows; which forwards
use it; the gather path where the kernel cannot be built."""

from __future__ import annotations

import pytest
import torch

from engine.attention import torch_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.forward_batch import make_batch
from engine.memory.kv_pool import KVPool
from tests.attention_cases import Gathering, ThroughKernel as KeyLists

H, HKV, D, SLOTS = 6, 2, 16, 2000


def pool_with_values(seed: int = 0, dtype=torch.float32) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, SLOTS, HKV, D, dtype)
    pool.k[0][1:SLOTS + 1] = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
    pool.v[0][1:SLOTS + 1] = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
    return pool


def random_batch(seed: int, prefix_lens: list[int], new: int, extra: int = 0, tree: bool = False,
                 dtype=torch.float32):
    """Requests over scattered slots: (batch, q, k, v) for one forward of `new` tokens each."""
    g = torch.Generator().manual_seed(seed)
    B = len(prefix_lens)
    perm = torch.randperm(SLOTS - 1, generator=g) + 1
    table = torch.zeros((B, max(prefix_lens) + 1), dtype=torch.long)
    used = 0
    for b, p in enumerate(prefix_lens):
        table[b, :p] = perm[used:used + p]
        used += p
    extra_slots = perm[used:used + B * extra]
    out_slots = perm[used + B * extra:used + B * (extra + new)]
    masks = None
    if tree:        # each new token sees a random half of the scratch keys, the tokens before it, itself
        masks = torch.rand((B, new, extra + new), generator=g) < 0.5
        masks[:, :, extra:] &= torch.ones(new, new, dtype=torch.bool).tril()
        masks[:, :, extra:] |= torch.eye(new, dtype=torch.bool)
    batch = make_batch(table, range(B), prefix_lens, torch.zeros(B * new, dtype=torch.long), out_slots, [new] * B,
                       extra_slots=extra_slots if extra else None, extra_lens=[extra] * B if extra else None,
                       masks=masks)
    q = torch.randn(B * new, H, D, generator=g).to(dtype)
    k, v = torch.randn(B * new, HKV, D, generator=g).to(dtype), torch.randn(B * new, HKV, D, generator=g).to(dtype)
    return batch, q, k, v


def attend(backend_cls, batch, q, k, v, pool=None) -> torch.Tensor:
    backend = backend_cls(pool or pool_with_values(dtype=q.dtype))
    backend.prepare(batch)
    return backend.forward(q, k, v, 0, batch, D ** -0.5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prefix_lens,new,extra,tree", [
    ([5, 300, 0, 77, 1, 128, 40, 9], 1, 0, False),         # decode, padded
    ([12, 250, 3], 7, 0, False),                            # extend over a prefix (causal)
    ([30, 200, 64, 1], 5, 0, True),                         # tree verification
    ([17, 90, 150], 3, 4, True),                            # draft tree: scratch keys
    ([60, 3], 1, 2, False),                                 # decode after scratch keys
])
def test_key_lists_match_gather_and_sdpa(prefix_lens, new, extra, tree, dtype, tol):
    args = random_batch(len(prefix_lens) + new, prefix_lens, new, extra, tree, dtype)
    torch.testing.assert_close(attend(KeyLists, *args), attend(Gathering, *args), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_does_not_depend_on_the_rest_of_the_batch(dtype):
    # The first request is the same in both (its slots are drawn first); the others, and so the
    # padding, differ.
    ref = attend(KeyLists, *random_batch(1, [100] * 8, 1, dtype=dtype))
    out = attend(KeyLists, *random_batch(1, [100, 1, 7, 300, 3, 90, 640, 2], 1, dtype=dtype))
    assert torch.equal(out[0], ref[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verified_tree_node_gets_the_bits_of_its_decode(dtype):
    """Tree verification in one extend (each node over the prefix, its ancestors and itself) against
    each node alone as a decode row after its ancestors: bit for bit, as speculative decoding needs
    to repeat plain decoding exactly."""
    batch, q, k, v = random_batch(5, [40, 333], 5, tree=True, dtype=dtype)
    pool = pool_with_values(dtype=dtype)
    together = attend(KeyLists, batch, q, k, v, pool)
    seen = batch.masks
    for b, prefix in enumerate(batch.prefix_lens):
        slots = batch.out_slots[b * 5:(b + 1) * 5]
        for i in range(5):
            ancestors = slots[:i][seen[b, i, :i]]
            row = make_batch(batch.table, [b], [prefix], [0], slots[i:i + 1], [1], extra_slots=ancestors,
                             extra_lens=[len(ancestors)])
            alone = attend(KeyLists, row, q[b * 5 + i:b * 5 + i + 1], k[b * 5 + i:b * 5 + i + 1],
                           v[b * 5 + i:b * 5 + i + 1], pool)
            assert torch.equal(alone[0], together[b * 5 + i]), (b, i)


def test_decode_steps_and_one_token_forwards_use_key_lists():
    backend = TorchAttentionBackend(pool_with_values())
    for new, decode_step, expected in [(1, False, True), (5, True, True), (5, False, False)]:
        batch, *_ = random_batch(0, [20] * 3, new)
        batch.decode_step = decode_step
        backend.prepare(batch)
        assert isinstance(batch.attn, torch_backend.KeyLists) is expected, (new, decode_step)


def test_a_drafts_forwards_of_a_few_tokens_use_key_lists():
    """A draft backend (create_backend(..., draft=True)) sends forwards of up to DRAFT_KEY_LIST_QUERIES
    tokens per request through the kernel (its catch-up and tree frontiers); its prefill gathers."""
    from engine.attention import create_backend

    backend = create_backend("auto", "cpu", pool_with_values(), draft=True)
    limit = torch_backend.DRAFT_KEY_LIST_QUERIES
    for new, expected in [(3, True), (limit, True), (limit + 1, False)]:
        batch, *_ = random_batch(0, [20] * 3, new)
        backend.prepare(batch)
        assert isinstance(batch.attn, torch_backend.KeyLists) is expected, new
    batch, *_ = random_batch(0, [20] * 3, 5)
    create_backend("auto", "cpu", pool_with_values()).prepare(batch)          # a target's extend
    assert not isinstance(batch.attn, torch_backend.KeyLists)


def test_gathers_when_the_kernel_cannot_be_built(monkeypatch):
    monkeypatch.setattr(torch_backend.cpu_attention, "library", lambda: None)
    batch, q, k, v = random_batch(3, [50] * 4, 1)
    backend = TorchAttentionBackend(pool_with_values())
    backend.prepare(batch)
    assert not isinstance(batch.attn, torch_backend.KeyLists)
    torch.testing.assert_close(backend.forward(q, k, v, 0, batch, D ** -0.5), attend(Gathering, batch, q, k, v))


@pytest.mark.parametrize("deterministic", [False, True])
def test_prefill_uses_key_lists_only_with_deterministic_inference(deterministic):
    backend = TorchAttentionBackend(pool_with_values(), batch_invariant_prefill=deterministic)
    batch, *_ = random_batch(0, [20, 0, 7], 9)
    backend.prepare(batch)
    assert isinstance(batch.attn, torch_backend.KeyLists) is deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_prefill_gives_a_prompt_the_same_bits_chunked_or_whole(dtype):
    """--enable-deterministic-inference: a prompt of 12 tokens prefilled whole beside another request,
    and alone in chunks of 5, 4 and 3 over what the earlier chunks cached: the same bits per token."""
    pool = pool_with_values(dtype=dtype)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(12, H, D, generator=g).to(dtype)
    k, v = torch.randn(12, HKV, D, generator=g).to(dtype), torch.randn(12, HKV, D, generator=g).to(dtype)
    slots = torch.arange(100, 112)
    table = torch.zeros((2, 64), dtype=torch.long)
    table[0, :12] = slots
    other = torch.randn(30, H, D, generator=g).to(dtype)
    backend = TorchAttentionBackend(pool, batch_invariant_prefill=True)
    whole = make_batch(table, [0, 1], [0, 0], torch.zeros(42, dtype=torch.long), torch.cat([slots, torch.arange(300, 330)]),
                       [12, 30])
    backend.prepare(whole)
    kk, vv = torch.cat([k, other[:, :HKV]]), torch.cat([v, other[:, :HKV]])
    together = backend.forward(torch.cat([q, other]), kk, vv, 0, whole, D ** -0.5)[:12]
    start = 0
    for n in (5, 4, 3):
        chunk = make_batch(table, [0], [start], torch.zeros(n, dtype=torch.long), slots[start:start + n], [n])
        backend.prepare(chunk)
        out = backend.forward(q[start:start + n], k[start:start + n], v[start:start + n], 0, chunk, D ** -0.5)
        assert torch.equal(out, together[start:start + n]), start
        start += n
