"""Soak seed 921491 (lora4, 2 CPU workers, torch AdamW): a final master off the plain-PyTorch reference by
5.6e-4 relative, TOL 1e-4.  Not an engine defect: every gradient before the step agreed within 4e-7 of its
tensor's largest; one element of 0.a.weight cancels to -3.5e-8 (fp64), ~1e-6 of the tensor's largest
gradient and ~3 Adam eps, so fp32 fixes it only within ~20% of itself and Adam's first step
g / (|g| + eps) turns that into ~1% of lr.  Plain PyTorch with another microbatch order is off by as much or more.
The soak's master check now takes off each element's allowance for that (tests/soak_checker.py, GRAD_NOISE).
"""
from __future__ import annotations

import copy
import dataclasses
import tempfile

import soak  # tests/soak.py
import torch
import torch.nn.functional as F
from rp_models import max_rel_err
from torch import nn

# The case minimised (9 of its 12 operations); each operation's batch is soak.data(case, its index).
OPS = [("late_bwd", True), ("fb", 5, True), ("composed", 1), ("fb", None, True), ("fb", 3, True), ("fb", 1, False),
       ("step", True, 0.5), ("step", True, None), ("fb", None, False)]


def minimised_case() -> soak.Case:
    return dataclasses.replace(soak.draw_case(921491, "lora4"), ops=OPS)


def test_case_921491_passes_the_soak_check():
    """The minimised case runs on the engine and its final masters pass the soak's check."""
    with tempfile.TemporaryDirectory(prefix="rp-soak-") as tmp:
        soak.run_with_watchdog(lambda: soak.run_case(minimised_case(), tmp), 120)


def reference_through_op_6(case: soak.Case) -> soak.Checker:
    """The soak's reference for operations 0-6 (whole batches), with its allowances."""
    chk = soak.Checker(case, soak.make_layers(case), None)
    ref = chk.ref
    ref.flush()
    chk.step(True)   # op 0, late_bwd: a step with no gradient (the scheduler only)
    for i in range(1, 6):
        x, y = soak.data(case, i)
        if OPS[i][0] == "composed":
            ref.composed(x, y)
        else:
            ref.forward_backward(x, y)
    chk.step(True, max_grad_norm=0.5)   # op 6
    ref.flush()
    return chk


def plain_pytorch_by_rows(case: soak.Case) -> dict[str, torch.Tensor]:
    """Operations 0-6 in plain PyTorch, each batch's gradient summed over 1-row microbatches."""
    model = nn.Sequential(*copy.deepcopy(soak.make_layers(case)))
    opt = soak.make_optimizer("torch", model.parameters())
    sched = soak.make_scheduler(opt)
    opt.step()   # op 0: no gradient, nothing updated
    sched.step()
    for i in range(1, 6):
        x, y = soak.data(case, i)
        for r in range(x.shape[0]):
            (F.mse_loss(model(x[r:r + 1]), y[r:r + 1]) / x.shape[0]).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.5)
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_plain_pytorch_in_another_order_is_off_by_more_than_tol_and_within_the_allowance():
    """Plain PyTorch alone, 1-row microbatches against whole batches: 0.a.weight differs beyond TOL after
    one AdamW step, in an element whose gradient is below 1e-5 of its tensor's largest; the allowance
    covers it and every other master."""
    case = minimised_case()
    chk = reference_through_op_6(case)
    rows = plain_pytorch_by_rows(case)
    whole = dict(chk.ref.cur.named_parameters())
    name = "0.a.weight"
    assert max_rel_err(rows[name], whole[name].detach()) > 5 * soak.TOL
    worst = (rows[name] - whole[name].detach()).abs().argmax()
    # the whole-batch gradient of that element, from the reference's Adam state after its first step
    g = chk.ref.opt.state[whole[name]]["exp_avg"].flatten() / (1 - chk.ref.opt.param_groups[0]["betas"][0])
    assert g[worst].abs() < 1e-5 * g.abs().max()
    for n, q in whole.items():
        assert chk.master_err(n, rows[n], q.detach()) <= soak.TOL, n


def test_allowance_still_tells_a_missed_update():
    """Masters one update behind (the weights before the step) fail the check in every trained tensor."""
    chk = reference_through_op_6(minimised_case())
    for n, q in chk.ref.cur.named_parameters():
        if q.requires_grad:
            assert chk.master_err(n, chk.ref.prev[n], q.detach()) > 20 * soak.TOL, n


def test_an_adamw8bit_reference_is_allowed_only_what_its_shadows_differ_by():
    """An AdamW8bit reference (blockwise 8-bit states) gets no first-order allowance: only what its two shadow
    optimizers' updates differ by (tests/soak_checker.py, Checker._shadow), far below TOL where no moment code flips."""
    case = dataclasses.replace(minimised_case(), kind="adamw8bit", optimizer="8bit")
    chk = reference_through_op_6(case)
    weights = dict(chk.ref.cur.named_parameters())
    for name, allow in chk.allow.items():
        assert (allow / (soak.TOL * weights[name].detach().abs().max())).median() < 0.01, name
