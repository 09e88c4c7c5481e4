//! The language and `--moe=...:list` findings of the newcomer report of 2026-12-04
//! (`shared/notes/breakit_2026-12-04.md`), one test per item, run as a user would.

use std::process::Output;
mod common;
use common::*;

const MOE_COST: &str = "../shared/costs/moe-1to1.toml";
const PARTS: &str = "tests/data/dualpipev_parts.sched";

// Item 10: `rank N:` lines indented inside `literal { }` start ranks (the block's common
// indentation is dropped); errors still point at the right line and column.
#[test]
fn item10_indented_rank_lines_in_a_literal_block() {
    let d = tmpdir("item10");
    let ok = d.join("lit4.sched");
    std::fs::write(
        &ok,
        "literal {\n  rank 0: F(0,0) BW(0,0)\n  rank 1: F(1,0) BW(1,0)\n}\n",
    )
    .unwrap();
    let o = schedc(&["check", ok.to_str().unwrap(), "--pp", "2", "--mb", "1"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("accepted — pp 2, 2 stages"),
        "{}",
        stdout(&o)
    );
    // A continuation line, indented further, still continues its rank.
    let cont = d.join("cont.sched");
    std::fs::write(
        &cont,
        "literal {\n    rank 0: F(0,0)\n        BW(0,0)\n    rank 1: F(1,0) BW(1,0)\n}\n",
    )
    .unwrap();
    let o = schedc(&["check", cont.to_str().unwrap(), "--pp", "2", "--mb", "1"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // An error in the block is located in the spec, at the op.
    let bad = d.join("bad.sched");
    std::fs::write(
        &bad,
        "literal {\n  rank 0: F(0,0) BW(0,0)\n  rank 1: F(1,0) QQ(1,0)\n}\n",
    )
    .unwrap();
    let o = schedc(&["check", bad.to_str().unwrap(), "--pp", "2", "--mb", "1"]);
    assert_ne!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("unknown op `QQ`"), "{}", stderr(&o));
    assert!(stderr(&o).contains("bad.sched:3:18"), "{}", stderr(&o));
}

// Item 12: under `:list` and `:adjacent` a spec's expectations are checked on its own order
// (plain `--moe`): the README's flagship commands exit 0.
#[test]
fn item12_list_expectations_are_checked_on_the_spec_order() {
    let o = schedc(&[
        "sim",
        "specs/dualpipe.sched",
        "--pp",
        "8",
        "--mb",
        "16",
        "--moe=all:list",
        "--cost",
        MOE_COST,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("makespan 0.889832 s"), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("0.727527 s exposed (23.7%"),
        "{}",
        stdout(&o)
    );
    assert!(
        stderr(&o).contains("checked on it with plain `--moe`"),
        "{}",
        stderr(&o)
    );
    for (mode, row) in [
        ("--moe=all:list", "dualpipe               0.8898"),
        ("--moe=all:adjacent", "dualpipe               0.9270"),
    ] {
        let o = schedc(&[
            "compare", "--pp", "8", "--mb", "16", mode, "--cost", MOE_COST,
        ]);
        assert_eq!(o.status.code(), Some(0), "{mode}: {}", stderr(&o));
        let out = stdout(&o);
        assert!(!out.contains("(!)"), "{mode}: {out}");
        // The name column is as wide as the longest spec name.
        let want: Vec<&str> = row.split_whitespace().collect();
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().take(2).eq(want.iter().copied())),
            "{mode}: {out}"
        );
        assert!(out.contains("checked on it with plain --moe"), "{out}");
    }
    // check, one instance and a sweep.
    let o = schedc(&[
        "check",
        "specs/dualpipe.sched",
        "--pp",
        "8",
        "--mb",
        "16",
        "--moe=all:list",
        "--cost",
        MOE_COST,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = schedc(&[
        "check",
        "specs/zbv.sched",
        "--pp",
        "2..=4",
        "--mb",
        "4..=8",
        "--moe=all:list",
        "--cost",
        MOE_COST,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("15 passed, 0 failed") || stdout(&o).contains("15 passed, 0 failed"),
        "{}{}",
        stdout(&o),
        stderr(&o)
    );
}

// Item 12: an expectation that is false of the spec's own order still fails under `:list`.
#[test]
fn item12_a_false_expectation_still_fails_under_list() {
    let d = tmpdir("item12");
    let spec = d.join("wrong.sched");
    let text = std::fs::read_to_string(root().join("specs/1f1b.sched")).unwrap()
        + "expect idle == 3 * (P - 1) + 1\n";
    std::fs::write(&spec, text).unwrap();
    let o = schedc(&[
        "sim",
        spec.to_str().unwrap(),
        "--pp",
        "4",
        "--mb",
        "8",
        "--moe=all:list",
        "--cost",
        MOE_COST,
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("unit-time idle does not hold on 4 rank(s): rank 0: 9, expected == 10"),
        "{}",
        stderr(&o)
    );
}

/// The summary line of a check sweep.
fn sweep_summary(o: &Output) -> String {
    let all = format!("{}{}", stdout(o), stderr(o));
    all.lines()
        .find(|l| l.contains(" instances: "))
        .unwrap_or_default()
        .to_string()
}

// Issue: `--moe=STAGES:list` kept the parts of hand-split ops out of order ("BW(0,1).mlp runs
// after a later part of the same BW").
#[test]
fn list_keeps_the_parts_of_hand_split_ops_in_order() {
    let o = schedc(&[
        "check",
        PARTS,
        "--pp",
        "2",
        "--mb",
        "4",
        "--param",
        "warm=0",
        "--param",
        "p3=0",
        "--moe=all:list",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    // The sweep, with and without the overlaps the spec adds, in unit times and under the
    // cost model.
    for (warm, p3) in [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")] {
        for cost in [None, Some(MOE_COST)] {
            let (w, p) = (format!("warm={warm}"), format!("p3={p3}"));
            let mut args = vec![
                "check",
                PARTS,
                "--pp",
                "2..=4",
                "--mb",
                "4..=12",
                "--param",
                &w,
                "--param",
                &p,
                "--moe=all:list",
            ];
            if let Some(c) = cost {
                args.extend(["--cost", c]);
            }
            let o = schedc(&args);
            assert_eq!(
                sweep_summary(&o),
                format!("{PARTS}: 27 instances: 21 passed, 0 failed, 6 outside the family (refused by `require`)"),
                "{args:?}"
            );
            assert_eq!(o.status.code(), Some(0), "{args:?}");
        }
    }
}

// Issue: a `check` sweep with `--moe=...:list --cost FILE` ordered the parts under unit
// times; each instance is now judged as `check` judges it alone (the cost's order). (Cap 24
// since the list scheduler's rollout, issue 26 item 5: hanayo's peak here went 27 -> 25.)
#[test]
fn check_sweep_orders_list_parts_under_the_cost() {
    let one = schedc(&[
        "check",
        "specs/hanayo.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--moe=all:list8",
        "--cost",
        MOE_COST,
        "--max-activations",
        "24",
        "--format",
        "json",
    ]);
    assert_eq!(one.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&one.stdout).unwrap();
    let first = v["diagnostics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["severity"] == "error")
        .unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        first,
        "rank 2 holds 25 live activations here, over the budget of 24 (its peak is 25)"
    );
    let sweep = schedc(&[
        "check",
        "specs/hanayo.sched",
        "--pp",
        "4",
        "--mb",
        "8..=9",
        "--moe=all:list8",
        "--cost",
        MOE_COST,
        "--max-activations",
        "24",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&sweep.stdout).unwrap();
    let at8 = v["failed"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["mb"] == 8)
        .unwrap();
    assert_eq!(at8["error"].as_str().unwrap(), format!("[memory] {first}"));
}

/// `convert SPEC --pp 8 --mb 16 --moe=all:list --cost MOE_COST --to ir-text` with `from`
/// replaced (once) by `to`, checked: the output with the exit status.
fn check_mutated_list_program(d: &std::path::Path, from: &str, to: &str) -> (Option<i32>, String) {
    let ir = d.join("list.ir");
    let o = schedc(&[
        "convert",
        "specs/dualpipe.sched",
        "--pp",
        "8",
        "--mb",
        "16",
        "--moe=all:list",
        "--cost",
        MOE_COST,
        "--to",
        "ir-text",
        "-o",
        ir.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = std::fs::read_to_string(&ir).unwrap();
    assert!(text.contains(from), "{from}");
    let m = d.join("mut.ir");
    std::fs::write(&m, text.replacen(from, to, 1)).unwrap();
    let o = schedc(&["check", m.to_str().unwrap()]);
    (o.status.code(), format!("{}{}", stdout(&o), stderr(&o)))
}

// Item 13: a duplicated MoE part names the earlier copy of the same part.
#[test]
fn item13_duplicate_part_names_its_own_first_copy() {
    let d = tmpdir("item13");
    let (code, out) = check_mutated_list_program(&d, "F(0,0).mlp", "F(0,0).mlp F(0,0).mlp");
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("F(0,0).mlp appears more than once"), "{out}");
    assert!(
        out.contains("first occurrence: rank 0 position 3 `F(0,0).mlp`"),
        "{out}"
    );
    let (code, out) =
        check_mutated_list_program(&d, "F(0,0).combine", "F(0,0).combine F(0,0).combine");
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("first occurrence: rank 0 position 5 `F(0,0).combine`"),
        "{out}"
    );
    let (code, out) = check_mutated_list_program(&d, "W(15,0).attn", "W(15,0).attn W(15,0).attn");
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("`W(15,0).attn`"), "{out}");
    assert!(
        !out.contains("first occurrence: rank 0 position 0 `W(15,0).mlp`"),
        "{out}"
    );
}

// Item 15: a spec cannot redefine the instance's built-in names.
#[test]
fn item15_builtin_names_cannot_be_redefined() {
    let d = tmpdir("item15");
    for (text, name, what) in [
        (
            "let M = 1\nrank r { for i in 0..M { F(0) BW(0) } }\n",
            "M",
            "the number of micro-batches, `--mb`",
        ),
        (
            "param M = 1\nrank r { for i in 0..M { F(0) BW(0) } }\n",
            "M",
            "the number of micro-batches, `--mb`",
        ),
        (
            "param P = 3\nrank r { repeat M { F(0) BW(0) } }\n",
            "P",
            "the number of ranks, `--pp`",
        ),
        (
            "rank r { for V in 0..M { F(0) BW(0) } }\n",
            "V",
            "the number of virtual",
        ),
        (
            "fn f(S) = S\nrank r { repeat M { F(0) BW(0) } }\n",
            "S",
            "the number of stages",
        ),
    ] {
        let f = d.join("x.sched");
        std::fs::write(&f, text).unwrap();
        let mut args = vec!["check", f.to_str().unwrap(), "--pp", "2", "--mb", "4"];
        if name == "P" {
            args.extend(["--param", "P=5"]);
        }
        let o = schedc(&args);
        assert_eq!(o.status.code(), Some(1), "{text}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(&format!("`{name}` is built in ({what}")),
            "{text}: {}",
            stderr(&o)
        );
        assert!(stderr(&o).contains("choose"), "{}", stderr(&o));
    }
}

// Item 20: `show` takes `--cost` and draws the `:list` order `sim --cost` timed (the
// program `convert --cost` writes).
#[test]
fn item20_show_draws_the_list_order_under_the_cost() {
    let args = [
        "specs/dualpipe.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--moe=all:list",
    ];
    let shown = schedc(&[&["show"][..], &args, &["--cost", MOE_COST]].concat());
    assert_eq!(shown.status.code(), Some(0), "{}", stderr(&shown));
    let conv = schedc(
        &[
            &["convert"][..],
            &args,
            &["--cost", MOE_COST, "--to", "ir-text", "-o", "-"],
        ]
        .concat(),
    );
    assert_eq!(conv.status.code(), Some(0), "{}", stderr(&conv));
    // Rank 0's compute ops, in order, in both.
    let grid = stdout(&shown);
    let row: Vec<&str> = grid
        .lines()
        .find(|l| l.trim_start().starts_with("rank 0 "))
        .unwrap()
        .split_whitespace()
        .skip(2)
        .filter(|t| *t != ".")
        .collect();
    let ir = stdout(&conv);
    let prog: Vec<&str> = ir
        .lines()
        .find(|l| l.starts_with("rank 0:"))
        .unwrap()
        .split_whitespace()
        .skip(2)
        .filter(|t| t.starts_with("F(") || t.starts_with("B") || t.starts_with("W("))
        .collect();
    assert_eq!(row.len(), 74, "{row:?}");
    assert_eq!(row, prog);
    // Unit times order the parts differently: the grid follows the model.
    let unit = schedc(&[&["show"][..], &args].concat());
    assert_ne!(stdout(&unit), grid);
    // `--cost unit` has no all-to-all times: refused as elsewhere.
    let o = schedc(&[&["show"][..], &args, &["--cost", "unit"]].concat());
    assert_eq!(o.status.code(), Some(2));
}

/// The `makespan` of a `--format json` report (`sim`) or of a spec's row (`compare`).
fn json_makespan(args: &[&str]) -> f64 {
    let o = schedc(args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    match v.get("rows") {
        Some(rows) => rows[0]["figures"]["makespan"].as_f64().unwrap(),
        None => v["makespan"].as_f64().unwrap(),
    }
}

// Issue: `sim` charged a stage of a V-way split the whole op time and `compare` 1/V of it
// (5.250 vs 2.694 s for one instance): both now time a stage as holding 1/(P V) of the model.
#[test]
fn sim_and_compare_agree_for_v_above_one() {
    for (spec, extra) in [
        ("specs/interleaved_1f1b.sched", vec!["--vpp", "2", "--moe"]),
        ("specs/zbv.sched", vec!["--moe"]),
        ("specs/dualpipev.sched", vec!["--moe=all:list"]),
        ("specs/1f1b.sched", vec!["--moe"]),
    ] {
        let inst = [
            &[spec, "--pp", "4", "--mb", "8"][..],
            &extra,
            &["--cost", MOE_COST],
        ]
        .concat();
        let sim = json_makespan(&[&["sim"][..], &inst, &["--format", "json"]].concat());
        let cmp = json_makespan(&[&["compare"][..], &inst, &["--format", "json"]].concat());
        assert!(
            (sim - cmp).abs() <= 1e-12 * sim,
            "{spec}: sim {sim} vs compare {cmp}"
        );
    }
    // The figure itself: ZB-V at unit times, 8 stages on 4 ranks, each op half a unit.
    let zbv = json_makespan(&[
        "sim",
        "specs/zbv.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--format",
        "json",
    ]);
    assert_eq!(zbv, 25.5);
    let o = schedc(&["sim", "specs/zbv.sched", "--pp", "4", "--mb", "8"]);
    assert!(
        stderr(&o)
            .contains("each of this schedule's 8 stages per direction is charged 0.5 of them"),
        "{}",
        stderr(&o)
    );
    // V = 1 is unchanged.
    let one = json_makespan(&[
        "sim",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--format",
        "json",
    ]);
    assert_eq!(one, 33.0);
}

// Newcomer round 4, finding 10: a shape line (`pp 2`) inside `literal { }` said "`pp` is
// given twice (first on line 1)" of a header the user never wrote, exit 1; now it says what
// a literal block holds, at the line, exit 2 (malformed input).
#[test]
fn round4_finding10_a_shape_line_in_a_literal_block() {
    let d = tmpdir("round4-10");
    let f = d.join("litpp.sched");
    std::fs::write(
        &f,
        "schedule \"lit\"\nliteral {\npp 2\nrank 0: F(0,0) BW(0,0)\nrank 1: F(1,0) BW(1,0)\n}\n",
    )
    .unwrap();
    let o = schedc(&["check", f.to_str().unwrap(), "--pp", "2", "--mb", "1"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.contains("`pp` is not written in a literal block"), "{e}");
    assert!(e.contains("litpp.sched:3:1"), "{e}");
    assert!(!e.contains("first on line"), "{e}");
}
