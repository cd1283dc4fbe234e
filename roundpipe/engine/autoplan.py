"""The engine's planning policy: which plan a `RoundPipe` runs, and when that may change.

Without an explicit `plan=`, the plan comes from the partitioner (roundpipe.planner,
docs/planner.md) and follows the measured costs:

    construction      plan from parameter sizes only (no input seen yet)
    first call        size-based estimate: a dry run of the layers on the first
                      microbatch (roundpipe/engine/dry_run.py; on the CPU for CPU
                      workers, else on the meta device)
                      gives per-layer FLOPs, parameter bytes and saved-activation bytes
                      (fallback: parameter counts x tokens; one worker without a
                      budget takes that estimate at once, see whole_batch)
    training calls    after `warmup` calls, the next `profile` calls are timed through
                      the stage_timing seam and folded into the Profiler; after each
                      one the Replanner re-solves only if some layer's cost moved by
                      more than `threshold` since the costs of the current plan
    later calls       no timing, no re-planning (`profile=None` keeps profiling)

A new plan takes effect only at the start of a call (`before_call`), under the
model's API lock with no iteration in flight.  That is a safe point even with an
asynchronous step pending: every piece of the per-layer protocol
(roundpipe.engine.step.async_step.LayerSync) counts per layer and per call (uploads expected,
gradient writes per round, stale windows in calls), the replicas are one per layer
and worker, and the schedule, saved points and board are rebuilt for every call, so
no state depends on which layers the previous call grouped together.

Stage timings include waiting for inputs from other workers.  `stage_seconds`
removes it: a forward (or fused) stage-microbatch cannot start before the stage
that produced its input finished, and a backward one recomputes first, then waits
for the output gradient; the waiting part is not charged to the stage's layers.
Workers that share a random generator (CPU workers; one GPU listed twice) take
turns running forward segments (roundpipe/workers/rng.py), a wait the seam cannot
see that also fakes input waits (B2 holds the generator, so B3 finishes late, so
B2 seems to have waited for B3's gradient); there the raw times are used.  Either
way a call contributes each stage's fastest microbatch: every microbatch does the
same work and waits only ever add time.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from roundpipe.core.checks import is_int
from roundpipe.core.tree import tree_leaves
from roundpipe.engine.dry_run import RATES, dry_run_costs
from roundpipe.planner import LayerCost, Profiler, Replanner, estimate_costs, objective
from roundpipe.planner.memory import LayerMemory, layer_memory
from roundpipe.planner.partition import LayerTooLarge, one_stage_bytes, partition_for_cap
from roundpipe.planner.plan import Plan

PHASES = {"F": "forward", "B": "backward", "fused": "fused"}
Timer = Callable[[str, range, float], float]


@dataclass(frozen=True)
class PlanningConfig:
    """How the engine chooses and revises its plan when none is given."""

    enabled: bool = True          # False: the fixed rule of dispatcher.default_plan, never changed
    threshold: float = 0.1        # relative change of a layer's cost that triggers a re-plan
    warmup: int = 1               # first training calls not timed (allocation, lazy init)
    profile: int | None = 8       # training calls timed after the warmup; None: all of them
    memory_budget: int | Literal["device"] | None = "device"
    #   bytes per device, half of it per stage (the other half holds the prefetched next stage);
    #   "device": the smallest CUDA device's memory, unlimited (None) on CPU workers
    alpha: float = 0.3            # weight of a new timing in the profiler's moving average
    timer: Timer | None = None    # (phase kind, layers, seconds) -> seconds; replaces timings (tests)

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise TypeError(f"PlanningConfig.enabled={self.enabled!r} must be a bool")
        if not isinstance(self.threshold, (int, float)) or not self.threshold > 0:
            raise ValueError(f"PlanningConfig.threshold={self.threshold!r} must be a number > 0")
        for name in ("warmup", "profile"):
            v = getattr(self, name)
            if not (v is None and name == "profile") and (not is_int(v) or v < 0):
                raise ValueError(f"PlanningConfig.{name}={v!r} must be an int >= 0"
                                 + (" or None" if name == "profile" else ""))
        mb = self.memory_budget
        if not (mb is None or mb == "device" or (is_int(mb) and mb > 0)):
            raise ValueError(f"PlanningConfig.memory_budget={mb!r} must be an int > 0 (bytes), 'device' or None")
        if not isinstance(self.alpha, (int, float)) or not 0 < self.alpha <= 1:
            raise ValueError(f"PlanningConfig.alpha={self.alpha!r} must be in (0, 1]")
        if self.timer is not None and not callable(self.timer):
            raise TypeError(f"PlanningConfig.timer must be callable or None, got {type(self.timer).__name__}")


def device_budget(devices: Sequence[torch.device]) -> int | None:
    """Memory of the smallest CUDA device of the pool; None (unlimited) for CPU workers."""
    if devices[0].type != "cuda":
        return None
    return min(torch.cuda.get_device_properties(d).total_memory for d in devices)


def _on_meta(layers: Sequence[nn.Module], sample: tuple[tuple, dict]) -> bool:
    tensors = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())]
    tensors += [t for t in tree_leaves(sample) if isinstance(t, torch.Tensor)]
    return any(t.is_meta for t in tensors)


def size_costs(layers: Sequence[nn.Module], sample: tuple[tuple, dict] | None, dtype: torch.dtype,
               device_type: str, loss: tuple[Callable, Any] | None = None, dry_run: bool = True) -> list[LayerCost]:
    """Per-layer costs before anything is measured (see the module docstring).

    The dry run that gives FLOPs and activation bytes runs on the meta device for GPU workers
    and on the CPU for CPU workers.  Why: torch registers Python meta kernels for most aten ops,
    wrapped in torch._disable_dynamo, whose first call imports torch._dynamo and sympy: 1.1-2.7 s
    (2-core CPU, torch 2.13, load-dependent) against a 0.2 s forward+backward of the
    `roundpipe train` default model.  CPU workers can run the layers anyway, and one forward of
    the first microbatch costs about one forward stage of the call it plans (60 ms there, most
    of it the dispatch mode's per-op Python).  It runs under the math attention backend, the
    only one the meta device has, so both ways count the same FLOPs and saved bytes (except
    that layer norms in bf16 keep fp32 statistics on the CPU); the CPU generator's state is
    restored after it (dropout).  Meta tensors in the layers or the sample take the meta path.
    `loss`: (loss_fn, the first microbatch's labels) of a training call, whose workspace the fused
    stage's memory includes (roundpipe/engine/memory_probe.py).  dry_run=False skips the dry run: parameter
    counts x the sample's tokens, no activation bytes (whole_batch, for one worker without a budget).
    """
    if sample is not None and dry_run:
        rates = RATES.get(device_type, RATES["cpu"])
        try:
            if device_type == "cpu" and not _on_meta(layers, sample):
                with torch.random.fork_rng(devices=[]), sdpa_kernel(SDPBackend.MATH):
                    return dry_run_costs(layers, sample, dtype, rates, "cpu", loss)
            return dry_run_costs(layers, sample, dtype, rates, "meta", loss)
        except Exception as e:  # noqa: BLE001 - a layer that cannot run there: fall back to sizes, loudly
            warnings.warn(f"roundpipe planner: the dry run of the first microbatch failed ({type(e).__name__}: {e}); "
                          "planning from parameter counts, without activation bytes, so a device-memory cap "
                          "bounds only weights and gradients", stacklevel=2)
    tokens = 1
    if sample is not None:   # leading dims of the widest input, e.g. (batch, seq) of token ids
        for t in tree_leaves(sample):
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                tokens = max(tokens, t.numel() // (t.shape[-1] if t.is_floating_point() and t.dim() > 1 else 1))
    return estimate_costs(list(layers), tokens=tokens, param_bytes_each=dtype.itemsize)


def stage_seconds(events: list[tuple], plan: Plan, costs: Sequence[LayerCost],
                  remove_waits: bool = True) -> dict[tuple[str, range], list[float]]:
    """Per (kind, stage) the busy seconds of each stage-microbatch, input waits removed
    (or the raw t1 - t0 with remove_waits=False).

    events: (worker, kind, first_layer, microbatch, t0, t1) of one call run under `plan`;
    costs: the current per-layer costs (fwd_s is the recompute part of a backward stage).
    A producer's t1 is taken after it published, so it can overstate when the input
    arrived: an event that ends before its producer's t1 is dropped, and a busy time
    below the current estimate is raised to it (capped by t1 - t0) so that no layer's
    cost collapses to zero (the profiler splits stage times in proportion to costs)."""
    ranges = {("F", r.start): r for r in plan.forward}
    ranges[("fused", plan.fused.start)] = plan.fused
    ranges.update({("B", r.start): r for r in plan.backward[1:]})
    fwd_done = {(ranges[("F", e[2])].stop, e[3]): e[5] for e in events if e[1] == "F"}
    grad_done = {(e[2], e[3]): e[5] for e in events if e[1] != "F"}
    out: dict[tuple[str, range], list[float]] = {}
    for _, kind, first, m, t0, t1 in events:
        r = ranges.get((kind, first))
        if r is None:
            continue
        if not remove_waits:
            out.setdefault((kind, r), []).append(t1 - t0)
            continue
        ready = (grad_done if kind == "B" else fwd_done).get((r.stop if kind == "B" else r.start, m), t0)
        if ready >= t1:
            continue   # finished before its producer's clock stopped: no information
        if kind == "B":
            busy = (t1 - t0) - max(0.0, ready - (t0 + sum(costs[l].fwd_s for l in r)))
        else:
            busy = t1 - max(t0, ready)
        estimate = sum(costs[l].fwd_s if kind == "F" else costs[l].bwd_s for l in r)
        out.setdefault((kind, r), []).append(max(busy, min(t1 - t0, estimate)))
    return out


def host_room(layers: Sequence[nn.Module], workers: int, compute_dtype: torch.dtype) -> bool:
    """Whether the host has room for the gradient sums of `workers` rounds landing apart (whole_batch): per
    trained parameter 4 bytes (an fp32 sum, where the compute dtype is narrower) plus one compute-dtype
    landing buffer per further worker, at most a quarter of /proc/meminfo's MemAvailable (False where it
    cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    size = compute_dtype.itemsize
    trained = sum(p.numel() for layer in layers for p in layer.parameters() if p.requires_grad)
    return trained * ((workers - 1) * size + (4 if size < 4 else 0)) <= available / 4


class AutoPlanner:
    """Owns a model's plan: the partitioner's choice, profiled and revised at safe points only."""

    def __init__(self, layers: Sequence[nn.Module], devices: Sequence[torch.device], compute_dtype: torch.dtype,
                 microbatches: int, config: PlanningConfig, fixed: Plan | None = None,
                 fallback: Callable[[], Plan] | None = None, layer_grain: bool = False, round_size: int | None = None):
        self.config = config
        self.round_size = round_size   # microbatches per round (None: workers + 1); the one-per-worker calls: 1
        self.layer_grain = layer_grain   # backward stages recompute a layer at a time (planner/memory.py)
        self.layers = list(layers)
        self.workers = len(devices)
        self.device_type = devices[0].type
        self.remove_waits = devices[0].type == "cuda" and len(set(devices)) == len(devices)
        self.compute_dtype = compute_dtype
        self.memory_budget = device_budget(devices) if config.memory_budget == "device" else config.memory_budget
        # One worker without a budget: the whole batch fits whatever it holds and that worker runs every layer, so
        # the first call's costs only seed the profiler's split of the timed stage: parameter counts x tokens do,
        # without a dry run's second forward and backward (0.18 s of the default `roundpipe train`'s first call
        # on 2 cores, issue 54).  Its costs then hold no activation bytes: no predicted peak is made from them.
        self.sized_only = self.memory_budget is None and len(devices) == 1
        self.enabled = config.enabled and fixed is None
        self.profiler: Profiler | None = None
        self.replanner: Replanner | None = None
        self.calls = 0          # training calls ended
        self._begun = 0         # training calls begun (calls overlap: the next begins before one ends)
        self.replans = 0        # plan changes after the first call's size-based plan
        self.history: list[Plan] = []
        self._requested: Plan | None = None   # request(plan): the next call's plan, whatever was measured
        self._measured: Plan | None = None    # the re-planner's plan, taken at the next call's start
        self._events: dict[int, list[tuple]] = {}   # call key -> its timing events (calls overlap)
        self._lock = threading.Lock()
        self._memory: list[LayerMemory] | None = None   # layer_memory for a fixed plan
        self._whole: tuple[bool, int] | None = None      # whole_batch's decision: (fits, batch size)
        self._first_costs: list[LayerCost] | None = None  # its dry run, which the first call's plan reuses
        if fixed is not None:
            self.plan = fixed
        elif not config.enabled:
            self.plan = fallback()
        else:
            costs = size_costs(self.layers, None, compute_dtype, self.device_type)
            self.plan = self._bounded(lambda budget: self._solver(costs, self.workers, microbatches, budget), costs)
        self.history.append(self.plan)

    def _bounded(self, solve: Callable[[int | None], Any], costs: Sequence[LayerCost] | None = None) -> Any:
        """solve(memory_budget) with the partitioner's cap rule (planner.partition_for_cap).  The bound is never
        dropped: when one layer cannot fit a stage, a ValueError names the layer, the bytes and the cap, with
        the microbatch size that would fit, before any work of the call."""
        try:
            return solve(self.memory_budget)
        except LayerTooLarge as e:
            hint = ""
            if costs is not None:
                c = costs[e.layer]
                fixed = c.param_bytes + c.grads
                acts = e.need - fixed
                if fixed < e.limit and acts > 0:   # activations scale with the microbatch's rows
                    hint = (f" or microbatches {math.ceil(acts / (e.limit - fixed))}x smaller "
                            "(num_microbatches=, or fewer rows per call)")
            raise ValueError(
                f"device_memory: layer {e.layer} needs about {e.need:,.0f} bytes in a backward stage (its weights, "
                f"fp32 gradients, one microbatch's activations and workspace), more than the {e.limit:,.0f} bytes "
                f"a stage may use of the {e.budget:,.0f}-byte cap (the rest holds its neighbouring stages' "
                f"weights, gradients and outputs): raise device_memory{hint}, or split the layer") from None

    def _solver(self, costs: Sequence[LayerCost], workers: int, microbatches: int, budget: float | None) -> Plan:
        return partition_for_cap(costs, workers, microbatches, budget, prefetch=self.device_type == "cuda",
                                 layer_grain=self.layer_grain, round_size=self.planned_rounds).plan

    @property
    def planned_rounds(self) -> int | None:
        """Microbatches per round of the calls the plan is made for: 1 where the calls run one microbatch per
        worker (whole_batch), else the model's."""
        return 1 if self._whole is not None and self._whole[0] else self.round_size

    def layer_memory(self, sample: tuple[tuple, dict], loss: tuple[Callable, Any] | None = None) -> list[LayerMemory]:
        """Each layer's device bytes for one microbatch (roundpipe/planner/memory.py): the first call's dry
        run; with a fixed plan, a dry run made for it once."""
        if self.profiler is not None:
            return layer_memory(self.profiler.estimates)
        if self._memory is None:
            self._memory = layer_memory(size_costs(self.layers, sample, self.compute_dtype, self.device_type, loss))
        return self._memory

    def request(self, plan: Plan) -> None:
        """Switches to `plan` at the next call's start (a safe point); keeps profiling and re-planning."""
        if not self.enabled:
            raise ValueError("request(plan): planning is disabled (an explicit plan= or "
                             "PlanningConfig(enabled=False)); the plan never changes")
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a roundpipe.Plan, got {type(plan).__name__}")
        with self._lock:
            self._requested = plan.check(len(self.layers))

    def _profiled(self, call: int) -> bool:
        """Training call number `call` (0-based) is timed: past the warm-up, within the profile."""
        n = call - self.config.warmup
        return n >= 0 and (self.config.profile is None or n < self.config.profile)

    def whole_batch(self, batch: int, each: Callable[[], Any], loss_fn: Callable | None) -> bool:
        """No penalty when the model fits (docs/planner.md): True when one microbatch per worker (the first
        of `each()`, the batch cut into min(workers, batch) microbatches; one worker: the whole batch) trains
        in one fused stage within the budget (weights, fp32 gradients, every layer's activations and the
        loss's workspace; no budget: always), so the call runs as those microbatches, each in one fused
        stage on a worker of its own, keeping its activations instead of recomputing them: plain PyTorch's
        work.  Decided at the first training call from a dry run of that microbatch (which its plan then
        reuses; one worker without a budget needs none); a later, larger batch is split as before.

        Host memory: with several workers each lands its own gradient sums, so a layer's gradients land
        once per worker and are summed in fp32 on the host (`HostState.land_grads`): per trained parameter
        4 bytes more in low precision and one landing buffer per further worker.  Those calls are taken
        only where that is at most a quarter of the host's available memory (`host_room`): the room the
        optimizer's state, made at the first step, still needs."""
        if not self.enabled:
            return False
        if self._whole is None:
            fits = False
            if self.replanner is None:   # a forward-only first call planned already: keep its plan
                mb = each()
                costs = size_costs(self.layers, (mb.args[0], mb.kwargs[0]), self.compute_dtype, self.device_type,
                                   None if loss_fn is None else (loss_fn, mb.labels[0]), dry_run=not self.sized_only)
                within = self.memory_budget is None or one_stage_bytes(costs) <= self.memory_budget
                fits = self.sized_only or within and (len(mb) == 1 or host_room(self.layers, len(mb),
                                                                                self.compute_dtype))
                self._first_costs = costs if fits else None
            self._whole = (fits, batch)
        fits, size = self._whole
        return fits and batch <= size

    @property
    def whole_decision(self) -> tuple[bool, int] | None:
        """whole_batch's decision, (fits, batch size), once made: a checkpoint keeps it, so a resumed run
        splits its calls as the run that saved did (None: not made yet)."""
        return self._whole

    def restore_whole_decision(self, decision: tuple[bool, int] | None) -> None:
        """A checkpoint's whole_batch decision, in place of any this model made (load_checkpoint)."""
        self._whole = decision
        self._first_costs = None   # a dry run of this model's own first call: not the saved run's

    def before_call(self, sample: tuple[tuple, dict], num_microbatches: int, training: bool,
                    loss: tuple[Callable, Any] | None = None) -> Plan:
        """The plan of the call about to start (the only place the plan changes); `loss`: its
        (loss_fn, first microbatch's labels) when it trains."""
        if not self.enabled:
            return self.plan
        if self.replanner is None:   # first call: the size-based plan for these inputs
            costs, self._first_costs = self._first_costs, None
            if costs is None:
                costs = size_costs(self.layers, sample, self.compute_dtype, self.device_type, loss,
                                   dry_run=not self.sized_only)
            self.profiler = Profiler(costs, alpha=self.config.alpha)
            self.replanner = self._bounded(lambda budget: Replanner(
                self.profiler, self.workers, num_microbatches, budget, self.config.threshold, self._solver),
                self.profiler.costs())
            self._switch(self.replanner.plan, count=False)
        with self._lock:
            pending = self._requested or self._measured
            self._requested = self._measured = None
        if pending is not None:
            self._switch(pending)
        return self.plan

    def follow(self, plan: Plan) -> Plan:
        """Runs `plan` from this call on (data parallelism: rank 0's choice on every rank); returns it."""
        self._switch(plan)
        return plan

    def _switch(self, plan: Plan, count: bool = True) -> None:
        if plan != self.plan:
            self.plan = plan
            self.history.append(plan)
            self.replans += count

    def recorder(self, key: int, training: bool, user: Callable[..., None] | None = None) -> Callable[..., None] | None:
        """The stage_timing callback of call `key`: the user's (model.stage_timing), plus the
        profiler's when the call is profiled; None when neither."""
        if not (self.enabled and training):
            return user
        self._begun += 1
        if not self._profiled(self._begun - 1):
            return user
        events = self._events[key] = []
        if user is None:
            return lambda *event: events.append(event)   # list.append: atomic under the GIL, cheap

        def both(*event) -> None:
            events.append(event)
            user(*event)
        return both

    def after_call(self, key: int, plan: Plan, training: bool, ok: bool) -> None:
        """Folds finished call `key`'s timings into the profiler; re-plans if they drifted past the threshold."""
        events = self._events.pop(key, None)   # None: the call was not profiled
        if not (self.enabled and training):
            return
        self.calls += 1
        if not (ok and events):
            return
        prof = self.profiler
        for (kind, r), secs in stage_seconds(events, plan, prof.costs(), self.remove_waits).items():
            sample = min(secs)   # the fastest microbatch (see the module docstring)
            if self.config.timer is not None:
                sample = self.config.timer(kind, r, sample)
            prof.record(r, PHASES[kind], sample)
        if not self.replanner.update():
            return
        with self._lock:   # calls overlap: an earlier call's measured plan may not have been taken yet
            next_plan = self._measured or self.plan
            if self._worth_it(self.replanner.plan, next_plan):
                self._measured = self.replanner.plan
            else:   # staying: later candidates are compared with that plan, not the refused one
                self.replanner.keep(next_plan)

    def _worth_it(self, candidate: Plan, current: Plan) -> bool:
        """Hysteresis: switch only when the candidate's predicted iteration time is more than
        `threshold` below `current`'s (the plan the next call would run) under the same costs.  Without it, timing noise on
        small layers (measured: >10% call to call on a shared 2-core CPU) flips between plans
        of equal merit."""
        costs = self.profiler.costs()
        m, r = self.replanner.microbatches, self.planned_rounds
        old = objective(current, costs, self.workers, m, r)
        return objective(candidate, costs, self.workers, m, r) < old * (1 - self.config.threshold)

    def summary(self) -> dict[str, Any]:
        """What was chosen and why, for logs: the config, the plan, counts and the cost table."""
        return {"enabled": self.enabled, "plan": self.plan, "replans": self.replans, "calls": self.calls,
                "memory_budget": self.memory_budget, "config": dataclasses.asdict(self.config),
                "costs": self.profiler.table() if self.profiler is not None else None}
