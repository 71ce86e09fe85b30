"""The interface every attention backend implements. Models call only `forward`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from engine.core.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-forward metadata (indices, masks) once; every layer reuses it."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
                scale: float, *, window: Optional[int] = None, softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store the new tokens' k/v [T, Hkv, D] in the KV pool, then attend q [T, H, D] over each
        request's cached prefix plus its new tokens. Returns [T, H, D].

        Variants a layer may ask for (None: none; every backend honours all three):
        - `window`: a sliding window. A query at position p sees only keys at positions j with
          p - window < j <= p, the `window` most recent positions, its own included (transformers'
          sliding_window). A query's visible keys always hold consecutive positions ending at its own
          (a draft tree's node at depth d, at position prefix_len + d, sees the prefix and its d
          ancestors), so backends keep the last `window` of the keys it would otherwise see.
        - `softcap`: logit soft-capping (Gemma 2): scores s (already scaled) become
          softcap * tanh(s / softcap) before the softmax.
        - `sinks` [H]: attention sinks (GPT-OSS): a logit per query head that joins the softmax's
          maximum and denominator and weighs no value.
        """
