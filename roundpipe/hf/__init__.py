"""Hugging Face models in one call: `rp.hf.wrap(hf_model)`, `rp.hf.from_pretrained(dir)`, `rp.hf.Trainer`.

Names load lazily (this package imports transformers only when a function that needs it runs):
roundpipe/hf/model.py (wrap, from_pretrained, HFRoundPipe), presets.py (where a model's parts
are), layers.py (the layers a decoder is cut into), loss.py (HF's token-weighted loss),
trainer.py (the transformers.Trainer subclass and its mixin for other Trainers), trainer_optim.py (the
Trainer's optimizer as roundpipe.optim), context.py (max_seq_len: the longest sequence that trains
under a device-memory cap, by the planner's memory model).
"""
from __future__ import annotations

from roundpipe.core.lazy import lazy_module

_LAZY = {
    "wrap": "roundpipe.hf.model",
    "from_pretrained": "roundpipe.hf.model",
    "HFRoundPipe": "roundpipe.hf.model",
    "PRESETS": "roundpipe.hf.presets",
    "Trainer": "roundpipe.hf.trainer",
    "TrainerMixin": "roundpipe.hf.trainer",
    "max_seq_len": "roundpipe.hf.context",
    "ContextFit": "roundpipe.hf.context",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_module(__name__, _LAZY, globals())
