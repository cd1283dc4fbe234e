"""`HostStep`: the optimizer step on the host CPU, a worker of its own beside the GPUs.

All training state lives in host memory, so every update runs on the host: the
simulator gives it one worker ("host step", tasks of category "optimizer", which
bubble accounting leaves out) that runs the steps in the order their gradients
land, one at a time (one step uses every host core).  A step of `p` parameters
takes p / `rate` seconds.  Two shapes of step:

    "whole"      one step over every parameter once every task of the iteration has
                 ended: a torch optimizer's `optimizer.step()` (the Trainer's old path,
                 roundpipe.engine.step.optimizer_step "torch optimizer")
    "per-layer"  one step per layer (the LM head first, then layers last to first),
                 starting when its backward stage's gradients have landed (the stage's
                 last microbatch), while the GPUs run the rest of the backward: the
                 fused step (roundpipe.optim, "per-layer fused")

and two ways the next iterations wait for it (the schedule decides):

    synchronous ("roundpipe")         iteration t + 1's work on a layer waits for the step
                                      of that layer in iteration t.  With "per-layer" the
                                      first forward stage waits for layer 0's step, the last
                                      to run, so what is exposed is the step of the layers
                                      whose gradients land last (and the rest of the step
                                      where it outlasts the backward it hides under)
    asynchronous ("roundpipe-async")  one step stale: iteration t + 2's work on a layer
                                      waits for the step of that layer in iteration t, so
                                      the step overlaps iteration t + 1's compute and shows
                                      only when it takes longer than that

With a host step the synchronous schedule is simulated over `iterations`
iterations too, and its makespan is the steady-state time per iteration, as for
the asynchronous one.  `host_step(...)` compares a schedule with and without the
step's time: the exposed seconds per iteration.  With `uploads`, the upload of a
layer also waits for its step (the P-copy writes the upload copy); with `allreduce`,
a layer's step waits for the bucket holding it.  With `disk` (roundpipe.sim.disk) the
per-layer step of an offloaded layer also waits for its read from disk and is written
behind on a "disk" worker: the state tier of `RoundPipe(offload_dir=, host_memory=)`.

Not modelled: the G-copy of downloaded gradients into the optimizer's (their
download is not modelled either), the wait of an asynchronous P-copy for the
previous iteration's uploads of the layer (the fused step writes the upload copy in
its pass), gradient clipping (which holds every layer's step until all gradients are
in: roundpipe.engine.step.optimizer_step), and a step slowed by the host memory the copy
streams share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from roundpipe.core.checks import check_number, is_int
from roundpipe.sim.disk import Disk

POLICIES = ("whole", "per-layer")


@dataclass(frozen=True)
class HostStep:
    """Parameters stepped per layer (the LM head last), the host's rate, and the shape of the step."""

    params: tuple[float, ...]                      # parameters per layer, the LM head last (layers + 1 entries)
    rate: float                                    # parameters per second the host steps (all its cores)
    policy: Literal["whole", "per-layer"] = "per-layer"
    disk: Disk | None = None                       # the layers whose state the step streams from disk

    def __post_init__(self):
        params = tuple(check_number(f"params[{i}]", v) for i, v in enumerate(self.params))
        if len(params) < 2:
            raise ValueError(f"params has {len(params)} entries; give one per layer plus the LM head last")
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "rate", check_number("rate", self.rate, positive=True))
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}")
        if self.disk is not None:
            if not isinstance(self.disk, Disk):
                raise TypeError(f"disk={self.disk!r} must be a roundpipe.sim.Disk or None")
            if self.disk.num_layers != self.num_layers:
                raise ValueError(f"disk has bytes for {self.disk.num_layers} layers (+ head) but params for "
                                 f"{self.num_layers}")
            if self.policy != "per-layer":
                raise ValueError(f"disk needs policy='per-layer' (the state tier streams the fused per-layer step), "
                                 f"got policy={self.policy!r}")

    @classmethod
    def uniform(cls, layers: int, params: float, rate: float, head_params: float = 0.0,
                policy: Literal["whole", "per-layer"] = "per-layer", disk: Disk | None = None) -> "HostStep":
        """`params` for each of `layers` layers, `head_params` for the LM head."""
        if not is_int(layers) or layers < 1:
            raise ValueError(f"layers={layers!r} must be an int >= 1")
        return cls((params,) * layers + (head_params,), rate, policy, disk)

    @property
    def num_layers(self) -> int:
        """Layers without the LM head."""
        return len(self.params) - 1

    def layer_time(self, layer: int) -> float:
        """Seconds of the step of `layer` (num_layers: the LM head)."""
        return self.params[layer] / self.rate

    def time(self) -> float:
        """Seconds of one iteration's step, all layers."""
        return sum(self.params) / self.rate
