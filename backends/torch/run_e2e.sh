#!/usr/bin/env bash
# End-to-end test of schedc schedules on PyTorch 2.15's pipelining runtime (CPU, gloo).
#
#   bash backends/torch/run_e2e.sh [test_e2e.py options, e.g. --only zbv]
#
# 1. Creates (first run: downloads several GB) or reuses the virtual environment
#    $SCHEDC_TORCH_VENV (default $HOME/.cache/schedc/torch-2.15.0-venv) with torch 2.15.0
#    from PyPI;
# 2. builds schedc (cargo build -p schedc-cli);
# 3. runs backends/torch/test_e2e.py: every spec exported in both CSV forms, trained 3 steps
#    on P gloo processes on 127.0.0.1 and compared with a non-pipelined run.
# Exits non-zero on any failure.
set -euo pipefail

TORCH_VERSION=2.15.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${SCHEDC_TORCH_VENV:-$HOME/.cache/schedc/torch-$TORCH_VERSION-venv}"
PY="$VENV/bin/python"
start=$(date +%s)
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the source tree

have_torch() {
    [ -x "$PY" ] && "$PY" -c "import sys, torch, numpy; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null
}

if have_torch; then
    echo "run_e2e: reusing $VENV ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
else
    echo "run_e2e: installing torch==$TORCH_VERSION into $VENV (first run: several GB from PyPI)"
    mkdir -p "$(dirname "$VENV")"
    if [ ! -x "$PY" ]; then
        python3 -m venv "$VENV"
    fi
    "$PY" -m pip install --quiet --upgrade pip || echo "run_e2e: (pip upgrade failed; continuing)"
    if ! "$PY" -m pip install "torch==$TORCH_VERSION" numpy; then
        echo "run_e2e: FAILED: pip could not install torch==$TORCH_VERSION into $VENV" >&2
        exit 1
    fi
    if ! have_torch; then
        echo "run_e2e: FAILED: $VENV does not import torch $TORCH_VERSION after installing it" >&2
        exit 1
    fi
    echo "run_e2e: installed in $(( $(date +%s) - start ))s"
fi

echo "run_e2e: building schedc"
(cd "$ROOT" && cargo build -p schedc-cli)
SCHEDC="${CARGO_TARGET_DIR:-$ROOT/target}/debug/schedc"

echo "run_e2e: running backends/torch/test_e2e.py"
status=0
(cd "$ROOT" && "$PY" backends/torch/test_e2e.py --schedc "$SCHEDC" "$@") || status=$?
echo "run_e2e: $( [ $status -eq 0 ] && echo passed || echo "FAILED (exit status $status)" ) in $(( $(date +%s) - start ))s"
exit $status
