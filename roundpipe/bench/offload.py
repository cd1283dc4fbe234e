"""Host<->device offload: bandwidth per memory kind, allocator cost, host footprint.

Three tables, each also appended as JSON rows (offload_alloc/_bandwidth/_footprint.jsonl
in the --out folder, see roundpipe.bench.runner):

alloc      first allocation (page-locking included) and steady alloc+free of
           each size, torch pinned vs the arena vs pageable torch.empty.
bandwidth  H2D, D2H and bidirectional copies of 64 KiB .. 1 GiB from pageable
           memory, torch pinned memory (`pin_memory=True`) and the roundpipe
           arena, with torch `copy_` on 1-4 streams and with the roundpipe copy
           engine (1 stream = the activation queue, 2 = activation + bulk
           queue); each GPU alone and all GPUs at once (PCIe/host contention).
           "% pinned" is the rate over plain pinned cudaMemcpy (torch pinned,
           1 stream, same size, direction and device) measured in the same run.
footprint  host bytes each allocator reserves for every parameter tensor of
           Qwen3/Llama shapes (bf16 upload copy, fp32 master copy).

Without a GPU the same program measures the host backend: copy-engine memcpy
throughput (1 and 2 threads per copy) against a plain single-threaded
memcpy and torch's `copy_`, and the
allocators; it says so in a note.  Its "mapped file" rows (up only) copy from a
fresh private map of a file already in the page cache, as a CPU worker uploads a
base left in its files (rp.hf.from_pretrained(base_in_ram=False), roundpipe/hf/mapped.py):
every 4 KiB page is a minor fault on first touch.  The GPU path has no such row yet.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

from roundpipe.bench.runner import Report, add_common_args, median_time
from roundpipe.offload import ArenaConfig, CopyEngine, HostArena, cuda_status
from roundpipe.offload.footprint import SHAPES, arena_footprint, pow2_footprint

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BW_COLUMNS = ["device", "dir", "memory", "provider", "streams", "size", "ms", "GB/s", "% pinned"]


def _size_name(n: int) -> str:
    return f"{n // GiB} GiB" if n >= GiB else f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _timing(size: int, quick: bool) -> dict:
    # Small copies are microseconds long: loop them for a few ms per sample.
    return dict(warmup=1 if size >= 256 * MiB else 2, repeat=5 if quick else 7,
                min_time=0.0 if size >= 16 * MiB else (0.005 if quick else 0.02))


def _pieces(t: torch.Tensor, k: int) -> list[torch.Tensor]:
    return list(t.chunk(k))


# -- GPU --------------------------------------------------------------------------------------
def _host_buffers(arena: HostArena, n: int) -> dict[str, torch.Tensor]:
    return {"pageable": torch.empty(n, dtype=torch.uint8), "torch pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True),
            "arena": arena.empty(n, torch.uint8)}


def _torch_copies(jobs, k: int):
    """jobs: (dst, src, device) triples; each split over k streams per job and direction."""
    streams = {}

    def run():
        for j, (dst, src, dev) in enumerate(jobs):
            for i, (d, s) in enumerate(zip(_pieces(dst, k), _pieces(src, k))):
                stream = streams.setdefault((j, i), torch.cuda.Stream(dev))
                with torch.cuda.stream(stream):
                    d.copy_(s, non_blocking=True)
        for s in streams.values():
            s.synchronize()
    return run


def _engine_copies(engines, jobs, k: int):
    """jobs: (dst, src, device, upload) on the device's engine; k=2 adds the bulk queue."""
    def run():
        fences = []
        for dst, src, dev, up in jobs:
            queues = (["act_up", "param_up"] if up else ["act_down", "grad_down"])[:k]
            for q, d, s in zip(queues, _pieces(dst, k), _pieces(src, k)):
                fences.append(engines[dev].copy(q, d, s))
        for f in fences:
            f.wait()
    return run


def gpu_bandwidth(report: Report, sizes: list[int], streams: list[int], quick: bool) -> None:
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    arena = HostArena(ArenaConfig(backend="cuda"))
    engines = {d: CopyEngine(d) for d in devices}
    groups = [(str(d), [d]) for d in devices] + ([("all", devices)] if len(devices) > 1 else [])
    for label, devs in groups:
        for size in sizes:
            if label == "all" and size > 256 * MiB:
                continue
            host = {d: (_host_buffers(arena, size), _host_buffers(arena, size)) for d in devs}
            gpu = {d: (torch.empty(size, dtype=torch.uint8, device=d), torch.empty(size, dtype=torch.uint8, device=d))
                   for d in devs}
            base = {}
            for direction in ("H2D", "D2H", "bidir"):
                for mem in ("torch pinned", "pageable", "arena"):
                    def jobs():
                        out = []
                        for d in devs:
                            (h0, h1), (g0, g1) = host[d], gpu[d]
                            if direction in ("H2D", "bidir"):
                                out.append((g0, h0[mem], d, True))
                            if direction in ("D2H", "bidir"):
                                out.append((h1[mem], g1, d, False))
                        return out
                    providers = [("torch copy_", k, _torch_copies([j[:3] for j in jobs()], k)) for k in streams]
                    if mem == "arena":
                        providers += [("roundpipe engine", k, _engine_copies(engines, jobs(), k)) for k in (1, 2)]
                    for provider, k, fn in providers:
                        t = median_time(fn, **_timing(size, quick))
                        nbytes = size * len(jobs())
                        gbs = nbytes / t / 1e9
                        if mem == "torch pinned" and k == 1:
                            base.setdefault(direction, gbs)
                        report.add(device=label, dir=direction, memory=mem, provider=provider, streams=k,
                                   size=_size_name(size), ms=t * 1e3, **{"GB/s": gbs,
                                   "% pinned": 100 * gbs / base[direction]})
            host = gpu = None   # frees the buffers (a del would unbind names the jobs() closure reads)
    if len(devices) == 1:
        report.note("one GPU visible: no all-GPUs-at-once rows")


# -- host backend -----------------------------------------------------------------------------
def _mapped(path: str, size: int) -> torch.Tensor:
    """A fresh private map of the file's `size` bytes (lazy: nothing is read until a copy touches it)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(path, shared=False, nbytes=size))


def mapped_bandwidth(report: Report, size: int, src: torch.Tensor, dst: torch.Tensor, engines: dict,
                     plain: float, quick: bool) -> None:
    """Rows for an upload read from a memory-mapped file in the page cache (warm), mapped anew every copy."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "base.bin")
        src.numpy().tofile(path)
        dst.copy_(_mapped(path, size))   # the page cache warm
        copies = {("torch copy_", "-"): lambda: dst.copy_(_mapped(path, size))}
        for k, engine in engines.items():
            def engine_copy(e=engine):
                fresh = _mapped(path, size)   # held until the copy is done: its map goes with it
                e.copy("act_up", dst, fresh).wait()
            copies[("roundpipe engine", k)] = engine_copy
        for (provider, k), run in copies.items():
            t = median_time(run, **_timing(size, quick))
            gbs = size / t / 1e9
            report.add(device="cpu", dir="up", memory="mapped file", provider=provider, streams=k,
                       size=_size_name(size), ms=t * 1e3, **{"GB/s": gbs, "% pinned": 100 * gbs / plain})


def host_bandwidth(report: Report, sizes: list[int], streams: list[int], quick: bool) -> None:
    arena = HostArena(ArenaConfig(backend="host"))
    engines = {k: CopyEngine("cpu", threads_per_copy=k) for k in streams}
    for size in sizes:
        srcs = {"pageable": torch.randint(0, 255, (size,), dtype=torch.uint8)}
        srcs["arena"] = arena.copy_of(srcs["pageable"])
        dsts = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        src2 = srcs["pageable"].clone()
        base = {}
        for direction in ("up", "bidir"):
            pairs = [(dsts[0], "act_up")] + ([(dsts[1], "act_down")] if direction == "bidir" else [])

            def memcpy():  # one thread, no pool: the host's plain memcpy rate
                np.copyto(dsts[0].numpy(), srcs["pageable"].numpy())
                if direction == "bidir":
                    np.copyto(dsts[1].numpy(), src2.numpy())
            t = median_time(memcpy, **_timing(size, quick))
            base[direction] = size * len(pairs) / t / 1e9
            report.add(device="cpu", dir=direction, memory="pageable", provider="plain memcpy", streams=1,
                       size=_size_name(size), ms=t * 1e3, **{"GB/s": base[direction], "% pinned": 100.0})
            for mem, src in srcs.items():
                def torch_copy():
                    dsts[0].copy_(src)
                    if direction == "bidir":
                        dsts[1].copy_(src2)
                t = median_time(torch_copy, **_timing(size, quick))
                gbs = size * len(pairs) / t / 1e9
                report.add(device="cpu", dir=direction, memory=mem, provider="torch copy_", streams="-",
                           size=_size_name(size), ms=t * 1e3, **{"GB/s": gbs, "% pinned": 100 * gbs / base[direction]})
                for k, engine in engines.items():
                    def engine_copy():
                        fs = [engine.copy(q, d, src if q == "act_up" else src2) for d, q in pairs]
                        for f in fs:
                            f.wait()
                    t = median_time(engine_copy, **_timing(size, quick))
                    gbs = size * len(pairs) / t / 1e9
                    report.add(device="cpu", dir=direction, memory=mem, provider="roundpipe engine", streams=k,
                               size=_size_name(size), ms=t * 1e3,
                               **{"GB/s": gbs, "% pinned": 100 * gbs / base[direction]})
        mapped_bandwidth(report, size, srcs["pageable"], dsts[0], engines, base["up"], quick)
    report.note("NO GPU: host backend only. 'up' = memcpy on the act_up worker, 'bidir' = act_up and act_down "
                "workers at once; streams = threads per copy; '% pinned' here is percent of a single-threaded "
                "plain memcpy (numpy.copyto) in the same run, not of cudaMemcpy; 'mapped file' = a fresh private "
                "map of a file in the page cache per copy (a base left in its files: CPU-worker numbers, the GPU "
                "path unmeasured)")


# -- allocators and footprint -----------------------------------------------------------------
def allocators(report: Report, sizes: list[int], gpu: bool, quick: bool) -> None:
    providers = {"pageable torch.empty": lambda n: torch.empty(n, dtype=torch.uint8)}
    if gpu:
        providers["torch pinned"] = lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)
    for size in sizes:
        arena = HostArena(ArenaConfig(backend="cuda" if gpu else "host"))
        table = dict(providers, **{f"arena ({arena.backend})": lambda n, a=arena: a.empty(n, torch.uint8)})
        for name, alloc in table.items():
            start = time.perf_counter()
            first = alloc(size)
            t_first = time.perf_counter() - start
            del first

            def cycle():
                t = alloc(size)
                del t
            t = median_time(cycle, warmup=1, repeat=5 if quick else 9, min_time=0.002)
            report.add(size=_size_name(size), allocator=name, **{"first alloc ms": t_first * 1e3,
                       "alloc+free us": t * 1e6})


def footprint(report: Report) -> None:
    for shape in SHAPES.values():
        for bpe, what in ((2, "bf16 upload"), (4, "fp32 master")):
            sizes = shape.tensor_bytes(bpe)
            req = sum(sizes)
            ours, pow2 = arena_footprint(sizes), pow2_footprint(sizes)
            report.add(model=shape.name, copy=what, tensors=len(sizes), **{
                "requested GiB": req / GiB, "arena GiB": ours / GiB, "arena x": ours / req,
                "pow2 GiB": pow2 / GiB, "pow2 x": pow2 / req})
    report.note("pow2 = torch's pinned CachingHostAllocator rounding (next power of two per tensor), modelled; "
                "arena = measured bookkeeping of a HostArena with default chunks (64 MiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roundpipe bench offload", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-size", type=int, default=None,
                        help="largest copy in bytes (default 1 GiB; 64 MiB with --quick)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    top = args.max_size or (64 * MiB if args.quick else GiB)
    if top < 64 * KiB:
        parser.error(f"--max-size={top} must be >= 65536")
    sizes = [s for s in ([64 * KiB, MiB, 16 * MiB, 64 * MiB] if args.quick else
                         [64 * KiB << (2 * i) for i in range(8)]) if s <= top]
    streams = [1, 4] if args.quick else [1, 2, 3, 4]
    # Allocators first: torch's pinned allocator caches every size it has served,
    # so a first allocation is only a real cudaHostAlloc before the copies run.
    al = Report("offload_alloc", ["size", "allocator", "first alloc ms", "alloc+free us"])
    allocators(al, sizes, gpu, args.quick)
    if not gpu:
        al.note("NO GPU: no torch pinned allocator to compare; arena serves plain memory")
    al.note("an arena's first allocation reserves a whole chunk (64 MiB, or the block's own size when larger); "
            "torch pinned rounds the block to a power of two")
    al.finish(args.out, save=not args.no_save)
    bw = Report("offload_bandwidth", BW_COLUMNS)
    (gpu_bandwidth if gpu else host_bandwidth)(bw, sizes, streams if gpu else [1, 2], args.quick)
    bw.note(f"CUDA: {cuda_status()}")
    bw.finish(args.out, save=not args.no_save)
    fp = Report("offload_footprint", ["model", "copy", "tensors", "requested GiB", "arena GiB", "arena x",
                                      "pow2 GiB", "pow2 x"])
    footprint(fp)
    fp.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
