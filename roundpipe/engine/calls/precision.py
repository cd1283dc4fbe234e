"""The precision policy: which dtype each part of training runs in.

    model = rp.RoundPipe(layers, precision=rp.Precision(torch.bfloat16))

    masters, optimizer state     fp32 on the host, always
    uploaded parameters          compute_dtype (the upload copies, roundpipe/engine/step/host_state.py)
    layers and loss_fn           under torch.autocast(device type, compute_dtype) when compute_dtype
                                 is not fp32 (`autocast=True`): matmuls in compute_dtype, the ops
                                 autocast keeps in fp32 (losses, softmax on CUDA, ...) in fp32,
                                 mixed operands promoted as PyTorch promotes them
    call inputs                  keep their dtype (an fp32 attention mask stays fp32, so its
                                 finfo(float32).min entries stay finite instead of becoming -inf
                                 in bf16/fp16, which turns a fully masked softmax row into NaN);
                                 `cast_inputs=True` casts every floating input leaf to
                                 compute_dtype instead (the previous behaviour)
    activations between stages   the dtype the layer produced: no cast at stage boundaries, so
                                 results do not depend on where the plan cuts the model
    parameter gradients          summed over microbatches in fp32 on the worker, sent home in
                                 compute_dtype, summed over calls in fp32
    fp16                         dynamic loss scaling (roundpipe/engine/step/loss_scale.py, `loss_scale`)

On CPU workers, autocast does not upcast a layer norm's low-precision weight for an
fp32 input as it does on CUDA: a model whose first layer is a LayerNorm fed fp32 data
needs `cast_inputs=True` there (the error says so).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager

import torch

from roundpipe.core.tree import tree_map
from roundpipe.workers import COMPUTE_DTYPES


@dataclasses.dataclass(frozen=True)
class Precision:
    """compute_dtype: parameters' upload dtype and autocast dtype (None: bf16 on GPUs, fp32 on CPU
    workers).  autocast: run layers and loss_fn under torch.autocast for it.  cast_inputs: cast
    the floating leaves of the call's inputs (not labels) to compute_dtype.  loss_scale: fp16
    dynamic loss scaling (a roundpipe.LossScale, None for its defaults; only with float16)."""

    compute_dtype: torch.dtype | None = None
    autocast: bool = True
    cast_inputs: bool = False
    loss_scale: Any = None

    def __post_init__(self):
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} must be one of {COMPUTE_DTYPES} or None")
        for name in ("autocast", "cast_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Precision.{name} must be True or False, got {getattr(self, name)!r}")

    def resolved(self, default: torch.dtype) -> "Precision":
        return self if self.compute_dtype is not None else dataclasses.replace(self, compute_dtype=default)

    def autocast_on(self, device_type: str) -> ContextManager:
        """The autocast context layers run in on a worker of this device type."""
        if not self.autocast or self.compute_dtype in (None, torch.float32):
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def cast_call_inputs(self, x: Any) -> Any:
        """The call's inputs as the first layer gets them."""
        if not self.cast_inputs or self.compute_dtype in (None, torch.float32):
            return x
        dt = self.compute_dtype
        return tree_map(lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and t.dtype != dt else t, x)


def resolve(precision: Precision | None, compute_dtype: torch.dtype | None, default: torch.dtype) -> Precision:
    """The model's policy from its `precision=` and `compute_dtype=` arguments."""
    if precision is not None and not isinstance(precision, Precision):
        raise TypeError(f"precision must be a roundpipe.Precision or None, got {type(precision).__name__}")
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r} must be one of {COMPUTE_DTYPES} or None")
    if precision is None:
        return Precision(compute_dtype).resolved(default)
    if compute_dtype is not None and precision.compute_dtype not in (None, compute_dtype):
        raise ValueError(f"compute_dtype={compute_dtype} and precision.compute_dtype={precision.compute_dtype} "
                         "disagree; give one of them")
    if compute_dtype is not None:
        precision = dataclasses.replace(precision, compute_dtype=compute_dtype)
    return precision.resolved(default)


# Keywords of the published RoundPipe's calls (roundpipe 0.1.1) and what replaces each (docs/migrating.md)
_PUBLISHED_KEYWORDS = {
    "input_args": "pass the inputs as ordinary positional arguments: forward_backward(x, ...)",
    "input_kwargs": "pass them as ordinary keyword arguments: forward_backward(x, mask=m, ...)",
    "label": "the labels are labels=",
    "run_config": "per-call options are keywords of the call (num_microbatches=, recompute=, return_outputs=), "
                  "model-wide ones the RoundPipe's",
}


def published_keyword_note(exc: BaseException) -> None:
    """Adds the rename to layer 0's TypeError for a keyword of the published RoundPipe's calls left in a call
    (`input_args=`, `label=`, `run_config=`), which reach the first layer as its keyword arguments."""
    if not isinstance(exc, TypeError):
        return
    msg = str(exc)
    for name, hint in _PUBLISHED_KEYWORDS.items():
        if f"unexpected keyword argument '{name}'" in msg:
            exc.add_note(f"[roundpipe] {name}= is a keyword of the published RoundPipe (0.1.1), not of this "
                         f"one: {hint} (docs/migrating.md)")
            return


def dtype_mismatch_note(exc: BaseException) -> None:
    """Adds the policy's hint to a dtype mismatch raised by a layer."""
    msg = str(exc)
    if isinstance(exc, RuntimeError) and ("dtype" in msg or "scalar type" in msg):
        exc.add_note("[roundpipe] call inputs keep their dtype under the precision policy (roundpipe/engine/"
                     "precision.py); if a layer needs them in the compute dtype, pass "
                     "precision=roundpipe.Precision(compute_dtype, cast_inputs=True)")
