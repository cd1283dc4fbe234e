"""Adam and AdamW: drop-in torch.optim optimizers on the native fused step.

    opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss.backward(); opt.step(); opt.zero_grad()

Param groups, lr schedulers, hooks and `zero_grad` come from
torch.optim.Optimizer.  `state_dict()` has torch.optim.AdamW's layout (state
'step' as a float32 0-dim tensor, 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq',
and torch's group keys), so checkpoints load into either optimizer both ways.

CPU fp32 contiguous parameters go through roundpipe._C's fused kernel, whose
arithmetic equals torch's AdamW(fused=True); any other parameter (CUDA, bf16,
non-contiguous) is updated with torch ops in the same formula.

The engine-facing entry is `fused_step(grads, params=, shadows=, grad_scale=,
clip_coef=, found_inf=)`: gradients passed in explicitly (any of fp32/bf16/fp16,
e.g. straight from the download buffer), the low-precision upload copies
written in the same pass, loss-scale and clipping folded into one multiplier,
and the whole step skipped when a gradient is not finite.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import torch

from roundpipe import _native
from roundpipe.optim.fused import AdamConfig, _torch_step, adam_step
from roundpipe.optim.gradients import grad_sumsq


class Adam(torch.optim.Optimizer):
    """torch.optim.Adam's interface and results (AdamW with decoupled_weight_decay=True)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False):
        if capturable or differentiable:
            raise ValueError(f"capturable={capturable} and differentiable={differentiable}: roundpipe's Adam "
                             "supports neither; use torch.optim.Adam for them")
        lr = float(lr) if isinstance(lr, torch.Tensor) else lr
        AdamConfig(lr, tuple(betas), eps, weight_decay, bool(decoupled_weight_decay), bool(amsgrad), bool(maximize))
        # foreach/fused are accepted (and stored, as None) only so that state dicts
        # carry the same keys as torch's: the kernel is always the fused one.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        self._fused_call: tuple | None = None

    @staticmethod
    def _config(group: dict[str, Any]) -> AdamConfig:
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        return AdamConfig(lr=float(lr), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                          weight_decay=float(group["weight_decay"]),
                          decoupled=bool(group.get("decoupled_weight_decay", False)),
                          amsgrad=bool(group.get("amsgrad", False)), maximize=bool(group.get("maximize", False)))

    def _state_for(self, p: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif not isinstance(state["step"], torch.Tensor):  # old checkpoints stored a number
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient (torch.optim semantics)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fused_call is not None:  # fused_step routed through here for hooks and lr schedulers
            params, grads, shadows, grad_mul = self._fused_call
            for gi, idx in self._by_group(params).items():
                self._update(self.param_groups[gi], [params[i] for i in idx], [grads[i] for i in idx],
                             [shadows[i] for i in idx], grad_mul)
            return loss
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
            self._update(group, params, [p.grad for p in params], None, 1.0)
        return loss

    @torch.no_grad()
    def fused_step(self, grads: Sequence[torch.Tensor], *, params: Sequence[torch.Tensor] | None = None,
                   shadows: Sequence[torch.Tensor | None] | None = None, grad_scale: float = 1.0,
                   clip_coef: float = 1.0, found_inf: bool | None = None) -> bool:
        """The engine's step: explicit gradients, optional upload copies, loss scale and clipping.

        grads[i] is the gradient of params[i] (default: all parameters, group
        by group) as fp32, bf16 or fp16 with the same number of elements; it is
        read as grads[i] * clip_coef / grad_scale.  shadows[i] (or None)
        receives the updated params[i] in its dtype.  found_inf: True skips the
        step, False runs it, None checks the gradients first (one extra read)
        when grad_scale != 1, as a loss scaler needs.  A skipped step changes
        nothing, step counts included, and returns False; otherwise True.
        """
        params = [p for g in self.param_groups for p in g["params"]] if params is None else list(params)
        grads = list(grads)
        if len(grads) != len(params):
            raise ValueError(f"grads has {len(grads)} tensors but params has {len(params)}; they must match")
        shadows = [None] * len(params) if shadows is None else list(shadows)
        if len(shadows) != len(params):
            raise ValueError(f"shadows has {len(shadows)} entries but params has {len(params)}; they must match")
        for i, (p, g, sh) in enumerate(zip(params, grads, shadows)):
            if not isinstance(g, torch.Tensor) or g.numel() != p.numel():
                raise ValueError(f"grads[{i}] must be a tensor with {p.numel()} elements like params[{i}], got "
                                 f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
            if sh is not None and (not isinstance(sh, torch.Tensor) or sh.numel() != p.numel()):
                raise ValueError(f"shadows[{i}] must be None or a tensor with {p.numel()} elements like params[{i}]")
        if not (grad_scale > 0 and math.isfinite(grad_scale)):
            raise ValueError(f"grad_scale={grad_scale!r} must be a finite number > 0")
        if not (clip_coef > 0 and math.isfinite(clip_coef)):
            raise ValueError(f"clip_coef={clip_coef!r} must be a finite number > 0")
        if found_inf is None and grad_scale != 1.0:
            found_inf = not math.isfinite(grad_sumsq(grads))
        self._by_group(params)  # rejects foreign parameters before anything runs
        if found_inf:
            return False
        # Through step(), so that step hooks run and lr schedulers see an optimizer step.
        self._fused_call = (params, grads, shadows, clip_coef / grad_scale)
        try:
            self.step()
        finally:
            self._fused_call = None
        return True

    @torch.no_grad()
    def step_layer(self, params: Sequence[torch.Tensor], upload: Sequence[torch.Tensor | None] | None = None,
                   clip_coef: float = 1.0, grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """The engine's per-layer step: updates those of `params` that have a `.grad` and writes
        each updated weight into upload[i] (the copy workers upload, any float dtype) in the same pass.
        The gradients are read as grad * clip_coef (global-norm clipping folded into the pass);
        `grads` gives them explicitly (one per parameter, None: no update; fp32, bf16 or fp16,
        read as they are), else each parameter's `.grad`.

        RoundPipe.step calls this once per layer as the layer's P-copy gate opens, so
        the update of shallow layers overlaps the next iteration's use of deep ones.
        Unlike step(), no step hooks run (they would fire once per layer).
        """
        params = list(params)
        upload = [None] * len(params) if upload is None else list(upload)
        if len(upload) != len(params):
            raise ValueError(f"upload has {len(upload)} entries but params has {len(params)}; they must match")
        if not (clip_coef > 0 and math.isfinite(clip_coef)):
            raise ValueError(f"clip_coef={clip_coef!r} must be a finite number > 0")
        grads = [p.grad for p in params] if grads is None else list(grads)
        if len(grads) != len(params):
            raise ValueError(f"grads has {len(grads)} entries but params has {len(params)}; they must match")
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is not None and (not isinstance(g, torch.Tensor) or g.shape != p.shape or not g.is_floating_point()):
                what = f"a {g.dtype} tensor of shape {tuple(g.shape)}" if isinstance(g, torch.Tensor) else type(g).__name__
                raise ValueError(f"grads[{i}] is {what}; expected None or a floating tensor of shape {tuple(p.shape)}")
        live = [i for i, g in enumerate(grads) if g is not None]
        for gi, idx in self._by_group([params[i] for i in live]).items():
            chosen = [live[i] for i in idx]
            self._update(self.param_groups[gi], [params[i] for i in chosen], [grads[i] for i in chosen],
                         [upload[i] for i in chosen], clip_coef)

    def _by_group(self, params: Sequence[torch.Tensor]) -> dict[int, list[int]]:
        """Indices into `params` per param-group index; ValueError for a parameter not in this optimizer."""
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        members: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if id(p) not in group_of:
                raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) is not a parameter of this optimizer")
            members.setdefault(group_of[id(p)], []).append(i)
        return members

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                shadows: list[torch.Tensor | None] | None, grad_mul: float) -> None:
        if not params:
            return
        config = self._config(group)
        states = [self._state_for(p, config.amsgrad) for p in params]
        # The step counters advance only once the update went through, so a
        # rejected call (bad shadow, wrong size) leaves the optimizer as it was.
        steps = [float(s["step"]) + 1 for s in states]
        native = [i for i, p in enumerate(params) if _native_ok(p, grads[i], states[i])]
        if native:
            pick = lambda seq: [seq[i] for i in native]  # noqa: E731
            adam_step(pick(params), pick(grads), [states[i]["exp_avg"] for i in native],
                      [states[i]["exp_avg_sq"] for i in native], pick(steps), config,
                      max_exp_avg_sqs=[states[i]["max_exp_avg_sq"] for i in native] if config.amsgrad else None,
                      shadows=pick(shadows) if shadows is not None else None, grad_mul=grad_mul)
        for i in sorted(set(range(len(params))) - set(native)):
            s = states[i]
            _torch_step(params[i], grads[i], s["exp_avg"], s["exp_avg_sq"], s.get("max_exp_avg_sq") if config.amsgrad
                        else None, steps[i], config, grad_mul)
            if shadows is not None and shadows[i] is not None:
                shadows[i].view(-1).copy_(params[i].view(-1))
        for s in states:
            s["step"] += 1


def _native_ok(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> bool:
    """Whether the native kernel can take this parameter (else the torch path runs)."""
    tensors = [p, grad, state["exp_avg"], state["exp_avg_sq"]] + ([state["max_exp_avg_sq"]]
                                                                  if "max_exp_avg_sq" in state else [])
    return (_native.available() and p.dtype == torch.float32 and grad.dtype in (torch.float32, torch.bfloat16,
            torch.float16) and all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32
                                   for t in tensors if t is not grad)
            and grad.device.type == "cpu" and grad.is_contiguous())


class AdamW(Adam):
    """torch.optim.AdamW's interface and results: decoupled weight decay, default 0.01."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)
