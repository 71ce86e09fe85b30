"""Drafter: what a speculative algorithm adds to a step. The worker asks it for trees before verifying
them and tells it what the target committed; it allocates nothing (its scratch KV slots come with
the step) and never changes a request."""

from __future__ import annotations

from typing import Optional, Sequence

from engine.core.model_runner import ForwardOutput
from engine.core.request import Request
from engine.speculative.tree import TreeBatch
from engine.core.step import DecodeStep, PrefillStep


class Drafter:
    scratch_slots = 0                    # KV slots per request per decode step besides the tree's
    capture_hidden: tuple[int, ...] = ()   # target hidden states it reads
    # A request left without drafts is caught up later, at a cost (a draft model fed the tokens it
    # skipped): its forwards are timed at start-up to price that.
    catches_up = False

    def set_tree(self, tree: tuple[int, int, int], sampling: str) -> None:
        """Draft trees of (steps, topk, num_draft_tokens) from now on, for verification of unseeded sampled
        requests by rule `sampling` (speculative/verify.py)."""
        self.steps, self.topk, self.num_draft_tokens = tree

    def draft(self, step: DecodeStep) -> TreeBatch:
        """Trees rooted at each request's newest token, of at most budgets(step)[b] + 1 nodes."""
        raise NotImplementedError

    def budgets(self, step: DecodeStep) -> list[int]:
        """Per request, the most draft tokens its tree may hold this step (step.drafts, else the tree's)."""
        return step.drafts if step.drafts is not None else [self.num_draft_tokens - 1] * len(step.reqs)

    def evidence(self, req: Request) -> Optional[int]:
        """What this step's draft for the request rests on, where the drafter knows it before drafting: a
        key under which drafts are accepted alike (the planner keeps an acceptance estimate per key);
        0: there is nothing to draft; None: no such key (the request's own estimate serves)."""
        return None

    def lag(self, req: Request) -> int:
        """Committed tokens of the request this drafter skipped, which drafting for it next feeds first."""
        return 0

    def after_prefill(self, step: PrefillStep, out: ForwardOutput, next_tokens: Sequence[int]) -> None:
        """The target fed these prompt pieces; next_tokens[i] follows piece i (the next prompt token or
        the sampled first output)."""

    def after_verify(self, step: DecodeStep, out: ForwardOutput, sizes: Sequence[int],
                     paths: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> None:
        """The target verified the trees (sizes[b] nodes of request b, node after node in `out`) and
        accepted the nodes paths[b] (root first); tokens[b] came out: the accepted drafts, then the bonus."""

    def release(self, req: Request) -> None:
        """The request stopped running (finished or retracted)."""
