"""Device-memory caps per worker: what `RoundPipe(device_memory=...)` means, and the check before a call.

    device_memory=None        CUDA: the device's free memory when the model is built, minus a
                              reserve (max(512 MiB, 5%)) for the CUDA context, kernels' workspace
                              and fragmentation, shared evenly by the workers on that device;
                              CPU workers: no cap
    device_memory=BYTES       every worker
    device_memory={key: BYTES}  by device ("cuda:0", "cpu") or by worker name ("cpu:1");
                              workers named by no key get no cap

The planner sizes its stages for the smallest cap (when `PlanningConfig.memory_budget`
is "device": half of it per stage, the other half for the prefetched next stage).
Before any work of a call, every stage is checked against the cap of the worker it
runs on: a stage needs at least its weights, the weights of the stage that worker
prefetches next and, for a backward stage, the fp32 gradients of its trainable
parameters; a ValueError names the first stage that cannot fit, the bytes and the
cap.  Activations are on top of that floor; the worker's ledger
(roundpipe/workers/ledger.py) records what was really held.

At run time a capped CPU worker's ledger enforces the cap (Worker.set_cap): an allocation
past it raises torch.OutOfMemoryError, as a GPU's allocator does at the device's limit.  The
error reaches the caller with a note naming the worker, the stage, the plan's predicted peak
(`PeakPredictions`) and the cap (roundpipe/engine/calls/dispatcher.py); the call has no effect.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from roundpipe.core.checks import is_int
from roundpipe.engine.step.device_step import eligible
from roundpipe.planner.memory import resident_prefix, worker_peaks

MIN_RESERVE = 512 << 20
RESERVE_FRACTION = 0.05


def _is_bytes(v: Any) -> bool:
    return is_int(v) and v > 0


def resolve_caps(device_memory: Any, devices: Sequence[torch.device]) -> dict[str, int | None]:
    """Worker name -> cap in bytes (None: no cap); ValueError/TypeError for a bad device_memory."""
    from roundpipe.workers import worker_names

    workers = list(zip(worker_names(list(devices)), devices))
    if device_memory is None:
        caps: dict[str, int | None] = {}
        sharing: dict[torch.device, int] = {}
        for _, dev in workers:
            sharing[dev] = sharing.get(dev, 0) + 1
        for name, dev in workers:
            if dev.type == "cuda":
                free, total = torch.cuda.mem_get_info(dev)
                usable = free - max(MIN_RESERVE, int(RESERVE_FRACTION * total))
                caps[name] = max(1, usable // sharing[dev])
            else:
                caps[name] = None
        return caps
    if is_int(device_memory):
        if device_memory <= 0:
            raise ValueError(f"device_memory={device_memory!r} must be an int > 0 (bytes)")
        return {name: device_memory for name, _ in workers}
    if not isinstance(device_memory, dict):
        raise TypeError(f"device_memory must be None, an int (bytes) or a dict of device or worker name -> bytes, "
                        f"got {type(device_memory).__name__}")
    known = {name for name, _ in workers} | {str(dev) for _, dev in workers}
    for key, v in device_memory.items():
        if str(key) not in known:
            raise ValueError(f"device_memory has key {key!r}, which is neither a device nor a worker of this "
                             f"RoundPipe ({sorted(known)})")
        if not _is_bytes(v):
            raise ValueError(f"device_memory[{key!r}]={v!r} must be an int > 0 (bytes)")
    table = {str(k): v for k, v in device_memory.items()}
    return {name: table.get(name, table.get(str(dev))) for name, dev in workers}


def layer_bytes(host) -> tuple[list[int], list[int]]:
    """Per layer: bytes of its uploaded weights and buffers, and of fp32 gradients of its trainable parameters."""
    weights, grads = [], []
    for st in host.layers:
        weights.append(sum(u.nbytes for u in st.upload) + sum(b.nbytes for b in st.buffers))
        grads.append(sum(st.params[j].numel() * 4 for j in st.trainable))
    return weights, grads


def check_schedule(tasks_by_worker: dict[str, list], caps: dict[str, int | None], host) -> None:
    """ValueError naming the first stage whose floor (weights, prefetched weights, gradients) exceeds its cap."""
    if not any(c is not None for c in caps.values()):
        return
    weights, grads = layer_bytes(host)
    for name, tasks in tasks_by_worker.items():
        cap = caps.get(name)
        if cap is None:
            continue
        for i, task in enumerate(tasks):
            own = sum(weights[l] for l in task.layers)
            nxt = sum(weights[l] for l in tasks[i + 1].layers) if i + 1 < len(tasks) else 0
            grad = sum(grads[l] for l in task.layers) if task.kind != "F" else 0
            need = own + nxt + grad
            if need > cap:
                r = task.layers
                raise ValueError(
                    f"stage {task.label} (layers {r.start}-{r.stop - 1}) on worker {name} needs at least "
                    f"{need:,} bytes of device memory (weights {own:,}, the next stage's prefetched weights "
                    f"{nxt:,}, gradients {grad:,}) but device_memory caps that worker at {cap:,}; give more "
                    "memory, or a plan with smaller stages (the automatic planner sizes them for the cap)")


def device_step_bytes(host) -> list[int]:
    """Per layer, the device bytes the device step keeps for it beside its weights
    (roundpipe/engine/step/device_step.py): per trained parameter an fp32 master (none when the compute
    dtype is fp32: the master is the weight stages bind), two fp32 state buffers (Adam's moments; other
    optimizers keep as many or fewer) and two fp32 gradient sums (the step's and the call in flight's);
    0 for a layer it does not step (device_step.eligible)."""
    master = 0 if host.upload_dtype == torch.float32 else 4
    return [sum(st.params[j].numel() for j in st.trainable) * (master + 8 + 8) if ok else 0
            for st, ok in zip(host.layers, eligible(host))]


class PeakPredictions:
    """The planner's predicted peak device bytes per worker: memory_stats()'s "predicted_peak".

    Worked out once per schedule, with its fit check, from the planner's memory model
    (roundpipe/planner/memory.py) and kept on the schedule; each call folds its schedule's
    figures into the maxima since the last `reset()`, as a worker's measured peak covers
    every schedule it ran (the rotation gives each call its own)."""

    def __init__(self, workers: Sequence, caps: dict[str, int | None], resident_layers: int | None = None,
                 device_step: bool = False):
        self.workers = workers
        self.device_step = device_step   # resident trained layers hold masters, state and gradients too
        self.caps = caps
        self.peaks: dict[str, int] = {}   # worker name -> predicted peak since the last reset()
        # RoundPipe(resident_layers=): None picks per schedule under the caps; `auto_resident` False
        # after a call with resident weights ran out of device memory (none kept from then on)
        self.resident_layers = resident_layers
        self.auto_resident = True
        for w in workers:   # named in out-of-memory errors; a CPU worker's ledger enforces it
            w.set_cap(caps.get(w.name))

    def check(self, sched, host, autoplan, sample: tuple[tuple, dict], loss) -> None:
        """Before any work of a call: its stages against the caps (ValueError), then its predicted peaks,
        each checked once per schedule; a warning where a prediction exceeds a cap (only an explicit plan
        can); the call's figures folded into the maxima."""
        if not sched.fits_checked:
            check_schedule(sched.tasks, self.caps, host)
            sched.predicted = self._predict(sched, host, autoplan, sample, loss)
            sched.fits_checked = True
        if not self.auto_resident and (sched.resident or sched.kept):   # a call with them ran out of memory:
            sched.resident = 0                                             # none from now on (nor graphs)
            sched.predicted = self._predict(sched, host, autoplan, sample, loss)
        for name, need in sched.predicted.items():
            self.peaks[name] = max(self.peaks.get(name, 0), need)

    def _predict(self, sched, host, autoplan, sample, loss) -> dict[str, int]:
        L = len(host)
        if self.resident_layers is not None:
            sched.resident = min(self.resident_layers, L) if self.auto_resident else 0
        if (autoplan.profiler is None or autoplan.sized_only) and not any(c is not None for c in self.caps.values()):
            return {}   # a fixed plan, or one worker planned without a dry run, without caps: none just for the figure
        weights, grads = layer_bytes(host)
        prefetches = any(w.prefetches for w in self.workers)
        mem = autoplan.layer_memory(sample, loss)
        held = device_step_bytes(host) if self.device_step else None
        sched.keep_activations(())
        if self.resident_layers is None and self.auto_resident:   # the most the caps leave room for
            sched.resident = resident_prefix(sched.tasks, weights, grads, mem, prefetches, self.caps,
                                             sched.layer_grain, headroom=self.resident_headroom(), held=held)
        if self.auto_resident:   # then graphs kept instead of recomputed, in the room the kept weights leave
            self._keep_activations(sched, host, weights, grads, mem, prefetches, held)
        predicted = worker_peaks(sched.tasks, weights, grads, mem, prefetches, sched.layer_grain,
                                 resident=sched.resident, held=held)
        for name, need in predicted.items():
            cap = self.caps.get(name)
            if cap is not None and need > cap:
                warnings.warn(f"worker {name}: the plan's predicted peak of {need:,} device bytes exceeds its "
                              f"device_memory cap of {cap:,} (weights, gradients and activations; "
                              "roundpipe/planner/memory.py); give a plan with smaller stages or fewer rows "
                              "per microbatch, or let the planner choose", stacklevel=5)
        return predicted

    def _keep_activations(self, sched, host, weights, grads, mem, prefetches, held) -> None:
        """The backward stages that keep their forward's graph instead of recomputing it (dispatcher.Schedule
        `keepable`, nearest the fused tail first, each while every worker's predicted peak stays within the
        share of its cap that kept weights may fill, `resident_headroom`); none where a worker has no cap."""
        limits = {name: self.caps.get(name) for name in sched.tasks}
        chosen: list[int] = []
        if limits and all(c is not None for c in limits.values()):
            def fits() -> bool:
                peaks = worker_peaks(sched.tasks, weights, grads, mem, prefetches, sched.layer_grain,
                                     resident=sched.resident, held=held)
                return all(peaks[n] <= (1 - self.resident_headroom()) * limits[n] for n in limits)
            for j in sched.keepable(lambda l: any(host.layers[l].constant)):
                sched.keep_activations(chosen + [j])
                if fits():
                    chosen.append(j)
        sched.keep_activations(chosen)

    def resident_headroom(self) -> float:
        """The share of each cap that kept weights leave free beyond the predicted peak (resident_prefix): 15%
        on CPU workers, whose ledger counts exact bytes (measured peaks reach 1.1x the prediction); 30% where a
        worker is a GPU, whose caching allocator also loses room to fragmentation the prediction does not
        model (unmeasured on GPU: chosen so that kept weights never turn a call that fits into one that runs
        out of memory; a call that does drops them for good)."""
        return 0.30 if any(w.device.type == "cuda" for w in self.workers) else 0.15

    def worker_stats(self) -> dict[str, dict]:
        """memory_stats()'s "workers": each worker's ledger figures, device, predicted peak and, on CUDA,
        torch.cuda.memory_allocated."""
        workers = {}
        for w in self.workers:
            stats = w.ledger.stats()
            stats["device"] = str(w.device)
            if w.name in self.peaks:
                stats["predicted_peak"] = self.peaks[w.name]
            if w.device.type == "cuda":
                stats["cuda_allocated"] = torch.cuda.memory_allocated(w.device)
            workers[w.name] = stats
        return workers

    def reset(self) -> None:
        self.peaks = {}   # the next call predicts again
        for w in self.workers:
            w.ledger.reset_peak()
