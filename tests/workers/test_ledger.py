"""The ledger's workspace category on CPU workers: what the layer compute allocates, until it dies.

Workers here record workspace (`CpuWorker.records_workspace`, off by default for its per-op
cost); each test's known temporary dwarfs the rest of its compute, so the peak is compared
with the temporary's size to within a few percent.
"""
import threading

import pytest
import torch
import torch.nn.functional as F
from rp_models import Slow, mlp
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import roundpipe as rp
from roundpipe.testing import inject_delays, random_sleeps

MiB = 1 << 20


def recording(model):
    for w in model.workers:
        w.records_workspace = True
    return model


def workspace_peak(model):
    return max(w.ledger.stats()["peak"]["workspace"] for w in model.workers)


def assert_nothing_live(model, when):
    for w in model.workers:
        cur = w.ledger.stats()["current"]
        assert sum(cur.values()) == 0, (when, w.name, cur)


class Temporary(nn.Module):
    """A residual Linear that also allocates a temporary of `no_grad_bytes` (forward stages) or
    `grad_bytes` (a fused stage's forward, a backward stage's recompute) and drops it."""

    def __init__(self, width, no_grad_bytes, grad_bytes):
        super().__init__()
        self.fc, self.sizes = nn.Linear(width, width), (no_grad_bytes, grad_bytes)

    def forward(self, x):
        n = self.sizes[torch.is_grad_enabled()]
        torch.empty(n // 4).fill_(0.5)
        return x + torch.tanh(self.fc(x))


def temporary_model(width=16):
    """Layer 0 allocates 1 MiB in forward stages and 3 MiB under grad; layers 1-3 nothing large.
    The plan puts layer 0 in a forward and a backward stage only (never in the fused tail)."""
    layers = [Temporary(width, 1 * MiB, 3 * MiB)] + mlp(3, width=width)
    plan = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])
    return layers, plan


@pytest.mark.parametrize("workers", [1, 2])
def test_a_temporary_shows_in_forward_stages_and_in_the_recompute(workers):
    """A layer's 1 MiB temporary in a forward stage and its 3 MiB one in the recompute of a backward
    stage each set the workspace peak to within 3% of their size (before: workspace was not recorded)."""
    torch.manual_seed(0)
    layers, plan = temporary_model()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with recording(rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=2, plan=plan)) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # the first call plans and warms up
        model.wait_calls()
        model.reset_peak_memory()
        with torch.no_grad():
            model(x)
        model.wait_calls()
        assert 1 * MiB <= workspace_peak(model) <= 1.03 * MiB, workspace_peak(model) / MiB
        model.reset_peak_memory()
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.wait_calls()
        assert 3 * MiB <= workspace_peak(model) <= 1.03 * 3 * MiB, workspace_peak(model) / MiB
        assert_nothing_live(model, "after forward_backward")


@pytest.mark.parametrize("workers, num_mb, asynchronous, dtype", [(1, None, False, torch.float32),
                                                                  (2, 5, True, torch.float32),
                                                                  (3, None, True, torch.bfloat16)])
def test_no_workspace_outlives_its_call(workers, num_mb, asynchronous, dtype):
    """Workspace is recorded (peak > 0) and none of it is live after any forward_backward, forward-only
    call or step, with copies delayed at random (bf16 compute included): saved tensors, recomputed
    activations and the gradients autograd wrote all die with their stage, and what the engine does while
    publishing an activation (the recompute check's host clones here) is not workspace."""
    torch.manual_seed(0)
    layers = [Slow(m, 0.001) for m in mlp(6, width=32)]
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    with recording(rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb,
                                compute_dtype=dtype)) as model:
        model._check_recompute = True   # publish keeps host clones of every activation for the call
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        with inject_delays(random_sleeps(0.002, seed=3)):
            for i in range(2):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.wait_calls()
                assert_nothing_live(model, f"after forward_backward {i}")
                model.step(opt, asynchronous=asynchronous)
                model(x)
                model.wait_calls()
                assert_nothing_live(model, f"after forward-only call {i}")
        model.synchronize()
        assert_nothing_live(model, "after synchronize")
        stats = model.memory_stats()["workers"]
        assert all(s["peak"]["workspace"] > 0 for s in stats.values()), stats


class Attention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention with the math backend (scores materialised)."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(width, 3 * width)

    def forward(self, x):   # x: [B, T, C]
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        with sdpa_kernel(SDPBackend.MATH):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # [B, nh, T, hd]
        return x + y.transpose(1, 2).reshape(B, T, C)


def test_attention_scores_show_in_the_workspace():
    """seq 512, 2 heads, one sequence per microbatch: the math backend's [1, 2, 512, 512] fp32 scores
    (2 MiB) are in the workspace peak of the forward stages and of the recompute, while a sequence's
    activation is 32 KiB; nothing is live afterwards."""
    torch.manual_seed(0)
    T, C, heads = 512, 16, 2
    scores = heads * T * T * 4
    layers = [Attention(C, heads) for _ in range(4)]
    plan = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])
    x = torch.randn(2, T, C)
    with recording(rp.RoundPipe(layers, devices=["cpu"], num_microbatches=2, plan=plan)) as model:
        model.forward_backward(x, labels=x, loss_fn=F.mse_loss)
        model.wait_calls()
        model.reset_peak_memory()
        with torch.no_grad():
            model(x)
        model.wait_calls()
        forward_peak = workspace_peak(model)
        # scores, the causal mask applied out of place, the softmax: 2.6x on torch 2.13
        assert scores <= forward_peak <= 4 * scores, forward_peak / scores
        model.reset_peak_memory()
        model.forward_backward(x, labels=x, loss_fn=F.mse_loss)
        model.wait_calls()
        # the fused stage keeps its two layers' softmax outputs for backward
        assert 2 * scores <= workspace_peak(model), workspace_peak(model) / scores
        assert_nothing_live(model, "after forward_backward")


def test_workers_see_only_their_own_compute():
    """Two workers computing side by side (layers sleep outside the turn), whose layers allocate 1 MiB on
    cpu:0 and 3 MiB on cpu:1: each worker's workspace peak is its own temporary, never the other's
    (the dispatch mode is thread-local; backward runs on the worker's thread)."""
    torch.manual_seed(0)

    class PerWorker(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x):
            n = (3 if threading.current_thread().name.endswith("cpu:1") else 1) * MiB
            torch.zeros(n // 4)
            return torch.tanh(self.fc(x))

    layers = [Slow(PerWorker(16), 0.002) for _ in range(8)]
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with recording(rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=4)) as model:
        for _ in range(2):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.wait_calls()
        peaks = {w.name: w.ledger.stats()["peak"]["workspace"] for w in model.workers}
        assert MiB <= peaks["cpu:0"] <= 1.1 * MiB, peaks
        assert 3 * MiB <= peaks["cpu:1"] <= 1.1 * 3 * MiB, peaks
        assert_nothing_live(model, "after forward_backward")


def test_a_storage_is_counted_once_and_moves_to_the_engines_category():
    """Views, in-place results and outputs on storages already registered add nothing; a storage the
    compute made and the engine then keeps (here: as gradients) moves out of workspace, once."""
    from roundpipe.workers.ledger import DeviceLedger, WorkspaceTracker
    ledger = DeviceLedger()
    w = ledger.track(torch.randn(64, 64), "weights")
    with WorkspaceTracker(ledger, "cpu"):
        h = torch.randn(8, 64) @ w              # the randn input (2 KiB, dies at once) and h (2 KiB)
        h.relu_()
        v = h.t()[:10].select(1, 0)
        w.mul_(1.0)
    assert ledger.stats()["current"] == {"weights": 16384, "activations": 0, "gradients": 0, "optimizer": 0, "workspace": 2048}
    ledger.track(h, "gradients")
    assert ledger.stats()["current"] == {"weights": 16384, "activations": 0, "gradients": 2048, "optimizer": 0, "workspace": 0}
    assert ledger.stats()["peak_total"] == 16384 + 4096
    del h, v, w
    assert ledger.live_bytes() == 0
