"""kernels/_triton.py: when the Triton kernels run, and the one-time warning when they cannot."""
import subprocess
import sys
import warnings

import torch

from roundpipe import kernels
from roundpipe.kernels import _triton
from roundpipe.kernels.rms_norm import rms_norm_ref

_WITHOUT_TRITON = """
import sys, warnings
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
from roundpipe.kernels import apply_rope, linear_cross_entropy, rms_norm, swiglu, available, unavailable_reason
assert not available() and "Triton is not importable" in unavailable_reason()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x = torch.randn(3, 8, requires_grad=True)
    rms_norm(x, torch.ones(8)).sum().backward()
    swiglu(x, x)
    q = torch.randn(1, 2, 3, 8)
    apply_rope(q, q, torch.ones(3, 8), torch.zeros(3, 8))
    linear_cross_entropy(x, torch.randn(5, 8), torch.tensor([0, 1, 4]))
assert x.grad is not None
msgs = [str(w.message) for w in caught if "roundpipe.kernels" in str(w.message)]
assert len(msgs) == 1, msgs
from roundpipe.kernels import report
done = report()
assert done["launched"] == [] and len(done["fell_back"]) == 1 and "Triton is not importable" in done["unavailable"], done
print("OK", msgs[0])
"""


def test_interpreter_makes_kernels_available():
    """Under the test setup (GPU or TRITON_INTERPRET=1) the kernels are available for tensors there."""
    assert kernels.available(), kernels.unavailable_reason()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert _triton.use_triton(torch.empty(1, device=device))


def test_report_names_the_kernels_launched():
    """kernels.report() names each Triton kernel a call launched in this process (what a benchmark row says it ran)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 8, device=device)
    kernels.rms_norm(x, torch.ones(8, device=device))
    done = kernels.report()
    assert any("rms" in name for name in done["launched"]), done
    assert done["unavailable"] is None


def test_wrong_device_falls_back_with_one_warning(monkeypatch):
    """A tensor the kernels cannot run on takes the reference path, warning once across ops."""
    monkeypatch.setattr(_triton, "_device_reason", lambda tensor: "a test says so")
    monkeypatch.setattr(_triton, "_fell_back", set())
    x, w = torch.randn(4, 16), torch.rand(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = kernels.rms_norm(x, w)
        kernels.swiglu(x, x)
    assert [str(c.message) for c in caught] == [
        "roundpipe.kernels: using the PyTorch reference path because a test says so."]
    torch.testing.assert_close(y, rms_norm_ref(x, w))


def test_importable_and_usable_without_triton():
    """With Triton unimportable every functional form runs its PyTorch path and one warning is given."""
    run = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("OK roundpipe.kernels: using the PyTorch reference path because Triton is not")


def test_first_launch_of_a_specialisation_is_serialised(monkeypatch):
    """Several worker threads reaching a new kernel specialisation at once launch (and so compile) it one at
    a time; once it is warm they launch side by side."""
    import threading
    import time

    monkeypatch.setattr(_triton, "_warm", set())   # a dead fake kernel's id may be reused by this one

    state = {"inside": 0, "most": 0, "meet": None}
    lock = threading.Lock()

    class FakeKernel:
        def __getitem__(self, grid):
            def run(*args, **meta):
                with lock:
                    state["inside"] += 1
                    state["most"] = max(state["most"], state["inside"])
                if state["meet"] is None:
                    time.sleep(0.05)   # cold: time for another launch to get in, were it not serialised
                else:   # warm: all four launches meet inside (a serialised launch times out alone)
                    try:
                        state["meet"].wait(timeout=30)
                    except threading.BrokenBarrierError:
                        pass
                with lock:
                    state["inside"] -= 1
            return run

    kernel, x = FakeKernel(), torch.zeros(16)
    go = threading.Barrier(4)

    def worker():
        go.wait()
        _triton.launch(kernel, (1,), x, 16, BLOCK=16)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["most"] == 1
    state["most"], state["meet"] = 0, threading.Barrier(4)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["most"] == 4   # warm: no lock


# Pairs of int arguments that Triton compiles separately: width (i32 / i64 / u64), ==1 (a constant), %16.
_DISTINCT_INTS = [(16, 2**31 + 16), (16, -2**31 - 16), (2**32, 2**63), (-16, 2**40), (1, 17), (16, 17),
                  (2**31 - 1, 2**31 + 1)]


def test_specialisation_key_separates_what_triton_compiles_separately():
    """Ints differing only in Triton's width (int32/int64/uint64), ==1 or divisibility by 16 give different keys;
    ints Triton treats alike share one."""
    def key(n):
        return _triton._specialisation("kernel", torch.device("cpu"), (torch.zeros(4), n), {"BLOCK": 16})
    for a, b in _DISTINCT_INTS:
        assert key(a) != key(b), (a, b)
    assert key(32) == key(2**31 - 16) and key(2**31 + 16) == key(2**40) and key(3) == key(2**31 - 3)
    if _triton.triton is not None:   # cross-check the width with Triton's own mangling of the argument
        from triton.runtime.jit import mangle_type
        for n in (5, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**62, 2**63, 2**64 - 1):
            assert _triton._int_type(n) == mangle_type(n), n


def test_first_launch_of_a_wider_int_takes_the_lock_again(monkeypatch):
    """After a launch with n=16 is warm, the same launch with n=2**31+16 (an int64 specialisation) compiles anew,
    so it runs under the first-launch lock; a repeat of either does not."""
    monkeypatch.setattr(_triton, "_warm", set())   # a dead fake kernel's id may be reused by this one
    held = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: held.append(_triton._first_launch.locked())

    kernel, x = FakeKernel(), torch.zeros(16)
    for n in (16, 16, 2**31 + 16, 2**31 + 16, 16):
        _triton.launch(kernel, (1,), x, n, BLOCK=16)
    assert held == [True, False, True, False, False]


def test_interpreted_kernels_run_from_several_threads():
    """Two CPU workers run Triton kernels at once in the interpreter (TRITON_INTERPRET=1), which swaps
    triton.language's builtins while a kernel runs: before interpreted launches were serialised, the second
    thread's launch failed ("Did you forget to add @triton.jit ?"; a tiny Qwen3 with patched kernels on two
    CPU workers, tests/hf/test_hf.py).  Each thread's results equal the reference."""
    import threading
    if torch.cuda.is_available():
        return   # compiled kernels: nothing interpreted
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # the threads interleave inside each other's kernels
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 64, generator=gen) for _ in range(2)]
    w = torch.randn(64, generator=gen)
    errors, outs = [], {}

    def run(k):
        try:
            for _ in range(4):
                outs[k] = kernels.rms_norm(xs[k], w)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors
    for k in range(2):
        torch.testing.assert_close(outs[k], rms_norm_ref(xs[k], w), rtol=1e-5, atol=1e-5)
