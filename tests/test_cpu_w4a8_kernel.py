"""The 4/6/8-bit x int8 CPU kernel (kernels/cpu_w4a8.c) against its float64 reference, its layouts from
GGUF groups, and a row's bits independent of the rows and threads beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.loader import gguf_quant
from engine.models.quant import Int8GroupLinear, Q5Linear, Q6KLinear, W4A8Linear
from spec_kernels import cpu_w4a8
from tests.compiler import needs_compiler

pytestmark = needs_compiler


def layer(n: int, k: int, seed: int = 0, form: str = "4"):
    """(q, scale, min, per-256 scales, the float weights they make) of a random layer in a form the kernel
    takes: "4" or "8" bits from floats (fp16 scale and min), Q4_K's and Q5_K's own scales, Q6_K's."""
    g = torch.Generator().manual_seed(seed)
    top = {"Q6_K": 64, "8": 256, "Q5_K": 32}.get(form, 16)
    q = torch.randint(0, top, (n, k), generator=g, dtype=torch.uint8)
    if form == "Q6_K":
        scale, low = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8), None
        sup = (torch.rand(n, k // 256, 1, generator=g) * 1e-3).half()
        return q, scale, low, sup, gguf_quant.dequantize(gguf_quant.Groups(6, q, scale, low, sup))
    if form in ("Q4_K", "Q5_K"):
        scale, low = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2))
        sup = (torch.rand(n, k // 256, 2, generator=g) * 1e-3).half()
        groups = gguf_quant.Groups(5, q, scale, low, sup) if form == "Q5_K" else \
            gguf_quant.Groups(4, gguf_quant.pack(q.numpy()), scale, low, sup)
        return q, scale, low, sup, gguf_quant.dequantize(groups)
    # fp16 is what the kernel keeps: the reference gets the same rounded values
    scale = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    low = (-torch.rand(n, k // 32, generator=g) * 0.05).half().float()
    return q, scale, low, None, (q.float().view(n, -1, 32) * scale[..., None] + low[..., None]).view(n, k)


def packed(q, scale, low, sup, form: str = "4"):
    return cpu_w4a8.pack(q, scale, low, {"8": 8, "Q5_K": 5, "Q6_K": 6}.get(form, 4), sup)


@pytest.mark.parametrize("form, n, k", [(f, n, k) for f in ("4", "8") for n, k in ((16, 32), (40, 96), (96, 576))]
                         + [(f, n, k) for f in ("Q4_K", "Q5_K", "Q6_K") for n, k in ((16, 256), (40, 768))])
@pytest.mark.parametrize("rows", [1, 5, 8, 11])                        # one pass of 8 rows, and more
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(n, k, rows, dtype, form):
    """Rows padded to blocks of 16; odd group counts; the weights the layout holds are the given ones."""
    *parts, w = layer(n, k, form=form)
    bias = torch.randn(n)
    x = torch.randn(rows, k).to(dtype)
    weights = packed(*parts, form)
    assert torch.equal(cpu_w4a8.unpack(*weights, n), w)
    y = cpu_w4a8.linear(x, *weights, bias, n)
    expected = cpu_w4a8.reference(x.float(), w, bias)
    assert y.dtype == dtype and y.shape == (rows, n)
    # fp32: the activations' int8 rounding is in the reference, so only float summation order remains
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert (y.double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("form, n", [("4", 40), ("Q4_K", 40), ("4", 16)])
def test_gguf_nibbles_pack_as_their_weights_do(form, n):
    """4-bit weights two a byte, as a GGUF stores them (what the loader passes), give the layout of the
    same weights one a byte."""
    q, scale, low, sup, _ = layer(n, 256, seed=3, form=form)
    nibbles = gguf_quant.pack(q.numpy())
    for got, want in zip(cpu_w4a8.pack(nibbles, scale, low, 4, sup, nibbles=True), packed(q, scale, low, sup, form)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_bf16_results_are_the_fp32_results_rounded_as_torch_rounds(bias_dtype):
    """The same activations in bf16 and in fp32 give the same sums; the bf16 result (full blocks of 16
    rows stored by vectors, the last block of 40 by scalar code) must be the fp32 one rounded by torch."""
    weights = packed(*layer(40, 96, seed=2)[:4])
    bias = None if bias_dtype is None else (torch.randn(40) * 1e3).to(bias_dtype)
    x = (torch.randn(11, 96) * torch.logspace(-30, 30, 11)[:, None]).to(torch.bfloat16)   # tiny to huge
    y32 = cpu_w4a8.linear(x.float(), *weights, bias, 40)
    assert torch.equal(cpu_w4a8.linear(x, *weights, bias, 40), y32.to(torch.bfloat16))


@pytest.mark.parametrize("form", ["4", "8", "Q4_K", "Q5_K", "Q6_K"])
def test_rows_and_threads_do_not_change_a_rows_bits(form):
    weights = packed(*layer(48, 256, seed=1, form=form)[:4], form)
    x = torch.randn(19, 256)
    together = cpu_w4a8.linear(x, *weights, None, 48)
    alone = torch.cat([cpu_w4a8.linear(x[i:i + 1], *weights, None, 48) for i in range(19)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = cpu_w4a8.linear(x, *weights, None, 48)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, one_thread)
    assert cpu_w4a8.linear(x[:0], *weights, None, 48).shape == (0, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_of_layers_in_different_forms_is_their_outputs_side_by_side(dtype):
    """Parts of a fused projection stored in different forms, chained: one call gives each part's
    columns, with its own slice of the bias, bit for bit what the part alone gives."""
    forms, sizes = ("Q4_K", "4", "Q5_K", "Q6_K"), (40, 16, 8, 24)
    parts = [packed(*layer(n, 256, seed=i, form=f)[:4], f) for i, (f, n) in enumerate(zip(forms, sizes))]
    bias = torch.randn(sum(sizes)).to(dtype)
    x = torch.randn(11, 256).to(dtype)
    ends = torch.tensor(sizes).cumsum(0).tolist()
    biases = [bias[end - n:end] for n, end in zip(sizes, ends)]
    structs = [cpu_w4a8.layer(*p, b, n) for p, b, n in zip(parts, biases, sizes)]
    together = cpu_w4a8.call(cpu_w4a8.chain(structs), x, sum(sizes))
    alone = torch.cat([cpu_w4a8.linear(x, *p, b, n) for p, b, n in zip(parts, biases, sizes)], -1)
    assert together.shape == (11, 88) and torch.equal(together, alone)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "MXFP4"])
def test_a_linear_from_gguf_groups_holds_the_files_weights(kind, monkeypatch):
    """Blocks as a GGUF stores them -> W4A8Linear (Q5Linear, Q6KLinear, Int8GroupLinear), packed in slices of 16
    rows: it holds the weights gguf dequantizes, bit for bit, and its product is theirs with the
    activations rounded to int8 groups. (MXFP4 with exponents whose scales fp16 holds, as real weights'.)"""
    import gguf

    from tests.gguf_files import gguf_blocks

    raw = gguf_blocks(kind, 40, 512)
    if kind == "MXFP4":
        raw[:, ::17] = np.random.default_rng(3).integers(110, 135, raw[:, ::17].shape)
    cls = {"Q4_1": W4A8Linear, "Q4_K": W4A8Linear, "Q6_K": Q6KLinear, "Q8_0": Int8GroupLinear}.get(kind, Q5Linear)
    monkeypatch.setattr(cls, "SLICE", 16)
    linear = cls.from_groups(gguf_quant.decode(raw, kind, 40), None)
    weights = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).reshape(40, 512)
    assert torch.equal(linear.dequantized(), weights)
    x = torch.randn(3, 512)
    expected = cpu_w4a8.reference(x, weights, None)
    assert (linear(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_int8_groups_keep_q8_0_weights_exactly(monkeypatch):
    """A GGUF's Q8_0 tensor (SmolLM2's embedding and tied head), dequantized by gguf and quantized
    again into int8 groups (three slices of rows here), holds the same weights."""
    import gguf

    raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32),
                               gguf.GGMLQuantizationType.Q8_0)
    weights = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)).reshape(48, 256)
    monkeypatch.setattr(Int8GroupLinear, "SLICE", 16)
    assert torch.equal(Int8GroupLinear.quantize(weights, None).dequantized(), weights)
