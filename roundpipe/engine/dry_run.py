"""The dry run: per-layer `LayerCost`s from one forward of the first microbatch, before anything is timed.

`dry_run_costs` runs copies of the layers on the meta device (shapes only, what GPU workers do) or
on the CPU (CPU workers), and counts per layer:

    FLOPs         aten matmuls and convolutions (`FlopCount`), at `RATES`' FLOP/s, plus the
                  weights, input and output at its bytes/s: the forward time; backward BWD_PER_FWD x
    param_bytes   weights in the compute dtype (4-bit layers: packed buffers + the dequantized copy
                  a stage run keeps, roundpipe/quant/keep.py)
    act_bytes     what autograd saves (saved-tensor hooks), attention counted as the fused kernel
                  keeps it (`fused_attention_bytes`), never the math backend's [B, heads, T, T] scores
    memory        the layer's LayerMemory (roundpipe/engine/memory_probe.py), with the loss's
                  workspace on the last layer when a training call's loss is given

The engine's planning policy (roundpipe/engine/autoplan.py `size_costs`) chooses where it runs; the
long-context fit (roundpipe/hf/context.py) calls it directly with GPU rates on the meta device.

Each distinct layer is measured once.  A decoder's layers are nearly all alike, so a layer whose
`layer_key` (classes, parameters, buffers and settings of every submodule) and `input_key` (the
input's structure) match an earlier layer's takes that LayerCost; it still runs one forward with
autograd on but no counting mode, so the layers after it get its real output (on the CPU the values,
which a later layer that routes by value needs) and an outer mode sees its ops (hf/context.py counts
attention calls per layer).  On the CPU a layer that read tensor values into Python (FlopCount's
`reads_values`, `_HostReads`) may cost otherwise on other values: it is measured every time.
Measured on a shared 2-core CPU: 38 layers of a 36-decoder Qwen3-1.7B shape on the meta device,
2,048 tokens, 9.2 s before, 1.9 s with it (medians of 3; a measured decoder ~0.14 s, a forward
~0.045 s: Python meta kernels); a 12-decoder Llama of hidden size 256 on the CPU in bf16, 4 x 256
tokens, 71 s to 20 s (one run each).
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe.core.tree import tree_leaves, tree_map
from roundpipe.engine.calls.compute import writable
from roundpipe.engine.memory_probe import measure_layer, measure_loss
from roundpipe.planner import LayerCost
from roundpipe.planner.costs import BWD_PER_FWD
from roundpipe.quant.keep import DequantKeep, attach, keeping

# Rough device rates (FLOP/s, bytes/s) per device type.  Only their ratio matters: once anything is
# measured the profiler rescales unmeasured layers by the measured ratio.
RATES = {"cuda": (100e12, 1e12), "cpu": (50e9, 10e9)}


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _matmul(a: torch.Tensor, b: torch.Tensor) -> int:
    """a [m, k] @ b [k, n] or a [B, m, k] @ b [B, k, n]: 2 m k n (per batch entry)."""
    return 2 * a.numel() * b.shape[-1]


def _conv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool) -> int:
    """2 x batch x (output positions, input ones when transposed) x weight elements."""
    return 2 * x.shape[0] * math.prod((x if transposed else out).shape[2:]) * w.numel()


def _flop_formulas() -> dict[Any, Callable[[tuple, Any], int]]:
    """aten overload packet -> FLOPs(args, out): torch.utils.flop_counter's formulas for the forward
    ops a dry run reaches (attention runs as math there: bmm).  Not that module itself: importing it
    imports Triton when installed, 0.45 s on a 2-core CPU, as much as the first call's budget."""
    aten = torch.ops.aten
    conv = lambda args, out: _conv(args[0], args[1], out, bool(args[6]))
    return {aten.mm: lambda args, out: _matmul(args[0], args[1]),
            aten.addmm: lambda args, out: _matmul(args[1], args[2]),
            aten.bmm: lambda args, out: _matmul(args[0], args[1]),
            aten.baddbmm: lambda args, out: _matmul(args[1], args[2]),
            aten._scaled_mm: lambda args, out: _matmul(args[0], args[1]),
            aten.convolution: conv, aten._convolution: conv, aten.convolution_overrideable: conv}


class FlopCount(TorchDispatchMode):
    """Sums the FLOPs of the aten ops run under it (`_flop_formulas`), decomposing an op without a
    formula as torch.utils.flop_counter.FlopCounterMode does.

    Why not FlopCounterMode itself: besides the Triton import, torch wraps every dispatch mode's
    __torch_dispatch__ in torch._disable_dynamo, whose first call imports torch._dynamo and sympy
    (1-3 s on a 2-core CPU, see `size_costs`).  This mode is never compiled, so it opts out of that
    wrapper (`_should_skip_dynamo`, read when the class is created by the torch versions that wrap).
    tests/engine/test_autoplan.py checks its counts against FlopCounterMode's, tests/engine/test_first_call.py that
    a first call imports neither torch._dynamo nor Triton.
    """

    _formulas: dict[Any, Callable[[tuple, Any], int]] | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    _READS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)   # item, bool, nonzero, unique, ...

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.reads_values = False   # an op ran whose result or output shape depends on tensor values
        if FlopCount._formulas is None:
            FlopCount._formulas = _flop_formulas()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.reads_values and any(tag in self._READS for tag in func.tags):
            self.reads_values = True
        if func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        formula = self._formulas.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(args, out)
        return out


def fused_attention_bytes(args: tuple, kwargs: dict, out: torch.Tensor) -> int:
    """What a fused attention kernel (flash or memory-efficient on GPUs, the flash kernel for CPU on
    CPU workers) saves for the backward of `F.scaled_dot_product_attention(*args, **kwargs) -> out`:
    q, k, v, the output and an fp32 log-sum-exp per query row; 0 when autograd records nothing."""
    q, k, v = (args[i] if i < len(args) else kwargs[name] for i, name in enumerate(("query", "key", "value")))
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return 0
    rows = q.numel() // q.shape[-1]   # one log-sum-exp per (batch, head, query)
    return sum(t.numel() * t.element_size() for t in (q, k, v, out)) + rows * 4


class _FusedAttentionBytes(TorchFunctionMode):
    """In the dry run, `F.scaled_dot_product_attention` runs as math (FLOPs counted, the only backend
    the meta device has) but its saved bytes are `fused_attention_bytes`, what the fused kernel a
    worker runs keeps, never the [B, heads, T, T] scores the math backend keeps.  Counted as math,
    one tiny-decoder layer at 4 x 1,024 tokens came to 177 MiB against 51 MiB."""

    def __init__(self, saved: list[int]):
        super().__init__()
        self.saved, self.counting = saved, True   # counting: the saved-tensor hook counts (off inside SDPA)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.counting = False
        try:
            out = func(*args, **kwargs)
        finally:
            self.counting = True
        self.saved[0] += fused_attention_bytes(args, kwargs, out)
        return out


def _returns_tensors(func: Any) -> bool:
    return any(str(r.type).startswith(("Tensor", "Optional[Tensor]", "List[Tensor]")) for r in func._schema.returns)


class SmallDataOnCpu(TorchDispatchMode):
    """The meta-device dry run with the sample's integer and boolean tensors kept real, on the CPU.

    A layer may branch on its inputs' values: transformers' mask builders ask whether an
    attention mask pads anything (`.all()`, then `.item()`), a MoE router counts tokens per
    expert.  On the meta device that is "Tensor.item() cannot be called on meta tensors", and the
    planner fell back to parameter counts (tests/hf/test_hf_meta_dry_run.py).  Under this mode an op
    whose tensor inputs all lie on the CPU runs there for real while its outputs stay small
    (`LIMIT` bytes: masks [batch, seq], positions, counts); a larger output ([batch, 1, T, T]
    causal masks) is kept as its meta shape, and an op with any meta input runs on the meta
    device, its CPU inputs moved there.  Entered below the dry run's counting modes, so they see
    every op as the layer made it; CPU tensors are not counted (a few bytes per token)."""

    LIMIT = 1 << 22

    @classmethod
    def _should_skip_dynamo(cls) -> bool:   # as FlopCount: no torch._dynamo import
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) and not v.is_meta else v
        if not tensors or any(t.is_meta for t in tensors):
            if not tensors:
                return func(*args, **kwargs)
            return func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        if not _returns_tensors(func):   # .item(), sizes, devices: the real answer
            return func(*args, **kwargs)
        try:
            shaped = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except (RuntimeError, NotImplementedError):   # a data-dependent shape (nonzero): small inputs, run it
            return func(*args, **kwargs)
        produced = [t for t in tree_leaves(shaped) if isinstance(t, torch.Tensor)]
        if sum(t.numel() * t.element_size() for t in produced) > self.LIMIT:
            return shaped
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            if any(t.is_floating_point() for t in produced):   # weights and activations go to the meta device
                return shaped
            kwargs = dict(kwargs, device="cpu")   # `mask.to(embeds.device)`: the values stay
        return func(*args, **kwargs)


# Layer fingerprints: which layers of one dry run may share a measurement.
#
# Every nn.Module keeps its parameters, buffers, children, hooks and training flag in these __dict__
# slots; the fingerprint reads those through the public accessors, and every other attribute is the
# module's own setting (HF: attention_type, layer_type, sliding_window, head_dim, scaling, ...).
_MODULE_SLOTS = frozenset(vars(nn.Module()))
_CALL_HOOKS = tuple(sorted(k for k in _MODULE_SLOTS if k.startswith(("_forward", "_backward")) and "hook" in k))
# transformers' model families whose modules read `layer_idx` only to index the KV cache (`cache.update(...,
# self.layer_idx)`; modeling_<family>.py, transformers 5.24), which no dry run or training call passes: their
# layers may differ in it.  Settings derived from it (layer_type, sliding_window, is_sliding, a dense MLP in
# place of the experts) are attributes or submodules of their own and keep the layers apart.  Elsewhere
# layer_idx may change the computation (gpt2 and imagegpt scale attention by it, dory looks up shared KV
# states with it), so it is compared like any other attribute.
_LAYER_IDX_INDEXES_CACHE = frozenset(f"transformers.models.{f}.modeling_{f}" for f in (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma", "gemma2", "gemma3"))
# peft's LoRA layers keep their construction arguments as `kwargs` (naming the target module, so every
# layer's differ); peft 0.21 never reads them back (tuners/lora/layer.py).
_LORA = "peft.tuners.lora."
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum)


class _NoKey(Exception):
    """Something in a layer or its input that the fingerprint cannot compare: measure the layer."""


_PLAIN_SIZE = type("_Plain", (), {}).__basicsize__   # an instance of a Python class: no field but its dict


def _state_in_dict(cls: type) -> bool:
    """Whether an instance of cls keeps all its state in its __dict__: no C fields (functools.partial, functions
    and other C types, or Python classes over them, are larger) and no __slots__ in its MRO; nn.Modules and
    tensors are compared otherwise."""
    return (cls.__basicsize__ == _PLAIN_SIZE and not issubclass(cls, (nn.Module, torch.Tensor))
            and not any("__slots__" in vars(b) for b in cls.__mro__))


def _value_key(v: Any, depth: int = 0) -> Hashable:
    """Plain values and nests of them by value (with their types: 1, 1.0 and True differ); an instance of a
    Python class that keeps its state in its __dict__ by its class and that state (diffusers gives every
    attention block an attention processor of its own, equal to the others: keyed by identity, no two blocks
    shared a measurement); anything else (functions, tensors kept as plain attributes, C objects) only as the
    same object (its id; the layers keep it alive for the dry run)."""
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if depth < 8:
        if isinstance(v, (tuple, list)):
            return (type(v), tuple(_value_key(o, depth + 1) for o in v))
        if isinstance(v, dict):
            return (type(v), tuple((_value_key(k, depth + 1), _value_key(o, depth + 1)) for k, o in v.items()))
        if isinstance(v, (set, frozenset)):
            return (type(v), frozenset(_value_key(o, depth + 1) for o in v))
        if _state_in_dict(type(v)) and hasattr(v, "__dict__"):
            return (type(v), _value_key(vars(v), depth + 1))
    return (object, id(v))


def layer_key(layer: nn.Module) -> Hashable | None:
    """What decides a layer's measurement besides its input: per submodule in order, its name, class and
    training flag, its own parameters (name, shape, dtype, device, requires_grad, class) and buffers, and
    every other attribute (`_value_key`; skipped: `layer_idx` where it only indexes the KV cache, and LoRA's
    record of its construction arguments).  None (measure it) for 4-bit layers (roundpipe.quant) and
    layers with forward or backward hooks."""
    if keeping(layer.modules()):
        return None
    entries = []
    for name, m in layer.named_modules():
        state = vars(m)
        if any(state.get(k) for k in _CALL_HOOKS):
            return None
        where = type(m).__module__
        skip = "layer_idx" if where in _LAYER_IDX_INDEXES_CACHE else "kwargs" if where.startswith(_LORA) else None
        entries.append((name, type(m), m.training,
                        tuple((n, tuple(p.shape), p.dtype, p.device.type, p.requires_grad, type(p))
                              for n, p in m.named_parameters(recurse=False)),
                        tuple((n, tuple(b.shape), b.dtype, b.device.type, type(b)) for n, b in m.named_buffers(recurse=False)),
                        tuple((k, _value_key(v)) for k, v in state.items() if k not in _MODULE_SLOTS and k != skip)))
    key = tuple(entries)
    try:
        hash(key)
    except TypeError:   # an enum or a value type whose hash fails
        return None
    return key


def input_key(x: Any, device: str) -> tuple[Hashable, list[torch.Tensor]] | None:
    """The structure of a layer's input: its nest (types, dict keys, non-tensor leaves by `_value_key`) and
    per tensor its shape, strides, offset, dtype, device, requires_grad and which earlier leaf shares its
    storage.  Tensors whose values a dry run can branch on are returned beside it, to be compared by value:
    on the meta device the real (CPU) ones, token ids and masks (SmallDataOnCpu); on the CPU the
    non-floating ones.  None when a leaf is a tensor subclass or not strided."""
    reals: list[torch.Tensor] = []
    storages: list[Any] = []

    def key(v: Any) -> Hashable:
        if isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor or v.layout != torch.strided:
                raise _NoKey
            s = v.untyped_storage()   # the same Python object for every view of one storage
            alias = next((j for j, o in enumerate(storages) if o is s), len(storages))
            if alias == len(storages):
                storages.append(s)
            real = -1
            if (not v.is_meta) if device == "meta" else not v.is_floating_point():
                real = len(reals)
                reals.append(v)
            return (torch.Tensor, tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, v.requires_grad,
                    alias, real)
        if isinstance(v, (tuple, list)):
            return (type(v), tuple(key(o) for o in v))
        if isinstance(v, dict):
            return (type(v), tuple((_value_key(k), key(o)) for k, o in v.items()))
        return _value_key(v)
    try:
        structure = key(x)
        hash(structure)
    except (_NoKey, TypeError):
        return None
    return structure, reals


class _HostReads(TorchFunctionMode):
    """Sees a layer read tensor values into Python where no aten op shows it (`tolist`, `numpy`); FlopCount
    sees the rest (`item`, `bool`, `nonzero`, ...) by their aten tags."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__):
            self.seen = True
        return func(*args, **(kwargs or {}))


class _Measured:
    """The costs measured so far in one dry run, by (layer_key, input_key); an input's real tensors are
    compared by value."""

    def __init__(self, device: str):
        self.device = device
        self.costs: dict[Hashable, list[tuple[list[torch.Tensor], LayerCost]]] = {}

    def key(self, layer: nn.Module, x: Any) -> tuple[Hashable, list[torch.Tensor]] | None:
        lk = layer_key(layer)
        ik = input_key(x, self.device) if lk is not None else None
        return None if ik is None else ((lk, ik[0]), ik[1])

    def find(self, key: tuple[Hashable, list[torch.Tensor]]) -> LayerCost | None:
        structure, reals = key
        for seen, cost in self.costs.get(structure, ()):
            if all(a is b or torch.equal(a, b) for a, b in zip(seen, reals)):
                return cost
        return None

    def add(self, key: tuple[Hashable, list[torch.Tensor]], cost: LayerCost) -> None:
        self.costs.setdefault(key[0], []).append((key[1], cost))


def dry_run_costs(layers: Sequence[nn.Module], sample: tuple[tuple, dict], dtype: torch.dtype,
                  rates: tuple[float, float], device: str, loss: tuple[Callable, Any] | None = None,
                  reuse: bool = True) -> list[LayerCost]:
    """Size-based costs from one forward of the first microbatch through copies of the layers.

    sample: (args, kwargs) of the first layer's call; dtype: the compute dtype floating tensors and
    weights are cast to; rates: (FLOP/s, bytes/s), e.g. RATES["cuda"]; device: "meta" (shapes only)
    or "cpu" (the caller restores the RNG and picks the math attention backend, autoplan
    `size_costs`); loss: (loss_fn, labels) of a training call, measured on the last layer; reuse: a
    layer identical to one measured before (`layer_key`) on an input of identical structure
    (`input_key`) takes that measurement and only runs its forward (False: every layer is measured)."""
    if not isinstance(reuse, bool):
        raise TypeError(f"reuse must be True or False, got {reuse!r}")
    if device != "meta":
        return _dry_run(layers, sample, dtype, rates, device, loss, reuse)
    with SmallDataOnCpu():   # token ids and masks keep their values: data-dependent branches can run
        return _dry_run(layers, sample, dtype, rates, device, loss, reuse)


def _replica(layer: nn.Module, device: str, dtype: torch.dtype) -> nn.Module:
    """A copy of the layer with its weights in the compute dtype on `device` (buffers keep their dtype)."""
    memo = {id(p): nn.Parameter(p.detach().to(device, dtype, copy=True), p.requires_grad)
            for p in layer.parameters()}
    memo.update({id(b): b.detach().to(device, copy=True) for b in layer.buffers()})
    return copy.deepcopy(layer, memo)


def _discard(_: Any) -> None:
    return None


def _dry_run(layers: Sequence[nn.Module], sample: tuple[tuple, dict], dtype: torch.dtype,
             rates: tuple[float, float], device: str, loss: tuple[Callable, Any] | None,
             reuse: bool) -> list[LayerCost]:
    def to_device(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if device == "meta" and not t.is_floating_point():   # ids, masks: real values (SmallDataOnCpu) ...
            if t.is_meta or t.numel() * t.element_size() > SmallDataOnCpu.LIMIT:   # ... unless too large to keep
                return torch.empty_like(t, device="meta")   # (int64 ids past 512K tokens): their shape only
            return t.detach().to("cpu", copy=True)
        copied = t.detach().to(device, dtype if t.is_floating_point() else t.dtype, copy=True)
        return copied.requires_grad_(t.requires_grad and copied.is_floating_point())
    x = tree_map(to_device, sample)
    measured = _Measured(device) if reuse else None
    out: list[LayerCost] = []
    for i, layer in enumerate(layers):
        replica = _replica(layer, device, dtype)
        if i > 0:
            x = tree_map(lambda t: t.detach().requires_grad_(True)
                         if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)
        # The first layer is called as (args, kwargs) with the model's input: never shared.
        key = measured.key(layer, x) if measured is not None and i > 0 else None
        cost = measured.find(key) if key is not None else None
        if cost is not None:   # its output, for the layers after it, from a forward without the counting modes
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_discard, _discard):
                x = replica(writable(x))
        else:
            cost, x, reads_values = _measure(replica, x, i == 0, dtype, device, rates)
            # On the CPU a layer that read values into Python (MoE routing, a mask's .all()) may cost
            # otherwise on another input: such a layer is measured every time.
            if key is not None and not (reads_values and device != "meta"):
                measured.add(key, cost)
        if i == len(layers) - 1 and loss is not None and loss[0] is not None:   # labels as sent: never cast
            labels = tree_map(lambda t: t.detach().to(device) if isinstance(t, torch.Tensor) else t, loss[1])
            cost = dataclasses.replace(cost, memory=dataclasses.replace(
                cost.memory, loss=measure_loss(loss[0], x, labels, device)))
        out.append(cost)
    return out


def _measure(replica: nn.Module, x: Any, first: bool, dtype: torch.dtype, device: str,
             rates: tuple[float, float]) -> tuple[LayerCost, Any, bool]:
    """One layer's LayerCost (its replica run on x), its output and whether it read tensor values into Python."""
    params = {id(p) for p in replica.parameters()}
    # 4-bit weights (roundpipe.quant): a stage run keeps each dequantized in the compute dtype for its
    # whole duration (roundpipe/quant/keep.py), beside the packed constant buffers it uploaded, so both
    # are the layer's weight bytes.  Dequantized here, before the measured runs, into a keep those runs
    # reuse: the measurement then sees no dequantization transient (it would count a second time, as
    # workspace), and saved tensors that are views of a kept weight are not activations.
    quantized, keep = keeping(replica.modules()), DequantKeep()
    attach(quantized, keep)
    kept = {id(w.untyped_storage()) for m in quantized for w in m.dequantized_weights(dtype)}
    quant_bytes = keep.nbytes + sum(b.numel() * b.element_size() for m in quantized
                                    for n, b in m.named_buffers(recurse=False) if n in m.constant_buffers)
    saved = [0]
    attention = _FusedAttentionBytes(saved)

    def pack(t: torch.Tensor) -> None:
        # Counts and keeps nothing (no backward runs here): packing t itself would close a
        # cycle through the autograd graph (an op saving its own output) that Python's gc
        # cannot see, and every layer copy would outlive the dry run (0.84 B/param of
        # bf16 weights for the 200M decoder).
        if attention.counting and id(t) not in params and not (kept and id(t.untyped_storage()) in kept):
            saved[0] += t.numel() * t.element_size()
    in_bytes = _nbytes(x)

    def call(v: Any) -> Any:   # input leaves writable in place (ReLU(inplace=True)), as in a stage: compute.py
        v = writable(v)
        return replica(*v[0], **v[1]) if first else replica(v)
    memory = measure_layer(replica, call, x, device, first=first)
    if dtype == torch.float32:   # an fp32 .grad is the accumulator itself (StageRun._backward)
        memory = dataclasses.replace(memory, param_grads=0)
    counter, reads = FlopCount(), _HostReads()
    with counter, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None), attention, reads:
        x = call(x)
    out_bytes = _nbytes(x)
    param_bytes = sum(p.numel() for p in replica.parameters()) * dtype.itemsize + quant_bytes
    attach(quantized, None)
    trainable = sum(p.numel() for p in replica.parameters() if p.requires_grad)
    flop_rate, byte_rate = rates
    fwd = counter.flops / flop_rate + (param_bytes + in_bytes + out_bytes) / byte_rate
    # fp32 gradient accumulators (a low-precision microbatch's .grad is in memory.param_grads)
    cost = LayerCost(fwd, BWD_PER_FWD * fwd, param_bytes, max(saved[0], out_bytes), trainable * 4, memory)
    return cost, x, counter.reads_values or reads.seen
