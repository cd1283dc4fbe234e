"""Every native entry point, called with random and extreme arguments, returns or raises; it never kills the process.

The calls run in a worker subprocess (tests/_native_fuzz_worker.py), one
hypothesis example being one batch of calls that share objects (an arena and its
blocks, an engine and its fences).  A signal or a hang ends only the worker, and
the test fails naming the call that was running, the batch before it and the
worker's stderr.  Outcomes other than a result or ValueError / TypeError /
MemoryError / RuntimeError (SystemError, AttributeError) fail too, and so does a
pack_lpt result that does not tile every tensor exactly.

What is random and what cannot be: buffers cross the binding as raw addresses,
so the native layer can check null, alignment, size overflow, address-space wrap
and overlap, but not that n elements really lie at an address.  Addresses here
are therefore either inside the worker's own buffers with an n that fits, or
null / near the top of the address space / not an int, with any n; sizes are
either in bounds or past what any buffer can be (> PTRDIFF_MAX bytes).  Calls
that would wait forever by design (Fence.wait on a fence nobody sets, synchronize
behind one) get the batch's pending host fences set and paused engines resumed
first.  CUDA handles are 0 (the legacy stream) or not ints; without a GPU the
CUDA methods are reached only as far as their constructors' errors.

Deterministic (derandomize=True, fixed example counts, no database, no
shrinking: the failing call is printed as drawn).  ~17 s of CPU on the 2-core
CI machine, half of it interpreter, torch and worker start-up.  The crashes that
brought these checks in have regression cases in tests/native/test_native_args.py,
through the same kind of worker.
"""
from __future__ import annotations

import inspect
import os

import pytest
from _native_fuzz_worker import POOL, POOL_BYTES, U64, Worker
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from roundpipe import _native

PMAX = 2**63 - 1                # PTRDIFF_MAX: no buffer is larger
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUEUES = ["act_up", "act_down", "param_up", "grad_down"]

pytestmark = pytest.mark.skipif(not _native.available(), reason="native extension not built")

FUZZ = settings(derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def worker():
    """The module's worker; ROUNDPIPE_FUZZ_STATS=1 (with -s) prints how each op ended, to judge coverage."""
    w = Worker()
    yield w
    w.stop()
    if os.environ.get("ROUNDPIPE_FUZZ_STATS"):
        for (op, outcome), n in sorted(w.seen.items()):
            print(f"{op:36s} {outcome:20s} {n}")


def batch(worker, draw, n_calls, gen, torch=False):
    """Runs one batch: n_calls drawn with gen(draw, outcomes_so_far) -> (op, args, kwargs)."""
    worker.begin(torch=torch)
    outcomes = []
    for _ in range(n_calls):
        op, args, kwargs = gen(draw, outcomes)
        out = worker.call(op, *args, **kwargs)
        outcomes.append((op, out))
    worker.end()


# -- argument strategies ------------------------------------------------------------------------
# Arguments are mostly valid (so objects get made and their methods run) and
# sometimes extreme or of the wrong type; `rarely` is the coin for that.
junk = st.sampled_from([None, "x", 1.5, float("nan"), -1, U64, 2**70, [], {"$junk": 1}])
size_extreme = st.sampled_from([0, 1, 255, 256, 4095, 4096, 2**31, 2**32 + 1, PMAX - 1, PMAX, PMAX + 1, 2**63,
                                U64 - 4095, U64 - 256, U64 - 2, U64 - 1])
any_size = st.one_of(size_extreme, st.integers(0, U64 - 1), st.integers(0, 1 << 20))
floats = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-8, 1e300, -1e300, float("inf"), float("-inf"),
                                    float("nan"), 5e-324]), st.floats(allow_nan=True, allow_infinity=True))
fence_ref = st.sampled_from([{"$fence": "set"}, {"$fence": "failed"}, {"$fence": "pending"}])


COIN = st.integers(0, 9)


def rarely(draw, in_ten: int = 1) -> bool:
    return draw(COIN) < in_ten


def mostly(draw, good, bad, in_ten: int = 2):
    """A draw from `good`, or in `in_ten` of ten cases from `bad` (strategies or plain values)."""
    pick = bad if rarely(draw, in_ten) else good
    return draw(pick) if isinstance(pick, st.SearchStrategy) else pick


def dtype_name(draw):
    return mostly(draw, st.sampled_from(sorted(DTYPES)), st.one_of(st.sampled_from(["float64", "int8", ""]), junk), 1)


def pool_addr(draw):
    off = mostly(draw, st.sampled_from([0, 64, 4, 8, 32]), st.sampled_from([1, 2, 3, 6]))
    return {"$buf": draw(st.integers(0, POOL - 1)), "off": off}


def buffer_arg(draw, elems_sizes):
    """(address kind, n) for buffers of these element sizes sharing one n: in bounds, or refused before any access.

    'pool' with an n that fits; 'null' with n > 0; 'high' (2**64 - 64 KiB or less) with a byte count that wraps
    past 2**64 but fits in PTRDIFF_MAX; or an n past PTRDIFF_MAX bytes, or not a size_t, with any address.
    """
    big, small = max(elems_sizes), min(elems_sizes)
    kind = mostly(draw, st.just("fit"), st.sampled_from(["zero", "overflow", "null", "high", "junk_n"]), 3)
    if kind == "fit":
        return "pool", draw(st.integers(0, POOL_BYTES // big))
    if kind == "zero":
        return draw(st.sampled_from(["pool", "null", "high"])), 0
    if kind == "overflow":
        n = draw(st.one_of(st.integers(PMAX // small + 1, U64 - 1), st.sampled_from([PMAX // small + 1, U64 - 1])))
        return draw(st.sampled_from(["pool", "null", "high"])), n
    if kind == "null":
        return "null", draw(st.integers(1, U64 - 1))
    if kind == "high":
        return "high", draw(st.integers((1 << 16) + 1, PMAX // big))
    return "pool", draw(junk)


def address(draw, kind):
    if kind == "pool":
        return pool_addr(draw)
    if kind == "null":
        return 0
    if kind == "high":
        return {"$high": draw(st.sampled_from([64, 4096, 1 << 16]))}
    return draw(junk)


def elem_of(name):
    return DTYPES.get(name, 4) if isinstance(name, str) else 4


def perturb(draw, lists: dict) -> dict:
    """Sometimes one of the per-tensor lists is one entry short or long, or not a list."""
    if rarely(draw, 2):
        key = draw(st.sampled_from(sorted(lists)))
        how = draw(st.sampled_from(["short", "long", "junk"]))
        lists[key] = lists[key][:-1] if how == "short" else lists[key] + [0] if how == "long" else draw(junk)
    return lists


# -- raw entry points ---------------------------------------------------------------------------
def gen_cpu(draw, _):
    op = draw(st.sampled_from(["simd_level", "best_simd_level", "cpu_features", "num_threads", "openmp",
                               "cuda_status", "cuda_flavor", "set_simd_level", "set_num_threads"]))
    if op == "set_simd_level":
        return op, [mostly(draw, st.sampled_from(["scalar", "avx2", "avx512"]),
                           st.one_of(st.sampled_from(["sse9", ""]), junk), 4)], {}
    if op == "set_num_threads":
        extreme = st.sampled_from([0, -1, 256, 257, 100000, 2**31 - 1, -2**31])
        return op, [mostly(draw, st.integers(1, 8), st.one_of(extreme, st.integers(-2**31, 2**31 - 1), junk), 5)], {}
    return op, [], {}


def optim_tensors(draw, count):
    """Per tensor of an optimizer step: (grad dtype, shadow dtype, numel, addr), addr(role) a slice of a
    distinct pool buffer per role and tensor, so that the kernel runs (a random one may overlap)."""
    bufs = draw(st.permutations(range(POOL)))
    for i in range(count):
        gd, sd = dtype_name(draw), dtype_name(draw)
        kind, n = buffer_arg(draw, [4, elem_of(gd), elem_of(sd)])
        if kind == "pool" and isinstance(n, int) and 0 <= n < U64:
            n = min(n, POOL_BYTES // 4 // max(count, 1))

        def addr(role, kind=kind, i=i):
            if kind != "pool":
                return address(draw, kind)
            slot = {"$buf": bufs[role], "off": i * (POOL_BYTES // max(count, 1))}
            return mostly(draw, st.just(slot), st.just(pool_addr(draw)), 1)
        yield gd, sd, n, addr


def gen_kernels(draw, _):
    op = draw(st.sampled_from(["convert", "accumulate", "grad_sumsq", "adam_step", "adam8bit_step", "sgd_step",
                               "adagrad_step", "lion_step", "copy_many"]))
    if op == "copy_many":   # pool pairs that fit, may overlap (a source as destination) or be null
        lists = {"dsts": [], "srcs": [], "nbytes": []}
        for kind, n in (buffer_arg(draw, [1]) for _ in range(draw(st.integers(0, 3)))):
            lists["srcs"].append(address(draw, kind))
            lists["dsts"].append(mostly(draw, st.just(address(draw, kind)), st.sampled_from([lists["srcs"][-1], 0]), 2))
            fits = kind == "pool" and isinstance(n, int) and 0 <= n < U64
            lists["nbytes"].append(min(n, POOL_BYTES // 8) if fits else n)
        lists = perturb(draw, lists)
        return op, [lists["dsts"], lists["srcs"], lists["nbytes"]], {}
    if op == "convert":
        sd, dd = dtype_name(draw), dtype_name(draw)
        kind, n = buffer_arg(draw, [elem_of(sd), elem_of(dd)])
        src = address(draw, kind)
        dst = mostly(draw, st.just(address(draw, kind)), st.sampled_from([src, pool_addr(draw)]), 3)
        return op, [src, sd, dst, dd, n], {}
    if op == "accumulate":
        sd = dtype_name(draw)
        kind, n = buffer_arg(draw, [4, elem_of(sd)])
        dst = address(draw, kind)
        src = mostly(draw, st.just(address(draw, kind)), st.sampled_from([dst, pool_addr(draw)]), 3)
        return op, [dst, src, sd, n], {}
    count = draw(st.integers(0, 3))
    if op == "grad_sumsq":
        lists = {"grads": [], "dtypes": [], "numels": []}
        for _ in range(count):
            dt = dtype_name(draw)
            kind, n = buffer_arg(draw, [elem_of(dt)])
            lists["grads"].append(address(draw, kind))
            lists["dtypes"].append(dt)
            lists["numels"].append(n)
        lists = perturb(draw, lists)
        return op, [lists["grads"], lists["dtypes"], lists["numels"]], {}
    if op == "adam8bit_step":
        return gen_adam8bit(draw, count)
    if op != "adam_step":
        return gen_optim(draw, op, count)
    amsgrad = draw(st.booleans())
    keys = ("params", "grads", "grad_dtypes", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "shadows",
            "shadow_dtypes", "numels", "steps")
    lists = {k: [] for k in keys}
    for gd, sd, n, addr in optim_tensors(draw, count):
        lists["params"].append(addr(0))
        lists["grads"].append(addr(1))
        lists["grad_dtypes"].append(gd)
        lists["exp_avgs"].append(addr(2))
        lists["exp_avg_sqs"].append(addr(3))
        if amsgrad:
            lists["max_exp_avg_sqs"].append(addr(4))
        lists["shadows"].append(mostly(draw, st.just(addr(5)), st.just(0), 3))
        lists["shadow_dtypes"].append(sd)
        lists["numels"].append(n)
        lists["steps"].append(mostly(draw, st.sampled_from([1.0, 2.0, 1e9]), floats))
    lists = perturb(draw, lists)
    kwargs = {k: mostly(draw, st.just(v), floats, 1) for k, v in
              {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "grad_mul": 1.0,
               "predict": 0.5}.items()}
    kwargs.update(decoupled=draw(st.booleans()), amsgrad=mostly(draw, st.just(amsgrad), st.just(not amsgrad), 1),
                  maximize=draw(st.booleans()))
    return op, [lists[k] for k in keys], kwargs


# sgd_step / adagrad_step / lion_step: their state list, per-tensor extras and options
OPTIM = {
    "sgd_step": ("momentum_buffers", "firsts",
                 {"lr": 1e-2, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01, "grad_mul": 1.0,
                  "predict": 0.5},
                 ("nesterov", "maximize")),
    "adagrad_step": ("sums", "steps", {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.01, "eps": 1e-10,
                                       "grad_mul": 1.0, "predict": 0.5}, ("maximize",)),
    "lion_step": ("exp_avgs", None, {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.01,
                                     "grad_mul": 1.0, "predict": 0.5}, ("maximize",)),
}


def gen_adam8bit(draw, count):
    """adam8bit_step: pool slices for weights, gradients, codes, absmax and shadows; the real code tables
    (their sizes cannot be checked at an address: a caller's contract), or a list of them that is short or
    holds a null address."""
    keys = ("params", "grads", "grad_dtypes", "state1s", "state2s", "absmax1s", "absmax2s", "shadows",
            "shadow_dtypes", "numels", "steps")
    lists = {k: [] for k in keys}
    for gd, sd, n, addr in optim_tensors(draw, count):
        for role, key in enumerate(("params", "grads", "state1s", "state2s", "absmax1s", "absmax2s")):
            lists[key].append(addr(role))
        lists["grad_dtypes"].append(gd)
        lists["shadows"].append(mostly(draw, st.just(addr(6)), st.just(0), 3))
        lists["shadow_dtypes"].append(sd)
        lists["numels"].append(n)
        lists["steps"].append(mostly(draw, st.sampled_from([1.0, 2.0, 1e9]), floats))
    lists = perturb(draw, lists)
    tables = [{"$table": k} for k in range(4)]
    tables = mostly(draw, st.just(tables), st.sampled_from([tables[:3], [0] + tables[1:], tables[:3] + [0]]), 1)
    kwargs = {k: mostly(draw, st.just(v), floats, 1) for k, v in
              {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "grad_mul": 1.0,
               "predict": 0.5}.items()}
    kwargs.update(decoupled=draw(st.booleans()), maximize=draw(st.booleans()))
    return "adam8bit_step", [lists[k] for k in keys] + [tables], kwargs


def gen_optim(draw, op, count):
    """The other fused optimizers: a distinct pool slice per role and tensor (so the kernel runs), then
    the same perturbations of lists and options as adam_step."""
    state, extra, options, flags = OPTIM[op]
    keys = ("params", "grads", "grad_dtypes", state, "shadows", "shadow_dtypes", "numels") + ((extra,) if extra else ())
    lists = {k: [] for k in keys}
    for gd, sd, n, addr in optim_tensors(draw, count):
        lists["params"].append(addr(0))
        lists["grads"].append(addr(1))
        lists["grad_dtypes"].append(gd)
        lists[state].append(addr(2))
        lists["shadows"].append(mostly(draw, st.just(addr(3)), st.just(0), 3))
        lists["shadow_dtypes"].append(sd)
        lists["numels"].append(n)
        if extra == "firsts":
            lists[extra].append(draw(st.booleans()))
        elif extra == "steps":
            lists[extra].append(mostly(draw, st.sampled_from([1.0, 2.0, 1e9]), floats))
    lists = perturb(draw, lists)
    kwargs = {k: mostly(draw, st.just(v), floats, 1) for k, v in options.items()}
    kwargs.update({f: draw(st.booleans()) for f in flags})
    return op, [lists[k] for k in keys], kwargs


def gen_fences(draw, outcomes):
    made = [{"$res": i} for i, (_, out) in enumerate(outcomes) if out.get("t") in ("HostFence", "CudaEventFence")]
    target = draw(st.sampled_from(made)) if made and draw(st.booleans()) else draw(fence_ref)
    op = draw(st.sampled_from(["HostFence", "Fence", "Fence.done", "Fence.wait", "Fence.state", "Fence.error",
                               "Fence.kind", "Fence.cuda_event", "HostFence.set", "HostFence.fail",
                               "HostFence.wait_for", "CudaEventFence", "CudaEventFence.borrow",
                               "CudaEventFence.record", "CudaEventFence.make_stream_wait",
                               "CudaEventFence.pool_stats"]))
    if op == "HostFence":
        return op, [mostly(draw, st.booleans(), junk)], {}
    if op in ("Fence", "CudaEventFence"):
        return op, draw(st.lists(junk, max_size=2)), {}
    if op == "HostFence.fail":
        return op, [target, mostly(draw, st.text(max_size=20), junk)], {}
    if op == "HostFence.wait_for":
        seconds = mostly(draw, st.sampled_from([0.0, 1e-4, 1e-3]), st.one_of(
            st.sampled_from([1e9, 1e9 + 1, 1e300, -1e-300, float("inf"), float("nan")]), floats, junk), 5)
        return op, [target, seconds], {}
    if op == "CudaEventFence.borrow":
        return op, [mostly(draw, st.just(0), junk, 5)], {}
    if op == "CudaEventFence.record":
        return op, [mostly(draw, st.just(0), junk), mostly(draw, st.integers(0, 1), st.one_of(
            st.integers(-2**31, 2**31 - 1), size_extreme, junk), 5)], {}
    if op == "CudaEventFence.make_stream_wait":
        return op, [target, mostly(draw, st.just(0), junk)], {}
    if op == "CudaEventFence.pool_stats":
        return op, draw(st.lists(junk, max_size=1)), {}
    return op, [target], {}


def gen_arena(draw, outcomes):
    if not outcomes:
        backend = mostly(draw, st.sampled_from(["host", "host", "auto"]), st.sampled_from(["cuda", "gpu", ""]), 1)
        if backend in ("auto", "cuda"):  # never page-lock gigabytes on a GPU machine
            chunk, limit = draw(st.sampled_from([4096, 1 << 16, 1 << 20])), draw(st.integers(1, 1 << 24))
        else:
            chunk = mostly(draw, st.sampled_from([4096, 1 << 16, 1 << 20]), st.one_of(any_size, junk), 1)
            limit = mostly(draw, st.sampled_from([0, 0, 1 << 30]), st.one_of(any_size, junk), 2)
        align = mostly(draw, st.sampled_from([8, 64, 256, 4096]), st.one_of(
            st.sampled_from([0, 1, 7, 100, 8192]), any_size, junk), 1)
        return "HostArena", [chunk, align, limit, backend], {}
    blocks = [i for i, (_, out) in enumerate(outcomes) if out.get("t") == "ArenaBlock"]
    block = draw(st.sampled_from(blocks)) if blocks else 0
    arena = {"$res": 0}
    op = draw(st.sampled_from(["HostArena.allocate"] * 4 + [
        "HostArena.record", "HostArena.collect", "HostArena.synchronize", "HostArena.reserve",
        "HostArena.release_unused", "HostArena.block_of", "HostArena.pinned", "HostArena.backend", "HostArena.stats",
        "ArenaBlock.address", "ArenaBlock.nbytes", "ArenaBlock.buffer", "ArenaBlock", "drop"]))
    if op == "drop" and not blocks:
        op = "HostArena.allocate"
    if op in ("HostArena.allocate", "HostArena.reserve"):
        return op, [arena, mostly(draw, st.integers(0, 1 << 20), st.one_of(any_size, junk), 3)], {}
    addr = mostly(draw, st.builds(lambda k: {"$addr_of": block, "plus": k}, st.sampled_from([0, 1, 255, 4096, -1])),
                  st.one_of(st.integers(0, U64 - 1), junk), 3)
    if op == "HostArena.record":
        return op, [arena, addr, mostly(draw, fence_ref, st.one_of(st.just(None), junk))], {}
    if op == "HostArena.block_of":
        return op, [arena, addr], {}
    if op.startswith("ArenaBlock."):
        return op, [{"$res": block}], {}
    if op == "ArenaBlock":
        return op, draw(st.lists(junk, max_size=2)), {}
    if op == "drop":
        return op, [block], {}
    return op, [arena], {}


def gen_fakecuda(draw, outcomes):
    """The test-only stand-in CUDA runtime (csrc/cuda_loader.h), and an arena and a fence using it."""
    fakes = [i for i, (_, out) in enumerate(outcomes) if out.get("t") == "FakeCuda"]
    if not fakes:
        return "FakeCuda", [mostly(draw, st.integers(1, 4), st.one_of(st.integers(-2**31, 2**31 - 1), junk), 2)], {}
    fake = {"$res": draw(st.sampled_from(fakes))}
    op = draw(st.sampled_from(["FakeCuda.set_device", "FakeCuda.thread_device", "FakeCuda.thread_context_depth",
                               "FakeCuda.contexts_created", "FakeCuda.calls", "FakeCuda.event_flags",
                               "HostArena", "CudaEventFence.record", "FakeCuda"]))
    device = mostly(draw, st.integers(0, 3), st.one_of(st.integers(-2**31, 2**31 - 1), junk), 3)
    if op == "FakeCuda.set_device":
        return op, [fake, device], {}
    if op == "HostArena":   # small chunks: the fake page-locks nothing, but the memory is real
        return op, [4096, 256, mostly(draw, st.sampled_from([0, 1 << 16]), any_size, 1), "cuda"], \
            {"home_device": device, "cuda": mostly(draw, st.just(fake), junk, 1)}
    if op == "CudaEventFence.record":
        return op, [0, device], {"cuda": mostly(draw, st.just(fake), junk, 1)}
    if op == "FakeCuda":
        return op, draw(st.lists(junk, max_size=2)), {}
    return op, [fake], {}


def gen_nvme(draw, outcomes):
    """The file store (csrc/nvme_io.h) in the batch's own folder: a first region, then transfers between regions and
    a 4096-aligned worker buffer (or refused addresses), faults injected, fences waited, the store closed midway.
    Sizes stay small or past any buffer: a valid size in between would preallocate real gigabytes."""
    if not outcomes:
        args = [{"$dir": 1}, draw(st.integers(1, 4)), draw(st.sampled_from([4096, 8192, 1 << 16])),
                draw(st.sampled_from(["auto", "off", "on"])), draw(st.sampled_from([0.0, 0.0, 1e-4])),
                rarely(draw, 2), draw(st.sampled_from(["auto", "io_uring", "threads"])), rarely(draw, 1)]
        if rarely(draw, 2):   # one argument wrong
            k = draw(st.integers(0, 7))
            args[k] = draw([st.one_of(st.sampled_from(["", "/nonexistent/roundpipe", "/proc/self/status", "a\0b"]),
                                      junk),
                            st.one_of(st.sampled_from([0, -1, 257, 2**31 - 1]), junk),
                            st.one_of(st.sampled_from([0, 1, 4095, 4097, (1 << 30) + 4096]), size_extreme, junk),
                            st.one_of(st.just("sometimes"), junk),
                            st.sampled_from([-1.0, 10.5, 1e300, float("inf"), float("nan"), "x"]),
                            junk, st.one_of(st.sampled_from(["uring", "", "IO_URING"]), junk), junk][k])
        return "FileStore", args, {}
    store = {"$res": 0}
    small = st.sampled_from([0, 1, 100, 4095, 4096, 4097, 8192, 20000, 1 << 16])
    if len(outcomes) == 1:
        return "FileStore.allocate", [store, "r0", draw(st.sampled_from([4096, 8192, 20000, 1 << 16]))], {}
    fences = [{"$res": i} for i, (_, out) in enumerate(outcomes) if out.get("t") == "IoFence"]
    op = draw(st.sampled_from(["FileStore.allocate"] * 2 + ["FileStore.read"] * 5 + ["FileStore.write"] * 5 + [
        "FileStore.synchronize", "FileStore.synchronize", "FileStore.close", "FileStore.inject_fault", "FileStore.region_path",
        "FileStore.region_bytes", "FileStore.num_regions", "FileStore.direct", "FileStore.direct_reason",
        "FileStore.directory", "FileStore.threads", "FileStore.chunk_bytes", "FileStore.closed",
        "FileStore.backend", "FileStore.backend_reason", "IoFence", "IoFence.wait", "IoFence.wait", "IoFence.done",
        "IoFence.done"]))
    region = mostly(draw, st.sampled_from([0, 0, 0, 1, 2]), st.one_of(st.sampled_from([-1, 7, 2**31, U64 - 1]), junk),
                    1)
    if op == "FileStore.allocate":
        name = mostly(draw, st.sampled_from(["r0", "r1", "r2"]), st.one_of(
            st.sampled_from(["", ".", "..", "a/b", ".x", "x" * 201, "a\0b"]), junk), 1)
        return op, [store, name, mostly(draw, small, st.one_of(st.sampled_from([
            PMAX - 4095, PMAX, 2**63, U64 - 1, -1]), junk), 1)], {}
    if op in ("FileStore.read", "FileStore.write"):
        offset = mostly(draw, st.sampled_from([0, 0, 4096]), st.one_of(small, size_extreme, junk), 1)
        kind = mostly(draw, st.just("aligned"), st.sampled_from(["pool", "null", "high", "junk"]), 2)
        whole = st.sampled_from([0, 4096, 8192]) if op == "FileStore.write" else small   # writes end on a block
        n = mostly(draw, whole, st.one_of(small, size_extreme, junk), 2)
        if kind == "aligned":
            buf = {"$abuf": mostly(draw, st.just(0), st.sampled_from([64, 4096 + 8]), 1)}
        else:
            buf = pool_addr(draw) if kind == "pool" else address(draw, kind)
        return op, [store, region, offset, buf, n], {}
    if op == "FileStore.inject_fault":
        return op, [store, mostly(draw, st.sampled_from(["read", "write"]), st.one_of(st.just("erase"), junk), 1),
                    mostly(draw, st.sampled_from([5, 28, 27]), st.one_of(st.sampled_from([0, -1, 4096]), junk), 2),
                    mostly(draw, st.sampled_from([0, 1, 2]), st.one_of(st.sampled_from([-1, 2**31]), junk), 1)], {}
    if op in ("FileStore.region_path", "FileStore.region_bytes"):
        return op, [store, region], {}
    if op == "IoFence":
        return op, draw(st.lists(junk, max_size=2)), {}
    if op.startswith("IoFence."):
        return op, [draw(st.sampled_from(fences)) if fences else draw(fence_ref)], {}
    return op, [store], {}


def gen_pack(draw, _):
    size = st.one_of(st.integers(0, 1 << 20), size_extreme, st.integers(0, U64 - 1))
    sizes = draw(st.lists(mostly(draw, st.just(st.integers(0, 1 << 20)), st.just(size), 5), max_size=6))
    windows = mostly(draw, st.integers(1, 9), st.one_of(st.sampled_from([0, 65535, 65536, 65537, U64 - 1]),
                                                       st.integers(0, U64 - 1)), 3)
    align = mostly(draw, st.sampled_from([1, 2, 3, 64, 256, 4096]), st.one_of(size_extreme, st.integers(0, U64 - 1)))
    which = draw(st.sampled_from(["none"] * 12 + ["sizes", "item", "windows", "align"]))
    if which == "sizes":
        sizes = draw(junk)
    elif which == "item":
        sizes = sizes + [draw(junk)]
    elif which == "windows":
        windows = draw(junk)
    elif which == "align":
        align = draw(junk)
    return "pack_lpt", [sizes, windows, align], {}


def copy_ops(draw, max_ops=4):
    ops = []
    for _ in range(draw(st.integers(0, max_ops))):
        kind, n = buffer_arg(draw, [1])
        dst = address(draw, kind)
        src = mostly(draw, st.just(address(draw, kind)), st.sampled_from([dst, pool_addr(draw)]))
        ops.append(mostly(draw, st.just([dst, src, n]), st.sampled_from([[dst, src], [dst, src, n, 0]]), 1))
    return mostly(draw, st.just(ops), junk, 1)


def gen_engine(draw, outcomes):
    if not outcomes:
        if rarely(draw, 1):
            streams = mostly(draw, st.just([]), st.one_of(st.lists(st.just(0), max_size=5), junk))
            return "CudaCopyEngine", [mostly(draw, st.just(0), st.one_of(st.integers(-2, 4), size_extreme, junk)),
                                      streams], {}
        threads = mostly(draw, st.integers(1, 4), st.one_of(
            st.sampled_from([0, -1, 256, 257, 100000, 2**31 - 1, -2**31]), junk), 1)
        return "HostCopyEngine", [threads], {}
    engine = {"$res": 0}
    made = [{"$res": i} for i, (_, out) in enumerate(outcomes) if out.get("t") == "HostFence"]
    fence = st.one_of(fence_ref, st.sampled_from(made)) if made else fence_ref
    queue_arg = mostly(draw, st.sampled_from([{"$q": q} for q in QUEUES]), st.one_of(
        st.sampled_from([{"$qint": v} for v in (-1, 4, 7, 2**31 - 1)]), junk), 1)
    op = draw(st.sampled_from(["CopyEngine.submit"] * 4 + [
        "CopyEngine.synchronize", "CopyEngine.backend", "HostCopyEngine.pause", "HostCopyEngine.resume",
        "HostCopyEngine.history", "CudaCopyEngine.device", "CudaCopyEngine.stream", "CopyEngine", "Fence.wait"]))
    tag = mostly(draw, st.integers(-5, 5), st.one_of(st.sampled_from([2**63 - 1, -2**63, 2**63, -2**63 - 1]), junk), 1)
    if op == "CopyEngine.submit":
        after = mostly(draw, st.lists(st.one_of(fence, st.just(None)), max_size=3), junk, 1)
        return op, [engine, queue_arg, copy_ops(draw), after, tag], {}
    if op == "CudaCopyEngine.stream":
        return op, [engine, queue_arg], {}
    if op == "CopyEngine":
        return op, draw(st.lists(junk, max_size=2)), {}
    if op == "Fence.wait":
        return op, [draw(fence)], {}
    return op, [engine], {}


# -- the Python wrappers (torch tensors) ------------------------------------------------------------
TORCH_DTYPES = ["float32", "bfloat16", "float16"]


def tensor(draw, dtypes=TORCH_DTYPES, shape=None):
    """A tensor spec: a view into one of four 4 KiB byte stores (views of one store may overlap)."""
    dtype = mostly(draw, st.sampled_from(dtypes), st.sampled_from(["float64", "int32", "uint8", "bool"]), 1)
    if shape is None:
        shape = draw(st.lists(st.integers(0, 8), max_size=3))
    spec = {"dtype": dtype, "shape": shape, "store": draw(st.integers(0, 7)), "off": draw(st.integers(0, 256)),
            "strided": rarely(draw, 1), "device": "meta" if rarely(draw, 1) else "cpu"}
    return mostly(draw, st.just({"$t": spec}), junk, 1)


def gen_wrap_math(draw, _):
    op = draw(st.sampled_from(["wrap.convert_", "wrap.accumulate_", "wrap.grad_sumsq", "wrap.grad_norm",
                               "wrap.clip_coef", "wrap.adam_step", "wrap.set_simd_level"]))
    shape = draw(st.lists(st.integers(0, 8), max_size=3))
    if op in ("wrap.convert_", "wrap.accumulate_"):
        dst = tensor(draw, ["float32"] if op == "wrap.accumulate_" else TORCH_DTYPES, shape)
        return op, [dst, mostly(draw, st.just(tensor(draw, shape=shape)), st.just(tensor(draw)), 2)], {}
    if op in ("wrap.grad_sumsq", "wrap.grad_norm"):
        grads = mostly(draw, st.just([tensor(draw) for _ in range(draw(st.integers(0, 3)))]), junk, 1)
        if op == "wrap.grad_norm":
            return op, [grads, mostly(draw, st.sampled_from([1.0, 1024.0]), st.one_of(floats, junk))], {}
        return op, [grads], {}
    if op == "wrap.clip_coef":
        return op, [mostly(draw, st.floats(0, 1e6), st.one_of(floats, junk), 5) for _ in range(3)], {}
    if op == "wrap.set_simd_level":
        return op, [mostly(draw, st.sampled_from(["scalar", "avx2", "avx512"]), st.one_of(st.just("sse9"), junk))], {}
    count = draw(st.integers(0, 3))
    shapes = [mostly(draw, st.just(shape), st.lists(st.integers(0, 8), max_size=3)) for _ in range(count)]
    f32 = ["float32"]
    lists = {"params": [tensor(draw, f32, s) for s in shapes], "grads": [tensor(draw, shape=s) for s in shapes],
             "exp_avgs": [tensor(draw, f32, s) for s in shapes], "exp_avg_sqs": [tensor(draw, f32, s) for s in shapes]}
    lists = perturb(draw, lists)
    config = {"lr": mostly(draw, st.just(1e-3), st.one_of(floats, junk), 1),
              "betas": mostly(draw, st.just([0.9, 0.999]), st.one_of(st.lists(floats, max_size=3), junk), 1),
              "eps": mostly(draw, st.just(1e-8), floats, 1), "weight_decay": mostly(draw, st.just(0.01), floats, 1),
              "amsgrad": mostly(draw, st.booleans(), junk, 1)}
    kwargs = {"config": config, "grad_mul": mostly(draw, st.just(1.0), st.one_of(floats, junk), 1),
              "shadows": mostly(draw, st.just([tensor(draw, shape=s) if draw(st.booleans()) else None
                                               for s in shapes]), st.one_of(st.none(), junk), 2)}
    if config["amsgrad"] is True:
        kwargs["max_exp_avg_sqs"] = [tensor(draw, f32, s) for s in shapes]
    steps = mostly(draw, st.sampled_from([1, 2.0]), st.one_of(st.lists(floats, max_size=3), floats, junk), 2)
    return op, [lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"], steps], kwargs


def gen_wrap_offload(draw, outcomes):
    if not outcomes:
        cfg = {"chunk_bytes": mostly(draw, st.sampled_from([4096, 1 << 16]), st.one_of(any_size, junk), 1),
               "alignment": mostly(draw, st.sampled_from([8, 256]), st.one_of(st.sampled_from([0, 7, 8192]), junk), 1),
               "limit_bytes": mostly(draw, st.sampled_from([0, 1 << 20]), st.one_of(any_size, junk), 1),
               "backend": mostly(draw, st.just("host"), st.one_of(st.just("gpu"), junk), 1)}
        return "wrap.HostArena", [], cfg
    if len(outcomes) == 1:
        return "wrap.CopyEngine", [mostly(draw, st.integers(1, 3), st.one_of(
            st.sampled_from([0, 257, 100000]), junk), 1)], {}
    arena, engine = {"$res": 0}, {"$res": 1}
    made = [{"$res": i} for i, (op, out) in enumerate(outcomes) if out.get("t") == "Tensor"]
    fences = [{"$res": i} for i, (op, out) in enumerate(outcomes) if out.get("t") == "HostFence"]
    fence = st.one_of(fence_ref, st.sampled_from(fences)) if fences else fence_ref

    def some_tensor(shape=None):
        return draw(st.sampled_from(made)) if made and draw(st.booleans()) else tensor(draw, shape=shape)

    op = draw(st.sampled_from(["wrap.HostArena.empty"] * 2 + ["wrap.CopyEngine.copy"] * 2 + [
        "wrap.HostArena.copy_of", "wrap.HostArena.owns", "wrap.HostArena.record", "wrap.HostArena.reserve",
        "wrap.HostArena.synchronize", "wrap.HostArena.stats", "wrap.CopyEngine.copy_many",
        "wrap.CopyEngine.synchronize", "wrap.pack_lpt", "wrap.wait_all"]))
    queue_name = mostly(draw, st.sampled_from(QUEUES), st.one_of(st.just("sideways"), junk), 1)
    tag = mostly(draw, st.integers(-3, 3), st.one_of(st.sampled_from([2**63, -2**63 - 1]), junk), 1)
    if op == "wrap.HostArena.empty":
        shape = mostly(draw, st.lists(st.integers(0, 64), max_size=3), st.one_of(
            st.lists(st.one_of(st.integers(-3, 3), st.sampled_from([2**31, 2**40, 2**62, 2**63])), max_size=3),
            st.integers(-1, 1 << 40), junk), 2)
        return op, [arena, shape, mostly(draw, st.sampled_from(TORCH_DTYPES + ["uint8"]), junk, 1)], {}
    if op in ("wrap.HostArena.copy_of", "wrap.HostArena.owns"):
        return op, [arena, some_tensor()], {}
    if op == "wrap.HostArena.record":
        return op, [arena, some_tensor(), mostly(draw, fence, junk, 1)], {}
    if op == "wrap.HostArena.reserve":
        return op, [arena, mostly(draw, st.integers(1, 1 << 20), st.one_of(any_size, st.just(-1), junk), 3)], {}
    if op in ("wrap.HostArena.synchronize", "wrap.HostArena.stats"):
        return op, [arena], {}
    if op == "wrap.CopyEngine.synchronize":
        return op, [engine], {}
    if op == "wrap.pack_lpt":
        return op, [draw(st.lists(st.one_of(st.integers(0, 1 << 20), size_extreme, st.just(-1)), max_size=4)),
                    mostly(draw, st.integers(1, 4), st.one_of(size_extreme, junk)),
                    mostly(draw, st.sampled_from([1, 256]), st.one_of(size_extreme, junk))], {}
    if op == "wrap.wait_all":
        return op, [mostly(draw, st.lists(fence, max_size=3), junk, 1)], {}
    pairs = []
    for _ in range(draw(st.integers(0 if op != "wrap.CopyEngine.copy" else 1, 3))):
        dst = some_tensor()
        spec = dst.get("$t", {}) if isinstance(dst, dict) else {}
        like = tensor(draw, [spec.get("dtype", "float32")], spec.get("shape"))
        pairs.append((dst, mostly(draw, st.just(like), st.just(some_tensor()), 3)))
    dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
    if rarely(draw, 1):
        srcs = srcs[:-1]
    after = mostly(draw, st.one_of(st.none(), st.lists(fence, max_size=2)), junk, 1)
    if op == "wrap.CopyEngine.copy":
        return op, [engine, queue_name, dsts[0], srcs[0] if srcs else None], {"after": after, "tag": tag}
    return op, [engine, queue_name, dsts, srcs], {"after": after, "tag": tag}   # copy_many


# Every public name of roundpipe._C (functions, constructors, methods, properties), by the
# generator that calls it; test_every_entry_point_is_fuzzed keeps this in step with the module.
SURFACE = {
    "cpu": ["simd_level", "best_simd_level", "cpu_features", "num_threads", "openmp", "cuda_status", "cuda_flavor",
            "set_simd_level", "set_num_threads"],
    "kernels": ["convert", "accumulate", "grad_sumsq", "adam_step", "adam8bit_step", "sgd_step", "adagrad_step",
                "lion_step", "copy_many"],
    "fences": ["Fence", "Fence.done", "Fence.wait", "Fence.state", "Fence.error", "Fence.kind", "Fence.cuda_event",
               "HostFence", "HostFence.set", "HostFence.fail", "HostFence.wait_for", "CudaEventFence",
               "CudaEventFence.borrow", "CudaEventFence.record", "CudaEventFence.make_stream_wait",
               "CudaEventFence.pool_stats"],
    "arena": ["HostArena", "HostArena.allocate", "HostArena.record", "HostArena.collect", "HostArena.synchronize",
              "HostArena.reserve", "HostArena.release_unused", "HostArena.block_of", "HostArena.pinned",
              "HostArena.backend", "HostArena.stats", "ArenaBlock", "ArenaBlock.address", "ArenaBlock.nbytes"],
    "pack_lpt": ["pack_lpt"],
    "fakecuda": ["FakeCuda", "FakeCuda.set_device", "FakeCuda.thread_device", "FakeCuda.thread_context_depth",
                 "FakeCuda.contexts_created", "FakeCuda.calls", "FakeCuda.event_flags"],
    "copy_engine": ["CopyEngine", "CopyEngine.submit", "CopyEngine.synchronize",
                    "CopyEngine.backend", "HostCopyEngine", "HostCopyEngine.pause", "HostCopyEngine.resume",
                    "HostCopyEngine.history", "CudaCopyEngine", "CudaCopyEngine.device", "CudaCopyEngine.stream"],
    "nvme": ["FileStore", "FileStore.allocate", "FileStore.read", "FileStore.write", "FileStore.synchronize",
             "FileStore.close", "FileStore.inject_fault", "FileStore.region_path", "FileStore.region_bytes",
             "FileStore.num_regions", "FileStore.direct", "FileStore.direct_reason", "FileStore.directory",
             "FileStore.threads", "FileStore.chunk_bytes", "FileStore.closed", "FileStore.backend",
             "FileStore.backend_reason", "IoFence", "IoFence.wait", "IoFence.done"],
}
GENERATORS = {"cpu": (gen_cpu, 40, 4), "kernels": (gen_kernels, 160, 3), "fences": (gen_fences, 80, 5),
              "arena": (gen_arena, 150, 8), "pack_lpt": (gen_pack, 150, 3), "copy_engine": (gen_engine, 120, 6),
              "fakecuda": (gen_fakecuda, 80, 6), "nvme": (gen_nvme, 120, 10)}


def test_every_entry_point_is_fuzzed():
    """SURFACE lists exactly the public functions, constructors, methods and properties of roundpipe._C."""
    C = _native.require()
    names = set()
    for name, obj in vars(C).items():
        if name.startswith("_"):
            continue
        if not inspect.isclass(obj):
            if callable(obj):   # constants (HOST_WAITED_EVENT_FLAGS) are no entry point
                names.add(name)
        elif not issubclass(obj, BaseException) and "__members__" not in vars(obj):
            names.add(name)
            names.update(f"{name}.{attr}" for attr in vars(obj) if not attr.startswith("_"))
    # CopyQueue (an enum: its constructor is fuzzed as out-of-range queue values) and the exception type take no
    # part of their own.
    assert names == {op for ops in SURFACE.values() for op in ops}


@pytest.mark.parametrize("group", list(GENERATORS))
def test_native_entry_points_never_crash(worker, group):
    """Random and extreme arguments to every bound function and method give a result or a Python exception."""
    gen, examples, calls = GENERATORS[group]
    worker.seen.clear()

    @settings(FUZZ, max_examples=examples)
    @given(st.data())
    def run(data):
        batch(worker, data.draw, calls, gen)

    run()
    called = {op for op, _ in worker.seen}
    assert set(SURFACE[group]) <= called, f"never called: {sorted(set(SURFACE[group]) - called)}"


@pytest.mark.parametrize("gen,examples,calls", [
    pytest.param(gen_wrap_math, 100, 3, id="hostops_optim"),
    pytest.param(gen_wrap_offload, 80, 8, id="offload"),
])
def test_python_wrappers_never_crash(worker, gen, examples, calls):
    """The wrappers (hostops, optim, offload) turn random tensors and values into results or Python exceptions."""

    @settings(FUZZ, max_examples=examples)
    @given(st.data())
    def run(data):
        batch(worker, data.draw, calls, gen, torch=True)

    run()
