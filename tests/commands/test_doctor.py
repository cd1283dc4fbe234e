"""`roundpipe doctor`: the report, its JSON form and its exit status."""
import json
import os
import subprocess
import sys

from roundpipe.commands import doctor


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "roundpipe", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=180)


def test_doctor_reports_everything_and_exits_zero():
    """The text report names versions, the native core with its SIMD level, threads, CUDA and Triton."""
    out = run_cli("doctor")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ["roundpipe", "python", "torch", "triton", "native", "SIMD", "threads", "cuda", "kernels",
                   "status: usable"]:
        assert needle in text, needle
    import torch

    if not torch.cuda.is_available():
        assert "cuda       none:" in text


def test_doctor_json_is_machine_readable():
    """--json prints one object with the same facts and usable=true."""
    out = run_cli("doctor", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["usable"] is True
    assert data["versions"]["torch"]
    assert data["native"]["simd_level"] in ("scalar", "avx2", "avx512", "none")
    assert isinstance(data["gpus"], list)


def test_doctor_strict_fails_when_degraded():
    """With the native core disabled, doctor still exits 0 but explains; --strict exits 1."""
    out = run_cli("doctor", ROUNDPIPE_NO_NATIVE="1")
    assert out.returncode == 0, out.stderr
    assert "native     MISSING: ROUNDPIPE_NO_NATIVE is set" in out.stdout
    assert "native core missing" in out.stdout
    assert run_cli("doctor", "--strict", ROUNDPIPE_NO_NATIVE="1").returncode == 1


def test_diagnosis_without_gpu_has_advice_and_parses_pcie(tmp_path, monkeypatch):
    """The in-process diagnosis reports no GPU here and reads PCIe link speed/width from sysfs."""
    d = doctor.diagnose()
    assert d.usable
    dev = tmp_path / "0000:65:00.0"
    dev.mkdir()
    (dev / "current_link_speed").write_text("16.0 GT/s PCIe\n")
    (dev / "current_link_width").write_text("16\n")
    (dev / "max_link_speed").write_text("32.0 GT/s PCIe\n")
    monkeypatch.setattr(doctor, "Path", lambda p: tmp_path if p == "/sys/bus/pci/devices" else __import__("pathlib").Path(p))
    link = doctor._pcie_from_sysfs("0000:65:00.0")
    assert link == {"pcie_gen": 4, "pcie_width": 16, "pcie_max_gen": 5}


def test_cli_routes_and_rejects_unknown_commands():
    """`roundpipe --help` lists commands; unknown commands exit 2 with the list."""
    out = run_cli("--help")
    assert out.returncode == 0 and "doctor" in out.stdout and "bench" in out.stdout
    bad = run_cli("frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
    assert run_cli("--version").stdout.startswith("roundpipe ")
