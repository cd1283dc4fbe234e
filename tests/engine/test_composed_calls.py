"""model(x) as a node of the caller's autograd graph: gradients as nn.Sequential's, inputs' included."""
import copy

import pytest
import torch
import torch.nn.functional as F
from rp_models import (
    MODELS,
    RunningMean,
    Slow,
    ToTuple,
    TupleToDict,
    buffered,
    max_rel_err,
    mlp,
    ref_forward,
    reference,
)
from rp_models import assert_grads_equal as _assert_grads_equal
from torch import nn

import roundpipe as rp

PLANS = {   # for 5 layers: everything fused; forward stages and recomputing backward stages, cut apart
    "fused": rp.Plan(forward=[], backward=[range(0, 5)]),
    "recompute": rp.Plan(forward=[range(0, 3)], backward=[range(3, 5), range(1, 3), range(0, 1)]),
}


@pytest.mark.parametrize("name", ["mlp", "nested", "residual"])
@pytest.mark.parametrize("workers, mbs, plan", [(1, 1, "fused"), (2, 3, "recompute"), (3, 4, "recompute")])
def test_backward_through_the_output_lands_pytorch_gradients(name, workers, mbs, plan):
    """loss = f(model(x), other); loss.backward() gives every p.grad of an nn.Sequential (fp32, 1e-6
    relative), over workers, uneven microbatches and recomputing stages."""
    torch.manual_seed(workers)
    layers = MODELS[name]()[:5] if name != "residual" else MODELS[name](5)
    ref = reference(layers)
    x, other = torch.randn(11, 8), torch.randn(11, 8)
    kw = {"scale": 0.5} if name == "nested" else {}
    (ref_forward(ref, x, **kw) * other).sin().sum().backward()
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=mbs, plan=PLANS[plan]) as model:
        out = model(x, **kw)
        assert out.requires_grad and out.device.type == "cpu"
        torch.testing.assert_close(out.detach(), ref_forward(ref, x, **kw).detach())
        (out * other).sin().sum().backward()
        model.synchronize()
        assert_grads_equal(model, ref)


def test_input_gradients_and_two_chained_models():
    """b(a(x)) backpropagates through both models into x, as two nn.Sequentials do; an input passed
    whole to every microbatch (a 0-dim scale) gets the sum of its microbatches' gradients."""
    torch.manual_seed(7)
    first = [ToTuple(), TupleToDict(), MODELS["nested"]()[2]]
    second = [Slow(m, 0.0005) for m in mlp(4)]
    ref_a, ref_b = reference(first), reference(second)
    x, scale = torch.randn(9, 8, requires_grad=True), torch.tensor(0.7, requires_grad=True)
    rx, rscale = x.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_()
    F.mse_loss(ref_b(ref_forward(ref_a, rx, scale=rscale)), torch.ones(9, 8)).backward()
    with rp.RoundPipe(first, devices=["cpu"] * 2, num_microbatches=3) as a, \
            rp.RoundPipe(second, devices=["cpu"] * 3, num_microbatches=4,
                         plan=rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])) as b:
        F.mse_loss(b(a(x, scale=scale)), torch.ones(9, 8)).backward()
        a.synchronize()
        b.synchronize()
        assert_grads_equal(a, ref_a)
        assert_grads_equal(b, ref_b)
    assert max_rel_err(x.grad, rx.grad) <= 1e-6
    assert max_rel_err(scale.grad, rscale.grad) <= 1e-6


def test_nested_outputs_connect_every_floating_leaf():
    """A dict output: each floating leaf is in the graph, an integer leaf is returned as it is."""
    torch.manual_seed(8)
    layers = [ToTuple(), TupleToDict()]
    ref = reference(layers)
    x = torch.randn(7, 8)
    d = ref_forward(ref, x, scale=2.0)
    (d["h"].pow(2).sum() + d["g"].mean()).backward()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        out = model(x, scale=2.0)
        assert out["h"].requires_grad and out["g"].requires_grad and not out["ids"].requires_grad
        assert torch.equal(out["ids"], torch.arange(7) - torch.tensor([0, 0, 0, 3, 3, 5, 5]))  # per microbatch
        (out["h"].pow(2).sum() + out["g"].mean()).backward()
        model.synchronize()
        assert_grads_equal(model, ref)


def test_an_unused_output_leaf_seeds_nothing():
    """Only out["h"] in the loss: the layer feeding only out["g"] gets no gradient, as in PyTorch."""
    torch.manual_seed(14)
    layers = [ToTuple(), TupleToDict()]
    ref = reference(layers)
    x = torch.randn(6, 8)
    ref_forward(ref, x)["h"].sum().backward()
    assert ref[1].b.weight.grad is None
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=2) as model:
        model(x)["h"].sum().backward()
        model.synchronize()
        assert layers[1].b.weight.grad is None and layers[1].b.bias.grad is None
        for name in ("0.fc.weight", "1.a.weight", "1.a.bias"):
            p, q = model.module.get_parameter(name), ref.get_parameter(name)
            assert max_rel_err(p.grad, q.grad) <= 1e-6, name


def test_dropout_masks_repeat_in_the_backward():
    """With dropout, the composed backward's gradients equal forward_backward's on the same seed: the
    backward call recomputes the forward's masks."""
    def layers():
        torch.manual_seed(9)
        return [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh()) for _ in range(4)]
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    grads = []
    for composed in (True, False):
        with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3,
                          plan=rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])) as model:
            torch.manual_seed(10)
            if composed:
                F.mse_loss(model(x), y).backward()
            else:
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
            grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert max_rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("asynchronous", [False, True])
def test_training_with_composed_calls_matches_pytorch(asynchronous):
    """Steps after composed backwards apply their gradients (both step modes); a step that mixes a
    forward_backward and a composed call accumulates both, as two backward() calls do."""
    torch.manual_seed(11)
    layers = mlp(5)
    ref = reference(layers)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    batches = [(torch.randn(6, 8), torch.randn(6, 8)) for _ in range(4)]
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i, (x, y) in enumerate(batches):
            (model(x) - y).pow(2).mean().backward()
            (ref(x) - y).pow(2).mean().backward()
            if i % 2:   # and a fast-path call in the same step
                model.forward_backward(y, labels=x, loss_fn=F.l1_loss)
                F.l1_loss(ref(y), x).backward()
            model.step(opt, asynchronous=asynchronous)
            ref_opt.step()
            ref_opt.zero_grad()
        model.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert max_rel_err(p, q) <= 1e-5


def test_buffers_update_once_per_composed_call():
    """The forward call updates buffers once per microbatch; the backward call's forwards do not again."""
    torch.manual_seed(12)
    layers = buffered()
    ref = reference(layers)
    x = torch.randn(8, 8)
    for xm in x.split(2):
        ref(xm).sum().backward()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=4) as model:
        model(x).sum().backward()
        model.synchronize()
        assert int(layers[1].calls) == 4
        for (n, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
            torch.testing.assert_close(b, rb, msg=n)
        assert_grads_equal(model, ref)


def test_forward_only_uses_stay_forward_only():
    """Under no_grad, in eval() without inputs that require grad, or with every parameter frozen, model(x)
    builds no graph and runs no training call."""
    layers = [RunningMean()] + mlp(2)
    x = torch.randn(4, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        kinds = []
        model.stage_timing = lambda w, kind, *rest: kinds.append(kind)
        with torch.no_grad():
            assert not model(x).requires_grad
        model.eval()
        assert not model(x).requires_grad
        model.train()
        for p in model.parameters():
            p.requires_grad_(False)
        out = model(x)
        assert not out.requires_grad
        assert set(kinds) == {"F"}
        assert model(x.requires_grad_()).requires_grad   # an input that requires grad: composed again
        model.eval()
        assert model(x).requires_grad


def test_frozen_model_passes_the_input_gradient():
    """A frozen model in eval() still backpropagates to an input that requires grad, landing no p.grad."""
    torch.manual_seed(13)
    layers = mlp(3)
    ref = copy.deepcopy(nn.Sequential(*layers))
    x = torch.randn(5, 8, requires_grad=True)
    rx = x.detach().clone().requires_grad_()
    ref(rx).pow(2).sum().backward()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=2) as model:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        model(x).pow(2).sum().backward()
        model.synchronize()
        assert all(p.grad is None for p in model.parameters())
    assert max_rel_err(x.grad, rx.grad) <= 1e-6


def test_backward_after_a_step_and_split_fn_with_input_grads_are_refused():
    """A backward after step() is a RuntimeError (its weights changed); inputs that require grad with a
    custom split_fn are a ValueError; the model stays usable."""
    x = torch.randn(4, 8)
    with rp.RoundPipe(mlp(2), devices=["cpu"]) as model:
        out = model(x)
        model.step(lambda: None, asynchronous=False)
        with pytest.raises(RuntimeError, match="after a step"):
            out.sum().backward()
        model(x).sum().backward()
        model.synchronize()
        assert all(p.grad is not None for p in model.parameters())

    def halves(args, kwargs, labels, n):
        return [((a,), kwargs, labels) for a in args[0].chunk(2)]
    with rp.RoundPipe(mlp(2), devices=["cpu"], split_fn=halves) as model:
        with pytest.raises(ValueError, match="split_fn"):
            model(x.clone().requires_grad_())
        assert model(x).requires_grad


def assert_grads_equal(model, ref, tol=1e-6):
    _assert_grads_equal(model, ref, tol)
