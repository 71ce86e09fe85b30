"""Attention backends behind one interface; `create_backend` picks one at start-up."""

from __future__ import annotations

import logging
import os

from engine.attention.base import AttentionBackend
from engine.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_backend(name: str, device: str) -> str:
    """The backend `name` stands for on `device`: `auto` is the fast path there, Triton's paged kernels on
    CUDA (their metadata has the bucket's shape, so decode steps replay from CUDA graphs) and torch on the
    CPU (its batch-invariant C kernel). Without triton, CUDA falls back to torch, said once."""
    if name != "auto":
        return name
    if not device.startswith("cuda"):
        return "torch"
    from spec_kernels.paged_attention import available

    if available():
        return "triton"
    log.warning("--attention-backend auto: triton is not installed, so attention runs on the torch backend and "
                "decode steps without CUDA graphs (pip install triton, or spec's [gpu] extra, for the fast path)")
    return "torch"


def create_backend(name: str, device: str, kv_pool, deterministic: bool = False, draft: bool = False
                   ) -> AttentionBackend:
    """The backend `name` (accepted by check_backend) over one model's K/V buffers (a draft model gets
    its own); `deterministic` (--enable-deterministic-inference): prefill batch-invariant too. A `draft`
    model's forwards of a few tokens per request (catch-up on accepted tokens, tree frontiers) attend
    through the CPU kernel, which reads the cache in place, where the target's prefill gathers it for SDPA."""
    if resolve_backend(name, device) == "torch":
        from engine.attention.torch_backend import DRAFT_KEY_LIST_QUERIES, TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, batch_invariant_prefill=deterministic,
                                     key_lists_up_to=DRAFT_KEY_LIST_QUERIES if draft else 1)
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(kv_pool)


def check_backend(name: str, device: str, deterministic: bool) -> None:
    """Refuse an --attention-backend that cannot run here (and deterministic inference where it cannot
    act), before any weight loads."""
    if name not in ("auto", "torch", "triton"):
        raise ConfigError(f"--attention-backend {name} is not implemented yet (torch and triton are); use "
                          "--attention-backend torch, triton or auto.")
    if name == "triton":
        check_triton(device)
    if deterministic:
        check_deterministic(name, device)


def check_triton(device: str) -> None:
    """Triton kernels need Triton, and a GPU unless they run in Triton's interpreter."""
    from spec_kernels.paged_attention import available

    if not available():
        raise ConfigError("--attention-backend triton needs the triton package: pip install triton "
                          "(or install spec with the [gpu] extra).")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--attention-backend triton runs on a CUDA GPU; on a CPU use --attention-backend torch "
                          "(TRITON_INTERPRET=1 runs the kernels in Triton's interpreter, for checking only).")


def check_deterministic(name: str, device: str) -> None:
    """--enable-deterministic-inference runs on the CPU kernel of the torch backend, which must build."""
    from spec_kernels import cpu_attention

    if device != "cpu" or name not in ("auto", "torch"):
        raise ConfigError("--enable-deterministic-inference is implemented for the CPU's torch attention backend "
                          "(kernels/cpu_attention.c); on a GPU or with another --attention-backend leave it out.")
    if cpu_attention.library() is None:
        raise ConfigError(f"--enable-deterministic-inference needs the CPU attention kernel, which could not be "
                          f"built: {cpu_attention.failure()}. Install a C compiler (gcc) or set CC.")
