//! `schedc sim --model`: op times and memory derived from a model, a GPU and a layout; the
//! step report; bad input named with its field, option or rank.

use std::process::Output;
mod common;
use common::*;

fn tmp(name: &str, text: &str) -> String {
    let d = std::env::temp_dir().join(format!("schedc-model-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

fn refused(o: &Output, code: i32, says: &str) {
    assert_eq!(o.status.code(), Some(code), "{}", stderr(o));
    assert!(
        stderr(o).contains(says),
        "wanted `{says}` in: {}",
        stderr(o)
    );
}

const ZB: [&str; 12] = [
    "--model",
    "zb-6.2b",
    "--hardware",
    "h800",
    "--seq",
    "1024",
    "--micro-batch-size",
    "4",
    "--attention",
    "eager",
    "--format",
    "json",
];

#[test]
fn sim_with_a_model_reports_the_step_in_json() {
    let mut a = vec!["sim", "specs/1f1b.sched", "--pp", "8", "--mb", "24"];
    a.extend(ZB);
    let o = schedc(&a);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in [
        "step_seconds",
        "tokens_per_second",
        "tflops_per_gpu",
        "mfu",
        "peak_memory_bytes",
    ] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {}", v[k]);
    }
    assert_eq!(v["memory_bytes"].as_array().unwrap().len(), 8);
    // The fitted figure (sail-sg#21's 1F1B, 55 samples/s = 96 sequences / step).
    let sps = 96.0 / v["step_seconds"].as_f64().unwrap();
    assert!((sps - 55.0).abs() < 0.3, "{sps}");
    let tokens = v["tokens_per_step"].as_f64().unwrap();
    assert_eq!(tokens, 96.0 * 1024.0);
}

#[test]
fn sim_with_a_config_json_reads_it() {
    let cfg = tmp(
        "tiny.json",
        r#"{"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 8,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": true}"#,
    );
    let o = schedc(&[
        "sim",
        "specs/zbv.sched",
        "--pp",
        "2",
        "--mb",
        "8",
        "--model",
        &cfg,
        "--hardware",
        "h100",
        "--mesh",
        "tp=2,dp=2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("on 8 x h100 (tp=2 pp=2 ep=1 dp=2 cp=1)"),
        "{out}"
    );
    assert!(
        out.contains("TFLOP/s per GPU") && out.contains("memory: peak"),
        "{out}"
    );
}

#[test]
fn bad_models_and_layouts_exit_2_naming_the_field() {
    let sim = |extra: &[&str]| {
        let mut a = vec!["sim", "specs/1f1b.sched", "--pp", "4", "--mb", "8"];
        a.extend(extra);
        schedc(&a)
    };
    let unknown = tmp("gpt2.json", r#"{"model_type": "gpt2"}"#);
    refused(
        &sim(&["--model", &unknown]),
        2,
        "unknown architecture `model_type: gpt2`",
    );
    let missing = tmp(
        "missing.json",
        r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "vocab_size": 32000}"#,
    );
    refused(
        &sim(&["--model", &missing]),
        2,
        "missing field `intermediate_size`",
    );
    let notjson = tmp("broken.json", "{\"model_type\": \"llama\",\n  oops }");
    refused(&sim(&["--model", &notjson]), 2, "broken.json:2:");
    refused(&sim(&["--model", "gpt-9"]), 2, "unknown model `gpt-9`");
    refused(
        &sim(&["--model", "llama3-8b", "--layout", "Et*8|t*8|t*8|t*8x"]),
        2,
        "column 17",
    );
    refused(
        &sim(&["--model", "llama3-8b", "--layout", "Et*8|t*8|t*8|t*7L"]),
        2,
        "holds 31 transformer layer(s) (`t`), but the model has 32",
    );
    refused(
        &sim(&["--model", "llama3-8b", "--mesh", "tp=3"]),
        2,
        "--mesh tp=3 does not divide",
    );
    refused(
        &sim(&["--model", "llama3-8b", "--mesh", "pp=8"]),
        2,
        "--mesh pp=8 but the schedule has 4",
    );
    refused(
        &sim(&["--model", "llama3-8b", "--mesh", "ep=2"]),
        2,
        "the model is dense",
    );
    refused(
        &sim(&["--model", "dsv3", "--mesh", "ep=3,dp=3"]),
        2,
        "ep=3 does not divide the model's 256 routed experts",
    );
    refused(
        &sim(&["--model", "llama3-8b", "--hardware", "tpu9"]),
        2,
        "unknown hardware `tpu9`",
    );
    refused(
        &sim(&["--mesh", "tp=2"]),
        2,
        "--mesh describes the cluster of --model",
    );
    refused(
        &sim(&["--model", "llama3-8b", "--cost", "dsv3-h800"]),
        2,
        "give --cost or --model, not both",
    );
    let o = sim(&[
        "--model",
        "dsv3",
        "--layout",
        "Et*3|(t*4|)*14,t*2mL",
        "--mesh",
        "ep=4,dp=4",
    ]);
    // 61 layers over 4 stages: the layout names 16 stages.
    refused(&o, 2, "16 stage(s), but the schedule has 4 model chunk(s)");
}

#[test]
fn a_model_that_does_not_fit_exits_1_naming_the_rank() {
    let o = schedc(&[
        "sim",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--model",
        "llama3-70b",
        "--hardware",
        "h100",
    ]);
    refused(&o, 1, "does not fit this layout");
    assert!(stderr(&o).contains("rank 0 needs"), "{}", stderr(&o));
    // The report is still printed.
    assert!(String::from_utf8_lossy(&o.stdout).contains("does not fit"));
}

#[test]
fn a_missing_input_with_a_model_says_it_cannot_be_read() {
    let o = schedc(&[
        "sim",
        "specs/no-such.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--moe",
        "--model",
        "dsv3",
    ]);
    refused(&o, 2, "cannot read");
}

#[test]
fn a_hardware_file_with_a_measured_efficiency_replaces_the_fit() {
    let base = r#"name = "mygpu"
bf16_flops = 312e12
fp8_flops = 312e12
hbm_bytes = 80e9
hbm_bandwidth = 2.039e12
nvlink_bandwidth = 300e9
network_bandwidth = 25e9
gpus_per_node = 8
"#;
    let plain = tmp("gpu.toml", base);
    let tuned = tmp("gpu-tuned.toml", &format!("{base}gemm_efficiency = 0.88\n"));
    let step = |hw: &str| {
        let o = schedc(&[
            "sim",
            "specs/1f1b.sched",
            "--pp",
            "8",
            "--mb",
            "24",
            "--model",
            "zb-6.2b",
            "--hardware",
            hw,
            "--seq",
            "1024",
            "--micro-batch-size",
            "3",
            "--format",
            "json",
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["step_seconds"].as_f64().unwrap()
    };
    let (a, b) = (step(&plain), step(&tuned));
    // Twice the GEMM efficiency: GEMMs are most of the step, not all of it.
    assert!(b < 0.65 * a && b > 0.5 * a, "{a} {b}");
    let bad = tmp("gpu-bad.toml", &format!("{base}gemm_efficiency = 1.5\n"));
    let o = schedc(&[
        "sim",
        "specs/1f1b.sched",
        "--pp",
        "8",
        "--mb",
        "24",
        "--model",
        "zb-6.2b",
        "--hardware",
        &bad,
    ]);
    refused(&o, 2, "`gemm_efficiency` must be in (0, 1], got 1.5");
    let typo = tmp("gpu-typo.toml", &format!("{base}bf16_flop = 1\n"));
    let o = schedc(&[
        "sim",
        "specs/1f1b.sched",
        "--pp",
        "8",
        "--mb",
        "24",
        "--model",
        "zb-6.2b",
        "--hardware",
        &typo,
    ]);
    refused(&o, 2, "bf16_flop");
}

#[test]
fn optimize_with_a_model_writes_what_sim_with_the_model_gives() {
    let d = std::env::temp_dir().join(format!("schedc-model-opt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let f = d.join("o.ir");
    let fs = f.to_str().unwrap();
    let model = [
        "--model",
        "llama3-8b",
        "--hardware",
        "h100",
        "--mesh",
        "tp=2",
    ];
    let mut a = vec![
        "optimize",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-activations",
        "4",
        "--time-limit",
        "20",
        "--no-progress",
        "-o",
        fs,
        "--format",
        "json",
    ];
    a.extend(model);
    let o = schedc(&a);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let reported = j["makespan"].as_f64().unwrap();
    let mut s = vec!["sim", fs, "--format", "json"];
    s.extend(model);
    let o = schedc(&s);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let simulated = v["makespan"].as_f64().unwrap();
    assert!(
        (reported - simulated).abs() < 1e-9 * reported,
        "{reported} {simulated}"
    );
    // Shorter than the 1F1B it started from, under the same derived costs.
    let o = schedc(&[
        "sim",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--format",
        "json",
        "--model",
        "llama3-8b",
        "--hardware",
        "h100",
        "--mesh",
        "tp=2",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(reported < v["makespan"].as_f64().unwrap());
    // Without an input there is no one stage count to derive the costs for.
    let o = schedc(&[
        "optimize",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-activations",
        "4",
        "--model",
        "dsv3",
    ]);
    refused(&o, 2, "give an input schedule");
}

#[test]
fn break_it_round_on_the_cost_model() {
    let sim = |extra: &[&str]| {
        let mut a = vec!["sim", "specs/1f1b.sched", "--pp", "4", "--mb", "8"];
        a.extend(extra);
        schedc(&a)
    };
    // A layout's `m` must be one of the model's multi-token-prediction modules.
    refused(
        &sim(&["--model", "llama3-8b", "--layout", "Et*8|t*8|t*8|t*8mL"]),
        2,
        "places 1 multi-token-prediction module(s) (`m`), but the model has 0",
    );
    // --moe on a dense model says so.
    refused(
        &sim(&["--model", "llama3-8b", "--moe"]),
        2,
        "has no MoE layer",
    );
    // fp8 caches the dense GEMM inputs in fp8 too: less activation memory than bf16.
    let mem = |dtype: &str| {
        let o = sim(&["--model", "llama3-8b", "--dtype", dtype, "--format", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["peak_memory_bytes"].as_f64().unwrap()
    };
    assert!(mem("fp8") < mem("bf16"));
    // optimize --model refuses a schedule that does not fit the GPU (exit 1, after the report).
    let o = schedc(&[
        "optimize",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-activations",
        "4",
        "--model",
        "llama3-8b",
        "--hardware",
        "h100",
        "--attention",
        "eager",
        "--time-limit",
        "5",
        "--no-progress",
    ]);
    refused(&o, 1, "it does not fit this layout");
}

/// `--a2a flat` prices the one-level all-to-all that `run --a2a flat` executes (issue 23,
/// item 4). Qwen3-30B-A3B routes each token to 8 of 128 experts with no node limit; over an
/// EP group of 16 on two 8-GPU nodes, two-level dispatch crosses the network for
/// `2 (1 - 2^-8) (1/2) = 0.996` node copies per token, flat for `8 (1/2) = 4` expert copies:
/// the all-to-all time grows about 4x (latency aside), and so does the step.
#[test]
fn sim_prices_flat_all_to_all_against_the_two_level_one() {
    let run = |a2a: &str| {
        let o = schedc(&[
            "sim",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "8",
            "--moe",
            "--model",
            "qwen3-30b-a3b",
            "--mesh",
            "pp=2,ep=16,dp=16",
            "--a2a",
            a2a,
            "--format",
            "json",
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (
            v["step_seconds"].as_f64().unwrap(),
            v["a2a"]["total"].as_f64().unwrap(),
        )
    };
    let (step_h, a2a_h) = run("hierarchical");
    let (step_f, a2a_f) = run("flat");
    let ratio = a2a_f / a2a_h;
    assert!(
        ratio > 3.8 && ratio < 4.02,
        "flat / two-level all-to-all {ratio}"
    );
    assert!(step_f > 1.5 * step_h, "{step_f} vs {step_h}");
    refused(
        &schedc(&[
            "sim",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--model",
            "qwen3-30b-a3b",
            "--a2a",
            "ring",
        ]),
        2,
        "--a2a: `ring` is not flat or hierarchical",
    );
    refused(
        &schedc(&[
            "sim",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--a2a",
            "flat",
        ]),
        2,
        "--a2a describes the cluster of --model",
    );
}
