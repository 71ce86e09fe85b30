"""Attention backends behind one interface; `create_backend` picks one at start-up."""

from __future__ import annotations

from engine.attention.base import AttentionBackend
from engine.errors import ConfigError


def create_backend(name: str, device: str, kv_pool) -> AttentionBackend:
    """The backend `name` over one model's K/V buffers (a draft model gets its own)."""
    if name in ("auto", "torch"):
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool)
    raise ConfigError(f"--attention-backend {name} is not implemented yet (only torch is); use --attention-backend "
                      "torch or auto.")
