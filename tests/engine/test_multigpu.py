"""Two GPUs: cross-device hand-offs, GPU-resident inputs on a non-zero GPU, no context on GPU 0.

Skipped without two CUDA GPUs (`multigpu` marker); `bash scripts/gpu-check.sh multigpu` runs them.
Each checks against plain PyTorch on the CPU in fp32 (the engine computes in fp32 here too).
"""
import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from rp_models import InPlaceFirst, max_rel_err

import roundpipe as rp

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]


def _grads_error(devices, input_device, calls=3):
    torch.manual_seed(0)
    layers = [InPlaceFirst(64) for _ in range(8)]
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    batches = [(torch.randn(32, 64), torch.randn(32, 64)) for _ in range(calls)]
    for x, y in batches:
        F.mse_loss(ref(x.clone()), y).backward()
    with rp.RoundPipe(layers, devices=devices, num_microbatches=4, compute_dtype=torch.float32) as model:
        buf = torch.empty(32, 64, device=input_device)
        for x, y in batches:
            buf.copy_(x, non_blocking=True)
            model.forward_backward(buf, labels=y, loss_fn=F.mse_loss)
            buf.fill_(float("nan"))   # the call owns a snapshot: refilling the caller's buffer changes nothing
        model.synchronize()
        return max(max_rel_err(p.grad.cpu(), q.grad) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("input_device", ["cpu", "cuda:1"])
def test_cross_device_handoffs_and_gpu_inputs_match_pytorch(input_device):
    """Stages alternate between cuda:0 and cuda:1 (every boundary crosses devices), in-place first ops,
    inputs on the CPU or already on cuda:1 and refilled after each call: gradients equal PyTorch's."""
    assert _grads_error(["cuda:0", "cuda:1"], input_device) <= 1e-4


def test_no_context_on_gpu0_for_a_model_on_gpu1():
    """A model whose only worker is cuda:1 pins its arena in cuda:1's context: GPU 0 gets none (issue 26
    part 2, item 4), read from the driver in a fresh process."""
    code = textwrap.dedent("""
        import ctypes, torch, torch.nn as nn, torch.nn.functional as F
        import roundpipe as rp
        cu = ctypes.CDLL("libcuda.so.1")
        assert cu.cuInit(0) == 0
        layers = [nn.Linear(64, 64) for _ in range(4)]
        with rp.RoundPipe(layers, devices=["cuda:1"]) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(2):
                model.forward_backward(torch.randn(16, 64), labels=torch.randn(16, 64), loss_fn=F.mse_loss)
                model.step(opt, asynchronous=True)
            model.synchronize()
        dev = ctypes.c_int()
        assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
        flags, active = ctypes.c_uint(), ctypes.c_int()
        assert cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
        print("GPU0_ACTIVE", active.value)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "GPU0_ACTIVE 0" in out.stdout, out.stdout
