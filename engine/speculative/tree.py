"""DraftTree: the tokens one step proposes for one request, as a tree rooted at the last real token.

Node 0 is the root: the request's newest token, already chosen but not yet in the KV cache. Every other
node is a draft token whose parent comes before it. Verification feeds all nodes in one forward, each
seeing the cached prefix and its own ancestors (`mask`) at position prefix + depth (`depths`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]                      # parent index per node; -1 for the root
    # For rejection sampling on chains: the draft distribution each non-root node's token was drawn
    # from, [len(tokens) - 1, V]; None when drafts are deterministic (greedy drafting, n-grams).
    draft_probs: Optional[torch.Tensor] = None
    depths: list[int] = field(init=False)
    children: list[list[int]] = field(init=False)

    def __post_init__(self):
        assert self.parents and self.parents[0] == -1, "node 0 is the root"
        self.depths, self.children = [0], [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            assert 0 <= p < i, "a parent precedes its children"
            self.depths.append(self.depths[p] + 1)
            self.children[p].append(i)

    @classmethod
    def chain(cls, root: int, drafts: list[int], draft_probs: Optional[torch.Tensor] = None) -> "DraftTree":
        return cls([root] + list(drafts), list(range(-1, len(drafts))), draft_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    def mask(self) -> torch.Tensor:
        """[n, n] bool: node i may attend to node j when j is i or one of its ancestors."""
        n = len(self.tokens)
        m = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            m[i] |= m[self.parents[i]]
        return m

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @classmethod
    def from_paths(cls, root: int, paths: list[list[int]], limit: int) -> "DraftTree":
        """Merge token paths (best first) into a prefix tree of at most `limit` nodes, root included.
        Sibling order follows the order paths were given in."""
        tokens, parents = [root], [-1]
        index: dict[tuple[int, int], int] = {}
        for path in paths:
            node = 0
            for tok in path:
                child = index.get((node, tok))
                if child is None:
                    if len(tokens) >= limit:
                        break
                    child = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    index[(node, tok)] = child
                node = child
        return cls(tokens, parents)
