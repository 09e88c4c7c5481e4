//! The break-it findings of issue 11, one test per item (items owned elsewhere are noted).
//! Each runs the `schedc` binary as a user would.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};

mod common;
use common::*;

/// Runs with standard output on `/dev/full`.
fn to_dev_full(args: &[&str]) -> Output {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    bin()
        .args(args)
        .stdout(Stdio::from(full))
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

const ZB: &str = "tests/data/torch/ScheduleInterleavedZeroBubble_P4_M8_V2.compute.csv";
const COMMS: &str = "tests/data/torch/ScheduleInterleavedZeroBubble_P4_M8_V2.comms.csv";

// Item 1: plan refuses an EP that cannot exist (since issue 22 through --mesh ep=N; the
// search itself only builds EP groups that divide the experts and fit a stage).
#[test]
fn item01_plan_refuses_impossible_ep() {
    for (ep, want) in [
        (
            "1000",
            "--mesh ep=1000 does not divide the model's 256 routed experts",
        ),
        (
            "3",
            "--mesh ep=3 does not divide the model's 256 routed experts",
        ),
    ] {
        let mesh = format!("ep={ep}");
        let o = schedc(&["plan", "--gpus", "8", "--model", "dsv3", "--mesh", &mesh]);
        assert_eq!(o.status.code(), Some(2), "--mesh ep={ep}");
        assert!(stderr(&o).contains(want), "{}", stderr(&o));
    }
    // 256 GPUs at pp=8 leave 32 GPUs per stage, fewer than an EP group of 64: refused,
    // naming the option.
    let o = schedc(&[
        "plan",
        "--gpus",
        "256",
        "--model",
        "dsv3",
        "--hardware",
        "h800",
        "--mesh",
        "ep=64,pp=8",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("at tp=1 pp=8 dp=32: --mesh ep=64 does not divide tp * dp = 32"),
        "{}",
        stderr(&o)
    );
}

// Item 3: a write error on standard output is exit 2 with the reason, for every command.
#[test]
fn item03_stdout_write_errors_exit_2() {
    let dir = tmpdir("full");
    let out = dir.join("prog");
    let cases: Vec<Vec<String>> = vec![
        vec!["check", ZB],
        vec!["check", "specs/1f1b.sched", "--pp", "2..=3", "--mb", "4"],
        vec!["show", ZB],
        vec![
            "convert",
            "specs/1f1b.sched",
            "--pp",
            "8",
            "--mb",
            "64",
            "--to",
            "ir-json",
        ],
        vec!["sim", ZB],
        vec!["compare", "--pp", "2", "--mb", "4"],
        vec![
            "plan",
            "--gpus",
            "4",
            "--model",
            "llama3-8b",
            "--global-batch",
            "8",
            "--mesh",
            "tp=2,pp=2",
        ],
        vec!["fmt", "specs/1f1b.sched"],
        vec!["test", "tests/cases/overlap-pair.case"],
        vec!["run", "specs/1f1b.sched", "--pp", "2", "--mb", "2"],
        vec![
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "-o",
            out.to_str().unwrap(),
        ],
        vec!["--help"],
        vec!["run", "--help"],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(String::from).collect())
    .collect();
    for args in cases {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = to_dev_full(&a);
        assert_eq!(o.status.code(), Some(2), "{a:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("cannot write to standard output"),
            "{a:?}: {}",
            stderr(&o)
        );
    }
}

// Item 4: run --verify's pass/fail and NaN handling are in backends/cpu/tests/faults.rs; here
// the report names the worst tensor and the tolerance.
#[test]
fn item04_verify_reports_tolerance_and_worst_tensor() {
    // DualPipe's gradients differ from sequential training's in the last bits (1F1B at
    // --pp 2 --mb 2 equals it exactly: no worst tensor then, breakit2 finding 24).
    let o = schedc(&[
        "run",
        "specs/dualpipe.sched",
        "--pp",
        "4",
        "--mb",
        "8",
        "--verify",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("verify passed") && out.contains("tolerance f64"),
        "{out}"
    );
    assert!(
        out.contains("worst gradient: ") && out.contains(" on rank "),
        "{out}"
    );
}

/// Starts `args` with a pipe on standard output, reads `n` bytes, closes the pipe and
/// returns the exit status and standard error.
fn close_early(args: &[&str], n: usize) -> (Option<i32>, String) {
    let mut child = bin()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut buf = vec![0u8; n];
    child.stdout.take().unwrap().read_exact(&mut buf).unwrap();
    // The read end is dropped here: further writes fail with EPIPE.
    let o = child.wait_with_output().unwrap();
    (o.status.code(), stderr(&o))
}

// Item 5: a closed pipe ends the output quietly (exit status of the verdict, no panic); a
// full one is exit 2 (item 3).
#[test]
fn item05_closed_stdout_is_no_panic() {
    for args in [
        &[
            "check",
            "specs/1f1b.sched",
            "--pp",
            "64",
            "--mb",
            "64",
            "--format",
            "json",
        ][..],
        &["show", "specs/1f1b.sched", "--pp", "64", "--mb", "64"][..],
        &[
            "convert",
            "specs/1f1b.sched",
            "--pp",
            "16",
            "--mb",
            "256",
            "--to",
            "ir-text",
        ][..],
    ] {
        let (code, err) = close_early(args, 16);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let o = to_dev_full(&["run", "specs/1f1b.sched", "--pp", "4", "--mb", "8"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!stderr(&o).contains("panicked"));
}

// Item 6: show refuses an instance over the memory limit with the estimate and the limit;
// the rows are streamed (the unit test in cli/src/show.rs).
#[test]
fn item06_show_refuses_past_the_limit() {
    let o = schedc(&["show", "specs/1f1b.sched", "--pp", "100000", "--mb", "1000"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("needs about") && e.contains("more than the limit of 8.0 GiB"),
        "{e}"
    );
    assert!(e.contains("SCHEDC_MEMORY_LIMIT"), "{e}");
}

// Item 7: a sweep says how many instances it has and the limit.
#[test]
fn item07_sweep_cap() {
    let o = schedc(&[
        "check",
        "specs/1f1b.sched",
        "--pp",
        "2..=4294967295",
        "--mb",
        "8",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("4294967294 instances") && e.contains("more than the limit of 1000000"),
        "{e}"
    );
    // A stepped range counts its steps.
    let o = schedc(&[
        "check",
        "specs/1f1b.sched",
        "--pp",
        "2..=8:2",
        "--mb",
        "8..=9",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("8 instances: 8 passed"),
        "{}",
        stdout(&o)
    );
}

/// The ids of the processes whose parent is `pid`, from /proc.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
            // pid (comm) state ppid ...: the command may hold spaces; split after ')'.
            if let Some(rest) = stat.rsplit_once(')').map(|x| x.1) {
                let ppid = rest.split_whitespace().nth(1).and_then(|x| x.parse().ok());
                if ppid == Some(pid) {
                    out.push(p);
                }
            }
        }
    }
    out
}

// Item 8: SIGTERM ends a training run, and nothing it started keeps running (there is no
// child process any more: the backend runs in the schedc process).
#[test]
fn item08_sigterm_leaves_nothing_running() {
    let mut child = bin()
        .args([
            "run",
            "specs/dualpipe.sched",
            "--pp",
            "4",
            "--mb",
            "8",
            "--steps",
            "100000",
            "--data",
            "tests/data/tinyshakespeare.txt",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Training has started (its rank threads are running) before the signal.
    let t0 = std::time::Instant::now();
    loop {
        let threads = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Threads:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u32>().ok())
            })
            .unwrap_or(0);
        if threads >= 5 || t0.elapsed() > std::time::Duration::from_secs(60) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "run ended before the signal"
    );
    assert!(children_of(pid).is_empty(), "run started a child process");
    let k = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(k.success());
    let status = child.wait().unwrap();
    assert!(!status.success());
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(15), "{status:?}");
    // Reaped: no process with that id is left, and none was its child.
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| !s.contains("schedc"))
                .unwrap_or(true),
        "process {pid} still exists"
    );
    assert!(children_of(pid).is_empty());
}

// Item 9: run and compile refuse sizes past the memory limit, with the estimate.
#[test]
fn item09_run_and_compile_size_limits() {
    let dir = tmpdir("big");
    for args in [
        vec!["run", "specs/1f1b.sched", "--pp", "100000", "--mb", "8"],
        vec!["run", "specs/1f1b.sched", "--pp", "4", "--mb", "1000000"],
        vec![
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "4",
            "--mb",
            "1000000",
            "-o",
            dir.join("out").to_str().unwrap(),
        ],
    ] {
        let o = schedc(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("more than the limit"), "{}", stderr(&o));
    }
    assert!(!dir.join("out").exists());
}

// Item 10: outputs are complete or absent; compile --force replaces an earlier output only.
#[test]
fn item10_outputs_whole_or_absent() {
    let dir = tmpdir("atomic");
    // A write error names the file, and leaves no temporary behind.
    let o = schedc(&["convert", ZB, "--to", "ir-text", "-o", "/dev/full"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("cannot write `/dev/full`"),
        "{}",
        stderr(&o)
    );
    let f = dir.join("a.ir");
    let o = schedc(&["convert", ZB, "--to", "ir-text", "-o", f.to_str().unwrap()]);
    assert!(o.status.success());
    let names = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&dir), ["a.ir"]);
    // An output directory whose parent is missing is refused before any work.
    let o = schedc(&[
        "sim",
        ZB,
        "--svg",
        dir.join("no/such/dir.svg").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("does not exist"), "{}", stderr(&o));
    // compile: into a new directory; a second time needs --force; --force replaces it.
    let out = dir.join("prog");
    let compile = |extra: &[&str]| {
        let mut a = vec![
            "compile",
            "specs/1f1b.sched",
            "--pp",
            "2",
            "--mb",
            "2",
            "-o",
            out.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        schedc(&a)
    };
    assert!(compile(&[]).status.success());
    assert_eq!(names(&out), ["manifest.json", "rank0.json", "rank1.json"]);
    assert_eq!(compile(&[]).status.code(), Some(2));
    let o = compile(&["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(names(&out), ["manifest.json", "rank0.json", "rank1.json"]);
    assert_eq!(names(&dir), ["a.ir", "prog"], "no temporary left");
    // A directory with anything else in it is never replaced.
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let o = compile(&["--force"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("did not write"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).unwrap(),
        "mine"
    );
}

// Item 11: bad usage and unreadable input are exit 2.
#[test]
fn item11_exit_codes() {
    let dir = tmpdir("codes");
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["run", "specs/1f1b.sched", "--pp", "4", "--mb", "8"];
        a.extend_from_slice(extra);
        schedc(&a)
    };
    for extra in [
        &["--data", "/nonexistent"][..],
        &["--steps", "0"][..],
        &["--data", empty.to_str().unwrap()][..],
        &["--mesh", "pp=4,tp=8"][..],
        &["--mesh", "pp=3"][..],
        &["--mesh", "pp=4,ep=3"][..],
    ] {
        let o = run(extra);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
    }
    let o = schedc(&[
        "check",
        "specs/1f1b.sched",
        "--pp",
        "0..=4",
        "--mb",
        "1..=2",
    ]);
    assert_eq!(o.status.code(), Some(2));
    // A spec that does not elaborate is rejected, exit 1 (issue 15 item 10: exit 2 is for
    // unreadable input and bad usage), in a sweep too.
    let bad = dir.join("bad.sched");
    std::fs::write(
        &bad,
        "schedule \"bad\"\nvpp 1\nplacement loop\nrank r {\n    repeat M { F(0) }\n    repeat M { BW(7) }\n}\n",
    )
    .unwrap();
    let b = bad.to_str().unwrap();
    assert_eq!(
        schedc(&["check", b, "--pp", "2", "--mb", "2"])
            .status
            .code(),
        Some(1)
    );
    let o = schedc(&["check", b, "--pp", "2..=3", "--mb", "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).contains("ERROR --pp 2 --mb 2"), "{}", stdout(&o));
}

// Item 12: `-` is standard output for --svg and --trace too.
#[test]
fn item12_dash_is_stdout() {
    let dir = tmpdir("dash");
    let o = bin()
        .current_dir(&dir)
        .args(["sim", &root().join(ZB).to_string_lossy(), "--svg", "-"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("<svg"));
    let o = bin()
        .current_dir(&dir)
        .args(["sim", &root().join(ZB).to_string_lossy(), "--trace", "-"])
        .output()
        .unwrap();
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["traceEvents"].is_array());
    assert!(!dir.join("-").exists(), "a file named `-` was written");
    let o = schedc(&["sim", ZB, "--svg", "-", "--trace", "-"]);
    assert_eq!(o.status.code(), Some(2));
}

// Item 13: --format json carries the error.
#[test]
fn item13_json_on_errors() {
    let o = schedc(&["check", "nonexist.csv", "--format", "json"]);
    assert_eq!(o.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["verdict"], "unreadable");
    assert!(v["error"]
        .as_str()
        .unwrap()
        .contains("cannot read `nonexist.csv`"));
    assert_eq!(v["diagnostics"], serde_json::json!([]));
    // A syntax error and a refused instance: structured diagnostics with file:line:col.
    let o = schedc(&["check", "book/src/examples/syntax.ir", "--format", "json"]);
    assert_eq!(o.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["diagnostics"][0]["code"], "syntax");
    assert_eq!(
        v["diagnostics"][0]["location"],
        "book/src/examples/syntax.ir:2:16"
    );
    let o = schedc(&[
        "check",
        "specs/chimera.sched",
        "--pp",
        "3",
        "--mb",
        "4",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["verdict"], "refused");
    assert_eq!(v["diagnostics"][0]["code"], "refused");
    assert_eq!(v["diagnostics"][0]["location"], "specs/chimera.sched:18:1");
    let o = schedc(&[
        "run",
        "specs/1f1b.sched",
        "--pp",
        "2",
        "--mb",
        "2",
        "--steps",
        "0",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exit"], 2);
    assert!(v["error"]
        .as_str()
        .unwrap()
        .contains("--steps must be at least 1"));
    let o = schedc(&[
        "run",
        "specs/dualpipe.sched",
        "--pp",
        "3",
        "--mb",
        "8",
        "--format",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().contains("even --pp"), "{v}");
}

// Item 14: run and compile take --param; a parameter given twice is refused.
#[test]
fn item14_param_for_run_and_compile() {
    let dir = tmpdir("param");
    let spec = dir.join("p.sched");
    std::fs::write(
        &spec,
        "schedule \"p\"\nvpp 1\nplacement loop\nparam rounds\nrequire rounds >= 1, \"rounds >= 1\"\nrank r {\n    repeat M { F(0) }\n    repeat M { BW(0) }\n}\n",
    )
    .unwrap();
    let s = spec.to_str().unwrap();
    let o = schedc(&["run", s, "--pp", "2", "--mb", "2", "--param", "rounds=1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = schedc(&["run", s, "--pp", "2", "--mb", "2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("--param rounds=VALUE"),
        "{}",
        stderr(&o)
    );
    let out = dir.join("out");
    let o = schedc(&[
        "compile",
        s,
        "--pp",
        "2",
        "--mb",
        "2",
        "--param",
        "rounds=2",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for cmd in ["check", "run"] {
        let o = schedc(&[
            cmd, s, "--pp", "2", "--mb", "2", "--param", "rounds=1", "--param", "rounds=2",
        ]);
        assert_eq!(o.status.code(), Some(2));
        assert!(
            stderr(&o).contains("--param rounds is given twice"),
            "{}",
            stderr(&o)
        );
    }
}

// Item 15: help names the schedc binary.
#[test]
fn item15_run_help() {
    let o = schedc(&["run", "--help"]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("Usage: schedc run"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("schedc-cpu"));
}

// Item 16: compare and plan work from any directory; --specs DIR overrides.
#[test]
fn item16_compare_and_plan_anywhere() {
    let dir = tmpdir("anywhere");
    let run = |args: &[&str]| bin().current_dir(&dir).args(args).output().unwrap();
    let o = run(&["compare", "--pp", "4", "--mb", "8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for s in ["1f1b", "dualpipe", "zbv", "gpipe"] {
        assert!(stdout(&o).contains(s), "{s}: {}", stdout(&o));
    }
    let o = run(&[
        "plan",
        "--gpus",
        "4",
        "--model",
        "llama3-8b",
        "--global-batch",
        "8",
        "--mesh",
        "tp=2,pp=2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("recommendation"), "{}", stdout(&o));
    // --specs DIR: only that directory's specs.
    std::fs::copy(root().join("specs/1f1b.sched"), dir.join("only.sched")).unwrap();
    let o = run(&["compare", "--pp", "4", "--mb", "8", "--specs", "."]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("only") && !stdout(&o).contains("dualpipe"));
    let o = run(&["compare", "--pp", "4", "--mb", "8", "--specs", "nowhere"]);
    assert_eq!(o.status.code(), Some(2));
}

// Item 17: plan lists the schedules it could not use, with the reason.
#[test]
fn item17_plan_lists_skipped() {
    let o = schedc(&[
        "plan",
        "--gpus",
        "32",
        "--model",
        "llama3-8b",
        "--mesh",
        "tp=1,pp=32",
        "--global-batch",
        "64",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("not simulated:"), "{out}");
    assert!(
        out.contains("zbv at tp=1 pp=32 ep=1 dp=1: 64 stages per direction for 32 layers"),
        "{out}"
    );
    assert!(
        out.contains(
            "interleaved_1f1b V>=2 at tp=1 pp=32 ep=1 dp=1: 64 stages or more for 32 layers"
        ),
        "{out}"
    );
}

// Item 18: plan refuses bad inputs (since issue 22 the cluster comes from --hardware: the
// old cluster flags are refused, saying what replaces them).
#[test]
fn item18_plan_bad_inputs() {
    for extra in [
        &["--peak-tflops", "0"][..],
        &["--gpu-memory", "0"][..],
        &["--mfu", "0"][..],
        &["--global-batch-tokens", "1"][..],
        &["--ep", "8"][..],
        &["--gpus", "1000000007"][..],
        &["--intra-node-bandwidth", "-1"][..],
        &["--global-batch", "0"][..],
        &["--seq", "0"][..],
        &["--hardware", "nope"][..],
    ] {
        let mut a = vec!["plan", "--gpus", "64", "--model", "dense70b"];
        a.extend_from_slice(extra);
        // A repeated --gpus is refused by the parser; give it once.
        if extra[0] == "--gpus" {
            a.drain(1..3);
        }
        let o = schedc(&a);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stdout(&o));
    }
}

// Items 19 and 20 belong to the language work (branch i15).

// Item 21: no unit-time makespan for a schedule that deadlocks.
#[test]
fn item21_no_makespan_for_a_deadlock() {
    let o = schedc(&["check", "tests/cases/a2a-cross-wait-deadlock.case"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        !stdout(&o)
            .lines()
            .any(|l| l.starts_with("unit-time makespan")),
        "{}",
        stdout(&o)
    );
    assert!(
        stdout(&o).contains("does not run to the end"),
        "{}",
        stdout(&o)
    );
    let o = schedc(&[
        "check",
        "tests/cases/a2a-cross-wait-deadlock.case",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["makespan"].is_null() && v["bubble"].is_null(), "{v}");
}

// Item 22: show does not repeat the code.
#[test]
fn item22_show_deadlock_note() {
    let o = schedc(&["show", "tests/cases/a2a-cross-wait-deadlock.case"]);
    let e = stderr(&o);
    assert!(
        e.contains("deadlock: ") && !e.contains("deadlock: deadlock:"),
        "{e}"
    );
}

// Item 24 (cropped snippets): a torch CSV row thousands of columns wide.
#[test]
fn item24_long_lines_are_cropped() {
    let dir = tmpdir("wide");
    let f = dir.join("wide.csv");
    let row: Vec<String> = (0..600).map(|m| format!("0F{m}")).collect();
    std::fs::write(&f, format!("{},0Q1\n", row.join(","))).unwrap();
    let o = schedc(&["check", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.contains("0Q1"), "{e}");
    assert!(e.lines().all(|l| l.chars().count() < 160), "{e}");
}

// Item 25: a WAIT_SEND without its send names the send.
#[test]
fn item25_missing_send_is_named() {
    let dir = tmpdir("nosend");
    let f = dir.join("x.csv");
    let text = std::fs::read_to_string(root().join(COMMS)).unwrap();
    std::fs::write(&f, text.replacen("0F0,0SEND_F0,", "0F0,", 1)).unwrap();
    let o = schedc(&["check", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    assert!(
        out.contains("send of the activation of stage 0, micro-batch 0")
            && out.contains("`0SEND_F0`"),
        "{out}"
    );
}

// Item 26: sim states its units.
#[test]
fn item26_sim_units() {
    let o = schedc(&["sim", ZB, "--cost", "dsv3-h800"]);
    assert!(o.status.success());
    let out = stdout(&o);
    assert!(
        out.contains("makespan 0.")
            && out.contains(" s  steady-state step 0.")
            && out.contains("busy (s)"),
        "{out}"
    );
    assert!(
        out.contains("peak_memory (GB)") && !out.contains("e10"),
        "{out}"
    );
}

// Item 27: a cost override for a stage the schedule lacks is refused.
#[test]
fn item27_cost_override_for_missing_stage() {
    let dir = tmpdir("cost");
    let f = dir.join("c.toml");
    std::fs::write(&f, "[compute.stage.99]\nF = 2.0\n").unwrap();
    let o = schedc(&["sim", ZB, "--cost", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("[compute.stage.99]"), "{}", stderr(&o));
}

// Item 28: a spec is recognised by its content (standard input, another extension).
#[test]
fn item28_spec_by_content() {
    let spec = std::fs::read(root().join("specs/1f1b.sched")).unwrap();
    let mut child = bin()
        .args(["check", "-", "--pp", "2", "--mb", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), &spec).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let dir = tmpdir("txt");
    let f = dir.join("1f1b.txt");
    std::fs::write(&f, &spec).unwrap();
    let o = schedc(&["check", f.to_str().unwrap(), "--pp", "2", "--mb", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = schedc(&["check", f.to_str().unwrap(), "--pp", "2..=3", "--mb", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

// Item 29: file names need not be UTF-8.
#[test]
fn item29_non_utf8_paths() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tmpdir("nonutf8");
    let f = dir.join(std::ffi::OsStr::from_bytes(b"sp\xffec.sched"));
    std::fs::copy(root().join("specs/1f1b.sched"), &f).unwrap();
    let o = bin()
        .arg("check")
        .arg(&f)
        .args(["--pp", "2", "--mb", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = dir.join(std::ffi::OsStr::from_bytes(b"out\xfe.ir"));
    let o = bin()
        .arg("convert")
        .arg(&f)
        .args(["--pp", "2", "--mb", "2", "--to", "ir-text", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.exists());
    // A cost model and compare's inputs by such names too.
    let cost = dir.join(std::ffi::OsStr::from_bytes(b"c\xffost.toml"));
    std::fs::copy(root().join("compiler/presets/dsv3-h800.toml"), &cost).unwrap();
    for cmd in ["check", "sim"] {
        let o = bin()
            .arg(cmd)
            .arg(&f)
            .args(["--pp", "2", "--mb", "2", "--cost"])
            .arg(&cost)
            .output()
            .unwrap();
        assert!(o.status.success(), "{cmd}: {}", stderr(&o));
    }
    let o = bin()
        .arg("compare")
        .arg(&f)
        .args(["--pp", "2", "--mb", "2", "--cost"])
        .arg(&cost)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("sp\u{fffd}ec"), "{}", stdout(&o));
}

// Item 30: --torch-format applies to torch CSV output only.
#[test]
fn item30_torch_format_only_for_torch_csv() {
    let o = schedc(&[
        "convert",
        ZB,
        "--to",
        "ir-json",
        "--torch-format",
        "compute-comms",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--torch-format applies to --to torch-csv only"));
}

// Item 33: --help describes every command; one step's loss is one figure.
#[test]
fn item33_help_and_messages() {
    let o = schedc(&["--help"]);
    let out = stdout(&o);
    for c in [
        "check", "show", "convert", "sim", "compare", "plan", "run", "compile", "fmt", "test",
    ] {
        assert!(out.contains(&format!("  {c} ")), "{c}: {out}");
    }
    assert!(out.contains("simulate") && out.contains("train"), "{out}");
    let o = schedc(&["run", "specs/1f1b.sched", "--pp", "2", "--mb", "2"]);
    let out = stdout(&o);
    assert!(out.contains("(one step)") && !out.contains("-> "), "{out}");
}
