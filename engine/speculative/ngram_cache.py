"""NgramCache: which tokens followed each recent context, learned from every request's text.

A flattened suffix trie: the key is a context (a tuple of `min_window`..`max_window` tokens), the value
maps each token seen right after that context to how often it was seen, most recently seen last. A
trie node is a key and its children are the followers; flattening lets any entry be evicted on its own
(no orphaned subtrees) and makes "does the suffix of length k match" one dict lookup.

The whole cache is bounded by `capacity` contexts, least recently *learned* dropped first (an
OrderedDict, so eviction is O(1)). Each context keeps at most `max_followers` followers (the least
frequent, oldest one makes room): drafting never uses more than the breadth cap, and unbounded follower
lists of short, common contexts (a single token) would make every lookup slow.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence


class NgramCache:
    def __init__(self, min_window: int, max_window: int, capacity: int, max_followers: int):
        assert 1 <= min_window <= max_window and capacity > 0 and max_followers > 0
        self.min_window, self.max_window = min_window, max_window
        self.capacity, self.max_followers = capacity, max_followers
        self._followers: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._followers)

    def learn(self, tokens: Sequence[int], first_new: int) -> None:
        """Record tokens[first_new:] as followers of every context (of the window sizes) before them.
        tokens[:first_new] is already-learned history, only read as context: pass at least `max_window`
        tokens of it, or all there is."""
        table = self._followers
        for j in range(max(first_new, self.min_window), len(tokens)):
            tok = tokens[j]
            window = tuple(tokens[max(0, j - self.max_window):j])
            for k in range(self.min_window, len(window) + 1):
                key = window[-k:]
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {}
                    if len(table) > self.capacity:
                        table.popitem(last=False)
                else:
                    table.move_to_end(key)
                    if tok not in counts and len(counts) >= self.max_followers:
                        del counts[min(counts, key=counts.__getitem__)]   # first minimum: the oldest
                counts[tok] = counts.pop(tok, 0) + 1                      # re-inserted: now most recent

    def match(self, context: Sequence[int], longest: Optional[int] = None) -> tuple[int, Optional[dict[int, int]]]:
        """The longest suffix of `context` (at most `longest` tokens) seen followed by something:
        (its length, {follower: count}), or (0, None) when no suffix of min_window or more matches."""
        top = min(len(context), self.max_window if longest is None else min(longest, self.max_window))
        for k in range(top, self.min_window - 1, -1):
            counts = self._followers.get(tuple(context[len(context) - k:]))
            if counts:
                return k, counts
        return 0, None
