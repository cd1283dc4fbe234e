"""Uploads of a base mapped from its files (issue 51, item 3): a frozen weight outside the pinned arena is staged
into an arena block by a host copy thread before its upload, never handed to an asynchronous copy as it is (on
a GPU that copy is synchronous with the worker's thread, which then issues no compute while it runs)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from rp_models import max_rel_err
from torch import nn

import roundpipe as rp
from roundpipe import _native
from roundpipe.engine.step.host_state import FILE_BACKED
from roundpipe.workers import strict

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")


def mapped_layers(tmp_path, n=4, width=16):
    """n Linear layers whose weights are frozen and mapped privately from a file (as rp.hf.mapped maps a base),
    each followed by a trainable Linear."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh(), nn.Linear(width, width)) for _ in range(n)]
    for i, layer in enumerate(layers):
        w = layer[0].weight.detach()
        path = tmp_path / f"w{i}.bin"
        path.write_bytes(w.numpy().tobytes())
        data = torch.empty(0, dtype=torch.uint8)
        data.set_(torch.UntypedStorage.from_file(str(path), shared=False, nbytes=w.numel() * w.element_size()))
        p = nn.Parameter(data.view(w.dtype).view(w.shape), requires_grad=False)
        setattr(p, FILE_BACKED, True)
        layer[0].weight = p
    return layers


@pytest.mark.parametrize("workers", [1, 2])
def test_a_mapped_base_is_staged_before_its_upload(tmp_path, workers):
    """Under the strict device model (tests/engine/conftest.py), which fails a copy given pageable host memory,
    a model over a mapped frozen base trains with gradients equal to plain PyTorch's; every worker staged its
    mapped uploads (before: PageableCopyError from the first stage's upload)."""
    assert strict.current() is not None
    layers = mapped_layers(tmp_path)
    ref = nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(6, 16), torch.randn(6, 16)
    F.mse_loss(ref(x), y).backward()
    plan = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=2, plan=plan) as model:
        assert all(w.stages_pageable for w in model.workers)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert all(w._stager is not None for w in model.workers)
        grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()) if p.requires_grad]
    assert grads and max(max_rel_err(a, b) for a, b in grads) <= 1e-5
    assert getattr(layers[0][0].weight, FILE_BACKED) and not layers[0][0].weight.requires_grad


def test_the_strict_model_refuses_a_pageable_copy(tmp_path):
    """A copy queue given host memory outside the arena fails at once, naming the copy (a GPU would copy it
    synchronously); the fast model copies it."""
    layers = mapped_layers(tmp_path, n=1)
    with rp.RoundPipe(layers, devices=["cpu"]) as model:
        w = model.workers[0]
        src = layers[0][0].weight.detach()
        dst = w._empty(src.shape, src.dtype, "param_up")
        with pytest.raises(strict.PageableCopyError, match="weight upload.*outside the pinned arena"):
            w.copies.bulk("param_up", [dst], [src], 1)
