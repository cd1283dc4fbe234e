"""Simulator weight uploads: bytes over a PCIe bandwidth per slot, overlapping the previous slot's compute."""
import pytest
from test_sim import check_invariants

from roundpipe.sim import Costs, Uploads, simulate

COSTS = Costs.uniform(8, fwd=1e-3, bwd=2e-3, head_fwd=2e-3, head_bwd=4e-3, comm=1e-4)
PARTITION = ([2, 2, 2], [2, 2, 2, 2])   # 7 slots a round; the fused stage holds layers 6-7 and the head


def upload_tasks(result):
    return [t for t in result.run.schedule.tasks if t.cat == "copy"]


@pytest.mark.parametrize("schedule", ["roundpipe", "roundpipe-async", "roundpipe-zb"])
def test_zero_bytes_change_nothing(schedule):
    """Uploads of zero bytes leave the makespan and bubbles as without uploads; every invariant holds."""
    costs = Costs.uniform(8, 1e-3, 2e-3, 2e-3, 4e-3, 1e-4, w_fraction=0.5)
    plain = simulate(schedule, costs, 3, 8, partition=PARTITION)
    up = simulate(schedule, costs, 3, 8, partition=PARTITION, uploads=Uploads.uniform(8, 0.0, gbps=20))
    if schedule != "roundpipe-zb":   # deferred W tasks run out of program order
        check_invariants(up.run)
    assert up.makespan == pytest.approx(plain.makespan)
    assert up.bubbles.ratio == pytest.approx(plain.bubbles.ratio)
    assert up.upload_bytes == 0


def test_upload_bound_stages_take_bytes_over_bandwidth():
    """When a slot's upload dwarfs its compute, each GPU runs one slot per bytes / bandwidth, back to back."""
    layer_bytes, gbps = 2e9, 20.0      # 0.1 s per layer, against ~ms of compute
    up = Uploads.uniform(8, layer_bytes, gbps, head_bytes=1e9)
    r = simulate("roundpipe", COSTS, 2, 3, partition=PARTITION, uploads=up)
    check_invariants(r.run)
    tasks = upload_tasks(r)
    assert len(tasks) == 7
    for t in tasks:
        layers = 2 * layer_bytes + (1e9 if t.name == "B1 upload" else 0.0)
        assert t.duration == pytest.approx(layers / (gbps * 1e9))
    # GPU 0 runs slots 0, 2, 4, 6 (F1, F3, B2, B4): its four uploads back to back, then B4's compute
    gpu0 = [r.run.start[i] for i, t in enumerate(r.run.schedule.tasks) if t.cat == "copy" and t.worker == 2]
    ends = [r.run.end[i] for i, t in enumerate(r.run.schedule.tasks) if t.cat == "copy" and t.worker == 2]
    assert gpu0[1:] == pytest.approx(ends[:-1])
    assert ends[-1] == pytest.approx(4 * 2 * layer_bytes / (gbps * 1e9))
    b4 = 3 * COSTS.backward(range(0, 2))
    assert r.makespan == pytest.approx(ends[-1] + b4)
    assert r.upload_bytes == pytest.approx(7 * 2 * layer_bytes + 1e9)


def test_compute_bound_uploads_hide_behind_compute():
    """An upload shorter than the slot before it costs only the first slot's upload (the pipeline fill)."""
    plain = simulate("roundpipe", COSTS, 2, 8, partition=PARTITION)
    up = Uploads.uniform(8, 1e6, gbps=20)          # 50 us a layer, against 8 ms a forward slot
    r = simulate("roundpipe", COSTS, 2, 8, partition=PARTITION, uploads=up)
    first = 2e6 / 20e9
    assert plain.makespan < r.makespan <= plain.makespan + first + 1e-12


def test_shared_host_link_divides_bandwidth():
    """host_gbps shared by N GPUs gives each min(gbps, host_gbps / N); activations ride the same link."""
    up = Uploads.uniform(8, 1e9, gbps=24, host_gbps=24, activation_bytes=1e6)
    assert up.bandwidth(1) == 24e9 and up.bandwidth(2) == 12e9 and up.bandwidth(8) == 3e9
    assert up.slot_bytes(range(2), 4, backward=False) == 2e9 + 4e6
    assert up.slot_bytes(range(2), 4, backward=True) == 2e9 + 8e6       # input + gradient flowing in
    assert up.slot_bytes(range(2), 4, backward=True, head=True) == 2e9 + 4e6
    alone = simulate("roundpipe", COSTS, 2, 3, partition=PARTITION, uploads=Uploads.uniform(8, 2e9, gbps=24))
    shared = simulate("roundpipe", COSTS, 2, 3, partition=PARTITION,
                      uploads=Uploads.uniform(8, 2e9, gbps=24, host_gbps=24))
    assert shared.makespan > 1.9 * alone.makespan


def test_async_steady_state_is_upload_bound():
    """Asynchronous iterations flow: the steady-state period is each GPU's upload bytes / bandwidth."""
    up = Uploads.uniform(8, 2e9, 20.0, head_bytes=0.0)
    r = simulate("roundpipe-async", COSTS, 2, 3, partition=PARTITION, uploads=up, iterations=9)
    check_invariants(r.run)
    # 7 slots of 0.2 s a round on 2 GPUs, alternating: 0.7 s an iteration on average
    assert r.makespan == pytest.approx(7 * 0.2 / 2, rel=1e-6)
    assert r.upload_bytes == pytest.approx(7 * 4e9)


def test_bad_uploads():
    """Uploads of another layer count, on a weight-bound schedule, or a zero bandwidth are rejected by name."""
    with pytest.raises(ValueError, match="uploads has bytes for 4 layers"):
        simulate("roundpipe", COSTS, 2, 3, partition=PARTITION, uploads=Uploads.uniform(4, 1.0, gbps=1))
    with pytest.raises(ValueError, match="RoundPipe schedules only"):
        simulate("1f1b", COSTS, 2, 3, uploads=Uploads.uniform(8, 1.0, gbps=1))
    with pytest.raises(ValueError, match="gbps=0"):
        Uploads.uniform(8, 1.0, gbps=0)
    with pytest.raises(ValueError, match=r"layer_bytes\[1\]"):
        Uploads((1.0, -1.0), gbps=1)
    with pytest.raises(TypeError, match="uploads="):
        simulate("roundpipe", COSTS, 2, 3, uploads=1.0)
