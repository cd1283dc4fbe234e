"""`roundpipe bench offload` runs end to end at the smallest size and prints all three tables."""
import pytest

from roundpipe import _native
from roundpipe.bench import offload

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")


def test_quick_smallest_size_prints_three_tables(capsys):
    """One size, no saving: alloc, bandwidth and footprint tables appear with their notes."""
    assert offload.main(["--quick", "--no-save", "--max-size", "65536"]) == 0
    out = capsys.readouterr().out
    for name in ("offload_alloc", "offload_bandwidth", "offload_footprint"):
        assert f"== {name}" in out
    assert "64 KiB" in out and "Qwen3-4B" in out   # the named shape (roundpipe/shapes.py)
    if "NO GPU" in out:
        assert "roundpipe engine" in out


def test_rejects_tiny_max_size():
    """--max-size below 64 KiB is a usage error."""
    with pytest.raises(SystemExit):
        offload.main(["--quick", "--no-save", "--max-size", "1000"])
