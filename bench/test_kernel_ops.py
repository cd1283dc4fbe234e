"""roundpipe.kernels against eager PyTorch, forward and forward+backward (bench/kernels.py's cases).

On a GPU: bf16 at small Qwen3-8B-like sizes (tokens 1024).  Without one: fp32 at
bench/kernels.py's CPU sanity sizes under the Triton interpreter (TRITON_INTERPRET=1
from conftest), which checks that every provider runs; those timings are the
interpreter's, not the kernels'.  extra_info "path" says which code ran.
"""
import pytest
import torch

import kernels as programs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SIZES = programs.Sizes(tokens=1024, lce_tokens=(1024,)) if CUDA else programs.CPU_SANITY
OPS = ["rms_norm", "swiglu", "rope", "lce"]
PARAMS = [(op, name, p) for op in OPS for name in programs.providers(op, False, None) for p in ("fwd", "fwd+bwd")]


@pytest.fixture(scope="module")
def cases():
    made = programs.cases(OPS, DEVICE, SIZES, torch.bfloat16 if CUDA else torch.float32)
    return {c.op: c for c in reversed(made)}   # the first (smallest) case of each op


def _path(provider: str) -> str:
    from roundpipe.kernels import _triton

    if provider == "eager":
        return "eager"
    if not _triton.available():
        return f"reference ({_triton.unavailable_reason()})"
    return "interpreter" if _triton.interpreting() else "compiled"


@pytest.mark.parametrize("op, provider, pass_name", PARAMS)
def test_kernel(benchmark, rate, cases, op, provider, pass_name):
    case = cases[op]
    run = programs.passes(programs.providers(op, False, None)[provider], case)[pass_name]
    benchmark.group = f"{case.label} {pass_name}"
    benchmark.extra_info["path"] = _path(provider)
    if CUDA:
        benchmark(lambda: (run(), torch.cuda.synchronize()))
    else:   # interpreted: a call takes tens of ms, so a few rounds
        benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    rate(case.work[pass_name] / (1e9 if case.unit == "GB/s" else 1e12), case.unit)
