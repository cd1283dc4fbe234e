"""Per-call options of RoundPipe calls: return_outputs=, several losses from loss_fn, num_microbatches=."""
import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS, max_rel_err, mlp, ref_forward, reference
from rp_models import assert_grads_equal as _assert_grads_equal
from torch import nn

import roundpipe as rp


def test_return_outputs_gives_the_forward_output_and_unchanged_gradients():
    """(loss, outputs): outputs equal model(x) (nested layer kwargs, uneven microbatches), detached, on the
    CPU; the loss and the gradients are those of the plain call."""
    torch.manual_seed(0)
    layers = MODELS["nested"]()
    ref = reference(layers)
    x, y = torch.randn(11, 8), torch.randn(11, 8)
    loss_ref = F.mse_loss(ref_forward(ref, x, scale=0.5), y)
    loss_ref.backward()
    with rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=4) as model:
        loss, out = model.forward_backward(x, labels=y, loss_fn=F.mse_loss, return_outputs=True, scale=0.5)
        model.synchronize()
        assert loss.shape == () and max_rel_err(loss, loss_ref.detach()) <= 1e-6
        assert not out.requires_grad and out.device.type == "cpu"
        torch.testing.assert_close(out, ref_forward(ref, x, scale=0.5).detach())
        assert_grads_equal(model, ref)
        plain = model.forward_backward(x, labels=y, loss_fn=F.mse_loss, scale=0.5)
        assert isinstance(plain, torch.Tensor) and plain.shape == ()   # the plain call is unchanged


def test_tuple_loss_optimizes_the_first_entry_and_reduces_the_others_like_the_loss():
    """A tuple's first entry is the loss; the others come back detached, each the weighted sum over
    microbatches (batch means for means, over uneven microbatches), and do not change the gradients."""
    torch.manual_seed(1)
    layers = mlp(4)
    ref = reference(layers)
    x, y = torch.randn(11, 8), torch.randn(11, 8)
    out_ref = ref(x)
    F.mse_loss(out_ref, y).backward()

    def loss_fn(o, t):
        return F.mse_loss(o, t), F.l1_loss(o, t), o.mean(0)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=4) as model:
        loss, extras = model.forward_backward(x, labels=y, loss_fn=loss_fn)
        model.synchronize()
        assert isinstance(extras, tuple) and len(extras) == 2
        assert all(not e.requires_grad and e.dtype == torch.float32 for e in extras)
        torch.testing.assert_close(loss, F.mse_loss(out_ref, y).detach())
        torch.testing.assert_close(extras[0], F.l1_loss(out_ref, y).detach())
        torch.testing.assert_close(extras[1], out_ref.mean(0).detach())
        assert_grads_equal(model, ref)


@pytest.mark.parametrize("key", ["loss", "first"])
def test_dict_loss_uses_its_loss_entry_else_its_first(key):
    """A dict optimizes its "loss" entry (else its first key); the rest come back as a dict in order; with
    return_outputs=True the result is (loss, extras, outputs)."""
    torch.manual_seed(2)
    layers = mlp(3)
    ref = reference(layers)
    x, y = torch.randn(7, 8), torch.randn(7, 8)
    out_ref = ref(x)
    F.mse_loss(out_ref, y).backward()
    if key == "loss":
        def loss_fn(o, t):
            return {"l1": F.l1_loss(o, t), "loss": F.mse_loss(o, t), "peak": o.abs().amax()}
    else:
        def loss_fn(o, t):
            return {"mse": F.mse_loss(o, t), "l1": F.l1_loss(o, t), "peak": o.abs().amax()}
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=1) as model:
        loss, extras, out = model.forward_backward(x, labels=y, loss_fn=loss_fn, return_outputs=True)
        model.synchronize()
        assert list(extras) == ["l1", "peak"]
        torch.testing.assert_close(loss, F.mse_loss(out_ref, y).detach())
        torch.testing.assert_close(extras["l1"], F.l1_loss(out_ref, y).detach())
        torch.testing.assert_close(extras["peak"], out_ref.abs().amax().detach())
        torch.testing.assert_close(out, out_ref.detach())
        assert_grads_equal(model, ref)


def test_extras_are_summed_with_sum_reduction():
    """With loss_reduction="sum" every entry is added over the microbatches as it is."""
    layers = mlp(2)
    x = torch.randn(6, 8)
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=3, loss_reduction="sum") as model:
        loss, (count,) = model.forward_backward(x, labels=x, loss_fn=lambda o, t: (o.sum(), torch.tensor(o.shape[0])))
    assert count.item() == 6.0 and count.dtype == torch.float32
    torch.testing.assert_close(loss, reference(layers)(x).sum().detach())


def test_bad_loss_entries_fail_the_call_and_leave_no_gradient():
    """A non-tensor entry or entries that change between microbatches are a TypeError naming loss_fn;
    the call then had no effect and the model stays usable; a non-bool return_outputs is a TypeError."""
    layers = mlp(2)
    x = torch.randn(5, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=2) as model:
        with pytest.raises(TypeError, match="entry 'acc' is a float"):
            model.forward_backward(x, labels=x, loss_fn=lambda o, t: {"loss": F.mse_loss(o, t), "acc": 0.5})
        with pytest.raises(TypeError, match="same shapes"):   # per-sample values: sizes 3 and 2
            model.forward_backward(x, labels=x, loss_fn=lambda o, t: (F.mse_loss(o, t), o.sum(1)))
        with pytest.raises(TypeError, match="return_outputs must be True or False"):
            model.forward_backward(x, labels=x, loss_fn=F.mse_loss, return_outputs="yes")
        model.synchronize()
        assert all(p.grad is None for p in model.parameters())
        loss, extras = model.forward_backward(x, labels=x, loss_fn=lambda o, t: (F.mse_loss(o, t),))
        assert extras == () and loss.shape == ()


@pytest.mark.parametrize("count", [1, 3, 5])
def test_per_call_microbatch_count_equals_the_configured_model(count):
    """forward_backward(..., num_microbatches=k) and model(x, num_microbatches=k) give what a model built
    with num_microbatches=k gives (dropout masks included); the call really ran k microbatches."""
    def layers():
        torch.manual_seed(3)
        return [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Tanh()) for _ in range(4)]
    x, y = torch.randn(9, 8), torch.randn(9, 8)
    results = []
    for per_call in (True, False):
        with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=None if per_call else count) as model:
            seen = []
            model.stage_timing = lambda w, kind, first, m, t0, t1: seen.append(m)
            kw = {"num_microbatches": count} if per_call else {}
            torch.manual_seed(4)
            loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss, **kw)
            model.synchronize()
            with torch.no_grad():
                torch.manual_seed(5)
                out = model(x, **kw)
            assert sorted(set(seen)) == list(range(count))
            results.append((loss, out, [p.grad.clone() for p in model.parameters()]))
    (loss_a, out_a, grads_a), (loss_b, out_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_per_call_counts_keep_the_plan_and_reuse_schedules():
    """Calls with several counts on one model keep its plan (the planner's, not re-solved per count; no
    timings taken here); each distinct count builds its schedule once."""
    layers = mlp(4)
    ref = reference(layers)
    x = torch.randn(8, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=2,
                      planning=rp.PlanningConfig(profile=0)) as model:
        model.forward_backward(x, labels=x, loss_fn=F.mse_loss)
        plan = model.plan
        for count in (4, 1, 4, 8, 2):
            model.forward_backward(x, labels=x, loss_fn=F.mse_loss, num_microbatches=count)
        assert model.plan == plan and len(model.autoplan.history) == 1
        counts = {key[3] for key in model.dispatcher._schedules}   # (forward, backward, training, count, ...)
        assert counts == {1, 2, 4, 8}
        model.synchronize()
        for _ in range(6):
            F.mse_loss(ref(x), x).backward()
        assert_grads_equal(model, ref, tol=1e-5)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "3"])
def test_bad_microbatch_counts_name_the_argument(bad):
    """A count that is not an int >= 1 is a ValueError naming num_microbatches, for both calls."""
    with rp.RoundPipe(mlp(2), devices=["cpu"]) as model:
        x = torch.randn(4, 8)
        with pytest.raises(ValueError, match=r"num_microbatches=.* must be an int >= 1"):
            model.forward_backward(x, labels=x, loss_fn=F.mse_loss, num_microbatches=bad)
        with pytest.raises(ValueError, match=r"num_microbatches=.* must be an int >= 1"):
            model(x, num_microbatches=bad)
        model.synchronize()
        assert all(p.grad is None for p in model.parameters())


def assert_grads_equal(model, ref, tol=1e-6):
    _assert_grads_equal(model, ref, tol)
