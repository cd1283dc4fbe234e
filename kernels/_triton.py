"""Whether the Triton kernels can run, decided once; the only module that knows.

Triton kernels run when Triton imports and either a CUDA device is present
(compiled kernels on CUDA tensors) or TRITON_INTERPRET=1 is set (the CPU
interpreter on CPU tensors; tests use it).  Otherwise every functional form
takes its fp32 PyTorch reference path and `use_triton()` warns once with the
reason.  The CUDA query is deferred to the first call: importing
roundpipe.kernels never touches a GPU.

Op modules import `triton`, `tl` and `jit` from here.  Without Triton these
are stand-ins: `jit` returns the function unchanged (it is never launched) and
`tl.constexpr` exists so that kernel signatures still evaluate.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
import warnings

import torch

from roundpipe.core.checks import is_int

try:
    import triton
    import triton.language as tl

    _import_error: str | None = None
except ImportError as exc:  # the fallback is the point of this module
    _import_error = f"{type(exc).__name__}: {exc}"
    triton = None
    tl = types.SimpleNamespace(constexpr=object)

_fell_back: set[str] = set()   # why calls took the PyTorch reference path (report(); the first one warns)


def jit(fn):
    """`triton.jit`, or the undecorated function when Triton is missing."""
    return triton.jit(fn) if triton is not None else fn


def interpreting() -> bool:
    """Whether TRITON_INTERPRET=1 (kernels run on CPU tensors in the interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why Triton kernels cannot run at all, or None when they can."""
    if _import_error is not None:
        return f"Triton is not importable ({_import_error})"
    if not interpreting() and not torch.cuda.is_available():
        return "no CUDA device is visible and TRITON_INTERPRET is not set"
    return None


def available() -> bool:
    """Whether Triton kernels can run on some device in this process."""
    return unavailable_reason() is None


def _device_reason(tensor: torch.Tensor) -> str | None:
    """Why the kernels cannot run on `tensor`'s device, or None."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if interpreting():
        if tensor.device.type != "cpu":
            return f"TRITON_INTERPRET=1 runs kernels on CPU tensors only, got a {tensor.device} tensor"
        return None
    if tensor.device.type != "cuda":
        return f"compiled Triton kernels need CUDA tensors, got a {tensor.device} tensor"
    return None


def can_run(tensor: torch.Tensor) -> bool:
    """Whether the kernels can run on `tensor`'s device; silent (for callers with their own fallback)."""
    return _device_reason(tensor) is None


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the kernels can run on `tensor`'s device; else warns once and returns False."""
    reason = _device_reason(tensor)
    if reason is None:
        return True
    if not _fell_back:
        warnings.warn(f"roundpipe.kernels: using the PyTorch reference path because {reason}.",
                      RuntimeWarning, stacklevel=3)
    _fell_back.add(reason)
    return False


def num_warps(block: int) -> int:
    """Warps for a row kernel of `block` elements: 4 up to 2K, doubling to 16 at 8K+."""
    return 4 if block <= 2048 else (8 if block <= 4096 else 16)


def num_programs(device: torch.device, work_items: int) -> int:
    """Programs for a persistent kernel that loops over `work_items` rows.

    On CUDA four per SM keeps every SM busy while the per-program partial sums
    (e.g. RMSNorm's weight gradient) stay small; the interpreter runs programs
    one after another, so a handful is enough there.
    """
    if device.type == "cuda":
        per_device = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        per_device = 8
    return max(1, min(work_items, per_device))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_float(name: str, tensor, dtypes=(torch.float16, torch.bfloat16, torch.float32)) -> None:
    """TypeError unless `tensor` is a torch.Tensor of one of `dtypes`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name}.dtype={tensor.dtype} is not supported; expected one of "
                        f"{', '.join(str(d) for d in dtypes)}")


def check_same(name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor, *, dtype: bool = True) -> None:
    """ValueError unless `tensor` is on `ref`'s device (and, with `dtype`, has its dtype)."""
    if tensor.device != ref.device:
        raise ValueError(f"{name} is on {tensor.device} but {ref_name} is on {ref.device}; "
                         "move both to the same device")
    if dtype and tensor.dtype != ref.dtype:
        raise TypeError(f"{name}.dtype={tensor.dtype} differs from {ref_name}.dtype={ref.dtype}; "
                        "cast one of them")


# Triton compiles a kernel on its first launch for each specialisation, and its compile path
# and caches are not safe against the same kernel being compiled from several threads at once,
# which is what several GPU workers reaching a new shape together would do.  So a launch whose
# specialisation key was never seen runs under one lock; later ones do not take it.  The key is
# finer than Triton's own only in the safe direction (it may lock a launch that is warm), never
# coarser: two launches Triton compiles separately must never share a key.
_first_launch = threading.Lock()
_warm: set = set()
_launched: set[str] = set()    # the kernels launched in this process, by name (report())
# The interpreter (TRITON_INTERPRET=1, CPU tensors) is not safe from several threads at any launch: while it
# runs a kernel it swaps triton.language's builtins, so two CPU workers running kernels at once fail ("Did you
# forget to add @triton.jit ?").  Interpreted launches run one at a time.
_interpreted = threading.Lock()


def _int_type(a: int) -> str:
    """The integer type Triton gives a Python int argument: i32 when it fits, else u64 or i64 (Triton 3.x)."""
    if -2**31 <= a < 2**31:
        return "i32"
    return "u64" if 2**63 <= a < 2**64 else "i64"


def _arg_key(a):
    """What Triton specialises an argument on: a tensor's dtype and 16-byte alignment; an int's width
    (i32/i64/u64), whether it is 1 (then a constant) and whether it divides by 16."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if is_int(a):
        return (_int_type(a), a == 1, a % 16 == 0)
    return type(a).__name__


def _specialisation(kernel, device: torch.device, args: tuple, meta: dict) -> tuple:
    return (id(kernel), device, tuple(_arg_key(a) for a in args), tuple(sorted(meta.items())))


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """kernel[grid](*args, **meta) with the first tensor argument's CUDA device made current.

    Triton launches on the current device; roundpipe drives several GPUs from
    worker threads, so a tensor on cuda:1 must not run on cuda:0's context.  A
    launch that may compile holds the first-launch lock, an interpreted one the interpreter's (see above).
    """
    first = next(a for a in args if isinstance(a, torch.Tensor))
    key = _specialisation(kernel, first.device, args, meta)
    if first.device.type != "cuda" and triton is not None and isinstance(kernel, triton.runtime.jit.KernelInterface):
        guard = _interpreted   # a Triton kernel on CPU tensors: the interpreter
    else:
        guard = contextlib.nullcontext() if key in _warm else _first_launch
    with guard:
        if first.device.type == "cuda":
            with torch.cuda.device(first.device):
                kernel[grid](*args, **meta)
        else:
            kernel[grid](*args, **meta)
        if key not in _warm:   # a first launch: its name for report(), off the warm launches' path
            _warm.add(key)
            _launched.add((getattr(kernel, "__name__", None) or type(kernel).__name__).strip("_").removesuffix("_kernel"))


def report() -> dict:
    """What the kernels did in this process so far: {"launched": the names of the Triton kernels launched,
    "fell_back": why calls took the PyTorch reference path instead (empty: none did), "unavailable": why Triton
    cannot run at all, or None}.  A benchmark reads it after its steps to say which path its numbers are from."""
    return {"launched": sorted(_launched), "fell_back": sorted(_fell_back), "unavailable": unavailable_reason()}
