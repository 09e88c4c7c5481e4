//! `schedc compile`: per-rank stream programs written to a directory.

use crate::common::*;
use crate::run::mesh;
use std::process::ExitCode;

/// `schedc compile`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// The device mesh, e.g. `pp=4,dp=2,ep=2,tp=1,sp=1` (default: `pp=P`).
    #[arg(long)]
    pub mesh: Option<String>,
    /// Output directory (created; existing files in it are not overwritten).
    #[arg(short, long)]
    pub output: std::path::PathBuf,
}

/// Runs `schedc compile`.
pub fn run(args: Args) -> ExitCode {
    let program = match load(&args.input) {
        Ok(l) => l.program,
        Err(c) => return c,
    };
    let mesh = match mesh(&args.mesh) {
        Ok(m) => m,
        Err(c) => return c,
    };
    let output = args.output;
    if output.exists()
        && std::fs::read_dir(&output)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        eprintln!(
            "error: `{}` exists and is not empty; not writing into it",
            output.display()
        );
        return ExitCode::from(2);
    }
    match schedc_program::compile(
        &program,
        mesh.as_ref(),
        &schedc_program::ModelConfig::small(),
        &output,
    ) {
        Ok((rep, files)) => {
            emit(&format!(
                "wrote {} files to {} (verified: {} instructions, {} messages, peak stash per rank {:?})\n",
                files.len(),
                output.display(),
                rep.ops,
                rep.messages,
                rep.peak_stash
            ));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
