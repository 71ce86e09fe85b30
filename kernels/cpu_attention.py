"""Batch-invariant paged attention on the CPU: kernels/cpu_attention.c, built once per machine.

The C source is compiled when first needed (the torch backend's start-up) with the system's C
compiler (the one torch.compile needs too) for this CPU (-march=native), into ~/.cache/spec/kernels
(SPEC_KERNEL_CACHE overrides), keyed by the source, the compiler and the CPU's flags; it takes about a
second, and later starts load the library.
No torch headers: it is called through ctypes with the tensors' pointers. Where the library cannot be
built (no compiler) `library()` returns None, says why once, and callers use their own attention.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([_SOURCE.read_text(), version, " ".join(_FLAGS), _cpu_flags()]).encode())
    cache = Path(os.environ.get("SPEC_KERNEL_CACHE", Path.home() / ".cache" / "spec" / "kernels"))
    target = cache / f"cpu_attention-{key.hexdigest()[:16]}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Built aside and renamed into place: processes starting together (tensor-parallel ranks)
        # never load a half-written library.
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            run = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-500:]}")
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    fn = library.spec_attend
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    return library


def library() -> Optional[ctypes.CDLL]:
    """The built kernel, or None (the reason is logged once and kept in `failure()`)."""
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _build()
            except (OSError, RuntimeError) as e:
                _failure = str(e)
                log.warning("batch-invariant CPU attention unavailable (%s): decode steps use SDPA, and with bf16 or "
                            "int8 activations speculative output can then differ from plain decoding's; install a "
                            "C compiler (gcc) or set CC", e)
        return _library


def failure() -> Optional[str]:
    return _failure


def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the kernel takes K/V (and queries) of this dtype and head dimension on this device."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and head_dim <= 512


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
           kv_len: torch.Tensor, scale: float, starts: Optional[torch.Tensor] = None,
           shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, H, D] over token t's visible slots kv_index[t, :kv_len[t]] (int64) of the pools
    [slots, Hkv, D] of q's dtype: [T, H, D]. Optionally the tokens in groups that share leading keys
    (a request's tokens share its prefix), read once for the group: group i is tokens
    starts[i]:starts[i + 1], whose first shared[i] slots are the same; by default every token is its own
    group. Grouping changes no bit of the result. Compiled code calls it as the opaque op
    spec::cpu_attention."""
    if starts is None:
        starts = torch.arange(len(q) + 1)
        shared = kv_len
    if torch.compiler.is_compiling():
        return torch.ops.spec.cpu_attention(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale)
    return _run(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale)


def _run(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale: float) -> torch.Tensor:
    lib = library()
    if lib is None:
        raise RuntimeError(f"batch-invariant CPU attention unavailable: {_failure}")
    q, kv_index, kv_len = q.contiguous(), kv_index.contiguous(), kv_len.contiguous()
    starts, shared = starts.contiguous(), shared.contiguous()
    assert q.dtype == k_pool.dtype == v_pool.dtype and k_pool.is_contiguous() and v_pool.is_contiguous()
    out = torch.empty_like(q)
    T, H, D = q.shape
    rc = lib.spec_attend(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(),
                         int(q.dtype == torch.bfloat16), T, H, k_pool.shape[1], D, kv_index.data_ptr(),
                         kv_len.data_ptr(), kv_index.shape[1], starts.data_ptr(), shared.data_ptr(), len(shared),
                         scale, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("cpu_attention: unsupported shape or out of memory")
    return out


# Eager calls go to _run directly: through the dispatcher a call cost ~8 us more, 30 times a step.
@torch.library.custom_op("spec::cpu_attention", mutates_args=())
def _op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
        kv_len: torch.Tensor, starts: torch.Tensor, shared: torch.Tensor, scale: float) -> torch.Tensor:
    return _run(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale)


@_op.register_fake
def _(q, k_pool, v_pool, kv_index, kv_len, starts, shared, scale):
    return torch.empty_like(q)


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
              kv_len: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in float64 torch ops, token by token (tests)."""
    T, H, D = q.shape
    G = H // k_pool.shape[1]
    out = torch.empty_like(q)
    for t in range(T):
        slots = kv_index[t, :kv_len[t]]
        k = k_pool[slots].double().repeat_interleave(G, 1).transpose(0, 1)    # [H, n, D]
        v = v_pool[slots].double().repeat_interleave(G, 1).transpose(0, 1)
        p = torch.softmax((q[t].double()[:, None, :] * k).sum(-1) * scale, -1)  # [H, n]
        out[t] = (p[..., None] * v).sum(1).to(q.dtype)
    return out
