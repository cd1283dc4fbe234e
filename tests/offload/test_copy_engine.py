"""CopyEngine: byte-exact copies, activation-first priority, LPT windows, fences, argument errors."""
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe import _native
from roundpipe.offload import ArenaConfig, CopyEngine, HostArena, Queue, pack_lpt

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")
C = _native.lib
MiB = 1 << 20


def random_bytes(n):
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


@pytest.mark.parametrize("n", [1, 255, 4097, 3 * MiB + 13])
@pytest.mark.parametrize("threads", [1, 2])
def test_host_copies_are_byte_exact(n, threads):
    """Every queue copies the exact bytes, split over threads or not."""
    engine = CopyEngine("cpu", threads_per_copy=threads)
    for q in Queue:
        src, dst = random_bytes(n), torch.zeros(n, dtype=torch.uint8)
        engine.copy(q, dst, src).wait()
        assert torch.equal(dst, src)


def test_activation_queue_goes_first():
    """Queued parameter copies yield to an activation copy submitted after them."""
    engine = CopyEngine("cpu")
    src, dst = random_bytes(MiB), torch.zeros(MiB, dtype=torch.uint8)
    engine.pause()
    for tag in range(3):
        engine.copy("param_up", dst, src, tag=tag)
    engine.copy("act_up", dst, src, tag=10)
    engine.copy("grad_down", dst, src, tag=20)
    engine.copy("act_down", dst, src, tag=30)
    engine.resume()
    engine.synchronize()
    hist = engine.history()
    up = [t for q, t in hist if q in ("act_up", "param_up")]
    down = [t for q, t in hist if q in ("act_down", "grad_down")]
    assert up == [10, 0, 1, 2]
    assert down == [30, 20]


def test_concurrent_submitters_get_exact_bytes():
    """Four Python threads submitting to one engine at once each get their exact bytes back."""
    import threading

    engine = CopyEngine("cpu")
    failures = []

    def work(seed):
        gen = torch.Generator().manual_seed(seed)
        for i in range(40):
            n = int(torch.randint(1, 200_000, (1,), generator=gen))
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            dst = torch.zeros(n, dtype=torch.uint8)
            queue = list(Queue)[(seed + i) % 4]
            engine.copy(queue, dst, src).wait()
            if not torch.equal(dst, src):
                failures.append((seed, i))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert len(engine.history()) == 160


def test_pack_lpt_known_results():
    """LPT gives the largest piece its own window and pre-splits oversized tensors."""
    assert pack_lpt([100, 50, 30, 20], 2, align=1) == [[(0, 0, 100)], [(1, 0, 50), (2, 0, 30), (3, 0, 20)]]
    assert pack_lpt([1000, 10], 4, align=1) == [[(0, 0, 250), (1, 0, 10)], [(0, 250, 250)], [(0, 500, 250)],
                                               [(0, 750, 250)]]
    assert pack_lpt([0, 0], 3) == [[], [], []]
    assert pack_lpt([512], 1) == [[(0, 0, 512)]]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 10**6), max_size=20), st.integers(1, 9), st.sampled_from([1, 64, 256]))
def test_pack_lpt_covers_every_byte_once_and_balances(sizes, windows, align):
    """Pieces tile each tensor exactly, on align boundaries, and no window exceeds mean + largest piece."""
    plan = pack_lpt(sizes, windows, align)
    assert len(plan) == windows
    pieces = sorted(p for win in plan for p in win)
    for t, s in enumerate(sizes):
        mine = [(o, n) for tt, o, n in pieces if tt == t]
        assert sum(n for _, n in mine) == s
        pos = 0
        for o, n in mine:
            assert o == pos and o % align == 0 and n > 0
            pos += n
    loads = [sum(n for _, _, n in win) for win in plan]
    if pieces:
        assert max(loads) <= sum(sizes) / windows + max(n for _, _, n in pieces)


def test_failed_dependency_fails_the_copy():
    """A copy behind a failed fence fails with that reason, and waiting raises it."""
    engine = CopyEngine("cpu")
    dep = C.HostFence()
    src, dst = random_bytes(64), torch.zeros(64, dtype=torch.uint8)
    f = engine.copy("act_down", dst, src, after=dep)
    dep.fail("upstream kernel crashed")
    with pytest.raises(RuntimeError, match="upstream kernel crashed"):
        f.wait()
    assert f.state == "failed" and not dst.any()


def test_completion_and_keepalive():
    """Fences report done after the copy; tensors dropped right after submit stay valid until then."""
    engine = CopyEngine("cpu")
    dst = torch.zeros(MiB, dtype=torch.uint8)
    src = random_bytes(MiB)
    expected = src.clone()
    engine.pause()
    f = engine.copy("param_up", dst, src)
    del src
    gc.collect()
    _ = [torch.full((MiB,), 7, dtype=torch.uint8) for _ in range(4)]
    assert f.state == "pending" and not f.done()
    engine.resume()
    f.wait()
    assert f.done() and torch.equal(dst, expected)


def test_arena_block_waits_for_engine_fence():
    """An arena tensor whose copy is recorded is not reused until the copy fence completes."""
    arena = HostArena(ArenaConfig(backend="host", chunk_bytes=1 << 20))
    engine = CopyEngine("cpu")
    src = arena.copy_of(random_bytes(4096))
    dst = torch.zeros(4096, dtype=torch.uint8)
    engine.pause()
    f = engine.copy("act_up", dst, src)
    engine.record_into(arena, f, [src, dst])
    addr = src.data_ptr()
    del src
    assert arena.empty(4096, torch.uint8).data_ptr() != addr
    engine.resume()
    f.wait()
    arena.collect()
    assert arena.stats().num_pending == 0


def test_bad_arguments():
    """Bad queues, sizes, layouts, fences and backend-specific calls raise ValueError/TypeError/RuntimeError."""
    engine = CopyEngine("cpu")
    a, b = torch.zeros(8), torch.zeros(9)
    with pytest.raises(ValueError, match="queue='sideways'"):
        engine.copy("sideways", a, a)
    with pytest.raises(ValueError, match="dst\\[0\\] has 32 bytes but src\\[0\\] has 36"):
        engine.copy("act_up", a, b)
    with pytest.raises(ValueError, match="contiguous"):
        engine.copy("act_up", torch.zeros(4, 4).t(), torch.zeros(4, 4))
    with pytest.raises(TypeError, match="src\\[0\\] must be a torch.Tensor"):
        engine.copy("act_up", a, [0.0] * 8)
    with pytest.raises(TypeError, match="after\\[0\\]"):
        engine.copy("act_up", a, a.clone(), after=[object()])
    with pytest.raises(ValueError, match="dsts has 1 tensors but srcs has 2"):
        engine.copy_many("param_up", [a], [a, a])
    with pytest.raises(ValueError, match="windows=0"):
        pack_lpt([1], 0)
    with pytest.raises(ValueError, match="sizes\\[1\\]=-3"):
        pack_lpt([1, -3], 2)
    with pytest.raises(ValueError, match="threads_per_copy=0"):
        CopyEngine("cpu", threads_per_copy=0)
    with pytest.raises(ValueError, match="device='meta'"):
        CopyEngine("meta")
    with pytest.raises(ValueError, match="CUDA engine"):
        engine.stream("act_up")
    engine.pause()
    engine.copy("act_up", a, a.clone())
    with pytest.raises(RuntimeError, match="paused"):
        engine.synchronize()
    engine.resume()
    engine.synchronize()


def test_bad_arguments_at_the_native_boundary():
    """Overlapping copies, tags past 64 bits, thread counts past 256 and absurd packings are errors naming them."""
    engine = CopyEngine("cpu")
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"dst\[0\] and src\[0\] overlap in memory"):
        engine.copy("act_up", buf[:32], buf[16:48])
    with pytest.raises(ValueError, match="tag=9223372036854775808 must fit in 64 bits"):
        engine.copy("act_up", buf[:8], buf[8:16], tag=2**63)
    with pytest.raises(TypeError, match="tag must be an int"):
        engine.copy("act_up", buf[:8], buf[8:16], tag="first")
    with pytest.raises(TypeError, match="after must be a fence or an iterable of fences, got int"):
        engine.copy("act_up", buf[:8], buf[8:16], after=3)
    with pytest.raises(ValueError, match=r"threads_per_copy=257 must be in \[1, 256\]"):
        CopyEngine("cpu", threads_per_copy=257)
    with pytest.raises(ValueError, match=r"windows=65537 must be in \[1, 65536\]"):
        pack_lpt([1], 65537)
    with pytest.raises(ValueError, match="sizes add up to more than"):
        pack_lpt([2**62, 2**62], 2)
    with pytest.raises(ValueError, match="queue=7 is not a copy queue"):
        C.HostCopyEngine(1).submit(C.CopyQueue(7), [], [])
    engine.synchronize()


def test_most_threads_per_copy_still_copy_exactly():
    """The largest accepted thread count (256) splits a 3 MiB copy over a full team and copies every byte."""
    engine = CopyEngine("cpu", threads_per_copy=256)
    src, dst = random_bytes(3 * MiB + 5), torch.zeros(3 * MiB + 5, dtype=torch.uint8)
    engine.copy("param_up", dst, src).wait()
    assert torch.equal(dst, src)


@pytest.mark.cuda
def test_cuda_engine_round_trip_and_stream_wait():
    """On a GPU: H2D/D2H through the four streams are exact and a compute stream can wait on a fence."""
    from roundpipe.offload import make_stream_wait

    arena = HostArena(ArenaConfig(backend="cuda"))
    engine = CopyEngine("cuda:0")
    host = arena.copy_of(torch.randn(1 << 20))
    dev = torch.empty(1 << 20, device="cuda")
    up = engine.copy("act_up", dev, host)
    compute = torch.cuda.Stream()
    make_stream_wait(up, compute)
    with torch.cuda.stream(compute):
        doubled = dev * 2
    done = compute.record_event()
    back = arena.empty(1 << 20)
    from roundpipe.offload.fences import stream_fence
    down = engine.copy("grad_down", back, doubled, after=[stream_fence(compute)])
    down.wait()
    done.synchronize()
    assert torch.equal(back, host * 2)
    params = [arena.copy_of(torch.randn(n)) for n in (300_000, 70_001, 5)]
    gpu = [torch.empty(p.shape, device="cuda") for p in params]
    acts = [engine.copy("act_up", dev, host) for _ in range(3)]
    engine.copy_many("param_up", gpu, params, after=acts).wait()
    assert all(torch.equal(g.cpu(), p) for g, p in zip(gpu, params))
    assert engine.stream("param_up").cuda_stream != engine.stream("act_up").cuda_stream


def test_arena_deferral_protects_inflight_copies_with_random_delays():
    """Blocks freed under delayed native copies are not recycled: every copy delivers its original bytes."""
    import random
    import threading

    rng = random.Random(0)
    arena = HostArena(ArenaConfig(backend="host", chunk_bytes=1 << 20))
    engine = CopyEngine("cpu")
    q = C.CopyQueue.act_up
    n = 32 * 1024
    dsts, timers = [], []
    for i in range(24):
        src = arena.empty(n, torch.uint8).fill_(i)
        dst = torch.zeros(n, dtype=torch.uint8)
        gate = C.HostFence()
        # The native submit holds no tensor reference: only the arena's fence deferral protects src.
        fence = engine._engine.submit(q, [(dst.data_ptr(), src.data_ptr(), n)], [gate])
        arena.record(src, fence)
        del src
        arena.empty(n, torch.uint8).fill_(255)  # would overwrite src's block if it were reused early
        timer = threading.Timer(rng.uniform(0.0, 0.02), gate.set)
        timer.start()
        dsts.append(dst)
        timers.append(timer)
    engine.synchronize()
    for t in timers:
        t.join()
    assert all(bool((d == i).all()) for i, d in enumerate(dsts))
    arena.collect()
    assert arena.stats().num_pending == 0
