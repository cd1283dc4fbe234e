"""The GPU benchmark's prepare phase: first-use costs paid once, before and outside the timed rows.

Measured against the rows' limits (issue 53): DeepSpeed's cpu_adam JIT build took 162 s on 2 cores
(~35-50 s expected on 16) against a 150 s row; the published RoundPipe's Adam build 37 s plus its
torch.compile against 100 s; our _C is built in place when the device's Python cannot import it.  So the
builds run here, in parallel, each a row of its own (workload "prepare", cap "call<N>") with its seconds;
then, in call 1, a tiny CUDA smoke of every provider (one step of the tiny config: imports, the CUDA
context, the peers' code paths, torch.compile's cache) and the cuda-marked engine tests beside them.

A killed JIT build leaves torch's `lock` file in the extension's build folder, and the next build waits
on it forever: locks older than this run are removed before a build starts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpu_plan import CUDA_TESTS_LIMIT_S, Case

REPO_ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = Path("/tmp/roundpipe-peers/torch-extensions")   # both peers' JIT builds (TORCH_EXTENSIONS_DIR)
# the engine paths changed since the last GPU session (issue 53, item 8): device step, kept graphs,
# resident weights, device OOM, device inputs
CUDA_TESTS = ["tests/engine/test_device_step.py", "tests/engine/test_kept_graphs.py", "tests/engine/test_resident.py",
              "tests/engine/test_device_oom.py", "tests/engine/test_gpu_inputs.py"]
BUILDS = {"build-_C": "ours", "build-cpu_adam": "deepspeed-zero-offload", "build-published-adam": "roundpipe-0.1.1"}


def meminfo_row(out: Path, call: int, host_available: int) -> dict:
    """/proc/meminfo into the logs (a VM whose memory grows on demand may report little available)."""
    text = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").is_file() else ""
    (out / "logs" / f"meminfo-call{call}.txt").write_text(text)
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in text.splitlines() if line.split()[1:]}
    override = os.environ.get("ROUNDPIPE_HOST_AVAILABLE_GIB")
    status = (f"ok: MemTotal {fields.get('MemTotal', 0) / 2**30:.1f} GiB, MemAvailable "
              f"{fields.get('MemAvailable', 0) / 2**30:.1f} GiB; the fit checks use {host_available / 2**30:.1f} GiB"
              + (" (ROUNDPIPE_HOST_AVAILABLE_GIB)" if override else ""))
    return {"provider": "meminfo", "status": status}


def clear_stale_locks(root: Path, since: float) -> list[str]:
    """Removes torch.utils.cpp_extension's `lock` files older than `since` under `root` (a killed build's)."""
    gone = []
    for lock in root.rglob("lock") if root.is_dir() else []:
        if lock.stat().st_mtime < since:
            lock.unlink(missing_ok=True)
            gone.append(str(lock))
    return gone


def build_ours(log: Path, dry: bool) -> str:
    """Our native core, built in place when it does not import (the device's Python differs from ours)."""
    if subprocess.run([sys.executable, "-c", "import roundpipe._C"], cwd=REPO_ROOT, capture_output=True).returncode == 0:
        return "ok: roundpipe._C imports (already built)"
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=REPO_ROOT, stdout=f,
                            stderr=subprocess.STDOUT, timeout=240).returncode
    return "ok: built in place" if rc == 0 else f"failed: setup.py build_ext exit {rc} (log: {log.name})"


def prepare(call: int, smoke: bool, args, out: Path, add_row, run_child, skip_reason, smoke_cases: list[Case],
            host_available: int) -> None:
    """Runs the phase, adding one row per step through add_row(row) as each finishes.

    run_child(case, limit, log, overrides) runs one provider process and returns its result (bench/gpu_bench.py's
    run_case); skip_reason(case) says why a case does not run; smoke_cases are the tiny cases, one per provider."""
    t_start = time.time()
    gate = threading.Semaphore(args.prepare_jobs)   # processes at once: the builds and smokes side by side

    def row(provider: str, status: str, seconds: float | None, **extra) -> None:
        add_row({"workload": "prepare", "provider": provider, "cap": f"call{call}", "s": seconds, "status": status,
                 "reason": None if status.startswith("ok") else status, **extra})

    if os.environ.get("ROUNDPIPE_BENCH_T0"):   # scripts/gpu-bench.sh's start: its checks and installs (once)
        row("shell", "ok: prerequisites and peer installs", time.time() - float(os.environ.pop("ROUNDPIPE_BENCH_T0")))
    meminfo = meminfo_row(out, call, host_available)
    row(meminfo["provider"], meminfo["status"], 0.0)

    def build(name: str) -> bool:
        log = out / "logs" / f"prepare-{name}-call{call}.log"
        stale = clear_stale_locks(EXTENSIONS, t_start) if name != "build-_C" else []
        with gate:
            t0 = time.perf_counter()   # its own seconds, not the wait for a slot
            if name == "build-_C":
                status = build_ours(log, args.dry)
            else:
                provider = BUILDS[name]
                probe = next(c for c in smoke_cases if c.provider == provider)
                why = skip_reason(probe)
                if why is None and args.dry:
                    why = "not built in a dry run (a GPU run builds it here, out of the timed rows)"
                if why:
                    status = f"skipped: {why}"
                else:
                    result = run_child(Case(probe.workload, name, None, 240.0), 240.0, log, {})
                    status = "ok: " + result["built"] if "error" not in result else f"failed: {result['error']}"
            seconds = time.perf_counter() - t0
        if stale:
            status += f"; removed stale locks {stale}"
        row(name, status, seconds)
        return status.startswith("ok")

    def smoke_one(case: Case) -> None:
        why = skip_reason(case)
        if why:
            row(f"smoke-{case.provider}", f"skipped: {why}", 0.0)
            return
        with gate:
            t0 = time.perf_counter()
            r = run_child(case, 120.0, out / "logs" / f"prepare-smoke-{case.provider}.log",
                          {"warmup": 0, "steps": 1, "exposed": False})
            seconds = time.perf_counter() - t0
        status = "ok" if "error" not in r else f"failed: {r['error']}"
        row(f"smoke-{case.provider}", status, seconds, **{"overhead s": r.get("ready_s"), "kernels": r.get("kernels")})

    def cuda_tests() -> None:
        log = out / "logs" / "prepare-cuda-tests.log"
        with gate, log.open("w") as f:
            t0 = time.perf_counter()
            try:
                rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                     *CUDA_TESTS], cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=CUDA_TESTS_LIMIT_S).returncode
            except subprocess.TimeoutExpired:
                rc = None
            seconds = time.perf_counter() - t0
        last = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:] or ["no output"]
        status = (f"failed: cut at its {CUDA_TESTS_LIMIT_S:.0f} s limit" if rc is None
                  else "ok: " + last[0].strip("= ") if rc in (0, 5) else f"failed: pytest exit {rc}: {last[0][:160]}")
        row("cuda-tests", status, seconds)

    with ThreadPoolExecutor(max_workers=8) as pool:
        built = {name: pool.submit(build, name) for name in BUILDS}
        if not smoke:
            for f in built.values():
                f.result()
            return
        waits = [pool.submit(lambda: cuda_tests() if built["build-_C"].result()
                             else row("cuda-tests", "skipped: roundpipe._C did not build", 0.0))]
        for c in smoke_cases:
            needs = "build-_C" if c.provider.startswith("ours") else next((n for n, p in BUILDS.items()
                                                                             if p == c.provider), None)
            waits.append(pool.submit(lambda c=c, n=needs: (built[n].result() if n else None, smoke_one(c))))
        for f in waits:
            f.result()

