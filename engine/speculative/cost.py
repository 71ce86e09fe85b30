"""StepCost: what a decode forward of R rows costs (every tree node of every request is a row), fitted
as a + b * R to the step times the scheduler observes, so that draft sizes can weigh a longer draft
against the time its rows add on this machine. On a CPU each extra row adds a noticeable share of a
step (the weight kernels are compute-bound past one row); on a GPU next to nothing, until the batch is
large. Until the observed steps span several row counts, the prior slope stands in."""

from __future__ import annotations

from collections import deque

WINDOW = 256
MIN_SLOPE = 0.002                 # rows are never free: keeps a noisy fit from drafting without bound


class StepCost:
    def __init__(self, prior_slope: float):
        """prior_slope: b / a, the share of a one-row step each further row adds, before measurements."""
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._fit: tuple[float, float] = (1.0, prior_slope)

    def observe(self, rows: int, seconds: float) -> None:
        self._steps.append((rows, seconds))
        if len(self._steps) % 16 == 0:
            self._refit()

    def relative(self, rows: int, more: int) -> float:
        """Time of a step of rows + more rows over that of `rows` rows."""
        a, b = self._fit
        return (a + b * (rows + more)) / (a + b * rows)

    def _refit(self) -> None:
        n = len(self._steps)
        xs, ys = [r for r, _ in self._steps], [t for _, t in self._steps]
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        if var < n * 0.25:                          # all steps about the same size: nothing to fit
            return
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        a = my - b * mx
        if a <= 0:
            return
        self._fit = (1.0, max(b / a, MIN_SLOPE))
