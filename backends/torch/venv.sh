# Sourced by run_e2e.sh and run_runtime.sh: creates (first run: downloads several GB) or reuses
# the virtual environment $SCHEDC_TORCH_VENV (default $HOME/.cache/schedc/torch-2.15.0-venv)
# with torch 2.15.0 and numpy from PyPI, and sets PY to its python. Needs `start` (the script's
# start time, for the install's duration) and prefixes its lines with $LOG.
TORCH_VERSION=2.15.0
VENV="${SCHEDC_TORCH_VENV:-$HOME/.cache/schedc/torch-$TORCH_VERSION-venv}"
PY="$VENV/bin/python"

have_torch() {
    [ -x "$PY" ] && "$PY" -c "import sys, torch, numpy; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null
}

if have_torch; then
    echo "$LOG: reusing $VENV ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
else
    echo "$LOG: installing torch==$TORCH_VERSION into $VENV (first run: several GB from PyPI)"
    mkdir -p "$(dirname "$VENV")"
    if [ ! -x "$PY" ]; then
        python3 -m venv "$VENV"
    fi
    "$PY" -m pip install --quiet --upgrade pip || echo "$LOG: (pip upgrade failed; continuing)"
    if ! "$PY" -m pip install "torch==$TORCH_VERSION" numpy; then
        echo "$LOG: FAILED: pip could not install torch==$TORCH_VERSION into $VENV" >&2
        exit 1
    fi
    if ! have_torch; then
        echo "$LOG: FAILED: $VENV does not import torch $TORCH_VERSION after installing it" >&2
        exit 1
    fi
    echo "$LOG: installed in $(( $(date +%s) - start ))s"
fi
