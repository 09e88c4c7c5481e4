//! The memory limit (issue 11): every command refuses, with exit status 2 and the estimate,
//! any instance whose estimated memory exceeds the limit (`SCHEDC_MEMORY_LIMIT`, default 8
//! GiB; the estimates are documented in the book's CLI chapter), before it allocates it.

use std::path::PathBuf;
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn run(limit: Option<&str>, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_schedc"));
    c.current_dir(root()).args(args);
    match limit {
        Some(l) => c.env("SCHEDC_MEMORY_LIMIT", l),
        None => c.env_remove("SCHEDC_MEMORY_LIMIT"),
    };
    c.output().unwrap()
}

/// Runs under an address-space limit of 3 GiB (`ulimit -v`): a command that tried to build
/// what it refuses would abort here instead of exiting 2.
fn run_capped(args: &[&str]) -> Output {
    let bin = env!("CARGO_BIN_EXE_schedc");
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 3145728; exec '{bin}' {}",
            quoted.join(" ")
        ))
        .current_dir(root())
        .env_remove("SCHEDC_MEMORY_LIMIT")
        .output()
        .unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("schedc-limits-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn refused(o: &Output, what: &str) {
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{what}: {e}");
    assert!(
        e.contains("more than the limit of") || e.contains("the most schedc reads"),
        "{what}: {e}"
    );
    assert!(e.contains("SCHEDC_MEMORY_LIMIT"), "{what}: {e}");
}

#[test]
fn every_command_refuses_an_instance_over_the_default_limit() {
    let dir = tmp("default");
    let out = dir.join("out");
    let o = out.to_str().unwrap();
    let big = ["--pp", "100000", "--mb", "100000"];
    let cases: Vec<Vec<&str>> = vec![
        [&["check", "specs/1f1b.sched"][..], &big].concat(),
        vec![
            "check",
            "specs/1f1b.sched",
            "--pp",
            "2..=100000:1000",
            "--mb",
            "100000",
        ],
        [&["show", "specs/1f1b.sched"][..], &big].concat(),
        [
            &["convert", "specs/1f1b.sched", "--to", "ir-text"][..],
            &big,
        ]
        .concat(),
        [&["sim", "specs/1f1b.sched"][..], &big].concat(),
        vec!["compare", "--pp", "100000", "--mb", "100000"],
        vec![
            "plan",
            "--gpus",
            "64",
            "--model",
            "dense70b",
            "--global-batch",
            "100000000000",
        ],
        vec!["run", "specs/1f1b.sched", "--pp", "4", "--mb", "1000000"],
        vec!["run", "specs/1f1b.sched", "--pp", "100000", "--mb", "8"],
        vec![
            "run",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "--steps",
            "100000000",
            "--verify",
        ],
        vec![
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "4",
            "--mb",
            "1000000",
            "-o",
            o,
        ],
    ];
    for args in &cases {
        refused(&run(None, args), &format!("{args:?}"));
        // Refused before the memory is taken: the same under a 3 GiB address-space cap.
        refused(&run_capped(args), &format!("{args:?} (capped)"));
    }
    assert!(!out.exists());
}

#[test]
fn a_lower_limit_applies_to_files_too() {
    let dir = tmp("files");
    // An IR text of 8192 compute ops: about 90 MB by the check estimate.
    let ir = dir.join("big.ir");
    let o = run(
        None,
        &[
            "convert",
            "specs/1f1b.sched",
            "--pp",
            "8",
            "--mb",
            "512",
            "--to",
            "ir-text",
            "-o",
            ir.to_str().unwrap(),
        ],
    );
    assert!(o.status.success());
    let f = ir.to_str().unwrap();
    for args in [
        vec!["check", f],
        vec!["show", f],
        vec!["sim", f],
        vec!["convert", f, "--to", "ir-json", "--lowered"],
    ] {
        refused(&run(Some("70M"), &args), &format!("{args:?}"));
        // Under the default limit the same file is fine.
        let ok = run(None, &args);
        assert!(ok.status.success(), "{args:?}");
    }
    // `test` reports a case over the limit as unreadable (exit 2).
    let o = run(Some("32M"), &["test", "tests/cases/overlap-pair.case"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stdout).contains("more than the limit"));
    // An input larger than a sixteenth of the limit is not read at all (fmt included).
    let huge = dir.join("huge.sched");
    let mut text = std::fs::read_to_string(root().join("specs/1f1b.sched")).unwrap();
    text.push_str(&"# padding\n".repeat(300_000));
    std::fs::write(&huge, text).unwrap();
    for cmd in ["fmt", "check"] {
        let o = run(
            Some("32M"),
            &[cmd, huge.to_str().unwrap(), "--pp", "2", "--mb", "2"]
                [..if cmd == "fmt" { 2 } else { 6 }],
        );
        refused(&o, cmd);
    }
    // A limit that is not a size is bad usage.
    let o = run(
        Some("lots"),
        &["check", "specs/1f1b.sched", "--pp", "2", "--mb", "2"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("SCHEDC_MEMORY_LIMIT: invalid size"));
}

#[test]
fn instances_under_the_limit_run() {
    // The README's sizes are far below the default limit.
    let o = run(
        None,
        &["check", "specs/dualpipe.sched", "--pp", "16", "--mb", "64"],
    );
    assert!(o.status.success());
    let o = run(
        Some("200M"),
        &["check", "specs/1f1b.sched", "--pp", "8", "--mb", "64"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
