"""kernels/cpu_attention.c against a float64 reference (fp32 and bf16 storage, grouped-query heads,
head dims 64 and 128, ragged key lists), a token's bits independent of the other tokens in the call,
of the prefix its group shares and of the thread count, and a clear failure where the library cannot
be built."""

from __future__ import annotations

import pytest
import torch

from spec_kernels import cpu_attention
from spec_kernels.native import Kernel


def case(seed: int, T: int, H: int, Hkv: int, D: int, dtype: torch.dtype, slots: int = 700):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    v = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    lens = torch.randint(1, 300, (T,), generator=g)
    index = torch.zeros((T, 320), dtype=torch.long)
    for t in range(T):
        index[t, :lens[t]] = torch.randperm(slots, generator=g)[:lens[t]]
    return torch.randn(T, H, D, generator=g).to(dtype), k, v, index, lens


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (12, 2, 128), (4, 4, 16)])
def test_matches_the_float64_reference(dtype, tol, H, Hkv, D):
    q, k, v, index, lens = case(0, 6, H, Hkv, D, dtype)
    out = cpu_attention.attend(q, k, v, index, lens, D ** -0.5)
    ref = cpu_attention.reference(q, k, v, index, lens, D ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_gets_the_same_bits_alone_or_among_others_and_whatever_the_threads(dtype):
    q, k, v, index, lens = case(1, 7, 9, 3, 64, dtype)
    together = cpu_attention.attend(q, k, v, index, lens, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for t in range(7):
            n = int(lens[t])
            alone = cpu_attention.attend(q[t:t + 1], k, v, index[t:t + 1, :n], lens[t:t + 1], 0.125)
            assert torch.equal(alone[0], together[t]), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [297, 296])
def test_a_token_gets_the_same_bits_whatever_prefix_its_group_shares(dtype, shared):
    """A request's chain of tokens in one group (the keys before `shared` read once for all) against each
    token alone. Every weight is 1 (zero queries) and the values at list positions 296-298 are 2^30, 1
    and -2^30: the 1 is lost or kept depending on which keys a lane adds together, so a split that
    changed how a bf16 pool pairs a token's keys would change its output."""
    g = torch.Generator().manual_seed(2)
    k, q = torch.randn(400, 3, 64, generator=g).to(dtype), torch.zeros(4, 9, 64, dtype=dtype)
    index = torch.randperm(400, generator=g)[:shared + 4].repeat(4, 1)
    v = torch.zeros(400, 3, 64, dtype=dtype)
    v[index[0, 296:299]] = torch.tensor([2.0 ** 30, 1.0, -2.0 ** 30], dtype=dtype)[:, None, None]
    lens = torch.tensor([shared + 1 + t for t in range(4)])
    together = cpu_attention.attend(q, k, v, index, lens, 0.125, starts=torch.tensor([0, 4]),
                                    shared=torch.tensor([shared]))
    for t in range(4):
        alone = cpu_attention.attend(q[t:t + 1], k, v, index[t:t + 1], lens[t:t + 1], 0.125)
        assert torch.equal(alone[0], together[t]), t


def test_without_a_compiler_the_library_is_none_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("SPEC_KERNEL_CACHE", str(tmp_path))
    kernel = Kernel("cpu_attention.c", cpu_attention._declare, "unavailable: %s")
    assert kernel.library() is None
    assert "/nonexistent/cc" in kernel.failure()
