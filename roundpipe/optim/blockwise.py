"""bitsandbytes' blockwise 8-bit state format (as of bitsandbytes 0.50), with torch-ops reference coders.

A tensor of n fp32 values is cut into blocks of BLOCK = 256 consecutive elements
(the last one may be shorter).  Each block keeps its absolute maximum (`absmax`,
fp32) and one byte per element: the index of a code in a 256-entry map of values
in [-1, 1], so that value = map[code] * absmax.  Optimizer state 1 (Adam's m) uses
the signed dynamic map, state 2 (v, never negative) the unsigned one (Dettmers et
al. 2021, "8-bit Optimizers via Block-wise Quantization").

The dynamic map: for each exponent e = 0..6 a run of fractions (linspace(0.1, 1)
midpoints) scaled by 10**(e - 6), mirrored for the signed map, plus 0 and 1, sorted:
fine steps near 0, coarse ones near 1.

Coding, exactly as bitsandbytes 0.50's CPU quantizer (csrc/cpu_ops.cpp) does it,
so that our codes equal its codes:

    absmax = max |x| over the block (NaN ignored);  absmax == 0: every code 0
    y      = clamp(x * (1 / absmax), -1, 1)                      fp32, NaN -> -1
    bin    = int((y + 1) * 0.5 * 65535 + 0.5)                    each op one fp32 rounding
    code   = LUT[bin],  LUT[i] = #{k : mid_k < -1 + 2i / 65535}  mid_k = (map[k] + map[k+1]) / 2

i.e. the nearest code of the bin's centre, not of x itself: 65,536 bins cannot tell
apart the codes near 0 that are 1e-7 apart (a value of 1e-9 * absmax gets the code
of 1.5e-5 in the unsigned map).  The native kernel reads the same maps and LUTs
(`tables()`), so that one rule lives in one place.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 256
LUT_BINS = 65536
# A LUT tensor holds its bins plus this many zero bytes: the native kernel reads 4 bytes per lookup.
LUT_SLACK = 3


def blocks(n: int) -> int:
    """The number of BLOCK-element blocks of an n-element tensor."""
    return -(-n // BLOCK)


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic 8-bit map (create_dynamic_map(signed), 7 exponent bits): 256 sorted fp32 values."""
    values = [0.0, 1.0]
    for e in range(7):
        # the linspace runs double in length with each exponent; the unsigned map has twice as many per run
        count = 2 ** (e + (0 if signed else 1)) + 1
        edges = torch.linspace(0.1, 1, count, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        run = ((10 ** (e - 6)) * means).tolist()
        values += run + ([-v for v in run] if signed else [])
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


def code_lut(code: torch.Tensor) -> torch.Tensor:
    """The bin -> code table of a map (see the module docstring): LUT_BINS uint8 entries + LUT_SLACK zeros."""
    mids = 0.5 * (code[:-1] + code[1:])
    centres = -1.0 + (2.0 * torch.arange(LUT_BINS, dtype=torch.float32)) / float(LUT_BINS - 1)
    lut = torch.searchsorted(mids, centres, right=False).to(torch.uint8)
    return torch.cat([lut, torch.zeros(LUT_SLACK, dtype=torch.uint8)])


@dataclass(frozen=True)
class Tables:
    """The maps and LUTs of Adam's two states: m (signed) and v (unsigned)."""

    code1: torch.Tensor
    lut1: torch.Tensor
    code2: torch.Tensor
    lut2: torch.Tensor


@functools.lru_cache(maxsize=None)
def tables() -> Tables:
    """The CPU tables, built once per process (2 x 65 KB)."""
    code1, code2 = dynamic_map(True), dynamic_map(False)
    return Tables(code1, code_lut(code1), code2, code_lut(code2))


def _blocked(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """x flattened and padded with `fill` to whole blocks, as a (blocks, BLOCK) view."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), fill)])
    return flat.view(-1, BLOCK)


def quantize_ref(x: torch.Tensor, code: torch.Tensor, lut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 shaped like x, absmax fp32 per block) of fp32 x, with torch ops (see the module docstring)."""
    xb = _blocked(x.float())
    absmax = torch.nan_to_num(xb.abs(), nan=0.0, posinf=float("inf")).amax(dim=1)
    y = torch.nan_to_num(xb * (1.0 / absmax)[:, None], nan=-1.0).clamp(-1.0, 1.0)
    bins = (((y + 1.0) * 0.5) * float(LUT_BINS - 1) + 0.5).to(torch.int64)
    codes = lut.to(x.device)[bins]
    codes[absmax == 0] = 0
    return codes.view(-1)[: x.numel()].view(x.shape), absmax


def dequantize_ref(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """fp32 values map[codes] * absmax of their block, shaped like codes."""
    values = _blocked(code.to(codes.device)[codes.long()]) * absmax[:, None]
    return values.view(-1)[: codes.numel()].view(codes.shape)
