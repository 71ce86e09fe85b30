"""Token-level KV cache: one slot per token per layer, the slot numbers handed out by a free list
(engine/memory/slots.py).

The allocator's slots index every model's KVPool alike: the target's and a draft's K/V for one token
live at the same slot number (engine/memory/kv_manager.py owns who holds which).

Slot 0 is never handed out: it stays zero and pads gathers, so a padded row attends to finite values
that its mask then hides. Nor is slot size + 1, where rows added to pad a batch to a fixed shape
(engine/core/graph_runner.py) write their K/V. Freeing a request's rejected or finished tokens is returning their slot
numbers to the free list; no KV is ever copied (but a STANDALONE draft's parked root: speculative/standalone.py).
A target whose layers are partly or wholly sliding-window keeps those layers' K/V in a second, smaller
pool, reached through a map from these slots (engine/memory/window_pool.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from engine.memory.window_pool import WindowPool


class KVPool:
    """K and V buffers for every layer, indexed by slot. With a `window` pool, its layers' buffers are
    the window pool's, smaller, and store/gather translate slots through its slot map
    (engine/memory/window_pool.py); `k[layer]` and `v[layer]` are each layer's own buffers either way."""

    def __init__(self, num_layers: int, size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", window: Optional[WindowPool] = None):
        self.size, self.window = size, window
        windowed = window.layers if window else frozenset()

        def shape(layer: int) -> tuple[int, int, int]:
            return ((window.slots if layer in windowed else size) + 2, num_kv_heads, head_dim)

        # torch.empty: on CPU the pages are committed only when written, so a large pool costs what is used.
        self.k = [torch.empty(shape(i), dtype=dtype, device=device) for i in range(num_layers)]
        self.v = [torch.empty(shape(i), dtype=dtype, device=device) for i in range(num_layers)]
        for buf in self.k + self.v:
            buf[0].zero_()

    def windowed(self, layer: int) -> bool:
        """Whether the layer's K/V live in the window pool, at the slots `translate` gives."""
        return self.window is not None and layer in self.window.layers

    def translate(self, slots: torch.Tensor) -> torch.Tensor:
        """The window pool's slots of full slots (0, a zero row, where the window slot was freed)."""
        return self.window.slot_map[slots]

    def _slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.translate(slots) if self.windowed(layer) else slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # index_copy_/index_select: about twice as fast on CPU as indexed assignment and lookup.
        slots = self._slots(layer, slots)
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (any shape S): two [*S, Hkv, D] copies, written into `out` (two
        [S.numel(), Hkv, D] buffers) when given."""
        flat = self._slots(layer, slots.reshape(-1))
        shape = (*slots.shape, *self.k[layer].shape[1:])
        if out is None:
            return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)
        return (torch.index_select(self.k[layer], 0, flat, out=out[0]).view(shape),
                torch.index_select(self.v[layer], 0, flat, out=out[1]).view(shape))

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of slots `src` into slots `dst`."""
        for layer, pair in enumerate(zip(self.k, self.v)):
            to, of = self._slots(layer, dst), self._slots(layer, src)
            for buf in pair:
                buf.index_copy_(0, to, buf.index_select(0, of))

    def gather_buffers(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers for `gather(..., out=)` of `count` slots."""
        return tuple(torch.empty((count, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
                     for buf in (self.k[0], self.v[0]))
