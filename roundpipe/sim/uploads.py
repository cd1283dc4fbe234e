"""`Uploads`: each RoundPipe stage's weights crossing PCIe to its GPU, overlapping compute.

Weights live in host memory, so every slot (a stage run on one GPU for one round
of microbatches) first uploads its layers' upload copies and constant buffers
(a 4-bit base's packed bytes and statistics) on the GPU's parameter-up copy
stream.  The simulator gives each GPU a copy worker ("GPU w upload", tasks of
category "copy", which bubble accounting leaves out) that runs the uploads of
that GPU's slots in dispatch order, and models the engine's prefetch rule (a
GPU holds the stage it runs and the next one):

    upload(slot s on GPU w)   starts when upload(s') ended (s' the slot before s on w)
                              and when slot s'' has ended on w (s'' the slot before s': its
                              weights' memory is what s is uploaded into)
    slot s's first task       waits for upload(s)

so an upload runs while the previous slot computes, and a slot whose upload is
longer than its predecessor's compute makes the GPU wait: an upload-bound
pipeline runs at one slot per bytes / bandwidth on each GPU.

    upload(s) seconds = (weight bytes of its layers [+ the LM head's for the fused stage]
                         + activation bytes x its microbatches [x 2 in a backward stage:
                         the stage input for the recompute and the gradient flowing in])
                        / bandwidth
    bandwidth         = min(gbps, host_gbps / N) x 1e9 bytes/s

`gbps` is one GPU's host-to-device link (pinned copies, PCIe 4.0 x16 ~22-26 GB/s);
`host_gbps`, when given, is what all N GPUs share (a PCIe switch's uplink, the host
memory's read bandwidth): each GPU then gets its fair share, as if all uploaded at
once, which an upload-bound pipeline nearly does.  Not modelled: downloads (the other
PCIe direction: activations out, gradients; LoRA's are small), the software priority
that puts activation copies ahead of parameter chunks inside a slot (activations are
charged as bytes on the same link, not as separate copies), and the optimizer's
P-copy before an upload (the uploads wait for no step; the compute tasks keep their
staleness dependencies, roundpipe.sim.roundpipe).  Static and Zero Bubble schedules
are weight-bound (weights resident): they take no `Uploads`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from roundpipe.core.checks import check_number, is_int


@dataclass(frozen=True)
class Uploads:
    """Upload bytes per layer (+ the LM head's), per microbatch of activations, and the PCIe link."""

    layer_bytes: tuple[float, ...]    # bytes a slot uploads for each layer (weights + constant buffers)
    gbps: float                       # host -> device bandwidth of one GPU's link, GB/s (1e9 bytes/s)
    head_bytes: float = 0.0           # the LM head (+ final norm), uploaded by the fused stage
    activation_bytes: float = 0.0     # one microbatch's stage input (and output gradient), bytes
    host_gbps: float | None = None    # shared by all GPUs together (None: each GPU has its own link)

    def __post_init__(self):
        layer = tuple(check_number(f"layer_bytes[{i}]", v) for i, v in enumerate(self.layer_bytes))
        if not layer:
            raise ValueError("layer_bytes is empty: give the upload bytes of every layer")
        object.__setattr__(self, "layer_bytes", layer)
        object.__setattr__(self, "gbps", check_number("gbps", self.gbps, positive=True))
        for name in ("head_bytes", "activation_bytes"):
            object.__setattr__(self, name, check_number(name, getattr(self, name)))
        if self.host_gbps is not None:
            object.__setattr__(self, "host_gbps", check_number("host_gbps", self.host_gbps, positive=True))

    @classmethod
    def uniform(cls, layers: int, layer_bytes: float, gbps: float, head_bytes: float = 0.0,
                activation_bytes: float = 0.0, host_gbps: float | None = None) -> "Uploads":
        if not is_int(layers) or layers < 1:
            raise ValueError(f"layers={layers!r} must be an int >= 1")
        return cls((layer_bytes,) * layers, gbps, head_bytes, activation_bytes, host_gbps)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    def bandwidth(self, workers: int) -> float:
        """Bytes/s one GPU uploads at while all `workers` GPUs upload."""
        share = self.gbps if self.host_gbps is None else min(self.gbps, self.host_gbps / workers)
        return share * 1e9

    def slot_bytes(self, layers: Sequence[int], microbatches: int, backward: bool, head: bool = False) -> float:
        """Bytes one slot uploads: its layers' weights (+ the head's) and its microbatches' activations."""
        acts = self.activation_bytes * microbatches * (2 if backward and not head else 1)
        return sum(self.layer_bytes[i] for i in layers) + (self.head_bytes if head else 0.0) + acts
