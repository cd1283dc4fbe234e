"""CPU AdamW step: roundpipe's fused kernel against torch and DeepSpeed, at DRAM speed.

Providers, side by side in one run, each stepping the same fp32 master weights
(split into tensors of at most 16M elements, as a model's matrices would be):

  (a) torch seq   bf16 grad -> .float() -> * 1/loss_scale -> AdamW(fused=True) -> weight.to(bf16)
  (b) torch foreach   AdamW(foreach=True) on fp32 grads (no conversion, no copy)
  (b') torch fused    AdamW(fused=True) on fp32 grads
  (c) roundpipe bf16  one pass: bf16 grad x 1/loss_scale, AdamW, bf16 copy written
  (c') roundpipe fp32 fp32 grads, no copy (same work as b')
  (d) DeepSpeedCPUAdam on fp32 grads, only when importable from --peer-path or
      $ROUNDPIPE_PEER_PATH (a separate environment; never installed here)

Bandwidth: a STREAM-style triad a = b + s*c (torch, fp32, all threads) over
buffers far larger than the last-level cache, measured in the same run, is the
physical limit.  "B/param" counts the bytes each provider's passes read and
write (no write-allocate traffic, as STREAM counts): (c) 28 = read w, m, v (12)
+ bf16 grad (2), write w, m, v (12) + bf16 copy (2); (a) 48 = convert 6 +
unscale 8 + fused step 28 + copy 6; fp32 steps 28; foreach ~84 (its nine
passes).  "% BW" = B/param x params/s over the triad rate.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe import _native  # noqa: E402
from roundpipe.bench.runner import Report, add_common_args, median_time  # noqa: E402
from roundpipe.optim import AdamW  # noqa: E402

CHUNK = 16 << 20
LOSS_SCALE = 1024.0
BYTES = {"a": 48, "b": 84, "b'": 28, "c": 28, "c'": 28, "d": 28}


def split(n: int) -> list[int]:
    return [min(CHUNK, n - i) for i in range(0, n, CHUNK)]


def triad_gbs(n: int, repeat: int) -> float:
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    t = median_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeat=repeat)
    return 12 * n / t / 1e9


def masters(sizes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in sizes]


def bf16_grads(sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(s, generator=g) * LOSS_SCALE).to(torch.bfloat16) for s in sizes]


def time_torch_seq(sizes, repeat):
    params = [torch.nn.Parameter(m) for m in masters(sizes)]
    grads = bf16_grads(sizes)
    for p in params:
        p.grad = torch.empty_like(p)
    shadows = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step():
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            torch._foreach_mul_([p.grad for p in params], 1.0 / LOSS_SCALE)
            opt.step()
            for s, p in zip(shadows, params):
                s.copy_(p)
    return median_time(step, repeat=repeat)


def time_torch_fp32(sizes, repeat, impl):
    params = [torch.nn.Parameter(m) for m in masters(sizes)]
    for p, g in zip(params, bf16_grads(sizes)):
        p.grad = g.float() / LOSS_SCALE
    opt = torch.optim.AdamW(params, lr=1e-4, **{impl: True})
    return median_time(opt.step, repeat=repeat)


def time_ours(sizes, repeat, lowp):
    params = masters(sizes)
    opt = AdamW(params, lr=1e-4)
    if lowp:
        grads = bf16_grads(sizes)
        shadows = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
        return median_time(lambda: opt.fused_step(grads, shadows=shadows, grad_scale=LOSS_SCALE, found_inf=False),
                           repeat=repeat)
    grads = [g.float() / LOSS_SCALE for g in bf16_grads(sizes)]
    return median_time(lambda: opt.fused_step(grads), repeat=repeat)


def load_deepspeed(peer_path: str | None):
    """DeepSpeedCPUAdam class from a separate environment, or (None, reason)."""
    if not peer_path:
        return None, "DeepSpeedCPUAdam skipped: no --peer-path / ROUNDPIPE_PEER_PATH given (not installed here)"
    sys.path.insert(0, peer_path)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        return DeepSpeedCPUAdam, None
    except Exception as exc:  # a peer's build failure must not stop the run
        return None, f"DeepSpeedCPUAdam skipped: import from {peer_path} failed ({type(exc).__name__}: {exc})"


def time_deepspeed(cls, sizes, repeat):
    params = [torch.nn.Parameter(m) for m in masters(sizes)]
    for p, g in zip(params, bf16_grads(sizes)):
        p.grad = g.float() / LOSS_SCALE
    opt = cls(params, lr=1e-4, adamw_mode=True)
    return median_time(opt.step, repeat=repeat)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/cpu_adam.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=str, default=None,
                        help="comma-separated parameter counts in millions (default 10,50,100; 10 with --quick)")
    parser.add_argument("--peer-path", default=os.environ.get("ROUNDPIPE_PEER_PATH"),
                        help="site-packages of an environment with deepspeed, for provider (d)")
    parser.add_argument("--levels", action="store_true", help="also time roundpipe bf16 at each lower SIMD level")
    add_common_args(parser)
    args = parser.parse_args(argv)
    counts = [int(float(x) * 1e6) for x in (args.params or ("10" if args.quick else "10,50,100")).split(",")]
    repeat = 3 if args.quick else 7

    report = Report("cpu_adam", columns=["params", "provider", "ms", "Mparam/s", "vs (a)", "B/param", "GB/s", "% BW"],
                    device="cpu")
    bw = triad_gbs((64 << 20) if args.quick else (256 << 20), repeat)
    report.note(f"STREAM-style triad (torch, fp32, {'64M' if args.quick else '256M'} elements x 3 buffers): "
                f"{bw:.1f} GB/s")
    ds_cls, ds_reason = load_deepspeed(args.peer_path)
    if ds_reason:
        report.note(ds_reason)
    if not _native.available():
        report.note(f"native core unavailable ({_native.unavailable_reason()}): roundpipe rows use the torch fallback")
    for n in counts:
        sizes = split(n)
        runs = [("a", "(a) torch seq bf16", lambda: time_torch_seq(sizes, repeat)),
                ("b", "(b) torch foreach fp32", lambda: time_torch_fp32(sizes, repeat, "foreach")),
                ("b'", "(b') torch fused fp32", lambda: time_torch_fp32(sizes, repeat, "fused")),
                ("c", f"(c) roundpipe bf16 [{_native.simd_level()}]", lambda: time_ours(sizes, repeat, True)),
                ("c'", f"(c') roundpipe fp32 [{_native.simd_level()}]", lambda: time_ours(sizes, repeat, False))]
        if args.levels and _native.available():
            best = _native.simd_level()
            for level in [lv for lv in ("avx2", "scalar") if lv != best]:
                def timed(level=level):
                    _native.set_simd_level(level)
                    try:
                        return time_ours(sizes, repeat, True)
                    finally:
                        _native.set_simd_level(best)
                runs.append(("c", f"(c) roundpipe bf16 [{level}]", timed))
        if ds_cls is not None:
            runs.append(("d", "(d) DeepSpeedCPUAdam fp32", lambda: time_deepspeed(ds_cls, sizes, repeat)))
        t_a = None
        for key, name, fn in runs:
            t = fn()
            gc.collect()
            t_a = t if key == "a" else t_a
            gbs = BYTES[key] * n / t / 1e9
            report.add(params=f"{n / 1e6:.0f}M", provider=name, ms=t * 1e3, **{
                "Mparam/s": n / t / 1e6, "vs (a)": t_a / t, "B/param": BYTES[key], "GB/s": gbs, "% BW": 100 * gbs / bw})
    report.note(f"threads: torch {torch.get_num_threads()}, roundpipe "
                f"{_native._C.num_threads() if _native.available() else 'n/a'}; loss scale {LOSS_SCALE:g}")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
