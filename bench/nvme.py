"""NVMe tier benchmark: the file store's read/write GB/s against a plain O_DIRECT probe on the same file system.

The program is roundpipe/bench/nvme.py (also `roundpipe bench nvme`); this script runs it from
a checkout.  Committed rows: bench/results/nvme.jsonl.

    python bench/nvme.py [--quick] [--dir /nvme/scratch] [--out bench/results] [--no-save]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe.bench.nvme import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
