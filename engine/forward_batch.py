"""ForwardBatch: everything one model forward needs, as tensors. Built by the model runner.

Every forward is an "extend": each request appends `extend_len` new tokens after `prefix_len` tokens
whose KV is already cached. Prefill, chunked prefill, decode (extend_len 1) and speculative tree
verification (extend_len = tree size, with a tree mask) are all this one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

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


@dataclass
class ForwardItem:
    """One request's part of a forward: its new tokens and where their KV goes."""
    row: int
    prefix_len: int
    token_ids: Sequence[int]
    positions: Optional[Sequence[int]] = None   # default: prefix_len, prefix_len + 1, ...
    mask: Optional[torch.Tensor] = None         # tree mask among the new tokens; None = causal


def build_forward_batch(items: Sequence[ForwardItem], out_slots: torch.Tensor, table: torch.Tensor,
                        capture_hidden: tuple[int, ...] = ()) -> ForwardBatch:
    """Record each item's new KV slots in its row of the req-to-token `table` (in order, `out_slots`
    holds them all) and lay the items out as one ForwardBatch on the table's device."""
    device = table.device
    ids, pos, offset = [], [], 0
    for it in items:
        n = len(it.token_ids)
        table[it.row, it.prefix_len:it.prefix_len + n] = out_slots[offset:offset + n].to(device)
        ids.extend(it.token_ids)
        pos.extend(it.positions if it.positions is not None else range(it.prefix_len, it.prefix_len + n))
        offset += n
    masks = [it.mask for it in items]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        out_slots=out_slots.to(device),
        req_rows=torch.tensor([it.row for it in items], dtype=torch.long),
        prefix_lens=[it.prefix_len for it in items],
        extend_lens=[len(it.token_ids) for it in items],
        custom_masks=masks if any(m is not None for m in masks) else None,
        capture_hidden=capture_hidden,
    )
