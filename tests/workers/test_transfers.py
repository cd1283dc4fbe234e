"""Worker copy queues: bulk windows ride behind activation copies, flushes, byte-exact data, late copies."""
import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import roundpipe as rp
from roundpipe import _native, testing
from roundpipe.workers.transfers import Transfers

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")


def bulk_tensors(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(n, generator=g) for n in sizes]
    return [torch.empty_like(s) for s in srcs], srcs


def test_windows_go_out_behind_activation_copies():
    """A 3-window bulk sends nothing until activation copies of its direction, one window behind each."""
    tr = Transfers(torch.device("cpu"))
    dsts, srcs = bulk_tensors([3000, 1000, 700, 5])
    b = tr.bulk("param_up", dsts, srcs, 3)
    assert b.fences == [] and not b.sent.is_set()
    tr.activation("act_down", [torch.empty(4)], [torch.ones(4)])   # other direction: releases nothing
    assert b.fences == []
    for k in range(1, 3):
        x = torch.empty(16)
        tr.activation("act_up", [x], [torch.full((16,), float(k))])
        assert len(b.fences) == k
    tr.flush()
    assert len(b.fences) == 3 and b.sent.is_set()
    tr.wait(b)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_a_wait_sends_every_download_and_one_upload_window():
    """Before a worker blocks: every held-back download goes (the wait may be for its landing: a layer's
    buffers from the previous round hung a 1-worker, 5-microbatch HF model when only one went), and one
    upload window, not all of them in front of the activation copy that ends the wait."""
    tr = Transfers(torch.device("cpu"))
    up = tr.bulk("param_up", *bulk_tensors([300, 200, 100, 50]), 4)
    down = tr.bulk("grad_down", *bulk_tensors([64, 64, 64]), 3)
    tr.before_wait()
    assert len(up.fences) == 1 and len(down.fences) == 3 and down.sent.is_set()
    tr.before_wait()
    assert len(up.fences) == 2
    tr.activation("act_up", [torch.empty(4)], [torch.ones(4)])   # the wait ended: the next one rides behind it
    assert len(up.fences) == 3
    tr.synchronize()
    assert up.sent.is_set()


def test_window_order_in_the_engine():
    """In the engine, window k starts only after activation copy k, and the data arrive intact."""
    tr = Transfers(torch.device("cpu"))
    tr.engine.pause()
    dsts, srcs = bulk_tensors([4096, 4096, 2048, 2048])
    b = tr.bulk("grad_down", dsts, srcs, 3)
    for _ in range(3):
        tr.activation("act_down", [torch.empty(8)], [torch.zeros(8)])
    tr.engine.resume()
    tr.wait(b)
    order = [q for q, _ in tr.engine.history()]
    assert sorted(order) == ["act_down"] * 3 + ["grad_down"] * 3
    for k, i in enumerate(i for i, q in enumerate(order) if q == "grad_down"):
        assert order[:i].count("act_down") >= k + 1, order   # window k started after activation k
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_single_window_and_empty_bulk_go_at_once():
    """windows=1 (weights needed now) is sent immediately; an empty bulk counts as sent."""
    tr = Transfers(torch.device("cpu"))
    dsts, srcs = bulk_tensors([100, 33])
    b = tr.bulk("param_up", dsts, srcs, 1)
    assert len(b.fences) == 1
    tr.wait(b)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert tr.bulk("grad_down", [], [], 4).sent.is_set()


def test_wait_sent_blocks_until_an_activation_releases_the_windows():
    """A completion thread waiting for a held-back bulk is woken by the activation copies that send it."""
    tr = Transfers(torch.device("cpu"))
    dsts, srcs = bulk_tensors([64, 64])
    b = tr.bulk("grad_down", dsts, srcs, 2)
    got = []
    waiter = threading.Thread(target=lambda: got.append(len(Transfers.wait_sent(b))))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()
    tr.activation("act_down", [torch.empty(2)], [torch.ones(2)])
    tr.activation("act_down", [torch.empty(2)], [torch.ones(2)])
    waiter.join(2)
    assert got == [2]
    tr.synchronize()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_delay_hook_holds_copies_back():
    """Under inject_delays a copy completes only after the hook returns, while its issuer goes on."""
    release = threading.Event()
    tr = Transfers(torch.device("cpu"))
    dst, src = torch.zeros(1000), torch.arange(1000.0)
    with testing.inject_delays(lambda kind: release.wait(5)):
        fence = tr.activation("act_up", [dst], [src])
        assert fence.state == "pending" and not torch.equal(dst, src)
        release.set()
        fence.wait()
    assert torch.equal(dst, src)


def test_without_native_core_copies_are_synchronous(monkeypatch):
    """Without roundpipe._C the queues copy at once with torch and every fence is None."""
    monkeypatch.setattr(_native, "available", lambda: False)
    tr = Transfers(torch.device("cpu"))
    dsts, srcs = bulk_tensors([10, 20])
    b = tr.bulk("param_up", dsts, srcs, 3)
    assert b.fences == [None] and all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    x = torch.empty(3)
    assert tr.activation("act_up", [x], [torch.ones(3)]) is None and torch.equal(x, torch.ones(3))


def test_activation_uploads_read_only_staging_blocks():
    """Call inputs, labels (non-contiguous ones too) and stage outputs reach the act_up queue only as
    contiguous blocks of the model's arena: on a GPU a copy from pageable memory is synchronous, and
    a temporary made under the queues' lock stalls every copy (before: labels went as they were
    and non-contiguous inputs were copied inside Transfers.act)."""
    import torch.nn.functional as F
    from rp_models import mlp

    import roundpipe as rp

    with rp.RoundPipe(mlp(4), devices=["cpu"] * 2, num_microbatches=2) as model:
        seen = []
        for w in model.workers:
            act = w.copies.activation

            def record(queue, dsts, srcs, after=(), act=act):
                if queue == "act_up":
                    seen.extend(srcs)
                return act(queue, dsts, srcs, after)
            w.copies.activation = record
        x = torch.randn(8, 4).t()            # [4, 8], non-contiguous
        y = torch.randn(4, 8)[:, ::2].repeat(1, 2)   # contiguous, but the caller's own memory
        assert not x.is_contiguous()
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert seen and all(t.is_contiguous() and model.host.arena.owns(t) for t in seen)


@pytest.mark.timeout(60)
def test_buffers_of_a_round_land_while_gradient_windows_are_held_back():
    """One worker, several rounds, a layer with buffers and gradient downloads big enough to be
    windowed: round 1 waits for round 0's buffers, whose landing is queued behind round 0's held-back
    gradient windows; the wait must send them (it hung when a wait sent one window per direction)."""
    import torch.nn.functional as F
    from rp_models import Mlp, RunningMean

    import roundpipe as rp

    width = 160   # 100 KB of weight gradients per Linear: above the 64 KiB inline copies, so windowed
    layers = [Mlp(width), RunningMean(width), Mlp(width)]
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=5) as model:
        for _ in range(2):
            model.forward_backward(torch.randn(10, width), labels=torch.randn(10, width), loss_fn=F.mse_loss)
        model.synchronize()
        assert int(layers[1].calls) == 10   # every microbatch's forward updated the buffer once


@pytest.mark.skipif(not _native.available(), reason="needs the native core's arena")
def test_buffers_are_uploaded_from_the_arena():
    """Module buffers (BatchNorm statistics, HF inv_freq) are uploaded from arena blocks, like the weights'
    upload copies (on a GPU: pinned, so the copy is asynchronous; before: from the module's pageable buffers,
    which makes every stage with buffers synchronise its copy stream), and still train like PyTorch."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)) for _ in range(3)]
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    F.mse_loss(ref(x), y).backward()
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=1) as model:
        sources, uploaded = [], []
        w = model.workers[0]
        bulk, upload_buffers = w.copies.bulk, w.upload_buffers

        def spy(queue, dsts, srcs, *a, **k):
            if queue == "param_up":
                sources.extend(srcs)
            return bulk(queue, dsts, srcs, *a, **k)

        def spy_buffers(host):
            uploaded.extend(host)
            return upload_buffers(host)
        w.copies.bulk, w.upload_buffers = spy, spy_buffers
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        # every stage uploads its layers' written buffers (3 layers x 2 statistics; num_batches_tracked too),
        # from snapshots in arena blocks (batchnorm.buffers_snapshot), never from the buffers themselves
        assert len(uploaded) >= len(buffers) == 6
        assert not {b.data_ptr() for b in buffers} & {u.data_ptr() for u in uploaded}
        assert all(model.host.owns(s) for s in sources + uploaded)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for b, c in zip(model.buffers(), ref.buffers()):
            torch.testing.assert_close(b, c)


class _Head(torch.nn.Module):
    """32 MiB of bf16 weights reading 8 rows of its input: large inputs, small outputs."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4096, 4096)

    def forward(self, x):
        return self.fc(x[:8].to(self.fc.weight.dtype))


@pytest.mark.cuda
def test_reserved_gpu_memory_follows_the_ledger():
    """Every device buffer of a CUDA worker comes from its compute stream's pool: after forward-only calls
    whose 256 MiB inputs were uploaded, training (64 MiB stages, their gradients) reuses those blocks, and
    reserved memory stays near the most ever live at once (before: uploads were allocated on their copy
    streams, whose cached blocks no other stream reuses, so reserved grew to the sum of the pools' peaks)."""
    mib = 1 << 20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    layers = [_Head()] + [torch.nn.Linear(4096, 4096) for _ in range(3)]
    plan = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])
    with rp.RoundPipe(layers, devices=["cuda:0"], num_microbatches=2, plan=plan) as model:
        for _ in range(2):
            model(torch.randn(32768, 4096))
        for _ in range(3):
            model.forward_backward(torch.randn(8, 4096), labels=torch.randn(8, 4096),
                                   loss_fn=lambda o, t: F.mse_loss(o.float(), t))
        model.synchronize()
        ledger = model.workers[0].ledger.stats()["peak_total"]
        peak = torch.cuda.max_memory_allocated() - base
        reserved = torch.cuda.memory_reserved() - base
        assert ledger <= peak, (ledger / mib, peak / mib)
        assert reserved <= 1.1 * peak + 16 * mib, (reserved / mib, peak / mib, ledger / mib)


def test_next_input_upload_is_issued_before_the_current_compute(monkeypatch):
    """With prefetching on, microbatch m+1's input upload is issued before m's compute (CUDA: its buffer's
    allocation fence then covers compute up to m-1 only, so the copy overlaps m's compute; issued after,
    it would wait for m's compute to finish), and m's own first."""
    from roundpipe.engine.calls import stage

    order = []
    real_early, real_forward = stage.StageRun.upload_input_early, stage.StageRun.forward

    def early(self, m):
        order.append((self.task.label, "up", m))
        return real_early(self, m)

    def forward(self, m):
        order.append((self.task.label, "compute", m))
        return real_forward(self, m)
    monkeypatch.setattr(stage.StageRun, "upload_input_early", early)
    monkeypatch.setattr(stage.StageRun, "forward", forward)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    plan = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=3, microbatches_per_round=3, plan=plan) as model:
        for w in model.workers:
            w.prefetches = True
        model(torch.randn(6, 8))
    f = [(kind, m) for label, kind, m in order if label.startswith("F")]
    assert f[:2] == [("up", 0), ("up", 1)] and f.index(("up", 2)) < f.index(("compute", 1)), f


def test_urgent_bulk_is_copied_on_the_issuing_thread():
    """A bulk the issuer waits for next (urgent) is copied inline whatever its size on a host engine
    that copies inline: a copy thread would only add two hand-offs.  Not under the delay hook, and
    never on an engine without inline copies (CUDA: inline_bytes 0)."""
    tr = Transfers(torch.device("cpu"), inline_bytes=64 << 10)
    dsts, srcs = bulk_tensors([1 << 18, 1 << 17])                       # 1.5 MiB, far above inline_bytes
    b = tr.bulk("param_up", dsts, srcs, 1, urgent=True)
    assert b.fences == [None] and all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert tr.engine.history() == []
    dsts, srcs = bulk_tensors([1 << 18], seed=1)
    tr.wait(tr.bulk("param_up", dsts, srcs, 1))                          # not urgent: the copy thread
    assert [q for q, _ in tr.engine.history()] == ["param_up"]
    threaded = Transfers(torch.device("cpu"))                            # inline_bytes 0: never inline
    dsts, srcs = bulk_tensors([1 << 10], seed=2)
    b = threaded.bulk("grad_down", dsts, srcs, 1, urgent=True)
    threaded.wait(b)
    assert b.fences[0] is not None and [q for q, _ in threaded.engine.history()] == ["grad_down"]


def test_one_cpu_worker_uploads_and_downloads_a_stage_inline():
    """A CPU worker waits for a stage's weights right after issuing their upload (it prefetches none),
    and its last stage's gradients end its part of the call: both are copied on the worker thread (two
    thread hand-offs fewer each).  An earlier stage's gradients still leave through the copy thread,
    overlapping the next stage's compute."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(128, 128) for _ in range(4)]             # 66 KiB each, above inline_copy_bytes
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(8, 128), torch.randn(8, 128)
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=1) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert model.workers[0].copies.engine.history() == []
        F.mse_loss(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    with rp.RoundPipe(copy.deepcopy(layers), devices=["cpu"], num_microbatches=2,
                      plan=rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert [q for q, _ in model.workers[0].copies.engine.history()] == ["grad_down"] * 2   # stage 1's 2 windows


def test_copy_many_copies_every_pair_in_one_pass():
    """The native multi-copy behind inline bulk copies: every pair byte for byte, ranges split across
    threads inside tensors, zero-byte entries, and clear errors for mismatched lists, null addresses
    and overlapping buffers."""
    C = _native.lib
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=g) for n in (1 << 18, 3, 0, 1 << 17, 70001)]
    dsts = [torch.empty_like(s) for s in srcs]
    C.copy_many([d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs], [s.nbytes for s in srcs])
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    with pytest.raises(ValueError, match="same length"):
        C.copy_many([dsts[0].data_ptr()], [], [4])
    with pytest.raises(ValueError, match="null pointer"):
        C.copy_many([0], [srcs[0].data_ptr()], [4])
    buf = torch.zeros(64)
    with pytest.raises(ValueError, match="separate source and destination"):
        C.copy_many([buf.data_ptr()], [buf.data_ptr() + 16], [128])
    assert torch.equal(buf, torch.zeros(64))


def test_inline_copies_of_mixed_pairs():
    """An inline bulk with pairs copy_many cannot take (dtype change, a strided view) copies those with
    torch and the rest natively, each right."""
    tr = Transfers(torch.device("cpu"), inline_bytes=64 << 10)
    base = torch.randn(64, 64)
    srcs = [torch.randn(1000), torch.randn(500), base.t(), torch.randn(300, dtype=torch.float64)]
    dsts = [torch.empty(1000), torch.empty(500), torch.empty(64, 64), torch.empty(300, dtype=torch.float32)]
    b = tr.bulk("grad_down", dsts, srcs, 1, urgent=True)
    assert b.fences == [None]
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.to(d.dtype))
