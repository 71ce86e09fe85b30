"""Planners for tests: fixed step costs and acceptance estimates, given to an engine through
Engine(planner=...), so that what a test sees does not depend on how fast the machine is."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from engine.speculative.cost import StepCost
from engine.speculative.planner import PRIOR_ROW_COST, Planner


class Untimed(StepCost):
    """A step cost that learns nothing from the steps it sees (the machine's timings aside)."""

    def observe(self, *args) -> None:
        pass


def fitted(slope: float, draft: float = 0.0, rows=range(1, 40)) -> Untimed:
    """A fixed cost model that has seen steps of a + b * R seconds (b / a = slope), drafting `draft`
    seconds per request."""
    cost = Untimed(slope)
    for r in list(rows) * 4:
        StepCost.observe(cost, r, 0.01 * (1 + slope * r) + draft, 1 if draft else 0, draft)
    return cost


class Fixed:
    """An acceptance estimate that does not move."""

    def __init__(self, value: float):
        self.value = value

    def record(self, proposed: int, accepted: int) -> None:
        pass


class ScriptedPlanner(Planner):
    """A planner whose acceptance estimates and draft sizes may come from the test."""

    def __init__(self, worker, args, cost: StepCost, estimate=None, sizes=None, **kw):
        self._make_estimate, self._sizes = estimate, sizes
        super().__init__(worker, args, cost, **kw)

    def estimate(self, start, decay=None):
        return self._make_estimate(start, decay) if self._make_estimate else super().estimate(start, decay)

    def sizes(self, alphas, forced, extra):
        return self._sizes(alphas, self.limit) if self._sizes else super().sizes(alphas, forced, extra)


def planner(cost: Optional[Callable[[], StepCost]] = None, estimate: Optional[Callable[..., object]] = None,
            sizes: Optional[Callable[[Sequence[float], int], list[int]]] = None, explore_every: Optional[int] = None,
            made: Optional[list] = None):
    """A planner factory for Engine(planner=...): a fixed `cost()` (by default the device's prior,
    untimed); acceptance estimates from `estimate(start, decay)`; draft sizes from `sizes(alphas,
    limit)` in place of the cost model's; tries every `explore_every` steps. Each planner made is
    appended to `made`."""

    def make(worker, args, kv) -> Planner:
        chosen = cost() if cost else Untimed(PRIOR_ROW_COST[kv.table.device.type])
        kw = {} if explore_every is None else {"explore_every": explore_every}
        one = ScriptedPlanner(worker, args, chosen, estimate, sizes, **kw)
        if made is not None:
            made.append(one)
        return one

    return make


untimed = planner()
