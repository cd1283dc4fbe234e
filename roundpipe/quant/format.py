"""The 4-bit weight format: code tables and `Quant4State`, byte-compatible with bitsandbytes.

A weight W of any shape and numel n is read flat (row-major) and cut into
blocks of `blocksize` (64) values; the last block may be short.  Each value is
stored as a 4-bit index into a 16-entry code table, two per byte, the *first*
value of a pair in the high nibble:

    data[j] = (q[2j] << 4) | q[2j + 1]        data: uint8 [ceil(n / 2)]
    W[i]   ~= code[q[i]] * absmax[i // blocksize]

absmax[b] = max |W| over block b, fp32 [ceil(n / blocksize)].  With double
quantization (bitsandbytes' `compress_statistics=True`) absmax is itself stored
in 8 bits: offset = mean(absmax), and (absmax - offset) is quantized blockwise
(block 256) against bitsandbytes' signed 8-bit dynamic map:

    absmax[b] = nested_code[qabsmax[b]] * nested_absmax[b // 256] + offset

    absmax          uint8 [blocks]          (fp32 [blocks] without double quantization)
    nested_absmax   fp32 [ceil(blocks / 256)]
    nested_code     fp32 [256]              (the dynamic map, sorted ascending)
    offset          fp32 []                 (a 0-dim tensor, so no device sync reads it)

That is 0.5 + 1/64 + ~1/16384 bytes per parameter: ~0.516 (0.5625 without it).
The tables here are the exact fp32 values bitsandbytes uses; tests compare them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch

QuantType = Literal["nf4", "fp4"]
QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4")
BLOCKSIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# NF4 (QLoRA): quantiles of N(0, 1) scaled to [-1, 1]; these are fp32 values, written as their doubles.
_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0)
# FP4 (1 sign, 2 exponent, 1 mantissa bit, bias 2) by bit pattern; divided by 12 in fp32 below.  Code 8
# (sign bit, zero) is +0.0 as in bitsandbytes' table (its quant_map); its CPU kernels disagree on that sign.
_FP4_TWELFTHS = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
# Quantizing picks the nearest table value; for FP4 that search runs over the values in ascending order,
# and sorted position -> code index is this permutation (bitsandbytes' order, with +0 before -0: a value
# in (-0.0026, 0] gets code 0, one in (0, 0.0026] code 8 (both zero); tests check it against bitsandbytes).
_FP4_SORTED_TO_CODE = (11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3)


def check_quant_type(quant_type) -> str:
    """ValueError unless quant_type is 'nf4' or 'fp4'; returns it."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type={quant_type!r} is not a 4-bit type; expected one of {QUANT_TYPES}")
    return quant_type


@functools.lru_cache(maxsize=None)
def _code_cpu(quant_type: str) -> torch.Tensor:
    if quant_type == "nf4":
        return torch.tensor(_NF4, dtype=torch.float32)
    return torch.tensor(_FP4_TWELFTHS, dtype=torch.float32) / 12.0


def code_table(quant_type: str, device=None) -> torch.Tensor:
    """The 16 fp32 values a 4-bit index decodes to (index order), on `device` (a fresh copy)."""
    return _code_cpu(check_quant_type(quant_type)).to(device or "cpu", copy=True)


@functools.lru_cache(maxsize=None)
def sorted_code(quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the table's values in ascending order, sorted position -> code index); CPU, shared: do not modify."""
    code = _code_cpu(check_quant_type(quant_type))
    order = torch.arange(16) if quant_type == "nf4" else torch.tensor(_FP4_SORTED_TO_CODE)
    return code[order], order


@functools.lru_cache(maxsize=1)
def _dynamic_map_cpu() -> torch.Tensor:
    # Signed dynamic 8-bit map: for exponent e = 0..6 the 2^e midpoints of linspace(0.1, 1, 2^e + 1) times
    # 10^(e - 6), both signs, plus 0 and 1: 2 * 127 + 2 = 256 values, ascending.  Built with the same fp32
    # operations as bitsandbytes' create_dynamic_map (a test checks equality).
    values = [0.0, 1.0]
    for e in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)
        mids = (10 ** (e - 6)) * ((bounds[:-1] + bounds[1:]) / 2.0)
        values += mids.tolist() + (-mids).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def dynamic_map(device=None) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (fp32 [256], ascending), the code of double-quantized absmax."""
    return _dynamic_map_cpu().to(device or "cpu", copy=True)


@dataclasses.dataclass(frozen=True)
class Quant4State:
    """A 4-bit quantized tensor: packed data plus its statistics (layout in the module docstring).

    Fields:
        data: uint8 [ceil(numel / 2)], two 4-bit codes a byte, first value in the high nibble.
        shape: the original tensor's shape.
        dtype: the original tensor's dtype; dequantized values are rounded to it (as bitsandbytes does)
            before any cast to another compute dtype.
        quant_type: 'nf4' or 'fp4'.
        absmax: fp32 [blocks], or uint8 [blocks] codes when double-quantized.
        blocksize: values per absmax block (bitsandbytes' default, 64).
        nested_absmax, nested_code, offset: the double quantization of absmax (all None without it):
            fp32 [ceil(blocks / 256)], fp32 [256], fp32 [].
        nested_blocksize: absmax values per nested block (256).
    """

    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    quant_type: QuantType
    absmax: torch.Tensor
    blocksize: int = 64
    nested_absmax: torch.Tensor | None = None
    nested_code: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    nested_blocksize: int = NESTED_BLOCKSIZE

    def __post_init__(self):
        check_quant_type(self.quant_type)
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype} is not supported; expected one of {DTYPES}")
        if self.blocksize not in BLOCKSIZES:
            raise ValueError(f"blocksize={self.blocksize!r} is not supported; expected one of {BLOCKSIZES}")
        n = self.numel
        _check_tensor("data", self.data, torch.uint8, ((n + 1) // 2,))
        blocks = self.blocks
        nested = (self.nested_absmax, self.nested_code, self.offset)
        if all(t is None for t in nested):
            _check_tensor("absmax", self.absmax, torch.float32, (blocks,))
            return
        if any(t is None for t in nested):
            raise ValueError("nested_absmax, nested_code and offset must be given together (double quantization) "
                             "or all be None")
        if self.nested_blocksize < 1:
            raise ValueError(f"nested_blocksize={self.nested_blocksize!r} must be a positive int")
        _check_tensor("absmax", self.absmax, torch.uint8, (blocks,))
        _check_tensor("nested_absmax", self.nested_absmax, torch.float32,
                      (-(-blocks // self.nested_blocksize),))
        _check_tensor("nested_code", self.nested_code, torch.float32, (256,))
        _check_tensor("offset", self.offset, torch.float32, ())

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def blocks(self) -> int:
        return -(-self.numel // self.blocksize)

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state's tensors by field name (those present): what has to live in host memory and be uploaded."""
        names = ("data", "absmax", "nested_absmax", "nested_code", "offset")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def replace(self, **tensors) -> "Quant4State":
        """A copy with some fields replaced (e.g. the tensors moved to another device)."""
        return dataclasses.replace(self, **tensors)

    def to(self, device, non_blocking: bool = False) -> "Quant4State":
        """The state with every tensor on `device` (itself when they already are)."""
        return self.replace(**{k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors().items()})

    def code(self) -> torch.Tensor:
        """The 16-entry fp32 code table of quant_type, on the state's device."""
        return code_table(self.quant_type, self.device)


def _check_tensor(name: str, t, dtype: torch.dtype, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}; expected {dtype} {tuple(shape)}")
    if t.requires_grad:
        raise ValueError(f"{name} requires grad; quantized weights are frozen (call .requires_grad_(False) "
                         "on the weight before quantizing)")


def packed_nbytes(state: Quant4State) -> int:
    """Bytes the state holds: packed data plus all statistics (what host memory and an upload carry)."""
    return sum(t.numel() * t.element_size() for t in state.tensors().values())
