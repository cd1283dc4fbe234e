"""`rp.hf.Trainer`: transformers.Trainer whose training step runs on a RoundPipe.

    trainer = rp.hf.Trainer(model=hf_model, args=args, train_dataset=ds, data_collator=collator)   # one line
    trainer.train()

`model` is a transformers causal LM, a PEFT model around one (both wrapped here with
`rp.hf.wrap(model, devices, **wrap_kwargs)`: every keyword wrap takes, roundpipe.hf.model.WRAP_OPTIONS,
goes to it, any other to the Trainer) or an `rp.hf.wrap`-ped model.  Everything else is the
Trainer's own: data loading, gradient accumulation (with HF's `num_items_in_batch`, so an
accumulation group's loss is the token mean over the whole group), parameter groups, the lr
schedule, logging, callbacks, saving.  What changes:

- `training_step` runs `model.forward_backward(**inputs, num_items_in_batch=...)` on the workers (the fused loss)
  where compute_loss is known to be the causal-LM loss (`trains_lm_loss`: transformers.Trainer's and
  trl.SFTTrainer's "nll", without label smoothing or compute_loss_func); any other compute_loss (TRL's DPO, KTO, a
  subclass's own) runs in the Trainer's own training_step with the RoundPipe as its model, each `model(...)` in it
  a RoundPipe call inside the loss's autograd graph (roundpipe/hf/trainer_model.py: a third more FLOPs, and the
  logits cross to the host).  The batches stay on the CPU whatever `args.device` says (the Trainer gets a copy of
  `args` with `use_cpu=True`: the GPUs are the RoundPipe's workers).
- the Trainer's arguments are bound to its own __init__'s signature: `args` is passed on by name (TRL's
  DPOTrainer and KTOTrainer take ref_model second, GRPOTrainer reward_funcs).
- the optimizer: `adamw_torch`, `adamw_torch_fused`, `sgd`, `adagrad`, `lion_32bit` become their
  roundpipe.optim versions over the Trainer's parameter groups (roundpipe/hf/trainer_optim.py) and
  run the per-layer fused step; any other optimizer runs as one torch step (with a warning).  The
  step is `model.step(optimizer, asynchronous=, max_grad_norm=args.max_grad_norm, lr_scheduler=)`.
- `asynchronous=False` (default): the update is applied when the step returns, and training equals
  transformers.Trainer's on the same model (tests/test_hf_trainer*.py).  `asynchronous=True`: the
  one-step-stale step (docs/staleness.md), the update overlapping the next step's forward; the
  logged `grad_norm` is then left out (it is known only on the host thread; reading it would be a
  sync point per step).
- `bf16=True` / `fp16=True` become the precision policy (compute_dtype bf16 / fp16 with autocast,
  fp16 with the engine's dynamic loss scaling); the Trainer's copy of `args` has them off so that
  accelerate adds no autocast or GradScaler of its own.  Neither: fp32, as transformers trains.
- HF's gradient checkpointing (`gradient_checkpointing=True`, SFTConfig's default) is turned off, with one
  line: the engine's backward stages recompute the forward already (roundpipe.hf.model.checkpointing_off).
- the model is wrapped after the Trainer's own __init__, so that an adapter it adds (TRL's `peft_config=`)
  is what the RoundPipe trains.
- checkpoints (`save_steps`, `resume_from_checkpoint`) hold a `roundpipe/` folder written by
  `model.save_checkpoint` (masters, optimizer, schedule, RNG): a resumed run equals an
  uninterrupted one bit for bit.
- under torchrun the model trains data-parallel on the world group (docs/data_parallel.md); the
  weights and the logged loss equal transformers.Trainer's with DDP.

Evaluation and prediction run the HF model itself on the host masters (plain PyTorch on the CPU),
after a sync point.  `TrainerMixin` carries all of it for other Trainer subclasses (TRL's):
`class SFT(rp.hf.TrainerMixin, trl.SFTTrainer)`.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import typing
import warnings

import torch
import transformers
from torch import nn

from roundpipe.hf import trainer_optim
from roundpipe.hf.loss import count_items, shift_labels
from roundpipe.hf.model import WRAP_OPTIONS, HFRoundPipe, checkpointing_off, wrap
from roundpipe.hf.trainer_model import EngineModel

CHECKPOINT_DIR = "roundpipe"   # the engine's checkpoint inside a Trainer checkpoint folder
# TrainingArguments' switches for HF's gradient checkpointing (transformers 5.x's name first, then its old alias)
CHECKPOINTING_ARGS = ("activation_checkpointing", "gradient_checkpointing")
# (derived, source): a config field that __post_init__ derives from another and refuses alongside it once both are set
# (TRL's GRPOConfig and RLOOConfig derive generation_batch_size from steps_per_generation or the reverse)
DERIVED_ARGS = (("generation_batch_size", "steps_per_generation"),)


def precision_of(args) -> torch.dtype:
    """The compute dtype TrainingArguments ask for: bf16, fp16, else fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def trainer_signature(cls: type) -> inspect.Signature:
    """The signature (less self) of the first __init__ after TrainerMixin in cls's MRO that names `model` and `args`
    (one that only passes *args, **kwargs on is looked through)."""
    after = cls.__mro__[cls.__mro__.index(TrainerMixin) + 1:]
    for c in after:
        if "__init__" in vars(c):
            sig = inspect.signature(c.__init__)
            if {"model", "args"} <= set(sig.parameters):
                return sig.replace(parameters=list(sig.parameters.values())[1:])
    raise TypeError(f"{cls.__name__}: no __init__ after rp.hf.TrainerMixin takes `model` and `args`; put the mixin in "
                    "front of a transformers.Trainer subclass: class T(rp.hf.TrainerMixin, SomeTrainer)")


def default_args(signature: inspect.Signature):
    """args=None: the Trainer's own config class (its `args` annotation: TRL's DPOConfig, ...; else
    TrainingArguments) with output_dir "tmp_trainer", and use_cpu=True as the Trainer's copy has it anyway (TRL's
    configs default to bf16=True, which TrainingArguments refuses on a host without a GPU otherwise)."""
    annotation = signature.parameters["args"].annotation
    for cls in (annotation, *typing.get_args(annotation)):
        if isinstance(cls, type) and issubclass(cls, transformers.TrainingArguments):
            return cls(output_dir="tmp_trainer", use_cpu=True)
    return transformers.TrainingArguments(output_dir="tmp_trainer", use_cpu=True)


def changed_args(args, changes: dict):
    """A copy of args with changes, its __post_init__ run again (the device, mixed precision and pin memory follow
    use_cpu and bf16); a field derived from another is left for it to derive again, to the same value."""
    cleared = {d: None for d, src in DERIVED_ARGS if getattr(args, d, None) is not None
               and getattr(args, src, None) is not None}
    return dataclasses.replace(args, **cleared, **changes)


def _engine_clears_grads(*args, **kwargs) -> None:
    """model.zero_grad() inside the Trainer's loop: the engine clears the gradients after the step read them
    (and in the asynchronous step it may still be reading them)."""


class TrainerMixin:
    """The RoundPipe side of `rp.hf.Trainer`, for any transformers.Trainer subclass:
    `class SFT(rp.hf.TrainerMixin, trl.SFTTrainer)`."""

    def __init__(self, *trainer_args, devices=None, asynchronous: bool = False, **kwargs):
        if not isinstance(asynchronous, bool):
            raise TypeError(f"asynchronous must be True or False, got {asynchronous!r}")
        # rp.hf.wrap's keywords (every engine option, and quantize, double_quant) go to it, the rest to the Trainer
        wrap_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in WRAP_OPTIONS}
        # bound to the Trainer's own signature: TRL's DPOTrainer and KTOTrainer take ref_model second, GRPO
        # reward_funcs, so args is found by its name wherever it stands and passed on where that signature wants it
        signature = trainer_signature(type(self))
        bound = signature.bind_partial(*trainer_args, **kwargs)
        model, args = bound.arguments.get("model"), bound.arguments.get("args")
        if args is None:
            args = default_args(signature)
        peft_config = bound.arguments.get("peft_config", kwargs.get("peft_config"))
        wrapped = self._checked(model, args, devices, wrap_kwargs, peft_config)
        self.asynchronous = asynchronous
        self._engine_scheduler = None
        self._issued_lr: float | None = None
        self._engine_model: EngineModel | None = None
        # HF's gradient checkpointing gives way to the engine's recompute (model.checkpointing_off): one line says so
        asked = [k for k in CHECKPOINTING_ARGS if getattr(args, k, None)]
        hf_model = model.hf_model if wrapped else model
        if asked or not wrapped:
            checkpointing_off(hf_model, f"TrainingArguments({asked[-1]}=True)" if asked else None)
        # the Trainer's copy: batches on the CPU, no autocast/GradScaler of accelerate's (the policy does it), and
        # no checkpointing for Trainer.train (or TRL) to turn on
        changes = {k: v for k, v in (("use_cpu", True), ("bf16", False), ("fp16", False)) if getattr(args, k) != v}
        changes.update({k: False for k in CHECKPOINTING_ARGS if hasattr(args, k)} if asked else {})
        bound.arguments["model"] = hf_model
        bound.arguments["args"] = changed_args(args, changes) if changes else args
        super().__init__(*bound.args, **bound.kwargs)
        self.place_model_on_device = False
        if wrapped:
            self.rp_model = model
        else:
            # wrapped after the Trainer's __init__: TRL's peft_config= puts its adapter around the model there
            # (SFTTrainer.__init__, seeded by args.seed), and the RoundPipe must train that adapter.  The RNG is
            # left as the Trainer's set_seed left it, so that shuffling and dropout are transformers.Trainer's.
            with torch.random.fork_rng(devices=[]):
                self.rp_model = wrap(self.model, devices, **wrap_kwargs)

    @staticmethod
    def _checked(model, args, devices, wrap_kwargs: dict, peft_config) -> bool:
        """Checks model and the wrap options against args before the Trainer's __init__ runs (which would load a
        string as a hub id); sets wrap_kwargs' compute_dtype from bf16/fp16.  True when model is wrapped already."""
        dtype = precision_of(args)
        flag = "bf16=True" if args.bf16 else "fp16=True" if args.fp16 else None
        if isinstance(model, HFRoundPipe):
            if devices is not None or wrap_kwargs:
                raise TypeError(f"model is already wrapped by rp.hf.wrap; give devices/{sorted(wrap_kwargs)} to "
                                "rp.hf.wrap, or pass the unwrapped model here")
            if peft_config is not None:
                raise TypeError("peft_config= with a model already wrapped by rp.hf.wrap: the adapter would be put "
                                "around the model after the RoundPipe was built; pass the unwrapped model (wrapped "
                                "here after the adapter), or wrap peft.get_peft_model(model, peft_config)")
            if flag is not None and model.compute_dtype != dtype:
                raise ValueError(f"TrainingArguments({flag}) but the wrapped model computes in {model.compute_dtype}; "
                                 f"wrap it with compute_dtype={dtype}, or pass the unwrapped model here")
            return True
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a transformers causal LM, a PEFT model around one or a model wrapped by "
                            f"rp.hf.wrap, got {type(model).__name__}")
        given = wrap_kwargs.get("compute_dtype") or getattr(wrap_kwargs.get("precision"), "compute_dtype", None)
        if given is None:
            wrap_kwargs["compute_dtype"] = dtype
        elif flag is not None and given != dtype:
            raise ValueError(f"TrainingArguments({flag}) and compute_dtype={given} disagree; give one of them")
        return False

    def _move_model_to_device(self, model, device) -> None:
        """The HF model is the RoundPipe's host master: it stays where it is."""

    # ---- the optimizer, its scheduler and the step
    def create_optimizer(self, model=None):
        """The Trainer's optimizer (its roundpipe.optim version where there is one), its step() routed
        through `model.step`."""
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            self.optimizer_cls_and_kwargs = trainer_optim.fused_cls_and_kwargs(
                self.args, self.model if model is None else model)
            try:
                optimizer = super().create_optimizer(model)
            finally:
                self.optimizer_cls_and_kwargs = None
        else:
            optimizer = super().create_optimizer(model)
        if not getattr(optimizer, "_roundpipe_routed", False):
            self._route(optimizer)
        return optimizer

    def _route(self, optimizer) -> None:
        from roundpipe.optim import FusedOptimizer
        if isinstance(optimizer, FusedOptimizer):
            target = optimizer   # the engine calls its step_layer, never step()
        else:
            warnings.warn(trainer_optim.routed_warning(self.args, optimizer), stacklevel=3)
            own_step = optimizer.step
            target = lambda: own_step()   # not `own_step`: the patched step() below would recurse

        def step(closure=None):
            if closure is not None:
                raise ValueError("rp.hf.Trainer: an optimizer step with a closure cannot run on a RoundPipe")
            self._engine_step(optimizer, target)
        optimizer.step = step
        optimizer._roundpipe_routed = True
        self._rp_optimizer = optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's scheduler; one stepped once per update is stepped by the engine after that update."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, trainer_optim.SteppedByEngine) and trainer_optim.is_stepwise(scheduler):
            self.lr_scheduler = trainer_optim.SteppedByEngine(scheduler)
        return self.lr_scheduler

    def _engine_lr_scheduler(self):
        sched = self.lr_scheduler
        if not isinstance(sched, trainer_optim.SteppedByEngine):
            return None
        if self._engine_scheduler is None or self._engine_scheduler.scheduler is not sched.scheduler:
            self._engine_scheduler = trainer_optim.EngineScheduler(sched.scheduler, self._rp_optimizer)
        return self._engine_scheduler

    def _engine_step(self, optimizer, target) -> None:
        """The optimizer's step as model.step (not named `_step`: TRL's GRPOTrainer and RLOOTrainer count their
        microbatches in self._step)."""
        scheduler = self._engine_lr_scheduler()
        if scheduler is not None:
            self._issued_lr = trainer_optim.scheduled_lr(scheduler.scheduler, self.state.global_step,
                                                         self.asynchronous)
        clip = self.args.max_grad_norm
        self.rp_model.step(target, asynchronous=self.asynchronous, lr_scheduler=scheduler,
                           max_grad_norm=clip if clip and clip > 0 else None)

    def _get_learning_rate(self) -> float:
        """The rate of the update just issued (the engine may have stepped the scheduler past it already)."""
        if self._issued_lr is not None:
            lr, self._issued_lr = self._issued_lr, None
            return lr
        return super()._get_learning_rate()

    def _clip_grad_norm(self, model):
        """The pre-clip gradient norm; the clipping itself is model.step(max_grad_norm=)'s."""
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        """clip_grad_norm_'s total norm of every p.grad (after a sync point), or None in the asynchronous step."""
        if grad_norm is not None or self.asynchronous:
            return grad_norm
        return self.rp_model.grad_norm()

    # ---- the training loop
    def _run_epoch(self, model, *args, **kwargs):
        model.zero_grad = _engine_clears_grads   # the loop's model (accelerate's DDP wrapper under torchrun)
        try:
            return super()._run_epoch(model, *args, **kwargs)
        finally:
            vars(model).pop("zero_grad", None)

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        self.rp_model.synchronize()   # the last (asynchronous) update applied: the masters are final
        return output

    def trains_lm_loss(self) -> bool:
        """Whether compute_loss is known to be the causal-LM loss, which forward_backward trains on the workers
        (the fast path): transformers.Trainer's and trl.SFTTrainer's (loss_type "nll"), without label smoothing or a
        compute_loss_func.  Any other is called with the RoundPipe as its model (roundpipe/hf/trainer_model.py).  A
        subclass whose own compute_loss is that loss may return True to take the fast path."""
        if self.label_smoother is not None or getattr(self, "compute_loss_func", None) is not None:
            return False
        own = type(self).compute_loss
        if own is transformers.Trainer.compute_loss:
            return True
        sft = sys.modules.get("trl.trainer.sft_trainer")   # loaded when a subclass of it is what runs
        return sft is not None and own is sft.SFTTrainer.compute_loss and getattr(self.args, "loss_type", "nll") == "nll"

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        self.rp_model.train()
        if not self.trains_lm_loss():
            # a loss of its own: the Trainer's step (compute_loss, its scaling for accumulation, backward) with the
            # RoundPipe as the model, each call of it a node of the loss's graph (a composed call)
            if self._engine_model is None:
                self._engine_model = EngineModel(self.rp_model)
            return super().training_step(self._engine_model, inputs, num_items_in_batch)
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        if num_items_in_batch is None and labels is not None:
            # the Trainer then divides each batch's mean loss by the accumulation steps
            num_items_in_batch = count_items(shift_labels(labels)) * self.current_gradient_accumulation_steps
        if num_items_in_batch is not None and float(num_items_in_batch) == 0:
            # no counted token in the accumulation group: a loss of 0 (transformers: 0 / 0 = nan) and the
            # same zero gradients; docs/hf.md, Loss
            num_items_in_batch = 1
        dp = self.rp_model.dp
        world = dp.world if dp is not None and num_items_in_batch is not None else 1
        if world > 1 and not getattr(self.args, "average_tokens_across_devices", False):
            # a per-rank count: DDP would average the ranks' means, the RoundPipe sums its ranks' gradients
            num_items_in_batch = num_items_in_batch * world
        loss = self.rp_model.forward_backward(**inputs, num_items_in_batch=num_items_in_batch)
        # the loss DDP's rank logs: its own sum over the ranks' count times the world (transformers scales it so)
        return (loss * world).detach().to(self.args.device)

    # ---- checkpoints, saving, evaluation
    def _save(self, output_dir=None, state_dict=None) -> None:
        self.rp_model.synchronize()
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (masters, optimizer, schedule, RNG, loss scale) in output_dir/roundpipe."""
        self.rp_model.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self._rp_optimizer,
                                      self._checkpoint_scheduler())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A roundpipe/ folder resumes bit for bit; a plain transformers.Trainer checkpoint loads as it does there."""
        if checkpoint is not None and os.path.isdir(os.path.join(checkpoint, CHECKPOINT_DIR)):
            self.rp_model.load_checkpoint(os.path.join(checkpoint, CHECKPOINT_DIR), self._rp_optimizer,
                                          self._checkpoint_scheduler())
        else:
            super()._load_optimizer_and_scheduler(checkpoint)

    def _checkpoint_scheduler(self):
        engine = self._engine_lr_scheduler()
        return engine if engine is not None else self.lr_scheduler

    def evaluate(self, *args, **kwargs):
        self.rp_model.synchronize()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self.rp_model.synchronize()
        return super().predict(*args, **kwargs)


class Trainer(TrainerMixin, transformers.Trainer):
    """transformers.Trainer training a (plain, PEFT or rp.hf.wrap-ped) causal LM on a RoundPipe's workers."""
