"""Keyed sampling: per row, the Gumbel-max draw from a distribution with noise fixed by a 64-bit key
(kernels/cpu_keyed_sample.c says how), on the CPU in one vectorized pass; `reference` is the same draw
in torch ops, used elsewhere (GPU, no compiler, inside a compiled graph) and in tests."""

from __future__ import annotations

import ctypes

import torch

from spec_kernels.native import Kernel

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
GOLDEN = 0x9E3779B97F4A7C15 - 2 ** 64          # splitmix64's constants, as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2 ** 64
_MIX2 = 0x94D049BB133111EB - 2 ** 64


def _declare(library: ctypes.CDLL) -> None:
    library.spec_keyed_sample_f32.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I]
    library.spec_keyed_sample_f32.restype = None


_kernel = Kernel("cpu_keyed_sample.c", _declare, "the CPU keyed-sampling kernel is unavailable (%s): sampled "
                 "tokens are drawn in torch ops (a few ms a row over a 150K vocabulary)")


def keyed_sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (non-negative, any scale; zeros never drawn), keys [R] int64 -> [R] int64 tokens."""
    if (probs.dim() != 2 or probs.dtype != torch.float32 or probs.device.type != "cpu" or probs.stride(-1) != 1
            or probs.shape[1] == 0 or torch.compiler.is_compiling() or _kernel.library() is None):
        return reference(probs, keys)
    keys = keys.to(torch.int64).contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.long)
    _kernel.library().spec_keyed_sample_f32(probs.data_ptr(), probs.shape[0], probs.shape[1], probs.stride(0),
                                            keys.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def shr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (multiplication wraps as on uint64)."""
    x = (x ^ shr(x, 30)) * _MIX1
    x = (x ^ shr(x, 27)) * _MIX2
    return x ^ shr(x, 31)


def reference(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The kernel's draw in torch ops: argmax of p / -log(u) over the tokens with p > 0."""
    j = torch.arange(probs.shape[-1], device=probs.device, dtype=torch.int64)
    u = (shr(mix(keys.to(torch.int64)[:, None] + j[None, :] * GOLDEN), 11) + 1).double() * 2.0 ** -53
    p = probs.double()
    return torch.where(p > 0, p / -torch.log(u), -1.0).argmax(-1)
