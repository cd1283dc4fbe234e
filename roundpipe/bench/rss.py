"""Process memory as the memory benchmarks and tests read it (Linux)."""
from __future__ import annotations

import resource

from roundpipe.core.checks import is_number

# The environment of the host-bytes-per-parameter runs (bench/memory.py's slope rows, tests/engine/test_memory_host.py):
# glibc's mmap threshold fixed at 1 MiB, so the CPU workers' released "device" buffers go back to the system at
# once instead of staying in their threads' malloc heaps; and MALLOC_PERTURB_, with which glibc fills every block
# as it hands it out, so that memory reserved is memory resident.  Without it the host arena's chunks (64 MiB,
# ordinary memory on a CPU) are paged in only where a block was ever placed: measured 2026-11-26 (AdamW8bit,
# hidden 1024) the arena reserves one chunk more than it ever holds, mostly untouched at 2-3 layers (5 MiB of it
# resident) and touched at 4-8 (63 MiB), a 61 MiB step that a two-depth slope (2 -> 6) reads as 1.4 bytes per
# added parameter.  Page-locked arenas (a GPU machine) are resident as reserved; this measures them the same way.
SLOPE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_PERTURB_": "165"}


def accounted_host_bytes(host: dict) -> int:
    """The engine's count from `RoundPipe.memory_stats(optimizer)["host"]`: masters, optimizer state, buffers,
    the arena's whole reserve, and any upload copy or gradient outside the arena (without one); a master that
    is its own upload copy is an arena block, counted once."""
    state = sum(host.get(k, 0) for k in ("masters", "optimizer_state", "buffers"))
    copies = sum(host.get(k, 0) for k in ("upload_copies", "grad_landing", "grads_held", "grads"))
    if "arena_reserved" not in host:
        return state + copies
    inside = host.get("masters_in_arena", 0)
    return state - inside + host["arena_reserved"] + max(0, copies + inside - host["arena_in_use"])


def peak_rss() -> int:
    """Peak resident set size of this process so far, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(key: str) -> int:
    """A kB line of /proc/self/status, in bytes; 0 where /proc does not say."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def rss_file() -> int:
    """File-backed resident bytes (library code paged in), bytes; 0 where /proc does not say."""
    return _status_bytes("RssFile:")


def rss() -> int:
    """Resident set size of this process now, bytes (VmRSS); 0 where /proc does not say."""
    return _status_bytes("VmRSS:")


class HostPeak:
    """The peak over time of RSS minus what `held()` says the CPU workers hold at that moment.

    On CPU workers the "device" memory (a stage's weights, its gradient accumulators, activations) is
    host memory inside the RSS.  Subtracting each worker's ledger *peak* from the peak RSS takes away
    bytes the workers never held at once: with a one-stage plan each worker peaks at the whole model's
    weights and gradients, in different calls, and the sum of those peaks is twice what was ever held
    (measured: 394 MiB subtracted against at most 200 MiB held, 25.8M parameters).  This samples RSS
    and the workers' live bytes together on a thread, every `period` seconds, and keeps the largest
    difference: the host side's own peak.  A spike shorter than the period can be missed; RSS is read
    before and after `held()` and the smaller one used, so a buffer allocated between the reads is
    not counted as host memory.

        with HostPeak(lambda: sum(w.ledger.live_bytes() for w in model.workers)) as hp:
            ...train...
        hp.peak   # bytes
    """

    def __init__(self, held, period: float = 2e-4):
        import threading
        if not callable(held):
            raise TypeError(f"held must be a callable returning bytes, got {type(held).__name__}")
        if not is_number(period) or not period > 0:
            raise ValueError(f"period={period!r} must be a number of seconds > 0")
        self.held, self.period, self.peak = held, float(period), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-peak", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            before = rss()
            held = self.held()
            self.peak = max(self.peak, min(before, rss()) - held)

    def __enter__(self) -> "HostPeak":
        self.peak = rss() - self.held()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss() - self.held())
