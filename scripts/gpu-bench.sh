#!/usr/bin/env bash
# Ours against every peer on one GPU held to 24 GiB (bench/gpu_bench.py), packed for a GPU machine without network.
#
#   bash scripts/gpu-bench.sh --call 1 --out /tmp/gpu --mirror $OUT/gpu   # device call 1 (< 5 min), then --call 2
#   bash scripts/gpu-bench.sh --dry --out DIR   # anywhere: both calls on CPU workers, tiny configs, and each
#                                               # call's expected seconds on the device (exit 1 past 5 minutes)
#
# docs/gpu-bench.md gives the two device calls verbatim.  Any other argument goes to bench/gpu_bench.py
# (--call, --prepare, --mirror, --budget, --timeout, --only, --cap-gib, ...; --help).
# Prerequisites are checked first and every missing one is listed with its fix before anything runs
# (exit 3): Python with torch, transformers and peft; for a GPU run also a CUDA GPU seen by torch and,
# when our native core does not import, what building it in place takes (a C++ compiler, setuptools and
# pybind11, taken from .whl/ as scripts/gpu-check.sh does when missing): the build itself is the prepare
# phase's (bench/gpu_prepare.py), beside the peers' JIT builds.  The interpreter: $PYTHON, else with --dry
# the project's .venv/bin/python (where it exists), else python3 (the GPU image's, with CUDA torch).  Peers come from .whl/peers/<peer>/
# (filled by scripts/fetch-peers.sh on a machine that reaches PyPI; .whl/ is git-ignored and travels
# with the working tree): each folder is installed with --no-index --no-deps into its own --target
# folder under $PEERS (default /tmp/roundpipe-peers), which only that peer's subprocess puts on its
# PYTHONPATH.  A peer without wheels, or whose install fails, gets a row saying so; nothing stops the run.
set -uo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-/tmp/roundpipe-peers}
export PYTHONUNBUFFERED=1 ROUNDPIPE_BENCH_T0=${ROUNDPIPE_BENCH_T0:-$(date +%s.%N)}
dry=false
for a in "$@"; do [ "$a" = --dry ] && dry=true; done
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif $dry && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi

# ---- prerequisites: every missing one is listed, with its fix, before anything runs
missing=()
source "$(dirname "${BASH_SOURCE[0]}")/prereq.sh"
require_python gpu-bench
if $dry; then   # located, not imported (3 interpreter starts and peft's ~9 CPU-s import saved): each row imports them
    absent=$(not_found torch transformers peft)
else
    absent=$(for module in torch transformers peft; do importable "$module" || printf '%s ' "$module"; done)
fi
for module in $absent; do
    missing+=("$module is not importable by $PY: point PYTHON at the environment that has it
    (on the GPU machine: the image's python3; pip cannot download here)")
done
if ! $dry && importable torch; then
    gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null \
           || echo 0)
    if [ "$gpus" -lt 1 ]; then
        missing+=("no CUDA GPU visible to torch: run this on the GPU machine, or use --dry on CPU workers")
    fi
    if ! "$PY" -c 'import roundpipe._C' >/dev/null 2>&1; then
        CXX_BIN=${CXX:-c++}
        command -v "$CXX_BIN" >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
            || missing+=("no C++ compiler ($CXX_BIN or g++; set CXX): our native core roundpipe._C is built in place")
        for module in setuptools pybind11; do
            importable "$module" || from_wheelhouse "$module" || missing+=("$module is not importable and has no
    wheel in .whl/ (the native core's build needs it): 'pip download $module -d .whl' where PyPI is reachable")
        done
    fi
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu-bench: cannot start; missing:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 3
fi

# ---- peers: each wheel folder into its own --target folder (a failure leaves it out: its row says why)
mkdir -p "$PEERS"
for dir in .whl/peers/*/; do
    [ -d "$dir" ] || continue
    name=$(basename "$dir")
    ls "$dir"*.whl >/dev/null 2>&1 || continue
    target="$PEERS/$name"
    # installed already, or failed with these very wheels (the log is newer than every wheel): not again
    newer=$(find "$dir" -name '*.whl' -newer "$PEERS/$name.install.log" 2>/dev/null | head -n 1)
    if [ ! -f "$target/.installed" ] && { [ ! -f "$PEERS/$name.install.log" ] || [ -n "$newer" ]; }; then
        rm -rf "$target"
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$target" "$dir"*.whl \
                >"$PEERS/$name.install.log" 2>&1; then
            touch "$target/.installed"
        else
            echo "== peer $name did not install ($PEERS/$name.install.log); its rows will say so"
            rm -rf "$target"
        fi
    fi
done

exec "$PY" bench/gpu_bench.py --peers "$PEERS" "$@"
