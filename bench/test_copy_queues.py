"""Copy-engine bandwidth per queue and size, against torch `copy_` (host backend without a GPU).

Upload queues (act_up, param_up) copy host arena -> device, download queues (act_down,
grad_down) device -> host arena; on CPU both sides are host memory and the copy runs on
that queue's worker thread.  extra_info "GB/s" is bytes moved over the median time.
"""
import pytest
import torch

from roundpipe import _native
from roundpipe.offload import ArenaConfig, CopyEngine, HostArena, Queue

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, MiB, 16 * MiB]
PROVIDERS = [q.value for q in Queue] + ["torch copy_ up", "torch copy_ down"]


def _size_name(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def engine_arena(request):
    device = request.param
    arena = HostArena(ArenaConfig(backend="cuda" if device == "cuda" else "host"))
    return CopyEngine(device), arena


@pytest.mark.parametrize("size", SIZES, ids=_size_name)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_copy(benchmark, rate, engine_arena, provider, size):
    engine, arena = engine_arena
    device = engine.device
    host = arena.copy_of(torch.randint(0, 255, (size,), dtype=torch.uint8))
    other = torch.empty(size, dtype=torch.uint8, device=device)
    upload = provider in ("act_up", "param_up", "torch copy_ up")
    dst, src = (other, host) if upload else (host, other)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if provider.startswith("torch"):
        def run():
            dst.copy_(src, non_blocking=True)
            sync()
    else:
        def run():
            engine.copy(provider, dst, src).wait()
    benchmark.group = f"copy {device.type} {_size_name(size)}"
    benchmark.extra_info["bytes"] = size
    benchmark(run)
    rate(size / 1e9, "GB/s")
