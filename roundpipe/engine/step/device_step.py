"""The device step: resident trained layers are updated on their worker (`RoundPipe(device_step=True)`).

With the host step every training iteration of a layer downloads its gradients and uploads its new
weights, and the host's CPU updates the fp32 masters in between.  For a model that fits the
device that traffic and the CPU update set the pace (docs/benchmarks.md, "GPU path: expected
gains").  With `device_step=True`, each resident layer (roundpipe/engine/calls/resident.py) whose
trained parameters are its own (no weight shared with another layer) keeps on its worker:

    master    an fp32 copy of each trained parameter (the weight stages bind when the compute
              dtype is fp32, else `weight` is made from it after each update)
    state     the optimizer's state buffers of it (FusedOptimizer.state_copies)
    grad      the fp32 sum of the calls' gradients since the last step

A backward stage hands such a layer's fp32 gradient sums here instead of downloading them; the
step updates masters, state and weights with the optimizer's own formula in torch ops
(FusedOptimizer.step_copies) on the worker's compute stream; the next call binds the updated
weights.  Nothing of the layer crosses the bus between steps.

One worker only: a pool of several would have to move a layer's state with it as the dispatch
rotates.  Synchronous steps (the default) with a roundpipe.optim optimizer and fp32 masters;
gradient clipping works (each device layer's norm joins the host's); fp16 loss scaling does not.

Where the truth lives.  Between steps the worker's masters and state are newer than the host's
(`dirty`).  They come home at the model's sync points: `synchronize()` (with the gradients, into
p.grad), `state_dict()`, `save_checkpoint` (with the gradients), `close()`, and the optimizer's
own `state_dict()` (a hook).  A synchronous step is not one: read masters after `synchronize()`.
A call that runs out of device memory with kept weights ends residency (roundpipe/engine/calls/resident.py);
the device step's tensors then come home too (`evict`) and its layers are stepped on the host.
A master the user changes after a sync point is uploaded again at the next call or step (its
device copies are dropped); one changed while its device copy is newer is a ValueError, since
the change was made to stale values.  `load_state_dict` / `load_checkpoint` drop the device
copies (the optimizer's `load_state_dict` drops the device state), so what was loaded is what
the next step reads.

Failed calls.  A call's gradients are summed apart (`_pending`) and joined to the layer's sum
when the call ends well, in call order; a failed call's are dropped, so the sum is exactly what
it was.  The memory model counts both sums (roundpipe/engine/device_memory.py).

Out of memory in a step.  The optimizer's formula updates a layer's tensors one parameter at a time,
in place, and allocates temporaries as it goes (Adam: the moments are written, then `sqrt`
allocates), so an allocation failing in the second parameter would leave the first one stepped (its
step count advanced), the second half-stepped, `dirty` unset and the weights not rewritten:
synchronize() would show the host's masters while the next call trained on the device's.  A layer's
update is therefore all or nothing (`_step`): what it allocates beside the formula's temporaries (a
bf16 weight's first buffer) and the truth before it are made before anything is written, and if the
formula raises, the layer is put back exactly as it was: the error reaches step()'s caller, the
protocol drops the step's gradients (as for any failed update) and the layer stays a device layer.
The truth before the update is the host's while the layer is not dirty (its first step, and the
first after a sync point): the device copies are dropped and made again from the host's at the next
step, nothing is copied.  While it is dirty (every other step) the device's masters and state are
the only truth, so they are copied on the device first and written back on failure (copy_, which
allocates nothing); the optimizer's host entries the update changes (step counts advanced in place,
the buffers a state lacked) are restored either way.  Cost: one layer's masters and state (Adam: 12
bytes per parameter) while it is updated, which the memory model counts (roundpipe/planner/memory.py
`worker_peaks`), and one copy of them per step (24 bytes per parameter read and written, beside the
~80 of Adam's formula in torch ops: counted from its ops, not timed on a GPU).  Rejected: reserving
the temporaries before writing (nothing more allocated, but the formula's allocations belong to the
optimizer and whether they reuse a reservation is the CUDA caching allocator's business, which no
CPU test can show), and stepping each parameter into its own scratch (one parameter's bytes, not a
layer's, but a failure in the second parameter would still leave the first stepped).  On a CPU
worker that records workspace (under a cap) the formula's temporaries are workspace in its ledger,
so a full modelled device fails there as a GPU would (tests/engine/test_device_step_oom.py).

Resident copies.  Before the device step owns a layer, its stages bind the kept upload copies of
resident.py; afterwards they bind `weight`, and the kept copy would stay beside it (24 bytes per
parameter held in bf16 where the model counts 22).  Each update stamps the layer on the host, as
a host update does, so its upload key moves and the next call's lookup drops the kept copy; none
is kept again for a weight the device step supplies (roundpipe/engine/calls/stage.py `upload_stage`).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from roundpipe.engine.step.host_state import HostState
from roundpipe.workers.ledger import WorkspaceTracker


def eligible(host: HostState) -> list[bool]:
    """Per layer, whether it can be stepped on the device: its trained parameters are all its own (no weight
    shared with another layer) and in fp32 masters."""
    groups = host.groups()
    return [groups[l] == (l,) and bool(st.trainable) and host.master_dtype == torch.float32
            for l, st in enumerate(host.layers)]


@dataclass
class DeviceLayer:
    """One device-stepped layer's tensors on the worker, per trained parameter index j."""

    master: dict[int, torch.Tensor] = field(default_factory=dict)   # fp32 masters (none before the first step)
    weight: dict[int, torch.Tensor] = field(default_factory=dict)   # what stages bind (the master when fp32)
    state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)   # optimizer state buffers
    grad: dict[int, torch.Tensor] = field(default_factory=dict)     # fp32 gradient sums of ended calls
    dirty: bool = False   # masters and state newer than the host's


class DeviceStep:
    """Masters, optimizer state and gradients of the device-stepped layers on the one worker."""

    def __init__(self, host: HostState, worker: Any):
        self.host, self.worker = host, worker
        self.layers: dict[int, DeviceLayer] = {}
        # per call (its index), per (layer, j): the fp32 gradient it landed, until it ends
        self._pending: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self._lock = threading.Lock()   # landings on the worker thread, call ends on the completion thread
        self._optimizer: Any = None     # the optimizer whose hooks are registered
        self._hooks: list = []
        self._eligible = eligible(host)

    # ---- which layers
    def chosen(self, count: int) -> frozenset[int]:
        """The device-stepped layers of a call whose first `count` layers are resident: the eligible
        ones among them, and any layer still holding device copies (they go home at its next step)."""
        with self._lock:
            return frozenset(l for l in range(count) if self._eligible[l]) | frozenset(self.layers)

    def weights(self, layer: int) -> list[torch.Tensor | None]:
        """Per parameter of the layer, the device weight a stage binds (None: upload as usual)."""
        with self._lock:
            rec = self.layers.get(layer)
            n = len(self.host.layers[layer].params)
            return [None] * n if rec is None else [rec.weight.get(j) for j in range(n)]

    # ---- gradients (worker thread, then the call's end)
    def land(self, call: int, layer: int, grads: list[torch.Tensor | None]) -> None:
        """A backward stage's fp32 gradient sums of a device layer (per trained parameter, None: none),
        kept apart for the call until it ends."""
        st = self.host.layers[layer]
        with self._lock, self.worker.compute():
            pending = self._pending.setdefault(call, {})
            for j, g in zip(st.trainable, grads):
                if g is None:
                    continue
                self.worker.ledger.track(g, "gradients")
                have = pending.get((layer, j))
                pending[(layer, j)] = g if have is None else have.add_(g)

    def end_call(self, call: int, ok: bool) -> None:
        """The call ended: its gradients join the layers' sums (ok), or are dropped."""
        with self._lock:
            pending = self._pending.pop(call, {})
            if not ok:
                return
            with self.worker.compute():
                for (layer, j), g in pending.items():
                    rec = self.layers.setdefault(layer, DeviceLayer())
                    have = rec.grad.get(j)
                    rec.grad[j] = g if have is None else have.add_(g)

    def grad_norms(self) -> list[torch.Tensor]:
        """Per device layer with gradients, the fp32 2-norm of its gradient sums, on the host.  Gradients of its
        layers that the host holds (shown by synchronize(), saved by save_checkpoint) join the device sums
        first: a parameter's gradient is their sum, and its norm is not the norms' combination."""
        with self._lock, self.worker.compute():
            for layer in self.layers:
                self._absorb(layer)
            out = []
            for rec in self.layers.values():
                gs = list(rec.grad.values())
                if gs:
                    out.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])).cpu())
            return out

    # ---- the update (the host thread, with the worker idle: steps are synchronous)
    def update(self, layer: int, optimizer: Any, clip_coef: float) -> None:
        """One step of the layer on the device: masters and state made there on its first step (from the
        host's), the host's own gradients (shown by synchronize(), or landed before the layer was
        device-stepped) added to the device sums, the update (all or nothing: `_step`), the weights rewritten."""
        st, w = self.host.layers[layer], self.worker
        with self._lock, w.compute():
            rec = self.layers.setdefault(layer, DeviceLayer())
            self._register(optimizer)
            for j in st.trainable:
                p = st.params[j]
                if j not in rec.master:
                    rec.master[j] = w.ledger.track(p.detach().to(w.device, copy=True), "optimizer")
                    if w.compute_dtype == torch.float32:
                        rec.weight[j] = rec.master[j]
            self._absorb(layer)
            live = [j for j in st.trainable if j in rec.grad]
            for j in live:
                if j not in rec.state:
                    rec.state[j] = {k: w.ledger.track(v, "optimizer")
                                    for k, v in optimizer.state_copies(st.params[j], w.device).items()}
            if live:
                self._step(layer, rec, live, optimizer, clip_coef)
            rec.grad.clear()

    def _step(self, layer: int, rec: DeviceLayer, live: list[int], optimizer: Any, clip_coef: float) -> None:
        """The update of the layer's parameters `live`, all or nothing (module docstring, "Out of memory in a
        step"): what it allocates beside the formula's temporaries first, then, while the layer is dirty, a
        copy of what the formula writes, restored if anything raises (not dirty: the device copies are
        dropped, the host's are the truth); on success the weights stages bind are rewritten and the layer
        stamped (its resident key moves: the kept upload copy the device weight replaced is dropped)."""
        st, w = self.host.layers[layer], self.worker
        params = [st.params[j] for j in live]
        fp32 = w.compute_dtype == torch.float32
        made = {j: w.ledger.track(torch.empty_like(rec.master[j], dtype=w.compute_dtype), "weights")
                for j in live if not fp32 and j not in rec.weight}
        # the truth before the update: the host's while the layer is not dirty, else a copy made on the device
        dirty = rec.dirty
        saved = _Saved(w, [rec.master[j] for j in live] + [v for j in live for v in rec.state[j].values()]
                       if dirty else [], [optimizer.state[p] for p in params])
        # a CPU worker recording workspace sees the formula's temporaries (on CUDA memory_allocated counts them)
        tracker = WorkspaceTracker(w.ledger, w.device.type) if w.records_workspace else None
        try:
            with tracker if tracker is not None else contextlib.nullcontext():
                optimizer.step_copies(params, [rec.master[j] for j in live], [rec.grad[j] for j in live],
                                      [rec.state[j] for j in live], clip_coef)
        except BaseException:
            saved.restore()
            if not dirty:   # made again from the host's at the next step, uploaded from it until then
                rec.master.clear()
                rec.weight.clear()
                rec.state.clear()
            raise
        rec.weight.update(made)
        if not fp32:
            for j in live:
                rec.weight[j].copy_(rec.master[j])
        rec.dirty = True
        self.host.stamp(layer)

    def _absorb(self, layer: int) -> None:
        """The host's gradients of a device layer (shown at a sync point, or landed before the layer was
        device-stepped) added to its device sums and cleared on the host (under the lock, compute stream)."""
        st, w = self.host.layers[layer], self.worker
        rec = self.layers.setdefault(layer, DeviceLayer())
        for j in st.trainable:
            p = st.params[j]
            host_grad = p.grad if p.grad is not None else st.held[j]
            if host_grad is not None:
                g = w.ledger.track(host_grad.to(w.device, torch.float32, copy=True), "gradients")
                rec.grad[j] = g if j not in rec.grad else rec.grad[j].add_(g)
        self.host.clear_grads(layer)

    def drop_grads(self, layer: int) -> None:
        """A skipped or failed update: the layer's gradient sums are consumed all the same."""
        with self._lock:
            rec = self.layers.get(layer)
            if rec is not None:
                rec.grad.clear()

    # ---- home (sync points)
    def home(self, grads: bool) -> None:
        """Masters and optimizer state newer on the device are written into the host's (the upload copies
        rewritten, the stamps taken); with `grads`, the device gradient sums move into p.grad too."""
        with self._lock, self.worker.compute():
            for layer, rec in self.layers.items():
                st = self.host.layers[layer]
                if rec.dirty:
                    for j, m in rec.master.items():
                        st.params[j].data.copy_(m)
                    if self._optimizer is not None:
                        for j, bufs in rec.state.items():
                            self._optimizer.store_state(st.params[j], bufs)
                    self.host.pcopy(layer)
                    rec.dirty = False
                if grads and rec.grad:
                    for j, g in rec.grad.items():
                        p = st.params[j]
                        host_g = g.to("cpu", copy=True)
                        if p.grad is None and st.held[j] is not None:
                            p.grad, st.held[j] = st.held[j].float(), None
                        p.grad = host_g if p.grad is None else p.grad.add_(host_g)
                    rec.grad.clear()

    def dirty(self, layer: int) -> bool:
        with self._lock:
            rec = self.layers.get(layer)
            return rec is not None and rec.dirty

    def drop(self, layer: int | None = None, grads: bool = False) -> None:
        """Forgets the device masters, weights and state of `layer` (None: every layer), and with `grads`
        its gradient sums: the host's are what the next step reads (after a load or an edit)."""
        with self._lock:
            for l in list(self.layers) if layer is None else [layer]:
                rec = self.layers.get(l)
                if rec is None:
                    continue
                rec.master.clear()
                rec.weight.clear()
                rec.state.clear()
                rec.dirty = False
                if grads:
                    rec.grad.clear()
                if not rec.grad:
                    del self.layers[l]

    def evict(self) -> None:
        """Everything comes home and the device keeps nothing (after a call ran out of device memory: the
        layers are stepped on the host from then on, the resident prefix being 0)."""
        self.home(grads=True)
        self.drop(grads=True)

    def drop_state(self) -> None:
        """The optimizer loaded a state: the device copies of the old one are forgotten (the masters stay)."""
        with self._lock:
            for rec in self.layers.values():
                rec.state.clear()

    def nbytes(self) -> int:
        """Device bytes held: masters, weights made from them, state and gradient sums."""
        with self._lock:
            seen = {}
            for rec in self.layers.values():
                for t in [*rec.master.values(), *rec.weight.values(), *rec.grad.values(),
                          *(v for bufs in rec.state.values() for v in bufs.values())]:
                    seen[id(t)] = t.nbytes
            return sum(seen.values())

    # ---- the optimizer's own state_dict / load_state_dict
    def _register(self, optimizer: Any) -> None:
        """Hooks on the optimizer stepping the layers: its state_dict() brings the device state home first,
        its load_state_dict() drops it (called under the lock)."""
        if optimizer is self._optimizer:
            return
        for h in self._hooks:
            h.remove()
        for layer, rec in self.layers.items():   # another optimizer: the old one's state goes back to it
            for j, bufs in rec.state.items():
                self._optimizer.store_state(self.host.layers[layer].params[j], bufs)
            rec.state.clear()
        self._optimizer = optimizer
        me = weakref.ref(self)   # the optimizer may outlive the model: its hooks must not keep it
        self._hooks = [optimizer.register_state_dict_pre_hook(lambda opt: _call(me, "home", grads=False)),
                       optimizer.register_load_state_dict_post_hook(lambda opt: _call(me, "drop_state"))]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._optimizer = [], None
        with self._lock:
            self.layers.clear()
            self._pending.clear()


class _Saved:
    """What a layer's update writes, as it was before the update: copies of its device tensors (masters and
    state buffers, in the ledger: they are device memory while the update runs) and the optimizer's host
    state entries of its parameters (which entries there were, and the 0-dim step counts by value: the
    update advances them in place and stores the buffers a state lacked)."""

    def __init__(self, worker: Any, tensors: list[torch.Tensor], states: list[dict[str, Any]]):
        self.device = [(t, worker.ledger.track(t.clone(), "optimizer")) for t in tensors]
        self.host = [(s, {k: v.clone() if isinstance(v, torch.Tensor) and v.dim() == 0 else v for k, v in s.items()})
                     for s in states]

    def restore(self) -> None:
        """Everything back as it was (copies into the tensors themselves: nothing is allocated)."""
        for t, copy in self.device:
            t.copy_(copy)
        for s, entries in self.host:
            s.clear()
            s.update(entries)


def _call(ref: weakref.ref, method: str, **kwargs: Any) -> None:
    """ref()'s method, unless the DeviceStep is gone."""
    obj = ref()
    if obj is not None:
        getattr(obj, method)(**kwargs)
