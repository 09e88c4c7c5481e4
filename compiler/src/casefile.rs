//! `schedc test`: runs `.case` files like a compiler's file tests, comparing the verdict,
//! the error code and the expected figures with the file's `expect` lines.

use crate::check::{self, Verdict};
use crate::input::{load_path, LoadError, Overrides};
use schedc_ir::text::Expect;

/// The outcome of one case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// The file.
    pub path: String,
    /// True if every expectation held.
    pub passed: bool,
    /// One line per expectation that failed.
    pub differences: Vec<String>,
    /// The file itself is wrong rather than the schedule: it cannot be loaded, or an
    /// `expect` line names an unknown error code or gives a per-rank list of the wrong
    /// length (`schedc test` exits 2 for it, as for other unusable input).
    pub malformed: bool,
}

fn fmt_list<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs one case file (a file over the memory limit of [`crate::limits`] cannot be loaded).
pub fn run_case(path: impl AsRef<std::path::Path>) -> CaseResult {
    let path_buf = path.as_ref();
    let shown = path_buf.to_string_lossy().into_owned();
    let path = shown.as_str();
    let mut diffs = Vec::new();
    let mut malformed = false;
    let loaded = load_path(path_buf, &Overrides::default()).and_then(|l| {
        let size = crate::limits::Size::of(&l.program);
        crate::limits::within_limit(
            "this case",
            crate::limits::estimate(crate::limits::Work::Check, &size),
        )
        .map_err(LoadError::Usage)?;
        Ok(l)
    });
    let loaded = match loaded {
        Ok(l) => l,
        Err(e) => {
            let msg = match e {
                LoadError::Io(s) | LoadError::Usage(s) => s,
                LoadError::Parse(p) => format!("{path}:{}:{}: {}", p.line, p.col, p.message),
                LoadError::Spec { diags, .. } => diags
                    .iter()
                    .map(|d| d.message.clone())
                    .collect::<Vec<_>>()
                    .join("; "),
            };
            return CaseResult {
                path: path.into(),
                passed: false,
                differences: vec![format!("cannot load: {msg}")],
                malformed: true,
            };
        }
    };
    if loaded.expects.is_empty() {
        diffs.push("the file has no `expect` line".into());
    }
    let opts = check::Options {
        max_activations: loaded.budget,
        ..Default::default()
    };
    let out = check::check(&loaded.program, loaded.spans.as_ref(), &opts);
    let rep = &out.report;
    let codes: Vec<&str> = rep
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(|d| d.code.as_str())
        .collect();
    for (e, sp) in &loaded.expects {
        let (line, _) = schedc_ir::text::line_col(&loaded.text, sp.start as usize);
        let at = format!("{path}:{line}");
        match e {
            Expect::Accept => {
                if rep.verdict != Verdict::Accepted {
                    diffs.push(format!(
                        "{at}: expected accept, got reject ({})",
                        codes.join(", ")
                    ));
                }
            }
            Expect::Reject(code) if !crate::diag::Code::ALL.iter().any(|c| c.as_str() == code) => {
                malformed = true;
                diffs.push(format!(
                    "{at}: unknown error code `{code}` (codes: {})",
                    crate::diag::Code::ALL
                        .iter()
                        .map(|c| c.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            Expect::Reject(code) => {
                if rep.verdict != Verdict::Rejected {
                    diffs.push(format!("{at}: expected reject {code}, got accept"));
                } else if !codes.contains(&code.as_str()) {
                    diffs.push(format!(
                        "{at}: expected an error `{code}`, got {}",
                        codes.join(", ")
                    ));
                }
            }
            Expect::PeakActivations(v) | Expect::Warmup(v) | Expect::Idle(v)
                if v.len() != rep.ranks.len() =>
            {
                malformed = true;
                diffs.push(format!(
                    "{at}: {} value{} for {} rank{} (give one per rank)",
                    v.len(),
                    if v.len() == 1 { "" } else { "s" },
                    rep.ranks.len(),
                    if rep.ranks.len() == 1 { "" } else { "s" },
                ));
            }
            Expect::PeakActivations(v) => {
                let got: Vec<u64> = rep.ranks.iter().map(|r| r.peak_activations).collect();
                if &got != v {
                    diffs.push(format!(
                        "{at}: peak_activations expected {}, got {}",
                        fmt_list(v),
                        fmt_list(&got)
                    ));
                }
            }
            Expect::Warmup(v) => {
                let got: Vec<u64> = rep.ranks.iter().map(|r| r.warmup).collect();
                if &got != v {
                    diffs.push(format!(
                        "{at}: warmup expected {}, got {}",
                        fmt_list(v),
                        fmt_list(&got)
                    ));
                }
            }
            Expect::Idle(v) => {
                let got: Vec<f64> = rep
                    .ranks
                    .iter()
                    .map(|r| r.idle.unwrap_or(f64::NAN))
                    .collect();
                let ok = got.len() == v.len()
                    && got.iter().zip(v).all(|(g, e)| (g - *e as f64).abs() < 1e-9);
                if !ok {
                    diffs.push(format!(
                        "{at}: idle expected {}, got {}",
                        fmt_list(v),
                        fmt_list(&got)
                    ));
                }
            }
        }
    }
    CaseResult {
        path: path.into(),
        passed: diffs.is_empty(),
        differences: diffs,
        malformed,
    }
}
