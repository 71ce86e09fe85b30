"""Verification: which draft tokens the target accepts, and the token it adds after them, for a whole
batch of trees at once on the device. Every rule keeps the output exactly the target's:
- greedy: follow the child whose token is the target's argmax; the first miss gives the bonus token.
- coupled (sampled requests, by default): every node draws the target's token at its output position
  as plain decoding would there (SamplingBatch.sample: the same distribution, seed and position give the
  same token), and the greedy rule follows those draws. The output is then plain decoding's, token for
  token, whatever the drafts; a draft is accepted with probability p(draft) (a drafter that samples with
  the same keys, coupled with the target's draw, more often).
- tree sampling (SGLang's, drafts treated as deterministic): at each node try the children in order,
  accepting child c with probability p(c) under the current residual p; a rejected child's token gets
  probability 0 and p is renormalised. If no child is accepted, the bonus is drawn from the residual.
  The chance that token x comes out is p(x) whatever the draft, so the output follows p exactly.
- rejection sampling (chains with draft probabilities q): accept with min(1, p/q); on rejection draw
  from max(0, p - q) normalised (Leviathan et al., Chen et al.).
Tree and rejection sampling are exact in distribution but not reproducible: which uniforms they read
depends on the drafts. Plain decoding is the same call on root-only trees: the "bonus" is the sampled
token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.core.sampling import SamplingBatch, sample_from_probs
from engine.speculative.tree import TreeBatch
from engine.core.to_device import to_device
from spec_kernels.cpu_argmax import argmax


@dataclass
class Accepted:
    index: torch.Tensor      # [B, D + 1] accepted node indices, root first, 0-padded past `length`
    length: torch.Tensor     # [B] accepted nodes, root included (>= 1)
    bonus: torch.Tensor      # [B] the target's token after the last accepted node


# How a request's sampled rows are checked (greedy rows always by the greedy rule).
RULES = ("coupled", "tree", "rejection")


def sampling_rule(req, unseeded: str) -> str:
    """The rule for request `req`: coupled when it gave a seed (a seed promises the same tokens under
    every algorithm), else `unseeded` (--speculative-sampling)."""
    return "coupled" if req.params.seed is not None else unseeded


def verify(tree: TreeBatch, logits: torch.Tensor, sb: SamplingBatch, rules: Sequence[str]) -> Accepted:
    """logits [T, V]: the target's, node after node, tree after tree (T = sum(tree.sizes));
    `sb` has one row per node; rules[b] (RULES): how request b's sampled rows are checked; rejection
    needs tree.draft_probs, tree sampling stands in without them."""
    if tree.width == 1:                 # root-only trees: the bonus is the sampled token
        zeros = torch.zeros((tree.batch_size, 1), dtype=torch.long, device=logits.device)
        return Accepted(zeros, zeros[:, 0] + 1, sb.sample(logits))
    node_row = _node_rows(tree)
    if sb.all_greedy:
        return _greedy(tree, argmax(sb.adjust(logits))[node_row])
    probs = sb.probs(logits)
    if tree.draft_probs is None:
        rules = ["tree" if r == "rejection" else r for r in rules]
    checks = {"coupled": lambda: _greedy(tree, sb.sample(logits, probs)[node_row]),
              "tree": lambda: _tree_sampling(tree, probs, node_row, sb),
              "rejection": lambda: _rejection(tree, probs, node_row, sb)}
    out = None
    for rule in RULES:                  # each rule's acceptance, computed for the batch where used
        use = [r == rule for r in rules]
        if any(use):
            got = checks[rule]()
            out = got if out is None else _select(use, got, out)
    return out


def _select(use: Sequence[bool], a: Accepted, b: Accepted) -> Accepted:
    """Per request, a where use[b] else b."""
    pick = to_device(list(use), a.length.device)
    width = max(a.index.shape[1], b.index.shape[1])
    return Accepted(torch.where(pick[:, None], _pad(a.index, width), _pad(b.index, width)),
                    torch.where(pick, a.length, b.length), torch.where(pick, a.bonus, b.bonus))


def _node_rows(tree: TreeBatch) -> torch.Tensor:
    """[B, N] row of each node in the flat logits (clamped for padding, which is never read as valid)."""
    sizes = to_device(tree.sizes, tree.tokens.device)
    starts = sizes.cumsum(0) - sizes
    return (starts[:, None] + torch.arange(tree.width, device=sizes.device)[None, :]).clamp(max=int(sum(tree.sizes)) - 1)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _path(tree: TreeBatch, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Node indices from the root down to `last` [B] (ancestors precede descendants), and their count."""
    on_path = tree.ancestors.gather(1, last[:, None, None].expand(-1, 1, tree.width)).squeeze(1)   # [B, N]
    length = on_path.sum(1)
    arange = torch.arange(tree.width, device=last.device)
    index = torch.where(on_path, arange, tree.width).sort(1).values[:, :tree.max_depth + 1]
    return torch.where(index < tree.width, index, 0), length


def _greedy(tree: TreeBatch, choice: torch.Tensor) -> Accepted:
    """choice [B, N]: the target's argmax after each node."""
    after_parent = choice.gather(1, tree.parents.clamp(min=0))
    correct = (tree.tokens == after_parent) & tree.valid
    correct[:, 0] = True
    # A node is accepted when it and all its ancestors are. Siblings with different tokens leave one
    # accepted path; a prediction's chain beside a drafter's tree may repeat a sibling's token, so the
    # deepest accepted node ends the path (the first of equals).
    accepted = ~(tree.ancestors & ~correct[:, None, :]).any(-1) & tree.valid
    N = tree.width
    rank = tree.depth * N + (N - 1 - torch.arange(N, device=choice.device))
    last = N - 1 - torch.where(accepted, rank, -1).max(1).values % N
    index, length = _path(tree, last)
    return Accepted(index, length, choice.gather(1, last[:, None]).squeeze(1))


def _tree_sampling(tree: TreeBatch, probs: torch.Tensor, node_row: torch.Tensor, sb: SamplingBatch) -> Accepted:
    B, N = tree.tokens.shape
    device = probs.device
    arange = torch.arange(N, device=device)
    valid = tree.valid
    cur = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    bonus = torch.zeros(B, dtype=torch.long, device=device)
    depth_max = tree.max_depth
    index = torch.zeros((B, depth_max + 1), dtype=torch.long, device=device)
    length = torch.ones(B, dtype=torch.long, device=device)
    trials = tree.max_children         # a bound on the trials per depth, known on the host
    for depth in range(depth_max + 1):
        p = probs[node_row.gather(1, cur[:, None]).squeeze(1)].double()       # residual at each row's node
        remaining = valid & (tree.parents == cur[:, None]) & ~done[:, None]
        accepted = torch.full((B,), -1, dtype=torch.long, device=device)
        at_depth = torch.full((B,), depth, dtype=torch.long, device=device)
        for trial in range(1, trials + 1):
            trying = remaining.any(1) & (accepted < 0)
            child = torch.where(remaining, arange, N).min(1).values.clamp(max=N - 1)
            tok = tree.tokens.gather(1, child[:, None])
            p_tok = p.gather(1, tok).squeeze(1)
            take = trying & (sb.request_uniforms(at_depth, trial) * p.sum(1) < p_tok)
            accepted = torch.where(take, child, accepted)
            p.scatter_(1, tok, torch.where(trying & ~take, 0.0, p_tok)[:, None])
            remaining &= ~((arange[None, :] == child[:, None]) & trying[:, None])
        stop = ~done & (accepted < 0)
        draw = sample_from_probs(p, sb.request_uniforms(at_depth, 0))
        bonus = torch.where(stop, draw, bonus)
        done |= stop
        moved = ~done
        if depth < depth_max:
            index[:, depth + 1] = torch.where(moved, accepted.clamp(min=0), 0)
        length += moved.long()
        cur = torch.where(moved, accepted, cur)
    return Accepted(index, length, bonus)


def _rejection(tree: TreeBatch, probs: torch.Tensor, node_row: torch.Tensor, sb: SamplingBatch) -> Accepted:
    """Chains only: tree.draft_probs[b, i] is q for node i's token."""
    assert tree.is_chain and tree.draft_probs is not None
    B, N = tree.tokens.shape
    device = probs.device
    q = tree.draft_probs.to(device).double()
    p = probs.double()
    depth = torch.arange(N - 1, device=device).expand(B, -1)
    tok = tree.tokens[:, 1:]
    p_tok = p[node_row[:, :-1]].gather(2, tok[:, :, None]).squeeze(2)            # p at node i-1 of token i
    q_tok = q[:, 1:].gather(2, tok[:, :, None]).squeeze(2)
    u = sb.request_uniforms(depth, 1)
    ok = (q_tok > 0) & (u * q_tok < p_tok) & tree.valid[:, 1:]
    drafted = ok.long().cumprod(1).sum(1)                                         # accepted drafts
    sizes = to_device(tree.sizes, device)
    p_last = p[node_row.gather(1, drafted[:, None]).squeeze(1)]
    q_next = q.gather(1, (drafted + 1).clamp(max=N - 1)[:, None, None].expand(-1, 1, q.shape[-1])).squeeze(1)
    residual = torch.where((drafted + 1 < sizes)[:, None], (p_last - q_next).clamp_min(0.0), p_last)
    # p == q up to rounding: any draw from p is right.
    residual = torch.where((residual.sum(1) > 0)[:, None], residual, p_last)
    bonus = sample_from_probs(residual / residual.sum(1, keepdim=True), sb.request_uniforms(drafted, 0))
    arange = torch.arange(N, device=device)
    index = torch.where(arange[None, :] <= drafted[:, None], arange, 0)
    return Accepted(index, drafted + 1, bonus)
