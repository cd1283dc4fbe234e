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

Seed 201388 (bf16, one worker, torch AdamW) failed on every run, no race: the soak's canonical rerun was
wrong.  With one worker and no num_microbatches, the model's first training call decides once whether
forward_backward calls without a count of their own run unsplit (docs/planner.md "No penalty when the
model fits"); a first call with a count of its own (or a forward-only one) rules it out.  The case's
first calls had counts and came before a load of a checkpoint saved before any training, so the rerun,
which drops them, made its last call its first: unsplit, where the run it checks split it in two, and
the bf16 loss differs in its last bit.  The rerun now splits those calls as the first run did.  The same
decision was missing from checkpoints: a new model resuming one decided anew at its first call (now
the manifest's "whole_batch", restored by load_checkpoint).
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
import types

import pytest
import soak  # tests/soak.py
import torch
import torch.nn.functional as F

import roundpipe as rp
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


def test_canonical_rerun_splits_default_calls_as_the_run_it_checks():
    """Seed 201388, shrunk: save, forward_backward with 2 microbatches, load, two asynchronous steps,
    forward_backward without a count.  Equal to the canonical rerun, which without the first run's
    decision runs its only call unsplit and gets another bf16 loss (so the check could tell)."""
    ops = [("save", "c0"), ("fb", 2, False), ("load", "c0"), ("step", True, None), ("step", True, None),
           ("fb", None, False)]
    c = soak.Case(201388, "bf16", 1, 3, 3, None, "torch", {"compute_dtype": "bfloat16"}, ops)
    soak.run_with_watchdog(lambda: soak.check_case(c), 60)
    got = {}
    for name, kept in (("run", None), ("rerun", {3, 4, 5})):
        with tempfile.TemporaryDirectory(prefix="rp-soak-") as tmp:
            got[name] = soak.run_with_watchdog(lambda: soak.run_case(c, tmp, kept=kept), 60)
    assert not torch.equal(got["run"][(5, "loss")], got["rerun"][(5, "loss")])


def test_a_resumed_run_splits_default_calls_as_the_run_that_saved():
    """bf16, one worker: a run that evaluated before training splits its default-count calls in two; a new model
    resuming its checkpoint split the next call too only once the checkpoint held that decision (before, it ran
    unsplit and the loss differed from the saving run's in its last bit)."""
    c = soak.Case(7, "bf16", 1, 3, 3, None, "torch", {}, [])
    (x0, _), (x1, y1), (x2, y2) = (soak.data(c, i) for i in range(3))
    losses = []
    with tempfile.TemporaryDirectory(prefix="rp-soak-") as tmp:
        for resumed in (False, True):
            with rp.RoundPipe(soak.make_layers(c), devices=["cpu"], compute_dtype=torch.bfloat16) as model:
                opt = torch.optim.AdamW(model.parameters(), lr=soak.LR)
                if resumed:
                    model.load_checkpoint(f"{tmp}/c", opt)
                else:
                    with torch.no_grad():
                        model(x0)   # a forward-only first call: later calls without a count split
                    model.forward_backward(x1, labels=y1, loss_fn=F.mse_loss)
                    model.step(opt, asynchronous=False)
                    model.save_checkpoint(f"{tmp}/c", opt)
                losses.append(model.forward_backward(x2, labels=y2, loss_fn=F.mse_loss))
    assert torch.equal(losses[0], losses[1]), [float(v) for v in losses]


@pytest.mark.parametrize("seed, kind", [(731049, "adamw8bit"), (732450, "nvme")])
def test_an_8bit_moment_code_flipped_by_fp32_noise(seed, kind, monkeypatch):
    """Seeds 731049 and 732450 (AdamW8bit; 2 workers): a microbatched gradient 3e-7 off the reference's whole-batch
    one (fp32 summation order) quantized one second moment to code 234 where the reference's is 233; the weight
    it steps was 5.7e-5 off two steps later (1.4 TOL), or, in the other case, a later call's outputs 2.5e-4 off.
    Both depend on one element only, so the reference now steps two shadow AdamW8bit optimizers on gradients moved
    by that noise (their moments persist, so a flipped code keeps moving later updates) and allows each master
    what the shadows' updates differ by; a forward's outputs are then checked at the engine's own masters.  The
    allowance stays far below TOL where no code can flip: the check still sees a wrong weights version (lr, 200
    TOL, on every element)."""
    case = soak.draw_case(seed, kind)
    allowances = []
    original = soak.Checker.master_err

    def recording(self, name, got, want):
        allowances.append((self.allow[name] / (soak.TOL * want.abs().max())).median().item())
        return original(self, name, got, want)

    monkeypatch.setattr(soak.Checker, "master_err", recording)
    soak.run_with_watchdog(lambda: soak.check_case(case), 120)
    assert allowances and max(allowances) < 0.01, allowances


def test_a_flipped_code_moves_the_gradients_of_the_layers_below(monkeypatch):
    """Seed 1312282 (nvme, AdamW8bit, one worker): after a flipped second-moment code 2.0.weight's allowance is
    3 TOL, and the gradient summed over the calls since the last step reached 1.0.weight through it, 1.4 TOL off at
    the next synchronize.  The gradient check allows it: along the twin of that 2.0.weight element
    (Checker.grads_value), and by what moving an open weight by its allowance moves a gradient
    (Checker.grad_value); gradients 0.1% off still fail it."""
    checked = []
    original = soak.Checker.grads_value

    def recording(self, at, model):
        off = [n for n, p in model.named_parameters() if p.grad is not None
               and soak.max_rel_err(p.grad, self.ref.cur.get_parameter(n).grad) > soak.TOL]
        if off:
            wrong = types.SimpleNamespace(named_parameters=lambda: [
                (n, types.SimpleNamespace(grad=None if p.grad is None else p.grad * 1.001))
                for n, p in model.named_parameters()])
            with pytest.raises(AssertionError, match="past the allowance"):
                original(self, at, wrong)
            checked.extend(off)
        return original(self, at, model)

    monkeypatch.setattr(soak.Checker, "grads_value", recording)
    soak.run_with_watchdog(lambda: soak.check_case(soak.draw_case(1312282, "nvme")), 120)
    assert checked == ["1.0.weight"], checked


def test_an_undetermined_first_update_is_followed():
    """Seed 730039 (dp2; here its ops in one process, fp32): the first real step is synchronous and clipped; one
    1.0.weight gradient element cancels to within fp32 noise of zero, so Adam's first update there (about lr
    times its sign) went the other way in the engine: 6.5e-3 of the tensor's largest weight, inside that element's
    allowance, but every later gradient moved with it and 2.0.weight ended 1.4e-4 off.  After a synchronous step
    the reference now takes the engine's value and moments where the allowance is open (Checker.follow)."""
    case = dataclasses.replace(soak.draw_case(730039, "dp2"), kind="fp32")
    soak.run_with_watchdog(lambda: soak.check_case(case), 120)


def test_seed_730039_on_two_ranks(tmp_path):
    """The case itself, on 2 ranks as the long soak ran it."""
    assert soak.run_dp_cases([730039], str(tmp_path), timeout=240) == {730039: "ok"}


def test_dp_cases_after_a_failing_one_still_run(tmp_path):
    """A dp2 case that fails stops its launch; the cases after it ran in a new launch and are reported as
    they ran, not as failures ("rank 0: not run" before, which replays showed to pass)."""
    results = soak.run_dp_cases([0, 1], str(tmp_path), timeout=240, fail=(0,))
    assert "failed on purpose" in results[0] and results[1] == "ok", results


def test_an_undetermined_update_no_step_follows_is_twinned():
    """Seed 1380402 (nvme, rp AdamW, 2 workers): a 3.0.weight element's first update, an asynchronous step, was
    undetermined by fp32 noise (gradient -5.2e-9, 3e-7 of its tensor's largest; allowance 868 TOL), and the engine's
    went 4.4e-4 off the reference's; nothing follows it (asynchronous steps, moments on disk).  The next window's call
    read it, its outputs 1.1e-4 off (a rank-one pattern, fitted by that one element to 1e-7), and two steps later
    4.0.weight was 1.9 TOL off, moved through the gradients.  The reference now runs a twin with that element moved
    and fits the engine's values along it (tests/soak_checker.py, Twin)."""
    soak.run_with_watchdog(lambda: soak.check_case(soak.draw_case(1380402, "nvme")), 120)


def test_values_off_the_twins_still_fail(monkeypatch):
    """Seed 1380402: the calls whose outputs are past TOL (ops 9, 10 and 15, 1.0-1.1 TOL) pass along the twin of
    that 3.0.weight element, while the same outputs 0.1% off fail (~10 TOL past), and so do the final masters."""
    checked = []
    call_value, masters_value = soak.Checker.call_value, soak.Checker.masters_value

    def calls(self, at, i, x, y, loss, out, want):
        if out is not None and soak.max_rel_err(out, want[1]) > soak.TOL:
            with pytest.raises(AssertionError, match="past the allowance"):
                call_value(self, at, i, x, y, loss, out * 1.001, want)
            checked.append((i, [(t.name, t.index) for t in self.twins]))
        return call_value(self, at, i, x, y, loss, out, want)

    def masters(self, at, got, what="masters"):
        if "final" in at:
            with pytest.raises(AssertionError, match="masters"):
                masters_value(self, at, {n: v * 1.001 for n, v in got.items()}, what)
            checked.append("final")
        return masters_value(self, at, got, what)

    monkeypatch.setattr(soak.Checker, "call_value", calls)
    monkeypatch.setattr(soak.Checker, "masters_value", masters)
    soak.run_with_watchdog(lambda: soak.check_case(soak.draw_case(1380402, "nvme")), 120)
    twin = [("3.0.weight", 62)]
    assert checked == [(9, twin), (10, twin), (15, twin), "final"], checked
