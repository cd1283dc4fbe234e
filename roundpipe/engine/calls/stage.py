"""One stage run: upload a stage's weights to a worker and run it over its microbatches.

Three kinds of stage (docs/architecture.md, "Computation dispatch"):

    F      forward only (no autograd), publishes the activation at every saved boundary
           inside the stage: the next forward stage's input and backward stages' inputs
    fused  the tail: forward + loss + backward back to back, no recompute (a composed call's
           backward seeds it with the caller's output gradient instead: composed.py)
    B      recompute from the saved input, then backward once the output gradient arrives; a kept
           B (dispatcher.Schedule.kept) runs the backward alone on the graph its forward stage kept
           on this worker, with the weights that stage bound: no upload, no input, no recompute

A B stage recomputes microbatch m before it asks for m's output gradient, so the
recompute overlaps with the upstream backward; only the backward part waits.  At layer grain
(RoundPipe(recompute="layer"), `StageTask.by_layer`) it recomputes and backpropagates one layer
at a time from the top, each from its own input saved by the forward (uploaded while the layer
above runs), so it holds one layer's activations whatever its size.
Parameter gradients accumulate in fp32 on the worker over the stage's
microbatches and are downloaded once per stage, in the compute dtype; buffers are written back after
F and fused stages only, so a recompute never updates them twice.  Constant buffers (a 4-bit base
weight's packed bytes: host_state.py) ride in the parameters' upload and are never written back.
A stage with 4-bit weights gets a DequantKeep (roundpipe/quant/keep.py) for its run: each weight is
dequantized once per compute dtype, kept (ledger: weights) for all microbatches and products, and
dropped at the release.

The layer compute itself (layers in order, backward, error tags) is in
roundpipe/engine/calls/compute.py; the copies go through the worker (roundpipe/workers/).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from roundpipe.core.tree import detached, tree_leaves, tree_map, tree_unflatten
from roundpipe.engine.calls.batchnorm import BUFFERS_LOCK, buffers_snapshot, recording
from roundpipe.engine.calls.compute import autograd_backward, float_leaves, loss_parts, run_layers, tag
from roundpipe.engine.calls.context import CallContext
from roundpipe.planner.memory import first_input
from roundpipe.quant.keep import DequantKeep, attach
from roundpipe.workers.base import Arrival, Handoff, Upload, Worker


@dataclass
class Consumer:
    worker: Worker
    forward: bool           # a forward (or fused) stage reads it as its input


@dataclass
class StageTask:
    kind: str                # "F", "fused" or "B"
    layers: range
    round: int
    slot: int
    mbs: list[int]
    # F: boundary -> consumers of the activation published there; fused/B: consumers of grad at start
    consumers: dict[int, list[Consumer]] = field(default_factory=dict)
    last_round: bool = True
    by_layer: bool = False   # B: layer-grain recompute (one layer at a time, each from its saved input)
    kept: bool = False       # B: backward on the graph its forward stage kept (dispatcher.Schedule), no recompute
    keep: tuple[range, ...] = ()   # F: the layer ranges run with autograd, their graphs kept for a kept B

    @property
    def label(self) -> str:
        return f"{self.kind}{self.slot}[{self.layers.start}-{self.layers.stop - 1}]"


class StageRun:
    """The weights of one stage bound on one worker, and its per-microbatch steps."""

    def __init__(self, ctx: CallContext, w: Worker, task: StageTask, last: bool = False):
        self.ctx, self.w, self.task = ctx, w, task
        self.last = last   # the worker's last stage of the call: its gradient download overlaps nothing
        self.reps = [ctx.replicas[w.name][l] for l in task.layers]
        self.bound: list[list[torch.nn.Parameter]] = []
        self.acc: list[list[torch.Tensor | None]] = []
        self.early: dict[tuple[int, int], Arrival] = {}   # (layer, microbatch) -> input upload issued early
        self._routes: dict[tuple, tuple[bool, bool]] = {}   # (kind, boundary) -> (keep_device, need_host)
        self.keep: DequantKeep | None = None   # the stage's dequantized 4-bit weights, while it runs
        self.quantized: list = []              # the replicas' 4-bit modules the keep is attached to
        self.segments = _segments(task) if task.keep else []   # a forward stage's layers cut at its kept ranges

    def _get(self, key: tuple) -> Any:
        """A board value; held-back bulk copies are sent first if it has to be waited for."""
        found, value = self.ctx.board.poll(key)
        if found:
            return value
        self.w.before_wait()
        with self.w.yielded():   # another worker may need the turn to produce it
            return self.ctx.board.get(key)

    def _use(self, arrival: Arrival) -> Any:
        """The arrived tensors as they were sent (no cast at stage boundaries: precision.py)."""
        return self.w.use(arrival)

    def _input(self, m: int, cast: bool = True, layer: int | None = None) -> Any:
        """Microbatch m's input of `layer` (default: the stage's first layer)."""
        layer = self.task.layers.start if layer is None else layer
        # a backward stage recomputes from the host copy, never from the forward consumer's tensors
        arrival = self.early.pop((layer, m), None)
        if arrival is None:
            arrival = self.w.receive(self._get(("act", layer, m)), self.task.kind != "B")
        x = self._use(arrival)
        return self.ctx.precision.cast_call_inputs(x) if layer == 0 and cast else x

    def upload_input_early(self, m: int, layer: int | None = None) -> None:
        """Issues microbatch m's input upload of `layer` now if it has arrived (it then overlaps the compute
        before it); default: the first input the stage reads (its top layer's at layer grain)."""
        if self.task.kept:
            return   # it reads no input: its forward's graph is on the worker
        layer = first_input(self.task, self.task.by_layer) if layer is None else layer
        found, h = self.ctx.board.poll(("act", layer, m))
        if found:
            self.early[(layer, m)] = self.w.receive(h, self.task.kind != "B")

    def upload(self, prefetched: Upload | None) -> None:
        ctx, task, w = self.ctx, self.task, self.w
        if task.kept:
            return self._bind_kept()
        grad = task.kind != "F"
        kept = {l for r in task.keep for l in r}   # run with autograd for a kept backward stage
        for l in task.layers:
            if ctx.write_buffers and ctx.host.layers[l].written and task.kind != "B" and task.round > 0:
                self._get(("buf", l, task.round - 1))   # buffers of the previous round's forward
        if prefetched is None:
            for l in task.layers:
                if not ctx.sync.upload_ready(ctx.call, l):
                    w.before_wait()
                    with w.yielded():
                        ctx.sync.wait_upload(ctx.call, l, ctx.abort_requested)
            prefetched = upload_stage(ctx, w, task.layers, windows=1, urgent=True)   # waited for right below
        stage_params = w.params_ready(prefetched)
        for l, rep, params in zip(task.layers, self.reps, stage_params):
            st = ctx.host.layers[l]
            params, bufs = params[:len(st.params)], params[len(st.params):]   # uploads: parameters, then constants
            if st.written:   # in buffer order: the constants uploaded with the parameters, the rest now
                written = iter(w.upload_buffers(buffers_snapshot(st.buffers, st.written, w.host_alloc)))
                constants = iter(bufs)
                bufs = [next(constants) if c else next(written) for c in st.constant]
            self.bound.append(rep.bind(params, [(grad or l in kept) and p.requires_grad for p in st.params], bufs))
            self.acc.append([None] * len(st.trainable))
            if grad and w.compute_dtype != torch.float32:
                acc = self.acc[-1]
                for k, j in enumerate(st.trainable):
                    self.bound[-1][j].register_post_accumulate_grad_hook(functools.partial(self._fold, acc, k))
        self.quantized = [m for rep in self.reps for m in rep.keeping]
        if self.quantized:   # dequantize once per stage run (roundpipe/quant/keep.py)
            self.keep = DequantKeep(w.ledger)
            attach(self.quantized, self.keep)

    def _bind_kept(self) -> None:
        """A kept backward stage: the weights its forward stage bound on this worker (the kept graph uses
        them; their gradients land on them), with this stage's accumulators."""
        self.bound = self.ctx.kept.pop(("weights", self.task.layers.start, self.task.round))
        for l, bound in zip(self.task.layers, self.bound):
            acc = [None] * len(self.ctx.host.layers[l].trainable)
            self.acc.append(acc)
            if self.w.compute_dtype != torch.float32:
                for k, j in enumerate(self.ctx.host.layers[l].trainable):
                    bound[j].register_post_accumulate_grad_hook(functools.partial(self._fold, acc, k))

    def release(self) -> None:
        """The end of the stage: its weights die once their copies completed (tests/engine/test_memory.py);
        those of a kept graph live on in it until its backward stage ran."""
        for rep in self.reps if not self.task.kept else ():
            rep.unbind()
        if self.keep is not None:   # the kept dequantized weights die here
            attach(self.quantized, None)
            self.keep.release()
        self.bound.clear()
        self.acc.clear()
        self.w.copies.release_completed()

    # ---- microbatch steps
    def _publish_act(self, m: int) -> Callable[[int, Any], None]:
        def publish(b: int, x: Any) -> None:
            cons = self.task.consumers.get(b, [])
            if self.ctx.check_recompute is not None:
                self.ctx.check_recompute[(b, m)] = tree_map(lambda t: t.detach().cpu().clone()
                                                            if isinstance(t, torch.Tensor) else t, x)
            self._handoff(("act", b, m), x, cons, goes_on=b != self.task.layers.stop)
        return publish

    def _handoff(self, key: tuple, x: Any, cons: list[Consumer], goes_on: bool = False) -> None:
        """Publishes x under key for its consumers; goes_on: this stage's next layer gets x too (Worker.send)."""
        w = self.w
        if key[0] == "act" and key[1] == len(self.ctx.host):
            self.ctx.outputs[key[2]] = w.send(x, need_host=True, keep_device=False)
            return
        if not cons:
            return   # nobody reads it (put with no consumers stores nothing)
        # The same for every microbatch of the stage: worked out at its first one.
        route = self._routes.get(key[:2])
        if route is None:
            route = self._routes[key[:2]] = (any(c.forward and c.worker.space == w.space for c in cons),
                                            any((not c.forward) or c.worker.space != w.space for c in cons))
        self.ctx.board.put(key, w.send(x, route[1], route[0], goes_on), len(cons))

    def _report(self, m: int, part: str) -> Callable[[float, float], None] | None:
        """The trace's record of one compute span of microbatch m (None when no trace is kept).

        Only compute is recorded, never a wait (for an input, a gradient, the turn or an upload):
        idle time in a trace is idle time of the worker (roundpipe/sim/metrics.py)."""
        trace, task = self.ctx.trace, self.task
        if trace is None:
            return None
        name, layers = f"{task.label} mb{m}", f"{task.layers.start}-{task.layers.stop - 1}"
        return lambda t0, t1: trace.add(self.w.name, name, t0, t1, cat=task.kind, stage=task.label,
                                        layers=layers, round=task.round, part=part)

    def forward(self, m: int) -> None:
        x = self._input(m)
        if not self.task.keep:
            with torch.no_grad(), recording(self.ctx.bn_stats):
                run_layers(self.ctx, self.w, self.task.layers, x, m, self._publish_act(m), self._report(m, "forward"))
            return
        publish, report = self._publish_act(m), self._report(m, "forward")
        for i, (r, keep) in enumerate(self.segments):
            if not keep:
                with torch.no_grad(), recording(self.ctx.bn_stats):
                    x = run_layers(self.ctx, self.w, r, x, m, publish, report)
                continue
            # a kept backward stage's layers: their own graph from a fresh input leaf, kept on this worker
            x = detached(x)
            for t in float_leaves(x):
                t.requires_grad_(True)
            watched = tree_leaves(x)
            with torch.enable_grad(), recording(self.ctx.bn_stats):
                # handed on without the graph: the next stage's input is a leaf
                out = run_layers(self.ctx, self.w, r, x, m, lambda b, y: publish(b, detached(y)), report, saving=False)
            self.ctx.kept[("graph", r.start, m)] = (watched, out)
            if m == self.task.mbs[0]:
                first = self.task.layers.start
                self.ctx.kept[("weights", r.start, self.task.round)] = self.bound[r.start - first:r.stop - first]
            # the next (no_grad) segment may write its input in place: not the kept graph's output
            x = out if i + 1 == len(self.segments) or self.segments[i + 1][1] else \
                tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)

    def _input_with_grad(self, m: int, layer: int | None = None) -> tuple[Any, list | None]:
        """The input of `layer` (default: the stage's first) with its floating leaves requiring grad, and the
        leaves whose gradients are sent on: a later layer's every leaf; of the call's inputs (layer 0) only
        those a composed call wants (`ctx.input_grad_leaves`, made fresh leaves before the cast to the compute
        dtype), else none."""
        start, wanted = self.task.layers.start if layer is None else layer, self.ctx.input_grad_leaves
        if start == 0 and not wanted:
            return self._input(m, layer=0), None
        if start > 0:
            x = self._input(m, layer=start)
            for t in float_leaves(x):
                t.requires_grad_(True)
            return x, tree_leaves(x)
        raw = self._input(m, cast=False, layer=0)
        leaves = tree_leaves(raw)
        for i in wanted:
            leaves[i] = leaves[i].detach().requires_grad_(True)
        return self.ctx.precision.cast_call_inputs(tree_unflatten(raw, leaves)), [leaves[i] for i in wanted]

    @staticmethod
    def _input_grads(watched: list) -> list:
        return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in watched]

    def _publish_input_grad(self, m: int, watched: list | None) -> None:
        if watched is None:
            return
        grads = self._input_grads(watched)
        start = self.task.layers.start
        if start == 0:   # a composed call's input gradients: home to its caller
            self.ctx.input_grads[m] = self.w.send(grads, need_host=True, keep_device=False)
            return
        self._handoff(("grad", start, m), grads, self.task.consumers.get(start, []))

    def _backward(self, roots: list[torch.Tensor], grads: list[torch.Tensor] | None, m: int,
                  r: range | None = None) -> None:
        """Backward of `r` (default: the stage's layers) from roots seeded with grads."""
        if not roots:
            return
        r = self.task.layers if r is None else r
        try:
            with self.w.compute_span(self.ctx.compute_s, ("b", r.start, r.stop), self._report(m, "backward")):
                autograd_backward(roots, grads)
        except Exception as e:  # noqa: BLE001 - tagged and re-raised
            raise tag(e, f"backward of layers {r.start}-{r.stop - 1}")  # noqa: B904 - re-raises e itself, tagged

    def _fold(self, acc: list[torch.Tensor | None], k: int, p: torch.nn.Parameter) -> None:
        """Low-precision compute: a parameter's gradient, as soon as autograd has written it, is added to its
        fp32 accumulator over the microbatches and dropped (a post-accumulate-grad hook).  So a backward
        holds one low-precision parameter gradient at a time, not the whole stage's (2 bytes per
        parameter of the stage beside the 4 of the accumulators; the tiny decoder's 2-layer stage at
        hidden 1024: 48 MiB less at the peak, on CPU workers host memory outside the ledger)."""
        g, p.grad = p.grad, None
        # the fp32 accumulator is held until the stage's download: in the ledger
        acc[k] = self.w.ledger.track(g.float(), "gradients") if acc[k] is None else acc[k].add_(g)

    def fused(self, m: int) -> None:
        ctx = self.ctx
        x, watched = self._input_with_grad(m)
        with torch.enable_grad():
            with recording(ctx.bn_stats):   # the first forward of the fused layers (never recomputed)
                out = run_layers(ctx, self.w, self.task.layers, x, m, report=self._report(m, "forward"))
            if ctx.keep_outputs:
                ctx.outputs[m] = self.w.send(out, need_host=True, keep_device=False)
            labels = (self.w.use(self.w.receive(Handoff(host=ctx.labels[m], gpu_ready=ctx.gpu_ready)))
                      if ctx.labels[m] is not None else None)
            scale = ctx.loss_scale() if ctx.loss_scale is not None else 1.0   # fp16 loss scaling
            if ctx.seeded:   # a composed call: the caller's gradient of each output leaf, as it is
                loss = None
                self._backward(*self._seeds(out, labels, scale), m)
            else:
                loss = self._loss(out, labels, m)
                self._backward([loss.reshape(()) * (ctx.weights[m] * scale)], None, m)
        with ctx.lock:
            ctx.losses[m] = self.w.scalar(loss) if loss is not None else (torch.zeros(()), None)
            known = len(ctx.losses) == len(ctx.weights)
        if known:
            ctx.losses_known.set()
            if ctx.on_losses is not None:
                ctx.on_losses()
        self._publish_input_grad(m, watched)

    def _loss(self, out: Any, labels: Any, m: int) -> torch.Tensor:
        """Microbatch m's loss (its other entries, if loss_fn returned several, go home to the caller)."""
        ctx = self.ctx
        try:
            if ctx.loss_fn is None:
                value = out
            else:
                with self.w.compute_span(ctx.compute_s, ("l", self.task.layers.start, self.task.layers.stop),
                                         self._report(m, "loss")), ctx.precision.autocast_on(self.w.device.type):
                    value = ctx.loss_fn(out, labels)
            loss, form, extras = loss_parts(value) if ctx.loss_fn is not None else (value, (), [])
            if form:   # the other entries' shapes too: each is reduced over the microbatches like the loss
                form = (*form, tuple(tuple(e.shape) for e in extras))
        except Exception as e:  # noqa: BLE001 - tagged and re-raised
            raise tag(e, f"loss_fn (microbatch {m})")  # noqa: B904 - re-raises e itself, tagged
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            what = f"tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            src = "loss_fn" if ctx.loss_fn is not None else "the last layer (no loss_fn given)"
            raise tag(TypeError(f"{src} must return a floating scalar loss, got a {what}"), "loss_fn")
        with ctx.lock:
            if ctx.loss_form is None:
                ctx.loss_form = form
        if form != ctx.loss_form:
            raise tag(TypeError(f"loss_fn returned {_describe_form(form)} for microbatch {m} but "
                                f"{_describe_form(ctx.loss_form)} for another; return the same entries, in the same "
                                "shapes, for every microbatch (they are reduced over microbatches like the loss; "
                                "per-sample values: return_outputs=True)"), "loss_fn")
        if form:
            ctx.extras[m] = self.w.send([e.detach().float() for e in extras], need_host=True, keep_device=False)
        return loss

    @staticmethod
    def _seeds(out: Any, grads: list, scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The output leaves that require grad and their seed gradients (the caller's, in their dtype,
        times the fp16 loss scale), for a composed call's backward."""
        pairs = [(o, g) for o, g in zip(tree_leaves(out), grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        seeds = [g.to(o.dtype) * scale if scale != 1.0 else g.to(o.dtype) for o, g in pairs]
        return [o for o, _ in pairs], seeds

    def _check_recompute(self, r: range, m: int, out: Any) -> None:
        """With RoundPipe._check_recompute: the recompute of r equals its forward's output, bitwise (called
        after the output gradient arrived: the forward has surely run)."""
        if self.ctx.check_recompute is None:
            return
        ref = self.ctx.check_recompute.get((r.stop, m))
        got = [t.detach().cpu() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        exp = [t for t in tree_leaves(ref) if isinstance(t, torch.Tensor)]
        assert len(got) == len(exp) and all(torch.equal(a, b) for a, b in zip(got, exp)), \
            f"recompute of layers {r.start}-{r.stop - 1} microbatch {m} differs from its forward"

    def backward(self, m: int) -> None:
        if self.task.kept:
            return self._backward_kept(m)
        if self.task.by_layer:
            return self._backward_by_layer(m)
        ctx, r = self.ctx, self.task.layers
        x, watched = self._input_with_grad(m)
        with torch.enable_grad():
            out = run_layers(ctx, self.w, r, x, m, report=self._report(m, "recompute"), recompute=True)
        grads = self._use(self.w.receive(self._get(("grad", r.stop, m))))
        self._check_recompute(r, m, out)
        self._backward(*self._pairs(out, grads), m)
        self._publish_input_grad(m, watched)

    @staticmethod
    def _pairs(out: Any, grads: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The output leaves that require grad and have a gradient, and those gradients."""
        pairs = [(o, g) for o, g in zip(tree_leaves(out), grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward_kept(self, m: int) -> None:
        """The backward alone, on the graph the forward stage kept on this worker: nothing recomputed."""
        watched, out = self.ctx.kept.pop(("graph", self.task.layers.start, m))
        grads = self._use(self.w.receive(self._get(("grad", self.task.layers.stop, m))))
        self._backward(*self._pairs(out, grads), m)
        del out
        self._publish_input_grad(m, watched)

    def _backward_by_layer(self, m: int) -> None:
        """Layer grain: from the top layer down, recompute one layer from its saved input, backpropagate it,
        and hand its input gradient to the layer below on the worker.  The next layer's input is uploaded
        while this one runs; a layer's activations die before the next one is recomputed."""
        ctx, r = self.ctx, self.task.layers
        grads = None
        for l in reversed(r):
            x, watched = self._input_with_grad(m, l)
            if l > r.start:
                self.upload_input_early(m, l - 1)
            one = range(l, l + 1)
            with torch.enable_grad():
                out = run_layers(ctx, self.w, one, x, m, report=self._report(m, "recompute"), recompute=True)
            if grads is None:   # the stage's output gradient, once the top layer is recomputed
                grads = self._use(self.w.receive(self._get(("grad", r.stop, m))))
            self._check_recompute(one, m, out)
            self._backward(*self._pairs(out, grads), m, one)
            del x, out
            if l == r.start:
                self._publish_input_grad(m, watched)
            else:
                grads = self._input_grads(watched)
            del watched
            self.w.copies.release_completed()   # this layer's input upload dies now, not at the microbatch's end

    # ---- end of stage
    def finish(self) -> None:
        ctx, task = self.ctx, self.task
        if task.kind != "B" and ctx.write_buffers:
            for l, rep in zip(task.layers, self.reps):
                written = ctx.host.layers[l].written
                if written:
                    bound = rep.bound_buffers()
                    self.w.download_buffers([bound[i] for i in written], self._land_buffers(l))
        if task.kind != "F":
            per_layer, homed = [], []
            dt = self.w.compute_dtype
            for l, bound, acc in zip(task.layers, self.bound, self.acc):
                st = ctx.host.layers[l]
                fp32 = [bound[j].grad for j in st.trainable] if dt == torch.float32 else None
                if l in ctx.device_layers:   # stays on the worker in fp32 for the device step (device_step.py)
                    ctx.device_step.land(ctx.call.index, l, fp32 or acc)
                    continue
                homed.append(l)
                # summed in fp32 over the microbatches, sent home in the compute dtype (rounded once)
                per_layer.append(fp32 or self._rounded(acc))
            # One LPT-windowed download for the whole stage, riding behind the next activation downloads.
            sizes = [len(g) for g in per_layer]
            if homed:
                self.w.download_grads([g for gs in per_layer for g in gs], len(task.mbs),
                                      self._land_grads(homed, sizes), urgent=self.last)

    def _rounded(self, acc: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The layer's fp32 gradient accumulators in the compute dtype, each accumulator dropped as soon as
        it is rounded and each rounded copy in the ledger as it is made: the stage never holds all its
        fp32 sums beside all their low-precision copies (6 bytes per parameter of the stage, 4 + 2 for
        the one tensor in hand instead; on CPU workers that "device" memory is host memory)."""
        out = []
        for k, a in enumerate(acc):
            acc[k] = None
            out.append(None if a is None else self.w.ledger.track(a.to(self.w.compute_dtype), "gradients"))
            del a
        return out

    def _land_buffers(self, l: int) -> Callable[[list], None]:
        skip = self.ctx.bn_skip.get(l, ())

        def land(host_bufs: list) -> None:
            st = self.ctx.host.layers[l]
            with BUFFERS_LOCK:   # a stage uploading them snapshots them under it (batchnorm.buffers_snapshot)
                for i, src in zip(st.written, host_bufs):
                    if i not in skip:   # whole-batch BatchNorm statistics: the call's end updates them
                        st.buffers[i].copy_(src)
            self.ctx.board.put(("buf", l, self.task.round), True, 0 if self.task.last_round else 1)
        return land

    def _land_grads(self, layers: list[int], sizes: list[int]) -> Callable[[list], None]:
        def land(host_grads: list) -> None:
            start = 0
            try:   # one wake-up for the stage's layers (wait_grad_write wakes the waiters before it blocks)
                for l, n in zip(layers, sizes):
                    with self.w.yielded():   # earlier rounds' writes may come from another worker
                        self.ctx.sync.wait_grad_write(self.ctx.call, l, self.task.round, self.ctx.abort_requested)
                    self.ctx.host.land_grads(l, host_grads[start:start + n])
                    self.ctx.sync.grad_written(self.ctx.call, l)
                    start += n
            finally:
                self.ctx.sync.notify()
        return land


def _segments(task: StageTask) -> list[tuple[range, bool]]:
    """A forward stage's layers cut at its kept ranges: (range, kept) in order."""
    out, at = [], task.layers.start
    for r in sorted(task.keep, key=lambda r: r.start):
        if at < r.start:
            out.append((range(at, r.start), False))
        out.append((r, True))
        at = r.stop
    if at < task.layers.stop:
        out.append((range(at, task.layers.stop), False))
    return out


def _describe_form(form: tuple) -> str:
    """A loss_fn's return (compute.loss_parts's form plus the other entries' shapes) in words."""
    if not form:
        return "a tensor"
    kind, names, shapes = form
    entries = f"{names + 1} entries" if kind == "tuple" else f"the loss and {list(names)}"
    return f"a {kind} of {entries} (other entries' shapes {[list(s) for s in shapes]})"


def upload_stage(ctx: CallContext, w: Worker, layers: range, windows: int, urgent: bool = False) -> Upload:
    """Issues the upload of a stage's weights (in `windows` LPT windows) and registers it per layer."""
    host = [ctx.host.layers[l].upload + ctx.host.layers[l].constants for l in layers]
    keep = [l for l in layers if l < ctx.resident_count]
    # device-stepped weights (roundpipe/engine/step/device_step.py): bound as the device step left them
    stepped = {l: ctx.device_step.weights(l) for l in layers if l in ctx.device_layers} \
        if ctx.device_step is not None else {}
    if (ctx.resident is None or not keep) and not any(t is not None for ts in stepped.values() for t in ts):
        up = w.upload_params(host, windows, urgent)
    else:   # resident weights (resident.py): bind the kept copies whose host values are unchanged
        if ctx.resident is not None:
            ctx.resident.trim(w.name, ctx.resident_count)
        keys = {l: ctx.host.upload_keys(l) for l in keep} if ctx.resident is not None else {}
        have = [ctx.resident.lookup(w.name, l, keys[l]) if l in keys else [None] * len(h)
                for l, h in zip(layers, host)]
        for i, l in enumerate(layers):
            for j, t in enumerate(stepped.get(l, ())):
                if t is not None:
                    have[i][j] = t
        up = w.upload_params(host, windows, urgent, have)
        for l, dev, had in zip(layers, up.params, have):
            if l in keys and any(t is None for t in had):   # what was uploaded now (not what it had bound)
                ctx.resident.keep(w.name, l, keys[l], [t if h is None else None for t, h in zip(dev, had)])
    done = w.upload_done(up)
    for l in layers:
        ctx.sync.uploaded(ctx.call, l, done)
    return up


def prefetch(ctx: CallContext, w: Worker, task: StageTask, windows: int) -> Upload | None:
    """Issues the uploads of a stage's parameters now if no layer waits for a P-copy, else None.

    They ride in the current stage's `windows`, behind its next activation uploads.
    """
    if task.kept or not all(ctx.sync.upload_ready(ctx.call, l) for l in task.layers):
        return None   # a kept backward stage uploads nothing
    return upload_stage(ctx, w, task.layers, windows)


def run_stage(ctx: CallContext, w: Worker, task: StageTask, prefetched: Upload | None = None,
              next_task: StageTask | None = None) -> Upload | None:
    """Runs one slot of the schedule on worker w: all of the slot's microbatches in order.

    Workers that copy asynchronously (`w.prefetches`) issue microbatch m+1's input upload just
    before issuing m's compute, and the next slot's parameter uploads right after the first
    microbatch, so both overlap this stage's compute; the parameter prefetch is returned.  Before,
    not after: a CUDA upload into a freshly allocated buffer waits for the compute issued before
    the allocation (CudaWorker._empty), so one made after m's compute was issued would wait for
    m's compute to finish instead of overlapping it.
    """
    run = StageRun(ctx, w, task, last=next_task is None)
    step = {"F": run.forward, "fused": run.fused, "B": run.backward}[task.kind]
    nxt = None
    with w.compute(), w.turn():
        try:
            run.upload(prefetched)
            for i, m in enumerate(task.mbs):
                if w.prefetches:   # m's own input first (FIFO queue), then m+1's, both ahead of m's compute
                    if i == 0:
                        run.upload_input_early(m)
                    if i + 1 < len(task.mbs):
                        run.upload_input_early(task.mbs[i + 1])
                # a kept backward stage's time (no recompute) is not the cost model's backward: not profiled
                timer = w.timer_start() if ctx.on_timing is not None and not task.kept else None
                step(m)
                w.copies.microbatch_done()   # earlier gradients paced out, downloads bounded, m's input freed
                if timer is not None:   # execution time: on a GPU measured by events, reported later
                    w.timer_stop(timer, functools.partial(ctx.on_timing, w.name, task.kind, task.layers.start, m))
                if i == 0 and next_task is not None and w.prefetches:
                    nxt = prefetch(ctx, w, next_task, len(task.mbs))
            w.copies.flush_downloads()   # what is left of earlier stages' gradients, before this stage's own
            run.finish()
        finally:
            run.release()
    return nxt
