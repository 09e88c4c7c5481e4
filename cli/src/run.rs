//! `schedc run`: train the model under a schedule on a backend.

use crate::common::*;
use clap::ValueEnum;
use schedc_cpu::{DType, RunConfig};
use schedc_program::mesh::Mesh;
use std::process::ExitCode;

/// `--backend`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Backend {
    Cpu,
}

/// `--dtype`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F64,
}

/// `schedc run`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// The device mesh, e.g. `pp=4,dp=2,ep=2,tp=1,sp=1` (default: `pp=P`).
    #[arg(long)]
    pub mesh: Option<String>,
    /// The backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: Backend,
    /// Floating-point precision.
    #[arg(long, value_enum, default_value = "f64")]
    pub dtype: Dtype,
    /// Optimizer steps.
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// Training text (bytes are tokens); default: a short built-in text.
    #[arg(long)]
    pub data: Option<std::path::PathBuf>,
    /// Also train sequentially on the same data and weights and compare.
    #[arg(long)]
    pub verify: bool,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
}

/// Parses `--mesh`. Errors: exit 2 after printing why.
pub fn mesh(m: &Option<String>) -> Result<Option<Mesh>, ExitCode> {
    match m {
        None => Ok(None),
        Some(m) => m.parse().map(Some).map_err(|e| {
            eprintln!("error: --mesh: {e}");
            ExitCode::from(2)
        }),
    }
}

/// Runs `schedc run`.
pub fn run(args: Args) -> ExitCode {
    let program = match load(&args.input) {
        Ok(l) => l.program,
        Err(c) => return c,
    };
    let mesh = match mesh(&args.mesh) {
        Ok(m) => m,
        Err(c) => return c,
    };
    let cfg = RunConfig {
        mesh,
        dtype: match args.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
        },
        steps: args.steps,
        data: args.data,
        verify: args.verify,
        progress: args.format == OutFormat::Human,
        ..RunConfig::default()
    };
    let report = match args.backend {
        Backend::Cpu => schedc_cpu::run(&program, &cfg),
    };
    match report {
        Ok(r) => {
            match args.format {
                OutFormat::Json => emit(&format!("{}\n", r.to_json())),
                OutFormat::Human => emit(&r.to_human()),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
