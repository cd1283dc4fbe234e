"""Workers: device parsing, copies that compute waits for, windows, low precision, and the CUDA worker."""
import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS, max_rel_err, reference

import roundpipe as rp
from roundpipe import _native, testing
from roundpipe.workers import Handoff, make_workers, parse_devices


def test_same_device_twice_gives_two_workers():
    """Listing a device twice gives two workers with distinct names."""
    workers = make_workers(parse_devices(["cpu", "cpu"]), torch.float32)
    try:
        assert [w.name for w in workers] == ["cpu:0", "cpu:1"]
    finally:
        for w in workers:
            w.close()


def test_device_list_errors():
    """A bare string, an unknown type and a mixed pool are rejected with the offending entry."""
    with pytest.raises(TypeError, match="wrap it in a list"):
        parse_devices("cpu")
    with pytest.raises(ValueError, match="'meta'"):
        parse_devices(["meta"])
    with pytest.raises(ValueError, match="not a device name"):
        parse_devices(["gpu0"])


def low_precision_errors(layers, devices, dtype, x, y):
    """Max relative gradient error of the engine in `dtype` and of plain PyTorch in `dtype`, vs fp32."""
    dev = torch.device(devices[0])
    ref32 = reference(layers).to(dev)
    F.mse_loss(ref32(x.to(dev)), y.to(dev)).backward()
    ref_lp = copy.deepcopy(ref32).to(dtype)
    ref_lp.zero_grad()
    F.mse_loss(ref_lp(x.to(dev, dtype)).float(), y.to(dev)).backward()
    with rp.RoundPipe(layers, devices=devices, num_microbatches=3, compute_dtype=dtype) as model:
        model.forward_backward(x, labels=y, loss_fn=lambda o, t: F.mse_loss(o.float(), t))
        model.synchronize()
        ours = max(max_rel_err(p.grad, q.grad.cpu()) for p, q in zip(model.parameters(), ref32.parameters()))
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    torchs = max(max_rel_err(p.grad.float().cpu(), q.grad.cpu()) for p, q in zip(ref_lp.parameters(), ref32.parameters()))
    return ours, torchs


def test_bf16_compute_on_cpu_workers():
    """bf16 compute with fp32 accumulation stays within ~2x PyTorch's own bf16 error."""
    torch.manual_seed(0)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    ours, torchs = low_precision_errors(MODELS["residual"](), ["cpu", "cpu"], torch.bfloat16, x, y)
    assert ours <= 2 * torchs + 1e-2, (ours, torchs)


native = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")


@pytest.fixture
def worker():
    w = make_workers(parse_devices(["cpu"]), torch.float32)[0]
    w.copies.inline_bytes = 0   # every copy through the memcpy threads
    yield w
    w.close()


@native
def test_cpu_worker_compute_waits_for_a_late_activation_copy(worker):
    """use() returns an uploaded input only after its (held back) copy completed, with the right values."""
    release = threading.Event()
    src = torch.arange(12.0).reshape(3, 4)
    with testing.inject_delays(lambda kind: release.wait(5)):
        arrival = worker.receive(Handoff(host=(src, {"n": 3})))
        assert arrival.fences[0].state == "pending"
        threading.Timer(0.05, release.set).start()
        x, extra = worker.use(arrival)
    assert torch.equal(x, src) and x.data_ptr() != src.data_ptr() and extra == {"n": 3}


@native
def test_param_windows_ride_behind_input_uploads(worker):
    """A prefetched stage's weights go out one LPT window per input upload; params_ready sends the rest."""
    host = [[torch.randn(64, 64), torch.randn(64)], [torch.randn(32, 64)]]
    up = worker.upload_params(host, windows=3)
    assert up.bulk.fences == []
    worker.use(worker.receive(Handoff(host=torch.randn(2, 4))))
    assert len(up.bulk.fences) == 1
    params = worker.params_ready(up)
    assert len(up.bulk.fences) == 3
    assert all(torch.equal(d, h) for dl, hl in zip(params, host) for d, h in zip(dl, hl))
    worker.upload_done(up)()


@native
def test_gradients_land_after_the_held_back_windows_are_sent(worker):
    """A windowed gradient download lands on the completion thread once activation downloads, waits
    (one window each) and the drain send it."""
    grads = [torch.randn(100), None, torch.randn(7, 3)]
    landed = []
    worker.download_grads(grads, 2, landed.append)
    worker.send(torch.randn(5), need_host=True, keep_device=False)   # releases window 0
    time.sleep(0.05)
    assert landed == []
    worker.before_wait()   # window 1 of 2: all sent
    worker.drain()
    (host,) = landed
    assert host[1] is None and torch.equal(host[0], grads[0]) and torch.equal(host[2], grads[2])


cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0"]])
def test_cuda_fp32_matches_autograd(devices):
    """fp32 on one GPU, and on the same GPU listed twice, equals CPU autograd."""
    torch.manual_seed(0)
    layers = MODELS["nested"]()
    x, y = torch.randn(9, 8), torch.randn(9, 8)
    ref = reference(layers)
    F.mse_loss(ref[2:](ref[1](ref[0](x, scale=0.5))), y).backward()
    with rp.RoundPipe(layers, devices=devices, num_microbatches=5, compute_dtype=torch.float32) as model:
        loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss, scale=0.5)
        model.synchronize()
        assert loss.device.type == "cpu"
        for p, q in zip(model.parameters(), ref.parameters()):
            assert max_rel_err(p.grad, q.grad) <= 1e-4
        out = model(x, scale=0.5)
    assert out.device.type == "cpu"


@cuda
@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0"]])
def test_cuda_bf16_within_bf16_tolerance(devices):
    """Default bf16 compute on the GPU stays within ~2x PyTorch's bf16 error against fp32."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    layers = MODELS["residual"](6, 64)
    ours, torchs = low_precision_errors(layers, devices, torch.bfloat16, x, y)
    assert ours <= 2 * torchs + 1e-2, (ours, torchs)


@cuda
def test_cuda_async_and_dropout_recompute():
    """On the same GPU twice: dropout recompute is exact and async training is reproducible."""
    def run():
        torch.manual_seed(3)
        layers = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.2)) for _ in range(6)]
        model = rp.RoundPipe(layers, devices=["cuda:0", "cuda:0"], compute_dtype=torch.float32, num_microbatches=4)
        model._check_recompute = True
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        with model:
            for _ in range(3):
                losses.append(model.forward_backward(torch.randn(8, 32), labels=torch.randn(8, 32),
                                                     loss_fn=F.mse_loss))
                model.step(opt, asynchronous=True)
            model.synchronize()
            return losses, [p.detach().clone() for p in model.parameters()]
    (la, pa), (lb, pb) = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


@native
@pytest.mark.parametrize("slow", ["param_up", "grad_down", "act_up", "act_down"])
def test_slow_copies_keep_async_training_one_step_stale(slow):
    """One copy queue held back 15 ms per copy while the host is fast: no P-copy, G-copy or compute runs ahead of it."""
    from test_async_step import assert_params_close, batches, nn_seq, one_step_late_reference, run_async
    layers = MODELS["mlp"](4)
    data = batches(4)
    ref, ref_losses = one_step_late_reference(layers, data, lr=5e-2)
    with testing.inject_delays(lambda kind: time.sleep(0.015) if kind == slow else None):
        losses = run_async(layers, data, 5e-2, 2, 3, prefetch=True)
    for a, b in zip(losses, ref_losses):
        assert max_rel_err(a, b) <= 1e-5
    assert_params_close(nn_seq(layers), ref)


@cuda
def test_cuda_stage_timing_reports_gpu_time_and_pinned_arena():
    """On a GPU: host buffers are pinned arena blocks, and stage_timing reports event-measured GPU time."""
    class Spin(torch.nn.Module):   # ~1 ms of GPU time whose launch costs the host almost nothing
        def forward(self, x):
            if x.is_cuda:
                torch.cuda._sleep(2_000_000)
            return x * 1.0

    layers = [torch.nn.Linear(16, 16), Spin(), torch.nn.Linear(16, 16), Spin()]
    with rp.RoundPipe(layers, devices=["cuda:0"], num_microbatches=2, compute_dtype=torch.float32) as model:
        assert model.host.arena is not None and model.host.arena.pinned
        assert model.host.layers[0].upload[0].is_pinned()
        timings = []
        model.stage_timing = lambda *a: timings.append(a)
        x = torch.randn(4, 16)
        model.forward_backward(x, labels=x, loss_fn=F.mse_loss)
        model.synchronize()
    assert timings and all(t1 > t0 for *_, t0, t1 in timings)
    spans = sorted(t1 - t0 for *_, t0, t1 in timings)
    assert spans[-1] >= 2e-4, spans    # a stage with a Spin layer: GPU time, not the microseconds of issuing it


@native
@pytest.mark.parametrize("model_name, workers, num_mb", [("nested", 3, 5), ("residual", 2, 4), ("buffered", 1, 3)])
def test_engine_path_end_to_end_matches_autograd(model_name, workers, num_mb):
    """Every copy through the memcpy threads, prefetch and windows on: gradients equal plain autograd."""
    torch.manual_seed(0)
    layers = MODELS[model_name]()
    x, y = torch.randn(7, 8), torch.randn(7, 8)
    ref = reference(layers)
    kwargs = {"scale": 0.5} if model_name == "nested" else {}
    F.mse_loss(ref[2:](ref[1](ref[0](x, **kwargs))) if kwargs else ref(x), y).backward()
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb) as model:
        for w in model.workers:
            w.copies.inline_bytes, w.prefetches = 0, True
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss, **kwargs)
        model.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert max_rel_err(p.grad, q.grad) <= 1e-5


def test_turn_is_exclusive_and_given_back_around_waits():
    """The CPU workers' turn: one holder; yielded() frees it for the body and takes it back after."""
    from roundpipe.workers.cpu import Turn
    turn, order = Turn(), []
    inside = threading.Event()

    def other():
        with turn.held():
            order.append("other")
            inside.set()

    with turn.held():
        t = threading.Thread(target=other)
        t.start()
        assert not inside.wait(0.05)           # held: the other thread waits
        with turn.yielded():
            assert inside.wait(5)              # given back: it ran
        order.append("back")
    t.join(5)
    assert order == ["other", "back"]
    with turn.yielded():                       # not the holder: a no-op
        pass
    with turn.held():
        pass


class Meeting:
    """Where threads meet inside a long compute (a wait that releases the interpreter lock, like a long matmul).

    Once `parties` threads have each arrived at least once, the next arrival of each waits there (once, up to
    `timeout_s`) until `parties` threads are inside together; the first arrivals do not wait, since the first
    compute may be what the others depend on.  Whether they met is an ordering, not a timing: an engine that
    serialises the compute keeps the others out while one waits, however loaded the machine."""

    def __init__(self, parties: int = 2, timeout_s: float = 10.0):
        self.parties, self.timeout_s = parties, timeout_s
        self.cond = threading.Condition()
        self.inside: list = []     # thread ids inside now
        self.seen: set = set()     # thread ids that arrived
        self.waited: set = set()   # thread ids that waited (once each)
        self.met = False

    def _together(self) -> bool:
        self.met = self.met or len(set(self.inside)) >= self.parties
        return self.met

    def __enter__(self):
        me = threading.get_ident()
        with self.cond:
            self.inside.append(me)
            self.seen.add(me)
            self.cond.notify_all()
            if len(self.seen) >= self.parties and me not in self.waited:
                self.waited.add(me)
                self.cond.wait_for(self._together, self.timeout_s)
            self._together()

    def __exit__(self, *exc):
        with self.cond:
            self.inside.remove(threading.get_ident())


class Sleeper(torch.nn.Module):
    """Its backward is a long compute: it sleeps (at least LONG_COMPUTE_S, interpreter lock released, like a long
    matmul) inside `meeting`."""
    meeting = Meeting()

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    @staticmethod
    def _slow(grad):
        with Sleeper.meeting:
            time.sleep(0.005)

    def forward(self, x):
        y = self.fc(x)
        if y.requires_grad:
            y.register_hook(self._slow)
        return y


def test_long_backward_compute_of_cpu_workers_overlaps():
    """Two CPU workers computing long backwards run them at the same time (outside their turns).

    Forward and recompute compute of CPU workers is serialised anyway: they share the CPU
    generator, whose lock makes reseeding and running a stage atomic (roundpipe/workers/rng.py)."""
    Sleeper.meeting = Meeting()
    plan = rp.Plan(forward=[range(0, 1), range(1, 2)], backward=[range(2, 3), range(1, 2), range(0, 1)])
    with rp.RoundPipe([Sleeper() for _ in range(3)], devices=["cpu", "cpu"], num_microbatches=4,
                      plan=plan) as model:
        model.forward_backward(torch.randn(8, 4), labels=torch.randn(8, 4), loss_fn=F.mse_loss)
    assert len(Sleeper.meeting.seen) == 2
    assert Sleeper.meeting.met, "the two workers never computed at the same time"


@pytest.mark.cuda
def test_gpu_inputs_are_read_after_the_callers_stream_produced_them():
    """An input made on the caller's (side) stream right before the call is read only after that stream's
    work: the worker's compute stream waits for an event recorded at the call's start.  The producer is
    non-blocking (a device-to-device copy behind a GPU sleep), so the call starts while it is still queued
    (before: a blocking copy from pageable memory, done before the call began, so nothing was waited for)."""
    layers = [torch.nn.Linear(64, 64) for _ in range(3)]
    ref = torch.nn.Sequential(*[copy.deepcopy(l) for l in layers])
    x_cpu = torch.randn(8, 64)
    with rp.RoundPipe(layers, devices=["cuda:0"], compute_dtype=torch.float32) as model:
        for training in (False, True):
            src, y = x_cpu.to("cuda:0"), torch.zeros(8, 64, device="cuda:0")
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                x = torch.zeros(8, 64, device="cuda:0")
                torch.cuda._sleep(200_000_000)   # ~0.1 s of GPU time before the value lands
                x.copy_(src, non_blocking=True)  # device to device: queued, the host goes on
                assert not side.query(), "the producer finished before the call: nothing would be waited for"
                if training:
                    model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                else:
                    out = model(x)
            if training:
                model.synchronize()
                F.mse_loss(ref(x_cpu), y.cpu()).backward()
                for p, q in zip(model.parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            else:
                torch.testing.assert_close(out.cpu(), ref(x_cpu).detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_critical_streams_have_the_highest_priority():
    """Compute and activation copy streams run at the device's highest priority, bulk copies at the default."""
    from roundpipe.workers.cuda import CudaWorker
    w = CudaWorker(torch.device("cuda:0"), "cuda:0", torch.bfloat16)
    try:
        low, high = torch.cuda.Stream.priority_range()
        for s in (w.s_compute, w.s_act_up, w.s_act_down):
            assert s.priority == min(low, high)
        assert w.s_param_up.priority == 0 and w.s_grad_down.priority == 0
    finally:
        w.close()
