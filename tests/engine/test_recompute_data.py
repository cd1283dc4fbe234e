"""rp.save_for_recompute / get_recompute_data / doing_recompute: a layer's forward data reaches its recompute."""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.engine.calls import compute
from roundpipe.engine.calls.board import Board
from roundpipe.testing import inject_delays, random_sleeps

LOG: list = []   # module level: every worker's replica of a layer appends here (a replica is a deep copy)
MISSED = threading.Event()   # a backward stage looked for recompute data that was not there yet


class Keeper(nn.Module):
    """Saves a summary of its input (a tensor, an int, a nest) in its first run; its recompute checks
    against the same input.  save=False: saves nothing, so its recompute must get None; gate: its first run
    waits until a backward stage missed recompute data (which then waits for this run's)."""

    def __init__(self, idx, save=True, fail_recompute_of=None, gate=False):
        super().__init__()
        self.idx, self.save, self.fail, self.gate = idx, save, fail_recompute_of, gate
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        first_col = x[:, 0].detach().clone()
        if rp.doing_recompute():
            data = rp.get_recompute_data()
            LOG.append(("recompute", self.idx, threading.current_thread().name, first_col, data))
            if self.fail is not None and data is not None and data[1] == self.fail:
                raise ValueError("recompute failed on purpose")
        else:
            if self.gate:
                MISSED.wait(timeout=10)   # bounded: if the miss never comes, the test's assertion says so
            if self.save:
                rp.save_for_recompute(first_col, int(x.shape[0]), {"rows": [x.shape[0]], "sum": x.sum()})
            LOG.append(("first", self.idx, threading.current_thread().name, first_col, torch.is_grad_enabled()))
        return torch.tanh(self.fc(x))


# Slots F[0] F[1] fused[2-3] B[0-1]: with 2 workers layer 0's forward runs on one worker and its recompute on
# the other; with 3 the backward stage follows F[0] on worker 0 and reaches layer 1 of a microbatch before
# F[1] (held back on worker 1 until then) ran it, so it waits for that data
PLAN = rp.Plan(forward=[range(0, 1), range(1, 2)], backward=[range(2, 4), range(0, 2)])


def layers(gate=False, **kw):
    torch.manual_seed(0)
    return [Keeper(0, **kw), Keeper(1, save=False, gate=gate), Keeper(2), Keeper(3)]


@pytest.fixture
def contexts(monkeypatch):
    """The CallContext of every stage-microbatch's layer runs (to look at the call's board afterwards)."""
    seen = []

    class Recording(compute.LayerRuns):
        def __init__(self, ctx, *args, **kw):
            seen.append(ctx)
            super().__init__(ctx, *args, **kw)
    monkeypatch.setattr(compute, "LayerRuns", Recording)
    return seen


@pytest.mark.parametrize("workers, grain", [(2, "stage"), (3, "stage"), (2, "layer")])
def test_forward_data_reaches_the_recompute_per_microbatch(contexts, monkeypatch, workers, grain):
    """Each microbatch's recompute gets what its forward saved (layer 1 None), on another worker for layer 0;
    doing_recompute is True only in the backward stage; nothing is left on the board; bitwise recompute.
    Also with layer-grain recompute (one run_layers call per layer)."""
    LOG.clear()
    MISSED.clear()
    waited = []   # recompute data a backward stage had to wait for
    poll = Board.poll

    def recording_poll(self, key):
        found = poll(self, key)
        if key[0] == "recompute" and not found[0]:
            waited.append(key)
            MISSED.set()
        return found
    monkeypatch.setattr(Board, "poll", recording_poll)
    model = rp.RoundPipe(layers(gate=workers == 3), devices=["cpu"] * workers, num_microbatches=4, plan=PLAN,
                         microbatches_per_round=4, recompute=grain)
    model._check_recompute = True   # the recompute's output equals the forward's, bitwise
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    with model:
        with inject_delays(random_sleeps(0.002, seed=3)):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        firsts = [e for e in LOG if e[0] == "first"]
        recomputes = [e for e in LOG if e[0] == "recompute"]
        # layers 0-1 run once in forward stages (no grad) and once recomputed, layers 2-3 in the fused stage only
        assert sorted(e[1] for e in firsts) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
        assert sorted(e[1] for e in recomputes) == [0] * 4 + [1] * 4
        assert all(not e[4] for e in firsts if e[1] < 2) and all(e[4] for e in firsts if e[1] >= 2)
        for _, idx, thread, col, data in recomputes:
            if idx == 1:
                assert data is None
                continue
            saved_col, n, nest = data
            assert torch.equal(saved_col, col) and n == col.shape[0] == 3 and nest["rows"] == [3]
            forward = [e for e in firsts if e[1] == 0 and torch.equal(e[3], col)]
            assert len(forward) == 1 and (forward[0][2] != thread) == (workers == 2)   # 2: on the other worker
            assert saved_col.data_ptr() != forward[0][3].data_ptr()   # a private copy that travelled
        assert contexts and all(len(ctx.board) == 0 for ctx in contexts)
        assert (("recompute", 1, 0) in waited) == (workers == 3)   # the wait for a forward not run yet

        LOG.clear()
        model(x)   # a forward-only call: no recompute follows, so nothing is saved or put on its board
        assert not any(e[0] == "recompute" for e in LOG)
        assert all(len(ctx.board) == 0 for ctx in contexts)


def test_a_failing_recompute_leaves_no_data_behind(contexts):
    """A recompute that raises fails the call with that error; the call's board holds nothing afterwards."""
    LOG.clear()
    model = rp.RoundPipe(layers(fail_recompute_of=3), devices=["cpu", "cpu"], num_microbatches=4, plan=PLAN)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    with model:
        with pytest.raises(ValueError, match="recompute failed on purpose"):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
        assert any(e[0] == "recompute" for e in LOG)
        assert contexts and all(len(ctx.board) == 0 for ctx in contexts)


class SavesTwice(nn.Module):
    def forward(self, x):
        rp.save_for_recompute(x)
        rp.save_for_recompute(x)
        return x * 2


def test_saving_twice_in_one_run_is_an_error_naming_the_layer():
    """A second save_for_recompute in one layer run reaches the caller as a RuntimeError naming the layer."""
    model = rp.RoundPipe([nn.Linear(8, 8), SavesTwice(), nn.Linear(8, 8)], devices=["cpu", "cpu"],
                         num_microbatches=2, plan=rp.Plan(forward=[range(0, 2)], backward=[range(2, 3), range(0, 2)]))
    with model, pytest.raises(RuntimeError, match="twice in one run of layer 1"):
        model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8), loss_fn=F.mse_loss)
        model.synchronize()


def test_outside_a_call():
    """Outside a call: save is a no-op, doing_recompute is False, get_recompute_data raises."""
    rp.save_for_recompute(torch.ones(2))
    assert rp.doing_recompute() is False
    with pytest.raises(RuntimeError, match="doing_recompute"):
        rp.get_recompute_data()


def test_a_wait_for_recompute_data_is_named():
    """A stall report names what a backward stage waits for (board.describe)."""
    from roundpipe.engine.calls.board import describe
    assert describe(("recompute", 3, 1)) == ("what layer 3's forward of microbatch 1 saved for its recompute "
                                             "(rp.save_for_recompute)")
