"""`simulate(...)`: one call from costs and a schedule name to makespan, bubbles and a trace.

    from roundpipe.sim import Costs, simulate
    costs = Costs.uniform(28, fwd=1e-3, bwd=2e-3, head_fwd=4e-3, head_bwd=8e-3, comm=1e-4)
    r = simulate("roundpipe-async", costs, workers=8, microbatches=16)
    r.makespan, r.bubbles.ratio, r.trace().save("sim.json")

Partitions: static schedules take stage sizes (default: balanced, see
static.default_sizes); RoundPipe takes (forward sizes, backward sizes) with the
fused stage first, or a `Plan` over `costs.planner_costs()` (default: the planner's).
Zero Bubble schedules (roundpipe.sim.zerobubble: "zb-h1", "zb-h2", "zb-v") take
stage sizes like the static ones (zb-v: two chunks per worker) and split each
backward into B and W by `costs.w_fraction`; "roundpipe-zb" is synchronous
RoundPipe with that split (roundpipe.sim.roundpipe).  `Result.span_bubble` is the
Zero Bubble paper's bubble rate (largest worker span over its work).
For "roundpipe-async" the reported makespan is the steady-state time per
iteration, measured between the ends of the second and of the second-to-last of
`iterations` overlapping iterations, and the bubbles are those of that window.

`allreduce` (RoundPipe only) adds the gradient all-reduce of data-parallel ranks
(roundpipe.sim.roundpipe); the makespan is then one rank's iteration time with it.
roundpipe.sim.scaling.data_parallel compares that with one rank.

`uploads` (RoundPipe only, roundpipe.sim.uploads) models each slot's weight
upload as bytes over a PCIe bandwidth on a copy worker per GPU, overlapping the
previous slot's compute; `Result.upload_bytes` is what crosses PCIe per iteration
(all GPUs).  Without it weights are assumed on the GPU in time.

`host_step` (RoundPipe only, roundpipe.sim.hoststep) adds the optimizer step on
the host, whole or per layer; "roundpipe" then also runs `iterations` iterations
(each waiting for the previous one's updates) and reports the steady-state time
per iteration like "roundpipe-async" (one step stale).  `Result.host_step` is the
step's seconds per iteration; host_step (below) gives the exposed part.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from roundpipe.core.checks import is_int
from roundpipe.planner.plan import Plan
from roundpipe.sim.allreduce import AllReduce
from roundpipe.sim.costs import Costs, sizes_from_plan
from roundpipe.sim.events import Run
from roundpipe.sim.events import simulate as run_schedule
from roundpipe.sim.hoststep import HostStep
from roundpipe.sim.metrics import Bubbles, bubbles, span_bubble
from roundpipe.sim.roundpipe import roundpipe_schedule
from roundpipe.sim.static import STATIC, default_sizes, static_schedule
from roundpipe.sim.uploads import Uploads
from roundpipe.sim.zerobubble import ZERO_BUBBLE, zero_bubble_schedule
from roundpipe.trace import Trace

SCHEDULES = STATIC + ZERO_BUBBLE + ("roundpipe", "roundpipe-async", "roundpipe-zb")


@dataclass
class Result:
    schedule: str
    run: Run
    makespan: float           # seconds per iteration (steady state for roundpipe-async)
    bubbles: Bubbles
    exposed_comm: float       # summed seconds workers waited only for communication, per iteration
    partition: object         # stage sizes, or (forward sizes, backward sizes) for RoundPipe
    reduction: float = 0.0    # seconds of gradient all-reduce per iteration (data parallel; 0 for one rank)
    upload_bytes: float = 0.0 # bytes uploaded over PCIe per iteration, all GPUs (0 without `uploads`)
    host_step: float = 0.0    # seconds of host optimizer step per iteration (0 without `host_step`)

    @property
    def span_bubble(self) -> float:
        """The Zero Bubble paper's bubble rate (its section 5.3): (cost - work) / cost, cost the longest
        worker span (first start to last end), work that worker's busy time."""
        return span_bubble(self.run)

    def trace(self) -> Trace:
        return self.run.trace()

    def summary(self) -> dict:
        """JSON-ready numbers: times in ms, ratios in percent of makespan x workers."""
        capacity = self.makespan * self.bubbles.workers or 1.0
        return {"schedule": self.schedule, "makespan_ms": 1e3 * self.makespan, **self.bubbles.percent(),
                "exposed_comm_ms": 1e3 * self.exposed_comm, "exposed_comm": 100 * self.exposed_comm / capacity,
                "span_bubble": 100 * self.span_bubble, "partition": self.partition}


def roundpipe_sizes(costs: Costs, workers: int, microbatches: int,
                    memory_budget: float | None = None) -> tuple[list[int], list[int]]:
    """The planner's partition for `costs`, as RoundPipe stage sizes."""
    from roundpipe.planner.partition import plan

    return sizes_from_plan(plan(costs.planner_costs(), workers, microbatches, memory_budget), costs)


def simulate(schedule: str, costs: Costs, workers: int, microbatches: int,
             partition: Sequence[int] | tuple[Sequence[int], Sequence[int]] | Plan | None = None,
             chunks: int = 2, iterations: int = 6, round_size: int | None = None,
             allreduce: AllReduce | None = None, uploads: Uploads | None = None,
             host_step: HostStep | None = None) -> Result:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    if not isinstance(costs, Costs):
        raise TypeError(f"costs={costs!r} must be a roundpipe.sim.Costs")
    for name, v in (("workers", workers), ("microbatches", microbatches), ("chunks", chunks),
                    ("iterations", iterations)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if allreduce is not None and not isinstance(allreduce, AllReduce):
        raise TypeError(f"allreduce={allreduce!r} must be a roundpipe.sim.AllReduce or None")
    if uploads is not None and not isinstance(uploads, Uploads):
        raise TypeError(f"uploads={uploads!r} must be a roundpipe.sim.Uploads or None")
    if host_step is not None and not isinstance(host_step, HostStep):
        raise TypeError(f"host_step={host_step!r} must be a roundpipe.sim.HostStep or None")
    if schedule in STATIC + ZERO_BUBBLE:
        if allreduce is not None:
            raise ValueError(f"allreduce is modelled for 'roundpipe' and 'roundpipe-async' only, not {schedule!r}")
        if uploads is not None:
            raise ValueError(f"uploads are modelled for the RoundPipe schedules only; {schedule!r} binds weights "
                             "to GPUs (nothing is uploaded per stage)")
        if host_step is not None:
            raise ValueError(f"host_step is modelled for the RoundPipe schedules only, not {schedule!r}")
        if schedule in ZERO_BUBBLE:
            sizes = list(partition) if partition is not None else default_sizes(schedule, costs, workers, 2)
            sched = zero_bubble_schedule(schedule, costs, workers, microbatches, sizes)
        else:
            sizes = list(partition) if partition is not None else default_sizes(schedule, costs, workers, chunks)
            sched = static_schedule(schedule, costs, workers, microbatches, sizes)
        run = run_schedule(sched, costs.comm)
        b = bubbles(run.trace(), (0.0, run.makespan))
        return Result(schedule, run, run.makespan, b, sum(run.exposed), sizes)
    if partition is None:
        fwd, bwd = roundpipe_sizes(costs, workers, microbatches)
    elif isinstance(partition, Plan):
        fwd, bwd = sizes_from_plan(partition, costs)
    else:
        if not (isinstance(partition, (tuple, list)) and len(partition) == 2):
            raise TypeError(f"partition={partition!r} for RoundPipe must be (forward sizes, backward sizes) or a Plan")
        fwd, bwd = list(partition[0]), list(partition[1])
    if not costs.recompute:
        raise ValueError(f"costs.recompute=False: {schedule} always recomputes (only stage inputs are kept)")
    flowing = schedule == "roundpipe-async" or host_step is not None
    n_it = iterations if flowing else 1
    if flowing and n_it < 4:
        raise ValueError(f"iterations={iterations} must be >= 4 for roundpipe-async or a host_step (the first and "
                         "last are left out of the steady-state window)")
    run = run_schedule(roundpipe_schedule(costs, workers, microbatches, fwd, bwd, n_it, round_size,
                                          allreduce=allreduce, split_w=schedule == "roundpipe-zb", uploads=uploads,
                                          host_step=host_step, lag=2 if schedule == "roundpipe-async" else 1),
                       costs.comm)
    stepped = host_step.time() if host_step is not None else 0.0
    gpus = [run.worker_name(w) for w in range(workers)] if host_step is not None else None
    reduction = allreduce.time() if allreduce is not None else 0.0
    uploaded = run.schedule.meta.get("upload_bytes", 0.0) / n_it
    if n_it == 1:
        b = bubbles(run.trace(), (0.0, run.makespan))
        return Result(schedule, run, run.makespan, b, sum(run.exposed), (fwd, bwd), reduction, uploaded, stepped)
    ends = [0.0] * n_it
    for i, t in enumerate(run.schedule.tasks):
        ends[t.iteration] = max(ends[t.iteration], run.end[i])
    # Skip the first iteration (no predecessor: it runs unusually fast) and the last one
    # (its tail runs alone); the window between holds n_it - 3 periods of steady state.
    # An iteration ends with its all-reduce, if any: when the reductions are the bottleneck,
    # their ends are the ones spaced exactly one reduction apart.
    window = (ends[1], ends[-2])
    b = bubbles(run.trace(), window, gpus)
    per_it = (window[1] - window[0]) / (n_it - 3)
    exposed = sum(x for i, x in enumerate(run.exposed) if window[0] <= run.start[i] < window[1]) / (n_it - 3)
    return Result(schedule, run, per_it, b, exposed, (fwd, bwd), reduction, uploaded, stepped)


@dataclass
class HostStepResult:
    iteration: float     # seconds per iteration with the step
    baseline: float      # seconds per iteration with the same schedule and an instantaneous step
    step: float          # seconds of step work per iteration (HostStep.time)
    result: object       # the simulate() Result with the step (result.trace() draws it)

    @property
    def exposed(self) -> float:
        """Seconds per iteration the step adds: iteration - baseline."""
        return self.iteration - self.baseline

    def summary(self) -> dict:
        """JSON-ready numbers, times in ms."""
        return {"iteration_ms": 1e3 * self.iteration, "baseline_ms": 1e3 * self.baseline,
                "step_ms": 1e3 * self.step, "exposed_ms": 1e3 * self.exposed, "disk_ms": 1e3 * self.disk}

    @property
    def disk(self) -> float:
        """Seconds per iteration the drive works for the step (0 without a disk)."""
        d = self.result.run.schedule.meta.get("disk")
        return d.time() if d is not None else 0.0


def host_step(schedule: str, costs, workers: int, microbatches: int, step: HostStep, **kwargs) -> HostStepResult:
    """Simulates `schedule` ("roundpipe" or "roundpipe-async") with `step` and with an instantaneous one
    (no disk either).

    `kwargs` go to `simulate` (partition, iterations, uploads, ...)."""
    if not isinstance(step, HostStep):
        raise TypeError(f"step={step!r} must be a roundpipe.sim.HostStep")
    timed = simulate(schedule, costs, workers, microbatches, host_step=step, **kwargs)
    free = simulate(schedule, costs, workers, microbatches,
                    host_step=replace(step, params=(0.0,) * len(step.params), disk=None), **kwargs)
    t, base = timed.makespan, free.makespan
    if abs(t - base) <= 1e-9 * base:   # the same steady state, measured through other task ends
        t = base
    return HostStepResult(t, base, step.time(), timed)
