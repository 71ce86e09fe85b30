"""StepCost: what a decode step costs on this machine, from the steps the scheduler observes: the
target's forward of R rows (every tree node of every request is a row), fitted as a + b * R, and the
drafter's work per request it drafts for. Draft sizes weigh a longer draft against the time its rows
and its drafting add. On a CPU each extra row adds a noticeable share of a step (the weight kernels are
compute-bound past one row); on a GPU next to nothing, until the batch is large. Until the observed
steps span several row counts, the prior slope stands in for b / a."""

from __future__ import annotations

from collections import deque
from typing import Optional

WINDOW = 256
MIN_SLOPE = 0.002                 # rows are never free: keeps a noisy fit from drafting without bound
DRAFT_DECAY = 0.9                 # weight of the previous estimate of a drafted request's cost


class StepCost:
    def __init__(self, prior_slope: float):
        """prior_slope: b / a, the share of a one-row step each further row adds, before measurements."""
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._slope = prior_slope
        self._base: Optional[float] = None          # a, in seconds, once a step was observed
        self._draft: Optional[float] = None         # seconds of drafting per drafted request

    def observe(self, rows: int, seconds: float, drafted: int = 0, draft_seconds: float = 0.0) -> None:
        """A decode step of `rows` target rows took `seconds`, of which `draft_seconds` drafting for
        `drafted` requests."""
        self._steps.append((rows, seconds - draft_seconds))
        if drafted:
            per = draft_seconds / drafted
            self._draft = per if self._draft is None else DRAFT_DECAY * self._draft + (1 - DRAFT_DECAY) * per
        if len(self._steps) % 16 == 0 or self._base is None:
            self._refit()

    def seconds(self, rows: int, drafted: int = 0) -> float:
        """A step's time with `rows` target rows and `drafted` requests drafted for (in units of a
        one-row step before any step was observed)."""
        base = self._base or 1.0
        return base * (1 + self._slope * rows) + (self._draft or 0.0) * drafted

    def relative(self, rows: int, more: int) -> float:
        """Time of a step of rows + more rows over that of `rows` rows (drafting aside)."""
        return (1 + self._slope * (rows + more)) / (1 + self._slope * rows)

    def _refit(self) -> None:
        n = len(self._steps)
        xs, ys = [r for r, _ in self._steps], [t for _, t in self._steps]
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        if var >= n * 0.25:                         # steps of several sizes: fit a + b * R
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
            a = my - b * mx
            if a > 0:
                self._slope = max(b / a, MIN_SLOPE)
        self._base = sum(t / (1 + self._slope * r) for r, t in self._steps) / n
