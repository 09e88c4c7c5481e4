//! Issue 22: `schedc plan` searches meshes and schedules, each priced by the simulator under
//! the model-level cost model; `schedc compare --model` derives each row's costs.

mod common;
use common::*;

/// A small plan: Llama-3-8B on 4 H100s, 16 sequences per step.
const SMALL: &[&str] = &[
    "plan",
    "--gpus",
    "4",
    "--model",
    "llama3-8b",
    "--hardware",
    "h100",
    "--global-batch",
    "16",
];

#[test]
fn plan_recommends_for_llama3_8b_on_4_h100() {
    let o = schedc(SMALL);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("recommendation: tp=2 pp=2 ep=1 dp=1 with zbv, M = 16\n"),
        "{out}"
    );
    assert!(
        out.contains("  step 2.277 s, 28785 tokens/s (7196 per GPU), 347.2 TFLOP/s per GPU, MFU 35.1%, 51.1 of 80.0 GB per GPU\n"),
        "{out}"
    );
    assert!(
        out.contains("against 1f1b on the same mesh: +5.3% tokens/s (1f1b: 2.396 s, bubble 11.1%)"),
        "{out}"
    );
    // tp=1 pp=1 holds all 8B parameters at 18 bytes each: not simulated.
    assert!(
        out.contains("every schedule at tp=1 pp=1 ep=1 dp=4: weights, gradients and optimizer state alone need 144.5 GB per GPU"),
        "{out}"
    );
    // The JSON's best is the table's first row, and it is what `sim --model` computes for
    // the same instance.
    let o = schedc(&[SMALL, &["--format", "json"]].concat());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["best"], 0);
    let b = &v["candidates"][0];
    assert_eq!(b["schedule"], "zbv");
    assert_eq!((b["tp"].as_u64(), b["pp"].as_u64()), (Some(2), Some(2)));
    let sim = schedc(&[
        "sim",
        "specs/zbv.sched",
        "--pp",
        "2",
        "--mb",
        "16",
        "--model",
        "llama3-8b",
        "--hardware",
        "h100",
        "--mesh",
        "tp=2,pp=2,dp=1",
        "--format",
        "json",
    ]);
    assert!(sim.status.success(), "{}", stderr(&sim));
    let s: serde_json::Value = serde_json::from_slice(&sim.stdout).unwrap();
    assert_eq!(b["step_seconds"], s["step_seconds"]);
    assert_eq!(b["memory_bytes"], s["peak_memory_bytes"]);
}

#[test]
fn plan_refuses_a_mesh_that_does_not_multiply_to_the_gpus() {
    let o = schedc(&[SMALL, &["--mesh", "tp=2,pp=4,dp=1"]].concat());
    assert_refused(&o, "--mesh tp=2 x pp=4 x dp=1 is 8 GPUs, but --gpus is 4");
    let o = schedc(&[SMALL, &["--mesh", "pp=3"]].concat());
    assert_refused(&o, "--mesh pp=3 = 3 does not divide --gpus 4");
    let o = schedc(&[SMALL, &["--mesh", "ep=2"]].concat());
    assert_refused(&o, "--mesh ep=2: `llama3-8b` is dense");
    let o = schedc(&[SMALL, &["--mesh", "tq=2"]].concat());
    assert_refused(&o, "--mesh: unknown dimension `tq`");
}

#[test]
fn plan_refuses_an_unknown_model_naming_the_option() {
    let o = schedc(&["plan", "--gpus", "8", "--model", "gpt5"]);
    assert_refused(&o, "--model: unknown model `gpt5`");
    let o = schedc(&["plan", "--gpus", "8"]);
    assert_refused(&o, "--model is required");
    let o = schedc(&[
        "plan",
        "--gpus",
        "8",
        "--model",
        "dsv3",
        "--hardware",
        "tpu",
    ]);
    assert_refused(&o, "--hardware: ");
}

#[test]
fn plan_refuses_the_retired_flags_with_what_replaces_them() {
    for (flag, says) in [
        (
            "--ep",
            "--ep is no longer an option of plan: give --mesh ep=N",
        ),
        ("--gpu-memory", "the memory comes from --hardware"),
        ("--mfu", "not from an assumed MFU"),
        (
            "--global-batch-tokens",
            "give --global-batch SEQS, sequences per step",
        ),
    ] {
        let o = schedc(&[SMALL, &[flag, "8"]].concat());
        assert_refused(&o, says);
    }
}

#[test]
fn plan_with_nothing_that_fits_exits_1_and_says_why() {
    // DeepSeek-V3 on one node: every mesh is over memory by its weights alone.
    let o = schedc(&[
        "plan",
        "--gpus",
        "8",
        "--model",
        "dsv3",
        "--hardware",
        "h800",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("no candidate fits in 80.0 GB per GPU"),
        "{out}"
    );
    assert!(
        out.contains("weights, gradients and optimizer state alone need"),
        "{out}"
    );
}

#[test]
fn compare_with_a_model_derives_each_rows_costs() {
    let args = [
        "compare",
        "specs/1f1b.sched",
        "specs/zbv.sched",
        "--pp",
        "2",
        "--mb",
        "16",
        "--model",
        "llama3-8b",
        "--hardware",
        "h100",
        "--mesh",
        "tp=2,dp=1",
        "--format",
        "json",
    ];
    let o = schedc(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["derived"], true);
    // Each row is what `sim --model` gives for it: zbv's four stages hold 8 layers each, not
    // 16 scaled by P / stages.
    for (name, spec) in [("1f1b", "specs/1f1b.sched"), ("zbv", "specs/zbv.sched")] {
        let row = v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["schedule"] == name)
            .unwrap();
        let sim = schedc(&[
            "sim",
            spec,
            "--pp",
            "2",
            "--mb",
            "16",
            "--model",
            "llama3-8b",
            "--hardware",
            "h100",
            "--mesh",
            "tp=2,dp=1",
            "--format",
            "json",
        ]);
        let s: serde_json::Value = serde_json::from_slice(&sim.stdout).unwrap();
        assert_eq!(row["figures"]["makespan"], s["makespan"], "{name}");
        assert_eq!(
            row["figures"]["step"]["step_seconds"], s["step_seconds"],
            "{name}"
        );
    }
    // The human table has the step-level columns.
    let o = schedc(&args[..args.len() - 2]);
    assert!(stdout(&o).contains("tokens/s"), "{}", stdout(&o));
    // A bad model is refused once, naming the option.
    let o = schedc(&["compare", "--pp", "2", "--mb", "4", "--model", "gpt5"]);
    assert_refused(&o, "--model: unknown model `gpt5`");
    let o = schedc(&["compare", "--pp", "2", "--mb", "4", "--hardware", "h100"]);
    assert_refused(&o, "--hardware describes the cluster of --model");
}

/// Issue 27: the derived cost model prices no host copy, so a spec that offloads would look
/// free; `plan` lists it as skipped instead of recommending it.
#[test]
fn plan_skips_offload_specs_whose_copies_it_cannot_price() {
    let o = schedc(SMALL);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("  1f1b_offload at every mesh: moves activations (OFFLOAD/RELOAD/RECOMPUTE), which `plan`'s cost model does not price yet\n"),
        "{out}"
    );
    assert!(!out.contains("1f1b_offload  "), "{out}");
}

/// Issue 27: `plan --max-memory` keeps only candidates whose simulated peak (without the
/// per-GPU overhead) is within the cap: llama3-8b on 4 H100 recommends ZB-V on tp=2 pp=2
/// (51.1 GB with the overhead) without it; under 40 GiB that candidate does not fit and
/// tp=4 pp=1 (41.2 GB with the overhead) is recommended; under 20 GiB no mesh fits.
#[test]
fn plan_max_memory_drops_the_candidates_over_the_cap() {
    let json = |extra: &[&str]| {
        let mut a = SMALL.to_vec();
        a.extend(extra);
        a.extend(["--format", "json"]);
        let o = schedc(&a);
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        (o.status.code(), v)
    };
    let best = |v: &serde_json::Value| {
        let c = &v["candidates"][v["best"].as_u64().unwrap() as usize];
        (
            c["schedule"].as_str().unwrap().to_string(),
            c["tp"].as_u64().unwrap(),
            c["pp"].as_u64().unwrap(),
        )
    };
    let (code, free) = json(&[]);
    assert_eq!(code, Some(0));
    assert_eq!(best(&free), ("zbv".to_string(), 2, 2));
    let (code, capped) = json(&["--max-memory", "40G"]);
    assert_eq!(code, Some(0));
    assert_eq!(best(&capped), ("interleaved_1f1b".to_string(), 4, 1));
    let cands = capped["candidates"].as_array().unwrap();
    assert_eq!(cands.iter().filter(|c| c["fits"] == true).count(), 15);
    assert!(cands
        .iter()
        .any(|c| c["schedule"] == "zbv" && c["tp"] == 2 && c["pp"] == 2 && c["fits"] == false));
    let mut a = SMALL.to_vec();
    a.extend(["--max-memory", "20G"]);
    let o = schedc(&a);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    assert!(
        out.contains("no candidate fits in 80.0 GB per GPU within --max-memory 21.5 GB (without the overhead)"),
        "{out}"
    );
    assert!(
        out.contains("every schedule at tp=1 pp=4 ep=1 dp=1: weights, gradients and optimizer state alone need 36.1 GB per GPU (averaged over the 4 pipeline ranks), over --max-memory 21.5 GB"),
        "{out}"
    );
}
