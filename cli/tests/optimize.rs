//! `schedc optimize` end to end: bad input exits 2 with the reason, a found schedule is
//! written in each form and passes `schedc check` within the cap, `--format json` reports
//! the from-start makespan and the comparison rows.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn schedc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_schedc"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("runs")
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("schedc-opt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// The command exited 2 and its standard error contains `says`.
fn assert_refused(o: &Output, says: &str) {
    assert_eq!(o.status.code(), Some(2), "{}", stderr(o));
    assert!(stderr(o).contains(says), "{}", stderr(o));
}

#[test]
fn a_cap_below_the_minimum_exits_2_and_says_the_minimum() {
    let o = schedc(&[
        "optimize",
        "--pp",
        "4",
        "--mb",
        "8",
        "--placement",
        "v",
        "--vpp",
        "2",
        "--max-activations",
        "0",
    ]);
    // In one-stage-per-rank units a V rank's two half stages need 1 (not 2: that is the
    // count in the V's own half stages, which the user did not give).
    assert_refused(&o, "the minimum any schedule on this placement needs: 1 (stage units of one stage per rank): rank 0 holds 2 virtual stages of one direction, 0.5 of a stage each");
    // Without a placement every standard one is tried: the error names the smallest minimum.
    let o = schedc(&[
        "optimize",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-activations",
        "0",
    ]);
    assert_refused(&o, "below the minimum of every placement tried; the smallest is 1 (loop V=1), in stage units of one stage per rank");
    let o = schedc(&[
        "optimize",
        "specs/zbv.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-activations",
        "1",
    ]);
    assert_refused(&o, "the minimum any schedule on this placement needs: 2");
}

#[test]
fn a_cost_model_without_times_exits_2() {
    let d = tmpdir("notimes");
    let f = d.join("mem.toml");
    std::fs::write(&f, "[memory]\nactivation_bytes = 1e9\n").unwrap();
    let o = schedc(&[
        "optimize",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-activations",
        "4",
        "--cost",
        f.to_str().unwrap(),
    ]);
    assert_refused(&o, "no op times");
}

#[test]
fn a_time_limit_of_zero_exits_2() {
    for t in ["0", "-1", "nan"] {
        let flag = format!("--time-limit={t}");
        let o = schedc(&[
            "optimize",
            "--pp",
            "4",
            "--mb",
            "8",
            "--max-activations",
            "4",
            &flag,
        ]);
        assert_eq!(o.status.code(), Some(2), "--time-limit {t}");
        assert!(stderr(&o).contains("--time-limit"), "{}", stderr(&o));
    }
}

#[test]
fn missing_sizes_and_an_existing_output_exit_2() {
    let o = schedc(&["optimize", "--max-activations", "4"]);
    assert_eq!(o.status.code(), Some(2));
    let d = tmpdir("exists");
    let f = d.join("out.ir");
    std::fs::write(&f, "keep me").unwrap();
    let o = schedc(&[
        "optimize",
        "--pp",
        "2",
        "--mb",
        "2",
        "--max-activations",
        "2",
        "-o",
        f.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "keep me");
}

fn check_ok(path: &Path, extra: &[&str]) {
    let mut args = vec!["check", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = schedc(&args);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn every_output_form_passes_check_within_the_cap() {
    let d = tmpdir("forms");
    for (to, name) in [
        ("ir-text", "o.ir"),
        ("spec", "o.sched"),
        ("torch-csv", "o.csv"),
    ] {
        let f = d.join(name);
        let o = schedc(&[
            "optimize",
            "specs/1f1b.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--cost",
            "F=1,B=1.1,W=0.9,latency=0.05",
            "--max-activations",
            "4",
            "--effort",
            "0.1",
            "--to",
            to,
            "-o",
            f.to_str().unwrap(),
            "--no-progress",
        ]);
        assert_eq!(o.status.code(), Some(0), "{to}: {}", stderr(&o));
        let extra: &[&str] = if to == "spec" {
            &["--pp", "4", "--mb", "8", "--max-activations", "4"]
        } else {
            &["--max-activations", "4"]
        };
        check_ok(&f, extra);
    }
}

#[test]
fn json_reports_the_from_start_makespan_and_the_baselines() {
    let o = schedc(&[
        "optimize",
        "--pp",
        "4",
        "--mb",
        "8",
        "--placement",
        "loop",
        "--max-activations",
        "4",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // F = B = W = 1, P = 4, M = 8, cap P: 3M + P - 1 = 27, the lower bound.
    assert_eq!(j["makespan"], 27.0);
    assert_eq!(j["lower_bound"], 27.0);
    assert_eq!(j["optimal"], true);
    assert_eq!(j["greedy"]["makespan"], 27.0);
    let specs: Vec<&str> = j["specs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert!(specs.contains(&"spec zb_h1"), "{specs:?}");
    assert!(specs.contains(&"spec 1f1b"), "{specs:?}");
    assert!(
        !specs.contains(&"spec zb_h2"),
        "ZB-H2 needs 2P - 1 > 4: {specs:?}"
    );
}

fn spec_row<'a>(j: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    j["specs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no row {name}"))
}

/// The headline under `steady_state`: P = 8, M = 16, F = B = W = 1, cap 8. The from-start
/// makespan is still reported as `makespan`; the steady-state bubble is at most a third of
/// 1F1B's (0 against 30.4%: ZB-V's V placement runs steps back to back without a gap).
#[test]
fn steady_state_headline_is_a_third_of_1f1b_or_less() {
    let o = schedc(&[
        "optimize",
        "--pp",
        "8",
        "--mb",
        "16",
        "--max-activations",
        "8",
        "--objective",
        "steady_state",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["objective"], "steady_state");
    assert_eq!(j["makespan"], 51.5);
    assert_eq!(j["steady_step"], 48.0);
    let ours = j["bubble"]["steady_state"].as_f64().unwrap();
    let f1b1 = spec_row(&j, "spec 1f1b")["bubble_steady_state"]
        .as_f64()
        .unwrap();
    assert!((f1b1 - 21.0 / 69.0).abs() < 1e-9, "1F1B: {f1b1}");
    assert!(ours <= f1b1 / 3.0, "{ours} against 1F1B's {f1b1}");
    assert!(j["peak_activations"].as_f64().unwrap() <= 8.0);
}

#[test]
fn moe_needs_all_to_all_times_and_scores_with_the_split_simulation() {
    let o = schedc(&[
        "optimize",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-activations",
        "4",
        "--moe",
    ]);
    assert_refused(&o, "moe");

    let o = schedc(&[
        "optimize",
        "specs/dualpipev.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--max-activations",
        "9",
        "--cost",
        "../shared/costs/moe-1to1.toml",
        "--moe",
        "--effort",
        "0.2",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["moe"], true);
    let dpv = spec_row(&j, "spec dualpipev");
    // The split simulation exposes all-to-all: DualPipeV's step is longer than its compute.
    assert!(dpv["bubble_per_rank_span"].as_f64().unwrap() > 0.2);
    assert!(j["makespan"].as_f64().unwrap() <= dpv["makespan"].as_f64().unwrap() + 1e-9);
    assert!(j["peak_activations"].as_f64().unwrap() <= 9.0);
}

/// Above the cheap lower bound, `optimal` says branch and bound proved it (V, P = 3, M = 4,
/// unit, one activation per rank: 21.5, bound 15; CP-SAT's optimum is 43 in half-stage units).
#[test]
fn an_optimum_above_the_lower_bound_says_branch_and_bound_proved_it() {
    let o = schedc(&[
        "optimize",
        "--pp",
        "3",
        "--mb",
        "4",
        "--placement",
        "v",
        "--vpp",
        "2",
        "--max-activations",
        "1",
        "--no-progress",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("optimized: makespan 21.5000 (v V=2; lower bound 15.0000, optimal: branch and bound proved no schedule on this placement is shorter)"),
        "{out}"
    );
}

/// `--heuristic` is list scheduling and the greedy only: `--exact auto` runs no branch and
/// bound under it, even on an instance small enough for it (ZB-V at P = 3, M = 4, cap 3 is
/// closed by branch and bound at 36 otherwise); `--exact on` still asks for it by name.
#[test]
fn heuristic_mode_runs_no_branch_and_bound_unless_asked() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "optimize",
            "specs/zbv.sched",
            "--pp",
            "3",
            "--mb",
            "4",
            "--max-activations",
            "3",
            "--format",
            "json",
        ];
        args.extend_from_slice(extra);
        let o = schedc(&args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let phases: Vec<String> = j["phases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap().to_string())
            .collect();
        (j, phases)
    };
    let (j, phases) = run(&["--heuristic"]);
    assert!(
        !phases.iter().any(|p| p == "branch and bound"),
        "{phases:?}"
    );
    assert_ne!(j["found_by"], "branch and bound");
    let (j, phases) = run(&["--heuristic", "--exact", "on"]);
    assert!(phases.iter().any(|p| p == "branch and bound"), "{phases:?}");
    assert_eq!(j["makespan"], 36.0);
    let (j, _) = run(&[]);
    assert_eq!(j["makespan"], 36.0);
}

/// `--format json` with `-o -` would put the schedule and the JSON report on one standard
/// output: refused before the search (exit 2), not an unparseable stream.
#[test]
fn json_report_and_schedule_on_standard_output_are_refused() {
    let o = schedc(&[
        "optimize",
        "--pp",
        "3",
        "--mb",
        "4",
        "--max-activations",
        "3",
        "--format",
        "json",
        "-o",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // Standard output holds the one JSON error object of every `--format json` error
    // (breakit2 finding 11), not a schedule.
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exit"], 2);
    assert!(v["error"]
        .as_str()
        .unwrap()
        .starts_with("`-o -` and `--format json` would both write"));
    assert!(
        stderr(&o).contains("`-o -` and `--format json` would both write to standard output"),
        "{}",
        stderr(&o)
    );
}

/// Run outside the repository (or with a wrong --specs), no spec can be compared: the report
/// says so instead of silently leaving out every spec row.
#[test]
fn a_missing_specs_directory_is_noted() {
    let o = schedc(&[
        "optimize",
        "--pp",
        "3",
        "--mb",
        "4",
        "--max-activations",
        "3",
        "--no-progress",
        "--specs",
        "no/such/dir",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("note: `no/such/dir` is not a directory: no spec is compared"),
        "{}",
        stderr(&o)
    );
    assert!(!String::from_utf8_lossy(&o.stdout).contains("spec "));
    let o = schedc(&[
        "optimize",
        "--pp",
        "3",
        "--mb",
        "4",
        "--max-activations",
        "3",
        "--no-progress",
    ]);
    assert!(!stderr(&o).contains("not a directory"), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("spec zbv"));
}

#[test]
fn a_placement_list_leaving_a_rank_without_a_stage_is_refused() {
    let o = schedc(&[
        "optimize",
        "--pp",
        "3",
        "--mb",
        "4",
        "--placement",
        "0,1,1",
        "--max-activations",
        "3",
    ]);
    assert_refused(&o, "--placement 0,1,1: rank 2 holds no stage (--pp 3)");
    // Every rank holding a stage is accepted.
    let o = schedc(&[
        "optimize",
        "--pp",
        "2",
        "--mb",
        "4",
        "--placement",
        "0,1,1,0",
        "--max-activations",
        "4",
        "--no-progress",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}
