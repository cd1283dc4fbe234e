"""Host dtype conversion (the optimizer's upload-copy write) against torch and DRAM speed.

For each direction, times roundpipe's native convert, torch's `dst.copy_(src)`
and a plain fp32 memcpy-style copy (`torch.Tensor.copy_` of same dtype) that
stands for the measured DRAM limit; reports GB/s of bytes read + written and
percent of that copy's rate.  Every forced SIMD level is measured too.
"""
from __future__ import annotations

import argparse

import torch

from roundpipe import _native, hostops
from roundpipe.bench.runner import Report, add_common_args, median_time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roundpipe bench convert", description=__doc__)
    parser.add_argument("--elements", type=int, default=None, help="elements per buffer (default 64M, 8M with --quick)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    n = args.elements or ((8 << 20) if args.quick else (64 << 20))
    repeat = 5 if args.quick else 9

    report = Report("convert", columns=["case", "provider", "ms", "GB/s", "% of copy", "vs torch"], device="cpu")
    copy_src = torch.randn(n)
    copy_dst = torch.empty(n)
    t_copy = median_time(lambda: copy_dst.copy_(copy_src), repeat=repeat)
    copy_gbs = 8 * n / t_copy / 1e9
    report.add(case=f"fp32->fp32 {n / 2**20:.0f}M", provider="torch copy (limit)", ms=t_copy * 1e3,
               **{"GB/s": copy_gbs, "% of copy": 100.0, "vs torch": 1.0})

    levels = [lvl for lvl in ("scalar", "avx2", "avx512") if _native.available() and
              ("scalar", "avx2", "avx512").index(lvl) <= ("scalar", "avx2", "avx512").index(_native.lib.best_simd_level())]
    start_level = _native.simd_level()
    for src_dt, dst_dt in [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                           (torch.float32, torch.float16), (torch.float16, torch.float32)]:
        src = torch.randn(n).to(src_dt)
        dst = torch.empty(n, dtype=dst_dt)
        nbytes = n * (src.element_size() + dst.element_size())
        case = f"{str(src_dt)[6:]}->{str(dst_dt)[6:]} {n / 2**20:.0f}M"
        t_torch = median_time(lambda: dst.copy_(src), repeat=repeat)
        report.add(case=case, provider="torch", ms=t_torch * 1e3, **{"GB/s": nbytes / t_torch / 1e9,
                   "% of copy": 100 * nbytes / t_torch / 1e9 / copy_gbs, "vs torch": 1.0})
        for level in levels:
            _native.set_simd_level(level)
            t = median_time(lambda: hostops.convert_(dst, src), repeat=repeat)
            report.add(case=case, provider=f"roundpipe {level}", ms=t * 1e3, **{"GB/s": nbytes / t / 1e9,
                       "% of copy": 100 * nbytes / t / 1e9 / copy_gbs, "vs torch": t_torch / t})
        if _native.available():
            _native.set_simd_level(start_level)
    if not _native.available():
        report.note(f"native core unavailable ({_native.unavailable_reason()}): only torch measured")
    report.note(f"{torch.get_num_threads()} torch threads; native threads: "
                f"{_native.lib.num_threads() if _native.available() else 'n/a'}")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
