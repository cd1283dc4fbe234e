"""Loading the compiled core `roundpipe._C`, with one loud fallback.

The extension is optional at run time: if it is missing (a broken build, an
unsupported platform, or ROUNDPIPE_NO_NATIVE=1), `import roundpipe` still works,
warns once with the reason, and every caller uses its PyTorch fallback.  Query
with `available()` / `unavailable_reason()`; `require()` raises with the reason
for code that has no fallback.
"""
from __future__ import annotations

import os
import warnings
from types import ModuleType

lib: ModuleType | None = None   # the loaded roundpipe._C, or None
_reason: str | None = None


def _load() -> None:
    global lib, _reason
    if os.environ.get("ROUNDPIPE_NO_NATIVE", "") not in ("", "0"):
        _reason = "ROUNDPIPE_NO_NATIVE is set"
    else:
        try:
            from roundpipe import _C as native  # type: ignore[attr-defined]

            lib = native
            return
        except ImportError as exc:
            _reason = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # e.g. ROUNDPIPE_SIMD names a level this CPU lacks
            _reason = f"{exc}"
    warnings.warn(
        f"roundpipe: the native core roundpipe._C is unavailable ({_reason}); using slower "
        "PyTorch fallbacks. Rebuild with `pip install .` from a source checkout (needs a C++17 "
        "compiler with OpenMP) and run `roundpipe doctor` for details.",
        RuntimeWarning,
        stacklevel=4,
    )


_load()


def available() -> bool:
    """Whether the compiled extension loaded."""
    return lib is not None


def unavailable_reason() -> str | None:
    """Why the extension did not load, or None if it did."""
    return _reason


def require() -> ModuleType:
    """The extension module; RuntimeError naming the reason when it is missing."""
    if lib is None:
        raise RuntimeError(f"roundpipe._C is required here but unavailable: {_reason}")
    return lib


def simd_level() -> str:
    """SIMD level the native kernels use: 'avx512', 'avx2', 'scalar', or 'none' without the extension."""
    return lib.simd_level() if lib is not None else "none"


SIMD_LEVELS = ("scalar", "avx2", "avx512")


def supported_simd_levels() -> list[str]:
    """The levels this CPU can run, lowest first ([] without the extension)."""
    if lib is None:
        return []
    return list(SIMD_LEVELS[: SIMD_LEVELS.index(lib.best_simd_level()) + 1])


def set_simd_level(level: str) -> None:
    """Force a SIMD level ('scalar', 'avx2', 'avx512'); ValueError if unknown or unsupported."""
    if level not in SIMD_LEVELS:
        raise ValueError(f"level={level!r} is unknown; expected 'scalar', 'avx2' or 'avx512'")
    require().set_simd_level(level)
