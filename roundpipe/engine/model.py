"""`RoundPipe`: the public wrapper around a CPU-resident sequence of layers.

    model = RoundPipe(layers, devices=["cuda:0", "cuda:1"])
    for x, y in data:
        loss = model.forward_backward(x, labels=y, loss_fn=F.cross_entropy)
        model.step(optimizer)          # synchronous by default; asynchronous=True overlaps the next call
    model.synchronize()                # masters, p.grad and buffers are now consistent

The wrapped module (an nn.Sequential of the layers) holds the fp32 master
weights; `parameters()`, `state_dict()` etc. are its.  RoundPipe is itself an
nn.Module whose tree is that module's (model_state.py, `_adopt_owner`), so a
parent module (Lightning, Accelerate) sees and saves the real masters.  `forward_backward`
splits the batch into microbatches, runs the round-robin schedule over the
worker pool (roundpipe/engine/calls/dispatcher.py) and returns the batch loss: the
microbatch losses weighted by microbatch size, so with a `loss_fn` that is a
mean over samples the loss and the gradients equal the whole batch's.
Gradients accumulate into `p.grad` across calls until `step()`, which runs the
optimizer and then clears them (do not call `optimizer.zero_grad()` yourself:
with an asynchronous step it would race with the update).

The class is in three files: this one (construction and the calls), model_steps.py (`step` and what
it issues) and model_state.py (the wrapped module's API, checkpoints, memory figures, traces).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable

import torch
from torch import nn

from roundpipe.core import omp
from roundpipe.core.executor import SerialExecutor, engine_thread, stop_when_collected
from roundpipe.core.tree import detached, tree_leaves, tree_map
from roundpipe.engine.autoplan import AutoPlanner, PlanningConfig
from roundpipe.engine.calls import batchnorm as batchnorm_stats
from roundpipe.engine.calls import composed
from roundpipe.engine.calls.board import Board
from roundpipe.engine.calls.context import CallContext
from roundpipe.engine.calls.dispatcher import CallRun, Dispatcher, default_plan, out_of_device_memory
from roundpipe.engine.calls.microbatch import SplitFn, batch_size_of, merge, split, weighted_sum
from roundpipe.engine.calls.precision import Precision
from roundpipe.engine.calls.replica import Replica
from roundpipe.engine.calls.resident import ResidentWeights
from roundpipe.engine.config import ENGINE_OPTIONS, RECOMPUTE_MODES, EngineConfig, engine_config
from roundpipe.engine.data_parallel import DataParallel, OptimizerShards
from roundpipe.engine.device_memory import PeakPredictions
from roundpipe.engine.model_state import ModelState
from roundpipe.engine.model_steps import ModelSteps
from roundpipe.engine.state.run_state import RunState
from roundpipe.engine.step import loss_scale
from roundpipe.engine.step.async_step import LayerSync
from roundpipe.engine.step.device_step import DeviceStep
from roundpipe.engine.step.host_state import HostState
from roundpipe.engine.step.optimizer_step import total_norm
from roundpipe.engine.step.staleness import StalenessCompensation
from roundpipe.offload.arena import fix_mmap_threshold
from roundpipe.planner.autosplit import SplitModule, split_module
from roundpipe.planner.plan import Plan
from roundpipe.trace import Trace
from roundpipe.workers import make_workers
from roundpipe.workers.base import Handoff, gpu_input_events, gpu_input_snapshots
from roundpipe.workers.rng import draw_base

TimingFn = Callable[[str, str, int, int, float, float], None]


def _as_layers(layers: object, cfg: EngineConfig) -> nn.Sequential:
    if isinstance(layers, RoundPipe):
        raise TypeError("layers is a RoundPipe already; RoundPipes cannot be nested: give its layers "
                        "(the_model.module) to one RoundPipe, or call it from a parent module")
    if isinstance(layers, nn.Sequential):
        seq = layers
    elif isinstance(layers, (list, tuple, nn.ModuleList)):
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"layers[{i}] must be an nn.Module, got {type(layer).__name__}")
        seq = nn.Sequential(*layers)
    elif isinstance(layers, nn.Module):   # any other module: cut where its forward hands one value on
        caps = [c for c in cfg.device_caps().values() if c is not None]
        seq = split_module(layers, device_memory=min(caps) if caps else None,
                           compute_dtype=cfg.resolved_precision.compute_dtype)
    else:
        raise TypeError(f"layers must be an nn.Module (an nn.Sequential, a list of nn.Module, or a module to cut "
                        f"into layers), got {type(layers).__name__}")
    if len(seq) == 0:
        raise ValueError("layers is empty; give at least one nn.Module")
    return seq


def _state_tier(host: HostState, offload_dir: Any, host_memory: Any, compute_dtype: torch.dtype):
    """The optimizer-state tier of offload_dir= / host_memory= (None without them; EngineConfig checked the
    combination, StateTier checks the directory and the bytes)."""
    if offload_dir is None:
        return None
    from roundpipe.offload.state_tier import StateTier
    return StateTier(host, offload_dir, host_memory, compute_dtype)


def _describe(error: BaseException) -> str:
    """An error folded into another one: its type, message and notes on one line."""
    notes = "; ".join(getattr(error, "__notes__", []))
    return f"an earlier call failed too: {type(error).__name__}: {error}" + (f" ({notes})" if notes else "")


def _on_host(handoffs: dict[int, Handoff], n: int) -> list:
    """Microbatches 0..n-1's values sent home (outputs, a loss_fn's other entries, input gradients), once
    their downloads completed."""
    values = []
    for m in range(n):
        h = handoffs[m]
        if h.host_ready is not None:
            h.host_ready.wait()
        values.append(h.host)
    return values


@dataclasses.dataclass
class _InFlight:
    """A training call that returned while its last stages may still run."""

    key: int
    plan: Plan
    run: CallRun


class RoundPipe(ModelState, ModelSteps, nn.Module):
    """A model kept in host memory whose stages are dispatched round-robin to a pool of workers.

    `RoundPipe(layers, **options)` or `RoundPipe(layers, config=EngineConfig(...))`: the options are
    EngineConfig's fields, each documented there (roundpipe/engine/config.py); `engine_config` is the
    checked EngineConfig the model was built with."""

    def __init__(self, layers, devices=None, num_microbatches: int | None = None,
                 compute_dtype: torch.dtype | None = None, plan: Plan | None = None, *,
                 microbatches_per_round: int | None = None, split_fn: SplitFn | None = None,
                 planning: PlanningConfig | None = None, device_memory: int | dict | None = None,
                 loss_reduction: str = "mean", batchnorm: str = "per-microbatch", recompute: str = "stage",
                 resident_layers: int | None = None, device_step: bool = False,
                 precision: Precision | None = None,
                 process_group: Any = None, shard_optimizer: bool = False,
                 compensation: StalenessCompensation | None = None, master_dtype: torch.dtype = torch.float32,
                 master_rounding: str = "stochastic", offload_dir: Any = None, host_memory: int | None = None,
                 stall_timeout: float | None = None, config: EngineConfig | None = None):
        # the keywords are EngineConfig's fields (roundpipe/engine/config.py documents and checks them, once);
        # config= gives them as one EngineConfig instead
        options = {name: value for name, value in locals().items() if name in ENGINE_OPTIONS}
        nn.Module.__init__(self)   # a parent module sees the wrapped model's tree as this one's (_adopt_owner)
        cfg = self.engine_config = engine_config(config, options)
        self.module = _as_layers(layers, cfg)   # any other module is cut into layers (planner/autosplit.py)
        self._adopt_owner()
        self.devices = list(cfg.worker_devices)
        n = len(self.devices)
        self.loss_reduction = cfg.loss_reduction
        self.batchnorm = cfg.batchnorm
        L = len(self.module)
        self.num_microbatches = cfg.num_microbatches
        self.round_size = cfg.round_size
        self.split_fn = cfg.split_fn
        self.precision = cfg.resolved_precision
        self.compute_dtype = self.precision.compute_dtype
        scaling = loss_scale.resolve(self.precision.loss_scale, self.compute_dtype)
        self.scaler = loss_scale.LossScaler(scaling) if scaling is not None else None
        self.run_state = RunState()   # flags and counts beyond the tensors; checkpoints save it
        # The plan: explicit (never changes) or the partitioner's, revised at call starts (roundpipe/engine/autoplan.py).
        self.planning = cfg.planning or PlanningConfig()
        self.device_memory = cfg.device_caps()   # worker name -> bytes or None
        caps = [c for c in self.device_memory.values() if c is not None]
        if caps and self.planning.memory_budget == "device":   # stages sized for the smallest cap
            self.planning = dataclasses.replace(self.planning, memory_budget=min(caps))
        self.autoplan = AutoPlanner(list(self.module), self.devices, self.compute_dtype,
                                    cfg.num_microbatches or self.round_size, self.planning,
                                    fixed=None if cfg.plan is None else cfg.plan.check(L),
                                    fallback=lambda: default_plan(L, n), layer_grain=cfg.recompute == "layer",
                                    round_size=self.round_size)
        self._cuda = self.devices[0].type == "cuda"
        layers = list(self.module)
        if caps and not self._cuda:   # capped CPU workers model a GPU's memory: their freed buffers go back to
            fix_mmap_threshold()      # the system at once (arena.py), from the host state's first buffers on
        # masters in master_dtype (fp32, or bf16 rounded as master_rounding says: roundpipe/optim/rounding.py)
        self.host = HostState(layers, self.compute_dtype, pinned=self._cuda,
                              device=self.devices[0].index if self._cuda else None,   # the arena's home GPU
                              master_dtype=cfg.master_dtype, master_rounding=cfg.master_rounding,
                              self_copy=cfg.compensation is None)   # predicted weights go to upload copies
        # data parallelism over torch.distributed (roundpipe/engine/data_parallel.py), None: this process
        # alone; checked before any thread starts, so a bad argument leaves nothing running
        self.dp = (DataParallel(cfg.process_group, L, cfg.loss_reduction, devices=self.devices)
                   if cfg.process_group is not None else None)
        self.shards = OptimizerShards(self.host, self.dp) if cfg.shard_optimizer else None
        # optimizer state of the layers that do not fit host_memory, on disk (roundpipe/offload/state_tier.py)
        self.offload = _state_tier(self.host, cfg.offload_dir, cfg.host_memory, self.compute_dtype)
        self.compensation = cfg.compensation   # asynchronous-step staleness compensation (engine/staleness.py)
        self.sync = LayerSync(L, self.host.groups())
        self.host_thread = SerialExecutor("roundpipe-step", idle_release_s=0)      # optimizer steps and P-copies
        self.gcopy_thread = SerialExecutor("roundpipe-gcopy", idle_release_s=0)    # G-copies
        self.workers = make_workers(self.devices, self.compute_dtype, self.host.alloc, self.host.owns)
        if cfg.resident_layers is not None and cfg.resident_layers > L:
            raise ValueError(f"resident_layers={cfg.resident_layers} is more than the model's {L} layers")
        # memory_stats()'s "predicted_peak", and how many first layers keep their weights on the workers
        self.predictions = PeakPredictions(self.workers, self.device_memory, cfg.resident_layers, cfg.device_step)
        self.resident = ResidentWeights()   # their kept device copies (roundpipe/engine/calls/resident.py)
        # resident trained layers updated on the worker (roundpipe/engine/step/device_step.py), or None
        self.device_step = DeviceStep(self.host, self.workers[0]) if cfg.device_step else None
        self._device_layers: frozenset[int] = frozenset()   # those of the latest call
        for w in self.workers:   # a capped CPU worker also counts compute workspace (ledger.py; ~12% slower)
            w.records_workspace = self.device_memory[w.name] is not None
        self.replicas = {w.name: [Replica(layer, st.param_names, st.buffer_names)
                                  for layer, st in zip(layers, self.host.layers)] for w in self.workers}
        # Whole-batch BatchNorm statistics (roundpipe/engine/calls/batchnorm.py): masters updated at call ends.
        self._bn = batchnorm_stats.tracked(layers) if cfg.batchnorm == "whole-batch" else {}
        self._bn_skip = {l: batchnorm_stats.stats_buffer_indices(layer, st.buffer_names)
                         for l, (layer, st) in enumerate(zip(layers, self.host.layers))} if self._bn else {}
        for reps in self.replicas.values() if self._bn else ():
            for l, rep in enumerate(reps):
                batchnorm_stats.patch_replica(rep.module, l)
        self.dispatcher = Dispatcher(self.workers, cfg.stall_timeout,   # stall watchdog: dispatcher.py
                                     layer_grain=cfg.recompute == "layer",   # ranks: for out-of-memory notes
                                     ranks=(self.dp.rank, self.dp.world) if self.dp and self.dp.world > 1 else None)
        self.stage_timing: TimingFn | None = None   # profiler seam: (worker, kind, first_layer, mb, t0, t1)
        self._trace: Trace | None = None
        self._check_recompute = False
        self._compute_s: dict[tuple[str, int, int], float] = {}   # last compute times (Worker.compute_span)
        self._api = threading.RLock()
        self._closed = False
        self._inflight: list[_InFlight] = []   # training calls that returned and may still be running
        self._grads_reserved = False   # the arena has grown for gradients (the first training call)
        self._kept_graphs: tuple[range, ...] = ()   # the last training call's kept backward stages (memory_stats)
        # A model dropped unclosed still lets its threads exit (executor.py); flush lets a pending step run.
        self._finalizer = stop_when_collected(self, [e for w in self.workers for e in w.executors()]
                                              + self._host_threads(), self.sync.flush)

    @property
    def plan(self) -> Plan:
        """The plan the next call runs (see `autoplan.summary()` for how it was chosen)."""
        return self.autoplan.plan

    def _host_threads(self) -> list[SerialExecutor]:
        return [self.host_thread, self.gcopy_thread]

    # ---- calls
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this RoundPipe is closed; create a new one (calls after close() are not allowed)")
        inside = engine_thread()
        if inside is not None:   # it would wait for workers that wait for this one (turn, RNG lock)
            raise RuntimeError(f"a RoundPipe was called from the engine thread {inside!r} (inside a layer, "
                               "loss_fn or step callable run by a RoundPipe); RoundPipes cannot be nested")
        for t in self._host_threads():
            t.raise_error()

    def forward_backward(self, *args, labels: Any = None, loss_fn: Callable | None = None,
                         return_outputs: bool = False, num_microbatches: int | None = None,
                         recompute: str | None = None, **kwargs) -> Any:
        """Forward, loss and backward of one batch; returns the batch loss as a 0-dim fp32 CPU tensor.

        Other keywords are the first layer's inputs (`labels`, `loss_fn`, `return_outputs`, `num_microbatches`
        and `recompute` are this method's own, so a layer cannot take inputs of those names).
        loss_fn(output, labels) returns the microbatch's loss, or a tuple/list (the first entry is the
        loss) or a dict (its "loss" entry, else its first) whose other entries are tensors returned
        detached, in fp32 on the CPU, each reduced over the microbatches as the loss is (weighted by
        size_m / B, or summed with loss_reduction="sum"; same shape in every microbatch).  Returns:

            loss                          loss_fn returns a tensor (or no loss_fn)
            (loss, extras)                it returns a tuple/list (extras: a tuple) or a dict (a dict)
            (loss, outputs)               return_outputs=True: outputs as model(x) returns them, detached
            (loss, extras, outputs)       both

        num_microbatches: this call's microbatch count instead of the model's (docs/semantics.md).
        recompute: this call's recompute grain, "stage" or "layer", instead of the model's (its plan stays)."""
        with self._api:
            self._check_open()
            args, kwargs = self._inputs_for_layers(args, kwargs)
            grain = self._layer_grain(recompute)
            if loss_fn is not None and not callable(loss_fn):
                raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
            if labels is not None and loss_fn is None:
                raise ValueError("labels were given but loss_fn is None; pass loss_fn(output, labels)")
            if not isinstance(return_outputs, bool):
                raise TypeError(f"return_outputs must be True or False, got {return_outputs!r}")
            count = self._microbatch_count(num_microbatches)
            required = loss_fn is not None and labels is not None
            mb = split(args, kwargs, labels, count, self.round_size, self.split_fn,
                       labels_required=required)
            if len(mb) > 1 and count is None and self.split_fn is None:   # the model fits: a microbatch per worker
                each = lambda: split(args, kwargs, labels, self.autoplan.workers, 1, labels_required=required)
                if self.autoplan.whole_batch(batch_size_of((args, kwargs)), each,
                                             self._as_run(loss_fn) if loss_fn is not None else None):
                    mb = each()
                    mb.round_size = 1   # each its own round: on a worker of its own, all in parallel
            mb.reduction = self.loss_reduction
            ctx = self._run(mb, training=True, loss_fn=loss_fn, keep_outputs=return_outputs, layer_grain=grain)
            losses = []
            for m in range(len(mb)):
                loss, ready = ctx.losses[m]
                if ready is not None:
                    ready.wait()
                losses.append(loss)
            result = [weighted_sum(losses, mb.weights)]
            if ctx.loss_form:
                result.append(self._extras(ctx, mb.weights))
            if return_outputs:
                result.append(merge(_on_host(ctx.outputs, len(mb))))
            return result[0] if len(result) == 1 else tuple(result)

    def _inputs_for_layers(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A module cut by rp.RoundPipe(module) takes none of the forward's arguments that default to None
        (SplitModule.check_call); others take the call's as they are."""
        return self.module.check_call(args, kwargs) if isinstance(self.module, SplitModule) else (args, kwargs)

    @staticmethod
    def _layer_grain(recompute: Any) -> bool | None:
        """A call's recompute= checked, as layer grain or not; None: the model's."""
        if recompute is None:
            return None
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={recompute!r} must be 'stage', 'layer' (this call's recompute grain) or "
                             "None (the model's)")
        return recompute == "layer"

    def _microbatch_count(self, num_microbatches: Any) -> int | None:
        """A call's num_microbatches= checked; None: the model's."""
        if num_microbatches is None:
            return self.num_microbatches
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches!r} must be an int >= 1 (this call's microbatch "
                             f"count) or None (the model's, {self.num_microbatches or 'the default'})")
        return num_microbatches

    @staticmethod
    def _extras(ctx: CallContext, weights: list[float]) -> tuple | dict:
        """The loss_fn's other entries, each reduced over the microbatches as the loss is (the fused
        stage checked that every microbatch returned the same entries in the same shapes)."""
        kind, names, _shapes = ctx.loss_form
        per_mb = _on_host(ctx.extras, len(weights))
        reduced = [weighted_sum([v[k] for v in per_mb], weights) for k in range(len(per_mb[0]))]
        return tuple(reduced) if kind == "tuple" else dict(zip(names, reduced))

    def __call__(self, *args, num_microbatches: int | None = None, recompute: str | None = None, **kwargs) -> Any:
        """The model's output, its tensors concatenated along dim 0 on the CPU.

        Forward only (nothing kept for a backward) under torch.no_grad(), or when no input requires grad
        and the model is in eval() or has no parameter that requires grad.  Otherwise the output is a node
        of the caller's autograd graph: a backward through it lands every parameter's gradient (and the
        inputs' that require grad) as an nn.Sequential's would, at the cost of one more forward
        (roundpipe/engine/calls/composed.py; forward_backward is the fast path, docs/semantics.md).
        num_microbatches: this call's microbatch count instead of the model's; recompute: the grain of a
        composed call's backward instead of the model's (so a layer cannot take inputs of those names)."""
        with self._api:
            self._check_open()
            args, kwargs = self._inputs_for_layers(args, kwargs)
            count = self._microbatch_count(num_microbatches)
            grain = self._layer_grain(recompute)
            self.sync.flush()   # a sync point: a forward after step() sees the updated weights
            if self._bn:
                self._retire()   # whole-batch BatchNorm statistics land at call ends: eval sees them
            grad = torch.is_grad_enabled()
            wanted = composed.requires_grad(args, kwargs) if grad else []
            if wanted or (grad and self._owner.training and any(p.requires_grad for p in self.parameters())):
                return self._composed(args, kwargs, count, wanted, grain)
            mb = split(args, kwargs, None, count, self.round_size, self.split_fn)
            ctx = self._run(mb, training=False, loss_fn=None)
            return merge(_on_host(ctx.outputs, len(mb)))

    def _composed(self, args: tuple, kwargs: dict, count: int | None, wanted: list[int],
                  layer_grain: bool | None = None) -> Any:
        """model(x) as a node of the caller's autograd graph (roundpipe/engine/calls/composed.py); `wanted`:
        the positions of the inputs that require grad."""
        if wanted and self.split_fn is not None:
            raise ValueError("an input that requires grad with split_fn= set: the gradient of an input can only be "
                             "put together from the default split's microbatches; detach the input, or build "
                             "the model without split_fn")
        inputs = detached((tuple(args), dict(kwargs)))
        mb = split(inputs[0], inputs[1], None, count, self.round_size, self.split_fn)
        base, steps = self._draw_base(), self.sync.steps_issued

        def forward(mb) -> list:
            return _on_host(self._run(mb, training=False, loss_fn=None, rng_base=base).outputs, len(mb))
        call = composed.ComposedCall(mb, inputs, wanted, forward,
                                     functools.partial(self._composed_backward, base, steps, layer_grain),
                                     self._backward_done)
        leaves = tree_leaves((args, kwargs))
        return composed.compose(call, [leaves[i] for i in wanted])

    def _composed_backward(self, base: int, steps: int, layer_grain: bool | None, mb,
                           wanted: tuple[int, ...]) -> list[list]:
        """A composed call's backward: a training call seeded with the output's gradients (composed.py)."""
        with self._api:
            self._check_open()
            if self.sync.steps_issued != steps:
                raise RuntimeError("backward through a RoundPipe call's output after a step(): the weights its "
                                   "forward used were updated since (as PyTorch refuses a backward through weights "
                                   "modified in place); call backward() before step()")
            ctx = self._run(mb, training=True, loss_fn=None, rng_base=base, seeded=True, write_buffers=False,
                            bn_stats=None, input_grad_leaves=wanted, layer_grain=layer_grain)
            if not wanted:
                return [[] for _ in range(len(mb))]
            self._retire()   # the input gradients come from the call's last stage: wait for its end
            return _on_host(ctx.input_grads, len(mb))

    def _backward_done(self) -> None:
        """The end of a backward pass through this model's composed calls (autograd runs it before backward()
        returns): p.grad final, as PyTorch promises a torch optimizer stepped next (issue 52 item 1).  What
        synchronize() does for gradients, no more: the calls end (their last backward stages and landings),
        a G-copy moves the landed sums into p.grad and held low-precision ones become fp32 (unscaled by the
        fp16 loss scale); a pending step is waited for only as far as that G-copy waits for it to consume the
        previous p.grad, and the masters are not brought home from a device step.  Nothing is pending when
        another node of the same pass ran it already: it then returns at once."""
        with self._api:
            self._check_open()
            self._retire()
            self._issue_gcopy()
            self.gcopy_thread.wait_idle(raise_errors=True)
            self._show_grads()

    def _draw_base(self) -> int:
        """A call's RNG base: one draw from the caller's generator (each rank's own with data parallelism)."""
        return draw_base() if self.dp is None else self.dp.rank_seed(draw_base())

    forward = __call__

    def _refresh_edited(self) -> None:
        """Masters the user changed since their last P-copy (in place, load, freeze): new upload copies.

        A freeze or unfreeze drains first (the landing buffers follow requires_grad).  Otherwise
        only layers no pending step will touch are refreshed: with a step pending the user had
        no sync point, so an edit races the update anyway, which then copies the layer itself."""
        host = self.host
        edited = [l for l in range(len(host)) if host.edited(l)]
        if not edited:
            return
        device = self.device_step
        if device is not None:   # device-stepped masters (device_step.py): edited on stale values, or uploaded again
            stale = [l for l in edited if device.dirty(l)]
            if stale:
                st = host.layers[stale[0]]
                raise ValueError(f"a master of layer {stale[0]} ({', '.join(st.param_names)}) was changed while "
                                 "the device step held newer values on the worker (device_step=True): the "
                                 "change was made to stale masters and is not applied; call "
                                 "model.synchronize() first, then change them")
        if any(host.freezes_changed(l) for l in edited):
            self._drain()
        for l in edited:
            if self.sync.settled(l):
                if device is not None:
                    device.drop(l)
                host.refresh(l)

    def _run(self, mb, training: bool, loss_fn: Callable | None, rng_base: int | None = None,
             layer_grain: bool | None = None, **fields: Any) -> CallContext:
        """Starts a call; returns once its loss is known (training) or its outputs are (forward).

        A training call's last backward stages, gradient landings and its end run on under the
        next call: `_inflight` keeps it until `_retire` folds its timings.  A call returns only once
        the calls before it ended (they run first on every worker); if one failed it is cancelled and
        raises that error.  A failing call folds the errors of those before it into its own: each
        error is raised once (tests/engine/test_call_errors.py).  rng_base: the call's RNG base when
        given (a composed call's backward repeats its forward's); layer_grain: the call's recompute grain
        (None: the model's); fields: more CallContext fields."""
        self._refresh_edited()
        if self.device_step is not None and not self.predictions.auto_resident and self.device_step.layers:
            self.device_step.evict()   # a call ran out of device memory: the device keeps nothing more
        loss = (self._as_run(loss_fn), mb.labels[0]) if training and loss_fn is not None else None
        plan = self.autoplan.before_call((mb.args[0], mb.kwargs[0]), len(mb), training, loss)   # the safe point
        if training and self.dp is not None:
            plan = self.autoplan.follow(self.dp.agree_plan(plan))   # rank 0's
        key = self.sync.iteration + 1   # the call about to begin
        if self._inflight and plan != self._inflight[-1].plan:
            self._retire(cancelled=key)   # a new plan starts from an empty pipeline
        self._retire(keep=1, cancelled=key)   # at most one earlier call still draining
        sched = self.dispatcher.schedule(plan, training, len(mb), mb.round_size or self.round_size, layer_grain)
        self.predictions.check(sched, self.host, self.autoplan, (mb.args[0], mb.kwargs[0]), loss)   # before any work
        if training:
            self._kept_graphs = tuple(plan.backward[j] for j in sorted(sched.kept))
        if training and not self._grads_reserved:   # before any work: no growth on the copy threads later
            self._grads_reserved = True
            self.host.reserve_gradients(reduced=self.dp is not None)
        # Inputs and labels are staged into the (pinned) arena here, on the caller's thread, made
        # contiguous on the way: workers then copy from staging blocks only (Worker._staged).
        pin = self.host.staged
        base = self._draw_base() if rng_base is None else rng_base
        fields.setdefault("bn_stats", batchnorm_stats.BatchStats() if self._bn else None)
        ctx = CallContext(self.host, self.sync, Board(), self.replicas, sched.points, base,
                          labels=[tree_map(pin, l) for l in mb.labels], weights=mb.weights, loss_fn=loss_fn,
                          trace=self._trace_call(plan),
                          on_timing=self.autoplan.recorder(key, training, self.stage_timing),
                          check_recompute={} if self._check_recompute else None, compute_s=self._compute_s,
                          bn_skip=self._bn_skip, precision=self.precision, resident=self.resident,
                          resident_count=sched.resident, device_step=self.device_step, **fields)
        if self.device_step is not None:   # a forward-only call binds the device-stepped weights too
            ctx.device_layers = self._device_layers = self.device_step.chosen(sched.resident)
        # A training call's inputs already on a GPU are copied on the caller's stream, owned by the call:
        # its last backward stages recompute from them after it returned (labels are read before it returns).
        own = gpu_input_snapshots(self.workers) if training else None
        inputs = [tree_map(lambda t: pin(t, own), (mb.args[m], mb.kwargs[m])) for m in range(len(mb))]
        ctx.gpu_ready = gpu_input_events(mb)   # recorded after the snapshots' copies
        if training and self.scaler is not None:
            scaler, index = self.scaler, self._scale_index()
            ctx.loss_scale = lambda: scaler.scale_of(index, ctx.abort_requested)
        for m in range(len(mb)):
            ctx.board.put(("act", 0, m), Handoff(host=inputs[m], gpu_ready=ctx.gpu_ready), sched.input_consumers)
        ctx.call = self.sync.begin_call(training, sched.uploads)
        host, sync, bn = self.host, self.sync, self._bn   # the end runs on a worker thread: no reference to the model
        resident, predictions, device, dp = self.resident, self.predictions, self.device_step, self.dp

        def on_end(run: CallRun) -> None:
            try:
                if not run.ok:   # kept weights go with a failed call; out of memory: no more weights or graphs kept
                    resident.clear()
                    oom = out_of_device_memory(run.error)   # a cuBLAS/cuDNN/CUDA RuntimeError too (dispatcher.py)
                    if oom and (run.ctx.resident_count or sched.kept):
                        predictions.auto_resident = False
                    if oom and training and dp is not None:   # this rank's alone: it must not go on (dispatcher.py)
                        dp.refuse(run.error)
                if device is not None and run.ctx.device_layers:   # its device gradients: kept or dropped
                    device.end_call(run.ctx.call.index, run.ok)
                host.end_call(run.ok)   # keeps or takes back the gradients the call landed
                if run.ok and run.ctx.bn_stats is not None:
                    run.ctx.bn_stats.apply(bn)   # whole-batch BatchNorm statistics, once per call
            finally:
                sync.end_call(run.ctx.call)
        earlier = [rec.run for rec in self._inflight]   # training calls still draining (they end first)
        omp.release_team()   # this thread only waits from here: its OpenMP team would throttle the workers'
        run = self.dispatcher.start(ctx, sched, on_end)
        for e in earlier:
            run.watch(e)

        def may_return() -> bool:
            """Its loss (outputs) known and the calls before it ended, or one of those failed."""
            if any(e.failed for e in earlier):
                return True
            done = ctx.losses_known.is_set() if training else run.finished
            return done and all(e.finished for e in earlier)
        try:
            try:
                self.dispatcher.wait(run, may_return)
                for t in self._host_threads():   # a step that failed meanwhile: this call then has no effect
                    t.raise_error()
            except BaseException:
                ctx.board.abort()
                run.wait_end()
                raise
            if any(e.failed for e in earlier):   # raised here, by a call that is cancelled for it
                ctx.board.abort()
                run.wait_end()
                self._retire(cancelled=key, also=run.error)
        except BaseException as e:
            self.autoplan.after_call(key, plan, training, False)
            for other in self._retire_collect():   # ended before this call did: folded into its error
                e.add_note("[roundpipe] " + _describe(other))
            raise
        if training:   # retired (timings folded, late error raised) at a fixed later point
            self._inflight.append(_InFlight(key, plan, run))
        else:
            self.autoplan.after_call(key, plan, training, run.ok)
        if training:
            self.run_state.grads_pending = True
            # waits for nothing but the call: gradients fill while the caller goes on (with data
            # parallelism only at step and sync points, the same on every rank)
            if self.dp is None and self.sync.gcopy_free():
                self._issue_gcopy()
        return ctx

    def _retire(self, keep: int = 0, cancelled: int | None = None, also: BaseException | None = None) -> None:
        """Forgets the earlier calls in flight but the newest `keep`, waiting for their ends, and
        folds their timings into the planner.  Raises the first error one of them met after it
        returned (its gradients were dropped), any other as a note; `cancelled`: the key of the call
        raising it, which was cancelled for it, and `also` its own error if it met one.  Timings are folded at fixed points (the start of
        the call after next, a sync point), so re-planning does not depend on thread timing."""
        errors = self._retire_collect(keep)
        if not errors:
            return
        first = errors[0]
        if cancelled is not None:
            first.add_note(f"[roundpipe] raised by call {cancelled}, which was cancelled for it and had no effect "
                           "(no loss returned, no gradients kept: pass its batch again)")
        for other in errors[1:]:
            first.add_note("[roundpipe] " + _describe(other))
        if also is not None:
            first.add_note(f"[roundpipe] call {cancelled} failed too: {type(also).__name__}: {also}")
        raise first

    def _retire_collect(self, keep: int = 0) -> list[BaseException]:
        """`_retire` without the raise: the errors of the calls it retired, each with a note naming its call."""
        errors = []
        while len(self._inflight) > keep:
            rec = self._inflight[0]
            rec.run.wait_end()
            self._inflight.pop(0)
            self.autoplan.after_call(rec.key, rec.plan, True, rec.run.ok)
            if rec.run.error is not None:
                rec.run.error.add_note(f"[roundpipe] raised after forward_backward returned, in the rest of training "
                                       f"call {rec.key} (its last backward stages); that call's gradients were dropped")
                errors.append(rec.run.error)
        return errors

    def _drain(self) -> None:
        """A sync point: every call ended, landed gradient in p.grad and issued step applied; raises their errors."""
        self._retire()
        self.sync.flush()
        self._issue_gcopy()
        omp.release_team()   # the caller only waits now: its spinning helpers would slow the step's team
        for t in self._host_threads():
            t.wait_idle()
        for t in self._host_threads():
            t.raise_error()
        if self.offload is not None:
            self.offload.settle()   # writes behind done; a write failure raised here

    def synchronize(self) -> None:
        """Waits for pending gradient copies and optimizer steps; masters and p.grad are then consistent.

        After it the masters may be edited (in place under no_grad, `p.data = ...`,
        `load_state_dict`): the next call uploads them as they are then."""
        with self._api:
            self._check_open()
            self._drain()
            if self.device_step is not None:   # device-stepped masters, state and gradients (device_step.py)
                self.device_step.home(grads=True)
            self._show_grads()

    def _show_grads(self) -> None:
        """Every layer's landed gradients as fp32 p.grad, unscaled by the scale its calls used (loss_scale.py)."""
        inv = self.scaler.inverse(self._scale_index()) if self.scaler is not None else None
        for l in range(len(self.host)):
            self.host.materialize(l, inv)

    def grad_norm(self) -> torch.Tensor:
        """clip_grad_norm_'s total 2-norm of the gradients accumulated since the last step (0 without any), a
        0-dim fp32 CPU tensor.  Waits for the calls and steps as synchronize() does; with device_step=True the
        device-stepped layers' gradients stay on the worker (their norms are read there) and no master comes
        home, so it costs no sync point of theirs (rp.hf.Trainer logs it every step)."""
        with self._api:
            self._check_open()
            if self.device_step is None:
                self.synchronize()
                grads = [p.grad for p in self.parameters() if p.grad is not None]
                return torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
            self._drain()   # fp16 loss scaling is refused with the device step: the gradients are unscaled
            on_device = self.device_step.grad_norms()   # first: the host's gradients of its layers join theirs
            held = [g for l in range(len(self.host)) for g in self.host.step_grads(l) if g is not None]
            parts = ([total_norm(held)] if held else []) + on_device
            return torch.linalg.vector_norm(torch.stack(parts)) if parts else torch.zeros(())

    def wait_calls(self) -> None:
        """Waits until the training calls still running after they returned (their last backward
        stages, the continuous pipeline) have ended; raises their errors.  Not a sync point: the
        step window stays open and pending steps keep running (for that, `synchronize()`)."""
        with self._api:
            self._check_open()
            self._retire()

    def _as_run(self, loss_fn: Callable) -> Callable:
        """loss_fn as the fused stage runs it (in the precision's autocast), for the planner's dry run."""
        def run(out: Any, labels: Any) -> Any:
            with self.precision.autocast_on(self.devices[0].type):
                return loss_fn(out, labels)
        return run

    def close(self) -> None:
        with self._api:
            if self._closed:
                return
            self._closed = True
            self._finalizer.detach()
            self.sync.flush()
            try:
                self._retire()   # calls still draining end first; their error is raised
                for t in self._host_threads():
                    t.wait_idle()
                if self.device_step is not None:   # the masters the device step updated come home
                    self.device_step.home(grads=True)
            finally:
                if self.device_step is not None:
                    self.device_step.close()
                for t in self._host_threads():
                    t.close()
                for w in self.workers:
                    w.close()
                self.resident.clear()
                self.host.close()
                if self.offload is not None:
                    self.offload.close()
            for t in self._host_threads():
                t.raise_error()

    def __enter__(self) -> "RoundPipe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RoundPipe({len(self.module)} layers, devices={[str(d) for d in self.devices]}, "
                f"compute_dtype={self.compute_dtype}, plan={self.plan})")
