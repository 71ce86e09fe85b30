"""Verification: which draft tokens the target accepts, and the token it adds after them.

Every rule here keeps the output exactly the target's:
- greedy: follow the child whose token is the target's argmax; the first miss gives the bonus token.
- tree sampling (SGLang's, drafts treated as deterministic): at each node try the children in order,
  accepting child c with probability p(c) under the current residual p; a rejected child's token gets
  probability 0 and p is renormalised. If no child is accepted, the bonus is drawn from the residual.
  The chance that token x comes out is p(x) whatever the draft, so the output follows p exactly.
- rejection sampling (chains with draft probabilities q): accept with min(1, p/q); on rejection draw
  from max(0, p - q) normalised (Leviathan et al., Chen et al.).
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.sampling import sample_from_probs
from engine.speculative.tree import DraftTree

# uniform(position_in_path, stream) -> a uniform in [0, 1); streams > 0 are acceptance trials.
Uniform = Callable[[int, int], float]


def verify_greedy(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    """argmax[i] is the target's choice after node i. Returns (accepted path from the root, bonus)."""
    node, path = 0, [0]
    while True:
        want = argmax[node]
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def verify_tree_sampling(tree: DraftTree, probs: torch.Tensor, uniform: Uniform) -> tuple[list[int], int]:
    """probs[i]: the target's distribution after node i (temperature and truncation applied)."""
    node, path = 0, [0]
    while True:
        p = probs[node].double().clone()
        accepted = None
        for trial, child in enumerate(tree.children[node], start=1):
            tok = tree.tokens[child]
            total = float(p.sum())
            if total <= 0:
                break
            if uniform(len(path) - 1, trial) * total < float(p[tok]):
                accepted = child
                break
            p[tok] = 0.0
        if accepted is None:
            return path, _draw(p, uniform(len(path) - 1, 0))
        path.append(accepted)
        node = accepted


def verify_rejection(tree: DraftTree, probs: torch.Tensor, uniform: Uniform) -> tuple[list[int], int]:
    """Chains only; tree.draft_probs[i - 1] is q for node i's token."""
    assert tree.is_chain and tree.draft_probs is not None
    path = [0]
    for node in range(1, len(tree)):
        p, q = probs[node - 1].double(), tree.draft_probs[node - 1].double()
        tok = tree.tokens[node]
        if q[tok] > 0 and uniform(node - 1, 1) * float(q[tok]) < float(p[tok]):
            path.append(node)
            continue
        residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0:      # p == q up to rounding: any draw from p is right
            residual = p
        return path, _draw(residual, uniform(node - 1, 0))
    return path, _draw(probs[len(tree) - 1].double(), uniform(len(tree) - 1, 0))


def _draw(p: torch.Tensor, u: float) -> int:
    return int(sample_from_probs((p / p.sum())[None], [u])[0])
