"""A second KV pool for the sliding-window layers, whose slots are freed once every window has moved past.

A model whose layers attend through a sliding window (Gemma 2/3's local layers, Mistral v0.1's every
layer) reads only the last `window` positions' K/V in those layers. Their K/V live in a pool of their
own, smaller than the full one: each token still gets a full slot (the number the request-to-token
table holds, indexing the global layers' K/V and any draft model's), and, for as long as a window may
still read it, a window slot, found through `slot_map` (full slot -> window slot; 0, the pool's zero
row, once it is freed). The KV manager frees a request's window slots as its window moves past them
(engine/memory/kv_manager.py), so the windowed layers of a long context cost what one window costs.
SGLang's SWA memory pool works the same way (SWATokenToKVPoolAllocator, SWAKVPool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.core.to_device import to_device
from engine.memory.slots import TokenSlotAllocator


@dataclass(frozen=True)
class SlidingLayout:
    """Which of a model's layers keep their K/V in the window pool, and the window they share: the
    longest of theirs (a window slot is freed only once no layer's window reaches it)."""
    layers: frozenset[int]
    window: int

    @classmethod
    def of(cls, windows: Sequence[Optional[int]], context_length: int) -> Optional["SlidingLayout"]:
        """The layout for per-layer windows (None: full attention); None where no window is shorter
        than the context, so that none would ever free a slot."""
        layers = frozenset(i for i, w in enumerate(windows) if w is not None and w < context_length)
        return cls(layers, max(windows[i] for i in layers)) if layers else None


@dataclass(frozen=True)
class WindowPool:
    """What a KVPool needs to keep `layers` in the window pool: its size and the slot map."""
    layers: frozenset[int]
    slots: int
    slot_map: torch.Tensor


class WindowedSlotAllocator:
    """TokenSlotAllocator's interface over two free lists: alloc(n) gives n full slots, each mapped to a
    window slot of its own; free gives both back; free_window the window slots alone (the token keeps
    its full slot, which the table and the radix cache go on naming)."""

    def __init__(self, size: int, window_slots: int, window: int, device):
        self.size, self.window_slots, self.window = size, window_slots, window
        self.full, self.local = TokenSlotAllocator(size), TokenSlotAllocator(window_slots)
        # The map the attention backends read, on the device; the host copy is the one read here. The
        # padding slot size + 1 maps to the window pool's own padding slot.
        self.slot_map = torch.zeros(size + 2, dtype=torch.int64, device=device)
        self._host_map = self.slot_map if self.slot_map.device.type == "cpu" else torch.zeros_like(self.slot_map, device="cpu")
        self.reset()

    def pool(self, layers: frozenset[int]) -> WindowPool:
        return WindowPool(layers, self.window_slots, self.slot_map)

    def available(self) -> int:
        return min(self.full.available(), self.local.available())

    def free_counts(self) -> tuple[int, int]:
        """(free full slots, free window slots)."""
        return self.full.available(), self.local.available()

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        if n > self.available():
            return None
        slots, local = self.full.alloc(n), self.local.alloc(n)
        self._map(slots, local)
        return slots

    def free(self, slots: torch.Tensor) -> None:
        self.free_window(slots)
        self.full.free(slots)

    def free_window(self, slots: torch.Tensor) -> None:
        """Free the window slots of `slots` that still have one."""
        slots = slots.to("cpu", torch.int64).flatten()
        local = self._host_map[slots]
        held = local > 0
        if held.any():
            self.local.free(local[held])
            self._map(slots[held], torch.zeros(int(held.sum()), dtype=torch.int64))

    def adopt_window(self, slots: torch.Tensor, donors: torch.Tensor) -> int:
        """Move window slots from `donors` to `slots` (one to one: the same tokens' slots) wherever a slot
        has none and its donor has one; return how many moved. The donors keep their full slots."""
        slots, donors = slots.to("cpu", torch.int64), donors.to("cpu", torch.int64)
        local = self._host_map[donors]
        move = (self._host_map[slots] == 0) & (local > 0)
        if not move.any():
            return 0
        self._map(slots[move], local[move])
        self._map(donors[move], torch.zeros(int(move.sum()), dtype=torch.int64))
        return int(move.sum())

    def count_held(self, slots: torch.Tensor) -> int:
        """How many of `slots` still have their window slot."""
        return int((self._host_map[slots.to("cpu", torch.int64)] > 0).sum())

    def reusable(self, slots: torch.Tensor) -> int:
        """The longest prefix of a sequence's slots (positions 0, 1, ...) that a request may continue
        from: the window before its end still held (a query at position m reads positions m - window + 1
        to m - 1 in the windowed layers)."""
        n = len(slots)
        missing = torch.cat([torch.zeros(1, dtype=torch.int64), (self._host_map[slots] == 0).cumsum(0)])
        ends = torch.arange(n + 1)
        ok = missing[ends] == missing[(ends - self.window + 1).clamp(min=0)]
        return int(ok.nonzero()[-1])

    def free_slots(self) -> torch.Tensor:
        return self.full.free_slots()

    def reset(self) -> None:
        self.full.reset()
        self.local.reset()
        self._host_map.zero_()
        self._host_map[self.size + 1] = self.window_slots + 1
        if self._host_map is not self.slot_map:
            self.slot_map.copy_(self._host_map)

    def _map(self, slots: torch.Tensor, local: torch.Tensor) -> None:
        self._host_map[slots] = local
        if self._host_map is not self.slot_map:
            device = self.slot_map.device
            self.slot_map[to_device(slots, device)] = to_device(local, device)
