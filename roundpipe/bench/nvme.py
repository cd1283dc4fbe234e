"""NVMe tier: read/write GB/s of the file store against a plain O_DIRECT probe on the same file system.

Cases, each run by both providers on files in the same folder (--dir):

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
the layer, then write it).  "% probe" is the store's rate over the probe's,
measured in the same run, alternating the two providers run by run (medians of 5,
3 with --quick); the goal is >= 80 (DeepSpeed's own tuning guide reaches
66-74% of a drive's rating).  Writes are not fsync'ed by either provider (O_DIRECT
bypasses the page cache; both see the same device write cache).

    roundpipe bench nvme [--quick] [--dir /nvme/scratch] [--threads 4] [--out FILE.jsonl | DIR] [--no-save]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from roundpipe.bench.runner import Report, add_common_args
from roundpipe.offload.nvme import NVMeConfig, NVMeStore, check_free_space, file_bytes

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


def _paired(probe_fn, ours_fn, warmup: int, repeat: int) -> tuple[float, float]:
    """Median seconds of each, measured alternately (probe, ours, probe, ...): a shared virtual disk drifts by
    tens of percent over seconds, and alternating puts both providers under the same drift."""
    for _ in range(warmup):
        probe_fn()
        ours_fn()
    times: tuple[list, list] = ([], [])
    for _ in range(repeat):
        for fn, out in ((probe_fn, times[0]), (ours_fn, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


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


def run(args) -> Report:
    report = Report("nvme", columns=COLUMNS, device="cpu")
    parent = args.dir or tempfile.gettempdir()
    size, layer_bytes, layers = args.size, args.layer_bytes, args.layers
    needed = 2 * file_bytes(size) + 2 * layers * file_bytes(layer_bytes)
    check_free_space(parent, needed, what="roundpipe bench nvme")
    repeat, warmup = (3, 1) if args.quick else (5, 1)
    store = NVMeStore(parent, NVMeConfig(threads=args.threads, chunk_bytes=args.chunk_bytes))
    probe = Probe(store.folder, max(size, layers * layer_bytes))
    try:
        buf = store.empty(size)
        buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        view = memoryview(buf.numpy())
        seq = store.allocate("sequential", size)
        store.write(seq, buf)
        probe.transfer(True, view)
        for case, write in (("sequential write", True), ("sequential read", False)):
            op = store.write if write else store.read
            t_probe, t_ours = _paired(lambda: probe.transfer(write, view), lambda: op(seq, buf), warmup, repeat)
            _rows(report, case, size, t_ours, t_probe, args.threads)

        regions = [store.allocate(f"layer{i}", layer_bytes) for i in range(layers)]
        bufs = [store.empty(layer_bytes) for _ in range(3)]
        for r in regions:
            store.write(r, buf[:layer_bytes] if layer_bytes <= size else bufs[0])
        moved = 2 * layers * layer_bytes
        lview = memoryview(bufs[0].numpy())
        t_probe, t_ours = _paired(lambda: _probe_layers(probe, lview, layers, layer_bytes),
                                  lambda: _layer_loop(store, regions, bufs), warmup, repeat)
        _rows(report, f"per-layer read+write ({layers} x {layer_bytes // MiB} MiB)", moved, t_ours, t_probe,
              args.threads)
        report.note(f"folder {parent} ({'O_DIRECT' if store.direct else 'buffered: no O_DIRECT'}); store: "
                    f"{args.threads} I/O threads, {args.chunk_bytes // MiB} MiB chunks, thread-pool pread/pwrite "
                    f"(no io_uring path); probe: 1 thread, {PROBE_BLOCK // MiB} MiB O_DIRECT pwrite/preadv")
    finally:
        probe.close()
        store.close()
    return report


def _rows(report: Report, case: str, nbytes: int, t_ours: float, t_probe: float, threads: int) -> None:
    probe = _gbps(nbytes, t_probe)
    report.add(case=case, provider="O_DIRECT probe (1 thread)", bytes=nbytes, ms=t_probe * 1e3, **{"GB/s": probe,
               "% probe": 100.0})
    ours = _gbps(nbytes, t_ours)
    report.add(case=case, provider=f"NVMeStore ({threads} threads)", bytes=nbytes, ms=t_ours * 1e3,
               **{"GB/s": ours, "% probe": 100.0 * ours / probe})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roundpipe bench nvme", description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--dir", default=None, help="folder on the drive to measure (default: the temp folder)")
    parser.add_argument("--threads", type=int, default=4, help="the store's I/O threads (default 4)")
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
