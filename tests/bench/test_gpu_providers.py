"""bench/gpu_providers.py without a GPU: the exposed step's measurement, and the published RoundPipe's row set up
alike to the others (no HF checkpointing on top of its own recompute, its planner held to the cap), run on the CPU
against a stand-in of the published API that records what it is given."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "scripts" / "gpu-bench.sh").is_file())
sys.path.insert(0, str(REPO / "bench"))

from gpu_plan import GiB, workloads  # noqa: E402


@pytest.fixture
def providers(monkeypatch):
    """bench/gpu_providers.py as a module (it takes bench/ off sys.path when loaded: restored after the test)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("gpu_providers_under_test", REPO / "bench" / "gpu_providers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_exposed_step_compares_iterations_with_and_without_the_step(providers):
    """Iterations of 30 ms with the step and 10 ms without (sleeps): the per-iteration times add up to the block's
    wall time, at least 5 each way are taken (the row timed 2: a fresh block), and the step adds ~20 ms."""
    step = lambda i: time.sleep(0.03)   # noqa: E731
    alone = lambda i: time.sleep(0.01)   # noqa: E731
    t0 = time.perf_counter()
    _, seconds = providers.iterations(step, 2, lambda: None)
    assert len(seconds) == 2 and abs(sum(seconds) - (time.perf_counter() - t0)) < 0.01
    est = providers.exposed_step(seconds, step, alone, lambda: None)
    assert est["samples"] == 5 and len(est["with_step_s"]) == len(est["without_s"]) == 5
    assert not est["within_noise"] and 0.015 < est["seconds"] < 0.03, est


def test_plan_against_cap_passes_the_caps_share(providers):
    """A class shaped as the published ModelExecutePlan (auto's model_memory_limit defaults to 0.6 x the card's free
    GiB, read at import): calls without a limit now get 0.6 x the cap, its recursive calls too, an explicit limit is
    kept; a full-card row (no cap) leaves the planner as it is."""
    seen = []

    class Plan:
        @classmethod
        def auto(cls, run_type, *models, min_stages=1, upper_threshold=1.1, model_memory_limit=47.4):
            seen.append(model_memory_limit)
            if len(models) > 1:
                return [cls.auto(run_type, m, min_stages=min_stages) for m in models]
            return run_type

    assert providers.plan_against_cap(Plan, None) is None and Plan.auto("fused", "m") == "fused" and seen == [47.4]
    seen.clear()
    assert providers.plan_against_cap(Plan, 24 * GiB) == pytest.approx(14.4)
    assert Plan.auto("fused", "m") == "fused" and Plan.auto("train", "a", "b") == ["train", "train"]
    Plan.auto("infer", "m", model_memory_limit=3.0)
    assert seen == [pytest.approx(14.4)] * 4 + [3.0]


STAND_IN = '''
"""A stand-in of the published RoundPipe 0.1.1's API, as bench/gpu_providers.py run_published calls it."""
import json, os, types

import torch

RECORD = {"plans": []}


class RoundPipeRunConfig:
    def __init__(self, **options):
        self.options = options


class ModelExecutePlan:
    @classmethod
    def auto(cls, run_type, *models, min_stages=1, upper_threshold=1.1, model_memory_limit=47.4):
        RECORD["plans"].append(model_memory_limit)


class _Wrapped:
    def __init__(self, hf):
        self.hf = hf

    def optim_parameters(self):
        return self.hf.parameters()

    def forward_backward(self, input_kwargs, loss_fn):
        ModelExecutePlan.auto("fused", self)   # as its forward_backward plans: without model_memory_limit
        kwargs = {k: v for k, v in input_kwargs.items() if k != "return_logits"}
        loss = loss_fn(self.hf(**kwargs), None)
        loss.backward()
        with open(os.environ["STAND_IN_RECORD"], "w") as f:
            json.dump(RECORD, f)
        return loss

    def step(self, update):
        update()

    def synchronize(self):
        pass


def wrap_model_to_roundpipe(hf, *, optim_dtype, use_sequential_preset, model_run_config):
    RECORD.update(hf_checkpointing=hf.is_gradient_checkpointing, config=model_run_config.options,
                  preset=use_sequential_preset)
    return _Wrapped(hf)


optim = types.SimpleNamespace(Adam=lambda params, lr, weight_decay: torch.optim.Adam(params, lr=lr,
                                                                                    weight_decay=weight_decay))
'''


@pytest.mark.slow
def test_published_row_adds_no_hf_checkpointing_and_plans_against_the_cap(tmp_path):
    """The published RoundPipe's row, run by the provider script on the CPU against the stand-in: the model it wraps
    has HF gradient checkpointing off (its own per-stage recompute is the only one), its run config asks for the
    stage grain, and every plan its forward_backward makes is given 0.6 x the 24 GiB cap; the row says 14.4 GiB."""
    peer = tmp_path / "peer"
    (peer / "roundpipe").mkdir(parents=True)
    (peer / "roundpipe" / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    record = tmp_path / "record.json"
    spec = {"provider": "roundpipe-0.1.1", "hf_config": workloads(True)[0].shape.hf_config(), "seed": 0,
            "device": "cpu", "batch": 2, "seq": 16, "warmup": 1, "steps": 1, "lr": 1e-4, "cap": 24 * GiB,
            "peer_path": str(peer), "threads": 1}
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_providers.py"), json.dumps(spec)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={"PYTHONPATH": str(peer), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                              "STAND_IN_RECORD": str(record)})
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, run.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert "error" not in result and result["tokens_per_s"] > 0, run.stderr[-3000:]
    assert result["planned_gib"] == pytest.approx(14.4)
    seen = json.loads(record.read_text())
    assert seen["hf_checkpointing"] is False and seen["preset"] is True
    assert seen["config"] == {"num_microbatch": 2, "recompute_grain": "stage"}
    assert seen["plans"] and all(x == pytest.approx(14.4) for x in seen["plans"]), seen["plans"]
