#!/usr/bin/env bash
# Creates ./.venv (or $VENV) and installs roundpipe into it, editable.
#
#   bash scripts/setup-venv.sh demo   # what `make demo` runs: torch + roundpipe, nothing else
#   bash scripts/setup-venv.sh test   # what `make test` runs: demo + Triton + the [dev] extra
#
# `demo` installs only what `roundpipe train` runs (torch, numpy, tqdm, the native core):
# the built-in model calls no Triton kernel, so Triton (about 1 GB) is left to `test`,
# whose kernel tests run it in interpreter mode on CPU.  A CUDA torch brings its own Triton.
#
# The venv sees the interpreter's site-packages (and, when $PYTHON itself runs in a
# virtualenv, that one's too) so a torch already installed there, e.g. a CUDA build,
# is reused and never replaced.  Only when no torch imports at all is the CPU build
# torch==2.13.0 installed, before anything that depends on torch, so pip never picks
# a torch of its own.  `test` installs Triton only when none imports.
#
# `test` installs with requirements/test-constraints.txt as pip constraints: the exact versions
# of transformers, peft, trl, pytest, ... that the suite was last run with (`make lock` upgrades
# them on purpose).  Its torch and Triton pins apply only when this script installs them: a
# torch already importable (a CUDA build on a GPU machine) is kept, with the Triton beside it.
set -euo pipefail
profile=${1:-test}
case "$profile" in demo|test) ;; *) echo "usage: $0 {demo|test}" >&2; exit 2;; esac
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
cd "$(dirname "$0")/.."

"$PYTHON" -m venv --system-site-packages "$VENV"
outer=$("$PYTHON" -c 'import sys, site; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -n "$outer" ]; then
  printf '%s\n' "$outer" > "$purelib/_roundpipe_outer_env.pth"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  echo "setup: no torch importable; installing the CPU build torch==2.13.0"
  "${pip[@]}" install torch==2.13.0
fi
if [ "$profile" = demo ]; then
  "${pip[@]}" install -e .
  exit 0
fi
lock=requirements/test-constraints.txt
pinned() { sed -n "s/^$1==\([^ ;]*\).*/\1/p" "$lock"; }
if ! "$VENV/bin/python" -c 'import triton' 2>/dev/null; then
  "${pip[@]}" install "triton==$(pinned triton)" || echo "setup: triton unavailable; kernels will use their PyTorch fallback"
fi
constraints="$VENV/test-constraints.txt"
grep -v -i -E '^(torch|triton|nvidia-[a-z0-9-]*|cuda-[a-z0-9-]*)==' "$lock" > "$constraints"
"${pip[@]}" install -c "$constraints" -e ".[dev]"
