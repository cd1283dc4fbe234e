"""CPU AdamW step: roundpipe's fused kernel against torch and DeepSpeed, at DRAM speed.

Providers, side by side in one run, each stepping the same fp32 master weights
(split into tensors of at most 16M elements, as a model's matrices would be):

  (a) torch seq   bf16 grad -> .float() -> * 1/loss_scale -> AdamW(fused=True) -> weight.to(bf16)
  (b) torch foreach   AdamW(foreach=True) on fp32 grads (no conversion, no copy)
  (b') torch fused    AdamW(fused=True) on fp32 grads
  (c) roundpipe bf16  one pass: bf16 grad x 1/loss_scale, AdamW, bf16 copy written
  (c') roundpipe fp32 fp32 grads, no copy (same work as b')
  (d) DeepSpeedCPUAdam   fp32 params and grads, fp32 m and v, AdamW in place (same
      work as b'/c').  Its step API has no bf16/fp16 copy output: adam_update takes
      params and grads of one dtype (fp32, or bf16/fp16 params with no fp32 master),
      so there is no (d) counterpart to (a)/(c).  Run only when deepspeed imports
      from --peer-path or $ROUNDPIPE_PEER_PATH, a separate package folder that is
      never one of roundpipe's dependencies, e.g.
          DS_ACCELERATOR=cpu pip install --no-deps --no-build-isolation
              --target /work/peers/deepspeed deepspeed==0.19.8
              hjson ninja psutil msgpack einops py-cpuinfo      (one command)
      (--no-deps and --no-build-isolation keep the torch already installed, the
      CPU build, out of reach of a CUDA torch download).  Its cpu_adam op is built by
      torch.utils.cpp_extension on first use (~2 min; gcc, -march=native, its
      choice), with DeepSpeed's "cpu" accelerator unless DS_ACCELERATOR says otherwise.

Bandwidth: three STREAM-style kernels over fp32 buffers far larger than the
last-level cache, sampled in the same run between the providers: torch triad
a = b + 3c (12 B/element), torch in-place scale a *= s (8 B/element), and
roundpipe's native a += b (accumulate_, 12 B/element, the same OpenMP threads
as the optimizer).  The in-place kernels read then write the same lines, the
optimizer's own pattern, which pays no write-allocate reads.  The highest of
the three medians is the physical limit "% BW" is taken against.  "B/param" counts the bytes each provider's passes read and
write (no write-allocate traffic, as STREAM counts): (c) 28 = read w, m, v (12)
+ bf16 grad (2), write w, m, v (12) + bf16 copy (2); (a) 48 = convert 6 +
unscale 8 + fused step 28 + copy 6; fp32 steps 28; foreach ~84 (its nine
passes).  "% BW" = B/param x params/s over the triad rate.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe import _native  # noqa: E402
from roundpipe.bench.runner import Report, add_common_args, median_time  # noqa: E402
from roundpipe.optim import AdamW, accumulate_  # noqa: E402

CHUNK = 16 << 20
LOSS_SCALE = 1024.0
BYTES = {"a": 48, "b": 84, "b'": 28, "c": 28, "c'": 28, "d": 28}


def split(n: int) -> list[int]:
    return [min(CHUNK, n - i) for i in range(0, n, CHUNK)]


class Bench:
    """All providers over one shared set of weights and gradients, so they fit in memory together.

    Each provider keeps its own optimizer state; sharing the weights only lets
    them drift a little differently, which does not change the work done.
    """

    def __init__(self, n: int, ds_cls=None):
        sizes = split(n)
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]
        self.bf16 = [(torch.randn(s, generator=gen) * LOSS_SCALE).to(torch.bfloat16) for s in sizes]
        self.fp32 = [g.float() / LOSS_SCALE for g in self.bf16]
        for p, g in zip(self.params, self.fp32):
            p.grad = g
        self.shadows = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
        self.torch_fused = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        self.torch_foreach = torch.optim.AdamW(self.params, lr=1e-4, foreach=True)
        self.ours = AdamW(self.params, lr=1e-4)
        self.deepspeed = ds_cls(self.params, lr=1e-4, adamw_mode=True) if ds_cls is not None else None

    @torch.no_grad()
    def torch_seq(self) -> None:
        """(a): what a torch offload loop does with a downloaded bf16 gradient."""
        for p, g in zip(self.params, self.bf16):
            p.grad.copy_(g)
        torch._foreach_mul_([p.grad for p in self.params], 1.0 / LOSS_SCALE)
        self.torch_fused.step()
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


def load_deepspeed(peer_path: str | None):
    """(DeepSpeedCPUAdam class, version, None) from a separate package folder, or (None, None, reason).

    The folder goes first on sys.path so its deepspeed wins over any other; roundpipe
    is imported before this and a folder holding a `roundpipe` is refused, so the
    peer never supplies our own package.  A one-element step builds and checks the
    cpu_adam op here, so a build failure is reported as (d)'s skip reason.
    """
    if not peer_path:
        return None, None, "(d) DeepSpeedCPUAdam skipped: no --peer-path / ROUNDPIPE_PEER_PATH given (not installed here)"
    peer = Path(peer_path).resolve()
    if not (peer / "deepspeed").is_dir():
        return None, None, f"(d) DeepSpeedCPUAdam skipped: {peer} has no deepspeed package"
    if any(peer.glob("roundpipe*")):
        return None, None, f"(d) DeepSpeedCPUAdam skipped: {peer} holds a roundpipe package; use a folder with deepspeed only"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(peer))
    try:
        import deepspeed  # type: ignore[import-not-found]
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        if not Path(deepspeed.__file__).resolve().is_relative_to(peer):
            return None, None, f"(d) DeepSpeedCPUAdam skipped: deepspeed imported from {deepspeed.__file__}, not {peer}"
        probe = torch.nn.Parameter(torch.zeros(1))
        probe.grad = torch.ones(1)
        DeepSpeedCPUAdam([probe], lr=1e-4, adamw_mode=True).step()
        return DeepSpeedCPUAdam, deepspeed.__version__, None
    except Exception as exc:  # a peer's build failure must not stop the run
        cause = f" <- {type(exc.__cause__).__name__}: {exc.__cause__}" if exc.__cause__ else ""
        return None, None, f"(d) DeepSpeedCPUAdam skipped: from {peer}: {type(exc).__name__}: {exc}{cause}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/cpu_adam.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=str, default=None,
                        help="comma-separated parameter counts in millions (default 10,50,100,200; 10 with --quick)")
    parser.add_argument("--peer-path", default=os.environ.get("ROUNDPIPE_PEER_PATH"),
                        help="folder holding the deepspeed package (e.g. a pip --target dir), for provider (d); "
                             "never installed with roundpipe")
    parser.add_argument("--levels", action="store_true", help="also time roundpipe bf16 at each lower SIMD level")
    add_common_args(parser)
    args = parser.parse_args(argv)
    counts = [int(float(x) * 1e6) for x in (args.params or ("10" if args.quick else "10,50,100,200")).split(",")]
    rounds = 3 if args.quick else 7

    report = Report("cpu_adam", columns=["params", "provider", "ms", "Mparam/s", "vs (a)", "B/param", "GB/s", "% BW",
                                        "BW GB/s"],
                    device="cpu")
    ds_cls, ds_version, ds_reason = load_deepspeed(args.peer_path)
    if ds_reason:
        print(ds_reason, file=sys.stderr)
        report.note(ds_reason)
    else:
        report.note(f"(d) DeepSpeedCPUAdam {ds_version} (DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}) from "
                    f"{args.peer_path}: fp32 params, fp32 grads, fp32 m/v, AdamW in place; no bf16 copy out "
                    "(its step API has none), so it does the work of (b')/(c'), not (a)/(c)")
    if not _native.available():
        report.note(f"native core unavailable ({_native.unavailable_reason()}): roundpipe rows use the torch fallback")
    triad_n = (64 << 20) if args.quick else (256 << 20)
    triad = [torch.empty(triad_n), torch.rand(triad_n), torch.rand(triad_n)]
    probes: dict[str, list[float]] = {"triad a = b + 3c (torch)": [], "in-place scale a *= s (torch)": [],
                                      "in-place add a += b (roundpipe native)": []}
    for n in counts:
        bench = Bench(n, ds_cls)
        level = _native.simd_level()
        runs = [("a", "(a) torch seq bf16", bench.torch_seq),
                ("b", "(b) torch foreach fp32", bench.torch_foreach.step),
                ("b'", "(b') torch fused fp32", bench.torch_fused.step),
                ("c", f"(c) roundpipe bf16 [{level}]", bench.ours_bf16),
                ("c'", f"(c') roundpipe fp32 [{level}]", bench.ours_fp32)]
        if args.levels and _native.available():
            runs += [("c", f"(c) roundpipe bf16 [{lv}]", with_level(bench.ours_bf16, lv))
                     for lv in ("avx2", "scalar") if lv != level]
        if bench.deepspeed is not None:
            runs.append(("d", "(d) DeepSpeedCPUAdam fp32", bench.deepspeed.step))
        # Interleaved rounds: on a shared machine the load changes over seconds, so
        # every provider (and the bandwidth probe) is sampled in every round and
        # the median over rounds is reported.
        samples: dict[str, list[float]] = {name: [] for _, name, _ in runs}
        for _ in range(rounds):
            for (name, values), nbytes, fn in zip(probes.items(), (12, 8, 12), (
                    lambda: torch.add(triad[1], triad[2], alpha=3.0, out=triad[0]),
                    lambda: triad[1].mul_(1.0),
                    lambda: accumulate_(triad[0], triad[2]))):
                values.append(nbytes * triad_n / median_time(fn, warmup=1, repeat=3) / 1e9)
            for _, name, fn in runs:
                samples[name].append(median_time(fn, warmup=1, repeat=3))
        bw = max(statistics.median(values[-rounds:]) for values in probes.values())
        t_a = statistics.median(samples[runs[0][1]])
        for key, name, _ in runs:
            t = statistics.median(samples[name])
            gbs = BYTES[key] * n / t / 1e9
            report.add(params=f"{n / 1e6:.0f}M", provider=name, ms=t * 1e3, **{
                "Mparam/s": n / t / 1e6, "vs (a)": t_a / t, "B/param": BYTES[key], "GB/s": gbs, "% BW": 100 * gbs / bw, "BW GB/s": bw})
        del bench
        gc.collect()
    for name, values in probes.items():
        report.note(f"STREAM-style {name}, fp32, {triad_n >> 20}M-element buffers: median "
                    f"{statistics.median(values):.1f} GB/s of {len(values)} samples interleaved with the providers "
                    f"(min {min(values):.1f}, max {max(values):.1f}); BW GB/s = the highest probe median over the rounds of that size")
    report.note(f"{rounds} interleaved rounds x 3 timed calls per provider and size; ms = median over rounds")
    report.note(f"threads: torch {torch.get_num_threads()}, roundpipe "
                f"{_native._C.num_threads() if _native.available() else 'n/a'}; loss scale {LOSS_SCALE:g}")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
