"""A failed call raises once: its other microbatches and the calls around it never raise it again.

A call that raises has no effect.  An error in the tail of a training call that already
returned (its last backward stages run on under the next call) is raised by the next call
at its return, which is cancelled for it, or by a sync point; step() never raises it.  Errors
of calls that were still draining when another call failed are folded into the one raised.

Each row of a batch carries a tag in column 0 through every layer (call * 1000 + row), so a
fault can be armed for one microbatch of one call however the stages run.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.testing import inject_delays, random_sleeps

W = 8
LR = 0.1
FAULT: dict = {}   # "at": the tags that fail, "where": "forward" | "backward" | "loss"


class Boom(Exception):
    """The injected fault (a type nothing else raises)."""


def _hit(x: torch.Tensor) -> bool:
    at = FAULT.get("at")
    return at is not None and bool(torch.isin(x[:, 0], at).any())


class Tagged(nn.Module):
    """Column 0 passes through unchanged (the row tag); the rest is tanh(Linear)."""

    def __init__(self, faulty: bool = False):
        super().__init__()
        self.fc = nn.Linear(W - 1, W - 1)
        self.faulty = faulty

    def forward(self, x):
        hit = self.faulty and _hit(x)
        if hit and FAULT["where"] == "forward":
            raise Boom("forward")
        y = torch.cat([x[:, :1], torch.tanh(self.fc(x[:, 1:]))], 1)
        if hit and FAULT["where"] == "backward" and y.requires_grad:
            def fail(_grad):
                raise Boom("backward")
            y.register_hook(fail)
        return y


def loss_fn(out, y):
    if FAULT.get("where") == "loss" and _hit(out):
        raise Boom("loss_fn")
    return F.mse_loss(out[:, 1:], y)


def batch(call: int, rows: int):
    g = torch.Generator().manual_seed(call)
    x = torch.randn(rows, W, generator=g)
    x[:, 0] = torch.arange(rows, dtype=torch.float32) + 1000.0 * call
    return x, torch.randn(rows, W - 1, generator=g)


def mb_tags(call: int, rows: int, num_mb: int, m: int) -> torch.Tensor:
    """The tags of microbatch m of a call (the engine splits rows into num_mb near-equal chunks)."""
    idx = torch.arange(rows).tensor_split(num_mb)[m]
    return idx.float() + 1000.0 * call


def make_layers(n: int, faulty: int):
    torch.manual_seed(0)
    return [Tagged(faulty=i == faulty) for i in range(n)]


def reference_grads(layers, steps_before: list[int], calls: list[int], rows: int):
    """Plain PyTorch: SGD steps on `steps_before`, then the gradient summed over `calls`."""
    ref = nn.Sequential(*[Tagged() for _ in layers])
    for a, b in zip(ref, layers):
        a.load_state_dict(b.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for c in steps_before:
        x, y = batch(c, rows)
        F.mse_loss(ref(x)[:, 1:], y).backward()
        opt.step()
        opt.zero_grad()
    for c in calls:
        x, y = batch(c, rows)
        F.mse_loss(ref(x)[:, 1:], y).backward()
    return [p.grad for p in ref.parameters()]


def assert_grads(model, expected):
    got = [p.grad for p in model.parameters()]
    for g, e in zip(got, expected):
        assert g is not None
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


CASES = [(where, workers, num_mb, m) for where in ("forward", "backward", "loss")
         for workers in (1, 2, 3, 4) for num_mb in (1, 2, 3, 4, 5) for m in range(num_mb)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["forward", "backward", "loss"])
def test_one_raise_and_next_calls_exact(where, asynchronous):
    """Every microbatch index, 1-4 workers, 1-5 microbatches: call 1 fails once (raised by itself or,
    from its tail, by call 2, which is then cancelled); later calls' gradients equal PyTorch's."""
    failures = []
    for _, workers, num_mb, m in [c for c in CASES if c[0] == where]:
        rows = 2 * num_mb
        layers = make_layers(4, faulty=(workers + m) % 4)
        expected_base = [{k: v.clone() for k, v in l.state_dict().items()} for l in layers]
        FAULT.clear()
        raised = {}
        with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb) as model:
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            model.forward_backward(*batch(0, rows)[:1], labels=batch(0, rows)[1], loss_fn=loss_fn)
            model.step(opt, asynchronous=asynchronous)
            FAULT.update(at=mb_tags(1, rows, num_mb, m), where=where)   # only call 1's microbatch m
            for call in (1, 2, 3, 4):
                x, y = batch(call, rows)
                try:
                    loss = model.forward_backward(x, labels=y, loss_fn=loss_fn)
                    assert torch.isfinite(loss)
                except Boom as e:
                    raised[call] = e
            try:
                model.synchronize()
            except Boom as e:
                raised["sync"] = e
            case = (workers, num_mb, m)
            if len(raised) != 1 or next(iter(raised)) not in (1, 2):
                failures.append(f"{case}: raised by {list(raised)} (expected once, by call 1 or 2)")
                continue
            ran = [c for c in (2, 3, 4) if c not in raised]
            ref_layers = make_layers(4, faulty=-1)
            for l, sd in zip(ref_layers, expected_base):
                l.load_state_dict(sd)
            try:
                assert_grads(model, reference_grads(ref_layers, [0], ran, rows))
            except AssertionError as e:
                failures.append(f"{case}: gradients of calls {ran} differ: {e}")
    FAULT.clear()
    assert not failures, "\n".join(failures)


class HeldTail(Tagged):
    """A faulty layer whose recompute of call 0 (grad enabled: a backward stage) waits until the
    fault is armed for call 1, so the fault surely hits call 0's tail too, after call 0 returned."""

    armed = None   # a threading.Event, set when call 1 begins

    def forward(self, x):
        if torch.is_grad_enabled() and bool((x[:, 0] < 1000).any()):
            assert self.armed.wait(30), "call 1 never began"
        return super().forward(x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,num_mb", [(2, 2), (3, 4), (2, 3), (4, 5)])
def test_fault_hitting_the_previous_calls_tail_is_folded(workers, num_mb):
    """A layer broken while call 1 runs also breaks the tail of call 0, which returned: one raise,
    call 0's error folded in as a note; the calls after it equal PyTorch."""
    import threading

    rows = 2 * num_mb
    for seed in range(3):
        torch.manual_seed(0)
        layers = [HeldTail(faulty=True) if i == 1 else Tagged() for i in range(4)]
        HeldTail.armed = threading.Event()
        base = [{k: v.clone() for k, v in l.state_dict().items()} for l in layers]
        FAULT.clear()
        raised = []
        plan = rp.Plan.uniform(4, backward_per_stage=1, forward_ratio=3)   # layer 1: a backward stage
        with inject_delays(random_sleeps(0.002, seed=seed)), \
                rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb, plan=plan) as model:
            for call in range(5):
                if call == 1:   # every tag of calls 0 and 1
                    FAULT.update(at=torch.cat([batch(c, rows)[0][:, 0] for c in (0, 1)]), where="forward")
                    HeldTail.armed.set()
                x, y = batch(call, rows)
                try:
                    model.forward_backward(x, labels=y, loss_fn=loss_fn)
                except Boom as e:
                    raised.append((call, e))
                    FAULT.clear()   # fixed once it raised
            model.synchronize()
        assert [c for c, _ in raised] == [1], raised
        notes = getattr(raised[0][1], "__notes__", [])
        assert any("training call 1 " in n for n in notes), notes   # call 0's error: raised or folded
        ref = make_layers(4, faulty=-1)
        for l, sd in zip(ref, base):
            l.load_state_dict(sd)
        assert_grads(model, reference_grads(ref, [], [2, 3, 4], rows))
    FAULT.clear()


@pytest.mark.timeout(120)
def test_tail_error_not_raised_by_step_but_by_next_forward():
    """A tail failure of a call that returned: step() does not raise it; the next forward-only call
    raises it (cancelled: no outputs) and the model then works on."""
    rows, num_mb = 6, 3
    layers = make_layers(4, faulty=1)
    with rp.RoundPipe(layers, devices=["cpu", "cpu"], num_microbatches=num_mb) as model:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        FAULT.update(at=mb_tags(0, rows, num_mb, 0), where="backward")
        x, y = batch(0, rows)
        raised = []
        for op in ("fb", "step", "eval", "eval"):
            try:
                if op == "fb":
                    model.forward_backward(x, labels=y, loss_fn=loss_fn)
                elif op == "step":
                    model.step(opt, asynchronous=True)
                else:
                    model(batch(5, rows)[0])
            except Boom as e:
                raised.append((op, e))
        FAULT.clear()
        assert len(raised) == 1 and raised[0][0] in ("fb", "eval"), raised
        if raised[0][0] == "eval":
            assert any("cancelled" in n for n in raised[0][1].__notes__)
        model.forward_backward(*batch(1, rows)[:1], labels=batch(1, rows)[1], loss_fn=loss_fn)
        model.synchronize()
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("keyword, hint", [("input_args", "positional arguments"), ("label", "labels="),
                                           ("run_config", "num_microbatches=")])
def test_a_published_keyword_names_its_replacement(keyword, hint):
    """A keyword of the published RoundPipe's calls left in a call fails in layer 0 with a note naming what
    replaces it (before: only `Linear.forward() got an unexpected keyword argument`)."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with rp.RoundPipe([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)], devices=["cpu"]) as model:
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'") as info:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss, **{keyword: y})
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"{keyword}= is a keyword of the published RoundPipe" in notes and hint in notes
