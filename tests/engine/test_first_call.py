"""The first `forward_backward` costs about a plain forward+backward: nothing on its path imports
torch._dynamo (1-3 s on a 2-core CPU; see roundpipe/engine/autoplan.py's `size_costs`), Triton, or sympy
with torch.fx.experimental.symbolic_shapes (0.6 s; roundpipe/engine/calls/compute.py's `autograd_backward`).
Timings are bench/dispatch.py's and bench/first_call.py's job; these tests check the cause, in fresh
interpreters."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FIRST_CALL = """
import json, sys
import torch
import roundpipe as rp
from roundpipe.models.tiny_decoder import build_layers, loss_fn
from roundpipe.commands.train import TrainConfig

cfg = TrainConfig(devices=["cpu"]).resolved()
layers = build_layers(cfg.model_config(), seed=0)
x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len))
after = {}
with rp.RoundPipe(layers, devices=cfg.devices * int(sys.argv[1])) as model:
    after["import and construction"] = "torch._dynamo" in sys.modules
    model.forward_backward(x, labels=torch.roll(x, -1, 1), loss_fn=loss_fn)
    model.synchronize()
    after["first call"] = "torch._dynamo" in sys.modules
    after["triton"] = "triton" in sys.modules
    after["sympy"] = "sympy" in sys.modules or "torch.fx.experimental.symbolic_shapes" in sys.modules
    after["planned from the dry run"] = model.autoplan.profiler is not None
print(json.dumps(after))
"""


class Scripts:
    """The module's fresh interpreters, all started at once (most of each is its single-threaded imports; each
    reads only its own sys.modules); `result(key)` waits for one and returns its last stdout line as JSON."""

    def __init__(self, scripts: dict):
        self.procs = {key: subprocess.Popen([sys.executable, "-c", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True) for key, argv in scripts.items()}
        self.done: dict = {}

    def result(self, key):
        if key not in self.done:
            self.done[key] = self.procs[key].communicate(timeout=300)
        stdout, stderr = self.done[key]
        assert self.procs[key].returncode == 0, stderr
        return json.loads(stdout.splitlines()[-1])

    def close(self):
        for proc in self.procs.values():
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def scripts():
    runs = Scripts({1: [FIRST_CALL, "1"], 2: [FIRST_CALL, "2"], "mlp": [MLP_FIRST_CALL]})
    yield runs
    runs.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_first_call_does_not_import_dynamo(workers, scripts):
    """Importing roundpipe, building a RoundPipe and its first forward_backward (default `roundpipe train`
    model, the partitioner's plan from the dry run) leave torch._dynamo, Triton (0.45 s) and sympy unimported."""
    assert scripts.result(workers) == {
        "import and construction": False, "first call": False, "triton": False, "sympy": False,
        "planned from the dry run": True}


MLP_FIRST_CALL = """
import json, sys
import torch
from torch import nn
import roundpipe as rp

torch.manual_seed(0)
layers = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(8)]
x, y = torch.randn(8, 32), torch.randn(8, 32)
with rp.RoundPipe(layers, devices=["cpu"]) as model:
    model.forward_backward(x, labels=y, loss_fn=lambda out, labels: ((out - labels) ** 2).mean())
    model.synchronize()
    grads = all(p.grad is not None for p in model.parameters())
print(json.dumps({"grads": grads, **{m: m in sys.modules for m in ("sympy", "torch.fx.experimental.symbolic_shapes")}}))
"""


def test_first_call_does_not_import_sympy(scripts):
    """The first forward_backward of an 8-layer MLP (memory probe, stage backward with explicit output gradients)
    leaves sympy and torch.fx.experimental.symbolic_shapes unimported (torch.autograd's gradient check imports
    them: 0.6 s)."""
    assert scripts.result("mlp") == {
        "grads": True, "sympy": False, "torch.fx.experimental.symbolic_shapes": False}
