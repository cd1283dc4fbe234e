"""roundpipe: train models larger than GPU memory on 1-8 PCIe GPUs or any single GPU.

All training state lives in host RAM; GPUs (or CPU workers) are a pool of
stateless workers to which pipeline stages are dispatched round-robin.  See
README.md for the API and docs/architecture.md for how the parts fit.

Importing roundpipe never touches a GPU.  Public names are loaded lazily from
their modules so that `import roundpipe` stays cheap and each subsystem can be
imported (and tested) on its own.
"""
from __future__ import annotations

import importlib

from roundpipe import _native
from roundpipe._version import __version__

# public name -> module that defines it
_LAZY = {
    "RoundPipe": "roundpipe.engine.model",
    "EngineConfig": "roundpipe.engine.config",
    "Plan": "roundpipe.planner.plan",
    "optim": "roundpipe.optim",
    "sim": "roundpipe.sim",
    "kernels": "roundpipe.kernels",
    "hostops": "roundpipe.hostops",
    "planner": "roundpipe.planner",
    "offload": "roundpipe.offload",
    "PlanningConfig": "roundpipe.engine.autoplan",
    "Precision": "roundpipe.engine.calls.precision",
    "LossScale": "roundpipe.engine.step.loss_scale",
    "StalenessCompensation": "roundpipe.engine.step.staleness",
    "hf": "roundpipe.hf",
    "diffusers": "roundpipe.diffusers",
    "RoundPipeStalled": "roundpipe.core.errors",
    "save_for_recompute": "roundpipe.engine.calls.recompute_data",
    "get_recompute_data": "roundpipe.engine.calls.recompute_data",
    "doing_recompute": "roundpipe.engine.calls.recompute_data",
}

native_available = _native.available
simd_level = _native.simd_level

__all__ = ["__version__", "native_available", "simd_level", *_LAZY]


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
