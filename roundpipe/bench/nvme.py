"""NVMe tier: read/write GB/s of the file store, io_uring and thread pool, against a plain O_DIRECT probe.

Providers, on files in the same folder (--dir): the probe, and an NVMeStore per
backend (--backend both: io_uring, where the kernel gives this process one, and
the thread pool; both keep --threads chunks of --chunk-bytes in the drive's queue).
Cases, each run by every provider:

sequential write / read   one region of --size bytes moved as one request (the
                          store cuts it into chunk_bytes pieces over its threads)
per-layer read+write      --layers regions of --layer-bytes (64 MiB: a decoder
                          layer's optimizer state), visited in order the way the
                          per-layer step will: wait for layer i's read, write it
                          behind, read layer i+1 ahead (three host buffers; a
                          buffer is read into again only after its write ended).
                          GB/s counts the bytes read plus the bytes written.

The probe is the simplest program that reaches the drive: one thread, an
O_DIRECT file descriptor, pwrite/preadv of 8 MiB blocks in a loop (per layer: read
the layer, then write it).  "% probe" is a store's rate over the probe's,
measured in the same run, the providers taking turns run by run (medians of 5,
3 with --quick); the goal is >= 80 (DeepSpeed's own tuning guide reaches
66-74% of a drive's rating).  Writes are not fsync'ed by either provider (O_DIRECT
bypasses the page cache; both see the same device write cache).

    roundpipe bench nvme [--quick] [--dir /nvme/scratch] [--threads 4] [--backend both|io_uring|threads]
                         [--out FILE.jsonl | DIR] [--no-save]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from roundpipe.bench.runner import Report, add_common_args
from roundpipe.offload.nvme import NVMeConfig, NVMeStore, check_free_space, file_bytes, io_uring_refused

MiB, GiB = 1 << 20, 1 << 30
PROBE_BLOCK = 8 * MiB
COLUMNS = ["case", "provider", "bytes", "ms", "GB/s", "% probe"]


class Probe:
    """A plain single-threaded O_DIRECT pread/pwrite loop over one preallocated file."""

    def __init__(self, folder: str, nbytes: int):
        self.path = os.path.join(folder, "probe.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, file_bytes(nbytes))

    def transfer(self, write: bool, view: memoryview, offset: int = 0) -> None:
        for at in range(0, len(view), PROBE_BLOCK):
            piece = view[at:at + PROBE_BLOCK]
            done = os.pwrite(self.fd, piece, offset + at) if write else os.preadv(self.fd, [piece], offset + at)
            if done != len(piece):
                raise OSError(f"probe: {done} of {len(piece)} bytes at offset {offset + at} of {self.path}")

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _turns(fns, warmup: int, repeat: int) -> list[float]:
    """Median seconds of each function, measured in turns (a, b, c, then b, c, a, ...): a shared virtual disk drifts
    by tens of percent over seconds, and taking turns puts every provider under the same drift."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeat):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _layer_loop(store: NVMeStore, regions, bufs) -> None:
    """Read ahead one layer while the previous one is written behind (three buffers, no host copies)."""
    n = len(regions)
    writes = [None] * n
    ahead = store.read_async(regions[0], bufs[0])
    for i in range(n):
        store.wait(ahead)
        writes[i] = store.write_async(regions[i], bufs[i % 3])
        if i + 1 < n:
            if i >= 2:   # buffer (i+1) % 3 was the source of layer i-2's write
                store.wait(writes[i - 2])
            ahead = store.read_async(regions[i + 1], bufs[(i + 1) % 3])
    store.wait(*[w for w in writes[-3:] if w is not None])


def _probe_layers(probe: Probe, view: memoryview, layers: int, layer_bytes: int) -> None:
    for i in range(layers):
        piece = view[:layer_bytes]
        probe.transfer(False, piece, i * layer_bytes)
        probe.transfer(True, piece, i * layer_bytes)


def _backends(choice: str) -> tuple[list[str], str]:
    """The store backends to time, and a note when io_uring was asked for and is refused here."""
    refused = io_uring_refused()
    if choice == "threads" or (choice == "both" and refused):
        return ["threads"], f"io_uring not timed: {refused}" if refused else ""
    if refused:
        raise SystemExit(f"roundpipe bench nvme: --backend io_uring, but {refused}")
    return (["io_uring", "threads"] if choice == "both" else ["io_uring"]), ""


def _provider(store: NVMeStore) -> str:
    n = store.config.threads
    return f"NVMeStore io_uring (depth {n})" if store.backend == "io_uring" else f"NVMeStore threads ({n} threads)"


def run(args) -> Report:
    report = Report("nvme", columns=COLUMNS, device="cpu")
    parent = args.dir or tempfile.gettempdir()
    size, layer_bytes, layers = args.size, args.layer_bytes, args.layers
    backends, skipped = _backends(args.backend)
    needed = (1 + len(backends)) * (file_bytes(size) + layers * file_bytes(layer_bytes))
    check_free_space(parent, needed, what="roundpipe bench nvme")
    repeat, warmup = (3, 1) if args.quick else (5, 1)
    stores = [NVMeStore(parent, NVMeConfig(threads=args.threads, chunk_bytes=args.chunk_bytes, backend=b))
              for b in backends]
    probe = Probe(stores[0].folder, max(size, layers * layer_bytes))
    try:
        buf = stores[0].empty(size)
        buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        view = memoryview(buf.numpy())
        seqs = [store.allocate("sequential", size) for store in stores]
        for store, seq in zip(stores, seqs):
            store.write(seq, buf)
        probe.transfer(True, view)
        for case, write in (("sequential write", True), ("sequential read", False)):
            ops = [(store.write if write else store.read, seq) for store, seq in zip(stores, seqs)]
            times = _turns([lambda: probe.transfer(write, view)] + [lambda op=op, seq=seq: op(seq, buf)
                                                                    for op, seq in ops], warmup, repeat)
            _rows(report, case, size, times, stores)

        bufs = [stores[0].empty(layer_bytes) for _ in range(3)]
        regions = [[store.allocate(f"layer{i}", layer_bytes) for i in range(layers)] for store in stores]
        for store, regs in zip(stores, regions):
            for r in regs:
                store.write(r, buf[:layer_bytes] if layer_bytes <= size else bufs[0])
        lview = memoryview(bufs[0].numpy())
        times = _turns([lambda: _probe_layers(probe, lview, layers, layer_bytes)] +
                       [lambda store=store, regs=regs: _layer_loop(store, regs, bufs)
                        for store, regs in zip(stores, regions)], warmup, repeat)
        _rows(report, f"per-layer read+write ({layers} x {layer_bytes // MiB} MiB)", 2 * layers * layer_bytes,
              times, stores)
        report.note(f"folder {parent} ({'O_DIRECT' if stores[0].direct else 'buffered: no O_DIRECT'}); stores: "
                    f"{args.chunk_bytes // MiB} MiB chunks, {args.threads} in flight; "
                    + "; ".join(f"{s.backend}: {s.backend_reason}" for s in stores)
                    + (f"; {skipped}" if skipped else "")
                    + f"; probe: 1 thread, {PROBE_BLOCK // MiB} MiB O_DIRECT pwrite/preadv")
    finally:
        probe.close()
        for store in stores:
            store.close()
    return report


def _rows(report: Report, case: str, nbytes: int, times: list[float], stores: list[NVMeStore]) -> None:
    """A row for the probe (times[0]) and one per store (times[1:]), with each store's percent of the probe."""
    probe = _gbps(nbytes, times[0])
    report.add(case=case, provider="O_DIRECT probe (1 thread)", bytes=nbytes, ms=times[0] * 1e3,
               **{"GB/s": probe, "% probe": 100.0})
    for store, t in zip(stores, times[1:]):
        ours = _gbps(nbytes, t)
        report.add(case=case, provider=_provider(store), bytes=nbytes, ms=t * 1e3,
                   **{"GB/s": ours, "% probe": 100.0 * ours / probe})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roundpipe bench nvme", description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--dir", default=None, help="folder on the drive to measure (default: the temp folder)")
    parser.add_argument("--threads", type=int, default=4,
                        help="chunks each store keeps in flight: I/O threads, or the io_uring's depth (default 4)")
    parser.add_argument("--backend", choices=["both", "io_uring", "threads"], default="both",
                        help="which store backends to time against the probe (default both; io_uring is left out "
                             "with a note where this process cannot use it)")
    parser.add_argument("--chunk-bytes", type=int, default=8 * MiB, help="bytes per thread per step (default 8 MiB)")
    parser.add_argument("--size", type=int, default=None, help="sequential case bytes (default 1 GiB, quick 256 MiB)")
    parser.add_argument("--layers", type=int, default=None, help="per-layer case regions (default 16, quick 6)")
    parser.add_argument("--layer-bytes", type=int, default=64 * MiB, help="bytes a layer (default 64 MiB)")
    args = parser.parse_args(argv)
    if args.size is None:
        args.size = 256 * MiB if args.quick else GiB
    if args.layers is None:
        args.layers = 6 if args.quick else 16
    for name in ("size", "layers", "layer_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.size % PROBE_BLOCK or args.layer_bytes % PROBE_BLOCK:
        parser.error(f"--size and --layer-bytes must be multiples of {PROBE_BLOCK // MiB} MiB (the probe's block)")
    report = run(args)
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
