"""The optimizer step: synchronous equals PyTorch, asynchronous equals a one-step-late reference."""
import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS, Slow, max_rel_err, reference, sync_steps_match

import roundpipe as rp
from roundpipe.engine.step.async_step import LayerSync
from roundpipe.testing import inject_delays, random_sleeps


def batches(n, batch=6, width=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(n)]


def assert_params_close(model, ref, tol=1e-5):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert max_rel_err(p.detach(), q.detach()) <= tol, (n, max_rel_err(p.detach(), q.detach()))


@pytest.mark.parametrize("fused", [False, True])
def test_synchronous_adamw_matches_pytorch(fused):
    """20 synchronous AdamW steps over 3 workers equal plain PyTorch training (torch's AdamW, or
    roundpipe.optim.AdamW on its per-layer fused path)."""
    layers = MODELS["residual"]()
    ref = reference(layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=5) as model:
        opt = (rp.optim.AdamW if fused else torch.optim.AdamW)(model.parameters(), lr=1e-2)
        sync_steps_match(model, opt, ref, ref_opt, batches(20))
        assert_params_close(model, ref)


def one_step_late_reference(layers, data, lr, opt_class=torch.optim.AdamW):
    """Pure PyTorch: the gradient of iteration t is taken at the weights before step t-1's update."""
    cur = reference(layers)
    opt = opt_class(cur.parameters(), lr=lr)
    stale = copy.deepcopy(cur)
    losses = []
    for x, y in data:
        stale.zero_grad()
        loss = F.mse_loss(stale(x), y)
        loss.backward()
        losses.append(loss.detach())
        for p, q in zip(cur.parameters(), stale.parameters()):
            p.grad = q.grad.clone()
        weights_t = copy.deepcopy(cur.state_dict())
        opt.step()
        opt.zero_grad()
        stale.load_state_dict(weights_t)
    return cur, losses


def run_async(layers, data, lr, workers, num_mb, prefetch=False, make_opt=None):
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb) as model:
        for w in model.workers:
            w.prefetches = prefetch   # the CUDA paths (weight prefetch, early input upload), forced on
        opt = make_opt(model) if make_opt else torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        for x, y in data:
            losses.append(model.forward_backward(x, labels=y, loss_fn=F.mse_loss))
            model.step(opt, asynchronous=True)   # asynchronous
        model.synchronize()
    return losses


@pytest.mark.parametrize("workers, num_mb", [(1, 2), (3, 5), (2, 6)])
def test_asynchronous_is_exactly_one_step_stale(workers, num_mb):
    """Async training equals the one-step-late reference, losses included (several rounds for 2x6)."""
    layers = MODELS["mlp"]()
    data = batches(6)
    ref, ref_losses = one_step_late_reference(layers, data, lr=5e-2)
    losses = run_async(layers, data, 5e-2, workers, num_mb)
    for a, b in zip(losses, ref_losses):
        assert max_rel_err(a, b) <= 1e-5
    assert_params_close(nn_seq(layers), ref)


def nn_seq(layers):
    return torch.nn.Sequential(*layers)


@pytest.mark.parametrize("workers, prefetch", [(3, False), (2, True)])
def test_asynchronous_under_random_delays(workers, prefetch):
    """Random sleeps in copies, the optimizer and layers do not change the one-step-late result."""
    layers = [Slow(m, 0.001) for m in MODELS["mlp"](5)]
    data = batches(5)
    ref, ref_losses = one_step_late_reference(layers, data, lr=5e-2)
    copies, host, opt = random_sleeps(0.002, seed=3), random_sleeps(0.02, seed=4, prob=0.7), random_sleeps(0.06, seed=5)

    def hook(kind):   # the host side slow enough that the next call races it
        {"optimizer": opt, "pcopy": host, "gcopy": host}.get(kind, copies)(kind)
    with inject_delays(hook):
        losses = run_async(layers, data, 5e-2, workers, num_mb=4, prefetch=prefetch)
    for a, b in zip(losses, ref_losses):
        assert max_rel_err(a, b) <= 1e-5
    assert_params_close(nn_seq(layers), ref)


def test_synchronize_makes_the_next_call_fresh():
    """After synchronize() the pending step is applied, so the next call uses the new weights."""
    layers = MODELS["mlp"](3)
    x, y = batches(1)[0]
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt, asynchronous=True)
        model.synchronize()
        out = model(x)
    torch.testing.assert_close(out, reference(layers)(x).detach())


def test_protocol_orders_pcopy_after_next_calls_uploads():
    """A P-copy waits for the next call's uploads of that layer, and the upload after it waits for it."""
    sync = LayerSync(2)
    c1 = sync.begin_call(True, [1, 1])
    assert c1.version == 0
    sync.uploaded(c1, 0, None)
    sync.uploaded(c1, 1, None)
    sync.end_call(c1)
    sync.issue_gcopy()
    rec = sync.new_step(asynchronous=True)
    assert rec.readers_left == 1 and not sync._gate(rec, 0)   # call 2 has not started yet
    c2 = sync.begin_call(True, [2, 1])
    assert c2.version == 0                                    # call 2 may read the old weights
    assert sync.upload_ready(c2, 0)
    sync.uploaded(c2, 1, None)
    assert sync._gate(rec, 1) and not sync._gate(rec, 0)
    sync.uploaded(c2, 0, None)
    sync.uploaded(c2, 0, None)
    assert sync._gate(rec, 0)
    sync.end_call(c2)
    c3 = sync.begin_call(True, [1, 1])
    assert c3.version == 1                                    # call 3 must see step 1's weights
    assert not sync.upload_ready(c3, 0)
    sync.layers_done([0], consumed=False, pcopied=True)
    assert sync.upload_ready(c3, 0) and not sync.upload_ready(c3, 1)


def test_protocol_with_two_calls_in_flight():
    """Call t still draining (its backward uploads of layer 0 not issued) while call t+1 runs: step t's
    update of layer 0 waits for both calls' uploads, a G-copy waits for call t's end, and call t+1
    lands gradients only after call t ended."""
    sync = LayerSync(2)
    t = sync.begin_call(True, [2, 2])
    for l in (0, 1):
        sync.uploaded(t, l, None)            # forwards of call t
    sync.uploaded(t, 1, None)                # call t's fused tail; its backward of layer 0 still to come
    _, calls = sync.issue_gcopy()
    assert calls == [t]
    rec = sync.new_step(asynchronous=True)
    t1 = sync.begin_call(True, [2, 2])       # the next call starts while t drains
    assert t1.version == 0 and sync.active == [t, t1]
    for l in (0, 1):
        sync.uploaded(t1, l, None)
        sync.uploaded(t1, l, None)
    assert sync._gate(rec, 1) and not sync._gate(rec, 0)     # t's backward still reads W_0 of layer 0
    landed = threading.Event()

    def land_t1():
        sync.wait_grad_write(t1, 0, 0)
        landed.set()
    th = threading.Thread(target=land_t1, daemon=True)
    th.start()
    waiter = threading.Thread(target=sync.wait_calls, args=(calls,), daemon=True)
    waiter.start()
    time.sleep(0.1)
    assert not landed.is_set() and waiter.is_alive()         # both wait for call t's end
    sync.uploaded(t, 0, None)
    assert sync._gate(rec, 0)
    sync.end_call(t)
    waiter.join(5)
    assert not waiter.is_alive()
    time.sleep(0.1)
    assert not landed.is_set()                               # and for the G-copy issued before t+1
    sync.gcopy_done([0])
    th.join(5)
    assert landed.is_set()
    sync.end_call(t1)


def test_protocol_window_is_the_accumulation_group():
    """With k calls per step, the next k calls read the old weights; a flush or the next step closes it."""
    sync = LayerSync(1)
    for _ in range(3):
        c = sync.begin_call(True, [1])
        assert c.version == 0
        sync.end_call(c)
    rec = sync.new_step(asynchronous=True)
    assert rec.readers_left == 3
    for _ in range(2):
        c = sync.begin_call(True, [1])
        assert c.version == 0
        sync.end_call(c)
    assert not sync._gate(rec, 0)
    sync.flush()                                             # e.g. synchronize(): the window closes
    assert sync._gate(rec, 0)
    c = sync.begin_call(True, [1])
    assert c.version == 1
    sync.end_call(c)
    assert sync.new_step(asynchronous=False).readers_left == 0   # a synchronous step opens no window


def test_optimizer_error_surfaces_at_the_next_call():
    """An exception inside an asynchronous step reaches the caller at its next call, with its type."""
    layers = MODELS["mlp"](3)
    x, y = batches(1)[0]

    def bad_step():
        raise FloatingPointError("non-finite gradient")
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(bad_step, asynchronous=True)
        with pytest.raises(FloatingPointError, match="non-finite"):
            model.synchronize()
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # usable afterwards
        model.step(torch.optim.SGD(model.parameters(), lr=0.1), asynchronous=False)


class LayerwiseSGD:
    """A per-layer optimizer in the shape of the fused-step seam: update masters, write upload copies (None: the
    master is its own)."""

    def __init__(self, lr):
        self.lr = lr

    def step_layer(self, params, upload):
        for p, u in zip(params, upload):
            if p.grad is not None:
                p.sub_(self.lr * p.grad)
            if u is not None:
                u.copy_(p)


def test_per_layer_optimizer_seam_is_one_step_stale():
    """A step_layer optimizer runs through the per-layer gates and matches one-step-late SGD."""
    layers = [Slow(m, 0.001) for m in MODELS["mlp"](4)]
    data = batches(4)
    ref, ref_losses = one_step_late_reference(layers, data, 0.1, torch.optim.SGD)
    losses = run_async(layers, data, 0.1, workers=2, num_mb=3, make_opt=lambda model: LayerwiseSGD(0.1))
    for a, b in zip(losses, ref_losses):
        assert max_rel_err(a, b) <= 1e-5
    assert_params_close(nn_seq(layers), ref)


def test_gradient_accumulation_is_one_step_stale():
    """With k calls per step, every call of a group sees the weights from before the previous step."""
    layers = MODELS["mlp"](4)
    data = batches(8)
    k = 2
    cur, stale = reference(layers), reference(layers)
    opt = torch.optim.AdamW(cur.parameters(), lr=5e-2)
    ref_losses = []
    for g in range(0, len(data), k):
        stale.zero_grad()
        for x, y in data[g:g + k]:
            loss = F.mse_loss(stale(x), y)
            loss.backward()
            ref_losses.append(loss.detach())
        for p, q in zip(cur.parameters(), stale.parameters()):
            p.grad = q.grad.clone()
        stale.load_state_dict(cur.state_dict())
        opt.step()
        opt.zero_grad()
    with rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=3) as model:
        ropt = torch.optim.AdamW(model.parameters(), lr=5e-2)
        losses = []
        for i, (x, y) in enumerate(data):
            losses.append(model.forward_backward(x, labels=y, loss_fn=F.mse_loss))
            if i % k == k - 1:
                model.step(ropt, asynchronous=True)
        model.synchronize()
    for a, b in zip(losses, ref_losses):
        assert max_rel_err(a, b) <= 1e-5
    assert_params_close(nn_seq(layers), cur)


@pytest.mark.parametrize("workers", [1, 3])
def test_fused_adamw_async_under_delays_is_one_step_stale(workers):
    """The fused per-layer step under random host/copy delays equals the torch one-step-late reference."""
    layers = [Slow(m, 0.001) for m in MODELS["mlp"](5)]
    data = batches(5)
    ref, ref_losses = one_step_late_reference(layers, data, lr=5e-2)
    copies, host, opt = random_sleeps(0.002, seed=6), random_sleeps(0.02, seed=7, prob=0.7), random_sleeps(0.05, seed=8)

    def hook(kind):
        {"optimizer": opt, "pcopy": host, "gcopy": host}.get(kind, copies)(kind)
    with inject_delays(hook):
        losses = run_async(layers, data, 5e-2, workers, num_mb=4,
                           make_opt=lambda m: rp.optim.AdamW(m.parameters(), lr=5e-2))
    for a, b in zip(losses, ref_losses):
        assert max_rel_err(a, b) <= 1e-5
    assert_params_close(nn_seq(layers), ref)


def fit_calls(model, opt, plan, asynchronous=True, seed=2):
    """Runs `plan`: a list of groups, each a list of 'fb' (training call) and 'eval' entries, a step after each."""
    g = torch.Generator().manual_seed(seed)
    for group in plan:
        for op in group:
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            if op == "fb":
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            else:
                model(x)
        model.step(opt, asynchronous=asynchronous)
    model.synchronize()


@pytest.mark.parametrize("case, num_mb, plan", [
    ("three calls per step", None, [["fb"] * 3] * 3),
    ("two calls of several rounds", 7, [["fb"] * 2] * 3),
    ("accumulation with an eval call", None, [["fb", "fb", "eval", "fb"]] * 3),
])
def test_fused_adamw_async_loops_do_not_deadlock(case, num_mb, plan):
    """Gradient accumulation, multi-round calls and eval calls between steps finish with the fused async step
    (each hung before: the step gate, the pending uploads and the G-copy waited on each other)."""
    from test_call_sequences import run_with_watchdog

    def run():
        with rp.RoundPipe(MODELS["mlp"](4), devices=["cpu"] * 2, num_microbatches=num_mb) as model:
            fit_calls(model, rp.optim.AdamW(model.parameters(), lr=1e-2), plan)
    run_with_watchdog(run, timeout_s=30)


def test_gradient_copy_error_reaches_the_caller(monkeypatch):
    """An exception while a layer's landed gradients are copied into p.grad (the G-copy thread) reaches the caller,
    once, and the thread still counts every layer, so nothing waits forever (before: the remaining layers were
    never counted and the next step hung)."""
    from roundpipe.engine.step.host_state import HostState
    layers = MODELS["mlp"](4)
    x, y = batches(1)[0]
    real = HostState.gcopy

    def failing(self, layer):
        if layer == 2:
            raise MemoryError("injected: gradient copy of layer 2")
        return real(self, layer)
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
        monkeypatch.setattr(HostState, "gcopy", failing)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        with pytest.raises(MemoryError, match="layer 2"):
            model.step(opt, asynchronous=True)
            model.synchronize()
        monkeypatch.setattr(HostState, "gcopy", real)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # usable afterwards
        model.step(opt, asynchronous=False)


class _CountingCondition(threading.Condition):
    def __init__(self):
        super().__init__()
        self.notified = 0

    def notify_all(self):
        self.notified += 1
        super().notify_all()


def _wakeups_per_step(num_layers: int) -> int:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(num_layers)]
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=1) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
        model.forward_backward(x, labels=y, loss_fn=torch.nn.functional.mse_loss)
        model.step(opt, asynchronous=False)
        model.sync.cv = cv = _CountingCondition()   # nothing waits between a synchronous step and the next call
        model.forward_backward(x, labels=y, loss_fn=torch.nn.functional.mse_loss)
        model.step(opt, asynchronous=False)
        return cv.notified


def test_a_stages_landings_and_a_gcopy_epoch_wake_the_waiters_once():
    """Every notify_all of the one condition wakes every waiting engine thread (a thread switch each,
    taken from compute on a small machine): a stage's gradient landings and a G-copy epoch's layers
    now wake them once each, not once per layer.  Per added layer of a synchronous step, what is
    left is its upload, its gradients consumed and its P-copy (before: also its landing and G-copy)."""
    per_layer = (_wakeups_per_step(12) - _wakeups_per_step(4)) / 8
    assert per_layer <= 3


@pytest.mark.parametrize("master_dtype, clip", [(torch.float32, None), (torch.float32, 0.5), (torch.bfloat16, None)])
def test_layers_ready_together_step_in_one_pass_bit_for_bit(monkeypatch, master_dtype, clip):
    """A synchronous step finds every layer's gate open and gradients in: one step_layer pass updates
    them all (one native call instead of one per layer), and the weights equal per-layer passes' bit
    for bit, with clipping and with stochastically rounded bf16 masters (keys are per parameter)."""
    import roundpipe.engine.step.optimizer_step as optimizer_step
    from roundpipe.optim.base import FusedOptimizer

    def train(batched: bool) -> tuple[list[torch.Tensor], int]:
        calls = []
        real = FusedOptimizer.step_layer
        monkeypatch.setattr(FusedOptimizer, "step_layer", lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
        make = optimizer_step.make_step
        if not batched:
            def per_layer(*a, **k):
                fns = make(*a, **k)
                fns.update_many = None
                return fns
            monkeypatch.setattr("roundpipe.engine.model_steps.make_step", per_layer)
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(5)]
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=1, master_dtype=master_dtype) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            for _ in range(3):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=False, max_grad_norm=clip)
            weights = [p.detach().clone() for p in model.parameters()]
        monkeypatch.undo()
        return weights, len(calls)

    per_layer, per_layer_calls = train(batched=False)
    batched, batched_calls = train(batched=True)
    assert all(torch.equal(a, b) for a, b in zip(per_layer, batched))
    assert per_layer_calls == 3 * 5 and batched_calls < per_layer_calls


def test_a_sole_cpu_workers_synchronous_step_runs_on_its_thread(monkeypatch):
    """A sole CPU worker's thread runs a synchronous step (its OpenMP team is warm; the step thread's
    own would compete with it for the cores), handed over and waited for by the step thread, so steps
    stay in order and an error still reaches step(); an asynchronous step stays on the step thread."""
    from roundpipe.optim.base import FusedOptimizer
    threads = []
    real = FusedOptimizer.step_layer

    def recording(self, *a, **k):
        threads.append(threading.current_thread().name)
        if getattr(self, "fail", False):
            raise RuntimeError("step failed on purpose")
        return real(self, *a, **k)
    monkeypatch.setattr(FusedOptimizer, "step_layer", recording)
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with rp.RoundPipe([torch.nn.Linear(8, 8) for _ in range(3)], devices=["cpu"], num_microbatches=1) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
        for asynchronous in (True, False, True, False):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        runs = [t for i, t in enumerate(threads) if i == 0 or threads[i - 1] != t]   # consecutive runs, in order
        assert runs == ["roundpipe-step", "roundpipe-cpu:0"] * 2
        opt.fail = True
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        with pytest.raises(RuntimeError, match="on purpose"):
            model.step(opt, asynchronous=False)
    with rp.RoundPipe([torch.nn.Linear(8, 8) for _ in range(2)], devices=["cpu", "cpu"]) as model:
        threads.clear()
        opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt, asynchronous=False)
        assert set(threads) == {"roundpipe-step"}
