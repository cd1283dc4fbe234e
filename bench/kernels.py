"""roundpipe.kernels against eager PyTorch, torch.compile and Liger-Kernel on one GPU.

    python bench/kernels.py [--quick] [--no-save] [--ops rms_norm,swiglu,rope,lce,lce_chunks]

For every op (bf16, Qwen3-8B-like sizes) and provider the table gives the
median milliseconds of the forward and of forward+backward, the achieved rate
(GB/s of the minimal bytes the op must move for the elementwise ops, TFLOP/s
of the three LM-head matmuls for the linear cross-entropy) as a percent of the
device's limits measured in the same run (a device-to-device copy and a bf16
8192^3 matmul), the speed relative to eager, and for the LM-head loss the peak
memory above the inputs for T = 8K..32K tokens, V = 151,936.  The LM-head loss
runs roundpipe and Liger-Kernel with both weight-gradient accumulators:
"accum=fp32" sums dW over the chunks in fp32 (roundpipe's default),
"accum=None" in the weight's dtype (Liger-Kernel's default).

"lce_chunks" is a second table, kernels_lce_chunks: the LM-head loss's chunk
sizing at V = 151,936 before and after the large-vocabulary fix, per (T, H):
chunk, chunk count, bytes moved per microbatch (forward+backward) and the
temporaries, as counted by roundpipe.kernels.linear_cross_entropy.chunk_costs
(a count of the code's tensor accesses, not a measurement), then the median
time of forward+backward with both chunk sizes on one smaller case: on CPU
under the Triton interpreter (whose interpreted softmax kernel costs both the
same), on a GPU at T = 16,384, H = 4,096 (unmeasured so far).  Its rows are
saved on CPU too (the counts do not depend on the device).

Liger-Kernel is an optional import (never a roundpipe dependency); when it is
missing the table says so.  Without a CUDA GPU the script runs a tiny CPU
sanity mode under the Triton interpreter (checks that every provider runs; its
timings mean nothing and are not saved).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from roundpipe.bench.runner import Report, add_common_args, median_time


@dataclass
class Sizes:
    """Model dimensions (Qwen3-8B by default) and token counts."""
    hidden: int = 4096
    intermediate: int = 12288
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    tokens: int = 16384
    lce_tokens: tuple = (8192, 16384, 32768)


CPU_SANITY = Sizes(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, vocab=1000, tokens=16,
                   lce_tokens=(16,))


@dataclass
class Case:
    """One op at one size: inputs, the tensors that get gradients, and the work per pass."""
    op: str
    label: str
    inputs: dict
    grad_of: list
    work: dict                 # {"fwd": amount, "fwd+bwd": amount} in bytes or FLOPs
    unit: str                  # "GB/s" or "TFLOP/s"


def _eager_rms_norm(x, w, eps, residual):
    x = x + residual
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), x


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def _eager_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _eager_lce(h, w, labels):
    return F.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100)


def providers(op: str, use_compile: bool, liger) -> dict[str, Callable]:
    """name -> fn(**inputs) returning a tensor or a tuple of tensors."""
    from roundpipe import kernels as rk

    eager = {"rms_norm": lambda x, w, r: _eager_rms_norm(x, w, 1e-6, r),
             "swiglu": lambda g, u: F.silu(g) * u,
             "rope": lambda q, k, cos, sin: _eager_rope(q, k, cos, sin),
             "lce": lambda h, w, labels: _eager_lce(h, w, labels)}[op]
    ours = {"rms_norm": lambda x, w, r: rk.rms_norm(x, w, 1e-6, r),
            "swiglu": lambda g, u: rk.swiglu(g, u), "rope": rk.apply_rope,
            "lce": lambda h, w, labels: rk.linear_cross_entropy(h, w, labels)}[op]
    found = {"eager": eager, "roundpipe": ours}
    if op == "lce":
        found = {"eager": eager, "roundpipe accum=fp32": ours,
                 "roundpipe accum=None": lambda h, w, labels: rk.linear_cross_entropy(h, w, labels, accum_dtype=None)}
    if use_compile:
        found["torch.compile"] = torch.compile(eager)
    if liger is not None and op == "lce":
        found["liger accum=None"] = lambda h, w, labels: liger.liger_fused_linear_cross_entropy(h, w, labels)
        found["liger accum=fp32"] = lambda h, w, labels: liger.liger_fused_linear_cross_entropy(
            h, w, labels, accum_dtype=torch.float32)
    elif liger is not None:
        found["liger"] = {"rms_norm": lambda x, w, r: (liger.liger_rms_norm(x + r, w, 1e-6), None),
                          "swiglu": lambda g, u: liger.liger_swiglu(g, u),
                          "rope": lambda q, k, cos, sin: liger.liger_rope(q, k, cos, sin)}[op]
    return found


def cases(ops: list[str], device: str, sz: Sizes, dtype) -> list[Case]:
    """Inputs per op; `work` counts the minimal HBM bytes (elementwise ops) or matmul FLOPs (LM head)."""
    e = torch.tensor([], dtype=dtype).element_size()
    tokens, hidden, inter, heads, kv_heads, head_dim, vocab = (
        sz.tokens, sz.hidden, sz.intermediate, sz.heads, sz.kv_heads, sz.head_dim, sz.vocab)
    new = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)
    out = []
    if "rms_norm" in ops:
        nh = tokens * hidden
        out.append(Case("rms_norm", f"rms_norm+residual {tokens}x{hidden}",
                        dict(x=new(tokens, hidden), w=1 + 0.1 * new(hidden), r=new(tokens, hidden)), ["x", "w", "r"],
                        {"fwd": 4 * nh * e, "fwd+bwd": 8 * nh * e}, "GB/s"))
    if "swiglu" in ops:
        n = tokens * inter
        out.append(Case("swiglu", f"swiglu {tokens}x{inter}",
                        dict(g=new(tokens, inter), u=new(tokens, inter)), ["g", "u"],
                        {"fwd": 3 * n * e, "fwd+bwd": 8 * n * e}, "GB/s"))
    if "rope" in ops:
        from roundpipe.kernels import RotaryEmbedding

        cos, sin = RotaryEmbedding(head_dim, 1e6, device=device).cos_sin(
            torch.arange(tokens, device=device)[None], dtype)
        nqk = tokens * (heads + kv_heads) * head_dim + tokens * head_dim  # q, k and cos+sin once each
        out.append(Case("rope", f"rope q{heads} k{kv_heads} T{tokens} D{head_dim}",
                        dict(q=new(1, tokens, heads, head_dim).transpose(1, 2),
                             k=new(1, tokens, kv_heads, head_dim).transpose(1, 2), cos=cos, sin=sin), ["q", "k"],
                        {"fwd": 2 * nqk * e, "fwd+bwd": 4 * nqk * e}, "GB/s"))
    if "lce" in ops:
        w = new(vocab, hidden) / hidden ** 0.5
        for t in sz.lce_tokens:
            labels = torch.randint(0, vocab, (t,), device=device)
            labels[::10] = -100
            flops = 2 * t * hidden * vocab
            out.append(Case("lce", f"lm-head loss T{t} V{vocab}", dict(h=new(t, hidden), w=w, labels=labels),
                            ["h", "w"], {"fwd": flops, "fwd+bwd": 3 * flops}, "TFLOP/s"))
    return out


def passes(fn, case: Case) -> dict[str, Callable]:
    """The forward (no autograd) and forward+backward (grads via autograd.grad, no accumulation)."""
    leaves = {k: (v.detach().requires_grad_(True) if k in case.grad_of else v) for k, v in case.inputs.items()}
    targets = [leaves[k] for k in case.grad_of]

    def fwd():
        with torch.no_grad():
            return fn(**case.inputs)

    def fwd_bwd():
        out = fn(**leaves)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None and o.requires_grad]
        return torch.autograd.grad(outs, targets, [torch.ones_like(o) for o in outs], allow_unused=True)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _old_lce_chunk(tokens: int, hidden: int, vocab: int) -> int:
    """linear_cross_entropy's default chunk before the large-vocabulary fix: logits about as large as hidden."""
    return max(1, min(tokens, 1 << (-(-tokens * hidden // vocab) - 1).bit_length()))


def lce_chunk_report(cuda: bool, quick: bool) -> Report:
    """Chunk sizing of the LM-head loss, old rule against the default: counted bytes, then a timed case."""
    from roundpipe.kernels import linear_cross_entropy
    from roundpipe.kernels.linear_cross_entropy import chunk_costs, default_chunk_size

    report = Report("kernels_lce_chunks", columns=["case", "rule", "chunk", "chunks", "GB moved", "[V,H] GB",
                                                   "logits GB", "temp GB", "fewer bytes", "ms", "vs before"],
                    device="cuda" if cuda else "cpu")
    vocab, b, acc = 151936, 2, 4
    for tokens, hidden in ((4096, 1024), (4096, 4096), (16384, 1024), (16384, 4096), (32768, 5120)):
        old = chunk_costs(tokens, hidden, vocab, _old_lce_chunk(tokens, hidden, vocab), b, acc)
        for rule, chunk in (("before", _old_lce_chunk(tokens, hidden, vocab)),
                            ("after", default_chunk_size(tokens, hidden, vocab, b, acc))):
            c = chunk_costs(tokens, hidden, vocab, chunk, b, acc)
            report.add(case=f"counted T{tokens} H{hidden} V{vocab} bf16", rule=rule, chunk=chunk, chunks=c.chunks,
                       **{"GB moved": c.bytes_moved / 1e9, "[V,H] GB": c.weight_bytes_moved / 1e9,
                          "logits GB": c.logits_bytes_moved / 1e9, "temp GB": c.temporary_bytes / 1e9,
                          "fewer bytes": old.bytes_moved / c.bytes_moved})
    if cuda:
        tokens, hidden, vocab, dtype = (4096, 1024, 151936, torch.bfloat16) if quick else \
            (16384, 4096, 151936, torch.bfloat16)
        device, sync, repeat = "cuda", torch.cuda.synchronize, 5
    else:
        tokens, hidden, vocab, dtype = 128, 1024, 32000, torch.bfloat16
        device, sync, repeat = "cpu", None, 3
    h = torch.randn(tokens, hidden, device=device, dtype=dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=device) / hidden ** 0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    before_ms = None
    for rule, chunk in (("before", _old_lce_chunk(tokens, hidden, vocab)),
                        ("after", default_chunk_size(tokens, hidden, vocab, dtype.itemsize, 4))):
        run = lambda: torch.autograd.grad(linear_cross_entropy(h, w, labels, chunk_size=chunk), [h, w])
        ms = median_time(run, warmup=1, repeat=repeat, sync=sync) * 1e3
        before_ms = before_ms or ms
        c = chunk_costs(tokens, hidden, vocab, chunk, dtype.itemsize, 4)
        report.add(case=f"timed T{tokens} H{hidden} V{vocab} {str(dtype)[6:]}", rule=rule, chunk=chunk,
                   chunks=c.chunks, **{"GB moved": c.bytes_moved / 1e9, "temp GB": c.temporary_bytes / 1e9,
                                       "ms": ms, "vs before": before_ms / ms})
    report.note("counted: chunk_costs' count of tensor accesses per forward+backward (bf16, fp32 dW sums), "
                "not a measurement; [V,H] GB: W read twice and dW's product and fp32 sum, per chunk")
    report.note("timed: median of forward+backward with the chunk forced; "
                + ("on this GPU" if cuda else "CPU under TRITON_INTERPRET=1, whose interpreted softmax costs both "
                   "rules the same; the difference is torch's matmuls and dW passes"))
    return report


def _peak_mib(fn, device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _device_limits(device: str, quick: bool) -> tuple[float, float]:
    """Measured copy bandwidth (GB/s, read+write) and bf16 matmul rate (TFLOP/s) of the device."""
    sync = torch.cuda.synchronize
    src = torch.empty(256 << 20 if quick else 1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / median_time(lambda: dst.copy_(src), sync=sync, repeat=9) / 1e9
    src = dst = None   # frees the buffers before the matmul (a del would unbind the lambda's names)
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    flops = 2 * n ** 3 / median_time(lambda: a @ b, sync=sync, repeat=9) / 1e12
    return bandwidth, flops


def _import_liger(report: Report):
    try:
        from liger_kernel.transformers import functional as liger

        return liger
    except ImportError as exc:
        report.note(f"Liger-Kernel not measured: {exc} (pip install liger-kernel in a separate environment)")
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/kernels.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="rms_norm,swiglu,rope,lce,lce_chunks",
                        help="comma-separated subset of the ops")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    add_common_args(parser)
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - {"rms_norm", "swiglu", "rope", "lce", "lce_chunks"}
    if unknown:
        parser.error(f"--ops has unknown names {sorted(unknown)}")
    cuda = torch.cuda.is_available()
    if not cuda:
        print("bench/kernels.py: no CUDA GPU visible; this benchmark is meaningful on a GPU only. Running the "
              "CPU sanity mode (tiny shapes, Triton interpreter; only the lce_chunks table is saved).", file=sys.stderr)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before roundpipe.kernels defines its kernels
    device = "cuda" if cuda else "cpu"
    if "lce_chunks" in ops:
        lce_chunk_report(cuda, args.quick).finish(args.out, save=not args.no_save)
        ops.remove("lce_chunks")
        if not ops:
            return 0
    report = Report("kernels", columns=["case", "pass", "provider", "ms", "rate", "unit", "% of limit",
                                        "vs eager", "peak MiB"], device=device)
    if cuda:
        bandwidth, matmul = _device_limits(device, args.quick)
        report.note(f"measured limits: copy {bandwidth:.0f} GB/s (read+write), bf16 matmul {matmul:.0f} TFLOP/s")
        sizes = Sizes(tokens=4096, lce_tokens=(8192,)) if args.quick else Sizes()
        sync, repeat = torch.cuda.synchronize, (5 if args.quick else 15)
    else:
        bandwidth = matmul = None
        sizes, sync, repeat = CPU_SANITY, None, 1
    liger = _import_liger(report) if cuda else None
    for case in cases(ops, device, sizes, torch.bfloat16 if cuda else torch.float32):
        limit = {"GB/s": bandwidth, "TFLOP/s": matmul}[case.unit]
        eager_ms = {}
        for name, fn in providers(case.op, cuda and not args.no_compile, liger).items():
            for pass_name, run in passes(fn, case).items():
                row = dict(case=case.label, **{"pass": pass_name}, provider=name, unit=case.unit)
                try:
                    seconds = median_time(run, warmup=2 if cuda else 0, repeat=repeat, sync=sync)
                    peak = _peak_mib(run, device) if case.op == "lce" and pass_name == "fwd+bwd" else None
                except torch.cuda.OutOfMemoryError:
                    report.add(**row, ms="OOM")
                    torch.cuda.empty_cache()
                    continue
                except Exception as exc:  # noqa: BLE001 - a peer or torch.compile failing must not end the run
                    report.add(**row, ms="error")
                    report.note(f"{name} {case.label} {pass_name}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                rate = case.work[pass_name] / seconds / (1e9 if case.unit == "GB/s" else 1e12)
                if name == "eager":
                    eager_ms[pass_name] = seconds * 1e3
                vs_eager = eager_ms[pass_name] / (seconds * 1e3) if pass_name in eager_ms else ""
                report.add(**row, ms=seconds * 1e3, rate=rate, **{
                    "% of limit": 100 * rate / limit if limit else "", "vs eager": vs_eager,
                    "peak MiB": peak if peak is not None else ""})
    report.note("rate: minimal bytes moved (elementwise ops) or 2*T*H*V FLOPs per LM-head matmul (3 with backward); "
                "vs eager > 1 is faster; peak MiB: allocated above the inputs during forward+backward")
    if not cuda:
        report.note("CPU sanity mode under TRITON_INTERPRET=1: timings are not meaningful")
    report.finish(args.out, save=cuda and not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
