"""KVManager: the one owner of KV memory bookkeeping, used by the scheduler alone.

It hands out KV slots (the token-level free list), keeps the request-to-token table (row r, position p:
the slot holding that token's KV) and the radix cache of shared prefixes, and writes a step's accepted
tokens into the table. It reads requests and never changes them: the scheduler records the row, cached
length and radix node it is given. Whatever a step allocated and did not commit goes back to the free
list, which is all a rollback is. Every model (the target and any draft) keeps its own K/V buffers
indexed by these same slots, so a cached prefix is cached for the draft too.

The radix cache is keyed by token pairs (each position's token and the next one), whatever decodes:
EAGLE-style drafts' KV at position t depends on token t + 1 (they read the target's feature at t with
the embedding of t + 1), so a match must agree on the next token too (SGLang does the same for EAGLE);
and with one key for every configuration, plain and speculative decoding cache and reuse exactly the
same positions (a finished request's first seq_len - 1, whose KV plain decoding computed), so a later
prompt's prefill starts at the same position in both and their outputs stay identical token for token.

With a window pool (a target with sliding-window layers: engine/memory/window_pool.py) each committed
step also frees the window slots of the request's own positions that no query can reach any more: the
next query of a request sits at its committed length or later, so positions more than `window - 1`
before it are read by global layers only. Positions of its cached prefix are the radix cache's: those
before its last window are freed when it is locked, on nodes no other request holds. A cached prefix is
reused only as far as the window before its end is still held, since the request's first queries read
it in the windowed layers (SGLang's SWA radix cache matches alike).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.memory.budget import KVBudget
from engine.memory.slots import TokenSlotAllocator
from engine.memory.radix_cache import RadixCache
from engine.memory.window_pool import SlidingLayout, WindowedSlotAllocator, WindowPool
from engine.core.request import Request
from engine.core.to_device import to_device

_NO_SLOTS = torch.empty(0, dtype=torch.int64)


class KVManager:
    def __init__(self, num_slots: int, max_rows: int, max_context: int, device, radix: bool,
                 budget: Optional[KVBudget] = None, sliding: Optional[SlidingLayout] = None, window_slots: int = 0):
        """`sliding` and `window_slots`: a window pool of that many slots for those layers."""
        self.sliding = sliding
        self.allocator = (WindowedSlotAllocator(num_slots, window_slots, sliding.window, device) if sliding
                          else TokenSlotAllocator(num_slots))
        self.budget = budget or KVBudget(num_slots)     # how the pool was sized: out-of-memory advice
        # One row more than handed out, all zeros: the row of dummy requests that pad a batch.
        self.table = torch.zeros((max_rows + 1, max_context), dtype=torch.int64, device=device)
        self.pad_row, self.pad_slot = max_rows, num_slots + 1
        self._free_rows = list(range(max_rows))
        self.radix: Optional[RadixCache] = RadixCache(self.allocator) if radix else None

    # ------------------------------------------------------------------ capacity
    @property
    def capacity(self) -> int:
        return self.allocator.size

    def available(self) -> int:
        """Slots that can be had now: free ones plus unlocked cached ones (evicted on demand); with a
        window pool, the fewer of its slots and the full pool's."""
        full, window = self.allocator.free_counts()
        if self.radix:
            full, window = full + self.radix.evictable_size(), window + self.radix.evictable_held()
        return min(full, window)

    def unused(self) -> int:
        """Slots free without evicting anything."""
        return self.allocator.available()

    def usage(self) -> tuple[int, int]:
        """Slots in use, by requests or the radix cache: (full pool's, window pool's); both the same
        without a window pool."""
        full, window = self.allocator.free_counts()
        return self.capacity - full, (self.allocator.window_slots if self.sliding else self.capacity) - window

    def cached(self) -> int:
        return self.radix.evictable_size() if self.radix else 0

    def window_pool(self) -> Optional[WindowPool]:
        """Where a target's KVPool keeps its sliding-window layers (None: every layer in the full pool)."""
        return self.allocator.pool(self.sliding.layers) if self.sliding else None

    def rows_available(self) -> int:
        return len(self._free_rows)

    def flush(self) -> None:
        """Evict every unlocked cached prefix."""
        if self.radix:
            self.radix.evict(self.radix.evictable_size())

    # ------------------------------------------------------------------ slots
    def alloc(self, n: int) -> torch.Tensor:
        """n slots, evicting cached prefixes as needed. The caller checked `available()` first."""
        full, window = self.allocator.free_counts()
        if self.radix and n > min(full, window):
            self.radix.evict(n - full, n - window)
        slots = self.allocator.alloc(n)
        assert slots is not None, "callers check available() first"
        return slots

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    # ------------------------------------------------------------------ requests
    def match(self, req: Request) -> tuple[torch.Tensor, object]:
        """The longest cached prefix of the request's tokens (slots, radix node), leaving at least its
        last token to compute: that token's logits give the next one."""
        if not self.radix:
            return _NO_SLOTS, None
        key = self._key(req.token_ids, req.seq_len - 1)
        slots, node = self.radix.match_prefix(key)
        usable = self.allocator.reusable(slots)     # the window before the end still held
        if usable < len(slots):
            slots, node = self.radix.match_prefix(key[:usable])
        return slots, node

    def lock(self, node) -> None:
        """Pin a matched prefix (it stops counting as available). With a window pool, the prefix's window
        slots before its last window are freed where no other request holds them: the request reads no
        further back, so a conversation's next turn holds one window of it, not all its turns'."""
        if self.radix:
            self.radix.inc_lock_ref(node)
            if self.sliding:
                self.radix.free_window(node, self.sliding.window - 1)

    def unlock(self, node) -> None:
        if self.radix:
            self.radix.dec_lock_ref(node)

    def admit(self, prefix: torch.Tensor) -> int:
        """A table row holding a cached prefix, which the caller has locked: the lock and the row are
        the request's until `release`."""
        row = self._free_rows.pop()
        self.table[row, :len(prefix)] = prefix.to(self.table.device)
        return row

    def commit(self, reqs: Sequence[Request], counts: Sequence[int], slots: torch.Tensor) -> None:
        """Write the slots of counts[i] tokens after reqs[i]'s cached length into its table row, taken in
        order from `slots` (flat, request after request)."""
        if not any(counts):
            return
        # Index lists built on the host: a handful of tokens per request, cheaper than tensor arithmetic.
        rows = [r.row for r, k in zip(reqs, counts) for _ in range(k)]
        cols = [r.kv_len + j for r, k in zip(reqs, counts) for j in range(k)]
        device = self.table.device
        self.table[to_device(rows, device), to_device(cols, device)] = to_device(slots, device)
        if self.sliding:
            self._slide(reqs, counts)

    def _slide(self, reqs: Sequence[Request], counts: Sequence[int]) -> None:
        """Free the window slots of positions the requests' next queries no longer reach (positions up
        to kv_len - window, once counts[i] more are committed), of their own positions only; those
        before the last commit's bound were freed then."""
        window = self.sliding.window
        rows, cols = [], []
        for r, k in zip(reqs, counts):
            start, end = max(r.prefix_len, r.kv_len - window + 1), r.kv_len + k - window + 1
            rows += [r.row] * max(0, end - start)
            cols += range(start, end)
        if rows:
            device = self.table.device
            self.allocator.free_window(self.table[to_device(rows, device), to_device(cols, device)])

    def release(self, req: Request) -> None:
        """Give back a request's KV: into the radix cache when on (the request itself may reuse it on
        resume, or others may), else to the free list; then its table row."""
        slots = self.table[req.row, :req.kv_len].cpu()
        # A pair key needs the token after its position: the last token's KV (which only a stop inside
        # an accepted run leaves) is not kept, nor KV past such a cut.
        keep = min(req.kv_len, req.seq_len - 1)
        self.allocator.free(slots[keep:])
        if self.radix:
            dup = self.radix.insert(self._key(req.token_ids, keep), slots[:keep])
            self.allocator.free(slots[req.prefix_len:dup])
            self.radix.dec_lock_ref(req.radix_node)
        else:
            self.allocator.free(slots[:keep])
        self._free_rows.append(req.row)

    def _key(self, ids: Sequence[int], n: int) -> Sequence[int]:
        """Radix key of the first n positions: (token, next token) pairs, each as one int."""
        return [(a << 32) | b for a, b in zip(ids[:n], ids[1:n + 1])]

