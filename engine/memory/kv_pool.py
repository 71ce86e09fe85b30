"""Token-level KV cache: one slot per token per layer, handed out by a free-list allocator.

The allocator's slots index every model's KVPool alike: the target's and a draft's K/V for one token
live at the same slot number (engine/memory/kv_manager.py owns who holds which).

Slot 0 is never handed out: it stays zero and pads gathers, so a padded row attends to finite values
that its mask then hides. Nor is slot size + 1, where rows added to pad a batch to a fixed shape
(engine/core/graph_runner.py) write their K/V. Freeing a request's rejected or finished tokens is returning their slot
numbers to the free list; no KV is ever copied (but a STANDALONE draft's parked root: speculative/standalone.py).
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free list of KV slot numbers 1..size."""

    def __init__(self, size: int):
        self.size = size
        self.reset()

    def available(self) -> int:
        return self._count

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


class KVPool:
    """K and V buffers for every layer, indexed by slot."""

    def __init__(self, num_layers: int, size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.size = size
        shape = (size + 2, num_kv_heads, head_dim)
        # torch.empty: on CPU the pages are committed only when written, so a large pool costs what is used.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in self.k + self.v:
            buf[0].zero_()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # index_copy_/index_select: about twice as fast on CPU as indexed assignment and lookup.
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (any shape S): two [*S, Hkv, D] copies, written into `out` (two
        [S.numel(), Hkv, D] buffers) when given."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.k[layer].shape[1:])
        if out is None:
            return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)
        return (torch.index_select(self.k[layer], 0, flat, out=out[0]).view(shape),
                torch.index_select(self.v[layer], 0, flat, out=out[1]).view(shape))

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of slots `src` into slots `dst`."""
        for buf in self.k + self.v:
            buf.index_copy_(0, dst, buf.index_select(0, src))

    def gather_buffers(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers for `gather(..., out=)` of `count` slots."""
        return tuple(torch.empty((count, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
                     for buf in (self.k[0], self.v[0]))
