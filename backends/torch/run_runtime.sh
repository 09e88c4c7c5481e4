#!/usr/bin/env bash
# End-to-end tests of schedc_torch_runtime: schedc's per-rank programs on torch.distributed
# (CPU, gloo), with the MoE transformer of moe_model.py.
#
#   bash backends/torch/run_runtime.sh [test_runtime.py options, e.g. --only dualpipe]
#
# 1. Creates or reuses the torch 2.15.0 virtual environment (venv.sh, shared with run_e2e.sh);
# 2. builds schedc (cargo build -p schedc-cli);
# 3. runs backends/torch/test_runtime.py: every spec of specs/ (and MoE parts, channels,
#    collectives, DualPipe with data parallelism) against non-pipelined training in f64 and
#    f32, torch's own runtime side by side, the profile against `schedc sim`, faults.
# Exits non-zero on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
start=$(date +%s)
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the source tree
LOG=run_runtime
# shellcheck source=venv.sh
source "$ROOT/backends/torch/venv.sh"

echo "run_runtime: building schedc"
(cd "$ROOT" && cargo build -p schedc-cli)
SCHEDC="${CARGO_TARGET_DIR:-$ROOT/target}/debug/schedc"

echo "run_runtime: running backends/torch/test_runtime.py"
status=0
(cd "$ROOT" && "$PY" backends/torch/test_runtime.py --schedc "$SCHEDC" "$@") || status=$?
echo "run_runtime: $( [ $status -eq 0 ] && echo passed || echo "FAILED (exit status $status)" ) in $(( $(date +%s) - start ))s"
exit $status
