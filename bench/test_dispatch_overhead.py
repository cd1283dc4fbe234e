"""Engine overhead: `forward_backward` + `synchronize` over near-zero-cost layers on CPU workers.

bench/dispatch.py's overhead case: 16 layers y = x * w, M = 4 microbatches, one layer per
backward stage (Plan.uniform), against the same work in plain PyTorch.  The difference
over the number of stage-microbatch runs is the engine's cost per stage-microbatch;
extra_info "stage-mb" gives that count, "us/stage-mb" the total time divided by it.
"""
import copy

import dispatch
import pytest
import torch

from roundpipe.engine.model import RoundPipe
from roundpipe.planner.plan import Plan

LAYERS, M = 16, 4


@pytest.mark.parametrize("provider", ["torch", "roundpipe 1 cpu worker", "roundpipe 2 cpu workers"])
def test_forward_backward(benchmark, provider):
    layers = [dispatch.Scale() for _ in range(LAYERS)]
    x, y = torch.randn(M, 4), torch.randn(M, 4)
    plan = Plan.uniform(LAYERS)
    executions = (len(plan.forward) + len(plan.backward)) * M
    benchmark.group = f"forward_backward {LAYERS} trivial layers, M={M}"
    benchmark.extra_info["stage-mb"] = executions
    if provider == "torch":
        plain = copy.deepcopy(layers)
        benchmark(lambda: dispatch.torch_microbatches(plain, x, y, M))
    else:
        workers = int(provider.split()[1])
        with RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=M, plan=plan) as model:
            def run():
                model.forward_backward(x, labels=y, loss_fn=dispatch.mse)
                model.synchronize()
            for _ in range(3):
                run()
            benchmark(run)
    if benchmark.stats:
        benchmark.extra_info["us/stage-mb"] = benchmark.stats.stats.median / executions * 1e6
