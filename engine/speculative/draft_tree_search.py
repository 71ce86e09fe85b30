"""EAGLE-2-style tree search over a draft model's distributions, for a whole batch at once on the device;
shared by the drafters that run a model (STANDALONE, EAGLE, EAGLE3, MTP). The search knows no model: the
caller gives the roots' draft scores and an `expand` function that runs its draft over a frontier.

For every request at once:
- depth 1: the topk tokens of the root's distribution, scored by log-probability;
- each further depth: one `expand` call forwards the frontier (the topk nodes kept at the last depth);
  every frontier node gets its topk children, scored by its own score plus the child's log-probability,
  and the best topk of those topk * topk children are the next frontier;
- finally every node generated (all children, not only the frontier's) is ranked by score and the best
  num_draft_tokens - 1 are kept. A child never scores above its parent and is generated after it, so a
  stable ranking by score puts every parent before its children: any best-n set is a tree. Every tree
  has the same size; a node the draft cannot propose (score -inf, outside an FR-Spec map) may fill a
  slot when too few can, and verification is exact whatever the drafts.
topk 1 is the chain: argmax drafts, or, for rows a `draw` function picks (sampled requests verified by
rejection sampling), tokens drawn from the draft's processed distribution, returned as draft_probs.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from engine.speculative.tree import TreeBatch
from engine.core.to_device import to_device

# expand(depth, tokens [B, k], parents [B, k]) -> draft scores [B, k, V] over the target vocabulary:
# feeds the frontier at `depth` (its parents' indices in the previous frontier; 0 at depth 1, the root).
# Logits or log-probs (the search log-softmaxes them), -inf for tokens the draft cannot propose.
Expand = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# draw(depth, scores [B, V]) -> (tokens [B], their distributions [B, V], rows that drew [B] bool).
Draw = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def top_k(x: torch.Tensor, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k) over the last dimension, up to the order of equal values. The k largest lie in the k
    blocks with the largest maxima, so only those are ranked: on a CPU topk over a whole vocabulary is a
    partial sort of every logit, where one pass for the block maxima and a sort of k blocks cost a
    fraction of it."""
    V = x.shape[-1]
    if V < 16 * block or k > V // block or x.device.type != "cpu":
        return x.topk(k, dim=-1)
    if V % block:
        x = torch.nn.functional.pad(x, (0, block - V % block), value=float("-inf"))
    blocks = x.unflatten(-1, (-1, block))                                           # [..., V / block, block]
    best = blocks.amax(-1).topk(k, dim=-1).indices                                  # [..., k]
    values, at = blocks.gather(-2, best[..., None].expand(*best.shape, block)).flatten(-2).topk(k, dim=-1)
    return values, best.gather(-1, at // block) * block + at % block


def search_trees(roots: torch.Tensor, root_scores: torch.Tensor, expand: Expand, steps: int, topk: int,
                 num_draft_tokens: int, draw: Optional[Draw] = None,
                 budgets: Optional[Sequence[int]] = None) -> TreeBatch:
    """Trees of num_draft_tokens nodes rooted at roots [B], from the roots' draft scores [B, V]; with
    `budgets`, tree b keeps its budgets[b] best drafts only (a child never scores above its parent, so
    they hold their ancestors)."""
    B, V = root_scores.shape
    device = root_scores.device
    k = min(topk, V)
    assert k == 1 or draw is None, "sampled drafts are chains (topk 1)"
    tokens, scores, parents, depths, drawn = [], [], [], [], []
    frontier_score = torch.zeros((B, 1), device=device)
    frontier_index = torch.full((B, 1), -1, dtype=torch.long, device=device)      # -1: the root
    frontier_tokens, from_parent = None, torch.zeros((B, 1), dtype=torch.long, device=device)
    generated = 0
    for depth in range(1, steps + 1):
        raw = root_scores[:, None, :] if depth == 1 else expand(depth - 1, frontier_tokens, from_parent)
        # log_softmax is <= 0 up to rounding; clamping keeps "a child never outscores its parent" exact.
        logp = torch.log_softmax(raw.float(), dim=-1).clamp_max(0.0)
        child_logp, child_token = top_k(logp, k)                    # the order of frontier_score + logp
        child_score = frontier_score[:, :, None] + child_logp                               # [B, f, k]
        if draw is not None:
            tok, q, drew = draw(depth, raw[:, 0])
            drawn.append(torch.where(drew[:, None], q, 0.0))
            child_token[:, 0, 0] = torch.where(drew, tok, child_token[:, 0, 0])
            child_score[:, 0, 0] = frontier_score[:, 0] + logp[:, 0].gather(1, child_token[:, 0, :1]).squeeze(1)
        child_score, child_token = child_score.flatten(1), child_token.flatten(1)          # [B, f * k]
        tokens.append(child_token)
        scores.append(child_score)
        parents.append(frontier_index.repeat_interleave(k, dim=1))
        depths += [depth] * child_token.shape[1]
        frontier_score, pick = child_score.topk(k, dim=-1)
        frontier_index = generated + pick
        generated += child_token.shape[1]
        frontier_tokens = child_token.gather(1, pick)
        from_parent = pick // k

    all_tokens, all_scores, all_parents = torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1)
    n = num_draft_tokens - 1
    ranked = all_scores.sort(dim=1, descending=True, stable=True).indices[:, :n]          # [B, n]
    # Parents before children, siblings (and cousins) best first: by depth, then rank; drafts past a
    # tree's budget after all of them.
    depth_of = to_device(depths, device)
    order = depth_of[ranked] * n + torch.arange(n, device=device)
    cut = None
    if budgets is not None:
        cut = torch.arange(n, device=device)[None, :] >= to_device(list(budgets), device)[:, None]
        order = order + cut * (steps + 1) * n
    order = order.argsort(dim=1)
    keep = ranked.gather(1, order)
    new_index = torch.zeros((B, generated), dtype=torch.long, device=device)
    new_index.scatter_(1, keep, torch.arange(1, n + 1, device=device).expand(B, n))
    kept_parents = all_parents.gather(1, keep)
    kept_parents = torch.where(kept_parents < 0, 0, new_index.gather(1, kept_parents.clamp(min=0)))
    draft_probs = None
    if drawn:
        draft_probs = torch.stack([torch.zeros_like(drawn[0])] + drawn, 1)                # chains: node i = depth i
    kept_tokens = all_tokens.gather(1, keep)
    if cut is not None:                 # sorted last: the cut drafts become padding
        kept_tokens = kept_tokens.masked_fill(cut, 0)
        kept_parents = kept_parents.masked_fill(cut, -1)
    return TreeBatch(torch.cat([roots[:, None], kept_tokens], 1),
                     torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=device), kept_parents], 1),
                     [n + 1] * B if budgets is None else [min(n, b) + 1 for b in budgets], k == 1, min(steps, n), k,
                     draft_probs)
