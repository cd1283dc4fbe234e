"""Ours against every peer on one GPU, held to a 24 GiB card: the table a short GPU session produces.

    bash scripts/gpu-bench.sh --call 1 --out /tmp/gpu --mirror $OUT/gpu   # device call 1 (< 5 min), then --call 2
    python bench/gpu_bench.py --dry --out DIR   # both calls on CPU workers, tiny configs, and the time estimate

The run plan (bench/gpu_plan.py) is two device calls on one warm machine, each held to 5 minutes: call 1
pays the first-use costs in a prepare phase (bench/gpu_prepare.py: /proc/meminfo, the builds in parallel,
a tiny smoke of every provider, the cuda-marked engine tests) and then runs the key rows; call 2 the rest.
Each (workload, provider, cap) runs in a process of its own (bench/gpu_providers.py) under a time limit,
so a hang, a crash or an allocator failure is a row with its reason and the run goes on; each call keeps
to --budget seconds (cases left when it is spent get a row saying so).  Every row is saved as it
finishes (bench/gpu_store.py): the jsonl appended, the table and the logs' archive rewritten.  Before a
provider starts, its host state is predicted and compared with the machine's available RAM
(ROUNDPIPE_HOST_AVAILABLE_GIB overrides MemAvailable): one that cannot fit gets a row instead of being
killed by the kernel.

Workloads (shapes from roundpipe/shapes.py, the published config.json values; random weights drawn on
the GPU from one seed, one random batch of token ids reused every step as the published
benchmark/train.py does, bf16 compute, fp32 masters and fp32 Adam state, weight decay 0 everywhere,
2 warm-up + 6 timed steps (8B: 2 + 3; FSDP2 and DeepSpeed 2 + 4), lr 1e-4 so the loss moves):

    qwen3-1.7b        full fine-tuning, 4 x 2048 tokens: every provider at 24 GiB; plain PyTorch (with
                      and without gradient checkpointing) and ours also on the full card
    qwen3-1.7b        the longest sequence ours trains at 24 GiB (bisection from 4k up to 1.25 x the
                      planner's prediction, first at the prediction, one full step a probe, bounded time),
                      beside that prediction (rp.hf.max_seq_len, in a process that sees no GPU)
    llama-3.1-8b-lora LoRA (r 32, alpha 16, all linear layers) over a frozen NF4 base, 4 x 2048: ours
                      (rp.hf.wrap(..., quantize="nf4")); a provider without a 4-bit base says so
    llama-3.1-8b      full fine-tuning at 24 GiB: ours with 8-bit Adam state and bf16 masters (~7 host
                      bytes/param); 16-18 bytes/param do not fit a 128 GiB host, and those rows say so

Columns: tokens/s (timed steps' tokens over their wall time), exposed step s (ours-sync/async on 1.7B:
seconds per iteration the optimizer step adds, from >= 5 iterations each way, with its spread, or "within
noise"; bench/gpu_measure.py), kernels (ours: Triton, or the PyTorch reference path, read after the steps),
kept layers, kept graphs (ours), vs torch (plain PyTorch
on the same workload at the same cap, else at the full card), vs best peer, the first and the final
step's loss, device peak (torch.cuda.max_memory_allocated after the initialisation), peak host RSS,
overhead s (process start to the first step: imports, initialisation, set-up; not in tokens/s), the
seconds the process took, and the status.  Every JSON row also carries the device, commit, date, the
interpreter and the torch/CUDA/driver versions.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_measure  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_search  # noqa: E402
from gpu_plan import CALL_LIMIT_S, PEERS, PROVIDERS, TINY, Case, GiB, Workload, cap_label, key, plan  # noqa: E402
from gpu_prepare import EXTENSIONS, prepare  # noqa: E402
from gpu_store import COLUMNS, JSONL, Store  # noqa: E402

from roundpipe.bench.runner import Report  # noqa: E402
from roundpipe.shapes import DecoderShape  # noqa: E402

CHILD = Path(__file__).with_name("gpu_providers.py")
PEER_FOLDERS = {"deepspeed-zero-offload": ("deepspeed", "deepspeed"), "roundpipe-0.1.1": ("roundpipe-0.1.1", "roundpipe"),
                "build-cpu_adam": ("deepspeed", "deepspeed"), "build-published-adam": ("roundpipe-0.1.1", "roundpipe")}
DIFFUSERS_FOLDER = "diffusers"   # scripts/fetch-peers.sh's wheel folder for the Flux rows (ours and the peer)


def host_available() -> int:
    """Bytes of host memory the fit checks may count on: ROUNDPIPE_HOST_AVAILABLE_GIB where set (a VM whose
    memory grows on demand reports little MemAvailable), else MemAvailable of /proc/meminfo (0 where unknown)."""
    override = os.environ.get("ROUNDPIPE_HOST_AVAILABLE_GIB")
    if override:
        try:
            return int(float(override) * GiB)
        except ValueError:
            raise ValueError(f"ROUNDPIPE_HOST_AVAILABLE_GIB={override!r} must be a number of GiB, e.g. 120") from None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def skip_reason(case: Case, dry: bool, peers: Path) -> str | None:
    """Why `case` is not run (support, the device, the peer's wheels, host or device bytes), or None."""
    p = case.provider
    why = gpu_plan.static_skip(case, dry, 0)
    if why:
        return why
    if p in PEER_FOLDERS:
        folder, package = PEER_FOLDERS[p]
        log = peers / f"{folder}.install.log"
        if not (peers / folder / package).is_dir() and log.is_file():
            last = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:] or ["no output"]
            return f"its wheels did not install here ({log}): {last[0][:160]}"
        if not (peers / folder / package).is_dir():
            return (f"no {package} in {peers / folder}: run `bash scripts/fetch-peers.sh` where PyPI is reachable, "
                    "carry .whl/ and let scripts/gpu-bench.sh install it")
    if dry and p in PEERS:
        return "needs a CUDA GPU (dry run: CPU workers)" + (f"; {isolation(case, peers)}" if p in PEER_FOLDERS else "")
    if dry and case.cap is None and p.startswith("ours"):
        return "full-card rows of ours need a GPU (dry run)"
    return gpu_plan.static_skip(case, dry, host_available())


def isolation(case: Case, peers: Path) -> str:
    """Where the peer's top-level package resolves in its process's environment (found, not imported)."""
    env, cwd = child_env(case, peers)
    package = PEER_FOLDERS[case.provider][1]
    code = f"import importlib.util as u; s = u.find_spec({package!r}); print(s.origin if s else None)"
    origin = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd,
                            timeout=60).stdout.strip()
    folder = (peers / PEER_FOLDERS[case.provider][0]).resolve()
    inside = origin not in ("", "None") and Path(origin).resolve().is_relative_to(folder)
    return f"installed; `import {package}` there resolves to {'its own folder' if inside else origin or 'nothing'}"


def child_env(case: Case, peers: Path) -> tuple[dict, str]:
    """(environment, cwd) of the case's process: a peer's folder first on its PYTHONPATH and our tree
    nowhere on it; ours and torch with the repository first.  Both peers JIT-build into one folder.  The
    prediction sees no GPU (CUDA_VISIBLE_DEVICES=""): it runs beside the GPU rows on the meta device, and a
    CUDA context of its own would take the card's memory from the row beside it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(EXTENSIONS)))
    if case.provider == "ours-predicted":
        env["CUDA_VISIBLE_DEVICES"] = ""
    path = [e for e in env.get("PYTHONPATH", "").split(os.pathsep)
            if e and Path(e).resolve() != REPO_ROOT and not Path(e).resolve().is_relative_to(peers.resolve())]
    # the Flux rows' diffusers (absent from the GPU image), after everything else on the path
    extra = [str(peers / DIFFUSERS_FOLDER)] if gpu_plan.is_dit(case) and (peers / DIFFUSERS_FOLDER).is_dir() else []
    if case.provider in PEER_FOLDERS:
        env["PYTHONPATH"] = os.pathsep.join([str(peers / PEER_FOLDERS[case.provider][0])] + path + extra)
        return env, tempfile.gettempdir()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + path + extra)
    return env, str(REPO_ROOT)


def run_case(case: Case, args, limit: float, log: Path, overrides: dict) -> dict:
    """One provider process under `limit` seconds; its RESULT, or {"error": why}."""
    w = case.workload
    warmup, steps, exposed = gpu_plan.steps_of(case, args.warmup, args.steps)
    spec = {"provider": case.provider, "hf_config": w.shape.hf_config(), "batch": w.batch, "seq": w.seq,
            "lora": w.lora, "state": w.state, "cap": case.cap, "device": "cpu" if args.dry else "cuda",
            "warmup": warmup, "steps": steps, "exposed": exposed, "lr": args.lr, "seed": 0, "threads": args.threads,
            "seq_min": args.seq_min, "seq_max": args.seq_max, "grain": args.grain, "search_s": args.search_s,
            "budget_s": max(10.0, limit - 40.0), "parent": os.getpid(), **overrides}
    if case.provider in PEER_FOLDERS:
        spec["peer_path"] = str(args.peers / PEER_FOLDERS[case.provider][0])
    env, cwd = child_env(case, args.peers)
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(spec)], stdout=subprocess.PIPE,
                                stderr=f, text=True, env=env, cwd=cwd, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # the provider and whatever it started (compilers, workers)
            stdout, _ = proc.communicate()
            f.write(stdout)
            probes = gpu_search.probes_in(stdout)
            fit, fail = gpu_search.bracket(probes)
            reached = f"; probes done: fits {fit}, not {fail}" if probes else ""   # the search's bracket so far
            return {"error": f"timed out after {limit:.0f} s (log: {log.name}){reached}", "seconds": limit,
                    **({"seq_len": fit, "probes": probes} if probes else {})}
        f.write(stdout)
    seconds = time.perf_counter() - start
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "seconds": seconds}
    tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:] or [""]
    why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    return {"error": f"{why}{' (SIGKILL: out of host memory?)' if proc.returncode == -9 else ''}: {tail[0][:160]}",
            "seconds": seconds}


def gpu_facts() -> dict:
    """Device name and driver from nvidia-smi, without a CUDA context in this process."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        name, total, driver = (x.strip() for x in out.split(","))
        return {"device": name, "device_memory_total": total, "driver": driver}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"device": "cuda (nvidia-smi unavailable)", "driver": "unknown"}


def row_of(case: Case, result: dict | None, reason: str | None) -> dict:
    w, r = case.workload, result or {}
    status = "ok" if result and "error" not in r else f"skipped: {reason}" if reason else f"failed: {r.get('error')}"
    overhead = r.get("ready_s")
    row = {"workload": w.name, "provider": case.provider, "cap": cap_label(case.cap), "call": case.call,
           "batch x seq": f"{w.batch}x{w.seq}", "tokens/s": r.get("tokens_per_s"),
           "exposed step s": gpu_measure.exposed_label(r.get("exposed_step")), "kernels": r.get("kernels"),
           "kept layers": r.get("kept_layers"),
           "kept graphs": r.get("kept_graphs"), "vs torch": None, "vs best peer": None,
           "first loss": r.get("first_loss"), "final loss": r.get("final_loss"), "max seq": r.get("seq_len"),
           "device peak GB": r["device_peak"] / 1e9 if r.get("device_peak") else None,
           "peak RSS GB": r["peak_rss"] / 1e9 if r.get("peak_rss") else None, "overhead s": overhead,
           "overhead cpu s": r.get("ready_cpu_s"), "init s": r.get("init_s"), "import s": r.get("import_s"),
           "s": r.get("seconds"),
           "status": status if not r.get("search") or "error" in r else f"ok: {r['search']}"}
    row["tokens_per_s"], row["final_loss"] = row["tokens/s"], row["final loss"]   # JSON names the test reads
    row["reason"] = None if status == "ok" else status
    # JSON only: the exposed step's numbers (seconds >= 0, spread, per-iteration seconds each way), which
    # kernels ran and why, the search's probes and top, the published planner's GiB, the prediction's GPU
    for name in ("exposed_step", "kernels_detail", "kernels_patched", "probes", "seq_bound", "planned_gib",
                 "cuda_visible_devices", "cuda_context"):
        if name in r:
            row[name] = r[name]
    return row


def smoke_cases(cap: int, timeout: float) -> list[Case]:
    """One tiny case per provider: the prepare phase's smoke (on the GPU in a real run)."""
    tiny = Workload("smoke", DecoderShape("tiny-qwen3", tied=True, model_type="qwen3", **TINY), 2, 32)
    return [Case(tiny, p, cap, timeout) for p in PROVIDERS]


def run_call(call: int, args, cases: list[Case], store: Store, cap: int) -> None:
    """One device call: its prepare phase, then its cases in order (the prediction beside them)."""
    d = args.dry
    deadline = time.perf_counter() + args.budget
    if args.prepare != "no":
        smoke = call == 1 or args.prepare == "yes"
        prepare(call, smoke, args, store.out, store.add, lambda c, lim, log, o: run_case(c, args, lim, log, o),
                lambda c: skip_reason(c, d, args.peers), smoke_cases(cap, 120.0), host_available())
    mine = [c for c in cases if c.call == call]

    predicted: dict[tuple, dict] = {}   # workload name, cap -> the prediction row's result

    def one(case: Case) -> dict | None:
        reason = skip_reason(case, d, args.peers)
        left = deadline - time.perf_counter()
        if reason is None and left < 15:
            reason = f"call {call}'s {args.budget:.0f} s budget was spent"
        result = None
        if reason is None:
            log = store.out / "logs" / f"{case.workload.name}_{case.provider}_{cap_label(case.cap)}.log"
            overrides = search_overrides(case, waiting, predicted, args) if case.provider == "ours-maxseq" else {}
            result = run_case(case, args, min(case.timeout, deadline - time.perf_counter()), log, overrides)
        print(f"[call {call}] {case.workload.name} {case.provider} cap={cap_label(case.cap)}: {reason or result}",
              file=sys.stderr, flush=True)
        store.add(row_of(case, result, reason))
        return result

    def predict(case: Case) -> None:
        predicted[(case.workload.name, case.cap)] = one(case) or {}

    # The planner's prediction needs no GPU and ~6 s of one core on the full-size shape (Qwen3-1.7B at 24 GiB,
    # 2026-12-08, 2 shared cores; 2 s more to import): it runs beside the others from the start (one thread; the
    # GPU providers' host steps have the other cores), and the search below waits for it (its top follows it).
    background = [c for c in mine if c.provider == "ours-predicted"]
    with ThreadPoolExecutor(max_workers=max(1, len(background))) as side, \
            ThreadPoolExecutor(max_workers=args.jobs) as pool:
        waiting = {(c.workload.name, c.cap): side.submit(predict, replace(c, timeout=args.budget)) for c in background}
        list(pool.map(one, [c for c in mine if c.provider != "ours-predicted"]))
        for f in waiting.values():
            f.result()


PREDICTION_WAIT_S = 60.0   # the most the search waits for its prediction (it takes ~8 s; started with the call)


def search_overrides(case: Case, waiting: dict, predicted: dict, args) -> dict:
    """The search's top and first probe from the planner's prediction for the same workload and cap
    (bench/gpu_search.py search_bound), waiting for that row up to PREDICTION_WAIT_S; --seq-max without one."""
    k = (case.workload.name, case.cap)
    if k in waiting:
        try:
            waiting[k].result(timeout=PREDICTION_WAIT_S)
        except TimeoutError:
            pass
    result = predicted.get(k) or {}
    seq = result.get("seq_len") if "error" not in result else None
    top, first, source = gpu_search.search_bound(seq, args.seq_min, args.grain, args.seq_max)
    if k not in waiting:
        source += ": no prediction row in this run"
    elif k not in predicted:
        source += f": the prediction was not done after {PREDICTION_WAIT_S:.0f} s"
    elif seq is None:
        source += f": the prediction failed ({str(result.get('error'))[:80]})"
    return {"seq_max": top, "seq_first": first, "bound_from": source}


def estimate(out: Path, cases: list[Case], args) -> int:
    """Prints each call's expected seconds on the device from the overheads measured in `out`'s rows;
    1 when a call would pass CALL_LIMIT_S."""
    text = (out / JSONL).read_text() if (out / JSONL).is_file() else ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    # CPU seconds to the first step: imports and set-up are single-threaded, so on the device's idle cores
    # their wall time is about their CPU time here, which a loaded machine does not stretch
    measured = {(r["workload"], r["provider"], r["cap"]): r["overhead cpu s"] for r in rows
                if isinstance(r.get("overhead cpu s"), (int, float)) and r.get("workload") != "prepare"}
    steps = (2, 6) if args.dry else (args.warmup, args.steps)   # dry: the device's defaults
    calls = gpu_plan.expected_seconds(cases, measured, *steps)
    worst = 0
    for call, t in calls.items():
        over = t["total"] > CALL_LIMIT_S
        worst |= over
        print(f"call {call}: expected {t['total']:.0f} s on a 16-core H100 (scripts {t['shell']:.0f} + prepare "
              f"{t['prepare']:.0f} + rows {t['rows']:.0f}; {len(measured)} process overheads measured here)"
              f" -- {'OVER' if over else 'within'} the {CALL_LIMIT_S:.0f} s a call may take")
    return 1 if worst else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="CPU workers, tiny configs, 2+2 steps; peers skipped")
    parser.add_argument("--call", choices=("1", "2", "all"), default="all",
                        help="the device call to run (default: both in sequence, then the time estimate)")
    parser.add_argument("--prepare", choices=("auto", "yes", "no"), default="auto",
                        help="auto: call 1 builds, smokes and tests, call 2 builds what is missing; no: rows only")
    parser.add_argument("--out", default=None, help="folder for gpu_bench.jsonl, table.txt, logs.tar.gz and logs/ "
                        "(rows of an earlier call there are kept; default: bench/results/gpu-<date>/; with --dry "
                        "a new temporary folder)")
    parser.add_argument("--mirror", type=Path, default=None, help="a folder that gets a copy of the jsonl, the table "
                        "and the logs' archive after every row (the device call's $OUT)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSONL",
                        help="no run: the rows of these files (the two calls' gpu_bench.jsonl) into --out")
    parser.add_argument("--estimate", action="store_true", help="no run: each call's expected seconds from --out's rows")
    parser.add_argument("--peers", type=Path, default=Path("/tmp/roundpipe-peers"),
                        help="folder holding one --target folder per peer (scripts/gpu-bench.sh fills it)")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="device memory every provider is held to")
    parser.add_argument("--budget", type=float, default=None, help="seconds for one call, its prepare phase "
                        "included (default 270; dry 150)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per provider (default 100; dry 60)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2: first-use costs are "
                        "the prepare phase's; dry 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 6; dry 2)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seq-min", type=int, default=None, help="search's shortest length (default 4096; dry 32)")
    parser.add_argument("--seq-max", type=int, default=None, help="search's longest length where the planner's "
                        "prediction is missing (default 65536; dry 512); with one, 1.25 x the prediction")
    parser.add_argument("--grain", type=int, default=None, help="search's step (default 2048; dry 32)")
    parser.add_argument("--search-s", type=float, default=None, help="the search's time (default 20)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (dry default 1)")
    parser.add_argument("--jobs", type=int, default=None, help="processes at once (default 1: timings; dry 2)")
    parser.add_argument("--prepare-jobs", type=int, default=None, help="processes at once in the prepare phase "
                        "(builds, smokes, tests; default 8; dry 2)")
    parser.add_argument("--only", default=None, help="comma-separated providers or workloads to run (others "
                        "get no row)")
    args = parser.parse_args(argv)
    d = args.dry
    if (args.peers / DIFFUSERS_FOLDER).is_dir():   # so gpu_plan.static_skip finds it (found, never imported here)
        sys.path.append(str(args.peers / DIFFUSERS_FOLDER))
    timeout = args.timeout or (60.0 if d else 100.0)
    args.warmup = args.warmup if args.warmup is not None else 2
    args.steps = args.steps or (2 if d else 6)
    args.seq_min, args.seq_max = args.seq_min or (32 if d else 4096), args.seq_max or (512 if d else 65536)
    args.grain = args.grain or (32 if d else 2048)
    args.search_s = args.search_s or gpu_plan.MAXSEQ_S
    args.threads = args.threads or (1 if d else None)
    args.jobs = args.jobs or (2 if d else 1)
    args.prepare_jobs = args.prepare_jobs or (2 if d else 8)
    cap = int(args.cap_gib * GiB) if not d else 24 * GiB   # dry: what a CPU worker may hold
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="gpu-bench-")) if d
                                           else REPO_ROOT / "bench" / "results" / f"gpu-{date}")
    cases = plan(d, cap, timeout)
    if d:   # the search in dry: a cap a few tiny layers exceed at a few hundred tokens
        cases = [replace(c, cap=2 << 20) if c.provider in ("ours-maxseq", "ours-predicted") else c for c in cases]
    if args.estimate:
        return estimate(out, cases, args)

    import torch  # versions only: no CUDA context in this process (children need the whole card)

    facts = {"device": "cpu (dry run)", "driver": None} if d else gpu_facts()
    report = Report("gpu_bench", columns=COLUMNS, device="cpu")
    report.env.update(device=facts["device"], cuda=torch.version.cuda, driver=facts.get("driver"),
                      python_executable=sys.executable)
    report.note(f"{args.warmup} warm-up + {args.steps} timed steps (8B: at most 2 + 3; FSDP2 and DeepSpeed 2 + 4), "
                f"lr {args.lr:g}, weight decay 0, one random batch reused, "
                f"{'fp32 on CPU workers (dry)' if d else 'bf16 compute, fp32 masters and Adam state'}; "
                f"cap {'per CPU worker (dry)' if d else 'via set_per_process_memory_fraction and device_memory='}")
    report.note("recompute: ours per stage (kept graphs excepted) and the published RoundPipe per stage (its own, "
                "no HF checkpointing); torch-ckpt, FSDP2 and DeepSpeed HF gradient checkpointing per layer; the "
                f"published planner plans against 0.6 x the cap ({0.6 * cap / GiB:.1f} GiB), not the card's free "
                "memory; overhead s (imports, initialisation, set-up) is outside tokens/s; the prepare rows give the "
                "builds' seconds")
    report.note("exposed step s: median of the pairwise differences of >= 5 iterations with the step and >= 5 "
                "without, +- half their interquartile range, 'within noise' where the lower quartile is <= 0; "
                "kernels: ours' Triton kernels launched, or the PyTorch reference path (kernels_detail says why); "
                "max seq: the bracket the search reached, its top 1.25 x the planner's prediction")
    report.note(f"torch {torch.__version__}, CUDA {torch.version.cuda}, driver {facts.get('driver')}; logs in "
                "logs.tar.gz")
    if args.merge:   # the device calls' rows, with their own environment in the table's title
        merged = [json.loads(line) for path in args.merge for line in path.read_text().splitlines() if line.strip()]
        report.env.update({k: merged[0][k] for k in report.env if merged and k in merged[0]})
        report.notes = merged[-1].get("notes") or report.notes if merged else report.notes
        store = Store(out, report, [key(c) for c in cases], PEERS, args.mirror, archive=False)
        for row in merged:
            store.add(row)
        print(store.finish())
        return 0
    store = Store(out, report, [key(c) for c in cases], PEERS, args.mirror)
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c.provider in keep or c.workload.name in keep]
    args.budget = args.budget or (150.0 if d else 270.0)
    for call in ((1, 2) if args.call == "all" else (int(args.call),)):
        run_call(call, args, cases, store, cap)
    print(store.finish())
    print(f"rows in {out / JSONL}; table in {out / 'table.txt'}", flush=True)
    if d and args.call == "all" and not args.only:
        return estimate(out, plan(d, cap, timeout), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
