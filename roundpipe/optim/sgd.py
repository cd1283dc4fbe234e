"""SGD (momentum, dampening, Nesterov, weight decay): a drop-in torch.optim.SGD on the native fused step.

    opt = roundpipe.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)

State and param groups have torch.optim.SGD's layout ('momentum_buffer', present
once a step with momentum != 0 ran), so state dicts load into either optimizer.
The kernel (csrc/optimizers.h) performs torch's operations with torch's
roundings, so fp32 results equal torch.optim.SGD's bit for bit; parameters it
cannot take run `_torch_step`, torch's own single-tensor formula.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from roundpipe import _native
from roundpipe.core.checks import is_number
from roundpipe.optim.base import (
    Buffers,
    FusedOptimizer,
    check_flags,
    check_nonneg,
    native_buffers,
    reject_unsupported,
    torch_grad,
)


@dataclass(frozen=True)
class SGDConfig:
    """Hyper-parameters of one parameter group (torch.optim.SGD's).

    lr, momentum, weight_decay: >= 0 (weight decay is an L2 term in the gradient).
    dampening: any finite number (the new gradient enters the buffer x (1 - dampening)).
    nesterov: needs momentum > 0 and dampening 0.  maximize: ascend.
    """

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "weight_decay"):
            check_nonneg(name, getattr(self, name))
        if not is_number(self.dampening) \
                or not math.isfinite(self.dampening):
            raise ValueError(f"dampening={self.dampening!r} must be a finite number")
        check_flags(self, "nesterov", "maximize")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(f"nesterov=True needs momentum > 0 and dampening=0, got momentum={self.momentum!r}, "
                             f"dampening={self.dampening!r}")


class SGD(FusedOptimizer):
    """torch.optim.SGD's interface and results."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None):
        reject_unsupported("SGD", differentiable=differentiable)
        lr = float(lr) if isinstance(lr, torch.Tensor) else lr
        SGDConfig(lr, momentum, dampening, weight_decay, bool(nesterov), bool(maximize))
        # foreach/fused: stored as None only for torch's state-dict keys (the kernel is always fused).
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=None, differentiable=False, fused=None)
        super().__init__(params, defaults)

    def _config(self, group: dict[str, Any]) -> SGDConfig:
        return SGDConfig(lr=float(group["lr"]), momentum=float(group["momentum"]),
                         dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
                         nesterov=bool(group["nesterov"]), maximize=bool(group.get("maximize", False)))

    def _buffer_names(self, config: SGDConfig) -> list[str]:
        return ["momentum_buffer"] if config.momentum != 0 else []

    def _native_step(self, config: SGDConfig, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list[tuple[dict[str, Any], Buffers]], shadows: list | None, grad_mul: float,
                     predict: float = 0.0, rounding: str | None = None, keys: list[int] | None = None) -> None:
        momentum = config.momentum != 0
        _native.lib.sgd_step(**native_buffers(params, grads, shadows, predict, rounding, keys),
                            momentum_buffers=[b["momentum_buffer"].data_ptr() for _, b in states] if momentum else [],
                            firsts=[momentum and s.get("momentum_buffer") is None for s, _ in states],
                            lr=config.lr, momentum=config.momentum, dampening=config.dampening,
                            weight_decay=config.weight_decay, nesterov=config.nesterov, maximize=config.maximize,
                            grad_mul=float(grad_mul))

    def _torch_step(self, config: SGDConfig, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                    bufs: Buffers, grad_mul: float) -> None:
        g = torch_grad(p, grad, grad_mul, config.maximize, config.weight_decay)
        if config.momentum != 0:
            buf = bufs["momentum_buffer"]
            if state.get("momentum_buffer") is None:   # a new buffer takes the gradient as it is
                buf.copy_(g)
            else:
                buf.mul_(config.momentum).add_(g, alpha=1 - config.dampening)
            g = g.add(buf, alpha=config.momentum) if config.nesterov else buf
        p.add_(g, alpha=-config.lr)
