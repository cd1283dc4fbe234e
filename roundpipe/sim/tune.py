"""Partition choice by simulation: the planner's candidates, ranked by simulated time.

The planner's closed-form objective (M*S + N*(N-1)) * t_max assumes every worker
busy with equal slots; it misses round structure, the fused stage's saved
recompute, communication and iteration overlap.  bench/schedules.py measured what
that costs: for the three model shapes there, the best greedy candidate by
simulated asynchronous time is 1-10% faster than the objective's pick.  Every
threshold of the planner gives one greedy plan (a few dozen distinct ones); this
module simulates each and keeps the fastest.  It costs a few hundred milliseconds
to seconds, so it suits the engine's occasional re-plans, not every iteration.

    from roundpipe.sim.tune import tuned_plan
    replanner = Replanner(profiler, workers=8, microbatches=16, solver=tuned_plan)
"""
from __future__ import annotations

from typing import Sequence

from roundpipe.planner.costs import LayerCost, check_costs
from roundpipe.planner.partition import candidates, check_args, greedy
from roundpipe.planner.plan import Plan
from roundpipe.sim.costs import Costs, sizes_from_plan
from roundpipe.sim.simulate import Result, simulate


def candidate_plans(costs: Sequence[LayerCost], memory_budget: float | None = None) -> list[Plan]:
    """The distinct greedy plans over every threshold the planner considers."""
    costs = check_costs(costs)
    limit = check_args(1, 1, memory_budget)
    plans = {greedy(costs, float(t) * (1 + 1e-12), limit) for t in candidates(costs)}
    return sorted((p for p in plans if p is not None), key=lambda p: len(p.stages()))


def best_partition(costs: Costs, workers: int, microbatches: int, schedule: str = "roundpipe-async",
                   memory_budget: float | None = None, iterations: int = 6,
                   layer_costs: Sequence[LayerCost] | None = None) -> tuple[Plan, Result]:
    """The candidate plan with the shortest simulated iteration.

    Candidates come from `layer_costs` (the planner's view: layers + head, with their
    memory; default `costs.planner_costs()`, which carries no memory sizes, so pass
    them whenever `memory_budget` should bind)."""
    if schedule not in ("roundpipe", "roundpipe-async", "roundpipe-zb"):
        raise ValueError(f"schedule={schedule!r} must be 'roundpipe', 'roundpipe-async' or 'roundpipe-zb'")
    layer_costs = costs.planner_costs() if layer_costs is None else check_costs(layer_costs)
    if len(layer_costs) != costs.num_layers + 1:
        raise ValueError(f"layer_costs has {len(layer_costs)} entries; expected {costs.num_layers + 1} "
                         "(every layer plus the LM head)")
    best = None
    for p in candidate_plans(layer_costs, memory_budget):
        r = simulate(schedule, costs, workers, microbatches, sizes_from_plan(p, costs), iterations=iterations)
        if best is None or r.makespan < best[1].makespan:
            best = (p, r)
    return best


def tuned_plan(costs: Sequence[LayerCost], workers: int, microbatches: int,
               memory_budget: float | None = None, comm: float = 0.0, asynchronous: bool = True) -> Plan:
    """Drop-in for roundpipe.planner.plan (Replanner's `solver`): the last layer is the LM head."""
    costs = check_costs(costs)
    sim_costs = Costs.from_planner(costs, comm)
    schedule = "roundpipe-async" if asynchronous else "roundpipe"
    return best_partition(sim_costs, workers, microbatches, schedule, memory_budget, layer_costs=costs)[0]
