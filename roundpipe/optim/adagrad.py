"""Adagrad: a drop-in torch.optim.Adagrad on the native fused step.

    opt = roundpipe.optim.Adagrad(model.parameters(), lr=1e-2, lr_decay=1e-4)

State and param groups have torch.optim.Adagrad's layout ('step' as a float32
0-dim tensor and 'sum', both created in the constructor as torch does), so state
dicts load into either optimizer.  The kernel (csrc/optimizers.h) performs the
operations of torch's fused CPU Adagrad, so fp32 results equal
torch.optim.Adagrad(fused=True)'s bit for bit; parameters it cannot take run
`_torch_step`, torch's single-tensor formula (whose MKL sqrt may be an ulp off).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from roundpipe import _native
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
class AdagradConfig:
    """Hyper-parameters of one parameter group (torch.optim.Adagrad's), all numbers >= 0.

    The step size of step t is lr / (1 + (t - 1) * lr_decay); weight_decay is an
    L2 term in the gradient; the sum of squared gradients starts at
    initial_accumulator_value; eps is added to its square root.  maximize: ascend.
    """

    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            check_nonneg(name, getattr(self, name))
        check_flags(self, "maximize")


class Adagrad(FusedOptimizer):
    """torch.optim.Adagrad's interface and results (those of fused=True)."""

    _counts_steps = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, foreach: bool | None = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: bool | None = None):
        reject_unsupported("Adagrad", differentiable=differentiable)
        lr = float(lr) if isinstance(lr, torch.Tensor) else lr
        AdagradConfig(lr, lr_decay, weight_decay, initial_accumulator_value, eps, bool(maximize))
        # foreach/fused: stored as None only for torch's state-dict keys (the kernel is always fused).
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=None, maximize=maximize,
                        differentiable=False, fused=None)
        super().__init__(params, defaults)
        for group in self.param_groups:   # torch creates the state up front; so do we, for equal state dicts
            for state, bufs in self._states(group["params"], self._config(group)):
                state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
                state.update(bufs)

    def _config(self, group: dict[str, Any]) -> AdagradConfig:
        return AdagradConfig(lr=float(group["lr"]), lr_decay=float(group["lr_decay"]),
                             weight_decay=float(group["weight_decay"]),
                             initial_accumulator_value=float(group["initial_accumulator_value"]),
                             eps=float(group["eps"]), maximize=bool(group.get("maximize", False)))

    def _buffer_names(self, config: AdagradConfig) -> list[str]:
        return ["sum"]

    def _initial_value(self, config: AdagradConfig) -> float:
        return config.initial_accumulator_value

    def _native_step(self, config: AdagradConfig, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list[tuple[dict[str, Any], Buffers]], shadows: list | None, grad_mul: float,
                     predict: float = 0.0, rounding: str | None = None, keys: list[int] | None = None) -> None:
        _native.lib.adagrad_step(**native_buffers(params, grads, shadows, predict, rounding, keys),
                                sums=[b["sum"].data_ptr() for _, b in states],
                                steps=[self._step_of(s) for s, _ in states], lr=config.lr, lr_decay=config.lr_decay,
                                weight_decay=config.weight_decay, eps=config.eps, maximize=config.maximize,
                                grad_mul=float(grad_mul))

    def _torch_step(self, config: AdagradConfig, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                    bufs: Buffers, grad_mul: float) -> None:
        g = torch_grad(p, grad, grad_mul, config.maximize, config.weight_decay)
        clr = config.lr / (1 + (self._step_of(state) - 1) * config.lr_decay)
        total = bufs["sum"].addcmul_(g, g, value=1)
        p.addcdiv_(g, total.sqrt().add_(config.eps), value=-clr)
