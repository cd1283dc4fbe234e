"""Ours against every peer on one GPU, held to a 24 GiB card: the table a short GPU session produces.

    bash scripts/gpu-bench.sh                  # on the GPU machine: prerequisites, build, then this (< 9 min)
    python bench/gpu_bench.py --dry --out DIR  # CPU workers, tiny configs, peers skipped with the reason (< 1 min)

Each (workload, provider, cap) runs in a process of its own (bench/gpu_providers.py) under a time
limit, so a hang, a crash or an allocator failure is a row with its reason and the run goes on; the
whole run keeps to --budget seconds (cases left when it is spent get a row saying so).  Before a
provider starts, its host state is predicted (bytes per parameter below) and compared with the
machine's available RAM: one that cannot fit gets a row instead of being killed by the kernel.

Workloads (shapes from roundpipe/shapes.py, the published config.json values; random weights, one
random batch of token ids reused every step as the published benchmark/train.py does, bf16 compute,
fp32 masters and fp32 Adam state, 5 warm-up + 10 timed steps, lr 1e-4 so the loss moves):

    qwen3-1.7b        full fine-tuning, 4 x 2048 tokens: every provider at 24 GiB; ours and plain
                      PyTorch also at the full card
    qwen3-1.7b        the longest sequence ours trains at 24 GiB (bisection over 4k..64k, one full
                      step a probe, bounded time), beside the planner's prediction (rp.hf.max_seq_len)
    llama-3.1-8b-lora LoRA (r 32, alpha 16, all linear layers) over a frozen NF4 base, 4 x 2048: ours
                      (rp.hf.wrap(..., quantize="nf4")); a provider without a 4-bit base says so
    llama-3.1-8b      full fine-tuning at 24 GiB: ours with 8-bit Adam state and bf16 masters (~6 host
                      bytes/param); 16-18 bytes/param do not fit a 128 GiB host, and those rows say so

Providers: ours-sync, ours-async, ours-device, torch, fsdp2-offload, deepspeed-zero-offload, roundpipe-0.1.1
(bench/gpu_providers.py says how each trains).  Peers come from wheels that scripts/fetch-peers.sh
put in .whl/peers/ and scripts/gpu-bench.sh installed into one --target folder each under --peers.

Columns: tokens/s (timed steps' tokens over their wall time), exposed step s (ours: seconds per
iteration the optimizer step adds, 2 iterations with it against 2 of forward_backward alone), kept layers (ours:
the layers whose weights stay on the GPU between stages, RoundPipe(resident_layers=)), kept graphs (ours: the
layers whose backward ran on their forward's graph, not recomputed: memory_stats()["kept_graphs"]), vs torch (plain PyTorch on the same
workload at the same cap, else at the full card), vs best peer (the fastest of fsdp2-offload,
deepspeed-zero-offload and roundpipe-0.1.1 on the same workload and cap), the first and the final
step's loss (nats/token; all providers start from the same weights and batch), device peak
(torch.cuda.max_memory_allocated), peak host RSS, seconds the process took, and the status.  Every
JSON row also carries the device, commit, date and the torch/CUDA/driver versions.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from roundpipe.bench.runner import Report  # noqa: E402
from roundpipe.shapes import LLAMA_3_1_8B, QWEN3_1_7B, DecoderShape  # noqa: E402

GiB = 1 << 30
CHILD = Path(__file__).with_name("gpu_providers.py")
PROVIDERS = ("ours-sync", "ours-async", "ours-device", "torch", "fsdp2-offload", "deepspeed-zero-offload",
             "roundpipe-0.1.1")
PEERS = ("fsdp2-offload", "deepspeed-zero-offload", "roundpipe-0.1.1")
PEER_FOLDERS = {"deepspeed-zero-offload": ("deepspeed", "deepspeed"), "roundpipe-0.1.1": ("roundpipe-0.1.1", "roundpipe")}
# Host bytes per trainable parameter (docs/architecture.md, host-resident state): fp32 master 4 + Adam m, v 8 + upload copy
# and gradient landing; 8-bit state with bf16 masters ~6; FSDP2's offload keeps fp32 params, grads and
# Adam state on the host (16); DeepSpeed's fp32 partitions and 0.1.1's fp32 optimizer copies likewise.
HOST_BYTES = {"ours": 18.0, "ours-8bit": 7.0, "torch": 4.0, "fsdp2-offload": 16.0, "deepspeed-zero-offload": 18.0,
              "roundpipe-0.1.1": 18.0}
HOST_OVERHEAD = 4 * GiB      # interpreter, torch, transformers, CUDA context's host side
TINY = dict(hidden=64, intermediate=128, layers=2, vocab=256, heads=4, kv_heads=2, head_dim=16)


@dataclass(frozen=True)
class Workload:
    """A model and how it trains; `shape` gives the config and the parameter count."""

    name: str
    shape: DecoderShape
    batch: int
    seq: int
    lora: bool = False        # LoRA over a frozen 4-bit (NF4) base
    state: str = "fp32"       # ours' host state: "fp32" (AdamW, fp32 masters) or "8bit" (AdamW8bit, bf16 masters)


@dataclass(frozen=True)
class Case:
    workload: Workload
    provider: str             # one of PROVIDERS, or ours-maxseq / ours-predicted
    cap: int | None           # device bytes the provider is held to; None: the full card
    timeout: float            # seconds for its process


def plan(dry: bool, cap: int, timeout: float) -> list[Case]:
    """The cases in the order they run (the most telling first: a spent budget cuts the tail)."""
    if dry:
        qwen = Workload("tiny-qwen3", DecoderShape("tiny-qwen3", tied=True, model_type="qwen3", **TINY), 4, 32)
        llama = DecoderShape("tiny-llama", **TINY)
        lora = Workload("tiny-llama-lora", llama, 4, 32, lora=True)
        big = Workload("tiny-llama-8bit", llama, 4, 32, state="8bit")
        search = replace(qwen, batch=1)
    else:
        qwen = Workload("qwen3-1.7b", QWEN3_1_7B, 4, 2048)
        lora = Workload("llama-3.1-8b-lora", LLAMA_3_1_8B, 4, 2048, lora=True)
        big = Workload("llama-3.1-8b", LLAMA_3_1_8B, 4, 2048, state="8bit")
        search = replace(qwen, batch=1)
    cases = [Case(qwen, p, cap, timeout * (1.5 if p == "deepspeed-zero-offload" else 1.0)) for p in PROVIDERS]
    cases += [Case(qwen, p, None, timeout) for p in ("ours-async", "ours-device", "torch")]
    cases += [Case(search, "ours-maxseq", cap, timeout), Case(search, "ours-predicted", cap, timeout)]
    cases += [Case(lora, p, cap, timeout) for p in PROVIDERS if p not in ("ours-sync", "ours-device")]
    cases += [Case(big, p, cap, timeout * 1.5) for p in ("ours-async", "fsdp2-offload", "deepspeed-zero-offload",
                                                          "roundpipe-0.1.1")]
    return cases


def host_available() -> int:
    """MemAvailable of /proc/meminfo, bytes (0 where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def skip_reason(case: Case, dry: bool, peers: Path) -> str | None:
    """Why `case` is not run (support, the device, the peer's wheels, host or device bytes), or None."""
    w, p = case.workload, case.provider
    n = w.shape.parameters()
    if w.lora and p in PEERS:
        return "not supported here: LoRA over a 4-bit (NF4) base needs bitsandbytes, absent from the GPU image"
    if w.lora and p == "torch":
        return "not supported: plain PyTorch has no NF4 Linear (bitsandbytes absent from the GPU image)"
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
    if dry and case.cap is None:
        return "full-card rows need a GPU (dry run)"
    key = "ours-8bit" if p.startswith("ours") and w.state == "8bit" else "ours" if p.startswith("ours") else p
    trainable = n // 100 if w.lora else n    # LoRA: the adapters (~1%), the base frozen
    base = n * 2.6 if w.lora else 0          # bf16 build, then NF4 (0.52 B/param) kept
    need = trainable * HOST_BYTES[key] + base + HOST_OVERHEAD
    avail = host_available()
    if avail and need > 0.9 * avail and p != "ours-predicted":
        return (f"host state does not fit: ~{need / GiB:.0f} GiB ({HOST_BYTES[key]:g} B/param for {n / 1e9:.2f}B "
                f"params) > 90% of {avail / GiB:.0f} GiB available")
    if p == "torch" and not dry and not w.lora and case.cap and n * 16 > case.cap:
        return (f"does not fit the cap: fp32 weights, grads and Adam state alone are {n * 16 / GiB:.1f} GiB "
                f"> {case.cap / GiB:.0f} GiB")
    return None


def isolation(case: Case, peers: Path) -> str:
    """Where the peer's top-level package resolves in its process's environment (found, not imported)."""
    env, cwd = child_env(case, peers)
    package = PEER_FOLDERS[case.provider][1]
    code = f"import importlib.util as u; s = u.find_spec({package!r}); print(s.origin if s else None)"
    origin = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd,
                            timeout=60).stdout.strip()
    inside = origin not in ("", "None") and Path(origin).resolve().is_relative_to((peers / PEER_FOLDERS[case.provider][0]).resolve())
    return f"installed; `import {package}` there resolves to {'its own folder' if inside else origin or 'nothing'}"


def child_env(case: Case, peers: Path) -> tuple[dict, str]:
    """(environment, cwd) of the case's process: a peer's folder first on its PYTHONPATH and our tree
    nowhere on it; ours and torch with the repository first."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    path = [e for e in env.get("PYTHONPATH", "").split(os.pathsep)
            if e and Path(e).resolve() != REPO_ROOT and not Path(e).resolve().is_relative_to(peers.resolve())]
    if case.provider in PEER_FOLDERS:
        env["PYTHONPATH"] = os.pathsep.join([str(peers / PEER_FOLDERS[case.provider][0])] + path)
        return env, tempfile.gettempdir()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + path)
    return env, str(REPO_ROOT)


def run_case(case: Case, args, limit: float, log: Path) -> dict:
    w = case.workload
    spec = {"provider": case.provider, "hf_config": w.shape.hf_config(), "batch": w.batch, "seq": w.seq,
            "lora": w.lora, "state": w.state, "cap": case.cap, "device": "cpu" if args.dry else "cuda",
            "warmup": args.warmup, "steps": args.steps, "lr": args.lr, "seed": 0, "threads": args.threads,
            "seq_min": args.seq_min, "seq_max": args.seq_max, "grain": args.grain,
            "budget_s": max(10.0, limit - 40.0)}
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
            proc.communicate()
            return {"error": f"timed out after {limit:.0f} s (log: {log.name})", "seconds": limit}
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


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def add_ratios(rows: list[dict]) -> None:
    def tps(r):
        return r.get("tokens/s") if finite(r.get("tokens/s")) else None

    for r in rows:
        if tps(r) is None or r["provider"] in ("ours-maxseq", "ours-predicted"):
            continue
        same = [x for x in rows if x["workload"] == r["workload"] and tps(x)]
        torch = ([x for x in same if x["provider"] == "torch" and x["cap"] == r["cap"]]
                 or [x for x in same if x["provider"] == "torch" and x["cap"] == "full"])
        peers = [tps(x) for x in same if x["provider"] in PEERS and x["cap"] == r["cap"]]
        r["vs torch"] = tps(r) / tps(torch[0]) if torch else None
        r["vs best peer"] = tps(r) / max(peers) if peers else None


def cap_label(cap: int | None) -> str:
    return "full" if cap is None else f"{cap / GiB:g}GiB" if cap >= GiB else f"{cap / (1 << 20):g}MiB"


def row_of(case: Case, result: dict | None, reason: str | None) -> dict:
    w, r = case.workload, result or {}
    status = "ok" if result and "error" not in r else f"skipped: {reason}" if reason else f"failed: {r.get('error')}"
    row = {"workload": w.name, "provider": case.provider,
           "cap": cap_label(case.cap),
           "batch x seq": f"{w.batch}x{w.seq}", "tokens/s": r.get("tokens_per_s"),
           "exposed step s": r.get("exposed_step_s"), "kept layers": r.get("kept_layers"),
           "kept graphs": r.get("kept_graphs"), "vs torch": None,
           "vs best peer": None, "first loss": r.get("first_loss"), "final loss": r.get("final_loss"),
           "max seq": r.get("seq_len"), "device peak GB": r["device_peak"] / 1e9 if r.get("device_peak") else None,
           "peak RSS GB": r["peak_rss"] / 1e9 if r.get("peak_rss") else None, "s": r.get("seconds"),
           "status": status if not r.get("search") or "error" in r else f"ok: {r['search']}"}
    row["tokens_per_s"], row["final_loss"] = row["tokens/s"], row["final loss"]   # JSON names the test reads
    row["reason"] = None if status == "ok" else status
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="CPU workers, tiny configs, 2+2 steps; peers skipped")
    parser.add_argument("--out", default=None, help="folder for gpu_bench.jsonl, table.txt and logs/ (default: "
                        "bench/results/gpu-<date>/; with --dry a new temporary folder)")
    parser.add_argument("--peers", type=Path, default=Path("/tmp/roundpipe-peers"),
                        help="folder holding one --target folder per peer (scripts/gpu-bench.sh fills it)")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="device memory every provider is held to")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 470; dry 150)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per provider (default 100; dry 60)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5; dry 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; dry 2)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seq-min", type=int, default=None, help="search's shortest length (default 4096; dry 32)")
    parser.add_argument("--seq-max", type=int, default=None, help="search's longest length (default 65536; dry 512)")
    parser.add_argument("--grain", type=int, default=None, help="search's step (default 2048; dry 32)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (dry default 1)")
    parser.add_argument("--jobs", type=int, default=None, help="processes at once (default 1: timings; dry 2)")
    parser.add_argument("--only", default=None, help="comma-separated providers or workloads to run (others "
                        "get no row)")
    args = parser.parse_args(argv)
    d = args.dry
    args.budget = args.budget or (150.0 if d else 470.0)
    timeout = args.timeout or (60.0 if d else 100.0)
    args.warmup = args.warmup if args.warmup is not None else (2 if d else 5)
    args.steps = args.steps or (2 if d else 10)
    args.seq_min, args.seq_max = args.seq_min or (32 if d else 4096), args.seq_max or (512 if d else 65536)
    args.grain = args.grain or (32 if d else 2048)
    args.threads = args.threads or (1 if d else None)
    jobs = args.jobs or (2 if d else 1)
    # dry: the cap is what a CPU worker may hold, small enough that the search finds a limit
    cap = int(args.cap_gib * GiB) if not d else 24 * GiB
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="gpu-bench-")) if d
                                           else REPO_ROOT / "bench" / "results" / f"gpu-{date}")
    (out / "logs").mkdir(parents=True, exist_ok=True)

    import torch  # versions only: no CUDA context in this process (children need the whole card)

    facts = {"device": "cpu (dry run)", "driver": None} if d else gpu_facts()
    versions = {"cuda": torch.version.cuda, "driver": facts.get("driver"), "torch": torch.__version__}
    cases = plan(d, cap, timeout)
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c.provider in keep or c.workload.name in keep]
    if d:   # the search in dry: a cap a few tiny layers exceed at a few hundred tokens
        cases = [replace(c, cap=2 << 20) if c.provider in ("ours-maxseq", "ours-predicted") else c for c in cases]
    deadline = time.perf_counter() + args.budget
    results: dict[int, tuple[dict | None, str | None]] = {}

    def one(i: int, case: Case) -> None:
        reason = skip_reason(case, d, args.peers)
        left = deadline - time.perf_counter()
        if reason is None and left < 15:
            reason = f"the run's {args.budget:.0f} s budget was spent"
        if reason is not None:
            results[i] = (None, reason)
        else:
            log = out / "logs" / f"{case.workload.name}_{case.provider}_{cap_label(case.cap)}.log"
            results[i] = (run_case(case, args, min(case.timeout, left), log), None)
        print(f"[{i + 1}/{len(cases)}] {case.workload.name} {case.provider} cap={case.cap}: "
              f"{results[i][1] or results[i][0]}", file=sys.stderr, flush=True)

    # The planner's prediction needs no GPU but minutes of one core on the full-size shape: it runs beside
    # the others from the start (one thread; the GPU providers' host steps have the other cores).
    background = [(i, c) for i, c in enumerate(cases) if c.provider == "ours-predicted"]
    with ThreadPoolExecutor(max_workers=max(1, len(background))) as side, \
            ThreadPoolExecutor(max_workers=jobs) as pool:
        waiting = [side.submit(one, i, replace(c, timeout=args.budget)) for i, c in background]
        list(pool.map(lambda ic: one(*ic), [(i, c) for i, c in enumerate(cases) if c.provider != "ours-predicted"]))
        for f in waiting:
            f.result()
    rows = [row_of(c, *results[i]) for i, c in enumerate(cases)]
    add_ratios(rows)

    report = Report("gpu_bench", columns=["workload", "provider", "cap", "batch x seq", "tokens/s", "exposed step s", "kept layers",
                                          "kept graphs", "vs torch",
                                          "vs best peer", "first loss", "final loss", "max seq", "device peak GB",
                                          "peak RSS GB", "s", "status"], device="cpu")
    report.env.update(device=facts["device"], **versions)
    for r in rows:
        report.add(**r)
    report.note(f"{args.warmup} warm-up + {args.steps} timed steps, lr {args.lr:g}, one random batch reused, "
                f"{'fp32 on CPU workers (dry)' if d else 'bf16 compute, fp32 masters and Adam state'}; "
                f"cap {'per CPU worker (dry)' if d else 'via set_per_process_memory_fraction and device_memory='}")
    report.note(f"torch {versions['torch']}, CUDA {versions['cuda']}, driver {versions['driver']}; "
                f"logs in {out / 'logs'}")
    report.finish(str(out))
    (out / "table.txt").write_text(report.table() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
