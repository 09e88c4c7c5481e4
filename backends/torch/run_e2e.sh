#!/usr/bin/env bash
# End-to-end test of schedc schedules on PyTorch 2.15's pipelining runtime (CPU, gloo).
#
#   bash backends/torch/run_e2e.sh [test_e2e.py options, e.g. --only zbv]
#
# 1. Creates (first run: downloads several GB) or reuses the virtual environment
#    $SCHEDC_TORCH_VENV (default $HOME/.cache/schedc/torch-2.15.0-venv) with torch 2.15.0
#    from PyPI;
# 2. builds schedc (cargo build -p schedc-cli);
# 3. runs backends/torch/test_schedc_torch.py (schedc_torch's checks: CSV form, M, stages)
#    and backends/torch/test_e2e.py: every spec exported in both CSV forms, trained 3 steps
#    on P gloo processes on 127.0.0.1 and compared with a non-pipelined run; then
#    backends/torch/test_torchtitan.py: torchtitan's path (the CSV and its --sidecar on
#    _PipelineScheduleRuntime) against schedc_torch_runtime, loss for loss.
# Exits non-zero on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
start=$(date +%s)
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the source tree
LOG=run_e2e
# shellcheck source=venv.sh
source "$ROOT/backends/torch/venv.sh"

echo "run_e2e: building schedc"
(cd "$ROOT" && cargo build -p schedc-cli)
SCHEDC="${CARGO_TARGET_DIR:-$ROOT/target}/debug/schedc"

echo "run_e2e: running backends/torch/test_schedc_torch.py, test_e2e.py and test_torchtitan.py"
status=0
(cd "$ROOT" && "$PY" backends/torch/test_schedc_torch.py) || status=$?
(cd "$ROOT" && "$PY" backends/torch/test_e2e.py --schedc "$SCHEDC" "$@") || status=$?
(cd "$ROOT" && "$PY" backends/torch/test_torchtitan.py --schedc "$SCHEDC") || status=$?
echo "run_e2e: $( [ $status -eq 0 ] && echo passed || echo "FAILED (exit status $status)" ) in $(( $(date +%s) - start ))s"
exit $status
