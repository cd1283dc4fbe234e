"""Adam8bit / AdamW8bit: bitsandbytes' format and codes, SIMD bit-identity, state dicts, the engine, validation."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS

import roundpipe as rp
import roundpipe.optim as rpo
from roundpipe import _native
from roundpipe.optim import blockwise

LEVELS = _native.supported_simd_levels()
native = pytest.mark.skipif(not _native.available(), reason="native core unavailable")
SIZES = [5000, 4096, 70000, 1000]   # awkward block tails, exactly 16 blocks, many blocks, one fp32-state tensor

try:
    import bitsandbytes as bnb
except Exception:   # noqa: BLE001 - any import failure means no peer
    bnb = None
peer = pytest.mark.skipif(bnb is None, reason="bitsandbytes not installed")


def grads_for(sizes, steps, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(n, generator=g) * (0.1 + i)).to(dtype) for i, n in enumerate(sizes)] for _ in range(steps)]


def run(make_opt, sizes, grads, seed=0):
    """Params from `seed`, one step() per gradient list; (params, optimizer)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    opt = make_opt(params)
    for gs in grads:
        for p, grad in zip(params, gs):
            p.grad = grad.clone()
        opt.step()
    return params, opt


def code_agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(fraction of equal codes, largest code difference)."""
    d = (a.int() - b.int()).abs()
    return float((d == 0).float().mean()), int(d.max())


def assert_weights_close(a: torch.Tensor, b: torch.Tensor, rel=1e-6):
    """max |a - b| within `rel` of the tensor's scale max |b|."""
    err = float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())
    assert err <= rel, err


def test_maps_and_coder_equal_bitsandbytes():
    """Our dynamic maps equal create_dynamic_map's; quantize/dequantize equal its CPU blockwise ops bit for bit."""
    if bnb is None:
        pytest.skip("bitsandbytes not installed")
    import bitsandbytes.functional as BF
    t = blockwise.tables()
    assert torch.equal(t.code1, BF.create_dynamic_map(signed=True))
    assert torch.equal(t.code2, BF.create_dynamic_map(signed=False))
    gen = torch.Generator().manual_seed(0)
    for code, lut, square in ((t.code1, t.lut1, False), (t.code2, t.lut2, True)):
        for n in (300, 4096, 70001):
            x = torch.randn(n, generator=gen) * torch.exp(3 * torch.randn(n, generator=gen))   # 1e-4 .. 1e4 spreads
            x = x * x if square else x
            x[:256] = 0   # a zero block: absmax 0, all codes 0
            codes, absmax = torch.ops.bitsandbytes.quantize_blockwise(x, code.clone(), 256)
            ours, our_absmax = blockwise.quantize_ref(x, code, lut)
            assert torch.equal(ours, codes) and torch.equal(our_absmax, absmax)
            assert torch.equal(blockwise.dequantize_ref(codes, absmax, code),
                               torch.ops.bitsandbytes.dequantize_blockwise(codes, absmax, code, 256, torch.float32))


@peer
@native
@pytest.mark.parametrize("ours, theirs, kw", [
    (rpo.AdamW8bit, "AdamW8bit", dict(lr=1e-2, weight_decay=0.1)),
    (rpo.AdamW8bit, "AdamW8bit", dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6)),
    (rpo.Adam8bit, "Adam8bit", dict(lr=1e-2)),
])
def test_peer_bitsandbytes_cpu(ours, theirs, kw, restore_level):
    """10 steps on the same params and grads as bitsandbytes' CPU optimizer, at every SIMD level: >= 99.9% of
    the codes equal, none more than one apart, absmax equal, weights within 1e-6 (relative to their scale)."""
    grads = grads_for(SIZES, 10)
    bnb_params, bnb_opt = run(lambda ps: getattr(bnb.optim, theirs)(ps, **kw), SIZES, grads)
    for level in LEVELS:
        _native.set_simd_level(level)
        params, opt = run(lambda ps: ours(ps, **kw), SIZES, grads)
        for p, q in zip(params, bnb_params):
            mine, theirs_state = opt.state[p], bnb_opt.state[q]
            assert mine["state1"].dtype == theirs_state["state1"].dtype   # 8-bit from 4096 elements, as bnb
            if mine["state1"].dtype == torch.uint8:
                for k in ("state1", "state2"):
                    equal, worst = code_agreement(mine[k], theirs_state[k])
                    assert equal >= 0.999 and worst <= 1, (level, p.numel(), k, equal, worst)
                for k in ("absmax1", "absmax2", "qmap1", "qmap2"):
                    torch.testing.assert_close(mine[k], theirs_state[k], rtol=1e-6, atol=0)
            assert_weights_close(p, q)


@native
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [dict(weight_decay=0.05), dict(decoupled_weight_decay=False, weight_decay=0.05,
                                                                 maximize=True)], ids=["adamw", "adam-l2-maximize"])
def test_simd_levels_bitwise_identical(grad_dtype, kw, restore_level):
    """scalar, AVX2 and AVX-512 give identical weights, codes, absmax and bf16/fp16 upload copies, on sizes with
    every kind of block tail, with clipping and predicted-weight uploads."""
    sizes = [1, 7, 255, 256, 257, 4100, 70003, 1_000_003]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen) for n in sizes]
    grads = grads_for(sizes, 3, dtype=grad_dtype)
    results = {}
    for level in LEVELS:
        _native.set_simd_level(level)
        params = [torch.nn.Parameter(s.clone()) for s in start]
        shadows = [torch.empty(n, dtype=torch.bfloat16 if i % 2 else torch.float16) for i, n in enumerate(sizes)]
        opt = rpo.Adam8bit(params, lr=1e-2, min_8bit_size=0, **kw)
        for i, gs in enumerate(grads):
            opt.step_layer(params, shadows, clip_coef=0.25, grads=gs, predict=0.5 * i)
        assert all(opt.state[p]["state1"].dtype == torch.uint8 for p in params)
        results[level] = [p.detach() for p in params] + shadows + [
            opt.state[p][k] for p in params for k in ("state1", "state2", "absmax1", "absmax2")]
    for level in LEVELS[1:]:
        for i, (a, b) in enumerate(zip(results[level], results[LEVELS[0]])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (level, i)


@native
def test_torch_path_matches_the_kernel(monkeypatch):
    """Without the native core the torch-ops path gives the same codes and weights within 1e-6."""
    grads = grads_for(SIZES, 5)
    params, opt = run(lambda ps: rpo.AdamW8bit(ps, lr=1e-2), SIZES, grads)
    monkeypatch.setattr(_native, "lib", None)
    ref_params, ref_opt = run(lambda ps: rpo.AdamW8bit(ps, lr=1e-2), SIZES, grads)
    for p, q in zip(params, ref_params):
        for k in ("state1", "state2"):
            if opt.state[p][k].dtype == torch.uint8:
                assert code_agreement(opt.state[p][k], ref_opt.state[q][k]) == (1.0, 0)
        assert_weights_close(p, q)


def test_low_precision_parameters_update_through_torch():
    """A bf16 parameter keeps fp32 absmax and uint8 codes and follows its fp32 twin within bf16 rounding."""
    grads = grads_for([5000], 3)
    p32, _ = run(lambda ps: rpo.AdamW8bit(ps, lr=1e-2), [5000], grads)
    g = torch.Generator().manual_seed(0)
    p16 = torch.nn.Parameter(torch.randn(5000, generator=g).bfloat16())
    opt = rpo.AdamW8bit([p16], lr=1e-2)
    for gs in grads:
        p16.grad = gs[0].bfloat16()
        opt.step()
    st = opt.state[p16]
    assert st["state1"].dtype == torch.uint8 and st["absmax1"].dtype == torch.float32
    torch.testing.assert_close(p16.float(), p32[0].detach(), rtol=2e-2, atol=2e-2)


@native
def test_state_dict_round_trip_is_bitwise_and_resumes_exactly():
    """state_dict -> torch.save -> load_state_dict into a fresh optimizer keeps every state tensor's dtype and bits,
    and the resumed run equals the uninterrupted one bit for bit."""
    grads = grads_for(SIZES, 6)
    full, full_opt = run(lambda ps: rpo.AdamW8bit(ps, lr=1e-2), SIZES, grads)
    half, half_opt = run(lambda ps: rpo.AdamW8bit(ps, lr=1e-2), SIZES, grads[:3])
    import io
    buf = io.BytesIO()
    torch.save(half_opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    params = [torch.nn.Parameter(p.detach().clone()) for p in half]
    opt = rpo.AdamW8bit(params, lr=1e-2)
    opt.load_state_dict(saved)
    for p, q in zip(params, half):
        for k, v in half_opt.state[q].items():
            assert opt.state[p][k].dtype == v.dtype and torch.equal(opt.state[p][k], v), k
    for gs in grads[3:]:
        for p, grad in zip(params, gs):
            p.grad = grad.clone()
        opt.step()
    for p, q in zip(params, full):
        assert torch.equal(p, q)
        for k, v in full_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v), k


@peer
@native
def test_a_bitsandbytes_state_dict_loads_and_continues_alike():
    """bitsandbytes' AdamW8bit state dict (its FSDP-wrapped layout, int step) loads into ours; the next steps
    keep >= 99.9% of the codes equal to bitsandbytes' own continuation."""
    grads = grads_for(SIZES, 6)
    bnb_params, bnb_opt = run(lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-2), SIZES, grads[:3])
    params = [torch.nn.Parameter(p.detach().clone()) for p in bnb_params]
    opt = rpo.AdamW8bit(params, lr=1e-2)
    opt.load_state_dict(bnb_opt.state_dict())
    for gs in grads[3:]:
        for p, q, grad in zip(params, bnb_params, gs):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        bnb_opt.step()
    for p, q in zip(params, bnb_params):
        if opt.state[p]["state1"].dtype == torch.uint8:
            assert code_agreement(opt.state[p]["state2"], bnb_opt.state[q]["state2"])[0] >= 0.999
        assert_weights_close(p, q)


@native
def test_another_state_format_is_refused_naming_both():
    """AdamW's fp32 moments into AdamW8bit, or 8-bit states into AdamW: a ValueError naming both formats,
    raised before anything changes."""
    grads = grads_for([5000], 1)
    _, adamw = run(lambda ps: rpo.AdamW(ps), [5000], grads)
    _, eight = run(lambda ps: rpo.AdamW8bit(ps), [5000], grads)
    target = rpo.AdamW8bit([torch.nn.Parameter(torch.zeros(5000))])
    with pytest.raises(ValueError, match=r"exp_avg.*fp32 Adam moments.*AdamW8bit keeps 8-bit blockwise"):
        target.load_state_dict(adamw.state_dict())
    assert not target.state
    with pytest.raises(ValueError, match=r"absmax1.*8-bit blockwise states.*AdamW keeps fp32 moments"):
        rpo.AdamW([torch.nn.Parameter(torch.zeros(5000))]).load_state_dict(eight.state_dict())
    bad = copy.deepcopy(eight.state_dict())
    bad["state"][0]["absmax1"] = bad["state"][0]["absmax1"][:-1]
    with pytest.raises(ValueError, match=r"'absmax1' of parameter 0 has shape \[19\].*20 blocks"):
        target.load_state_dict(bad)


@native
@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_steps_equal_the_standalone_optimizer_on_its_gradients(asynchronous, dtype):
    """RoundPipe over 3 CPU workers with AdamW8bit (8-bit states on every tensor), synchronous and asynchronous:
    the masters equal a standalone AdamW8bit fed, call by call, the gradients the engine passed."""
    layers = MODELS["mlp"](5, width=24)
    start = [p.detach().clone() for layer in layers for p in layer.parameters()]
    calls = []

    class Recording(rpo.AdamW8bit):
        def step_layer(self, params, upload=None, clip_coef=1.0, grads=None, predict=0.0):
            gs = [p.grad for p in params] if grads is None else grads
            calls.append(([ids[id(p)] for p in params], [g.clone() if g is not None else None for g in gs], clip_coef))
            super().step_layer(params, upload, clip_coef, grads, predict)

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 24, generator=g), torch.randn(6, 24, generator=g)) for _ in range(5)]
    with rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=3, precision=rp.Precision(dtype)) as model:
        params = list(model.parameters())
        ids = {id(p): i for i, p in enumerate(params)}
        opt = Recording(params, lr=5e-2, min_8bit_size=0)
        for x, y in data:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=asynchronous, max_grad_norm=1.0)
        model.synchronize()
        masters = [p.detach().clone() for p in params]
        assert all(opt.state[p]["state1"].dtype == torch.uint8 for p in params)
    twins = [torch.nn.Parameter(s.clone()) for s in start]
    twin_opt = rpo.AdamW8bit(twins, lr=5e-2, min_8bit_size=0)
    for idx, gs, clip in calls:
        twin_opt.step_layer([twins[i] for i in idx], None, clip, grads=gs)
    assert len(calls) >= len(data)
    for a, b in zip(masters, twins):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize("make, match", [
    (lambda p: rpo.AdamW8bit(p, lr=-0.1), "lr=-0.1"),
    (lambda p: rpo.AdamW8bit(p, betas=(1.0, 0.999)), r"betas\[0\]=1.0"),
    (lambda p: rpo.Adam8bit(p, betas=(0.9, -0.1)), r"betas\[1\]=-0.1"),
    (lambda p: rpo.AdamW8bit(p, eps=-1e-8), "eps=-1e-08"),
    (lambda p: rpo.AdamW8bit(p, weight_decay=float("nan")), "weight_decay=nan"),
    (lambda p: rpo.AdamW8bit(p, amsgrad=True), "amsgrad=True"),
    (lambda p: rpo.Adam8bit(p, min_8bit_size=-1), "min_8bit_size=-1"),
    (lambda p: rpo.Adam8bit(p, min_8bit_size=4096.0), "min_8bit_size=4096.0"),
])
def test_bad_arguments_name_themselves(make, match):
    """Bad hyper-parameters: a ValueError naming the argument and its value."""
    with pytest.raises(ValueError, match=match):
        make([torch.nn.Parameter(torch.zeros(3))])


@native
def test_every_bin_gets_its_lut_code_at_every_level(restore_level):
    """With betas 0 the new m is the gradient and v its square: gradients at every bin centre of the
    coder (one 1.0 per block sets absmax) get exactly blockwise.quantize_ref's codes at every SIMD level,
    so the AVX-512 search over the LUT's code starts equals the LUT for all 65,536 bins."""
    t = blockwise.tables()
    centres = -1.0 + (2.0 * torch.arange(blockwise.LUT_BINS, dtype=torch.float32)) / float(blockwise.LUT_BINS - 1)
    rows = -(-centres.numel() // 255)
    body = torch.cat([centres, centres[: rows * 255 - centres.numel()]]).view(rows, 255)
    grad = torch.cat([torch.ones(rows, 1), body], dim=1).reshape(-1)
    want1, _ = blockwise.quantize_ref(grad, t.code1, t.lut1)
    want2, _ = blockwise.quantize_ref(grad * grad, t.code2, t.lut2)
    for level in LEVELS:
        _native.set_simd_level(level)
        param = torch.nn.Parameter(torch.zeros_like(grad))
        opt = rpo.AdamW8bit([param], lr=1e-3, betas=(0.0, 0.0), min_8bit_size=0)
        opt.fused_step([grad])
        assert torch.equal(opt.state[param]["state1"], want1), level
        assert torch.equal(opt.state[param]["state2"], want2), level


@native
def test_native_entry_checks_its_tables():
    """The binding refuses a wrong table list, a LUT that is not non-decreasing and overlapping state buffers,
    naming them."""
    p, g = torch.zeros(300), torch.zeros(300)
    q1, q2 = torch.zeros(300, dtype=torch.uint8), torch.zeros(300, dtype=torch.uint8)
    a1, a2 = torch.zeros(2), torch.zeros(2)
    t = blockwise.tables()
    kw = dict(params=[p.data_ptr()], grads=[g.data_ptr()], grad_dtypes=["float32"], state1s=[q1.data_ptr()],
              state2s=[q2.data_ptr()], absmax1s=[a1.data_ptr()], absmax2s=[a2.data_ptr()], shadows=[0],
              shadow_dtypes=["bfloat16"], numels=[300], steps=[1.0], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, decoupled=True, maximize=False, grad_mul=1.0)
    with pytest.raises(ValueError, match="tables has 2 entries"):
        _native.lib.adam8bit_step(tables=[t.code1.data_ptr(), t.lut1.data_ptr()], **kw)
    tables = [t.code1.data_ptr(), t.lut1.data_ptr(), t.code2.data_ptr(), t.lut2.data_ptr()]
    with pytest.raises(ValueError, match=r"state2s\[0\] overlaps state1s\[0\]"):
        _native.lib.adam8bit_step(tables=tables, **{**kw, "state2s": [q1.data_ptr()]})
    falling = t.lut2.clone()
    falling[40000] = 255   # then 40001's code is below it
    with pytest.raises(ValueError, match="lut2 must be non-decreasing.*bin 40001"):
        _native.lib.adam8bit_step(tables=[*tables[:3], falling.data_ptr()], **kw)
