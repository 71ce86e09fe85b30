"""ForwardBatch: everything one model forward needs, as tensors.

Every forward is an "extend": each request appends `extend_len` new tokens after the `prefix_len`
positions its row of the request-to-token table already holds. Prefill, chunked prefill, decode
(extend_len 1), tree verification and draft-tree expansion are all this one shape. A forward never
writes the table (the KV manager alone does, when a step's tokens are committed): the new tokens' slots
come with the batch, and so do `extra_slots`, scratch keys a request also sees after its prefix (the
ancestors drafted at earlier depths of a draft tree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from engine.core.to_device import to_device


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] new tokens of all requests, request after request
    positions: torch.Tensor        # [T] their positions
    out_slots: torch.Tensor        # [T] KV slots their K/V are written to
    table: torch.Tensor            # the request-to-token table, read only
    rows: torch.Tensor             # [B] table rows
    prefix_lens: list[int]         # [B] positions of each row visible to all its new tokens
    extend_lens: list[int]         # [B] new tokens per request
    extra_slots: Optional[torch.Tensor] = None   # [sum(extra_lens)] scratch keys after each prefix
    extra_lens: Optional[list[int]] = None
    # [B, max(extend_lens), max(extra + extend)] bool: new token i sees tail key j, the tail being the
    # extra keys then the new tokens. None: every extra key, and the new tokens causally.
    masks: Optional[torch.Tensor] = None
    # Hidden states to return, by index in Hugging Face's `hidden_states` tuple (0 = embeddings, i = the
    # input of layer i); EAGLE-3 drafts read three of them.
    capture_hidden: tuple[int, ...] = ()
    # A decode step's forward (decode or tree verification): attention must give each token the bits a
    # lone decode of it would (engine/attention/torch_backend.py), or speculation changes the output.
    decode_step: bool = False
    attn: Any = field(default=None, repr=False)   # backend-specific metadata, set by AttentionBackend.prepare

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def tail_lens(self) -> list[int]:
        extra = self.extra_lens or [0] * self.batch_size
        return [e + n for e, n in zip(extra, self.extend_lens)]

    @property
    def tail_slots(self) -> torch.Tensor:
        """Each request's extra keys then its new tokens' slots, request after request."""
        if self.extra_slots is None:
            return self.out_slots
        extra = self.extra_slots.split(self.extra_lens)
        new = self.out_slots.split(self.extend_lens)
        return torch.cat([t for pair in zip(extra, new) for t in pair])

    def padded_tails(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, max tail] each request's tail slots, 0-padded; [B] tail lengths), on the device."""
        device, lens = self.out_slots.device, self.tail_lens
        n = to_device(lens, device)
        tails = torch.zeros((len(lens), max(lens)), dtype=torch.long, device=device)
        b = torch.arange(len(lens), device=device).repeat_interleave(n, output_size=sum(lens))
        tails[b, torch.arange(len(b), device=device) - (n.cumsum(0) - n)[b]] = self.tail_slots
        return tails, n


def make_batch(table: torch.Tensor, rows: Sequence[int], prefix_lens: Sequence[int], input_ids,
               out_slots: torch.Tensor, extend_lens: Sequence[int], *, positions: Optional[torch.Tensor] = None,
               extra_slots: Optional[torch.Tensor] = None, extra_lens: Optional[Sequence[int]] = None,
               masks: Optional[torch.Tensor] = None, capture_hidden: tuple[int, ...] = ()) -> ForwardBatch:
    """Lay a step's work out as one ForwardBatch on the table's device. `positions` default to the
    positions right after each request's prefix and extra keys."""
    device = table.device
    input_ids = to_device(torch.as_tensor(input_ids, dtype=torch.long), device)
    if positions is None:
        n = to_device(list(extend_lens), device)
        starts = to_device([p + e for p, e in zip(prefix_lens, extra_lens or [0] * len(prefix_lens))], device)
        offsets = n.cumsum(0) - n
        positions = (starts - offsets).repeat_interleave(n, output_size=len(input_ids)) + \
            torch.arange(len(input_ids), device=device)
    return ForwardBatch(
        input_ids=input_ids, positions=to_device(positions, device), out_slots=to_device(out_slots, device),
        table=table,
        rows=to_device(list(rows), device, torch.long), prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens), extra_slots=None if extra_slots is None else to_device(extra_slots, device),
        extra_lens=None if extra_lens is None else list(extra_lens), masks=masks, capture_hidden=capture_hidden)
