"""4-bit (NF4/FP4, bitsandbytes layout) dequantization into fp32/bf16/fp16.

Shapes (roundpipe.quant.format has the layout): data uint8 [ceil(n / 2)], two
codes a byte, first value in the high nibble; absmax fp32 [blocks] or, double-
quantized, uint8 [blocks] + nested_absmax fp32 [ceil(blocks / 256)] +
nested_code fp32 [256] + offset fp32 []; code fp32 [16]; out [n] viewed as the
weight's shape.

One program writes BLOCK (1024) consecutive values from BLOCK / 2 bytes: the
high and low nibbles are split and interleaved back into value order, each
value's code and its block's absmax are gathered (the 16-entry table, absmax
and the nested statistics stay in L1/L2), and

    absmax = nested_code[q] * nested_absmax[b // 256] + offset
    value  = (code[nibble] * absmax  rounded to the state's dtype)  cast to out's dtype

in fp32 with FMA contraction off (`enable_fp_fusion=False`), so the fp32 output
is bitwise the reference (roundpipe.quant.reference), which is bitwise
bitsandbytes' dequantize_4bit.  Rounding to bf16 is done with integer ops on the
fp32 bits (round to nearest even), because the interpreter's own fp32 -> bf16
cast truncates; so every output dtype is bitwise the reference in the
interpreter too, and the final cast never rounds.

Fusing with the matmul would pay where the weight is read once per product and
the product is small (decode-sized batches, the input-gradient product of a thin
microbatch): the dequantized [out, in] weight then costs a write and a read of
2 bytes/param against 0.52 for the packed one.  For a stage's training
microbatches (thousands of tokens) the matmul dominates and a separate
dequantize costs a few percent; unmeasured on a GPU here, so not built.
"""
from __future__ import annotations

import torch

from roundpipe.quant.format import DTYPES, Quant4State
from roundpipe.quant.reference import dequantize_4bit_ref

from . import _triton
from ._triton import jit, tl, triton

BLOCK = 1024


def dequant4_ref(state: Quant4State, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The PyTorch reference (roundpipe.quant's CPU backend)."""
    return dequantize_4bit_ref(state, dtype)


@jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still in fp32: integer ops, exact in the interpreter too."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@jit
def _dequant4_kernel(DATA, CODE, ABSMAX, NESTED_ABSMAX, NESTED_CODE, OFFSET, OUT, n,
                     BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, DOUBLE_QUANT: tl.constexpr,
                     STATE_ROUNDING: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    byte_offs = start // 2 + tl.arange(0, BLOCK // 2)
    packed = tl.load(DATA + byte_offs, mask=byte_offs < (n + 1) // 2, other=0).to(tl.int32)
    nibbles = tl.interleave(packed >> 4, packed & 0xF)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    value = tl.load(CODE + nibbles)
    block = offs // BLOCKSIZE
    if DOUBLE_QUANT:
        q = tl.load(ABSMAX + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(NESTED_CODE + q) * tl.load(NESTED_ABSMAX + block // NESTED_BLOCKSIZE, mask=mask, other=0.0)
        scale = scale + tl.load(OFFSET)
    else:
        scale = tl.load(ABSMAX + block, mask=mask, other=0.0)
    out = value * scale
    if STATE_ROUNDING == 1:   # the state's dtype is fp16
        out = out.to(tl.float16).to(tl.float32)
    if STATE_ROUNDING == 2:   # bf16
        out = _round_to_bf16(out)
    if OUT_BF16:
        out = _round_to_bf16(out)   # exact in bf16 now, so the cast below cannot round
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)


_ROUNDING = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # STATE_ROUNDING by dtype


def _dequant4(state: Quant4State, dtype: torch.dtype) -> torch.Tensor:
    """Launches the kernel; returns the dequantized tensor in `dtype`, shaped like the original."""
    n = state.numel
    out = torch.empty(n, dtype=dtype, device=state.device)
    code = state.code()
    nested = (state.nested_absmax, state.nested_code, state.offset) if state.double_quant else (code,) * 3
    _triton.launch(_dequant4_kernel, (triton.cdiv(n, BLOCK),), state.data, code, state.absmax, *nested, out, n,
                   BLOCKSIZE=state.blocksize, NESTED_BLOCKSIZE=state.nested_blocksize,
                   DOUBLE_QUANT=state.double_quant, STATE_ROUNDING=_ROUNDING[state.dtype],
                   OUT_BF16=dtype == torch.bfloat16,
                   BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return out.view(state.shape)


def dequant4(state: Quant4State, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor `state` stands for, in `dtype` (default: the state's), on the state's device.

    Runs the Triton kernel where it can run on the state's device, else the
    PyTorch reference.  No autograd: quantized weights are frozen.
    """
    if not isinstance(state, Quant4State):
        raise TypeError(f"state must be a roundpipe.quant.Quant4State, got {type(state).__name__}")
    dtype = state.dtype if dtype is None else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; expected one of {DTYPES}")
    if not _triton.use_triton(state.data):
        return dequant4_ref(state, dtype)
    return _dequant4(state, dtype)
