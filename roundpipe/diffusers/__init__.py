"""Diffusion transformers in one call: `rp.diffusers.wrap(transformer)` (Flux, SD3, Wan).

Names load lazily (this package imports diffusers only when a function that needs it runs):
roundpipe/diffusers/model.py (wrap, DiffusersRoundPipe), presets.py (each family's arguments, what is split and
what is passed whole; example_inputs), layers.py (the layers a transformer is cut into), train.py (the
flow-matching inputs and loss), context.py (max_resolution / max_frames: the largest image or clip that
trains under a device-memory cap, by the planner's memory model) and shapes.py (the published configs).
"""
from __future__ import annotations

from roundpipe.core.lazy import lazy_module

_LAZY = {
    "wrap": "roundpipe.diffusers.model",
    "DiffusersRoundPipe": "roundpipe.diffusers.model",
    "cut_layers": "roundpipe.diffusers.layers",
    "example_inputs": "roundpipe.diffusers.presets",
    "FAMILIES": "roundpipe.diffusers.presets",
    "flow_matching_inputs": "roundpipe.diffusers.train",
    "diffusion_loss": "roundpipe.diffusers.train",
    "max_resolution": "roundpipe.diffusers.context",
    "max_frames": "roundpipe.diffusers.context",
    "DiTFit": "roundpipe.diffusers.context",
    "SHAPES": "roundpipe.diffusers.shapes",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_module(__name__, _LAZY, globals())
