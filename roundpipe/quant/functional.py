"""Dequantize with a backend per device, as bitsandbytes organises its ops.

    cuda  -> the Triton kernel (roundpipe.kernels.dequant4; its PyTorch reference,
             with one warning, where Triton cannot run)
    other -> PyTorch (roundpipe.quant.reference): what CPU workers run

Both give the same bits (tests compare the kernel with the reference under
TRITON_INTERPRET=1), so where a layer runs does not change its numbers.
"""
from __future__ import annotations

import torch

from .format import Quant4State
from .reference import dequantize_4bit_ref


def dequantize(state: Quant4State, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor `state` stands for in `dtype` (default: the state's), on the state's device; a fresh tensor."""
    if not isinstance(state, Quant4State):
        raise TypeError(f"state must be a roundpipe.quant.Quant4State, got {type(state).__name__}")
    if state.device.type == "cuda":
        from roundpipe.kernels.dequant4 import dequant4  # not at import: roundpipe.kernels imports this package

        return dequant4(state, dtype)
    return dequantize_4bit_ref(state, dtype)
