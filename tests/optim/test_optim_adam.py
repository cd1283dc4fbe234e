"""Adam/AdamW as torch.optim drop-ins, and the engine-facing fused_step."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import roundpipe.optim as rpo

LOWP = [torch.bfloat16, torch.float16]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| relative to |b|, or to 1e-3 (the step size) where the weight is smaller than a step."""
    return float(((a.detach().float() - b.detach().float()).abs() / b.detach().float().abs().clamp_min(1e-3)).max())


def model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.Linear(64, 3)).to(dtype)


def train(net, opt, steps, sched=None, seed=1):
    """`steps` optimizer steps on a fixed seeded gradient sequence (not the model's own loss, whose
    gradients would amplify one-ulp differences between implementations chaotically)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for p in net.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
        if sched is not None:
            sched.step()


def groups(net, **extra):
    return [{"params": net[0].parameters(), "lr": 2e-3, **extra}, {"params": net[2].parameters()}]


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1, "amsgrad": True}, {"maximize": True, "betas": (0.8, 0.99)}])
def test_drop_in_matches_torch_with_groups_and_scheduler(name, kw):
    """50 steps with two param groups and a StepLR schedule stay within 1e-6 of torch's optimizer."""
    ours_net, ref_net = model(), model()
    ours = getattr(rpo, name)(groups(ours_net), lr=1e-3, **kw)
    ref = getattr(torch.optim, name)(groups(ref_net), lr=1e-3, fused=True, **kw)
    train(ours_net, ours, 50, torch.optim.lr_scheduler.StepLR(ours, 10, 0.5))
    train(ref_net, ref, 50, torch.optim.lr_scheduler.StepLR(ref, 10, 0.5))
    for a, b in zip(ours_net.parameters(), ref_net.parameters()):
        assert rel_diff(a, b) <= 1e-6
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 2e-3 * 0.5**5


@pytest.mark.parametrize("dtype", LOWP)
def test_low_precision_params_use_torch_math(dtype):
    """bf16/fp16 parameters (torch path) give exactly torch's single-tensor AdamW results."""
    ours_net, ref_net = model(dtype=dtype), model(dtype=dtype)
    ours = rpo.AdamW(ours_net.parameters(), lr=1e-2, eps=1e-3)  # 1e-8 underflows in fp16
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-2, eps=1e-3, foreach=False)
    train(ours_net, ours, 10)
    train(ref_net, ref, 10)
    for a, b in zip(ours_net.parameters(), ref_net.parameters()):
        assert torch.equal(a, b)


def test_state_dict_round_trip_with_torch_both_ways():
    """A checkpoint moves ours -> torch.optim.AdamW -> ours mid-training, continuing as uninterrupted training."""
    nets = [model() for _ in range(3)]
    ours = rpo.AdamW(groups(nets[0]), lr=1e-3, amsgrad=True)
    train(nets[0], ours, 5)
    sd = ours.state_dict()
    assert isinstance(sd["state"][0]["step"], torch.Tensor) and sd["state"][0]["step"].dtype == torch.float32
    assert float(sd["state"][0]["step"]) == 5.0
    ref_sd = torch.optim.AdamW(groups(model()), lr=1e-3, amsgrad=True).state_dict()
    assert set(sd["param_groups"][0]) == set(ref_sd["param_groups"][0])

    nets[1].load_state_dict(nets[0].state_dict())
    torch_opt = torch.optim.AdamW(groups(nets[1]), lr=1e-3, amsgrad=True)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    train(nets[0], ours, 5, seed=2)
    train(nets[1], torch_opt, 5, seed=2)
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert rel_diff(a, b) <= 1e-6

    nets[2].load_state_dict(nets[1].state_dict())
    back = rpo.AdamW(groups(nets[2]), lr=1e-3, amsgrad=True)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # torch's keys and step tensors
    train(nets[1], torch_opt, 5, seed=3)
    train(nets[2], back, 5, seed=3)
    for a, b in zip(nets[1].parameters(), nets[2].parameters()):
        assert rel_diff(a, b) <= 1e-6
    assert float(back.state_dict()["state"][0]["step"]) == 15.0
    assert back.state_dict()["param_groups"][1]["lr"] == 1e-3


def test_torch_checkpoint_loads_and_continues():
    """torch.optim.AdamW's state dict, loaded into ours, continues like torch would."""
    a, b = model(), model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-3)
    train(a, ref, 4)
    b.load_state_dict(a.state_dict())
    ours = rpo.AdamW(b.parameters(), lr=1e-3)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(a, ref, 6, seed=5)
    train(b, ours, 6, seed=5)
    for x, y in zip(a.parameters(), b.parameters()):
        assert rel_diff(x, y) <= 1e-6


def test_params_without_grad_are_skipped_and_zero_grad_works():
    """Parameters with no gradient keep their value and step count; zero_grad clears gradients."""
    net = model()
    frozen = net[2].weight.detach().clone()
    opt = rpo.Adam(net.parameters(), lr=1e-2)
    net[2].weight.requires_grad_(False)
    train(net, opt, 3)
    assert torch.equal(net[2].weight, frozen) and net[2].weight not in opt.state
    assert float(opt.state[net[0].weight]["step"]) == 3.0
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_closure_and_unsupported_options():
    """step(closure) returns the loss; sparse gradients and capturable are rejected."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = rpo.AdamW([p])
    loss = opt.step(lambda: (p.sum().backward(), p.sum().detach())[1])
    assert float(loss) == 3.0 and p.grad is not None
    with warnings.catch_warnings():  # torch's note about sparse invariant checks
        warnings.simplefilter("ignore")
        p.grad = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    with pytest.raises(ValueError, match="capturable=True"):
        rpo.AdamW([p], capturable=True)
    with pytest.raises(ValueError, match="lr=-0.1"):
        rpo.Adam([p], lr=-0.1)


def engine_setup(sizes=(4096, 1000, 7), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    return masters, grads


@pytest.mark.parametrize("dtype", LOWP)
def test_fused_step_equals_torch_on_unscaled_clipped_upcast(dtype):
    """fused_step with low-precision grads, loss scale and clip factor equals torch AdamW on grad.float()*clip/scale."""
    masters, grads = engine_setup(dtype=dtype)
    ref_params = [torch.nn.Parameter(m.clone()) for m in masters]
    ours = rpo.AdamW(masters, lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.01, fused=True)
    shadows = [torch.empty(m.numel(), dtype=torch.bfloat16) for m in masters]
    for _ in range(3):
        assert ours.fused_step(grads, shadows=shadows, grad_scale=1024.0, clip_coef=0.5, found_inf=False)
        for p, g in zip(ref_params, grads):
            p.grad = g.float() * (0.5 / 1024.0)
        ref.step()
    for m, p, s in zip(masters, ref_params, shadows):
        assert rel_diff(m, p.detach()) <= 1e-6
        assert torch.equal(s, m.to(torch.bfloat16))


@pytest.mark.parametrize("found_inf", [True, None])
def test_fused_step_skips_on_nonfinite_gradient(found_inf):
    """A NaN/inf gradient under a loss scale (found or passed in) leaves weights, moments and steps untouched."""
    masters, grads = engine_setup()
    opt = rpo.AdamW(masters, lr=1e-3)
    assert opt.fused_step(grads, grad_scale=8.0)
    before = copy.deepcopy(opt.state_dict()), [m.clone() for m in masters]
    grads[1][17] = math.inf if found_inf is None else math.nan
    grads[2][6] = math.nan
    shadows = [torch.zeros(m.numel(), dtype=torch.bfloat16) for m in masters]
    assert opt.fused_step(grads, shadows=shadows, grad_scale=8.0, found_inf=found_inf) is False
    assert all(torch.equal(a, b) for a, b in zip(masters, before[1]))
    after = opt.state_dict()
    for k, st in before[0]["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][k][key], value)
    assert all(not s.any() for s in shadows)


def test_fused_step_on_a_subset_across_groups():
    """fused_step(params=subset) updates only those parameters, each with its own group's lr."""
    masters, grads = engine_setup()
    opt = rpo.AdamW([{"params": masters[:2], "lr": 1e-2}, {"params": masters[2:], "lr": 0.0}], weight_decay=0.0)
    start = [m.clone() for m in masters]
    assert opt.fused_step([grads[2], grads[0]], params=[masters[2], masters[0]])
    assert torch.equal(masters[1], start[1]) and masters[1] not in opt.state
    assert torch.equal(masters[2], start[2])  # lr 0
    assert not torch.equal(masters[0], start[0])
    with pytest.raises(ValueError, match=r"params\[0\] .* is not a parameter of this optimizer"):
        opt.fused_step([grads[0]], params=[torch.zeros(4096)])
    with pytest.raises(ValueError, match="grads has 1 tensors but params has 3"):
        opt.fused_step([grads[0]])
    with pytest.raises(ValueError, match=r"grads\[1\] must be a tensor with 1000 elements"):
        opt.fused_step([grads[0], grads[0], grads[2]])
    with pytest.raises(ValueError, match="clip_coef=nan"):
        opt.fused_step(grads, clip_coef=math.nan)


def test_fused_step_rejection_leaves_state_unchanged():
    """A call rejected for a bad shadow leaves weights and step counts as they were."""
    masters, grads = engine_setup()
    opt = rpo.AdamW(masters)
    opt.fused_step(grads)
    start = [m.clone() for m in masters]
    bad = [None, torch.empty(1000, dtype=torch.bfloat16)[None].expand(2, 1000).reshape(-1)[:1000], None]
    bad[1] = torch.empty(2000, dtype=torch.bfloat16)[::2]
    with pytest.raises(ValueError, match=r"shadows\[1\] must be contiguous"):
        opt.fused_step(grads, shadows=bad)
    assert all(torch.equal(a, b) for a, b in zip(masters, start))
    assert all(float(opt.state[m]["step"]) == 1.0 for m in masters)


def test_fused_step_runs_step_hooks_and_satisfies_lr_schedulers(recwarn):
    """fused_step counts as optimizer.step(): post-hooks fire and a scheduler sees no out-of-order step."""
    masters, grads = engine_setup()
    opt = rpo.AdamW(masters, lr=1.0)
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    for _ in range(3):
        opt.fused_step(grads)
        sched.step()
    assert calls == [1, 1, 1] and opt.param_groups[0]["lr"] == 0.125
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    assert opt.fused_step(grads, found_inf=True) is False and calls == [1, 1, 1]


def test_drop_in_without_native_core_matches_torch(monkeypatch):
    """With the extension missing, the torch path gives torch's single-tensor AdamW results exactly."""
    from roundpipe import _native

    monkeypatch.setattr(_native, "lib", None)
    ours_net, ref_net = model(), model()
    ours = rpo.AdamW(groups(ours_net, weight_decay=0.1), lr=1e-3)
    ref = torch.optim.AdamW(groups(ref_net, weight_decay=0.1), lr=1e-3, foreach=False)
    train(ours_net, ours, 10)
    train(ref_net, ref, 10)
    for a, b in zip(ours_net.parameters(), ref_net.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("upload_dtype", [torch.float32, torch.bfloat16])
def test_step_layer_equals_step_and_writes_upload(upload_dtype):
    """step_layer over the layers one by one equals one step(), and writes each upload copy."""
    torch.manual_seed(3)
    layers = [[torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(5))],
              [torch.nn.Parameter(torch.randn(1001))]]
    frozen = torch.nn.Parameter(torch.randn(3))
    twins = [[torch.nn.Parameter(p.detach().clone()) for p in layer] for layer in layers]
    flat, twin_flat = [p for l in layers for p in l] + [frozen], [p for l in twins for p in l]
    ours = rpo.AdamW(flat, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(twin_flat, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for p, q in zip(flat, twin_flat):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        uploads = [[torch.empty_like(p, dtype=upload_dtype) for p in layer] for layer in layers]
        for layer, up in zip(reversed(layers), reversed(uploads)):   # tail first, as the engine does
            ours.step_layer(layer, up)
        ours.step_layer([frozen], [None])
        ref.step()
        for p, q in zip(flat, twin_flat):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for layer, up in zip(layers, uploads):
            for p, u in zip(layer, up):
                assert torch.equal(u, p.detach().to(upload_dtype))
    with pytest.raises(ValueError, match="upload has 1 entries but params has 2"):
        ours.step_layer(layers[0], [None])


def test_step_layer_reads_explicit_low_precision_grads_like_their_fp32_copy():
    """step_layer(grads=...) with bf16 gradients (the engine's held gradients) equals the same step
    over p.grad = g.float(): the kernel widens bf16 exactly."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(11))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    grads = [torch.randn_like(p).to(torch.bfloat16) for p in a]
    opt_a, opt_b = rpo.AdamW(a, lr=1e-2), rpo.AdamW(b, lr=1e-2)
    up_a = [torch.empty_like(p, dtype=torch.bfloat16) for p in a]
    up_b = [torch.empty_like(p, dtype=torch.bfloat16) for p in b]
    for _ in range(3):
        opt_a.step_layer(a, up_a, clip_coef=0.5, grads=grads)
        for p, g in zip(b, grads):
            p.grad = g.float()
        opt_b.step_layer(b, up_b, clip_coef=0.5)
    for pa, pb, ua, ub in zip(a, b, up_a, up_b):
        assert torch.equal(pa, pb) and torch.equal(ua, ub)
        assert pa.grad is None   # explicit gradients leave .grad alone
    with pytest.raises(ValueError, match=r"grads\[1\]"):
        opt_a.step_layer(a, up_a, grads=[grads[0], torch.zeros(3)])
    with pytest.raises(ValueError, match="grads has 1 entries"):
        opt_a.step_layer(a, up_a, grads=[grads[0]])
