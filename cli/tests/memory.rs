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
    let o = schedc(&[
        "sim",
        "specs/1f1b_offload.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--set",
        "activation_bytes=1e9,offload=2",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["makespan"], 39.0);
    let peaks: Vec<f64> = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["peak_activation_bytes"].as_f64().unwrap() / 1e9)
        .collect();
    assert_eq!(peaks, vec![3.0, 3.0, 2.0, 1.0]);
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
