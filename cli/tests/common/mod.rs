//! Helpers shared by the CLI's integration tests (each `tests/*.rs` is its own crate and
//! includes this module with `mod common;`; not every test file uses every helper).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository root: commands run there so that `specs/...` paths resolve.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `schedc` binary under test, run at the repository root, without the caller's
/// `SCHEDC_MEMORY_LIMIT` (tests that need one set it) and without backtraces.
pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_schedc"));
    c.current_dir(root());
    c.env_remove("SCHEDC_MEMORY_LIMIT");
    c.env("RUST_BACKTRACE", "0");
    c
}

/// Runs `schedc ARGS` to completion.
pub fn schedc(args: &[&str]) -> Output {
    bin().args(args).output().expect("runs")
}

/// Standard output as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh, empty scratch directory for one test, named after the test file, the process
/// and `name`.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "schedc-{}-{}-{name}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The command exited 2 (unusable input) and its standard error contains `says`.
pub fn assert_refused(o: &Output, says: &str) {
    assert_eq!(o.status.code(), Some(2), "{}", stderr(o));
    assert!(
        stderr(o).contains(says),
        "wanted `{says}` in: {}",
        stderr(o)
    );
}
