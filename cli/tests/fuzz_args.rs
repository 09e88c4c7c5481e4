//! A property test over command lines (issue 11): argument vectors built from the real
//! commands, flags and values, good and bad, never crash `schedc`: no panic (exit 101), no
//! abort or other signal, no hang, and the exit status is 0, 1 or 2. Failures found are kept
//! in `fuzz_args.proptest-regressions` and replayed first.
//!
//! `PROPTEST_CASES` sets the number of command lines (default 96 here; each runs the debug
//! binary).

use proptest::prelude::*;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A scratch directory holding copies of the inputs at their repository paths: the command
/// lines run there, so that `fmt --write`, `compile -o` and `convert -o` touch only copies.
fn fixture() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("schedc-fuzz-args-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let extra = ["tests/data/tinyshakespeare.txt", "specs/gpipe.sched"];
        for f in INPUTS.iter().chain(extra.iter()) {
            let src = root().join(f);
            if f.is_empty() || *f == "-" || !src.is_file() {
                continue;
            }
            let dst = d.join(f);
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::copy(&src, &dst).unwrap();
        }
        d
    })
    .clone()
}

/// Inputs: specs, every importer's format, a case, missing and odd paths, standard input.
const INPUTS: &[&str] = &[
    "specs/1f1b.sched",
    "specs/dualpipe.sched",
    "specs/zbv.sched",
    "specs/interleaved_1f1b.sched",
    "tests/data/torch/ScheduleInterleavedZeroBubble_P4_M8_V2.compute.csv",
    "tests/data/torch/ScheduleInterleavedZeroBubble_P4_M8_V2.comms.csv",
    "tests/cases/overlap-pair.case",
    "tests/cases/a2a-cross-wait-deadlock.case",
    "fuzz/seeds/dualpipe/dualpipe_P2_N4.json",
    "fuzz/seeds/ir_json/dualpipev_P1_N2.json",
    "no/such/file.sched",
    "specs",
    "-",
    "",
    "README.md",
];

/// Values for the size flags: good, zero, negative, ranges (good and empty), huge, text.
const SIZES: &[&str] = &[
    "1",
    "2",
    "4",
    "8",
    "0",
    "-1",
    "2..=4",
    "4..=2",
    "0..=2",
    "2..=8:2",
    "1000000",
    "4294967295",
    "4294967296",
    "x",
    "",
];

/// A flag and the values it may get (`None`: a switch).
type Flag = (&'static str, Option<&'static [&'static str]>);

const FORMAT: &[&str] = &["human", "json", "xml"];
const COSTS: &[&str] = &[
    "unit",
    "dsv3-h800",
    "dualpipe-readme",
    "F=1,B=2,W=1",
    "F=-1",
    "nonsense",
    "no/such.toml",
];
const PLACEMENTS: &[&str] = &["loop", "v", "bidir", "0,1,1,0", "0,9", "x"];
const PARAMS: &[&str] = &["x=1", "x=y", "=3", "x"];
const OUT: &[&str] = &["-", "/dev/null", "/dev/full", "no/such/dir/out"];

fn flags(cmd: &str) -> Vec<Flag> {
    let input: Vec<Flag> = vec![
        ("--pp", Some(SIZES)),
        ("--mb", Some(SIZES)),
        ("--vpp", Some(SIZES)),
        ("--param", Some(PARAMS)),
        ("--placement", Some(PLACEMENTS)),
    ];
    let mut f = match cmd {
        "check" => vec![
            ("--format", Some(FORMAT)),
            ("--max-activations", Some(SIZES)),
            ("--buffer-slots", Some(SIZES)),
            ("--eager-sends", None),
            ("--per-op-groups", None),
        ],
        "show" => vec![],
        "convert" => vec![
            (
                "--to",
                Some(&["ir-text", "ir-json", "torch-csv", "megatron", "svg"][..]),
            ),
            (
                "--torch-format",
                Some(&["compute-only", "compute-comms", "x"][..]),
            ),
            ("--sidecar", Some(OUT)),
            ("--layers", Some(SIZES)),
            ("--model", Some(&["dsv3", "llama3-8b", "nope"][..])),
            ("--layout", Some(&["Et|tL", "Et*3|(t*4|)*6t*3L", "E(t"][..])),
            ("--micro-batch-size", Some(SIZES)),
            ("--dp", Some(SIZES)),
            ("--lowered", None),
            ("-o", Some(OUT)),
            ("--force", None),
        ],
        "sim" => vec![
            ("--cost", Some(COSTS)),
            ("--set", Some(&["latency=1e-5", "F=x", "bogus=1"][..])),
            ("--format", Some(FORMAT)),
            ("--trace", Some(OUT)),
            ("--svg", Some(OUT)),
            ("--force", None),
        ],
        "run" => vec![
            (
                "--mesh",
                Some(
                    &[
                        "pp=2",
                        "pp=4,ep=2",
                        "pp=4,tp=2",
                        "pp=2,sp=2",
                        "pp=2,ep=2,node=1",
                        "pp=2,node=3",
                        "dp=0",
                        "x",
                    ][..],
                ),
            ),
            ("--a2a", Some(&["flat", "hierarchical", "x"][..])),
            ("--experts", Some(&["8", "3", "0", "x"][..])),
            ("--top-k", Some(&["1", "4", "9", "0"][..])),
            ("--node-limit", Some(&["1", "2", "0", "x"][..])),
            ("--dtype", Some(&["f32", "f64", "f16"][..])),
            ("--steps", Some(&["0", "1", "2", "-1", "x"][..])),
            (
                "--data",
                Some(
                    &[
                        "tests/data/tinyshakespeare.txt",
                        "/nonexistent",
                        "/dev/null",
                    ][..],
                ),
            ),
            ("--verify", None),
            ("--format", Some(FORMAT)),
            ("--backend", Some(&["cpu", "gpu"][..])),
        ],
        "compile" => vec![
            ("--mesh", Some(&["pp=2", "pp=4,ep=2", "x"][..])),
            ("-o", Some(OUT)),
            ("--force", None),
        ],
        _ => vec![],
    };
    f.extend(input);
    f
}

/// Commands without one input: their own flags.
fn standalone(cmd: &str) -> Vec<Flag> {
    match cmd {
        "compare" => vec![
            ("--pp", Some(&["1", "2", "4", "0", "-1", "100000", "x"][..])),
            ("--mb", Some(&["1", "4", "8", "0", "x"][..])),
            ("--vpp", Some(&["1", "2", "0"][..])),
            ("--cost", Some(COSTS)),
            ("--specs", Some(&["specs", "no/such/dir", "README.md"][..])),
            ("--format", Some(FORMAT)),
        ],
        "plan" => vec![
            ("--gpus", Some(&["8", "16", "0", "7", "-8", "x"][..])),
            ("--gpus-per-node", Some(&["8", "4", "0", "3"][..])),
            (
                "--model",
                Some(&["dsv3", "llama3-8b", "gpt5", "README.md"][..]),
            ),
            ("--hardware", Some(&["h100", "a100", "x", "README.md"][..])),
            ("--mesh", Some(&["tp=2", "ep=3", "tp=3", "pp=0", "x"][..])),
            ("--ep", Some(&["1", "8", "3", "0", "1000"][..])),
            ("--seq", Some(&["4096", "0", "1"][..])),
            ("--global-batch", Some(&["8", "0", "7", "-5"][..])),
            ("--recompute", Some(&["full", "x"][..])),
            ("--dtype", Some(&["fp8", "x"][..])),
            ("--global-batch-tokens", Some(&["1e5", "1"][..])),
            ("--format", Some(FORMAT)),
        ],
        "fmt" => vec![("--write", None), ("--check", None)],
        _ => vec![],
    }
}

const COMMANDS: &[&str] = &[
    "check",
    "show",
    "convert",
    "sim",
    "run",
    "compile",
    "compare",
    "plan",
    "fmt",
    "test",
    "frobnicate",
];

/// One command line: the command, its input (for commands that take one), and flags, each
/// chosen by index so that shrinking removes flags and picks earlier values.
fn command_line() -> impl Strategy<Value = Vec<String>> {
    (
        0..COMMANDS.len(),
        0..INPUTS.len(),
        prop::collection::vec((0usize..64, 0usize..64, any::<bool>()), 0..5),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(c, i, picks, with_input, base)| {
            let cmd = COMMANDS[c];
            let mut v = vec![cmd.to_string()];
            let fl = match cmd {
                "compare" | "plan" => standalone(cmd),
                "fmt" => {
                    v.push(INPUTS[i].to_string());
                    standalone(cmd)
                }
                "test" => {
                    if with_input {
                        v.push(INPUTS[i].to_string());
                    }
                    vec![]
                }
                _ => {
                    if with_input || cmd != "frobnicate" {
                        v.push(INPUTS[i].to_string());
                    }
                    flags(cmd)
                }
            };
            if cmd == "plan" {
                // Keep plan quick in a debug build: a small batch unless a pick overrides it.
                v.extend(
                    [
                        "--gpus",
                        "4",
                        "--model",
                        "llama3-8b",
                        "--global-batch",
                        "8",
                        "--mesh",
                        "tp=2,pp=2",
                    ]
                    .map(String::from),
                );
            }
            // Half the time, an instance a spec accepts, so that the flags reach the work
            // rather than stop at a missing --pp.
            let mut used: Vec<&str> = Vec::new();
            if cmd == "plan" {
                used.extend(["--gpus", "--model", "--global-batch", "--mesh"]);
            }
            if base && !matches!(cmd, "compare" | "plan" | "fmt" | "test") {
                v.extend(["--pp", "2", "--mb", "4"].map(String::from));
                used.extend(["--pp", "--mb"]);
                if cmd == "convert" {
                    v.extend(["--to", "ir-text"].map(String::from));
                    used.push("--to");
                }
                if cmd == "compile" {
                    v.extend(["-o", "out.d"].map(String::from));
                    used.push("-o");
                }
            }
            for (f, k, good) in picks {
                if fl.is_empty() {
                    break;
                }
                let (name, vals) = fl[f % fl.len()];
                // A flag given twice is a parse error every time: mostly give each once.
                if used.contains(&name) && good {
                    continue;
                }
                used.push(name);
                v.push(name.to_string());
                if let Some(vals) = vals {
                    // `good` picks among the first (valid) values.
                    let n = if good { vals.len().min(3) } else { vals.len() };
                    v.push(vals[k % n].to_string());
                }
            }
            v
        })
}

/// Runs a command line with a timeout; returns (exit code, signal, stderr).
fn run(args: &[String]) -> (Option<i32>, Option<i32>, String) {
    let dir = fixture();
    let mut child = Command::new(env!("CARGO_BIN_EXE_schedc"))
        .args(args)
        .current_dir(&dir)
        // Small enough that the largest sizes above are refused quickly, large enough for
        // every ordinary instance.
        .env("SCHEDC_MEMORY_LIMIT", "1G")
        .env("TMPDIR", &dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{args:?}: still running after 120 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
    use std::os::unix::process::ExitStatusExt;
    (status.code(), status.signal(), err)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(96),
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::SourceParallel("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    })]

    #[test]
    fn no_command_line_crashes(args in command_line()) {
        let (code, signal, err) = run(&args);
        if std::env::var_os("FUZZ_ARGS_LOG").is_some() {
            println!("exit {code:?} {args:?} {}", err.lines().next().unwrap_or(""));
        }
        prop_assert!(signal.is_none(), "{:?}: killed by signal {:?}\n{}", args, signal, err);
        prop_assert!(!err.contains("panicked"), "{:?}: panicked\n{}", args, err);
        prop_assert!(
            matches!(code, Some(0..=2)),
            "{:?}: exit {:?}\n{}", args, code, err
        );
    }
}
