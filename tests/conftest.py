"""Shared test setup: test folders on the import path, Triton interpreter without a GPU, the `cuda` and
`multigpu` skips, seeding.

The tests mirror the package (tests/engine/, tests/workers/, ...); helpers shared across folders
(rp_models, stale_reference, ranks, ...) live in tests/ itself, and a test may import another folder's
test module for its helpers.  So tests/ and every folder under it go on sys.path, and on PYTHONPATH
for the scripts that tests start as subprocesses (ranks, checkpoint runs).
"""
import os
import random
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_FOLDERS = [str(_TESTS)] + sorted(str(d) for d in _TESTS.iterdir() if d.is_dir() and d.name[0] not in "._")
sys.path[:0] = [f for f in _FOLDERS if f not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(_FOLDERS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

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
