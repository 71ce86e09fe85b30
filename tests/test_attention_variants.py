"""Sliding windows, logit soft-caps and attention sinks (engine/attention/base.py) in every attention
backend (torch's gather + SDPA, torch's CPU kernel kernels/cpu_attention.c, Triton's paged kernel in the
interpreter, and that kernel's torch reference) against a dense float64 reference that windows by the
keys' positions: decode, chunked prefill, tree verification, a draft tree's frontier over scratch keys,
batches mixing them and requests of different lengths, windows smaller and larger than the context. The
CPU kernel's results stay batch-invariant with a window; layers with a variant do not run as one C call."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import KeyLists, TorchAttentionBackend
from engine.core.forward_batch import make_batch
from spec_kernels import cpu_attention
from tests.attention_cases import D, Gathering, ThroughKernel, build, dense_reference, draft_frontier, extend, tree
from tests.compiler import needs_compiler
from tests.tiny import make_model, tiny_engine

SCALE = D ** -0.5
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6]                   # depths 0, 1, 1, 2, 2, 2, 3, 4

BATCHES = {
    "decode": [extend(p, 1) for p in (5, 40, 1, 23, 11)],
    "chunked prefill": [extend(0, 9), extend(7, 5), extend(20, 3)],
    "tree": [tree(10, PARENTS), tree(3, PARENTS)],
    "draft frontier": [draft_frontier(12, 2, 3), draft_frontier(4, 2, 3)],
    "mixed": [extend(30, 1), tree(6, PARENTS), extend(2, 6), extend(0, 4)],
    # several of the Triton kernel's key blocks: a window skips whole blocks
    "long contexts": [extend(150, 1), tree(100, PARENTS), extend(90, 5)],
}
VARIANTS = {
    "none": {},
    "window 3": {"window": 3},            # smaller than every context, and than the deeper tree paths
    "window 12": {"window": 12},
    "window 200": {"window": 200},        # larger than every context
    "softcap": {"softcap": 0.7},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    "all three": {"window": 4, "softcap": 1.5, "sinks": torch.tensor([1.0, 0.0, -0.5, 3.0])},
}


def triton_backend(pool):
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(pool)


BACKENDS = {"sdpa": Gathering, "cpu kernel": ThroughKernel, "triton": triton_backend}


def run(backend_cls, pool, batch, q, k, v, **variants) -> torch.Tensor:
    backend = backend_cls(pool)
    backend.prepare(batch)
    return backend.forward(q, k, v, 0, batch, SCALE, **variants)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_match_the_dense_reference(backend, kind, variant):
    requests, variants = BATCHES[kind], VARIANTS[variant]
    pool, batch, q, k, v = build(requests, seed=len(kind))
    out = run(BACKENDS[backend], pool, batch, q, k, v, **variants)
    expected = dense_reference(requests, pool, batch, q, k, v, SCALE, **variants)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("variant", ["window 3", "all three"])
@pytest.mark.parametrize("kind", BATCHES)
def test_bf16_cpu_kernel_is_near_the_dense_reference(kind, variant):
    requests, variants = BATCHES[kind], VARIANTS[variant]
    pool, batch, q, k, v = build(requests, seed=len(kind), dtype=torch.bfloat16)
    out = run(ThroughKernel, pool, batch, q, k, v, **variants)
    expected = dense_reference(requests, pool, batch, q, k, v, SCALE, **variants)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("variant", ["window 3", "window 12", "all three"])
@pytest.mark.parametrize("kind", ["tree", "mixed"])
def test_triton_reference_matches_the_dense_reference(kind, variant):
    paged = pytest.importorskip("spec_kernels.paged_attention")
    requests, variants = BATCHES[kind], VARIANTS[variant]
    pool, batch, q, k, v = build(requests, seed=len(kind))
    backend = Gathering(pool)
    backend.prepare(batch)
    backend.forward(q, k, v, 0, batch, SCALE)                 # stores the new tokens' K/V
    tails, tail_lens = batch.padded_tails()
    qo_indptr = torch.nn.functional.pad(torch.tensor(batch.extend_lens).cumsum(0), (1, 0))
    out = paged.attention_reference(q, pool.k[0], pool.v[0], qo_indptr, batch.table, batch.rows,
                                    torch.tensor(batch.prefix_lens), tails, tail_lens, batch.masks, SCALE, **variants)
    expected = dense_reference(requests, pool, batch, q, k, v, SCALE, **variants)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["window 3", "window 12", "all three"])
def test_windowed_tree_nodes_get_the_bits_of_their_decode_rows(dtype, variant):
    """Batch invariance with a window: each node of a verified tree, in one forward beside other
    requests, against the node alone as a decode row after its ancestors (its own start in its list)."""
    variants = VARIANTS[variant]
    requests = [tree(20, PARENTS), extend(33, 1), tree(5, PARENTS)]
    pool, batch, q, k, v = build(requests, seed=3, dtype=dtype)
    together = run(ThroughKernel, pool, batch, q, k, v, **variants)
    starts = [0, len(PARENTS), len(PARENTS) + 1]
    for b in (0, 2):
        slots, seen = batch.out_slots[starts[b]:starts[b] + len(PARENTS)], requests[b].seen
        for i in range(len(PARENTS)):
            t = starts[b] + i
            ancestors = slots[:i][seen[i, :i]]
            row = make_batch(batch.table, [b], [requests[b].prefix], [0], slots[i:i + 1], [1],
                             extra_slots=ancestors, extra_lens=[len(ancestors)])
            row.decode_step = True
            alone = run(TorchAttentionBackend, pool, row, q[t:t + 1], k[t:t + 1], v[t:t + 1], **variants)
            assert isinstance(row.attn, KeyLists)
            assert torch.equal(alone[0], together[t]), (b, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_token_does_not_depend_on_the_rest_of_the_call(dtype):
    """The kernel alone: tokens grouped as a request's (a shared prefix read once) with a window, against
    each token alone on one thread."""
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(400, 2, 64, generator=g).to(dtype), torch.randn(400, 2, 64, generator=g).to(dtype)
    q = torch.randn(5, 8, 64, generator=g).to(dtype)
    index = torch.randperm(400, generator=g)[:260].repeat(5, 1)
    lens = torch.tensor([251, 252, 253, 255, 260])
    variants = {"window": 37, "softcap": 2.0, "sinks": torch.randn(8, generator=g)}
    together = cpu_attention.attend(q, k, v, index, lens, 0.125, torch.tensor([0, 5]), torch.tensor([250]),
                                    **variants)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for t in range(5):
            alone = cpu_attention.attend(q[t:t + 1], k, v, index[t:t + 1], lens[t:t + 1], 0.125, **variants)
            assert torch.equal(alone[0], together[t]), t
    finally:
        torch.set_num_threads(threads)


@needs_compiler
@pytest.mark.parametrize("variant", ["window", "softcap", "sinks"])
def test_layers_with_a_variant_do_not_run_as_one_c_call(variant, tmp_path):
    """kernels/cpu_decoder.c has none of the variants: a model with any of them on a layer keeps its
    layers (engine/models/fused_decode.py asks fusable_decode)."""
    eng = tiny_engine(make_model(tmp_path, layers=2), quantization="w4a8", dtype="bfloat16")
    model = eng.debug.target.model
    try:
        assert model.fusable_decode()
        value = {"window": 4, "softcap": 30.0, "sinks": torch.zeros(4)}[variant]
        setattr(model.model.layers[1].self_attn, variant, value)
        assert not model.fusable_decode()
    finally:
        eng.shutdown()
