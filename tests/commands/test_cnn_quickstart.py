"""The CNN quick start (examples/cnn_quickstart.py) runs on CPU workers, and its ResNet-18-shaped
layers train through RoundPipe as they do in plain PyTorch over the same microbatches."""
import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import roundpipe as rp
from roundpipe.models.resnet import resnet18_layers, synthetic_cifar

ROOT = Path(__file__).resolve().parents[2]


def test_quick_start_learns():
    spec = importlib.util.spec_from_file_location("cnn_quickstart", ROOT / "examples" / "cnn_quickstart.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--width", "8", "--steps", "12", "--batch-size", "16"])
    assert out["losses"][-1] < 0.75 * out["losses"][0] and out["accuracy"] > 0.3   # chance: 0.1


def test_resnet_layers_match_pytorch_over_the_same_microbatches():
    """Loss, gradients and BatchNorm running statistics equal plain PyTorch run microbatch by
    microbatch (each microbatch normalised with its own statistics, running stats updated per
    microbatch: the default; docs/semantics.md)."""
    layers = resnet18_layers(width=4)
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    x, y = synthetic_cifar(6, seed=3)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        loss = model.forward_backward(x, labels=y, loss_fn=F.cross_entropy)
        model.synchronize()
        total = 0.0
        for xm, ym in zip(x.chunk(3), y.chunk(3)):
            lm = F.cross_entropy(ref(xm), ym) * (len(xm) / len(x))
            lm.backward()
            total += float(lm.detach())
        assert loss.item() == pytest.approx(total, rel=1e-5)
        for (name, p), q in zip(torch.nn.Sequential(*layers).named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        for (name, b), c in zip(torch.nn.Sequential(*layers).named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="width=0"):
        resnet18_layers(width=0)
    with pytest.raises(ValueError, match="n=0"):
        synthetic_cifar(0)
