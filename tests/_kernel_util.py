"""Shared checks for the kernel tests: the STYLE.md point 4 tolerance rule."""
from __future__ import annotations

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_torch_error(name: str, ours: torch.Tensor, torch_same_dtype: torch.Tensor,
                              ref: torch.Tensor, atol: float = 1e-5) -> None:
    """ours may be at most 2x as far from the fp32 reference as PyTorch in the same dtype, plus atol.

    One ulp of the output dtype at the reference's scale is added to atol: the
    interpreter may round a value to the other neighbour than PyTorch does.
    """
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    ulp = torch.finfo(ours.dtype).eps * ref.abs().max().item() if ref.numel() else 0.0
    mine, theirs = max_err(ours, ref), max_err(torch_same_dtype, ref)
    assert mine <= 2 * theirs + atol + ulp, f"{name}: error {mine:.3g} vs torch {theirs:.3g} (+{atol + ulp:.3g})"


def grads(out: torch.Tensor, inputs, seed_grad: torch.Tensor):
    """Gradients of (out * seed_grad).sum() with respect to `inputs` (None where unused)."""
    return torch.autograd.grad(out, inputs, seed_grad, allow_unused=True)


def leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """A detached copy (optionally cast) that requires grad."""
    return t.detach().to(dtype or t.dtype).clone().requires_grad_(True)
