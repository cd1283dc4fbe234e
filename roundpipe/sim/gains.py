"""`GpuPath`: issue 38's GPU-path changes applied to RoundPipe's simulated schedule, one at a time or together.

Today's path (roundpipe.sim.roundpipe with `Uploads` and a `HostStep`) uploads every stage's
weights per slot, recomputes every backward stage but the fused one and steps every layer on
the host.  The changes, as the simulator can justify them:

    kept         (a) no recompute where activations fit: a backward stage that keeps its forward's
                 activations on the GPU has no recompute task (its duration is 0) and does not
                 upload its input again (one activation per microbatch less)
    resident     (b) layers 0..resident-1 (resident = num_layers + 1: the LM head too) stay in each
                 worker's weight cache across stage runs, with the host step (the engine's resident
                 weights): a cached weight is reused while the host's upload copy has not been rewritten
                 since it went up.  A trained weight is rewritten by every step, so it crosses PCIe once
                 an iteration per worker (charged to the first slot of the iteration on that worker: on
                 one GPU a backward stage's recompute reuses its forward's upload); a frozen one
                 (`frozen_bytes`: a LoRA / QLoRA base) crosses once per worker in the whole run, in the
                 first slot that holds it, and never again.  With `device_step` their masters and
                 optimizer state live there too: no upload at all, their host step is 0 and a device
                 step of `device_step_s[l]` seconds is added to the GPU after the last microbatch of
                 their backward stage
    reuse_s      (c) a recompute that reuses the forward's masks, rotary tables and counts: every
                 recompute task that remains is `reuse_s` shorter (a mask build and a host sync)
    layer_grain  (d) layer-grain recompute: the FLOPs are the same; a recomputed stage uploads the
                 saved input of each of its layers (+ the gradient flowing in) instead of the
                 stage's input alone.  Its other effect, larger backward stages under a cap, is
                 the planner's (partition(..., layer_grain=True)): pass that plan's sizes

A slot that starts at layer 0 takes token ids, not activations: it uploads no input activation
(today's `Uploads` charges one; this module does not).  Gradient downloads are not modelled (the
other PCIe direction, half the bytes of the uploads; roundpipe.sim.uploads).

`simulate_path` runs `iterations` flowing iterations (lag 2: one step stale; 1: synchronous) and
returns the steady-state seconds per iteration as `roundpipe.sim.simulate` measures it, and the upload
bytes of an iteration after the first (the first also fills the weight caches with the frozen bytes).
`resident_prefix` is the engine's rule for how many layers are resident (as roundpipe.planner.memory's): the
plan stays as it is, and the prefix is the largest whose kept bytes (a trained layer's compute-dtype
weights; a frozen base as stored, a 4-bit one packed) beside each stage and the one it prefetches leave
the predicted peak under the cap (`resident_peak`).  Since the plan does not change, the prefix only
removes upload bytes.
`plain_time` is one GPU that holds everything: the whole batch's forward and backward with no
recompute and no transfer, then a device step.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from roundpipe.core.checks import check_int, check_number, is_int
from roundpipe.sim.costs import Costs, check_sizes
from roundpipe.sim.events import Run, Schedule
from roundpipe.sim.events import simulate as run_schedule
from roundpipe.sim.hoststep import HostStep
from roundpipe.sim.roundpipe import default_round_size, roundpipe_schedule
from roundpipe.sim.uploads import Uploads


@dataclass(frozen=True)
class GpuPath:
    """Which GPU-path changes an iteration has; the defaults are today's path (module docstring)."""

    kept: tuple[int, ...] = ()     # (a) backward stage indices (1..: 0 is the fused stage) keeping activations
    resident: int = 0              # (b) layers 0..resident-1 cached on each worker (num_layers + 1: the head too)
    device_step: bool = False      # (b) ... and stepped on the GPU
    reuse_s: float = 0.0           # (c) seconds each remaining recompute task saves
    layer_grain: bool = False      # (d) per-layer saved inputs uploaded for a recompute

    def __post_init__(self):
        kept = tuple(self.kept)
        for j in kept:
            if not is_int(j) or j < 1:
                raise ValueError(f"kept={self.kept!r}: each entry must be a backward stage index >= 1 (stage 0, the "
                                 "fused one, never recomputes)")
        object.__setattr__(self, "kept", tuple(sorted(set(kept))))
        check_int("resident", self.resident, 0)
        object.__setattr__(self, "reuse_s", check_number("reuse_s", self.reuse_s, unit=" (seconds)"))
        for name in ("device_step", "layer_grain"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.device_step and not self.resident:
            raise ValueError("device_step=True needs resident >= 1 (only resident layers are stepped on the GPU)")


@dataclass
class PathResult:
    iteration: float          # seconds per iteration, steady state
    upload_bytes: float       # bytes uploaded per iteration after the first (mean: the steady state)
    uploads: tuple[float, ...]  # bytes uploaded in each iteration, the first included
    host_step: float          # seconds of host step work per iteration
    device_step: float        # seconds of device step work per iteration
    recompute: float          # seconds of recompute work per iteration
    run: Run = field(repr=False)


def path_schedule(costs: Costs, microbatches: int, forward: Sequence[int], backward: Sequence[int], path: GpuPath,
                  uploads: Uploads, step: HostStep, device_step_s: Sequence[float] = (), iterations: int = 6,
                  lag: int = 2, workers: int = 1, frozen_bytes: Sequence[float] = ()) -> Schedule:
    """RoundPipe's schedule with `path`'s changes; `device_step_s` gives a device step's seconds per layer
    (LM head last) and is needed with `path.device_step`; `frozen_bytes` (per layer, the LM head last; empty:
    none) the bytes of each layer's upload that no step rewrites (a frozen base), at most its upload bytes."""
    L = costs.num_layers
    if not isinstance(path, GpuPath):
        raise TypeError(f"path={path!r} must be a roundpipe.sim.gains.GpuPath")
    if path.resident > L + 1:
        raise ValueError(f"resident={path.resident} must be <= {L + 1} (the layers, then the LM head)")
    backward = check_sizes("backward", backward, L, allow_empty_first=True)
    forward = check_sizes("forward", forward, L - backward[0])
    if any(j >= len(backward) for j in path.kept):
        raise ValueError(f"kept={path.kept} names a stage past the {len(backward)} backward stages")
    device = [check_number(f"device_step_s[{i}]", v) for i, v in enumerate(device_step_s)]
    if path.device_step and len(device) != L + 1:
        raise ValueError(f"device_step_s has {len(device)} entries; give one per layer plus the LM head ({L + 1})")
    frozen = _check_frozen(frozen_bytes, uploads, L)
    on_gpu = set(range(path.resident))
    params = tuple(0.0 if path.device_step and l in on_gpu else p for l, p in enumerate(step.params))
    sched = roundpipe_schedule(costs, workers, microbatches, forward, backward, iterations, lag=lag,
                               uploads=uploads, host_step=replace(step, params=params))
    ranges = _stage_ranges(forward, backward, L)
    round_size = default_round_size(workers)
    cache: dict[tuple[int, int], int] = {}   # (GPU, resident layer) -> the iteration its weights last went up
    per_it = [0.0] * iterations
    last = {}                        # (stage, iteration) -> the id of its last backward task
    for i, t in enumerate(sched.tasks):
        if t.cat == "recompute":
            j = int(t.stage[1:]) - 1
            t.duration = 0.0 if j in path.kept else max(0.0, t.duration - path.reuse_s)
        elif t.cat in ("backward", "fused"):
            last[t.stage, t.iteration] = i
        elif t.cat == "copy" and t.name.endswith(" upload"):
            n = min(round_size, microbatches - t.mb)
            gpu = t.worker - workers                 # roundpipe_schedule: "GPU w upload" is worker N + w
            nbytes = _slot_bytes(t.stage, ranges[t.stage], n, path, uploads, frozen, cache, gpu, t.iteration, L)
            t.duration = nbytes / uploads.bandwidth(workers)
            per_it[t.iteration] += nbytes
    if path.device_step:
        for (stage, _), i in last.items():
            r = ranges[stage]
            layers = list(r) + ([L] if stage == "B1" else [])
            sched.tasks[i].duration += sum(device[l] for l in layers if l in on_gpu)
    sched.meta["upload_bytes"] = sum(per_it)
    sched.meta["upload_bytes_by_iteration"] = tuple(per_it)
    sched.meta["gpu_path"] = path
    return sched


def _stage_ranges(forward, backward, L) -> dict[str, range]:
    out, start = {}, 0
    for j, n in enumerate(forward):
        out[f"F{j + 1}"] = range(start, start + n)
        start += n
    top = L
    for j, n in enumerate(backward):
        out[f"B{j + 1}"] = range(top - n, top)
        top -= n
    return out


def _check_frozen(frozen_bytes: Sequence[float], uploads: Uploads, L: int) -> list[float]:
    """`frozen_bytes` validated against the upload bytes (zeros where none is given)."""
    sizes = list(uploads.layer_bytes) + [uploads.head_bytes]
    if len(frozen_bytes) == 0:
        return [0.0] * (L + 1)
    if len(frozen_bytes) != L + 1:
        raise ValueError(f"frozen_bytes has {len(frozen_bytes)} entries; give one per layer plus the LM head "
                         f"({L + 1}), or none")
    out = [check_number(f"frozen_bytes[{l}]", v) for l, v in enumerate(frozen_bytes)]
    for l, (f, size) in enumerate(zip(out, sizes)):
        if f > size:
            raise ValueError(f"frozen_bytes[{l}]={f!r} exceeds that layer's upload bytes ({size!r}): the frozen "
                             "part is a part of what the layer uploads")
    return out


def _slot_bytes(stage: str, layers: range, n: int, path: GpuPath, uploads: Uploads, frozen: list[float],
                cache: dict[tuple[int, int], int], gpu: int, it: int, L: int) -> float:
    """Bytes one slot of iteration `it` uploads to `gpu` on `path`: its weights not in that GPU's cache, and
    its activations (module docstring)."""
    head = stage == "B1"
    weights = 0.0
    for l in list(layers) + ([L] if head else []):
        size = uploads.head_bytes if l == L else uploads.layer_bytes[l]
        if l >= path.resident:
            weights += size
        elif not path.device_step:
            if (gpu, l) not in cache:                 # a frozen part goes up once per GPU, then stays valid
                weights += frozen[l]
            if cache.get((gpu, l)) != it:             # a trained part: rewritten by every step, once an iteration
                weights += size - frozen[l]
            cache[gpu, l] = it
    recomputed = stage.startswith("B") and not head and int(stage[1:]) - 1 not in path.kept
    inputs = 0 if layers.start == 0 or (stage.startswith("B") and not recomputed and not head) else 1
    if recomputed and path.layer_grain:
        inputs = len(layers) - (1 if layers.start == 0 else 0)
    flowing = 1 if stage.startswith("B") and not head else 0     # the gradient from the stage above
    return weights + uploads.activation_bytes * n * (inputs + flowing)


def simulate_path(costs: Costs, microbatches: int, forward: Sequence[int], backward: Sequence[int], path: GpuPath,
                  uploads: Uploads, step: HostStep, device_step_s: Sequence[float] = (), iterations: int = 6,
                  lag: int = 2, workers: int = 1, frozen_bytes: Sequence[float] = ()) -> PathResult:
    """`path_schedule` simulated: steady-state seconds per iteration between the ends of the second and
    of the second-to-last iteration (as roundpipe.sim.simulate), and the work per iteration."""
    if not is_int(iterations) or iterations < 4:
        raise ValueError(f"iterations={iterations!r} must be an int >= 4 (the first and last are left out)")
    sched = path_schedule(costs, microbatches, forward, backward, path, uploads, step, device_step_s, iterations,
                          lag, workers, frozen_bytes)
    run = run_schedule(sched, costs.comm)
    ends = [0.0] * iterations
    for i, t in enumerate(sched.tasks):
        ends[t.iteration] = max(ends[t.iteration], run.end[i])
    per_it = (ends[-2] - ends[1]) / (iterations - 3)
    work = {cat: sum(t.duration for t in sched.tasks if t.cat == cat) / iterations
            for cat in ("optimizer", "recompute")}
    device = 0.0
    if path.device_step:
        device = sum(device_step_s[l] for l in range(min(path.resident, costs.num_layers + 1)))
    by_it = sched.meta["upload_bytes_by_iteration"]
    return PathResult(per_it, sum(by_it[1:]) / (iterations - 1), by_it, work["optimizer"], device,
                      work["recompute"], run)


def resident_peak(stages: Sequence[tuple[range, float]], resident_bytes: Sequence[float], resident: int) -> float:
    """Predicted peak device bytes of a worker that runs `stages` ((layers, bytes) each, in its order, every
    iteration) with layers 0..resident-1 kept: a stage, the next one it prefetches (after the last: the first,
    of the next iteration) and the kept weights of the layers in neither.  roundpipe.planner.memory.worker_peaks
    adds kept weights the same way; it counts only the prefetched stage's weights and next input."""
    check_int("resident", resident, 0)
    if not stages:
        raise ValueError("stages is empty: give the (layers, bytes) of every stage the worker runs")
    if resident > len(resident_bytes):
        raise ValueError(f"resident={resident} must be <= {len(resident_bytes)} (the layers given resident_bytes)")
    sizes = [check_number(f"resident_bytes[{l}]", v) for l, v in enumerate(resident_bytes)]
    peak = 0.0
    for i, (layers, nbytes) in enumerate(stages):
        after, next_bytes = stages[(i + 1) % len(stages)]
        beside = sum(sizes[l] for l in range(resident) if l not in layers and l not in after)
        peak = max(peak, nbytes + next_bytes + beside)
    return peak


def resident_prefix(stages: Sequence[tuple[range, float]], resident_bytes: Sequence[float], cap: float) -> int:
    """The planner's rule: the largest prefix whose kept weights leave `resident_peak` within `cap` with the plan
    unchanged (0 where even none fits).  It never looks at time, and the peak only grows with the prefix."""
    cap = check_number("cap", cap, positive=True)
    best = 0
    for r in range(1, len(resident_bytes) + 1):
        if resident_peak(stages, resident_bytes, r) > cap:
            break
        best = r
    return best


def plain_time(costs: Costs, microbatches: int, step_s: float) -> float:
    """Seconds per iteration of one GPU holding the model, its gradients and optimizer state: every
    microbatch's forward and backward with no recompute, then `step_s` of device step."""
    check_int("microbatches", microbatches, 1)
    layers = range(costs.num_layers)
    once = costs.forward(layers) + costs.backward(layers, recompute=False) + costs.head_fwd + costs.head_bwd
    return microbatches * once + check_number("step_s", step_s)
