"""CPU optimizer steps: roundpipe's fused kernels against torch and DeepSpeed, at DRAM speed.

For each of AdamW, SGD (momentum 0.9), Adagrad and Lion, providers side by side in
one run, each stepping the same fp32 master weights (split into tensors of at
most 16M elements, as a model's matrices would be):

  (a) torch seq       bf16 grad -> .float() -> * 1/loss_scale -> torch's best step -> weight.to(bf16)
  (b) torch foreach   foreach=True on fp32 grads (Lion: torch has none; a hand-written
                      _foreach_* version of the same rule stands in)
  (b') torch fused    fused=True on fp32 grads (AdamW, SGD, Adagrad; torch has no fused Lion)
  (c) roundpipe bf16  one pass: bf16 grad x 1/loss_scale, the update, bf16 copy written
  (c') roundpipe fp32 fp32 grads, no copy (the same work as b/b')
  (d) DeepSpeed       DeepSpeedCPUAdam / DeepSpeedCPUAdagrad / DeepSpeedCPULion (no SGD):
      fp32 params and grads, fp32 state, in place (the work of b'/c').  Their step
      API has no bf16/fp16 copy output, so there is no (d) counterpart to (a)/(c).
      Run only when deepspeed imports from --peer-path or $ROUNDPIPE_PEER_PATH, a
      separate package folder that is never one of roundpipe's dependencies, e.g.
          DS_ACCELERATOR=cpu pip install --no-deps --no-build-isolation
              --target /work/peers/deepspeed deepspeed==0.19.8
              hjson ninja psutil msgpack einops py-cpuinfo      (one command)
      (--no-deps and --no-build-isolation keep the torch already installed, the
      CPU build, out of reach of a CUDA torch download).  Each CPU op (cpu_adam,
      cpu_adagrad, cpu_lion) is built by torch.utils.cpp_extension on first use
      (~3 min each on 2 cores; gcc, -march=native, its choice), with DeepSpeed's
      "cpu" accelerator unless DS_ACCELERATOR says otherwise; an op that fails to
      build is reported as that row's skip reason.

adamw8bit: roundpipe's AdamW8bit (moments in bitsandbytes' 8-bit blocks) in (c)/(c'),
against torch's fp32 AdamW in (a)/(b)/(b') and (e) bitsandbytes' CPU AdamW8bit (fp32
grads, in place, no copy: the work of (c')), when bitsandbytes imports; a note gives
its ratios to roundpipe's fp32 AdamW (c) of the same run and size and to (e).

"vs torch" = the time of torch's faster fp32 step, (b) or (b'), over the row's.
"B/param" is the traffic of the one-pass update (no write-allocate traffic, as
STREAM counts), the same for every provider of an optimizer so that "GB/s" is a
speed: AdamW 28 = read w, m, v (12) + grad, write w, m, v (12) + bf16 copy,
with a bf16 grad and copy (2 + 2) or an fp32 grad and no copy (4); SGD, Adagrad
and Lion 20 = one fp32 state instead of two; AdamW8bit 16 = one byte each for m and v
(read and written) instead of four, the per-block absmax aside.  A multi-pass provider moves more
(torch's foreach AdamW ~84 B/param, its sequence (a) 20 more than the fused step).

Bandwidth: three STREAM-style kernels over fp32 buffers far larger than the
last-level cache, sampled in the same run between the providers: torch triad
a = b + 3c (12 B/element), torch in-place scale a *= s (8 B/element), and
roundpipe's native a += b (accumulate_, 12 B/element, the same OpenMP threads
as the optimizers).  The in-place kernels read then write the same lines, the
optimizers' own pattern.  The highest of the three medians is the physical
limit "% BW" is taken against.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe import _native  # noqa: E402
from roundpipe.bench.runner import Report, add_common_args, median_time  # noqa: E402
from roundpipe.optim import SGD, Adagrad, AdamW, AdamW8bit, Lion, accumulate_  # noqa: E402

CHUNK = 16 << 20
LOSS_SCALE = 1024.0


class ForeachLion:
    """Lion (roundpipe/optim/lion.py's rule) in torch _foreach_* ops: what torch users write without a kernel."""

    def __init__(self, params: list[torch.Tensor], lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        self.params, self.lr, self.betas, self.wd = params, lr, betas, weight_decay
        self.exp_avgs = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        grads = [p.grad for p in self.params]
        if self.wd:
            torch._foreach_mul_(self.params, 1 - self.lr * self.wd)
        update = torch._foreach_mul(self.exp_avgs, beta1)
        torch._foreach_add_(update, grads, alpha=1 - beta1)
        torch._foreach_sign_(update)
        torch._foreach_add_(self.params, update, alpha=-self.lr)
        torch._foreach_mul_(self.exp_avgs, beta2)
        torch._foreach_add_(self.exp_avgs, grads, alpha=1 - beta2)


@dataclass
class Spec:
    """One optimizer's providers, all with the same hyper-parameters."""

    ours: Callable[[list], Any]
    foreach: Callable[[list], Any]
    fused: Callable[[list], Any] | None
    deepspeed: tuple[str, str, dict] | None   # (module, class, extra kwargs)
    kwargs: dict = field(default_factory=dict)
    bytes: int = 20
    peer: Callable[[list], Any] | None = None   # (e): a peer's optimizer over the fp32 grads (bitsandbytes)


def bnb_adamw8bit(params: list) -> Any:
    """(e) bitsandbytes' CPU AdamW8bit, or None when it does not import."""
    try:
        import bitsandbytes
    except Exception:  # noqa: BLE001 - a peer's failure must not stop the run
        return None
    return bitsandbytes.optim.AdamW8bit(params, lr=1e-4)


OPTIMIZERS = {
    "adamw": Spec(lambda ps: AdamW(ps, lr=1e-4), lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
                  lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
                  ("deepspeed.ops.adam", "DeepSpeedCPUAdam", dict(adamw_mode=True)), dict(lr=1e-4), 28),
    "sgd": Spec(lambda ps: SGD(ps, lr=1e-4, momentum=0.9),
                lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, foreach=True),
                lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, fused=True), None),
    "adagrad": Spec(lambda ps: Adagrad(ps, lr=1e-4), lambda ps: torch.optim.Adagrad(ps, lr=1e-4, foreach=True),
                    lambda ps: torch.optim.Adagrad(ps, lr=1e-4, fused=True),
                    ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad", {}), dict(lr=1e-4)),
    "adamw8bit": Spec(lambda ps: AdamW8bit(ps, lr=1e-4), lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
                      lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), None, dict(lr=1e-4), 16,
                      peer=bnb_adamw8bit),
    "lion": Spec(lambda ps: Lion(ps, lr=1e-4), lambda ps: ForeachLion(ps, lr=1e-4), None,
                 ("deepspeed.ops.lion", "DeepSpeedCPULion", dict(betas=(0.9, 0.99))), dict(lr=1e-4)),
}


def split(n: int) -> list[int]:
    return [min(CHUNK, n - i) for i in range(0, n, CHUNK)]


class Bench:
    """All providers of one optimizer over one shared set of weights and gradients, so they fit in memory
    together.  Each provider keeps its own state; sharing the weights only lets them drift a little
    differently, which does not change the work done."""

    def __init__(self, n: int, name: str = "adamw", ds_cls=None):
        spec = OPTIMIZERS[name]
        sizes = split(n)
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]
        self.bf16 = [(torch.randn(s, generator=gen) * LOSS_SCALE).to(torch.bfloat16) for s in sizes]
        self.fp32 = [g.float() / LOSS_SCALE for g in self.bf16]
        for p, g in zip(self.params, self.fp32):
            p.grad = g
        self.shadows = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
        self.torch_foreach = spec.foreach(self.params)
        self.torch_fused = spec.fused(self.params) if spec.fused else None
        self.ours = spec.ours(self.params)
        self.deepspeed = ds_cls(self.params, **spec.kwargs, **spec.deepspeed[2]) if ds_cls is not None else None
        self.peer = spec.peer(self.params) if spec.peer else None

    @torch.no_grad()
    def torch_seq(self) -> None:
        """(a): what a torch offload loop does with a downloaded bf16 gradient."""
        for p, g in zip(self.params, self.bf16):
            p.grad.copy_(g)
        torch._foreach_mul_([p.grad for p in self.params], 1.0 / LOSS_SCALE)
        (self.torch_fused or self.torch_foreach).step()
        for s, p in zip(self.shadows, self.params):
            s.copy_(p)

    def ours_bf16(self) -> None:
        self.ours.fused_step(self.bf16, shadows=self.shadows, grad_scale=LOSS_SCALE, found_inf=False)

    def ours_fp32(self) -> None:
        self.ours.fused_step(self.fp32)


def with_level(fn, level: str):
    def run() -> None:
        best = _native.simd_level()
        _native.set_simd_level(level)
        try:
            fn()
        finally:
            _native.set_simd_level(best)
    return run


def load_deepspeed(peer_path: str | None, names: list[str]) -> tuple[dict[str, Any], str | None, list[str]]:
    """({optimizer: DeepSpeed class}, version, [skip reasons]) from a separate package folder.

    The folder goes first on sys.path so its deepspeed wins over any other; roundpipe
    is imported before this and a folder holding a `roundpipe` is refused, so the
    peer never supplies our own package.  A one-element step builds and checks each
    CPU op here, so a build failure is reported as that provider's skip reason.
    """
    wanted = [n for n in names if OPTIMIZERS[n].deepspeed]
    if not peer_path:
        return {}, None, ["(d) DeepSpeed skipped: no --peer-path / ROUNDPIPE_PEER_PATH given (not installed here)"]
    peer = Path(peer_path).resolve()
    if not (peer / "deepspeed").is_dir():
        return {}, None, [f"(d) DeepSpeed skipped: {peer} has no deepspeed package"]
    if any(peer.glob("roundpipe*")):
        return {}, None, [f"(d) DeepSpeed skipped: {peer} holds a roundpipe package; use a folder with deepspeed only"]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(peer))
    try:
        import deepspeed  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - a peer's failure must not stop the run
        return {}, None, [f"(d) DeepSpeed skipped: import from {peer}: {type(exc).__name__}: {exc}"]
    if not Path(deepspeed.__file__).resolve().is_relative_to(peer):
        return {}, None, [f"(d) DeepSpeed skipped: deepspeed imported from {deepspeed.__file__}, not {peer}"]
    found, reasons = {}, []
    for name in wanted:
        module, cls_name, extra = OPTIMIZERS[name].deepspeed
        try:
            cls = getattr(importlib.import_module(module), cls_name)
            probe = torch.nn.Parameter(torch.zeros(1))
            probe.grad = torch.ones(1)
            cls([probe], lr=1e-4, **extra).step()
            found[name] = cls
        except Exception as exc:  # noqa: BLE001 - a peer optimizer failing is reported, not fatal
            cause = f" <- {type(exc.__cause__).__name__}: {exc.__cause__}" if exc.__cause__ else ""
            reasons.append(f"(d) {cls_name} skipped: {type(exc).__name__}: {exc}{cause}")
    return found, deepspeed.__version__, reasons


def providers(bench: Bench, name: str, levels: bool) -> list[tuple[str, Callable[[], None]]]:
    level = _native.simd_level()
    runs = [("(a) torch seq bf16", bench.torch_seq), ("(b) torch foreach fp32", bench.torch_foreach.step)]
    if bench.torch_fused is not None:
        runs.append(("(b') torch fused fp32", bench.torch_fused.step))
    runs += [(f"(c) roundpipe bf16 [{level}]", bench.ours_bf16), (f"(c') roundpipe fp32 [{level}]", bench.ours_fp32)]
    if levels and _native.available():
        runs += [(f"(c) roundpipe bf16 [{lv}]", with_level(bench.ours_bf16, lv))
                 for lv in ("avx2", "scalar") if lv != level]
    if bench.deepspeed is not None:
        runs.append((f"(d) {type(bench.deepspeed).__name__} fp32", bench.deepspeed.step))
    if bench.peer is not None:
        runs.append((f"(e) bitsandbytes {type(bench.peer).__name__} fp32", bench.peer.step))
    return runs


def adamw8bit_ratios(medians: dict[tuple[str, int], dict[str, float]], n: int) -> str:
    """The note on AdamW8bit at n parameters: its times over roundpipe's fp32 AdamW and over bitsandbytes'."""
    eight, fp32 = medians.get(("adamw8bit", n)), medians.get(("adamw", n))
    if eight is None:
        return ""
    pick = lambda rows, prefix: next((t for label, t in rows.items() if label.startswith(prefix)), None)
    parts = []
    for ours in ("(c) ", "(c') "):
        t = pick(eight, ours)
        if fp32 is not None and pick(fp32, ours):
            parts.append(f"AdamW8bit {ours.strip()} is {pick(fp32, ours) / t:.2f}x roundpipe fp32 AdamW {ours.strip()}")
        if pick(eight, "(e)"):
            parts.append(f"AdamW8bit {ours.strip()} is {pick(eight, '(e)') / t:.2f}x bitsandbytes' CPU AdamW8bit")
    return f"{n / 1e6:.0f}M params: " + "; ".join(parts) if parts else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/cpu_optim.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=str, default=None,
                        help="comma-separated parameter counts in millions (default 10,50; 10 with --quick)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help=f"comma-separated subset of {', '.join(OPTIMIZERS)} (default: all)")
    parser.add_argument("--peer-path", default=os.environ.get("ROUNDPIPE_PEER_PATH"),
                        help="folder holding the deepspeed package (e.g. a pip --target dir), for provider (d); "
                             "never installed with roundpipe")
    parser.add_argument("--levels", action="store_true", help="also time roundpipe bf16 at each lower SIMD level")
    add_common_args(parser)
    args = parser.parse_args(argv)
    counts = [int(float(x) * 1e6) for x in (args.params or ("10" if args.quick else "10,50")).split(",")]
    names = [n.strip() for n in args.optimizers.split(",")]
    for n in names:
        if n not in OPTIMIZERS:
            parser.error(f"--optimizers: {n!r} is not one of {', '.join(OPTIMIZERS)}")
    rounds = 3 if args.quick else 7

    report = Report("cpu_optim", columns=["optimizer", "params", "provider", "ms", "Mparam/s", "vs torch", "B/param",
                                         "GB/s", "% BW", "BW GB/s"], device="cpu")
    ds, ds_version, ds_reasons = load_deepspeed(args.peer_path, names)
    for reason in ds_reasons:
        print(reason, file=sys.stderr)
        report.note(reason)
    if ds:
        report.note(f"(d) DeepSpeed {ds_version} (DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}) from "
                    f"{args.peer_path}: fp32 params, grads and state, in place; no bf16 copy out (its step API has "
                    "none), so it does the work of (b')/(c'), not (a)/(c)")
    if not _native.available():
        report.note(f"native core unavailable ({_native.unavailable_reason()}): roundpipe rows use the torch fallback")
    triad_n = (64 << 20) if args.quick else (128 << 20)
    triad = [torch.empty(triad_n), torch.rand(triad_n), torch.rand(triad_n)]
    probes: dict[str, list[float]] = {"triad a = b + 3c (torch)": [], "in-place scale a *= s (torch)": [],
                                      "in-place add a += b (roundpipe native)": []}
    medians: dict[tuple[str, int], dict[str, float]] = {}
    for name in names:
        for n in counts:
            bench = Bench(n, name, ds.get(name))
            runs = providers(bench, name, args.levels)
            # Interleaved rounds: on a shared machine the load changes over seconds, so
            # every provider (and the bandwidth probe) is sampled in every round and
            # the median over rounds is reported.
            samples: dict[str, list[float]] = {label: [] for label, _ in runs}
            for _ in range(rounds):
                for (_probe, values), nbytes, fn in zip(probes.items(), (12, 8, 12), (
                        lambda: torch.add(triad[1], triad[2], alpha=3.0, out=triad[0]),
                        lambda: triad[1].mul_(1.0),
                        lambda: accumulate_(triad[0], triad[2]))):
                    values.append(nbytes * triad_n / median_time(fn, warmup=1, repeat=3) / 1e9)
                for label, fn in runs:
                    samples[label].append(median_time(fn, warmup=1, repeat=3))
            bw = max(statistics.median(values[-rounds:]) for values in probes.values())
            t_torch = min(statistics.median(samples[label]) for label, _ in runs if label.startswith("(b"))
            nbytes = OPTIMIZERS[name].bytes
            medians[name, n] = {label: statistics.median(samples[label]) for label, _ in runs}
            for label, _ in runs:
                t = statistics.median(samples[label])
                gbs = nbytes * n / t / 1e9
                report.add(optimizer=name, params=f"{n / 1e6:.0f}M", provider=label, ms=t * 1e3, **{
                    "Mparam/s": n / t / 1e6, "vs torch": t_torch / t, "B/param": nbytes, "GB/s": gbs,
                    "% BW": 100 * gbs / bw, "BW GB/s": bw})
            del bench, runs
            gc.collect()
    for text in filter(None, (adamw8bit_ratios(medians, n) for n in counts)):
        report.note(text)
    for probe, values in probes.items():
        report.note(f"STREAM-style {probe}, fp32, {triad_n >> 20}M-element buffers: median "
                    f"{statistics.median(values):.1f} GB/s of {len(values)} samples interleaved with the providers "
                    f"(min {min(values):.1f}, max {max(values):.1f}); BW GB/s = the highest probe median over the "
                    "rounds of that size")
    report.note(f"{rounds} interleaved rounds x 3 timed calls per provider and size; ms = median over rounds; "
                "vs torch = time of torch's faster fp32 step (b or b') / time")
    report.note(f"threads: torch {torch.get_num_threads()}, roundpipe "
                f"{_native.lib.num_threads() if _native.available() else 'n/a'}; loss scale {LOSS_SCALE:g}")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
