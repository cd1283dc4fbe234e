"""Adam and AdamW: drop-in torch.optim optimizers on the native fused step.

    opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss.backward(); opt.step(); opt.zero_grad()

Param groups, lr schedulers, hooks and `zero_grad` come from
torch.optim.Optimizer.  `state_dict()` has torch.optim.AdamW's layout (state
'step' as a float32 0-dim tensor, 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq',
and torch's group keys), so checkpoints load into either optimizer both ways.

CPU fp32 contiguous parameters go through roundpipe._C's fused kernel, whose
arithmetic equals torch's AdamW(fused=True); any other parameter (CUDA, bf16,
non-contiguous) is updated with torch ops in the same formula.  The engine's
entries (`step_layer`, `fused_step`) and the split come from
roundpipe/optim/base.py.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from roundpipe.optim.base import Buffers, FusedOptimizer, reject_unsupported
from roundpipe.optim.fused import AdamConfig, adam_step, adam_step_torch


class Adam(FusedOptimizer):
    """torch.optim.Adam's interface and results (AdamW with decoupled_weight_decay=True)."""

    _counts_steps = True
    _state_keys = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
    _state_format = "fp32 moments (exp_avg, exp_avg_sq)"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False):
        reject_unsupported("Adam", capturable, differentiable)
        lr = float(lr) if isinstance(lr, torch.Tensor) else lr
        AdamConfig(lr, tuple(betas), eps, weight_decay, bool(decoupled_weight_decay), bool(amsgrad), bool(maximize))
        # foreach/fused are accepted (and stored, as None) only so that state dicts
        # carry the same keys as torch's: the kernel is always the fused one.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)

    def _config(self, group: dict[str, Any]) -> AdamConfig:
        beta1, beta2 = group["betas"]
        return AdamConfig(lr=float(group["lr"]), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                          weight_decay=float(group["weight_decay"]),
                          decoupled=bool(group.get("decoupled_weight_decay", False)),
                          amsgrad=bool(group.get("amsgrad", False)), maximize=bool(group.get("maximize", False)))

    def _buffer_names(self, config: AdamConfig) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if config.amsgrad else [])

    def _native_step(self, config: AdamConfig, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list[tuple[dict[str, Any], Buffers]], shadows: list | None, grad_mul: float,
                     predict: float = 0.0, rounding: str | None = None, keys: list[int] | None = None) -> None:
        adam_step(params, grads, [b["exp_avg"] for _, b in states], [b["exp_avg_sq"] for _, b in states],
                  [self._step_of(s) for s, _ in states], config,
                  max_exp_avg_sqs=[b["max_exp_avg_sq"] for _, b in states] if config.amsgrad else None,
                  shadows=shadows, grad_mul=grad_mul, predict=predict, rounding=rounding or "nearest", round_keys=keys)

    def _torch_step(self, config: AdamConfig, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                    bufs: Buffers, grad_mul: float) -> None:
        adam_step_torch(p, grad, bufs["exp_avg"], bufs["exp_avg_sq"], bufs.get("max_exp_avg_sq"), self._step_of(state),
                    config, grad_mul)


class AdamW(Adam):
    """torch.optim.AdamW's interface and results: decoupled weight decay, default 0.01."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)
