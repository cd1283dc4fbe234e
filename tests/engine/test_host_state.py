"""Host state: every host buffer comes from the model's arena, returns on close, and a torch fallback."""
import gc

import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS, max_rel_err, reference
from torch import nn

import roundpipe as rp
from roundpipe import _native, testing
from roundpipe.engine.step.host_state import HostState

native = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")


@native
def test_buffers_live_in_the_arena_and_return_on_close():
    """Upload copies, landing buffers and worker staging are arena blocks; close() gives them all back but the
    masters, which are their own upload copies (fp32 compute) and stay with the user's module."""
    torch.manual_seed(0)
    layers = MODELS["residual"]()
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    model = rp.RoundPipe(layers, devices=["cpu", "cpu"], num_microbatches=3)
    arena = model.host.arena
    assert arena is not None and not arena.pinned   # CPU workers: plain memory, same bookkeeping
    st = model.host.layers[0]
    assert all(arena.owns(u) for u in st.upload) and all(g is None for g in st.gbuf)   # landing: made lazily
    params_bytes = sum(p.numel() * 4 for p in model.parameters())
    before = arena.stats().requested_bytes
    assert before == params_bytes   # fp32 upload copies, nothing rounded up
    model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
    model.wait_calls()   # every landing done
    assert arena.stats().num_allocations > 2 * len(list(model.parameters()))   # + landing and staging
    model.synchronize()
    assert all(arena.owns(p.grad) for p in model.parameters())   # the landing buffers became p.grad
    model.close()
    for p in model.parameters():   # p.grad is the user's now (an arena block handed over by the G-copy)
        p.grad = None
    gc.collect()
    arena.synchronize()
    align = arena.config.alignment
    masters = list(model.parameters())
    assert all(arena.owns(p) for p in masters)
    assert arena.stats().in_use_bytes == sum(-(-p.nbytes // align) * align for p in masters)


@native
def test_worker_staging_comes_from_the_arena():
    """A stage output sent to the host lands in an arena tensor."""
    with rp.RoundPipe(MODELS["mlp"](), devices=["cpu"]) as model:
        w = model.workers[0]
        w.copies.inline_bytes = 0
        h = w.send(torch.randn(4, 8), need_host=True, keep_device=False)
        h.host_ready.wait()
        assert model.host.arena.owns(h.host)


def test_alloc_and_staged_copies():
    """alloc gives contiguous host tensors of the asked dtype; staged copies host tensors and passes others."""
    host = HostState([torch.nn.Linear(3, 2)], torch.bfloat16, pinned=False)
    t = host.alloc(torch.Size([5, 3]), torch.float16)
    assert t.shape == (5, 3) and t.dtype == torch.float16 and t.is_contiguous()
    assert host.layers[0].upload[0].dtype == torch.bfloat16
    src = torch.randn(4)
    dup = host.staged(src)
    assert torch.equal(dup, src) and dup.data_ptr() != src.data_ptr()
    assert host.staged("label") == "label"
    host.close()
    assert host.layers[0].upload == [] and host.arena is None


def test_without_native_core_the_engine_still_matches_autograd(monkeypatch):
    """With roundpipe._C reported missing: plain torch buffers, synchronous copies, exact gradients."""
    monkeypatch.setattr(_native, "available", lambda: False)
    torch.manual_seed(1)
    layers = MODELS["mlp"]()
    x, y = torch.randn(7, 8), torch.randn(7, 8)
    ref = reference(layers)
    F.mse_loss(ref(x), y).backward()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        assert model.host.arena is None
        assert not model.workers[0].copies.native
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert max_rel_err(p.grad, q.grad) <= 1e-5


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_arena_grows_for_gradients_before_training_not_during_it(dtype):
    """The first training call reserves room for the gradients before any work (the first asynchronous step
    for the set it holds), so no chunk is added while layers compute and gradients land (before: the first
    gradient downloads added a 64 MiB chunk under the arena's lock on the copy threads, mid-iteration)."""
    torch.manual_seed(0)
    layers = [nn.Linear(2048, 2048) for _ in range(6)]   # 16 MiB of fp32 gradient per layer
    model = rp.RoundPipe(layers, devices=["cpu", "cpu"], num_microbatches=3, compute_dtype=dtype)
    arena = model.host.arena
    seen: list[list[int]] = []   # per call, the arena's chunk count whenever a layer starts computing
    with model, testing.inject_delays(lambda kind: kind == "compute" and seen[-1].append(arena.stats().num_chunks)):
        opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(6, 2048)
        for _ in range(4):
            seen.append([])
            model.forward_backward(x, labels=x, loss_fn=F.mse_loss)
            model.wait_calls()
            model.step(opt, asynchronous=True)   # the first asynchronous one reserves the second gradient set, between calls
        model.synchronize()
        assert all(len(set(s)) == 1 for s in seen), seen   # never grown while a call computes
        assert {s[0] for s in seen[1:]} == {arena.stats().num_chunks}, seen
