"""The decoder's elementwise steps in bf16 on the CPU: kernels/cpu_elementwise.c, built once per machine
(kernels/native.py), called through ctypes in eager mode and as opaque ops (spec::rms_norm_bf16, ...)
inside a compiled model, so that both give the same bits. `usable(x)` says whether a tensor takes this
path: bf16 on the CPU, where the library builds; float32 stays on torch's ops (the exact reference)."""

from __future__ import annotations

import ctypes

import torch

from spec_kernels.native import Kernel

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _declare(library: ctypes.CDLL) -> None:
    library.spec_rms_norm_bf16.argtypes = [_P, _I64, _P, _P, _I64, _I, _F, _I, _I]
    library.spec_rope_bf16.argtypes = [_P, _I64, _P, _P, _P, _I64, _I, _I, _I]
    library.spec_silu_mul_bf16.argtypes = [_P, _P, _I64, _I, _I]
    for fn in (library.spec_rms_norm_bf16, library.spec_rope_bf16, library.spec_silu_mul_bf16):
        fn.restype = None


_kernel = Kernel("cpu_elementwise.c", _declare,
                 "the CPU's bf16 elementwise kernels are unavailable (%s): norms, rotary embedding and SiLU run "
                 "as torch ops (a few microseconds more each); install a C compiler (gcc) or set CC")
library, failure = _kernel.library, _kernel.failure


def usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and library() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each token's heads contiguous, tokens one stride apart (q/k of the fused
    q/k/v projection are taken as they lie); otherwise a contiguous copy."""
    if x.stride(-1) == 1 and all(x.stride(i) == x.stride(i + 1) * x.shape[i + 1] for i in range(1, x.dim() - 1)):
        return x
    return x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """weight * bf16(x / sqrt(mean(x^2) + eps)) over the last dimension, x and weight bf16; with `offset`
    (Gemma's norms) bf16(x / sqrt(mean(x^2) + eps) * (1 + weight)), scaled in fp32."""
    if torch.compiler.is_compiling():
        return torch.ops.spec.rms_norm_bf16(x, weight, eps, offset)
    # Rows one stride apart: a matrix's rows as they lie (a column slice too), anything else made contiguous
    # (Qwen3's q/k heads of one token are D apart, its tokens the fused projection's width).
    if x.stride(-1) != 1 or (x.dim() > 2 and not x.is_contiguous()):
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    D = x.shape[-1]
    T = out.numel() // D
    # (A size-1 dimension's stride can be anything in a contiguous tensor: only a matrix's is read.)
    library().spec_rms_norm_bf16(x.data_ptr(), x.stride(0) if x.dim() == 2 else D, weight.data_ptr(),
                                 out.data_ptr(), T, D, eps, int(offset), torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] * cos + roll(x, D / 2) * sin, with cos and signed sin [T, 1, D] (Rotary's)."""
    if torch.compiler.is_compiling():
        return torch.ops.spec.rope_bf16(x, cos, sin)
    x, cos, sin = _rows(x), cos.contiguous(), sin.contiguous()
    T, heads, D = x.shape
    out = torch.empty((T, heads, D), dtype=x.dtype)
    library().spec_rope_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), T, heads, D,
                             torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> silu(gate) * up [..., I]."""
    if torch.compiler.is_compiling():
        return torch.ops.spec.silu_mul_bf16(gate_up)
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
    library().spec_silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), out.numel() // inter, inter,
                                 torch.get_num_threads())
    return out


# Opaque ops for compiled graphs (eager calls skip the dispatcher, whose cost per call adds up over a step).
@torch.library.custom_op("spec::rms_norm_bf16", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    return rms_norm(x, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("spec::rope_bf16", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope(x, cos, sin)


@_rope_op.register_fake
def _(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("spec::silu_mul_bf16", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul(gate_up)


@_silu_mul_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
