"""roundpipe.sim.gains: each GPU-path change of issue 38 on RoundPipe's simulated one-GPU schedule."""
from __future__ import annotations

import random

import pytest

from roundpipe.sim import Costs, HostStep, Uploads
from roundpipe.sim.gains import GpuPath, path_schedule, plain_time, resident_peak, resident_prefix, simulate_path

L = 6
COSTS = Costs.uniform(L, fwd=1.0, bwd=2.0, head_fwd=0.5, head_bwd=1.0)
UPLOADS = Uploads.uniform(L, layer_bytes=1e9, gbps=10.0, head_bytes=2e9, activation_bytes=1e8)
STEP = HostStep.uniform(L, params=1e8, rate=1e9, head_params=2e8)
DEVICE = [0.01] * (L + 1)
PLAN = ([2, 2], [2, 2, 2])      # forward F1 (layers 0-1), F2 (2-3); backward B1 (fused, 4-5), B2 (2-3), B3 (0-1)
MB = 2


ADAPTER = 0.05e9                 # a LoRA layer: 0.95 GB of frozen base, 0.05 GB of trained adapters
FROZEN = [UPLOADS.layer_bytes[0] - ADAPTER] * L + [UPLOADS.head_bytes]     # the LM head frozen whole


def run(path, lag=2, plan=PLAN, workers=1, frozen=()):
    return simulate_path(COSTS, MB, *plan, path, UPLOADS, STEP, DEVICE, iterations=6, lag=lag, workers=workers,
                         frozen_bytes=frozen)


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


def test_a_resident_frozen_base_goes_up_in_the_first_iteration_only():
    """Every layer and the head resident over a frozen base, one fused stage: after the first iteration only
    the adapters go up (once an iteration); the first also fills the cache with the base."""
    for lag in (1, 2):
        r = run(GpuPath(resident=L + 1), lag=lag, plan=([], [L]), frozen=FROZEN)
        assert r.upload_bytes == pytest.approx(L * ADAPTER)
        assert r.uploads[1:] == pytest.approx([L * ADAPTER] * 5)
        assert r.uploads[0] == pytest.approx(L * UPLOADS.layer_bytes[0] + UPLOADS.head_bytes)
        assert r.host_step == run(GpuPath(), lag=lag, plan=([], [L]), frozen=FROZEN).host_step   # still on the host


def test_a_resident_frozen_prefix_saves_both_uploads_a_trained_one_the_second():
    """Layers 0-1 (in F1 and B3) resident: a trained prefix saves one of its two uploads an iteration, a frozen
    base saves both but for the adapters, and the non-resident layers upload their frozen base every slot."""
    today, trained = run(GpuPath()), run(GpuPath(resident=2))
    frozen_today, frozen = run(GpuPath(), frozen=FROZEN), run(GpuPath(resident=2), frozen=FROZEN)
    assert frozen_today.upload_bytes == pytest.approx(today.upload_bytes)     # frozen or not, no cache: same bytes
    assert today.upload_bytes - trained.upload_bytes == pytest.approx(2 * UPLOADS.layer_bytes[0])
    assert today.upload_bytes - frozen.upload_bytes == pytest.approx(2 * (2 * UPLOADS.layer_bytes[0] - ADAPTER))
    assert frozen.iteration <= trained.iteration <= today.iteration


def test_the_weight_cache_is_per_worker():
    """Two GPUs, plan F1 (0-1) F2 (2-3) B1 (fused 4-5) B2 (0-3): F2 and B2 run on the same GPU, F1 and B2 on
    different ones, so a trained resident prefix 0-3 saves the second upload of layers 2-3 only; on one GPU it
    saves all four.  A frozen base goes up once per GPU and then never again."""
    plan = ([2, 2], [2, 4])
    layer = UPLOADS.layer_bytes[0]
    one = run(GpuPath(), plan=plan).upload_bytes - run(GpuPath(resident=4), plan=plan).upload_bytes
    two = (run(GpuPath(), plan=plan, workers=2).upload_bytes
           - run(GpuPath(resident=4), plan=plan, workers=2).upload_bytes)
    assert one == pytest.approx(4 * layer)
    assert two == pytest.approx(2 * layer)
    frozen = run(GpuPath(resident=4), plan=plan, workers=2, frozen=FROZEN)
    base = run(GpuPath(), plan=plan, workers=2, frozen=FROZEN)
    # today 8 layer uploads an iteration; first iteration: layers 0-1 go up to both GPUs, 2-3 to one (6); then
    # only adapters: layers 0-1's on both GPUs, 2-3's once (6 adapters an iteration)
    assert base.uploads[0] - frozen.uploads[0] == pytest.approx(2 * layer)
    assert base.upload_bytes - frozen.upload_bytes == pytest.approx(8 * layer - 6 * ADAPTER)


def test_removing_upload_bytes_never_slows_an_iteration():
    """Random plans, both step modes, one and two GPUs: a resident prefix (trained or frozen) only removes upload
    bytes, so no iteration is longer than today's (vs today >= 1.0x)."""
    rng = random.Random(38)
    for _ in range(12):
        fused = rng.randint(0, 3)
        backward = [fused] + _split(rng, L - fused)
        forward = _split(rng, L - fused)
        workers, lag = rng.choice((1, 2)), rng.choice((1, 2))
        resident = rng.randint(1, L + 1)
        frozen = rng.choice(((), FROZEN))
        today = run(GpuPath(), lag, (forward, backward), workers, frozen)
        res = run(GpuPath(resident=resident), lag, (forward, backward), workers, frozen)
        assert res.upload_bytes <= today.upload_bytes
        assert res.iteration <= today.iteration * (1 + 1e-12), (forward, backward, workers, lag, resident, frozen)


def _split(rng, n):
    """n layers cut into random positive stage sizes."""
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
    edges = [0, *cuts, n]
    return [b - a for a, b in zip(edges, edges[1:])]


def test_the_resident_prefix_is_the_largest_that_fits_and_shrinks_with_the_cap():
    """A worker holds a stage and the one it prefetches, and kept weights of the layers in neither beside them:
    the largest prefix whose peak stays under the cap, smaller for a smaller cap, none where the plan alone
    is over it."""
    two = [(range(0, 4), 5.0), (range(4, 8), 6.0)]
    assert resident_peak(two, [1.0] * 8, 8) == 11.0              # both stages always held: nothing beside
    three = [(range(0, 2), 4.0), (range(2, 5), 4.0), (range(5, 8), 6.0)]
    sizes = [1.0] * 8
    # pairs (F1, F2), (F2, B1), (B1, F1 next iteration): with layers 0..r-1 kept, (F2, B1) has layers 0-1
    # beside, (B1, F1) layers 2-4, (F1, F2) none
    assert [resident_peak(three, sizes, r) for r in (0, 2, 3, 5)] == [10.0, 12.0, 12.0, 13.0]
    assert resident_prefix(three, sizes, 20.0) == 8
    assert resident_prefix(three, sizes, 12.5) == 4
    assert resident_prefix(three, sizes, 11.0) == 1
    assert resident_prefix(three, sizes, 9.0) == 0                # today's plan alone is over: none kept
    with pytest.raises(ValueError, match="resident_bytes"):
        resident_peak(three, [1.0, -1.0], 2)
    with pytest.raises(ValueError, match="resident=3"):
        resident_peak(three, [1.0, 1.0], 3)


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
    with pytest.raises(ValueError, match="frozen_bytes has 2 entries"):
        path_schedule(COSTS, MB, *PLAN, GpuPath(resident=1), UPLOADS, STEP, frozen_bytes=[0.0, 0.0])
    with pytest.raises(ValueError, match=r"frozen_bytes\[6\]"):
        path_schedule(COSTS, MB, *PLAN, GpuPath(resident=1), UPLOADS, STEP, frozen_bytes=[0.0] * L + [3e9])
