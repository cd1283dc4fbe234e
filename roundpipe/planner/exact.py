"""Exhaustive reference solver for the partitioning objective (tests only; small L).

Enumerates every fused boundary and, for the layers before it, every composition
into forward stages and every composition into backward stages (2^(a-1) each),
so it shares no reasoning with the greedy/threshold search of partition.py.
For each boundary it keeps the smallest possible bottleneck per stage count, then
combines forward and backward counts.  About 2 * 2^(L-1) compositions: L <= 14.
"""
from __future__ import annotations

from typing import Sequence

from roundpipe.planner.costs import LayerCost, backward_memory, backward_time, check_costs, forward_memory, forward_time
from roundpipe.planner.partition import Partition, check_args, objective, one_stage_partition, stage_times
from roundpipe.planner.plan import Plan

MAX_LAYERS = 14


def _compositions(n: int):
    """Every way to cut [0, n) into consecutive non-empty ranges."""
    if n == 0:
        yield []
        return
    for mask in range(1 << (n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        yield [range(cuts[k], cuts[k + 1]) for k in range(len(cuts) - 1)]


def _best_by_count(n: int, time, memory, mem_limit: float) -> dict[int, tuple[float, list[range]]]:
    best: dict[int, tuple[float, list[range]]] = {}
    for parts in _compositions(n):
        if any(memory(r) > mem_limit for r in parts):
            continue
        t = max((time(r) for r in parts), default=0.0)
        if len(parts) not in best or t < best[len(parts)][0]:
            best[len(parts)] = (t, parts)
    return best


def exact_partition(costs: Sequence[LayerCost], workers: int, microbatches: int,
                    memory_budget: float | None = None, round_size: int | None = None) -> Partition:
    """The optimal plan by exhaustive search; ValueError when L > MAX_LAYERS or nothing fits."""
    costs = check_costs(costs)
    mem_limit = check_args(workers, microbatches, memory_budget)
    L = len(costs)
    if L > MAX_LAYERS:
        raise ValueError(f"len(costs)={L} is too many for the exhaustive solver (at most {MAX_LAYERS})")
    ftime = lambda r: forward_time(costs, r)
    btime = lambda r: backward_time(costs, r)
    fmem = lambda r: forward_memory(costs, r)
    bmem = lambda r: backward_memory(costs, r)
    # one stage where it may take the whole budget; else judged below against half of it
    best: Partition | None = one_stage_partition(costs, workers, microbatches, memory_budget, round_size)
    for a in range(L - 1, -1, -1):
        fused = range(a, L)
        if backward_memory(costs, fused, fused=True) > mem_limit:   # the loss's workspace at its top
            break  # a longer fused stage only needs more memory
        fwd = _best_by_count(a, ftime, fmem, mem_limit)
        bwd = _best_by_count(a, btime, bmem, mem_limit)
        for _tf, fparts in fwd.values():
            for _tb, bparts in bwd.values():
                plan = Plan(forward=fparts, backward=[fused] + bparts[::-1])
                obj = objective(plan, costs, workers, microbatches, round_size)
                if best is None or obj < best.objective:
                    best = Partition(plan, max(stage_times(plan, costs)), obj)
    if best is None:
        raise ValueError(f"memory_budget={memory_budget!r}: no partition fits half the budget per stage")
    return best

