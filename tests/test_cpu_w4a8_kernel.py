"""The 4/6/8-bit x int8 CPU kernel (kernels/cpu_w4a8.c) against its float64 reference, its layouts from
GGUF groups, and a row's bits independent of the rows and threads beside it."""

from __future__ import annotations

import pytest
import torch

from engine.loader import gguf_quant
from engine.models.quant import Int8GroupLinear, W4A8Linear
from spec_kernels import cpu_w4a8

pytestmark = pytest.mark.skipif(cpu_w4a8.library() is None, reason="no C compiler")


def weights(n: int, k: int, seed: int = 0, bits: int = 4):
    """q, scale, min (for 6 bits, Q6_K's q, int8 scales per 16 and d per 256)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    if bits == 6:
        return q, torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8), \
            (torch.rand(n, k // 256, generator=g) * 1e-3).half()
    scale, low = torch.rand(n, k // 32, generator=g) * 0.01, -torch.rand(n, k // 32, generator=g) * 0.05
    # fp16 is what the kernel keeps: the reference gets the same rounded values
    return q, scale.half().float(), low.half().float()


@pytest.mark.parametrize("bits, n, k", [(b, n, k) for b in (4, 8) for n, k in ((16, 32), (40, 96), (96, 576))]
                         + [(6, 16, 256), (6, 40, 768)])       # rows padded to 16; odd group counts
@pytest.mark.parametrize("rows", [1, 5, 8, 11])                        # one pass of 8 rows, and more
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(n, k, rows, dtype, bits):
    q, scale, low = weights(n, k, bits=bits)
    bias = torch.randn(n)
    x = torch.randn(rows, k).to(dtype)
    packed = cpu_w4a8.pack(q, scale, low, bits)
    groups = gguf_quant.Groups(6, q, scale, low) if bits == 6 else None
    assert torch.equal(cpu_w4a8.unpack(*packed, n), gguf_quant.dequantize(groups) if bits == 6 else
                       (q.float().view(n, -1, 32) * scale[..., None] + low[..., None]).view(n, k))
    y = cpu_w4a8.linear(x, *packed, bias, n)
    expected = cpu_w4a8.reference(x.float(), q, scale, low, bias, bits)
    assert y.dtype == dtype and y.shape == (rows, n)
    # fp32: the activations' int8 rounding is in the reference, so only float summation order remains
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert (y.double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_bf16_results_are_the_fp32_results_rounded_as_torch_rounds(bias_dtype):
    """The same activations in bf16 and in fp32 give the same sums; the bf16 result (full blocks of 16
    rows stored by vectors, the last block of 40 by scalar code) must be the fp32 one rounded by torch."""
    q, scale, low = weights(40, 96, seed=2)
    packed = cpu_w4a8.pack(q, scale, low)
    bias = None if bias_dtype is None else (torch.randn(40) * 1e3).to(bias_dtype)
    x = (torch.randn(11, 96) * torch.logspace(-30, 30, 11)[:, None]).to(torch.bfloat16)   # tiny to huge
    y32 = cpu_w4a8.linear(x.float(), *packed, bias, 40)
    assert torch.equal(cpu_w4a8.linear(x, *packed, bias, 40), y32.to(torch.bfloat16))


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_rows_and_threads_do_not_change_a_rows_bits(bits):
    q, scale, low = weights(48, 256, seed=1, bits=bits)
    packed = cpu_w4a8.pack(q, scale, low, bits)
    x = torch.randn(19, 256)
    together = cpu_w4a8.linear(x, *packed, None, 48)
    alone = torch.cat([cpu_w4a8.linear(x[i:i + 1], *packed, None, 48) for i in range(19)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = cpu_w4a8.linear(x, *packed, None, 48)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, one_thread)
    assert cpu_w4a8.linear(x[:0], *packed, None, 48).shape == (0, 48)


def test_a_linear_from_gguf_groups_computes_with_them():
    """Q4_1 blocks as a GGUF stores them -> W4A8Linear: its product is the dequantized weights' with
    the activations rounded to int8 groups (fp16 scales are exact for Q4_1)."""
    import gguf
    import numpy as np

    raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32),
                               gguf.GGMLQuantizationType.Q4_1)
    q, scale, low = gguf_quant.decode(raw, "Q4_1", 64)
    scale, low = torch.from_numpy(scale), torch.from_numpy(low)
    linear = W4A8Linear.from_groups(gguf_quant.Groups(4, gguf_quant.pack(q), scale, low), None)
    x = torch.randn(3, 128)
    expected = cpu_w4a8.reference(x, torch.from_numpy(q), scale, low, None)
    assert (linear(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_int8_groups_keep_q8_0_weights_exactly(monkeypatch):
    """A GGUF's Q8_0 tensor (SmolLM2's embedding and tied head), dequantized by gguf and quantized
    again into int8 groups (three slices of rows here), holds the same weights."""
    import gguf
    import numpy as np

    raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32),
                               gguf.GGMLQuantizationType.Q8_0)
    weights = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)).reshape(48, 256)
    monkeypatch.setattr(Int8GroupLinear, "SLICE", 16)
    assert torch.equal(Int8GroupLinear.quantize(weights, None).dequantized(), weights)
