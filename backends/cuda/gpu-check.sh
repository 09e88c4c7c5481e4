#!/usr/bin/env bash
# The CUDA backend's GPU checks, in one call on a GPU machine (book/src/cuda.md, "The GPU
# run"). Two halves:
#
#   bash backends/cuda/gpu-check.sh prepare   # here (no GPU needed): release build of schedc
#                                             # and gpu_bench into .gpu/ (git-ignored), with
#                                             # the Shakespeare data; about 40 MB
#   bash backends/cuda/gpu-check.sh run       # on the GPU machine, with .gpu carried and $OUT
#                                             # set: every check, results under $OUT
#
# With the device tool: run(command="bash backends/cuda/gpu-check.sh run", carry=[".gpu"],
# timeout_s=540). The checks (each bounded by `timeout`, about 6 minutes in all, most of
# it NVRTC compiling the kernels once per run):
#   1. numerics: 1F1B, ZB-H1, DualPipe at P=4, single-GPU mode, one step: f32 loss and every
#      gradient against the CPU's sequential f32 reference (--verify), goal 1e-4 relative;
#      bf16 loss against the CPU backend's f32 loss, goal 1e-2 relative;
#   2. training: the README's Shakespeare run under DualPipe (200 steps) on the GPU (f32 and
#      bf16) and on the CPU (f32): the three loss curves;
#   3. expert GEMMs at DeepSeek-like shapes against a plain bf16 GEMM of the same run (goal
#      70%), an overlapped F&B chunk against F then B (all-to-alls as device copies), and
#      the launch overhead (gpu_bench);
#   4. the driver's per-instruction overhead (wall time of the training run per instruction);
#   5. tensor parallelism: 1F1B and DualPipe at --mesh pp=2,tp=2, f32 --verify (goal 1e-4);
#      1F1B at pp=2,tp=2 in bf16, its loss against the CPU backend's f32 loss (goal 1e-2).
# Outputs: $OUT/log.txt, numerics.json, training.json, bench.json, summary.txt.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GPU="$ROOT/.gpu"

prepare() {
    cd "$ROOT" || exit 1
    local ex
    ex="$(git rev-parse --git-path info/exclude)"
    grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >>"$ex"
    cargo build --release -p schedc-cli || exit 1
    cargo build --release -p schedc-cuda --example gpu_bench || exit 1
    rm -rf "$GPU" && mkdir -p "$GPU"
    local target="${CARGO_TARGET_DIR:-$ROOT/target}"
    cp "$target/release/schedc" "$target/release/examples/gpu_bench" "$GPU/"
    strip "$GPU/schedc" "$GPU/gpu_bench" 2>/dev/null || true
    cp tests/data/tinyshakespeare.txt "$GPU/"
    du -sh "$GPU"
    echo "gpu-check: prepared $GPU; carry .gpu and run: bash backends/cuda/gpu-check.sh run"
}

libs() {
    # CUDA's libraries on the GPU machine: the toolkit, and the pip wheels of its python
    # (nvidia-cuda-nvrtc, nvidia-cublas, nvidia-nccl-cu13). NCCL ships as libnccl.so.2, a
    # name cudarc does not try: link it as libnccl.so in a directory of our own.
    local dirs=() sp d nccl
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && dirs+=("$d")
    done
    sp="$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)"
    for s in $sp; do
        for d in "$s"/nvidia/cu13/lib "$s"/nvidia/*/lib; do
            [ -d "$d" ] && dirs+=("$d")
        done
    done
    nccl="$(for d in "${dirs[@]}"; do ls "$d"/libnccl.so* 2>/dev/null; done | head -1)"
    if [ -n "$nccl" ]; then
        mkdir -p "$GPU/nccl-shim"
        ln -sf "$nccl" "$GPU/nccl-shim/libnccl.so"
        dirs=("$GPU/nccl-shim" "${dirs[@]}")
    fi
    local joined
    joined="$(IFS=:; echo "${dirs[*]}")"
    export LD_LIBRARY_PATH="$joined${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
}

# step NAME SECONDS CMD...: runs CMD with a time limit, its stdout into $OUT/parts/NAME.json,
# its stderr into the log; never stops the script.
step() {
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS
    echo "== $name: $*" >>"$OUT/log.txt"
    timeout "$limit" "$@" >"$PARTS/$name.json" 2>>"$OUT/log.txt"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s" >>"$OUT/log.txt"
    echo "$name: exit $rc after $((SECONDS - t0)) s"
}

run() {
    : "${OUT:?set OUT to the results directory}"
    [ -x "$GPU/schedc" ] || { echo "gpu-check: $GPU/schedc is missing: run 'prepare' here and carry .gpu" >&2; exit 1; }
    cd "$ROOT" || exit 1
    PARTS="$(mktemp -d)"
    export PARTS
    : >"$OUT/log.txt"
    libs >>"$OUT/log.txt"
    nvidia-smi -L >>"$OUT/log.txt" 2>&1 || true
    local S="$GPU/schedc" start=$SECONDS
    step smoke 120 "$S" run specs/1f1b.sched --pp 2 --mb 4 --backend cuda --format json
    for spec in 1f1b zb_h1 dualpipe; do
        step "f32_$spec" 120 "$S" run "specs/$spec.sched" --pp 4 --mb 8 --backend cuda --dtype f32 --verify --format json
        step "bf16_$spec" 120 "$S" run "specs/$spec.sched" --pp 4 --mb 8 --backend cuda --dtype bf16 --format json
        step "cpu_$spec" 60 "$S" run "specs/$spec.sched" --pp 4 --mb 8 --backend cpu --dtype f32 --format json
    done
    # Tensor parallelism (issue 23): pp=2,tp=2 in single-GPU mode (four ranks on the one GPU,
    # the TP all-reduces through the transport on each rank's tp stream), f32 --verify.
    for spec in 1f1b dualpipe; do
        step "tp_$spec" 120 "$S" run "specs/$spec.sched" --pp 2 --mb 4 --mesh pp=2,tp=2 --backend cuda --dtype f32 --verify --format json
    done
    # TP in bf16 (the TP all-reduces sum bf16 activations): its loss against the CPU's f32.
    step tp_bf16_1f1b 120 "$S" run specs/1f1b.sched --pp 2 --mb 4 --mesh pp=2,tp=2 --backend cuda --dtype bf16 --format json
    step tp_cpu_1f1b 60 "$S" run specs/1f1b.sched --pp 2 --mb 4 --mesh pp=2,tp=2 --backend cpu --dtype f32 --format json
    local train=(run specs/dualpipe.sched --pp 4 --mb 8 --data "$GPU/tinyshakespeare.txt" --steps 200 --format json)
    step train_cuda_f32 240 "$S" "${train[@]}" --backend cuda --dtype f32
    step train_cuda_bf16 240 "$S" "${train[@]}" --backend cuda --dtype bf16
    step train_cpu_f32 120 "$S" "${train[@]}" --backend cpu --dtype f32
    step bench 240 "$GPU/gpu_bench"
    echo "gpu-check: all steps ran in $((SECONDS - start)) s" | tee -a "$OUT/log.txt"
    python3 - "$PARTS" "$OUT" <<'PY'
import json, os, sys
parts, out = sys.argv[1], sys.argv[2]
def load(n):
    try:
        with open(os.path.join(parts, n + ".json")) as f:
            return json.load(f)
    except Exception as e:
        return {"error": f"{n}: no result ({e}); see log.txt"}
lines = []
num = {}
for spec in ["1f1b", "zb_h1", "dualpipe"]:
    f, b, c = load("f32_" + spec), load("bf16_" + spec), load("cpu_" + spec)
    r = {"f32": {k: f.get(k) for k in ["loss", "reference_loss", "max_rel_grad_err", "max_abs_loss_err", "max_rel_param_err", "error"] if k in f}}
    if "loss" in b and "loss" in c:
        r["bf16_loss"], r["cpu_f32_loss"] = b["loss"][0], c["loss"][0]
        r["bf16_rel_loss_err"] = abs(b["loss"][0] - c["loss"][0]) / abs(c["loss"][0])
    if "max_abs_loss_err" in f and "reference_loss" in f:
        r["f32_rel_loss_err"] = f["max_abs_loss_err"] / abs(f["reference_loss"][0])
    r["f32_pass"] = f.get("max_rel_grad_err", 1) <= 1e-4 and r.get("f32_rel_loss_err", 1) <= 1e-4
    r["bf16_pass"] = r.get("bf16_rel_loss_err", 1) <= 1e-2
    num[spec] = r
    lines.append(f"numerics {spec} P=4: f32 grad {f.get('max_rel_grad_err')} loss {r.get('f32_rel_loss_err')} (goal 1e-4) {'PASS' if r['f32_pass'] else 'FAIL'}; bf16 loss {r.get('bf16_rel_loss_err')} (goal 1e-2) {'PASS' if r['bf16_pass'] else 'FAIL'}")
for spec in ["1f1b", "dualpipe"]:
    f = load("tp_" + spec)
    r = {k: f.get(k) for k in ["loss", "reference_loss", "max_rel_grad_err", "max_abs_loss_err", "max_rel_param_err", "error"] if k in f}
    if "max_abs_loss_err" in f and "reference_loss" in f:
        r["f32_rel_loss_err"] = f["max_abs_loss_err"] / abs(f["reference_loss"][0])
    r["f32_pass"] = f.get("max_rel_grad_err", 1) <= 1e-4 and r.get("f32_rel_loss_err", 1) <= 1e-4
    num["tp_" + spec] = r
    lines.append(f"numerics {spec} pp=2,tp=2: f32 grad {f.get('max_rel_grad_err')} loss {r.get('f32_rel_loss_err')} (goal 1e-4) {'PASS' if r['f32_pass'] else 'FAIL'}")
b, c = load("tp_bf16_1f1b"), load("tp_cpu_1f1b")
r = {"error": b.get("error") or c.get("error")}
if "loss" in b and "loss" in c:
    r = {"bf16_loss": b["loss"][0], "cpu_f32_loss": c["loss"][0],
         "bf16_rel_loss_err": abs(b["loss"][0] - c["loss"][0]) / abs(c["loss"][0])}
r["bf16_pass"] = r.get("bf16_rel_loss_err", 1) <= 1e-2
num["tp_bf16_1f1b"] = r
lines.append(f"numerics 1f1b pp=2,tp=2 bf16: loss {r.get('bf16_rel_loss_err')} (goal 1e-2) {'PASS' if r['bf16_pass'] else 'FAIL'}")
json.dump(num, open(os.path.join(out, "numerics.json"), "w"), indent=1)
tr = {k: load("train_" + k) for k in ["cuda_f32", "cuda_bf16", "cpu_f32"]}
curves = {k: v.get("loss", v.get("error")) for k, v in tr.items()}
t = tr["cuda_f32"]
if "loss" in t:
    per = t["seconds"] / (t["steps"] * t["instructions_per_step"])
    curves["cuda_f32_seconds"] = t["seconds"]
    curves["driver_seconds_per_instruction"] = per
    curves["peak_device_memory_per_rank"] = t.get("peak_device_memory")
    lines.append(f"training dualpipe P=4 200 steps: cuda f32 {t['loss'][0]:.4f} -> {t['loss'][-1]:.4f} in {t['seconds']:.2f} s ({per*1e6:.1f} us per instruction)")
    for k in ["cuda_bf16", "cpu_f32"]:
        if isinstance(curves.get(k), list):
            d = max(abs(a - b) for a, b in zip(curves[k], t["loss"]))
            lines.append(f"training: {k} {curves[k][0]:.4f} -> {curves[k][-1]:.4f}, largest step difference from cuda f32 {d:.3e}")
json.dump(curves, open(os.path.join(out, "training.json"), "w"), indent=1)
bench = load("bench")
json.dump(bench, open(os.path.join(out, "bench.json"), "w"), indent=1)
if "gemm_peak" in bench:
    lines.append(f"gemm peak {bench['gemm_peak']['tflops']:.0f} TFLOP/s (8192^3 bf16)")
    for e in bench["expert_gemms"]:
        lines.append(f"expert gemms {e['local_experts']} experts x {e['rows_per_expert']} rows: forward {e['forward_tflops']:.0f} TFLOP/s = {100*e['forward_fraction_of_peak']:.0f}% of peak (goal 70%), W-grad {e['wgrad_w1_tflops']:.0f} TFLOP/s")
if "overlap" in bench:
    o = bench["overlap"]
    lines.append(f"overlap: F then B {o['serial_f_then_b_ms']:.3f} ms, overlapped {o['overlapped_ms']:.3f} ms, compute only {o['compute_only_ms']:.3f} ms; exposed all-to-all {o['exposed_all_to_all_overlapped_ms']:.3f} ms (serial {o['exposed_all_to_all_serial_ms']:.3f} ms)")
if "launch" in bench:
    l = bench["launch"]
    lines.append(f"launch: {l['host_us_per_launch']:.2f} us host, {l['device_us_per_launch']:.2f} us device per kernel")
open(os.path.join(out, "summary.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
    rm -rf "$PARTS"
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
*)
    echo "usage: bash backends/cuda/gpu-check.sh prepare|run" >&2
    exit 2
    ;;
esac
