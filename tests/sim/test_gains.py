"""roundpipe.sim.gains: each GPU-path change of issue 38 on RoundPipe's simulated one-GPU schedule."""
from __future__ import annotations

import pytest

from roundpipe.sim import Costs, HostStep, Uploads
from roundpipe.sim.gains import GpuPath, path_schedule, plain_time, simulate_path

L = 6
COSTS = Costs.uniform(L, fwd=1.0, bwd=2.0, head_fwd=0.5, head_bwd=1.0)
UPLOADS = Uploads.uniform(L, layer_bytes=1e9, gbps=10.0, head_bytes=2e9, activation_bytes=1e8)
STEP = HostStep.uniform(L, params=1e8, rate=1e9, head_params=2e8)
DEVICE = [0.01] * (L + 1)
PLAN = ([2, 2], [2, 2, 2])      # forward F1 (layers 0-1), F2 (2-3); backward B1 (fused, 4-5), B2 (2-3), B3 (0-1)
MB = 2


def run(path, lag=2, plan=PLAN):
    return simulate_path(COSTS, MB, *plan, path, UPLOADS, STEP, DEVICE, iterations=6, lag=lag)


def test_no_recompute_removes_exactly_the_kept_stages_recompute():
    """Keeping B2's activations removes its recompute work (2 layers x 2 microbatches) and nothing else."""
    today, kept = run(GpuPath()), run(GpuPath(kept=(1,)))
    assert today.recompute == pytest.approx(4 * MB * 1.0)          # B2 and B3: two layers each, 2 microbatches
    assert today.recompute - kept.recompute == pytest.approx(MB * (COSTS.fwd[2] + COSTS.fwd[3]))
    assert kept.upload_bytes == pytest.approx(today.upload_bytes - MB * UPLOADS.activation_bytes)
    assert kept.iteration <= today.iteration


def test_fully_resident_model_uploads_nothing_and_steps_nothing_on_the_host():
    """Every layer and the head resident with a device step, one fused stage: no upload bytes, no host step."""
    r = run(GpuPath(resident=L + 1, device_step=True), plan=([], [L]))
    assert r.upload_bytes == 0.0 and r.host_step == 0.0
    assert r.device_step == pytest.approx(sum(DEVICE))
    # then an iteration is the compute of its microbatches plus the device step, as plain PyTorch's
    assert r.iteration == pytest.approx(plain_time(COSTS, MB, sum(DEVICE)))


def test_resident_weights_go_up_once_an_iteration():
    """Resident weights without a device step: layers 0-1 (in F1 and B3) cross once an iteration, not twice."""
    today, res = run(GpuPath()), run(GpuPath(resident=2))
    assert today.upload_bytes - res.upload_bytes == pytest.approx(2 * UPLOADS.layer_bytes[0])
    assert res.host_step == today.host_step


def test_device_step_takes_the_prefix_off_the_host():
    """A resident prefix stepped on the GPU: its host step is gone, its device step is on the GPU."""
    today, dev = run(GpuPath()), run(GpuPath(resident=2, device_step=True))
    assert today.host_step - dev.host_step == pytest.approx(2 * STEP.layer_time(0))
    assert dev.device_step == pytest.approx(2 * DEVICE[0])
    assert today.upload_bytes - dev.upload_bytes == pytest.approx(4 * UPLOADS.layer_bytes[0])


def test_reuse_shortens_each_recompute_and_layer_grain_uploads_each_layers_input():
    """(c) takes reuse_s off each recompute task; (d) uploads one input per recomputed layer."""
    today = run(GpuPath())
    reuse = run(GpuPath(reuse_s=0.25))
    assert today.recompute - reuse.recompute == pytest.approx(0.25 * 2 * MB)
    plan = ([4], [2, 4])                                # B2 recomputes layers 0-3: inputs of layers 1, 2, 3
    grain, whole = run(GpuPath(layer_grain=True), plan=plan), run(GpuPath(), plan=plan)
    assert grain.recompute == whole.recompute
    assert grain.upload_bytes - whole.upload_bytes == pytest.approx(3 * MB * UPLOADS.activation_bytes)


def test_synchronous_step_is_exposed_and_the_asynchronous_one_hides():
    """With a step shorter than an iteration, lag 2 hides it; lag 1 shows part of it."""
    sync, asyn = run(GpuPath(), lag=1), run(GpuPath(), lag=2)
    assert sync.iteration > asyn.iteration


def test_bad_paths_are_refused():
    with pytest.raises(ValueError, match="kept"):
        GpuPath(kept=(0,))
    with pytest.raises(ValueError, match="device_step"):
        GpuPath(device_step=True)
    with pytest.raises(ValueError, match="reuse_s"):
        GpuPath(reuse_s=-1.0)
    with pytest.raises(ValueError, match="resident"):
        path_schedule(COSTS, MB, *PLAN, GpuPath(resident=L + 2), UPLOADS, STEP)
    with pytest.raises(ValueError, match="device_step_s"):
        path_schedule(COSTS, MB, *PLAN, GpuPath(resident=1, device_step=True), UPLOADS, STEP, [0.1])
    with pytest.raises(ValueError, match="past the"):
        path_schedule(COSTS, MB, *PLAN, GpuPath(kept=(3,)), UPLOADS, STEP)
