"""Greedy token choice: argmax over fp32 logits rows with torch.argmax's result (first maximum, NaN as
the largest) in one vectorized pass of kernels/cpu_argmax.c; torch's own is used elsewhere (GPU, other
dtypes, no compiler, inside a compiled graph)."""

from __future__ import annotations

import ctypes

import torch

from spec_kernels.native import Kernel

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _declare(library: ctypes.CDLL) -> None:
    library.spec_argmax_f32.argtypes = [_P, _I64, _I64, _I64, _P, _I]
    library.spec_argmax_f32.restype = None


_kernel = Kernel("cpu_argmax.c", _declare, "the CPU argmax kernel is unavailable (%s): greedy picks use "
                 "torch.argmax (slower over a large vocabulary)")


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> [R] int64: the index of each row's largest value, as logits.argmax(-1)."""
    if (logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.stride(-1) != 1 or logits.shape[1] >= 2**31 or logits.shape[1] == 0
            or torch.compiler.is_compiling() or _kernel.library() is None):
        return logits.argmax(-1)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    _kernel.library().spec_argmax_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                                      out.data_ptr(), torch.get_num_threads())
    return out
