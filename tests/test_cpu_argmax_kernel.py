"""The argmax kernel (kernels/cpu_argmax.c) gives torch.argmax's index: greedy decoding depends on it."""

from __future__ import annotations

import pytest
import torch

from spec_kernels import cpu_argmax
from tests.compiler import needs_compiler

pytestmark = needs_compiler


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 151936), (5, 17), (2, 1), (4, 33)])
def test_argmax_is_torchs_on_random_tied_nan_and_infinite_rows(rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    cases = [torch.randn(rows, vocab, generator=g),
             torch.randint(-3, 3, (rows, vocab), generator=g).float(),      # many equal maxima: the first wins
             torch.full((rows, vocab), float("-inf"))]
    nan = cases[1].clone()
    nan[:, vocab // 2] = float("nan")               # a NaN counts as the largest value
    nan[0, vocab // 3] = float("nan")
    inf = cases[2].clone()
    inf[-1, -1] = float("inf")
    for x in (*cases, nan, inf):
        assert torch.equal(cpu_argmax.argmax(x), x.argmax(-1))


def test_argmax_reads_rows_a_stride_apart_and_leaves_other_tensors_to_torch():
    x = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cpu_argmax.argmax(x[:, 10:90]), x[:, 10:90].argmax(-1))
    assert torch.equal(cpu_argmax.argmax(x[::2]), x[::2].argmax(-1))
    assert torch.equal(cpu_argmax.argmax(x.bfloat16()), x.bfloat16().argmax(-1))
