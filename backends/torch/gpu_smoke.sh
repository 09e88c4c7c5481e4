#!/usr/bin/env bash
# Prepares (and optionally runs) the GPU smoke test of schedc_torch_runtime.
#
#   bash backends/torch/gpu_smoke.sh --prepare DIR   # compile the programs (needs cargo)
#   bash backends/torch/gpu_smoke.sh --run DIR       # run gpu_smoke.py on them (needs a GPU)
#
# The programs: ZB-V and DualPipeV with P = 1 (world size 1), DualPipeV with P = 1 split into
# MoE parts, DualPipeV with P = 2 (two processes on one GPU). A directory inside the worktree
# that git does not ignore travels with it to the device machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mode="${1:-}"
DIR="${2:-$ROOT/backends/torch/gpu_programs}"
case "$mode" in
--prepare)
    (cd "$ROOT" && cargo build -q -p schedc-cli)
    S="${CARGO_TARGET_DIR:-$ROOT/target}/debug/schedc"
    rm -rf "$DIR"
    mkdir -p "$DIR"
    (cd "$ROOT" &&
        "$S" compile specs/zbv.sched --pp 1 --mb 2 --granularity stage -o "$DIR/zbv-p1" &&
        "$S" compile specs/dualpipev.sched --pp 1 --mb 2 --granularity stage -o "$DIR/dualpipev-p1" &&
        "$S" compile specs/dualpipev.sched --pp 2 --mb 4 --granularity stage -o "$DIR/dualpipev-p2" &&
        "$S" compile specs/dualpipev.sched --pp 1 --mb 2 --moe --granularity stage -o "$DIR/dualpipev-p1-moe")
    echo "gpu_smoke: programs in $DIR"
    ;;
--run)
    PY="${PYTHON:-python3}"
    export PYTHONDONTWRITEBYTECODE=1
    (cd "$ROOT" && "$PY" backends/torch/gpu_smoke.py --programs "$DIR")
    ;;
*)
    echo "usage: gpu_smoke.sh --prepare DIR | --run DIR" >&2
    exit 2
    ;;
esac
