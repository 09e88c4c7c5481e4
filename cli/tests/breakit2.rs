//! Findings of the second newcomer report (`breakit_2026-12-04.md`) on the command line:
//! one test per finding, named after its number. Each runs the `schedc` binary as a user
//! would.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_schedc"));
    c.current_dir(root());
    c.env_remove("SCHEDC_MEMORY_LIMIT");
    c.env("RUST_BACKTRACE", "0");
    c
}

fn schedc(args: &[&str]) -> Output {
    bin().args(args).output().expect("runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("schedc-breakit2-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

// Finding 11: every `--format json` error of sim, compare, optimize, plan and check is one
// `{"error": ..., "exit": N}` object on standard output (the report's list of cases).
#[test]
fn finding11_json_error_object_on_every_error_path() {
    let d = tmpdir("f11");
    let syn = d.join("syntax.sched");
    std::fs::write(&syn, "schedule \"x\"\nrank r {\n  F(0 BW(0)\n}\n").unwrap();
    let syn = s(&syn);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["sim", "/nonexistent.csv"],
            "cannot read `/nonexistent.csv`",
        ),
        (
            vec![
                "sim",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--cost",
                "/nonexistent.toml",
            ],
            "cannot read cost model `/nonexistent.toml`",
        ),
        (
            vec!["sim", syn, "--pp", "2", "--mb", "2"],
            "syntax.sched:3:",
        ),
        (
            vec![
                "sim",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--moe",
                "--cost",
                "unit",
            ],
            "has no [moe] section",
        ),
        (
            vec![
                "compare",
                "--pp",
                "4",
                "--mb",
                "8",
                "--cost",
                "/nonexistent.toml",
            ],
            "cannot read cost model",
        ),
        (
            vec!["compare", "/nonexistent.sched", "--pp", "4", "--mb", "8"],
            "`/nonexistent.sched` does not exist",
        ),
        (
            vec!["compare", "--pp", "0", "--mb", "8"],
            "must be at least 1",
        ),
        (
            vec![
                "optimize",
                "--pp",
                "4",
                "--mb",
                "8",
                "--max-activations",
                "0",
            ],
            "--max-activations 0 is below the minimum",
        ),
        (
            vec![
                "optimize",
                "/nonexistent.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--max-activations",
                "4",
            ],
            "cannot read `/nonexistent.sched`",
        ),
        (
            vec![
                "optimize",
                syn,
                "--pp",
                "2",
                "--mb",
                "2",
                "--max-activations",
                "2",
            ],
            "syntax.sched:3:",
        ),
        (
            vec![
                "optimize",
                "--pp",
                "4",
                "--mb",
                "8",
                "--max-activations",
                "4",
                "--moe",
                "--cost",
                "unit",
            ],
            "has no [moe] section",
        ),
        (
            vec![
                "optimize",
                "--pp",
                "4",
                "--mb",
                "8",
                "--max-activations",
                "4",
                "--time-limit",
                "0",
            ],
            "--time-limit must be a positive number of seconds, got 0",
        ),
        (
            vec!["plan", "--gpus", "0", "--model", "dsv3"],
            "--gpus must be",
        ),
        (
            vec!["plan", "--gpus", "8", "--model", "/nonexistent"],
            "unknown model `/nonexistent`",
        ),
        (
            vec![
                "check",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--cost",
                "/nonexistent.toml",
            ],
            "cannot read cost model",
        ),
        (
            vec![
                "check",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--set",
                "foo=1",
            ],
            "unknown cost key `foo`",
        ),
        (
            vec![
                "check",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--moe=all:list",
                "--cost",
                "unit",
            ],
            "has no [moe] section",
        ),
        (
            vec![
                "check",
                "specs/1f1b.sched",
                "--pp",
                "2..=4",
                "--mb",
                "8",
                "--cost",
                "/nonexistent.toml",
            ],
            "cannot read cost model",
        ),
        // A usage error that clap finds is one object too.
        (
            vec!["sim", "specs/1f1b.sched", "--bogus"],
            "unexpected argument '--bogus'",
        ),
    ];
    for (mut args, want) in cases {
        args.extend(["--format", "json"]);
        let o = schedc(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not JSON ({e}): {}", stdout(&o)));
        assert_eq!(v["exit"], 2, "{args:?}: {v}");
        let err = v["error"].as_str().unwrap_or_default();
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.starts_with("error: "), "{args:?}: {err}");
        // One object, nothing else.
        assert_eq!(stdout(&o).lines().count(), 1, "{args:?}");
    }
    // check's own objects (an unreadable input) carry the exit status too.
    let o = schedc(&["check", "/nonexistent.ir", "--format", "json"]);
    assert_eq!(o.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["verdict"].as_str(), v["exit"].as_u64()),
        (Some("unreadable"), Some(2))
    );
    // A failure that prints its own report keeps it (no second object): compare's failed rows.
    let o = schedc(&[
        "compare",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v.get("error").is_none(), "{v}");
}
