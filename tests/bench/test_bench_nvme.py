"""`roundpipe bench nvme` runs end to end at small sizes and prints both providers with their ratio."""
import pytest

from roundpipe import _native

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")


def test_small_run_prints_store_and_probe(capsys, tmp_path):
    """8 MiB cases, no saving: sequential and per-layer rows for each store backend and the O_DIRECT probe."""
    from roundpipe.bench import nvme
    from roundpipe.offload.nvme import io_uring_refused

    providers = 2 if io_uring_refused() else 3   # the probe, the thread pool and, where the kernel allows, io_uring

    assert nvme.main(["--quick", "--no-save", "--dir", str(tmp_path), "--size", str(8 << 20), "--layers", "3",
                      "--layer-bytes", str(8 << 20)]) == 0
    out = capsys.readouterr().out
    assert "== nvme" in out and "% probe" in out
    for case in ("sequential write", "sequential read", "per-layer read+write (3 x 8 MiB)"):
        assert out.count(case) == providers
    assert list(tmp_path.iterdir()) == []   # the store's and the probe's files are gone


def test_rejects_sizes_off_the_probe_block():
    """--size must be a multiple of the probe's 8 MiB block."""
    from roundpipe.bench import nvme

    with pytest.raises(SystemExit):
        nvme.main(["--quick", "--no-save", "--size", "1000"])
