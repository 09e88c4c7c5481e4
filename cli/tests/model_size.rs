//! Issue 24, item 1: `schedc run` and `schedc compile` with `--model` (a Hugging Face
//! config.json of a DeepSeek-V3-style model, or a preset), `--seq`, `--micro-batch-size`
//! and the memory check made before anything is allocated.

use std::process::{Command, Output};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_schedc"));
    c.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    c
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Hidden 256, 8 experts (top-2, hidden 128), MLA with 4 heads, 2 layers, byte vocabulary.
const SMALL: &str = r#"{"model_type":"deepseek_v3","hidden_size":256,"num_hidden_layers":2,
"intermediate_size":512,"moe_intermediate_size":128,"n_routed_experts":8,
"n_shared_experts":1,"num_experts_per_tok":2,"first_k_dense_replace":0,"moe_layer_freq":1,
"q_lora_rank":96,"kv_lora_rank":64,"qk_nope_head_dim":32,"qk_rope_head_dim":16,
"v_head_dim":32,"num_attention_heads":4,"vocab_size":256,"tie_word_embeddings":false}"#;

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("schedc-model-size-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn small_json(dir: &std::path::Path) -> String {
    let p = dir.join("small.json");
    std::fs::write(&p, SMALL).unwrap();
    p.display().to_string()
}

#[test]
fn run_model_config_json_trains_and_verifies_on_the_cpu() {
    let dir = tmp("run");
    let model = small_json(&dir);
    let out = bin()
        .args([
            "run",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "--model",
            &model,
        ])
        .args([
            "--seq", "256", "--dtype", "f32", "--verify", "--format", "json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tokens_per_step"], 512);
    assert_eq!(v["verify_passed"], true);
    let loss = v["loss"][0].as_f64().unwrap();
    // A fresh model's loss is near ln(256) = 5.55.
    assert!((5.3..5.9).contains(&loss), "{loss}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_dsv3_on_the_cpu_is_refused_by_the_memory_check_with_the_figures() {
    let t0 = std::time::Instant::now();
    let out = bin()
        .args([
            "run",
            "specs/1f1b.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--model",
            "dsv3",
        ])
        .args(["--memory-limit", "64G"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    // Nothing was allocated: the refusal takes no time.
    assert!(t0.elapsed().as_secs() < 10, "{:?}", t0.elapsed());
    let e = stderr(&out);
    assert!(
        e.contains("note: --model: `dsv3` has 61 layers; the executors give each of the 4 stages 16 (64 in all)"),
        "{e}"
    );
    assert!(
        e.contains("error: the model does not fit: the 4 rank(s) run here need 25.4 TiB together, more than --memory-limit (64.0 GiB); the largest, rank 0 needs 7.0 TiB (5.4 TiB of parameters, gradients and optimizer state, 1.6 TiB of activations and buffers)"),
        "{e}"
    );
}

#[test]
fn model_flags_that_cannot_be_used_are_refused() {
    let run = |extra: &[&str]| {
        let out = bin()
            .args(["run", "specs/1f1b.sched", "--pp", "2", "--mb", "2"])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", stderr(&out));
        stderr(&out)
    };
    let e = run(&["--model", "llama3-8b"]);
    assert!(
        e.contains("error: --model: `llama3-8b` (model_type `llama`) has grouped-query attention"),
        "{e}"
    );
    let e = run(&["--model", "no-such-model"]);
    assert!(
        e.contains("error: --model: unknown model `no-such-model`"),
        "{e}"
    );
    let e = run(&["--model", "dsv3", "--experts", "8"]);
    assert!(
        e.contains("--experts and --top-k change the small model"),
        "{e}"
    );
    let e = run(&["--micro-batch-size", "0"]);
    assert!(e.contains("--micro-batch-size must be at least 1"), "{e}");
    let e = run(&["--micro-batch-size", "2", "--mesh", "pp=2,sp=2"]);
    assert!(
        e.contains(
            "--micro-batch-size 2 with sequence parallelism (--mesh sp=2 / --sequence-parallel)"
        ),
        "{e}"
    );
    let e = run(&["--seq", "0"]);
    assert!(e.contains("--seq must be at least 1"), "{e}");
    let e = run(&["--memory-limit", "lots"]);
    assert!(e.contains("--memory-limit: invalid size `lots`"), "{e}");
    // A longer sequence than the built-in text: the data says so.
    let e = run(&["--seq", "4096"]);
    assert!(e.contains("fewer than one sequence of 4096"), "{e}");
}

#[test]
fn compile_model_writes_the_model_into_the_manifest() {
    let dir = tmp("compile");
    let model = small_json(&dir);
    let out_dir = dir.join("progs");
    let out = bin()
        .args([
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "--model",
            &model,
        ])
        .args(["--seq", "256", "-o"])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("manifest.json")).unwrap())
            .unwrap();
    let model = &m["model"];
    assert_eq!(model["hidden"], 256);
    assert_eq!(model["experts"], 8);
    assert_eq!(model["top_k"], 2);
    assert_eq!(model["seq_len"], 256);
    assert_eq!(model["layers_per_stage"], 1);
    assert_eq!(model["kv_lora_rank"], 64);
    let _ = std::fs::remove_dir_all(&dir);
}
