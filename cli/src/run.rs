//! `schedc run`: train the model under a schedule on a backend.

use crate::common::*;
use clap::ValueEnum;
use schedc_cpu::{DType, RunConfig};
use schedc_program::mesh::Mesh;
use std::process::ExitCode;
use std::sync::Arc;

/// `--backend`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Backend {
    /// The CPU reference executor (one thread per global rank).
    Cpu,
    /// The CUDA/NCCL backend (kernels compiled by NVRTC at run time).
    Cuda,
}

/// `--dtype`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F64,
    Bf16,
}

/// `--mode` of the CUDA backend.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Mode {
    /// Every rank in this process on one GPU, each with its own streams.
    Single,
    /// One process per GPU, NCCL between them.
    Nccl,
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
    /// Floating-point precision (default: f64 on the CPU, f32 on CUDA; CUDA takes f32 or
    /// bf16 storage with f32 accumulation).
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// CUDA: all ranks on one GPU (`single`), or one process per GPU with NCCL (`nccl`;
    /// without --rank, this process starts one per rank on this node's GPUs).
    #[arg(long, value_enum, default_value = "single")]
    pub mode: Mode,
    /// CUDA NCCL mode: this process's global rank (with --rendezvous; one process per GPU,
    /// started by a cluster launcher).
    #[arg(long)]
    pub rank: Option<u32>,
    /// CUDA NCCL mode: where the ranks meet, `tcp://HOST:PORT` (rank 0 listens) or
    /// `file:PATH` on a shared file system.
    #[arg(long)]
    pub rendezvous: Option<String>,
    /// CUDA: the GPU of this process (default: 0; with --rank, the rank modulo the GPUs).
    #[arg(long)]
    pub device: Option<usize>,
    /// CUDA: the GPU architecture NVRTC compiles for (default: the device's, e.g. sm_90).
    #[arg(long)]
    pub arch: Option<String>,
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

fn usage(msg: &str) -> ExitCode {
    eprintln!("error: {msg}");
    ExitCode::from(2)
}

/// A progress bar on standard error, advanced by a step callback.
fn progress(
    steps: usize,
) -> (
    indicatif::ProgressBar,
    Arc<dyn Fn(usize, f64) + Send + Sync>,
) {
    let b = indicatif::ProgressBar::new(steps as u64);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps {elapsed_precise} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let bc = b.clone();
    (
        b,
        Arc::new(move |_step: usize, loss: f64| {
            bc.set_message(format!("loss {loss:.4}"));
            bc.inc(1);
        }),
    )
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
    if args.backend == Backend::Cuda {
        return run_cuda(args, program, mesh);
    }
    if args.mode != Mode::Single
        || args.rank.is_some()
        || args.rendezvous.is_some()
        || args.arch.is_some()
        || args.device.is_some()
    {
        return usage("--mode, --rank, --rendezvous, --device and --arch are for --backend cuda");
    }
    let dtype = match args.dtype.unwrap_or(Dtype::F64) {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::Bf16 => return usage("the CPU backend computes in f32 or f64, not bf16"),
    };
    let cfg = RunConfig {
        mesh,
        dtype,
        steps: args.steps,
        data: args.data,
        verify: args.verify,
        progress: args.format == OutFormat::Human,
        ..RunConfig::default()
    };
    match schedc_cpu::run(&program, &cfg) {
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

fn run_cuda(args: Args, program: schedc_ir::Program, mesh: Option<Mesh>) -> ExitCode {
    use schedc_cuda::run as cu;
    let dtype = match args.dtype.unwrap_or(Dtype::F32) {
        Dtype::F32 => schedc_cuda::api::DType::F32,
        Dtype::Bf16 => schedc_cuda::api::DType::Bf16,
        Dtype::F64 => {
            return usage("the CUDA backend computes in f32 or bf16 (f32 accumulation), not f64")
        }
    };
    let nccl = match (args.mode, args.rank, &args.rendezvous) {
        (Mode::Single, None, None) => None,
        (Mode::Single, _, _) => return usage("--rank and --rendezvous are for --mode nccl"),
        (Mode::Nccl, Some(rank), Some(r)) => match r.parse() {
            Ok(rendezvous) => Some(cu::NcclRank { rank, rendezvous }),
            Err(e) => return usage(&format!("--rendezvous: {e}")),
        },
        (Mode::Nccl, Some(_), None) => return usage("--rank needs --rendezvous"),
        (Mode::Nccl, None, _) => {
            let world = mesh.as_ref().map_or(program.pipeline.pp, |m| m.world());
            return launch_local(world);
        }
    };
    let bar = (args.format == OutFormat::Human).then(|| progress(args.steps));
    let device = args
        .device
        .or_else(|| nccl.as_ref().map(|n| n.rank as usize))
        .unwrap_or(0);
    let cfg = cu::RunConfig {
        mesh,
        dtype,
        mode: match args.mode {
            Mode::Single => cu::Mode::Single,
            Mode::Nccl => cu::Mode::Nccl,
        },
        steps: args.steps,
        data: args.data,
        verify: args.verify,
        on_step: bar.as_ref().map(|b| b.1.clone()),
        device,
        arch: args.arch,
        nccl,
        ..cu::RunConfig::default()
    };
    let r = cu::run(&program, &cfg);
    if let Some((b, _)) = &bar {
        b.finish();
    }
    match r {
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

/// NCCL mode without --rank: one process per rank on this node's GPUs (rank r on GPU r),
/// meeting through a file in a fresh temporary directory; rank 0's report is printed.
fn launch_local(world: u32) -> ExitCode {
    let gpus = match schedc_cuda::cuda::probe(true) {
        Ok(_) => schedc_cuda::cuda::device_count().unwrap_or(0),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    if (gpus as u32) < world {
        eprintln!(
            "error: NCCL mode runs one process per GPU: {world} ranks, {gpus} GPU(s) here (run on a cluster with --rank and --rendezvous, or use --mode single to run every rank on one GPU)"
        );
        return ExitCode::from(1);
    }
    let dir = std::env::temp_dir().join(format!("schedc-nccl-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("error: cannot create {}: {e}", dir.display());
        return ExitCode::from(1);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find this executable to start the ranks: {e}");
            return ExitCode::from(1);
        }
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rdv = format!("file:{}", dir.join("ids").display());
    let mut children = Vec::new();
    for r in 0..world {
        let mut c = std::process::Command::new(&exe);
        c.args(&args).args([
            "--rank",
            &r.to_string(),
            "--rendezvous",
            &rdv,
            "--device",
            &r.to_string(),
        ]);
        if r != 0 {
            c.stdout(std::process::Stdio::null());
        }
        match c.spawn() {
            Ok(ch) => children.push(ch),
            Err(e) => {
                eprintln!("error: cannot start rank {r}: {e}");
                for mut ch in children {
                    let _ = ch.kill();
                }
                return ExitCode::from(1);
            }
        }
    }
    let mut code = ExitCode::SUCCESS;
    for (r, mut ch) in children.into_iter().enumerate() {
        match ch.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("error: rank {r} exited with {s}");
                code = ExitCode::from(1);
            }
            Err(e) => {
                eprintln!("error: rank {r}: {e}");
                code = ExitCode::from(1);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    code
}
