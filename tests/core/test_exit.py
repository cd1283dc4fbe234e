"""Process exit without close(): every run of a training script must end with its own status.

Before the fix a script ending with an asynchronous step pending aborted with "terminate
called without an active exception" (status 134) in about half of its runs: an engine thread
still inside torch when the interpreter finalized was killed while it reacquired the GIL
(roundpipe/core/executor.py).  Each scenario's script runs 20 times, in children forked from a
launcher that has already imported torch (and, for torch optimizers, torch._dynamo): a fresh
interpreter spends ~2-6 s there, so 66 fresh runs would take minutes.  Each child runs its
script as `__main__` and leaves through the ordinary interpreter exit (atexit, finalization),
as `python script.py` does; that exit (~0.5 s of torch teardown) is most of a run's cost.
Before the fix, on the 2-core CI VM: training 7-18 of 20 runs aborted, layer error 5-14 of 20,
Ctrl-C 11 of 20 (caught) and 4 of 6 (uncaught).  The two launchers run side by side; the
module takes ~80 s of CPU, ~40 s on an idle 2-core machine.
"""
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.core.executor import SerialExecutor

LINUX = sys.platform.startswith("linux") and os.path.isdir("/proc/self/task")

LAUNCHER = '''
import json, os, runpy, signal, sys

# a shell starting pytest in the background (`cmd &`) leaves SIGINT ignored, and an ignored signal stays
# ignored across exec: the Ctrl-C scenarios need Python's own handler
signal.signal(signal.SIGINT, signal.default_int_handler)

import torch
import torch.nn.functional
import roundpipe.engine.model, roundpipe.offload, roundpipe.optim

out, warm, jobs = sys.argv[1], sys.argv[2], sys.argv[3:]
if warm == "optim":   # a torch optimizer imports torch._dynamo (~5 s): once, here
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
assert len(os.listdir("/proc/self/task")) == 1, "fork needs a single-threaded parent"
runs = []
for job in jobs:                                   # script:count[:arg,arg]
    script, count, *args = job.split(":")
    runs += [(script, args[0].split(",") if args else [])] * int(count)
statuses = []
for n, (script, args) in enumerate(runs):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.path.join(out, f"{n}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)
        sys.argv = [script] + args
        runpy.run_path(script, run_name="__main__")   # then this interpreter exits like `python script`
        break
    statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
else:
    print(json.dumps(statuses))
'''

TRAIN = '''
"""Three models, synchronous and asynchronous steps, no close(): two end with a step pending, one is dropped."""
import gc
import torch
import torch.nn.functional as F
from torch import nn
import roundpipe as rp

torch.manual_seed(0)
d = 256
x, y = torch.randn(8, d), torch.randn(8, d)
models = [rp.RoundPipe([nn.Linear(d, d) for _ in range(4)], devices=["cpu", "cpu"]) for _ in range(3)]
opts = [rp.optim.AdamW(models[0].parameters(), lr=1e-3)]
opts += [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models[1:]]
for m, opt in zip(models, opts):
    for asynchronous in (False, True):
        m.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        m.step(opt, asynchronous=asynchronous)
del m, opt, models[2], opts[2]
gc.collect()
'''

LAYER_ERROR = '''
"""A layer raises in the call after an asynchronous step; the script catches it and ends."""
import torch
import torch.nn.functional as F
from torch import nn
import roundpipe as rp

ARMED = [False]

class Boom(nn.Linear):
    def forward(self, x):
        if ARMED[0]:
            raise ValueError("boom")
        return super().forward(x)

torch.manual_seed(0)
d = 512
x, y = torch.randn(8, d), torch.randn(8, d)
m = rp.RoundPipe([nn.Linear(d, d), nn.Linear(d, d), Boom(d, d), nn.Linear(d, d)], devices=["cpu", "cpu"])

def sgd():
    for p in m.parameters():
        p.add_(p.grad, alpha=-1e-3)

m.forward_backward(x, labels=y, loss_fn=F.mse_loss)
m.step(sgd, asynchronous=True)
ARMED[0] = True
try:
    m.forward_backward(x, labels=y, loss_fn=F.mse_loss)
except ValueError:
    pass
else:
    raise SystemExit("the layer did not raise")
'''

CTRL_C = '''
"""SIGINT to the process during training (a Timer: anywhere; in-step: while the optimizer runs)."""
import os, random, signal, sys, threading, time
import torch
import torch.nn.functional as F
from torch import nn
import roundpipe as rp

class Slow(nn.Linear):
    def forward(self, x):
        time.sleep(0.002)
        return super().forward(x)

torch.manual_seed(0)
d = 1024
x, y = torch.randn(8, d), torch.randn(8, d)
m = rp.RoundPipe([Slow(d, d) for _ in range(4)], devices=["cpu", "cpu"])
ctrl_c = lambda *_: os.kill(os.getpid(), signal.SIGINT)
steps, momentum = [0], {}

def sgd():   # SGD with momentum and weight decay, as a zero-argument callable
    steps[0] += 1
    if steps[0] == 3 and "in-step" in sys.argv:   # lands while this step runs on the engine's host thread
        ctrl_c()
    for p in m.parameters():
        buf = momentum.setdefault(p, torch.zeros_like(p))
        buf.mul_(0.9).add_(p.grad).add_(p, alpha=1e-2)
        p.add_(buf, alpha=-1e-3)

try:
    for i in range(300):
        m.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        m.step(sgd, asynchronous=i % 2 == 0)
        if i == 0 and "in-step" not in sys.argv:   # after the first call's planning, which runs layers here
            threading.Timer(random.uniform(0.02, 0.15), ctrl_c).start()
    raise SystemExit("no KeyboardInterrupt arrived")
except KeyboardInterrupt:
    if "propagate" in sys.argv:
        raise
'''

# scenario -> (launcher warm-up, jobs); the two launchers run side by side
JOBS = {
    "train": ("optim", ["train.py:20"]),
    "layer_error": ("plain", ["layer_error.py:20"]),
    "ctrl_c": ("plain", ["ctrl_c.py:10", "ctrl_c.py:10:in-step"]),
    "ctrl_c_propagated": ("plain", ["ctrl_c.py:3:propagate", "ctrl_c.py:3:in-step,propagate"]),
}


@pytest.fixture(scope="module")
def exits(tmp_path_factory) -> dict[str, list[tuple[int, str]]]:
    """Runs every scenario's script in forked children; scenario -> [(exit status, output)]."""
    d = tmp_path_factory.mktemp("exit")
    for name, text in (("launcher.py", LAUNCHER), ("train.py", TRAIN), ("layer_error.py", LAYER_ERROR),
                       ("ctrl_c.py", CTRL_C)):
        (d / name).write_text(text)
    root = Path(__file__).resolve().parents[2]
    # OMP_NUM_THREADS=1: the two launchers' children train side by side on a small machine, and OpenMP
    # teams that spin at full count in two processes at once (roundpipe/core/omp.py) starve each
    # other: the module took over 280 s instead of ~90 on the 2-core CI VM
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",   # numpy's BLAS would start a thread before the fork
               PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    procs = {}
    for warm in ("optim", "plain"):
        (d / warm).mkdir()
        jobs = [j for w, js in JOBS.values() if w == warm for j in js]
        procs[warm] = subprocess.Popen([sys.executable, "launcher.py", warm, warm, *jobs], cwd=d, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = {}
    for warm, proc in procs.items():
        text = proc.communicate(timeout=280)[0]
        assert proc.returncode == 0, text
        statuses = json.loads(text.strip().splitlines()[-1])
        runs[warm] = [(s, (d / warm / f"{n}.txt").read_text()) for n, s in enumerate(statuses)]
    out = {}
    for name, (warm, js) in JOBS.items():
        count = sum(int(j.split(":")[1]) for j in js)
        out[name], runs[warm] = runs[warm][:count], runs[warm][count:]
    return out


def _check(runs: list[tuple[int, str]], status: int) -> None:
    bad = [(i, s, text[-400:]) for i, (s, text) in enumerate(runs)
           if s != status or "terminate called" in text or "Fatal Python error" in text]
    assert not bad, f"{len(bad)} of {len(runs)} runs did not exit with status {status}: {bad[:3]}"


needs_fork = pytest.mark.skipif(not LINUX, reason="forks children from a launcher and reads /proc (Linux only)")


@needs_fork
def test_training_script_exits_without_close(exits):
    """20 runs of a script ending with steps pending (rp and torch AdamW, one model dropped) exit with 0."""
    _check(exits["train"], 0)


@needs_fork
def test_exit_after_an_exception_in_a_layer(exits):
    """20 runs of a script whose layer raised (caught) with a step pending exit with 0."""
    _check(exits["layer_error"], 0)
    assert all(text == "" for _, text in exits["layer_error"])


@needs_fork
def test_exit_after_ctrl_c(exits):
    """20 runs interrupted by SIGINT (in a call, in a step) that catch KeyboardInterrupt and end exit with 0."""
    _check(exits["ctrl_c"], 0)


@needs_fork
def test_exit_after_uncaught_ctrl_c(exits):
    """An uncaught KeyboardInterrupt ends the process by SIGINT, as for any Python script, never by an abort."""
    _check(exits["ctrl_c_propagated"], -signal.SIGINT)
    assert all(text.rstrip().endswith("KeyboardInterrupt") for _, text in exits["ctrl_c_propagated"])


def test_dropped_model_applies_its_pending_step_and_stops_its_threads():
    """A RoundPipe dropped with an asynchronous step pending is collected; the step runs, its threads exit."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(3)]
    m = rp.RoundPipe(layers, devices=["cpu", "cpu"])
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    opt = rp.optim.AdamW(m.parameters(), lr=0.1)   # per-layer updates: each waits for the stale window
    before = layers[0].weight.detach().clone()
    m.forward_backward(x, labels=y, loss_fn=F.mse_loss)
    m.step(opt, asynchronous=True)   # its window waits for a next call that never comes
    threads = [t._thread for t in m._host_threads()] + [e._thread for w in m.workers for e in w.executors()]
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None, "a queued job keeps the model alive"
    for t in threads:
        t.join(10)
    assert not [t.name for t in threads if t.is_alive()]
    assert not torch.equal(layers[0].weight, before), "the pending step was dropped"


def test_submit_after_stop_raises():
    """Work handed to a stopped engine thread raises instead of waiting forever."""
    e = SerialExecutor("test-stopped")
    ran = threading.Event()
    e.submit(ran.set)
    e.close()
    assert ran.is_set()
    with pytest.raises(RuntimeError, match="test-stopped.*has stopped"):
        e.submit(ran.set)
    e.wait_idle()
