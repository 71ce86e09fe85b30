"""Batch-invariant paged attention on the CPU: kernels/cpu_attention.c, built once per machine
(kernels/native.py: at the torch backend's start-up, with the system's C compiler) and called through
ctypes with the tensors' pointers. Where it cannot be built (no compiler) `library()` returns None,
says why once, and callers use their own attention.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from spec_kernels.native import Kernel


def _declare(library: ctypes.CDLL) -> None:
    fn = library.spec_attend_variants
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
                                           ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


_kernel = Kernel("cpu_attention.c", _declare,
                 "batch-invariant CPU attention unavailable (%s): decode steps use SDPA, and with bf16 or int8 "
                 "activations speculative output can then differ from plain decoding's; install a C compiler "
                 "(gcc) or set CC")
library, failure = _kernel.library, _kernel.failure


def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the kernel takes K/V (and queries) of this dtype and head dimension on this device."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and head_dim <= 512


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
           kv_len: torch.Tensor, scale: float, starts: Optional[torch.Tensor] = None,
           shared: Optional[torch.Tensor] = None, *, window: Optional[int] = None, softcap: Optional[float] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, H, D] over token t's visible slots kv_index[t, :kv_len[t]] (int64) of the pools
    [slots, Hkv, D] of q's dtype: [T, H, D]. Optionally the tokens in groups that share leading keys
    (a request's tokens share its prefix), read once for the group: group i is tokens
    starts[i]:starts[i + 1], whose first shared[i] slots are the same; by default every token is its own
    group. Grouping changes no bit of the result. Variants (engine/attention/base.py): `window`, the
    last keys of a token's list it sees at most; `softcap`, scores s taken as softcap * tanh(s / softcap);
    `sinks` [H], a logit per query head in the softmax's sum that weighs no value. Compiled code calls it
    as the opaque op spec::cpu_attention."""
    if starts is None:
        starts = torch.arange(len(q) + 1)
        shared = kv_len
    variants = (window or 0, softcap or 0.0, None if sinks is None else sinks.float().contiguous())
    if torch.compiler.is_compiling():
        return torch.ops.spec.cpu_attention(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale, *variants)
    return _run(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale, *variants)


def _run(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale: float, window: int = 0, softcap: float = 0.0,
         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    lib = library()
    if lib is None:
        raise RuntimeError(f"batch-invariant CPU attention unavailable: {failure()}")
    q, kv_index, kv_len = q.contiguous(), kv_index.contiguous(), kv_len.contiguous()
    starts, shared = starts.contiguous(), shared.contiguous()
    assert q.dtype == k_pool.dtype == v_pool.dtype and k_pool.is_contiguous() and v_pool.is_contiguous()
    out = torch.empty_like(q)
    T, H, D = q.shape
    assert sinks is None or sinks.shape == (H,)
    rc = lib.spec_attend_variants(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(),
                                  int(q.dtype == torch.bfloat16), T, H, k_pool.shape[1], D, kv_index.data_ptr(),
                                  kv_len.data_ptr(), kv_index.shape[1], starts.data_ptr(), shared.data_ptr(),
                                  len(shared), scale, window, softcap, None if sinks is None else sinks.data_ptr(),
                                  torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("cpu_attention: unsupported shape or out of memory")
    return out


# Eager calls go to _run directly: the dispatcher adds a cost to every call, and a step makes dozens.
@torch.library.custom_op("spec::cpu_attention", mutates_args=())
def _op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
        kv_len: torch.Tensor, starts: torch.Tensor, shared: torch.Tensor, scale: float, window: int,
        softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    return _run(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale, window, softcap, sinks)


@_op.register_fake
def _(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale, window, softcap, sinks):
    return torch.empty_like(q)


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
              kv_len: torch.Tensor, scale: float, *, window: Optional[int] = None, softcap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same attention in float64 torch ops, token by token (tests)."""
    T, H, D = q.shape
    G = H // k_pool.shape[1]
    out = torch.empty_like(q)
    for t in range(T):
        n = int(kv_len[t])
        slots = kv_index[t, max(0, n - window) if window else 0:n]
        k = k_pool[slots].double().repeat_interleave(G, 1).transpose(0, 1)    # [H, n, D]
        v = v_pool[slots].double().repeat_interleave(G, 1).transpose(0, 1)
        s = (q[t].double()[:, None, :] * k).sum(-1) * scale                    # [H, n]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        p = torch.softmax(s, -1)[:, :len(slots)]
        out[t] = (p[..., None] * v).sum(1).to(q.dtype)
    return out
