"""Diffusion-transformer shapes: the published transformer configs and how pixels become tokens.

`rp.diffusers.max_resolution` / `max_frames` (roundpipe/diffusers/context.py), `roundpipe plan
max-resolution` and the GPU bench's Flux row take their models from here.  Each config is the
`transformer/config.json` its Hugging Face repository publishes (the repo is named beside it), less
the `_class_name` / `_diffusers_version` bookkeeping; diffusers builds the transformer from it on the
meta device (`DiTShape.build`), no weights and no download.

How an image or a video becomes the transformer's tokens (a VAE in front of it, not trained, not on
the workers):

    model          VAE (spatial, temporal)   patch          px per token side   frames rule
    Flux.1         8, -                      2 x 2 packed   16                  -
    SD3 / SD3.5    8, -                      2 x 2 conv     16                  -
    Wan2.1         8, 4 (causal)             1 x 2 x 2      16                  4k + 1 (latent k + 1)

so an image of H x W pixels is (H / 16) x (W / 16) tokens beside the text's, and a Wan video of F
frames is (1 + (F - 1) / 4) x (H / 16) x (W / 16) tokens.  Text tokens (their encoders' padded
lengths, as the pipelines send them): Flux's T5 512, SD3's CLIP 77 + T5 256, Wan's umT5 512.

SD3.5 Medium (MMDiT-X) is here too: its first 13 blocks add a second self-attention over the image
tokens (`dual_attention_layers`), which diffusers builds like any other block.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["image", "video"]
CLASSES = ("FluxTransformer2DModel", "SD3Transformer2DModel", "WanTransformer3DModel")


@dataclass(frozen=True)
class DiTShape:
    """A diffusion transformer as published: its diffusers class and config, and its pixel-to-token rules."""

    name: str                  # the published model name; SHAPES key: `key`
    key: str                   # the CLI's name for it: "flux-dev", "sd3.5-large", "wan2.1-14b"
    repo: str                  # the Hugging Face repository whose transformer/config.json `config` is
    class_name: str            # the diffusers transformer class, one of CLASSES
    config: dict[str, Any] = field(repr=False)
    kind: Kind = "image"
    pixels_per_token: int = 16   # a token's side in pixels: VAE downsampling x patch side
    temporal: int = 1            # video: frames per latent frame after the first (Wan's causal VAE: 4)
    text_tokens: int = 512       # the text encoders' padded length, as the pipeline sends it
    max_latent: int | None = None   # SD3's PatchEmbed refuses latents past pos_embed_max_size patches a side

    def __post_init__(self):
        if self.class_name not in CLASSES:
            raise ValueError(f"class_name={self.class_name!r} must be one of {CLASSES}")
        if self.kind not in ("image", "video"):
            raise ValueError(f"kind={self.kind!r} must be 'image' or 'video'")
        for name in ("pixels_per_token", "temporal", "text_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")

    @property
    def max_pixels(self) -> int | None:
        """The largest image side the transformer accepts (SD3: pos_embed_max_size patches), or None."""
        return None if self.max_latent is None else self.max_latent * self.pixels_per_token

    def transformer_class(self):
        import diffusers
        return getattr(diffusers, self.class_name)

    def build(self, device: str = "meta"):
        """The transformer from `config` on `device` (the meta device: shapes only, no memory, no init)."""
        import torch
        with torch.device(device):
            return self.transformer_class().from_config(dict(self.config))

    def image_tokens(self, height: int, width: int, frames: int | None = None) -> int:
        """Tokens of one sample's latents (module docstring), text excluded."""
        side = self.pixels_per_token
        latent_frames = 1 if frames is None else 1 + (frames - 1) // self.temporal
        return latent_frames * (height // side) * (width // side)

    def parameters(self) -> int:
        """The transformer's parameter count (built on the meta device once per config)."""
        key = (self.class_name, json.dumps(self.config, sort_keys=True))
        if key not in _PARAMETERS:
            _PARAMETERS[key] = sum(p.numel() for p in self.build().parameters())
        return _PARAMETERS[key]

    def hf_config(self) -> dict[str, Any]:
        """The config as its config.json holds it, `_class_name` included (the GPU bench's spec carries it as
        DecoderShape.hf_config's transformers fields)."""
        return {"_class_name": self.class_name, **self.config}


_PARAMETERS: dict[tuple[str, str], int] = {}


# black-forest-labs/FLUX.1-dev, transformer/config.json: 19 double-stream + 38 single-stream blocks, 11.9B
FLUX_DEV = DiTShape("FLUX.1-dev", "flux-dev", "black-forest-labs/FLUX.1-dev", "FluxTransformer2DModel", dict(
    attention_head_dim=128, guidance_embeds=True, in_channels=64, joint_attention_dim=4096, num_attention_heads=24,
    num_layers=19, num_single_layers=38, patch_size=1, pooled_projection_dim=768, axes_dims_rope=[16, 56, 56]))
# stabilityai/stable-diffusion-3.5-large, transformer/config.json: 38 joint blocks, 8.06B
SD35_LARGE = DiTShape("Stable Diffusion 3.5 Large", "sd3.5-large", "stabilityai/stable-diffusion-3.5-large",
                      "SD3Transformer2DModel", dict(
                          attention_head_dim=64, caption_projection_dim=2432, in_channels=16, joint_attention_dim=4096,
                          num_attention_heads=38, num_layers=38, out_channels=16, patch_size=2,
                          pooled_projection_dim=2048, pos_embed_max_size=192, qk_norm="rms_norm", sample_size=128),
                      text_tokens=77 + 256, max_latent=192)
# stabilityai/stable-diffusion-3.5-medium, transformer/config.json: 24 joint blocks, 13 with dual attention, 2.24B
SD35_MEDIUM = DiTShape("Stable Diffusion 3.5 Medium", "sd3.5-medium", "stabilityai/stable-diffusion-3.5-medium",
                       "SD3Transformer2DModel", dict(
                           attention_head_dim=64, caption_projection_dim=1536, dual_attention_layers=list(range(13)),
                           in_channels=16, joint_attention_dim=4096, num_attention_heads=24, num_layers=24,
                           out_channels=16, patch_size=2, pooled_projection_dim=2048, pos_embed_max_size=384,
                           qk_norm="rms_norm", sample_size=128),
                       text_tokens=77 + 256, max_latent=384)
# Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json: 40 blocks, 14.3B
WAN21_14B = DiTShape("Wan2.1-T2V-14B", "wan2.1-14b", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "WanTransformer3DModel", dict(
    added_kv_proj_dim=None, attention_head_dim=128, cross_attn_norm=True, eps=1e-6, ffn_dim=13824, freq_dim=256,
    image_dim=None, in_channels=16, num_attention_heads=40, num_layers=40, out_channels=16, patch_size=[1, 2, 2],
    qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, text_dim=4096), kind="video", temporal=4)

SHAPES = {s.key: s for s in (FLUX_DEV, SD35_LARGE, SD35_MEDIUM, WAN21_14B)}
