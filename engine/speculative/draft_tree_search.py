"""EAGLE-2-style tree search over a draft model's distributions, shared by the workers whose draft is a
model (STANDALONE, EAGLE, EAGLE3, MTP). The search knows no model: the caller gives the roots' draft
scores and an `expand` function that runs its draft over a batch of frontier nodes.

For every request of the batch at once:
- depth 1: the topk tokens of the root's distribution, scored by log-probability;
- each further depth: one `expand` call forwards the frontier (the topk nodes kept at the last depth);
  every frontier node gets its topk children, scored by its own score plus the child's log-probability,
  and the best topk of those topk * topk children are the next frontier;
- finally every node generated (all children, not only the frontier's) is ranked by score and the best
  num_draft_tokens - 1 are kept. A child never scores above its parent and is deeper, so ranking by
  (score, depth) puts every parent before its children: any best-n set is a tree. Tokens the draft
  cannot propose (score -inf, e.g. outside an FR-Spec map) are never kept.
topk 1 is the chain: argmax drafts, or, for requests given a `Sampler` (sampled requests verified by
rejection sampling), tokens drawn from the draft's processed distribution, returned as draft_probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from engine.request import Request
from engine.sampling import sample_from_probs, target_probs
from engine.speculative.tree import DraftTree
from engine.worker import sampling_row

# Uniform streams for drafted tokens, apart from verification's (0 for bonus draws, 1.. for trials).
DRAFT_STREAM = 1000


@dataclass
class Frontier:
    """One request's nodes to forward in an `expand` call."""
    depth: int             # depth of these nodes: 1 = children of the root
    tokens: list[int]      # one token per node
    parents: list[int]     # per node, its parent's index in this request's previous Frontier; -1 = the root


# expand(frontiers) -> draft scores [sum of len(f.tokens), V] over the target vocabulary, frontier after
# frontier, node after node: logits or log-probs (the search log-softmaxes them), -inf for tokens the
# draft cannot propose. Called steps - 1 times, frontier depths 1, 2, ..., steps - 1.
Expand = Callable[[list[Frontier]], torch.Tensor]
# sampler(depth, scores [V]) -> (token, the distribution it was drawn from [V]); called once per depth, in order.
Sampler = Callable[[int, torch.Tensor], tuple[int, torch.Tensor]]


def search_trees(roots: Sequence[int], root_scores: torch.Tensor, expand: Expand, steps: int, topk: int,
                 num_draft_tokens: int, samplers: Optional[Sequence[Optional[Sampler]]] = None) -> list[DraftTree]:
    """A tree of at most num_draft_tokens nodes per request, rooted at roots[b], from the root's draft
    scores root_scores[b] ([B, V], same conventions as `expand`'s result)."""
    B, V = root_scores.shape
    k = min(topk, V)
    samplers = list(samplers) if samplers is not None else [None] * B
    assert k == 1 or not any(samplers), "sampled drafts are chains (topk 1)"
    draws: list[list[torch.Tensor]] = [[] for _ in range(B)]
    tokens, scores, parents, depths = [], [], [], []      # per depth: [B, nodes] tensors / ints
    frontier_score = root_scores.new_zeros((B, 1), dtype=torch.float32)
    frontier_index = torch.full((B, 1), -1, dtype=torch.long, device=root_scores.device)  # -1: the root
    frontiers: list[Frontier] = []
    generated = 0
    for depth in range(1, steps + 1):
        raw = root_scores[:, None, :] if depth == 1 else expand(frontiers).view(B, k, V)
        # log_softmax is <= 0 up to rounding; clamping keeps "a child never outscores its parent" exact.
        logp = torch.log_softmax(raw.float(), dim=-1).clamp_max(0.0)
        child_score, child_token = (frontier_score[:, :, None] + logp).topk(k, dim=-1)     # [B, f, k]
        for b, sampler in enumerate(samplers):
            if sampler is not None:
                tok, q = sampler(depth, raw[b, 0])
                draws[b].append(q)
                child_token[b, 0, 0] = tok
                child_score[b, 0, 0] = frontier_score[b, 0] + logp[b, 0, tok]
        child_score, child_token = child_score.flatten(1), child_token.flatten(1)          # [B, f * k]
        tokens.append(child_token)
        scores.append(child_score)
        parents.append(frontier_index.repeat_interleave(k, dim=1))
        depths += [depth] * child_token.shape[1]
        frontier_score, pick = child_score.topk(k, dim=-1)
        frontier_index = generated + pick
        generated += child_token.shape[1]
        kept_tokens = child_token.gather(1, pick).tolist()
        from_parent = (pick // k).tolist() if depth > 1 else [[-1] * k] * B
        frontiers = [Frontier(depth, kept_tokens[b], from_parent[b]) for b in range(B)]

    all_tokens = torch.cat(tokens, 1).tolist()
    all_scores = torch.cat(scores, 1).tolist()
    all_parents = torch.cat(parents, 1).tolist()
    trees = []
    for b in range(B):
        ranked = sorted((i for i, s in enumerate(all_scores[b]) if s != float("-inf")),
                        key=lambda i: (-all_scores[b][i], depths[i], i))
        # Parents before children, siblings (and cousins) best first.
        keep = sorted(ranked[:num_draft_tokens - 1], key=lambda i: (depths[i], -all_scores[b][i], i))
        index = {-1: 0, **{node: n for n, node in enumerate(keep, start=1)}}
        probs = torch.stack([draws[b][depths[i] - 1] for i in keep]).cpu() if draws[b] and keep else None
        trees.append(DraftTree([roots[b]] + [all_tokens[b][i] for i in keep],
                               [-1] + [index[all_parents[b][i]] for i in keep], probs))
    return trees


def chain_sampler(req: Request, eos_ids: Sequence[int]) -> Sampler:
    """Draws a request's chain drafts from the distribution its sampling parameters make of the draft's
    scores (temperature, top-k/p, min-p and penalties, as verification processes the target's), with
    uniforms of the request's own, so rejection sampling can use p/q."""
    base, drafted = len(req.output_ids), []

    def draw(depth: int, scores: torch.Tensor) -> tuple[int, torch.Tensor]:
        q = target_probs(scores[None].float().cpu(), [sampling_row(req, eos_ids, drafted)])[0]
        tok = int(sample_from_probs(q[None], [req.uniform(base + depth - 1, DRAFT_STREAM + depth)])[0])
        drafted.append(tok)
        return tok, q

    return draw


def chain_samplers(reqs: Sequence[Request], eos_ids: Sequence[int], enabled: bool) -> list[Optional[Sampler]]:
    """Samplers for the sampled requests when `enabled` (chains verified by rejection sampling); greedy
    requests, and every request otherwise, draft by argmax."""
    return [chain_sampler(r, eos_ids) if enabled and not r.params.greedy else None for r in reqs]
