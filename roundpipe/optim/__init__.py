"""Optimizers on the native fused CPU step.

`Adam` / `AdamW`, `SGD`, `Adagrad`, `Lion`: drop-in torch.optim optimizers (state
dicts interchangeable with torch's; Lion has no torch counterpart), and
`Adam8bit` / `AdamW8bit` (moments in bitsandbytes' blockwise 8-bit format), each
with the engine's `step_layer` / `fused_step` (roundpipe/optim/base.py).  `adam_step` /
`AdamConfig`: the functional fused Adam step over explicit tensors.  `grad_norm`,
`grad_sumsq`, `clip_coef`, `accumulate_`: the gradient passes around it.
"""
from roundpipe.optim.adagrad import Adagrad, AdagradConfig
from roundpipe.optim.adam import Adam, AdamW
from roundpipe.optim.adam8bit import Adam8bit, Adam8bitConfig, AdamW8bit
from roundpipe.optim.base import FusedOptimizer
from roundpipe.optim.fused import AdamConfig, adam_step
from roundpipe.optim.gradients import accumulate_, clip_coef, grad_norm, grad_sumsq
from roundpipe.optim.lion import Lion, LionConfig
from roundpipe.optim.sgd import SGD, SGDConfig

__all__ = ["Adam", "AdamW", "Adam8bit", "AdamW8bit", "SGD", "Adagrad", "Lion", "FusedOptimizer", "AdamConfig",
           "Adam8bitConfig", "SGDConfig", "AdagradConfig", "LionConfig", "adam_step", "grad_norm", "grad_sumsq", "clip_coef", "accumulate_"]
