"""The model a Trainer's own `compute_loss` gets from `rp.hf.TrainerMixin`: the HF model, its calls run by the RoundPipe.

    loss = trainer.compute_loss(EngineModel(rp_model), inputs)   # each model(**kwargs) inside: rp_model(...)
    loss.backward()                                               # lands every gradient, as through the HF model

The mixin's fast path, `forward_backward` with the fused loss on the workers, trains the causal-LM loss only, so it
is taken only where compute_loss is known to be that loss (roundpipe/hf/trainer.py).  Any other compute_loss (TRL's
DPO and KTO, a subclass's own, label smoothing) is called as transformers calls it, with this view as its model:

- `model(input_ids=, attention_mask=, position_ids=, labels=, ...)` is a call of the RoundPipe, `rp_model(...)`:
  its logits [B, T, V] (on the host), and under autograd (grad enabled, the model in train()) a node of the caller's
  graph whose backward lands every parameter's gradient as HF's forward would, adding to other calls' until the
  step (a composed call: roundpipe/engine/calls/composed.py).  From the logits the view builds what the HF model
  returns: HF's CausalLMOutputWithPast (the model's own `loss_function` for `labels=`), or with `fused_lm_head=True`
  TRL's FusedCausalLMOutput (`fused_output`: log_probs, entropy, ... under the settings trl's add_fused_lm_head gave
  the model).
- every other attribute is the HF model's (config, peft_config, disable_adapter, ...).  A reference forward through
  the trainer's own `self.model` (DPO's and KTO's with the PEFT adapter disabled) runs the HF model itself, on the
  host.

Measured on CPU workers against TRL and transformers run on the same model (fp32): trl.DPOTrainer and KTOTrainer with
a LoRA adapter, and SFTTrainer with loss_type="dft", log every metric TRL logs (losses, rewards, log-probabilities,
entropy, token accuracy) within 1e-4 and train the same weights (tests/hf/test_trainer_mixin_trl.py); a subclass's
own loss, label smoothing and compute_loss_func train as under transformers.Trainer (tests/hf/test_trainer_own_loss.py);
ORPO and GRPO with a LoRA adapter log every metric within 1e-4 (tests/hf/test_trainer_mixin_rl.py).

Cost, a composed call's: forward_backward plus one forward of the model (by FLOP count a third more), and the logits
and their gradient, [B, T, V] each, cross between host and workers (forward_backward's fused loss never builds them).
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from roundpipe.hf.loss import IGNORE_INDEX
from roundpipe.hf.presets import causal_lm

if TYPE_CHECKING:
    from roundpipe.hf.model import HFRoundPipe

# what trl's add_fused_lm_head closes over in the forward it gives the model (trl/trainer/utils.py)
FUSED_HEAD_SETTINGS = ("temperature", "outputs", "final_logit_softcapping", "logit_scale")
# HF forward arguments with nothing to do here: no cache is kept, and the output is always a ModelOutput's content
INERT = ("use_cache", "cache_position", "output_attentions", "output_hidden_states")


def fused_head_settings(lm) -> tuple:
    """(temperature, outputs, final_logit_softcapping, logit_scale) of the forward trl's add_fused_lm_head gave lm."""
    forward = getattr(lm.forward, "__func__", None)
    found = inspect.getclosurevars(forward).nonlocals if inspect.isfunction(forward) else {}
    missing = [k for k in FUSED_HEAD_SETTINGS if k not in found]
    if missing:
        raise ValueError(f"fused_lm_head=True, but {type(lm).__name__}'s forward is not the one trl's add_fused_lm_head "
                         f"gives it (it holds no {', '.join(missing)}); call trl.trainer.utils.add_fused_lm_head(model) "
                         "before training, or call the model without fused_lm_head")
    return tuple(found[k] for k in FUSED_HEAD_SETTINGS)


def fused_output(lm, logits: torch.Tensor, labels, shift_labels, num_items_in_batch):
    """TRL's FusedCausalLMOutput from the logits [B, T, V]: what its fused head computes from the hidden states and
    the head weight in tiles (trl/kernels/chunked_logprob.py), here over the whole logits; every per-token field
    zero where the label is -100."""
    from trl.trainer.utils import FusedCausalLMOutput
    temperature, outputs, softcap, scale = fused_head_settings(lm)
    if shift_labels is None:
        if labels is None:
            raise ValueError("fused_lm_head=True needs labels= (or shift_labels=): it scores each next-token label")
        logits, targets = logits[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    mask = targets != IGNORE_INDEX
    z = logits * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_z = torch.logsumexp(z, dim=-1)
    log_probs = (z.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) - log_z).masked_fill(~mask, 0)
    entropy = None
    if "entropy" in outputs:
        entropy = (log_z - (torch.softmax(z, dim=-1) * z).sum(-1)).masked_fill(~mask, 0)
    with torch.no_grad():   # TRL's are without gradient too
        log_sum_sq_probs = ((torch.logsumexp(2 * z, dim=-1) - 2 * log_z).masked_fill(~mask, 0)
                            if "log_sum_sq_probs" in outputs else None)
        mean_logits = z.mean(-1).masked_fill(~mask, 0) if "mean_logits" in outputs else None
        is_top1 = (z.argmax(-1) == targets) & mask if "is_top1" in outputs else None   # argmax: the first maximum
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                               log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits, is_top1=is_top1,
                               label_mask=mask)


def causal_lm_output(lm, logits: torch.Tensor, labels, shift_labels, num_items_in_batch, logits_to_keep):
    """HF's CausalLMOutputWithPast from the logits, as the model's forward makes it (logits_to_keep, loss_function)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = logits[:, keep]
    loss = None
    if labels is not None:
        kwargs = {k: v for k, v in (("num_items_in_batch", num_items_in_batch), ("shift_labels", shift_labels))
                  if v is not None}
        loss = lm.loss_function(logits=logits, labels=labels, vocab_size=lm.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


class EngineModel:
    """The HF model as a Trainer's compute_loss calls it, each call run by the RoundPipe (module docstring); every
    other attribute is the HF model's."""

    def __init__(self, rp_model: HFRoundPipe):
        self.rp_model = rp_model
        self.lm = causal_lm(rp_model.hf_model)

    def __getattr__(self, name: str) -> Any:
        if name in ("rp_model", "lm"):   # not set yet (a copy being built): no recursion through the HF model
            raise AttributeError(name)
        return getattr(self.rp_model.hf_model, name)

    def _get_name(self) -> str:
        """The causal LM's class name (transformers.Trainer's label smoother shifts the labels of causal LMs)."""
        return self.lm._get_name()

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, *, shift_labels=None,
                 num_items_in_batch=None, logits_to_keep=0, fused_lm_head: bool = False, return_dict=None,
                 output_router_logits=None, **other):
        """What the HF model returns for these arguments (a ModelOutput, or its tuple with return_dict=False)."""
        extra = sorted(k for k, v in other.items() if k not in INERT and v is not None)
        if extra:
            raise TypeError(f"unexpected keyword argument(s) {extra}; the model compute_loss gets (the RoundPipe's view "
                            "of the HF model) takes input_ids, attention_mask, position_ids, labels, shift_labels, "
                            "num_items_in_batch, logits_to_keep, return_dict and TRL's fused_lm_head")
        if output_router_logits or getattr(self.lm.config, "output_router_logits", False):
            raise ValueError("output_router_logits: a compute_loss of its own cannot have the router loss yet (a call of "
                             "the RoundPipe returns the logits only); set "
                             "config.output_router_logits=False, or train with the causal-LM loss (forward_backward)")
        logits = self._logits(input_ids, attention_mask, position_ids)
        if fused_lm_head:
            out = fused_output(self.lm, logits, labels, shift_labels, num_items_in_batch)
        else:
            out = causal_lm_output(self.lm, logits, labels, shift_labels, num_items_in_batch, logits_to_keep)
        return out.to_tuple() if return_dict is False else out

    forward = __call__

    def _logits(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """The logits [B, T, V] of rp_model(...), fp32; under autograd a node of the caller's graph."""
        logits = self.rp_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).float()
        dp = self.rp_model.dp
        if logits.requires_grad and dp is not None and dp.world > 1:
            # the engine sums the ranks' gradients (loss_reduction="sum"); DDP, which the Trainer's loss expects,
            # averages them
            logits.register_hook(lambda grad: grad / dp.world)
        return logits
