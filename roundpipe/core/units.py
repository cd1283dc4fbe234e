"""Quantities as the planner's reports print them: a byte count's unit, a dtype's short name."""
from __future__ import annotations

import torch


def byte_unit(n: int) -> tuple[str, int]:
    """The largest of GiB, MiB, KiB that `n` bytes reach (else B), and its size in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return unit, scale
    return "B", 1


def dtype_name(dtype: torch.dtype) -> str:
    """bf16, fp16, fp32, or torch's own name for another dtype."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
