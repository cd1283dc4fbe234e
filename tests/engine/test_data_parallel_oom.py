"""Out of device memory under data parallelism: a training call that fails on one rank alone must not be retried
on that rank alone (its plan broadcast and reductions would pair with different calls of the other ranks), so the
note says to restart every rank and the rank refuses every later collective (issue 51, item 5)."""
import os
import types

import pytest
import ranks
import torch

from roundpipe.engine.data_parallel import DataParallel, OptimizerShards
from roundpipe.planner.plan import Plan

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: the scripts
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def rank_of(world: int, rank: int = 1) -> DataParallel:
    """A DataParallel as rank `rank` of `world` would hold it, without a process group (no collective runs)."""
    dp = object.__new__(DataParallel)
    dp.rank, dp.world, dp.refused = rank, world, None
    return dp


def test_a_refusing_rank_raises_at_every_collective_and_drops_its_gradients():
    """After refuse(oom), the plan broadcast, the sum over ranks, the checkpoint's barrier and vote, the gradient
    all_reduce (its local sums dropped) and the shards' gather raise a RuntimeError caused by the OOM, before any
    collective is issued; with one rank there is no one to desynchronise and nothing is refused."""
    oom = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    alone = rank_of(1, rank=0)
    alone.refuse(oom)
    assert alone.refused is None
    dp = rank_of(2)
    dp.refuse(oom)
    grad = torch.ones(3)
    host = types.SimpleNamespace(layers=[types.SimpleNamespace(trainable=[0], gbuf=[grad], ghas=[True])])
    shards = object.__new__(OptimizerShards)
    shards.dp = dp
    calls = [lambda: dp.agree_plan(Plan.uniform(4, backward_per_stage=1, forward_ratio=3)),
             lambda: dp.sum_over_ranks(3.0), dp.barrier, lambda: dp.all_true(True), dp.reducer(host), shards.gather]
    for call in calls:
        with pytest.raises(RuntimeError, match="refused: rank 1 of 2 ran out of device memory") as info:
            call()
        assert info.value.__cause__ is oom
    assert host.layers[0].gbuf == [None] and host.layers[0].ghas == [False]


def test_a_rank_out_of_memory_is_told_to_restart_every_rank_and_cannot_retry_alone(tmp_path):
    """Two ranks; rank 1's second call raises cuBLAS's out-of-memory RuntimeError and the rank retries it with half
    its batch, as an automatic batch-size search does: the error's note names rank 1 of 2 and says to restart every
    rank (no retry advice), the retry raises at once (before, it broadcast a plan that the other rank's next call
    received), and rank 0 fails at its next collective instead of training on out of step."""
    cfg = dict(timeout=20)
    out = ranks.launch(os.path.join(HERE, "dp_oom_run.py"), cfg, 2, tmp_path, timeout=120)
    (seen,) = out[1]["seen"]
    notes = "\n".join(seen["notes"])
    assert seen["error"].startswith("CUDA error: CUBLAS_STATUS_ALLOC_FAILED"), seen
    assert "out of device memory on worker cpu:" in notes and "rank 1 of the 2" in notes, notes
    assert "restart them all from the last checkpoint" in notes and "retry with" not in notes, notes
    assert "refused: rank 1 of 2 ran out of device memory" in out[1]["error"], out[1]
    assert "ALLOC_FAILED" in out[1]["cause"], out[1]
    assert any("gradient all_reduce across 2 ranks failed" in n for n in out[0].get("notes", [])), out[0]
