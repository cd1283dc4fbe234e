"""CallContext: what every stage run of one call shares (host state, hand-off board, losses, RNG base).

The model builds one per call (engine/model.py); the dispatcher hands it to each worker's
stage runs (stage.py), whose layer compute (compute.py) reads it.  Its own module so that
those three read one definition without importing each other.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from roundpipe.engine.calls.batchnorm import BatchStats
from roundpipe.engine.calls.board import Board
from roundpipe.engine.calls.precision import Precision
from roundpipe.engine.calls.resident import ResidentWeights
from roundpipe.engine.step.async_step import CallState, LayerSync
from roundpipe.engine.step.device_step import DeviceStep
from roundpipe.engine.step.host_state import HostState
from roundpipe.trace import Trace
from roundpipe.workers.base import Handoff


@dataclass
class CallContext:
    """Everything the stage runs of one call share."""

    host: HostState
    sync: LayerSync
    board: Board
    replicas: dict[str, list]          # worker name -> Replica per layer
    points: frozenset[int]              # boundaries where activations are saved and RNG reseeded
    rng_base: int
    labels: list[Any] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    loss_fn: Callable | None = None
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Handoff] = field(default_factory=dict)
    trace: Trace | None = None
    on_timing: Callable[[str, str, int, int, float, float], None] | None = None
    check_recompute: dict | None = None  # (boundary, mb) -> forward activation, when checking
    lock: threading.Lock = field(default_factory=threading.Lock)
    # ("f" or "b", first, stop layer) -> seconds its last forward / backward took; kept by the model
    compute_s: dict[tuple[str, int, int], float] = field(default_factory=dict)
    gpu_ready: dict | None = None         # events for call inputs already on a GPU (Handoff.gpu_ready)
    call: CallState | None = None         # this call in the per-layer protocol (set when it begins)
    losses_known: threading.Event = field(default_factory=threading.Event)   # every microbatch's loss is in
    on_losses: Callable[[], None] | None = None   # called once losses_known is set (wakes the caller)
    bn_stats: BatchStats | None = None    # whole-batch BatchNorm sums of this call (engine/batchnorm.py)
    bn_skip: dict[int, frozenset[int]] = field(default_factory=dict)   # layer -> buffers never landed
    precision: Precision = field(default_factory=Precision)   # dtypes of compute (engine/precision.py)
    loss_scale: Callable[[], float] | None = None   # the fp16 loss scale of this call (engine/loss_scale.py)
    # several losses and outputs of a training call (forward_backward's loss_fn returning a tuple or dict,
    # return_outputs=True): the loss_fn's form (compute.loss_parts; the first microbatch's, which every
    # other must repeat), microbatch -> its other entries (fp32, on their way to the host)
    loss_form: tuple | None = None
    extras: dict[int, Handoff] = field(default_factory=dict)
    keep_outputs: bool = False            # a training call also sends each microbatch's output home (outputs)
    # a composed call's backward (roundpipe/engine/calls/composed.py): labels are the gradients of the
    # output leaves that seed the backward instead of a loss; its forwards write no buffers; the positions
    # (tree_leaves of (args, kwargs)) of the call inputs whose gradients come home, microbatch -> them
    seeded: bool = False
    write_buffers: bool = True
    input_grad_leaves: tuple[int, ...] = ()
    input_grads: dict[int, Handoff] = field(default_factory=dict)
    # resident weights (resident.py): the model's kept copies, and how many first layers keep theirs
    resident: ResidentWeights | None = None
    resident_count: int = 0
    # the device step (roundpipe/engine/step/device_step.py) and the layers it steps in this call
    device_step: DeviceStep | None = None
    device_layers: frozenset[int] = frozenset()
    # kept graphs (dispatcher.Schedule.kept): ("graph", first layer, microbatch) -> (input leaves, output),
    # ("weights", first layer, round) -> the forward's bound weights; each taken by its backward stage
    kept: dict[tuple, Any] = field(default_factory=dict)

    def abort_requested(self) -> bool:
        return self.board.aborted
