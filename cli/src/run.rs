//! `schedc run`: train the model under a schedule on a backend.

use crate::common::*;
use clap::ValueEnum;
use schedc_cpu::{DType, RunConfig, RunError};
use schedc_program::mesh::Mesh;
use schedc_program::ProgramError;
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
    /// Optimizer steps (at least 1).
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// Training text (bytes are tokens); default: a short built-in text.
    #[arg(long)]
    pub data: Option<std::path::PathBuf>,
    /// Also train sequentially on the same data and weights and compare: exit status 1 if
    /// a difference exceeds the dtype's tolerance or is NaN (f64: every loss, gradient and
    /// parameter to 1e-9; f32: the first step's gradients to 1e-3 and every loss to 2%).
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

/// The exit status of a program error: 2 for what the command line got wrong (the mesh,
/// the model, something the backend does not run), 1 for a schedule the checks reject.
pub fn program_error_code(e: &ProgramError) -> u8 {
    match e {
        ProgramError::Mesh(_) | ProgramError::Model(_) | ProgramError::Unsupported(_) => 2,
        ProgramError::Rejected(_)
        | ProgramError::Invalid { .. }
        | ProgramError::Buffer { .. }
        | ProgramError::Deadlock(_) => 1,
    }
}

/// Prints an error: to standard error, and with `--format json` as `{"error": ..., "exit":
/// N}` on standard output. Returns the exit status.
fn fail(format: OutFormat, message: &str, code: u8) -> ExitCode {
    eprintln!("error: {message}");
    if format == OutFormat::Json {
        let v = serde_json::json!({"error": message, "exit": code});
        return emit_then(&format!("{v}\n"), ExitCode::from(code));
    }
    ExitCode::from(code)
}

/// Runs `schedc run`.
pub fn run(args: Args) -> ExitCode {
    let format = args.format;
    let mesh = match args.mesh.as_ref().map(|m| m.parse::<Mesh>()).transpose() {
        Ok(m) => m,
        Err(e) => return fail(format, &format!("--mesh: {e}"), 2),
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
        progress: format == OutFormat::Human,
        ..RunConfig::default()
    };
    // Refuse what cannot fit before the spec is elaborated.
    if let Err(c) = pre_check(&args.input, "running", |size| {
        let world = cfg.mesh.as_ref().map_or(size.ranks, |m| m.world() as u64);
        schedc_cpu::run::estimate_memory_of(size, world, &cfg)
    }) {
        return c;
    }
    let program = match load_for(&args.input, None) {
        Ok(l) => l.program,
        Err(f) => {
            if format == OutFormat::Json {
                let v =
                    serde_json::json!({"error": f.message, "exit": if f.refused { 1 } else { 2 }});
                return emit_then(&format!("{v}\n"), f.code);
            }
            return f.code;
        }
    };
    let report = match args.backend {
        Backend::Cpu => schedc_cpu::run(&program, &cfg),
    };
    match report {
        Ok(r) => {
            let code = if r.verify_passed == Some(false) {
                eprintln!(
                    "error: --verify: the pipelined run differs from sequential training by more than the {} tolerance",
                    match cfg.dtype {
                        DType::F32 => "f32",
                        DType::F64 => "f64",
                    }
                );
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            };
            match format {
                OutFormat::Json => emit_then(&format!("{}\n", r.to_json()), code),
                OutFormat::Human => emit_then(&r.to_human(), code),
            }
        }
        Err(e) => {
            let code = match &e {
                RunError::Program(p) => program_error_code(p),
                RunError::Config(_) | RunError::TooLarge(_) => 2,
                RunError::Failed(_) => 1,
            };
            fail(format, &e.to_string(), code)
        }
    }
}
