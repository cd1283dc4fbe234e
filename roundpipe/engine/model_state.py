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

    # ---- an nn.Module to a parent (RoundPipe derives from nn.Module: Lightning, Accelerate, any parent module)
    def _adopt_owner(self) -> None:
        """Makes the owner's module tree this module's own: the same parameter, buffer and child dicts, so a
        parent module sees the real masters under the owner's names (`parent.rp.0.weight` for a layer list,
        `parent.rp.model.layers.0...` for an HF model), its optimizer steps them, and its state_dict,
        load_state_dict, train(), eval(), named_modules() and apply() reach them.  What the engine keeps
        beside them (workers, threads, arena) are plain attributes, never submodules (`__setattr__`)."""
        owner = self._owner
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, name, getattr(owner, name))
        # a parent's load_state_dict reaches the tensors through the shared dicts, not through load_state_dict
        # below: the same waits come first and the same refresh after
        self.register_load_state_dict_pre_hook(ModelState._before_parent_load)
        self.register_load_state_dict_post_hook(ModelState._after_load)
        object.__setattr__(self, "_adopted", True)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)   # the engine's own state: never a submodule or parameter

    @property
    def training(self) -> bool:
        """The owner's train/eval mode (a parent reads and restores it here, as Lightning does)."""
        return self._owner.training if self.__dict__.get("_adopted") else True

    @training.setter
    def training(self, mode: bool) -> None:
        if self.__dict__.get("_adopted"):   # nn.Module.__init__'s own `training = True` does not reach the owner
            self._owner.training = mode

    def _apply(self, fn, recurse: bool = True):
        """`.to(device)`, `.cuda()`, `.cpu()` from a parent (Lightning and Accelerate move the whole model) leave
        the masters in host memory, where the engine keeps them (its workers are the devices); a cast refuses."""
        probe = torch.zeros(1)
        out = fn(probe)
        if isinstance(out, torch.Tensor) and out.dtype != probe.dtype:
            raise TypeError(f"a RoundPipe cannot be cast to {out.dtype} (.half(), .to(dtype), a framework's "
                            "'16-true'/'bf16-true' precision): its masters stay in master_dtype and it computes in "
                            "its compute_dtype; give RoundPipe(compute_dtype=...) or precision=, and a mixed "
                            "precision to the framework")
        return self

    def forward(self, *args, **kwargs) -> Any:
        return self(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._owner.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self._owner.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._owner.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._owner.named_buffers(*args, **kwargs)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The module's state_dict after every pending step (a parent's state_dict calls this with its prefix);
        masters on disk (offload_dir, phase 2) are read into copies (their bytes in RAM: save_checkpoint streams
        them instead)."""
        with self._api:
            self._check_open()
            self._drain()
            if self.device_step is not None:   # masters the device step updated (device_step.py)
                self.device_step.home(grads=False)
            sd = self._owner.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
            if self.offload is not None and self.offload.placeholders:
                for name in self.offload.masters_on_disk({k: v for k, v in sd.items() if k.startswith(prefix)}):
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

    def _before_load(self, assign: bool) -> None:
        """Under self._api: pending steps end, the device step's state comes home and is dropped."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would put new tensors in place of the masters the engine "
                             "holds (its pinned upload copies, optimizer state and workers point at them); load "
                             "with assign=False: the values are copied into the masters")
        self._check_open()
        self._drain()
        if self.device_step is not None:   # the optimizer state it updated comes home; the masters are replaced
            self.device_step.home(grads=False)
            self.device_step.drop()

    def _before_parent_load(self, state_dict, prefix, local_metadata, *_) -> None:
        with self._api:
            self._before_load(bool(local_metadata.get("assign_to_params_buffers", False)))

    def _after_load(self, *_) -> None:
        """The upload copies of every layer rewritten from the masters just loaded."""
        with self._api:
            for l in range(len(self.host)):
                self.host.refresh(l)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        with self._api:
            self._before_load(assign)
            result = self._owner.load_state_dict(state_dict, strict=strict)
            self._after_load()
            return result

    def train(self, mode: bool = True) -> ModelState:
        if not isinstance(mode, bool):
            raise ValueError(f"train(mode) takes True or False, got {mode!r}")
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
