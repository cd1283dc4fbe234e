"""Kept graphs (issue 38, "no recompute where activations fit", per stage): under a device cap with room, a
backward stage whose forward stage runs on the same worker keeps that forward's autograd graph instead of
recomputing it (roundpipe/engine/calls/dispatcher.py `Schedule.keepable`, chosen by
roundpipe/engine/device_memory.py `PeakPredictions`).  Checked here: the trace shows no recompute for the
kept stages and their weights are not uploaded again; gradients equal the recomputing run's bitwise; the
measured peak is within the cap and near the prediction (roundpipe/planner/memory.py `_stage_need`); no
stage is kept where the prediction says the graphs do not fit; a failed call drops the kept graphs and the
model keeps none from then on."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.engine.calls.dispatcher import Schedule
from roundpipe.models.tiny_decoder import DecoderConfig, build_layers, loss_fn


class Named:
    def __init__(self, name):
        self.name = name


def _schedule(plan, workers):
    return Schedule(plan, True, num_mb=2, round_size=2, workers=[Named(f"w{i}") for i in range(workers)], g0=0)


def test_keepable_stages_are_those_on_their_forward_stages_worker():
    """Slots F0 F1 fused B.. : a backward stage can keep its forward's graph when its layers lie in one forward
    stage whose slot is a multiple of N before its own, and it does not start at layer 0."""
    plan = rp.Plan(forward=[range(0, 4), range(4, 6)], backward=[range(6, 8), range(4, 6), range(2, 4), range(0, 2)])
    assert _schedule(plan, 1).keepable() == [1, 2]   # [4-5] in F1, [2-3] in F0; [0-1] starts at layer 0
    # 2 workers: B[4-5] is slot 3, F1 slot 1 (same worker); B[2-3] slot 4, F0 slot 0 (same worker)
    assert _schedule(plan, 2).keepable() == [1, 2]
    # 3 workers: B[4-5] slot 3 vs F1 slot 1: no; B[2-3] slot 4 vs F0 slot 0: no
    assert _schedule(plan, 3).keepable() == []
    # a backward stage across two forward stages cannot keep (its graph would span two workers' runs)
    across = rp.Plan(forward=[range(0, 3), range(3, 6)], backward=[range(6, 8), range(2, 6), range(0, 2)])
    assert _schedule(across, 1).keepable() == []
    assert _schedule(plan, 1).keepable(quantized=lambda l: l == 5) == [2]


def test_kept_stages_read_no_input_and_upload_nothing():
    """A kept backward stage is no consumer of its input activation and is not counted as an upload of its
    layers (the per-layer protocol waits for the uploads it counts); the forward stage runs its range kept."""
    plan = rp.Plan(forward=[range(0, 4), range(4, 6)], backward=[range(6, 8), range(4, 6), range(2, 4), range(0, 2)])
    sched = _schedule(plan, 1)
    before = list(sched.uploads)
    sched.keep_activations([1])
    tasks = {t.label: t for t in sched.tasks["w0"]}
    assert tasks["F1[4-5]"].keep == (range(4, 6),) and tasks["B3[4-5]"].kept
    assert not tasks["B4[2-3]"].kept and tasks["F0[0-3]"].keep == ()
    assert sched.uploads == [u - (1 if l in (4, 5) else 0) for l, u in enumerate(before)]
    f0 = tasks["F0[0-3]"]   # boundary 4 is F0's output: read by F1 only now, not by B[4-5]
    assert [c.forward for c in f0.consumers[4]] == [True]
    sched.keep_activations(())
    assert not any(t.kept or t.keep for t in sched.tasks["w0"])


DECODER = DecoderConfig(hidden=64, layers=6, heads=2)
# 8 layers: embedding, 6 blocks, the head; slots F0[0-3] F1[4-5] fused[6-7] B[4-5] B[2-3] B[0-1]
PLAN = rp.Plan(forward=[range(0, 4), range(4, 6)], backward=[range(6, 8), range(4, 6), range(2, 4), range(0, 2)])


def _train(cap, dtype=torch.float32, workers=1, calls=1):
    """One model over the tiny decoder with PLAN: (losses, parameter grads, trace of the last call, its
    schedule's kept stages, memory_stats' workers)."""
    layers = build_layers(DECODER, seed=0)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (8, 64), generator=gen) for _ in range(2))
    with rp.RoundPipe(layers, devices=["cpu"] * workers, device_memory=cap, plan=PLAN, num_microbatches=2,
                      compute_dtype=dtype, resident_layers=0) as model:
        losses = []
        for _ in range(calls):
            with model.record_trace() as trace:
                losses.append(model.forward_backward(x, labels=y, loss_fn=loss_fn))
        model.synchronize()
        kept = model.dispatcher.schedule(PLAN, True, 2, model.round_size).kept
        stats = model.memory_stats()
        for s in stats["workers"].values():   # every kept graph and its weights died with its backward stage
            assert sum(s["current"].values()) == 0, s
        assert stats["kept_graphs"] == [[PLAN.backward[j].start, PLAN.backward[j].stop - 1] for j in sorted(kept)]
        return losses, [p.grad.clone() for p in model.parameters()], trace, kept, stats["workers"]


def _parts(trace) -> set[tuple[str, str]]:
    return {(e.args["stage"], e.args["part"]) for e in trace.events if e.cat != "copy"}


def _uploaded(trace) -> int:
    return sum(e.args.get("bytes", 0) for e in trace.events if e.cat == "copy" and e.name.startswith("param_up"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_backward_stage_whose_graph_fits_is_not_recomputed(dtype):
    """One worker under a roomy cap: B[4-5] and B[2-3] keep their forward's graph (no recompute span, their
    weights not uploaded again), B[0-1] still recomputes; losses and gradients equal the uncapped run's, which
    recomputes everything, bitwise (the same ops on the same values); the peak is within the cap and 0.85-1.1x
    the prediction.  bf16: the gradients fold into fp32 accumulators through hooks registered on the forward's
    weights after the graph was built."""
    loss_a, grads_a, trace_a, kept_a, _ = _train(None, dtype)
    cap = 64 << 20
    loss_b, grads_b, trace_b, kept_b, stats = _train(cap, dtype)
    assert kept_a == frozenset() and kept_b == frozenset({1, 2})
    assert ("B3[4-5]", "recompute") in _parts(trace_a) and ("B4[2-3]", "recompute") in _parts(trace_a)
    parts = _parts(trace_b)
    assert ("B3[4-5]", "recompute") not in parts and ("B4[2-3]", "recompute") not in parts
    assert {("B3[4-5]", "backward"), ("B4[2-3]", "backward"), ("B5[0-1]", "recompute")} <= parts
    layer_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in build_layers(DECODER)]
    saved = sum(layer_bytes[2:6]) * (2 if dtype == torch.bfloat16 else 4) // 4
    assert _uploaded(trace_a) - _uploaded(trace_b) == saved
    assert torch.equal(loss_a[0], loss_b[0])
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    s = stats["cpu:0"]
    assert s["peak_total"] <= cap and 0.85 <= s["peak_total"] / s["predicted_peak"] <= 1.1, s


def test_gradients_equal_plain_pytorch_over_several_calls_on_two_workers():
    """Two workers: the kept stages are those on their forward stage's worker; three accumulated calls give
    plain PyTorch's gradients (fp32, rtol 1e-5)."""
    _, grads, trace, kept, stats = _train(64 << 20, workers=2, calls=3)
    assert kept == frozenset({1, 2})
    by_stage = {}
    for e in trace.events:
        if e.cat != "copy":
            by_stage.setdefault(e.args["stage"], set()).add(e.worker)
    assert by_stage["F1[4-5]"] == by_stage["B3[4-5]"] and by_stage["F0[0-3]"] == by_stage["B4[2-3]"]
    layers = build_layers(DECODER, seed=0)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (8, 64), generator=gen) for _ in range(2))
    for _ in range(3):
        loss_fn(nn.Sequential(*layers)(x), y).backward()
    for got, p in zip(grads, (p for layer in layers for p in layer.parameters())):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-7)
    for s in stats.values():
        assert s["peak_total"] <= 64 << 20


def test_no_graph_is_kept_where_the_prediction_says_it_does_not_fit(monkeypatch):
    """A cap whose kept-weights share (85% on CPU workers) holds the recomputing schedule's predicted peak
    but no more: nothing is kept and every backward stage recomputes."""
    with monkeypatch.context() as m:
        m.setattr(Schedule, "keepable", lambda self, quantized=None: [])
        _, _, _, kept, stats = _train(64 << 20)
    assert kept == frozenset()
    recomputing = stats["cpu:0"]["predicted_peak"]
    _, _, trace, kept, stats = _train(int(recomputing / 0.85) + 1)
    assert kept == frozenset() and stats["cpu:0"]["predicted_peak"] == recomputing
    assert ("B3[4-5]", "recompute") in _parts(trace) and ("B4[2-3]", "recompute") in _parts(trace)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if rp.doing_recompute():   # a kept range is never recomputed, so never asks
            assert rp.get_recompute_data() is not None
        else:
            rp.save_for_recompute(x.sum())
        return torch.tanh(self.fc(x))


BLOCK_PLAN = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(2, 4), range(0, 2)])


def _blocks():
    torch.manual_seed(0)
    return [Block() for _ in range(6)]


def test_a_failed_call_drops_the_kept_graphs_and_none_are_kept_after_it():
    """Out of device memory in a kept backward stage: the call fails with no effect, the kept graphs die with
    it (the worker's ledger back to what it held before), and from then on nothing is kept: the next calls
    recompute and train exactly like a model that never failed."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    kwargs = dict(devices=["cpu"], num_microbatches=2, plan=BLOCK_PLAN, device_memory=1 << 30, resident_layers=0)
    ref = rp.RoundPipe(_blocks(), **kwargs)
    with rp.RoundPipe(_blocks(), **kwargs) as model, ref:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        sched = model.dispatcher.schedule(BLOCK_PLAN, True, 2, model.round_size)
        assert sched.kept == frozenset({1})
        model.synchronize()
        w = model.workers[0]
        live = w.ledger.live_bytes()
        w.inject_oom("backward")   # the fused tail's backward, while F[2-3]'s graphs are kept for B[2-3]
        with pytest.raises(torch.OutOfMemoryError):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        assert w.ledger.live_bytes() == live
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        assert model.dispatcher.schedule(BLOCK_PLAN, True, 2, model.round_size).kept == frozenset()
        ref.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        ref.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # the two calls that did not fail
        model.synchronize()
        ref.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_a_kept_range_saves_no_recompute_data():
    """rp.save_for_recompute in a kept range is a no-op (no recompute follows, as in the fused tail): the
    call leaves no recompute entry on its board and the recomputed layers still get theirs."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    with rp.RoundPipe(_blocks(), devices=["cpu"], num_microbatches=2, plan=BLOCK_PLAN, device_memory=1 << 30,
                      resident_layers=0) as model:
        with model.record_trace() as trace:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert ("B3[2-3]", "recompute") not in _parts(trace) and ("B4[0-1]", "recompute") in _parts(trace)
        ref = copy.deepcopy(_blocks())
        loss = sum(F.mse_loss(nn.Sequential(*ref)(x[i:i + 2]), y[i:i + 2]) for i in (0, 2)) / 2
        loss.backward()
        for p, q in zip(model.parameters(), (p for b in ref for p in b.parameters())):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.cuda
def test_kept_graphs_on_a_gpu_worker(monkeypatch):
    """One CUDA worker (which always has a cap): the kept stages' backward runs on the forward's graph on the
    compute stream (no recompute span), and the gradients equal those of a run whose kept-graph choice is
    switched off, bitwise (bf16)."""
    def run():
        layers = build_layers(DECODER, seed=0)
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 256, (8, 64), generator=gen) for _ in range(2))
        with rp.RoundPipe(layers, devices=["cuda:0"], device_memory=4 << 30, plan=PLAN, num_microbatches=2,
                          compute_dtype=torch.bfloat16, resident_layers=0) as model:
            with model.record_trace() as trace:
                model.forward_backward(x, labels=y, loss_fn=loss_fn)
            model.synchronize()
            return [p.grad.clone() for p in model.parameters()], _parts(trace), model.memory_stats()["kept_graphs"]
    with monkeypatch.context() as m:
        m.setattr(Schedule, "keepable", lambda self, quantized=None: [])
        want, parts_want, none = run()
    got, parts, kept = run()
    assert none == [] and ("B3[4-5]", "recompute") in parts_want
    assert kept == [[4, 5], [2, 3]] and ("B3[4-5]", "recompute") not in parts
    assert all(torch.equal(a, b) for a, b in zip(want, got))
