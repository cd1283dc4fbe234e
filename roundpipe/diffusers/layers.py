"""The layers a diffusion transformer is cut into: its input embedders, one layer per block, its output head.

    Flux  (FluxTransformer2DModel):   FluxInput, Block x (num_layers double + num_single_layers single), FluxOutput
    SD3   (SD3Transformer2DModel):    SD3Input,  Block x num_layers (joint blocks),                      SD3Output
    Wan   (WanTransformer3DModel):    WanInput,  Block x num_layers,                                      WanOutput

Each layer holds the transformer's OWN modules (no copy), so the host masters are the transformer's
parameters: their names, `state_dict()`, `save_pretrained()` and PEFT adapters are diffusers' unchanged.
Each layer does what diffusers 0.42.1's forward does between two blocks, line for line
(models/transformers/transformer_flux.py, transformer_sd3.py, transformer_wan.py); tests/diffusers/test_wrap.py
holds the layers' output to the transformer's own.

Shapes (b: a microbatch's samples; D: inner dim = heads * head_dim; S_img: latent tokens, S_txt: text tokens):

    Activation.hidden      [b, S_img, D]   image / video tokens
    Activation.context     Flux, SD3: [b, S_txt, D] (SD3: caption_projection_dim) the text stream, None after SD3's last
                           block (context_pre_only); Wan: [b, S_txt (+ S_clip), D] the cross-attention keys
    Activation.temb        [b, D] time (+ pooled text, + guidance) embedding; Wan 2.2 ti2v: [b, S_img, D]
    Activation.rotary      Flux: (cos, sin) [S_txt + S_img, head_dim] fp32, from txt_ids and img_ids (whole, not
                           per sample); Wan: (cos, sin) [1, S_img, 1, head_dim] fp32, from the latent grid; SD3: None
    Activation.block_temb  Wan: timestep_proj [b, 6, D] (ti2v: [b, S_img, 6, D]); None otherwise
    Activation.grid        ints for the unpatchify: SD3 (height, width) of the latent; Wan (batch-free) post-patch
                           (frames, height, width); Flux () (its output stays packed, as diffusers returns it)

The output layer returns the transformer's sample: Flux [b, S_img, patch^2 * out_channels] (packed, as
FluxTransformer2DModel returns it), SD3 [b, out_channels, H, W], Wan [b, out_channels, F, H, W].

`adapters` carries the call's PEFT adapter state to the workers' replicas, as rp.hf's layers do
(roundpipe/hf/layers.py: `with transformer.disable_adapters()`-style switches read when a call starts).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from roundpipe.core.tree import detached
from roundpipe.hf.layers import AdapterState, is_tuner, set_adapters


class Activation(NamedTuple):
    hidden: torch.Tensor
    context: torch.Tensor | None
    temb: torch.Tensor
    rotary: tuple | None
    block_temb: torch.Tensor | None = None
    grid: tuple = ()
    adapters: AdapterState | None = None


class _Layer(nn.Module):
    """What every layer shares: the names of its PEFT modules, and the adapter state its replica was set to."""

    def _find_tuners(self) -> None:
        self.tuner_names = [n for n, m in self.named_modules() if is_tuner(m)]   # by name: a replica finds its own
        self.adapters_set: AdapterState | None = None


# ---- Flux
class FluxInput(_Layer):
    """x_embedder, time (+ guidance) + pooled-text embedding, context_embedder, rotary table from the ids."""

    def __init__(self, t: nn.Module):
        super().__init__()
        self.x_embedder, self.time_text_embed = t.x_embedder, t.time_text_embed
        self.context_embedder, self.pos_embed = t.context_embedder, t.pos_embed
        self._find_tuners()

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                txt_ids: torch.Tensor, guidance: torch.Tensor | None = None,
                adapters: AdapterState | None = None) -> Activation:
        set_adapters(self, adapters)
        hidden_states = self.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is None:
            temb = self.time_text_embed(timestep, pooled_projections)
        else:
            temb = self.time_text_embed(timestep, guidance.to(hidden_states.dtype) * 1000, pooled_projections)
        context = self.context_embedder(encoder_hidden_states)
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids   # diffusers' deprecated batched ids
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        rotary = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return Activation(hidden_states, context, temb, tuple(rotary), adapters=adapters)


class FluxOutput(_Layer):
    """norm_out (adaptive, from temb) + proj_out; the sample stays packed [b, S_img, p*p*C]."""

    def __init__(self, t: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = t.norm_out, t.proj_out
        self._find_tuners()

    def forward(self, x: Activation) -> torch.Tensor:
        x = Activation(*x)
        set_adapters(self, x.adapters)
        return self.proj_out(self.norm_out(x.hidden, x.temb))


# ---- SD3
class SD3Input(_Layer):
    """Patch embedding (+ cropped sin-cos positions), time + pooled-text embedding, context_embedder."""

    def __init__(self, t: nn.Module):
        super().__init__()
        self.pos_embed, self.time_text_embed, self.context_embedder = t.pos_embed, t.time_text_embed, t.context_embedder
        self._find_tuners()

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor,
                adapters: AdapterState | None = None) -> Activation:
        set_adapters(self, adapters)
        height, width = hidden_states.shape[-2:]
        hidden = self.pos_embed(hidden_states).contiguous()
        temb = self.time_text_embed(timestep, pooled_projections)
        context = self.context_embedder(encoder_hidden_states)
        return Activation(hidden, context, temb, None, grid=(int(height), int(width)), adapters=adapters)


class SD3Output(_Layer):
    """norm_out + proj_out + unpatchify to [b, C, H, W]."""

    def __init__(self, t: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = t.norm_out, t.proj_out
        self.patch_size, self.out_channels = t.config.patch_size, t.out_channels
        self._find_tuners()

    def forward(self, x: Activation) -> torch.Tensor:
        x = Activation(*x)
        set_adapters(self, x.adapters)
        h = self.proj_out(self.norm_out(x.hidden, x.temb))
        p, c = self.patch_size, self.out_channels
        height, width = x.grid[0] // p, x.grid[1] // p
        h = h.reshape(shape=(h.shape[0], height, width, p, p, c))
        h = torch.einsum("nhwpqc->nchpwq", h)
        return h.reshape(shape=(h.shape[0], c, height * p, width * p))


# ---- Wan
class WanInput(_Layer):
    """Rotary table of the latent grid, Conv3d patch embedding, time + text (+ CLIP image) embedding."""

    def __init__(self, t: nn.Module):
        super().__init__()
        self.rope, self.patch_embedding, self.condition_embedder = t.rope, t.patch_embedding, t.condition_embedder
        self.patch_size = tuple(t.config.patch_size)
        self._find_tuners()

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None,
                adapters: AdapterState | None = None) -> Activation:
        set_adapters(self, adapters)
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        grid = (int(frames) // p_t, int(height) // p_h, int(width) // p_w)
        rotary = self.rope(hidden_states)
        hidden = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        ts_seq_len = None
        if timestep.ndim == 2:   # [b, S_img] (Wan 2.2 ti2v)
            ts_seq_len = timestep.shape[1]
            timestep = timestep.flatten()
        temb, tproj, context, image = self.condition_embedder(timestep, encoder_hidden_states,
                                                              encoder_hidden_states_image,
                                                              timestep_seq_len=ts_seq_len)
        tproj = tproj.unflatten(2, (6, -1)) if ts_seq_len is not None else tproj.unflatten(1, (6, -1))
        if image is not None:
            context = torch.concat([image, context], dim=1)
        return Activation(hidden, context, temb, tuple(rotary), tproj, grid, adapters)


class WanOutput(_Layer):
    """Adaptive fp32 LayerNorm (scale_shift_table + temb) + proj_out + unpatchify to [b, C, F, H, W]."""

    def __init__(self, t: nn.Module):
        super().__init__()
        self.norm_out, self.proj_out = t.norm_out, t.proj_out
        self.scale_shift_table = t.scale_shift_table   # the transformer's own Parameter
        self.patch_size = tuple(t.config.patch_size)
        self._find_tuners()

    def forward(self, x: Activation) -> torch.Tensor:
        x = Activation(*x)
        set_adapters(self, x.adapters)
        temb, h = x.temb, x.hidden
        if temb.ndim == 3:
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        h = (self.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
        h = self.proj_out(h)
        (f, hh, ww), (p_t, p_h, p_w) = x.grid, self.patch_size
        h = h.reshape(h.shape[0], f, hh, ww, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return h.flatten(6, 7).flatten(4, 5).flatten(2, 3)


# ---- blocks
class Block(_Layer):
    """One transformer block, called as the transformer's forward calls it.

    kind "joint" (Flux double and single blocks, SD3 joint blocks): (context, hidden) = block(hidden, context, temb
    [, rotary]); kind "wan": hidden = block(hidden, context, timestep_proj, rotary)."""

    def __init__(self, block: nn.Module, kind: str, rotary: bool):
        super().__init__()
        self.block, self.kind, self.rotary = block, kind, rotary
        self._find_tuners()

    def forward(self, x: Activation) -> Activation:
        x = Activation(*x)
        set_adapters(self, x.adapters)
        rotary = None if x.rotary is None else tuple(detached(t) for t in x.rotary)
        if self.kind == "wan":
            return x._replace(hidden=self.block(x.hidden, x.context, x.block_temb, rotary))
        kwargs: dict[str, Any] = {"image_rotary_emb": rotary} if self.rotary else {}
        context, hidden = self.block(hidden_states=x.hidden, encoder_hidden_states=x.context, temb=x.temb, **kwargs)
        return x._replace(hidden=hidden, context=context)


def cut_layers(transformer: nn.Module) -> list[nn.Module]:
    """The roundpipe layers of a Flux, SD3 or Wan transformer: input layer, one per block, output layer.

    Works on a transformer built on the meta device.  Every parameter of the transformer must be held by
    a layer (a ValueError names the first that is not: e.g. an IP-adapter projection loaded beside it)."""
    from roundpipe.diffusers.presets import family
    kind = family(transformer)
    if kind == "flux":
        layers: list[nn.Module] = [FluxInput(transformer)]
        layers += [Block(b, "joint", True) for b in transformer.transformer_blocks]
        layers += [Block(b, "joint", True) for b in transformer.single_transformer_blocks]
        layers.append(FluxOutput(transformer))
    elif kind == "sd3":
        layers = [SD3Input(transformer), *(Block(b, "joint", False) for b in transformer.transformer_blocks),
                  SD3Output(transformer)]
    else:
        layers = [WanInput(transformer), *(Block(b, "wan", True) for b in transformer.blocks), WanOutput(transformer)]
    covered = {id(p) for layer in layers for p in layer.parameters()}
    for name, p in transformer.named_parameters():
        if id(p) not in covered:
            raise ValueError(f"{type(transformer).__name__}: parameter {name!r} is outside the input embedders, the "
                             "transformer blocks and the output norm/projection that roundpipe cuts the model into, so "
                             "no layer would train it (an IP-adapter or other module added to the transformer is not "
                             "supported)")
    return layers


VERIFIED_DIFFUSERS = "0.42.1"   # the diffusers whose forwards the layers reproduce (tests/diffusers/test_wrap.py)


@torch.no_grad()
def check_forward(transformer: nn.Module, layers: list[nn.Module]) -> None:
    """The layers, run in turn, must give the transformer's own sample on a one-sample forward at the smallest
    size (eval mode, modes restored after): a ValueError otherwise, rather than wrong training later (a diffusers
    whose forward changed, a patched forward or block)."""
    from roundpipe.diffusers.presets import example_inputs, family
    kind = family(transformer)
    dtype = next(transformer.parameters()).dtype
    modes = [(m, m.training) for m in transformer.modules()]
    transformer.eval()
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            inputs = example_inputs(transformer, 1, 16, 16, frames=1 if kind == "wan" else None, dtype=dtype,
                                    text_len=2)
        expected = transformer(**inputs).sample.float()
        x = layers[0](**inputs)
        for layer in layers[1:]:
            x = layer(x)
        got = x.float()
    finally:
        for m, mode in modes:
            m.training = mode
    err = ((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12)).item() \
        if got.shape == expected.shape else float("inf")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if not err <= tol:
        import diffusers
        raise ValueError(f"{type(transformer).__name__}: roundpipe's layers give another output than its own forward "
                         f"(max relative error {err:.2e}) under diffusers {diffusers.__version__} (the layers reproduce "
                         f"{VERIFIED_DIFFUSERS}'s forward); its forward or a block was changed or patched")
