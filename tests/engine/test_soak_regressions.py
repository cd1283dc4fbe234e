"""Cases the feature soak (tests/soak.py, tools/soak.py) once failed at random, replayed under delays
that make the race they hit happen every time.

A failing call right after a training call.  forward_backward returns once its loss is known; its last
backward stages, which recompute the forwards of their layers, run on under the next call.  The soak
used to make its Fail layer raise through a global switch turned on around the failing call, so that
recompute could raise too: the call before then failed after it returned (its gradients dropped, its
error raised by the failing call) while the reference kept its gradients.  Seeds 100072 and 100160
(fp32) and 100084 (bf16, against its canonical rerun) failed in about 1 run of 3-5.  Slowing every
compute span down by DELAY_S keeps the earlier call's tail running while the failing call starts
(the caller needs well under a millisecond between the two), so these fail on every run with such a
switch; the failing call's batch marks it now (soak.poisoned).
"""
from __future__ import annotations

import tempfile
import time

import pytest
import soak  # tests/soak.py
import torch

from roundpipe.testing import inject_delays

DELAY_S = 0.02


def slow_compute(kind: str) -> None:
    if kind == "compute":
        time.sleep(DELAY_S)


def case(kind: str, fail_at: int, ops: list, workers: int = 3, layers: int = 3, optimizer: str = "rp",
         num_mb: int | None = None) -> soak.Case:
    options = {"compute_dtype": "bfloat16"} if kind == "bf16" else {}
    return soak.Case(100072, kind, workers, layers, fail_at, num_mb, optimizer, options, ops)


@pytest.mark.parametrize("fail_at, what", [(2, "fb"), (0, "fb"), (1, "eval")])
def test_failing_call_leaves_the_call_before_it_alone(fail_at, what):
    """fb (its tail still running), a failing fb or model(x), an asynchronous step, fb: every loss and
    the final masters as plain PyTorch's, where the failed call changed nothing (seed 100072, shrunk)."""
    c = case("fp32", fail_at, [("fb", 2, True), ("fail", what), ("step", True, None), ("fb", None, False)])
    with inject_delays(slow_compute), tempfile.TemporaryDirectory(prefix="rp-soak-") as tmp:
        soak.run_with_watchdog(lambda: soak.run_case(c, tmp), 60)


def test_failing_call_in_a_bf16_run_has_no_effect():
    """Seed 100084's situation (bf16, torch AdamW, 5 microbatches; compared with the engine itself): the
    run with the failing call right after a training call is bitwise the run without it."""
    ops = [("fb", 2, True), ("fail", "fb"), ("step", True, None), ("fb", None, True), ("step", True, None),
           ("fb", None, False)]
    c = case("bf16", 0, ops, optimizer="torch", num_mb=5)
    got = {}
    for name, kept in (("with", None), ("without", {0, 2, 3, 4, 5})):
        with inject_delays(slow_compute), tempfile.TemporaryDirectory(prefix="rp-soak-") as tmp:
            got[name] = soak.run_with_watchdog(lambda: soak.run_case(c, tmp, kept=kept), 60)
    assert got["with"].keys() == got["without"].keys()
    for key, want in got["without"].items():
        have = got["with"][key]
        same = all(map(torch.equal, have, want)) if key == "final" else torch.equal(have, want)
        assert same, f"{key}: the failed call changed it"
