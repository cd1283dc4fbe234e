"""4-bit quantization and dequantization in PyTorch: the CPU backend and every other backend's reference.

Each step uses the same fp32 operations, in the same order, as bitsandbytes'
CPU backend, so the packed bytes and statistics are bitwise equal to
`bitsandbytes.functional.quantize_4bit(w, blocksize=64, compress_statistics=...,
quant_type=..., quant_storage=torch.uint8)` on the CPU for fp32/bf16/fp16 input:

- 4-bit codes (bitsandbytes' PyTorch `quantize_4bit`): a full block is scaled by the fp32 reciprocal of its
  absmax (clamped to >= 1e-38), the short last block is *divided* by its (clamped) absmax, and that clamped
  value is what it stores; the nearest table value wins, a tie (exactly on a midpoint) going to the lower
  value; an odd numel pads one 0.0 value into the last low nibble.
- Double quantization (bitsandbytes' native CPU `quantize_blockwise`, block 256): each value times the fp32
  reciprocal of its block's absmax gives v in [-1, 1]; the code is not the exact nearest but a 65,536-entry
  lookup table's: i = trunc((v + 1) * 0.5 * 65535 + 0.5) picks the table entry, which holds the nearest code
  to -1 + 2i / 65535.  (bitsandbytes' CUDA kernel searches exactly, so a GPU-quantized checkpoint can differ
  from a CPU one in a few absmax codes; both dequantize the same way.)
- Dequantization: absmax = nested_code[q] * nested_absmax + offset (fp32, two roundings, no FMA), then
  value = code[nibble] * absmax in fp32, rounded to the state's dtype and then cast to the requested one:
  bitwise what bitsandbytes' `dequantize_4bit(...).to(dtype)` gives.
"""
from __future__ import annotations

import functools

import torch

from .format import DTYPES, NESTED_BLOCKSIZE, Quant4State, check_quant_type, code_table, dynamic_map, sorted_code

_LUT_SIZE = 65536


def _blocks_absmax(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values scaled into [-1, 1], fp32 absmax per block) the way bitsandbytes' 4-bit quantizer does it."""
    n = flat.numel()
    full = n - n % blocksize
    whole = flat[:full].view(-1, blocksize)
    absmax = whole.abs().max(dim=-1)[0]
    scaled = torch.clamp(whole * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if full < n:
        tail = flat[full:]
        tail_max = tail.abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail_max.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(tail / tail_max, -1, 1)])
    return scaled, absmax


def _nearest_4bit(scaled: torch.Tensor, quant_type: str) -> torch.Tensor:
    """4-bit code index (int64) of the nearest table value; a midpoint goes to the lower value."""
    values, order = sorted_code(quant_type)
    midpoints = (values[:-1] + values[1:]) / 2
    return order[torch.bucketize(scaled, midpoints)]


@functools.lru_cache(maxsize=4)
def _lut(code_bytes: bytes) -> torch.Tensor:
    """The 65,536-entry table of nearest codes to -1 + 2i/65535 (bitsandbytes' CPU quantize_blockwise)."""
    code = torch.frombuffer(bytearray(code_bytes), dtype=torch.float32)
    midpoints = (code[:-1] + code[1:]) * 0.5
    grid = -1.0 + (torch.arange(_LUT_SIZE, dtype=torch.float32) * 2.0) / float(_LUT_SIZE - 1)
    return torch.searchsorted(midpoints, grid, side="left").to(torch.uint8)


def quantize_blockwise_8bit(x: torch.Tensor, code: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE):
    """fp32 x [n] -> (uint8 codes [n], fp32 absmax [ceil(n / blocksize)]), as bitsandbytes' CPU backend."""
    n = x.numel()
    blocks = -(-n // blocksize)
    padded = torch.zeros(blocks * blocksize, dtype=torch.float32)
    padded[:n] = x.float().reshape(-1)
    padded = padded.view(blocks, blocksize)
    absmax = padded.abs().amax(dim=1)
    v = padded * (1.0 / absmax).view(-1, 1)
    index = ((v.clamp(-1.0, 1.0) + 1.0) * 0.5 * float(_LUT_SIZE - 1) + 0.5).to(torch.int64)
    q = _lut(code.cpu().float().numpy().tobytes())[index.clamp(0, _LUT_SIZE - 1)]
    q[absmax == 0] = 0   # an all-zero block (its v is nan) stores code 0
    return q.reshape(-1)[:n], absmax


def quantize_4bit(w: torch.Tensor, quant_type: str = "nf4", double_quant: bool = True,
                  blocksize: int = 64) -> Quant4State:
    """Quantizes a fp32/bf16/fp16 tensor of any shape into a Quant4State (on the CPU; w is copied there)."""
    check_quant_type(quant_type)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in DTYPES:
        raise ValueError(f"w.dtype={w.dtype} cannot be quantized; expected one of {DTYPES}")
    if w.numel() == 0:
        raise ValueError(f"w.shape={tuple(w.shape)} is empty; there is nothing to quantize")
    flat = w.detach().reshape(-1).cpu().float()
    scaled, absmax = _blocks_absmax(flat, blocksize)
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    q = _nearest_4bit(scaled, quant_type).to(torch.uint8)
    data = (q[0::2] << 4) | q[1::2]
    common = dict(data=data, shape=w.shape, dtype=w.dtype, quant_type=quant_type, blocksize=blocksize)
    if not double_quant:
        return Quant4State(absmax=absmax, **common)
    offset = absmax.mean()
    nested_code = dynamic_map()
    qabsmax, nested_absmax = quantize_blockwise_8bit(absmax - offset, nested_code)
    return Quant4State(absmax=qabsmax, nested_absmax=nested_absmax, nested_code=nested_code, offset=offset,
                       **common)


def absmax_ref(state: Quant4State) -> torch.Tensor:
    """fp32 absmax per block (double quantization undone)."""
    if not state.double_quant:
        return state.absmax
    per_block = torch.arange(state.blocks, device=state.device) // state.nested_blocksize
    return state.nested_code[state.absmax.long()] * state.nested_absmax[per_block] + state.offset


def dequantize_4bit_ref(state: Quant4State, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor a Quant4State stands for, in `dtype` (default: the state's), on the state's device."""
    dtype = state.dtype if dtype is None else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; expected one of {DTYPES}")
    # A byte decodes to its (high, low) pair of table values in one gather, and whole blocks are scaled
    # as rows: 2.5 ms instead of 19.6 ms for a 1408 x 512 bf16 weight (one thread, EPYC, 2026-11), ~10
    # transient bytes a value instead of ~40, the same fp32 products.
    code = code_table(state.quant_type, state.device)
    pairs = torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1)   # byte -> (high, low)
    values = pairs.index_select(0, state.data.int()).view(-1)
    absmax = absmax_ref(state)
    n, blocksize = state.numel, state.blocksize
    if n % blocksize == 0 and values.numel() == n:
        out = values.view(-1, blocksize).mul_(absmax.view(-1, 1))
    else:   # a short last block or an odd numel's padding nibble
        out = values[:n] * absmax[torch.arange(n, device=state.device) // blocksize]
    return out.to(state.dtype).to(dtype).view(state.shape)
