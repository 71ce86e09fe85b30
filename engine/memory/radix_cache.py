"""Token-level radix tree from token-id sequences to the KV slots that hold them.

Requests whose prompts share a prefix share that prefix's KV: a new request matches its prompt
against the tree, locks the matched node and computes only the rest. Each edge holds a run of tokens
and one slot per token; the tree owns the slots of its nodes until it evicts them back to the
allocator. A lock on a node pins the node and all its ancestors, since a running request needs its
whole prefix. Unlocked leaves are evicted least recently used first.

With a window pool (engine/memory/window_pool.py) some of a node's tokens may have had their window slot
freed already (a request frees them as its window moves on, and a request that locks a prefix alone frees
those before its last window): each node counts the tokens still holding one, so that the cache knows how
many window slots evicting would give back. When the window pool is what runs short, an unlocked inner
node gives back its window slots alone and keeps its full ones, which the matches running through it to
a longer prefix still use; a request that recomputed tokens whose window slots were freed gives the
cache its own when it inserts them. SGLang's SWA radix cache does both (its tombstones).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from engine.memory.slots import TokenSlotAllocator

_NO_SLOTS = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("children", "key", "value", "parent", "lock_ref", "last_access", "held")

    def __init__(self, key: tuple[int, ...] = (), value: torch.Tensor = _NO_SLOTS,
                 parent: TreeNode | None = None, last_access: int = 0, held: int = 0):
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token id
        self.key = key
        self.value = value  # int64 slots, one per token of key
        self.parent = parent
        self.lock_ref = 0  # locks held on this node or any descendant
        self.last_access = last_access
        self.held = held  # tokens whose window slot is held (all of them without a window pool)

    def __lt__(self, other: TreeNode) -> bool:  # heap order for eviction: oldest first
        return self.last_access < other.last_access


def _common_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class RadixCache:
    def __init__(self, allocator: TokenSlotAllocator):
        self.allocator = allocator
        self.reset()

    def reset(self) -> None:
        """Forget every node. The slots are not freed: reset the allocator alongside."""
        self._clock = itertools.count(1)  # a counter, not time: deterministic, and later calls always rank newer
        self.root = TreeNode()
        self._evictable = 0
        self._protected = 0
        self._evictable_held = 0

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of token_ids: (its slots, possibly empty; the node ending exactly there)."""
        node, _, values = self._walk(tuple(map(int, token_ids)))
        return (torch.cat(values) if values else _NO_SLOTS.clone()), node

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Insert token_ids with their slots; return how many leading tokens were already cached.

        The tree keeps its own slots for those leading tokens, so slots[:returned] stay the caller's
        (to free unless they are the tree's own, matched earlier); the tree owns slots[returned:].
        """
        key = tuple(map(int, token_ids))
        assert len(key) == len(slots), "one slot per token"
        node, i, _ = self._walk(key)
        self._adopt_windows(node, slots[:i])
        if i < len(key):
            # Copy: the caller's tensor is often a view of a request's row, which gets reused.
            value = slots[i:].to("cpu", torch.int64, copy=True)
            held = self.allocator.count_held(value)
            node.children[key[i]] = TreeNode(key[i:], value, node, next(self._clock), held)
            self._evictable += len(key) - i
            self._evictable_held += held
        return i

    def _adopt_windows(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give the path to `node` the window slots that `slots` (the caller's, for the same tokens) hold
        where the path's own were freed."""
        end = len(slots)
        while node is not self.root:
            moved = self.allocator.adopt_window(node.value, slots[end - len(node.key):end])
            node.held += moved
            if node.lock_ref == 0:
                self._evictable_held += moved
            end -= len(node.key)
            node = node.parent

    def _walk(self, key: tuple[int, ...]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow key down the tree, splitting where it ends or diverges inside an edge, and mark the
        path as used now. Returns the deepest node reached, the tokens matched and their slots."""
        now = next(self._clock)
        node, i, values = self.root, 0, []
        while i < len(key) and (child := node.children.get(key[i])) is not None:
            n = _common_len(child.key, key[i:i + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, i = child, i + n
        return node, i, values

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut node's edge after n tokens; return the new upper node. `node` keeps being the lower part,
        so a caller holding it (and its lock) still holds the same full prefix."""
        upper = TreeNode(node.key[:n], node.value[:n], node.parent, node.last_access,
                         self.allocator.count_held(node.value[:n]))
        upper.lock_ref = node.lock_ref  # the same locks pass through both halves; sizes don't change
        node.held -= upper.held
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                self._evictable_held -= node.held
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "dec_lock_ref without a matching inc_lock_ref"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
                self._evictable_held += node.held
            node = node.parent

    def free_window(self, node: TreeNode, keep: int) -> None:
        """Free the window slots of the path to `node` but its last `keep` tokens', on the nodes no other
        lock than the caller's holds (engine/memory/window_pool.py): its new queries read no further back,
        and no one else reads them. The nodes keep their full slots."""
        path, length = [], 0
        while node is not self.root:
            path.append(node)
            length += len(node.key)
            node = node.parent
        start = 0
        for node in reversed(path):
            cut = min(len(node.key), length - keep - start)
            if cut <= 0:
                return
            if node.lock_ref == 1 and node.held:
                self.allocator.free_window(node.value[:cut])
                node.held = self.allocator.count_held(node.value)   # locked: not among the evictable
            start += len(node.key)

    def evict(self, num_tokens: int, num_held: int = 0) -> int:
        """Free at least num_tokens slots, LRU unlocked leaves first, then num_held window slots, LRU
        unlocked nodes holding any first: a leaf whole, an inner node its window slots alone; as far as
        that many are evictable. Return tokens freed."""
        if num_tokens <= 0 and num_held <= 0:
            return 0
        # Evictions are rare next to matches, so the candidates are gathered here rather than tracked.
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed: list[torch.Tensor] = []
        num_freed = held_freed = 0
        while num_freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            held_freed += node.held
            num_freed += self._remove(node, freed)
            parent = node.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        holding = [n for n in self._nodes() if n.held and n.lock_ref == 0] if held_freed < num_held else []
        heapq.heapify(holding)
        while held_freed < num_held and holding:
            node = heapq.heappop(holding)
            held_freed += node.held
            if node.children:
                self.allocator.free_window(node.value)
                self._evictable_held -= node.held
                node.held = 0
            else:
                num_freed += self._remove(node, freed)
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed

    def _remove(self, leaf: TreeNode, freed: list[torch.Tensor]) -> int:
        """Take an unlocked leaf out of the tree, its slots onto `freed`; return how many."""
        del leaf.parent.children[leaf.key[0]]
        freed.append(leaf.value)
        self._evictable -= len(leaf.key)
        self._evictable_held -= leaf.held
        return len(leaf.key)

    def _nodes(self):
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def evictable_size(self) -> int:
        return self._evictable

    def evictable_held(self) -> int:
        """Window slots the evictable nodes hold (engine/memory/window_pool.py)."""
        return self._evictable_held

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected
