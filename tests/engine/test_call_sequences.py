"""Random sequences of engine calls never hang and equal a plain-PyTorch stale-1 reference.

Each case drives a random mix of forward_backward (gradient accumulation), forward-only
calls, step (asynchronous and synchronous), synchronize, state_dict, load_state_dict and
in-place edits of the masters, on 1-3 CPU workers, with roundpipe's AdamW (fused per-layer
path), torch's AdamW or a callable, against `StaleReference`, which spells out the
documented semantics (roundpipe/engine/step/async_step.py): step s opens a window of k training
calls (k = training calls since the previous step) that still read the weights before
step s; the next step or any sync point closes it.

Every case runs under a watchdog: a hang fails that case with every thread's stack and
the run goes on.  ROUNDPIPE_SOAK=N runs N more seeds (a longer soak, not in CI).
"""
import functools
import os
import random

import pytest
import soak
import torch
import torch.nn.functional as F
from rp_models import max_rel_err, mlp, reference
from stale_reference import StaleReference

import roundpipe as rp
from roundpipe.testing import inject_delays, random_sleeps

LR = 2e-2
# fp32 microbatch sums in another order than the whole-batch reference, amplified by up to ~14
# AdamW steps (2.3e-5 seen in a 2,800-case soak).  Reading the wrong weights version is off by
# about one update, lr = 2e-2 relative: 200x this.
TOL = 1e-4
CASE_TIMEOUT_S = 60


run_with_watchdog = functools.partial(soak.run_with_watchdog, timeout_s=CASE_TIMEOUT_S)   # tests/soak.py


def make_optimizer(kind, model, weight_decay):
    if kind == "rp":
        return rp.optim.AdamW(model.parameters(), lr=LR, weight_decay=weight_decay)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=weight_decay)
    return opt if kind == "torch" else (lambda: opt.step())


OPS = ["fb"] * 9 + ["step_async"] * 3 + ["step_sync", "eval", "eval", "sync", "state_dict", "load", "edit"]


def run_case(seed, pause=None):
    """`pause()` runs between the ops on the caller's thread."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    workers = rng.choice([1, 2, 3])
    num_mb = rng.choice([None, workers + 3])          # None: one round of N+1; else several rounds
    kind = rng.choice(["rp", "torch", "callable"])
    weight_decay = rng.choice([0.0, 0.1])
    layers = mlp(rng.choice([2, 4]))
    ref = StaleReference(reference(layers), lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=weight_decay))
    ops = [rng.choice(OPS) for _ in range(rng.randint(6, 14))] + ["step_async", "fb"]
    g = torch.Generator().manual_seed(seed)
    data = lambda: (torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g))
    where = f"seed {seed}: {workers} workers, num_mb {num_mb}, {kind}, ops {ops}"
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb) as model:
        opt = make_optimizer(kind, model, weight_decay)
        for i, op in enumerate(ops):
            at = f"{where}, op {i} ({op})"
            if pause is not None:
                pause()
            if op == "fb":
                x, y = data()
                loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                assert max_rel_err(loss, ref.forward_backward(x, y)) <= TOL, at
            elif op.startswith("step"):
                model.step(opt, asynchronous=op == "step_async")
                ref.step(op == "step_async")
            elif op == "eval":
                x, _ = data()
                assert max_rel_err(model(x), ref(x)) <= TOL, at
            elif op == "sync":
                model.synchronize()
                ref.flush()
                for (n, p), q in zip(model.named_parameters(), ref.cur.parameters()):
                    assert (p.grad is None) == (q.grad is None), at
                    if p.grad is not None:
                        assert max_rel_err(p.grad, q.grad) <= TOL, (at, n)
            elif op == "state_dict":
                sd = model.state_dict()
                ref.flush()
                for k, v in ref.cur.state_dict().items():
                    assert max_rel_err(sd[k], v) <= TOL, (at, k)
            elif op == "load":
                sd = {k: v * 0.9 for k, v in model.state_dict().items()}
                model.load_state_dict(sd)
                ref.flush()
                ref.cur.load_state_dict(sd)
            elif op == "edit":   # an in-place edit of a master after a sync point (an EMA copy-back, say)
                model.synchronize()
                ref.flush()
                j = rng.randrange(len(layers))
                with torch.no_grad():
                    next(model.module[j].parameters()).mul_(0.5)
                    next(ref.cur[j].parameters()).mul_(0.5)
        model.synchronize()
    for (n, p), q in zip(torch.nn.Sequential(*layers).named_parameters(), ref.cur.parameters()):
        assert max_rel_err(p.detach(), q.detach()) <= TOL, (where, n)


SOAK = int(os.environ.get("ROUNDPIPE_SOAK", "0"))


@pytest.mark.parametrize("seed", range(300 + SOAK))
def test_random_call_sequence(seed):
    """A random sequence of calls neither hangs nor departs from the stale-1 reference."""
    run_with_watchdog(lambda: run_case(seed))


@pytest.mark.parametrize("seed", range(6))
def test_random_call_sequence_under_delays(seed):
    """The same under random sleeps in copies, G-/P-copies and the optimizer (a missing wait shows)."""
    copies, host = random_sleeps(0.001, seed=seed), random_sleeps(0.01, seed=seed + 100, prob=0.5)

    def hook(kind):
        (host if kind in ("optimizer", "pcopy", "gcopy") else copies)(kind)
    with inject_delays(hook):
        run_with_watchdog(lambda: run_case(1000 + seed))


@pytest.mark.parametrize("seed", range(6))
def test_random_call_sequence_with_delays_between_calls(seed):
    """Random sleeps in layer compute and between the calls: a call begins while the last backward
    stages of the one before still run, or after they ended, or in between (the continuous pipeline)."""
    compute = random_sleeps(0.006, seed=seed, prob=0.7)
    between = random_sleeps(0.01, seed=seed + 200, prob=0.5)

    def hook(kind):
        if kind == "compute":
            compute(kind)
    with inject_delays(hook):
        run_with_watchdog(lambda: run_case(2000 + seed, pause=lambda: between("caller")))
