"""Lion (EvoLved Sign Momentum) on the native fused step.

Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms" (arXiv:2302.06675),
Algorithm 2, with decoupled weight decay:

    c = beta1 * m + (1 - beta1) * g
    w = w - lr * (sign(c) + weight_decay * w)     computed as w * (1 - lr * wd) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

One fp32 state buffer per parameter ('exp_avg'), no step count.  The paper's
defaults: betas (0.9, 0.99) and a learning rate 3-10x smaller than AdamW's
(with a weight decay 3-10x larger, to keep lr * wd).  torch has no Lion; the
fallback `_torch_step` is the same formula in torch ops, equal to the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from roundpipe import _native
from roundpipe.optim.base import (
    Buffers,
    FusedOptimizer,
    check_betas,
    check_flags,
    check_nonneg,
    native_buffers,
    torch_grad,
)


@dataclass(frozen=True)
class LionConfig:
    """Hyper-parameters of one parameter group.

    lr, weight_decay: >= 0 (decay decoupled: the weight shrinks by lr * weight_decay).
    betas: (interpolation for the update's sign, decay of the momentum), each in [0, 1).
    maximize: ascend.
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay"):
            check_nonneg(name, getattr(self, name))
        check_betas(self.betas)
        check_flags(self, "maximize")


class Lion(FusedOptimizer):
    """Lion with torch.optim conventions (param groups, schedulers, state dicts)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False):
        lr = float(lr) if isinstance(lr, torch.Tensor) else lr
        LionConfig(lr, tuple(betas), weight_decay, bool(maximize))
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize))

    def _config(self, group: dict[str, Any]) -> LionConfig:
        beta1, beta2 = group["betas"]
        return LionConfig(lr=float(group["lr"]), betas=(float(beta1), float(beta2)),
                          weight_decay=float(group["weight_decay"]), maximize=bool(group.get("maximize", False)))

    def _buffer_names(self, config: LionConfig) -> list[str]:
        return ["exp_avg"]

    def _native_step(self, config: LionConfig, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list[tuple[dict[str, Any], Buffers]], shadows: list | None, grad_mul: float,
                     predict: float = 0.0, rounding: str | None = None, keys: list[int] | None = None) -> None:
        beta1, beta2 = config.betas
        _native.lib.lion_step(**native_buffers(params, grads, shadows, predict, rounding, keys),
                             exp_avgs=[b["exp_avg"].data_ptr() for _, b in states], lr=config.lr, beta1=beta1,
                             beta2=beta2, weight_decay=config.weight_decay, maximize=config.maximize,
                             grad_mul=float(grad_mul))

    def _torch_step(self, config: LionConfig, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                    bufs: Buffers, grad_mul: float) -> None:
        beta1, beta2 = config.betas
        g = torch_grad(p, grad, grad_mul, config.maximize)
        if config.weight_decay != 0:
            p.mul_(1 - config.lr * config.weight_decay)
        m = bufs["exp_avg"]
        p.add_(m.mul(beta1).add_(g, alpha=1 - beta1).sign_(), alpha=-config.lr)
        m.mul_(beta2).add_(g, alpha=1 - beta2)
