"""`Disk`: the optimizer state (and masters) of the layers that do not fit host memory, streamed from NVMe.

With `RoundPipe(offload_dir=, host_memory=)` (roundpipe.offload.state_tier) the
per-layer host step of an offloaded layer reads the layer's bytes from disk before
it updates them and writes them back after, through a ring of `slots` layer-sized
buffers.  The simulator gives the drive one worker ("disk", tasks of category
"copy", which bubble accounting leaves out) that runs the transfers one at a time in
the order the tier issues them; for the n offloaded layers of a step, in step order
(the LM head first, then the layers last to first):

    R0 .. R(k-1)                 read ahead: issued when the previous step's last offloaded
                                 layer was updated (under the next call's compute), k = slots
    W(i), R(i + k)               layer i's write behind once its update ended; its ring slot is
                                 then free for the read of layer i + k
    step(i)                      the host step of layer i waits for R(i) (and its gradients)
    settle                       after the last offloaded layer's update the step waits for all
                                 of its writes (state_tier: `_settle_writes`), so whatever waits
                                 for that layer's update (its upload, the next call) waits for them

Each on-disk byte is read once and written once a step: a step costs the drive
sum(bytes) / read + sum(bytes) / write seconds, overlapped with the gradients still
landing, the rest of the step and (asynchronous, one step stale) the next call.
Reads and writes share the drive (one worker): an NVMe drive's mixed read/write
bandwidth is not the sum of its read and write ratings, so this is the pessimistic end.
Not modelled: the page cache (O_DIRECT has none), the tier's read-ahead giving up a
slot it waits for out of order, a drive that slows when its write cache fills.

`Disk.first_fit` places the bytes as the tier does: layers keep their state in host
memory first fit from layer 0 while it fits the budget less the ring; the rest go to disk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from roundpipe.core.checks import check_number, is_int


@dataclass(frozen=True)
class Disk:
    """Bytes on disk per layer (the LM head last; 0: in host memory), the drive's bandwidths and the ring."""

    layer_bytes: tuple[float, ...]   # bytes each layer's step reads and writes (optimizer state [+ masters])
    read_gbps: float                 # sequential O_DIRECT read, GB/s (1e9 bytes/s)
    write_gbps: float                # sequential O_DIRECT write, GB/s
    slots: int = 3                   # ring buffers (state_tier.StateTier(slots=)): reads ahead = slots

    def __post_init__(self):
        layer = tuple(check_number(f"layer_bytes[{i}]", v) for i, v in enumerate(self.layer_bytes))
        if len(layer) < 2:
            raise ValueError(f"layer_bytes has {len(layer)} entries; give one per layer plus the LM head last")
        object.__setattr__(self, "layer_bytes", layer)
        for name in ("read_gbps", "write_gbps"):
            object.__setattr__(self, name, check_number(name, getattr(self, name), positive=True))
        if not is_int(self.slots) or self.slots < 2:
            raise ValueError(f"slots={self.slots!r} must be an int >= 2 (one updated, one read ahead or written)")

    @classmethod
    def first_fit(cls, state_bytes: Sequence[float], budget: float | None, read_gbps: float, write_gbps: float,
                  slots: int = 3) -> "Disk":
        """The tier's placement: `state_bytes` per layer (head last) stay in RAM first fit from layer 0 while they
        fit `budget` (host memory left beside masters, upload copies and gradients) less the ring of `slots`
        buffers of the largest layer; the others go to disk.  budget None: every layer on disk."""
        state = [check_number(f"state_bytes[{i}]", v) for i, v in enumerate(state_bytes)]
        if budget is not None:
            budget = check_number("budget", budget) - slots * max(state, default=0.0)
            if budget < 0:
                raise ValueError(f"budget leaves no room for the ring of {slots} x {max(state):.0f} bytes")
        on_disk, resident = [], 0.0
        for b in state:
            keep = budget is not None and resident + b <= budget
            resident += b if keep else 0.0
            on_disk.append(0.0 if keep else b)
        return cls(tuple(on_disk), read_gbps, write_gbps, slots)

    @property
    def num_layers(self) -> int:
        """Layers without the LM head."""
        return len(self.layer_bytes) - 1

    @property
    def bytes(self) -> float:
        """Bytes on disk: what a step reads and then writes."""
        return sum(self.layer_bytes)

    def read_time(self, layer: int) -> float:
        return self.layer_bytes[layer] / (self.read_gbps * 1e9)

    def write_time(self, layer: int) -> float:
        return self.layer_bytes[layer] / (self.write_gbps * 1e9)

    def time(self) -> float:
        """Seconds the drive works per step: every on-disk byte read once and written once."""
        return self.bytes / (self.read_gbps * 1e9) + self.bytes / (self.write_gbps * 1e9)
