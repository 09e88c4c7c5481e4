//! `schedc fmt`: the canonical layout of a spec.

use crate::common::*;
use schedc_ir::text::{self, ParseError};
use std::process::ExitCode;

/// `schedc fmt`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The spec (`-` reads standard input).
    pub file: std::path::PathBuf,
    /// Rewrite the file in place (only if it parses; the original is replaced atomically).
    #[arg(long, conflicts_with = "check")]
    pub write: bool,
    /// Exit 1 if the file is not in canonical layout (for CI); print nothing.
    #[arg(long)]
    pub check: bool,
}

/// Runs `schedc fmt`.
pub fn run(args: Args) -> ExitCode {
    let Args { file, write, check } = args;
    let name = file.to_string_lossy().into_owned();
    if is_stdout(&file) && write {
        eprintln!("error: --write needs a file, not standard input");
        return ExitCode::from(2);
    }
    // Only specs have a canonical layout here; other formats would fail as a spec's syntax
    // error at 1:1.
    let ext = file
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    if matches!(ext.as_str(), "ir" | "case" | "csv" | "json") {
        eprintln!(
            "error: `{name}` is not a spec: schedc fmt formats `.sched` specs (IR text, CSV and JSON are written in their layout by `schedc convert`)"
        );
        return ExitCode::from(2);
    }
    let text = match schedc::input::read_text(&file) {
        Ok(t) => t,
        Err(e) => {
            print_load_error(&e, &name);
            return ExitCode::from(2);
        }
    };
    let parsed = match schedc::dsl::parse_file(&text) {
        Ok(f) => f,
        Err(e) => {
            let pe = ParseError {
                offset: e.offset,
                len: e.len,
                line: text::line_col(&text, e.offset).0,
                col: text::line_col(&text, e.offset).1,
                message: e.message,
                help: e.help,
            };
            eprint!("{}", render_parse_error(&pe, &name));
            return ExitCode::from(2);
        }
    };
    let out = schedc::dsl::fmt::format_file(&parsed, &text);
    if check {
        return if out == text {
            ExitCode::SUCCESS
        } else {
            eprintln!("{name} is not formatted (run `schedc fmt --write {name}`)");
            ExitCode::from(1)
        };
    }
    if write {
        if out != text {
            // Write the file a symbolic link points to, keep its permissions, and
            // replace it atomically.
            let target = std::fs::canonicalize(&file).unwrap_or_else(|_| file.clone());
            let tmp = target.with_extension("schedc-fmt.tmp");
            let res = std::fs::write(&tmp, &out)
                .and_then(|_| std::fs::metadata(&target))
                .and_then(|m| std::fs::set_permissions(&tmp, m.permissions()))
                .and_then(|_| std::fs::rename(&tmp, &target));
            if let Err(e) = res {
                let _ = std::fs::remove_file(&tmp);
                eprintln!("error: cannot write `{}`: {e}", target.display());
                return ExitCode::from(2);
            }
        }
    } else {
        return emit_then(&out, ExitCode::SUCCESS);
    }
    ExitCode::SUCCESS
}
