"""The fused AdamW step against torch's, per parameter count (bench/cpu_adam.py's providers).

(a) torch's bf16-gradient sequence, (b) foreach and (b') fused fp32 steps, (c) roundpipe's
one-pass bf16 step writing the bf16 upload copy, (c') roundpipe fp32.  extra_info
"Mparam/s" is parameters updated per second at the median time.
"""
import pytest

import cpu_adam

SIZES = [1 << 20, 4 << 20]
PROVIDERS = {
    "(a) torch seq bf16": lambda b: b.torch_seq,
    "(b) torch foreach fp32": lambda b: b.torch_foreach.step,
    "(b') torch fused fp32": lambda b: b.torch_fused.step,
    "(c) roundpipe bf16": lambda b: b.ours_bf16,
    "(c') roundpipe fp32": lambda b: b.ours_fp32,
}


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"{n >> 20}M")
def state(request):
    return request.param, cpu_adam.Bench(request.param)


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_adamw_step(benchmark, rate, state, provider):
    n, bench = state
    benchmark.group = f"adamw step {n >> 20}M params"
    benchmark(PROVIDERS[provider](bench))
    rate(n / 1e6, "Mparam/s")
