"""Shared test setup: Triton interpreter without a GPU, the `cuda` and `multigpu` skips, seeding."""
import random

from roundpipe.testing import triton_interpreter_unless_cuda  # noqa: E402

HAS_CUDA = triton_interpreter_unless_cuda()   # before any kernel module is imported

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    multi = [item for item in items if "multigpu" in item.keywords]
    if multi:   # counted only when such a test was collected, and never without CUDA
        import torch

        count = torch.cuda.device_count() if HAS_CUDA else 0
        if count < 2:
            skip = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs; {count} visible")
            for item in multi:
                item.add_marker(skip)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "cuda" in item.keywords and "multigpu" not in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def restore_level():
    """Puts the native core's SIMD level back after a test that forces one."""
    from roundpipe import _native

    level = _native.simd_level()
    yield
    if _native.available():
        _native.set_simd_level(level)


@pytest.fixture(autouse=True)
def _seed():
    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(params=["io_uring", "threads"])
def state_tier_backend(request, monkeypatch):
    """Runs a test once per file-store backend: the StateTier's NVMeStore is made with NVMeConfig(backend=...)."""
    from roundpipe.offload import state_tier
    from roundpipe.offload.nvme import NVMeConfig, NVMeStore, io_uring_refused

    if request.param == "io_uring" and io_uring_refused():
        pytest.skip(f"no io_uring here: {io_uring_refused()}")

    def store(directory, config=None, **kwargs):
        made = NVMeStore(directory, config or NVMeConfig(backend=request.param), **kwargs)
        assert made.backend == request.param
        return made

    monkeypatch.setattr(state_tier, "NVMeStore", store)
    return request.param
