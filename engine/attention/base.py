"""The interface every attention backend implements. Models call only `forward`."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.core.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-forward metadata (indices, masks) once; every layer reuses it."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Store the new tokens' k/v [T, Hkv, D] in the KV pool, then attend q [T, H, D] over each
        request's cached prefix plus its new tokens. Returns [T, H, D]."""
