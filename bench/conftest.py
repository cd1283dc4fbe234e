"""The microbenchmarks as a pytest-benchmark suite: `pytest bench --benchmark-only`.

The programs in this folder (cpu_optim.py, dispatch.py, kernels.py, schedules.py) and
`roundpipe bench NAME` are the benchmarks proper: providers side by side, tables,
JSON rows with their provenance.  The test_*.py files here time the same operations
at small sizes with pytest-benchmark, so two machines (or two commits) can be
compared with its own tools:

    pytest bench --benchmark-only --benchmark-autosave     # .benchmarks/<machine>/0001_*.json
    pytest bench --benchmark-only --benchmark-compare      # against the last saved run
    pytest-benchmark compare 0001 0002 --group-by=group

Each machine-info record carries roundpipe's environment (device, CPU, commit,
SIMD level, versions).  `make test` never runs this folder (testpaths = tests).
Without a GPU everything runs on CPU, the kernels under the Triton interpreter
(timings that say nothing about kernel speed; extra_info "path" says which ran);
with one, the cuda cases run too.
"""
import sys
from pathlib import Path

from roundpipe.testing import triton_interpreter_unless_cuda  # noqa: E402

HAS_CUDA = triton_interpreter_unless_cuda()   # before any kernel module is imported
# The programs beside this file are imported by name (cpu_optim, dispatch, kernels).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

try:
    import pytest_benchmark  # noqa: F401
except ImportError:
    # The suite needs the plugin's `benchmark` fixture; say so once instead of erroring per test.
    collect_ignore_glob = ["test_*.py"]

    def pytest_report_header(config):
        return "bench: pytest-benchmark is not installed (pip install -e '.[dev]'); no benchmark collected"
else:
    def pytest_benchmark_update_machine_info(config, machine_info):
        from roundpipe.bench.runner import environment

        machine_info["roundpipe"] = environment()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


@pytest.fixture
def rate(benchmark):
    """record(amount, unit): after the timed run, stores amount / median seconds as extra_info[unit]."""
    def record(amount: float, unit: str) -> None:
        if benchmark.stats:   # None under --benchmark-disable (one plain call)
            benchmark.extra_info[unit] = amount / benchmark.stats.stats.median
    return record
