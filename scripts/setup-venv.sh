#!/usr/bin/env bash
# Creates ./.venv (or $VENV) and installs roundpipe into it, editable, with its test extras.
#
# The venv sees the interpreter's site-packages (and, when $PYTHON itself runs in a
# virtualenv, that one's too) so a torch already installed there, e.g. a CUDA build,
# is reused and never replaced.  Only when no torch imports at all is the CPU build
# torch==2.13.0 installed.  Triton is installed only when none imports.
set -euo pipefail
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
if ! "$VENV/bin/python" -c 'import triton' 2>/dev/null; then
  "${pip[@]}" install 'triton>=3.0' || echo "setup: triton unavailable; kernels will use their PyTorch fallback"
fi
"${pip[@]}" install -e ".[dev]"
