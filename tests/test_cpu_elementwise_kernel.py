"""The bf16 elementwise kernels (kernels/cpu_elementwise.c) against torch's ops, row by row alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spec_kernels import cpu_elementwise
from tests.compiler import needs_compiler

pytestmark = needs_compiler


def test_rms_norm_is_transformers_rmsnorm_in_bf16():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    expected = w * F.rms_norm(x.float(), (576,), None, 1e-5).to(torch.bfloat16)
    y = cpu_elementwise.rms_norm(x, w, 1e-5)
    # the sum of squares is taken in another order than torch's: at most one bf16 step apart
    assert ((y.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -7).all()
    assert torch.equal(cpu_elementwise.rms_norm(x[3:4], w, 1e-5), y[3:4])
    assert torch.equal(cpu_elementwise.rms_norm(x.view(7, 1, 576), w, 1e-5).view(7, 576), y)
    # heads of a fused projection's column slice (Qwen3's q/k norm): tokens 960 apart, heads 64
    qkv = torch.randn(5, 960, generator=g).bfloat16()
    heads = qkv[:, :768].view(5, 12, 64)
    w64 = (torch.rand(64, generator=g) + 0.5).bfloat16()
    assert torch.equal(cpu_elementwise.rms_norm(heads, w64, 1e-6), cpu_elementwise.rms_norm(heads.contiguous(), w64, 1e-6))
    assert torch.equal(cpu_elementwise.rms_norm(qkv[:, 192:768], w, 1e-5)[2], cpu_elementwise.rms_norm(qkv[2:3, 192:768], w, 1e-5)[0])


def test_gemma_rms_norm_scales_by_one_plus_the_weight_before_rounding():
    """offset: Gemma's x / rms * (1 + w), scaled in fp32 and rounded once (engine/models/gemma.py's
    torch path), row by row alone, over q/k heads too."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 640, generator=g).bfloat16()
    w = (torch.randn(640, generator=g) * 0.5).bfloat16()            # centred on zero, as Gemma stores it
    expected = (F.rms_norm(x.float(), (640,), None, 1e-6) * (1.0 + w.float())).bfloat16()
    y = cpu_elementwise.rms_norm(x, w, 1e-6, offset=True)
    assert ((y.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -7).all()
    assert not torch.equal(y, cpu_elementwise.rms_norm(x, w, 1e-6))         # not Llama's w * bf16(normed)
    assert torch.equal(cpu_elementwise.rms_norm(x[2:3], w, 1e-6, offset=True), y[2:3])
    heads = torch.randn(3, 4, 64, generator=g).bfloat16()
    w64 = (torch.randn(64, generator=g) * 0.5).bfloat16()
    expected = (F.rms_norm(heads.float(), (64,), None, 1e-6) * (1.0 + w64.float())).bfloat16()
    y = cpu_elementwise.rms_norm(heads, w64, 1e-6, offset=True)
    assert ((y.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -7).all()


def test_rope_rotates_a_column_slice_as_torch_does():
    from engine.models.llama import Rotary

    class Config:
        rope_theta = 10000.0

    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 960, generator=g).bfloat16()
    qk = qkv[:, :768].view(5, 12, 64)                       # rows 960 apart, as in the fused projection
    cos, sin = Rotary(Config, 64, 128)(torch.tensor([0, 3, 7, 50, 127]), torch.bfloat16)
    expected = qk.float() * cos.float() + qk.float().roll(32, -1) * sin.float()
    y = cpu_elementwise.rope(qk, cos, sin)
    assert y.shape == (5, 12, 64) and (y.float() - expected).abs().max() <= 2 ** -7 * expected.abs().max()
    assert torch.equal(cpu_elementwise.rope(qk[2:3], cos[2:3], sin[2:3]), y[2:3])


def test_silu_mul_over_a_gate_up_projection():
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(6, 2 * 1536, generator=g) * 4).bfloat16()     # large |gate|: exp must not overflow
    gate, up = gate_up.float().split(1536, -1)
    expected = F.silu(gate) * up
    y = cpu_elementwise.silu_mul(gate_up)
    assert y.shape == (6, 1536) and ((y.float() - expected).abs() <= expected.abs() * 2 ** -7 + 1e-6).all()
    assert torch.equal(cpu_elementwise.silu_mul(gate_up[4:5]), y[4:5])
