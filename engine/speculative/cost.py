"""StepCost: what a decode step costs on this machine: the target's forward by its row count R (every
tree node of every request is a row), the drafter's work per request it drafts for, and what a draft
model that fell behind pays to catch up. Draft sizes weigh a longer draft against the time its rows and
its drafting add.

A forward is memory-bound at a few rows (the weights are read once whatever R is) and compute-bound past
a knee that depends on the model and the machine (on a CPU within a handful of rows; on a GPU far
later), so no one line fits every R. Forwards of 1 to 32 rows are timed at start-up (cost_probe.py):
that curve is the prior. The time of each row count the planner then observes is kept (decayed, as
contexts grow), and a step of R rows is priced by linear interpolation between the nearest ones seen;
outside them, by the prior's curve scaled through the nearest one seen (a step carries host work that a
bare forward does not). Without a measured curve (tensor parallelism, tests) the prior is a line, b / a
being the share of a one-row step each further row adds, and past the largest count seen the slope
between the two largest continues, never less than half the line's. Drafting is priced per request
from the drafted steps observed; before there are enough, a draft model's is priced by its own forwards
timed at start-up, so that a fresh server under load does not pay for drafts to learn they do not pay."""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Mapping, Optional

DECAY = 0.9                       # weight of the previous time of a row count, and of a drafted request's cost
# Drafting is priced by the steps observed once this many drafted: the first ones carry one-off work
# (first calls, a catch-up where the draft's forwards were not timed), and a price taken from them alone
# would stop drafting before it is measured. Until then it is priced by the draft model's start-up
# timings where there are some, else not at all.
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
        self._curve: Optional[Curve] = None          # the target's forward times measured at start-up
        self._draft_curve: Optional[Curve] = None    # the draft model's, where it catches up
        self._draft_forwards, self._draft_rows = 0, 1

    def measured(self, target: Mapping[int, float], draft: Optional[Mapping[int, float]] = None,
                 draft_forwards: int = 0, draft_rows: int = 1) -> None:
        """Forward times by row count measured at start-up (cost_probe.py): the target's, and the draft
        model's where a draft that fell behind feeds what it skipped. Drafting for n requests runs
        `draft_forwards` draft forwards of n * draft_rows rows: its price until steps are observed."""
        self._curve = Curve(target) if target else None
        self._draft_curve = Curve(draft) if draft else None
        self._draft_forwards, self._draft_rows = draft_forwards, draft_rows

    def observe(self, rows: int, seconds: float, drafted: int = 0, draft_seconds: float = 0.0,
                caught_up: int = 0) -> None:
        """A decode step of `rows` target rows took `seconds`, of which `draft_seconds` drafting for
        `drafted` requests, the draft model catching up on `caught_up` tokens first (priced apart)."""
        target = seconds - draft_seconds
        seen = self._times.get(rows)
        if seen is None:
            insort(self._counts, rows)
        self._times[rows] = target if seen is None else DECAY * seen + (1 - DECAY) * target
        if drafted:
            self._drafted_steps += 1
            per = max(0.0, draft_seconds - self.catch_up(caught_up)) / drafted
            if self._drafted_steps > 1:             # the first carries the most one-off work: left out
                self._draft = per if self._draft is None else DECAY * self._draft + (1 - DECAY) * per

    def seconds(self, rows: int, drafted: int = 0) -> float:
        """A step's time with `rows` target rows and `drafted` requests drafted for (in units of a
        one-row step where no forward was timed or observed)."""
        return self._target(rows) + self._drafting(drafted)

    def catch_up(self, tokens: int) -> float:
        """Seconds a draft model that skipped `tokens` committed tokens adds to the step it drafts again in
        (0 where it does not catch up, or where its forwards were not measured)."""
        if not tokens or self._draft_curve is None:
            return 0.0
        return self._draft_curve(1 + tokens) - self._draft_curve(1)

    def _drafting(self, drafted: int) -> float:
        if not drafted:
            return 0.0
        if self._drafted_steps >= DRAFT_WARMUP:
            return self._draft * drafted
        if self._draft_curve is None:
            return 0.0
        return self._draft_forwards * self._draft_curve(drafted * self._draft_rows)

    def relative(self, rows: int, more: int) -> float:
        """Time of a step of rows + more rows over that of `rows` rows (drafting aside)."""
        return self._target(rows + more) / self._target(rows)

    def _target(self, rows: int) -> float:
        counts, times, curve = self._counts, self._times, self._curve
        if not counts:
            return curve(rows) if curve else 1 + self._prior * rows
        i = bisect_left(counts, rows)
        if i < len(counts) and counts[i] == rows:
            return times[rows]
        if 0 < i < len(counts):                   # between two row counts seen
            r0, r1 = counts[i - 1], counts[i]
            return times[r0] + (times[r1] - times[r0]) * (rows - r0) / (r1 - r0)
        at = counts[-1] if i else counts[0]
        if curve:
            return times[at] * curve(rows) / curve(at)
        prior = self._prior * times[at] / (1 + self._prior * at)       # the prior's slope there
        slope = prior
        if i and len(counts) > 1:                 # past the largest: the slope of the two largest
            slope = (times[counts[-1]] - times[counts[-2]]) / (counts[-1] - counts[-2])
        floor = MIN_SLOPE_SHARE * prior
        return max(times[at] + max(slope, floor) * (rows - at), floor)


class Curve:
    """Forward seconds by row count from a few measured counts: linear between them, the last two's
    slope past the largest, the time of one row below the smallest. Made non-decreasing: a forward of
    more rows never costs less (a measurement that says so is noise)."""

    def __init__(self, times: Mapping[int, float]):
        self._rows = sorted(times)
        self._times, most = [], 0.0
        for r in self._rows:
            most = max(most, times[r])
            self._times.append(most)

    def __call__(self, rows: int) -> float:
        xs, ys = self._rows, self._times
        if rows <= xs[0] or len(xs) == 1:
            return ys[0] if rows <= xs[0] else ys[0] * rows / xs[0]
        i = min(bisect_left(xs, rows), len(xs) - 1)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
