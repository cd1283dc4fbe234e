"""The training objective of diffusion transformers: noisy inputs and targets, and the loss.

Rectified flow (Flux, SD3, Wan; diffusers' train_dreambooth_lora_flux.py / _sd3.py):

    noisy  = (1 - sigma) * x0 + sigma * noise          sigma in [0, 1], one per sample
    target = noise - x0                                 prediction="flow" (the velocity the model predicts)
           = noise                                      prediction="noise" (epsilon prediction)
           = x0                                         prediction="sample"
    loss   = mean_b( mean_{latent}( weighting * (pred - target)^2 ) )

The timestep each family takes for that sigma: Flux `timestep = sigma` (its forward multiplies by 1000),
SD3 and Wan `timestep = 1000 * sigma` (FlowMatchEulerDiscreteScheduler's timesteps).
"""
from __future__ import annotations

from typing import Any

import torch

PREDICTIONS = ("flow", "noise", "sample")


def _per_sample(sigmas: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """sigmas [B] (or [B, 1, ...]) as [B, 1, ..., 1] against `like` [B, ...]."""
    if not isinstance(sigmas, torch.Tensor):
        raise TypeError(f"{name} must be a tensor [batch], got {type(sigmas).__name__}")
    if sigmas.dim() == 0 or sigmas.shape[0] != like.shape[0] or sigmas.numel() != like.shape[0]:
        raise ValueError(f"{name} must hold one value per sample: shape [{like.shape[0]}], got {tuple(sigmas.shape)}")
    return sigmas.reshape(-1, *([1] * (like.dim() - 1)))


def flow_matching_inputs(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor,
                         prediction: str = "flow") -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy latents, target) of rectified flow for clean `latents`, `noise` of their shape and per-sample
    `sigmas` [batch] in [0, 1] (module docstring)."""
    if prediction not in PREDICTIONS:
        raise ValueError(f"prediction={prediction!r} must be one of {PREDICTIONS}")
    if not isinstance(latents, torch.Tensor) or not isinstance(noise, torch.Tensor) or noise.shape != latents.shape:
        shape = lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__   # noqa: E731
        raise ValueError(f"noise must be a tensor of latents' shape {shape(latents)}, got {shape(noise)}")
    s = _per_sample(sigmas, latents, "sigmas").to(latents.dtype)
    noisy = (1.0 - s) * latents + s * noise
    target = {"flow": noise - latents, "noise": noise, "sample": latents}[prediction]
    return noisy, target


def diffusion_loss(pred: torch.Tensor, labels: Any) -> torch.Tensor:
    """The microbatch's loss: per sample the mean over latents of weighting * (pred - target)^2, then the mean
    over samples, in fp32, as diffusers' training scripts compute it.  labels: the target tensor, or a dict
    {"target": tensor, "weighting": per-sample weights [b] or a tensor broadcastable to the target}."""
    if isinstance(labels, dict):
        target, weighting = labels["target"], labels.get("weighting")
    else:
        target, weighting = labels, None
    err = (pred.float() - target.float()) ** 2
    if weighting is not None:
        w = weighting.float()
        if w.dim() == 1:
            w = w.reshape(-1, *([1] * (err.dim() - 1)))
        err = w * err
    return err.reshape(target.shape[0], -1).mean(1).mean()
