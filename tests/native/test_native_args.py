"""The crashes that brought the native argument checks in (tests/native/test_native_fuzz.py), and each check's message.

Each case runs its steps in one batch in a worker subprocess (tests/_native_fuzz_worker.py),
so a regression that kills the process fails the test instead of the run.
"""
from __future__ import annotations

import pytest
from _native_fuzz_worker import U64, Worker

from roundpipe import _native

PMAX = 2**63 - 1                # PTRDIFF_MAX: no buffer is larger

pytestmark = pytest.mark.skipif(not _native.available(), reason="native extension not built")


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.stop()


# -- the crashes that brought these checks in, and the checks' messages -----------------------------------
# Each case: steps (op, args, expected) run in one batch; expected is "ok" or (exception type, message part).
ARENA = ("HostArena", [1 << 20, 256, 0, "host"], "ok")
ENGINE = ("HostCopyEngine", [1], "ok")
BUF, BUF2, A0 = {"$buf": 0, "off": 0}, {"$buf": 1, "off": 0}, {"$res": 0}
CASES = {
    # issue: pack_lpt with a size of 2**64-1 died of SIGFPE (a rounding wrapped to a zero divisor)
    "pack_lpt_size_2**64-1": [("pack_lpt", [[U64 - 1], 1, 256], (
        "ValueError", "sizes[0]=18446744073709551615 must be at most 9223372036854775807"))],
    "pack_lpt_wrapper_default_align": [("wrap.pack_lpt", [[U64 - 1], 2], ("ValueError", "sizes[0]="))],
    # issue: sizes whose sum overflowed were packed from the wrapped total ([2**63] * 2 -> no piece at all)
    "pack_lpt_sum_wraps_to_0": [("pack_lpt", [[2**63, 2**63], 2, 1], ("ValueError", "sizes[0]=9223372036854775808"))],
    "pack_lpt_sum_overflows": [("pack_lpt", [[PMAX, PMAX, 2], 2, 1], ("ValueError", "sizes add up to more than"))],
    "pack_lpt_windows": [("pack_lpt", [[1], 65537, 1], ("ValueError", "windows=65537 must be in [1, 65536]")),
                         ("pack_lpt", [[PMAX - 1, 0, 1], 65536, 1], "ok")],  # the largest accepted: tiles exactly
    # issue: CopyEngine(threads_per_copy=100000) died (libgomp could not start the team)
    "copy_engine_100000_threads": [("wrap.CopyEngine", [100000], (
        "ValueError", "threads_per_copy=100000 must be in [1, 256]")), ("wrap.CopyEngine", [256], "ok")],
    "host_copy_engine_100000_threads": [("HostCopyEngine", [100000], ("ValueError", "threads_per_copy=100000"))],
    "set_num_threads_100000": [("set_num_threads", [100000], ("ValueError", "n=100000 must be in [1, 256]"))],
    # issue: HostArena.reserve(2**64-4095) rounded up to 0 bytes and succeeded
    "arena_reserve_2**64-4095": [ARENA, ("HostArena.reserve", [A0, U64 - 4095], (
        "ValueError", "nbytes=18446744073709547521 must be at most 9223372036854771712"))],
    # allocate(2**64-1) returned a block of 2**64-1 bytes; after allocate(2**64-100) a free aborted
    "arena_allocate_wraps": [ARENA, ("HostArena.allocate", [A0, U64 - 1], ("ValueError", "nbytes=")),
                             ("HostArena.allocate", [A0, U64 - 100], ("ValueError", "nbytes=")),
                             ("HostArena.allocate", [A0, 10], "ok"), ("drop", [3], "ok")],
    "arena_chunk_bytes_2**64-1": [("HostArena", [U64 - 1, 256, 0, "host"], ("ValueError", "chunk_bytes="))],
    # issue: clip_coef(-5, 1) returned a negative coefficient
    "clip_coef_negative_norm": [("wrap.clip_coef", [-5, 1], ("ValueError", "total_norm=-5.0 must be >= 0")),
                                ("wrap.clip_coef", [0.0, 1.0, 0.0], "ok")],  # 1.0, not ZeroDivisionError
    # the other boundary checks, one message each
    "convert_misaligned": [("convert", [{"$buf": 0, "off": 2}, "float32", BUF2, "bfloat16", 4], (
        "ValueError", "is not aligned to its element size (4 bytes)"))],
    "convert_overlap": [("convert", [BUF, "float32", {"$buf": 0, "off": 8}, "bfloat16", 4], (
        "ValueError", "dst overlaps src"))],
    "convert_n_overflows": [("convert", [BUF, "float32", BUF2, "bfloat16", 2**62], (
        "ValueError", "src: n=4611686018427387904 x 4 bytes is more than the largest possible buffer"))],
    "accumulate_wraps": [("accumulate", [{"$high": 4096}, BUF, "float32", 2048], (
        "ValueError", "runs past the end of the address space"))],
    "grad_sumsq_null": [("grad_sumsq", [[0], ["float16"], [3]], ("ValueError", "grads[0] is a null pointer"))],
    "copy_overlap": [ENGINE, ("CopyEngine.submit", [A0, {"$q": "act_up"}, [[BUF, {"$buf": 0, "off": 8}, 64]], []], (
        "ValueError", "ops[0].src overlaps ops[0].dst"))],
    "copy_queue_out_of_range": [ENGINE, ("CopyEngine.submit", [A0, {"$qint": 7}, [], []], (
        "ValueError", "queue=7 is not a copy queue"))],
    "wait_for_inf": [("HostFence.wait_for", [{"$fence": "set"}, float("inf")], (
        "ValueError", "seconds=inf must be a number in [0, 1e9]"))],
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_arguments_raise_naming_them(worker, name):
    """Each crash of the issue (and each kind of check) is now an exception naming the argument, in a subprocess."""
    steps = CASES[name]
    worker.begin(torch=any(op.startswith("wrap.") for op, _, _ in steps))
    outs = [worker.call(op, *args) for op, args, _ in steps]
    worker.end()
    for (op, args, expected), out in zip(steps, outs):
        if expected == "ok":
            assert out["r"] == "ok", (op, args, out)
        else:
            assert out["r"] == "exc" and out["t"] == expected[0] and expected[1] in out["m"], (op, args, out)
