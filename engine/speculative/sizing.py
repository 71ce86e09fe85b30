"""Per-step draft sizes (--speculative-adaptive): how many draft tokens each running request gets this
step, 0 being a plain step for it, chosen to maximise the batch's expected tokens per second.

A request's drafts are summed up by one number, alpha: k draft tokens are expected to add
alpha + alpha^2 + ... + alpha^k accepted tokens to the one every step yields, as a chain whose tokens
are each accepted with chance alpha once those before it were. alpha is fitted to past verifications
(decayed, so it follows the text), starting from the algorithm's running average: the alpha under
which drafts of their mean size are accepted as often as they were. For a chain that is the chance per
token; for a tree, whose siblings are alternatives (a tree of two children of the root accepts one
token at most), it is what makes the expectation right at the sizes in use. The verifications are the
request's own, or, where the drafter says before drafting what a draft rests on (Drafter.evidence:
NGRAM's match length), those of all drafts resting on the same: a copy from a long match is accepted
far more often than one from a single token, whichever request it is for.

The cost of a step is the machine's (cost.py): the target's forward grows with the rows every
request's draft adds, drafting costs its time per request drafted for, and a draft model that skipped
a request's recent tokens feeds them first (priced over the steps that catch-up serves).

Tokens per second, sum_b (1 + E_b(k_b)) / T(k), is maximised by Dinkelbach's iteration: for the current
ratio lam, each request alone takes the k maximising 1 + E_b(k) - lam * (its rows and drafting time),
and lam becomes the ratio of the sizes chosen; a few rounds settle it. At batch 1 on a memory-bound
device this keeps the whole tree wherever acceptance pays for it; as the batch grows and every row
costs compute, trees shrink and turn off for the requests whose drafts are accepted least.

Sizes depend on past verifications and committed text only, never on the current step's draws:
verification stays exact whatever they are (speculative/verify.py).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from engine.speculative.cost import StepCost

# A request's alpha starts as PRIOR_WEIGHT verifications at the running average; a verification
# DECAY ago weighs DECAY^n.
PRIOR_WEIGHT, DECAY = 2.0, 0.9
# The running average across requests starts here: speculation is tried before anything is known.
START_ALPHA = 0.6
# A request drafting well: trying one left off tells something only where such drafts would pay.
EXPLORE_ALPHA = 0.9
FIT_ROUNDS = 20                     # bisection rounds fitting alpha: within 1e-6


class Acceptance:
    """A decayed estimate of alpha: the alpha for which expected_accepted at the drafts' mean size
    equals their mean accepted count. Fitting the mean rather than counting each stop as a miss keeps
    trees right: two sibling drafts of which one is accepted 9 times in 10 count as a chain of two
    with alpha 0.57, not as a chain stopped early every time (alpha under 0.5)."""

    def __init__(self, alpha: float = START_ALPHA, weight: float = PRIOR_WEIGHT, decay: float = DECAY):
        # The prior: `weight` verifications of one draft token, accepted `alpha` of the time.
        self._weight, self._proposed, self._accepted, self._decay = weight, weight, alpha * weight, decay
        self._value: Optional[float] = alpha

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        d = self._decay
        self._weight, self._proposed = self._weight * d + 1, self._proposed * d + proposed
        self._accepted = self._accepted * d + accepted
        self._value = None

    @property
    def value(self) -> float:
        if self._value is None:
            self._value = _fit(self._proposed / self._weight, self._accepted / self._weight)
        return self._value


def _fit(size: float, accepted: float) -> float:
    """The alpha in [0, 1] with expected_accepted(alpha, size) = accepted (size may be fractional: the
    expectation grows linearly between whole sizes), by bisection."""
    whole, part = int(size), size - int(size)

    def expected(alpha: float) -> float:
        return expected_accepted(alpha, whole) + part * alpha ** (whole + 1)

    lo, hi = 0.0, 1.0
    for _ in range(FIT_ROUNDS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < accepted else (lo, mid)
    return (lo + hi) / 2


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
