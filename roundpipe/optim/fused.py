"""The fused Adam/AdamW step over a group of fp32 master tensors (engine-facing).

One sweep per element reads the gradient in the dtype it arrived in (fp32,
bf16 or fp16), multiplies it by `grad_mul` (clip_coef / loss_scale), updates the
fp32 weight and moments, and writes the weight's low-precision shadow copy (the
next upload) in the same pass.  The sequence torch needs for the same result,
`g.float() * inv_scale -> AdamW(fused=True) -> w.to(bf16)`, streams the state
three times; see bench/cpu_optim.py for the measured difference.

The native kernel (roundpipe._C.adam_step, GIL released) performs torch's fused
CPU AdamW arithmetic operation by operation, so with fp32 gradients the weights
equal torch.optim.AdamW(fused=True)'s bit for bit, and every SIMD level gives
the same bits.  Without the extension, `adam_step_torch` runs the same formulas as
torch ops (equal to torch's single-tensor AdamW, within an ulp of the kernel).

bf16 masters: params[i] may be bf16; it is read, updated in fp32 as above and
rounded back in the same pass (`rounding`: nearest, or stochastic with one
counter-based key per tensor, roundpipe/optim/rounding.py), and its shadow gets
the rounded value.

Shapes: per tensor i, params[i] (fp32 or bf16), exp_avgs[i], exp_avg_sqs[i] and
max_exp_avg_sqs[i] (fp32) have n_i elements; grads[i] and shadows[i] hold
n_i elements of fp32/bf16/fp16 (any shape, contiguous).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Sequence

import torch

from roundpipe import _native
from roundpipe.hostops import NATIVE_DTYPES, check_host_tensor, check_real, tensor_list
from roundpipe.optim.base import check_betas, check_flags, check_nonneg, master_args, torch_grad, with_shadow
from roundpipe.optim.rounding import check_rounding, round_bf16_

_F32 = {torch.float32: "float32"}
_MASTERS = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class AdamConfig:
    """Hyper-parameters of one parameter group.

    lr: step size (>= 0).  betas: moment decay rates, each in [0, 1).  eps: added
    to the denominator (>= 0).  weight_decay: >= 0; applied to the weight
    (`decoupled=True`, AdamW) or added to the gradient as an L2 term (Adam).
    amsgrad: use the running maximum of the second moment.  maximize: ascend.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "eps", "weight_decay"):
            check_nonneg(name, getattr(self, name))
        check_betas(self.betas)
        check_flags(self, "decoupled", "amsgrad", "maximize")


def _check_same_numel(name: str, tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
    if len(tensors) != len(params):
        raise ValueError(f"{name} has {len(tensors)} tensors but params has {len(params)}; they must match one to one")
    for i, (t, p) in enumerate(zip(tensors, params)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and t.numel() != p.numel():
            raise ValueError(f"{name}[{i}] has {t.numel()} elements but params[{i}] has {p.numel()}")


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: int | Sequence[int],
    config: AdamConfig,
    *,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    shadows: Sequence[torch.Tensor | None] | None = None,
    grad_mul: float = 1.0,
    predict: float = 0.0,
    rounding: str = "nearest",
    round_keys: Sequence[int] | None = None,
) -> None:
    """One Adam/AdamW update of every tensor of a group, in place.

    `steps` is the step number of this update (1 for the first), one for all
    tensors or one per tensor.  `max_exp_avg_sqs` is required with amsgrad.
    `shadows[i]` (or None) receives params[i] converted to its dtype (bf16 RNE).
    The gradients are read as `grad * grad_mul`.  predict > 0: the shadows receive
    the predicted next weights p + predict * (p - p_before).  All tensors must be
    contiguous CPU tensors; moments fp32, params fp32 or bf16 masters: a bf16 one is updated
    in fp32 and rounded back (`rounding` 'nearest', or 'stochastic' with round_keys[i], one
    64-bit key per tensor: roundpipe/optim/rounding.py).
    """
    if not isinstance(config, AdamConfig):
        raise TypeError(f"config must be an AdamConfig, got {type(config).__name__}")
    params = tensor_list("params", params)
    n = len(params)
    if isinstance(steps, numbers.Real):
        step_list = [steps] * n
    elif isinstance(steps, Iterable) and not isinstance(steps, (str, bytes)):
        step_list = list(steps)
    else:
        raise TypeError(f"steps must be a number or one number per tensor, got {type(steps).__name__}")
    if len(step_list) != n:
        raise ValueError(f"steps has {len(step_list)} entries but params has {n}")
    for i, s in enumerate(step_list):
        if not check_real(f"steps[{i}]", s) >= 1:
            raise ValueError(f"steps[{i}]={s!r} must be >= 1 (the number of this update)")
    grad_mul = check_real("grad_mul", grad_mul)
    if not math.isfinite(grad_mul):
        raise ValueError(f"grad_mul={grad_mul!r} must be finite")
    predict = check_real("predict", predict)
    if not 0 <= predict < math.inf:
        raise ValueError(f"predict={predict!r} must be a finite number >= 0")
    grads, exp_avgs = tensor_list("grads", grads), tensor_list("exp_avgs", exp_avgs)
    exp_avg_sqs = tensor_list("exp_avg_sqs", exp_avg_sqs)
    for i, p in enumerate(params):
        check_host_tensor(f"params[{i}]", p, _MASTERS)
    check_rounding(rounding, "rounding")
    keys = [0] * n if round_keys is None else [int(k) for k in round_keys]
    if len(keys) != n:
        raise ValueError(f"round_keys has {len(keys)} entries but params has {n}")
    _check_same_numel("grads", grads, params)
    _check_same_numel("exp_avgs", exp_avgs, params)
    _check_same_numel("exp_avg_sqs", exp_avg_sqs, params)
    for i in range(n):
        check_host_tensor(f"grads[{i}]", grads[i])
        check_host_tensor(f"exp_avgs[{i}]", exp_avgs[i], _F32)
        check_host_tensor(f"exp_avg_sqs[{i}]", exp_avg_sqs[i], _F32)
    if config.amsgrad:
        if max_exp_avg_sqs is None:
            raise ValueError("max_exp_avg_sqs is required when config.amsgrad is True")
        max_exp_avg_sqs = tensor_list("max_exp_avg_sqs", max_exp_avg_sqs)
        _check_same_numel("max_exp_avg_sqs", max_exp_avg_sqs, params)
        for i, t in enumerate(max_exp_avg_sqs):
            check_host_tensor(f"max_exp_avg_sqs[{i}]", t, _F32)
    else:
        max_exp_avg_sqs = []
    shadow_list = tensor_list("shadows", shadows) if shadows is not None else [None] * n
    _check_same_numel("shadows", shadow_list, params)
    for i, t in enumerate(shadow_list):
        if t is not None:
            check_host_tensor(f"shadows[{i}]", t)
    if _native.available():
        beta1, beta2 = config.betas
        _native.lib.adam_step(
            [p.data_ptr() for p in params], [g.data_ptr() for g in grads], [NATIVE_DTYPES[g.dtype] for g in grads],
            [t.data_ptr() for t in exp_avgs], [t.data_ptr() for t in exp_avg_sqs],
            [t.data_ptr() for t in max_exp_avg_sqs],
            [t.data_ptr() if t is not None else 0 for t in shadow_list],
            [NATIVE_DTYPES[t.dtype] if t is not None else "bfloat16" for t in shadow_list],
            [p.numel() for p in params], [float(s) for s in step_list],
            lr=float(config.lr), beta1=float(beta1), beta2=float(beta2), eps=float(config.eps),
            weight_decay=float(config.weight_decay), decoupled=config.decoupled, amsgrad=config.amsgrad,
            maximize=config.maximize, grad_mul=float(grad_mul), predict=float(predict),
            **master_args(params, rounding, keys))
        return
    _check_no_overlap(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, shadow_list)
    for i, p in enumerate(params):
        w = p.float() if p.dtype == torch.bfloat16 else p   # a bf16 master: updated in fp32, then rounded

        def update(i=i, p=p, w=w) -> None:
            adam_step_torch(w, grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i] if config.amsgrad else None,
                        float(step_list[i]), config, grad_mul)
            if w is not p:
                round_bf16_(p, w, rounding, keys[i])
        with_shadow(p, shadow_list[i], predict, update)


def _check_no_overlap(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, shadows) -> None:
    """The fallback's copy of the native overlap check: outputs may share memory with nothing."""
    spans = []
    for name, tensors, output in [("params", params, True), ("grads", grads, False), ("exp_avgs", exp_avgs, True),
                                  ("exp_avg_sqs", exp_avg_sqs, True), ("max_exp_avg_sqs", max_exp_avg_sqs, True),
                                  ("shadows", shadows, True)]:
        for i, t in enumerate(tensors):
            if t is not None and t.numel():
                start = t.data_ptr()
                spans.append((start, start + t.numel() * t.element_size(), f"{name}[{i}]", output))
    spans.sort()
    reach = {True: None, False: None}
    for span in spans:
        for other in ([reach[True], reach[False]] if span[3] else [reach[True]]):
            if other is not None and other[1] > span[0]:
                raise ValueError(f"{span[2]} overlaps {other[2]} in memory; outputs must not share memory "
                                 "with each other or with the gradients")
        if reach[span[3]] is None or span[1] > reach[span[3]][1]:
            reach[span[3]] = span


def adam_step_torch(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                max_exp_avg_sq: torch.Tensor | None, step: float, config: AdamConfig, grad_mul: float = 1.0) -> None:
    """One tensor's update with torch ops (any device and float dtype), in the kernel's order."""
    beta1, beta2 = config.betas
    g = torch_grad(p, grad, grad_mul, config.maximize, 0.0 if config.decoupled else config.weight_decay,
                   exp_avg.dtype)
    if config.decoupled and config.weight_decay != 0:
        p.mul_(1 - config.lr * config.weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    second = exp_avg_sq
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        second = max_exp_avg_sq
    denom = (second.sqrt() / bias_correction2_sqrt).add_(config.eps)
    p.addcdiv_(exp_avg, denom, value=-config.lr / bias_correction1)
