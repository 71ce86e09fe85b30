"""Draft trees: the tokens one step proposes, rooted at each request's newest token.

Node 0 is the root: the request's newest token, already chosen but not yet in the KV cache. Every other
node is a draft token whose parent comes before it; siblings come best first. Verification feeds all
nodes in one forward, each seeing the cached prefix and its own ancestors, at position prefix + depth.

`DraftTree` is one request's tree as host lists (n-gram drafting builds them); `TreeBatch` is a whole
step's trees as padded device tensors, what drafting with a model produces and verification reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from engine.core.to_device import to_device


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]                      # parent index per node; -1 for the root

    def __post_init__(self):
        assert self.parents and self.parents[0] == -1, "node 0 is the root"
        assert all(0 <= p < i for i, p in enumerate(self.parents[1:], start=1)), "a parent precedes its children"

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> "DraftTree":
        return cls([root] + list(drafts), list(range(-1, len(drafts))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def depths(self) -> list[int]:
        depths = [0]
        for p in self.parents[1:]:
            depths.append(depths[p] + 1)
        return depths

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @property
    def max_children(self) -> int:
        counts = [0] * len(self.tokens)
        for p in self.parents[1:]:
            counts[p] += 1
        return max(counts)


@dataclass
class TreeBatch:
    tokens: torch.Tensor                    # [B, N] token per node (0 past a tree's size)
    parents: torch.Tensor                   # [B, N] parent per node; -1 for roots and padding
    sizes: list[int]                        # nodes per tree, root included
    is_chain: bool                          # every tree is a chain (node i's parent is i - 1)
    max_depth: int                          # deepest node's depth (host bounds: no device sync)
    max_children: int                       # most children of one node
    # For rejection sampling on chains: the distribution each node's token was drawn from, [B, N, V]
    # (row 0 unused); None when drafts are deterministic (greedy drafting, n-grams).
    draft_probs: Optional[torch.Tensor] = None
    _ancestors: Optional[torch.Tensor] = field(default=None, repr=False)
    _valid: Optional[torch.Tensor] = field(default=None, repr=False)

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree], device) -> "TreeBatch":
        n = max(len(t) for t in trees)
        if n == 1:                          # nothing drafted: a plain step's trees, without the host loop
            return cls.roots(to_device([t.tokens[0] for t in trees], device, torch.long))
        tokens = torch.zeros((len(trees), n), dtype=torch.long)
        parents = torch.full((len(trees), n), -1, dtype=torch.long)
        for b, t in enumerate(trees):
            tokens[b, :len(t)] = torch.tensor(t.tokens)
            parents[b, :len(t)] = torch.tensor(t.parents)
        return cls(to_device(tokens, device), to_device(parents, device), [len(t) for t in trees],
                   all(t.is_chain for t in trees), max(max(t.depths) for t in trees), max(t.max_children for t in trees))

    def with_chains(self, chains: Sequence[Sequence[int]]) -> "TreeBatch":
        """These trees with chains[b] grown from request b's root after its nodes: node sizes[b] holds
        the chain's first token, each next node the following one as its child (Predicted Outputs
        beside a drafter's tree). Drafted probabilities are dropped: the chains are deterministic drafts."""
        sizes = [n + len(c) for n, c in zip(self.sizes, chains)]
        width = max(max(sizes), self.width)
        rows = [b for b, c in enumerate(chains) for _ in c]
        cols = [n + j for n, c in zip(self.sizes, chains) for j in range(len(c))]
        parents = [0 if j == 0 else n + j - 1 for n, c in zip(self.sizes, chains) for j in range(len(c))]
        pad = (0, width - self.width)
        tokens = torch.nn.functional.pad(self.tokens, pad)
        parent = torch.nn.functional.pad(self.parents, pad, value=-1)
        device = tokens.device
        tokens[rows, cols] = to_device([t for c in chains for t in c], device, torch.long)
        parent[rows, cols] = to_device(parents, device, torch.long)
        chain = self.is_chain and all(n == 1 for n, c in zip(self.sizes, chains) if c)
        return TreeBatch(tokens, parent, sizes, chain, max(self.max_depth, max(map(len, chains))),
                         self.max_children + 1)

    def spread(self, at: Sequence[int], roots: torch.Tensor) -> "TreeBatch":
        """These trees, of requests `at` of a batch, in the whole batch of roots [B]: the other requests'
        trees are their roots alone."""
        B, device = roots.shape[0], self.tokens.device
        index = to_device(list(at), device)
        tokens = torch.zeros((B, self.width), dtype=self.tokens.dtype, device=device)
        tokens[:, 0] = roots
        tokens[index] = self.tokens
        parents = torch.full((B, self.width), -1, dtype=self.parents.dtype, device=device)
        parents[index] = self.parents
        sizes = [1] * B
        for i, b in enumerate(at):
            sizes[b] = self.sizes[i]
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs.new_zeros((B, *self.draft_probs.shape[1:]))
            probs[index] = self.draft_probs
        return TreeBatch(tokens, parents, sizes, self.is_chain, self.max_depth, self.max_children, probs)

    @classmethod
    def roots(cls, roots: torch.Tensor) -> "TreeBatch":
        """Root-only trees: plain decoding is verification of an empty draft."""
        return cls(roots[:, None], torch.full_like(roots[:, None], -1), [1] * roots.shape[0], True, 0, 0)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """[B, N] bool: the node exists."""
        if self._valid is None:
            sizes = to_device(self.sizes, self.tokens.device)
            self._valid = torch.arange(self.width, device=self.tokens.device)[None, :] < sizes[:, None]
        return self._valid

    @property
    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: node i sees node j (j is i or one of its ancestors). Built by propagating
        one level per pass, so a tree of depth D takes D passes."""
        if self._ancestors is None:
            B, N = self.tokens.shape
            eye = torch.eye(N, dtype=torch.bool, device=self.tokens.device).expand(B, N, N)
            if self.is_chain:
                self._ancestors = eye.new_ones((N, N)).tril() & self.valid[:, None, :]
            else:
                has_parent = (self.parents >= 0)[:, :, None]
                index = self.parents.clamp(min=0)[:, :, None].expand(B, N, N)
                anc = eye
                for _ in range(self.max_depth):
                    anc = eye | (anc.gather(1, index) & has_parent)
                self._ancestors = anc
        return self._ancestors

    @property
    def depth(self) -> torch.Tensor:
        """[B, N] depth below the root (0 for roots and padding)."""
        if self.is_chain:
            return torch.arange(self.width, device=self.tokens.device).expand(self.batch_size, -1) * self.valid
        return self.ancestors.sum(-1) - 1
