"""The NVMe file store (roundpipe.offload.nvme over csrc/nvme_io): bytes, ordering, faults and bad arguments, each
with the io_uring backend and with the thread pool."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from roundpipe import _native

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")

if _native.available():
    from roundpipe.offload import ArenaConfig, HostArena, IoFence, NVMeConfig, NVMeStore, StorageError
    from roundpipe.offload.nvme import check_free_space, file_bytes, free_bytes, io_uring_refused

BACKENDS = ["io_uring", "threads"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "io_uring" and io_uring_refused():
        pytest.skip(f"no io_uring here: {io_uring_refused()}")
    return request.param


AWKWARD = [0, 1, 123, 4095, 4096, 4097, 3000 * 7, (64 << 10) - 1, (1 << 20) + 5, 3 * (64 << 10) + 17]


def _random(store, nbytes, seed):
    g = torch.Generator().manual_seed(seed)
    t = store.empty(nbytes)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return t


@pytest.fixture
def store(tmp_path, backend):
    s = NVMeStore(tmp_path, NVMeConfig(threads=3, chunk_bytes=64 << 10, backend=backend))
    assert s.backend == backend
    yield s
    s.close()


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_round_trip_awkward_sizes_bitwise(tmp_path, direct, backend):
    """Regions of awkward sizes (0, 1, 4095, 4097, several chunks + 17) read back bit for bit, O_DIRECT and buffered."""
    with NVMeStore(tmp_path, NVMeConfig(threads=3, chunk_bytes=64 << 10, direct=direct, backend=backend)) as store:
        assert store.direct == (direct == "auto")   # this machine's disk takes O_DIRECT
        regions = [store.allocate(f"r{i}", n) for i, n in enumerate(AWKWARD)]
        for r in regions:
            assert os.path.getsize(r.path) == file_bytes(r.nbytes)
        srcs = [_random(store, r.nbytes, i) for i, r in enumerate(regions)]
        fences = [store.write_async(r, s) for r, s in zip(regions, srcs)]
        store.wait(*fences)
        outs = [store.empty(r.nbytes) for r in regions]
        store.wait(*[store.read_async(r, o) for r, o in zip(regions, outs)])
        for s, o in zip(srcs, outs):
            assert torch.equal(s, o)
        folder = store.folder
    assert not os.path.exists(folder)   # close removes the store's files


def test_sub_ranges_and_dtypes(store):
    """Reads and writes at 4096-multiples inside a region, with float tensors, leave the other bytes alone."""
    r = store.allocate("layer", 5 * 4096 + 100)
    whole = _random(store, r.nbytes, 1)
    store.write(r, whole)
    part = store.empty(1024, torch.float32)           # bytes [8192, 12288)
    part.copy_(torch.randn(1024))
    store.write(r, part, offset=8192)
    tail = store.empty(4096 + 100)                     # to the region's end: may end mid-block
    tail.fill_(7)
    store.write(r, tail, offset=4 * 4096)
    out = store.read(r, store.empty(r.nbytes))
    expect = whole.clone()
    expect[8192:12288] = part.view(torch.uint8)
    expect[4 * 4096:] = 7
    assert torch.equal(out, expect)
    small = store.read(r, store.empty(300, torch.uint8), offset=8192)   # a read may end anywhere
    assert torch.equal(small, part.view(torch.uint8)[:300])


def test_concurrent_threads(store):
    """Four Python threads writing and reading their own regions at once all get their own bytes back."""
    errors = []

    def run(k):
        try:
            regions = [store.allocate(f"t{k}-{i}", (200 << 10) + 37 * i) for i in range(3)]
            for rep in range(3):
                srcs = [_random(store, r.nbytes, 100 * k + 10 * rep + i) for i, r in enumerate(regions)]
                store.wait(*[store.write_async(r, s) for r, s in zip(regions, srcs)])
                outs = [store.empty(r.nbytes) for r in regions]
                store.wait(*[store.read_async(r, o) for r, o in zip(regions, outs)])
                assert all(torch.equal(s, o) for s, o in zip(srcs, outs))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_read_ahead_write_behind_order(tmp_path, backend):
    """With chunks delayed at random on 4 threads, a read queued right after a write of the same bytes sees the
    write, and a write queued after a read does not change what the read returns: a per-layer loop of read ahead,
    update, write behind needs no waits between."""
    store = NVMeStore(tmp_path, NVMeConfig(threads=4, chunk_bytes=16 << 10, backend=backend),
                      _test_hooks={"delay_s": 0.004})
    try:
        r = store.allocate("rw", 48 << 10)
        for k in range(6):   # write then read at once, no wait between
            src = _random(store, r.nbytes, k)
            store.write_async(r, src)
            out = store.empty(r.nbytes)
            store.wait(store.read_async(r, out))
            assert torch.equal(out, src), k
        layers, n = 4, 64 << 10
        regions = [store.allocate(f"layer{i}", n) for i in range(layers)]
        bufs = [store.empty(n // 4, torch.int32) for _ in range(2)]
        for i, r in enumerate(regions):
            bufs[0].fill_(i)
            store.write(r, bufs[0])
        # Two steps of "read layer i+1 ahead while layer i is updated and written behind".
        for step in range(2):
            ahead = store.read_async(regions[0], bufs[0])
            for i in range(layers):
                cur = bufs[i % 2]
                store.wait(ahead)
                assert torch.all(cur == i + 10 * step), (step, i, cur[:4])
                cur.add_(10)
                behind_src = store.empty(n // 4, torch.int32)
                behind_src.copy_(cur)
                store.write_async(regions[i], behind_src)
                if i + 1 < layers:   # the next buffer was written behind one layer ago: the read is ordered after
                    ahead = store.read_async(regions[i + 1], bufs[(i + 1) % 2])
            # read, then overwrite at once: the read returns the old bytes
            old = store.empty(n // 4, torch.int32)
            f_read = store.read_async(regions[0], old)
            junk = store.empty(n // 4, torch.int32)
            junk.fill_(-1)
            f_write = store.write_async(regions[0], junk)
            store.wait(f_read, f_write)
            assert torch.all(old == 10 * (step + 1))
            fix = store.empty(n // 4, torch.int32)
            fix.fill_(10 * (step + 1))
            store.write(regions[0], fix)
    finally:
        store.close()


# -- faults -------------------------------------------------------------------------------------------------
def test_truncated_underneath_names_the_file(store):
    """A region file truncated by someone else: the read fails with StorageError naming the file and offset."""
    r = store.allocate("victim", 256 << 10)
    store.write(r, _random(store, r.nbytes, 3))
    os.truncate(r.path, 4096)
    with pytest.raises(StorageError) as info:
        store.read(r, store.empty(r.nbytes))
    e = info.value
    assert isinstance(e, OSError) and e.filename == r.path and e.errno == errno.ENODATA
    assert "truncated underneath" in str(e) and "offset 0" in str(e) and "'victim'" in str(e)
    with pytest.raises(StorageError, match="truncated underneath"):   # a write would silently re-extend it
        store.write(r, store.empty(r.nbytes))


def test_removed_underneath_names_the_file(store):
    """A region file unlinked underneath: the next transfer fails naming the file (ENOENT)."""
    r = store.allocate("gone", 8192)
    os.unlink(r.path)
    with pytest.raises(StorageError) as info:
        store.write(r, store.empty(8192))
    assert info.value.errno == errno.ENOENT and info.value.filename == r.path and "removed" in str(info.value)


@pytest.mark.parametrize("kind,code", [("write", errno.ENOSPC), ("read", errno.EIO)])
def test_injected_errors_reach_the_waiter(store, kind, code):
    """ENOSPC on a write and EIO on a read (injected at the syscall) are StorageErrors with errno text, region and
    offset, raised by wait, never printed; the store keeps working after."""
    r = store.allocate("x", 300 << 10)
    buf = store.empty(r.nbytes)
    store._native.inject_fault(kind, code, 1)
    f = store.write_async(r, buf) if kind == "write" else store.read_async(r, buf)
    with pytest.raises(StorageError) as info:
        store.wait(f)
    assert info.value.errno == code and os.strerror(code) in str(info.value)
    assert "region 'x'" in str(info.value) and "offset" in str(info.value) and info.value.filename == r.path
    assert f.state == "failed" and r.path in f.error
    store.write(r, _random(store, r.nbytes, 5))   # the fault was one chunk


def test_read_after_failed_write_fails(store):
    """After a write to a region failed, reads of it fail saying so (queued behind the write or later) until a
    write of the whole region succeeds; synchronize reports a failure nobody waited for."""
    r = store.allocate("x", 64 << 10)
    store._native.inject_fault("write", errno.EIO, 1)
    store.write_async(r, store.empty(r.nbytes))
    queued = store.read_async(r, store.empty(r.nbytes))
    with pytest.raises(StorageError, match="after a failed write to it"):
        queued.wait()
    with pytest.raises(StorageError, match="Input/output error"):
        store.synchronize()
    with pytest.raises(StorageError, match="after a failed write to it") as info:   # the write long finished
        store.read(r, store.empty(4096), offset=8192)
    assert info.value.errno == errno.EIO and info.value.filename == r.path
    store.write(r, store.empty(4096), offset=4096)   # a partial write does not make the region whole again
    with pytest.raises(StorageError, match="after a failed write"):
        store.read(r, store.empty(4096))
    src = _random(store, r.nbytes, 11)
    store.write(r, src)
    assert torch.equal(store.read(r, store.empty(r.nbytes)), src)


FSIZE_SCRIPT = r"""
import errno, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from roundpipe.offload import NVMeConfig, NVMeStore, StorageError
store = NVMeStore(sys.argv[1], NVMeConfig(threads=2, chunk_bytes=64 << 10, backend=sys.argv[2]))
big = store.allocate("big", 1 << 20)                    # preallocated before the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
try:
    store.allocate("huge", 2 << 20)
except StorageError as e:
    print("allocate", e.errno == errno.EFBIG, e.filename.endswith("huge"), "preallocating" in str(e))
try:
    store.write(big, store.empty(1 << 20))
except StorageError as e:
    print("write", e.errno == errno.EFBIG, e.filename == big.path, "offset 262144" in str(e))
store.close()
"""


def test_file_size_limit_is_a_clear_error(tmp_path, backend):
    """With RLIMIT_FSIZE (the stand-in for a full disk: SIGXFSZ ignored -> EFBIG), preallocation fails naming the new
    file, and a write past the limit fails naming the file and the offset where it stopped."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path), backend], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["allocate True True True", "write True True True"], out.stdout


def test_no_o_direct_falls_back_with_one_warning(tmp_path, backend):
    """A file system without O_DIRECT (simulated: tmpfs takes it since Linux 6.6): buffered I/O, one RuntimeWarning
    naming the reason, bytes intact; direct='on' refuses instead."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = NVMeStore(tmp_path, NVMeConfig(backend=backend), _test_hooks={"simulate_no_direct": True})
        assert not store.direct
        r = store.allocate("a", 10_000)
        src = _random(store, r.nbytes, 9)
        for _ in range(3):
            store.write(r, src)
            assert torch.equal(store.read(r, store.empty(r.nbytes)), src)
        store.close()
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "O_DIRECT" in msgs[0] and "buffered" in msgs[0] and "simulated" in msgs[0]
    with pytest.raises(ValueError, match="direct='on'"):
        NVMeStore(tmp_path, NVMeConfig(direct="on", backend=backend), _test_hooks={"simulate_no_direct": True})
    assert os.listdir(tmp_path) == []   # the refused store left no folder


def test_backend_choice_and_fallback(tmp_path):
    """'auto' takes io_uring where io_uring_setup succeeds and says so; where it is refused (simulated) the thread pool
    with the errno as the reason and no warning (the same bytes and speed); backend='io_uring' raises instead and
    leaves no folder; 'threads' is taken as asked."""
    if io_uring_refused():
        pytest.skip(f"no io_uring here: {io_uring_refused()}")
    with NVMeStore(tmp_path) as store:
        assert (store.backend, store.backend_reason) == ("io_uring", "io_uring_setup succeeded")
        assert "backend='io_uring'" in repr(store)
    with NVMeStore(tmp_path, NVMeConfig(backend="threads")) as store:
        assert (store.backend, store.backend_reason) == ("threads", "backend='threads'")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = NVMeStore(tmp_path, _test_hooks={"simulate_no_uring": True})
    assert store.backend == "threads" and store.backend_reason == "io_uring_setup: Operation not permitted (simulated)"
    r = store.allocate("a", 5000)
    src = _random(store, r.nbytes, 4)
    store.write(r, src)
    assert torch.equal(store.read(r, store.empty(r.nbytes)), src)
    store.close()
    with pytest.raises(ValueError, match=r"backend='io_uring' but .*Operation not permitted \(simulated\).*'auto'"):
        NVMeStore(tmp_path, NVMeConfig(backend="io_uring"), _test_hooks={"simulate_no_uring": True})
    assert os.listdir(tmp_path) == []


def test_free_space_check(tmp_path):
    """check_free_space: a ValueError naming the bytes needed and available when the disk is too small."""
    avail = free_bytes(tmp_path)
    check_free_space(tmp_path, 4096)
    with pytest.raises(ValueError, match=rf"needs {avail * 2 + 1} bytes .* has \d+ bytes .*available"):
        check_free_space(tmp_path, avail * 2 + 1)
    with pytest.raises(TypeError, match="needed"):
        check_free_space(tmp_path, 1.5)


def test_io_fence_defers_arena_reuse(store):
    """An IoFence is a Fence: an arena block recorded against an in-flight read is not reused before it ends."""
    arena = HostArena(ArenaConfig(alignment=4096, backend="host"))
    r = store.allocate("x", 64 << 10)
    t = arena.empty(64 << 10, torch.uint8)
    f = store.read_async(r, t)
    assert isinstance(f, IoFence)
    arena.record(t, f)
    store.wait(f)
    assert f.done() and f.kind == "io"


# -- bad arguments --------------------------------------------------------------------------------------------
def test_bad_arguments_name_themselves(store, tmp_path):
    """Wrong tensors, offsets, regions and names raise TypeError/ValueError naming the argument."""
    r = store.allocate("r", 3 * 4096)
    good = store.empty(4096)
    with pytest.raises(TypeError, match="into must be a torch.Tensor"):
        store.read_async(r, bytearray(4096))
    with pytest.raises(ValueError, match="into must be a dense CPU tensor, got device meta"):
        store.read_async(r, torch.empty(4096, dtype=torch.uint8, device="meta"))
    wide = store.empty((64, 128), torch.uint8)
    with pytest.raises(ValueError, match=r"src \(shape \(128, 64\).*must be contiguous"):
        store.write_async(r, wide.t())
    with pytest.raises(ValueError, match="src.data_ptr.*not 4096-byte aligned.*NVMeStore.empty"):
        store.write_async(r, store.empty(8192)[64:64 + 4096])
    with pytest.raises(ValueError, match="into has 16384 bytes, more than region 'r' holds"):
        store.read_async(r, store.empty(16384))
    with pytest.raises(ValueError, match="offset=100 must be a multiple of 4096"):
        store.read_async(r, good, offset=100)
    with pytest.raises(ValueError, match="a write must end at a multiple of 4096 or at the region's end"):
        store.write_async(r, store.empty(100))
    with pytest.raises(TypeError, match="offset must be an int"):
        store.read_async(r, good, offset=1.0)
    with NVMeStore(tmp_path) as other:
        foreign = other.allocate("r", 4096)
        with pytest.raises(ValueError, match="region 'r' is not a region of this store"):
            store.read_async(foreign, good)
    with pytest.raises(TypeError, match="region must be a Region"):
        store.read_async("r", good)
    with pytest.raises(ValueError, match="name='r' is already a region"):
        store.allocate("r", 10)
    for bad in ["", "a/b", ".hidden", "x" * 201]:
        with pytest.raises(ValueError, match="must be a file name"):
            store.allocate(bad, 10)
    with pytest.raises(ValueError, match="nbytes=-1"):
        store.allocate("neg", -1)
    with pytest.raises(TypeError, match="fences must be what read_async/write_async returned"):
        store.wait(object())
    for cfg, msg in [(dict(threads=0), "threads=0"), (dict(chunk_bytes=1000), "chunk_bytes=1000"),
                     (dict(direct="maybe"), "direct='maybe'"), (dict(threads=2.0), "threads must be an int"),
                     (dict(backend="uring"), "backend='uring' must be 'auto', 'io_uring' or 'threads'")]:
        with pytest.raises((TypeError, ValueError), match=msg):
            NVMeConfig(**cfg)
    with pytest.raises(ValueError, match="alignment=256"):
        NVMeStore(tmp_path, arena=HostArena(ArenaConfig(backend="host")))
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.read_async(r, good)
