"""SpeculativeWorker: draft a tree per request, verify all trees in one target forward, commit.

Subclasses implement `draft` (and, when they keep state, `after_prefill`, `after_verify`, `release`).
Everything that decides which tokens come out lives here and in verify.py, shared by all algorithms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.config import ServerArgs
from engine.model_runner import ForwardItem, ForwardOutput, ModelRunner
from engine.request import Request
from engine.sampling import Row, adjust_logits, target_probs
from engine.speculative.tree import DraftTree
from engine.speculative.verify import verify_greedy, verify_rejection, verify_tree_sampling
from engine.worker import PlainWorker


@dataclass
class SpecStats:
    """Engine-wide acceptance figures."""
    steps: int                                   # draft depth, for per-position acceptance
    verify_ct: int = 0
    tokens: int = 0                              # tokens produced by verification (accepted + bonus)
    accepted_at_depth: list[int] = field(default_factory=list)   # [d]: verifies that accepted >= d+1 drafts

    def __post_init__(self):
        self.accepted_at_depth = [0] * self.steps

    def record(self, accepted: int) -> None:
        self.verify_ct += 1
        self.tokens += accepted + 1
        for d in range(min(accepted, self.steps)):
            self.accepted_at_depth[d] += 1

    def summary(self) -> dict:
        n = max(self.verify_ct, 1)
        return {
            "spec_verify_ct": self.verify_ct,
            "avg_spec_accept_length": self.tokens / n if self.verify_ct else None,
            # share of the draft depth accepted per step
            "spec_accept_rate": (self.tokens - self.verify_ct) / (n * self.steps) if self.verify_ct else None,
            "spec_accept_by_position": [c / n for c in self.accepted_at_depth],
        }


@dataclass
class Verified:
    """One request's verification result, handed to `after_verify`."""
    tree: DraftTree
    path: list[int]              # accepted node indices, root first
    bonus: int
    hidden_offset: int           # where this request's nodes start in the forward's hidden states


class SpeculativeWorker(PlainWorker):
    def __init__(self, runner: ModelRunner, eos_ids: Sequence[int], args: ServerArgs):
        super().__init__(runner, eos_ids)
        self.args = args
        self.steps, self.topk, self.num_draft_tokens = args.speculative_tree
        self.slots_per_request = self.num_draft_tokens
        self.stats = SpecStats(self.steps)

    # ------------------------------------------------------------------ to implement
    def draft(self, reqs: Sequence[Request]) -> list[DraftTree]:
        """A tree of at most num_draft_tokens nodes per request, rooted at its last token."""
        raise NotImplementedError

    def after_verify(self, reqs: Sequence[Request], results: list[Verified], out: ForwardOutput) -> None:
        """Update draft state with what was accepted (runs before the tokens are appended)."""

    # ------------------------------------------------------------------ the step
    def decode(self, reqs: Sequence[Request]) -> list[list[int]]:
        trees = self.draft(reqs)
        sizes = [len(t) for t in trees]
        slots = self.runner.allocator.alloc(sum(sizes))
        assert slots is not None, "the scheduler reserves slots_per_request slots per request"
        items = [ForwardItem(r.row, r.kv_len, t.tokens, [r.kv_len + d for d in t.depths],
                             None if t.is_chain else t.mask()) for r, t in zip(reqs, trees)]
        out = self.runner.forward(items, slots, torch.arange(sum(sizes)), self.capture_hidden)

        results, new_tokens, offset = [], [], 0
        table = self.runner.req_to_token.table
        for req, tree, n in zip(reqs, trees, sizes):
            path, bonus = self._verify(req, tree, out.logits[offset:offset + n])
            node_slots = slots[offset:offset + n]
            kept = torch.zeros(n, dtype=torch.bool)
            kept[path] = True
            # Rollback is freeing: accepted nodes' slots take their positions, the rest go back now.
            table[req.row, req.kv_len:req.kv_len + len(path)] = node_slots[path]
            self.runner.allocator.free(node_slots[~kept])
            req.kv_len += len(path)
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += len(path) - 1
            self.stats.record(len(path) - 1)
            results.append(Verified(tree, path, bonus, offset))
            new_tokens.append([tree.tokens[i] for i in path[1:]] + [bonus])
            offset += n
        self.after_verify(reqs, results, out)
        return new_tokens

    def _verify(self, req: Request, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
        # Each node's distribution is conditioned on the path to it (penalties count those tokens).
        rows = [Row(req.params, req.prompt_ids, req.output_ids + [tree.tokens[j] for j in tree.path_to(i)[1:]],
                    self.eos_ids) for i in range(len(tree))]
        if req.params.greedy:
            return verify_greedy(tree, adjust_logits(logits, rows).argmax(-1).tolist())
        probs = target_probs(logits, rows)
        base = len(req.output_ids)

        def uniform(depth: int, stream: int) -> float:
            return req.uniform(base + depth, stream)

        if tree.draft_probs is not None and tree.is_chain and self.use_rejection:
            return verify_rejection(tree, probs, uniform)
        return verify_tree_sampling(tree, probs, uniform)

    @property
    def use_rejection(self) -> bool:
        mode = self.args.speculative_sampling
        return mode == "rejection" or (mode == "auto" and self.topk == 1)
