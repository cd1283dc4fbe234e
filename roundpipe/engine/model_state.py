"""What a RoundPipe presents of its state: the wrapped module's API (parameters, state dicts, train/eval),
checkpoints, memory figures and traces.  `RoundPipe` (model.py) derives from `ModelState`; the attributes
read here are the ones RoundPipe.__init__ makes (module, host, offload, predictions, workers, ...), and
the calls (`_drain`, `_retire`, `_check_open`) are RoundPipe's own.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from roundpipe.engine.state import checkpoint
from roundpipe.planner.autosplit import SplitModule
from roundpipe.planner.plan import Plan
from roundpipe.trace import Trace


class ModelState:
    """The state side of `RoundPipe` (see the module docstring)."""

    @property
    def _owner(self) -> nn.Module:
        """The module whose parameters, names and state dict this model presents: the wrapped
        layers (an rp.hf.wrap model: the HF model; a module cut into layers: that module; both hold the same
        tensors)."""
        return self.module.source if isinstance(self.module, SplitModule) else self.module

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._owner.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self._owner.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._owner.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._owner.named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The module's state_dict after every pending step; masters on disk (offload_dir, phase 2) are read into
        copies (their bytes in RAM: save_checkpoint streams them instead)."""
        with self._api:
            self._check_open()
            self._drain()
            if self.device_step is not None:   # masters the device step updated (device_step.py)
                self.device_step.home(grads=False)
            sd = self._owner.state_dict(*args, **kwargs)
            if self.offload is not None and self.offload.placeholders:
                for name in self.offload.masters_on_disk(sd):
                    sd[name] = self.offload.master(sd[name])
            return sd

    def named_state(self) -> dict[str, torch.Tensor]:
        """Every master and buffer under the names a checkpoint stores them by: the owner's state_dict
        names, plus any tensor of the layers that state dict does not hold, under its layer name."""
        named = dict(self._owner.state_dict(keep_vars=True))
        if self._owner is not self.module:
            held = {(t.data_ptr(), t.dtype, tuple(t.shape)) for t in named.values()}
            for name, t in self.module.state_dict(keep_vars=True).items():
                if (t.data_ptr(), t.dtype, tuple(t.shape)) not in held:
                    named[f"roundpipe.layers.{name}"] = t
        return named

    def load_state_dict(self, state_dict, strict: bool = True):
        with self._api:
            self._check_open()
            self._drain()
            if self.device_step is not None:   # the optimizer state it updated comes home; the masters are replaced
                self.device_step.home(grads=False)
                self.device_step.drop()
            result = self._owner.load_state_dict(state_dict, strict=strict)
            for l in range(len(self.host)):
                self.host.refresh(l)
            return result

    def train(self, mode: bool = True) -> ModelState:
        self._owner.train(mode)
        return self

    def eval(self) -> ModelState:
        return self.train(False)

    # ---- checkpoints (roundpipe/engine/state/checkpoint.py)
    def save_checkpoint(self, path, optimizer=None, lr_scheduler=None, *, extra: dict | None = None) -> None:
        """Writes a checkpoint directory that `load_checkpoint` resumes from bit for bit.

        Not a sync point: an asynchronous step still pending (its stale window open) is saved as
        pending, with what it will read, and the run goes on exactly as without the save.  Pass
        the optimizer and lr_scheduler given to step() (required while a step is pending).
        extra: JSON-serialisable values of the caller's (epoch, data position), returned by
        load_checkpoint."""
        with self._api:
            self._check_open()
            self._retire()   # calls in flight end; nothing is issued or closed
            pending = self.sync.wait_settled()
            for t in self._host_threads():
                t.raise_error()
            if self.device_step is not None:   # masters, state and gradients the device step holds (device_step.py)
                self.device_step.home(grads=True)
            checkpoint.save(self, path, pending, optimizer, lr_scheduler, extra)

    def load_checkpoint(self, path, optimizer=None, lr_scheduler=None) -> dict:
        """Restores a checkpoint of this model (masters, buffers, pending gradients and step, loss
        scale, the CPU RNG state) and, if given, the optimizer's and lr scheduler's state; build
        them over this model's parameters first.  Everything is checked before anything changes.
        Returns the `extra` dict it was saved with ({} if none)."""
        with self._api:
            self._check_open()
            self._drain()
            self.resident.clear()   # the weights change under the kept copies (their keys would move too)
            if self.device_step is not None:   # and the device step's: the checkpoint's are what the next step reads
                self.device_step.drop(grads=True)
            return checkpoint.load(self, path, optimizer, lr_scheduler)

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Device bytes per worker (current and peak per category, roundpipe/workers/ledger.py) and host
        bytes of the training state; with `optimizer`, its state's bytes too; "kept_graphs": the last
        training call's backward stages ([first, last] layer) that kept their forward's graph.  Peaks since the last
        `reset_peak_memory()`.  On CUDA each worker also reports torch.cuda.memory_allocated.
        Waits for the calls still draining (`wait_calls`), so the figures are not caught mid-call."""
        if not self._closed:
            self.wait_calls()
        workers = self.predictions.worker_stats()
        for name, stats in workers.items():   # resident weights (roundpipe/engine/calls/resident.py)
            stats["resident_bytes"] = self.resident.nbytes(name)
            stats["resident_layers"] = len(self.resident.layers(name))
            if self.device_step is not None and name == self.device_step.worker.name:
                stats["device_step_bytes"] = self.device_step.nbytes()
                stats["device_step_layers"] = len(self.device_step.layers)
        host = self.host.host_bytes()
        if optimizer is not None:
            host["optimizer_state"] = sum(v.nbytes for state in optimizer.state.values()
                                          for v in state.values() if isinstance(v, torch.Tensor))
        if self.offload is not None:
            host.update(self.offload.stats())
        # the backward stages of the last training call that ran on their forward's graph (docs/planner.md)
        kept = [[r.start, r.stop - 1] for r in self._kept_graphs]
        return {"workers": workers, "host": host, "kept_graphs": kept}

    def reset_peak_memory(self) -> None:
        self.predictions.reset()

    @contextlib.contextmanager
    def record_trace(self) -> Iterator[Trace]:
        """Records the compute of every stage-microbatch of the calls begun in the block into a Trace.

        One event per compute span (a forward, a recompute, a loss, a backward), waits left out,
        and one per copy (issued to completed, on a row per worker queue, cat "copy"); leaving
        the block waits for the calls begun in it to end, so the trace is complete."""
        trace = Trace(metadata={"devices": [str(d) for d in self.devices], "plan": repr(self.plan)})
        self._trace = trace
        for w in self.workers:   # every copy too, one row per queue ("cpu:0 param_up"), cat "copy"
            w.copies.record_copies(lambda q, n, t0, t1, w=w: trace.add(
                f"{w.name} {q}", f"{q} {n} B", t0, t1, cat="copy", bytes=n))
        try:
            yield trace
        finally:
            self._trace = None
            try:
                with self._api:
                    if not self._closed:
                        self._retire()
            finally:
                for w in self.workers:
                    w.copies.record_copies(None)

    def _trace_call(self, plan: Plan):
        """This call's view of the recording trace (events stamped with the iteration), or None."""
        if self._trace is None:
            return None
        j = self.sync.iteration + 1   # the iteration this call begins
        self._trace.metadata.setdefault("plans", {})[j] = repr(plan)   # the plan may change between calls
        return self._trace.scoped(iteration=j)
