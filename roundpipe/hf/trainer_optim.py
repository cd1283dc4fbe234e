"""What `rp.hf.Trainer` steps: the Trainer's optimizer choice as a roundpipe.optim optimizer, and
its lr scheduler stepped by the engine.

A roundpipe.optim optimizer runs the engine's per-layer fused step (each layer updated, and its
upload copy written, in one pass as soon as its gradients are in; roundpipe/engine/step/optimizer_step.py).
Any other optimizer is one whole-model torch step after every layer's gradients arrived, with the
workers idle meanwhile in the synchronous step; it still works, with one warning.

    TrainingArguments.optim       roundpipe.optim      transformers builds
    adamw_torch                   AdamW                torch.optim.AdamW
    adamw_torch_fused             AdamW                torch.optim.AdamW(fused=True)
    sgd                           SGD                  torch.optim.SGD
    adagrad                       Adagrad              torch.optim.Adagrad
    lion_32bit                    Lion                 bitsandbytes.optim.Lion(optim_bits=32)
    adamw_8bit, adamw_bnb_8bit,   AdamW8bit            bitsandbytes.optim.AdamW(optim_bits=8)
    paged_adamw_8bit

The keyword arguments are the ones transformers passes (learning rate, betas, eps, `optim_args`),
over the Trainer's own parameter groups (weight decay on all but biases and norms), less the ones
only its class takes (`fused`, bitsandbytes' `optim_bits` and `is_paged`: paging is moot, the state
is in host memory anyway).
"""
from __future__ import annotations

from typing import Any

import torch

# TrainingArguments.optim -> (the roundpipe.optim class, keyword arguments of transformers' that it does not take)
FUSED_OPTIMIZERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "adamw_torch": ("AdamW", ()),
    "adamw_torch_fused": ("AdamW", ("fused",)),
    "sgd": ("SGD", ()),
    "adagrad": ("Adagrad", ()),
    "lion_32bit": ("Lion", ("optim_bits", "is_paged")),
    "adamw_8bit": ("AdamW8bit", ("optim_bits", "is_paged")),
    "adamw_bnb_8bit": ("AdamW8bit", ("optim_bits", "is_paged")),
    "paged_adamw_8bit": ("AdamW8bit", ("optim_bits", "is_paged")),
}


def optim_name(args: Any) -> str:
    return str(getattr(args.optim, "value", args.optim))


def fused_cls_and_kwargs(args: Any, model: torch.nn.Module) -> tuple[type, dict[str, Any]] | None:
    """The roundpipe.optim class and keyword arguments for `args.optim`, or None where there is none."""
    from transformers import Trainer

    import roundpipe.optim

    entry = FUSED_OPTIMIZERS.get(optim_name(args))
    if entry is None:
        return None
    name, drop = entry
    cls = getattr(roundpipe.optim, name, None)
    if cls is None:
        raise ValueError(f"TrainingArguments(optim={optim_name(args)!r}) maps to roundpipe.optim.{name}, which is not "
                         f"yet available in this roundpipe; use optim='adamw_torch' (roundpipe.optim.AdamW)")
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return cls, {k: v for k, v in kwargs.items() if k not in drop}


def routed_warning(args: Any, optimizer: torch.optim.Optimizer) -> str:
    return (f"rp.hf.Trainer: optim={optim_name(args)!r} ({type(optimizer).__name__}) has no roundpipe.optim "
            "version, so it runs as one torch step over the whole model once every layer's gradients are in (the "
            "workers idle meanwhile in a synchronous step) instead of the per-layer fused step; optim= "
            f"{', '.join(sorted(FUSED_OPTIMIZERS))} take the fused step")


def is_stepwise(scheduler: Any) -> bool:
    """Whether the Trainer steps `scheduler` once per optimizer step with no argument (not ReduceLROnPlateau and
    transformers' GreedyLR, which it steps with eval metrics): such a scheduler is stepped by the engine."""
    greedy = getattr(__import__("transformers.optimization", fromlist=["GreedyLR"]), "GreedyLR", ())
    return not isinstance(scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, greedy))


class SteppedByEngine:
    """The Trainer's view of its lr scheduler: everything the scheduler's, but `step()` does nothing,
    since `model.step(lr_scheduler=)` steps it right after the update it belongs to (in the
    asynchronous step on the host thread, where the Trainer's own call would race with it)."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def step(self, *args, **kwargs) -> None:
        """Stepped by the engine instead."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


class EngineScheduler:
    """The engine's view: steps the Trainer's scheduler; `optimizer` is the one the engine steps (the
    scheduler itself holds accelerate's wrapper of it)."""

    def __init__(self, scheduler: Any, optimizer: Any):
        self.scheduler, self.optimizer = scheduler, optimizer

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


def scheduled_lr(scheduler: Any, steps_done: int, asynchronous: bool) -> float:
    """The learning rate of update number `steps_done` (0-based), as the Trainer logs it.  Synchronous: the
    scheduler's last rate (every earlier update and scheduler step is done).  Asynchronous, where the previous
    update's scheduler step may still be running: a LambdaLR's (every transformers schedule but
    reduce_lr_on_plateau and greedy) rate worked out from its function; another scheduler's last rate."""
    if asynchronous and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return float(scheduler.base_lrs[0] * scheduler.lr_lambdas[0](steps_done))
    lr = scheduler.get_last_lr()[0]
    return float(lr.item() if torch.is_tensor(lr) else lr)
