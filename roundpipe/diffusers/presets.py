"""What roundpipe knows of each diffusion transformer: its call arguments (which are per sample and which are
passed whole), and inputs of the shape a training batch at a pixel size has (`example_inputs`).

Pixels to latent tokens (the VAE downsamples by 8 in space; Wan's also by 4 in time):

    Flux  latent [16, H/8, W/8] packed into 2x2 patches: S_img = (H/16) * (W/16) tokens of in_channels (64) each;
          hidden_states [b, S_img, in_channels], img_ids [S_img, 3] (0, row, col), txt_ids [S_txt, 3] zeros
    SD3   latent [in_channels, H/8, W/8], patch_size p (2): S_img = (H/8/p) * (W/8/p)
    Wan   latent [in_channels, (F-1)/4 + 1, H/8, W/8], patch (1, 2, 2): S_img = ((F-1)/4 + 1) * (H/16) * (W/16)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    """One transformer family's call: its argument names in the order the input layer takes them."""

    per_sample: tuple[str, ...]   # split along dim 0 into microbatches (dim 0 must be the batch)
    whole: tuple[str, ...]        # passed whole to every microbatch (never split, whatever their length)
    required: tuple[str, ...]     # must be given
    refused: tuple[str, ...]      # the transformer's own forward arguments roundpipe does not support
    text_len: int                 # text tokens of example_inputs (the pipelines' default prompt length)


FAMILIES = {
    "flux": Family(per_sample=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
                   whole=("img_ids", "txt_ids"),
                   required=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
                             "txt_ids"),
                   refused=("joint_attention_kwargs", "controlnet_block_samples", "controlnet_single_block_samples",
                            "controlnet_blocks_repeat", "return_dict"),
                   text_len=512),
    "sd3": Family(per_sample=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
                  whole=(),
                  required=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
                  refused=("block_controlnet_hidden_states", "joint_attention_kwargs", "skip_layers", "return_dict"),
                  text_len=333),   # CLIP-L/G 77 + T5 256 tokens, concatenated
    "wan": Family(per_sample=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
                  whole=(),
                  required=("hidden_states", "timestep", "encoder_hidden_states"),
                  refused=("attention_kwargs", "return_dict"),
                  text_len=512),
}
WAN_IMAGE_TOKENS = 257   # CLIP ViT-H/14 tokens of the I2V models' image embedding


def _classes() -> dict[str, type]:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel
    return {"flux": FluxTransformer2DModel, "sd3": SD3Transformer2DModel, "wan": WanTransformer3DModel}


def family(transformer: nn.Module) -> str:
    """"flux", "sd3" or "wan"; a TypeError for any other module, or a subclass that overrides forward (its
    forward may do what our layers do not)."""
    for name, cls in _classes().items():
        if isinstance(transformer, cls):
            if type(transformer).forward is not cls.forward:
                raise TypeError(f"{type(transformer).__name__} overrides {cls.__name__}.forward; roundpipe reproduces "
                                f"{cls.__name__}'s own forward only")
            return name
    raise TypeError(f"rp.diffusers.wrap takes a diffusers FluxTransformer2DModel, SD3Transformer2DModel or "
                    f"WanTransformer3DModel, got {type(transformer).__name__}")


def _latent(height: int, width: int, multiple: int) -> tuple[int, int]:
    for name, v in (("height", height), ("width", width)):
        if not (isinstance(v, int) and v > 0 and v % multiple == 0):
            raise ValueError(f"{name}={v!r} must be a positive multiple of {multiple} pixels")
    return height // 8, width // 8


def example_inputs(transformer: nn.Module, batch: int, height: int, width: int, frames: int | None = None,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   text_len: int | None = None) -> dict:
    """Keyword arguments of `transformer` (and of the wrapped model's calls, and its first layer) for a batch of
    `batch` samples of height x width pixels (and `frames` video frames, Wan only): random latents and text
    embeddings, timesteps in the family's convention (Flux: sigma in [0, 1]; SD3, Wan: 1000 * sigma).

    The transformer may live on the meta device (its config is all that is read); so may `device`."""
    kind = family(transformer)
    cfg = transformer.config
    fam = FAMILIES[kind]
    text = fam.text_len if text_len is None else text_len
    if not (isinstance(batch, int) and batch >= 1):
        raise ValueError(f"batch={batch!r} must be an int >= 1")
    rand = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)   # noqa: E731
    sigma = torch.rand(batch, device=device).to(dtype) if torch.device(device).type != "meta" else \
        torch.empty(batch, dtype=dtype, device=device)
    if kind == "flux":
        if frames is not None:
            raise ValueError("frames= is for video (Wan); Flux takes height and width")
        lh, lw = _latent(height, width, 16)
        h, w = lh // 2, lw // 2
        img_ids = torch.zeros(h, w, 3, dtype=dtype, device=device)
        img_ids[..., 1] += torch.arange(h, dtype=dtype, device=device)[:, None]
        img_ids[..., 2] += torch.arange(w, dtype=dtype, device=device)[None, :]
        out = {"hidden_states": rand(batch, h * w, cfg.in_channels),
               "encoder_hidden_states": rand(batch, text, cfg.joint_attention_dim),
               "pooled_projections": rand(batch, cfg.pooled_projection_dim),
               "timestep": sigma,
               "img_ids": img_ids.reshape(h * w, 3),
               "txt_ids": torch.zeros(text, 3, dtype=dtype, device=device)}
        if cfg.guidance_embeds:
            out["guidance"] = torch.full((batch,), 3.5, dtype=dtype, device=device)
        return out
    if kind == "sd3":
        if frames is not None:
            raise ValueError("frames= is for video (Wan); SD3 takes height and width")
        lh, lw = _latent(height, width, 8 * cfg.patch_size)
        return {"hidden_states": rand(batch, cfg.in_channels, lh, lw),
                "encoder_hidden_states": rand(batch, text, cfg.joint_attention_dim),
                "pooled_projections": rand(batch, cfg.pooled_projection_dim),
                "timestep": sigma * 1000}
    p_t, p_h, p_w = cfg.patch_size
    lh, lw = _latent(height, width, 8 * max(p_h, p_w))
    frames = 1 if frames is None else frames
    if not (isinstance(frames, int) and frames >= 1 and (frames - 1) % 4 == 0):
        raise ValueError(f"frames={frames!r} must be 4k + 1 (1, 5, 9, ...): Wan's VAE keeps the first frame and "
                         "packs each 4 after it into one latent frame")
    out = {"hidden_states": rand(batch, cfg.in_channels, (frames - 1) // 4 + 1, lh, lw),
           "timestep": sigma * 1000,
           "encoder_hidden_states": rand(batch, text, cfg.text_dim)}
    if cfg.image_dim is not None:
        out["encoder_hidden_states_image"] = rand(batch, WAN_IMAGE_TOKENS, cfg.image_dim)
    return out
