"""Optimizers on the native fused CPU step.

`Adam` / `AdamW`: drop-in torch.optim optimizers (state dicts interchangeable
with torch's), plus `fused_step` for the engine.  `adam_step` / `AdamConfig`:
the functional fused step over explicit tensors.  `grad_norm`, `grad_sumsq`,
`clip_coef`, `accumulate_`: the gradient passes around it.
"""
from roundpipe.optim.adam import Adam, AdamW
from roundpipe.optim.fused import AdamConfig, adam_step
from roundpipe.optim.gradients import accumulate_, clip_coef, grad_norm, grad_sumsq

__all__ = ["Adam", "AdamW", "AdamConfig", "adam_step", "grad_norm", "grad_sumsq", "clip_coef", "accumulate_"]
