"""`wrap`: a diffusers Flux, SD3 or Wan transformer as a RoundPipe, with diffusers' names, files and adapters.

    model = rp.diffusers.wrap(transformer, devices=["cpu", "cpu"])
    noisy, target = rp.diffusers.flow_matching_inputs(latents, noise, sigmas)
    loss = model.forward_backward(hidden_states=noisy, timestep=sigmas, encoder_hidden_states=text,
                                  pooled_projections=pooled, img_ids=img_ids, txt_ids=txt_ids, target=target)
    model.step(optimizer)
    sample = model(hidden_states=noisy, ...)          # the transformer's output, on the CPU
    model.save_lora_weights(out_dir)                  # diffusers' LoRA file (FluxPipeline.load_lora_weights reads it)

The transformer is cut into its input embedders, one layer per block and its output head (layers.py), which
hold its own modules: `named_parameters()`, `state_dict()` and `save_pretrained()` are the transformer's.

What is split into microbatches is decided by name, never by size (presets.FAMILIES): the per-sample
arguments (hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance, ...) along dim 0, and
the rest (Flux's img_ids and txt_ids) passed whole to every microbatch, whatever their length: the engine's
default rule would split any tensor whose dim 0 equals the batch size.  The labels (target, weighting) are
per sample.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from roundpipe.core.tree import tree_map
from roundpipe.diffusers.layers import VERIFIED_DIFFUSERS, check_forward, cut_layers
from roundpipe.diffusers.presets import FAMILIES, Family, family
from roundpipe.diffusers.train import diffusion_loss
from roundpipe.engine.calls.microbatch import even_sizes
from roundpipe.engine.config import EngineConfig, check_wrap_options
from roundpipe.engine.data_parallel import launched_group
from roundpipe.engine.model import RoundPipe
from roundpipe.hf.layers import adapter_state, is_tuner

# engine options wrap sets itself, and why
_FIXED = {"split_fn": "microbatches are split by argument name",
          "loss_reduction": "the loss is the mean over samples"}


class SampleSplit:
    """The engine's split_fn for one family: per-sample arguments and every label along dim 0 into
    `even_sizes` pieces, the others whole (the call's kwargs come checked and ordered, hidden_states first, so
    the engine reads each microbatch's size from it)."""

    def __init__(self, fam: Family):
        self.per_sample = frozenset(fam.per_sample)

    def __call__(self, args: tuple, kwargs: dict, labels: Any, num: int) -> list:
        batch = kwargs["hidden_states"].shape[0]
        sizes = even_sizes(batch, num)
        pieces = {k: torch.split(v, sizes) for k, v in kwargs.items()
                  if k in self.per_sample and isinstance(v, torch.Tensor)}
        cut: dict[int, tuple] = {}

        def split_label(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                cut[id(t)] = torch.split(t, sizes)
            return t
        tree_map(split_label, labels)
        parts = []
        for m in range(len(sizes)):
            kw = {k: pieces[k][m] if k in pieces else v for k, v in kwargs.items()}
            lab = tree_map(lambda t: cut[id(t)][m] if isinstance(t, torch.Tensor) else t, labels)
            parts.append((args, kw, lab))
        return parts


def _diffusers_version() -> str:
    import diffusers
    return diffusers.__version__


def _shape(v: Any) -> str:
    return f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


class DiffusersRoundPipe(RoundPipe):
    """A RoundPipe over a diffusers diffusion transformer (built by `wrap`); diffusers' names and files."""

    def __init__(self, transformer: nn.Module, devices=None, num_microbatches: int | None = None,
                 compute_dtype: torch.dtype | None = None, plan=None, *, check: bool | None = None,
                 **roundpipe_kwargs):
        check_wrap_options("rp.diffusers.wrap", "transformer", "a diffusers transformer", transformer,
                           roundpipe_kwargs, _FIXED, ("check",))
        kind = family(transformer)   # TypeError for another class
        if check is not None and not isinstance(check, bool):
            raise TypeError(f"check must be True, False or None, got {check!r}")
        if "process_group" not in roundpipe_kwargs:   # launched by torchrun: the ranks train together
            roundpipe_kwargs["process_group"] = launched_group("rp.diffusers.wrap")
        self.family = kind
        self._fam = FAMILIES[kind]
        config = EngineConfig(devices=devices, num_microbatches=num_microbatches, compute_dtype=compute_dtype,
                              plan=plan, split_fn=SampleSplit(self._fam), loss_reduction="mean", **roundpipe_kwargs)
        layers = cut_layers(transformer)
        if check or (check is None and _diffusers_version() != VERIFIED_DIFFUSERS):
            check_forward(transformer, layers)
        self.transformer = transformer
        self._tuners = [(n, m) for n, m in transformer.named_modules() if is_tuner(m)]
        super().__init__(layers, config=config)

    @property
    def config(self):
        return self.transformer.config

    @property
    def _owner(self) -> nn.Module:
        return self.transformer

    # ---- calls
    def _inputs(self, kwargs: dict) -> dict:
        """The first layer's keyword arguments of one call, checked: the per-sample ones first (hidden_states
        leading), then those passed whole, then the adapter state."""
        fam, name = self._fam, type(self.transformer).__name__
        refused = [k for k in kwargs if k in fam.refused]
        if refused:
            raise TypeError(f"{name}'s argument {refused[0]!r} is not supported by rp.diffusers (controlnet residuals, "
                            "attention kwargs, skipped layers and return_dict change the forward our layers reproduce); "
                            "call without it (the output is the sample tensor)")
        unknown = sorted(set(kwargs) - set(fam.per_sample) - set(fam.whole))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; a wrapped {name} takes "
                            f"{', '.join(fam.per_sample + fam.whole)} (and target, weighting, loss_fn in training)")
        missing = [k for k in fam.required if kwargs.get(k) is None]
        if missing:
            raise ValueError(f"{missing[0]} is missing (None); a wrapped {name} needs {', '.join(fam.required)}")
        hidden = kwargs["hidden_states"]
        dims = {"flux": 3, "sd3": 4, "wan": 5}[self.family]
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != dims or not hidden.is_floating_point():
            raise ValueError(f"hidden_states must be a floating tensor of {dims} dims (batch first), got {_shape(hidden)}")
        batch = hidden.shape[0]
        for k in fam.per_sample:
            v = kwargs.get(k)
            if v is not None and (not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch):
                raise ValueError(f"{k} is split per sample, so its dim 0 must be the batch ({batch}), got {_shape(v)}; "
                                 "give one row per sample (a timestep: timestep.expand(batch))")
        if self.family == "flux":
            self._check_flux(kwargs, batch)
        out = {k: kwargs[k] for k in fam.per_sample if kwargs.get(k) is not None}
        out.update({k: kwargs[k] for k in fam.whole if k in kwargs})
        out["adapters"] = adapter_state(self._tuners)
        return out

    def _check_flux(self, kwargs: dict, batch: int) -> None:
        guided = bool(self.config.guidance_embeds)
        if guided != (kwargs.get("guidance") is not None):
            raise ValueError(f"guidance must be {'a tensor [batch]' if guided else 'None'}: this Flux transformer has "
                             f"guidance_embeds={guided}")
        for k, tokens in (("img_ids", kwargs["hidden_states"].shape[1]),
                          ("txt_ids", kwargs["encoder_hidden_states"].shape[1])):
            v = kwargs[k]
            if not isinstance(v, torch.Tensor) or v.dim() not in (2, 3) or v.shape[-2] != tokens:
                raise ValueError(f"{k} must be a tensor [{tokens}, n_axes] (one row per token, passed whole to every "
                                 f"microbatch), got {_shape(v)}")

    def output_shape(self, inputs: dict) -> tuple[int, ...]:
        """The shape of the transformer's sample for these (checked) inputs."""
        cfg, h = self.config, inputs["hidden_states"]
        channels = cfg.out_channels or cfg.in_channels
        if self.family == "flux":
            return (*h.shape[:2], cfg.patch_size ** 2 * channels)
        return (h.shape[0], channels, *h.shape[2:])

    def forward_backward(self, target: torch.Tensor | None = None, *, weighting: torch.Tensor | None = None,
                         loss_fn: Callable | None = None, return_outputs: bool = False,
                         num_microbatches: int | None = None, recompute: str | None = None, **inputs) -> Any:
        """The loss of the batch and its gradients (accumulated into p.grad until step()).

        inputs: the transformer's forward arguments (hidden_states, timestep, ...); target: what the output
        should be (train.flow_matching_inputs), per sample; weighting: per-sample loss weights [batch] or a tensor
        broadcastable to the target.  The loss is train.diffusion_loss (the mean over samples of the mean squared
        error over latents), or loss_fn(output, labels) with labels the target (a dict {"target", "weighting"}
        when weighting is given) of the microbatch, a mean over its samples.  return_outputs, num_microbatches and
        recompute: as RoundPipe.forward_backward takes them."""
        inputs = self._inputs(inputs)
        batch = inputs["hidden_states"].shape[0]
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"target must be a tensor [batch, ...] (what the output should be), got {_shape(target)}")
        expected = self.output_shape(inputs)
        if target.shape[0] != batch or (loss_fn is None and tuple(target.shape) != expected):
            raise ValueError(f"target has shape {tuple(target.shape)}, the transformer's output will have {expected}"
                             + ("" if loss_fn is None else " (dim 0 must be the batch)"))
        if weighting is not None and (not isinstance(weighting, torch.Tensor) or weighting.dim() == 0
                                      or weighting.shape[0] != batch):
            raise ValueError(f"weighting must be a tensor with the batch ({batch}) along dim 0, got {_shape(weighting)}")
        labels: Any = target if weighting is None else {"target": target, "weighting": weighting}
        return super().forward_backward(labels=labels, loss_fn=diffusion_loss if loss_fn is None else loss_fn,
                                        return_outputs=return_outputs, num_microbatches=num_microbatches,
                                        recompute=recompute, **inputs)

    def __call__(self, *, num_microbatches: int | None = None, recompute: str | None = None, **inputs) -> torch.Tensor:
        """The transformer's sample on the CPU (`transformer(**inputs).sample`): forward only, or under autograd a
        node of the caller's graph (RoundPipe.__call__)."""
        return super().__call__(num_microbatches=num_microbatches, recompute=recompute, **self._inputs(inputs))

    forward = __call__

    # ---- files
    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """The transformer's save_pretrained (diffusers' names, safetensors) with the masters as they are after
        every pending step."""
        self.synchronize()
        self.transformer.save_pretrained(save_directory, **kwargs)

    def lora_state_dict(self, adapter_name: str = "default") -> dict[str, torch.Tensor]:
        """The adapter's weights as PEFT names them (get_peft_model_state_dict), after every pending step."""
        from peft.utils import get_peft_model_state_dict
        self.synchronize()
        if adapter_name not in getattr(self.transformer, "peft_config", {}):
            raise ValueError(f"adapter_name={adapter_name!r}: the transformer has no such adapter (has "
                             f"{sorted(getattr(self.transformer, 'peft_config', {}))}); add one with "
                             "transformer.add_adapter(LoraConfig(...)) before wrapping")
        return get_peft_model_state_dict(self.transformer, adapter_name=adapter_name)

    def save_lora_weights(self, save_directory: str | os.PathLike, adapter_name: str = "default", **kwargs) -> None:
        """The adapter in diffusers' LoRA file (the family's pipeline save_lora_weights, with the LoraConfig as
        metadata so that rank and alpha load back): FluxPipeline / StableDiffusion3Pipeline / WanPipeline
        .load_lora_weights(save_directory), or transformer.load_lora_adapter, read it."""
        from diffusers.loaders import FluxLoraLoaderMixin, SD3LoraLoaderMixin, WanLoraLoaderMixin
        loader = {"flux": FluxLoraLoaderMixin, "sd3": SD3LoraLoaderMixin, "wan": WanLoraLoaderMixin}[self.family]
        layers = self.lora_state_dict(adapter_name)
        metadata = self.transformer.peft_config[adapter_name].to_dict()
        loader.save_lora_weights(save_directory, transformer_lora_layers=layers,
                                 transformer_lora_adapter_metadata=metadata, **kwargs)


def wrap(transformer: nn.Module, devices=None, num_microbatches: int | None = None,
         compute_dtype: torch.dtype | None = None, plan=None, *, check: bool | None = None,
         **roundpipe_kwargs: Any) -> DiffusersRoundPipe:
    """A RoundPipe over a diffusers FluxTransformer2DModel, SD3Transformer2DModel or WanTransformer3DModel (with
    or without a PEFT adapter: transformer.add_adapter(LoraConfig(...))).

    The transformer must be on the CPU; it becomes the host master (trainable parameters fp32 in place).
    roundpipe_kwargs are RoundPipe's other options (EngineConfig's fields: compute_dtype=torch.bfloat16,
    device_memory, master_dtype, offload_dir, ...), but split_fn and loss_reduction, which wrap sets.  Under
    torchrun (more than one rank) the ranks train data-parallel on the world group unless process_group= says
    otherwise (None: this process alone), joining it first if torch.distributed is not initialized
    (roundpipe.engine.data_parallel.launched_group).

    check: run one tiny forward through the layers and the transformer and refuse (ValueError) a difference;
    None (default): only under a diffusers other than the one the layers reproduce (layers.VERIFIED_DIFFUSERS),
    whose tests hold them equal already (a check of a 12B model is a full pass over its weights on the CPU)."""
    return DiffusersRoundPipe(transformer, devices, num_microbatches, compute_dtype, plan, check=check,
                              **roundpipe_kwargs)
