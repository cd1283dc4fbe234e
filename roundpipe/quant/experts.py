"""QuantExperts: fused MoE expert tensors stored 4-bit per expert, dequantized on the device that runs them.

transformers 5 stores a MoE layer's experts as fused 3-D parameters of one module
(Qwen3-MoE, Mixtral, ...: `Qwen3MoeExperts.gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) whose forward indexes them per expert.  Each expert's matrix is
quantized on its own, bitwise what `bitsandbytes.functional.quantize_4bit` gives
for that 2-D matrix (one Quant4State per expert: its own absmax blocks and, double-
quantized, its own offset and nested blocks, which a state over the flattened
3-D tensor would share across experts), and the E states are stacked row-wise
into the buffers of one constant tensor per field:

    <name>                 uint8 [E, ceil(n / 2)]   n = one expert's numel
    <name>_absmax          fp32 [E, blocks] | uint8 [E, blocks] (double-quantized)
    <name>_nested_absmax   fp32 [E, ceil(blocks / 256)]       (double-quantized)
    <name>_nested_code     fp32 [256]  (bitsandbytes' dynamic map, the same for every expert)
    <name>_offset          fp32 [E]

`QuantExperts` replaces the experts module and keeps it, without its quantized
parameters, as `base`.  Its forward dequantizes each tensor whole ([E, ...] in the
activations' dtype), sets it as a plain instance attribute of `base` for the call
(no parametrization: `base.gate_up_proj` then finds the tensor in its __dict__) and
runs `base` itself, so transformers' experts forward (eager, grouped_mm or batched_mm,
as the config says) computes exactly what it computes over those weights.  Every
expert is dequantized, not only the routed ones: routing is data on the device.

Dequantizing whole tensors.  When an expert's numel is a multiple of the block size
(every real model: 64 divides the widths) expert e's blocks are rows e*blocks ..
of the flattened tensor, so one state over [E * rows, cols] with each expert's fp32
absmax (double quantization undone per expert with the reference's fp32 operations)
dequantizes all E at once, bitwise equal to E separate dequantizations (a test
compares); otherwise each expert is dequantized alone.

Memory.  transformers' forward saves the dequantized weight for the input gradient
(F.linear saves its weight), so outside the engine a layer holds its experts in
the compute dtype from forward to backward; inside a stage run the engine's
`DequantKeep` (roundpipe/quant/keep.py) holds them once for the whole stage anyway.
"""
from __future__ import annotations

import torch
from torch import nn

from .format import Quant4State, check_quant_type
from .functional import dequantize
from .keep import DequantKeep
from .reference import quantize_4bit

_FIELDS = ("data", "absmax", "nested_absmax", "nested_code", "offset")
_SUFFIX = {"data": "", "absmax": "_absmax", "nested_absmax": "_nested_absmax", "nested_code": "_nested_code",
           "offset": "_offset"}


def fused_expert_weights(module: nn.Module) -> list[str]:
    """Names of a module's own frozen floating 3-D parameters (fused expert tensors [E, ., .])."""
    return [n for n, p in module.named_parameters(recurse=False)
            if p.dim() == 3 and p.is_floating_point() and not p.requires_grad]


def quantize_experts(w: torch.Tensor, quant_type: str = "nf4", double_quant: bool = True) -> list[Quant4State]:
    """One Quant4State per expert matrix w[e] (bitwise bitsandbytes' quantize_4bit of that 2-D matrix)."""
    check_quant_type(quant_type)
    if w.dim() != 3:
        raise ValueError(f"w.shape={tuple(w.shape)} is not a fused expert tensor [experts, rows, cols]")
    return [quantize_4bit(w[e], quant_type, double_quant) for e in range(w.shape[0])]


def stack_states(states: list[Quant4State]) -> dict[str, torch.Tensor]:
    """The per-expert states' tensors stacked by field (the module docstring's layout)."""
    out = {f: torch.stack([getattr(s, f) for s in states]) for f in _FIELDS if getattr(states[0], f) is not None}
    if "nested_code" in out:
        if not all(torch.equal(s.nested_code, states[0].nested_code) for s in states):
            raise ValueError("the experts' nested codes differ; stacked experts share one")
        out["nested_code"] = states[0].nested_code
    return out


class QuantExperts(nn.Module):
    """A fused MoE experts module with its frozen 3-D weights stored 4-bit per expert (the module docstring)."""

    dequant_keep: DequantKeep | None = None   # the stage run's, while the engine has one attached

    def __init__(self, base: nn.Module, quant_type: str = "nf4", double_quant: bool = True,
                 names: list[str] | None = None):
        super().__init__()
        check_quant_type(quant_type)
        names = fused_expert_weights(base) if names is None else list(names)
        if not names:
            raise ValueError(f"{type(base).__name__} has no frozen 3-D expert weight to quantize")
        self.quant_type, self.quantized = quant_type, tuple(names)
        self.shapes: dict[str, torch.Size] = {}
        self.weight_dtypes: dict[str, torch.dtype] = {}
        for name in names:
            w = base._parameters.get(name)
            if w is None or w.dim() != 3 or w.requires_grad:
                raise ValueError(f"{type(base).__name__}.{name} is not a frozen 3-D parameter")
            self.shapes[name], self.weight_dtypes[name] = w.shape, w.dtype
            for field, t in stack_states(quantize_experts(w, quant_type, double_quant)).items():
                self.register_buffer(name + _SUFFIX[field], t.to(w.device))
            del base._parameters[name]
        self.base = base
        self.blocksize = 64
        self.constant_buffers = frozenset(self._buffers)   # all of them: never written by a forward

    @property
    def quantized_numel(self) -> int:
        """How many expert weights the packed buffers stand for."""
        return sum(s.numel() for s in self.shapes.values())

    def expert_state(self, name: str, e: int) -> Quant4State:
        """Expert e's Quant4State of tensor `name` (views of the current buffers)."""
        bufs = {f: self._buffers.get(name + _SUFFIX[f]) for f in _FIELDS}
        row = {f: (t if f == "nested_code" else t[e]) for f, t in bufs.items() if t is not None}
        return Quant4State(shape=self.shapes[name][1:], dtype=self.weight_dtypes[name], quant_type=self.quant_type,
                           blocksize=self.blocksize, **row)

    def _dequantize(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        shape = self.shapes[name]
        experts, per = shape[0], shape[1:].numel()
        if per % self.blocksize:
            return torch.stack([dequantize(self.expert_state(name, e), dtype) for e in range(experts)])
        absmax = self._absmax(name)
        flat = Quant4State(data=self._buffers[name].reshape(-1), shape=(experts * shape[1], shape[2]),
                           dtype=self.weight_dtypes[name], quant_type=self.quant_type, blocksize=self.blocksize,
                           absmax=absmax.reshape(-1))
        return dequantize(flat, dtype).view(shape)

    def _absmax(self, name: str) -> torch.Tensor:
        """fp32 absmax [E, blocks], double quantization undone per expert with absmax_ref's fp32 operations."""
        q = self._buffers[name + "_absmax"]
        if self._buffers.get(name + "_offset") is None:
            return q
        nested = self._buffers[name + "_nested_absmax"]
        per_block = torch.arange(q.shape[1], device=q.device) // 256
        return (self._buffers[name + "_nested_code"][q.long()] * nested[:, per_block]
                + self._buffers[name + "_offset"].view(-1, 1))

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` [E, ...] in dtype: through the attached keep (once per stage run) or fresh."""
        keep = self.dequant_keep
        if keep is None:
            return self._dequantize(name, dtype)
        return keep.get((id(self._buffers[name]), dtype), lambda: self._dequantize(name, dtype))

    def dequantized_weights(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """What a forward on activations of `dtype` dequantizes, through the keep."""
        return [self.dequantized(name, dtype) for name in self.quantized]

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        base = self.base
        weights = {name: self.dequantized(name, hidden_states.dtype) for name in self.quantized}
        base.__dict__.update(weights)   # found before nn.Module.__getattr__; the parameters were removed
        try:
            return base(hidden_states, *args, **kwargs)
        finally:
            for name in weights:
                base.__dict__.pop(name, None)

    def __getstate__(self):
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state.pop("dequant_keep", None)   # a stage run's, never a copy's
        return state

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={tuple(s)}" for n, s in self.shapes.items())
        return f"{shapes}, quant_type={self.quant_type}, double_quant={self._buffers.get(self.quantized[0] + '_offset') is not None}"
