#!/usr/bin/env bash
# NVRTC compile check of every CUDA kernel, without a GPU (CI):
#
#   bash backends/cuda/nvrtc_check.sh
#
# 1. Creates (first run: about 250 MB from PyPI) or reuses the virtual environment
#    $SCHEDC_NVRTC_VENV (default $HOME/.cache/schedc/nvrtc-13.0.88-venv) holding the pinned
#    nvidia-cuda-nvrtc wheel (CUDA 13.0's NVRTC: libnvrtc.so.13, no driver needed);
# 2. builds schedc (cargo build -p schedc-cli);
# 3. runs `schedc compile ... --backend cuda --ptx DIR` with that NVRTC on LD_LIBRARY_PATH:
#    every kernel source, for f32 and bf16, compiled for sm_90 by cudarc's NVRTC bindings;
# 4. checks one non-empty PTX file with its entry point per kernel and element type, and
#    runs the CLI test that checks the same through `schedc` with NVRTC present;
# 5. assembles every kernel for the real sm_90 (nvrtc_cubin.py: NVRTC runs ptxas), so that
#    inline PTX (the attention kernels' tensor-core mma.sync) is checked too, and fails on a
#    kernel that spills registers to local memory.
# Prints "NVRTC compiled N kernels"; exits non-zero on any compile error.
set -euo pipefail

NVRTC_VERSION=13.0.88
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${SCHEDC_NVRTC_VENV:-$HOME/.cache/schedc/nvrtc-$NVRTC_VERSION-venv}"
start=$(date +%s)

libdir() {
    ls -d "$VENV"/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -1
}

if [ -n "$(libdir)" ] && [ -e "$(libdir)/libnvrtc.so.13" ]; then
    echo "nvrtc_check: reusing $VENV"
else
    echo "nvrtc_check: installing nvidia-cuda-nvrtc==$NVRTC_VERSION into $VENV"
    mkdir -p "$(dirname "$VENV")"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    if ! "$VENV/bin/python" -m pip install --quiet "nvidia-cuda-nvrtc==$NVRTC_VERSION"; then
        echo "nvrtc_check: FAILED: pip could not install nvidia-cuda-nvrtc==$NVRTC_VERSION" >&2
        exit 1
    fi
fi
LIB="$(libdir)"
[ -e "$LIB/libnvrtc.so.13" ] || { echo "nvrtc_check: FAILED: no libnvrtc.so.13 in $VENV" >&2; exit 1; }

(cd "$ROOT" && cargo build -q -p schedc-cli)
SCHEDC="${CARGO_TARGET_DIR:-$ROOT/target}/debug/schedc"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
cd "$ROOT"
LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$SCHEDC" compile specs/1f1b.sched --pp 4 --mb 8 --backend cuda --ptx "$OUT/ptx" --arch sm_90

sources=$(ls backends/cuda/kernels/*.cu | wc -l)
files=$(ls "$OUT"/ptx/*.ptx | wc -l)
if [ "$files" -ne $((2 * sources)) ]; then
    echo "nvrtc_check: FAILED: $files PTX files for $sources kernel sources in f32 and bf16" >&2
    exit 1
fi
for f in "$OUT"/ptx/*.ptx; do
    k="$(basename "$f" | cut -d. -f1)"
    if ! grep -q "\.entry $k(" "$f"; then
        echo "nvrtc_check: FAILED: $f has no entry point $k" >&2
        exit 1
    fi
done
LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test -q -p schedc-cli --test run compile_ptx_needs_cuda_and_nvrtc
LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    python3 backends/cuda/nvrtc_cubin.py "$LIB" sm_90
echo "NVRTC compiled $files kernels ($sources kernel sources, f32 and bf16, sm_90) in $(( $(date +%s) - start ))s"
