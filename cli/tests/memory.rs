//! Issue 27: memory ops through the CLI (`check`, `sim`).

mod common;
use common::*;

#[test]
fn check_rejects_a_backward_whose_activations_were_offloaded_and_never_reloaded() {
    let dir = std::env::temp_dir().join(format!("schedc-mem27-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("bad.ir");
    std::fs::write(
        &f,
        "pp 1\nstages 1\nmicrobatches 2\nrank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) BW(0,0)\n",
    )
    .unwrap();
    let o = schedc(&["check", f.to_str().unwrap(), "--format", "json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let d = &v["diagnostics"][0];
    assert_eq!(d["code"], "memory");
    assert_eq!(
        (d["rank"].as_u64(), d["position"].as_u64()),
        (Some(0), Some(4))
    );
    assert_eq!(
        d["message"],
        "rank 0 step 4: `BW(0,0)` reads the activations of F(0,0), offloaded at step 1 and never reloaded or recomputed"
    );
    assert_eq!(v["ranks"][0]["peak_host_activations"], 1);
    // With the reload before the backward: accepted.
    std::fs::write(
        &f,
        "pp 1\nstages 1\nmicrobatches 2\nrank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) RELOAD(0,0) BW(0,0)\n",
    )
    .unwrap();
    let o = schedc(&["check", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert!(stdout(&o).contains(
        "peak activations offloaded to the host, per rank: 1 (peak_act counts the device)\n"
    ));
}

#[test]
fn sim_of_1f1b_offload_with_a_memory_cost() {
    let sim = |copy: &str| {
        let set = format!("activation_bytes=1e9,offload={copy}");
        let o = schedc(&[
            "sim",
            "specs/1f1b_offload.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--set",
            &set,
            "--format",
            "json",
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let peaks: Vec<f64> = v["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["peak_activation_bytes"].as_f64().unwrap() / 1e9)
            .collect();
        (v["makespan"].as_f64().unwrap(), peaks)
    };
    // Copies of 1 s (a forward's time): each reload runs under the forward after the
    // backward that freed its slot, each offload under the next backward: half of 1F1B's
    // rank 0 (4 activations) at 1F1B's step (33 s).
    assert_eq!(sim("1"), (33.0, vec![2.0, 2.0, 2.0, 1.0]));
    // Copies of 2 s, longer than a forward: the offloads of the warmup fall behind (the
    // device holds all four at once) and each reload delays its backward by 1 s.
    assert_eq!(sim("2"), (38.0, vec![4.0, 3.0, 2.0, 1.0]));
}

/// Writes `text` to a fresh file in a temporary directory and returns its path.
fn spec_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("schedc-lend27-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join(name);
    std::fs::write(&f, text).unwrap();
    f
}

/// The first diagnostic of `check FILE --pp 2 --mb 1 --format json`, with the exit code.
fn first_diagnostic(f: &std::path::Path) -> (Option<i32>, serde_json::Value) {
    let o = schedc(&[
        "check",
        f.to_str().unwrap(),
        "--pp",
        "2",
        "--mb",
        "1",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    (o.status.code(), v["diagnostics"][0].clone())
}

#[test]
fn check_rejects_a_return_without_lend_naming_the_spec_line_rank_and_step() {
    let f = spec_file(
        "nolend.sched",
        "schedule \"bad\"\nvpp 1\nplacement loop\nrank r {\n    F(0, 0)\n    if r == 0 {\n        RETURN(0, 0) from 1 @ 1\n    } else {\n        RETURN(stage 0, 0) to 0 @ 1\n    }\n    BW(0, 0)\n}\n",
    );
    let (code, d) = first_diagnostic(&f);
    assert_eq!(code, Some(1));
    assert_eq!(d["code"], "memory");
    assert_eq!(
        d["message"],
        "rank 0 step 1: `RETURN(0,0<-1@1)` is not valid here: the activations of F(0,0) are already on the device"
    );
    assert!(
        d["location"]
            .as_str()
            .unwrap()
            .ends_with("nolend.sched:7:9"),
        "{d}"
    );
    assert_eq!(
        (d["rank"].as_u64(), d["position"].as_u64()),
        (Some(0), Some(1))
    );
}

#[test]
fn check_rejects_a_lend_to_a_rank_that_does_not_exist_and_to_itself() {
    for (name, peer, message) in [
        (
            "far.sched",
            9,
            "rank 0 step 1: LEND(0,0): rank 0 lends the stash to rank 9, which does not exist (the pipeline has ranks 0..1)",
        ),
        (
            "self.sched",
            0,
            "rank 0 step 1: LEND(0,0->0): rank 0 lends the stash of F(0,0) to itself; lend it to another rank (BPipe pairs rank r with rank P-1-r)",
        ),
    ] {
        let f = spec_file(
            name,
            &format!("schedule \"bad\"\nvpp 1\nplacement loop\nrank r {{\n    F(0, 0)\n    if r == 0 {{ LEND(0, 0) to {peer} @ 1 }}\n    BW(0, 0)\n}}\n"),
        );
        let (code, d) = first_diagnostic(&f);
        assert_eq!(code, Some(1), "{name}");
        assert_eq!(d["message"], message);
        assert!(
            d["location"].as_str().unwrap().ends_with(&format!("{name}:6:17")),
            "{d}"
        );
        // `sim` refuses it too, without a panic.
        let o = schedc(&["sim", f.to_str().unwrap(), "--pp", "2", "--mb", "1"]);
        assert_eq!(o.status.code(), Some(1), "{name}");
    }
}

#[test]
fn bpipe_passes_check_over_the_grid_with_its_expectations() {
    let o = schedc(&[
        "check",
        "specs/bpipe.sched",
        "--pp",
        "1..=8",
        "--mb",
        "1..=16",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("specs/bpipe.sched: 128 instances: 128 passed, 0 failed"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn sim_of_bpipe_moves_peak_bytes_from_the_first_ranks_to_their_partners_and_balances_them() {
    let peaks = |spec: &str| -> (f64, Vec<f64>) {
        let o = schedc(&[
            "sim",
            spec,
            "--pp",
            "4",
            "--mb",
            "8",
            "--set",
            "activation_bytes=1e9",
            "--format",
            "json",
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let p = v["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["peak_activation_bytes"].as_f64().unwrap() / 1e9)
            .collect();
        (v["makespan"].as_f64().unwrap(), p)
    };
    assert_eq!(peaks("specs/1f1b.sched"), (33.0, vec![4.0, 3.0, 2.0, 1.0]));
    assert_eq!(peaks("specs/bpipe.sched"), (33.0, vec![2.0, 2.0, 3.0, 3.0]));
}

#[test]
fn the_cpu_backend_runs_bpipe_equal_to_sequential_and_the_stage_runtime_lends_too() {
    let o = schedc(&[
        "run",
        "specs/bpipe.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--backend",
        "cpu",
        "--verify",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        stdout(&o)
            .contains("every gradient, loss and parameter equals sequential training's exactly"),
        "{}",
        stdout(&o)
    );
    // Issue 27: a runtime of the user's own stages (the torch runtime) lends the tensors
    // autograd saved: the program sends the stash to the partner on channel 1 (after the
    // forward) and gets it back (before the backward), each receive waiting for the compute
    // stream to reach it (backends/torch/test_runtime.py runs it against sequential training).
    let dir = std::env::temp_dir().join(format!("schedc-lend27-stage-{}", std::process::id()));
    let o = schedc(&[
        "compile",
        "specs/bpipe.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--granularity",
        "stage",
        "-o",
        dir.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(0), "{err}");
    let rank0: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rank0.json")).unwrap()).unwrap();
    let ch1 = rank0["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["kind"]["comm"]["channel"] == 1)
        .expect("rank 0 has a stream for channel 1");
    let msgs: Vec<String> = ch1["ops"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["op"] == "send" || o["op"] == "recv")
        .map(|o| {
            format!(
                "{} {} {}",
                o["op"].as_str().unwrap(),
                o["buf"]["mb"],
                o["peer"]
            )
        })
        .collect();
    // Lends of F(0,1..6) to rank 3, each back before its backward.
    assert_eq!(
        msgs[..5],
        ["send 1 3", "send 2 3", "recv 1 3", "send 3 3", "recv 2 3"],
        "{msgs:?}"
    );
    assert_eq!(msgs.len(), 12, "{msgs:?}");
    // Each RETURN's receive waits for the compute stream to reach it (after the backward
    // that frees a slot), so that a stash back early does not raise the owner's peak.
    let ops = ch1["ops"].as_array().unwrap();
    for (i, o) in ops.iter().enumerate() {
        if o["op"] == "recv" {
            assert_eq!(ops[i - 1]["op"], "wait", "op #{i} {o}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The model-level cost model (`--model`) prices a lent stash on the pipeline link with its
/// own bytes (`latency + activation_bytes / bandwidth`), not as an activation message: at
/// tp=8 the pairs talk over the 50 GB/s network and rank 1's returns (2.8 GB each) come back
/// late, so bpipe's step is a little longer than 1F1B's (it was equal when a stash cost as
/// much as a 67 MB activation message).
#[test]
fn model_level_sim_prices_a_lent_stash_with_its_bytes() {
    let run = |spec: &str| -> (f64, Vec<f64>) {
        let o = schedc(&[
            "sim",
            spec,
            "--pp",
            "4",
            "--mb",
            "8",
            "--model",
            "llama3-70b",
            "--hardware",
            "h100",
            "--mesh",
            "tp=8,pp=4,dp=1",
            "--format",
            "json",
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let peaks = v["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["peak_activation_bytes"].as_f64().unwrap() / 1e7).round() / 100.0)
            .collect();
        (v["makespan"].as_f64().unwrap(), peaks)
    };
    let (t1, p1) = run("specs/1f1b.sched");
    let (tb, pb) = run("specs/bpipe.sched");
    assert_eq!(p1, vec![11.25, 8.44, 5.63, 3.09]);
    assert_eq!(pb, vec![11.25, 8.44, 8.44, 8.72]);
    assert_eq!(((t1 * 1e4).round(), (tb * 1e4).round()), (18292.0, 18316.0));
}

/// Issue 27: a checkpointed forward `F(0)!` whose backward has no `RECOMPUTE` before it is
/// rejected by `check` (exit 1), at the backward's line of the spec, saying what to add.
#[test]
fn check_rejects_a_checkpointed_forward_never_recomputed_at_its_spec_line() {
    let dir = std::env::temp_dir().join(format!("schedc-ckpt27-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("bad.sched");
    std::fs::write(
        &f,
        "schedule \"ckpt\"\nvpp 1\nplacement loop\nrank r {\n    F(0, 0)!\n    F(0, 1)!\n    RECOMPUTE(0, 1)\n    BW(0, 1)\n    BW(0, 0)\n}\n",
    )
    .unwrap();
    let o = schedc(&[
        "check",
        f.to_str().unwrap(),
        "--pp",
        "1",
        "--mb",
        "2",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let d = &v["diagnostics"][0];
    assert_eq!(d["code"], "memory");
    assert_eq!(
        d["message"],
        "rank 0 step 4: `BW(0,0)` reads the activations of F(0,0), checkpointed at step 0 (`F(0,0)!` saves only its input) and never recomputed"
    );
    assert!(
        d["location"].as_str().unwrap().ends_with("bad.sched:9:5"),
        "{d}"
    );
    // The IR text round-trips the mark.
    let o = schedc(&[
        "convert",
        "specs/1f1b_recompute.sched",
        "--pp",
        "4",
        "--mb",
        "4",
        "--to",
        "ir-text",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("F(0,0)! F(0,1)! F(0,2)! F(0,3)! RECOMPUTE(0,0)"),
        "{}",
        stdout(&o)
    );
}

/// `ARGS --format json`: the exit code and the parsed standard output.
fn json(args: &[&str]) -> (Option<i32>, serde_json::Value) {
    let mut a = args.to_vec();
    a.extend(["--format", "json"]);
    let o = schedc(&a);
    let v = serde_json::from_str(&stdout(&o))
        .unwrap_or_else(|e| panic!("{e}: {} {}", stdout(&o), stderr(&o)));
    (o.status.code(), v)
}

const ONE_F_ONE_B: [&str; 6] = ["specs/1f1b.sched", "--pp", "4", "--mb", "8", "--cost"];

#[test]
fn max_memory_rejects_the_rank_over_the_cap_naming_its_peak_and_the_cap() {
    // 1F1B at P = 4, M = 8 holds 4, 3, 2, 1 activations of 1 GB: rank 0 peaks at 4 GB.
    let msg = "rank 0 needs 3.7 GiB of device memory at its peak (4000000000 bytes), over the --max-memory cap of 3.5 GiB (3758096384 bytes)";
    let mut check = vec!["check"];
    check.extend(ONE_F_ONE_B);
    check.extend(["activation_bytes=1e9", "--max-memory", "3.5G"]);
    let (code, v) = json(&check);
    assert_eq!(code, Some(1));
    assert_eq!(v["verdict"], "rejected");
    let d = &v["diagnostics"].as_array().unwrap();
    assert_eq!(d.len(), 1, "only rank 0 is over: {d:?}");
    assert_eq!(
        (d[0]["code"].as_str(), d[0]["rank"].as_u64()),
        (Some("memory"), Some(0))
    );
    assert_eq!(d[0]["message"], msg);
    // Human output says the same.
    let o = schedc(&check);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stdout(&o).contains("rank 0 needs 3.7 GiB of device memory"),
        "{}",
        stdout(&o)
    );
    // `sim` rejects it after the report (exit 1), in its JSON and on standard error.
    let mut sim = check.clone();
    sim[0] = "sim";
    let (code, v) = json(&sim);
    assert_eq!(code, Some(1));
    assert_eq!(v["errors"][0]["message"], msg);
    assert_eq!(v["ranks"][0]["peak_memory_bytes"], 4e9);
    let o = schedc(&sim);
    assert_eq!(o.status.code(), Some(1));
    // (The rendering wraps the message.)
    for part in [
        "rank 0 needs 3.7 GiB of device memory",
        "cap",
        "(3758096384 bytes)",
    ] {
        assert!(stderr(&o).contains(part), "{}", stderr(&o));
    }
    assert!(
        stdout(&o).contains("makespan 33.000000 s"),
        "the report comes first"
    );
    // A cap equal to the peak holds (4e9 bytes), and 80G, 80GB, 80GiB are the same cap.
    for cap in ["4000000000", "80G", "80GB", "80GiB"] {
        let mut ok = check.clone();
        *ok.last_mut().unwrap() = cap;
        assert_eq!(schedc(&ok).status.code(), Some(0), "--max-memory {cap}");
    }
    let mut big = vec!["check"];
    big.extend(ONE_F_ONE_B);
    big.extend(["activation_bytes=1e11", "--max-memory", "80GiB"]);
    let (code, v) = json(&big);
    assert_eq!(code, Some(1));
    assert_eq!(
        v["diagnostics"][0]["message"],
        "rank 0 needs 372.5 GiB of device memory at its peak (400000000000 bytes), over the --max-memory cap of 80.0 GiB (85899345920 bytes)"
    );
}

#[test]
fn max_memory_without_memory_sizes_is_refused() {
    let says = "--max-memory needs memory sizes, but the cost model has none";
    for cmd in ["check", "sim"] {
        let o = schedc(&[
            cmd,
            "specs/1f1b.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--max-memory",
            "80G",
        ]);
        assert_refused(&o, says);
    }
    let o = schedc(&[
        "check",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-memory",
        "8X",
    ]);
    assert_refused(&o, "invalid size `8X`");
}

#[test]
fn host_budget_rejects_the_offload_that_goes_over_it_at_its_spec_line() {
    let msg = "rank 0 step 5: OFFLOAD(0,2) needs 1.0 GB of host memory, 2.0 GB already offloaded, over the host budget of 2.5 GB";
    let base = ["specs/1f1b_offload.sched", "--pp", "4", "--mb", "8"];
    let mut check = vec!["check"];
    check.extend(base);
    check.extend([
        "--cost",
        "activation_bytes=1e9",
        "--set",
        "host_bytes=2.5e9",
    ]);
    let (code, v) = json(&check);
    assert_eq!(code, Some(1));
    let d = v["diagnostics"].as_array().unwrap();
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0]["message"], msg);
    assert_eq!(d[0]["location"], "specs/1f1b_offload.sched:24:13");
    assert_eq!(
        (d[0]["rank"].as_u64(), d[0]["position"].as_u64()),
        (Some(0), Some(5))
    );
    // `sim` with the key in a cost file's [memory] section.
    let dir = tmpdir("host-budget");
    let f = dir.join("cost.toml");
    std::fs::write(&f, "[memory]\nactivation_bytes = 1e9\nhost_bytes = 2.5e9\n").unwrap();
    let mut sim = vec!["sim"];
    sim.extend(base);
    sim.extend(["--cost", f.to_str().unwrap()]);
    let o = schedc(&sim);
    assert_eq!(o.status.code(), Some(1));
    for part in [
        "rank 0 step 5: OFFLOAD(0,2) needs 1.0 GB of host memory",
        "host budget of 2.5 GB",
        "specs/1f1b_offload.sched:24:13",
    ] {
        assert!(stderr(&o).contains(part), "{}", stderr(&o));
    }
    assert!(
        stdout(&o).contains(
            "peak host memory (GB, offloaded activations), per rank: 3.00 2.00 0.00 0.00\n"
        ),
        "{}",
        stdout(&o)
    );
    let (code, v) = json(&sim);
    assert_eq!(code, Some(1));
    assert_eq!(v["errors"][0]["message"], msg);
    assert_eq!(v["errors"][0]["location"], "specs/1f1b_offload.sched:24:13");
    // 3 GB holds every rank's peak; 0 (the default) is unlimited.
    for budget in ["host_bytes=3e9", "host_bytes=0"] {
        let mut ok = vec!["sim"];
        ok.extend(base);
        ok.extend(["--cost", f.to_str().unwrap(), "--set", budget]);
        let (code, v) = json(&ok);
        assert_eq!(code, Some(0), "{budget}");
        let host: Vec<f64> = v["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["peak_host_bytes"].as_f64().unwrap())
            .collect();
        assert_eq!(host, vec![3e9, 2e9, 0.0, 0.0]);
        assert!(v.get("errors").is_none());
    }
}

#[test]
fn max_memory_applies_to_model_derived_sizes_and_host_budget_to_a_sweep() {
    // --model derives the sizes: llama3-8b under 1F1B at P = 4, M = 8 peaks at 59.1 GB on
    // rank 0; a 50 GiB cap rejects rank 0 only.
    let (code, v) = json(&[
        "sim",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--model",
        "llama3-8b",
        "--max-memory",
        "50GiB",
    ]);
    assert_eq!(code, Some(1));
    let errs = v["errors"].as_array().unwrap();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(
        errs[0]["message"],
        "rank 0 needs 55.1 GiB of device memory at its peak (59134574592 bytes), over the --max-memory cap of 50.0 GiB (53687091200 bytes)"
    );
    // A sweep checks the host budget on every instance.
    let o = schedc(&[
        "check",
        "specs/1f1b_offload.sched",
        "--pp",
        "3..=4",
        "--mb",
        "8",
        "--cost",
        "activation_bytes=1e9",
        "--set",
        "host_bytes=2.5e9",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stdout(&o),
        "FAIL --pp 4 --mb 8: [memory] rank 0 step 5: OFFLOAD(0,2) needs 1.0 GB of host memory, 2.0 GB already offloaded, over the host budget of 2.5 GB\n\
         specs/1f1b_offload.sched: 2 instances: 1 passed, 1 failed, 0 outside the family (refused by `require`)\n"
    );
}

/// Newcomer round 4, finding 1: an OFFLOAD after a split B moves only what the W still needs
/// (`released_at_b` of the activation was freed by the B), in the device peak, the host peak,
/// the copy time and the host budget.
#[test]
fn sim_offload_after_a_split_b_moves_only_what_w_still_needs() {
    let f = spec_file(
        "offB.ir",
        "pp 1\nrank 0: F(0,0) B(0,0) OFFLOAD(0,0) F(0,1) F(0,2) B(0,1) W(0,1) B(0,2) W(0,2) RELOAD(0,0) W(0,0)\n",
    );
    let set = "activation_bytes=1e9,released_at_b=0.5,pcie_bandwidth=1e9";
    let (code, v) = json(&["sim", f.to_str().unwrap(), "--set", set]);
    assert_eq!(code, Some(0), "{v}");
    let r0 = &v["ranks"][0];
    // Two whole stashes (F(0,1), F(0,2)) at once; half of F(0,0)'s went to the host.
    assert_eq!(r0["peak_activation_bytes"], 2e9);
    assert_eq!(r0["peak_host_bytes"], 5e8);
    // The 0.5 GB reload takes 0.5 s at 1 GB/s; the last W waits for it.
    assert_eq!(v["makespan"], 9.5);
    // A host budget of 0.6 GB holds that half; 0.4 GB does not.
    let ok = format!("{set},host_bytes=0.6e9");
    let (code, _) = json(&["sim", f.to_str().unwrap(), "--set", &ok]);
    assert_eq!(code, Some(0));
    let small = format!("{set},host_bytes=0.4e9");
    let (code, v) = json(&["sim", f.to_str().unwrap(), "--set", &small]);
    assert_eq!(code, Some(1), "{v}");
}

/// Newcomer round 4, finding 2: a copy or message time that overflows the step gave
/// `makespan 0.000000 s` and exit 0; now refused as an unusable cost model (exit 2).
#[test]
fn overflowing_copy_and_message_times_are_refused_not_a_zero_makespan() {
    for (spec, set) in [
        ("specs/1f1b.sched", "latency=1e308"),
        (
            "specs/1f1b_offload.sched",
            "activation_bytes=1e9,pcie_bandwidth=1e-300",
        ),
        ("specs/1f1b_offload.sched", "offload=1e308,reload=1e308"),
    ] {
        let o = schedc(&["sim", spec, "--pp", "4", "--mb", "8", "--set", set]);
        assert_eq!(o.status.code(), Some(2), "{spec} {set}: {}", stdout(&o));
        let e = stderr(&o);
        assert!(
            e.contains("the simulated step does not end in finite time")
                || e.contains("their sums overflow"),
            "{spec} {set}: {e}"
        );
        assert!(!stdout(&o).contains("makespan"), "{spec} {set}");
    }
}

/// Newcomer round 4, finding 3: a LEND after an OFFLOAD and a RELOAD passed `check` but the
/// lowering sent the stash unordered with the copy stream's reload (run failed with a race);
/// the send now waits for the reload. A stash lent twice in a step (around a split B/W) is a
/// valid schedule the executors do not run: exit 2 "unsupported", not 1 "does not verify".
#[test]
fn a_lend_after_a_reload_runs_and_a_stash_lent_twice_is_unsupported() {
    let f = spec_file(
        "lend_off.ir",
        "pp 2\nrank 0: F(0,0) OFFLOAD(0,0) RELOAD(0,0) LEND(0,0->1@1) SA(0,0->1) RG(1,0<-1) RETURN(0,0<-1@1) BW(0,0)\nrank 1: LEND(0,0<-0@1) RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0) RETURN(0,0->0@1)\n",
    );
    let o = schedc(&["run", f.to_str().unwrap(), "--backend", "cpu", "--verify"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o)
            .contains("every gradient, loss and parameter equals sequential training's exactly"),
        "{}",
        stdout(&o)
    );
    let f = spec_file(
        "lend_twice.ir",
        "pp 3\nrank 0: F(0,0) LEND(0,0->1@1) SA(0,0->1) RG(1,0<-1) RETURN(0,0<-1@1) B(0,0) LEND(0,0->1@1) RETURN(0,0<-1@1) W(0,0)\nrank 1: LEND(0,0<-0@1) RA(0,0<-0) F(1,0) SA(1,0->2) RG(2,0<-2) BW(1,0) SG(1,0->0) RETURN(0,0->0@1) LEND(0,0<-0@1) RETURN(0,0->0@1)\nrank 2: RA(1,0<-1) F(2,0) BW(2,0) SG(2,0->1)\n",
    );
    assert_eq!(
        schedc(&["check", f.to_str().unwrap()]).status.code(),
        Some(0)
    );
    let o = schedc(&["run", f.to_str().unwrap(), "--backend", "cpu"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o).trim_end(),
        "error: unsupported: rank 0: `LEND(0,0->1@1)`: the stash of F(0,0) is sent twice by this rank; the executors move a stash to its holder and back once per step"
    );
}

/// Newcomer round 4, finding 5: `compile` reported BPipe's peak stashes as 1F1B's ([4, 3, 2,
/// 1]: a stash lent to the partner rank was still counted on its owner and not on its
/// holder) and the `--memory-limit` estimate of bpipe equalled 1F1B's. Both now use the
/// checker's count: [2, 2, 3, 3], the largest rank of bpipe needs 3/4 of 1F1B's rank 0.
#[test]
fn compile_and_the_memory_estimate_count_a_lent_stash_on_its_holder() {
    let out = tmpdir("bpipe-compile");
    let o = schedc(&[
        "compile",
        "specs/bpipe.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).ends_with("peak activations per rank [2, 2, 3, 3])\n"),
        "{}",
        stdout(&o)
    );
    let need = |spec: &str| {
        let o = schedc(&[
            "run",
            spec,
            "--pp",
            "4",
            "--mb",
            "8",
            "--backend",
            "cpu",
            "--seq",
            "400",
            "--memory-limit",
            "1M",
        ]);
        assert_eq!(o.status.code(), Some(2), "{spec}: {}", stderr(&o));
        stderr(&o)
    };
    let a = need("specs/1f1b.sched");
    let b = need("specs/bpipe.sched");
    assert!(a.contains("the largest, rank 0 needs 31.4 MiB (903.2 KiB of parameters, gradients and optimizer state, 30.5 MiB of activations and buffers)"), "{a}");
    assert!(b.contains("the largest, rank 3 needs 27.0 MiB (904.2 KiB of parameters, gradients and optimizer state, 26.1 MiB of activations and buffers)"), "{b}");
}

/// Newcomer round 4, finding 7: a host budget without activation sizes was silently ignored
/// (every offload held 0 bytes); now refused as `--max-memory` without sizes is (exit 2).
#[test]
fn a_host_budget_without_activation_sizes_is_refused() {
    for cmd in ["check", "sim"] {
        let o = schedc(&[
            cmd,
            "specs/1f1b_offload.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--set",
            "host_bytes=1",
        ]);
        assert_eq!(o.status.code(), Some(2), "{cmd}");
        assert_eq!(
            stderr(&o).trim_end(),
            "error: [memory] host_bytes is a budget for offloaded activations, but the cost model gives them no size ([memory] activation_bytes is 0): give it with --cost FILE or --set activation_bytes=BYTES (or derive it with `sim --model`)"
        );
    }
}

/// Newcomer round 4, finding 9: sizes in exponent notation are accepted like suffixed ones,
/// 0 says what is wrong with it, and a cap given in binary units (`43G` = 43 x 2^30) is
/// printed in them with the peak, the rank named once.
#[test]
fn max_memory_takes_exponents_refuses_zero_plainly_and_prints_binary_units() {
    let base = [
        "check",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--set",
        "activation_bytes=20e9",
    ];
    let o = schedc(&[&base[..], &["--max-memory", "43G"]].concat());
    assert_eq!(o.status.code(), Some(1));
    let e = stdout(&o) + &stderr(&o);
    assert!(
        e.contains("rank 1 needs 55.9 GiB of device memory at its peak (60000000000 bytes), over the --max-memory")
            && e.contains("cap of 43.0 GiB (46170898432 bytes)\n"),
        "{e}"
    );
    assert!(!e.contains("(rank 1)"), "{e}");
    // 3.5e11 bytes hold every rank (peak 80 GB); 1.5e10 holds none.
    let o = schedc(&[&base[..], &["--max-memory", "3.5e11"]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = schedc(&[&base[..], &["--max-memory", "1.5e10"]].concat());
    assert_eq!(o.status.code(), Some(1));
    let o = schedc(&[&base[..], &["--max-memory", "0"]].concat());
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("invalid size `0`: must be at least 1 byte"),
        "{}",
        stderr(&o)
    );
}

/// Newcomer round 4, finding 12: IR JSON with an unknown field (`"bytes"` in a memory op)
/// was accepted silently (the TOML cost files refuse theirs); now a syntax error naming the
/// field and its position (exit 2).
#[test]
fn ir_json_with_an_unknown_field_is_refused() {
    let f = spec_file(
        "extra.json",
        r#"{"pipeline": {"pp": 1, "stages": 1, "microbatches": 1, "placement": "loop", "stage_to_rank": [0]}, "ranks": [[{"Compute": {"kind": "F", "stage": 0, "mb": 0}}, {"Mem": {"kind": "offload", "stage": 0, "mb": 0, "bytes": 5}}, {"Mem": {"kind": "reload", "stage": 0, "mb": 0}}, {"Compute": {"kind": "BW", "stage": 0, "mb": 0}}]]}"#,
    );
    let o = schedc(&["check", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("unknown field `bytes`, expected one of `kind`, `stage`, `mb`"),
        "{}",
        stderr(&o)
    );
    // Without it: accepted.
    let text = std::fs::read_to_string(&f)
        .unwrap()
        .replace(", \"bytes\": 5", "");
    std::fs::write(&f, text).unwrap();
    assert_eq!(
        schedc(&["check", f.to_str().unwrap()]).status.code(),
        Some(0)
    );
}

/// Newcomer round 4, finding 11: rank 0 lends F(0,0) to rank 1 and takes it back from rank
/// 2: only rank 2's "RETURN without LEND" was reported. Now also the owner's receive from
/// the wrong rank and the holder that never returns the stash.
#[test]
fn a_return_from_the_wrong_rank_is_reported_on_all_three_ranks() {
    let f = spec_file(
        "ret_wrong.ir",
        "pp 3\nrank 0: F(0,0) LEND(0,0->1@1) SA(0,0->1) RETURN(0,0<-2@1) RG(1,0<-1) BW(0,0)\nrank 1: LEND(0,0<-0@1) RA(0,0<-0) F(1,0) SA(1,0->2) RG(2,0<-2) BW(1,0) SG(1,0->0)\nrank 2: RA(1,0<-1) F(2,0) BW(2,0) SG(2,0->1) RETURN(0,0->0@1)\n",
    );
    let (code, v) = json(&["check", f.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    let msgs: Vec<&str> = v["diagnostics"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["code"] == "memory")
        .map(|d| d["message"].as_str().unwrap())
        .collect();
    assert_eq!(
        msgs,
        vec![
            "rank 0 step 3: `RETURN(0,0<-2@1)` receives the activations of F(0,0) back from rank 2, but they were lent to rank 1 at step 1",
            "rank 1 step 0: `LEND(0,0<-0@1)` is not valid here: the activations of F(0,0) are held here and never returned to their owner (LEND without RETURN)",
            "rank 2 step 4: `RETURN(0,0->0@1)` is not valid here: the activations of F(0,0) are not held by this rank: no LEND of them was received before it (RETURN without LEND)",
        ]
    );
}

// ---- issue 27: compare --max-memory ----

#[test]
fn compare_max_memory_marks_the_rows_over_the_cap_and_keeps_exit_0() {
    let args = [
        "compare",
        "specs/1f1b.sched",
        "specs/1f1b_offload.sched",
        "specs/1f1b_recompute.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--set",
        "activation_bytes=1e9,offload=1",
        "--max-memory",
        "2500000000",
    ];
    let mut j = args.to_vec();
    j.extend(["--format", "json"]);
    let o = schedc(&j);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["max_memory"], 2500000000u64);
    let got: Vec<(String, f64, bool)> = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["schedule"].as_str().unwrap().to_string(),
                r["figures"]["peak_memory_bytes"].as_f64().unwrap(),
                r["figures"]["fits_max_memory"].as_bool().unwrap(),
            )
        })
        .collect();
    // 1F1B holds 4 activations on rank 0; 1f1b_offload and 1f1b_recompute 2.
    assert_eq!(
        got,
        vec![
            ("1f1b".to_string(), 4e9, false),
            ("1f1b_offload".to_string(), 2e9, true),
            ("1f1b_recompute".to_string(), 2e9, true),
        ]
    );
    let o = schedc(&args);
    assert_eq!(o.status.code(), Some(0));
    let out = stdout(&o);
    assert!(out.contains("\n1f1b (over)  "), "{out}");
    assert!(out.contains("\n1f1b_recompute  "), "{out}");
    assert!(out.contains("\n(over) over --max-memory 2500000000 bytes (2.50 GB) per rank (simulated peak device memory, or [memory] host_bytes overflowed): 1f1b (4.00 GB)\n"), "{out}");
    // Without memory sizes the cap would hold vacuously: refused.
    let o = schedc(&[
        "compare",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-memory",
        "80G",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("--max-memory needs memory sizes"),
        "{}",
        stderr(&o)
    );
}

/// `convert SPEC --pp P --mb M --to ir-text`: the program's rank lines.
fn rank_lines(spec: &str, pp: &str, mb: &str, extra: &[&str]) -> Vec<String> {
    let mut a = vec!["convert", spec, "--pp", pp, "--mb", mb, "--to", "ir-text"];
    a.extend_from_slice(extra);
    let o = schedc(&a);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    stdout(&o)
        .lines()
        .filter(|l| l.starts_with("rank "))
        .map(str::to_string)
        .collect()
}

/// Per-rank `peak_act` of `check ARGS --format json` (which must accept).
fn peaks(args: &[&str]) -> Vec<u64> {
    let (code, v) = json(args);
    assert_eq!(code, Some(0), "{v}");
    v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["peak_activations"].as_u64().unwrap())
        .collect()
}

/// Issue 27, item 3: a `list` block under `memory <= 2` with 1F1B's priorities stalls today
/// (`memory wait`, the default: 51 s at unit op times); `memory offload` and `memory
/// recompute` make room instead, pass `check --max-activations 2`, and run shorter under
/// `sim` (offload: 33 s with 1 s copies, an offload and a reload running at once on the
/// two directions of the host link, and with 0.5 s copies; recompute: 35 s, each recompute
/// charged as a forward; 1F1B without a cap: 33 s).
#[test]
fn list_memory_rule_offloads_or_recomputes_instead_of_waiting_at_the_cap() {
    let spec = |p: &str| format!("tests/data/list_1f1b_cap_{p}.sched");
    for (policy, makespan) in [("wait", 51.0), ("offload", 33.0), ("recompute", 35.0)] {
        let f = spec(policy);
        let args = [
            "check",
            &f,
            "--pp",
            "4",
            "--mb",
            "8",
            "--max-activations",
            "2",
        ];
        assert_eq!(peaks(&args), vec![2, 2, 2, 1], "{policy}");
        let (code, v) = json(&[
            "sim",
            &f,
            "--pp",
            "4",
            "--mb",
            "8",
            "--set",
            "activation_bytes=1e9,offload=1",
        ]);
        assert_eq!(code, Some(0), "{v}");
        assert_eq!(v["makespan"], makespan, "{policy}");
    }
    // With 0.5 s copies, the offloads and reloads hide under the compute: 1F1B's 33 s.
    let (code, v) = json(&[
        "sim",
        &spec("offload"),
        "--pp",
        "4",
        "--mb",
        "8",
        "--set",
        "activation_bytes=1e9,offload=0.5",
    ]);
    assert_eq!((code, v["makespan"].as_f64()), (Some(0), Some(33.0)));
    let (code, v) = json(&[
        "sim",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--set",
        "activation_bytes=1e9,offload=1",
    ]);
    assert_eq!((code, v["makespan"].as_f64()), (Some(0), Some(33.0)));
    // Waiting: no memory op. Offloading: the activation whose backward comes last (for a
    // reload, not the forward just run), reloaded one op ahead of its backward with the
    // offload that makes room for it; the last ranks (at most 2 in flight) run plain 1F1B.
    let wait = rank_lines(&spec("wait"), "4", "8", &[]);
    assert!(wait
        .iter()
        .all(|l| !l.contains("OFFLOAD") && !l.contains('!')));
    let off = rank_lines(&spec("offload"), "4", "8", &[]);
    assert_eq!(
        off[0],
        "rank 0: F(0,0) F(0,1) OFFLOAD(0,1) F(0,2) OFFLOAD(0,2) F(0,3) BW(0,0) OFFLOAD(0,3) \
         RELOAD(0,1) F(0,4) BW(0,1) OFFLOAD(0,4) RELOAD(0,2) F(0,5) BW(0,2) OFFLOAD(0,5) \
         RELOAD(0,3) F(0,6) BW(0,3) OFFLOAD(0,6) RELOAD(0,4) F(0,7) BW(0,4) RELOAD(0,5) BW(0,5) \
         RELOAD(0,6) BW(0,6) BW(0,7)"
    );
    assert_eq!(
        off[2],
        "rank 2: F(2,0) F(2,1) BW(2,0) F(2,2) BW(2,1) F(2,3) BW(2,2) F(2,4) BW(2,3) F(2,5) \
         BW(2,4) F(2,6) BW(2,5) F(2,7) BW(2,6) BW(2,7)"
    );
    // Recomputing: a forward that would take the last unit while another forward (or a
    // recompute) comes next runs checkpointed.
    let rec = rank_lines(&spec("recompute"), "4", "8", &[]);
    assert_eq!(
        rec[0],
        "rank 0: F(0,0) F(0,1)! F(0,2)! F(0,3) BW(0,0) F(0,4)! RECOMPUTE(0,1) BW(0,1) F(0,5)! \
         RECOMPUTE(0,2) BW(0,2) F(0,6) BW(0,3) F(0,7)! RECOMPUTE(0,4) BW(0,4) RECOMPUTE(0,5) \
         BW(0,5) BW(0,6) RECOMPUTE(0,7) BW(0,7)"
    );
    assert_eq!(rec[2], off[2]);
}

/// A reload goes one compute op ahead of its backward where the cap leaves room, so that the
/// copy runs under that op: V-Half with half its cap, offloading.
#[test]
fn list_memory_offload_reloads_one_op_ahead_where_the_cap_allows() {
    let src = std::fs::read_to_string(root().join("specs/v_half.sched"))
        .unwrap()
        .replace(
            "memory <= 2 * ((P + 2) / 2)",
            "memory <= (P + 2) / 2\n    memory offload",
        )
        .lines()
        .filter(|l| !l.starts_with("expect"))
        .map(|l| format!("{l}\n"))
        .collect::<String>();
    let f = tmpdir("v_half_offload").join("v_half_offload.sched");
    std::fs::write(&f, src).unwrap();
    let f = f.to_str().unwrap();
    assert_eq!(
        peaks(&[
            "check",
            f,
            "--pp",
            "8",
            "--mb",
            "16",
            "--max-activations",
            "5"
        ]),
        vec![5; 8]
    );
    let lines = rank_lines(f, "8", "16", &[]);
    let (mut ahead, mut at) = (0, 0);
    for l in &lines {
        let ops: Vec<&str> = l.split(' ').skip(2).collect();
        for (k, op) in ops.iter().enumerate() {
            if let Some(arg) = op.strip_prefix("RELOAD") {
                // The compute ops between the reload and the backward that reads it.
                let between = ops[k + 1..]
                    .iter()
                    .take_while(|o| !o.starts_with('B') || !o.ends_with(arg))
                    .filter(|o| !o.contains("LOAD"))
                    .count();
                match between {
                    0 => at += 1,
                    1 => ahead += 1,
                    _ => panic!("{op} {between} ops ahead: {l}"),
                }
            }
        }
    }
    assert_eq!((ahead, at), (103, 11));
}

#[test]
fn list_memory_policy_without_a_cap_is_refused_at_its_line() {
    let f = tmpdir("nocap").join("nocap.sched");
    std::fs::write(
        &f,
        "schedule \"x\"\nlist r {\n    F(c, m) = m\n    BW(c, m) = m\n    memory recompute\n}\n",
    )
    .unwrap();
    let o = schedc(&["check", f.to_str().unwrap(), "--pp", "2", "--mb", "2"]);
    assert_refused(
        &o,
        "`memory recompute` needs a cap: the `list` block has no `memory <= e` line",
    );
    assert!(stderr(&o).contains("nocap.sched:5:5]"), "{}", stderr(&o));
}

/// Issue 27, item 6: `recompute stages SET` checkpoints every forward of those stages;
/// interleaved 1F1B takes it as `--param recompute=K` (stages 0..K), default 0 unchanged.
#[test]
fn recompute_stages_checkpoints_every_forward_of_the_chosen_stages() {
    let base = [
        "check",
        "specs/interleaved_1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
    ];
    let with = |k: &str| {
        let mut a = base.to_vec();
        a.extend(["--param", k]);
        peaks(&a)
    };
    assert_eq!(peaks(&base), vec![11, 9, 7, 5]);
    assert_eq!(with("recompute=4"), vec![5, 5, 3, 1]);
    assert_eq!(with("recompute=8"), vec![1, 1, 1, 1]);
    let lines = rank_lines(
        "specs/interleaved_1f1b.sched",
        "4",
        "8",
        &["--param", "recompute=4"],
    );
    // Rank 0 holds stages 0 (chosen) and 4: 8 checkpointed forwards, 8 recomputes, each
    // right before its backward.
    let r0: Vec<&str> = lines[0].split(' ').skip(2).collect();
    assert_eq!(r0.iter().filter(|o| o.ends_with('!')).count(), 8);
    assert!(r0
        .iter()
        .filter(|o| o.ends_with('!'))
        .all(|o| o.starts_with("F(0,")));
    for (k, o) in r0.iter().enumerate() {
        if let Some(arg) = o.strip_prefix("RECOMPUTE") {
            assert_eq!(r0[k + 1], format!("BW{arg}"));
        }
    }
    assert_eq!(r0.iter().filter(|o| o.starts_with("RECOMPUTE")).count(), 8);
    // A stage out of range is an error at the item.
    let f = tmpdir("recompute_range").join("bad.sched");
    std::fs::write(
        &f,
        std::fs::read_to_string(root().join("specs/1f1b.sched")).unwrap()
            + "recompute stages [0, 9]\n",
    )
    .unwrap();
    let (code, v) = json(&["check", f.to_str().unwrap(), "--pp", "4", "--mb", "8"]);
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(
        v["diagnostics"][0]["message"],
        "stage 9 is out of range 0..4 (S = 4)"
    );
}

/// Issue 27, item 2: DualPipe with `--param recompute=1` (DeepSeek-V3's recompute, as whole
/// forwards): every forward checkpointed; the peak drops from P + 1 to max(2, h + 1).
#[test]
fn dualpipe_recompute_param_lowers_the_peak_and_defaults_off() {
    let run = |pp: &str, mb: &str, extra: &[&str]| {
        let mut a = vec!["check", "specs/dualpipe.sched", "--pp", pp, "--mb", mb];
        a.extend_from_slice(extra);
        peaks(&a)
    };
    assert_eq!(run("4", "8", &[]), vec![5; 4]);
    assert_eq!(run("4", "8", &["--param", "recompute=1"]), vec![2; 4]);
    assert_eq!(run("8", "16", &[]), vec![9; 8]);
    assert_eq!(
        run("8", "16", &["--param", "recompute=1"]),
        vec![2, 2, 3, 4, 4, 3, 2, 2]
    );
    let lines = rank_lines(
        "specs/dualpipe.sched",
        "4",
        "8",
        &["--param", "recompute=1"],
    );
    let all: String = lines.join(" ");
    // 2 directions x 4 stages x 4 micro-batches each.
    assert_eq!(all.matches("RECOMPUTE(").count(), 32);
    assert_eq!(all.matches(")!").count(), 32);
    let (code, v) = json(&[
        "check",
        "specs/dualpipe.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--param",
        "recompute=2",
    ]);
    assert_eq!(code, Some(1), "{v}");
    assert!(v["diagnostics"][0]["message"]
        .as_str()
        .unwrap()
        .contains("--param recompute takes 0 (off) or 1"));
}

/// `schedc fmt` keeps the new lines: `memory offload` in a list block, `recompute stages`.
#[test]
fn fmt_keeps_the_memory_rule_and_recompute_stages() {
    let f = tmpdir("fmt_memory").join("x.sched");
    std::fs::write(
        &f,
        "schedule \"x\"\nparam k = 1\nlist r {\n  F(c, m) = m\n  BW(c, m) = m + P\n  memory <= 2\n  memory   recompute\n}\nrecompute   stages s => s < k\n",
    )
    .unwrap();
    let o = schedc(&["fmt", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        "schedule \"x\"\nparam k = 1\n\nlist r {\n    F(c, m) = m\n    BW(c, m) = m + P\n    memory <= 2\n    memory recompute\n}\n\nrecompute stages s => s < k\n"
    );
}

/// GPipe's order (every forward before every backward) run `strict` under `memory <= 2` is
/// stuck with `memory wait` (no backward can free memory before the forwards ahead of it);
/// `memory offload` and `memory recompute` finish it within the cap: 24 offloads (or
/// checkpointed forwards), 39 s under `sim` with 1 s copies (GPipe without a cap: 33 s).
#[test]
fn strict_gpipe_order_stuck_at_the_cap_runs_with_offload_or_recompute() {
    let dir = tmpdir("gpipe_cap");
    for (policy, code) in [("wait", 1), ("offload", 0), ("recompute", 0)] {
        let f = dir.join(format!("g_{policy}.sched"));
        std::fs::write(
            &f,
            format!(
                "schedule \"g\"\nvpp 1\nlist r {{\n    F(c, m) = m\n    BW(c, m) = M + m\n    memory <= 2\n    memory {policy}\n    strict\n}}\n"
            ),
        )
        .unwrap();
        let f = f.to_str().unwrap();
        let o = schedc(&[
            "check",
            f,
            "--pp",
            "4",
            "--mb",
            "8",
            "--max-activations",
            "2",
        ]);
        assert_eq!(o.status.code(), Some(code), "{policy}: {}", stderr(&o));
        if policy == "wait" {
            assert!(stderr(&o).contains(
                "list scheduling is stuck at time 5 after 8 of 64 ops: no rank can start its next op"
            ));
            continue;
        }
        let ops = rank_lines(f, "4", "8", &[]).join(" ");
        let moved = if policy == "offload" {
            "OFFLOAD("
        } else {
            "RECOMPUTE("
        };
        assert_eq!(ops.matches(moved).count(), 24, "{policy}");
        let (code, v) = json(&[
            "sim",
            f,
            "--pp",
            "4",
            "--mb",
            "8",
            "--set",
            "activation_bytes=1e9,offload=1",
        ]);
        assert_eq!(
            (code, v["makespan"].as_f64()),
            (Some(0), Some(39.0)),
            "{policy}"
        );
    }
}

/// Newcomer round 5: what `check` accepts of memory ops the executors run, and what the
/// exports and specs say of them.
#[test]
fn newcomer_round_5_memory_findings() {
    let d = tmpdir("round5");
    // Finding 1: a RECOMPUTE after an offload that follows the split backward's B cannot
    // rebuild what W needs (`run` failed on it): `check` rejects it at its line, exit 1.
    let ir = d.join("rc_after_b.ir");
    std::fs::write(
        &ir,
        "pp 2\nstages 2\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) F(0,1) BW(0,0) BW(0,1)\nrank 1: F(1,0) F(1,1) B(1,0) OFFLOAD(1,0) B(1,1) RECOMPUTE(1,0) W(1,0) W(1,1)\n",
    )
    .unwrap();
    let o = schedc(&["check", ir.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = format!("{}{}", stdout(&o), stderr(&o));
    assert!(
        e.contains("rank 1 step 5: `RECOMPUTE(1,0)` is not valid here"),
        "{e}"
    );
    assert!(e.contains("after B ran: W needs what B left"), "{e}");
    assert!(e.contains("rc_after_b.ir:6:"), "{e}");
    assert!(e.contains("help: put RELOAD(1,0) before W(1,0)"), "{e}");
    // Finding 2: the Megatron export refuses a schedule that moves activations (it wrote
    // plain 1F1B's arguments).
    for spec in ["1f1b_recompute", "1f1b_offload", "bpipe"] {
        let o = schedc(&[
            "convert",
            &format!("specs/{spec}.sched"),
            "--pp",
            "4",
            "--mb",
            "8",
            "--to",
            "megatron",
        ]);
        assert_eq!(o.status.code(), Some(1), "{spec}: {}", stdout(&o));
        assert!(
            stderr(&o).contains(
                "cannot export to Megatron-LM: the program moves or recomputes activations (rank "
            ),
            "{spec}: {}",
            stderr(&o)
        );
    }
    // Finding 7: interleaved_1f1b's recompute takes 0..=S.
    for bad in ["-1", "9"] {
        let o = schedc(&[
            "check",
            "specs/interleaved_1f1b.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--param",
            &format!("recompute={bad}"),
        ]);
        assert_ne!(o.status.code(), Some(0), "recompute={bad}");
        assert!(
            stderr(&o).contains("--param recompute takes K in 0..=8 (the first K of the 8")
                && stderr(&o).contains(&format!("got {bad}")),
            "{}",
            stderr(&o)
        );
    }
    // Finding 8: a second `memory` line in a list block is an input error, exit 2, as a
    // `memory offload` without a cap is.
    let twice = d.join("twice.sched");
    std::fs::write(
        &twice,
        "schedule \"l\"\nvpp 1\nplacement loop\nlist r {\n    F(c, m) = 2 * m\n    BW(c, m) = 2 * (m + P - r) - 1\n    memory <= 2\n    memory offload\n    memory recompute\n}\n",
    )
    .unwrap();
    let o = schedc(&["check", twice.to_str().unwrap(), "--pp", "4", "--mb", "8"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("a second `memory offload|recompute|wait` line"));
    // Finding 10: the input within the cap and faster than what the search found is named.
    let o = schedc(&[
        "optimize",
        "specs/1f1b_offload.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--cost",
        "F=1,B=1,W=1",
        "--max-activations",
        "2",
        "--time-limit",
        "5",
    ]);
    assert!(
        stderr(&o).contains("note: the input is faster than the schedule found (33.0000 against 41.0000) and within the caps"),
        "{}",
        stderr(&o)
    );
}
