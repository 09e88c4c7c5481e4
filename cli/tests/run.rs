//! `schedc run` and `schedc compile` end to end (the CPU backend linked into `schedc`).

use std::process::Output;

mod common;
use common::*;

/// Asserts exit status 0, showing standard error otherwise.
fn assert_ok(out: &Output) {
    assert!(out.status.success(), "{}", stderr(out));
}

fn read_json(path: impl AsRef<std::path::Path>) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn run_verify_json() {
    let out = bin()
        .args([
            "run",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--steps",
            "2",
            "--verify",
            "--format",
            "json",
        ])
        .output()
        .unwrap();
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let err = v["max_rel_grad_err"].as_f64().unwrap();
    assert!(err < 1e-10, "{err}");
    assert!(v["max_abs_loss_err"].as_f64().unwrap() < 1e-10);
    assert_eq!(v["loss"].as_array().unwrap().len(), 2);
    assert_eq!(v["reference_loss"].as_array().unwrap().len(), 2);
}

#[test]
fn compile_writes_one_file_per_rank_and_a_manifest() {
    let dir = std::env::temp_dir().join(format!("schedc-cpu-compile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = bin()
        .args([
            "compile",
            "specs/zbv.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--mesh",
            "pp=2,ep=2",
            "-o",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert_ok(&out);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "manifest.json",
            "rank0.json",
            "rank1.json",
            "rank2.json",
            "rank3.json"
        ]
    );
    let manifest = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    assert!(
        manifest.contains("\"granularity\": \"model\""),
        "{manifest}"
    );
    // A second compile into the same directory is refused; nothing is overwritten.
    let out = bin()
        .args(["compile", "specs/zbv.sched", "--pp", "2", "--mb", "4", "-o"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn compile_at_stage_granularity() {
    let dir = std::env::temp_dir().join(format!("schedc-stage-compile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = bin()
        .args([
            "compile",
            "specs/dualpipe.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--granularity",
            "stage",
            "-o",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert_ok(&out);
    let m = read_json(dir.join("manifest.json"));
    assert_eq!(m["format_version"], 2);
    assert_eq!(m["granularity"], "stage");
    assert!(m.get("model").is_none());
    // DualPipe's mirror ranks sum their copies' gradients over one group.
    assert_eq!(m["groups"], serde_json::json!([[0, 1]]));
    let r0 = std::fs::read_to_string(dir.join("rank0.json")).unwrap();
    assert!(r0.contains("\"op\": \"overlap\""));
    assert!(r0.contains("\"op\": \"replica_sum\""));
    std::fs::remove_dir_all(&dir).unwrap();
    // An unknown granularity is bad usage.
    let out = bin()
        .args([
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "--granularity",
            "layer",
            "-o",
            "/nonexistent",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("layer"));
}

#[test]
fn bad_input_is_a_clear_error() {
    let out = bin()
        .args(["run", "specs/dualpipe.sched", "--pp", "3", "--mb", "8"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("even --pp"));
    let out = bin()
        .args([
            "run",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--mesh",
            "pp=2,ep=3",
        ])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(!stderr(&out).contains("panicked"));
}

#[test]
fn cuda_run_without_a_gpu_fails_cleanly() {
    // This machine has no CUDA driver (CI): the run must say so, with the cause, and exit
    // 2 (an environment error), never panic. On a GPU machine the same command trains.
    let probe = bin()
        .args([
            "run",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--backend",
            "cuda",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&probe.stderr);
    if probe.status.success() {
        println!("a GPU is present: the run trained");
        return;
    }
    assert_eq!(probe.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no CUDA driver") || err.contains("no CUDA device"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    println!("skipped the GPU run: {}", err.trim());
    for mode in [["--mode", "nccl"], ["--dtype", "bf16"]] {
        let out = bin()
            .args([
                "run",
                "specs/1f1b.sched",
                "--pp",
                "2",
                "--mb",
                "4",
                "--backend",
                "cuda",
            ])
            .args(mode)
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("no CUDA driver"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn cuda_flags_are_checked() {
    for (args, why) in [
        (vec!["--dtype", "f64", "--backend", "cuda"], "not f64"),
        (vec!["--dtype", "bf16"], "not bf16"),
        (vec!["--mode", "nccl"], "for --backend cuda"),
        (vec!["--backend", "cuda", "--rank", "0"], "for --mode nccl"),
        (
            vec!["--backend", "cuda", "--mode", "nccl", "--rank", "0"],
            "needs --rendezvous",
        ),
        (
            vec![
                "--backend",
                "cuda",
                "--mode",
                "nccl",
                "--rank",
                "0",
                "--rendezvous",
                "udp://x",
            ],
            "expected tcp://HOST:PORT or file:PATH",
        ),
    ] {
        let out = bin()
            .args(["run", "specs/1f1b.sched", "--pp", "2", "--mb", "4"])
            .args(&args)
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(why), "{args:?}: {err}");
    }
}

#[test]
fn compile_ptx_needs_cuda_and_nvrtc() {
    let dir = std::env::temp_dir().join(format!("schedc-ptx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = bin()
        .args([
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--ptx",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("need --backend cuda"));
    let out = bin()
        .args(["compile", "specs/1f1b.sched", "--pp", "2", "--mb", "4"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = bin()
        .args([
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--backend",
            "cuda",
            "--ptx",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let err = stderr(&out);
    if out.status.success() {
        // NVRTC is on the library path (the CI's NVRTC check sets it): every kernel's PTX.
        let n = std::fs::read_dir(&dir).unwrap().count();
        assert!(n >= 60, "{n} files");
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            assert!(
                std::fs::read_to_string(&p).unwrap().contains(".entry"),
                "{}",
                p.display()
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    } else {
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("NVRTC library cannot be loaded"), "{err}");
        println!("skipped the PTX check: no NVRTC on the library path here (.ci/run checks it)");
    }
}

#[test]
fn run_and_compile_moe_parts_with_a_trace() {
    let dir = std::env::temp_dir().join(format!("schedc-cpu-moe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.json");
    let args = [
        "run",
        "specs/dualpipev.sched",
        "--pp",
        "2",
        "--mb",
        "4",
        "--moe",
        "--mesh",
        "pp=2,ep=2",
        "--verify",
        "--format",
        "json",
        "--trace",
    ];
    let out = bin().args(args).arg(&trace).output().unwrap();
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let err = v["max_rel_grad_err"].as_f64().unwrap();
    assert!(err <= 1e-12, "{err}");
    assert!(v["max_rel_param_err"].as_f64().unwrap() <= 1e-12);
    let t = read_json(&trace);
    let ev = t["traceEvents"].as_array().unwrap();
    assert!(ev
        .iter()
        .any(|e| e["cat"] == "all_to_all" && e["name"].as_str().unwrap().contains("Dispatch")));
    assert!(ev
        .iter()
        .any(|e| e["ph"] == "M" && e["args"]["name"] == "ep"));
    // The trace is not overwritten without --force.
    let out = bin().args(args).arg(&trace).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--force"));
    // compile --moe: every rank program has the EP stream last.
    let progs = dir.join("programs");
    let out = bin()
        .args([
            "compile",
            "specs/dualpipe.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--moe",
            "--mesh",
            "pp=2,ep=2",
            "-o",
        ])
        .arg(&progs)
        .output()
        .unwrap();
    assert_ok(&out);
    let r0 = read_json(progs.join("rank0.json"));
    let streams = r0["streams"].as_array().unwrap();
    assert_eq!(streams.last().unwrap()["kind"], "ep");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_trace_is_refused_before_training_when_it_cannot_be_written() {
    let base = [
        "run",
        "specs/1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "2",
        "--backend",
        "cpu",
        "--steps",
        "1",
        "--trace",
    ];
    // `-` is standard output (the report then goes to standard error: breakit2 finding 21),
    // so no file named `-` appears.
    let out = bin().args(base).arg("-").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["traceEvents"].is_array());
    assert!(stderr(&out).contains("loss"), "{}", stderr(&out));
    assert!(!std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../-")).exists());
    // A missing directory is found before the run, which prints no loss.
    let out = bin()
        .args(base)
        .arg("/nonexistent-schedc-dir/t.json")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("does not exist"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("loss"));
}

/// `run --format json` reports a cost model it cannot use (unreadable, not TOML, an unknown
/// `--set` key, `--moe` without all-to-all times) as JSON on standard output, like its other
/// errors, with exit status 2; human mode prints it on standard error.
#[test]
fn run_json_reports_a_bad_cost_model_as_json() {
    let dir = std::env::temp_dir().join(format!("schedc-run-bad-cost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "F = [\n").unwrap();
    let missing = dir.join("missing.toml");
    let (bad, missing) = (bad.to_str().unwrap(), missing.to_str().unwrap());
    for (flags, says) in [
        (vec!["--cost", bad], "TOML parse error"),
        (vec!["--cost", missing], "cannot read cost model"),
        (vec!["--set", "frob=1"], "unknown cost key `frob`"),
        (
            vec!["--moe", "--cost", "unit"],
            "which has no [moe] section",
        ),
    ] {
        let mut args = vec!["run", "specs/1f1b.sched", "--pp", "2", "--mb", "2"];
        args.extend(&flags);
        let out = bin()
            .args(&args)
            .args(["--format", "json"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{flags:?}: not JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        assert_eq!(v["exit"], 2, "{v}");
        assert!(
            v["error"].as_str().is_some_and(|e| e.contains(says)),
            "{flags:?}: {v}"
        );
        let out = bin().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(out.stdout.is_empty());
        assert!(stderr(&out).contains(says), "{flags:?}: {}", stderr(&out));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 23: `run --mesh pp=2,tp=2 --verify` trains with tensor parallelism on the CPU
/// backend and equals sequential training; a TP size that does not divide the heads is
/// refused (exit 2) naming the dimension.
#[test]
fn run_tensor_parallel_equals_sequential_and_refuses_what_does_not_divide() {
    let args = |mesh: &str| {
        let mut c = bin();
        c.args([
            "run",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--steps",
            "2",
            "--verify",
            "--format",
            "json",
            "--mesh",
            mesh,
        ]);
        c.output().unwrap()
    };
    let out = args("pp=2,tp=2");
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["max_rel_grad_err"].as_f64().unwrap() < 1e-10, "{v}");
    assert!(v["max_abs_loss_err"].as_f64().unwrap() < 1e-10, "{v}");
    assert!(v["max_rel_param_err"].as_f64().unwrap() < 1e-10, "{v}");
    let out = args("pp=2,tp=8");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("tp=8 does not divide the model's attention heads (4)"),
        "{}",
        stderr(&out)
    );
}

/// Issue 23: `run --a2a hierarchical` at `--mesh pp=2,ep=8,node=4` with top-4 routing over 8
/// experts trains exactly like `--a2a flat` (same losses to the last bit) and reports
/// `a2a_bytes` by level: 4x fewer inter-node messages, about half the dispatch's inter-node
/// bytes. A node size that neither divides nor is a multiple of `ep` is refused (exit 2).
#[test]
fn run_hierarchical_all_to_all_reports_bytes_by_level() {
    let run = |a2a: &str, mesh: &str| {
        bin()
            .args([
                "run",
                "specs/1f1b.sched",
                "--pp",
                "2",
                "--mb",
                "2",
                "--experts",
                "8",
                "--top-k",
                "4",
                "--format",
                "json",
                "--a2a",
                a2a,
                "--mesh",
                mesh,
            ])
            .output()
            .unwrap()
    };
    let f = run("flat", "pp=2,ep=8,node=4");
    let h = run("hierarchical", "pp=2,ep=8,node=4");
    assert_ok(&f);
    assert_ok(&h);
    let f: serde_json::Value = serde_json::from_slice(&f.stdout).unwrap();
    let h: serde_json::Value = serde_json::from_slice(&h.stdout).unwrap();
    assert_eq!(f["loss"], h["loss"]);
    assert_eq!(
        (f["a2a"].as_str(), h["a2a"].as_str()),
        (Some("flat"), Some("hierarchical"))
    );
    let n = |v: &serde_json::Value, k: &str, l: &str| v[k][l].as_u64().unwrap();
    assert_eq!(
        n(&f, "a2a_messages", "inter_node"),
        4 * n(&h, "a2a_messages", "inter_node")
    );
    assert!(n(&h, "a2a_bytes", "inter_node") < n(&f, "a2a_bytes", "inter_node"));
    assert!(n(&h, "a2a_bytes", "intra_node") > n(&f, "a2a_bytes", "intra_node"));
    let d = |v: &serde_json::Value| v["dispatch_inter_node_bytes"].as_u64().unwrap() as f64;
    assert!(d(&f) / d(&h) > 1.5, "{} {}", d(&f), d(&h));
    let bad = run("hierarchical", "pp=2,ep=8,node=3");
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
    assert!(
        stderr(&bad).contains("node=3 does not divide the 16 ranks"),
        "{}",
        stderr(&bad)
    );
}

/// Issue 23: `run --sequence-parallel` (Megatron's sequence parallelism inside the TP
/// group) equals sequential training at `pp=2,tp=2` and with the mesh's `sp=2`; without a
/// TP group it is refused (exit 2) and says which `sp` is which.
#[test]
fn run_sequence_parallel_in_the_tp_group() {
    let run = |mesh: &str| {
        bin()
            .args([
                "run",
                "specs/1f1b.sched",
                "--pp",
                "2",
                "--mb",
                "2",
                "--steps",
                "2",
                "--verify",
                "--sequence-parallel",
                "--format",
                "json",
                "--mesh",
                mesh,
            ])
            .output()
            .unwrap()
    };
    for mesh in ["pp=2,tp=2", "pp=2,tp=2,sp=2"] {
        let out = run(mesh);
        assert_ok(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(
            v["max_rel_grad_err"].as_f64().unwrap() < 1e-10,
            "{mesh}: {v}"
        );
        assert!(
            v["max_rel_param_err"].as_f64().unwrap() < 1e-10,
            "{mesh}: {v}"
        );
        assert!(
            v["tp_bytes"]["intra_node"].as_u64().unwrap() > 0,
            "{mesh}: {v}"
        );
    }
    let out = run("pp=2,sp=2");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("it needs tp > 1") && stderr(&out).contains("the mesh's `sp`"),
        "{}",
        stderr(&out)
    );
}

/// Issue 23: `run --backend cuda --sequence-parallel` is no longer refused as a flag of the
/// CPU backend: the programs are lowered with Megatron sequence parallelism and verified
/// before the device is probed, so without a GPU the run gets as far as the probe (exit 2,
/// "no CUDA driver"), and a mesh without TP gets the lowering's reason (exit 2). On a GPU
/// the same command trains and `--verify` compares it with the sequential reference (on
/// the host shim: `sequence_parallel_run_equals_the_sequential_reference_as_verify_checks`
/// in backends/cuda/tests/equivalence.rs).
#[test]
fn cuda_run_sequence_parallel_reaches_the_device() {
    let run = |mesh: &str| {
        bin()
            .args([
                "run",
                "specs/1f1b.sched",
                "--pp",
                "2",
                "--mb",
                "4",
                "--steps",
                "2",
                "--backend",
                "cuda",
                "--verify",
                "--sequence-parallel",
                "--mesh",
                mesh,
            ])
            .output()
            .unwrap()
    };
    let out = run("pp=2,tp=2,sp=2");
    let err = stderr(&out);
    if out.status.success() {
        println!("a GPU is present: the run trained and verified");
    } else {
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("no CUDA driver") || err.contains("no CUDA device"),
            "{err}"
        );
        assert!(!err.contains("for --backend cpu"), "{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    let out = run("pp=2,sp=2");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("it needs tp > 1") && stderr(&out).contains("the mesh's `sp`"),
        "{}",
        stderr(&out)
    );
}

/// Issue 23: `run --node-limit M` (DeepSeek-V3's node-limited routing: each token's experts
/// on at most M of the nodes its EP group spans) at `--mesh pp=2,ep=8,node=4`, top-4 of 8:
/// `--verify` passes (the sequential reference routes under the same limit), hierarchical
/// equals flat, and the hierarchical dispatch crosses nodes less than without the limit. A
/// limit beyond the nodes, and the flag on the CUDA backend, are refused (exit 2).
#[test]
fn run_node_limited_routing() {
    let run = |extra: &[&str]| {
        let mut c = bin();
        c.args([
            "run",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "--experts",
            "8",
            "--top-k",
            "4",
            "--format",
            "json",
            "--mesh",
            "pp=2,ep=8,node=4",
        ]);
        c.args(extra).output().unwrap()
    };
    let json = |out: &Output| -> serde_json::Value {
        assert_ok(out);
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let f = json(&run(&["--node-limit", "1", "--a2a", "flat", "--verify"]));
    let h = json(&run(&["--node-limit", "1", "--a2a", "hierarchical"]));
    let free = json(&run(&["--a2a", "hierarchical"]));
    assert!(f["max_rel_grad_err"].as_f64().unwrap() < 1e-10, "{f}");
    assert_eq!(f["loss"], h["loss"]);
    assert_ne!(h["loss"], free["loss"]);
    let d = |v: &serde_json::Value| v["dispatch_inter_node_bytes"].as_u64().unwrap();
    assert!(d(&h) < d(&free), "{} {}", d(&h), d(&free));
    let bad = run(&["--node-limit", "3"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
    assert!(
        stderr(&bad).contains(
            "--node-limit: the EP group spans 2 node(s): model: a token's experts must come from 1 to 2 groups, got 3"
        ),
        "{}",
        stderr(&bad)
    );
    let cuda = bin()
        .args([
            "run",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "--backend",
            "cuda",
            "--node-limit",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(cuda.status.code(), Some(2), "{}", stderr(&cuda));
    assert!(
        stderr(&cuda).contains("--top-k and --node-limit are for --backend cpu"),
        "{}",
        stderr(&cuda)
    );
}

/// Issue 24: `--micro-batch-size 2` runs two sequences per micro-batch and equals the
/// sequential reference (`--verify`, f64); the step is 2x the tokens; `0` is refused, and
/// so is B > 1 with Megatron's `--sequence-parallel`; the help text says what B is.
#[test]
fn run_with_two_sequences_per_micro_batch_verifies() {
    let run = |extra: &[&str]| {
        bin()
            .args(["run", "specs/1f1b.sched", "--pp", "2", "--mb", "4"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&[
        "--micro-batch-size",
        "2",
        "--steps",
        "3",
        "--verify",
        "--format",
        "json",
    ]);
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (g, l) = (
        v["max_rel_grad_err"].as_f64().unwrap(),
        v["max_abs_loss_err"].as_f64().unwrap(),
    );
    println!("--micro-batch-size 2: grad {g:.2e} loss {l:.2e}");
    assert!(g < 1e-9 && l < 1e-9, "{g} {l}");
    assert_eq!(v["loss"].as_array().unwrap().len(), 3);
    // 4 micro-batches x 2 sequences x 32 tokens.
    assert_eq!(v["tokens_per_step"].as_u64(), Some(256), "{v}");
    let out = run(&["--micro-batch-size", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--micro-batch-size must be at least 1"));
    let out = run(&[
        "--micro-batch-size",
        "2",
        "--mesh",
        "pp=2,tp=2",
        "--sequence-parallel",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--micro-batch-size 2 with sequence parallelism"),
        "{}",
        stderr(&out)
    );
    let help = bin().args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    assert!(
        help.contains("Sequences per micro-batch B (default 1)"),
        "{help}"
    );
}
