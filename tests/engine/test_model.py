"""RoundPipe on CPU workers: exact gradients, API semantics, bad input and faults."""
import collections
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS, Mlp, RunningMean, Slow, max_rel_err, mlp, ref_forward, reference, sync_steps_match
from rp_models import assert_grads_equal as _assert_grads_equal
from torch import nn

import roundpipe as rp
from roundpipe.testing import inject_delays, random_sleeps


def ref_grads(layers, x, y, loss_fn=F.mse_loss, **kw):
    ref = reference(layers)
    loss = loss_fn(ref_forward(ref, x, **kw), y)
    loss.backward()
    return loss, ref


PLANS = {
    "default": None,
    "all_fused": rp.Plan(forward=[], backward=[range(0, 5)]),
    "misaligned": rp.Plan(forward=[range(0, 3)], backward=[range(3, 5), range(1, 3), range(0, 1)]),
    "uniform": rp.Plan.uniform(5, backward_per_stage=2, forward_ratio=1),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_gradients_match_autograd(name, workers):
    """Gradients and loss equal plain autograd for every model and pool size (uneven microbatches)."""
    torch.manual_seed(workers)
    layers = MODELS[name]()
    x, y = torch.randn(11, 8), torch.randn(11, 8)
    kw = {"scale": 0.5} if name == "nested" else {}
    loss_ref, ref = ref_grads(layers, x, y, **kw)
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=2 + workers) as model:
        loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss, **kw)
        model.synchronize()
        assert loss.shape == () and loss.device.type == "cpu"
        assert max_rel_err(loss, loss_ref.detach()) <= 1e-5
        assert_grads_equal(model, ref)


@pytest.mark.parametrize("num_mb", range(1, 8))
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_microbatch_counts_and_plans(num_mb, plan):
    """1-7 microbatches (several rounds for 3 workers) under default and explicit plans give exact gradients."""
    layers = [Slow(m, 0.0005) for m in mlp(5)]
    x, y = torch.randn(9, 8), torch.randn(9, 8)
    _, ref = ref_grads(layers, x, y)
    with rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=num_mb, plan=PLANS[plan],
                      microbatches_per_round=3) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert_grads_equal(model, ref)


def test_exact_under_random_copy_delays():
    """Random sleeps at every copy point do not change the gradients."""
    layers = MODELS["nested"]()
    x, y = torch.randn(7, 8), torch.randn(7, 8)
    _, ref = ref_grads(layers, x, y, scale=2.0)
    with rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=7) as model, inject_delays(random_sleeps(0.002)):
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss, scale=2.0)
        model.synchronize()
        assert_grads_equal(model, ref)


def test_calls_accumulate_and_step_clears():
    """Two forward_backward calls accumulate like two backward() calls; step() clears p.grad."""
    layers = mlp(4)
    ref = reference(layers)
    xs = [torch.randn(6, 8) for _ in range(2)]
    with rp.RoundPipe(layers, devices=["cpu", "cpu"]) as model:
        for x in xs:
            model.forward_backward(x, labels=x, loss_fn=F.mse_loss)
            F.mse_loss(ref(x), x).backward()
        model.synchronize()
        assert_grads_equal(model, ref)
        model.step(lambda: None, asynchronous=False)
        assert all(p.grad is None for p in model.parameters())


def test_buffers_update_once_per_forward():
    """Buffers end as in plain PyTorch: one update per microbatch forward, none from recompute."""
    layers = [Mlp(), RunningMean(), nn.BatchNorm1d(8), Mlp(), RunningMean()]
    ref = reference(layers)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=4,
                      plan=rp.Plan(forward=[range(0, 4)], backward=[range(4, 5), range(2, 4), range(0, 2)])) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        for xm, ym in zip(x.split(2), y.split(2)):   # BatchNorm sees microbatch statistics
            (F.mse_loss(ref(xm), ym) / 4).backward()
        for (n, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
            assert torch.allclose(b.float(), rb.float(), rtol=1e-6, atol=1e-7), n
        assert int(layers[1].calls) == 4
        assert_grads_equal(model, ref)


def test_forward_only_matches_and_keeps_no_grad():
    """model(x) under no_grad (or in eval mode) returns the concatenated output on the CPU with no autograd
    graph (with grad enabled in train mode it is a composed call: tests/engine/test_composed_calls.py)."""
    layers = MODELS["nested"]()
    ref = reference(layers)
    x = torch.randn(5, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        with torch.no_grad():
            out = model(x, scale=3.0)
        model.eval()
        out_eval = model(x, scale=3.0)
    assert not out.requires_grad and not out_eval.requires_grad
    torch.testing.assert_close(out_eval, out)
    torch.testing.assert_close(out, ref_forward(ref, x, scale=3.0).detach())
    assert all(p.grad is None for p in layers[0].parameters())


def test_loss_is_weighted_by_microbatch_size():
    """With a mean loss_fn the returned loss is the batch mean even for uneven microbatches."""
    layers = mlp(3)
    x = torch.randn(7, 8)
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=3) as model:
        loss = model.forward_backward(x, labels=torch.zeros(7, 8), loss_fn=lambda o, t: (o - t).pow(2).mean())
    torch.testing.assert_close(loss, reference(layers)(x).pow(2).mean().detach())


def test_loss_from_last_layer_without_loss_fn():
    """Without loss_fn the last layer's output is the loss."""
    class MeanLoss(nn.Module):
        def forward(self, h):
            return h.pow(2).mean()
    layers = mlp(3) + [MeanLoss()]
    x = torch.randn(4, 8)
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=2) as model:
        loss = model.forward_backward(x)
    torch.testing.assert_close(loss, reference(layers)(x).detach())


def test_state_dict_round_trip_and_names():
    """Names are the wrapped module's; load_state_dict changes what the workers compute."""
    layers = mlp(3)
    with rp.RoundPipe(nn.Sequential(*layers), devices=["cpu"]) as model:
        names = [n for n, _ in model.named_parameters()]
        assert names[0] == "0.0.weight"
        sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(sd)
        assert torch.count_nonzero(model(torch.randn(3, 8))) == 0


def test_trace_and_rotation():
    """Every stage-microbatch is traced and timed, and the rotation continues across calls."""
    layers = mlp(4)
    plan = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])
    with rp.RoundPipe(layers, devices=["cpu"] * 2, plan=plan, num_microbatches=3) as model:
        timings = []
        model.stage_timing = lambda *a: timings.append(a)   # the profiler seam
        with model.record_trace() as trace:
            model.forward_backward(torch.randn(3, 8), labels=torch.randn(3, 8), loss_fn=F.mse_loss)
        assert any(e.cat == "copy" for e in trace.events)   # the copy queues' rows
        trace.events = [e for e in trace.events if e.cat != "copy"]
        # one event per compute span: F forward; fused forward, loss, backward; B recompute, backward
        assert len({(e.args["stage"], e.name) for e in trace.events}) == len(timings) == 3 * 3
        parts = collections.Counter((e.cat, e.args["part"]) for e in trace.events)
        assert parts == {("F", "forward"): 3, ("fused", "forward"): 3, ("fused", "loss"): 3,
                         ("fused", "backward"): 3, ("B", "recompute"): 3, ("B", "backward"): 3}
        assert sorted((w, k, first, m) for w, k, first, m, t0, t1 in timings if k == "B") == \
            [("cpu:0", "B", 0, m) for m in range(3)]
        placed = {(e.cat, e.args["layers"], e.worker) for e in trace.events}
        assert placed == {("F", "0-1", "cpu:0"), ("fused", "2-3", "cpu:1"), ("B", "0-1", "cpu:0")}
        with model.record_trace() as trace2:
            model.forward_backward(torch.randn(3, 8), labels=torch.randn(3, 8), loss_fn=F.mse_loss)
        f_stage = [e.worker for e in trace2.events if e.cat == "F"]   # copies: cat "copy"
        assert set(f_stage) == {"cpu:1"}   # 3 slots used last call, so slot 0 now goes to worker 1


@pytest.mark.parametrize("make, exc, match", [
    (lambda: rp.RoundPipe([]), ValueError, "layers is empty"),
    (lambda: rp.RoundPipe([nn.Linear(2, 2), "x"]), TypeError, r"layers\[1\]"),
    (lambda: rp.RoundPipe(mlp(2), devices=[]), ValueError, "devices=\\[\\] is empty"),
    (lambda: rp.RoundPipe(mlp(2), devices=["tpu:0"]), ValueError, "tpu:0"),
    (lambda: rp.RoundPipe(mlp(2), devices=["cuda:0"]), ValueError, "CUDA"),
    (lambda: rp.RoundPipe(mlp(2), devices=["cpu"], num_microbatches=0), ValueError, "num_microbatches=0"),
    (lambda: rp.RoundPipe(mlp(2), devices=["cpu"], compute_dtype=torch.int8), ValueError, "compute_dtype"),
    (lambda: rp.RoundPipe(mlp(4), devices=["cpu"], plan=rp.Plan(forward=[], backward=[range(0, 3)])),
     ValueError, "plan covers 3 layers"),
])
def test_bad_construction(make, exc, match):
    """Bad constructor arguments raise ValueError/TypeError naming the argument."""
    if "CUDA" in match and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(exc, match=match):
        make()


def test_bad_plan_names_the_stage():
    """Explicit plans with gaps or overlaps raise ValueError naming the stage."""
    with pytest.raises(ValueError, match="backward stage 1"):
        rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 3)])
    with pytest.raises(ValueError, match="forward stage 1"):
        rp.Plan(forward=[range(0, 1), range(2, 3)], backward=[range(3, 4), range(0, 3)])


def test_bad_calls_and_closed_model():
    """Bad call arguments raise ValueError/TypeError; any call after close() raises ValueError."""
    model = rp.RoundPipe(mlp(2), devices=["cpu"], num_microbatches=4)
    x = torch.randn(3, 8)
    model.forward_backward(x, labels=x, loss_fn=F.mse_loss)   # fewer samples than microbatches: one each
    with pytest.raises(ValueError, match="batch is empty"):
        model.forward_backward(torch.randn(0, 8), labels=torch.randn(0, 8), loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="labels have batch size 2"):
        model.forward_backward(torch.randn(4, 8), labels=torch.randn(2, 8), loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="nothing to split"):
        model.forward_backward(3.0, loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match="optimizer"):
        model.step(42, asynchronous=True)
    with pytest.raises(TypeError, match="loss_fn"):
        model.forward_backward(torch.randn(4, 8), labels=x, loss_fn="mse")
    model.close()
    for call in (lambda: model(torch.randn(4, 8)), model.synchronize, lambda: model.step(lambda: None, asynchronous=True)):
        with pytest.raises(ValueError, match="closed"):
            call()
    model.close()   # idempotent


class Nested(nn.Module):
    """A layer that calls another RoundPipe from its worker thread."""
    inner = None

    def forward(self, x):
        return Nested.inner(x)


def test_nested_roundpipe_is_refused_not_deadlocked():
    """A RoundPipe called inside a layer of another raises RuntimeError in the caller; both stay usable."""
    x = torch.randn(4, 8)
    with rp.RoundPipe(mlp(2), devices=["cpu"]) as inner, \
            rp.RoundPipe([nn.Linear(8, 8), Nested()], devices=["cpu"] * 2) as outer:
        Nested.inner = inner
        try:
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="cannot be nested"):
                outer(x)
            assert time.monotonic() - t0 < 60   # refused at once, not after a watchdog-length wait
        finally:
            Nested.inner = None
        assert inner(x).shape == (4, 8)
        Nested.inner = lambda t: t   # the outer model is usable after the error
        try:
            assert outer(x).shape == (4, 8)
        finally:
            Nested.inner = None


class Boom(nn.Module):
    exc = None   # class attribute: workers run replicas, which share the class but not instance state

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if Boom.exc is not None:
            raise Boom.exc
        return self.fc(x)


@pytest.mark.parametrize("exc", [RuntimeError("bad shape"), KeyError("k"), KeyboardInterrupt()])
def test_layer_exception_surfaces_and_model_recovers(exc):
    """A layer's exception reaches the caller fast with its type and layer index; nothing is changed."""
    layers = mlp(3) + [Boom()] + mlp(2)
    boom = Boom
    opt_model = rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=4)
    opt = torch.optim.AdamW(opt_model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    opt_model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
    opt_model.step(opt, asynchronous=False)
    before = {k: v.clone() for k, v in opt_model.state_dict().items()}
    opt_state = {id(p): s["exp_avg"].clone() for p, s in opt.state.items()}
    boom.exc = exc
    t0 = time.perf_counter()
    with pytest.raises(type(exc)) as info:
        opt_model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
    assert time.perf_counter() - t0 < 30   # the other workers stop at once; only a hang takes this long
    if not isinstance(exc, KeyboardInterrupt):
        assert "layer 3" in str(info.value)
    opt_model.synchronize()
    assert all(torch.equal(v, before[k]) for k, v in opt_model.state_dict().items())
    assert all(p.grad is None for p in opt_model.parameters())
    assert all(torch.equal(s["exp_avg"], opt_state[id(p)]) for p, s in opt.state.items())
    boom.exc = None   # usable again, and the failed call left no gradient behind
    _, ref = ref_grads(layers, x, y)
    opt_model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
    opt_model.synchronize()
    assert_grads_equal(opt_model, ref)
    opt_model.close()
    assert threading.active_count() < 50


def test_loss_fn_exception_is_tagged():
    """An exception in loss_fn keeps its type and says it came from loss_fn."""
    def bad_loss(out, y):
        raise IndexError("label out of range")
    with rp.RoundPipe(mlp(3), devices=["cpu"] * 2) as model:
        with pytest.raises(IndexError, match="loss_fn"):
            model.forward_backward(torch.randn(4, 8), labels=torch.zeros(4), loss_fn=bad_loss)
        with pytest.raises(TypeError, match="scalar loss"):
            model.forward_backward(torch.randn(4, 8), labels=torch.zeros(4), loss_fn=lambda o, y: o)
        model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8), loss_fn=F.mse_loss)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test: a shell that starts pytest in the background (`cmd &`)
    leaves SIGINT ignored, and then `_thread.interrupt_main()` raises nothing (both Ctrl-C tests failed so)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_in_the_caller_leaves_state_unchanged(sigint_raises):
    """A KeyboardInterrupt delivered to the waiting caller stops the call; weights and optimizer state stay."""
    import _thread

    class InterruptOnce(torch.nn.Module):
        """Sends the caller a Ctrl-C from inside the call (so it surely still waits), then carries on."""
        armed = False

        def forward(self, x):
            if InterruptOnce.armed:
                InterruptOnce.armed = False
                _thread.interrupt_main()
            return x

    layers = [Slow(m, 0.01) for m in mlp(4)]
    layers.insert(2, InterruptOnce())
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=4) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt, asynchronous=False)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        steps = [s["step"].clone() for s in opt.state.values()]
        InterruptOnce.armed = True   # the replicas share the class attribute
        with pytest.raises(KeyboardInterrupt):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert all(p.grad is None for p in model.parameters())
        assert [s["step"] for s in opt.state.values()] == steps
        _, ref = ref_grads(layers, x, y)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert_grads_equal(model, ref)


def test_frozen_parameters_get_no_gradient():
    """Parameters with requires_grad=False stay without .grad; the others are exact."""
    layers = mlp(4)
    for p in layers[1].parameters():
        p.requires_grad_(False)
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    _, ref = ref_grads(layers, x, y)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert (p.grad is None) == (not p.requires_grad)
            if p.requires_grad:
                assert max_rel_err(p.grad, q.grad) <= 1e-5


@pytest.mark.fast_device   # the strict device model adds four copy-queue threads per CPU worker
def test_dropped_model_stops_its_threads():
    """A model garbage-collected without close() lets its worker and host threads exit."""
    import gc
    before = threading.active_count()
    model = rp.RoundPipe(mlp(2), devices=["cpu"] * 3)
    model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8), loss_fn=F.mse_loss)
    assert threading.active_count() == before + 8   # 3 workers and their completion threads, step, G-copy
    del model
    gc.collect()
    deadline = time.time() + 30
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_stage_backward_entry_matches_torch_and_keeps_its_errors():
    """The stages' backward call gives torch.autograd.backward's gradients, and its error on a mismatch."""
    from roundpipe.engine.calls.compute import autograd_backward
    torch.manual_seed(0)
    w = torch.randn(3, 5, requires_grad=True)
    x = torch.randn(4, 3)
    g = torch.randn(4, 5)
    autograd_backward([x @ w], [g])
    ours, w.grad = w.grad.clone(), None
    torch.autograd.backward([x @ w], [g])
    assert torch.equal(ours, w.grad)
    w.grad = None
    autograd_backward([x @ w], [g.double()])   # another dtype: torch's path, which casts
    assert torch.allclose(w.grad, ours)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        autograd_backward([x @ w], [torch.randn(4, 6)])


class Branchy(nn.Module):
    """A parameter on an unused branch and one used only when asked: both get no gradient otherwise."""

    def __init__(self):
        super().__init__()
        self.fc, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.ones(8))
        self.use_gate = False

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return h * self.gate if self.use_gate else h


@pytest.mark.parametrize("asynchronous", [True, False])
def test_parameters_without_gradient_keep_grad_none(asynchronous):
    """Unused or off-path parameters keep p.grad None (zeros before), so AdamW's decay and momentum leave
    them alone and training equals PyTorch; a parameter used in a later call of the group gets its grad."""
    layers = [Mlp(), Branchy(), Mlp()]
    ref = reference(layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.5)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
        for _ in range(3):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
            assert layers[1].unused.weight.grad is None and layers[1].gate.grad is None
            model.step(opt, asynchronous=False)
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert max_rel_err(p.detach(), q.detach()) <= 1e-5
        assert torch.equal(layers[1].gate.detach(), torch.ones(8))
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        for m in (layers[1], model.replicas[model.workers[0].name][1].module,
                  model.replicas[model.workers[1].name][1].module):
            m.use_gate = True
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt, asynchronous=asynchronous)   # gradients of the group: gate's from the second call only
        model.synchronize()
        assert not torch.equal(layers[1].gate.detach(), torch.ones(8))


def test_frozen_parameters_cost_no_gradient_buffer():
    """A frozen parameter has no landing buffer, is not downloaded and keeps its value; freezing after
    wrapping takes effect at the next call."""
    layers = mlp(3)
    layers[0][0].weight.requires_grad_(False)
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        st = model.host.layers[0]
        assert st.gbuf[0] is None and st.trainable == [1]
        layers[2][0].bias.requires_grad_(False)                # frozen after wrapping
        w0, b2 = layers[0][0].weight.detach().clone(), layers[2][0].bias.detach().clone()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        for _ in range(2):
            model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8), loss_fn=F.mse_loss)
            model.step(opt, asynchronous=True)
        model.synchronize()
        assert model.host.layers[2].gbuf[1] is None
        assert torch.equal(layers[0][0].weight.detach(), w0) and torch.equal(layers[2][0].bias.detach(), b2)
        assert layers[0][0].weight.grad is None and layers[2][0].bias.grad is None


@pytest.mark.parametrize("how", ["inplace", "data", "load_state_dict", "tie", "after_sync_step"])
def test_edits_of_masters_reach_the_next_call(how):
    """Masters edited between steps (in place, `p.data = t`, by load_state_dict, tied by the user) are what
    the next forward uses (before: the old upload copy was reused until the next step)."""
    layers = mlp(3)
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt, asynchronous=False)
        if how != "after_sync_step":
            model.synchronize()
        w = layers[1][0].weight
        if how == "inplace" or how == "after_sync_step":
            with torch.no_grad():
                w.mul_(0.5)
        elif how == "data":
            w.data = w.data * 0.5
        elif how == "load_state_dict":
            model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
        else:
            with torch.no_grad():
                w.copy_(layers[0][0].weight)
        expected = reference(layers)(x).detach()
        torch.testing.assert_close(model(x), expected)
        loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        torch.testing.assert_close(loss, F.mse_loss(expected, y))


def test_bad_batches_and_labels_are_named():
    """An empty batch, non-tensor labels for a loss_fn and non-scalar or integer losses raise named errors."""
    with rp.RoundPipe(mlp(2), devices=["cpu"] * 2) as model:
        with pytest.raises(ValueError, match="batch is empty"):
            model.forward_backward(torch.randn(0, 8), labels=torch.randn(0, 8), loss_fn=F.mse_loss)
        with pytest.raises(ValueError, match="batch is empty"):
            model(torch.randn(0, 8))
        with pytest.raises(TypeError, match="labels must be a tensor.*got list"):
            model.forward_backward(torch.randn(4, 8), labels=[0, 1, 2, 3], loss_fn=F.cross_entropy)
        with pytest.raises(ValueError, match="labels have batch size 3"):
            model.forward_backward(torch.randn(4, 8), labels=torch.zeros(3, dtype=torch.long),
                                   loss_fn=F.cross_entropy)
        with pytest.raises(TypeError, match="floating scalar loss, got a tensor of shape \\(2, 8\\)"):
            model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8), loss_fn=lambda o, y: o)
        with pytest.raises(TypeError, match="floating scalar loss"):
            model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8),
                                   loss_fn=lambda o, y: (o > 0).sum())
        model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8), loss_fn=F.mse_loss)   # still usable
        model.synchronize()
        assert all(p.grad is not None for p in model.parameters())


def test_ctrl_c_between_registering_and_queuing_a_step_never_hangs(monkeypatch, sigint_raises):
    """A Ctrl-C that lands right after step() registered with the protocol is raised once the step is
    queued: the step runs and later calls go on (before: the step was never queued; the next call hung)."""
    import _thread

    from test_call_sequences import run_with_watchdog
    layers = mlp(3)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        before = [p.detach().clone() for p in model.parameters()]
        registered = model.sync.new_step

        def new_step_then_interrupt(*a, **k):
            rec = registered(*a, **k)
            _thread.interrupt_main()   # pending: raised at the next check, between the two
            return rec
        monkeypatch.setattr(model.sync, "new_step", new_step_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            model.step(opt, asynchronous=True)
        monkeypatch.undo()
        run_with_watchdog(lambda: (model.forward_backward(x, labels=y, loss_fn=F.mse_loss), model.synchronize()),
                          timeout_s=30)
        assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_partial_last_batch_trains_like_pytorch():
    """Batches of 6, 6 and 2 samples with 3 microbatches (the last batch of a DataLoader with
    drop_last=False): the last runs as 2 microbatches, and synchronous training equals PyTorch."""
    torch.manual_seed(0)
    layers = mlp(4)
    ref = reference(layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)) for n in (6, 6, 2)]
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        sync_steps_match(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ref, ref_opt, batches)
    for p, q in zip(torch.nn.Sequential(*layers).parameters(), ref.parameters()):
        assert max_rel_err(p.detach(), q.detach()) <= 1e-5


def assert_grads_equal(model, ref, tol=1e-5):
    _assert_grads_equal(model, ref, tol)
