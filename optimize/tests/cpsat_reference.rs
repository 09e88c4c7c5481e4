//! The small grid against an independent solver: OR-Tools CP-SAT's optima
//! (`optimize/tests/data/cpsat_small.jsonl`, written by `optimize/cpsat/prove.py` from the
//! instances of `--example dump_small`; regenerate with the commands in
//! `optimize/cpsat/README.md`).
//!
//! For each of the 216 instances (P in {2, 3, 4}, M in 1..=6, costs unit / profA / profB, caps
//! {P, 2P}, loop and V placements):
//! - CP-SAT's schedule, read back as tokens, passes every check of `schedc check` within the
//!   cap, and our evaluator and the simulator both give it exactly CP-SAT's makespan (the two
//!   models are the same problem);
//! - where CP-SAT proved its makespan optimal, no lower bound of ours exceeds it (the cheap
//!   bound of `crate::bound` and branch and bound's root bound): a soundness check of our
//!   bounds by a solver that shares no code with them;
//! - `prove.py` itself rejects bad input (empty, not JSON, a missing field, a time that is
//!   not positive or not a multiple of 0.001) with the line and exit 2, before solving.
//!
//! `schedc optimize` equalling these optima is measured by `--example cpsat_check` (release,
//! minutes); `optimizer_meets_the_optimum_where_branch_and_bound_did_not_prove` runs it on
//! the instances our own branch and bound could not close.

use schedc::sim::cost::CostModel;
use schedc_optimize::eval::Evaluator;
use schedc_optimize::exact::root_bound;
use schedc_optimize::refdata::small_instance;
use schedc_optimize::search::{optimize, Options};
use schedc_optimize::{Instance, Sched, Tok};

const DATA: &str = include_str!("data/cpsat_small.jsonl");

/// One line of the reference data.
struct Row {
    inst: Instance,
    cost: CostModel,
    label: String,
    makespan: f64,
    proved: bool,
    order: Sched,
}

fn rows() -> Vec<Row> {
    DATA.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let p = v["P"].as_u64().unwrap() as u32;
            let m = v["M"].as_u64().unwrap() as u32;
            let cap = v["cap"].as_u64().unwrap();
            let cn = v["cost"].as_str().unwrap();
            let placement = v["placement"].as_str().unwrap();
            let (inst, cost) = small_instance(placement, p, m, cn, cap).unwrap();
            let order = Sched {
                ranks: v["order"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| {
                        r.as_array()
                            .unwrap()
                            .iter()
                            .map(|t| {
                                let t = t.as_str().unwrap();
                                let s: u32 = t[1..].parse().unwrap();
                                match &t[..1] {
                                    "F" => Tok::F(s),
                                    "B" => Tok::B(s),
                                    "W" => Tok::W(s),
                                    other => panic!("unknown token kind {other}"),
                                }
                            })
                            .collect()
                    })
                    .collect(),
            };
            Row {
                inst,
                cost,
                label: format!("{placement} P={p} M={m} {cn} cap {cap}"),
                makespan: v["cpsat"].as_f64().unwrap(),
                proved: v["proved"].as_bool().unwrap(),
                order,
            }
        })
        .collect()
}

#[test]
fn the_data_covers_the_grid_and_cp_sat_proved_every_instance() {
    let rows = rows();
    assert_eq!(rows.len(), 216, "108 instances per placement");
    let unproved: Vec<&str> = rows
        .iter()
        .filter(|r| !r.proved)
        .map(|r| r.label.as_str())
        .collect();
    assert!(unproved.is_empty(), "not proved by CP-SAT: {unproved:?}");
}

#[test]
fn cp_sat_schedules_pass_check_and_evaluate_to_cp_sat_makespans() {
    for r in rows() {
        let mut ev = Evaluator::new(&r.inst);
        let e = ev
            .eval(&r.order)
            .unwrap_or_else(|f| panic!("{}: CP-SAT's order is not a schedule: {f:?}", r.label));
        assert!(
            (e.makespan - r.makespan).abs() < 1e-9,
            "{}: evaluator {} vs CP-SAT {}",
            r.label,
            e.makespan,
            r.makespan
        );
        let v = schedc_optimize::verify(&r.inst, &r.cost, &r.order)
            .unwrap_or_else(|err| panic!("{}: {err}", r.label));
        assert!(
            (v.sim.makespan - r.makespan).abs() < 1e-9,
            "{}: simulator {} vs CP-SAT {}",
            r.label,
            v.sim.makespan,
            r.makespan
        );
    }
}

#[test]
fn our_bounds_never_exceed_a_cp_sat_optimum() {
    for r in rows().into_iter().filter(|r| r.proved) {
        let lb = schedc_optimize::bound::lower_bound(&r.inst);
        assert!(
            lb <= r.makespan + 1e-9,
            "{}: lower bound {lb} > optimum {}",
            r.label,
            r.makespan
        );
        let rb = root_bound(&r.inst).unwrap();
        assert!(
            rb <= r.makespan + 1e-9,
            "{}: root bound {rb} > optimum {}",
            r.label,
            r.makespan
        );
    }
}

/// The three V instances where our branch and bound runs out of nodes above its bound.
const HARD: [&str; 3] = [
    "v P=3 M=6 profA cap 3",
    "v P=4 M=6 profA cap 4",
    "v P=4 M=6 profB cap 4",
];

/// Our branch and bound, from no incumbent, against CP-SAT on every loop instance and the V
/// instances with P = 2 (144; from no incumbent the larger V ones can run out of nodes): it
/// proves each optimum and finds the same makespan.
#[test]
fn branch_and_bound_proves_cp_sat_s_optimum_from_scratch() {
    let mut n = 0;
    for r in rows()
        .into_iter()
        .filter(|r| r.label.starts_with("loop") || r.inst.p == 2)
    {
        let e = schedc_optimize::exact::solve(&r.inst, None, 2_000_000, None).unwrap();
        assert!(e.proved, "{}: not proved in 2 M nodes", r.label);
        assert!(
            (e.makespan - r.makespan).abs() < 1e-9,
            "{}: branch and bound {} vs CP-SAT {}",
            r.label,
            e.makespan,
            r.makespan
        );
        n += 1;
    }
    assert_eq!(n, 144);
}

/// The three V instances our branch and bound could not close (its node budget ran out
/// above its bound): the search with the CLI's default options (`--exact auto`) reaches
/// CP-SAT's optimum on each.
#[test]
fn optimizer_meets_the_optimum_where_branch_and_bound_did_not_prove() {
    let rows: Vec<Row> = rows()
        .into_iter()
        .filter(|r| HARD.contains(&r.label.as_str()))
        .collect();
    assert_eq!(rows.len(), 3);
    let opts = Options::cli_default();
    for r in rows {
        let out = optimize(&r.inst, &[], &opts, &|_| {});
        assert!(
            (out.makespan - r.makespan).abs() < 1e-9,
            "{}: optimize {} vs CP-SAT optimum {}",
            r.label,
            out.makespan,
            r.makespan
        );
    }
}

/// `prove.py` checks every line before it solves any (and before it imports OR-Tools, so this
/// runs with any `python3`): bad input is an error naming the line, exit 2, no traceback.
#[test]
fn prove_py_rejects_bad_input_naming_the_line() {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/cpsat/prove.py");
    let good = r#"{"placement": "v", "P": 2, "M": 1, "cost": "unit", "cap": 2, "rank_of": [0, 1, 1, 0], "next": [1, 2, 3, null], "prev": [null, 0, 1, 2], "d_f": [1.0, 1.0, 1.0, 1.0], "d_b": [1.0, 1.0, 1.0, 1.0], "d_w": [1.0, 1.0, 1.0, 1.0], "d_bw": [2.0, 2.0, 2.0, 2.0], "lat": 0.0}"#;
    let cases: Vec<(String, &[&str], &str)> = vec![
        (String::new(), &[], "no instances on standard input"),
        ("\n\n".into(), &[], "no instances on standard input"),
        (
            format!("{good}\n{{\"P\": 2, \n"),
            &[],
            "standard input, line 2: not JSON: Expecting property name enclosed in double quotes at column 9",
        ),
        ("[1]\n".into(), &[], "line 1: not a JSON object"),
        (
            format!("\n{}\n", good.replace("\"d_w\"", "\"dw\"")),
            &[],
            "line 2: missing field `d_w`",
        ),
        (
            good.replace("\"d_f\": [1.0,", "\"d_f\": [0.3333,"),
            &[],
            "line 1: op and message times must be multiples of 0.001 seconds",
        ),
        (
            good.replace("\"d_f\": [1.0,", "\"d_f\": [-1.0,"),
            &[],
            "line 1: `d_f` of stage 0 must be a positive, finite time, got -1.0",
        ),
        (
            good.replace("\"lat\": 0.0", "\"lat\": NaN"),
            &[],
            "line 1: `lat` must be a non-negative, finite time, got nan",
        ),
        (
            good.replace("\"d_bw\": [2.0,", "\"d_bw\": [1.5,"),
            &[],
            "line 1: stage 0: BW faster than B + W",
        ),
        (
            good.replace("\"rank_of\": [0, 1, 1, 0]", "\"rank_of\": [0, 1, 2, 0]"),
            &[],
            "line 1: `rank_of` must hold ranks in 0..1",
        ),
        (
            good.into(),
            &["--time-limit", "0"],
            "--time-limit must be a positive number of seconds",
        ),
    ];
    for (input, args, want) in cases {
        let child = Command::new("python3")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let Ok(mut child) = child else {
            eprintln!("skipped: no `python3` on PATH to run {script}");
            return;
        };
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{input:?} {args:?}: {err}");
        assert!(err.contains(want), "{input:?} {args:?}: {err}");
        assert!(!err.contains("Traceback"), "{input:?} {args:?}: {err}");
        assert!(out.stdout.is_empty(), "{input:?} {args:?}: wrote output");
    }
}
