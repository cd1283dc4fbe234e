"""The continuous pipeline: a training call returns once its loss is known and the next call's
forwards run while its last backward stages drain (roundpipe/engine/model.py, `_run`)."""
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import roundpipe as rp
from roundpipe.models.sleep import sleep_layers

FWD_S, BWD_S = 0.01, 0.02
PLAN = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])   # 4 layers: F, fused, B


def calls_of(trace):
    """iteration -> (first compute start, last compute end) of its events."""
    spans = {}
    for e in trace.events:
        if e.cat == "copy":
            continue
        i = e.args["iteration"]
        lo, hi = spans.get(i, (e.start, e.end))
        spans[i] = (min(lo, e.start), max(hi, e.end))
    return spans


class _HeldBackward(torch.autograd.Function):
    """Identity whose backward in call t waits (up to GATE_S) until a forward of call t + 1 has begun.

    Call t + 1 is issued only once call t has returned, so an engine that returned after its last
    backward, or that ran the next call's forwards only after it, leaves the wait to time out: the
    outcome is an ordering, not a timing."""
    GATE_S = 10.0
    began: dict = {}        # call -> threading.Event, set by its first forward (or recompute)
    timed_out: list = []    # calls whose backward waited in vain
    held: set = set()       # calls whose backwards wait

    @staticmethod
    def forward(ctx, y, call):
        ctx.call = call
        _HeldBackward.began.setdefault(call, threading.Event()).set()
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.call in _HeldBackward.held:
            nxt = _HeldBackward.began.setdefault(ctx.call + 1, threading.Event())
            if not nxt.wait(_HeldBackward.GATE_S):
                _HeldBackward.timed_out.append(ctx.call)
        return g, None


class HeldFirst(torch.nn.Module):
    """Layer 0 (its backward runs in a call's last stage), its backward held by _HeldBackward; the call's
    number rides in the input's first column."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return _HeldBackward.apply(self.layer(x), int(x[0, 0].item()))


@pytest.mark.parametrize("asynchronous", [None, True])
def test_next_call_forwards_run_while_the_last_backward_drains(asynchronous):
    """Call t returns before its last backward ends, and call t+1's first forward starts before
    it ends: on two workers the second worker is free once call t's fused stage is done."""
    layers = sleep_layers(4, fwd_s=FWD_S, bwd_s=BWD_S)
    layers[0] = HeldFirst(layers[0])
    _HeldBackward.began, _HeldBackward.timed_out, _HeldBackward.held = {}, [], {1, 2}
    y = torch.randn(4, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, plan=PLAN, num_microbatches=2) as model:
        opt = rp.optim.Adam(model.parameters(), lr=1e-3)
        with model.record_trace() as trace:
            for t in (1, 2, 3):
                x = torch.randn(4, 8)
                x[:, 0] = t
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                # returned while its last backward stage (layer 0's) was held: no backward span of it ended
                assert t not in _HeldBackward.held or not [
                    e for e in trace.events
                    if e.cat == "B" and e.args["iteration"] == t and e.args["part"] == "backward"], t
                if asynchronous:
                    model.step(opt, asynchronous=True)
        assert _HeldBackward.timed_out == [], ("calls whose next call's forwards began only after their last backward "
                                               "(or that returned only after it)")
        spans = calls_of(trace)
        assert sorted(spans) == [1, 2, 3]
        for t in (1, 2):
            assert spans[t + 1][0] < spans[t][1], (t, spans)
        b_first = [e for e in trace.events if e.cat == "B" and e.args["iteration"] == 1]
        f_next = [e for e in trace.events if e.cat == "F" and e.args["iteration"] == 2]
        assert {e.worker for e in b_first}.isdisjoint({e.worker for e in f_next[:1]})


def test_state_reads_wait_for_calls_in_flight():
    """A sync point after a call that returned early sees all of its gradients."""
    layers = sleep_layers(4, fwd_s=0.0, bwd_s=0.02)
    ref = sleep_layers(4, fwd_s=0.0, bwd_s=0.0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, plan=PLAN, num_microbatches=2) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
    net = torch.nn.Sequential(*ref)
    F.mse_loss(net(x), y).backward()
    for g, p in zip(grads, net.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def test_error_after_return_reaches_the_next_call():
    """A layer failing in call t's last backward stage, after forward_backward returned, is raised
    by the next call into the model; the failed call's gradients are dropped."""
    class FailOnce(torch.autograd.Function):
        armed = False

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.05)
            if FailOnce.armed:
                FailOnce.armed = False
                raise RuntimeError("backward blew up")
            return g

    class First(torch.nn.Linear):   # layer 0: its backward runs in the call's last stage
        def forward(self, x):
            return FailOnce.apply(super().forward(x))

    torch.manual_seed(0)
    layers = [First(8, 8)] + [torch.nn.Linear(8, 8) for _ in range(3)]
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, plan=PLAN, num_microbatches=2) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        clean = [p.grad.clone() for p in model.parameters()]
        FailOnce.armed = True
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # fused stage fine: the loss is known
        with pytest.raises(RuntimeError, match="backward blew up") as info:
            model.synchronize()
        assert any("after forward_backward returned" in n for n in getattr(info.value, "__notes__", []))
        model.synchronize()   # the error was raised once; the model is usable
        for g, p in zip(clean, model.parameters()):
            torch.testing.assert_close(p.grad, g)   # the failed call left no gradient behind
