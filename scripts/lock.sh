#!/usr/bin/env bash
# Re-resolves the test environment and writes requirements/test-constraints.txt (`make lock`).
#
# The library's own requirements (pyproject.toml) stay ranges; what `make test` and CI install
# is pinned by that constraints file, so a registry release never changes a test run by itself.
# Upgrading is a deliberate step: run this, run the suite, commit the file with the results.
#
# The resolution happens in a throw-away venv that sees no other site-packages, so the file
# holds the whole closure of torch, Triton and the [dev] extra, and nothing else.
#   TORCH=2.13.0 TRITON=3.9.0 bash scripts/lock.sh   # the defaults; other pins on purpose only
set -euo pipefail
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-2.13.0}
TRITON=${TRITON:-3.9.0}
cd "$(dirname "$0")/.."
out=requirements/test-constraints.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PYTHON" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install "torch==$TORCH" "triton==$TRITON"
"${pip[@]}" install ".[dev]"
{
  echo "# Exact versions of the test environment: scripts/setup-venv.sh test (make test, CI) installs"
  echo "# with these as pip constraints.  Regenerate on purpose with 'make lock' (scripts/lock.sh),"
  echo "# then run the suite and commit.  Resolved $(date -u +%Y-%m-%d) with $("$tmp/venv/bin/python" -V)."
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable --all | grep -v -i -E '^(roundpipe|pip|setuptools|wheel)[=@ ]'
} > "$out"
echo "wrote $out ($(grep -c '==' "$out") pins)"
