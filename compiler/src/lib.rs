//! # schedc: the schedule compiler
//!
//! Front ends ([`import`]) read schedules into the IR of `schedc_ir`; the verifier
//! ([`passes`]) proves what can be proved about them and collects every error as a
//! [`diag::Diagnostic`] with its location; [`check`] runs the whole pipeline and returns the
//! facts (warmup, peak activations, idle) that reports and back ends need.

#![warn(missing_docs)]

pub mod casefile;
pub mod check;
pub mod compare;
pub mod costmodel;
pub mod diag;
pub mod dsl;
pub mod export;
pub mod import;
pub mod input;
pub mod limits;
pub mod moe;
pub mod moe_list;
pub mod passes;
pub mod plan;
pub mod sim;
pub mod specs;

pub use schedc_ir as ir;

/// What the unit tests share.
#[cfg(test)]
pub(crate) mod test_support {
    /// The shared reference data: `$SCHEDC_SHARED_DIR`, else `shared/` next to the
    /// checkout.
    pub fn shared() -> std::path::PathBuf {
        match std::env::var_os("SCHEDC_SHARED_DIR") {
            Some(d) => d.into(),
            None => std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"),
        }
    }

    /// A reference file or directory under `../shared` is missing: fails under
    /// `SCHEDC_REQUIRE_SHARED=1` (CI), else says so on the terminal, uncaptured, so that the
    /// skip shows in `cargo test`'s output where the test passes (libtest captures only the
    /// print macros).
    pub fn skip_missing(path: &std::path::Path) {
        if std::env::var_os("SCHEDC_REQUIRE_SHARED").is_some_and(|v| v != "0") {
            panic!(
                "{} is missing and SCHEDC_REQUIRE_SHARED is set",
                path.display()
            );
        }
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: {} not found (the shared reference data: see README.md)",
            path.display()
        );
    }
}
