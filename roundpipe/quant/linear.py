"""QuantLinear: a frozen Linear whose weight is stored 4-bit and dequantized on the device that runs it.

The packed weight and its statistics are buffers (uint8/fp32, never trainable),
so they move with the module and can live in a pinned host arena.  Outside the
engine the dequantized [out, in] weight is a transient of the forward (and, again,
of the backward) and is never saved for backward: the autograd Function keeps only
a reference to the packed state, so between forward and backward a layer holds
0.52 bytes per weight instead of 2-4.  Inside a stage run the engine attaches a
`DequantKeep` (roundpipe/quant/keep.py, `dequant_keep`): the weight is dequantized
once per compute dtype and reused by every product of every microbatch of the stage.

Gradients flow to the input (and to a bias that requires grad), never to the weight.

`quant_state` is cached without holding the tensors: the engine binds each stage
run's uploaded buffers into a worker's replica and unbinds them after it
(roundpipe/engine/calls/replica.py), so a strong cache would keep a layer's packed
bytes on the GPU past its release.  The cache keeps weak references to the state
and to the buffers it was validated for: while the buffers are the same objects the
state is reused (or rebuilt without re-validation), and a new binding validates
once.  Measured (2-core EPYC, torch 2.13 CPU, shared with other jobs): building and
validating the state took 9.3 us a forward (4.9 us validation, 4.2 us nn.Module buffer
lookups); cached, 0.8 us while a backward holds it and 2.9 us when rebuilt unvalidated.
Forward + backward of a 64 x 64 layer on 4 tokens went from 201 to 192 us (-5%); for the
bench's 512 x 1408 layer on 128 tokens (4-8 ms, dequantization included) the saving is
under the timing noise: it matters only for tiny layers or a launch-bound GPU worker.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn import functional as F

from .format import Quant4State, check_quant_type
from .functional import dequantize
from .keep import DequantKeep
from .reference import quantize_4bit

_STATE_BUFFERS = ("absmax", "nested_absmax", "nested_code", "offset")
_BUFFERS = ("weight",) + _STATE_BUFFERS


def _weight(state: Quant4State, dtype: torch.dtype, keep: DequantKeep | None) -> torch.Tensor:
    """state dequantized in dtype: once per stage run through `keep`, else a fresh transient."""
    if keep is None:
        return dequantize(state, dtype)
    return keep.get((id(state.data), dtype), lambda: dequantize(state, dtype))


class QuantLinearFunction(torch.autograd.Function):
    """y = x W^T + b with W dequantized from `state` in x's dtype, in forward and again in backward
    (through `keep`, when given, the same tensor both times)."""

    @staticmethod
    def forward(ctx, x, bias, state, keep):
        ctx.state, ctx.keep = state, keep   # the packed tensors (and the stage run's keep), not the weight
        return F.linear(x, _weight(state, x.dtype, keep), bias)

    @staticmethod
    def backward(ctx, dy):
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = dy @ _weight(ctx.state, dy.dtype, ctx.keep)
        if ctx.needs_input_grad[1]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, db, None, None


def quant_linear(x: torch.Tensor, state: Quant4State, bias: torch.Tensor | None = None,
                 keep: DequantKeep | None = None) -> torch.Tensor:
    """x [..., in] @ dequantize(state)^T + bias, state of shape [out, in]; gradients w.r.t. x and bias only.
    With `keep` the dequantized weight is made once per dtype and kept there (roundpipe/quant/keep.py)."""
    if x.shape[-1] != state.shape[-1]:
        raise ValueError(f"x.shape={tuple(x.shape)} does not end in in_features={state.shape[-1]}")
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return QuantLinearFunction.apply(x, bias, state, keep)


class QuantLinear(nn.Module):
    """A frozen Linear with a 4-bit (NF4/FP4, bitsandbytes layout) weight.

    Buffers: `weight` (packed uint8 [ceil(out * in / 2)]), `absmax` and, double-
    quantized, `nested_absmax`, `nested_code`, `offset`; an optional `bias`
    Parameter.  With `compute_dtype` the input is cast to it for the product and
    the output cast back (bitsandbytes' Linear4bit semantics); without it the
    product runs in the input's dtype.
    """

    # The packed state never changes: the engine keeps it once in its arena, uploads it with the parameters
    # and never downloads it back (roundpipe/engine/step/host_state.py, "Constant buffers").
    constant_buffers = frozenset({"weight", *_STATE_BUFFERS})
    # The stage run's DequantKeep while the engine has one attached (roundpipe/quant/keep.py); None: per product.
    dequant_keep: DequantKeep | None = None

    def __init__(self, state: Quant4State, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        if not isinstance(state, Quant4State):
            raise TypeError(f"state must be a roundpipe.quant.Quant4State, got {type(state).__name__}")
        if len(state.shape) != 2:
            raise ValueError(f"state.shape={tuple(state.shape)} must be [out_features, in_features]")
        self.out_features, self.in_features = state.shape
        self.quant_type = state.quant_type
        self.blocksize, self.nested_blocksize = state.blocksize, state.nested_blocksize
        self.weight_dtype = state.dtype
        self.compute_dtype = compute_dtype
        self.register_buffer("weight", state.data)
        for name in _STATE_BUFFERS:
            self.register_buffer(name, getattr(state, name))
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias.shape={tuple(bias.shape)} must be ({self.out_features},)")
            bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach(), requires_grad=False)
        self.bias = bias

    @property
    def quant_state(self) -> Quant4State:
        """The Quant4State over the module's current buffers (wherever they now live); cached weakly
        (the module docstring)."""
        bufs = self._buffers
        tensors = [bufs[name] for name in _BUFFERS]
        cache = self.__dict__.get("_state_cache")
        if cache is not None and all((r is None and t is None) or (r is not None and r() is t)
                                     for r, t in zip(cache[0], tensors)):
            state = cache[1]()
            if state is not None:
                return state
            state = object.__new__(Quant4State)   # the same tensors, validated when first cached
            state.__dict__.update(cache[2], data=tensors[0], **dict(zip(_STATE_BUFFERS, tensors[1:])))
        else:
            state = Quant4State(data=tensors[0], shape=(self.out_features, self.in_features),
                                dtype=self.weight_dtype, quant_type=self.quant_type, blocksize=self.blocksize,
                                nested_blocksize=self.nested_blocksize, **dict(zip(_STATE_BUFFERS, tensors[1:])))
            fields = {k: v for k, v in state.__dict__.items() if k != "data" and k not in _STATE_BUFFERS}
            cache = (tuple(None if t is None else weakref.ref(t) for t in tensors), None, fields)
        self.__dict__["_state_cache"] = (cache[0], weakref.ref(state), cache[2])
        return state

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.pop("_state_cache", None)   # weak references do not pickle
        state.pop("dequant_keep", None)   # a stage run's, never a copy's
        return state

    @property
    def quantized_numel(self) -> int:
        """How many weights the packed buffers stand for (out_features * in_features)."""
        return self.out_features * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None or x.dtype == self.compute_dtype:
            return quant_linear(x, self.quant_state, self.bias, self.dequant_keep)
        return quant_linear(x.to(self.compute_dtype), self.quant_state, self.bias, self.dequant_keep).to(x.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in dtype, through the attached keep (kept) or fresh."""
        return _weight(self.quant_state, dtype, self.dequant_keep)

    def dequantized_weights(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """What a forward on activations of `dtype` dequantizes (compute_dtype wins), through the keep."""
        return [self.dequantized(self.compute_dtype or dtype)]

    @classmethod
    def from_linear(cls, linear: nn.Linear, quant_type: str = "nf4", double_quant: bool = True,
                    compute_dtype: torch.dtype | None = None) -> "QuantLinear":
        """Quantizes a frozen nn.Linear's weight (bitwise as bitsandbytes' quantize_4bit); bias kept as is."""
        check_quant_type(quant_type)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QuantLinear.from_linear needs a torch.nn.Linear, got {type(linear).__name__}")
        if not linear.weight.is_floating_point():
            raise TypeError(f"{type(linear).__name__}.weight is {linear.weight.dtype}, already quantized; "
                            "use QuantLinear.from_bnb for a bitsandbytes Linear4bit")
        if linear.weight.requires_grad:
            raise ValueError(f"the weight of {linear!r} requires grad, but a quantized weight is frozen; "
                             "call linear.weight.requires_grad_(False) first (train it with LoRA instead)")
        state = quantize_4bit(linear.weight, quant_type, double_quant).to(linear.weight.device)
        return cls(state, linear.bias, compute_dtype)

    @classmethod
    def from_bnb(cls, module) -> "QuantLinear":
        """Takes a bitsandbytes Linear4bit's packed weight and statistics as they are (no dequantization)."""
        from .bnb import from_bnb

        return cls(from_bnb(module), module.bias, getattr(module, "compute_dtype", None))

    def extra_repr(self) -> str:
        double = self.nested_absmax is not None
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"quant_type={self.quant_type}, double_quant={double}, compute_dtype={self.compute_dtype}")

