"""Engine tests run their CPU workers under the strict device model (roundpipe/workers/strict.py): every copy
late on its own queue, sources checked for unordered writes, destinations poisoned until their copy is done.

Seeded per test (its node id), so a failing test's delays replay; ranks started as subprocesses inherit it
through the environment.  `ROUNDPIPE_DEVICE_MODEL=fast` runs them on the fast model instead, and
`ROUNDPIPE_DEVICE_MODEL=strict` runs every test of the suite under the strict one.  A test of the fast model
itself (inline copies, the threads a worker has) is marked `fast_device`.
"""
import os
import zlib

import pytest

from roundpipe.workers import strict


@pytest.fixture(autouse=True)
def _device_model(request, monkeypatch):
    if os.environ.get(strict.ENV, "") == "fast" or request.node.get_closest_marker("fast_device"):
        with strict.model(None):
            yield
        return
    seed = zlib.crc32(request.node.nodeid.encode())
    monkeypatch.setenv(strict.ENV, "strict")
    monkeypatch.setenv(strict.ENV + "_SEED", str(seed))
    with strict.model(strict.DeviceModel(seed=seed)):
        yield
