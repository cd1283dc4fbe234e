"""bf16 masters: the fp32 update rounded back to bf16, to nearest or stochastically.

A trainable parameter may be a bf16 master (`RoundPipe(master_dtype=torch.bfloat16)`,
or any bf16 CPU parameter given to a roundpipe.optim optimizer).  Every optimizer
loads it, computes the update in fp32 exactly as for an fp32 master and rounds the
new weight back to bf16 in the same pass (csrc/kind_dispatch.h, MasterBF16*K):

    nearest      round to nearest even (torch's .to(torch.bfloat16))
    stochastic   add 16 random bits below bf16's mantissa, then truncate: the weight
                 rounds up with probability (dropped bits) / 2^16, so E[rounded] equals
                 the fp32 result and updates far below an ulp still move the weight on
                 average (Zamirai et al. 2020, "Revisiting BFloat16 Training": within
                 0.2% of fp32 masters where nearest rounding stalls)

The random bits come from a counter-based hash, not a generator's stream: element i
of parameter `index` (its position in the optimizer's param_groups, flattened) at
step `step` (its update count, 1 for the first) under `seed` gets

    key  = mix64(mix64(mix64(seed) ^ step) ^ index)           (splitmix64's finaliser)
    h    = lowbias32(lowbias32(lo32(i) ^ lo32(key)) ^ hi32(key) ^ hi32(i) * 0x9E3779B9)
    bits = h >> 16

so a result depends only on (seed, step, index, i): not on the plan, the thread
count or the SIMD level, and a resumed run (which restores the step counts) draws the
same bits.  `round_bf16_` is the torch-ops twin of the native rounding, used by the
optimizers' fallback path; the tests hold the two to identical bits.

Bytes: a bf16 master is 2 bytes instead of 4, and with a bf16 compute dtype it is
its own upload copy (roundpipe/engine/step/host_state.py), so AdamW8bit's host state
falls from ~10 to ~6 bytes per parameter.
"""
from __future__ import annotations

from typing import Literal

import torch

Rounding = Literal["stochastic", "nearest"]
ROUNDINGS: tuple[str, ...] = ("stochastic", "nearest")
MASTER_DTYPES = (torch.float32, torch.bfloat16)

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_GOLDEN32 = 0x9E3779B9
_CHUNK = 1 << 20   # elements rounded at a time by the torch path (int64 temporaries: ~40 MB)


def check_rounding(value: object, name: str = "master_rounding") -> str:
    """value if it is 'stochastic' or 'nearest', else ValueError naming `name`."""
    if value not in ROUNDINGS:
        raise ValueError(f"{name}={value!r} must be 'stochastic' (unbiased, counter-based random bits) or "
                         "'nearest' (round to nearest even)")
    return value  # type: ignore[return-value]


def check_master_dtype(value: object, name: str = "master_dtype") -> torch.dtype:
    """value if it is torch.float32 or torch.bfloat16, else ValueError naming `name` and the value."""
    if value not in MASTER_DTYPES:
        raise ValueError(f"{name}={value!r} is not supported: trainable masters are torch.float32 (default) or "
                         "torch.bfloat16 (updated in fp32 and rounded, master_rounding=)")
    return value  # type: ignore[return-value]


def _mix64(x: int) -> int:
    """splitmix64's finaliser (Steele et al. 2014): a bijection of 64-bit integers."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def round_key(seed: int, step: float | int, index: int) -> int:
    """The 64-bit key of one parameter's stochastic rounding at one step (see the module docstring)."""
    return _mix64(_mix64(_mix64(int(seed) & _M64) ^ (int(step) & _M64)) ^ (int(index) & _M64))


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 on int64 lanes holding 32-bit values (products wrap mod 2^64; the
    low 32 bits kept are exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def sr_bits(key: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 random bits (int64) of elements start .. start + n - 1 under `key`."""
    i = torch.arange(start, start + n, dtype=torch.int64, device=device)
    h = _lowbias32((i & _M32) ^ (key & _M32))
    hi = ((i >> 32) * _GOLDEN32) & _M32
    return _lowbias32(h ^ hi ^ (key >> 32)) >> 16


def round_bf16_(dst: torch.Tensor, src: torch.Tensor, rounding: str, key: int = 0) -> torch.Tensor:
    """dst (bf16) <- src (fp32, as many elements) rounded as the native kernels round a bf16 master:
    to nearest even, or stochastically with the bits of `key` (NaN -> 0x7FC0 either way)."""
    if rounding == "nearest":
        dst.view(-1).copy_(src.reshape(-1))
        return dst
    flat_src = src.detach().reshape(-1)
    flat_dst = dst.view(-1)
    for start in range(0, flat_src.numel(), _CHUNK):
        x = flat_src[start:start + _CHUNK]
        u = x.view(torch.int32).to(torch.int64) & _M32
        r = ((u + sr_bits(key, start, x.numel(), x.device)) >> 16) & 0xFFFF
        r = torch.where(x.isnan(), torch.full_like(r, 0x7FC0), r)
        flat_dst[start:start + _CHUNK].view(torch.int16).copy_(torch.where(r >= 0x8000, r - 0x10000, r))
    return dst
