//! `schedc convert --to megatron` and `--to torch-csv --sidecar`: the exports to Megatron-LM
//! and torchtitan (issue 25, items 4 and 5).

use std::process::Output;
mod common;
use common::*;

/// The lines of the `SCHEDC_MEGATRON_ARGS=( ... )` array, trimmed.
fn megatron_args(o: &Output) -> Vec<String> {
    assert_eq!(o.status.code(), Some(0), "{}", stderr(o));
    let out = stdout(o);
    let body = out
        .split_once("SCHEDC_MEGATRON_ARGS=(\n")
        .unwrap_or_else(|| panic!("no array in {out}"))
        .1;
    let body = body.split_once(")\n").expect("closed array").0;
    body.lines().map(|l| l.trim().to_string()).collect()
}

fn assert_exit(o: &Output, code: i32, says: &str) {
    assert_eq!(o.status.code(), Some(code), "{}", stderr(o));
    assert!(stderr(o).contains(says), "{}", stderr(o));
}

#[test]
fn megatron_export_of_interleaved_1f1b_writes_the_layout_and_the_batch() {
    let o = schedc(&[
        "convert",
        "specs/interleaved_1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--vpp",
        "2",
        "--to",
        "megatron",
        "--layers",
        "30",
        "--micro-batch-size",
        "2",
        "--dp",
        "4",
    ]);
    assert_eq!(
        megatron_args(&o),
        [
            "--pipeline-model-parallel-size 4",
            "--num-layers 30",
            // 8 model chunks: 3, 4 x 6, 3 (Megatron-LM's layout grammar; chunk k on rank
            // k mod 4).
            "--pipeline-model-parallel-layout 'Et*3|(t*4|)*6t*3L'",
            "--micro-batch-size 2",
            // 8 micro-batches x 2 sequences x 4 replicas.
            "--global-batch-size 64",
        ]
    );
    assert!(
        stdout(&o).contains("Megatron-Core's interleaved 1F1B with P=4, V=2, M=8"),
        "{}",
        stdout(&o)
    );
    // Without a layer count: the virtual stages by number.
    let o = schedc(&[
        "convert",
        "specs/interleaved_1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--vpp",
        "2",
        "--to",
        "megatron",
    ]);
    assert_eq!(
        megatron_args(&o),
        [
            "--pipeline-model-parallel-size 4",
            "--num-virtual-stages-per-pipeline-rank 2",
            "--micro-batch-size 1",
            "--global-batch-size 8",
        ]
    );
}

#[test]
fn megatron_export_of_1f1b_and_of_the_combined_1f1b_with_ep_overlap() {
    let o = schedc(&[
        "convert",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--to",
        "megatron",
        "--layers",
        "8",
    ]);
    assert_eq!(
        megatron_args(&o),
        [
            "--pipeline-model-parallel-size 4",
            "--num-layers 8",
            "--pipeline-model-parallel-layout 'Et*2|(t*2|)*2t*2L'",
            "--micro-batch-size 1",
            "--global-batch-size 8",
        ]
    );
    // The layer count of a model preset: DeepSeek-V3's 61 layers over 8 chunks.
    let o = schedc(&[
        "convert",
        "specs/interleaved_1f1b_a2a.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--vpp",
        "2",
        "--to",
        "megatron",
        "--model",
        "dsv3",
        "--dp",
        "8",
    ]);
    assert_eq!(
        megatron_args(&o),
        [
            "--pipeline-model-parallel-size 4",
            "--num-layers 61",
            "--pipeline-model-parallel-layout 'Et*7|(t*8|)*5t*7|t*7L'",
            "--micro-batch-size 1",
            "--global-batch-size 64",
            "--overlap-moe-expert-parallel-comm",
            "--delay-wgrad-compute",
        ]
    );
    assert!(
        stdout(&o).contains("--expert-model-parallel-size above 1"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn megatron_detects_the_schedule_by_its_order_not_its_file() {
    let d = tmpdir("by-order");
    let ir = d.join("mine.ir");
    let o = schedc(&[
        "convert",
        "specs/interleaved_1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "4",
        "--vpp",
        "2",
        "--to",
        "ir-text",
        "-o",
        ir.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // IR text of the same order: recognised.
    let o = schedc(&["convert", ir.to_str().unwrap(), "--to", "megatron"]);
    assert_eq!(
        megatron_args(&o),
        [
            "--pipeline-model-parallel-size 2",
            "--num-virtual-stages-per-pipeline-rank 2",
            "--micro-batch-size 1",
            "--global-batch-size 4",
        ]
    );
    // torch's CSV of 1F1B, lowered with its sends and receives: recognised.
    let csv = d.join("1f1b.csv");
    let o = schedc(&[
        "convert",
        "specs/1f1b.sched",
        "--pp",
        "3",
        "--mb",
        "5",
        "--to",
        "torch-csv",
        "--torch-format",
        "compute-comms",
        "-o",
        csv.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = schedc(&["convert", csv.to_str().unwrap(), "--to", "megatron"]);
    assert_eq!(megatron_args(&o)[0], "--pipeline-model-parallel-size 3");
    // Two forwards of rank 0 swapped: still a valid schedule, but not Megatron's.
    let text = std::fs::read_to_string(&ir).unwrap();
    let swapped = text.replacen("F(0,0) F(0,1)", "F(0,1) F(0,0)", 1);
    assert_ne!(text, swapped);
    let bad = d.join("swapped.ir");
    std::fs::write(&bad, swapped).unwrap();
    let o = schedc(&["convert", bad.to_str().unwrap(), "--to", "megatron"]);
    assert_exit(
        &o,
        1,
        "it is not Megatron-Core's interleaved 1F1B (specs/interleaved_1f1b.sched at P=2, M=4, V=2): rank 0's compute op 1 is F(0,1) here, F(0,0) there",
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn megatron_refuses_the_schedules_it_cannot_run_with_the_reason() {
    let refuse = |args: &[&str], says: &str| {
        let mut a = vec!["convert"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["--to", "megatron"]);
        let o = schedc(&a);
        assert_exit(&o, 1, "error: cannot export to Megatron-LM: ");
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
        assert!(o.stdout.is_empty());
    };
    refuse(
        &["specs/zbv.sched", "--pp", "4", "--mb", "8"],
        "stage 4 is on rank 3, but Megatron-Core places model chunk k on rank k mod P (0, the loop placement)",
    );
    refuse(
        &["specs/zb_h1.sched", "--pp", "4", "--mb", "8"],
        "splits a backward into its input and weight gradients (B(0,0)",
    );
    refuse(
        &["specs/gpipe.sched", "--pp", "4", "--mb", "8"],
        "it is not Megatron-Core's 1F1B (specs/1f1b.sched at P=4, M=8, V=1): rank 0's compute op 5 is F(0,4) here, BW(0,0) there",
    );
    refuse(
        &["specs/dualpipe.sched", "--pp", "4", "--mb", "8"],
        "two copies of every stage in opposite directions",
    );
    refuse(
        &["specs/interleaved_1f1b.sched", "--pp", "4", "--mb", "2", "--vpp", "2"],
        "groups of at least P = 4 micro-batches on each virtual stage (--microbatch-group-size-per-virtual-pipeline-stage must lie in [P, M]), but M = 2",
    );
    refuse(
        &[
            "specs/interleaved_1f1b.sched",
            "--pp",
            "1",
            "--mb",
            "4",
            "--vpp",
            "2",
        ],
        "Megatron-LM runs virtual pipeline stages only with a pipeline-parallel size above 1",
    );
    refuse(
        &[
            "specs/interleaved_1f1b_a2a.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--moe=all",
        ],
        "splits MoE stages into parts (F(0,0).attn)",
    );
}

#[test]
fn megatron_group_size_flag_when_m_is_not_a_multiple_of_p() {
    // torch's and schedc's interleaved 1F1B at M = 6, P = 4 runs one round of 6 micro-batches
    // per chunk: Megatron's micro-batch group of 6.
    let o = schedc(&[
        "convert",
        "specs/interleaved_1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "6",
        "--vpp",
        "2",
        "--to",
        "megatron",
    ]);
    assert_eq!(
        megatron_args(&o),
        [
            "--pipeline-model-parallel-size 4",
            "--num-virtual-stages-per-pipeline-rank 2",
            "--microbatch-group-size-per-virtual-pipeline-stage 6",
            "--micro-batch-size 1",
            "--global-batch-size 6",
        ]
    );
}

#[test]
fn export_options_out_of_place_are_bad_usage() {
    let base = ["convert", "specs/1f1b.sched", "--pp", "4", "--mb", "8"];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        schedc(&a)
    };
    assert_exit(
        &run(&["--to", "megatron", "--layout", "Et|t|t|tL"]),
        2,
        "--layout needs the model's layer count",
    );
    assert_exit(
        &run(&["--to", "megatron", "--layers", "3"]),
        2,
        "3 layer(s) over 4 pipeline stages would leave a stage without a transformer layer",
    );
    assert_exit(
        &run(&["--to", "megatron", "--layers", "8", "--layout", "Et|t|t|tL"]),
        2,
        "--layout holds 4 transformer layer(s) (`t`), but the model has 8",
    );
    assert_exit(
        &run(&["--to", "torch-csv", "--dp", "2"]),
        2,
        "--micro-batch-size and --dp apply to --to megatron only",
    );
    assert_exit(
        &run(&["--to", "ir-text", "--layers", "8"]),
        2,
        "--layers, --model and --layout apply to --to megatron and to --sidecar only",
    );
    assert_exit(
        &run(&["--to", "megatron", "--layers", "8", "--model", "dsv3"]),
        2,
        "--layers and --model both give the layer count",
    );
    assert_exit(
        &run(&["--to", "megatron", "--layers", "4294967295"]),
        2,
        "4294967295 layers: at most 100000 are supported",
    );
    assert_exit(
        &run(&[
            "--to",
            "megatron",
            "--micro-batch-size",
            "18446744073709551615",
            "--dp",
            "4",
        ]),
        2,
        "the global batch, 8 micro-batches x --micro-batch-size 18446744073709551615 x --dp 4, does not fit 64 bits",
    );
    assert_exit(
        &run(&["--to", "torch-csv", "--sidecar", "x.json"]),
        2,
        "--sidecar names the CSV file it describes: give -o FILE too",
    );
}

#[test]
fn torch_csv_sidecar_has_torchtitans_settings_for_a_v_shaped_schedule() {
    let d = tmpdir("sidecar");
    let csv = d.join("zbv.csv");
    let side = d.join("zbv.json");
    let o = schedc(&[
        "convert",
        "specs/zbv.sched",
        "--pp",
        "2",
        "--mb",
        "4",
        "--to",
        "torch-csv",
        "-o",
        csv.to_str().unwrap(),
        "--sidecar",
        side.to_str().unwrap(),
        "--layers",
        "6",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(csv.is_file());
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&side).unwrap()).unwrap();
    let csv_s = csv.to_str().unwrap();
    let fqns = serde_json::json!([
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "norm", "lm_head"]
    ]);
    assert_eq!(
        v,
        serde_json::json!({
            "schedule_csv": csv_s,
            "pipeline_parallel_degree": 2,
            "stages": 4,
            "stages_per_rank": 2,
            "microbatches": 4,
            "placement": "v",
            "stage_to_rank": [0, 1, 1, 0],
            "stages_of_rank": [[0, 3], [1, 2]],
            "layers": 6,
            "module_fqns_per_model_part": fqns,
            "torchtitan": {"parallelism": {
                "pipeline_parallel_degree": 2,
                "pipeline_parallel_schedule": "ZBVZeroBubble",
                "pipeline_parallel_schedule_csv": csv_s,
                "num_pp_microbatches": 4,
                "module_fqns_per_model_part": fqns,
            }},
        })
    );
    // An explicit placement torchtitan cannot derive: the maps, and why there are no
    // torchtitan settings.
    let ir = d.join("explicit.ir");
    std::fs::write(
        &ir,
        "pp 3\nstages 3\nmicrobatches 1\nplacement 2 0 1\nrank 0: F(1,0) BW(1,0)\nrank 1: F(2,0) BW(2,0)\nrank 2: F(0,0) BW(0,0)\n",
    )
    .unwrap();
    let csv2 = d.join("explicit.csv");
    let side2 = d.join("explicit.json");
    let o = schedc(&[
        "convert",
        ir.to_str().unwrap(),
        "--to",
        "torch-csv",
        "-o",
        csv2.to_str().unwrap(),
        "--sidecar",
        side2.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&side2).unwrap()).unwrap();
    assert_eq!(v["stage_to_rank"], serde_json::json!([2, 0, 1]));
    assert_eq!(v["stages_of_rank"], serde_json::json!([[1], [2], [0]]));
    assert_eq!(v["torchtitan"], serde_json::Value::Null);
    assert!(
        v["torchtitan_note"]
            .as_str()
            .unwrap()
            .contains("torchtitan places stages only as a loop"),
        "{v}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
