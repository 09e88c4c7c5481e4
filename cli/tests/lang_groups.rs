//! Issue 26 item 4, the language's remaining items: named op groups (`def`), run as a user
//! would.

use std::process::Output;
mod common;
use common::*;

fn write(d: &std::path::Path, name: &str, text: &str) -> String {
    let p = d.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

const PARTS: &str = "tests/data/dualpipev_parts.sched";
const PARTS_INLINE: &str = "tests/data/dualpipev_parts_inline.sched";

/// `def fb(f, b)` in dualpipev_parts.sched: the lowered program of every instance is
/// byte-identical to the one of the same spec with the eight parts written out at each use.
#[test]
fn def_pair_elaborates_byte_identical_to_the_written_out_parts() {
    let mut n = 0;
    for (pp, mb) in [(1, 2), (2, 4), (2, 5), (3, 9), (4, 8), (4, 11)] {
        for (warm, p3) in [(0, 0), (1, 1), (0, 1)] {
            for moe in [None, Some("--moe")] {
                let (pp, mb) = (pp.to_string(), mb.to_string());
                let (w, p) = (format!("warm={warm}"), format!("p3={p3}"));
                let run = |spec: &str| {
                    let mut a = vec![
                        "convert",
                        spec,
                        "--pp",
                        &pp,
                        "--mb",
                        &mb,
                        "--param",
                        &w,
                        "--param",
                        &p,
                        "--to",
                        "ir-text",
                        "--lowered",
                    ];
                    a.extend(moe);
                    let o = schedc(&a);
                    assert_eq!(o.status.code(), Some(0), "{spec}: {}", stderr(&o));
                    stdout(&o)
                };
                let (a, b) = (run(PARTS), run(PARTS_INLINE));
                assert!(a.lines().count() > pp.parse::<usize>().unwrap());
                assert_eq!(a, b, "--pp {pp} --mb {mb} --param {w} --param {p} {moe:?}");
                n += 1;
            }
        }
    }
    assert_eq!(n, 36);
    // The spec with the def is shorter, and `fmt` keeps it (canonical, def included).
    let lines = |p: &str| {
        std::fs::read_to_string(root().join(p))
            .unwrap()
            .lines()
            .count()
    };
    // Four lines shorter with the def and its comment (seven lines) included; each of the
    // four uses is one line instead of two to four.
    assert_eq!(lines(PARTS_INLINE) - 2 - lines(PARTS), 4);
    let o = schedc(&["fmt", "--check", PARTS]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = schedc(&["fmt", PARTS]);
    assert!(
        stdout(&o).contains("def fb(f, b) {\n    BW(b).combine F(f).attn"),
        "{}",
        stdout(&o)
    );
}

/// `fmt` is idempotent on a def written loosely, keeps its comments, and a one-line use.
#[test]
fn def_fmt_round_trips_and_is_idempotent() {
    let d = tmpdir("fmt");
    let spec = write(
        &d,
        "g.sched",
        "vpp 1\ndef  two( c ){F(c)   # first\n BW(c) }\nrank r { repeat M / 2 { two(0) ; two( 0 ) } }\n",
    );
    let o = schedc(&["fmt", &spec]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let once = stdout(&o);
    assert_eq!(
        once,
        "vpp 1\n\ndef two(c) {\n    F(c) # first\n    BW(c)\n}\n\nrank r {\n    repeat M / 2 { two(0) two(0) }\n}\n"
    );
    let again = write(&d, "g2.sched", &once);
    let o = schedc(&["fmt", "--check", &again]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let o = schedc(&["check", &again, "--pp", "2", "--mb", "4"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

/// An error inside an expansion shows the statement in the def and the use it was expanded
/// from, each with its file:line:col (text and JSON).
#[test]
fn def_error_points_at_the_definition_and_the_use() {
    let d = tmpdir("err");
    let spec = write(
        &d,
        "e.sched",
        "vpp 1\ndef pair(c) {\n    F(c)\n    BW(c)\n    F(c)\n}\nrank r {\n    repeat M { pair(0) }\n}\n",
    );
    let o = schedc(&["check", &spec, "--pp", "2", "--mb", "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("has no micro-batch left"), "{e}");
    assert!(e.contains("e.sched:3:5]"), "{e}");
    assert!(e.contains("e.sched:8:16]"), "{e}");
    assert!(e.contains("in this use of `pair`"), "{e}");
    let o = schedc(&["check", &spec, "--pp", "2", "--mb", "2", "--format", "json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let diag = &j["diagnostics"][0];
    assert!(diag["location"].as_str().unwrap().ends_with("e.sched:3:5"));
    let rel = &diag["related"][0];
    assert!(rel["location"].as_str().unwrap().ends_with("e.sched:8:16"));
    assert_eq!(rel["label"], "in this use of `pair`");
}

/// An error of the checks on an op a def emitted (an order error, also under `--moe`) points
/// at the statement in the def and at the use it was expanded from.
#[test]
fn def_check_error_points_at_the_definition_and_the_use() {
    let d = tmpdir("ord");
    let spec = write(
        &d,
        "o.sched",
        "vpp 1\ndef pair(c) {\n    BW(c)\n    F(c)\n}\nrank r {\n    repeat M { pair(0) }\n}\n",
    );
    for moe in [None, Some("--moe")] {
        let mut a = vec!["check", &spec, "--pp", "2", "--mb", "1"];
        a.extend(moe);
        let o = schedc(&a);
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        let e = format!("{}{}", stdout(&o), stderr(&o));
        assert!(e.contains("runs before its forward F(0,0)"), "{e}");
        assert!(e.contains("o.sched:3:5]"), "{e}");
        assert!(e.contains("╰── in this use of `pair`"), "{e}");
    }
    let o = schedc(&["check", &spec, "--pp", "2", "--mb", "1", "--format", "json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let diag = &j["diagnostics"][0];
    assert_eq!(diag["code"], "order");
    assert!(diag["location"].as_str().unwrap().ends_with("o.sched:3:5"));
    let rel = &diag["related"][0];
    assert_eq!(rel["label"], "in this use of `pair`");
    assert!(rel["location"].as_str().unwrap().ends_with("o.sched:7:16"));
}

/// Recursion is refused with a clear error, directly and through a def defined below.
#[test]
fn def_recursion_is_refused() {
    let d = tmpdir("rec");
    let spec = write(
        &d,
        "self.sched",
        "vpp 1\ndef loop_(c) {\n    F(c)\n    loop_(c)\n}\nrank r { loop_(0) }\n",
    );
    let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("`def loop_` uses itself: a def cannot be recursive"),
        "{e}"
    );
    assert!(e.contains("self.sched:4:5]"), "{e}");
    assert!(e.contains("`def loop_` is here"), "{e}");
    let spec = write(
        &d,
        "mutual.sched",
        "vpp 1\ndef a(c) { b(c) }\ndef b(c) { a(c) }\nrank r { a(0) }\n",
    );
    let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("`def a` uses `b`, which is defined below it"),
        "{e}"
    );
    assert!(e.contains("a def sees only the defs above it"), "{e}");
}

/// A use with the wrong number of arguments names the def's parameters and points at it; an
/// unknown name suggests the closest def.
#[test]
fn def_arity_and_unknown_name() {
    let d = tmpdir("arity");
    let spec = write(
        &d,
        "a.sched",
        "vpp 1\ndef pair(c, k) {\n    F(c)\n    BW(k)\n}\nrank r { repeat M { pair(0) } }\n",
    );
    let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("`pair` takes 2 argument(s) (c, k), given 1"),
        "{e}"
    );
    assert!(e.contains("a.sched:6:21]"), "{e}");
    assert!(e.contains("`def pair` is here"), "{e}");
    let spec = write(
        &d,
        "u.sched",
        "vpp 1\ndef pair(c) {\n    F(c)\n    BW(c)\n}\nrank r { repeat M { piar(0) } }\n",
    );
    // An unknown statement is a syntax error (exit 2), found before elaboration; the
    // misuses above are input errors too (issue 26 g).
    let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("the use of a def), found `piar`"), "{e}");
    assert!(e.contains("u.sched:6:21]"), "{e}");
    assert!(
        e.contains("no `def piar` in this file; did you mean `pair`?"),
        "{e}"
    );
    // A def cannot take an op's name.
    let spec = write(
        &d,
        "op.sched",
        "vpp 1\ndef BW(c) { F(c) }\nrank r { F(0) BW(0) }\n",
    );
    let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("`BW` is an op of the language"),
        "{}",
        stderr(&o)
    );
}

/// A def's body sees the items above it and its parameters, not the caller's names: the rank
/// goes in as an argument.
#[test]
fn def_body_sees_its_parameters_not_the_callers_names() {
    let d = tmpdir("scope");
    let spec = write(
        &d,
        "s.sched",
        "vpp 1\nlet k = 1\ndef warm(n) { repeat n { F(0) } }\ndef leak() { repeat w { F(0) } }\nrank r {\n    let w = min(P - r, M)\n    warm(w)\n    repeat M - w { F(0) BW(0) }\n    repeat w { BW(0) }\n}\n",
    );
    let o = schedc(&["check", &spec, "--pp", "4", "--mb", "8"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bad = write(
        &d,
        "leak.sched",
        "vpp 1\ndef leak() { repeat w { F(0) } }\nrank r {\n    let w = 1\n    leak()\n    repeat M - 1 { F(0) BW(0) }\n    BW(0)\n}\n",
    );
    let o = schedc(&["check", &bad, "--pp", "1", "--mb", "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("unknown name `w`"), "{e}");
    assert!(e.contains("in this use of `leak`"), "{e}");
}

const MOE_COST: &str = "../shared/costs/moe-1to1.toml";

/// `src` with `lines` inserted after its `placement` line.
fn with_lines(src: &str, lines: &str) -> String {
    let text = std::fs::read_to_string(root().join(src)).unwrap();
    let at = text.find("\nplacement ").expect("a placement line") + 1;
    let eol = at + text[at..].find('\n').unwrap() + 1;
    format!("{}{lines}{}", &text[..eol], &text[eol..])
}

/// Issue 26 (g): a `def` used with the wrong arity, recursive, using one defined below it,
/// named as an op, defined twice or with a parameter twice exited 1 (a rejected instance),
/// while a use of no `def` exited 2: all are input errors, whatever the instance, so all
/// exit 2 (`syntax`; JSON verdict `unreadable`), in one instance and in a sweep.
#[test]
fn def_misuse_exits_2_like_an_unknown_def() {
    let d = tmpdir("def_exit");
    for (name, text, says) in [
        (
            "rec.sched",
            "vpp 1\ndef a(c) {\n    F(c)\n    a(c)\n}\nrank r { a(0) }\n",
            "`def a` uses itself: a def cannot be recursive",
        ),
        (
            "below.sched",
            "vpp 1\ndef a(c) { b(c) }\ndef b(c) { F(c) BW(c) }\nrank r { a(0) }\n",
            "`def a` uses `b`, which is defined below it",
        ),
        (
            "arity.sched",
            "vpp 1\ndef a(c, k) { F(c) BW(k) }\nrank r { a(0) }\n",
            "`a` takes 2 argument(s) (c, k), given 1",
        ),
        (
            "op.sched",
            "vpp 1\ndef F(c) { BW(c) }\nrank r { F(0) BW(0) }\n",
            "`F` is an op of the language",
        ),
        (
            // Newcomer round 3: the memory ops' names were free for a def, whose use then
            // failed to parse as the op.
            "lend.sched",
            "vpp 1\ndef LEND(c) { F(c) BW(c) }\nrank r { F(0) BW(0) }\n",
            "`LEND` is an op of the language",
        ),
        (
            "recompute.sched",
            "vpp 1\ndef RECOMPUTE(c) { F(c) BW(c) }\nrank r { F(0) BW(0) }\n",
            "`RECOMPUTE` is an op of the language",
        ),
        (
            "twice.sched",
            "vpp 1\ndef a(c) { F(c) BW(c) }\ndef a(c) { F(c) BW(c) }\nrank r { a(0) }\n",
            "`def a` is defined twice",
        ),
        (
            "param.sched",
            "vpp 1\ndef a(c, c) { F(c) BW(c) }\nrank r { a(0, 0) }\n",
            "`def a` names the parameter `c` twice",
        ),
        (
            "unknown.sched",
            "vpp 1\ndef a(c) { F(c) BW(c) }\nrank r { b(0) }\n",
            "no `def b` in this file",
        ),
    ] {
        let spec = write(&d, name, text);
        let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1"]);
        assert_refused(&o, says);
        let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1", "--format", "json"]);
        assert_eq!(o.status.code(), Some(2), "{name}: {}", stdout(&o));
        assert!(
            stdout(&o).contains("\"unreadable\""),
            "{name}: {}",
            stdout(&o)
        );
        let o = schedc(&["sim", &spec, "--pp", "1", "--mb", "1"]);
        assert_refused(&o, says);
        let o = schedc(&["check", &spec, "--pp", "1..=2", "--mb", "1"]);
        assert_eq!(o.status.code(), Some(2), "{name}: {}", stdout(&o));
        assert!(
            stdout(&o).contains("ERROR --pp 2 --mb 1: "),
            "{name}: {}",
            stdout(&o)
        );
    }
}

/// Issue 26 (h): `fn a` and `def a` could share a name (one used in expressions, the other
/// as a statement). Refused (exit 2) in either order, naming both definitions.
#[test]
fn fn_and_def_of_one_name_are_refused_naming_both() {
    let d = tmpdir("fn_def");
    for (name, text, first, second) in [
        (
            "fd.sched",
            "vpp 1\nfn a(x) = x + 1\ndef a(c) {\n    F(c)\n    BW(c)\n}\nrank r { repeat M { a(0) } }\n",
            "fd.sched:2:1]",
            "fd.sched:3:1]",
        ),
        (
            "df.sched",
            "vpp 1\ndef a(c) {\n    F(c)\n    BW(c)\n}\nfn a(x) = x + 1\nrank r { repeat M { a(0) } }\n",
            "df.sched:2:1]",
            "df.sched:6:1]",
        ),
    ] {
        let spec = write(&d, name, text);
        let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1"]);
        assert_refused(&o, "`a` is both a `fn` and a `def`");
        let e = stderr(&o);
        assert!(e.contains(first) || e.contains(second), "{e}");
        assert!(e.contains("`fn a` is here") || e.contains("`def a` is here"), "{e}");
        let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1", "--format", "json"]);
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let text = j.to_string();
        let (l1, l2) = (
            first.trim_end_matches(']').rsplit_once('/').map_or(first, |x| x.1),
            second.trim_end_matches(']'),
        );
        assert!(text.contains(l1.trim_end_matches(']')), "{text}");
        assert!(text.contains(l2), "{text}");
    }
}

/// A spec's `parts list` item gives exactly what `--moe=all:list` gives for the same spec
/// without it (both `moe all`): the program (convert), the simulated step under a cost model
/// (sim), and a check sweep ordered under the cost.
#[test]
fn parts_list_item_equals_moe_all_list_on_the_command_line() {
    let d = tmpdir("parts");
    let mut n = 0;
    for (src, params) in [
        ("specs/dualpipev.sched", vec![]),
        (PARTS, vec!["--param", "warm=0", "--param", "p3=0"]),
        (PARTS, vec![]),
    ] {
        let moe = if src == PARTS { "" } else { "moe all\n" };
        let with = write(
            &d,
            "with.sched",
            &with_lines(src, &format!("{moe}parts list\n")),
        );
        let without = write(&d, "without.sched", &with_lines(src, moe));
        for (pp, mb) in [("2", "4"), ("4", "10")] {
            for cost in [None, Some(MOE_COST)] {
                let run = |spec: &str, extra: &[&str]| {
                    let mut a = vec!["convert", spec, "--pp", pp, "--mb", mb, "--to", "ir-text"];
                    a.extend(&params);
                    a.extend(extra);
                    if let Some(c) = cost {
                        a.extend(["--cost", c]);
                    }
                    let o = schedc(&a);
                    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
                    stdout(&o)
                };
                let a = run(&with, &[]);
                assert_eq!(
                    a,
                    run(&without, &["--moe=all:list"]),
                    "{src} {pp} {mb} {cost:?}"
                );
                // Not plain --moe's order: the item does reorder.
                assert_ne!(a, run(&without, &["--moe"]), "{src} {pp} {mb} {cost:?}");
                n += 1;
            }
        }
        let sim = |spec: &str, extra: &[&str]| {
            let mut a = vec!["sim", spec, "--pp", "4", "--mb", "10", "--cost", MOE_COST];
            a.extend(&params);
            a.extend(extra);
            let o = schedc(&a);
            assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
            stdout(&o)
        };
        assert_eq!(sim(&with, &[]), sim(&without, &["--moe=all:list"]));
        let sweep = |spec: &str, extra: &[&str]| {
            let mut a = vec![
                "check", spec, "--pp", "2..=3", "--mb", "6..=8", "--cost", MOE_COST,
            ];
            a.extend(&params);
            a.extend(extra);
            let o = schedc(&a);
            (
                o.status.code(),
                stdout(&o).replace("without.sched", "with.sched"),
            )
        };
        let (code, out) = sweep(&with, &[]);
        assert_eq!(
            (code, out.clone()),
            sweep(&without, &["--moe=all:list"]),
            "{out}"
        );
    }
    assert_eq!(n, 12);
}

/// `parts list N` is `--moe=all:listN`, `parts adjacent` is `--moe=all:adjacent`; a `--moe`
/// on the command line takes precedence; `fmt` keeps the item; N out of 1..=8 is refused.
#[test]
fn parts_item_window_adjacent_precedence_fmt_and_errors() {
    let d = tmpdir("parts2");
    let src = "specs/dualpipev.sched";
    let conv = |spec: &str, extra: &[&str]| {
        let mut a = vec!["convert", spec, "--pp", "4", "--mb", "8", "--to", "ir-text"];
        a.extend(extra);
        let o = schedc(&a);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        stdout(&o)
    };
    let without = write(&d, "without.sched", &with_lines(src, "moe all\n"));
    let l3 = write(&d, "l3.sched", &with_lines(src, "moe all\nparts list 3\n"));
    assert_eq!(conv(&l3, &[]), conv(&without, &["--moe=all:list3"]));
    let adj = write(
        &d,
        "adj.sched",
        &with_lines(src, "moe all\nparts adjacent\n"),
    );
    assert_eq!(conv(&adj, &[]), conv(&without, &["--moe=all:adjacent"]));
    assert_eq!(conv(&l3, &["--moe"]), conv(&without, &["--moe"]));
    for spec in [&l3, &adj] {
        let o = schedc(&["fmt", "--check", spec]);
        assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    }
    let o = schedc(&["fmt", &l3]);
    assert!(
        stdout(&o).contains("\nmoe all\nparts list 3\n"),
        "{}",
        stdout(&o)
    );
    // The optimizer orders whole ops: a spec whose `parts` item splits them is refused.
    let o = schedc(&[
        "optimize",
        &l3,
        "--pp",
        "2",
        "--mb",
        "4",
        "--max-activations",
        "8",
        "--time-limit",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("`parts list 3`: the spec's `parts` item splits its MoE stages into parts, and the search orders whole ops: give the spec without the item"),
        "{}",
        stderr(&o)
    );
    let bad = write(&d, "bad.sched", &with_lines(src, "moe all\nparts list 9\n"));
    let o = schedc(&["check", &bad, "--pp", "2", "--mb", "4"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("`parts list 9`: the ops in flight must be 1 to 8"),
        "{}",
        stderr(&o)
    );
}

/// The `LINE:COL` of the line `line` in `text` (column 1).
fn line_of(text: &str, line: &str) -> String {
    let n = text.lines().position(|l| l == line).expect("the line") + 1;
    format!("{n}:1")
}

/// Issue 26 (d): `--moe=all:list` under a cost model without all-to-all times is refused
/// (they would take no time), and a spec's `parts list` item, which splits the parts the
/// same way, was timed with all-to-alls at zero. Now every command that is given (or, as
/// `sim` and `compare`, always has) a cost model refuses the item as it refuses the flag,
/// naming the item's location; without a cost model (`check`, `convert`) both pass.
#[test]
fn parts_item_without_all_to_all_times_is_refused_as_moe_list_is() {
    let d = tmpdir("parts_costs");
    let text = with_lines("specs/dualpipev.sched", "moe all\nparts list\n");
    let with = write(&d, "with.sched", &text);
    let at = format!("{with}:{}: `parts list` (the spec's MoE stages split into parts, as by --moe=auto:list) with the cost model `unit`, which has no [moe] section", line_of(&text, "parts list"));
    let flag = "--moe with the cost model `unit`, which has no [moe] section";
    let size = ["--pp", "2", "--mb", "4"];
    let run = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(size);
        schedc(&a)
    };
    for cmd in [
        vec!["sim"],
        vec!["sim", "--cost", "unit"],
        vec!["check", "--cost", "unit"],
        vec!["show", "--cost", "unit"],
        vec!["convert", "--to", "ir-text", "--cost", "unit"],
    ] {
        let mut a = vec![cmd[0], with.as_str()];
        a.extend(&cmd[1..]);
        let o = run(&a);
        assert_refused(&o, &at);
        let mut a = vec![cmd[0], "specs/dualpipev.sched", "--moe=all:list"];
        a.extend(&cmd[1..]);
        assert_refused(&run(&a), flag);
    }
    // A check sweep under --cost refuses it before sweeping.
    let o = schedc(&[
        "check", &with, "--pp", "2..=3", "--mb", "4", "--cost", "unit",
    ]);
    assert_refused(&o, &at);
    // Without a cost model nothing is timed: both pass.
    for extra in [vec!["check"], vec!["convert", "--to", "ir-text"]] {
        let mut a = vec![extra[0], with.as_str()];
        a.extend(&extra[1..]);
        let o = run(&a);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    }
    // With all-to-all times it runs (the item is the flag: the same report).
    let o = run(&["sim", &with, "--cost", MOE_COST]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // compare: the spec's row fails with the reason, the others are compared.
    let o = schedc(&[
        "compare",
        "--pp",
        "2",
        "--mb",
        "4",
        "--specs",
        d.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(&format!("with: {at}")),
        "{}",
        stdout(&o)
    );
}

/// Issue 26 (f): `optimize` on a spec with a `parts` item said "give the spec ... with
/// --moe" when no --moe was given: the refusal names the item (its location) as the cause,
/// and says what --moe does with or without it.
#[test]
fn optimize_refusal_of_a_parts_item_names_the_item() {
    let d = tmpdir("parts_optimize");
    let text = with_lines("specs/dualpipev.sched", "moe all\nparts list\n");
    let with = write(&d, "with.sched", &text);
    let at = format!("{with}:{}: `parts list`: the spec's `parts` item splits its MoE stages into parts, and the search orders whole ops", line_of(&text, "parts list"));
    let base = [
        "optimize",
        with.as_str(),
        "--pp",
        "2",
        "--mb",
        "4",
        "--max-activations",
        "5",
    ];
    let o = schedc(&base);
    assert_refused(
        &o,
        &format!(
            "{at}: give the spec without the item (add --moe[=STAGES] to score with the MoE parts)"
        ),
    );
    let mut a = base.to_vec();
    a.extend(["--moe", "--cost", MOE_COST]);
    let o = schedc(&a);
    assert_refused(&o, &format!("{at} (the item is the spec's part order; --moe does not replace it here): give the spec without the item, keeping --moe"));
}

/// Runs `schedc optimize INPUT --pp P --mb M --max-activations CAP --to FORM -o OUT`.
fn optimize(input: &str, pp: &str, mb: &str, cap: &str, form: &str, out: &str) -> Output {
    let mut a = vec![
        "optimize",
        "--pp",
        pp,
        "--mb",
        mb,
        "--max-activations",
        cap,
        "--time-limit",
        "2",
        "--to",
        form,
        "-o",
        out,
        "--force",
    ];
    if !input.is_empty() {
        a.insert(1, input);
    }
    schedc(&a)
}

/// `optimize --to spec` on a periodic result writes a family in M: its instance at the
/// optimized M is the order written as IR text (byte for byte, as `convert` prints them), it
/// simulates to the reported makespan, other M pass `check` under the same cap, and M below
/// the checked range is refused by its `require`.
#[test]
fn optimize_to_spec_writes_a_family_when_the_order_is_periodic() {
    let d = tmpdir("family");
    let fam = d.join("fam.sched");
    let fam = fam.to_str().unwrap();
    let ir = d.join("inst.ir");
    let ir = ir.to_str().unwrap();
    let o = optimize("specs/1f1b.sched", "4", "8", "4", "spec", fam);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("periodic: wrote a family in M (P fixed), M = 4..=12 step 1 checked by `schedc check` (periods of 5 to 7 instructions per rank, 1 micro-batch(es) per period)"),
        "{}",
        stdout(&o)
    );
    let text = std::fs::read_to_string(fam).unwrap();
    assert!(text.contains("require P == 4,"), "{text}");
    assert!(text.contains("require M >= 4,"), "{text}");
    assert!(text.contains("for k in 0..n_mb - 4 {"), "{text}");
    assert!(!text.contains("literal"), "{text}");
    let o = optimize("specs/1f1b.sched", "4", "8", "4", "ir-text", ir);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let conv = |args: &[&str]| {
        let mut a = vec!["convert"];
        a.extend(args);
        a.extend(["--to", "ir-text"]);
        let o = schedc(&a);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        stdout(&o)
    };
    assert_eq!(conv(&[fam, "--pp", "4", "--mb", "8"]), conv(&[ir]));
    let o = schedc(&["sim", fam, "--pp", "4", "--mb", "8", "--cost", "unit"]);
    assert!(
        stdout(&o).starts_with("makespan 27.000000 s"),
        "{}",
        stdout(&o)
    );
    for (mb, code) in [("5", 0), ("11", 0), ("20", 0), ("3", 1)] {
        let o = schedc(&[
            "check",
            fam,
            "--pp",
            "4",
            "--mb",
            mb,
            "--max-activations",
            "4",
        ]);
        assert_eq!(o.status.code(), Some(code), "M = {mb}: {}", stderr(&o));
    }
    // `fmt` leaves the written family as it is.
    let o = schedc(&["fmt", "--check", fam]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
}

/// Interleaved 1F1B's order repeats every P = 4 micro-batches: the family's M steps by 4.
#[test]
fn optimize_to_spec_family_with_a_period_of_several_micro_batches() {
    let d = tmpdir("family4");
    let fam = d.join("fam.sched");
    let fam = fam.to_str().unwrap();
    let o = optimize("specs/interleaved_1f1b.sched", "4", "16", "8", "spec", fam);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("periodic: wrote a family in M (P fixed), M = 8..=32 step 4"),
        "{}",
        stdout(&o)
    );
    // Only the clauses that constrain M (breakit: `M % 1 == 0` was written).
    let text = std::fs::read_to_string(fam).unwrap();
    assert!(
        text.contains("require M >= 8 && (M - 16) % 4 == 0,"),
        "{text}"
    );
    for (mb, code) in [("12", 0), ("24", 0), ("18", 1)] {
        let o = schedc(&[
            "check",
            fam,
            "--pp",
            "4",
            "--mb",
            mb,
            "--max-activations",
            "8",
        ]);
        assert_eq!(o.status.code(), Some(code), "M = {mb}: {}", stderr(&o));
    }
}

/// A result with no steady state (M = 2 on 4 ranks) is written as the one instance, and the
/// report says so.
#[test]
fn optimize_to_spec_says_not_periodic_and_writes_one_instance() {
    let d = tmpdir("nofamily");
    let out = d.join("one.sched");
    let out = out.to_str().unwrap();
    let o = optimize("specs/1f1b.sched", "4", "2", "4", "spec", out);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(
            "not periodic: wrote one instance (rank 0 repeats no block of ops with shifted micro-batches)"
        ),
        "{}",
        stdout(&o)
    );
    let text = std::fs::read_to_string(out).unwrap();
    assert!(text.contains("require M == 2,"), "{text}");
    assert!(text.contains("literal {"), "{text}");
}

/// Issue 26 (e): `optimize --to spec` at a large M searched the family's smallest M only
/// 11 periods below the optimized M: at M = 300 it wrote `require M >= 289` for a family
/// that holds from M = 4. The smallest M is now found from the fewest periods upward (small
/// instances check fast), with M at doubling distances checked up to the optimized M.
#[test]
fn optimize_family_at_a_large_m_holds_down_to_its_smallest_m() {
    let d = tmpdir("family_large");
    let fam = d.join("fam.sched");
    let fam = fam.to_str().unwrap();
    let o = schedc(&[
        "optimize",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "300",
        "--max-activations",
        "4",
        "--heuristic",
        "--to",
        "spec",
        "-o",
        fam,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("periodic: wrote a family in M (P fixed), M = 4..=8, 12, 20, 36, 68, 132, 260, 300..=304 step 1 checked by `schedc check`, the M between them by the period"),
        "{}",
        stdout(&o)
    );
    let text = std::fs::read_to_string(fam).unwrap();
    assert!(text.contains("require M >= 4,"), "{text}");
    // Every M of the family passes `check` under the cap; below it `require` refuses.
    let o = schedc(&[
        "check",
        fam,
        "--pp",
        "4",
        "--mb",
        "3..=310",
        "--max-activations",
        "4",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("308 instances: 307 passed, 0 failed, 1 outside the family"),
        "{}",
        stdout(&o)
    );
}

/// Newcomer round 3, finding 8: `fn min(a, b) = a` (a built-in function's name) exited 1, a
/// rejected instance, where every other malformed definition exits 2.
#[test]
fn fn_named_like_a_builtin_exits_2() {
    let d = tmpdir("fn_builtin");
    let spec = write(
        &d,
        "fn_min.sched",
        "fn min(a, b) = a\nrank r { F(0) BW(0) }\n",
    );
    let o = schedc(&["check", &spec, "--pp", "1", "--mb", "1"]);
    assert_refused(&o, "`min` is a built-in function; pick another name");
}
