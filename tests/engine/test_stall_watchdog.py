"""A stalled worker is named: with stall_timeout set, a stage that makes no progress raises RoundPipeStalled in
the caller (worker, stage, microbatch, what it waits for, every engine thread's stack) instead of hanging, and
the model refuses further calls without blocking its caller; a healthy run never trips it."""
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.core.errors import RoundPipeStalled

W = 8
PLAN = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(2, 4), range(0, 2)])
# slots of the first call on 2 workers: F0[0-1] cpu:0, F1[2-3] cpu:1, fused2[4-5] cpu:0, B3[2-3] cpu:1, B4[0-1] cpu:0


GATE: dict = {}   # "event": the gate; "block": which forward of the gated layer waits; "recompute": of which kind


class Gate(nn.Module):
    """tanh(Linear), optionally sleeping; when `gated`, its GATE["block"]-th forward (from 0) of the kind asked
    for (a forward stage's, no grad, or a recompute's) waits on GATE["event"].  Workers run deep copies of
    the layer, so the count lives in GATE."""

    def __init__(self, gated: bool = False, sleep: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.gated, self.sleep = gated, sleep

    def forward(self, x):
        if self.gated and torch.is_grad_enabled() == GATE["recompute"]:
            GATE["seen"] += 1
            if GATE["seen"] - 1 == GATE["block"]:
                GATE["event"].wait()   # the stuck layer
        if self.sleep:
            time.sleep(self.sleep)
        return torch.tanh(self.fc(x))


def layers(block: int | None = None, recompute: bool = False, sleep: float = 0.0, at: int = 3):
    """Six layers; with `block`, layer `at` waits on a fresh gate (GATE["event"])."""
    GATE.update(event=threading.Event(), block=block, recompute=recompute, seen=0)
    torch.manual_seed(0)
    return [Gate(gated=block is not None and i == at, sleep=sleep) for i in range(6)]


def data(rows: int = 4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, W, generator=g), torch.randn(rows, W, generator=g)


def release(model) -> None:
    """Lets the stuck layer return; every engine thread of the model then ends."""
    GATE["event"].set()
    for w in model.workers:
        for e in w.executors():
            e.stop()
            assert e.join(10), e.name


def test_a_blocked_layer_is_named_and_the_caller_is_not_blocked():
    """Layer 3 blocks in microbatch 1 of its forward stage: RoundPipeStalled names worker cpu:1, stage F1[2-3],
    microbatch 1 and the layer's frame, says what the other worker waits for, and holds the blocked thread's
    stack; later calls raise at once and close() returns while the layer is still blocked.  Another model's
    threads of the same names, alive in the process, come after its own (before, the report could show the
    other model's idle "roundpipe-cpu:1" where this one's blocked thread was looked for)."""
    x, y = data()
    other = rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=2, plan=PLAN)
    other.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # its worker threads now idle, alive
    model = rp.RoundPipe(layers(block=1), devices=["cpu"] * 2, num_microbatches=2, plan=PLAN,
                         stall_timeout=0.5)
    try:
        with pytest.raises(RoundPipeStalled) as info:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        msg = str(info.value)
        head = msg.split("\n")[0]
        assert "stall_timeout=0.5 s" in head, head
        assert "worker cpu:1 in stage F1[2-3] (forward of layers 2-3), at microbatch 1" in head, head
        assert "waits for its own forward (or recompute) to return" in head and "in forward" in head, head
        # cpu:0 waits for cpu:1's output in its fused stage, or for the turn when the layer blocked inside it (a
        # fast first forward): in the fused stage, or still in F0 after its last microbatch's output went out
        # (on a loaded machine it gave the turn back while it waited for that download, and cpu:1 took it first)
        behind = msg.split("\n")[1]
        assert behind.startswith(("waiting behind it: worker cpu:0 in stage fused2[4-5]",
                                  "waiting behind it: worker cpu:0 in stage F0[0-1]")), behind
        assert "the input of layer 4, microbatch 1" in behind or "the CPU workers' turn" in behind, behind
        stacks = msg.split("Engine threads (the stalled model's workers first):\n", 1)[1]
        assert stacks.count("thread 'roundpipe-cpu:1'") >= 2   # this model's, the other one's (and earlier tests')
        blocked = stacks.split("thread 'roundpipe-cpu:1'", 1)[1].split("thread 'roundpipe-", 1)[0]
        assert "GATE[\"event\"].wait()" in blocked and "run_layers" in blocked, blocked
        assert isinstance(info.value, RuntimeError)
        with pytest.raises(RoundPipeStalled, match="stalled earlier"):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        assert not GATE["event"].is_set()
        model.close()   # returns although cpu:1's thread is still blocked
        assert [w.name for w in model.workers if w.stalled] == ["cpu:0", "cpu:1"] or \
            [w.name for w in model.workers if w.stalled] == ["cpu:1"]
    finally:
        release(model)
        other.close()


def test_a_stall_in_a_calls_tail_is_raised_by_the_sync_point():
    """The recompute of the last backward stage (cpu:0's, after the fused stage gave every loss) blocks after
    forward_backward returned: synchronize() raises RoundPipeStalled naming that stage and microbatch instead
    of waiting forever."""
    x, y = data()
    model = rp.RoundPipe(layers(block=0, recompute=True, at=1), devices=["cpu"] * 2, num_microbatches=2,
                         plan=PLAN, stall_timeout=0.5)
    try:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # its loss is known: it returns
        with pytest.raises(RoundPipeStalled) as info:
            model.synchronize()
        head = str(info.value).split("\n")[0]
        assert "worker cpu:0 in stage B4[0-1] (recompute and backward of layers 0-1), at microbatch 0" in head, head
        model.close()
    finally:
        release(model)


def test_a_healthy_slow_run_does_not_fire():
    """Layers sleeping 50 ms each (100 ms per stage-microbatch) under stall_timeout=1: training calls with
    synchronous and asynchronous steps and a forward run through, with the results of a model without
    the watchdog (or the sleeps)."""
    x, y = data(4)
    results = []
    for timeout, sleep in ((1.0, 0.05), (None, 0.0)):
        with rp.RoundPipe(layers(sleep=sleep), devices=["cpu"] * 2, num_microbatches=2, plan=PLAN,
                          stall_timeout=timeout) as model:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False)
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=True)
            out = model(x)
            model.synchronize()
            results.append([out] + [p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (0, ValueError), (float("nan"), ValueError),
                                      (float("inf"), ValueError), ("1s", TypeError), (True, TypeError)])
def test_bad_stall_timeout_is_named(bad, exc):
    """stall_timeout must be None or a finite number of seconds > 0."""
    with pytest.raises(exc, match=r"stall_timeout="):
        rp.EngineConfig(stall_timeout=bad)
    with pytest.raises(exc, match=r"stall_timeout="):
        rp.RoundPipe([nn.Linear(2, 2)], devices=["cpu"], stall_timeout=bad)
    assert rp.EngineConfig(stall_timeout=2).stall_timeout == 2


def test_a_closed_executor_whose_thread_ident_was_reused_is_not_listed():
    """A closed executor still referenced keeps its dead thread's ident, which the system may give a later thread:
    the report then listed that thread's stack under the dead executor's name, among the stalled model's own
    (CI, 2026-11-28: an idle stack came first where the blocked 'roundpipe-cpu:1' was looked for)."""
    from roundpipe.core.executor import SerialExecutor, engine_stacks
    live = SerialExecutor("roundpipe-zz-probe")
    dead = SerialExecutor("roundpipe-cpu:1")
    dead.close()
    dead._thread._ident = live.ident   # what the reuse of an ident does
    try:
        assert not dead.alive and live.alive
        assert engine_stacks({live.ident}).startswith("thread 'roundpipe-zz-probe'")
    finally:
        live.close()
