"""Data parallelism on torch.distributed (gloo on loopback): ranks vs one process on the combined batch."""
import os

import dp_run  # noqa: E402
import pytest
import ranks  # noqa: E402
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: the scripts
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def launch(cfg: dict, world: int, tmp_path, timeout: float = 240) -> list[dict]:
    """Runs dp_run.py on `world` ranks; returns what each rank saved (its result or its error)."""
    return ranks.launch(os.path.join(HERE, "dp_run.py"), cfg, world, tmp_path, timeout)


def assert_close(a, b, rel=1e-5):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rel, atol=1e-7)


@pytest.mark.parametrize("world, asynchronous, optimizer, shard", [
    (2, False, "rp", False), (2, True, "rp", False), (2, False, "torch", False), (3, True, "torch", False),
    (3, False, "rp", False), (2, False, "rp", True), (2, True, "torch", True), (3, True, "rp", True)])
def test_ranks_train_like_one_process_on_the_combined_batch(tmp_path, world, asynchronous, optimizer, shard):
    """Gradients averaged over 2 or 3 ranks equal one process on the combined batch (rel 1e-5), the masters
    are identical on every rank; with shard_optimizer each rank holds 1/W of the AdamW state (+ padding)."""
    cfg = dict(steps=4, batch=4 * world, microbatches=2, asynchronous=asynchronous, optimizer=optimizer, clip=0.5,
               shard=shard)
    ranks = launch(cfg, world, tmp_path)
    for r in ranks:
        assert "error" not in r, r
    torch.manual_seed(0)
    ref = dp_run.run(dict(cfg, microbatches=2 * world, shard=False))
    for r in ranks:
        if shard:   # 8 bytes per parameter in total, this rank's ceil(n/W) of each tensor
            assert r["optimizer_bytes"] <= 8 * (r["params"] / world + 2 * 8) + 64 * 8, r["optimizer_bytes"]
            assert r["optimizer_bytes"] < ref["optimizer_bytes"] / world * 1.3
        else:
            assert r["optimizer_bytes"] == ref["optimizer_bytes"]
    for r in ranks[1:]:   # masters identical on every rank after every step
        for a, b in zip(ranks[0]["masters"] + [ranks[0]["final"]], r["masters"] + [r["final"]]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    for mine, theirs in zip(ranks[0]["masters"], ref["masters"]):
        assert_close(mine, theirs)
    assert_close(ranks[0]["final"], ref["final"])
    # each rank's loss is its own batch's; their mean is the combined batch's
    means = [sum(r["losses"][s] for r in ranks) / world for s in range(cfg["steps"])]
    torch.testing.assert_close(torch.tensor(means), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)


def test_a_rank_that_raises_makes_every_rank_fail_instead_of_hanging(tmp_path):
    """Rank 1 raises in its second call and exits; rank 0's next all_reduce fails (connection closed or the
    group's 20 s timeout) and its next engine call raises, naming the all_reduce."""
    cfg = dict(steps=4, batch=8, microbatches=2, asynchronous=False, optimizer="rp", fail_rank=1, fail_at=2,
               timeout=20)
    ranks = launch(cfg, 2, tmp_path, timeout=120)
    assert "injected failure" in ranks[1]["error"]
    assert "error" in ranks[0], ranks[0]
    assert any("gradient all_reduce across 2 ranks failed" in n for n in ranks[0]["notes"]), ranks[0]


@pytest.mark.parametrize("shard", [False, True])
def test_a_checkpoint_across_ranks_resumes_exactly_on_as_many_ranks(tmp_path, shard):
    """Two ranks, asynchronous step: (A) saves after step 2 and goes on, (B) two new ranks load it and go on,
    (C) never saves: bitwise-equal final masters; one process cannot load a two-rank checkpoint.  With
    shard_optimizer each rank saves its own optimizer slices."""
    cfg = dict(steps=4, batch=8, microbatches=2, asynchronous=True, optimizer="rp", clip=0.5, shard=shard)
    path = str(tmp_path / "ckpt")
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    a = launch(dict(cfg, save_at=2, path=path), 2, tmp_path / "a")
    # sharded: a whole-model update; the fp32 masters of CPU workers are their own upload copies, so it waits for
    # every layer's gate (HostState.in_place) and no window of old weights is saved beside it
    optimizer_files = ["optimizer.rank0.pt", "optimizer.rank1.pt"] if shard else ["optimizer.pt"]
    assert sorted(os.listdir(path)) == sorted(["checkpoint.json", "engine.rank0.safetensors",
                                               "engine.rank1.safetensors", "model.safetensors"] + optimizer_files)
    b = launch(dict(cfg, load=path, start=2), 2, tmp_path / "b")
    c = launch(cfg, 2, tmp_path / "c")
    for rank in range(2):
        assert all(torch.equal(x, y) for x, y in zip(a[rank]["final"], c[rank]["final"]))
        assert all(torch.equal(x, y) for x, y in zip(b[rank]["final"], c[rank]["final"]))
        assert b[rank]["losses"] == c[rank]["losses"][2:]
    with pytest.raises(ValueError, match="saved by 2 ranks and this run has 1"):
        dp_run.run(dict(cfg, load=path, start=2, shard=False))


def test_a_wrapped_hf_model_under_torchrun_trains_on_every_ranks_tokens(tmp_path):
    """rp.hf.wrap picks the world group itself; with rows padded differently per rank the gradient is the
    token mean over both ranks' tokens, as one process on the combined batch."""
    pytest.importorskip("transformers")
    cfg = dict(model="hf", steps=3, batch=4, microbatches=2, asynchronous=True)
    ranks = launch(cfg, 2, tmp_path)
    for r in ranks:
        assert "error" not in r, r
        assert r["world"] == 2
    ref = dp_run.run(dict(cfg, microbatches=4))
    assert all(torch.equal(x, y) for x, y in zip(ranks[0]["final"], ranks[1]["final"]))
    assert_close(ranks[0]["final"], ref["final"])


@pytest.mark.parametrize("average_tokens", [True, False])
def test_rp_hf_trainer_under_torchrun_equals_transformers_trainer_with_ddp(tmp_path, average_tokens):
    """Two ranks: rp.hf.Trainer (the wrapped model joins the world group itself) ends with the weights
    transformers.Trainer reaches with DDP on the same data, accumulation and schedule (SGD: scale-sensitive, so a
    gradient twice too large would show), with per-rank or global token counts."""
    pytest.importorskip("transformers")
    ranks = launch(dict(model="trainer", average_tokens=average_tokens), 2, tmp_path)
    for r in ranks:
        assert "error" not in r, r
        assert r["world"] == 2
        assert_close(r["final"], r["ref"], rel=1e-4)
    assert all(torch.equal(x, y) for x, y in zip(ranks[0]["final"], ranks[1]["final"]))


def test_process_group_must_be_a_process_group():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        torch.manual_seed(0)
        import roundpipe as rp
        rp.RoundPipe([torch.nn.Linear(2, 2)], devices=["cpu"], process_group="world")
    with pytest.raises(ValueError, match="shard_optimizer=True needs process_group"):
        import roundpipe as rp
        rp.RoundPipe([torch.nn.Linear(2, 2)], devices=["cpu"], shard_optimizer=True)


def test_nccl_reduce_device_follows_the_workers_and_local_rank(monkeypatch):
    """Under NCCL each rank of a node reduces on a GPU of its own: ranks sharing cuda:0..3 (devices=None under
    torchrun) spread by LOCAL_RANK, a rank with one worker stays on it, never cuda:0 for all; gloo is the CPU."""
    from roundpipe.engine.data_parallel import reduce_device
    cuda = [torch.device("cuda", i) for i in range(4)]
    assert [reduce_device("nccl", cuda, str(r)) for r in range(4)] == cuda
    assert reduce_device("nccl", [torch.device("cuda", 2)] * 2, "1") == torch.device("cuda", 2)
    assert reduce_device("nccl", [torch.device("cuda", 3), torch.device("cpu")], None) == torch.device("cuda", 3)
    assert reduce_device("gloo", cuda, "1") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)   # CPU workers on an NCCL group
    assert reduce_device("nccl", [torch.device("cpu")], "3") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="LOCAL_RANK='x' must be a non-negative integer"):
        reduce_device("nccl", cuda, "x")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="NCCL backend but no CUDA device"):
        reduce_device("nccl", [torch.device("cpu")], "0")


def test_reduced_buckets_live_in_the_models_host_memory(monkeypatch):
    """A gradient bucket is staged in the model's host memory (its arena: pinned on GPUs, so the copies to and
    from the GPU are DMA) and the reduced gradients are views of it, with the missing ones left out."""
    from roundpipe import _native
    from roundpipe.engine import data_parallel
    from roundpipe.engine.step.host_state import HostState
    if not _native.available():
        pytest.skip("needs the native core (the arena)")
    calls = []
    monkeypatch.setattr(data_parallel, "_dist", lambda: type("D", (), {
        "all_reduce": staticmethod(lambda t, group: calls.append(t.clone()))}))
    layers = [torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)]
    host = HostState(layers, torch.float32, pinned=False)
    dp = data_parallel.DataParallel.__new__(data_parallel.DataParallel)
    dp.device, dp.world, dp.reduction, dp.group, dp.bucket_bytes = torch.device("cpu"), 2, "mean", None, 1 << 20
    for j, p in enumerate(host.layers[0].params):
        host.layers[0].gbuf[j], host.layers[0].ghas[j] = torch.full(p.shape, 4.0), True
    dp.reduce_landed(host)
    assert len(calls) == 1 and calls[0].numel() == (6 + 2) + (4 + 2) + 4   # weights, biases, one "has" flag each
    for j, p in enumerate(host.layers[0].params):
        g = host.layers[0].gbuf[j]
        assert host.owns(g) and torch.equal(g, torch.full(p.shape, 2.0))
    assert host.layers[1].gbuf == [None, None] and host.layers[1].ghas == [False, False]
