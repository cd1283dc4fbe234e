"""SGD, Adagrad and Lion: torch equality, the published Lion rule, step_layer, SIMD bit-identity, validation."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import roundpipe.optim as rpo
from roundpipe import _native

LEVELS = _native.supported_simd_levels()
LOWP = [torch.bfloat16, torch.float16]
native = pytest.mark.skipif(not _native.available(), reason="native core unavailable")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| relative to |b|, or to 1e-3 where the weight is smaller than that."""
    return float(((a.detach().float() - b.detach().float()).abs() / b.detach().float().abs().clamp_min(1e-3)).max())


def model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.Linear(64, 3)).to(dtype)


def groups(net, **extra):
    """Three param groups (the first with its own lr and `extra`), odd sizes included."""
    return [{"params": [net[0].weight], "lr": 0.02, **extra}, {"params": [net[0].bias]},
            {"params": net[2].parameters()}]


def train(net, opt, steps, seed=1, grad_dtype=None):
    """`steps` steps on a fixed seeded gradient sequence (not the model's loss, which would amplify
    one-ulp differences chaotically); grad_dtype rounds each gradient first, as the engine's bf16 download."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in net.parameters():
            grad = torch.randn(p.shape, generator=g)
            p.grad = (grad.to(grad_dtype) if grad_dtype else grad).to(p.dtype)
        opt.step()


def lion_reference(params, grads_per_step, lr, betas, weight_decay, maximize=False, dtype=torch.float32):
    """Chen et al. 2023, Algorithm 2, literally, in `dtype`:
    c = b1 m + (1 - b1) g;  w = w - lr (sign(c) + wd w);  m = b2 m + (1 - b2) g."""
    beta1, beta2 = betas
    ws = [p.detach().to(dtype) for p in params]
    ms = [torch.zeros_like(w) for w in ws]
    for grads in grads_per_step:
        for w, m, g in zip(ws, ms, grads):
            g = (-g if maximize else g).to(dtype)
            c = beta1 * m + (1 - beta1) * g
            w -= lr * (torch.sign(c) + weight_decay * w)
            m.copy_(beta2 * m + (1 - beta2) * g)
    return ws, ms


SGD_KW = [dict(momentum=m, dampening=d, weight_decay=wd, nesterov=n, maximize=mx)
          for m, d, wd, n, mx in itertools.product([0.0, 0.9], [0.0, 0.1], [0.0, 0.01], [False, True], [False, True])
          if not (n and (m == 0 or d != 0))]
ADAGRAD_KW = [dict(lr_decay=ld, weight_decay=wd, initial_accumulator_value=iv, eps=eps, maximize=mx)
              for ld, wd, iv, eps, mx in itertools.product([0.0, 0.01], [0.0, 0.01], [0.0, 0.1], [1e-10, 0.0],
                                                           [False, True])]


def kw_id(kw):
    return "-".join(f"{k}{v}" for k, v in kw.items())


@pytest.mark.parametrize("kw", SGD_KW, ids=kw_id)
def test_sgd_equals_torch_over_30_steps(kw):
    """Every SGD option combination, three param groups, 30 steps: torch.optim.SGD's weights, bit for bit."""
    ours_net, ref_net = model(), model()
    ours, ref = rpo.SGD(groups(ours_net), lr=0.01, **kw), torch.optim.SGD(groups(ref_net), lr=0.01, **kw)
    train(ours_net, ours, 30)
    train(ref_net, ref, 30)
    for a, b in zip(ours_net.parameters(), ref_net.parameters()):
        assert rel_diff(a, b) <= 1e-6
        if _native.available():
            assert torch.equal(a, b)


@pytest.mark.parametrize("kw", ADAGRAD_KW, ids=kw_id)
def test_adagrad_equals_torch_over_30_steps(kw):
    """Every Adagrad option combination, three groups, 30 steps: torch.optim.Adagrad(fused=True)'s weights bit
    for bit.  Its single-tensor path rounds differently (sqrt from MKL, an ulp off the rounded root for some
    inputs, as for Adam in test_optim_fused.py; addcmul/addcdiv without fma): up to 7.5e-6 over 30 steps here."""
    nets = [model() for _ in range(3)]
    ours = rpo.Adagrad(groups(nets[0]), lr=0.01, **kw)
    fused = torch.optim.Adagrad(groups(nets[1]), lr=0.01, fused=True, **kw)
    single = torch.optim.Adagrad(groups(nets[2]), lr=0.01, foreach=False, **kw)
    for net, opt in zip(nets, (ours, fused, single)):
        train(net, opt, 30)
    for a, b, c in zip(*(n.parameters() for n in nets)):
        assert rel_diff(a, b) <= 1e-6 and rel_diff(a, c) <= 1e-5
        if _native.available():
            assert torch.equal(a, b)
    assert float(ours.state[nets[0][0].weight]["step"]) == 30.0


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.5), dict(betas=(0.95, 0.98), maximize=True),
                                dict(weight_decay=0.1, betas=(0.0, 0.5))], ids=kw_id)
def test_lion_equals_the_published_update_rule(kw):
    """30 steps over three groups follow Algorithm 2 of Chen et al. 2023 written in torch ops: the momentum within
    1e-6, the weights as close to the rule computed in fp64 as the rule computed in fp32 is (within 1e-6 of it
    without weight decay, where both round the same operations; with it the kernel decays as w * (1 - lr wd))."""
    net = model()
    start = [p.detach().clone() for p in net.parameters()]
    opt = rpo.Lion(groups(net, lr=3e-3), lr=1e-3, **kw)
    gen = torch.Generator().manual_seed(1)
    seq = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(30)]
    for grads in seq:
        for p, g in zip(net.parameters(), grads):
            p.grad = g
        opt.step()
    rule = dict(betas=kw.get("betas", (0.9, 0.99)), weight_decay=kw.get("weight_decay", 0.0),
                maximize=kw.get("maximize", False))
    for i, (p, lr) in enumerate(zip(net.parameters(), [3e-3, 1e-3, 1e-3, 1e-3])):
        steps = [[grads[i]] for grads in seq]
        (w32,), (m32,) = lion_reference([start[i]], steps, lr, **rule)
        (w64,), _ = lion_reference([start[i]], steps, lr, dtype=torch.float64, **rule)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m32, rtol=1e-6, atol=1e-7)
        assert (p.double() - w64).abs().max() <= 2 * (w32.double() - w64).abs().max() + 1e-8
        if rule["weight_decay"] == 0:
            assert rel_diff(p, w32) <= 1e-6


CASES = {"SGD": (rpo.SGD, torch.optim.SGD, dict(lr=0.01, momentum=0.9, dampening=0.1, weight_decay=0.01)),
         "SGD-nesterov": (rpo.SGD, torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True)),
         "Adagrad": (rpo.Adagrad, torch.optim.Adagrad, dict(lr=0.01, lr_decay=0.01, weight_decay=0.01,
                                                           initial_accumulator_value=0.1)),
         "Lion": (rpo.Lion, None, dict(lr=1e-3, weight_decay=0.1))}


def _twin(cls, params, kw):
    """The reference optimizer for a case: torch's fused one, or for Lion ours on fp32 .grad."""
    return cls(params, fused=True, **kw) if cls is not rpo.Lion else rpo.Lion(params, **kw)


@pytest.mark.parametrize("grad_dtype", [torch.float32, *LOWP])
@pytest.mark.parametrize("shadow_dtype", [None, torch.float32, *LOWP])
@pytest.mark.parametrize("case", list(CASES))
def test_step_layer_with_grads_and_shadows(case, grad_dtype, shadow_dtype):
    """step_layer(grads=g in fp32/bf16/fp16, clip_coef) over layers one by one equals torch on g.float() * clip_coef,
    and writes each shadow as the updated master rounded to its dtype."""
    ours_cls, torch_cls, kw = CASES[case]
    torch.manual_seed(3)
    layers = [[torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(5))],
              [torch.nn.Parameter(torch.randn(1001))]]
    twins = [torch.nn.Parameter(p.detach().clone()) for layer in layers for p in layer]
    ours = ours_cls([p for layer in layers for p in layer], **kw)
    ref = _twin(torch_cls or rpo.Lion, twins, kw)
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):
        grads = [[torch.randn(p.shape, generator=gen).to(grad_dtype) for p in layer] for layer in layers]
        shadows = [[torch.empty_like(p, dtype=shadow_dtype) if shadow_dtype else None for p in layer]
                   for layer in layers]
        for layer, gs, sh in zip(reversed(layers), reversed(grads), reversed(shadows)):  # tail first, as the engine
            ours.step_layer(layer, sh, clip_coef=0.5, grads=gs)
        for q, g in zip(twins, [g for gs in grads for g in gs]):
            q.grad = g.float() * 0.5
        ref.step()
        for layer, sh in zip(layers, shadows):
            for p, s in zip(layer, sh):
                assert p.grad is None and (s is None or torch.equal(s, p.detach().to(shadow_dtype)))
    for p, q in zip([p for layer in layers for p in layer], twins):
        assert rel_diff(p, q) <= 1e-6


@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_loss_scale_and_inf_skip(case):
    """fused_step reads grads / grad_scale and skips the whole step (state included) on an inf gradient."""
    ours_cls, _, kw = CASES[case]
    a, b = model(), model()
    opt_a, opt_b = ours_cls(a.parameters(), **kw), ours_cls(b.parameters(), **kw)
    grads = [torch.randn_like(p) for p in a.parameters()]
    assert opt_a.fused_step([(g * 1024).to(torch.bfloat16) for g in grads], grad_scale=1024.0)
    for p, g in zip(b.parameters(), grads):
        p.grad = (g * 1024).to(torch.bfloat16).float() / 1024
    opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    before = copy.deepcopy(opt_a.state_dict())
    weights = [p.detach().clone() for p in a.parameters()]
    bad = [g.clone() for g in grads]
    bad[1][0] = float("inf")
    assert opt_a.fused_step(bad, grad_scale=2.0) is False
    assert all(torch.equal(p, w) for p, w in zip(a.parameters(), weights))
    after = opt_a.state_dict()
    for k, st in before["state"].items():
        assert all(torch.equal(v, after["state"][k][name]) for name, v in st.items())


@pytest.mark.parametrize("case", ["SGD", "Adagrad"])
def test_state_dict_round_trip_with_torch(case):
    """ours -> torch -> ours mid-training continues as uninterrupted training; same keys as torch's."""
    ours_cls, torch_cls, kw = CASES[case]
    nets = [model() for _ in range(3)]
    ours = ours_cls(groups(nets[0]), **kw)
    train(nets[0], ours, 5)
    sd = ours.state_dict()
    ref_sd = torch_cls(groups(model()), **kw).state_dict()
    kw = {**kw, "fused": True}   # Adagrad: the rounding ours equals (SGD: every torch path is the same)
    assert set(sd["param_groups"][0]) == set(ref_sd["param_groups"][0])
    assert set(sd["state"][0]) == ({"momentum_buffer"} if case.startswith("SGD") else {"step", "sum"})
    if case == "Adagrad":
        assert sd["state"][0]["step"].dtype == torch.float32 and float(sd["state"][0]["step"]) == 5.0
    nets[1].load_state_dict(nets[0].state_dict())
    torch_opt = torch_cls(groups(nets[1]), **kw)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    for group in torch_opt.param_groups:   # the groups came with our fused=None: back to torch's fused kernel
        group["fused"] = True
    train(nets[0], ours, 5, seed=2)
    train(nets[1], torch_opt, 5, seed=2)
    nets[2].load_state_dict(nets[1].state_dict())
    back = ours_cls(groups(nets[2]), **{k: v for k, v in kw.items() if k != "fused"})
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    train(nets[1], torch_opt, 5, seed=3)
    train(nets[2], back, 5, seed=3)
    for a, b in zip(nets[1].parameters(), nets[2].parameters()):
        assert rel_diff(a, b) <= 1e-6


def test_adagrad_state_exists_before_the_first_step_like_torch():
    """Adagrad's state dict before any step equals torch's (step 0 and sum = initial_accumulator_value)."""
    ours = rpo.Adagrad(model().parameters(), initial_accumulator_value=0.25).state_dict()
    ref = torch.optim.Adagrad(model().parameters(), initial_accumulator_value=0.25).state_dict()
    assert ours["state"].keys() == ref["state"].keys()
    for k in ref["state"]:
        for name in ("step", "sum"):
            assert torch.equal(ours["state"][k][name], ref["state"][k][name])


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("case", ["SGD", "Adagrad"])
def test_low_precision_params_take_the_torch_path(case, dtype):
    """bf16/fp16 parameters (the torch fallback) give torch's single-tensor results exactly."""
    ours_cls, torch_cls, kw = CASES[case]
    kw = {**kw, "lr": 0.1}
    a, b = model(dtype=dtype), model(dtype=dtype)
    ours, ref = ours_cls(a.parameters(), **kw), torch_cls(b.parameters(), foreach=False, **kw)
    train(a, ours, 10)
    train(b, ref, 10)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("case", list(CASES))
def test_fallback_without_native_core(case, monkeypatch):
    """With the extension missing, every optimizer still runs: torch's single-tensor results (Lion: the kernel's)."""
    ours_cls, torch_cls, kw = CASES[case]
    expected = model()
    ref_cls = torch_cls or rpo.Lion   # Lion: against the native kernel
    train(expected, ref_cls(expected.parameters(), **kw, **({"foreach": False} if torch_cls else {})), 10)
    monkeypatch.setattr(_native, "lib", None)
    net = model()
    train(net, ours_cls(net.parameters(), **kw), 10)
    for x, y in zip(net.parameters(), expected.parameters()):
        assert rel_diff(x, y) <= 1e-6


@native
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_simd_levels_bitwise_identical(case, grad_dtype, restore_level):
    """scalar, AVX2 and AVX-512 give identical weights, states and bf16 shadows (sizes 1..1_000_003 and 300 small)."""
    ours_cls, _, kw = CASES[case]
    sizes = [1, 7, 1023, 1_000_003] + [1 + (i * 37) % 300 for i in range(300)]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(grad_dtype) for n in sizes] for _ in range(2)]
    results = {}
    for level in LEVELS:
        _native.set_simd_level(level)
        params = [torch.nn.Parameter(s.clone()) for s in start]
        shadows = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        opt = ours_cls(params, **kw)
        for gs in grads:
            opt.step_layer(params, shadows, clip_coef=0.25, grads=gs)
        state = [t for p in params for k, t in opt.state[p].items() if k != "step"]
        results[level] = [p.detach() for p in params] + state + shadows
    base = results[LEVELS[0]]
    for level in LEVELS[1:]:
        for i, (a, b) in enumerate(zip(results[level], base)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (level, i)


@native
def test_lion_sign_of_zero_and_nan_is_zero(restore_level):
    """sign(c) is 0 for c = +-0 and NaN at every level (torch.sign's CPU result), so those weights only decay."""
    for level in LEVELS:
        _native.set_simd_level(level)
        p = torch.nn.Parameter(torch.ones(40))
        opt = rpo.Lion([p], lr=0.5, betas=(0.9, 0.99))
        grad = torch.zeros(40)
        grad[::3] = -0.0
        grad[1::3] = float("nan")
        opt.step_layer([p], grads=[grad])
        assert torch.equal(p.detach()[::3], torch.ones(14)) and torch.equal(p.detach()[1::3], torch.ones(13))


@pytest.mark.parametrize("make, match", [
    (lambda p: rpo.SGD(p, lr=-0.1), "lr=-0.1"),
    (lambda p: rpo.SGD(p, momentum=-1), "momentum=-1"),
    (lambda p: rpo.SGD(p, momentum=0.9, dampening=float("nan")), "dampening=nan"),
    (lambda p: rpo.SGD(p, momentum=0.9, dampening=0.1, nesterov=True), "nesterov=True needs"),
    (lambda p: rpo.SGD(p, nesterov=True), "momentum=0.0"),
    (lambda p: rpo.SGD(p, weight_decay=float("inf")), "weight_decay=inf"),
    (lambda p: rpo.SGD(p, differentiable=True), "differentiable=True"),
    (lambda p: rpo.Adagrad(p, lr_decay=-1e-3), "lr_decay=-0.001"),
    (lambda p: rpo.Adagrad(p, initial_accumulator_value=-1), "initial_accumulator_value=-1"),
    (lambda p: rpo.Adagrad(p, eps=-1e-10), "eps=-1e-10"),
    (lambda p: rpo.Lion(p, betas=(0.9, 1.0)), r"betas\[1\]=1.0"),
    (lambda p: rpo.Lion(p, betas=(0.9,)), r"betas=\(0.9,\)"),
    (lambda p: rpo.Lion(p, weight_decay=-0.1), "weight_decay=-0.1"),
])
def test_bad_arguments_name_argument_and_value(make, match):
    """A bad hyper-parameter is a ValueError naming it and its value."""
    with pytest.raises(ValueError, match=match):
        make([torch.nn.Parameter(torch.ones(3))])


@pytest.mark.parametrize("case", list(CASES))
def test_bad_group_value_and_rejected_call_change_nothing(case):
    """A group edited to a bad value fails the next step by name; a rejected shadow leaves weights and state alone."""
    ours_cls, _, kw = CASES[case]
    p = torch.nn.Parameter(torch.ones(1000))
    opt = ours_cls([p], **kw)
    opt.step_layer([p], grads=[torch.ones(1000)])
    weights, state = p.detach().clone(), copy.deepcopy(opt.state_dict())
    bad = torch.empty(2000, dtype=torch.bfloat16)[::2]
    with pytest.raises(ValueError, match=r"shadows\[0\] must be contiguous"):
        opt.step_layer([p], [bad], grads=[torch.ones(1000)])
    assert torch.equal(p, weights)
    for name, v in state["state"][0].items():
        assert torch.equal(opt.state_dict()["state"][0][name], v)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr=-1.0"):
        opt.step_layer([p], grads=[torch.ones(1000)])


@native
def test_native_bindings_validate_directly():
    """The bindings reject bad lists, values and overlapping outputs themselves (ValueError naming the argument)."""
    p, g, m = torch.zeros(64), torch.ones(64), torch.zeros(64)
    base = dict(params=[p.data_ptr()], grads=[g.data_ptr()], grad_dtypes=["float32"], shadows=[0],
                shadow_dtypes=["bfloat16"], numels=[64])
    sgd = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, grad_mul=1.0)
    with pytest.raises(ValueError, match="firsts has 0 entries"):
        _native.lib.sgd_step(**base, momentum_buffers=[m.data_ptr()], firsts=[], **sgd)
    with pytest.raises(ValueError, match="momentum_buffers must be empty when momentum=0"):
        _native.lib.sgd_step(**base, momentum_buffers=[m.data_ptr()], firsts=[True], **{**sgd, "momentum": 0.0})
    with pytest.raises(ValueError, match="overlaps"):
        _native.lib.sgd_step(**base, momentum_buffers=[p.data_ptr()], firsts=[True], **sgd)
    with pytest.raises(ValueError, match=r"steps\[0\]=0"):
        _native.lib.adagrad_step(**base, sums=[m.data_ptr()], steps=[0.0], lr=0.1, lr_decay=0.0, weight_decay=0.0,
                                eps=1e-10, maximize=False, grad_mul=1.0)
    with pytest.raises(ValueError, match="beta2=1"):
        _native.lib.lion_step(**base, exp_avgs=[m.data_ptr()], lr=0.1, beta1=0.9, beta2=1.0, weight_decay=0.0,
                             maximize=False, grad_mul=1.0)
    with pytest.raises(ValueError, match="grad_mul=inf"):
        _native.lib.lion_step(**base, exp_avgs=[m.data_ptr()], lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0,
                             maximize=False, grad_mul=float("inf"))


ENGINE = {"SGD": (rpo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
          "SGD-nesterov": (rpo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
          "SGD-plain": (rpo.SGD, torch.optim.SGD, dict(lr=0.05)),
          "Adagrad": (rpo.Adagrad, torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.01,
                                                            initial_accumulator_value=0.1)),
          "Lion": (rpo.Lion, rpo.Lion, dict(lr=1e-3, weight_decay=0.1))}


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
@pytest.mark.parametrize("case", list(ENGINE))
def test_roundpipe_step_equals_plain_pytorch_training(case, max_grad_norm):
    """model.step(rp.optim.X, asynchronous=True) through RoundPipe (2 CPU workers, fp32, sync) trains like plain PyTorch with torch's X
    (Adagrad: fused=True; Lion: ours on the plain model's .grad), clipping folded into the fused pass included.
    One micro-batch, so the gradients are PyTorch's bit for bit (with more, their sum is ordered differently:
    5e-6 apart after 6 steps here) and what is compared is the step."""
    import torch.nn.functional as F
    from rp_models import mlp, reference

    import roundpipe as rp

    ours_cls, torch_cls, kw = ENGINE[case]
    layers = mlp(3)
    ref = reference(layers)
    ref_opt = torch_cls(ref.parameters(), **kw, **({"fused": True} if torch_cls is torch.optim.Adagrad else {}))
    gen = torch.Generator().manual_seed(0)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.float32, num_microbatches=1) as model:
        opt = ours_cls(model.parameters(), **kw)
        for _ in range(6):
            x, y = torch.randn(6, 8, generator=gen) * 10, torch.randn(6, 8, generator=gen)
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False, max_grad_norm=max_grad_norm)
            F.mse_loss(ref(x), y).backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
            ref_opt.step()
            ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert rel_diff(p, q) <= 1e-6
