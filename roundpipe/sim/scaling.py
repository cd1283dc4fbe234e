"""`data_parallel(...)`: predicted iteration time and throughput of W RoundPipe ranks.

    from roundpipe.sim import AllReduce, Costs, data_parallel
    costs = Costs.uniform(32, fwd=1e-3, bwd=2e-3, head_fwd=4e-3, head_bwd=8e-3)
    ar = AllReduce.uniform(4, 32, grad_bytes=400e6, head_grad_bytes=2e9, bandwidth_gbps=20, latency_us=10)
    dp = data_parallel("roundpipe-async", costs, workers=8, microbatches=16, allreduce=ar)
    dp.iteration, dp.reduction, dp.exposed, dp.scaling

`microbatches` is per rank (weak scaling: the global batch grows with W), so one
rank's time without any reduction is the baseline: scaling = W * T(1) / T(W),
where T(W) is the per-rank iteration time with the reduction (roundpipe.sim.
roundpipe describes how the synchronous and asynchronous schedules place it).
`exposed` = T(W) - T(1): all of the reduction for the synchronous schedule, the
part the next iterations could not hide for the asynchronous one.
"""
from __future__ import annotations

from dataclasses import dataclass

from roundpipe.core.checks import is_int
from roundpipe.sim.allreduce import AllReduce
from roundpipe.sim.costs import Costs
from roundpipe.sim.simulate import Result, simulate


@dataclass
class DataParallelResult:
    ranks: int
    iteration: float         # seconds per iteration of one rank, reduction included
    single: float            # seconds per iteration of one rank alone (no reduction)
    reduction: float         # seconds of all-reduce per iteration (all buckets)
    buckets: int
    exposed: float           # iteration - single
    samples_per_s: float     # all ranks together
    result: Result           # the simulated rank, reduction included (result.trace() draws it)

    @property
    def scaling(self) -> float:
        """Samples/s of W ranks over one rank's."""
        return self.ranks * self.single / self.iteration if self.iteration > 0 else float(self.ranks)

    @property
    def efficiency(self) -> float:
        return self.scaling / self.ranks

    def summary(self) -> dict:
        """JSON-ready numbers: times in ms, efficiency in percent."""
        return {"ranks": self.ranks, "iteration_ms": 1e3 * self.iteration, "single_rank_ms": 1e3 * self.single,
                "reduction_ms": 1e3 * self.reduction, "buckets": self.buckets, "exposed_ms": 1e3 * self.exposed,
                "samples_per_s": self.samples_per_s, "scaling": self.scaling, "efficiency": 100 * self.efficiency}


def data_parallel(schedule: str, costs: Costs, workers: int, microbatches: int, allreduce: AllReduce,
                  microbatch_size: int = 1, **kwargs) -> DataParallelResult:
    """Simulates one rank with and without the reduction; `kwargs` go to `simulate` (partition, ...).

    `workers` and `microbatches` are per rank; `microbatch_size` (samples) only scales samples_per_s."""
    if not isinstance(allreduce, AllReduce):
        raise TypeError(f"allreduce={allreduce!r} must be a roundpipe.sim.AllReduce")
    if not is_int(microbatch_size) or microbatch_size < 1:
        raise ValueError(f"microbatch_size={microbatch_size!r} must be an int >= 1 (samples per microbatch)")
    single = simulate(schedule, costs, workers, microbatches, **kwargs)
    ranked = simulate(schedule, costs, workers, microbatches, allreduce=allreduce, **kwargs)
    t = ranked.makespan
    exposed = t - single.makespan
    if abs(exposed) <= 1e-9 * single.makespan:  # the same steady state, measured through other task ends
        exposed = 0.0
    samples = allreduce.ranks * microbatches * microbatch_size / t if t > 0 else float("inf")
    return DataParallelResult(allreduce.ranks, t, single.makespan, ranked.reduction, len(allreduce.buckets()),
                              exposed, samples, ranked)
