"""Predicted Outputs (OpenAI's `prediction` parameter): the text a request's answer is expected to
mostly repeat, drafted as a chain beside whatever the speculative algorithm drafts (or alone, without
one), and verified like any draft: the output stays the model's own.

A Prediction follows the output through the predicted tokens: `next` is the prediction token the output
is expected to produce next. Every committed token that equals it moves it on; any other token loses
the place (an edit). The place is found again by prompt lookup: the output's newest few tokens looked
up in the prediction, the first occurrence after the last confirmed place (edits move forward through a
document), so after an insertion, a deletion or a changed line the unchanged rest drafts again.
Matching is on the prediction's own tokens: the same text inside the answer may be cut into tokens
differently at the edges of an edit, and a few tokens on the cuts fall in line again.

A place is confirmed once CONFIRM output tokens in a row agree with it. Before that it may be chance:
in code a short n-gram (an indentation, `self.`) also matches lines it does not belong to, and a token
or two agree there. So only confirmed places move the lookups on, and each kind of place has its own
chance that the next token matches, learnt from every committed token, drafted or not.

How many tokens to verify comes from `chain_length`: the expected accepted tokens of a chain of k, from
those chances, against the measured cost of k more rows in the step's forward
(engine/speculative/cost.py). A prediction being followed runs long chains; an unrelated one, whose
places are never confirmed, drafts next to nothing; one that failed for a stretch drafts again as soon
as the output is seen following it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional, Sequence

MAX_CHAIN = 64
# Re-anchoring looks up the output's newest ANCHOR_MAX .. ANCHOR_MIN tokens; a single token only where
# it occurs once in what is left of the prediction.
ANCHOR_MAX, ANCHOR_MIN = 4, 2
CONFIRM = 6                 # output tokens in a row agreeing with a place before it counts as confirmed
# Each chance starts as if HITS of HITS + MISSES tokens had matched (a prediction is meant to be right
# where the output is confirmed to follow it; an unconfirmed place is a guess), and a token DECAY tokens
# ago weighs DECAY^n.
PRIOR_CONFIRMED, PRIOR_UNCONFIRMED, DECAY = (4.0, 1.0), (1.0, 1.0), 0.9


class _Chance:
    """A decayed estimate of how often an event happens."""

    def __init__(self, prior: tuple[float, float]):
        self._hits, self._misses = prior

    def update(self, hit: bool) -> None:
        self._hits = self._hits * DECAY + hit
        self._misses = self._misses * DECAY + (not hit)

    @property
    def value(self) -> float:
        return self._hits / (self._hits + self._misses)


class Prediction:
    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self.next: Optional[int] = 0            # the prediction token expected next; None: place lost
        self.floor = 0                          # re-anchoring looks from here on: the last confirmed place
        self.accepted = 0                       # prediction tokens verified and kept (usage)
        self.rejected = 0                       # prediction tokens verified and refused (usage)
        # Output tokens in a row that agree with the place; the output's start is where the prediction
        # is meant to start, so that place counts as confirmed.
        self._agreeing = CONFIRM
        self._confirmed = _Chance(PRIOR_CONFIRMED)
        self._unconfirmed = _Chance(PRIOR_UNCONFIRMED)
        self._ends: dict[int, dict[tuple, list[int]]] = {}

    # ------------------------------------------------------------------ following the output
    def follow(self, token: int) -> None:
        """A token was committed to the output."""
        if self.next is None:
            return
        hit = self.next < len(self.tokens) and self.tokens[self.next] == token
        self._chance(self._agreeing).update(hit)
        if hit:
            self.next += 1
            self._agreeing += 1
            if self._agreeing >= CONFIRM:
                self.floor = self.next
        else:
            self.next, self._agreeing = None, 0

    def verified(self, proposed: int, accepted: int) -> None:
        """A chain of `proposed` tokens was verified and its first `accepted` kept."""
        self.accepted += accepted
        self.rejected += proposed - accepted

    def chance(self, i: int) -> float:
        """Chance that the i-th token of a chain from the current place (0: the first) is accepted, given
        the ones before it were."""
        return self._chance(self._agreeing + i).value

    def _chance(self, agreeing: int) -> _Chance:
        return self._confirmed if agreeing >= CONFIRM else self._unconfirmed

    # ------------------------------------------------------------------ drafting
    def place(self, output_tail: Sequence[int]) -> Optional[int]:
        """Where the output stands in the prediction (found again from its newest tokens when lost)."""
        if self.next is None:
            self.next, self._agreeing = self._lookup(output_tail)
        return self.next

    def chain(self, output_tail: Sequence[int], length: int) -> list[int]:
        """Up to `length` prediction tokens to verify after the output's newest token."""
        at = self.place(output_tail)
        return [] if at is None or length <= 0 else self.tokens[at:at + length]

    def remaining(self, output_tail: Sequence[int]) -> int:
        at = self.place(output_tail)
        return 0 if at is None else len(self.tokens) - at

    def _lookup(self, tail: Sequence[int]) -> tuple[Optional[int], int]:
        """The place after the output's newest tokens, and how many of them agree with it."""
        for n in range(min(ANCHOR_MAX, len(tail)), ANCHOR_MIN - 1, -1):
            ends = self._index(n).get(tuple(tail[-n:]), ())
            after = [e for e in ends if e >= self.floor]
            if after:
                return after[0], n
        if tail:
            ends = [e for e in self._index(1).get((tail[-1],), ()) if e >= self.floor]
            if len(ends) == 1:
                return ends[0], 1
        return None, 0

    def _index(self, n: int) -> dict[tuple, list[int]]:
        """n-gram of the prediction -> the positions right after its occurrences, in order (built once)."""
        if n not in self._ends:
            ends: dict[tuple, list[int]] = defaultdict(list)
            for end in range(n, len(self.tokens) + 1):
                ends[tuple(self.tokens[end - n:end])].append(end)
            self._ends[n] = dict(ends)
        return self._ends[n]


def chain_length(chance: Callable[[int], float], limit: int, relative_cost: Callable[[int], float]) -> int:
    """The k in 0..limit maximizing expected tokens per step over the step's cost with k more rows,
    relative_cost(k) (1 at k = 0): the step's own token plus the chain's expected accepted tokens, token
    i accepted with chance(i) once those before it were."""
    best, best_gain, accepted, reach = 0, 1.0, 0.0, 1.0
    for k in range(1, min(limit, MAX_CHAIN) + 1):
        reach *= chance(k - 1)
        accepted += reach
        gain = (1 + accepted) / relative_cost(k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best
