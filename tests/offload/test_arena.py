"""HostArena: exact-size best-fit blocks, fence-ordered reuse, limits, tensor lifetime."""
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundpipe import _native
from roundpipe.offload import ArenaConfig, HostArena

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")
C = _native.lib
KiB, MiB = 1 << 10, 1 << 20


def run_in_threads(work, n):
    """work(seed) on n threads at once; returns when all ended (a hang is the suite's watchdog's)."""
    threads = [threading.Thread(target=work, args=(s,)) for s in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def small_arena(**kw):
    cfg = dict(chunk_bytes=256 * KiB, alignment=256, backend="host")
    cfg.update(kw)
    return HostArena(ArenaConfig(**cfg))


def fill(block, value):
    torch.frombuffer(block, dtype=torch.uint8).fill_(value)


def intact(block, value):
    return bool((torch.frombuffer(block, dtype=torch.uint8) == value).all())


def check_invariants(arena, live, num_pending):
    """No overlap, alignment, and accounting that matches the blocks we hold."""
    spans = sorted(arena._arena.block_of(b.address) for b, _ in live)
    for (a0, s0), (a1, _) in zip(spans, spans[1:]):
        assert a0 + s0 <= a1, "live blocks overlap"
    align = arena.config.alignment
    assert all(a % align == 0 and s % align == 0 for a, s in spans)
    st_ = arena.stats()
    assert st_.num_blocks == len(live)
    assert st_.requested_bytes == sum(b.nbytes for b, _ in live)
    assert st_.in_use_bytes == sum(s for _, s in spans) + st_.pending_bytes
    assert st_.num_pending == num_pending
    assert st_.free_bytes == st_.reserved_bytes - st_.in_use_bytes
    assert st_.largest_free_block <= st_.free_bytes


ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "free_fenced", "signal"]),
                         st.integers(1, 300 * KiB), st.integers(0, 10**6)), max_size=60)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_sequences_keep_invariants_and_coalesce(seq):
    """Random alloc/free/fence sequences: no overlap, aligned, exact accounting, one segment per chunk at the end."""
    arena = small_arena()
    live, fences = [], []
    for n, (op, size, pick) in enumerate(seq):
        if op == "alloc":
            b = arena._arena.allocate(size)
            fill(b, n % 251)
            live.append((b, n % 251))
        elif op in ("free", "free_fenced") and live:
            b, v = live.pop(pick % len(live))
            assert intact(b, v), "another block overwrote this one"
            if op == "free_fenced":
                f = C.HostFence()
                arena._arena.record(b.address, f)
                fences.append(f)
            del b
        elif op == "signal" and fences:
            fences[pick % len(fences)].set()
        arena.collect()
        check_invariants(arena, live, sum(f.state == "pending" for f in fences))
    assert all(intact(b, v) for b, v in live)
    b = None  # the loop variable may still hold the last allocated block
    live.clear()
    for f in fences:
        f.set()
    arena.collect()
    s = arena.stats()
    assert s.in_use_bytes == 0 and s.num_pending == 0
    assert s.num_free_segments == s.num_chunks, "free neighbours were not coalesced"
    assert arena.release_unused() == s.reserved_bytes
    assert arena.stats().reserved_bytes == 0


def test_no_power_of_two_rounding():
    """A request costs its size rounded to the alignment, not to a power of two."""
    arena = small_arena(alignment=64)
    b = arena._arena.allocate(65 * KiB + 1)
    assert arena._arena.block_of(b.address)[1] == 65 * KiB + 64
    assert arena.stats().requested_bytes == 65 * KiB + 1


def test_best_fit_picks_smallest_hole():
    """Of two free holes the smallest one that fits is reused."""
    arena = small_arena(alignment=256)
    blocks = [arena._arena.allocate(n) for n in (8 * KiB, 1 * KiB, 4 * KiB, 1 * KiB)]
    big_hole, small_hole = blocks[0].address, blocks[2].address
    del blocks[2], blocks[0]
    b = arena._arena.allocate(3 * KiB)
    assert b.address == small_hole and b.address != big_hole


def test_no_reuse_before_fence_completes():
    """A freed block with a pending fence is not handed out again until the fence is set."""
    arena = small_arena()
    b = arena._arena.allocate(16 * KiB)
    addr = b.address
    fence = C.HostFence()
    arena._arena.record(addr, fence)
    del b
    assert arena.stats().pending_bytes == 16 * KiB
    # 15 blocks fill the first chunk, 5 go to a second one.  They stay alive: freed, both
    # chunks would be wholly free and equally sized, and best fit breaks that tie by
    # address, i.e. by where malloc happened to put the second chunk.
    others = [arena._arena.allocate(16 * KiB) for _ in range(20)]
    assert addr not in {o.address for o in others}
    fence.set()
    assert arena.collect() == 1
    assert arena._arena.allocate(16 * KiB).address == addr   # the best fit: the freed 16 KiB hole


def test_failed_fence_releases_block():
    """A fence that failed no longer holds the block (the copy will never touch it)."""
    arena = small_arena()
    t = arena.empty(1024, torch.uint8)
    f = C.HostFence()
    arena.record(t, f)
    del t
    f.fail("copy aborted")
    arena.collect()
    assert arena.stats().in_use_bytes == 0


def test_exhaustion_error_names_request_and_limit():
    """Over the limit: MemoryError subclass naming the request and the limit."""
    arena = small_arena(limit_bytes=1 * MiB)
    keep = arena.empty(600 * KiB, torch.uint8)
    with pytest.raises(C.ArenaExhaustedError) as err:
        arena.empty(700 * KiB, torch.uint8)
    assert isinstance(err.value, MemoryError)
    msg = str(err.value)
    assert "700.00 KiB (716800 bytes)" in msg and "limit_bytes is 1.00 MiB (1048576 bytes)" in msg
    assert keep.numel() == 600 * KiB


def test_at_limit_waits_for_pending_fence():
    """At the limit, an allocation waits for an in-flight block instead of failing."""
    arena = small_arena(limit_bytes=512 * KiB, chunk_bytes=512 * KiB)
    t = arena.empty(400 * KiB, torch.uint8)
    f = C.HostFence()
    arena.record(t, f)
    del t
    released = []

    def release():
        released.append(True)
        f.set()
    timer = threading.Timer(0.05, release)
    timer.start()
    u = arena.empty(400 * KiB, torch.uint8)
    assert released, "the allocation returned before the pending block's fence was set"
    assert u.numel() == 400 * KiB
    timer.join()


def test_idle_chunks_released_to_fit_under_limit():
    """Wholly free chunks are returned to make room for a request that needs a new one."""
    arena = small_arena(limit_bytes=1 * MiB, chunk_bytes=512 * KiB)
    a = arena.empty(300 * KiB, torch.uint8)
    del a
    big = arena.empty(900 * KiB, torch.uint8)
    assert arena.stats().reserved_bytes <= 1 * MiB and big.numel() == 900 * KiB


def test_tensor_lifetime_returns_block():
    """A tensor (and its views) keeps its block; releasing the last one returns it."""
    arena = small_arena()
    t = arena.empty((10, 33), torch.float32)
    assert t.shape == (10, 33) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % 256 == 0 and arena.owns(t)
    view = t[3:]
    del t
    assert arena.stats().num_blocks == 1
    view.fill_(2.5)
    assert float(view.sum()) == 2.5 * 7 * 33
    del view
    assert arena.stats().num_blocks == 0


def test_copy_of_and_zero_size():
    """copy_of duplicates a tensor into the arena; zero-size requests give ordinary empty tensors."""
    arena = small_arena()
    src = torch.randn(5, 7, dtype=torch.bfloat16)
    dup = arena.copy_of(src)
    assert torch.equal(dup, src) and arena.owns(dup)
    z = arena.empty((0, 4), torch.float16)
    assert z.shape == (0, 4) and not arena.owns(z)


def test_reserve_then_carve_exactly():
    """reserve(total) then allocating the tensors uses no further chunk."""
    arena = small_arena(chunk_bytes=64 * KiB)
    sizes = [100 * KiB, 3 * KiB + 5, 250 * KiB]
    arena.reserve(sum((s + 255) // 256 * 256 for s in sizes))
    ts = [arena.empty(s, torch.uint8) for s in sizes]
    s = arena.stats()
    assert s.num_chunks == 1 and s.reserved_bytes < sum(sizes) * 1.01
    assert len(ts) == 3


def test_stats_peak_and_fragmentation():
    """Holes between live blocks show up as fragmentation; the peak survives frees."""
    arena = small_arena(chunk_bytes=64 * KiB, alignment=256)
    blocks = [arena._arena.allocate(8 * KiB) for _ in range(8)]
    peak = arena.stats().in_use_bytes
    del blocks[6], blocks[4], blocks[2], blocks[0]  # four 8 KiB holes
    s = arena.stats()
    assert s.peak_in_use_bytes == peak == 64 * KiB and s.in_use_bytes == 32 * KiB
    assert s.largest_free_block == 8 * KiB and s.free_bytes == 32 * KiB
    assert s.fragmentation == pytest.approx(0.75)
    blocks.clear()
    s = arena.stats()
    assert s.fragmentation == 0.0 and s.largest_free_block == 64 * KiB and s.num_allocations == 8


def test_thread_stress():
    """Four threads allocating, writing, verifying and freeing concurrently corrupt nothing."""
    arena = small_arena(chunk_bytes=1 * MiB)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        held = []
        for i in range(600):
            if held and rng.random() < 0.5:
                b, v = held.pop(rng.randrange(len(held)))
                if not intact(b, v):
                    errors.append("corrupted block")
            else:
                b = arena._arena.allocate(rng.randrange(1, 48 * KiB))
                v = (seed * 37 + i) % 256
                fill(b, v)
                held.append((b, v))
        held.clear()

    run_in_threads(work, 4)
    assert not errors
    s = arena.stats()
    assert s.in_use_bytes == 0 and s.num_blocks == 0 and s.num_free_segments == s.num_chunks


def test_bad_arguments():
    """Config and call errors are ValueError/TypeError naming the argument."""
    with pytest.raises(ValueError, match="alignment=100"):
        ArenaConfig(alignment=100)
    with pytest.raises(ValueError, match="chunk_bytes=10"):
        ArenaConfig(chunk_bytes=10)
    with pytest.raises(ValueError, match="backend='gpu'"):
        ArenaConfig(backend="gpu")
    with pytest.raises(TypeError, match="limit_bytes"):
        ArenaConfig(limit_bytes=1.5)
    arena = small_arena()
    with pytest.raises(ValueError, match="not a tensor of this arena"):
        arena.record(torch.ones(4), C.HostFence())
    with pytest.raises(TypeError, match="fence"):
        arena.record(arena.empty(4), object())
    with pytest.raises(ValueError, match="negative"):
        arena.empty((-1, 2))
    with pytest.raises(ValueError, match="nbytes"):
        arena.reserve(0)


def test_sizes_past_any_buffer_are_refused():
    """Requests that wrapped around 2**64 (reserve(2**64-4095) reserved 0 bytes) are ValueErrors naming them."""
    arena = small_arena()
    with pytest.raises(ValueError, match="nbytes=18446744073709547521 must be at most"):
        arena.reserve(2**64 - 4095)
    with pytest.raises(ValueError, match="nbytes=18446744073709551615 must be at most"):
        arena._arena.allocate(2**64 - 1)
    with pytest.raises(ValueError, match=r"shape=\(4294967296, 4294967296\) of torch.float32 is 73786976294838206464 "
                       "bytes"):
        arena.empty((2**32, 2**32))  # torch.Size.numel() wraps this to 0
    with pytest.raises(TypeError, match="shape must be an int or a sequence of ints"):
        arena.empty(2.5)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        arena.reserve(4096.0)
    with pytest.raises(ValueError, match="chunk_bytes=18446744073709551615 must be at most"):
        C.HostArena(2**64 - 1, 256, 0, "host")
    with pytest.raises(C.ArenaExhaustedError):  # possible in principle, but not here
        arena._arena.allocate(2**62)
    s = arena.stats()
    assert s.num_blocks == 0 and s.in_use_bytes == 0


def test_page_locking_runs_outside_the_lock():
    """While one thread grows the arena (its allocator made to take 0.6 s, as cudaHostAlloc of a large
    chunk does), another thread's allocation from space already free returns at once; both blocks are right."""
    arena = C.HostArena(256 * KiB, 256, 0, "host", system_delay_s=0.6)
    arena.reserve(256 * KiB)                     # free space for the small request
    grown = []
    grower = threading.Thread(target=lambda: grown.append(arena.allocate(1 * MiB)))   # needs a new chunk
    grower.start()
    time.sleep(0.15)                             # the grower is inside the slow allocator now
    t0 = time.perf_counter()
    small = arena.allocate(4 * KiB)
    waited = time.perf_counter() - t0
    grower.join()
    assert waited < 0.3, f"an allocation from free space waited {waited:.2f} s for another thread's page-locking"
    fill(small, 7)
    fill(grown[0], 9)
    assert intact(small, 7) and intact(grown[0], 9)
    s = arena.stats()
    assert s["num_chunks"] == 2 and s["reserved_bytes"] == 256 * KiB + 1 * MiB


def test_growth_in_flight_counts_against_the_limit():
    """A chunk being page-locked on another thread counts against limit_bytes: a request that finds no room
    waits for that growth instead of growing past the limit or failing, and then fits in what it left."""
    arena = C.HostArena(256 * KiB, 256, 280 * KiB, "host", system_delay_s=0.5)   # no room for a second chunk
    big = []
    grower = threading.Thread(target=lambda: big.append(arena.allocate(100 * KiB)))   # a 256 KiB chunk
    grower.start()
    time.sleep(0.15)
    small = arena.allocate(40 * KiB)     # no room, and no chunk fits beside the one in flight: waits for it
    grower.join()
    s = arena.stats()
    assert s["num_chunks"] == 1 and s["peak_reserved_bytes"] == 256 * KiB
    a0, _ = arena.block_of(big[0].address)
    assert a0 <= small.address < a0 + 256 * KiB


def test_concurrent_growth_and_release_corrupt_nothing():
    """Threads growing a limited arena at once, with a slow allocator and idle chunks being released
    meanwhile, never reserve past the limit and corrupt nothing."""
    # at most 12 blocks of < 30 KiB live or being allocated: at worst one per 64 KiB chunk, so 768 KiB always
    # suffices, yet the limit is reached
    arena = C.HostArena(64 * KiB, 256, 768 * KiB, "host", system_delay_s=0.01)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        held = []
        try:
            for i in range(40):
                if len(held) == 3 or (held and rng.random() < 0.5):
                    b, v = held.pop(rng.randrange(len(held)))
                    if not intact(b, v):
                        errors.append("corrupted block")
                else:
                    b = arena.allocate(rng.randrange(1, 30 * KiB))
                    v = (seed * 31 + i) % 256
                    fill(b, v)
                    held.append((b, v))
                if rng.random() < 0.1:
                    arena.release_unused()
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(repr(e))
        held.clear()

    run_in_threads(work, 4)
    assert not errors
    s = arena.stats()
    assert s["peak_reserved_bytes"] <= 768 * KiB and s["in_use_bytes"] == 0 and s["num_blocks"] == 0


def test_bad_hooks_are_named():
    """system_delay_s and home_device out of range are ValueErrors naming them; home_device must be an int."""
    with pytest.raises(ValueError, match="system_delay_s=-1 must be"):
        C.HostArena(256 * KiB, 256, 0, "host", system_delay_s=-1.0)
    with pytest.raises(ValueError, match="home_device=-2 must be"):
        C.HostArena(256 * KiB, 256, 0, "host", home_device=-2)
    with pytest.raises(ValueError, match="home_device=-1 must be None or a CUDA device index"):
        ArenaConfig(home_device=-1)
    with pytest.raises(TypeError, match="home_device must be None or a CUDA device index"):
        ArenaConfig(home_device="cuda:1")


def test_chunks_are_page_locked_in_the_home_devices_context():
    """With a home device, a thread that never chose a GPU (a completion or G-copy thread) page-locks and frees
    chunks in that device's context, restored after: no context is created on GPU 0 (0.3-0.5 GB per process),
    the thread's own device is left as it was.  Modelled by a stand-in CUDA runtime (C.FakeCuda)."""
    fake = C.FakeCuda(4)
    arena = C.HostArena(256 * KiB, 256, 0, "cuda", home_device=2, cuda=fake)
    assert arena.pinned

    def grow_and_release():
        blocks = [arena.allocate(100 * KiB) for _ in range(5)]     # three chunks
        depth, device = fake.thread_context_depth(), fake.thread_device()
        blocks.clear()
        arena.release_unused()
        result.append((depth, device, fake.thread_context_depth(), fake.thread_device()))

    result = []
    t = threading.Thread(target=grow_and_release)
    t.start()
    t.join()
    assert result == [(0, 0, 0, 0)]                              # nothing left current on that thread
    assert fake.contexts_created == [2]
    locks = [(call, dev) for call, dev in fake.calls if call in ("cudaHostAlloc", "cudaFreeHost")]
    assert locks == [("cudaHostAlloc", 2)] * 3 + [("cudaFreeHost", 2)] * 3
    fake.set_device(1)                                           # a thread that did choose a GPU keeps it
    b = arena.allocate(300 * KiB)
    assert fake.thread_device() == 1 and fake.calls[-1] == ("cudaHostAlloc", 2)
    del b
    arena = None   # the arena frees its chunks now (a del would unbind the closure's name)


@pytest.mark.cuda
def test_cuda_arena_is_pinned_and_fence_ordered():
    """On a GPU the arena page-locks memory, copies are async, and record_stream defers reuse."""
    arena = HostArena(ArenaConfig(backend="cuda"))
    assert arena.pinned
    t = arena.copy_of(torch.arange(1 << 20, dtype=torch.float32))
    assert t.is_pinned()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        g = t.to("cuda", non_blocking=True)
        arena.record_stream(t, s)
    addr = t.data_ptr()
    del t
    assert arena.stats().num_pending == 1
    u = arena.empty(1 << 20, torch.float32)
    assert u.data_ptr() != addr
    s.synchronize()
    arena.collect()
    assert arena.stats().num_pending == 0
    assert torch.equal(g.cpu(), torch.arange(1 << 20, dtype=torch.float32))


def test_pinned_arena_initialises_torch_cuda_so_is_pinned_agrees(monkeypatch):
    """torch answers is_pinned() False for every pointer until it has initialised CUDA itself
    (at::Context::isPinnedPtr), and the arena page-locks through its own runtime handle: an arena
    built before any torch CUDA call gave arena.pinned True and t.is_pinned() False on an H200.
    The CPU analogue: a page-locking arena (fake runtime) must start torch's CUDA when torch has one."""
    import roundpipe.offload.arena as arena_mod

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    native = C

    class FakeNative:
        def HostArena(self, *args, **kwargs):
            return native.HostArena(*args, cuda=native.FakeCuda(1), **kwargs)

    monkeypatch.setattr(arena_mod, "_c", lambda: FakeNative())
    arena = HostArena(ArenaConfig(backend="cuda"))
    assert arena.pinned and calls == ["init"]
    monkeypatch.setattr(arena_mod, "_c", lambda: native)
    assert not HostArena(ArenaConfig(backend="host")).pinned and calls == ["init"]   # host memory: no CUDA start
