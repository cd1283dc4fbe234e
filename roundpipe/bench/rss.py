"""Process memory as the memory benchmarks and tests read it (Linux)."""
from __future__ import annotations

import resource


def peak_rss() -> int:
    """Peak resident set size of this process so far, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_file() -> int:
    """File-backed resident bytes (library code paged in), bytes; 0 where /proc does not say."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0
