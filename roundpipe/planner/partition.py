"""The partitioner (docs/planner.md): per-layer costs -> an asymmetric `Plan`.

Objective, for N workers and M microbatches: minimise

    (M * S + N * (N - 1)) * t_max

over the stage count S (forward + backward stages, fused tail included) and the
largest per-microbatch stage time t_max, with each stage's memory at most half the
device budget (the other half holds the prefetched next stage).

For a threshold T, greedy scans give the fewest stages whose times are all <= T:
fill the fused tail first (the longest suffix that fits; a longer fused stage only
leaves fewer layers for the others), then pack backward stages from the fused
boundary down and forward stages from layer 0 up.  Greedy packing is optimal for
"fewest contiguous parts under a per-part bound" because a part's time and memory
only grow as it gains layers.  The optimum's t_max is the time of one of its
stages, i.e. a contiguous-run sum of forward or backward times, so trying every
such candidate T (O(L^2) of them, O(L) each) finds the exact optimum: O(L^3).

Since S(T) never increases with T, only the smallest T of each stage count can be
optimal; bisection over the sorted candidates finds those breakpoints with
O(L log L) scans instead of O(L^2).  Measured on this repository's dev machine:
94 layers plan in ~0.02 s (2 shared cores; the paper quotes ~1.5 s for O(L^3)).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from roundpipe.planner.costs import LayerCost, backward_memory, backward_time, check_costs, forward_time
from roundpipe.planner.memory import BackwardFootprint, ForwardFootprint, beside_bytes, layer_memory
from roundpipe.planner.plan import Plan


@dataclass(frozen=True)
class Partition:
    """A plan with its predicted per-microbatch bottleneck and objective value."""

    plan: Plan
    t_max: float       # largest per-microbatch stage time (seconds)
    objective: float   # (M * S + N * (N - 1)) * t_max


class LayerTooLarge(ValueError):
    """One layer alone does not fit a backward stage within the stage limit (half the memory budget, or
    `cap_stage_limit`'s larger one)."""

    def __init__(self, layer: int, need: float, limit: float, budget: float | None):
        self.layer, self.need, self.limit, self.budget = layer, need, limit, budget
        super().__init__(f"memory_budget={budget!r}: layer {layer} alone needs {need:.0f} bytes in a backward "
                         f"stage, more than a stage may hold ({limit:.0f}); raise the budget or split the layer")


def check_args(workers: int, microbatches: int, memory_budget: float | None) -> float:
    """Validates the shared planner arguments; returns the per-stage memory limit."""
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be an int >= 1")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be an int >= 1")
    if memory_budget is None:
        return math.inf
    if not memory_budget > 0:
        raise ValueError(f"memory_budget={memory_budget!r} must be > 0 bytes (or None for unlimited)")
    return memory_budget / 2


def stage_times(plan: Plan, costs: Sequence[LayerCost]) -> list[float]:
    """Per-microbatch time of each stage, in `plan.stages()` order."""
    return [forward_time(costs, r) if kind == "F" else backward_time(costs, r) for kind, r in plan.stages()]


def objective(plan: Plan, costs: Sequence[LayerCost], workers: int, microbatches: int,
              round_size: int | None = None) -> float:
    """N times the predicted iteration length (docs/planner.md "The objective"); `round_size`: microbatches
    per round (None: the engine's default, workers + 1)."""
    plan.check(len(costs))
    stages = len(plan.stages())
    if stages == 1:   # one stage: no pipeline to fill; round r runs on worker r mod N, all in parallel
        return workers * most_per_worker(workers, microbatches, round_size) * max(stage_times(plan, costs))
    return (microbatches * stages + workers * (workers - 1)) * max(stage_times(plan, costs))


def most_per_worker(workers: int, microbatches: int, round_size: int | None = None) -> int:
    """The most microbatches one worker runs when each round goes to the next worker in turn (a plan of one
    stage, roundpipe/engine/calls/dispatcher.py)."""
    r = _round_size(workers, round_size)
    sizes = [min(r, microbatches - start) for start in range(0, microbatches, r)]
    return max(sum(sizes[w::workers]) for w in range(workers))


def one_stage(costs: Sequence[LayerCost]) -> Plan:
    """The plan of a single fused stage: every layer's forward, the loss and the backward back to back,
    nothing recomputed (plain PyTorch's work per microbatch)."""
    return Plan(forward=[], backward=[range(0, len(costs))])


def one_stage_bytes(costs: Sequence[LayerCost]) -> float:
    """Device bytes of `one_stage`'s stage for one microbatch, its input included.  Where a call has no
    more rounds than workers (`one_stage_fits`), each worker runs it at most once per call, with no
    neighbouring stage of the call beside it, so it may take the whole budget, not half."""
    return backward_memory(costs, range(0, len(costs)), fused=True) + layer_memory(costs)[0].in_bytes


def one_stage_fits(costs: Sequence[LayerCost], workers: int, microbatches: int, memory_budget: float | None,
                   round_size: int | None = None) -> bool:
    """`one_stage` within the whole budget, each worker running it at most once per call."""
    return (memory_budget is not None and -(-microbatches // _round_size(workers, round_size)) <= workers
            and one_stage_bytes(costs) <= memory_budget)


def one_stage_partition(costs: Sequence[LayerCost], workers: int, microbatches: int, memory_budget: float | None,
                        round_size: int | None = None) -> Partition | None:
    """`one_stage`, scored, where it may take the whole budget (`one_stage_fits`); None elsewhere, where the
    search judges it against the stage limit like any plan."""
    if not one_stage_fits(costs, workers, microbatches, memory_budget, round_size):
        return None
    plan = one_stage(costs)
    return Partition(plan, backward_time(costs, range(0, len(costs))),
                     objective(plan, costs, workers, microbatches, round_size))


def _round_size(workers: int, round_size: int | None) -> int:
    """Microbatches per round: `round_size`, or the engine's default of workers + 1."""
    return workers + 1 if round_size is None else round_size


def _pack(order: range, t: float, mem_limit: float, times: list[float], params: list[float],
          footprint: Callable[[int], Any]) -> list[range] | None:
    """Fewest contiguous parts of the layers in `order` (scanned in that direction), each with
    time <= t and memory <= mem_limit; None if a layer alone does not fit.  Memory is
    sum(params) plus the activation footprint `footprint(first)` (planner/memory.py), grown by `.add`."""
    parts: list[range] = []
    step = order.step
    begin = acts = None
    time = param = 0.0
    for i in order:
        if begin is not None:
            grown = copy.copy(acts)
            grown.add(i)
            nt, np_ = time + times[i], param + params[i]
            if nt <= t and np_ + grown.bytes <= mem_limit:
                time, param, acts = nt, np_, grown
                continue
            parts.append(range(begin, i) if step > 0 else range(i + 1, begin + 1))
        acts = footprint(i)
        if times[i] > t or params[i] + acts.bytes > mem_limit:
            return None
        begin, time, param = i, times[i], params[i]
    if begin is not None:
        parts.append(range(begin, order.stop) if step > 0 else range(order.stop + 1, begin + 1))
    return parts


def greedy(costs: Sequence[LayerCost], t: float, mem_limit: float = math.inf, layer_grain: bool = False) -> Plan | None:
    """The plan with the fewest stages whose times are all <= t (None when none exists); `layer_grain`:
    backward stages recompute a layer at a time (planner/memory.py), so their activations are one layer's."""
    L = len(costs)
    fwd = [c.fwd_s for c in costs]
    bwd = [c.bwd_s for c in costs]
    bparam = [c.param_bytes + c.grads for c in costs]
    fparam = [float(c.param_bytes) for c in costs]
    mem = layer_memory(costs)
    # The fused tail: the longest suffix that fits, at least the last layer.
    a, time, param = L, 0.0, 0.0
    tail = BackwardFootprint(mem, L - 1, fused=True)
    while a > 0 and time + bwd[a - 1] <= t:
        grown = tail
        if a < L:
            grown = copy.copy(tail)
            grown.add(a - 1)
        if param + bparam[a - 1] + grown.bytes > mem_limit:
            break
        a, tail = a - 1, grown
        time, param = time + bwd[a], param + bparam[a]
    if a == L:
        return None
    backward = _pack(range(a - 1, -1, -1), t, mem_limit, bwd, bparam,
                     lambda i: BackwardFootprint(mem, i, layer_grain=layer_grain))
    forward = _pack(range(0, a), t, mem_limit, fwd, fparam, lambda i: ForwardFootprint(mem, i))
    if backward is None or forward is None:
        return None
    return Plan(forward=forward, backward=[range(a, L)] + backward)


def candidates(costs: Sequence[LayerCost]) -> np.ndarray:
    """Every contiguous-run sum of forward and of backward times, sorted and unique."""
    out = []
    for values in ([c.fwd_s for c in costs], [c.bwd_s for c in costs]):
        prefix = np.concatenate([[0.0], np.cumsum(values)])
        diff = prefix[None, :] - prefix[:, None]
        out.append(diff[np.triu_indices(len(prefix), k=1)])
    return np.unique(np.concatenate(out))


def partition(costs: Sequence[LayerCost], workers: int, microbatches: int,
              memory_budget: float | None = None, stage_limit: float | None = None,
              layer_grain: bool = False, round_size: int | None = None) -> Partition:
    """The optimal plan under the objective above (see the module docstring); each stage within
    `stage_limit` bytes (default: half the memory budget; a plan of one stage: `one_stage_fits`);
    `layer_grain`: see `greedy`; `round_size`: see `objective`."""
    costs = check_costs(costs)
    mem_limit = check_args(workers, microbatches, memory_budget)
    if stage_limit is not None and memory_budget is not None:
        mem_limit = stage_limit
    whole = one_stage_partition(costs, workers, microbatches, memory_budget, round_size)   # not bound by half
    cand = candidates(costs)
    # Tolerance so a candidate equal to a stage's sum still admits it after float reordering.
    cand = cand * (1 + 1e-12) + 1e-300
    cache: dict[int, Plan | None] = {}

    def at(i: int) -> Plan | None:
        if i not in cache:
            cache[i] = greedy(costs, float(cand[i]), mem_limit, layer_grain)
        return cache[i]

    count = lambda i: math.inf if at(i) is None else len(at(i).stages())
    if at(len(cand) - 1) is None:
        if whole is not None:
            return whole
        need = [backward_memory(costs, range(i, i + 1), fused=i == len(costs) - 1, layer_grain=layer_grain)
                for i in range(len(costs))]
        worst = max(range(len(costs)), key=need.__getitem__)
        raise LayerTooLarge(worst, need[worst], mem_limit, memory_budget)
    lo, hi = 0, len(cand) - 1
    while lo < hi:  # first feasible candidate (feasibility is monotone in T)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if at(mid) is not None else (mid + 1, hi)
    breakpoints = [lo]

    def split(i: int, j: int) -> None:
        if count(i) == count(j):
            return
        if j == i + 1:
            breakpoints.append(j)
            return
        mid = (i + j) // 2
        split(i, mid)
        split(mid, j)

    split(lo, len(cand) - 1)
    best = whole
    for i in breakpoints:
        p = at(i)
        obj = objective(p, costs, workers, microbatches, round_size)
        if best is None or obj < best.objective:
            best = Partition(p, max(stage_times(p, costs)), obj)
    return best


def cap_stage_limit(costs: Sequence[LayerCost], memory_budget: float, prefetch: bool = False) -> float:
    """The most one stage may hold under a device cap of `memory_budget` bytes, the engine's rule: half
    the cap (the other half holds what its neighbouring stages leave on the worker), or, when that is
    more, the cap less what the largest one-layer neighbour holds (`memory.beside_bytes`; `prefetch`:
    workers that prefetch the next stage).  A layer whose backward stage needs more is refused."""
    return max(memory_budget / 2, memory_budget - beside_bytes(check_costs(costs), prefetch))


def partition_for_cap(costs: Sequence[LayerCost], workers: int, microbatches: int,
                      memory_budget: float | None = None, prefetch: bool = False,
                      layer_grain: bool = False, round_size: int | None = None) -> Partition:
    """`partition` for a device cap: each stage within half the budget; when one layer does not fit that,
    within `cap_stage_limit`.  The schedule's predicted peaks are checked against the cap after
    (memory.worker_peaks).  LayerTooLarge names the last limit tried."""
    try:
        return partition(costs, workers, microbatches, memory_budget, layer_grain=layer_grain, round_size=round_size)
    except LayerTooLarge as e:
        limit = cap_stage_limit(costs, memory_budget, prefetch)
        if limit <= e.limit:
            raise
        return partition(costs, workers, microbatches, memory_budget, stage_limit=limit, layer_grain=layer_grain,
                         round_size=round_size)


def plan(costs: Sequence[LayerCost], workers: int, microbatches: int,
         memory_budget: float | None = None) -> Plan:
    """`partition(...).plan`: the plan the engine should run."""
    return partition(costs, workers, microbatches, memory_budget).plan


def balanced_split(weights: Sequence[float], parts: int) -> list[int]:
    """Sizes of `parts` contiguous groups of `weights` minimising the largest group sum.

    For the weight-bound (static) schedules the simulator compares against; exact
    O(parts * L^2) dynamic programme."""
    L = len(weights)
    if not isinstance(parts, int) or not 1 <= parts <= L:
        raise ValueError(f"parts={parts!r} must be an int in [1, {L}] (one layer per part at least)")
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full((parts + 1, L + 1), np.inf)
    cut = np.zeros((parts + 1, L + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, L + 1):
            i = np.arange(k - 1, j)
            vals = np.maximum(best[k - 1, i], prefix[j] - prefix[i])
            m = int(np.argmin(vals))
            best[k, j], cut[k, j] = vals[m], i[m]
    sizes, j = [], L
    for k in range(parts, 0, -1):
        sizes.append(int(j - cut[k, j]))
        j = int(cut[k, j])
    return sizes[::-1]
