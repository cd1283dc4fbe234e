"""The subprocess behind tests/native/test_native_fuzz.py: runs native calls where a crash kills only it.

Run as a script (`python _native_fuzz_worker.py --worker`) it reads one JSON
message a line from stdin: {"begin": ...} starts a batch (fresh host fences, the
results list), a call {"op", "a", "k"} runs and answers {"r": "ok"|"exc"|"skip"|
"broken", ...} on the protocol pipe, {"end": ...} sets every pending fence,
resumes engines, drops the batch's objects and restores the SIMD level and thread
count.  Arguments reference worker objects by marker: {"$buf": k, "off": o} an
address in pool buffer k, {"$abuf": o} an address in the 4096-aligned 64 KiB buffer,
{"$dir": 1} the batch's own folder (removed at its end), {"$high": d} the address 2**64 - d, {"$res": j} call
j's result, {"$table": k} the address of 8-bit coder table k, {"$fence": "set"|"failed"|"pending"}, {"$q": name} / {"$qint": v} a
CopyQueue, {"$t": spec} a tensor view of the batch's byte stores, {"$junk": 1}
an object().  Imported, it gives the parent side: `Worker`.
"""
from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading

U64 = 2**64
POOL = 12                       # worker buffers
POOL_BYTES = 4096               # bytes usable from any pool address (offset <= 64)
ALIGNED_BYTES = 1 << 17         # the 4096-aligned buffer: offset (<= 4104) + nbytes (<= 64 KiB) fit
# OSError: the file store's StorageError, e.g. EFAULT for an address the kernel refuses, or a folder that is a file.
ALLOWED = ("ValueError", "TypeError", "MemoryError", "RuntimeError", "OSError")
CALL_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------------------------------
# The worker: runs calls in this process; its death is what the tests look for.
# ---------------------------------------------------------------------------------------------
class _Batch:
    """The objects one batch of calls shares: pool buffers, three host fences, results."""

    def __init__(self, C, pool):
        self.C, self.pool = C, pool
        failed = C.HostFence()
        failed.fail("fuzz: failed on purpose")
        self.fences = {"set": C.HostFence(True), "failed": failed, "pending": C.HostFence()}
        self.results: list = []
        self.engines: list = []
        self.folder: str | None = None

    def resolve(self, x):
        if isinstance(x, list):
            return [self.resolve(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "$buf" in x:
            return self.pool[x["$buf"]] + x["off"]
        if "$abuf" in x:
            return self.aligned + x["$abuf"]
        if "$dir" in x:
            if self.folder is None:
                import tempfile
                self.folder = tempfile.mkdtemp(prefix="roundpipe-fuzz-")
            return self.folder
        if "$high" in x:
            return U64 - x["$high"]
        if "$res" in x:
            j = x["$res"]
            return self.results[j] if j < len(self.results) else None
        if "$fence" in x:
            return self.fences[x["$fence"]]
        if "$q" in x:
            return getattr(self.C.CopyQueue, x["$q"])
        if "$qint" in x:
            return self.C.CopyQueue(x["$qint"])
        if "$tuple" in x:
            return tuple(self.resolve(v) for v in x["$tuple"])
        if "$junk" in x:
            return object()
        if "$addr_of" in x:  # an arena block's address (+ offset); looked up by the arena, never dereferenced
            block = self.results[x["$addr_of"]] if x["$addr_of"] < len(self.results) else None
            return (block.address if isinstance(block, self.C.ArenaBlock) else 0) + x["plus"]
        if "$table" in x:  # the 8-bit coder's tables (code1, lut1, code2, lut2): what adam8bit_step must be given
            from roundpipe.optim import blockwise
            t = blockwise.tables()
            return (t.code1, t.lut1, t.code2, t.lut2)[x["$table"]].data_ptr()
        if "$t" in x:
            return _make_tensor(self, x["$t"])
        return {k: self.resolve(v) for k, v in x.items()}

    def finish(self):
        """Ends the batch: waits released, objects dropped (file stores close, their transfers finished), the
        batch's folder removed."""
        self.release()
        self.results.clear()
        self.engines.clear()
        if self.folder is not None:
            import shutil
            shutil.rmtree(self.folder, ignore_errors=True)

    def release(self):
        """Lets every wait of this batch end: pending host fences set, paused engines resumed."""
        C = self.C
        for f in list(self.fences.values()) + self.results:
            if isinstance(f, C.HostFence):
                f.set()
            elif isinstance(f, list):
                for g in f:
                    if isinstance(g, C.HostFence):
                        g.set()
        for e in self.engines:
            e.resume()


def _make_tensor(batch, spec):
    """A tensor from a spec: a view of pool storage (so views can overlap), strided or on 'meta'."""
    import torch

    dtype = getattr(torch, spec["dtype"])
    shape = spec["shape"]
    if spec.get("device") == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    store = batch.storages[spec["store"]]
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    off = spec["off"] // itemsize * itemsize
    flat = store[off:off + numel * itemsize].view(dtype)
    t = flat.view(shape)
    if spec.get("strided") and t.dim() >= 2:
        t = t.transpose(0, 1)
    return t


def _check_pack(result, sizes, windows, align):
    """pack_lpt's promise: `windows` windows whose pieces tile every tensor exactly, cut at multiples of align."""
    if len(result) != windows:
        return f"{len(result)} windows, asked for {windows}"
    pieces: dict[int, list[tuple[int, int]]] = {}
    for win in result:
        for t, off, length in win:
            if length <= 0 or off % align:
                return f"piece {(t, off, length)} is empty or not at a multiple of align={align}"
            pieces.setdefault(t, []).append((off, length))
    for t, size in enumerate(sizes):
        at = 0
        for off, length in sorted(pieces.pop(t, [])):
            if off != at:
                return f"tensor {t}: bytes [{at}, {off}) missing or doubled"
            at = off + length
        if at != size:
            return f"tensor {t}: pieces cover {at} of {size} bytes"
    return f"pieces for unknown tensors {sorted(pieces)}" if pieces else None


def _worker_ops(C):
    """Ops the worker runs beyond the generic ones (function, Class(...), Class.method, Class.property)."""

    def pack_lpt(sizes, windows, align):
        out = C.pack_lpt(sizes, windows, align)
        bad = _check_pack(out, sizes, windows, align)
        if bad:
            raise _Broken(f"pack_lpt({sizes}, {windows}, {align}): {bad}")
        return None  # the (large) result is not kept

    def block_buffer(block):
        view = memoryview(block)
        if len(view) != block.nbytes:
            raise _Broken(f"buffer of {len(view)} bytes for a block of {block.nbytes}")
        if len(view):
            view[0] = 1
            view[len(view) - 1] = 2
        return None

    return {"pack_lpt": pack_lpt, "ArenaBlock.buffer": block_buffer}


class _Broken(Exception):
    """A native call returned, but broke its promise."""


# Calls that may wait for other work: the batch's waits are released first.
BLOCKING = {"Fence.wait", "HostFence.wait_for", "CopyEngine.synchronize", "HostArena.synchronize",
            "HostArena.allocate", "wrap.CopyEngine.synchronize", "wrap.HostArena.synchronize", "wrap.HostArena.empty",
            "wrap.wait_all"}


def _run(batch, call, extra):
    C = batch.C
    name, args, kwargs = call["op"], batch.resolve(call.get("a", [])), batch.resolve(call.get("k", {}))
    if name in BLOCKING or (name.startswith("CopyEngine.submit") and isinstance(args[0], C.CudaCopyEngine)):
        batch.release()  # (the CUDA backend waits for host fences on the submitting thread)
    if name == "drop":
        batch.results[args[0]] = None
        return None
    if name in extra:
        return extra[name](*args, **kwargs)
    if "." not in name:
        return getattr(C, name)(*args, **kwargs)
    cls_name, attr = name.split(".")
    cls = getattr(C, cls_name)
    if attr in ("borrow", "record", "pool_stats") and cls_name == "CudaEventFence":
        return getattr(cls, attr)(*args, **kwargs)
    target = args[0]
    if not isinstance(target, cls):
        return _Skip
    value = getattr(target, attr)
    return value(*args[1:], **kwargs) if callable(value) else value


class _Skip:
    """The call's object was never made (its constructor raised): nothing to call."""


def worker_main() -> None:
    import ctypes
    import warnings

    warnings.simplefilter("ignore")
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (libgomp, pybind) go to stderr, not into the protocol
    from roundpipe import _native

    C = _native.require()
    raw = [ctypes.create_string_buffer(POOL_BYTES + 256) for _ in range(POOL)]
    pool = [(ctypes.addressof(b) + 63) // 64 * 64 for b in raw]
    raw_aligned = ctypes.create_string_buffer(ALIGNED_BYTES + 4096)
    aligned = (ctypes.addressof(raw_aligned) + 4095) // 4096 * 4096
    base_threads, base_level = C.num_threads(), C.simd_level()
    extra = _worker_ops(C)
    wrap = None
    batch = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("begin"):
            if batch is not None:   # hypothesis abandoned the last example mid-draw: no "end" came
                batch.finish()
            batch = _Batch(C, pool)
            batch.aligned = aligned
            if msg.get("torch"):
                if wrap is None:
                    wrap = _wrapper_ops()
                import torch

                batch.storages = [torch.zeros(POOL_BYTES + 256, dtype=torch.uint8) for _ in range(8)]
            proto.write("{}\n")
            continue
        if msg.get("end"):
            batch.finish()
            batch = None
            C.set_num_threads(base_threads)
            C.set_simd_level(base_level)
            proto.write("{}\n")
            continue
        try:
            result = _run(batch, msg, {**extra, **(wrap or {})})
            if result is _Skip:
                out = {"r": "skip"}
            else:
                out = {"r": "ok", "t": type(result).__name__}
                batch.results.append(result)
                if type(result).__name__ in ("HostCopyEngine", "CopyEngine"):
                    batch.engines.append(result)
        except _Broken as exc:
            out = {"r": "broken", "m": str(exc)}
        except BaseException as exc:  # noqa: BLE001 - classified by the parent
            out = {"r": "exc", "t": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
                   "m": str(exc)[:300]}
        if out["r"] != "ok":
            batch.results.append(None)
        proto.write(json.dumps(out) + "\n")
    if batch is not None:   # stdin closed mid-batch
        batch.finish()


# ---------------------------------------------------------------------------------------------
# Wrapper ops: the Python layer over the native core (torch tensors in, validation first).
# ---------------------------------------------------------------------------------------------
def _wrapper_ops():
    import torch

    from roundpipe import _native, hostops
    from roundpipe.offload import ArenaConfig, CopyEngine, HostArena, fences, pack_lpt
    from roundpipe.optim import fused, gradients

    def method(cls, name):  # skipped when its object was never made (its constructor raised)
        return lambda target, *a, **k: getattr(target, name)(*a, **k) if isinstance(target, cls) else _Skip

    def empty(arena, shape, dtype):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and hasattr(torch, dtype) else dtype
        return arena.empty(shape, dtype) if isinstance(arena, HostArena) else _Skip

    ops = {
        "wrap.convert_": hostops.convert_,
        "wrap.grad_sumsq": gradients.grad_sumsq,
        "wrap.grad_norm": gradients.grad_norm,
        "wrap.clip_coef": gradients.clip_coef,
        "wrap.accumulate_": gradients.accumulate_,
        "wrap.adam_step": lambda *a, config, **k: fused.adam_step(*a, config=fused.AdamConfig(**config), **k),
        "wrap.set_simd_level": _native.set_simd_level,
        "wrap.pack_lpt": pack_lpt,
        "wrap.wait_all": fences.wait_all,
        "wrap.HostArena": lambda **config: HostArena(ArenaConfig(**config)),
        "wrap.HostArena.empty": empty,
        "wrap.CopyEngine": lambda threads: CopyEngine("cpu", threads_per_copy=threads),
    }
    for name in ("copy_of", "owns", "record", "reserve", "synchronize", "stats"):
        ops[f"wrap.HostArena.{name}"] = method(HostArena, name)
    for name in ("copy", "copy_many", "synchronize"):
        ops[f"wrap.CopyEngine.{name}"] = method(CopyEngine, name)
    return ops


# ---------------------------------------------------------------------------------------------
# The parent side: a worker process, batches, and what counts as a failure.
# ---------------------------------------------------------------------------------------------
class WorkerDied(AssertionError):
    pass


class Worker:
    """One worker subprocess; `call` returns its outcome or raises WorkerDied describing the crash."""

    def __init__(self):
        self.proc = None
        self.batch: list = []
        self.seen: collections.Counter = collections.Counter()  # (op, outcome) -> calls

    def start(self):
        import tempfile

        self.stderr = tempfile.TemporaryFile()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        proc, lines = self.proc, self.lines
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=CALL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _send(self, msg: dict) -> dict:
        if self.proc is None:
            self.start()
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=CALL_TIMEOUT_S)
        except (BrokenPipeError, queue.Empty):
            line = None
        if line is None:
            self._died(msg)
        return json.loads(line)

    def _died(self, msg: dict):
        proc = self.proc
        try:
            rc = proc.wait(timeout=2)
            how = f"died of {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            how = f"hung for {CALL_TIMEOUT_S:.0f} s (killed)"
        except ValueError:
            how = f"died with status {rc}"
        self.stderr.seek(0)
        err = self.stderr.read().decode(errors="replace")[-3000:]
        self.proc = None
        before = "\n".join(f"  {json.dumps(c)}" for c in self.batch[:-1]) or "  (none)"
        raise WorkerDied(f"the native core {how} in the call\n  {json.dumps(msg)}\n(or in asynchronous work, a copy, "
                         f"queued by an earlier call of the batch), after, in the same batch:\n{before}\n"
                         f"worker stderr (tail):\n{err}")

    def begin(self, torch: bool = False):
        self.batch = []
        self._send({"begin": True, "torch": torch})

    def end(self):
        self.batch.append({"op": "(end of batch: fences set, objects destroyed)"})
        self._send({"end": True})

    def call(self, op: str, *args, **kwargs) -> dict:
        msg = {"op": op, "a": list(args), "k": kwargs}
        self.batch.append(msg)
        out = self._send(msg)
        self.seen[(op, out["r"] if out["r"] != "exc" else out["t"])] += 1
        if out["r"] == "broken":
            raise AssertionError(f"{json.dumps(msg)} returned but broke its promise: {out['m']}")
        if out["r"] == "exc" and not set(out["mro"]) & set(ALLOWED):
            raise AssertionError(f"{json.dumps(msg)} raised {out['t']}: {out['m']}; expected a result or one of "
                                 f"{ALLOWED}")
        return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker_main()
