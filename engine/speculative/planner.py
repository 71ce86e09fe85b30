"""Planner: what each decode step drafts, apart from how a step runs (the worker and drafters).

The scheduler asks `plan(reqs)` for a decode step's drafts and tells `observe(step, result, seconds)`
what the step did; nothing else crosses. The planner owns the policy's state:
- the step cost model (cost.py), priced from this worker's forwards timed when it is built and refined
  by the steps observed;
- acceptance estimates (sizing.py): per request, per evidence a drafter gives before drafting
  (Drafter.evidence: NGRAM's match length), and across requests, where a new request's starts;
- exploration: a request whose estimate keeps it from drafting tries again now and then, where drafting
  well would pay;
- catch-up: a draft model that skipped a request's tokens feeds them when it drafts for it again, priced
  over the steps that drafting is expected to go on;
- Predicted Output chains (prediction.py), as long as pays by the step cost.

One planner per worker: a new speculative configuration (Engine.set_speculative) gets a new planner,
priced by its own draft model's forwards, so that nothing learnt of one draft prices another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence
from weakref import WeakKeyDictionary

from engine.config import ServerArgs
from engine.memory.kv_manager import KVManager
from engine.core.request import Request
from engine.speculative.cost import StepCost
from engine.speculative.prediction import ANCHOR_MAX, chain_length
from engine.speculative.sizing import START_ALPHA, Acceptance, draft_sizes, worth_exploring
from engine.core.step import DecodeStep, StepResult
from engine.core.worker import Worker

# A request kept from drafting tries again after this many decode steps, times a quarter of the batch,
# so that about one request in four steps explores; a draft model's catch-up is priced over at most
# CATCH_UP_STEPS steps (the load may change before); the estimate across requests forgets more slowly
# than a request's own.
EXPLORE_EVERY = 16
CATCH_UP_STEPS = 64
ACROSS_DECAY = 0.99
# A further row's share of a one-row decode step before step times are measured: on a CPU the weight
# kernels are compute-bound past one row; on a GPU rows are nearly free until the batch is large.
PRIOR_ROW_COST = {"cpu": 0.12, "cuda": 0.01}


@dataclass
class Plan:
    """A decode step's drafts (DecodeStep's fields of the same names): drafts[b], the most draft tokens
    request b's tree may hold (None: the whole tree, sized by nothing); evidence[b], what that size
    rests on; chains[b], Predicted Output tokens to verify (None: no request has one); catch_up, tokens a
    draft model that fell behind feeds first."""
    drafts: Optional[list[int]]
    evidence: Optional[list[Optional[int]]]
    chains: Optional[list[list[int]]]
    catch_up: int


# How an engine makes the planner of each worker it runs (build.TimedPlanners unless a test gives one).
PlannerFactory = Callable[[Worker, ServerArgs, KVManager], "Planner"]


class _Own:
    """A request's part of the policy: its acceptance estimate, and the decode steps since it drafted."""

    def __init__(self, estimate: Acceptance):
        self.estimate, self.undrafted = estimate, 0


class Planner:
    def __init__(self, worker: Worker, args: ServerArgs, cost: StepCost, explore_every: int = EXPLORE_EVERY):
        self.drafter, self.cost = worker.drafter, cost
        self.limit = worker.num_draft_tokens - 1
        self.adaptive = self.drafter is not None and args.speculative_adaptive != "off"
        self.context_len = args.context_length
        self.explore_every = explore_every
        self.across = self.estimate(START_ALPHA, ACROSS_DECAY)
        self.by_evidence: dict[int, Acceptance] = {}
        # A request's own part lives as long as the request does (it may be retracted and come back).
        self._own: WeakKeyDictionary[Request, _Own] = WeakKeyDictionary()

    def estimate(self, start: float, decay: Optional[float] = None) -> Acceptance:
        """A new acceptance estimate starting at `start` (tests give estimates of their own here)."""
        return Acceptance(start) if decay is None else Acceptance(start, decay=decay)

    def sizes(self, alphas: Sequence[float], forced: Sequence[bool], extra: Sequence[float]) -> list[int]:
        """Draft tokens per request for these acceptances (sizing.draft_sizes)."""
        return draft_sizes(alphas, self.limit, self.cost, forced, extra)

    # ------------------------------------------------------------------ the two calls
    def plan(self, reqs: Sequence[Request]) -> Plan:
        """What a decode step of `reqs` drafts."""
        lags = [self.drafter.lag(r) for r in reqs] if self.drafter else [0] * len(reqs)
        drafts, evidence = self._drafts(reqs, lags) if self.adaptive else (None, None)
        catch_up = sum(lag for lag, on in zip(lags, self._drafting(drafts, len(reqs))) if on)
        return Plan(drafts, evidence, self._chains(reqs, drafts), catch_up)

    def observe(self, step: DecodeStep, result: StepResult, seconds: float) -> None:
        """A decode step ran in `seconds`: its time prices later steps, its verifications the estimates
        its sizes were chosen by."""
        drafted = sum(self._drafting(step.drafts, len(step.reqs)))
        self.cost.observe(result.rows, seconds, drafted, result.draft_seconds, step.catch_up)
        if result.drafts is None or step.evidence is None:
            return
        for req, key, proposed, accepted in zip(step.reqs, step.evidence, result.proposed, result.drafts):
            estimate = self._estimate(req, key)
            if estimate is not None:
                estimate.record(proposed, accepted)
                self.across.record(proposed, accepted)

    # ------------------------------------------------------------------ draft sizes
    def _drafts(self, reqs: Sequence[Request], lags: Sequence[int]) -> tuple[list[int], list[Optional[int]]]:
        """Each request's draft tokens (--speculative-adaptive), as many as pay by the step cost and the
        acceptance expected of them, and what each rests on. lags[b]: tokens of request b the drafter
        skipped (Drafter.lag)."""
        evidence = [self.drafter.evidence(r) for r in reqs]
        estimates = [self._estimate(r, key) for r, key in zip(reqs, evidence)]
        # A catch-up pays off over the steps the request goes on drafting (about two tokens each).
        catch_up = [self.cost.catch_up(lag) / max(1, min(r.remaining_tokens() // 2, CATCH_UP_STEPS))
                    for r, lag in zip(reqs, lags)]
        alphas = [e.value if e else 0.0 for e in estimates]
        # An estimate that keeps a request off would never change (nor would the average new requests
        # start from): try it again now and then; not where drafting well would not pay either.
        every = self.explore_every * max(1, len(reqs) // 4)
        owns = [self._own_part(r) for r in reqs]
        due = [e is not None and own.undrafted >= every for own, e in zip(owns, estimates)]
        sizes = self.sizes(alphas, worth_exploring(alphas, due, self.limit, self.cost, catch_up), catch_up)
        for own, k in zip(owns, sizes):
            own.undrafted = 0 if k else own.undrafted + 1
        return sizes, evidence

    def _estimate(self, req: Request, key: Optional[int]) -> Optional[Acceptance]:
        """The estimate that sizes a request's draft: that of drafts resting on the same evidence, else
        the request's own; either starts from the average across requests. None: nothing to draft."""
        if key == 0:
            return None
        if key is None:
            return self._own_part(req).estimate
        if key not in self.by_evidence:
            self.by_evidence[key] = self.estimate(self.across.value, ACROSS_DECAY)
        return self.by_evidence[key]

    def _own_part(self, req: Request) -> _Own:
        own = self._own.get(req)
        if own is None:
            own = self._own[req] = _Own(self.estimate(self.across.value))
        return own

    def _drafting(self, drafts: Optional[Sequence[int]], n: int) -> list[bool]:
        """Per request, whether the drafter drafts for it in a step of these sizes."""
        if self.drafter is None:
            return [False] * n
        return [True] * n if drafts is None else [k > 0 for k in drafts]

    # ------------------------------------------------------------------ Predicted Outputs
    def _chains(self, reqs: Sequence[Request], drafts: Optional[Sequence[int]]) -> Optional[list[list[int]]]:
        """Each request's Predicted Output chain, as long as pays by the step cost and its recent
        acceptance (none without a prediction); None when no request has one."""
        if all(r.prediction is None for r in reqs):
            return None
        rows = len(reqs) + (sum(drafts) if drafts is not None else len(reqs) * self.limit)

        def cost(k: int) -> float:
            return self.cost.relative(rows, k)

        chains = []
        for r in reqs:
            p = r.prediction
            tail = r.token_ids[-ANCHOR_MAX:]
            left = p.remaining(tail) if p is not None else 0        # finds the place first, when lost
            room = min(left, r.remaining_tokens() - 1, self.context_len - r.seq_len - 1)
            chains.append(p.chain(tail, chain_length(p.chance, room, cost)) if left else [])
        return chains if any(chains) else None
