"""Simulator disk for the state tier: reads ahead, writes behind, the drive's seconds against hand-computed times."""
import pytest
from test_sim import check_invariants

from roundpipe.sim import Costs, Disk, HostStep, host_step

# The toy of tests/sim/test_sim_hoststep.py: one GPU, one microbatch, 4 layers of forward 1 and backward 2, no head.
#     GPU 0   F1 [0, 2) layers 0-1   B1 [2, 8) layers 2-3 (fused)   B2 [8, 14) layers 0-1
# Each layer's step takes 1 s; in RAM the synchronous period is 16, the asynchronous one C = 14.
TOY = Costs.uniform(4, 1.0, 2.0)
TOY_PARTITION = ([2], [2, 2])
C = 14.0


def toy(schedule, seconds, write_seconds=None, head_bytes=0.0, slots=3):
    """Every layer on disk, `seconds` to read it and `write_seconds` (default the same) to write it."""
    w = seconds if write_seconds is None else write_seconds
    disk = Disk((seconds * 1e9,) * 4 + (head_bytes,), 1.0, seconds / w, slots)
    r = host_step(schedule, TOY, 1, 1, HostStep.uniform(4, 1.0, 1.0, disk=disk), partition=TOY_PARTITION,
                  iterations=8)
    check_invariants(r.result.run)
    return r


@pytest.mark.parametrize("s,expected", [(1.0, 17.0), (2.0, 19.0), (5.0, 40.0)])
def test_synchronous_step_waits_for_its_reads_and_the_last_write(s, expected):
    """Reads R3 R2 R1 ahead, W3 R0 W2 W1 W0 behind on one drive; the step settles W0 before the next F1.
    s = 1: L0 steps 15-16, W0 16-17, so 17 (RAM: 16); s = 2: W0 ends at 19; s = 5: the drive's 4 x 10 s."""
    r = toy("roundpipe", s)
    assert r.iteration == pytest.approx(expected)
    assert r.disk == pytest.approx(8 * s)


@pytest.mark.parametrize("s", [1.0, 2.0, 3.0, 5.0])
def test_asynchronous_step_is_disk_bound_past_the_compute(s):
    """One step stale: the drive's reads and writes overlap the next call; the period is max(C, 4 x (r + w))."""
    assert toy("roundpipe-async", s).iteration == pytest.approx(max(C, 8 * s))


def test_each_byte_crosses_the_disk_once_each_way_per_step():
    """Per iteration one read before and one write after each offloaded layer's step; the head (in RAM) has none."""
    r = toy("roundpipe-async", 1.0)
    run = r.result.run
    tasks = run.schedule.tasks
    for it in range(1, 7):
        steps = {t.mb: i for i, t in enumerate(tasks) if t.iteration == it and t.name.startswith("step")}
        reads = {t.mb: i for i, t in enumerate(tasks) if t.iteration == it and t.name.startswith("read")}
        writes = {t.mb: i for i, t in enumerate(tasks) if t.iteration == it and t.name.startswith("write")}
        assert sorted(reads) == sorted(writes) == [0, 1, 2, 3]
        for l in range(4):
            assert run.end[reads[l]] <= run.start[steps[l]] and run.end[steps[l]] <= run.start[writes[l]]


def test_ring_slots_bound_the_reads_ahead():
    """With 2 slots the read of a layer waits for the write two layers before it: slower than 3 when disk-bound."""
    two, three = toy("roundpipe", 2.0, slots=2), toy("roundpipe", 2.0, slots=3)
    assert two.iteration > three.iteration
    run = two.result.run
    tasks = run.schedule.tasks
    at = {(t.name, t.iteration): i for i, t in enumerate(tasks)}
    assert run.start[at["read L1", 2]] >= run.end[at["write L3", 2]]


def test_read_and_write_bandwidths():
    """Reading at 1 s and writing at 3 s a layer: the drive works 4 x 4 s a step, and sets the async period."""
    r = toy("roundpipe-async", 1.0, write_seconds=3.0)
    assert r.disk == pytest.approx(16.0)
    assert r.iteration == pytest.approx(16.0)


def test_first_fit_places_like_the_state_tier():
    """Layers stay in RAM first fit from layer 0 within the budget less the ring; the rest go to disk."""
    d = Disk.first_fit([4, 10, 4, 4, 2], budget=3 * 10 + 10, read_gbps=1, write_gbps=1)
    assert d.layer_bytes == (0.0, 10.0, 0.0, 4.0, 0.0)      # 10 left: 4, (10 does not fit), 4, (4 does not), 2
    d = Disk.first_fit([4, 10, 4, 4, 2], budget=3 * 10 + 8, read_gbps=1, write_gbps=1)
    assert d.layer_bytes == (0.0, 10.0, 0.0, 4.0, 2.0)
    assert Disk.first_fit([1, 1], None, 1, 1).layer_bytes == (1.0, 1.0)
    assert Disk.first_fit([1, 1], None, 1, 1).bytes == 2.0
    with pytest.raises(ValueError, match="ring"):
        Disk.first_fit([4, 10], budget=20, read_gbps=1, write_gbps=1)


def test_disk_errors():
    """Wrong layer counts, bandwidths, slots and policies are errors naming the argument."""
    with pytest.raises(ValueError, match="read_gbps"):
        Disk((1.0, 1.0), 0.0, 1.0)
    with pytest.raises(ValueError, match="slots"):
        Disk((1.0, 1.0), 1.0, 1.0, slots=1)
    with pytest.raises(ValueError, match=r"layer_bytes\[1\]"):
        Disk((1.0, -1.0), 1.0, 1.0)
    with pytest.raises(ValueError, match="disk has bytes for 2 layers"):
        HostStep.uniform(4, 1.0, 1.0, disk=Disk((1.0,) * 3, 1.0, 1.0))
    with pytest.raises(ValueError, match="policy='per-layer'"):
        HostStep.uniform(4, 1.0, 1.0, policy="whole", disk=Disk((1.0,) * 5, 1.0, 1.0))
    with pytest.raises(TypeError, match="disk"):
        HostStep.uniform(4, 1.0, 1.0, disk=3.0)
