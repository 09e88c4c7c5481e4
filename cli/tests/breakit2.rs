//! Findings of the second newcomer report (`breakit_2026-12-04.md`) on the command line:
//! one test per finding, named after its number. Each runs the `schedc` binary as a user
//! would.

use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::*;

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

/// Waits for `c` at most `secs` seconds; kills it (it is ours) and fails the test past that.
fn wait_at_most(mut c: std::process::Child, secs: u64, what: &str) -> Output {
    let t0 = std::time::Instant::now();
    loop {
        if c.try_wait().unwrap().is_some() {
            return c.wait_with_output().unwrap();
        }
        if t0.elapsed() > std::time::Duration::from_secs(secs) {
            let _ = c.kill();
            let _ = c.wait();
            panic!("{what}: still running after {secs} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn spawn(args: &[&str]) -> std::process::Child {
    bin()
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

// Finding 7: `run --trace` streams the trace to its temporary file while the run goes (the
// file grows between steps), and the result is the whole trace, renamed into place.
#[test]
fn finding07_run_trace_is_written_while_the_run_goes() {
    let d = tmpdir("f07");
    let t = d.join("t.json");
    let child = spawn(&[
        "run",
        "specs/1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "4",
        "--steps",
        "60",
        "--trace",
        s(&t),
    ]);
    let tmp = d.join(format!(".t.json.schedc-{}-out.tmp", child.id()));
    // Two different non-zero sizes of the temporary file while the final one is absent.
    let mut sizes = Vec::new();
    let t0 = std::time::Instant::now();
    while sizes.len() < 2 && t0.elapsed() < std::time::Duration::from_secs(120) {
        if let Ok(m) = std::fs::metadata(&tmp) {
            if m.len() > 100 && sizes.last() != Some(&m.len()) && !t.exists() {
                sizes.push(m.len());
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let o = wait_at_most(child, 300, "run --trace");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        sizes.len(),
        2,
        "the trace file did not grow during the run: {sizes:?}"
    );
    assert!(!tmp.exists());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&t).unwrap()).unwrap();
    let steps: std::collections::BTreeSet<u64> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["args"]["step"].as_u64())
        .collect();
    assert_eq!(steps.len(), 60);
    assert_eq!(v["displayTimeUnit"], "ms");
}

// Finding 8: an output that cannot be written is refused before the work, by every command
// that writes a file: a directory where files cannot be created (/sys) or that does not
// exist. The commands would run for minutes otherwise (`--steps 100000`, a large search).
#[test]
fn finding08_unwritable_output_is_refused_before_the_work() {
    let d = tmpdir("f08");
    let exists = d.join("exists.json");
    std::fs::write(&exists, "x").unwrap();
    for dir in ["/sys", "/nonexistent-schedc-dir"] {
        let f = format!("{dir}/out.json");
        let cdir = format!("{dir}/progs");
        let cases: Vec<Vec<&str>> = vec![
            vec![
                "run",
                "specs/1f1b.sched",
                "--pp",
                "2",
                "--mb",
                "2",
                "--steps",
                "100000",
                "--trace",
                &f,
            ],
            vec![
                "optimize",
                "--pp",
                "16",
                "--mb",
                "64",
                "--max-activations",
                "16",
                "--cost",
                "F=1,B=1.1,W=0.9,latency=0.05",
                "-o",
                &f,
            ],
            vec![
                "sim",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--svg",
                &f,
            ],
            vec![
                "sim",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--trace",
                &f,
            ],
            vec![
                "convert",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--to",
                "ir-text",
                "-o",
                &f,
            ],
            vec![
                "compile",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "-o",
                &cdir,
            ],
        ];
        for args in cases {
            let o = wait_at_most(spawn(&args), 60, &format!("{args:?}"));
            assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
            let e = stderr(&o);
            assert!(
                e.contains(&format!("cannot write `{dir}/")),
                "{args:?}: {e}"
            );
            assert_eq!(stdout(&o), "", "{args:?}");
        }
    }
    // The probe leaves nothing behind.
    let o = schedc(&[
        "sim",
        "specs/1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "2",
        "--svg",
        s(&exists),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
}

// Finding 8: when the final write fails all the same (here /dev/full, written in place),
// the report is printed first, then the error, exit status 2.
#[test]
fn finding08_failed_write_still_prints_the_report() {
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "run",
                "specs/1f1b.sched",
                "--pp",
                "2",
                "--mb",
                "2",
                "--steps",
                "2",
                "--trace",
                "/dev/full",
            ],
            "ran 2 step(s)",
        ),
        (
            vec![
                "sim",
                "specs/1f1b.sched",
                "--pp",
                "4",
                "--mb",
                "8",
                "--svg",
                "/dev/full",
            ],
            "makespan",
        ),
        (
            vec![
                "optimize",
                "--pp",
                "2",
                "--mb",
                "2",
                "--max-activations",
                "2",
                "-o",
                "/dev/full",
            ],
            "optimized",
        ),
    ];
    for (args, report) in cases {
        let o = schedc(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).contains(report), "{args:?}: {}", stdout(&o));
        assert!(
            stderr(&o).contains("No space left on device"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
}

// Finding 9: SIGTERM during `compile -o DIR` removes the temporary directory (the signal
// handling removes it, then the process ends by the signal); one left by a process that no
// longer runs (SIGKILL) is swept by the next compile to the same DIR.
#[cfg(unix)]
#[test]
fn finding09_interrupted_compile_leaves_no_temporary_directory() {
    use std::os::unix::process::ExitStatusExt;
    let d = tmpdir("f09");
    let out = d.join("c3");
    let child = spawn(&[
        "compile",
        "specs/1f1b.sched",
        "--pp",
        "32",
        "--mb",
        "512",
        "-o",
        s(&out),
    ]);
    let pid = child.id();
    let tmp = d.join(format!(".c3.schedc-{pid}-dir.tmp"));
    let t0 = std::time::Instant::now();
    // Wait until it is writing the rank files.
    while !std::fs::read_dir(&tmp).is_ok_and(|mut r| r.next().is_some()) {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(240),
            "no rank file written"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let o = wait_at_most(child, 60, "compile after SIGTERM");
    assert_eq!(o.status.signal(), Some(libc::SIGTERM), "{:?}", o.status);
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // A stale one of a process that has ended is swept; one of a running process is kept.
    let mut gone = Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    let stale = d.join(format!(".c3.schedc-{dead}-dir.tmp"));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("rank0.json"), "{}").unwrap();
    let live = d.join(format!(".c3.schedc-{}-dir.tmp", std::process::id()));
    std::fs::create_dir(&live).unwrap();
    let o = schedc(&[
        "compile",
        "specs/1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "2",
        "-o",
        s(&out),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stale.exists());
    assert!(live.exists());
    assert!(out.join("manifest.json").exists());
}

// Finding 21: `run --trace -` writes the trace on standard output and the report on
// standard error, as the README says; with `--format json` it is refused.
#[test]
fn finding21_run_trace_to_stdout() {
    let o = schedc(&[
        "run",
        "specs/zbv.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--trace",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["traceEvents"].as_array().unwrap().len() > 100);
    assert!(
        stderr(&o).contains("ran 1 step(s) on 4 rank(s)"),
        "{}",
        stderr(&o)
    );
    let o = schedc(&[
        "run",
        "specs/zbv.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--trace",
        "-",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("--trace - with --format json"),
        "{v}"
    );
}

// Finding 14: under a small `ulimit -v`, --version and --help work (they need no worker
// thread), a command says which limit to raise, and the memory estimate refuses an instance
// that does not fit under the limit instead of aborting on a failed allocation.
#[cfg(target_os = "linux")]
#[test]
fn finding14_small_ulimit_v() {
    let exe = env!("CARGO_BIN_EXE_schedc");
    let under = |kib: u32, args: &str| {
        Command::new("bash")
            .arg("-c")
            .arg(format!("ulimit -v {kib} && exec {exe} {args}"))
            .current_dir(root())
            .env_remove("SCHEDC_MEMORY_LIMIT")
            .output()
            .unwrap()
    };
    let o = under(250_000, "--version");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("schedc "));
    let o = under(250_000, "check --help");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = under(250_000, "check specs/1f1b.sched --pp 2 --mb 2");
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("cannot start the worker thread: its 256 MiB stack does not fit under the virtual-memory limit (`ulimit -v 250000`"),
        "{e}"
    );
    // The figure it names is enough.
    let need: u32 = e
        .split("at least `ulimit -v ")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{e}"));
    let o = under(need, "check specs/1f1b.sched --pp 2 --mb 2");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = under(400_000, "check specs/1f1b.sched --pp 64 --mb 4096");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("left under the virtual-memory limit"),
        "{}",
        stderr(&o)
    );
}

// Finding 16: a missing CUDA driver or NVRTC is an environment error, exit status 2, and
// `--arch` is validated before NVRTC is loaded (so before any work and on any machine).
#[test]
fn finding16_cuda_environment_errors_exit_2() {
    let d = tmpdir("f16");
    let ptx = d.join("ptx");
    for args in [
        vec![
            "run",
            "specs/1f1b.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--backend",
            "cuda",
            "--arch",
            "sm_9000",
        ],
        vec![
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--backend",
            "cuda",
            "--ptx",
            s(&ptx),
            "--arch",
            "sm_9000",
        ],
    ] {
        let o = schedc(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(
            stderr(&o).contains("--arch sm_9000: expected a GPU architecture such as sm_80"),
            "{args:?}: {}",
            stderr(&o)
        );
        assert!(!ptx.exists());
    }
    let o = schedc(&[
        "run",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--backend",
        "cuda",
    ]);
    if o.status.success() {
        println!("a GPU is present: the run trained");
    } else {
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("no CUDA"), "{}", stderr(&o));
    }
    let o = schedc(&[
        "compile",
        "specs/1f1b.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--backend",
        "cuda",
        "--ptx",
        s(&ptx),
    ]);
    if o.status.success() {
        println!("NVRTC is present: the PTX was written");
    } else {
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("NVRTC library cannot be loaded"),
            "{}",
            stderr(&o)
        );
    }
}

// Finding 24: the small message and format nits.
#[test]
fn finding24_message_nits() {
    let d = tmpdir("f24");
    // A per-rank list of the wrong length: singular/plural, and a malformed file exits 2.
    let wrongn = d.join("wrongn.case");
    std::fs::write(
        &wrongn,
        "pp 2\nrank 0: F(0,0) BW(0,0)\nrank 1: F(1,0) BW(1,0)\nexpect accept\nexpect warmup 1\n",
    )
    .unwrap();
    let o = schedc(&["test", s(&wrongn)]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("wrongn.case:5: 1 value for 2 ranks (give one per rank)"),
        "{}",
        stdout(&o)
    );
    // An unknown error code in `expect reject`: the file is malformed, exit 2.
    let unknown = d.join("unknown.case");
    std::fs::write(
        &unknown,
        "pp 2\nrank 0: F(0,0) BW(0,0)\nrank 1: F(1,0) BW(1,0)\nexpect reject no-such-code\n",
    )
    .unwrap();
    let o = schedc(&["test", s(&unknown)]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("unknown error code `no-such-code`"),
        "{}",
        stdout(&o)
    );
    // A stage id out of range names the valid ids.
    let o = schedc(&[
        "check",
        "specs/1f1b.sched",
        "--pp",
        "8",
        "--mb",
        "8",
        "--moe=0-20",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o)
            .contains("--moe names stage 8, but the schedule's stage ids are 0..=7 (8 stages)"),
        "{}",
        stderr(&o)
    );
    // --verify with every difference exactly 0 names no "worst" tensor.
    let o = schedc(&[
        "run",
        "specs/1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "2",
        "--verify",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("every gradient, loss and parameter equals sequential training's exactly"),
        "{out}"
    );
    assert!(!out.contains("worst gradient"), "{out}");
    // fmt on IR text says what fmt formats.
    let o = schedc(&["fmt", "book/src/examples/syntax.ir"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("is not a spec: schedc fmt formats `.sched` specs"),
        "{}",
        stderr(&o)
    );
}

// Finding 24: on a narrow terminal the progress bar fits the line (it wrapped at 80 columns
// and was redrawn with cursor-up codes). Needs `script` for a pseudo-terminal.
#[cfg(target_os = "linux")]
#[test]
fn finding24_progress_bar_fits_the_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        println!("skipped: no `script` here for a pseudo-terminal");
        return;
    }
    let exe = env!("CARGO_BIN_EXE_schedc");
    let o = Command::new("script")
        .args(["-qc"])
        .arg(format!(
            "stty rows 24 cols 60; {exe} run specs/1f1b.sched --pp 2 --mb 2 --steps 20 >/dev/null"
        ))
        .arg("/dev/null")
        .current_dir(root())
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&o.stdout);
    assert!(
        !t.contains("\u{1b}[1A"),
        "redrawn with cursor-up codes: {t:?}"
    );
    // Without colour and cursor codes, no line is wider than the 60 columns.
    let mut plain = String::new();
    let mut it = t.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            for d in it.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    let widest = plain
        .split(['\r', '\n'])
        .map(|l| l.chars().count())
        .max()
        .unwrap();
    assert!(plain.contains("20/20 steps"), "{plain:?}");
    assert!(widest <= 60, "{widest} columns: {plain:?}");
}
