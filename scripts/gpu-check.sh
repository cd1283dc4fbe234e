#!/usr/bin/env bash
# The GPU checks CI cannot run, packed for a machine with a CUDA GPU and a working torch.
#
#   bash scripts/gpu-check.sh tests      # build, doctor, every cuda-marked test              (< 8 min)
#   bash scripts/gpu-check.sh bench      # build, offload and kernel benchmarks               (< 8 min)
#   bash scripts/gpu-check.sh train      # build, 0.8B decoder tokens/s: 1 GPU, same GPU twice (< 6 min)
#   bash scripts/gpu-check.sh multigpu   # build, 2+ GPUs: multigpu tests, NCCL ranks, 2-GPU run (< 9 min)
#   bash scripts/gpu-check.sh all        # all of them, one after the other (multigpu with 2+ GPUs)
#
# Each phase but `all` fits one 10-minute command.
# The prerequisites are checked first, and the script stops with what is missing and how to get it
# before running anything: an NVIDIA GPU seen by torch (two for `multigpu`), a C++ compiler,
# setuptools and pybind11 importable (the build runs without isolation), pytest for the test
# phases, torch.distributed with NCCL for `multigpu`.  The GPU machine has no network: pip never
# downloads here.  A missing setuptools or pybind11 is taken from a wheel in .whl/ (the
# wheelhouse: `pip download setuptools pybind11 -d .whl` on a machine with network) into a
# separate folder, never into the project's environment.
# Builds the extension in place against the machine's own torch (no downloads, no build
# isolation), then writes one log per step and the benchmarks' JSON rows under $OUT
# (default gpu-check-out/); copy the rows into bench/results/ and commit them.  Optional
# peers (liger-kernel for bench/kernels.py) are taken from wheels in .whl/ when present,
# installed into a separate folder, never into the project's environment.  Every step has
# its own time limit, and a failing step does not stop the next; the exit status is
# non-zero when any step failed (3 when a prerequisite is missing: nothing ran).
set -uo pipefail
phase=${1:-all}
case "$phase" in
    tests|bench|train|multigpu|all) ;;
    *) echo "usage: $0 {tests|bench|train|multigpu|all}" >&2; exit 2;;
esac
OUT=${OUT:-gpu-check-out}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
failed=()

# ---- prerequisites: every missing one is listed, with its fix, before anything runs
missing=()
source "$(dirname "${BASH_SOURCE[0]}")/prereq.sh"
require_python gpu-check
gpus=0
if ! importable torch; then
    missing+=("torch is not importable by $PY: point PYTHON at the machine's CUDA build of torch;
    pip cannot download one here")
else
    gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null \
           || echo 0)
    if [ "$gpus" -lt 1 ]; then
        build=$("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")' \
                2>/dev/null)
        smi=$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>&1 | head -n 2 || echo "no nvidia-smi")
        missing+=("no CUDA GPU visible to torch ($build; nvidia-smi: $smi): run this on the GPU machine")
    elif [ "$phase" = multigpu ] && [ "$gpus" -lt 2 ]; then
        missing+=("multigpu needs 2+ GPUs; torch sees $gpus (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})")
    fi
fi
CXX_BIN=${CXX:-c++}
if ! command -v "$CXX_BIN" >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
    missing+=("no C++ compiler ($CXX_BIN or g++; set CXX): the native core roundpipe._C is built in place")
fi
for module in setuptools pybind11; do
    if ! importable "$module" && ! from_wheelhouse "$module"; then
        missing+=("$module is not importable by $PY and has no wheel in .whl/; pip cannot download it here (no network):
    on a machine with network run 'pip download $module -d .whl' and copy .whl/ over")
    fi
done
if [ "$phase" = tests ] || [ "$phase" = multigpu ] || [ "$phase" = all ]; then
    importable pytest || missing+=("pytest is not importable by $PY (the test phases run it): with its wheels in .whl/,
    'pip install --no-index --find-links .whl pytest pytest-timeout' installs it offline")
fi
multi=false
if [ "$phase" = multigpu ] || { [ "$phase" = all ] && [ "$gpus" -ge 2 ]; }; then
    multi=true
fi
if $multi && ! "$PY" -c 'import torch.distributed as d; assert d.is_available() and d.is_nccl_available()' \
        >/dev/null 2>&1; then
    missing+=("torch.distributed with NCCL is not available in this torch: the multigpu phase runs two NCCL ranks")
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu-check: cannot start the '$phase' phase; missing:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 3
fi

mkdir -p "$OUT"
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
step build 300 "$PY" -m pip install -q --no-index --no-build-isolation --no-deps -e .
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

# Two NCCL ranks (torchrun), each a RoundPipe over cuda:0 and cuda:1 (cross-device hand-offs) fed its half of
# the batch resident on its own GPU: the all-reduce runs on cuda:LOCAL_RANK (the data-parallel device choice),
# the averaged gradients equal one fp32 process on the whole batch, and after a step the ranks' weights agree.
write_nccl_check() {
    cat > "$1" <<'PYEOF'
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import roundpipe as rp

dist.init_process_group("nccl")
rank, world, device = dist.get_rank(), dist.get_world_size(), torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)
layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)]
ref = torch.nn.Sequential(*copy.deepcopy(layers))
x, y = torch.randn(8 * world, 64), torch.randn(8 * world, 64)
F.mse_loss(ref(x), y).backward()
mine = slice(8 * rank, 8 * (rank + 1))
with rp.RoundPipe(layers, devices=["cuda:0", "cuda:1"], num_microbatches=2, compute_dtype=torch.float32,
                  process_group=dist.group.WORLD) as model:
    assert model.dp.device == device, f"rank {rank}: all-reduce on {model.dp.device}, expected {device}"
    model.forward_backward(x[mine].to(device), labels=y[mine].to(device), loss_fn=F.mse_loss)
    model.synchronize()
    err = max(((p.grad.cpu() - q.grad).abs().max() / q.grad.abs().max()).item()
              for p, q in zip(model.parameters(), ref.parameters()))
    assert err <= 1e-4, f"rank {rank}: averaged gradients {err:.3g} (relative) from one process on the whole batch"
    model.step(rp.optim.AdamW(model.parameters(), lr=1e-2), asynchronous=False)
    model.synchronize()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(device)
    first = flat.clone()
    dist.broadcast(first, 0)
    assert torch.equal(flat, first), f"rank {rank}: weights differ from rank 0's after the step"
print(f"rank {rank}: all-reduce on {device}, gradient error {err:.2g}, weights equal rank 0's")
dist.destroy_process_group()
PYEOF
}

if $multi; then
    # pytest exits 5 when it selects nothing: no multigpu-marked test is a note, not a failure
    step multigpu-tests 240 bash -c '"$@"; rc=$?; if [ $rc -eq 5 ]; then echo "no multigpu-marked tests"; rc=0; fi
                                     exit $rc' _ "$PY" -m pytest -q -rs -m multigpu -p no:cacheprovider tests
    write_nccl_check "$OUT/nccl_two_ranks.py"
    step nccl-2ranks 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 "$OUT/nccl_two_ranks.py"
    step train-0.8b-2gpus 140 "$PY" -m roundpipe train --size 0.8b --steps 20 --devices cuda:0,cuda:1 --no-progress
elif [ "$phase" = all ]; then
    echo "== multigpu skipped: $gpus GPU visible, it needs 2 or more"
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed; logs and rows in $OUT"
