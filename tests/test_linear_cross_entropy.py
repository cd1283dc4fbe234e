"""Chunked linear cross-entropy against the fp32 reference: loss, gradients, peak memory."""
import pytest
import torch
import torch.nn.functional as F
from _kernel_util import LOW_PRECISION, assert_within_torch_error, leaf
from torch.profiler import ProfilerActivity, profile

from roundpipe.kernels import LinearCrossEntropyLoss, linear_cross_entropy
from roundpipe.kernels.linear_cross_entropy import linear_cross_entropy_ref

IGNORE = -100


def _labels(T, V, ignored: str):
    labels = torch.randint(0, V, (T,))
    if ignored == "some":
        labels[torch.rand(T) < 0.3] = IGNORE
        labels[0] = IGNORE
    elif ignored == "all":
        labels[:] = IGNORE
    return labels


def _run(fn, h, w, labels, reduction, dtype=None, **kw):
    """Loss and (dh, dw) of fn with an upstream gradient of 0.5 (or a fixed vector for 'none')."""
    h, w = leaf(h, dtype), leaf(w, dtype)
    loss = fn(h, w, labels, IGNORE, reduction, **kw)
    seed = torch.linspace(-1, 2, loss.numel()).view(loss.shape) if reduction == "none" else torch.tensor(0.5)
    loss.backward(seed)
    return loss, h.grad, w.grad


@pytest.mark.parametrize("T,H,V,chunk", [(1, 123, 1000, None), (37, 64, 2053, 8), (9, 3000, 1000, 4),
                                         (16, 123, 2053, None)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
def test_fp32_matches_reference(T, H, V, chunk, reduction, ignored):
    """fp32 loss, dhidden and dweight match the reference's autograd for every reduction and ignore pattern."""
    h, w = torch.randn(T, H), torch.randn(V, H) / H ** 0.5
    labels = _labels(T, V, ignored)
    ours = _run(linear_cross_entropy, h, w, labels, reduction, chunk_size=chunk)
    ref = _run(linear_cross_entropy_ref, h, w, labels, reduction)
    for name, a, b in zip(["loss", "dhidden", "dweight"], ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=name)
    if ignored == "all":
        assert float(ours[0].detach().abs().sum()) == 0.0 and float(ours[1].abs().sum()) == 0.0


def test_matches_torch_cross_entropy():
    """With some labels ignored the mean equals F.cross_entropy on full logits (batched [B, S] input)."""
    h, w = torch.randn(2, 11, 123), torch.randn(1000, 123) / 11
    labels = _labels(22, 1000, "some").view(2, 11)
    expect = F.cross_entropy((h @ w.t()).view(-1, 1000), labels.view(-1), ignore_index=IGNORE)
    torch.testing.assert_close(linear_cross_entropy(h, w, labels), expect, rtol=1e-5, atol=1e-6)
    assert linear_cross_entropy(h, w, labels, reduction="none").shape == (2, 11)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_within_twice_torch_error(dtype):
    """fp16/bf16 loss and gradients are at most ~2x as far from fp32 as eager PyTorch (bf16 logits, fp32 CE)."""
    T, H, V = 24, 123, 2053
    h, w = torch.randn(T, H), torch.randn(V, H) / H ** 0.5
    labels = _labels(T, V, "some")

    def eager(hh, ww, lab, ignore_index, reduction):
        return F.cross_entropy((hh @ ww.t()).float(), lab, ignore_index=ignore_index, reduction=reduction)

    ref = _run(linear_cross_entropy_ref, h, w, labels, "mean")
    ours = _run(linear_cross_entropy, h, w, labels, "mean", dtype, chunk_size=8)
    theirs = _run(eager, h, w, labels, "mean", dtype)
    for name, a, b, r in zip(["loss", "dhidden", "dweight"], ours, theirs, ref):
        assert_within_torch_error(f"{dtype} {name}", a.float(), b.float(), r, atol=1e-4)


def _peak_bytes(fn) -> int:
    """Peak live bytes of CPU tensors allocated while fn runs, from the profiler's allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_peak_memory_is_order_chunk_times_vocab():
    """Forward+backward allocate about chunk x V + gradients, far below T x V; the naive path exceeds T x V."""
    T, H, V, chunk = 1024, 16, 2053, 32
    h = torch.randn(T, H, requires_grad=True)
    w = (torch.randn(V, H) / 4).requires_grad_(True)
    labels = _labels(T, V, "some")

    def step(fn, **kw):
        fn(h, w, labels, IGNORE, "mean", **kw).backward()
        h.grad = w.grad = None

    logits_bytes = T * V * 4
    ours = _peak_bytes(lambda: step(linear_cross_entropy, chunk_size=chunk))
    naive = _peak_bytes(lambda: step(linear_cross_entropy_ref))
    grads_bytes = (T * H + V * H) * 4
    assert naive >= logits_bytes, f"the measurement misses the naive path's logits ({naive} bytes)"
    # One logits chunk, the two gradient buffers and their scaled copies, the [T] loss: no T x V term.
    assert ours <= 2 * chunk * V * 4 + 2 * grads_bytes + 16 * T + 65536, (ours, chunk * V * 4, logits_bytes)
    assert ours < logits_bytes / 4


def test_strided_hidden():
    """A non-contiguous hidden (a transposed buffer) gives the reference loss and gradients."""
    h, w = torch.randn(64, 19), torch.randn(1000, 64) / 8
    labels = _labels(19, 1000, "some")
    ours = _run(linear_cross_entropy, h.t(), w, labels, "sum", chunk_size=4)
    ref = _run(linear_cross_entropy_ref, h.t(), w, labels, "sum")
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_no_grad_and_module():
    """Without autograd the loss alone is computed; the module forwards its options."""
    h, w = torch.randn(5, 64), torch.randn(1000, 64)
    labels = _labels(5, 1000, "none")
    with torch.no_grad():
        got = linear_cross_entropy(h.requires_grad_(), w, labels, reduction="sum")
    assert not got.requires_grad
    torch.testing.assert_close(got, linear_cross_entropy_ref(h, w, labels, reduction="sum"))
    module = LinearCrossEntropyLoss(reduction="none", chunk_size=2)
    torch.testing.assert_close(module(h, w, labels), linear_cross_entropy_ref(h, w, labels, reduction="none"))


def test_bad_arguments_name_the_argument():
    """Out-of-range labels, shape mismatches and bad options raise errors naming them."""
    h, w = torch.randn(3, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="labels contain 10"):
        linear_cross_entropy(h, w, torch.tensor([1, 10, IGNORE]))
    with pytest.raises(ValueError, match="labels.shape"):
        linear_cross_entropy(h, w, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="weight.shape"):
        linear_cross_entropy(h, torch.randn(10, 7), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="reduction"):
        LinearCrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, torch.tensor([1, 2, 3]), chunk_size=0)
    with pytest.raises(TypeError, match="labels"):
        linear_cross_entropy(h, w, torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.cuda
def test_cuda_compiled_matches_reference_and_saves_memory():
    """On a GPU: bf16 loss/gradients close to fp32, and peak memory far below eager at T=4096, V=151936."""
    T, H, V = 4096, 1024, 151936
    h = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda") / 32).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::7] = IGNORE
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(h, w, labels)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < T * V * 2 / 2, f"extra {extra / 2**20:.0f} MiB vs bf16 logits {T * V * 2 / 2**20:.0f} MiB"
    ref = linear_cross_entropy_ref(h.detach()[:512], w.detach(), labels[:512])
    loss_512 = linear_cross_entropy(h.detach()[:512], w.detach(), labels[:512])
    torch.testing.assert_close(loss_512, ref, rtol=1e-2, atol=1e-2)
    assert torch.isfinite(h.grad.float()).all() and torch.isfinite(w.grad.float()).all()
