"""Worker pool construction: device strings -> validated CPU or CUDA workers."""
from __future__ import annotations

import torch

from roundpipe.workers.base import Alloc, Handoff, Owns, Worker
from roundpipe.workers.cpu import CpuWorker

__all__ = ["Handoff", "Worker", "CpuWorker", "parse_devices", "make_workers", "default_compute_dtype"]

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def parse_devices(devices: object) -> list[torch.device]:
    """Validates a device list; None means every visible GPU, else one CPU worker."""
    if devices is None:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    if isinstance(devices, (str, torch.device)):
        raise TypeError(f"devices must be a list of devices such as ['cuda:0', 'cuda:1'] or ['cpu', 'cpu'], "
                        f"got the single device {devices!r}; wrap it in a list")
    try:
        items = list(devices)
    except TypeError:
        raise TypeError(f"devices must be a list of device strings, got {type(devices).__name__}") from None
    if not items:
        raise ValueError("devices=[] is empty; give at least one device, e.g. ['cpu'] or ['cuda:0']")
    out = []
    for d in items:
        if not isinstance(d, (str, torch.device)):
            raise TypeError(f"devices entry {d!r} must be a string or torch.device")
        try:
            dev = torch.device(d)
        except RuntimeError:
            raise ValueError(f"devices entry {d!r} is not a device name; expected 'cpu' or 'cuda:<index>'") from None
        if dev.type == "cpu":
            out.append(torch.device("cpu"))
        elif dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"devices entry {d!r} names a CUDA device but CUDA is not available here; "
                                 "use ['cpu', ...] workers")
            index = torch.cuda.current_device() if dev.index is None else dev.index
            if index >= torch.cuda.device_count():
                raise ValueError(f"devices entry {d!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
            out.append(torch.device("cuda", index))
        else:
            raise ValueError(f"devices entry {d!r} has type {dev.type!r}; only 'cpu' and 'cuda' workers exist")
    if len({d.type for d in out}) > 1:
        raise ValueError(f"devices={items!r} mixes CPU and CUDA workers; use one kind per model")
    return out


def default_compute_dtype(devices: list[torch.device]) -> torch.dtype:
    return torch.bfloat16 if devices[0].type == "cuda" else torch.float32


def make_workers(devices: list[torch.device], compute_dtype: torch.dtype, alloc: Alloc | None = None,
                 owns: Owns | None = None) -> list[Worker]:
    """One worker per entry; the same device listed twice gives two workers on it.

    alloc(shape, dtype) gives host staging buffers (the model's HostState.alloc: its arena);
    owns(t) says whether a host tensor is one of them (HostState.owns).
    """
    workers: list[Worker] = []
    for dev, name in zip(devices, worker_names(devices)):
        if dev.type == "cpu":
            workers.append(CpuWorker(dev, name, compute_dtype, alloc, owns))
        else:
            from roundpipe.workers.cuda import CudaWorker  # touches CUDA only when asked for
            workers.append(CudaWorker(dev, name, compute_dtype, alloc, owns))
    if any(d.type == "cuda" for d in devices):
        # dropout masks are not reproducible across GPU models: such a pool refuses random draws
        from roundpipe.workers.rng import mixed_models
        reason = mixed_models(devices)
        for w in workers:
            w.rng.refuse = reason
    return workers


def worker_names(devices: list[torch.device]) -> list[str]:
    """The workers' names: cpu:0, cpu:1, ... for CPU entries; cuda:0, then cuda:0#1 for a repeated GPU."""
    names, seen = [], {}
    for dev in devices:
        key = str(dev)
        k = seen.get(key, 0)
        seen[key] = k + 1
        names.append(f"cpu:{k}" if dev.type == "cpu" else (key if k == 0 else f"{key}#{k}"))
    return names
