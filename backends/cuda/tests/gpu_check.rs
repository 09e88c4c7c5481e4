//! Issue 24, item 4: `gpu-check.sh run` with stub binaries (a fake `schedc` and
//! `gpu_bench` that print canned reports: one step killed, one NaN, one timed out), so that
//! the script's bookkeeping is tested without a GPU: every step's result in `$OUT` as it
//! ends, the smoke step stopping the rest, the deadline skipping what cannot finish, and a
//! summary that survives NaN and missing steps.

use std::path::{Path, PathBuf};
use std::process::Command;

const SCHEDC: &str = r#"#!/usr/bin/env bash
case "$GPU_CHECK_STEP" in
smoke) [ -n "${FAIL_SMOKE:-}" ] && { echo "error: no CUDA driver" >&2; exit 2; }
    sleep "${SLEEP_SMOKE:-0}"
    echo '{"loss": [5.81]}' ;;
f32_1f1b) echo '{"verify_passed": true, "max_rel_grad_err": 9.5e-7, "max_abs_loss_err": 1e-7, "worst": {"grad": "layer0.wo at step 0 on rank 1"}}' ;;
f32_zb_h1) echo '{"verify_passed": false, "max_rel_grad_err": NaN, "max_abs_loss_err": null, "worst": {"grad": "head at step 0 on rank 3"}}'; exit 1 ;;
f32_dualpipe) echo '{"trunc'; exit 137 ;;
bf16_dualpipe) echo '{"loss": [5.8158]}' ;;
tp_dualpipe) echo '{"verify_passed": true, "max_rel_grad_err": 1.0e-6, "max_abs_loss_err": 0.0, "worst": {"grad": "layer1.wuq[tp 1/2 columns 16] at step 0 on rank 2"}}' ;;
sp_1f1b) echo '{"verify_passed": true, "max_rel_grad_err": 1.1e-6, "max_abs_loss_err": 2e-7, "worst": {"grad": "layer0.q_norm at step 1 on rank 0"}}' ;;
realsize) echo '{"loss": [5.55, 5.4, 5.2], "tokens_per_step": 16384, "step_seconds": [30.0, 2.0, 2.2], "peak_device_memory": 60000000000}' ;;
train_cuda_f32) echo '{"loss": [5.7687, 2.3204], "seconds": 7.0, "steps": 200, "instructions_per_step": 1096}' ;;
train_cuda_bf16) exit 124 ;;
*) echo "unexpected step $GPU_CHECK_STEP" >&2; exit 3 ;;
esac
"#;

const BENCH: &str = r#"#!/usr/bin/env bash
if [ "$GPU_CHECK_STEP" = graph ]; then
    echo '{"device": "stub", "graph": {"attention_replay_equals_eager": true, "attention_outputs_differing": [], "host_us_per_launch": 0.25, "device_us_per_launch": 1.5}}'
    exit 0
fi
echo '{"gemm_peak": {"tflops": 794.2}, "expert_gemms": [{"local_experts": 256, "rows_per_expert": 128, "forward_tflops": 515.0, "forward_fraction_of_peak": NaN, "wgrad_w1_tflops": 84.0}], "launch": {"host_us_per_launch": 3.3}, "attention": {"heads": 16, "tokens": 4096, "forward_ms": 2.0, "forward_backward_ms": 8.0, "check": {"errors": {"out": 0.004}}}}'
"#;

const SDPA: &str = r#"import json
print(json.dumps({"torch": "stub", "numerics": {"worst": 0.0034, "rel_err": {"out": 0.0024}}, "speed": {"forward_ms": 1.5, "forward_backward_ms": 6.8}}))
"#;

fn setup(name: &str) -> (PathBuf, PathBuf) {
    let base = std::env::temp_dir().join(format!("schedc-gpu-check-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let gpu = base.join("gpu");
    let out = base.join("out");
    std::fs::create_dir_all(gpu.join("ref")).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(gpu.join("sdpa_check.py"), SDPA).unwrap();
    for (f, text) in [("schedc", SCHEDC), ("gpu_bench", BENCH)] {
        std::fs::write(gpu.join(f), text).unwrap();
        let _ = Command::new("chmod").arg("+x").arg(gpu.join(f)).status();
    }
    for (f, text) in [
        ("cpu_dualpipe.json", r#"{"loss": [5.8]}"#),
        ("train_cpu_f32.json", r#"{"loss": [5.7687, 2.3210]}"#),
        (
            "realsize_sim.json",
            r#"{"step_seconds": 0.1, "tflops_per_gpu": 340.8, "mfu": 0.5, "tokens_per_step": 16384}"#,
        ),
    ] {
        std::fs::write(gpu.join("ref").join(f), text).unwrap();
    }
    (gpu, out)
}

fn run(gpu: &Path, out: &Path, env: &[(&str, &str)]) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/gpu-check.sh");
    let o = Command::new("bash")
        .args([script, "run"])
        .env("OUT", out)
        .env("GPU_CHECK_DIR", gpu)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::read_to_string(out.join("summary.txt")).unwrap()
}

fn status(out: &Path, step: &str) -> String {
    std::fs::read_to_string(out.join("steps").join(format!("{step}.status")))
        .unwrap()
        .trim()
        .to_string()
}

fn line<'a>(summary: &'a str, start: &str) -> &'a str {
    summary
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line `{start}...` in\n{summary}"))
}

#[test]
fn gpu_check_writes_every_step_and_a_summary_that_survives_nan_and_failures() {
    let (gpu, out) = setup("all");
    let s = run(&gpu, &out, &[]);
    // Every step's status and raw report are in $OUT.
    for step in [
        "smoke",
        "f32_1f1b",
        "f32_zb_h1",
        "f32_dualpipe",
        "bf16_dualpipe",
        "tp_dualpipe",
        "sp_1f1b",
        "realsize",
        "train_cuda_f32",
        "train_cuda_bf16",
        "bench",
        "graph",
        "sdpa",
    ] {
        assert!(
            out.join("steps").join(format!("{step}.json")).exists(),
            "{step}"
        );
        assert!(
            status(&out, step).starts_with("exit "),
            "{step}: {}",
            status(&out, step)
        );
    }
    assert!(status(&out, "f32_dualpipe").starts_with("exit 137 after "));
    assert!(status(&out, "f32_dualpipe").ends_with("(timed out at 30 s)"));
    let l = line(&s, "f32_1f1b: ");
    assert!(
        l.starts_with("f32_1f1b: --verify PASS (exit 0 after "),
        "{l}"
    );
    assert!(
        l.ends_with("worst gradient 9.500e-07 at layer0.wo at step 0 on rank 1, loss 1.000e-07"),
        "{l}"
    );
    let l = line(&s, "f32_zb_h1: ");
    assert!(
        l.starts_with("f32_zb_h1: --verify FAIL (exit 1 after "),
        "{l}"
    );
    assert!(
        l.ends_with("worst gradient nan at head at step 0 on rank 3, loss n/a"),
        "{l}"
    );
    let l = line(&s, "f32_dualpipe: ");
    assert!(
        l.starts_with("f32_dualpipe: --verify FAIL (exit 137 after "),
        "{l}"
    );
    assert!(l.ends_with("worst gradient n/a at n/a, loss n/a"), "{l}");
    let l = line(&s, "sp_1f1b: ");
    assert!(
        l.starts_with("sp_1f1b: --verify PASS (exit 0 after "),
        "{l}"
    );
    assert!(
        l.ends_with(
            "worst gradient 1.100e-06 at layer0.q_norm at step 1 on rank 0, loss 2.000e-07"
        ),
        "{l}"
    );
    let l = line(&s, "bf16_dualpipe: ");
    assert!(
        l.starts_with(
            "bf16_dualpipe: loss 5.81580 against the CPU's f32 5.80000: 2.724e-03 (goal 1e-2) PASS"
        ),
        "{l}"
    );
    let l = line(&s, "realsize: ");
    assert!(
        l.starts_with("realsize: 7447 tokens/s (median of steps 2..; steps 30.000, 2.000, 2.200 s), MFU 2.3% (goal 40%)"),
        "{l}"
    );
    let l = line(&s, "training dualpipe");
    assert_eq!(l, "training dualpipe P=4 200 steps: cuda f32 5.7687 -> 2.3204 in 7.00 s (31.9 us per instruction)");
    let l = line(&s, "training: cuda_bf16");
    assert!(l.starts_with("training: cuda_bf16: exit 124 after "), "{l}");
    assert!(l.ends_with("(timed out at 30 s)"), "{l}");
    assert_eq!(
        line(&s, "training: cpu_f32"),
        "training: cpu_f32 5.7687 -> 2.3210, largest step difference from cuda f32 6.000e-04"
    );
    assert_eq!(
        line(&s, "expert gemms"),
        "expert gemms 256 experts x 128 rows: forward 515 TFLOP/s = nan% of peak (goal 70%), W-grad 84 TFLOP/s"
    );
    // Issue 24, item 3: the CUDA-graph step and the comparison with torch's SDPA.
    let l = line(&s, "graph: ");
    assert!(
        l.starts_with("graph: attention replay equals eager (PASS); 0.250 us host, 1.500 us device per launch through a graph (exit 0 after "),
        "{l}"
    );
    assert_eq!(
        line(&s, "sdpa numerics: "),
        "sdpa numerics: ours (bf16) against torch SDPA (f32, same inputs) worst rel err 3.40e-03 (goal 2e-2) PASS"
    );
    assert_eq!(
        line(&s, "sdpa speed"),
        "sdpa speed at 16 heads x 4096 tokens: torch forward 1.500 ms, forward+backward 6.800 ms; ours at 75% / 85% of its speed (goal 70%)"
    );
    assert!(!s.contains("summary failed"), "{s}");
    let _ = std::fs::remove_dir_all(gpu.parent().unwrap());
}

#[test]
fn gpu_check_stops_after_a_failed_smoke_step() {
    let (gpu, out) = setup("smoke");
    let s = run(&gpu, &out, &[("FAIL_SMOKE", "1")]);
    assert!(status(&out, "smoke").starts_with("exit 2 after "));
    assert_eq!(
        std::fs::read_to_string(out.join("steps").join("smoke.log")).unwrap(),
        "error: no CUDA driver\n"
    );
    for step in ["f32_1f1b", "realsize", "bench"] {
        assert_eq!(
            status(&out, step),
            "skipped: smoke failed (steps/smoke.log)"
        );
    }
    assert_eq!(
        line(&s, "realsize: "),
        "realsize: skipped: smoke failed (steps/smoke.log)"
    );
    assert!(!s.contains("summary failed"), "{s}");
    let _ = std::fs::remove_dir_all(gpu.parent().unwrap());
}

#[test]
fn gpu_check_skips_the_steps_the_deadline_leaves_no_time_for() {
    let (gpu, out) = setup("deadline");
    // A budget of 45 s: at the start every step but realsize (60 s) would fit; the smoke
    // step takes 6 s, after which the 40 s steps no longer do, the 30 s ones still do.
    let s = run(
        &gpu,
        &out,
        &[("GPU_CHECK_BUDGET", "45"), ("SLEEP_SMOKE", "6")],
    );
    assert!(status(&out, "smoke").starts_with("exit 0 after "));
    // The first 25 s steps run (each step's bookkeeping takes a second or two here); the
    // later ones may or may not, with the machine's load.
    for step in ["f32_1f1b", "f32_zb_h1"] {
        assert!(
            status(&out, step).starts_with("exit "),
            "{step}: {}",
            status(&out, step)
        );
    }
    for (step, limit) in [("realsize", 60), ("train_cuda_f32", 40), ("bench", 40)] {
        let st = status(&out, step);
        assert!(
            st.starts_with("skipped: deadline (")
                && st.ends_with(&format!("s left, the step's limit is {limit} s)")),
            "{step}: {st}"
        );
        assert!(!out.join("steps").join(format!("{step}.json")).exists());
    }
    let log = std::fs::read_to_string(out.join("log.txt")).unwrap();
    assert!(
        log.contains("gpu-check: the steps' limits add up to 420 s, more than the budget of 45 s"),
        "{log}"
    );
    assert!(line(&s, "realsize: ").starts_with("realsize: skipped: deadline ("));
    assert!(line(&s, "f32_1f1b: ").starts_with("f32_1f1b: --verify PASS"));
    let _ = std::fs::remove_dir_all(gpu.parent().unwrap());
}
