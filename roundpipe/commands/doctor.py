"""`roundpipe doctor`: what this installation can do, and what to fix.

Reports versions, the native core and its SIMD level, threads, CUDA devices
(name, memory, PCIe link) and how Triton kernels will run.  Exit status 0 when
the library is usable (torch imports and roundpipe works, with or without the
native core); 1 otherwise, or with --strict when anything is degraded.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

PCIE_GEN_BY_GTS = {"2.5": 1, "5.0": 2, "5": 2, "8.0": 3, "8": 3, "16.0": 4, "16": 4, "32.0": 5, "32": 5, "64.0": 6, "64": 6}


@dataclass
class GpuInfo:
    index: int
    name: str
    memory_gib: float
    capability: str
    pci_bus_id: str | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None


@dataclass
class Diagnosis:
    versions: dict[str, str | None] = field(default_factory=dict)
    native: dict[str, object] = field(default_factory=dict)
    threads: dict[str, int | None] = field(default_factory=dict)
    gpus: list[GpuInfo] = field(default_factory=list)
    cuda_note: str = ""
    triton: str = ""
    offload: str = ""                                   # which CUDA runtime the pinned arena / copy engine use
    problems: list[str] = field(default_factory=list)   # the library cannot work
    advice: list[str] = field(default_factory=list)     # it works, but something is missing

    @property
    def usable(self) -> bool:
        return not self.problems


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pcie_from_sysfs(bus_id: str) -> dict[str, int | None]:
    """Link generation/width from /sys/bus/pci/devices/<bus id>/ (Linux)."""
    out: dict[str, int | None] = {}
    dev = Path("/sys/bus/pci/devices") / bus_id.lower()
    for key, fname in [("pcie_gen", "current_link_speed"), ("pcie_max_gen", "max_link_speed"),
                       ("pcie_width", "current_link_width"), ("pcie_max_width", "max_link_width")]:
        try:
            text = (dev / fname).read_text().strip()
        except OSError:
            continue
        if key.endswith("gen"):
            out[key] = PCIE_GEN_BY_GTS.get(text.split()[0])
        elif text.isdigit():
            out[key] = int(text)
    return out


def _pcie_from_nvidia_smi(index: int) -> dict[str, int | None]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    query = "pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max"
    try:
        res = subprocess.run([exe, f"--id={index}", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {}
    vals = [v.strip() for v in res.stdout.strip().split(",")]
    if res.returncode != 0 or len(vals) != 4:
        return {}
    as_int = lambda v: int(v) if v.isdigit() else None
    return dict(zip(["pcie_gen", "pcie_width", "pcie_max_gen", "pcie_max_width"], map(as_int, vals)))


def _gpus(torch) -> tuple[list[GpuInfo], str]:
    if not torch.cuda.is_available():
        reason = "no CUDA device visible"
        if torch.version.cuda is None:
            reason += f" (torch {torch.__version__} is a CPU-only build)"
        return [], reason
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = None
        if getattr(p, "pci_bus_id", None) is not None:
            bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"
        info = GpuInfo(i, p.name, round(p.total_memory / 2**30, 1), f"{p.major}.{p.minor}", bus)
        link = _pcie_from_sysfs(bus) if bus else {}
        if link.get("pcie_gen") is None:
            link = _pcie_from_nvidia_smi(i) or link
        for k, v in link.items():
            setattr(info, k, v)
        gpus.append(info)
    return gpus, f"CUDA {torch.version.cuda}"


def diagnose() -> Diagnosis:
    d = Diagnosis()
    d.versions = {"roundpipe": None, "python": platform.python_version(), "torch": _version("torch"),
                  "triton": _version("triton") or _version("pytorch-triton"), "numpy": _version("numpy"),
                  "platform": platform.platform()}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means unusable
        d.problems.append(f"torch does not import ({type(exc).__name__}: {exc}); install it: pip install torch")
        return d
    from roundpipe import __version__, _native

    d.versions["roundpipe"] = __version__
    d.versions["torch"] = torch.__version__
    native = {"available": _native.available(), "reason": _native.unavailable_reason(),
              "simd_level": _native.simd_level()}
    if _native.available():
        C = _native.lib
        native.update(best_simd_level=C.best_simd_level(), cpu_features=C.cpu_features(), openmp=C.openmp())
        if os.environ.get("ROUNDPIPE_SIMD"):
            native["forced_by"] = f"ROUNDPIPE_SIMD={os.environ['ROUNDPIPE_SIMD']}"
        if not C.openmp():
            d.advice.append("the native core was built without OpenMP: host kernels run on one thread; "
                            "rebuild with a compiler that supports -fopenmp")
    else:
        d.advice.append(f"native core missing ({_native.unavailable_reason()}): optimizer and host copies use "
                        "slow PyTorch fallbacks; reinstall from source with `pip install .` and a C++17 compiler")
    d.native = native
    d.threads = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "native_threads": _native.lib.num_threads() if _native.available() else None}

    d.gpus, d.cuda_note = _gpus(torch)
    if _native.available():
        from roundpipe.offload import cuda_status

        d.offload = cuda_status()
    triton_version = d.versions["triton"]
    interpret = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    if triton_version is None:
        d.triton = "not installed: fused kernels use their PyTorch fallback"
        d.advice.append("install Triton for the fused kernels: pip install 'roundpipe[triton]' "
                        "(on a CUDA machine, keep the triton version your torch build pins)")
    elif interpret:
        d.triton = f"triton {triton_version}: interpreted (TRITON_INTERPRET=1), slow, for testing only"
    elif d.gpus:
        d.triton = f"triton {triton_version}: compiled for the GPU"
    else:
        d.triton = (f"triton {triton_version}: no GPU, so kernels use their PyTorch fallback "
                    "(TRITON_INTERPRET=1 runs them in the interpreter, for tests)")
    if not d.gpus:
        d.advice.append(f"{d.cuda_note}: roundpipe runs with CPU workers only (correct, but slow); "
                        "for GPUs install a CUDA build of torch")
    return d


def render(d: Diagnosis) -> str:
    lines = ["roundpipe doctor", ""]
    lines += [f"  {k:<10} {v if v is not None else 'not installed'}" for k, v in d.versions.items()]
    if d.native:
        n = d.native
        if n["available"]:
            feats = ", ".join(k for k, v in n.get("cpu_features", {}).items() if v) or "none"
            forced = f" ({n['forced_by']})" if "forced_by" in n else ""
            lines += ["", f"  native     roundpipe._C loaded; SIMD {n['simd_level']}{forced} "
                      f"(best here: {n['best_simd_level']}; CPU: {feats}); OpenMP {'on' if n['openmp'] else 'off'}"]
        else:
            lines += ["", f"  native     MISSING: {n['reason']}"]
    if d.threads:
        t = d.threads
        lines.append(f"  threads    {t['cpu_count']} CPUs; torch {t['torch_threads']}; native {t['native_threads']}")
    if d.gpus:
        lines.append(f"  cuda       {d.cuda_note}, {len(d.gpus)} device(s)")
        for g in d.gpus:
            link = "PCIe link unknown"
            if g.pcie_gen or g.pcie_width:
                link = f"PCIe gen{g.pcie_gen or '?'} x{g.pcie_width or '?'}"
                if g.pcie_max_gen:
                    link += f" (max gen{g.pcie_max_gen} x{g.pcie_max_width or '?'})"
            lines.append(f"    cuda:{g.index}  {g.name}, {g.memory_gib} GiB, sm_{g.capability.replace('.', '')}, {link}")
    elif d.cuda_note:
        lines.append(f"  cuda       none: {d.cuda_note}")
    if d.offload:
        lines.append(f"  offload    {d.offload}")
    if d.triton:
        lines.append(f"  kernels    {d.triton}")
    for p in d.problems:
        lines.append(f"\nPROBLEM: {p}")
    if d.advice:
        lines.append("\nto improve:")
        lines += [f"  - {a}" for a in d.advice]
    lines.append("\nstatus: " + ("usable" if d.usable else "NOT usable"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roundpipe doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--strict", action="store_true", help="exit 1 when anything is degraded, too")
    args = parser.parse_args(argv)
    d = diagnose()
    if args.json:
        print(json.dumps({**asdict(d), "usable": d.usable}, indent=2, default=str))
    else:
        print(render(d))
    if not d.usable or (args.strict and d.advice):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
