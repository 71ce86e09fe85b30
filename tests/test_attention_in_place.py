"""The torch backend's in-place CPU attention (engine/attention/in_place.py) against its gather + SDPA
path: the same outputs within fp32 rounding for decode, extend over a prefix, tree masks and draft
scratch keys in padded batches; a row's result independent of the other rows; the gather path where
compiling fails."""

from __future__ import annotations

import pytest
import torch

from engine.attention import in_place
from engine.attention.torch_backend import TorchAttentionBackend
from engine.forward_batch import make_batch
from engine.memory.kv_pool import KVPool

H, HKV, D, SLOTS = 6, 2, 16, 2000


class Gathering(TorchAttentionBackend):
    def reads_in_place(self, batch, max_new):
        return False


class InPlace(TorchAttentionBackend):
    def reads_in_place(self, batch, max_new):
        return True


def pool_with_values(seed: int = 0) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, SLOTS, HKV, D, torch.float32)
    pool.k[0][1:SLOTS + 1] = torch.randn(SLOTS, HKV, D, generator=g)
    pool.v[0][1:SLOTS + 1] = torch.randn(SLOTS, HKV, D, generator=g)
    return pool


def random_batch(seed: int, prefix_lens: list[int], new: int, extra: int = 0, tree: bool = False):
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
    q = torch.randn(B * new, H, D, generator=g)
    k, v = torch.randn(B * new, HKV, D, generator=g), torch.randn(B * new, HKV, D, generator=g)
    return batch, q, k, v


def attend(backend_cls, batch, q, k, v, pool=None) -> torch.Tensor:
    backend = backend_cls(pool or pool_with_values())
    backend.prepare(batch)
    out = backend.forward(q.clone(), k, v, 0, batch, D ** -0.5)
    if backend.reads_in_place(batch, 0):        # the first call starts compiling and gathers meanwhile
        backend.in_place_attention.join()
        assert backend.in_place_attention.ready
        out = backend.forward(q, k, v, 0, batch, D ** -0.5)
    return out


@pytest.mark.parametrize("prefix_lens,new,extra,tree", [
    ([5, 300, 0, 77, 1, 128, 40, 9], 1, 0, False),         # decode, padded
    ([12, 250, 3], 7, 0, False),                            # extend over a prefix (causal)
    ([30, 200, 64, 1], 5, 0, True),                         # tree verification
    ([17, 90, 150], 3, 4, True),                            # draft tree: scratch keys
    ([60, 3], 1, 2, False),                                 # decode after scratch keys
])
def test_in_place_matches_gather_and_sdpa(prefix_lens, new, extra, tree):
    args = random_batch(len(prefix_lens) + new, prefix_lens, new, extra, tree)
    torch.testing.assert_close(attend(InPlace, *args), attend(Gathering, *args), atol=1e-5, rtol=1e-5)


def test_a_row_does_not_depend_on_the_others():
    # The first request is the same in both (its slots are drawn first); the others, and so the
    # padding, differ.
    ref = attend(InPlace, *random_batch(1, [100] * 8, 1))
    out = attend(InPlace, *random_batch(1, [100, 1, 7, 300, 3, 90, 640, 2], 1))
    torch.testing.assert_close(out[0], ref[0], atol=1e-6, rtol=0)


def test_engine_reads_in_place_for_float32_decode_from_batch_8():
    pool = pool_with_values()
    backend = TorchAttentionBackend(pool)
    for B, new, expected in [(8, 1, True), (7, 1, False), (8, 2, False)]:
        batch, *_ = random_batch(0, [20] * B, new)
        backend.prepare(batch)
        assert batch.attn.in_place is expected
    assert not in_place.wanted(torch.bfloat16, torch.device("cpu"), 64, 1)


def test_gathers_when_compiling_fails():
    batch, q, k, v = random_batch(3, [50] * 8, 1)
    backend = TorchAttentionBackend(pool_with_values())

    def fail(*args):
        raise RuntimeError("no C++ compiler")
    backend.in_place_attention._fn = fail
    backend.prepare(batch)
    torch.testing.assert_close(backend.forward(q, k, v, 0, batch, D ** -0.5), attend(Gathering, batch, q, k, v))
    backend.in_place_attention.join()
    backend.prepare(batch)
    assert backend.in_place_attention.broken and not batch.attn.in_place
