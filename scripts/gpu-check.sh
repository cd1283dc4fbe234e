#!/usr/bin/env bash
# The GPU checks CI cannot run, packed for a machine with a CUDA GPU and a working torch.
#
#   bash scripts/gpu-check.sh tests   # build, doctor, every cuda-marked test       (< 8 min)
#   bash scripts/gpu-check.sh bench   # build, offload and kernel benchmarks        (< 8 min)
#   bash scripts/gpu-check.sh train   # build, 0.8B decoder tokens/s: 1 GPU, same GPU twice (< 6 min)
#   bash scripts/gpu-check.sh all     # all three, one after the other
#
# Each phase but `all` fits one 10-minute command.
# Builds the extension in place against the machine's own torch (no downloads, no build
# isolation), then writes one log per step and the benchmarks' JSON rows under $OUT
# (default gpu-check-out/); copy the rows into bench/results/ and commit them.  Optional
# peers (liger-kernel for bench/kernels.py) are taken from wheels in .whl/ when present,
# installed into a separate folder, never into the project's environment.  Every step has
# its own time limit, and a failing step does not stop the next; the exit status is
# non-zero when any step failed.
set -uo pipefail
phase=${1:-all}
case "$phase" in tests|bench|train|all) ;; *) echo "usage: $0 {tests|bench|train|all}" >&2; exit 2;; esac
OUT=${OUT:-gpu-check-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failed=()

step() {   # step NAME SECONDS COMMAND...: runs it with a limit, output to $OUT/NAME.log and the terminal
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    if ! timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; then
        echo "== $name FAILED (see $OUT/$name.log)"
        failed+=("$name")
    fi
}

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    git rev-parse HEAD 2>/dev/null || echo "commit unknown"
    nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,driver_version \
        --format=csv 2>&1 || echo "nvidia-smi failed"
} | tee "$OUT/device.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/roundpipe-peers .whl/*.whl \
        && export PYTHONPATH="/tmp/roundpipe-peers${PYTHONPATH:+:$PYTHONPATH}"
fi
step build 300 "$PY" -m pip install -q --no-build-isolation --no-deps -e .
step doctor 60 "$PY" -m roundpipe doctor

if [ "$phase" = tests ] || [ "$phase" = all ]; then
    step cuda-tests 360 "$PY" -m pytest -q -rs -m cuda -p no:cacheprovider tests
fi
if [ "$phase" = bench ] || [ "$phase" = all ]; then
    step bench-offload 180 "$PY" -m roundpipe.bench.offload --out "$OUT/offload.jsonl"
    step bench-kernels 180 "$PY" bench/kernels.py --out "$OUT/kernels.jsonl"
fi
if [ "$phase" = train ] || [ "$phase" = all ]; then
    step train-0.8b-1gpu 140 "$PY" -m roundpipe train --size 0.8b --steps 20 --devices cuda:0 --no-progress
    step train-0.8b-2workers 140 "$PY" -m roundpipe train --size 0.8b --steps 20 --devices cuda:0,cuda:0 --no-progress
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed; logs and rows in $OUT"
