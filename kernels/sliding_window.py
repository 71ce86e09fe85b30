"""Sliding windows over visibility masks, shared by the attention backends' torch paths and references."""

from __future__ import annotations

import torch


def last_seen(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A sliding window over a visibility mask [..., keys]: of the keys each row sees, the last `window`.
    A query's visible keys are consecutive positions ending at its own (engine/attention/base.py), so
    these are the keys within `window` positions of it."""
    seen_from_here = mask.flip(-1).cumsum(-1).flip(-1)       # visible keys at or after each key
    return mask & (seen_from_here <= window)
