"""Our Triton kernels inside a Hugging Face model: `patch_kernels(hf_model) -> int`.

Three kinds of module are patched, each instance on its own (the classes stay
untouched, so an unpatched model of the same class in the process is unaffected):

    RMSNorm     a module whose class name contains "RMSNorm", with a 1-D `weight`
                and a float `variance_epsilon` or `eps` (LlamaRMSNorm, Qwen2RMSNorm,
                Qwen3RMSNorm and its q_norm/k_norm, MistralRMSNorm, ...)
                -> roundpipe.kernels.rms_norm(x, weight, eps)
    SwiGLU MLP  `gate_proj`, `up_proj`, `down_proj` submodules and a SiLU `act_fn`
                -> down_proj(swiglu(gate_proj(x), up_proj(x)))
    attention   a forward that calls its modeling module's `apply_rotary_pos_emb`
                (rotate-half layout) -> roundpipe.kernels.apply_rope

A patch is an instance attribute `forward` (a method bound to the module), so
`copy.deepcopy` (roundpipe's per-worker replicas) rebinds it to the copy.  The
MLP calls its projection submodules rather than reading their weights, so PEFT's
LoRA wrappers of gate_proj/up_proj/down_proj keep working.  The attention's own
forward is reused: a copy of its function whose globals map
`apply_rotary_pos_emb` to ours (through functools.wraps decorators such as
transformers' deprecate_kwarg), so every other line of HF's attention, its cache
and attention interfaces included, runs as HF wrote it.

Semantics are checked before a module is patched, not assumed from a class name:
each candidate's own forward runs once on a tiny fp32 CPU probe (an RMSNorm with
a random weight, an MLP with 4-wide stand-in projections, the rotary function on
a [1, 2, 3, 8] q/k) and is patched only if it equals our reference.  So Gemma's
`x * (1 + weight)` norm, a GELU MLP, or a partial/interleaved rotary stays as it is.

Every patched forward decides per call: the kernel where it can run (CUDA
tensors; CPU tensors under TRITON_INTERPRET=1), the module's own forward
otherwise, and also for inputs outside the kernel's contract (mixed input and
weight dtypes, extra arguments, cos/sin that need gradients, hidden sizes past
65,536).  fp32 results equal HF's to rounding (tests/hf/test_hf_kernels.py, CPU,
Triton interpreter); in bf16 our RMSNorm rounds once where HF rounds the
normalised value before the weight product.  On CUDA the patched model is
unmeasured on GPU: the speed-up is the kernels' own (bench/kernels.py).
"""
from __future__ import annotations

import copy
import functools
import logging
import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe.core.checks import is_number
from roundpipe.kernels import apply_rope, can_run, rms_norm, swiglu
from roundpipe.kernels.rms_norm import MAX_HIDDEN, rms_norm_ref
from roundpipe.kernels.rope import apply_rope_ref

__all__ = ["patch_kernels", "unpatch_kernels"]

log = logging.getLogger(__name__)

_MARK = "_roundpipe_kernel"          # instance attribute: which patch a module carries
_ROPE_NAME = "apply_rotary_pos_emb"  # the global HF attention forwards call


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if is_number(value) and value > 0:
            return float(value)
    return None


def _probe_copy(module: nn.Module, **swap) -> nn.Module:
    """A shallow copy of `module` whose parameters/submodules named in `swap` are replaced (no weight is copied)."""
    probe = copy.copy(module)
    probe._parameters = dict(module._parameters)
    probe._modules = dict(module._modules)
    probe.__dict__.pop("forward", None)
    for name, value in swap.items():
        (probe._parameters if isinstance(value, nn.Parameter) else probe._modules)[name] = value
    return probe


def _same(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- RMSNorm -----------------------------------------------------------------------------------

def _is_rms_norm(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    if "rmsnorm" not in type(module).__name__.lower() or weight is None or weight.dim() != 1:
        return False
    eps = _eps(module)
    if eps is None:
        return False
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, generator=gen, dtype=torch.float32), torch.randn(3, 8, generator=gen, dtype=torch.float32)
    try:
        probe = _probe_copy(module, weight=nn.Parameter(w, requires_grad=False))
        with torch.no_grad():
            return _same(type(module).forward(probe, x), rms_norm_ref(x, w, eps))
    except Exception as exc:  # noqa: BLE001 - a forward that needs more than (x,) is not the RMSNorm we replace
        log.debug("not patching %s: its forward failed on the probe (%s)", type(module).__name__, exc)
        return False


def _rms_norm_forward(self, hidden_states, *args, **kwargs):
    weight = self.weight
    if (args or kwargs or not isinstance(hidden_states, torch.Tensor) or not can_run(hidden_states)
            or hidden_states.dtype != weight.dtype or hidden_states.shape[-1] > MAX_HIDDEN):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return rms_norm(hidden_states, weight, _eps(self))


# ---- SwiGLU MLP ----------------------------------------------------------------------------------

def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation") or act is F.silu


def _is_swiglu_mlp(module: nn.Module) -> bool:
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Module) for p in parts) or not _is_silu(getattr(module, "act_fn", None)):
        return False
    gen = torch.Generator().manual_seed(0)
    f32 = dict(generator=gen, dtype=torch.float32)
    stand_ins = {}
    for name, part, (n_in, n_out) in zip(("gate_proj", "up_proj", "down_proj"), parts, ((4, 6), (4, 6), (6, 4))):
        has_bias = isinstance(getattr(part, "bias", None), torch.Tensor)
        lin = nn.Linear(n_in, n_out, bias=has_bias, dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n_out, n_in, **f32))
            if has_bias:
                lin.bias.copy_(torch.randn(n_out, **f32))
        stand_ins[name] = lin
    x = torch.randn(2, 4, **f32)
    try:
        probe = _probe_copy(module, **stand_ins)
        with torch.no_grad():
            expect = stand_ins["down_proj"](F.silu(stand_ins["gate_proj"](x)) * stand_ins["up_proj"](x))
            return _same(type(module).forward(probe, x), expect)
    except Exception as exc:  # noqa: BLE001 - any failure means: not ours to patch
        log.debug("not patching %s: its forward failed on the probe (%s)", type(module).__name__, exc)
        return False


def _swiglu_forward(self, x, *args, **kwargs):
    if args or kwargs or not isinstance(x, torch.Tensor) or not can_run(x):
        return type(self).forward(self, x, *args, **kwargs)
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype or gate.shape != up.shape:
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(swiglu(gate, up))


# ---- rotary application inside attention ---------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _rope_replacement(original: Callable) -> Callable | None:
    """Our rotation with HF's apply_rotary_pos_emb signature, falling back to `original`; None if it differs."""
    gen = torch.Generator().manual_seed(0)
    f32 = dict(generator=gen, dtype=torch.float32)
    q, k = torch.randn(1, 2, 3, 8, **f32), torch.randn(1, 2, 3, 8, **f32)
    cos, sin = torch.randn(1, 3, 8, **f32), torch.randn(1, 3, 8, **f32)
    try:
        with torch.no_grad():
            got, expect = original(q, k, cos, sin), apply_rope_ref(q, k, cos, sin)
        if not (isinstance(got, tuple) and len(got) == 2 and all(_same(g, e) for g, e in zip(got, expect))):
            return None
    except Exception as exc:  # noqa: BLE001 - any failure means: not ours to patch
        log.debug("not patching %s: it failed on the probe (%s)", getattr(original, "__qualname__", original), exc)
        return None

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        tensors = (q, k, cos, sin)
        plain_call = not args and set(kwargs) <= {"unsqueeze_dim"} and kwargs.get("unsqueeze_dim", 1) == 1
        if (not plain_call or not all(isinstance(t, torch.Tensor) for t in tensors)
                or not can_run(q) or q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype
                or cos.requires_grad or sin.requires_grad or cos.shape != sin.shape or cos.dim() not in (2, 3)
                or cos.shape[-2:] != q.shape[-2:] or q.shape[-1] % 2
                or (q.shape[0], q.shape[2:]) != (k.shape[0], k.shape[2:])
                or (cos.dim() == 3 and cos.shape[0] not in (1, q.shape[0]))):
            return original(q, k, cos, sin, *args, **kwargs)
        return apply_rope(q, k, cos, sin)

    apply_rotary_pos_emb.__qualname__ = f"roundpipe.hf.kernels.rope[{getattr(original, '__module__', '?')}]"
    return apply_rotary_pos_emb


def _copy_function(fn: types.FunctionType, globals_: dict, closure) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    return new


def _with_global(fn, name: str, value) -> types.FunctionType | None:
    """A copy of `fn` that sees `value` as its global `name`, rebuilt through functools.wraps wrappers.

    The function that reads the global gets a snapshot of its module's globals
    with that one name replaced; each wrapper above it is copied with the
    closure cell that held the wrapped function pointing at the copy.  None when
    no function in the chain reads `name` or a wrapper reaches its inner function
    some other way.
    """
    if not isinstance(fn, types.FunctionType):
        return None
    if name in fn.__code__.co_names:
        globals_ = dict(fn.__globals__)
        globals_[name] = value
        return _copy_function(fn, globals_, fn.__closure__)
    inner = getattr(fn, "__wrapped__", None)
    new_inner = _with_global(inner, name, value) if inner is not None else None
    if new_inner is None or not fn.__closure__:
        return None
    cells, replaced = [], False
    for cell in fn.__closure__:
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            held = None
        if held is inner:
            cells.append(types.CellType(new_inner))
            replaced = True
        else:
            cells.append(cell)
    if not replaced:
        return None
    new = _copy_function(fn, fn.__globals__, tuple(cells))
    new.__wrapped__ = new_inner
    return new


@functools.lru_cache(maxsize=None)
def _attention_forward(cls: type) -> types.FunctionType | None:
    """cls.forward with our rotation in place of its module's apply_rotary_pos_emb, or None."""
    forward = cls.__dict__.get("forward") or getattr(cls, "forward", None)
    target = forward
    while isinstance(target, types.FunctionType) and _ROPE_NAME not in target.__code__.co_names:
        target = getattr(target, "__wrapped__", None)
    if not isinstance(target, types.FunctionType):
        return None
    original = target.__globals__.get(_ROPE_NAME)
    if not isinstance(original, types.FunctionType):
        return None
    replacement = _rope_replacement(original)
    return _with_global(forward, _ROPE_NAME, replacement) if replacement is not None else None


# ---- the entry points ----------------------------------------------------------------------------

def _wants_cuda(hf_model: nn.Module, devices) -> bool:
    if devices is None:
        return torch.cuda.is_available() or any(p.device.type == "cuda" for p in hf_model.parameters())
    from roundpipe.workers import parse_devices

    return any(d.type == "cuda" for d in parse_devices(devices))


def patch_kernels(hf_model: nn.Module, devices=None, *, force: bool = False) -> int:
    """Makes the HF model's RMSNorms, SwiGLU MLPs and rotary attention run our Triton kernels; returns the count.

    devices: where the model will run (roundpipe's workers), as `rp.RoundPipe`
    takes them; None means every visible GPU, or the CPU when there is none.
    Without a CUDA device among them nothing is patched and 0 is returned,
    unless `force=True` (tests: the patched forwards then run the kernels under
    TRITON_INTERPRET=1 on CPU tensors, and the module's own forward where
    kernels cannot run).  Modules patched before are skipped (not counted
    again); `unpatch_kernels` undoes it.
    """
    if not isinstance(hf_model, nn.Module):
        raise TypeError(f"hf_model must be a torch.nn.Module (a transformers model), got {type(hf_model).__name__}")
    if not isinstance(force, bool):
        raise TypeError(f"force={force!r} must be a bool")
    if not force and not _wants_cuda(hf_model, devices):
        return 0
    patched = 0
    for module in hf_model.modules():
        if getattr(module, _MARK, None) is not None or "forward" in module.__dict__:
            continue   # patched already, by us or by someone else
        if _is_rms_norm(module):
            kind, forward = "rms_norm", _rms_norm_forward
        elif _is_swiglu_mlp(module):
            kind, forward = "swiglu", _swiglu_forward
        else:
            forward = _attention_forward(type(module))
            kind = "rope" if forward is not None else None
        if kind is None:
            continue
        module.forward = types.MethodType(forward, module)
        setattr(module, _MARK, kind)
        patched += 1
    return patched


def unpatch_kernels(hf_model: nn.Module) -> int:
    """Removes the patches `patch_kernels` made (the modules' own forwards run again); returns how many."""
    if not isinstance(hf_model, nn.Module):
        raise TypeError(f"hf_model must be a torch.nn.Module (a transformers model), got {type(hf_model).__name__}")
    removed = 0
    for module in hf_model.modules():
        if getattr(module, _MARK, None) is not None:
            module.__dict__.pop("forward", None)
            delattr(module, _MARK)
            removed += 1
    return removed
