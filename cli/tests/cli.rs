//! The `schedc` binary end to end: exit statuses, output formats, conversions.

use std::path::Path;

mod common;
use common::*;

const ZB: &str = "tests/data/torch/ScheduleInterleavedZeroBubble_P4_M8_V2.compute.csv";

#[test]
fn check_exit_statuses() {
    assert_eq!(schedc(&["check", ZB]).status.code(), Some(0));
    assert_eq!(
        schedc(&["check", "tests/cases/a2a-order-mismatch.case"])
            .status
            .code(),
        Some(1)
    );
    let missing = schedc(&["check", "tests/data/no-such-file.csv"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read"));
    assert_eq!(schedc(&["check"]).status.code(), Some(2));
    assert_eq!(schedc(&["frobnicate"]).status.code(), Some(2));
}

#[test]
fn spec_exit_statuses_elaboration_is_a_rejection() {
    // Issue 15 item 10: a spec that parses but cannot be elaborated for this instance is
    // rejected (1), like a `require` refusal; a spec that does not parse is unreadable (2).
    let d = tmpdir("elab");
    let bad = d.join("exhausted.sched");
    std::fs::write(&bad, "rank r {\n    repeat M + 1 { F(0) }\n}\n").unwrap();
    let out = schedc(&["check", bad.to_str().unwrap(), "--pp", "2", "--mb", "2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("schedc::elaboration"));
    let json = schedc(&[
        "check",
        bad.to_str().unwrap(),
        "--pp",
        "2",
        "--mb",
        "2",
        "--format",
        "json",
    ]);
    assert_eq!(json.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["verdict"], "rejected");
    let syntax = d.join("syntax.sched");
    std::fs::write(&syntax, "rank r {\n    F(0\n}\n").unwrap();
    let out = schedc(&["check", syntax.to_str().unwrap(), "--pp", "2", "--mb", "2"]);
    assert_eq!(out.status.code(), Some(2));
    for cmd in ["sim", "show"] {
        let out = schedc(&[cmd, bad.to_str().unwrap(), "--pp", "2", "--mb", "2"]);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
    }
}

#[test]
fn syntax_error_has_location_and_exit_2() {
    let d = tmpdir("syntax");
    let f = d.join("bad.ir");
    std::fs::write(&f, "pp 2\nrank 0: F(0,0) I(0,0)\n").unwrap();
    let out = schedc(&["check", f.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("syntax error in") && err.contains("at 2:16"),
        "{err}"
    );
    assert!(err.contains("bad.ir:2:16"), "{err}");
    assert!(err.contains("unknown op `I`"), "{err}");
    assert!(err.contains("torch's `I`"), "{err}");
}

#[test]
fn json_report_has_the_documented_fields() {
    let out = schedc(&["check", ZB, "--format", "json"]);
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verdict"], "accepted");
    assert_eq!(v["pp"], 4);
    assert_eq!(v["stages"], 8);
    assert_eq!(v["microbatches"], 8);
    let ranks = v["ranks"].as_array().unwrap();
    let warm: Vec<u64> = ranks
        .iter()
        .map(|r| r["warmup"].as_u64().unwrap())
        .collect();
    let peak: Vec<u64> = ranks
        .iter()
        .map(|r| r["peak_activations"].as_u64().unwrap())
        .collect();
    // torch 2.15's own figures for this config (shared/reference/torch/expected.json).
    assert_eq!(warm, vec![8, 7, 6, 5]);
    assert_eq!(peak, vec![8, 8, 8, 8]);
    for r in ranks {
        for k in ["rank", "ops", "idle"] {
            assert!(r.get(k).is_some(), "missing {k}");
        }
    }
    assert!(v["diagnostics"].as_array().unwrap().is_empty());

    let out = schedc(&[
        "check",
        "tests/cases/a2a-order-mismatch.case",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verdict"], "rejected");
    let d = &v["diagnostics"][0];
    assert_eq!(d["severity"], "error");
    assert_eq!(d["code"], "collective-order");
    assert_eq!(d["rank"], 1);
    assert_eq!(d["position"], 2);
}

#[test]
fn torch_csv_round_trips_byte_for_byte_through_the_ir() {
    let d = tmpdir("roundtrip");
    for f in [
        ZB,
        "tests/data/torch/ScheduleDualPipeV_P4_M8_V2.compute.csv",
    ] {
        let ir = d.join("x.ir");
        let json = d.join("x.json");
        let back = d.join("back.csv");
        for p in [&ir, &json, &back] {
            let _ = std::fs::remove_file(p);
        }
        let run = |args: &[&str]| {
            let r = schedc(args);
            assert!(
                r.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&r.stderr)
            );
        };
        run(&["convert", f, "--to", "ir-text", "-o", ir.to_str().unwrap()]);
        run(&[
            "convert",
            ir.to_str().unwrap(),
            "--to",
            "ir-json",
            "-o",
            json.to_str().unwrap(),
        ]);
        run(&[
            "convert",
            json.to_str().unwrap(),
            "--to",
            "torch-csv",
            "-o",
            back.to_str().unwrap(),
        ]);
        let a = std::fs::read(root().join(f)).unwrap();
        let b = std::fs::read(&back).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&a),
            String::from_utf8_lossy(&b),
            "{f}"
        );
    }
}

#[test]
fn convert_never_overwrites_without_force() {
    let d = tmpdir("overwrite");
    let out = d.join("keep.ir");
    std::fs::write(&out, "precious").unwrap();
    let r = schedc(&[
        "convert",
        ZB,
        "--to",
        "ir-text",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("--force"));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "precious");
    let r = schedc(&[
        "convert",
        ZB,
        "--to",
        "ir-text",
        "-o",
        out.to_str().unwrap(),
        "--force",
    ]);
    assert!(r.status.success());
    assert!(std::fs::read_to_string(&out).unwrap().starts_with("pp 4\n"));
}

#[test]
fn compute_comms_export_is_the_verified_lowering() {
    let d = tmpdir("comms");
    let out = d.join("x.comms.csv");
    let r = schedc(&[
        "convert",
        ZB,
        "--to",
        "torch-csv",
        "--torch-format",
        "compute-comms",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("SEND_F") && text.contains("RECV_B"));
    assert!(!text.contains(",,"), "compute_comms has no empty cells");
    // It checks, as torch's lowered form, with the same figures.
    let r = schedc(&["check", out.to_str().unwrap(), "--format", "json"]);
    assert_eq!(r.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    assert_eq!(v["lowered"], false);
    let warm: Vec<u64> = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["warmup"].as_u64().unwrap())
        .collect();
    assert_eq!(warm, vec![8, 7, 6, 5]);
}

#[test]
fn test_command_runs_case_files() {
    let cases: Vec<String> = std::fs::read_dir(root().join("tests/cases"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "case"))
        .map(|p| p.to_str().unwrap().to_string())
        .collect();
    assert!(cases.len() >= 10);
    let args: Vec<&str> = std::iter::once("test")
        .chain(cases.iter().map(String::as_str))
        .collect();
    let r = schedc(&args);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{out}");
    assert!(
        out.contains(&format!("{} passed, 0 failed", cases.len())),
        "{out}"
    );
    // A case whose expectation does not hold fails, with the difference shown.
    let d = tmpdir("case");
    let f = d.join("wrong.case");
    std::fs::write(
        &f,
        "pp 1\nstages 1\nmicrobatches 1\nexpect reject deadlock\nexpect warmup 3\nrank 0: F(0,0) BW(0,0)\n",
    )
    .unwrap();
    let r = schedc(&["test", f.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert_eq!(r.status.code(), Some(1));
    assert!(
        out.contains("expected reject deadlock, got accept"),
        "{out}"
    );
    assert!(out.contains("warmup expected 3, got 1"), "{out}");
    assert!(out.contains("0 passed, 1 failed"), "{out}");
}

#[test]
fn show_prints_the_rank_by_step_grid() {
    let r = schedc(&["show", "tests/cases/overlap-pair.case"]);
    assert!(r.status.success());
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    insta::assert_snapshot!(out);
}

#[test]
fn repository_inputs_exist_in_a_fresh_clone() {
    // The README's main command reads only files in the repository.
    assert!(Path::new(&root().join(ZB)).exists());
}

const MOE_COST: &str = "../shared/costs/moe-1to1.toml";

#[test]
fn sim_json_carries_the_all_to_all_and_every_bubble_convention() {
    let out = schedc(&[
        "sim",
        "specs/dualpipe.sched",
        "--pp",
        "4",
        "--mb",
        "16",
        "--moe",
        "--cost",
        MOE_COST,
        "--format",
        "json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (total, exposed) = (
        v["a2a"]["total"].as_f64().unwrap(),
        v["a2a"]["exposed"].as_f64().unwrap(),
    );
    assert!(
        total > 0.0 && exposed > 0.0 && exposed < total,
        "{total} {exposed}"
    );
    for c in ["from_start", "per_rank_span", "steady_state"] {
        let b = v["bubble"][c].as_f64().unwrap();
        assert!((0.0..1.0).contains(&b), "{c}: {b}");
    }
    assert_eq!(v["bubble"]["from_start"], v["bubble_ratio"]);
}

#[test]
fn moe_needs_a_cost_model_with_all_to_all_times() {
    for args in [
        vec!["sim", "specs/1f1b.sched", "--pp", "2", "--mb", "4", "--moe"],
        vec!["compare", "--pp", "2", "--mb", "4", "--moe"],
        vec![
            "check",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--moe",
            "--cost",
            "unit",
        ],
    ] {
        let out = schedc(&args);
        // Bad usage (the cost model does not fit --moe), as for compare: exit 2.
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("has no [moe] section"), "{args:?}: {err}");
    }
    // `check --moe` without a cost model checks the schedule only.
    let ok = schedc(&[
        "check",
        "specs/1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "4",
        "--moe",
    ]);
    assert_eq!(ok.status.code(), Some(0));
}

#[test]
fn check_names_the_bubble_convention_and_moe_bad_input_exits_1() {
    let out = schedc(&["check", "specs/1f1b.sched", "--pp", "4", "--mb", "8"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("bubble 27.3% (from_start)"));
    let d = tmpdir("moe-bad");
    for (name, src, needle) in [
        (
            "order.sched",
            "vpp 1\nrank r {\n    F(0).attn\n    F(0).mlp\n    F(0).dispatch\n    F(0).combine\n    BW(0)\n}\n",
            "order.sched:5:5",
        ),
        (
            "dense.sched",
            "vpp 1\nmoe []\nrank r {\n    F(0).attn F(0).dispatch F(0).mlp F(0).combine\n    BW(0)\n}\n",
            "dense.sched:4:5",
        ),
    ] {
        let f = d.join(name);
        std::fs::write(&f, src).unwrap();
        let out = schedc(&["check", f.to_str().unwrap(), "--pp", "1", "--mb", "1"]);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(needle), "{name}: {text}");
    }
}

#[test]
fn compare_reports_failures_as_such() {
    let d = tmpdir("compare");
    let deadlock = d.join("deadlock.sched");
    // Rank 0 runs micro-batch 1's forward only after micro-batch 0's backward; rank 1 wants it
    // first: no execution.
    std::fs::write(
        &deadlock,
        "vpp 1\nrank r {\n    if r == 0 { F(0) BW(0) F(0) BW(0) } else { F(0) F(0) BW(0) BW(0) }\n}\n",
    )
    .unwrap();
    let worse = d.join("worse.sched");
    std::fs::write(
        &worse,
        "vpp 1\nparam extra = 0\nrank r {\n    let warmup = min(max(P - r - 1 - extra, 0), M)\n    repeat warmup { F(0) }\n    repeat M - warmup { F(0) BW(0) }\n    repeat warmup { BW(0) }\n}\nexpect bubble(from_start) <= (P - 1) / (M + P - 1)\n",
    )
    .unwrap();
    let broken = d.join("broken.sched");
    std::fs::write(&broken, "vpp 1\nrank r { F(0) F(0) F(0) }\n").unwrap();
    let small = d.join("small.sched");
    std::fs::write(
        &small,
        "vpp 1\nrequire M >= 100, \"needs 100\"\nrank r { F(0) BW(0) }\n",
    )
    .unwrap();
    let files = [&deadlock, &worse, &broken, &small].map(|p| p.to_str().unwrap().to_string());
    let mut args = vec!["compare", "--pp", "2", "--mb", "2"];
    args.extend(files.iter().map(String::as_str));
    args.push("specs/1f1b.sched");
    args.push("tests/cases/overlap-pair.case");
    let out = schedc(&args);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("deadlock: rejected by `schedc check`"),
        "{text}"
    );
    assert!(text.contains("[deadlock]"), "{text}");
    assert!(text.contains("broken: elaboration"), "{text}");
    assert!(text.contains("not applicable at this size"), "{text}");
    assert!(text.contains("small: needs 100"), "{text}");
    assert!(text.contains("1f1b "), "{text}");
    assert!(text.contains("overlap-pair "), "{text}");
    // The worse warmup passes as written; with --param extra=1 it is legal but worse and
    // fails its bubble expectation, reported as such.
    assert!(!text.contains("worse (!)"), "{text}");
    let out = schedc(&[
        "compare",
        "--pp",
        "4",
        "--mb",
        "8",
        "--param",
        "extra=1",
        files[1].as_str(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("worse (!): expectation fails: bubble (from_start convention)"),
        "{text}"
    );
    // A parameter no spec declares is a usage error.
    let out = schedc(&[
        "compare", "--pp", "4", "--mb", "8", "--param", "nope=1", "specs",
    ]);
    assert_eq!(out.status.code(), Some(2));
    // Every spec at a size they all accept: exit 0, each convention labelled.
    let out = schedc(&[
        "compare", "--pp", "4", "--mb", "8", "--moe", "--cost", MOE_COST,
    ]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{text}");
    for col in ["from_start", "per_rank_span", "steady_state", "a2a exposed"] {
        assert!(text.contains(col), "{col}: {text}");
    }
}

/// A spec's `list` block is scheduled under the cost model of `check --cost` (one instance
/// and a sweep), as under `sim --cost`, so its timing expectations judge the orders that those
/// costs give, not the unit-time ones.
#[test]
fn check_cost_schedules_list_blocks_under_the_model() {
    let cost = "F=1,B=2,W=1,BW=3";
    let (pp, mb) = ("4", "12");
    let makespan = |args: &[&str]| {
        let out = schedc(args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["makespan"].as_f64().unwrap()
    };
    let under_cost = makespan(&[
        "sim",
        "specs/v_half.sched",
        "--pp",
        pp,
        "--mb",
        mb,
        "--cost",
        cost,
        "--format",
        "json",
    ]);
    // The unit-time orders, timed under the same costs, are slower.
    let d = tmpdir("listcost");
    let ir = d.join("unit.ir");
    let conv = schedc(&[
        "convert",
        "specs/v_half.sched",
        "--pp",
        pp,
        "--mb",
        mb,
        "--to",
        "ir-text",
        "-o",
        ir.to_str().unwrap(),
    ]);
    assert_eq!(conv.status.code(), Some(0));
    let unit_orders = makespan(&[
        "sim",
        ir.to_str().unwrap(),
        "--cost",
        cost,
        "--format",
        "json",
    ]);
    assert!(under_cost < unit_orders, "{under_cost} vs {unit_orders}");
    // Integer op costs, each op of v_half's 2P stages charged half (a stage holds 1/(2P) of the
    // model): a makespan in halves, written as `twice / 2` below (the language has no decimal
    // literals; `/` in a timing bound divides exactly).
    assert_eq!((2.0 * under_cost).fract(), 0.0);
    let twice = (2.0 * under_cost) as i64;
    // A spec that promises the cost-model makespan: check --cost accepts it, alone and in a
    // sweep; without --cost (unit orders, unit times) the bound is not the one judged.
    let spec = d.join("v_half_bound.sched");
    let text = std::fs::read_to_string(root().join("specs/v_half.sched")).unwrap();
    std::fs::write(&spec, format!("{text}\nexpect makespan <= {twice} / 2\n")).unwrap();
    let s = spec.to_str().unwrap();
    for mbs in [mb, "11..=12"] {
        let out = schedc(&["check", s, "--pp", pp, "--mb", mbs, "--cost", cost]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "--mb {mbs}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::write(
        &spec,
        format!("{text}\nexpect makespan <= {twice} / 2 - 1 / 4\n"),
    )
    .unwrap();
    let out = schedc(&["check", s, "--pp", pp, "--mb", mb, "--cost", cost]);
    assert_eq!(out.status.code(), Some(1));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("makespan"), "{said}");
}

#[test]
fn compare_marks_fixed_size_inputs_not_at_the_size_asked() {
    let case = root().join("../shared/cases/05b-paired-1f1b.case");
    if !case.exists() {
        assert!(
            std::env::var_os("SCHEDC_REQUIRE_SHARED").is_none(),
            "SCHEDC_REQUIRE_SHARED is set but ../shared/cases is missing"
        );
        eprintln!("skipped: ../shared/cases is not next to the repository");
        return;
    }
    let o = schedc(&[
        "compare",
        case.to_str().unwrap(),
        "specs/1f1b.sched",
        "--pp",
        "8",
        "--mb",
        "16",
    ]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("05b-paired-1f1b (*)"), "{out}");
    assert!(
        out.contains(
            "(*) not at the size asked, a fixed-size input: 05b-paired-1f1b is P = 2, M = 2"
        ),
        "{out}"
    );
    assert!(
        !out.contains("1f1b (*)\n") && out.contains("\n1f1b  "),
        "{out}"
    );
}

#[test]
fn zero_sizes_are_bad_usage() {
    for (flag, extra) in [("--pp", "--mb"), ("--mb", "--pp"), ("--vpp", "--pp")] {
        let mut args = vec![
            "check",
            "specs/interleaved_1f1b.sched",
            flag,
            "0",
            extra,
            "4",
        ];
        if flag == "--vpp" {
            args.extend(["--mb", "4"]);
        }
        let o = schedc(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(&format!("{flag} must be at least 1")), "{err}");
    }
}

/// A schedule name with its marker longer than the default column (`interleaved_1f1b (!)`,
/// 20 characters) widens the column: every row's makespan ends under the header's.
#[test]
fn compare_columns_stay_aligned_with_long_names() {
    // interleaved_1f1b with an expectation that fails: its row is marked `(!)`.
    let d = tmpdir("compare-long-names");
    let marked = d.join("interleaved_1f1b.sched");
    let text = std::fs::read_to_string(root().join("specs/interleaved_1f1b.sched")).unwrap();
    std::fs::write(&marked, format!("{text}\nexpect idle == 0 if r == 0\n")).unwrap();
    let o = schedc(&[
        "compare",
        marked.to_str().unwrap(),
        "specs/1f1b.sched",
        "--pp",
        "8",
        "--mb",
        "16",
        "--moe=all:list",
        "--cost",
        "dsv3-h800",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    let header = out
        .lines()
        .find(|l| l.starts_with("schedule "))
        .unwrap_or_else(|| panic!("{out}"));
    let end = header.find("makespan").unwrap() + "makespan".len();
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("interleaved_1f1b") || l.starts_with("1f1b"))
        .collect();
    assert!(
        rows.iter().any(|l| l.starts_with("interleaved_1f1b (!) ")),
        "{out}"
    );
    assert_eq!(rows.len(), 2, "{out}");
    for l in rows {
        // The makespan is the first number after the name; it ends where the header's word ends.
        let name_end = l.find("  ").unwrap();
        let rest = &l[name_end..];
        let num_start = name_end + rest.find(|c: char| c.is_ascii_digit()).unwrap();
        let num_end = num_start + l[num_start..].find(' ').unwrap();
        assert_eq!(num_end, end, "{l}\n{out}");
    }
}

/// `convert --cost` writes the `--moe=STAGES:list` order that `sim --cost` simulated (the same
/// makespan and exposed all-to-all); without `--cost` it writes the unit-time order, which
/// differs.
#[test]
fn convert_writes_the_list_order_of_the_cost_model_given() {
    let d = tmpdir("convert-list-cost");
    let sim = |args: &[&str]| -> (f64, f64) {
        let o = schedc(args);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&o.stderr));
        });
        (
            v["makespan"].as_f64().unwrap(),
            v["a2a"]["exposed"].as_f64().unwrap(),
        )
    };
    let spec = [
        "specs/dualpipe.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--moe=all:list",
    ];
    let mut a = vec!["sim"];
    a.extend(spec);
    a.extend(["--cost", "dsv3-h800", "--format", "json"]);
    let simulated = sim(&a);
    let mut figures = vec![];
    for cost in [Some("dsv3-h800"), None] {
        let out = d.join(format!("{}.ir", cost.unwrap_or("unit")));
        let mut c = vec!["convert"];
        c.extend(spec);
        if let Some(cost) = cost {
            c.extend(["--cost", cost]);
        }
        c.extend(["--to", "ir-text", "-o", out.to_str().unwrap()]);
        let o = schedc(&c);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        figures.push(sim(&[
            "sim",
            out.to_str().unwrap(),
            "--cost",
            "dsv3-h800",
            "--format",
            "json",
        ]));
    }
    assert_eq!(figures[0], simulated);
    assert_ne!(figures[1], simulated);
    // A cost model without all-to-all times cannot order MoE parts.
    let mut c = vec!["convert"];
    c.extend(spec);
    c.extend(["--cost", "unit", "--to", "ir-text"]);
    let o = schedc(&c);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no [moe] section"));
}

/// `--moe=...:list` on an input with its messages written cannot reorder its parts: a note
/// says so (it used to fall back to plain `--moe`'s order silently).
#[test]
fn moe_list_on_an_input_with_messages_says_it_keeps_the_default_order() {
    let d = tmpdir("moe-list-messages");
    let f = d.join("p2.ir");
    std::fs::write(
        &f,
        "pp 2\nstages 2\nmicrobatches 1\nrank 0: F(0,0) SA(0,0->1) RG(1,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n",
    )
    .unwrap();
    let o = schedc(&["check", f.to_str().unwrap(), "--moe=all:list"]);
    assert_eq!(o.status.code(), Some(0));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("note:")
            && err.contains("`--moe=...:list` orders the parts of a compute-only program")
            && err.contains("`SA(0,0->1)`"),
        "{err}"
    );
    // Plain --moe and a compute-only input say nothing.
    let o = schedc(&["check", f.to_str().unwrap(), "--moe=all"]);
    assert!(!String::from_utf8_lossy(&o.stderr).contains("note:"));
    let o = schedc(&[
        "check",
        "specs/1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "2",
        "--moe=all:list",
    ]);
    assert!(!String::from_utf8_lossy(&o.stderr).contains("compute-only"));
}

/// `compare` says it too, once for each such input (it used to say nothing), and its JSON
/// row carries the note.
#[test]
fn compare_moe_list_on_an_input_with_messages_says_it_keeps_the_default_order() {
    let d = tmpdir("compare-moe-list-messages");
    let f = d.join("p2.ir");
    std::fs::write(
        &f,
        "pp 2\nstages 2\nmicrobatches 1\nrank 0: F(0,0) SA(0,0->1) RG(1,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n",
    )
    .unwrap();
    let compare = |moe: &str, format: &str| {
        schedc(&[
            "compare",
            f.to_str().unwrap(),
            "specs/gpipe.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "--cost",
            "dsv3-h800",
            moe,
            "--format",
            format,
        ])
    };
    let o = compare("--moe=all:list", "human");
    let err = String::from_utf8_lossy(&o.stderr);
    let note = format!(
        "note: {}: `--moe=...:list` orders the parts of a compute-only program, and this one has `SA(0,0->1)` written in it",
        f.display()
    );
    assert_eq!(err.matches(&note).count(), 1, "{err}");
    // Only the input with messages: the spec is compute-only.
    assert_eq!(err.matches("note:").count(), 1, "{err}");
    let o = compare("--moe=all:list", "json");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let rows = v["rows"].as_array().expect("rows");
    let notes = |name: &str| {
        rows.iter()
            .find(|r| r["schedule"] == name)
            .map(|r| r.get("notes").cloned())
            .expect("row")
    };
    let p2 = notes("p2").expect("p2 has notes");
    assert_eq!(p2.as_array().map(Vec::len), Some(1), "{p2}");
    assert!(p2[0]
        .as_str()
        .is_some_and(|n| n.contains("keep the default order of plain `--moe`")));
    assert_eq!(notes("gpipe"), None);
    // Plain --moe orders nothing: no note.
    let o = compare("--moe=all", "human");
    assert!(!String::from_utf8_lossy(&o.stderr).contains("note:"));
}

/// `optimize` simulates the parts in plain `--moe`'s order: a `:list` suffix is refused
/// (exit 2), not silently ignored.
#[test]
fn optimize_refuses_a_moe_reordering_suffix() {
    for m in ["--moe=all:list", "--moe=all:adjacent"] {
        let o = schedc(&[
            "optimize",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "4",
            "--cost",
            "dsv3-h800",
            "--max-activations",
            "4",
            m,
            "--time-limit",
            "1",
            "--no-progress",
        ]);
        assert_eq!(o.status.code(), Some(2), "{m}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("are not supported here"), "{err}");
    }
}
