//! `schedc test`: run `.case` files against their `expect` lines.

use crate::common::*;
use std::process::ExitCode;

/// `schedc test`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The case files.
    #[arg(required = true)]
    pub files: Vec<std::path::PathBuf>,
}

/// Runs `schedc test`.
pub fn run(args: Args) -> ExitCode {
    let Args { files } = args;
    use std::fmt::Write as _;
    let mut o = String::new();
    let (mut pass, mut fail, mut unreadable) = (0, 0, false);
    for f in &files {
        let r = schedc::casefile::run_case(f);
        let f = f.display();
        if r.passed {
            pass += 1;
            let _ = writeln!(o, "PASS {f}");
        } else {
            fail += 1;
            // A file that cannot be loaded or whose `expect` lines are malformed is unusable
            // input (2), not a failed case (1).
            unreadable |= r.malformed;
            let _ = writeln!(o, "FAIL {f}");
            for d in &r.differences {
                let _ = writeln!(o, "    {d}");
            }
        }
    }
    let _ = writeln!(o, "{pass} passed, {fail} failed");
    let code = if unreadable {
        ExitCode::from(2)
    } else if fail == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    emit_then(&o, code)
}
