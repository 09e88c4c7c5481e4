#!/usr/bin/env bash
# `pip install` of this checkout into a fresh virtual environment, then `schedc --version` and
# the book's runtime example (book/src/torch-runtime.md, the block after
# `<!-- pip-check: train.py -->`) under torchrun, from that environment only.
#
#   bash backends/torch/pip_check.sh
#
# torch is not downloaded again: the fresh environment sees the cached torch 2.15.0 one
# (venv.sh) through a .pth file. The wheel's release build of schedc-cli reuses
# $CARGO_TARGET_DIR (default: the workspace's target/), so that only what changed is rebuilt.
# Exits non-zero on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
start=$(date +%s)
export PYTHONDONTWRITEBYTECODE=1
LOG=pip_check
# shellcheck source=venv.sh
source "$ROOT/backends/torch/venv.sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"

TMP="$(mktemp -d "${TMPDIR:-/tmp}/schedc-pip-check.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
FRESH="$TMP/venv"
python3 -m venv "$FRESH"
SITE="$("$FRESH/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
TORCH_SITE="$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
echo "$TORCH_SITE" > "$SITE/schedc_pip_check_torch.pth"

echo "$LOG: pip install $ROOT (release build into $CARGO_TARGET_DIR)"
t0=$(date +%s)
"$FRESH/bin/python" -m pip install --quiet "$ROOT"
echo "$LOG: installed in $(( $(date +%s) - t0 ))s"

fail() { echo "$LOG: FAILED: $*" >&2; exit 1; }
cd "$TMP"  # nothing of the checkout on the path from here on
export PATH="$FRESH/bin:$PATH"
unset PYTHONPATH
[ "$(command -v schedc)" = "$FRESH/bin/schedc" ] || fail "schedc is not the installed command: $(command -v schedc)"
schedc --version
"$FRESH/bin/python" - "$SITE" <<'PY' || fail "schedc_torch is not imported from the fresh environment"
import sys
import schedc_torch
assert schedc_torch.__file__.startswith(sys.argv[1]), schedc_torch.__file__
for name in ("load_program", "ProgramRuntime", "load_schedule", "stages_of_rank"):
    assert hasattr(schedc_torch, name), name
print("schedc_torch from", schedc_torch.__file__)
PY

# The book's runtime example, as the book shows it.
awk '/^<!-- pip-check: train.py -->$/ {on=1; next} on && /^```python$/ {body=1; next} body && /^```$/ {exit} body {print}' \
    "$ROOT/book/src/torch-runtime.md" > train.py
[ -s train.py ] || fail "no <!-- pip-check: train.py --> block in book/src/torch-runtime.md"
schedc compile "$ROOT/specs/zbv.sched" --pp 2 --mb 4 --granularity stage -o zbv >/dev/null
"$FRESH/bin/python" -m torch.distributed.run --nproc-per-node 2 train.py zbv | tee out.txt
grep -q "^step 4: loss " out.txt || fail "the example did not print its fifth step"
echo "$LOG: passed in $(( $(date +%s) - start ))s"
