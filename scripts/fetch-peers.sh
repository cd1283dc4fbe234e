#!/usr/bin/env bash
# Fills .whl/peers/ with the peers' wheels for scripts/gpu-bench.sh, on a machine that reaches PyPI.
#
#   bash scripts/fetch-peers.sh            # then carry .whl/ to the GPU machine (it reaches no network)
#
# One folder per peer, each installed by gpu-bench.sh into its own `--target` folder under /tmp
# (--no-index --no-deps), put first on PYTHONPATH of that peer's subprocess only, so no peer is
# ever importable beside our roundpipe, and none is a dependency of the project:
#
#   .whl/peers/roundpipe-0.1.1/   the published RoundPipe (pure Python) and beartype, the one dependency
#                                 the GPU image lacks (ninja, py-cpuinfo, tqdm, typing-extensions are there),
#                                 and the transformers it was written for (4.57.x, with its huggingface_hub
#                                 and tokenizers): its Qwen3 preset calls create_causal_mask(input_embeds=,
#                                 cache_position=), which the image's transformers 5.17 lacks (TypeError)
#   .whl/peers/deepspeed/         DeepSpeed, built here from its sdist into a py3-none-any wheel with no ops
#                                 prebuilt (DS_BUILD_OPS=0: CPU Adam is JIT-built there with ninja, and its
#                                 row says why when that fails), plus hjson, pydantic 2 and typing-extensions (pydantic-core is
#                                 a compiled wheel: fetched for the GPU machine's Python, $PEER_PYTHON)
#   .whl/peers/liger-kernel/      liger-kernel (pure Python over Triton), for kernel comparisons
#   .whl/peers/diffusers/         diffusers (pure Python; its requirements are on the image), for the Flux LoRA
#                                 rows: appended to the PYTHONPATH of both of them (ours through rp.diffusers,
#                                 and the plain diffusers peer), since the image lacks it
#
# What the GPU image already holds (the lent GPU machine's image: torch, transformers, peft, numpy,
# msgpack, psutil, ninja, nvidia-ml-py, einops, ...) is not fetched: a second copy would shadow it.
# .whl/ is git-ignored (/.whl/ in .gitignore); the wheels are never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PEER_PYTHON=${PEER_PYTHON:-3.12}              # the GPU machine's Python (3.12.3 on the lent image)
ROUNDPIPE_PEER=${ROUNDPIPE_PEER:-0.1.1}
DEEPSPEED=${DEEPSPEED:-0.19.8}
LIGER=${LIGER:-0.8.5}
DIFFUSERS=${DIFFUSERS:-0.42.1}                 # requirements/test-constraints.txt's
PEER_TRANSFORMERS=${PEER_TRANSFORMERS:-4.57.6}   # the published RoundPipe's (with the two below, as it requires)
PEER_HUB=${PEER_HUB:-0.36.2}
PEER_TOKENIZERS=${PEER_TOKENIZERS:-0.22.2}
OUT=.whl/peers
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

download() {   # download FOLDER SPEC...: wheels only, for the GPU machine's Python, no dependencies
    local dir=$1
    shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PEER_PYTHON" --implementation cp \
        "${PLATFORMS[@]}" -d "$dir" "$@"
}

mkdir -p "$OUT/roundpipe-$ROUNDPIPE_PEER" "$OUT/deepspeed" "$OUT/liger-kernel" "$OUT/diffusers"
echo "== roundpipe==$ROUNDPIPE_PEER, beartype and transformers==$PEER_TRANSFORMERS for it"
download "$OUT/roundpipe-$ROUNDPIPE_PEER" "roundpipe==$ROUNDPIPE_PEER" beartype "transformers==$PEER_TRANSFORMERS" \
    "huggingface_hub==$PEER_HUB" "tokenizers==$PEER_TOKENIZERS"

echo "== deepspeed==$DEEPSPEED (sdist built into a wheel here, no ops prebuilt) and its missing pure deps"
if ! ls "$OUT"/deepspeed/deepspeed-"$DEEPSPEED"-*.whl >/dev/null 2>&1; then
    sdist=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$sdist" "deepspeed==$DEEPSPEED"
    # setup.py imports torch: the build uses this environment's torch (no isolation); no op is compiled
    DS_BUILD_OPS=0 DS_BUILD_STRING="" "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/deepspeed" \
        "$sdist"/deepspeed-*.tar.gz
    rm -rf "$sdist"
fi
# typing-extensions too: pydantic 2.14 needs >= 4.16, newer than some images hold (only its subprocess sees it)
download "$OUT/deepspeed" hjson "pydantic>=2,<3" pydantic-core annotated-types typing-inspection typing-extensions
# pydantic pins pydantic-core exactly: fetch the one it names
core=$(unzip -p "$OUT"/deepspeed/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
if [ -n "$core" ] && ! ls "$OUT"/deepspeed/pydantic_core-"$core"-*.whl >/dev/null 2>&1; then
    rm -f "$OUT"/deepspeed/pydantic_core-*.whl
    download "$OUT/deepspeed" "pydantic-core==$core"
fi

echo "== liger-kernel==$LIGER"
download "$OUT/liger-kernel" "liger-kernel==$LIGER"

echo "== diffusers==$DIFFUSERS"
download "$OUT/diffusers" "diffusers==$DIFFUSERS"

echo "== in $OUT:"
find "$OUT" -name '*.whl' -printf '%8k KiB  %p\n' | sort -k3
du -sh "$OUT"
