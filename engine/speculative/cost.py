"""StepCost: what a decode step costs on this machine, from the steps the scheduler observes: the
target's forward by its row count R (every tree node of every request is a row), and the drafter's work
per request it drafts for. Draft sizes weigh a longer draft against the time its rows and its drafting
add.

A forward is memory-bound at a few rows (the weights are read once whatever R is) and compute-bound past
a knee that depends on the model and the machine (on a CPU within a handful of rows; on a GPU far
later), so no one line fits every R. The time of each row count seen is kept (decayed, as contexts
grow), and a step of R rows is priced by linear interpolation between the nearest ones seen. Past the
largest, the slope between the two largest seen continues (the compute-bound side); below the smallest,
or with a single count seen, the prior slope (b / a, the share of a one-row step each further row adds)
stands in, never less than half of it."""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Optional

DECAY = 0.9                       # weight of the previous time of a row count, and of a drafted request's cost
# Drafting is priced once this many steps drafted: the first ones carry one-off work (a root fed after a
# prefill, first calls), and a price taken from them alone would stop drafting before it is measured.
DRAFT_WARMUP = 8
# Slopes are kept at or above this share of the prior's: steps differ in more than their rows, and a
# rate that found rows free would draft without bound.
MIN_SLOPE_SHARE = 0.5


class StepCost:
    def __init__(self, prior_slope: float):
        self._prior = prior_slope
        self._times: dict[int, float] = {}          # row count -> decayed seconds of the target's forward
        self._counts: list[int] = []                # its keys, sorted (steps are priced many times each)
        self._draft: Optional[float] = None         # seconds of drafting per drafted request
        self._drafted_steps = 0

    def observe(self, rows: int, seconds: float, drafted: int = 0, draft_seconds: float = 0.0) -> None:
        """A decode step of `rows` target rows took `seconds`, of which `draft_seconds` drafting for
        `drafted` requests."""
        target = seconds - draft_seconds
        seen = self._times.get(rows)
        if seen is None:
            insort(self._counts, rows)
        self._times[rows] = target if seen is None else DECAY * seen + (1 - DECAY) * target
        if drafted:
            self._drafted_steps += 1
            per = draft_seconds / drafted
            if self._drafted_steps > 1:             # the first carries the most one-off work: left out
                self._draft = per if self._draft is None else DECAY * self._draft + (1 - DECAY) * per

    def seconds(self, rows: int, drafted: int = 0) -> float:
        """A step's time with `rows` target rows and `drafted` requests drafted for (in units of a
        one-row step before any step was observed)."""
        priced = self._draft if self._drafted_steps >= DRAFT_WARMUP else 0.0
        return self._target(rows) + priced * drafted

    def relative(self, rows: int, more: int) -> float:
        """Time of a step of rows + more rows over that of `rows` rows (drafting aside)."""
        return self._target(rows + more) / self._target(rows)

    def _target(self, rows: int) -> float:
        counts, times = self._counts, self._times
        if not counts:
            return 1 + self._prior * rows
        i = bisect_left(counts, rows)
        if i < len(counts) and counts[i] == rows:
            return times[rows]
        if 0 < i < len(counts):                   # between two row counts seen
            r0, r1 = counts[i - 1], counts[i]
            return times[r0] + (times[r1] - times[r0]) * (rows - r0) / (r1 - r0)
        at = counts[-1] if i else counts[0]
        prior = self._prior * times[at] / (1 + self._prior * at)       # the prior's slope there
        slope = prior
        if i and len(counts) > 1:                 # past the largest: the slope of the two largest
            slope = (times[counts[-1]] - times[counts[-2]]) / (counts[-1] - counts[-2])
        floor = MIN_SLOPE_SHARE * prior
        return max(times[at] + max(slope, floor) * (rows - at), floor)
