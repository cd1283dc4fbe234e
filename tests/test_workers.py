"""Workers: device parsing, low-precision compute with fp32 accumulation, and the CUDA worker."""
import copy

import pytest
import torch
import torch.nn.functional as F

import roundpipe as rp
from rp_models import MODELS, max_rel_err, reference
from roundpipe.workers import make_workers, parse_devices


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
                model.step(opt)
            model.synchronize()
            return losses, [p.detach().clone() for p in model.parameters()]
    (la, pa), (lb, pb) = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
