"""`rp.hf.Trainer`: transformers.Trainer whose training step runs on a wrapped model.

    model = rp.hf.wrap(hf_model, devices=["cuda:0", "cuda:1"])      # line 1
    trainer = rp.hf.Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)   # line 2
    trainer.train()

Everything else is the Trainer's own: data loading, gradient accumulation (with HF's
`num_items_in_batch`, so an accumulation group's loss is the token mean over the whole group),
the optimizer and lr scheduler it builds, logging, callbacks, saving.  What changes:

- `training_step` runs `model.forward_backward(**inputs, num_items_in_batch=...)`: the forward and
  backward run on the RoundPipe's workers; the gradients land in the HF model's `p.grad` (the
  masters are the HF model's parameters).
- the optimizer's `step()` runs as `model.step(optimizer's own step, asynchronous=False)`: the
  update is synchronous, so training equals transformers.Trainer's on the same model exactly,
  lr scheduler and all (the one-step-stale asynchronous step is not used here).
- gradient clipping and the logged gradient norm read `p.grad` after `model.synchronize()`.
- saving goes through the HF model's `save_pretrained` (a PEFT model writes its adapter).
- under torchrun the wrapped model trains data-parallel on the world group (docs/data_parallel.md);
  the weights then equal transformers.Trainer's with DDP, with or without average_tokens_across_devices.
- the batches stay on the CPU: TrainingArguments must resolve to the CPU device
  (`use_cpu=True` on a machine with GPUs); the GPUs are the RoundPipe's workers.

Evaluation and prediction run the HF model itself on the host masters (plain PyTorch on the CPU).
"""
from __future__ import annotations

import torch
import transformers

from roundpipe.hf.loss import count_items, shift_labels
from roundpipe.hf.model import HFRoundPipe


class Trainer(transformers.Trainer):
    """transformers.Trainer training an `rp.hf.wrap`-ped model on its workers."""

    def __init__(self, model: HFRoundPipe = None, args: transformers.TrainingArguments = None, **kwargs):
        if not isinstance(model, HFRoundPipe):
            raise TypeError(f"model must be a model wrapped by rp.hf.wrap(hf_model), got {type(model).__name__}")
        if args is not None and args.device.type != "cpu":
            raise ValueError(f"TrainingArguments resolve to device {args.device}; pass use_cpu=True: the batches stay "
                             "in host memory and the RoundPipe's workers are the GPUs")
        self.rp_model = model
        super().__init__(model=model.hf_model, args=args, **kwargs)
        self.place_model_on_device = False

    def _move_model_to_device(self, model, device) -> None:
        """The HF model is the RoundPipe's host master: it stays where it is."""

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, its step() routed through the RoundPipe (G-copies, update, upload copies)."""
        optimizer = super().create_optimizer(model)
        if not getattr(optimizer, "_roundpipe_routed", False):
            own_step = optimizer.step
            rp_model = self.rp_model

            def step(closure=None):
                if closure is not None:
                    raise ValueError("rp.hf.Trainer: an optimizer step with a closure cannot run on a RoundPipe")
                rp_model.step(lambda: own_step(), asynchronous=False)
            optimizer.step = step
            optimizer._roundpipe_routed = True
        return optimizer

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        self.rp_model.train()
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        if num_items_in_batch is None and labels is not None:
            # the Trainer then divides each batch's mean loss by the accumulation steps
            num_items_in_batch = count_items(shift_labels(labels)) * self.current_gradient_accumulation_steps
        dp = self.rp_model.dp
        if dp is not None and num_items_in_batch is not None and not getattr(self.args, "average_tokens_across_devices",
                                                                             False):
            # a per-rank count: DDP would average the ranks' means, the RoundPipe sums its ranks' gradients
            num_items_in_batch = num_items_in_batch * dp.world
        loss = self.rp_model.forward_backward(**inputs, num_items_in_batch=num_items_in_batch)
        return loss.detach().to(self.args.device)

    def _clip_grad_norm(self, model):
        self.rp_model.synchronize()   # p.grad of every master, as the Trainer's clipping reads it
        params = [p for p in self.rp_model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            self.rp_model.synchronize()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save(self, output_dir=None, state_dict=None) -> None:
        self.rp_model.synchronize()
        super()._save(output_dir, state_dict=state_dict)
