"""ForwardBatch: everything one model forward needs, as tensors. Built by the model runner.

Every forward is an "extend": each request appends `extend_len` new tokens after `prefix_len` tokens
whose KV is already cached. Prefill, chunked prefill, decode (extend_len 1) and speculative tree
verification (extend_len = tree size, with a tree mask) are all this one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] new tokens of all requests, request after request
    positions: torch.Tensor        # [T] their positions (tree nodes: prefix length + depth)
    out_slots: torch.Tensor        # [T] KV slots their K/V are written to
    req_rows: torch.Tensor         # [B] rows of the req-to-token table
    prefix_lens: list[int]         # [B] tokens already cached before this forward
    extend_lens: list[int]         # [B] new tokens per request
    # Per request, None (causal among the new tokens) or a bool [n, n] mask: mask[i, j] = new token i
    # may attend to new token j. A request always attends to its whole cached prefix.
    custom_masks: Optional[list[Optional[torch.Tensor]]] = None
    # Hidden states to return, by index in Hugging Face's `hidden_states` tuple (0 = embeddings, i = the
    # input of layer i); EAGLE-3 drafts read three of them.
    capture_hidden: tuple[int, ...] = ()
    attn: Any = field(default=None, repr=False)   # backend-specific metadata, set by AttentionBackend.prepare

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return self.custom_masks is None and all(n == 1 for n in self.extend_lens)
