"""Planner: per-layer costs (estimated, then profiled) -> the asymmetric stage plan.

    costs      LayerCost, estimate_costs: the cost model and size-based estimates
    profiler   Profiler: measured stage times attributed to layers, smoothed
    partition  plan / partition: the partitioner of docs/planner.md
    exact      exact_partition: exhaustive reference for small L (tests)
    replanner  Replanner: re-plans only when the costs drift past a threshold
"""
from roundpipe.planner.costs import LayerCost, estimate_costs
from roundpipe.planner.partition import Partition, balanced_split, objective, partition, plan, stage_times
from roundpipe.planner.profiler import Profiler
from roundpipe.planner.replanner import Replanner

__all__ = ["LayerCost", "estimate_costs", "Profiler", "Partition", "partition", "plan", "objective",
           "stage_times", "balanced_split", "Replanner"]
