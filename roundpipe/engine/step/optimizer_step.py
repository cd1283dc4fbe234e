"""How `RoundPipe.step` drives an optimizer: checks, clipping, per-layer updates, the lr scheduler.

Three shapes of optimizer fit the per-layer protocol (roundpipe/engine/step/async_step.py):

    per-layer fused   an object with `step_layer(params, upload)` (roundpipe.optim.Adam/AdamW):
                      layer l is updated and its upload copy written in one pass as soon
                      as l's gate opens, tail layers first
    torch optimizer   one `optimizer.step()` over every p.grad once all layers' gradients
                      are in, then each layer's upload copy as its gate opens
    callable          a zero-argument function, run like a torch optimizer's step

`max_grad_norm` clips like `torch.nn.utils.clip_grad_norm_` over every parameter
with a gradient.  The global norm needs every layer's gradient, so with it even the
fused path updates no layer before the step's G-copies are all done and one pass
has read every gradient (roundpipe.optim folds the factor into its update; any
other step_layer optimizer gets p.grad scaled in place first).  In the
asynchronous step those G-copies run while the next call's forward stages run,
before the first gate opens, so the overlap stays (bench/dispatch.py measures it).

The lr scheduler is stepped on the host thread right after the update of every
layer went through, so every update uses the rate PyTorch's `opt.step();
sched.step()` would; after a failed update it is not stepped.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch

from roundpipe.core.checks import is_number
from roundpipe.engine.step.async_step import StepFns
from roundpipe.engine.step.host_state import HostState


def check_optimizer_params(optimizer: torch.optim.Optimizer, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """ValueError unless the optimizer's parameters are the model's own (frozen ones may be left out)."""
    model = {id(p): name for name, p in named_params}
    seen = set()
    for gi, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in model:
                raise ValueError(f"optimizer: param_groups[{gi}]['params'][{j}] (shape {tuple(p.shape)}) is not a "
                                 "parameter of this RoundPipe (a copy, or another model's?); build the optimizer "
                                 "over model.parameters()")
            seen.add(id(p))
    for name, p in named_params:
        if p.requires_grad and id(p) not in seen:
            raise ValueError(f"optimizer: the model's parameter {name!r} (shape {tuple(p.shape)}) requires grad but "
                             "is not in the optimizer, so it would never be updated; build the optimizer over "
                             "model.parameters() (or freeze it with requires_grad_(False))")


def check_step_args(asynchronous: Any, lr_scheduler: Any, max_grad_norm: Any, optimizer: Any) -> float | None:
    """Validates step()'s keyword arguments; returns max_grad_norm as a float (or None)."""
    if not isinstance(asynchronous, bool):
        raise TypeError(f"asynchronous must be True or False, got {asynchronous!r} ({type(asynchronous).__name__})")
    if lr_scheduler is not None:
        if not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"lr_scheduler must have a step() method (a torch.optim.lr_scheduler.LRScheduler), got "
                            f"{type(lr_scheduler).__name__}")
        owner = getattr(lr_scheduler, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer) and owner is not None and owner is not optimizer:
            raise ValueError("lr_scheduler belongs to another optimizer than the one passed to step(); build it over "
                             "the same optimizer")
    if max_grad_norm is None:
        return None
    if not is_number(max_grad_norm) \
            or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be None or a finite number > 0")
    return float(max_grad_norm)


NORM_CHUNK = 1 << 24   # elements of a low-precision gradient upcast at a time by the norm (64 MiB of fp32)


def _fp32_norm(g: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a low-precision tensor computed in fp32.  vector_norm(g, dtype=float32) upcasts
    the whole tensor first (4 bytes per element, measured with torch 2.13 CPU: an LM head of
    151,936 x 4,096 would cost 2.5 GB during the step), so a tensor above NORM_CHUNK elements is
    read in pieces and their norms combined: fp32 sums of fewer terms, so closer to the float64 norm
    than the one-piece one (3e-4 against 3e-3 relative over 42M bf16 elements)."""
    if g.numel() <= NORM_CHUNK:
        return torch.linalg.vector_norm(g, dtype=torch.float32)
    pieces = g.reshape(-1).split(NORM_CHUNK)   # a held gradient is contiguous: views
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(c, dtype=torch.float32) for c in pieces]))


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over all gradients; low-precision ones (held bf16/fp16) are read in fp32, as
    clip_grad_norm_ would read their fp32 `p.grad`, at most NORM_CHUNK elements at a time."""
    if any(g.dtype != torch.float32 for g in grads):
        return torch.linalg.vector_norm(torch.stack([_fp32_norm(g) if g.dtype != torch.float32
                                                     else torch.linalg.vector_norm(g) for g in grads]))
    get = getattr(torch.nn.utils, "get_total_norm", None)   # torch >= 2.6: clip_grad_norm_'s own norm
    if get is not None:
        return get(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def clip_coefficient(grads: list[torch.Tensor], max_norm: float, scale: float = 1.0,
                     unscaled: list[torch.Tensor] | None = None, extra: list[torch.Tensor] | None = None) -> float:
    """clip_grad_norm_'s factor: min(1, max_norm / (total_norm + 1e-6)), computed in fp32 as torch does,
    of `grads` divided by `scale` (a loss scale; a power of two, so the division is exact) together
    with `unscaled` (gradients already divided by it: shown as p.grad after synchronize()) and `extra`
    (fp32 norms of gradients held elsewhere: the device step's layers).

    Not roundpipe.optim.grad_norm + clip_coef: those work in float64, so the factor could differ
    from torch's in its last bit, and step(max_grad_norm=) promises clip_grad_norm_'s numbers."""
    parts = [total_norm(gs) / s for gs, s in ((grads, scale), (unscaled or [], 1.0)) if gs] + list(extra or [])
    if not parts:
        return 1.0
    total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))
    coef = max_norm / (total + 1e-6)
    return float(torch.clamp(coef, max=1.0))


class _Scaling:
    """One step's side of loss scaling (roundpipe/engine/step/loss_scale.py): which scale its gradients
    carry, the overflow check over every layer before any update, and whether it was skipped.

    A layer whose gradients were shown unscaled (HostState.materialize: p.grad after synchronize())
    is read as it is: `divisor(l)` is 1 for it, the scale for the others."""

    def __init__(self, scaler: Any, step_index: int, used: int, host: HostState):
        self.scaler, self.step_index, self.used, self.host = scaler, step_index, used, host
        self.scale, self.skipped = 1.0, False
        self._inverse: float | None = None

    def inverse(self) -> float | None:
        """The fp32 factor that unscales the step's gradients (None without loss scaling); asked per
        layer, worked out once (the scale its calls used never changes)."""
        if self.scaler is None:
            return None
        if self._inverse is None:
            from roundpipe.engine.step.loss_scale import inverse_scale
            self._inverse = inverse_scale(self.scaler.scale_of(self.used))
        return self._inverse

    def divisor(self, layer: int) -> float:
        """What the step divides layer's gradients by: the scale, or 1 once they are unscaled."""
        return 1.0 if self.host.layers[layer].inv_scale is not None else self.scale

    def clip_coefficient(self, max_norm: float, extra: list[torch.Tensor] | None = None) -> float:
        """clip_grad_norm_'s factor over every layer's gradient, each read unscaled, and the fp32 norms `extra`
        of gradients held elsewhere (device-stepped layers)."""
        scaled: list[torch.Tensor] = []
        unscaled: list[torch.Tensor] = []
        for l in range(len(self.host)):
            into = unscaled if self.host.layers[l].inv_scale is not None else scaled
            into.extend(g for g in self.host.step_grads(l) if g is not None)
        return clip_coefficient(scaled, max_norm, self.scale, unscaled, extra)

    def check(self, grads: list[torch.Tensor]) -> bool:
        """Records the step's result; True if it must be skipped (a gradient is inf or NaN)."""
        if self.scaler is None:
            return False
        from roundpipe.optim.gradients import grad_sumsq
        self.scale = self.scaler.scale_of(self.used)
        self.skipped = bool(grads) and not math.isfinite(grad_sumsq(grads))
        self.scaler.record(self.step_index, self.used, self.skipped)
        return self.skipped


def make_step(optimizer: Any, host: HostState, named_params: list[tuple[str, torch.nn.Parameter]],
              lr_scheduler: Any = None, max_grad_norm: float | None = None, scaler: Any = None,
              step_index: int = 0, scale_used: int = 0, shards: Any = None, predict: float = 0.0,
              lr_factor: float = 1.0, device: tuple[Any, frozenset[int]] | None = None) -> StepFns:
    """The protocol's view of one step with this optimizer (TypeError/ValueError before anything runs).

    With a loss scaler, step `step_index`'s gradients carry the scale of its history entry
    `scale_used`: they are checked for inf/NaN over every layer before any layer is updated,
    an overflowed step updates nothing (the lr scheduler is not stepped), a good one reads
    them divided by the scale.  Staleness compensation (roundpipe/engine/step/staleness.py): `predict`
    makes the fused pass write the predicted next weights into the upload copies, `lr_factor`
    scales every group's learning rate for this step only.  `device`: (the DeviceStep, the layers it
    updates on the worker: roundpipe/engine/step/device_step.py)."""
    from roundpipe.optim.base import FusedOptimizer

    params = [p for _, p in named_params]
    scaling = _Scaling(scaler, step_index, scale_used, host)

    def all_grads() -> list[torch.Tensor]:
        return [g for l in range(len(host)) for g in host.step_grads(l) if g is not None]
    if (predict or lr_factor != 1.0) and not isinstance(optimizer, FusedOptimizer):
        raise ValueError(f"compensation needs a roundpipe.optim optimizer (the prediction is written in its fused "
                         f"pass), got {type(optimizer).__name__}")
    if predict and shards is not None:
        raise ValueError("compensation with predict > 0 and shard_optimizer=True are not supported together (the "
                         "sharded step rewrites the upload copies from the gathered masters)")
    if shards is not None:
        return _sharded_step(optimizer, host, named_params, lr_scheduler, max_grad_norm, scaling, all_grads, shards)
    dev, on_device = device if device is not None else (None, frozenset())
    if on_device and not isinstance(optimizer, FusedOptimizer):
        raise ValueError(f"device_step=True steps layers {sorted(on_device)} with the optimizer's own formula in "
                         f"torch ops on the worker: it needs a roundpipe.optim optimizer (AdamW, Adam, SGD, "
                         f"Adagrad, Lion), got {type(optimizer).__name__}")
    if callable(getattr(optimizer, "step_layer", None)):
        if isinstance(optimizer, torch.optim.Optimizer):
            check_optimizer_params(optimizer, named_params)
        native_clip = isinstance(optimizer, FusedOptimizer)   # rp Adam/AdamW, SGD, Adagrad, Lion
        rounding = _rounding(host)
        clip = [1.0]

        finish = _scheduler_step(optimizer, lr_scheduler, lambda: scaling.skipped)

        def measure() -> None:
            # first: the host's gradients of device-stepped layers join their device sums (device_step.py)
            extra = dev.grad_norms() if on_device else None
            grads = all_grads()
            if not scaling.check(grads) and max_grad_norm is not None:
                clip[0] = scaling.clip_coefficient(max_grad_norm, extra)

        def update_many(layers: list[int]) -> None:
            """The layers' updates in one native pass per loss-scale divisor (fewer calls and thread
            wake-ups than one per layer: a synchronous step finds every layer ready at once); the
            device-stepped ones on their worker (device_step.py)."""
            if scaling.skipped:
                return
            by_divisor: dict[float, list[int]] = {}
            for l in layers:
                if l in on_device:
                    dev.update(l, optimizer, clip[0])
                else:
                    by_divisor.setdefault(scaling.divisor(l), []).append(l)
            for divisor, ls in by_divisor.items():
                params, upload, grads = [], [], []
                for l in ls:
                    p, u = host.step_params(l)
                    params += p
                    upload += u
                    grads += host.step_grads(l)
                with torch.no_grad(), _scaled_lr(optimizer, lr_factor):
                    optimizer.step_layer(params, upload, clip_coef=clip[0] / divisor, grads=grads, predict=predict,
                                         **rounding)
                for l in ls:
                    host.stamp(l)

        def update(l: int) -> None:
            if scaling.skipped:
                return
            if l in on_device:
                dev.update(l, optimizer, clip[0])
                return
            params, upload = host.step_params(l)   # a shared master once, with its first layer
            with torch.no_grad(), _scaled_lr(optimizer, lr_factor):
                if native_clip:   # reads held low-precision gradients as they are, unscales in its pass
                    optimizer.step_layer(params, upload, clip_coef=clip[0] / scaling.divisor(l),
                                         grads=host.step_grads(l), predict=predict, **rounding)
                else:   # p.grad unscaled as GradScaler.unscale_ does (unless it already is), then clipped
                    host.materialize(l, scaling.inverse())
                    if clip[0] != 1.0:
                        for p in params:
                            if p.grad is not None:
                                p.grad.mul_(clip[0])
                    optimizer.step_layer(params, upload)
            host.stamp(l)

        def clear(l: int) -> None:
            host.clear_grads(l)
            if l in on_device:   # a failed update consumes the device gradients too
                dev.drop_grads(l)
        prepare = measure if max_grad_norm is not None or scaler is not None else None
        return StepFns(prepare, False, update, host.pcopy, clear if on_device else host.clear_grads, finish,
                       update_many=update_many if native_clip else None)
    if isinstance(optimizer, torch.optim.Optimizer):
        check_optimizer_params(optimizer, named_params)
        fn: Callable[[], Any] = optimizer.step
    elif callable(optimizer):
        fn = optimizer
    else:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, a zero-argument callable or an object with "
                        f"step_layer(params, upload), got {type(optimizer).__name__}")

    def whole_step() -> None:
        inv = scaling.inverse()
        for l in range(len(host)):   # p.grad unscaled as GradScaler.unscale_ does (unless it already is)
            host.materialize(l, inv)
        if scaling.check(all_grads()):
            return
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_grad_norm)
        for p in params:   # bf16 masters: a torch optimizer steps them as bf16 parameters, in their dtype
            if p.grad is not None and p.grad.dtype != p.dtype:
                p.grad = p.grad.to(p.dtype)
        with torch.no_grad():
            fn()

    def after() -> None:
        if lr_scheduler is not None and not scaling.skipped:
            lr_scheduler.step()
    return StepFns(whole_step, True, host.pcopy, host.pcopy, host.clear_grads, after, host.in_place())


def _rounding(host: HostState) -> dict[str, str]:
    """step_layer's rounding= for bf16 masters (none for fp32 ones, so that an override without it still fits)."""
    return {"rounding": host.master_rounding} if host.master_dtype != torch.float32 else {}


@contextlib.contextmanager
def _scaled_lr(optimizer: Any, factor: float) -> Iterator[None]:
    """Every param group's lr times `factor` inside (the host thread is the only one stepping)."""
    if factor == 1.0:
        yield
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = g["lr"] * factor
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr


def _sharded_step(optimizer: Any, host: HostState, named_params: list, lr_scheduler: Any,
                  max_grad_norm: float | None, scaling: _Scaling, all_grads: Callable[[], list[torch.Tensor]],
                  shards: Any) -> StepFns:
    """shard_optimizer=True (roundpipe/engine/data_parallel.py): one pass before the gates steps this
    rank's slice of every layer, in layer order, then all-gathers the updated masters; each
    layer's upload copy is rewritten from them as its gate opens (a whole-model update)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard_optimizer=True needs a torch.optim.Optimizer (its param_groups are rewritten to this "
                        f"rank's slices), got {type(optimizer).__name__}")
    if id(optimizer) not in shards.adopted:
        check_optimizer_params(optimizer, named_params)
    shards.adopt(optimizer)
    fused = callable(getattr(optimizer, "step_layer", None))
    from roundpipe.optim.base import FusedOptimizer
    native = isinstance(optimizer, FusedOptimizer)

    def update() -> None:
        grads = all_grads()
        if scaling.check(grads):
            return
        clip = scaling.clip_coefficient(max_grad_norm) if max_grad_norm is not None else 1.0
        with torch.no_grad():
            slices = [shards.layer(l) for l in range(len(host))]
            for l, (ps, gs) in enumerate(slices):
                mul = clip / scaling.divisor(l)
                if native:   # reads held low-precision slices as they are
                    optimizer.step_layer(ps, None, clip_coef=mul, grads=gs, **_rounding(host))
                    continue
                for p, g in zip(ps, gs):
                    p.grad = None if g is None else (g.float() * mul if mul != 1.0 else g.float())
                if fused:
                    optimizer.step_layer(ps, None)
            if not fused:
                optimizer.step()
            for ps, _ in slices:
                for p in ps:
                    p.grad = None
        del grads, slices
        for l in range(len(host)):   # read: their fp32 sums go before the gather's buffers come (asynchronous:
            host.clear_grads(l)      # while the next call lands its gradients; 2.3 bytes per parameter of arena)
        shards.gather()

    return StepFns(update, True, host.pcopy, host.pcopy, host.clear_grads,
                   _scheduler_step(optimizer, lr_scheduler, lambda: scaling.skipped), host.in_place())


def copy_step(optimizer: Any, host: HostState, lr_scheduler: Any = None, skipped: bool = False) -> StepFns:
    """A step whose whole-model update already happened (restored from a checkpoint saved while its
    stale window was open): each layer's upload copy is rewritten as its gate opens, then the lr
    scheduler steps, as the original step would have done (not if it was skipped for overflow)."""
    return StepFns(lambda: None, True, host.pcopy, host.pcopy, host.clear_grads,
                   _scheduler_step(optimizer, lr_scheduler, lambda: skipped))


def _scheduler_step(optimizer: Any, lr_scheduler: Any, skipped: Callable[[], bool]) -> Callable[[], None]:
    """The step's end: the lr scheduler stepped unless the step was skipped for overflow.  optimizer.step()
    never ran here, so the scheduler is told the update happened (its own wrapper's flag)."""
    def after() -> None:
        if skipped():
            return
        if optimizer is not None:
            optimizer._opt_called = True
        if lr_scheduler is not None:
            lr_scheduler.step()
    return after
