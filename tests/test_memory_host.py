"""Host memory: nothing the engine builds outlives its use (planning copies, autograd graphs), and the
host bytes per parameter of a bf16 model with rp AdamW stay near the accounted 16-18."""
import gc
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import roundpipe as rp
from roundpipe import _native
from roundpipe.commands.train import TrainConfig
from roundpipe.engine.autoplan import size_costs
from roundpipe.models.tiny_decoder import build_layers, loss_fn


def _live(pred) -> list:
    """Live objects for which pred holds (after a collection)."""
    gc.collect()
    with warnings.catch_warnings():   # isinstance on deprecated torch.distributed aliases warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if pred(o)]


def _graph_tensors() -> int:
    """Live tensors that carry an autograd graph (grad_fn)."""
    return len(_live(lambda o: isinstance(o, torch.Tensor) and o.grad_fn is not None))


def _decoder(seed: int = 0):
    cfg = TrainConfig(size="tiny", devices=["cpu"], seq_len=32, batch_size=2).resolved()
    return build_layers(cfg.model_config(), seed=seed)


def test_dry_run_keeps_no_layer_copies():
    """The planner's CPU dry run (bf16 copies of every layer, one forward with grad) leaves no autograd
    graph and no layer copy behind (its saved-tensor hook once packed each tensor as itself: a cycle
    through the graph that gc cannot see, keeping the copies' weights alive for good)."""
    torch.manual_seed(0)
    layers = _decoder()
    x = torch.randint(0, 256, (2, 32))
    before = _graph_tensors()
    costs = size_costs(layers, ((x,), {}), torch.bfloat16, "cpu")
    assert len(costs) == len(layers) and all(c.act_bytes > 0 for c in costs)
    assert _graph_tensors() == before


def test_no_graph_or_weight_copy_after_synchronize():
    """After calls and steps and a sync point, no tensor with an autograd graph is alive and no compute-dtype
    Parameter (a worker's or the planner's layer copy) either."""
    torch.manual_seed(0)
    layers = _decoder()
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.bfloat16) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            model.forward_backward(x, labels=y, loss_fn=loss_fn)
            model.step(opt, asynchronous=True)
        model.synchronize()
        assert _graph_tensors() == 0
        assert not _live(lambda o: isinstance(o, torch.nn.Parameter) and o.dtype == torch.bfloat16)


_RSS_CHILD = r'''
import json, sys
import torch
import roundpipe as rp
from roundpipe.models.tiny_decoder import DecoderConfig, build_layers, loss_fn
asynchronous, depth = sys.argv[1] == "async", int(sys.argv[2])
from roundpipe.bench.rss import peak_rss as peak, rss_file
torch.manual_seed(0)
x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
base, base_file = peak(), rss_file()
layers = build_layers(DecoderConfig(hidden=1024, layers=depth, heads=16), seed=0)
n = sum(p.numel() for l in layers for p in l.parameters())
with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.bfloat16) as model:
    opt = rp.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(3):
        model.forward_backward(x, labels=y, loss_fn=loss_fn)
        if i == 2:
            host = model.memory_stats(opt)["host"]
        model.step(opt, asynchronous=asynchronous)
    model.synchronize()
    held = sum(s["peak_total"] for s in model.memory_stats()["workers"].values())
accounted = host["masters"] + host["optimizer_state"] + host["arena_reserved"]
print("RESULT " + json.dumps({"params": n, "rss": peak() - base, "code": rss_file() - base_file, "held": held,
                              "accounted": accounted}))
'''


def _rss_run(mode: str, layers: int) -> dict:
    # glibc's mmap threshold fixed at 1 MiB: the CPU workers' released "device" buffers go back to the system
    # instead of staying in their threads' malloc heaps (bench/memory.py measures both ways)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, mode, str(layers)], capture_output=True, text=True, timeout=300,
                          env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _native.available(),
                    reason="reads /proc and glibc's MALLOC_MMAP_THRESHOLD_; needs the native arena")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_host_bytes_per_param_by_peak_rss(mode):
    """bf16 decoders with rp AdamW on 2 CPU workers, each in its own process: peak RSS minus the workers'
    ledger peaks (device memory on a GPU) and library code paged in grows by at most 20 bytes per added
    parameter (2 -> 10 layers of width 1024, 25M -> 101M parameters; the slope leaves out the fixed
    100-220 MB of threads, code and arena chunk slack, which vary by +-50 MB from run to run).  Measured
    2026-11-25 on a 2-core EPYC: 16.7 sync and async (4 -> 8 layers: 14.8-16.5 sync, 17.7-18.3 async);
    the accounted slope is 16 (fp32 master 4, Adam 8, bf16 upload copy 2, bf16 gradient 2)."""
    small, large = _rss_run(mode, 2), _rss_run(mode, 10)
    host = lambda r: r["rss"] - r["held"] - r["code"]   # noqa: E731
    slope = (host(large) - host(small)) / (large["params"] - small["params"])
    assert slope <= 20, (slope, small, large)


_NORM_CHILD = r'''
import json, torch
from roundpipe.engine.optimizer_step import NORM_CHUNK, clip_coefficient
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
torch.manual_seed(0)
g = torch.randn(5 * NORM_CHUNK // 2 + 123).bfloat16()
small = torch.randn(1000).bfloat16()
clip_coefficient([small], 1.0)   # warm-up: kernels and thread pools paged in
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")   # resets VmHWM to the current RSS
before = hwm()
coef = clip_coefficient([g, small], 1.0)
grown = hwm() - before
whole = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in (g, small)]))
torch_coef = float(torch.clamp(1.0 / (whole + 1e-6), max=1.0))   # the one-piece fp32 norm, as before
exact = 1.0 / (float(torch.cat([g, small]).double().norm()) + 1e-6)
print("RESULT " + json.dumps({"grown": grown, "numel": g.numel(), "chunk": NORM_CHUNK, "coef": coef,
                              "torch": torch_coef, "exact": exact}))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_clip_norm_of_held_gradients_upcasts_in_pieces():
    """max_grad_norm over held bf16 gradients reads a large gradient in fp32 pieces of at most NORM_CHUNK
    elements (vector_norm(g, dtype=float32) upcast the whole tensor first: 4 bytes per element during the
    step), and the factor is at least as close to the float64 one as the one-piece fp32 norm's (over 42M
    elements that one is 3e-3 off, the pieces 3e-4: fp32 sums of fewer terms)."""
    proc = subprocess.run([sys.executable, "-c", _NORM_CHILD], capture_output=True, text=True, timeout=120)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    assert r["grown"] <= 4 * r["chunk"] + (16 << 20), r   # one fp32 piece (the whole tensor: 2.5x that)
    assert abs(r["coef"] - r["exact"]) <= abs(r["torch"] - r["exact"]), r
