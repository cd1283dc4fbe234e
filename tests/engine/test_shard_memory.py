"""shard_optimizer=True lowers each rank's host memory by the optimizer share it removes (issue 29), with the
synchronous and the asynchronous step: 2 gloo ranks, the tiny decoder at hidden 768 x 4 layers (28.7M
parameters), bf16 compute, rp AdamW (8 bytes of state per parameter unsharded, 4 per rank sharded), 2 CPU
workers per rank (roundpipe/bench/shard_memory.py runs a rank).  A batch of 2 x 2 tokens: every byte compared
here is per parameter, and on a CPU without bf16 instructions (AVX2) torch's bf16 backward matmuls take time
in proportion to the tokens (2 x 32, bench/ddp.py's size: 163 s sync, 181 s async on a loaded 2-core EPYC)."""
import sys
from pathlib import Path

import pytest
from ranks import launch

from roundpipe import _native

SCRIPT = str(Path(__file__).resolve().parents[2] / "roundpipe" / "bench" / "shard_memory.py")


def _ranks(tmp_path, asynchronous: bool, shard: bool) -> list[dict]:
    cfg = dict(hidden=768, layers=4, steps=3, asynchronous=asynchronous, shard=shard, seq=2)
    out = tmp_path / ("shard" if shard else "full")
    out.mkdir()
    return launch(SCRIPT, cfg, 2, out, timeout=300)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _native.available(),
                    reason="reads /proc; needs the native arena")
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_sharding_lowers_each_rank_by_the_optimizer_share(tmp_path, asynchronous):
    """Per rank: the accounted host bytes (masters, optimizer state, the arena's reserve) drop by the optimizer
    state sharding removes (4 of AdamW's 8 bytes per parameter), the arena never reserves more than unsharded, and
    the host peak (RSS - the workers' live ledger bytes, code pages left out) is lower.  Before 2026-11-26 the
    asynchronous sharded step held its fp32 gradient sums through the gather, beside the next call's landings
    (the arena reserved 13.0 bytes per parameter sharded against 8.3-10.7), and the gather's all_gather made
    gloo allocate buffers the glibc heaps kept (host peak 37.0 sharded against 29.8 unsharded, synchronous).
    Measured 2026-11-26 on a 2-core EPYC (bench/ddp.py --memory): accounted 20.0 -> 16.0 sync, 22.0 -> 18.0
    async; host peak savings 1.1-6.0 bytes per parameter from rank to rank and run to run (glibc heap
    memory the CPU workers freed, kept or not)."""
    full, shard = _ranks(tmp_path, asynchronous, False), _ranks(tmp_path, asynchronous, True)
    for f, s in zip(full, shard):
        n = f["params"]
        share = f["optimizer_state"] - s["optimizer_state"]
        assert share >= 3.9 * n, (share / n, f, s)   # AdamW: 8 bytes -> 4 (+ padding of the slices)
        assert f["accounted"] - s["accounted"] >= share, ((f["accounted"] - s["accounted"]) / n, f, s)
        assert s["arena_peak_reserved"] <= f["arena_peak_reserved"], (s["arena_peak_reserved"] / n,
                                                                      f["arena_peak_reserved"] / n)
        assert s["host_peak"] < f["host_peak"], ((f["host_peak"] - s["host_peak"]) / n, share / n)
