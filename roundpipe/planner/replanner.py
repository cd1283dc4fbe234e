"""`Replanner`: keeps the engine's plan in step with the profiler, without churn.

Re-planning is cheap (milliseconds) but a new plan changes which layers move
together, so the engine should not switch plans on measurement noise.  The
replanner re-plans only when some layer's forward or backward cost has moved by
more than `threshold` (relative) since the costs the current plan was made from;
then it keeps the new plan only if it differs from the current one.  The solver
is roundpipe.planner.plan (the closed-form objective) unless another is given,
e.g. roundpipe.sim.tune.tuned_plan, which ranks candidates by simulation.

    replanner = Replanner(profiler, workers=8, microbatches=16, memory_budget=24 << 30)
    plan = replanner.plan                    # size-based plan before any measurement
    ... each iteration: profiler.record(...) per stage ...
    if replanner.update():                   # True when the plan changed
        plan = replanner.plan
"""
from __future__ import annotations

from typing import Callable, Sequence

from roundpipe.planner.costs import LayerCost
from roundpipe.planner.partition import check_args
from roundpipe.planner.partition import plan as closed_form_plan
from roundpipe.planner.plan import Plan
from roundpipe.planner.profiler import Profiler

# (costs, workers, microbatches, memory_budget) -> Plan: planner.plan, or roundpipe.sim.tune.tuned_plan
Solver = Callable[[Sequence[LayerCost], int, int, "float | None"], Plan]


class Replanner:
    """The current plan for a profiler's costs; re-planned only past a threshold."""

    def __init__(self, profiler: Profiler, workers: int, microbatches: int,
                 memory_budget: float | None = None, threshold: float = 0.1, solver: Solver | None = None):
        if not isinstance(profiler, Profiler):
            raise TypeError(f"profiler={profiler!r} must be a roundpipe.planner.Profiler")
        check_args(workers, microbatches, memory_budget)
        if not threshold > 0:
            raise ValueError(f"threshold={threshold!r} must be > 0 (relative change that triggers a re-plan)")
        self.profiler = profiler
        self.workers, self.microbatches, self.memory_budget = workers, microbatches, memory_budget
        self.threshold = threshold
        self.solver: Solver = solver or closed_form_plan
        self.replans = 0  # how many times the partitioner ran
        self._basis: list[LayerCost] = profiler.costs()
        self._plan = self._solve(self._basis)

    def _solve(self, costs: list[LayerCost]) -> Plan:
        self.replans += 1
        return self.solver(costs, self.workers, self.microbatches, self.memory_budget)

    @property
    def plan(self) -> Plan:
        return self._plan

    def drift(self) -> float:
        """Largest relative change of any layer's fwd/bwd time since the current plan's costs."""
        worst = 0.0
        for old, new in zip(self._basis, self.profiler.costs()):
            for a, b in ((old.fwd_s, new.fwd_s), (old.bwd_s, new.bwd_s)):
                if a > 0:
                    worst = max(worst, abs(b - a) / a)
                elif b > 0:
                    return float("inf")
        return worst

    def keep(self, plan: Plan) -> None:
        """The caller stays on `plan` rather than switching to `self.plan` (e.g. a gain below its
        hysteresis): the basis stays, and the next update reports any candidate that differs from
        `plan`, the one refused now included, so it can be taken once the costs make it worth it."""
        self._plan = plan.check(self.profiler.num_layers)

    def update(self) -> bool:
        """Re-plans if the costs drifted past the threshold; True when the plan changed."""
        if self.drift() <= self.threshold:
            return False
        costs = self.profiler.costs()
        candidate = self._solve(costs)
        self._basis = costs
        if candidate == self._plan:
            return False
        self._plan = candidate
        return True
