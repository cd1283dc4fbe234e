"""`import roundpipe` without a GPU, without CUDA, and without the compiled extension."""
import os
import subprocess
import sys
import textwrap


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-W", "always::RuntimeWarning", "-c", textwrap.dedent(code)],
                          env=full_env, capture_output=True, text=True, timeout=180)


def test_import_touches_no_gpu_and_warns_nothing():
    """Importing roundpipe (and its lazy names) initialises no CUDA context and emits no warning."""
    out = run_py("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import roundpipe, torch
            roundpipe.Plan, roundpipe.hostops
        assert not torch.cuda.is_initialized(), "import initialised CUDA"
        print("warnings:", [str(w.message) for w in caught if "roundpipe" in str(w.message)])
        print("native:", roundpipe.native_available())
    """, CUDA_VISIBLE_DEVICES="")
    assert out.returncode == 0, out.stderr
    assert "warnings: []" in out.stdout
    assert "native: True" in out.stdout


def test_missing_extension_warns_once_and_falls_back():
    """With roundpipe._C unimportable, import warns once with the reason and host ops still work."""
    out = run_py("""
        import sys, warnings
        sys.modules["roundpipe._C"] = None  # makes `from roundpipe import _C` raise ImportError
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import roundpipe
            import roundpipe.hostops, roundpipe.commands.doctor
        ours = [str(w.message) for w in caught if "roundpipe._C" in str(w.message)]
        print("count:", len(ours))
        print("message:", ours[0])
        import torch
        from roundpipe import hostops
        src = torch.randn(1001)
        dst = torch.empty(1001, dtype=torch.bfloat16)
        hostops.convert_(dst, src)
        assert torch.equal(dst, src.to(torch.bfloat16))
        print("simd:", roundpipe.simd_level(), "available:", roundpipe.native_available())
    """)
    assert out.returncode == 0, out.stderr
    assert "count: 1" in out.stdout
    assert "unavailable (ModuleNotFoundError: import of roundpipe._C" in out.stdout and "pip install ." in out.stdout
    assert "simd: none available: False" in out.stdout


def test_env_switch_and_bad_simd_level_fall_back_with_reason():
    """ROUNDPIPE_NO_NATIVE=1 and an unknown ROUNDPIPE_SIMD both give the warning with their reason."""
    out = run_py("import roundpipe; print(roundpipe.native_available())", ROUNDPIPE_NO_NATIVE="1")
    assert out.returncode == 0 and out.stdout.strip() == "False"
    assert "ROUNDPIPE_NO_NATIVE is set" in out.stderr
    out = run_py("import roundpipe; print(roundpipe.native_available())", ROUNDPIPE_SIMD="sse9")
    assert out.returncode == 0 and out.stdout.strip() == "False"
    assert "sse9" in out.stderr
