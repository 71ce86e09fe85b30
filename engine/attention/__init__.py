"""Attention backends behind one interface; `create_backend` picks one at start-up."""

from __future__ import annotations

from engine.attention.base import AttentionBackend
from engine.errors import ConfigError


def create_backend(name: str, device: str, kv_pool, req_to_token) -> AttentionBackend:
    if name in ("auto", "torch"):
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, req_to_token)
    raise ConfigError(f"--attention-backend {name} is not implemented yet (only torch is); use --attention-backend "
                      "torch or auto.")
