"""Per-step draft sizes (--speculative-adaptive): how many draft tokens each running request gets this
step, 0 being a plain step for it, chosen to maximise the batch's expected tokens per second.

A request's drafts are summed up by one number, alpha: the chance that a draft token is accepted once
those before it were, estimated from its own verifications (decayed, so it follows the text) and
starting from the algorithm's running average. k draft tokens are then expected to add
alpha + alpha^2 + ... + alpha^k accepted tokens to the one every step yields; a tree of k nodes does at
least as well as a chain of k, so the estimate errs towards drafting less. The cost of a step is the
machine's (cost.py): the target's forward grows with the rows every request's draft adds, drafting
costs its time per request drafted for, and a draft model that skipped a request's recent tokens feeds
them first (priced over the steps that catch-up serves).

Tokens per second, sum_b (1 + E_b(k_b)) / T(k), is maximised by Dinkelbach's iteration: for the current
ratio lam, each request alone takes the k maximising 1 + E_b(k) - lam * (its rows and drafting time),
and lam becomes the ratio of the sizes chosen; a few rounds settle it. At batch 1 on a memory-bound
device this keeps the whole tree wherever acceptance pays for it; as the batch grows and every row
costs compute, trees shrink and turn off for the requests whose drafts are accepted least.

Sizes depend on past verifications only, never on the current step's draws: verification stays exact
whatever they are (speculative/verify.py).
"""

from __future__ import annotations

import math
from typing import Sequence

from engine.speculative.cost import StepCost

# A request's alpha starts as PRIOR_WEIGHT verifications at the running average; a verification
# DECAY ago weighs DECAY^n.
PRIOR_WEIGHT, DECAY = 2.0, 0.9
# The running average across requests starts here: speculation is tried before anything is known.
START_ALPHA = 0.6
# A request drafting well: trying one left off tells something only where such drafts would pay.
EXPLORE_ALPHA = 0.9


class Acceptance:
    """A decayed estimate of alpha: each accepted draft token a success, each verification that
    stopped before the end of its draft a failure (the maximum-likelihood estimate for a geometric
    run cut at the draft's length)."""

    def __init__(self, alpha: float = START_ALPHA, weight: float = PRIOR_WEIGHT, decay: float = DECAY):
        self._hits, self._misses, self._decay = alpha * weight, (1 - alpha) * weight, decay

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self._hits = self._hits * self._decay + accepted
        self._misses = self._misses * self._decay + (accepted < proposed)

    @property
    def value(self) -> float:
        return self._hits / (self._hits + self._misses)


def expected_accepted(alpha: float, k: int) -> float:
    """Draft tokens accepted out of a chain of k, each accepted with chance alpha after the ones before."""
    total, reach = 0.0, 1.0
    for _ in range(k):
        reach *= alpha
        total += reach
    return total


def draft_sizes(alphas: Sequence[float], limit: int, cost: StepCost, forced: Sequence[bool] = (),
                extra: Sequence[float] = ()) -> list[int]:
    """Draft tokens per request, 0..limit, maximising expected tokens per second of the whole step.
    forced[b]: request b drafts at least one token (exploring an estimate that would keep it off).
    extra[b]: seconds drafting for request b adds this step beyond the usual (a catch-up's share)."""
    B = len(alphas)
    forced = list(forced) or [False] * B
    extra = list(extra) or [0.0] * B
    if limit <= 0 or not B:
        return [0] * B
    row = (cost.seconds(2 * B) - cost.seconds(B)) / B            # what one more row adds, at this batch
    drafting = (cost.seconds(0, B) - cost.seconds(0)) / B        # what drafting for a request adds, at this batch

    def ratio(sizes: list[int]) -> float:
        tokens = sum(1 + expected_accepted(a, k) for a, k in zip(alphas, sizes))
        more = sum(e for e, k in zip(extra, sizes) if k)
        return tokens / (cost.seconds(B + sum(sizes), sum(1 for k in sizes if k)) + more)

    def best(alpha: float, must: bool, lam: float, once: float) -> int:
        # The k-th token pays its row while alpha^k > lam * row: the best k >= 1 is the largest such
        # (1 at least); then it must pay for the drafting too, unless forced.
        threshold = lam * row
        if alpha <= 0 or alpha <= threshold:
            k = 1
        elif threshold <= 0:
            k = limit
        else:
            k = max(1, min(limit, int(math.log(threshold) / math.log(alpha) - 1e-9)))
        if must or expected_accepted(alpha, k) > lam * (row * k + drafting + once):
            return k
        return 0

    sizes = [1 if f else 0 for f in forced]
    lam = ratio(sizes)
    for _ in range(8):
        chosen = [best(a, f, lam, e) for a, f, e in zip(alphas, forced, extra)]
        new = ratio(chosen)
        if new <= lam * (1 + 1e-9):
            break
        sizes, lam = chosen, new
    return sizes


def worth_exploring(alphas: Sequence[float], due: Sequence[bool], limit: int, cost: StepCost,
                    extra: Sequence[float] = ()) -> list[bool]:
    """Of the requests due to try drafting again (due[b]), those that would draft this step if their
    drafts were accepted as well as EXPLORE_ALPHA: where even such drafts cannot pay for their rows at
    this batch, a try costs rows and could change nothing."""
    if not any(due):
        return list(due)
    hopeful = draft_sizes([max(a, EXPLORE_ALPHA) if d else a for a, d in zip(alphas, due)], limit, cost,
                          extra=extra)
    return [d and k > 0 for d, k in zip(due, hopeful)]
