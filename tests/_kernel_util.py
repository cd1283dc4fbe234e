"""Shared checks for the kernel tests: the STYLE.md point 4 tolerance rule, and that the kernels ran.

Every functional form quietly takes its PyTorch reference path for a tensor
the kernels cannot run on (a CPU tensor on a GPU host, no Triton), where a
comparison with the reference would pass whatever the kernels compute.  So a
kernel test calls `spy_launches` first (it skips, with the reason, where the
kernels cannot run on the device) and `assert_launched` after.
"""
from __future__ import annotations

import pytest
import torch

from roundpipe.kernels import _triton

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


def kernel_name(kernel) -> str:
    """A Triton kernel's Python name (a JITFunction, the interpreter's wrapper, or a test's stand-in)."""
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?")


def spy_launches(monkeypatch, device="cpu") -> list:
    """Skips unless the Triton kernels can run on `device`; returns the names of the kernels launched from now on."""
    probe = torch.empty(0, device=device)
    if not _triton.can_run(probe):
        pytest.skip(f"the Triton kernels cannot run on {probe.device} tensors here "
                    f"({_triton._device_reason(probe)}); the ops would compare the reference with itself")
    names, real = [], _triton.launch

    def recording(kernel, grid, *args, **meta):
        names.append(kernel_name(kernel))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(_triton, "launch", recording)
    return names


def assert_launched(launched: list, *names: str) -> None:
    """Each of `names` was launched at least once since spy_launches (the op did not take its reference path)."""
    missing = [n for n in names if n not in launched]
    assert not missing, f"kernels {missing} never launched (launched: {sorted(set(launched))}): the op fell back"
