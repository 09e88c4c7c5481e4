#!/usr/bin/env bash
# The CUDA backend's GPU checks, in one call on a GPU machine (book/src/cuda.md, "The GPU
# run"). Three commands:
#
#   bash backends/cuda/gpu-check.sh prepare   # here (no GPU needed): release build of schedc
#                                             # and gpu_bench into .gpu/ (git-ignored), the
#                                             # data, the real-size model, and every CPU-only
#                                             # reference (.gpu/ref/): nothing of the CPU's
#                                             # runs on the GPU machine's time
#   bash backends/cuda/gpu-check.sh run       # on the GPU machine, with .gpu carried and $OUT
#                                             # set: every step, its result into $OUT as it ends
#   bash backends/cuda/gpu-check.sh summary   # (re)writes $OUT/summary.txt from what is there
#
# With the device tool: run(command="bash backends/cuda/gpu-check.sh run", carry=[".gpu"],
# timeout_s=480). The steps' time limits (STEPS below) add up to at most GPU_CHECK_BUDGET
# seconds (default 420, leaving the call's last minute for the summary and the transfer);
# a step that cannot finish before that deadline is skipped ("skipped: deadline"), and if
# the smoke step fails every other step is skipped ("skipped: smoke failed"). Each step
# writes, as it ends: $OUT/steps/NAME.json (the command's standard output: the CLI's JSON
# report), NAME.log (its standard error), NAME.status (`exit RC after S s` or `skipped: WHY`),
# a line of $OUT/steps.txt, and a fresh $OUT/summary.txt; so whatever ends the call, the
# figures of the steps that ended are in $OUT.
#
# Steps (single-GPU mode unless said):
#   smoke          1F1B P=2 M=4, f32, one step
#   f32_SPEC       1F1B, ZB-H1, DualPipe at P=4 M=8, f32 --verify: the CLI's own verdict
#                  (exit 0 and verify_passed) and the worst tensor
#   bf16_dualpipe  DualPipe P=4 M=8 in bf16: its loss against the CPU backend's f32 loss
#                  (ref/cpu_dualpipe.json, from prepare), goal 1e-2 relative
#   tp_dualpipe    DualPipe at --mesh pp=2,tp=2, f32 --verify
#   tp_bf16_1f1b   1F1B at --mesh pp=2,tp=2 in bf16 (the TP all-reduces sum bf16): its loss
#                  against the CPU backend's f32 loss (ref/cpu_tp_1f1b.json), goal 1e-2
#   sp_1f1b        1F1B at --mesh pp=2,tp=2,sp=2 --sequence-parallel (Megatron SP: the TP
#                  collectives are all-gathers and reduce-scatters), f32 --verify; not yet
#                  run on a GPU (its 25 s limit is a guess from tp_dualpipe's)
#   realsize       the issue-24 model (realsize.json: hidden 2048, MLA, 64 experts top-6, four
#                  layers) at sequence 4096 on one stage (P=1, M=4), bf16, 3 steps: tokens/s
#                  from the later steps, MFU with the FLOPs the simulator counts
#                  (ref/realsize_sim.json) over its bf16 peak
#   train_cuda_*   the README's Shakespeare run under DualPipe (200 steps), f32 and bf16,
#                  against the CPU's f32 curve (ref/train_cpu_f32.json)
#   graph          gpu_bench --what graph: an attention forward+backward captured as a CUDA
#                  graph and replayed, against the same calls run eagerly (bit for bit), and
#                  the host and device time per launch through a graph
#   sdpa           sdpa_check.py: the graph step's attention case against
#                  torch.nn.functional.scaled_dot_product_attention (f32 from the same
#                  bf16 inputs, goal 2e-2), and SDPA's speed at the bench's shape (16 heads x
#                  4096 tokens, d_qk 192, d_v 128) against ours (goal >= 70%); skipped when
#                  the machine's python3 has no torch
#   bench          gpu_bench: expert GEMMs against a bf16 GEMM peak, F&B overlap, launches,
#                  the tiled attention's device kernels against the host shim's on the same
#                  inputs and its speed at 16 heads x 4096 tokens
# Environment: OUT (required for run/summary), GPU_CHECK_DIR (default .gpu),
# GPU_CHECK_BUDGET (seconds, default 420).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GPU="${GPU_CHECK_DIR:-$ROOT/.gpu}"
BUDGET="${GPU_CHECK_BUDGET:-420}"

# NAME:LIMIT in order; the limits add up to 420 s. A step added here takes its time from
# another (or the deadline skips the last ones).
STEPS=(smoke:30 f32_1f1b:25 f32_zb_h1:25 f32_dualpipe:30 bf16_dualpipe:25 tp_dualpipe:25
    tp_bf16_1f1b:25 sp_1f1b:25 realsize:60 train_cuda_f32:40 train_cuda_bf16:30 bench:40 graph:15
    sdpa:25)

prepare() {
    cd "$ROOT" || exit 1
    local ex
    ex="$(git rev-parse --git-path info/exclude)"
    grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >>"$ex"
    cargo build --release -p schedc-cli || exit 1
    cargo build --release -p schedc-cuda --example gpu_bench || exit 1
    rm -rf "$GPU" && mkdir -p "$GPU/ref"
    local target="${CARGO_TARGET_DIR:-$ROOT/target}"
    cp "$target/release/schedc" "$target/release/examples/gpu_bench" "$GPU/"
    strip "$GPU/schedc" "$GPU/gpu_bench" 2>/dev/null || true
    cp tests/data/tinyshakespeare.txt backends/cuda/realsize.json backends/cuda/sdpa_check.py "$GPU/"
    # The CPU-only references, made here.
    local S="$GPU/schedc" spec
    for spec in 1f1b zb_h1 dualpipe; do
        "$S" run "specs/$spec.sched" --pp 4 --mb 8 --backend cpu --dtype f32 --format json >"$GPU/ref/cpu_$spec.json" || exit 1
    done
    "$S" run specs/1f1b.sched --pp 2 --mb 4 --mesh pp=2,tp=2 --backend cpu --dtype f32 --format json >"$GPU/ref/cpu_tp_1f1b.json" || exit 1
    "$S" run specs/dualpipe.sched --pp 4 --mb 8 --data "$GPU/tinyshakespeare.txt" --steps 200 --backend cpu --dtype f32 --format json >"$GPU/ref/train_cpu_f32.json" || exit 1
    "$S" sim specs/1f1b.sched --pp 1 --mb 4 --model "$GPU/realsize.json" --seq 4096 --hardware h200 --format json >"$GPU/ref/realsize_sim.json" || exit 1
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

# The limit of step NAME from STEPS.
limit_of() {
    local s
    for s in "${STEPS[@]}"; do
        [ "${s%%:*}" = "$1" ] && { echo "${s##*:}"; return; }
    done
    echo 60
}

# record NAME STATUS: the step's status file, its line in steps.txt, the summary.
record() {
    printf '%s\n' "$2" >"$OUT/steps/$1.status"
    echo "$1: $2" | tee -a "$OUT/steps.txt"
    echo "== $1: $2" >>"$OUT/log.txt"
    summary >/dev/null 2>>"$OUT/log.txt" || true
}

# step NAME CMD...: runs CMD under its limit unless the smoke step failed or the deadline is
# too near; stdout into $OUT/steps/NAME.json (renamed into place when it ends), stderr into
# NAME.log. Returns the command's status (1 when skipped). GPU_CHECK_STEP names the step
# to the command.
step() {
    local name="$1" limit
    shift
    limit="$(limit_of "$name")"
    if [ -n "$STOP" ]; then
        record "$name" "skipped: $STOP"
        return 1
    fi
    local left=$((DEADLINE - SECONDS))
    if [ "$limit" -gt "$left" ]; then
        record "$name" "skipped: deadline (${left} s left, the step's limit is ${limit} s)"
        return 1
    fi
    local t0=$SECONDS rc
    echo "== $name: $*" >>"$OUT/log.txt"
    GPU_CHECK_STEP="$name" timeout -k 2 "$limit" "$@" >"$OUT/steps/$name.json.part" 2>"$OUT/steps/$name.log"
    rc=$?
    mv -f "$OUT/steps/$name.json.part" "$OUT/steps/$name.json"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record "$name" "exit $rc after $((SECONDS - t0)) s (timed out at ${limit} s)"
    else
        record "$name" "exit $rc after $((SECONDS - t0)) s"
    fi
    return "$rc"
}

run() {
    : "${OUT:?set OUT to the results directory}"
    [ -x "$GPU/schedc" ] || { echo "gpu-check: $GPU/schedc is missing: run 'prepare' here and carry .gpu" >&2; exit 1; }
    cd "$ROOT" || exit 1
    mkdir -p "$OUT/steps"
    : >"$OUT/log.txt"
    : >"$OUT/steps.txt"
    local total=0 s
    for s in "${STEPS[@]}"; do total=$((total + ${s##*:})); done
    if [ "$total" -gt "$BUDGET" ]; then
        echo "gpu-check: the steps' limits add up to $total s, more than the budget of $BUDGET s: the last ones will be skipped" | tee -a "$OUT/log.txt"
    fi
    DEADLINE=$((SECONDS + BUDGET))
    STOP=""
    libs >>"$OUT/log.txt"
    nvidia-smi -L >>"$OUT/log.txt" 2>&1 || true
    local S="$GPU/schedc" start=$SECONDS
    step smoke "$S" run specs/1f1b.sched --pp 2 --mb 4 --backend cuda --format json ||
        STOP="smoke failed (steps/smoke.log)"
    for spec in 1f1b zb_h1 dualpipe; do
        step "f32_$spec" "$S" run "specs/$spec.sched" --pp 4 --mb 8 --backend cuda --dtype f32 --verify --format json
    done
    step bf16_dualpipe "$S" run specs/dualpipe.sched --pp 4 --mb 8 --backend cuda --dtype bf16 --format json
    # Tensor parallelism (issue 23): pp=2,tp=2 in single-GPU mode (four ranks on the one GPU,
    # the TP all-reduces through the transport on each rank's tp stream), f32 --verify.
    step tp_dualpipe "$S" run specs/dualpipe.sched --pp 2 --mb 4 --mesh pp=2,tp=2 --backend cuda --dtype f32 --verify --format json
    # TP in bf16 (the TP all-reduces sum bf16 activations): its loss against the CPU's f32.
    step tp_bf16_1f1b "$S" run specs/1f1b.sched --pp 2 --mb 4 --mesh pp=2,tp=2 --backend cuda --dtype bf16 --format json
    # Megatron sequence parallelism (issue 23): eight ranks on the one GPU, each TP member
    # on its shard of its SP chunk, f32 --verify against the reference that routes each
    # shard alone.
    step sp_1f1b "$S" run specs/1f1b.sched --pp 2 --mb 4 --mesh pp=2,tp=2,sp=2 --sequence-parallel --backend cuda --dtype f32 --verify --format json
    # Issue 24: the real-size model on one stage, 3 steps (the first with the setup).
    step realsize "$S" run specs/1f1b.sched --pp 1 --mb 4 --model "$GPU/realsize.json" --seq 4096 --data "$GPU/tinyshakespeare.txt" --steps 3 --backend cuda --dtype bf16 --format json
    local train=(run specs/dualpipe.sched --pp 4 --mb 8 --data "$GPU/tinyshakespeare.txt" --steps 200 --format json)
    step train_cuda_f32 "$S" "${train[@]}" --backend cuda --dtype f32
    step train_cuda_bf16 "$S" "${train[@]}" --backend cuda --dtype bf16
    step bench "$GPU/gpu_bench"
    # Issue 24, item 3: CUDA graphs (an attention forward+backward captured and replayed
    # against eager, bit for bit; launch overhead through a graph), dumping the attention
    # case for the next step.
    step graph "$GPU/gpu_bench" --what graph --dump-attention "$OUT/steps/attention_case.json"
    # Our attention against torch's scaled_dot_product_attention on the same GPU (the case
    # above; speed at 16 heads x 4096 tokens). Skipped (exit 0, {"skipped": ...}) without torch.
    step sdpa python3 "$GPU/sdpa_check.py" "$OUT/steps/attention_case.json"
    echo "gpu-check: all steps ran in $((SECONDS - start)) s" | tee -a "$OUT/log.txt"
    summary
}

summary() {
    : "${OUT:?set OUT to the results directory}"
    python3 - "$OUT" "$GPU/ref" "${STEPS[@]}" <<'PY'
import json, math, os, sys
out, ref, steps = sys.argv[1], sys.argv[2], [s.split(":")[0] for s in sys.argv[3:]]

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:
        return {"error": f"no result ({type(e).__name__})"}

def status(n):
    try:
        return open(os.path.join(out, "steps", n + ".status")).read().strip()
    except Exception:
        return "not run"

def res(n):
    return load(os.path.join(out, "steps", n + ".json"))

def num(x):
    """A float, or None for anything else (missing, null, a string, NaN stays NaN)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)

def fmt(x, spec=".3e"):
    x = num(x)
    if x is None:
        return "n/a"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return format(x, spec)

def ok(x, goal):
    x = num(x)
    return x is not None and not math.isnan(x) and x <= goal

lines, figures = [], {}
def section(name, f):
    try:
        f()
    except Exception as e:  # the summary never stops on one section
        lines.append(f"{name}: summary failed ({type(e).__name__}: {e})")

def f32(n):
    r, st = res(n), status(n)
    if not st.startswith("exit"):
        lines.append(f"{n}: {st}"); return
    passed = st.startswith("exit 0 ") and r.get("verify_passed") is True
    worst = r.get("worst") or {}
    figures[n] = {"verify_passed": r.get("verify_passed"), "exit": st,
                  "max_rel_grad_err": r.get("max_rel_grad_err"),
                  "max_abs_loss_err": r.get("max_abs_loss_err"), "worst_grad": worst.get("grad")}
    lines.append(f"{n}: --verify {'PASS' if passed else 'FAIL'} ({st}); worst gradient {fmt(r.get('max_rel_grad_err'))} at {worst.get('grad', 'n/a')}, loss {fmt(r.get('max_abs_loss_err'))}")

def bf16(n="bf16_dualpipe", cpu="cpu_dualpipe.json"):
    r, c, st = res(n), load(os.path.join(ref, cpu)), status(n)
    if not st.startswith("exit"):
        lines.append(f"{n}: {st}"); return
    a, b = num((r.get("loss") or [None])[0]), num((c.get("loss") or [None])[0])
    e = abs(a - b) / abs(b) if a is not None and b else None
    figures[n] = {"loss": a, "cpu_f32_loss": b, "rel_loss_err": e}
    lines.append(f"{n}: loss {fmt(a, '.5f')} against the CPU's f32 {fmt(b, '.5f')}: {fmt(e)} (goal 1e-2) {'PASS' if ok(e, 1e-2) else 'FAIL'} ({st})")

def realsize():
    n = "realsize"
    r, sim, st = res(n), load(os.path.join(ref, "realsize_sim.json")), status(n)
    if not st.startswith("exit"):
        lines.append(f"{n}: {st}"); return
    if not st.startswith("exit 0 "):
        lines.append(f"{n}: failed ({st}; steps/{n}.log)"); return
    secs = [num(x) for x in r.get("step_seconds") or []]
    later = sorted(x for x in secs[1:] if x is not None and x > 0)
    tokens = num(r.get("tokens_per_step"))
    tps = tokens / later[len(later) // 2] if later and tokens else None
    step_s, tf, mfu_sim, tsim = (num(sim.get(k)) for k in ["step_seconds", "tflops_per_gpu", "mfu", "tokens_per_step"])
    flops_tok = tf * 1e12 * step_s / tsim if None not in (tf, step_s, tsim) and tsim else None
    peak = tf * 1e12 / mfu_sim if tf and mfu_sim else None
    mfu = tps * flops_tok / peak if None not in (tps, flops_tok, peak) else None
    figures[n] = {"step_seconds": secs, "tokens_per_step": tokens, "tokens_per_second": tps,
                  "flops_per_token": flops_tok, "peak_flops": peak, "mfu": mfu,
                  "peak_device_memory": r.get("peak_device_memory"), "loss": r.get("loss")}
    lines.append(f"{n}: {fmt(tps, '.0f')} tokens/s (median of steps 2..; steps {', '.join(fmt(x, '.3f') for x in secs)} s), MFU {fmt(None if mfu is None else 100 * mfu, '.1f')}% (goal 40%), peak device memory {fmt(r.get('peak_device_memory'), '.3e')} B")

def training():
    t = {k: res("train_" + k) for k in ["cuda_f32", "cuda_bf16"]}
    t["cpu_f32"] = load(os.path.join(ref, "train_cpu_f32.json"))
    curves = {k: v.get("loss") for k, v in t.items()}
    figures["training"] = curves
    g = t["cuda_f32"]
    st = status("train_cuda_f32")
    if not isinstance(g.get("loss"), list) or not g["loss"]:
        lines.append(f"train_cuda_f32: {st}"); return
    secs, steps, ins = num(g.get("seconds")), num(g.get("steps")), num(g.get("instructions_per_step"))
    per = secs / (steps * ins) if None not in (secs, steps, ins) and steps and ins else None
    lines.append(f"training dualpipe P=4 200 steps: cuda f32 {fmt(g['loss'][0], '.4f')} -> {fmt(g['loss'][-1], '.4f')} in {fmt(secs, '.2f')} s ({fmt(None if per is None else per * 1e6, '.1f')} us per instruction)")
    for k in ["cuda_bf16", "cpu_f32"]:
        c = curves.get(k)
        if isinstance(c, list) and c:
            d = [abs(num(a) - num(b)) for a, b in zip(c, g["loss"]) if num(a) is not None and num(b) is not None]
            lines.append(f"training: {k} {fmt(c[0], '.4f')} -> {fmt(c[-1], '.4f')}, largest step difference from cuda f32 {fmt(max(d) if d else None)}")
        else:
            lines.append(f"training: {k}: {status('train_' + k) if k.startswith('cuda') else 'no reference (run prepare)'}")

def bench():
    b, st = res("bench"), status("bench")
    figures["bench"] = b
    if "gemm_peak" not in b:
        lines.append(f"bench: {st}"); return
    lines.append(f"gemm peak {fmt(b['gemm_peak'].get('tflops'), '.0f')} TFLOP/s (8192^3 bf16)")
    for e in b.get("expert_gemms", []):
        lines.append(f"expert gemms {e.get('local_experts')} experts x {e.get('rows_per_expert')} rows: forward {fmt(e.get('forward_tflops'), '.0f')} TFLOP/s = {fmt(100 * num(e.get('forward_fraction_of_peak')) if num(e.get('forward_fraction_of_peak')) is not None else None, '.0f')}% of peak (goal 70%), W-grad {fmt(e.get('wgrad_w1_tflops'), '.0f')} TFLOP/s")
    if "launch" in b:
        l = b["launch"]
        lines.append(f"launch: {fmt(l.get('host_us_per_launch'), '.2f')} us host, {fmt(l.get('device_us_per_launch'), '.2f')} us device per kernel")
    if isinstance(b.get("overlap"), dict):
        o = b["overlap"]
        lines.append(f"overlap: F then B {fmt(o.get('serial_f_then_b_ms'), '.3f')} ms, overlapped {fmt(o.get('overlapped_ms'), '.3f')} ms, compute only {fmt(o.get('compute_only_ms'), '.3f')} ms; exposed all-to-all {fmt(o.get('exposed_all_to_all_overlapped_ms'), '.3f')} ms (serial {fmt(o.get('exposed_all_to_all_serial_ms'), '.3f')} ms)")
    if isinstance(b.get("attention"), dict):
        a = b["attention"]
        if "error" in a:
            lines.append(f"attention: error {a['error']}")
        else:
            errs = a.get("check", {}).get("errors", {})
            vals = [num(v) for v in errs.values() if num(v) is not None]
            lines.append(f"attention: device vs shim worst rel err {fmt(max(vals) if vals else None, '.2e')} (bf16, tensor cores); {a.get('heads')} heads x {a.get('tokens')} tokens causal: forward {fmt(a.get('forward_ms'), '.3f')} ms ({fmt(a.get('forward_tflops'), '.1f')} TFLOP/s), forward+backward {fmt(a.get('forward_backward_ms'), '.3f')} ms ({fmt(a.get('forward_backward_tflops'), '.1f')} TFLOP/s)")

lines.append("steps: " + "; ".join(f"{n} {status(n)}" for n in steps))
section("smoke", lambda: lines.append(f"smoke: {status('smoke')}"))
for n in ["f32_1f1b", "f32_zb_h1", "f32_dualpipe", "tp_dualpipe", "sp_1f1b"]:
    section(n, lambda n=n: f32(n))
section("bf16_dualpipe", bf16)
section("tp_bf16_1f1b", lambda: bf16("tp_bf16_1f1b", "cpu_tp_1f1b.json"))
section("realsize", realsize)
section("training", training)
section("bench", bench)

def graph():
    g, st = res("graph"), status("graph")
    gr = g.get("graph") if isinstance(g.get("graph"), dict) else None
    if gr is None:
        lines.append(f"graph: {st}"); return
    figures["graph"] = gr
    if "error" in gr:
        lines.append(f"graph: error {gr['error']} ({st})"); return
    eq = gr.get("attention_replay_equals_eager")
    lines.append(f"graph: attention replay {'equals' if eq is True else 'DIFFERS from'} eager ({'PASS' if eq is True else 'FAIL'}); {fmt(gr.get('host_us_per_launch'), '.3f')} us host, {fmt(gr.get('device_us_per_launch'), '.3f')} us device per launch through a graph ({st})")

def sdpa():
    r, st = res("sdpa"), status("sdpa")
    if not st.startswith("exit"):
        lines.append(f"sdpa: {st}"); return
    if "skipped" in r:
        lines.append(f"sdpa: skipped ({r['skipped']})"); return
    if "error" in r:
        lines.append(f"sdpa: failed ({st}; steps/sdpa.log)"); return
    figures["sdpa"] = r
    n = r.get("numerics") or {}
    w = n.get("worst")
    lines.append(f"sdpa numerics: ours (bf16) against torch SDPA (f32, same inputs) worst rel err {fmt(w, '.2e')} (goal 2e-2) {'PASS' if ok(w, 2e-2) else 'FAIL'}" + (f" ({n['error']})" if "error" in n else ""))
    sp = r.get("speed") or {}
    ours = (res("bench").get("attention") or {}) if isinstance(res("bench").get("attention"), dict) else {}
    ratio = {}
    for k in ["forward_ms", "forward_backward_ms"]:
        a, b = num(ours.get(k)), num(sp.get(k))
        ratio[k] = b / a if a and b is not None else None
    lines.append(f"sdpa speed at 16 heads x 4096 tokens: torch forward {fmt(sp.get('forward_ms'), '.3f')} ms, forward+backward {fmt(sp.get('forward_backward_ms'), '.3f')} ms; ours at {fmt(None if ratio['forward_ms'] is None else 100 * ratio['forward_ms'], '.0f')}% / {fmt(None if ratio['forward_backward_ms'] is None else 100 * ratio['forward_backward_ms'], '.0f')}% of its speed (goal 70%)" + (f" ({sp['error']})" if "error" in sp else ""))

section("graph", graph)
section("sdpa", sdpa)
for k, v in figures.items():
    try:
        json.dump(v, open(os.path.join(out, k + ".json"), "w"), indent=1)
    except Exception as e:
        lines.append(f"{k}: cannot write {k}.json ({e})")
open(os.path.join(out, "summary.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
summary) summary ;;
*)
    echo "usage: bash backends/cuda/gpu-check.sh prepare|run|summary" >&2
    exit 2
    ;;
esac
