"""The free list of KV slot numbers that every model's KVPool is indexed by (engine/memory/kv_pool.py):
slot 0 and slot size + 1 are never handed out; freeing is returning numbers to the list."""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free list of KV slot numbers 1..size."""

    def __init__(self, size: int):
        self.size = size
        self.reset()

    def available(self) -> int:
        return self._count

    def free_counts(self) -> tuple[int, int]:
        """(free slots, free slots of the windowed layers): one pool holds every layer here."""
        return self._count, self._count

    def count_held(self, slots: torch.Tensor) -> int:
        """How many of `slots` hold the windowed layers' K/V: all (engine/memory/window_pool.py)."""
        return slots.numel()

    def adopt_window(self, slots: torch.Tensor, donors: torch.Tensor) -> int:
        """Window slots moved from `donors` to `slots`: none, every slot holding its own
        (engine/memory/window_pool.py)."""
        return 0

    def reusable(self, slots: torch.Tensor) -> int:
        """The longest prefix of a sequence's slots a request may continue from: all of it."""
        return len(slots)

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots as an int64 tensor, or None when fewer are free (nothing is taken then)."""
        if n > self._count:
            return None
        if n > self._free.numel():
            # Freed slots are gathered here, once, not on every free: a free per request per step
            # must not copy a pool-sized list.
            self._free = torch.cat([self._free, *self._returned])
            self._returned = []
        out, self._free = self._free[:n], self._free[n:]
        self._count -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            # A copy, always: slots are often a view of the req-to-token table (on a CPU, .to("cpu") is
            # no copy), whose row the next request overwrites while these wait here to be handed out.
            self._returned.append(slots.to("cpu", torch.int64, copy=True).flatten())
            self._count += slots.numel()

    def free_slots(self) -> torch.Tensor:
        """Every free slot, the most recently freed last."""
        return torch.cat([self._free, *self._returned])

    def reset(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._returned: list[torch.Tensor] = []
        self._count = self.size
