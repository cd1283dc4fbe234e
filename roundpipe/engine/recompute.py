"""RNG handling that makes recomputation exact and runs reproducible.

Backward stages recompute their forward, so a dropout mask drawn in the forward
must be drawn again, bit for bit, in the recompute.  Workers run concurrently
and the CPU generator (and a GPU's generator, when one GPU is listed twice) is
shared, so the state a segment sees must not depend on the schedule.  Each
*segment* (the layers from one saved activation to the next) therefore starts
from a generator seeded with `segment_seed(base, boundary, microbatch)`, where
`base` is drawn once per call from the caller's generator; forward and
recompute reseed identically, and two runs with the same `torch.manual_seed`
give bitwise-equal results.

Seeding and the random draws of a segment must not interleave with another
worker's: `RngDomain.hold()` serialises forward segments on one generator (all
CPU workers share one domain; each GPU has its own, so for CUDA only kernel
launches are serialised, not the kernels).  `CallerRng` saves the caller's
generator states after drawing `base` and restores them when the call ends, so
the user's random stream advances by exactly one draw per call.
"""
from __future__ import annotations

import threading

import torch

_MASK = (1 << 63) - 1


def segment_seed(base: int, boundary: int, microbatch: int) -> int:
    """A seed unique to (call, segment start, microbatch) (splitmix64-style mixing)."""
    x = (base + 0x9E3779B97F4A7C15 * (boundary + 1) + 0xBF58476D1CE4E5B9 * (microbatch + 1)) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK


class RngDomain:
    """One random generator shared by some workers: a lock and a reseed function."""

    _domains: dict[str, "RngDomain"] = {}
    _registry_lock = threading.Lock()

    def __init__(self, device: torch.device):
        self.device = device
        self.lock = threading.RLock()

    @classmethod
    def of(cls, device: torch.device) -> "RngDomain":
        key = str(device) if device.type == "cuda" else "cpu"
        with cls._registry_lock:
            if key not in cls._domains:
                cls._domains[key] = cls(device)
            return cls._domains[key]

    def hold(self) -> threading.RLock:
        return self.lock

    def reseed(self, seed: int) -> None:
        """Seeds this domain's generator(s); call with `hold()` held."""
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)


class CallerRng:
    """Draws the call's base seed and restores the caller's generators when the call ends."""

    def __init__(self, devices: list[torch.device]):
        self.base = int(torch.randint(0, 2**62, (1,)).item())
        self.cpu_state = torch.get_rng_state()
        self.cuda_states = {d.index: torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"}

    def restore(self) -> None:
        cpu = RngDomain.of(torch.device("cpu"))
        with cpu.hold():
            torch.set_rng_state(self.cpu_state)
        for index, state in self.cuda_states.items():
            dev = torch.device("cuda", index)
            with RngDomain.of(dev).hold():
                torch.cuda.set_rng_state(state, dev)
