"""RunState: what a RoundPipe knows of its run beyond tensors, and what a checkpoint saves of it.

The model owns one (`model.run_state`) and updates it as calls and steps happen;
`save_checkpoint` writes it into the manifest and `load_checkpoint` restores it, so the
checkpoint module reads this object and the model's public methods, never its private names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def no_step() -> dict[str, Any]:
    return {"optimizer": None, "lr_scheduler": None, "max_grad_norm": None}


@dataclass
class RunState:
    # the last step was asynchronous (which loss scale the next calls use: engine/step/loss_scale.py)
    latest_asynchronous: bool = False
    # a training call landed gradients that no G-copy has been issued for
    grads_pending: bool = False
    # what the last step() was given: a checkpoint saved while it is pending records and re-issues it
    step_info: dict[str, Any] = field(default_factory=no_step)
    # calls and steps of the runs this one resumes (load_checkpoint)
    counted: tuple[int, int] = (0, 0)
