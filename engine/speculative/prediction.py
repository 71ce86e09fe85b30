"""Predicted Outputs (OpenAI's `prediction` parameter): the text a request's answer is expected to
mostly repeat, drafted as a chain beside whatever the speculative algorithm drafts (or alone, without
one), and verified like any draft: the output stays the model's own.

A Prediction follows the output through the predicted tokens: `next` is the prediction token the output
is expected to produce next. Every committed token that equals it moves it on; any other token loses
the place (an edit). The place is found again by prompt lookup: the output's newest few tokens looked
up in the prediction, the first occurrence after the last place the output confirmed (edits move
forward through a document), so after an insertion, a deletion or a changed line the unchanged rest
drafts again. Matching is on the prediction's own tokens: the same text inside the answer may be cut
into tokens differently at the edges of an edit, and a few tokens on the cuts fall in line again.

How many tokens to verify comes from `chain_length`: the expected accepted tokens of a chain of k
(geometric in the request's recent acceptance rate) against the measured cost of k more rows in the
step's forward (engine/speculative/cost.py). A prediction being accepted runs long chains; a failing
one shrinks to none, so a wrong prediction costs next to nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

MAX_CHAIN = 64
# Re-anchoring looks up the output's newest ANCHOR_MAX .. ANCHOR_MIN tokens; a single token only where
# it occurs once in what is left of the prediction.
ANCHOR_MAX, ANCHOR_MIN = 4, 2
# The acceptance rate starts as if PRIOR_ACCEPTED of PRIOR_ACCEPTED + 1 proposals had been accepted (a
# prediction is meant to be right), and older steps weigh less by DECAY a step.
PRIOR_ACCEPTED, DECAY = 4.0, 0.8


class Prediction:
    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self.next: Optional[int] = 0            # the prediction token expected next; None: place lost
        self.floor = 0                          # re-anchoring looks from here on: the last confirmed place
        self.accepted = 0                       # prediction tokens verified and kept (usage)
        self.rejected = 0                       # prediction tokens verified and refused (usage)
        self._hits, self._misses = PRIOR_ACCEPTED, 1.0
        self._ends: dict[int, dict[tuple, list[int]]] = {}

    # ------------------------------------------------------------------ following the output
    def follow(self, token: int) -> None:
        """A token was committed to the output."""
        if self.next is not None and self.next < len(self.tokens) and self.tokens[self.next] == token:
            self.next += 1
            self.floor = self.next
        else:
            self.next = None

    def verified(self, proposed: int, accepted: int) -> None:
        """A chain of `proposed` tokens was verified and its first `accepted` kept."""
        self.accepted += accepted
        self.rejected += proposed - accepted
        self._hits = self._hits * DECAY + accepted
        self._misses = self._misses * DECAY + (accepted < proposed)

    @property
    def rate(self) -> float:
        """Estimated chance that the next proposed token is accepted, given the ones before it were."""
        return self._hits / (self._hits + self._misses)

    # ------------------------------------------------------------------ drafting
    def place(self, output_tail: Sequence[int]) -> Optional[int]:
        """Where the output stands in the prediction (found again from its newest tokens when lost)."""
        if self.next is None:
            self.next = self._lookup(output_tail)
        return self.next

    def chain(self, output_tail: Sequence[int], length: int) -> list[int]:
        """Up to `length` prediction tokens to verify after the output's newest token."""
        at = self.place(output_tail)
        return [] if at is None or length <= 0 else self.tokens[at:at + length]

    def remaining(self, output_tail: Sequence[int]) -> int:
        at = self.place(output_tail)
        return 0 if at is None else len(self.tokens) - at

    def _lookup(self, tail: Sequence[int]) -> Optional[int]:
        for n in range(min(ANCHOR_MAX, len(tail)), ANCHOR_MIN - 1, -1):
            ends = self._index(n).get(tuple(tail[-n:]), ())
            after = [e for e in ends if e >= self.floor]
            if after:
                return after[0]
        if tail:
            ends = [e for e in self._index(1).get((tail[-1],), ()) if e >= self.floor]
            if len(ends) == 1:
                return ends[0]
        return None

    def _index(self, n: int) -> dict[tuple, list[int]]:
        """n-gram of the prediction -> the positions right after its occurrences, in order (built once)."""
        if n not in self._ends:
            ends: dict[tuple, list[int]] = defaultdict(list)
            for end in range(n, len(self.tokens) + 1):
                ends[tuple(self.tokens[end - n:end])].append(end)
            self._ends[n] = dict(ends)
        return self._ends[n]


def chain_length(rate: float, limit: int, relative_cost) -> int:
    """The k in 0..limit maximizing expected tokens per step, (1 + rate + ... + rate^k), over the step's
    cost with k more rows, relative_cost(k) (1 at k = 0)."""
    best, best_gain, expected, power = 0, 1.0, 1.0, 1.0
    for k in range(1, min(limit, MAX_CHAIN) + 1):
        power *= rate
        expected += power
        gain = expected / relative_cost(k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best
