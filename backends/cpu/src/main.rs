//! `schedc-cpu`: the CPU backend's commands, run by `schedc run ... --backend cpu` and
//! `schedc compile ...` (the `schedc` binary executes this one, which sits next to it).

use clap::{Parser, Subcommand, ValueEnum};
use schedc::input::{load_path, LoadError, Overrides};
use schedc_cpu::{compile, run, DType, RunConfig};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "schedc-cpu",
    version,
    about = "schedc's CPU backend: compile schedules to per-rank programs and train a small MoE transformer under them"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Backend {
    Cpu,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Dtype {
    F32,
    F64,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Format {
    Human,
    Json,
}

#[derive(clap::Args)]
struct Input {
    /// A spec (`.sched`) or any schedule schedc reads.
    input: String,
    /// Pipeline ranks (specs).
    #[arg(long)]
    pp: Option<u32>,
    /// Micro-batches per step.
    #[arg(long = "mb")]
    mb: Option<u32>,
    /// Virtual stages per rank (specs).
    #[arg(long)]
    vpp: Option<u32>,
    /// The device mesh, e.g. `pp=4,dp=2,ep=2,tp=1,sp=1` (default: `pp=P`).
    #[arg(long)]
    mesh: Option<String>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train under the schedule, one thread per global rank.
    Run {
        #[command(flatten)]
        input: Input,
        /// The backend.
        #[arg(long, value_enum, default_value = "cpu")]
        backend: Backend,
        /// Floating-point precision.
        #[arg(long, value_enum, default_value = "f64")]
        dtype: Dtype,
        /// Optimizer steps.
        #[arg(long, default_value_t = 1)]
        steps: usize,
        /// Training text (bytes are tokens); default: a short built-in text.
        #[arg(long)]
        data: Option<std::path::PathBuf>,
        /// Also train sequentially on the same data and weights and compare.
        #[arg(long)]
        verify: bool,
        /// Output format.
        #[arg(long, value_enum, default_value = "human")]
        format: Format,
    },
    /// Lower the schedule to per-rank stream programs and write them to a directory (one
    /// file per rank and a manifest), after verifying them.
    Compile {
        #[command(flatten)]
        input: Input,
        /// Output directory (created; existing files in it are not overwritten).
        #[arg(short, long)]
        output: std::path::PathBuf,
    },
}

fn load(i: &Input) -> Result<schedc_ir::Program, ExitCode> {
    let ov = Overrides {
        pp: i.pp,
        microbatches: i.mb,
        vpp: i.vpp,
        ..Default::default()
    };
    match load_path(&i.input, &ov) {
        Ok(l) => Ok(l.program),
        Err(e) => {
            let (msg, code) = match e {
                LoadError::Io(s) | LoadError::Usage(s) => (s, 2),
                LoadError::Parse(p) => (
                    format!("{}:{}:{}: {}", i.input, p.line, p.col, p.message),
                    2,
                ),
                LoadError::Spec { diags, refused, .. } => (
                    diags
                        .iter()
                        .map(|d| d.message.clone())
                        .collect::<Vec<_>>()
                        .join("; "),
                    if refused { 1 } else { 2 },
                ),
            };
            eprintln!("error: {msg}");
            Err(ExitCode::from(code))
        }
    }
}

fn mesh(i: &Input) -> Result<Option<schedc_cpu::mesh::Mesh>, ExitCode> {
    match &i.mesh {
        None => Ok(None),
        Some(m) => m.parse().map(Some).map_err(|e| {
            eprintln!("error: --mesh: {e}");
            ExitCode::from(2)
        }),
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match cli.cmd {
        Cmd::Run {
            input,
            backend: _,
            dtype,
            steps,
            data,
            verify,
            format,
        } => {
            let program = match load(&input) {
                Ok(p) => p,
                Err(c) => return c,
            };
            let mesh = match mesh(&input) {
                Ok(m) => m,
                Err(c) => return c,
            };
            let cfg = RunConfig {
                mesh,
                dtype: if dtype == Dtype::F32 {
                    DType::F32
                } else {
                    DType::F64
                },
                steps,
                data,
                verify,
                progress: format == Format::Human,
                ..RunConfig::default()
            };
            match run(&program, &cfg) {
                Ok(r) => {
                    match format {
                        Format::Json => println!("{}", r.to_json()),
                        Format::Human => print!("{}", r.to_human()),
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Compile { input, output } => {
            let program = match load(&input) {
                Ok(p) => p,
                Err(c) => return c,
            };
            let mesh = match mesh(&input) {
                Ok(m) => m,
                Err(c) => return c,
            };
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
            match compile(
                &program,
                mesh.as_ref(),
                &RunConfig::default().model,
                &output,
            ) {
                Ok((rep, files)) => {
                    println!(
                        "wrote {} files to {} (verified: {} instructions, {} messages, peak stash per rank {:?})",
                        files.len(),
                        output.display(),
                        rep.ops,
                        rep.messages,
                        rep.peak_stash
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(1)
                }
            }
        }
    }
}
