"""The peers' wheels for the GPU benchmark (scripts/fetch-peers.sh's .whl/peers/): they are for the device's
Python 3.12, need nothing the device image (bench/gpu_device_packages.txt) lacks, and the published RoundPipe's
folder installs as gpu-bench.sh installs it and brings the transformers it was written for.

Skipped where .whl/peers/ was never filled (it needs PyPI: `bash scripts/fetch-peers.sh`)."""
from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = next(p for p in Path(__file__).resolve().parents if (p / "scripts" / "gpu-bench.sh").is_file())
PEERS = REPO / ".whl" / "peers"
FOLDERS = sorted(d for d in PEERS.iterdir() if d.is_dir()) if PEERS.is_dir() else []
DEVICE = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": ""}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"]
pytestmark = pytest.mark.skipif(not FOLDERS, reason="no .whl/peers/: run `bash scripts/fetch-peers.sh` (needs PyPI)")


def device_packages() -> set[str]:
    lines = (REPO / "bench" / "gpu_device_packages.txt").read_text().splitlines()
    return {canonicalize_name(x.split("==")[0]) for x in lines if x.strip() and not x.startswith("#")}


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


@pytest.mark.parametrize("folder", FOLDERS, ids=[d.name for d in FOLDERS])
def test_peer_wheels_fit_the_device_python_and_packages(folder):
    """Every wheel installs on CPython 3.12 for x86-64 Linux, one version of each, and each requirement (markers
    read for the device) is another wheel of the folder or a package of the device image."""
    tags = set(cpython_tags((3, 12), platforms=PLATFORMS)) | set(compatible_tags((3, 12), "cp312", PLATFORMS))
    wheels = sorted(folder.glob("*.whl"))
    names = [parse_wheel_filename(w.name)[0] for w in wheels]
    assert len(names) == len(set(names)), f"two versions of one package stop the install: {names}"
    for w in wheels:
        assert parse_wheel_filename(w.name)[3] & tags, f"{w.name} does not install on the device's Python 3.12"
    have = set(names) | device_packages()
    missing = []
    for w in wheels:
        for line in metadata(w).get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(DEVICE):
                if canonicalize_name(req.name) not in have:
                    missing.append(f"{w.name} needs {line}")
    assert not missing, missing


@pytest.mark.slow
def test_published_roundpipe_folder_brings_its_own_transformers(tmp_path):
    """Installed as gpu-bench.sh does (--no-index --no-deps --target), the published RoundPipe's folder resolves
    `roundpipe` to itself and `transformers` to 4.57, whose create_causal_mask takes the input_embeds and
    cache_position its Qwen3 preset passes.  Neither the peer's roundpipe nor its presets are imported here."""
    folder = next((d for d in FOLDERS if d.name.startswith("roundpipe-")), None)
    if folder is None:
        pytest.skip("no roundpipe-* peer folder")
    target = tmp_path / "target"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", str(target), *map(str, folder.glob("*.whl"))], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    code = ("import importlib.util as u, inspect, transformers\n"
            "from transformers.masking_utils import create_causal_mask\n"
            "print(u.find_spec('roundpipe').origin)\n"
            "print(transformers.__version__, transformers.__file__)\n"
            "print(' '.join(inspect.signature(create_causal_mask).parameters))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    origin, version, params = out.stdout.splitlines()[-3:]
    assert Path(origin).resolve().is_relative_to(target.resolve()), origin
    assert version.startswith("4.57.") and str(target) in version, version
    assert {"input_embeds", "cache_position"} <= set(params.split()), params
    # the benchmark's own model building and training under that transformers, in a process whose path is
    # the peer's folder (as its row's is): plain PyTorch with checkpointing, one step on the CPU.  Run as a
    # script, bench/ must not be on the path: transformers would import bench/kernels.py as HF's `kernels`,
    # and that imports `roundpipe`, the peer's in this process
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_plan import workloads

    spec = {"provider": "torch-ckpt", "hf_config": workloads(True)[0].shape.hf_config(), "seed": 0, "device": "cpu",
            "batch": 2, "seq": 16, "warmup": 1, "steps": 1, "lr": 1e-4}
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_providers.py"), json.dumps(spec)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    result = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert "error" not in result and result["tokens_per_s"] > 0, run.stderr[-2000:]


def published_source(name: str) -> ast.Module:
    """roundpipe/<name> from the published RoundPipe's wheel, parsed (never imported)."""
    folder = next((d for d in FOLDERS if d.name.startswith("roundpipe-")), None)
    wheel = next(folder.glob("roundpipe-*.whl"), None) if folder else None
    if wheel is None:
        pytest.skip("no published RoundPipe wheel in .whl/peers/")
    with zipfile.ZipFile(wheel) as z:
        return ast.parse(z.read(f"roundpipe/{name}").decode())


def test_published_planner_and_recompute_are_as_the_benchmark_assumes(monkeypatch):
    """What bench/gpu_providers.py run_published relies on, read from the carried wheel's source: auto()'s
    model_memory_limit defaults to get_min_gpu_memory() * PLAN_SHARE (the card's free memory, which the allocator's
    fraction does not change), every plan its forward paths make omits it (so the wrapper's value is the one used),
    its run config takes recompute_grain, and its forward runs without autograd while each backward stage reruns
    its layers' forward with it (its own checkpointing: HF's on top would be a third forward)."""
    monkeypatch.setattr(sys, "path", list(sys.path))   # the script takes bench/ off sys.path when loaded
    spec = importlib.util.spec_from_file_location("gpu_providers_under_test", REPO / "bench" / "gpu_providers.py")
    providers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(providers)

    scheduler = published_source("scheduler.py")
    autos = [f for f in ast.walk(scheduler) if isinstance(f, ast.FunctionDef) and f.name == "auto"
             and not any("overload" in ast.unparse(d) for d in f.decorator_list)]
    assert len(autos) == 1
    names = [a.arg for a in autos[0].args.kwonlyargs]
    default = ast.unparse(autos[0].args.kw_defaults[names.index("model_memory_limit")])
    assert default == f"get_min_gpu_memory() * {providers.PLAN_SHARE}", default
    device = ast.unparse(published_source("device.py"))
    assert "torch.cuda.mem_get_info" in device
    calls = [c for c in ast.walk(published_source("roundpipe.py")) if isinstance(c, ast.Call)
             and ast.unparse(c.func) == "ModelExecutePlan.auto"]
    assert len(calls) >= 2 and not any(k.arg == "model_memory_limit" for c in calls for k in c.keywords)
    config = next(f for f in ast.walk(published_source("run_config.py"))
                  if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    assert "recompute_grain" in [a.arg for a in config.args.args]
    run = {f.name: f for f in ast.walk(published_source("run.py")) if isinstance(f, ast.FunctionDef)}
    assert "torch.no_grad()" in [ast.unparse(d) for d in run["run_forward"].decorator_list]
    assert "torch.enable_grad()" in ast.unparse(run["run_backward"])
