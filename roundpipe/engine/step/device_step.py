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
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from roundpipe.engine.step.host_state import HostState


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
        device-stepped) added to the device sums, the update, the weights rewritten."""
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
                optimizer.step_copies([st.params[j] for j in live], [rec.master[j] for j in live],
                                      [rec.grad[j] for j in live], [rec.state[j] for j in live], clip_coef)
            for j in live:
                if w.compute_dtype != torch.float32:
                    if j in rec.weight:
                        rec.weight[j].copy_(rec.master[j])
                    else:
                        rec.weight[j] = w.ledger.track(rec.master[j].to(w.compute_dtype), "weights")
            rec.grad.clear()
            rec.dirty = rec.dirty or bool(live)

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


def _call(ref: weakref.ref, method: str, **kwargs: Any) -> None:
    """ref()'s method, unless the DeviceStep is gone."""
    obj = ref()
    if obj is not None:
        getattr(obj, method)(**kwargs)
