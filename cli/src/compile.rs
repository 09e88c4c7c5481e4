//! `schedc compile`: per-rank stream programs written to a directory, and with
//! `--backend cuda --ptx DIR` the PTX of every CUDA kernel.

use crate::common::*;
use crate::run::mesh;
use std::path::Path;
use std::process::ExitCode;

/// `--backend` of `compile`.
#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq)]
pub enum Backend {
    /// Programs only (every backend runs the same programs).
    Cpu,
    /// Programs, and with --ptx the kernels compiled by NVRTC.
    Cuda,
}

/// `schedc compile`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// The device mesh, e.g. `pp=4,dp=2,ep=2,tp=1,sp=1` (default: `pp=P`).
    #[arg(long)]
    pub mesh: Option<String>,
    /// What the kernels are: `model` (schedc's MoE transformer per layer, what `schedc run`
    /// trains) or `stage` (one kernel per F/B/W/BW of a stage or MoE part, for a runtime that
    /// runs the user's model: `backends/torch/schedc_torch_runtime.py`).
    #[arg(long, default_value = "model", value_parser = ["model", "stage"])]
    pub granularity: String,
    /// Output directory of the programs (created; existing files in it are not
    /// overwritten).
    #[arg(short, long)]
    pub output: Option<std::path::PathBuf>,
    /// The backend the programs are for.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: Backend,
    /// With --backend cuda: write every kernel's PTX, one `KERNEL.DTYPE.ptx` file per kernel
    /// and element type (f32, bf16), into this directory (created; must be empty). Needs
    /// NVRTC (libnvrtc.so.13) on the library path.
    #[arg(long)]
    pub ptx: Option<std::path::PathBuf>,
    /// With --ptx: the GPU architecture (default sm_90: H100, H200).
    #[arg(long)]
    pub arch: Option<String>,
}

/// Refuses a directory that exists with files in it (exit 2).
fn fresh(dir: &Path) -> Result<(), ExitCode> {
    if dir.exists()
        && std::fs::read_dir(dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        eprintln!(
            "error: `{}` exists and is not empty; not writing into it",
            dir.display()
        );
        return Err(ExitCode::from(2));
    }
    Ok(())
}

/// Runs `schedc compile`.
pub fn run(args: Args) -> ExitCode {
    if args.output.is_none() && args.ptx.is_none() {
        eprintln!("error: nothing to write: give -o DIR (programs) or, with --backend cuda, --ptx DIR (kernels)");
        return ExitCode::from(2);
    }
    if (args.ptx.is_some() || args.arch.is_some()) && args.backend != Backend::Cuda {
        eprintln!("error: --ptx and --arch need --backend cuda");
        return ExitCode::from(2);
    }
    let opts = schedc_program::LowerOptions {
        granularity: match args.granularity.parse() {
            Ok(g) => g,
            Err(e) => {
                eprintln!("error: --granularity: {e}");
                return ExitCode::from(2);
            }
        },
        ..Default::default()
    };
    if opts.granularity == schedc_program::Granularity::Stage && args.backend == Backend::Cuda {
        eprintln!("error: --granularity stage is for a runtime of your own model; the CUDA backend runs schedc's model (--granularity model)");
        return ExitCode::from(2);
    }
    let program = match load(&args.input) {
        Ok(l) => l.program,
        Err(c) => return c,
    };
    let mesh = match mesh(&args.mesh) {
        Ok(m) => m,
        Err(c) => return c,
    };
    for d in [&args.output, &args.ptx].into_iter().flatten() {
        if let Err(c) = fresh(d) {
            return c;
        }
    }
    let model = schedc_program::ModelConfig::small();
    if let Some(output) = &args.output {
        match schedc_program::compile(&program, mesh.as_ref(), &model, opts, output) {
            Ok((rep, files)) => {
                emit(&format!(
                    "wrote {} files to {} (verified: {} instructions, {} messages, peak stash per rank {:?})\n",
                    files.len(),
                    output.display(),
                    rep.ops,
                    rep.messages,
                    rep.peak_stash
                ));
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        }
    } else if let Err(e) =
        schedc_program::lower_verified_with(&program, mesh.as_ref(), &model, opts)
    {
        eprintln!("error: {e}");
        return ExitCode::from(1);
    }
    if let Some(dir) = &args.ptx {
        let arch = args
            .arch
            .as_deref()
            .unwrap_or(schedc_cuda::nvrtc::DEFAULT_ARCH);
        use schedc_cuda::api::DType;
        let files = match schedc_cuda::nvrtc::compile_each(arch, &[DType::F32, DType::Bf16]) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        };
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("error: cannot create {}: {e}", dir.display());
            return ExitCode::from(1);
        }
        for (name, ptx) in &files {
            if let Err(e) = std::fs::write(dir.join(name), ptx) {
                eprintln!("error: cannot write {}: {e}", dir.join(name).display());
                return ExitCode::from(1);
            }
        }
        emit(&format!(
            "NVRTC compiled {} kernels ({} kernel sources for f32 and bf16) for {arch} into {}\n",
            files.len(),
            files.len() / 2,
            dir.display()
        ));
    }
    ExitCode::SUCCESS
}
