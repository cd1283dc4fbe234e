"""Idle threads give their OpenMP teams back (roundpipe/core/omp.py).

libgomp throttles every team's spinning once all teams' helper threads outnumber the
CPUs; the engine keeps teams only on the threads working now.  Teams are counted as the
process's threads: a parallel region started by a thread without a team starts helpers.
"""
import os
import threading
import time

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe
from roundpipe.core import omp
from roundpipe.core.executor import SerialExecutor

pytestmark = pytest.mark.skipif(not omp.available() or torch.get_num_threads() < 2,
                                reason="needs libgomp with omp_pause_resource_all and 2+ OpenMP threads")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_region() -> None:
    """A torch op large enough to run on every OpenMP thread."""
    torch.ones(1 << 22).sum()


def test_release_team_joins_the_callers_helpers():
    parallel_region()
    with_team = threads()
    assert omp.release_team()
    assert threads() == with_team - (torch.get_num_threads() - 1)
    assert omp.release_team()   # no team: still fine
    parallel_region()           # the next region builds it again
    assert threads() == with_team


def test_an_idle_engine_thread_gives_its_team_back():
    parallel_region()
    omp.release_team()
    before = threads()
    ex = SerialExecutor("omp-test")
    try:
        started = threads()
        assert started == before + 1
        seen = []
        ex.submit(lambda: (parallel_region(), seen.append(threads())))
        ex.wait_idle(raise_errors=True)
        assert seen == [started + torch.get_num_threads() - 1]   # the job ran with a team of its own
        deadline = time.monotonic() + 10
        while threads() > started and time.monotonic() < deadline:
            time.sleep(omp.IDLE_RELEASE_S)
        assert threads() == started
    finally:
        ex.close()


def test_a_call_gives_the_callers_team_back():
    torch.manual_seed(0)
    model = RoundPipe(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)), devices=["cpu"])
    try:
        seen = {}
        main = threading.get_ident()

        def loss_fn(out, y):
            seen["during"] = threads()
            return ((out - y) ** 2).mean()

        x, y = torch.randn(4, 8), torch.randn(4, 1)
        model.forward_backward(x, labels=y, loss_fn=loss_fn)   # the first call sets everything up
        model.synchronize()
        parallel_region()   # the script's own work gives the main thread a team
        with_team = threads()
        model.forward_backward(x, labels=y, loss_fn=loss_fn)
        assert threading.get_ident() == main
        assert seen["during"] <= with_team - (torch.get_num_threads() - 1)
    finally:
        model.close()


def test_keep_teams_switch():
    """ROUNDPIPE_KEEP_OMP_TEAMS=1 keeps every team (libgomp throttles as before): nothing is given back."""
    import subprocess
    import sys

    code = "import torch; from roundpipe.core import omp; print(omp.available(), omp.release_team())"
    for value, expected in (("1", "False False"), ("0", "True True")):
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ROUNDPIPE_KEEP_OMP_TEAMS=value),
                             capture_output=True, text=True, check=True).stdout.split("\n")[0]
        assert out == expected, (value, out)


def test_a_thread_with_sparse_jobs_gives_its_team_back_at_once(monkeypatch):
    """The step, G-copy and landing threads get a job once per call or step (idle_release_s=0): their
    helpers, left spinning for IDLE_RELEASE_S, took cores from the compute that follows (a host step
    right after the backward ran 1.6 -> 3.1 ms on 2 cores).  idle_release_s=0 gives the team back as
    soon as the queue is empty; a long idle_release_s keeps it for that long."""
    released = []
    real = omp.release_team
    monkeypatch.setattr(omp, "release_team", lambda: (released.append(threading.current_thread().name), real())[1])
    for name, idle, expect in (("omp-test-at-once", 0, True), ("omp-test-keep", 30.0, False)):
        ex = SerialExecutor(name, idle_release_s=idle)
        try:
            ex.submit(parallel_region)
            ex.wait_idle(raise_errors=True)
            deadline = time.monotonic() + (10 if expect else 0.2)
            while name not in released and time.monotonic() < deadline:
                time.sleep(1e-3)
            assert (name in released) == expect
        finally:
            ex.close()


def test_the_engines_sparse_threads_release_at_once():
    """Step, G-copy and landing threads give their teams back at once; compute threads keep theirs
    between stages."""
    with RoundPipe([nn.Linear(8, 8), nn.Linear(8, 8)], devices=["cpu", "cpu"]) as model:
        assert model.host_thread._idle_release_s == 0 and model.gcopy_thread._idle_release_s == 0
        assert all(w._completer._idle_release_s == 0 for w in model.workers)
        assert all(w._thread._idle_release_s == omp.IDLE_RELEASE_S for w in model.workers)
