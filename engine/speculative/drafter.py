"""Drafter: what a speculative algorithm adds to a step. The worker asks it for trees before verifying
them and tells it what the target committed; it allocates nothing (its scratch KV slots come with
the step) and never changes a request."""

from __future__ import annotations

from typing import Sequence

from engine.model_runner import ForwardOutput
from engine.request import Request
from engine.speculative.tree import TreeBatch
from engine.step import DecodeStep, PrefillStep


class Drafter:
    scratch_slots = 0                    # KV slots per request per decode step besides the tree's
    capture_hidden: tuple[int, ...] = ()   # target hidden states it reads

    def set_tree(self, tree: tuple[int, int, int], sampling: str) -> None:
        """Draft trees of (steps, topk, num_draft_tokens) from now on, for verification of unseeded sampled
        requests by rule `sampling` (speculative/verify.py)."""
        self.steps, self.topk, self.num_draft_tokens = tree

    def draft(self, step: DecodeStep) -> TreeBatch:
        """Trees of at most num_draft_tokens nodes rooted at each request's newest token."""
        raise NotImplementedError

    def after_prefill(self, step: PrefillStep, out: ForwardOutput, next_tokens: Sequence[int]) -> None:
        """The target fed these prompt pieces; next_tokens[i] follows piece i (the next prompt token or
        the sampled first output)."""

    def after_verify(self, step: DecodeStep, out: ForwardOutput, sizes: Sequence[int],
                     paths: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> None:
        """The target verified the trees (sizes[b] nodes of request b, node after node in `out`) and
        accepted the nodes paths[b] (root first); tokens[b] came out: the accepted drafts, then the bonus."""

    def release(self, req: Request) -> None:
        """The request stopped running (finished or retracted)."""
