"""The compiled core: SIMD level reporting and forcing, and the conversion primitive."""
import os
import subprocess
import sys

import pytest
import torch

from roundpipe import _native, hostops

pytestmark = pytest.mark.skipif(not _native.available(), reason="native extension not built")

LEVELS = list(_native.SIMD_LEVELS)


def special_values():
    """fp32 values that exercise rounding, overflow, subnormals and signed zero in both targets."""
    f = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 1e5, -1e5, float("inf"), float("-inf"),
                      6e-8, 3e-8, 2.98e-8, 5.96e-8, 1e-40, -1e-40, 1.17e-38, 3.4e38, 2 ** -14, 2 ** -24, 2 ** -25,
                      1.0 + 2 ** -8, 1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11])
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (4099,), dtype=torch.int32)  # every exponent, random mantissas
    return torch.cat([f, bits.view(torch.float32), torch.randn(1001) * 1e3])


def test_reports_simd_level():
    """The extension reports a known level, no higher than the CPU's best, and the CPU features."""
    assert _native.simd_level() in LEVELS
    assert LEVELS.index(_native.simd_level()) <= LEVELS.index(_native.lib.best_simd_level())
    feats = _native.lib.cpu_features()
    assert set(feats) == {"avx2_fma_f16c", "avx512", "avx512_bf16"}
    assert _native.lib.num_threads() >= 1 and _native.lib.openmp() is True


def test_set_simd_level_rejects_unknown_and_unsupported(restore_level):
    """Unknown level names and levels above the CPU's best are ValueErrors naming the level."""
    with pytest.raises(ValueError, match="'sse9'"):
        _native.set_simd_level("sse9")
    for level in _native.supported_simd_levels():
        _native.set_simd_level(level)
        assert _native.simd_level() == level
    if _native.lib.best_simd_level() != "avx512":
        with pytest.raises(ValueError, match="not supported"):
            _native.set_simd_level("avx512")


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, 33, 1023, 100_003, 300_001])
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                 (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                 (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_convert_bit_identical_across_levels(n, src_dtype, dst_dtype, restore_level):
    """Every forced SIMD level gives the same bits on odd lengths, including NaN/inf/subnormal inputs."""
    src = special_values().repeat(n // 5000 + 1)[:n].to(src_dtype) if src_dtype == torch.float32 else \
        torch.randint(0, 2 ** 16, (n,), dtype=torch.int32).to(torch.int16).view(src_dtype)
    outs = []
    for level in _native.supported_simd_levels():
        _native.set_simd_level(level)
        dst = torch.full((n,), 7, dtype=dst_dtype)
        hostops.convert_(dst, src)
        outs.append(dst.view(torch.int16 if dst_dtype != torch.float32 else torch.int32))
    for level, out in zip(_native.supported_simd_levels()[1:], outs[1:]):
        assert torch.equal(out, outs[0]), f"{level} differs from scalar"


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16])
def test_convert_matches_torch_rounding(dst_dtype, restore_level):
    """Narrowing equals torch's round-to-nearest-even bit for bit on every non-NaN value; NaN stays NaN."""
    src = special_values()
    expected = src.to(dst_dtype)
    for level in _native.supported_simd_levels():
        _native.set_simd_level(level)
        dst = torch.empty_like(src, dtype=dst_dtype)
        hostops.convert_(dst, src)
        nan = torch.isnan(src)
        assert torch.equal(torch.isnan(dst.float()), nan)
        assert torch.equal(dst[~nan].view(torch.int16), expected[~nan].view(torch.int16)), level


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
def test_widening_is_exact(src_dtype, restore_level):
    """Widening every 16-bit pattern to fp32 equals torch's exact conversion (NaNs stay NaN)."""
    src = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(src_dtype)
    expected = src.float()
    for level in _native.supported_simd_levels():
        _native.set_simd_level(level)
        dst = torch.empty(src.numel())
        hostops.convert_(dst, src)
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(dst), nan)
        assert torch.equal(dst[~nan], expected[~nan]), level


def test_convert_is_multithreaded_and_correct_on_large_buffers():
    """A buffer far above the threading threshold converts exactly like torch."""
    src = torch.randn(3_000_017)
    dst = torch.empty(src.numel(), dtype=torch.bfloat16)
    hostops.convert_(dst, src)
    assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))


def test_raw_binding_validates_arguments():
    """The binding itself rejects unknown dtype names and null pointers with ValueError naming them."""
    with pytest.raises(ValueError, match="src_dtype='float64'"):
        _native.lib.convert(1, "float64", 1, "float32", 0)
    with pytest.raises(ValueError, match="dst is a null pointer"):
        x = torch.zeros(4)
        _native.lib.convert(x.data_ptr(), "float32", 0, "bfloat16", 4)


@pytest.mark.parametrize("level", ["scalar", "avx2"])
def test_env_var_forces_level_at_load(level):
    """ROUNDPIPE_SIMD chooses the level when the extension loads."""
    if level not in _native.supported_simd_levels():
        pytest.skip(f"CPU lacks {level}")
    env = {**os.environ, "ROUNDPIPE_SIMD": level}
    out = subprocess.run([sys.executable, "-c", "import roundpipe; print(roundpipe.simd_level())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == level
