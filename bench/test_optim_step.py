"""The fused optimizer steps against torch's, per parameter count (bench/cpu_optim.py's providers).

Per optimizer (AdamW, SGD with momentum, Adagrad, Lion): (a) torch's bf16-gradient sequence,
(b) foreach and (b') fused fp32 steps (where torch has them), (c) roundpipe's one-pass bf16 step
writing the bf16 upload copy, (c') roundpipe fp32.  extra_info "Mparam/s" is parameters updated
per second at the median time.
"""
import cpu_optim
import pytest

SIZES = [1 << 20, 4 << 20]
PROVIDERS = {
    "(a) torch seq bf16": lambda b: b.torch_seq,
    "(b) torch foreach fp32": lambda b: b.torch_foreach.step,
    "(b') torch fused fp32": lambda b: b.torch_fused.step if b.torch_fused is not None else None,
    "(c) roundpipe bf16": lambda b: b.ours_bf16,
    "(c') roundpipe fp32": lambda b: b.ours_fp32,
}


@pytest.fixture(scope="module", params=[(name, n) for name in cpu_optim.OPTIMIZERS for n in SIZES],
                ids=lambda p: f"{p[0]}-{p[1] >> 20}M")
def state(request):
    name, n = request.param
    return name, n, cpu_optim.Bench(n, name)


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_optimizer_step(benchmark, rate, state, provider):
    name, n, bench = state
    fn = PROVIDERS[provider](bench)
    if fn is None:
        pytest.skip(f"torch has no fused {name}")
    benchmark.group = f"{name} step {n >> 20}M params"
    benchmark(fn)
    rate(n / 1e6, "Mparam/s")
