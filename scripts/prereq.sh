# Sourced by scripts/gpu-check.sh and scripts/gpu-bench.sh: prerequisite helpers for a GPU machine
# that has no network.  Needs $PY (the Python to use); `require_python NAME` exits 3 without it.
importable() { "$PY" -c "import $1" >/dev/null 2>&1; }
not_found() {   # not_found MODULE...: prints those that no finder locates (one interpreter, nothing imported)
    "$PY" -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' "$@"
}
from_wheelhouse() {   # from_wheelhouse MODULE: MODULE's wheel from .whl/ into a side folder (build deps only)
    local target=/tmp/roundpipe-build-deps
    ls .whl/"$1"-*.whl >/dev/null 2>&1 || return 1
    "$PY" -m pip install -q --no-index --no-deps --target "$target" .whl/"$1"-*.whl || return 1
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
    importable "$1"
}
require_python() {   # require_python SCRIPT_NAME
    if ! command -v "$PY" >/dev/null 2>&1; then
        echo "$1: cannot start: no Python at '$PY' (set PYTHON=/path/to/python)" >&2
        exit 3
    fi
}
