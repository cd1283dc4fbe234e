"""bf16 masters (roundpipe/optim/rounding.py): unbiased, reproducible, plan- and SIMD-independent stochastic rounding,
nearest equal to torch's cast, the torch path's bits equal to the kernel's, the engine's bf16 masters and bad input."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe import _native
from roundpipe.optim import base
from roundpipe.optim.rounding import round_bf16_, round_key

native = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")
LEVELS = _native.supported_simd_levels() if _native.available() else []
CASES = {"AdamW": (rp.optim.AdamW, dict(lr=1e-3)), "Adam": (rp.optim.Adam, dict(lr=1e-3, weight_decay=0.01)),
         "SGD": (rp.optim.SGD, dict(lr=1e-2, momentum=0.9)), "Adagrad": (rp.optim.Adagrad, dict(lr=1e-2)),
         "Lion": (rp.optim.Lion, dict(lr=1e-3, weight_decay=0.1)),
         "AdamW8bit": (rp.optim.AdamW8bit, dict(lr=1e-3)), "Adam8bit": (rp.optim.Adam8bit, dict(lr=1e-3))}
SIZES = (5000, 1000, 37, 300)   # 8-bit and fp32-state tensors, odd tails


def bits(t):
    return t.detach().view(torch.int16).clone()


def run(cls, kw, rounding="stochastic", steps=3, native_core=True, seed=0, sizes=SIZES):
    """bf16 masters stepped `steps` times on the same gradients; the masters after."""
    torch.manual_seed(seed)
    ps = [nn.Parameter(torch.randn(n).bfloat16()) for n in sizes]
    grads = [[torch.randn(n).bfloat16() for n in sizes] for _ in range(steps)]
    opt = cls(ps, **kw)
    opt.master_rounding = rounding
    saved = base._native.available
    if not native_core:
        base._native.available = lambda: False
    try:
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g
            opt.step()
    finally:
        base._native.available = saved
    return ps


def test_stochastic_rounding_is_unbiased():
    """The mean of many stochastic roundings of one fp32 value is that value (not its nearest bf16)."""
    x = torch.full((1 << 16,), 1.0 + 2 ** -10)   # 1/8 of a bf16 ulp above 1
    out = torch.empty_like(x, dtype=torch.bfloat16)
    means = [round_bf16_(out, x, "stochastic", round_key(0, step, 0)).double().mean().item() for step in (1, 2, 3)]
    for m in means:   # 65,536 draws: standard error ulp * sqrt(p (1 - p) / n) ~ 1.3e-5 ulp-relative
        assert abs(m - (1.0 + 2 ** -10)) < 5e-5
    assert out.float().unique().tolist() == [1.0, 1.0078125]
    assert round_bf16_(out, x, "nearest").float().unique().tolist() == [1.0]


@native
def test_optimizer_sr_is_unbiased_over_small_updates():
    """Updates far below a bf16 ulp move a stochastically rounded master on average like the fp32 update; nearest
    rounding leaves it where it was (SGD, where the fp32 update is exact to predict)."""
    p = nn.Parameter(torch.ones(1 << 16).bfloat16())
    opt = rp.optim.SGD([p], lr=1.0)
    opt.master_rounding = "stochastic"
    for _ in range(8):
        p.grad = torch.full_like(p, 2 ** -12)   # 1/32 ulp per step
        opt.step()
    assert abs(p.double().mean().item() - (1.0 - 8 * 2 ** -12)) < 2e-4
    q = nn.Parameter(torch.ones(16).bfloat16())
    opt = rp.optim.SGD([q], lr=1.0)
    opt.master_rounding = "nearest"
    q.grad = torch.full_like(q, 2 ** -12)
    opt.step()
    assert torch.equal(q, torch.ones_like(q))


@native
@pytest.mark.parametrize("name", list(CASES))
def test_reproducible_and_torch_path_bit_identical(name):
    """Two runs give the same bits; the torch path (no native core) gives the kernel's bits, both roundings."""
    cls, kw = CASES[name]
    for rounding in ("stochastic", "nearest"):
        a, b = run(cls, kw, rounding), run(cls, kw, rounding)
        c = run(cls, kw, rounding, native_core=False)
        for x, y, z in zip(a, b, c):
            assert torch.equal(bits(x), bits(y)) and torch.equal(bits(x), bits(z)), (name, rounding)


@native
@pytest.mark.parametrize("name", list(CASES))
def test_simd_levels_bit_identical(name):
    """Scalar, AVX2 and AVX-512 give the same bf16 masters, stochastic and nearest."""
    cls, kw = CASES[name]
    before = _native.simd_level()
    try:
        for rounding in ("stochastic", "nearest"):
            outs = []
            for level in LEVELS:
                _native.set_simd_level(level)
                outs.append([bits(p) for p in run(cls, kw, rounding)])
            for other in outs[1:]:
                assert all(torch.equal(x, y) for x, y in zip(outs[0], other)), (name, rounding)
    finally:
        _native.set_simd_level(before)


@native
def test_thread_count_does_not_change_the_bits():
    """One thread or several: the same masters (the bits are keyed by element, not by stream position)."""
    threads = torch.get_num_threads()
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            outs.append([bits(p) for p in run(rp.optim.AdamW, dict(lr=1e-3), sizes=(1 << 17, 300))])
        finally:
            torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(*outs))


@native
def test_nearest_equals_torch_cast_of_the_fp32_update():
    """With nearest rounding a bf16 master equals the fp32 update of its value cast with .to(bfloat16)."""
    torch.manual_seed(1)
    p16 = nn.Parameter(torch.randn(3001).bfloat16())
    p32 = nn.Parameter(p16.detach().float())
    g = torch.randn(3001).bfloat16()
    for p in (p16, p32):
        p.grad = g.to(p.dtype)
    opt16 = rp.optim.SGD([p16], lr=0.1, momentum=0.9)
    opt16.master_rounding = "nearest"
    opt16.step()
    rp.optim.SGD([p32], lr=0.1, momentum=0.9).step()
    assert torch.equal(bits(p16), bits(p32.detach().to(torch.bfloat16)))


@native
def test_nan_and_inf_round_as_the_kernels_do():
    """NaN becomes bf16's 0x7FC0 under both roundings (rp::f32_to_bf16's NaN); inf and exact values stay."""
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -3.0])
    for r in ("stochastic", "nearest"):
        got = round_bf16_(torch.empty(4, dtype=torch.bfloat16), x, r, 123).view(torch.int16).tolist()
        assert got[:2] == [0x7FC0, 0x7FC0] or r == "nearest"
        assert got[2:] == x[2:].to(torch.bfloat16).view(torch.int16).tolist()
    p = nn.Parameter(torch.tensor([1.0, 2.0]).bfloat16())
    opt = rp.optim.SGD([p], lr=1.0)
    opt.master_rounding = "stochastic"
    p.grad = torch.tensor([float("nan"), 0.0]).bfloat16()
    opt.step()
    assert p.view(torch.int16).tolist() == [0x7FC0, p.view(torch.int16).tolist()[1]] and p[1] == 2.0


def model_layers():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(5)] + [nn.Linear(64, 4)]


def train_engine(workers, asynchronous=True, optimizer="AdamW8bit", steps=4, compute=torch.bfloat16, **kw):
    model = rp.RoundPipe(model_layers(), devices=["cpu"] * workers, num_microbatches=3,
                         compute_dtype=compute, master_dtype=torch.bfloat16, **kw)
    with model:
        opt = getattr(rp.optim, optimizer)(model.parameters(), lr=1e-2, **({"min_8bit_size": 64}
                                                                          if "8bit" in optimizer else {}))
        g = torch.Generator().manual_seed(3)
        for _ in range(steps):
            x, y = torch.randn(12, 64, generator=g), torch.randint(0, 4, (12,), generator=g)
            model.forward_backward(x, labels=y, loss_fn=F.cross_entropy)
            model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        return {k: v.clone() for k, v in model.state_dict().items()}, model.memory_stats(opt)["host"]


@native
@pytest.mark.parametrize("optimizer", ["AdamW8bit", "AdamW", "Lion"])
def test_engine_bf16_masters_are_plan_independent_and_their_own_upload_copies(optimizer):
    """RoundPipe(master_dtype=bf16): 1 and 3 workers (other stages, other threads) give identical masters with fp32
    compute (whose gradients do not depend on the plan); with bf16 compute the masters are their own upload copies
    (no separate upload bytes)."""
    one, host = train_engine(1, optimizer=optimizer, compute=torch.float32)
    three, _ = train_engine(3, optimizer=optimizer, compute=torch.float32)
    for k, v in one.items():
        assert v.dtype == torch.bfloat16, k
        assert torch.equal(bits(v), bits(three[k])), k
    assert host["upload_copies"] == sum(v.numel() * 4 for v in one.values())   # fp32 copies of bf16 masters
    masters, host = train_engine(2, optimizer=optimizer)
    assert host["upload_copies"] == 0 and all(v.dtype == torch.bfloat16 for v in masters.values())


@native
def test_engine_nearest_and_stochastic_differ_and_fp32_compute_keeps_an_fp32_copy():
    """master_rounding='nearest' gives other masters than 'stochastic'; with fp32 compute the bf16 masters get an
    fp32 upload copy written from the rounded value."""
    sr, _ = train_engine(1, asynchronous=False)
    nearest, _ = train_engine(1, asynchronous=False, master_rounding="nearest")
    assert any(not torch.equal(sr[k], nearest[k]) for k in sr)
    model = rp.RoundPipe(model_layers(), devices=["cpu"], master_dtype=torch.bfloat16, compute_dtype=torch.float32)
    with model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        model.forward_backward(torch.randn(4, 64), labels=torch.randint(0, 4, (4,)), loss_fn=F.cross_entropy)
        model.step(opt, asynchronous=False)
        for st in model.host.layers:
            for p, u in zip(st.params, st.upload):
                assert p.dtype == torch.bfloat16 and u.dtype == torch.float32 and torch.equal(p.float(), u)


@pytest.mark.parametrize("bad", [torch.float16, torch.float64, "bf16"])
def test_bad_master_dtype_is_named(bad):
    """A master_dtype other than fp32/bf16: ValueError naming it, before anything is converted."""
    layers = model_layers()
    with pytest.raises(ValueError, match=r"master_dtype=.*not supported"):
        rp.RoundPipe(layers, devices=["cpu"], master_dtype=bad)
    assert all(p.dtype == torch.float32 for layer in layers for p in layer.parameters())


def test_bad_rounding_is_named():
    with pytest.raises(ValueError, match="master_rounding='up'"):
        rp.RoundPipe(model_layers(), devices=["cpu"], master_dtype=torch.bfloat16, master_rounding="up")


@native
def test_checkpoint_of_another_master_dtype_is_refused_naming_both(tmp_path):
    """A checkpoint written with fp32 masters does not load into a bf16-master model: ValueError naming both."""
    with rp.RoundPipe(model_layers(), devices=["cpu"]) as model:
        model.save_checkpoint(str(tmp_path / "ck"))
    with rp.RoundPipe(model_layers(), devices=["cpu"], master_dtype=torch.bfloat16) as model:
        with pytest.raises(ValueError, match=r"torch.float32.*torch.bfloat16"):
            model.load_checkpoint(str(tmp_path / "ck"))


def test_hf_wrap_passes_master_dtype():
    """rp.hf.wrap(..., master_dtype=torch.bfloat16): the HF model's trainable parameters become bf16 masters and
    train with AdamW8bit."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with rp.hf.wrap(hf, devices=["cpu"], compute_dtype=torch.bfloat16, master_dtype=torch.bfloat16) as model:
        assert all(p.dtype == torch.bfloat16 for p in hf.parameters())
        opt = rp.optim.AdamW8bit(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 64, (2, 8))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        loss = model.forward_backward(input_ids=ids, labels=ids)
        model.step(opt, asynchronous=False)
        assert torch.isfinite(loss)
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_train_cli_master_dtype_flag():
    """`roundpipe train --master-dtype bf16` reaches the engine; a bad value is refused by TrainConfig."""
    from roundpipe.commands.train import TrainConfig, build_parser, config_from_args
    cfg = config_from_args(build_parser().parse_args(["--master-dtype", "bf16", "--optim", "adamw8bit"]))
    assert cfg.master_dtype == "bf16" and cfg.optim == "adamw8bit"
    with pytest.raises(ValueError, match="master_dtype='fp16'"):
        TrainConfig(master_dtype="fp16")


@native
def test_bf16_masters_resume_accumulated_fp32_gradients_from_a_checkpoint(tmp_path):
    """Two calls without a step sum their bf16 gradients into an fp32 p.grad (a bf16 master takes one);
    a checkpoint then holds it, and loading it was refused ("gradient ... is torch.float32; the parameter
    is torch.bfloat16"; found by tests/engine/test_soak_features.py).  The resumed run equals the unbroken one."""
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(12, 64, generator=g), torch.randint(0, 4, (12,), generator=g)) for _ in range(3)]

    def run(resume):
        with rp.RoundPipe(model_layers(), devices=["cpu"] * 2, num_microbatches=3, compute_dtype=torch.bfloat16,
                          master_dtype=torch.bfloat16) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            if resume:
                model.load_checkpoint(str(tmp_path / "ck"), opt)
            else:
                for x, y in data[:2]:
                    model.forward_backward(x, labels=y, loss_fn=F.cross_entropy)
                model.synchronize()
                assert any(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
                model.save_checkpoint(str(tmp_path / "ck"), opt)
            model.step(opt, asynchronous=False)
            model.forward_backward(*data[2][:1], labels=data[2][1], loss_fn=F.cross_entropy)
            model.step(opt, asynchronous=False)
            return {k: v.clone() for k, v in model.state_dict().items()}
    unbroken = run(resume=False)
    resumed = run(resume=True)
    assert all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)
