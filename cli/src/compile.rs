//! `schedc compile`: per-rank stream programs written to a directory, and with
//! `--backend cuda --ptx DIR` the PTX of every CUDA kernel.

use crate::common::*;
use crate::run::{mesh, program_error_code};
use std::path::{Path, PathBuf};
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
    #[command(flatten)]
    pub order_cost: OrderCostArgs,
    #[command(flatten)]
    pub model: crate::run::ModelArgs,
    /// The device mesh, e.g. `pp=4,dp=2,ep=2,tp=1,sp=1` (default: `pp=P`).
    #[arg(long)]
    pub mesh: Option<String>,
    /// What the kernels are: `model` (schedc's MoE transformer per layer, what `schedc run`
    /// trains) or `stage` (one kernel per F/B/W/BW of a stage or MoE part, for a runtime that
    /// runs the user's model: `backends/torch/schedc_torch_runtime.py`).
    #[arg(long, default_value = "model", value_parser = ["model", "stage"])]
    pub granularity: String,
    /// Output directory of the programs. It is written whole or not at all (a temporary
    /// directory renamed into place); an existing non-empty directory is refused unless
    /// --force.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Replace an existing output directory that holds an earlier `schedc compile`'s output
    /// (manifest.json and rankN.json files only; anything else is refused).
    #[arg(long)]
    pub force: bool,
    /// The backend the programs are for.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: Backend,
    /// With --backend cuda: write every kernel's PTX, one `KERNEL.DTYPE.ptx` file per kernel
    /// and element type (f32, bf16), into this directory (created whole or not at all; must
    /// be absent or empty). Needs NVRTC (libnvrtc.so.13) on the library path.
    #[arg(long)]
    pub ptx: Option<PathBuf>,
    /// With --ptx: the GPU architecture (default sm_90: H100, H200).
    #[arg(long)]
    pub arch: Option<String>,
}

/// True if `dir` holds only what `schedc compile` writes (manifest.json, rankN.json).
fn is_compile_output(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut manifest = false;
    for e in entries {
        let Ok(e) = e else { return false };
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            return false;
        };
        if name == "manifest.json" {
            manifest = true;
            continue;
        }
        let rank = name
            .strip_prefix("rank")
            .and_then(|r| r.strip_suffix(".json"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if !rank || !e.file_type().is_ok_and(|t| t.is_file()) {
            return false;
        }
    }
    manifest
}

/// Refuses, before any work, an output directory that cannot be written: `-`, a file, a
/// directory in a missing parent, or a non-empty directory (unless `replaceable`, then only
/// one holding an earlier compile's output). Exit 2 after printing why.
fn writable_dir(output: &Path, force: bool, replaceable: bool) -> Result<(), ExitCode> {
    let shown = output.display();
    if is_stdout(output) {
        eprintln!("error: compile writes a directory of files; `-` (standard output) cannot hold them: give a directory");
        return Err(ExitCode::from(2));
    }
    if std::fs::symlink_metadata(output).is_ok() {
        if !output.is_dir() {
            eprintln!("error: `{shown}` exists and is not a directory");
            return Err(ExitCode::from(2));
        }
        let empty = std::fs::read_dir(output)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        let may_replace = force && replaceable;
        if !empty && !may_replace {
            eprintln!(
                "error: `{shown}` exists and is not empty; not writing into it{}",
                if replaceable {
                    " (pass --force to replace an earlier compile's output)"
                } else {
                    ""
                }
            );
            return Err(ExitCode::from(2));
        }
        if !empty && !is_compile_output(output) {
            eprintln!(
                "error: `{shown}` holds files that `schedc compile` did not write; not replacing it, even with --force"
            );
            return Err(ExitCode::from(2));
        }
    } else if let Some(parent) = output.parent() {
        if !parent.as_os_str().is_empty() && !parent.is_dir() {
            eprintln!(
                "error: cannot write `{shown}`: the directory `{}` does not exist",
                parent.display()
            );
            return Err(ExitCode::from(2));
        }
    }
    // A directory that cannot be written into (read-only, no permission) is found now, not
    // after the work: create the temporary directory there and remove it again.
    let probe = temp_sibling(output, "dir");
    sweep_stale_temps(output);
    if let Err(e) = std::fs::create_dir(&probe) {
        eprintln!("error: cannot write `{shown}`: {e}");
        return Err(ExitCode::from(2));
    }
    let _ = std::fs::remove_dir(&probe);
    Ok(())
}

/// Writes files into a temporary sibling of `dir` with `write`, then renames it into place.
/// Errors: the message, for exit status 2 (nothing is left behind).
fn write_dir_atomically<T>(
    dir: &Path,
    write: impl FnOnce(&Path) -> Result<T, String>,
) -> Result<T, String> {
    let shown = dir.display();
    // What an earlier run killed by SIGKILL left here; a signal now removes `tmp`.
    sweep_stale_temps(dir);
    let tmp = temp_sibling(dir, "dir");
    signals::remove_on_signal(&tmp);
    let res =
        write(&tmp).and_then(|x| replace_dir(&tmp, dir).map(|_| x).map_err(|e| e.to_string()));
    signals::forget(&tmp);
    match res {
        Ok(x) => Ok(x),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(format!("cannot write `{shown}`: {e}"))
        }
    }
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
    // Before any work, and before NVRTC is loaded.
    if let Some(a) = &args.arch {
        if let Err(e) = schedc_cuda::nvrtc::validate_arch(a) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
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
    if args.force && args.output.is_none() {
        eprintln!("error: --force replaces an earlier -o DIR; there is no -o");
        return ExitCode::from(2);
    }
    if args.output.is_some() && args.output == args.ptx {
        eprintln!("error: -o and --ptx name the same directory");
        return ExitCode::from(2);
    }
    // Refuse before any work what cannot be written.
    if let Some(o) = &args.output {
        if let Err(c) = writable_dir(o, args.force, true) {
            return c;
        }
    }
    if let Some(d) = &args.ptx {
        if let Err(c) = writable_dir(d, false, false) {
            return c;
        }
    }
    let mesh = match mesh(&args.mesh) {
        Ok(m) => m,
        Err(c) => return c,
    };
    if let Err(e) = args.model.check() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let model = schedc_program::ModelConfig::small();
    // Refuse what cannot fit before the spec is elaborated.
    if let Err(c) = pre_check(&args.input, "compiling", mesh.as_ref(), |size| {
        let world = mesh.as_ref().map_or(size.ranks, |m| m.world() as u64);
        schedc_program::estimate_memory(size, world, &model)
    }) {
        return c;
    }
    let order_model = match args.order_cost.model(&args.input) {
        Ok(m) => m,
        Err(c) => return c,
    };
    let order_name = args.order_cost.name();
    let program = match load_for_under(
        &args.input,
        None,
        order_model.as_ref().map(|m| (m, order_name.as_str())),
    ) {
        Ok(l) => l.program,
        Err(f) => return f.code(),
    };
    let model = match args.model.config(program.pipeline.stages_per_direction()) {
        Ok((m, notes)) => {
            for n in notes {
                eprintln!("note: --model: {n}");
            }
            m
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let world = mesh
        .as_ref()
        .map_or(program.pipeline.pp as u64, |m| m.world() as u64);
    let size = schedc::limits::Size::of(&program);
    if let Err(e) = schedc::limits::within_limit(
        &format!(
            "compiling {} for {world} global ranks{}",
            args.input.name(),
            mesh.as_ref()
                .map(|m| format!(" (mesh {m})"))
                .unwrap_or_default()
        ),
        schedc_program::estimate_memory(&size, world, &model),
    ) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let (set, rep) =
        match schedc_program::lower_verified_with(&program, mesh.as_ref(), &model, opts) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(program_error_code(&e));
            }
        };
    let mut said = String::new();
    if let Some(output) = &args.output {
        let files =
            match write_dir_atomically(output, |tmp| set.write_dir(tmp).map_err(|e| e.to_string()))
            {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
        said += &format!(
            "wrote {} files to {} (verified: {} instructions, {} messages, peak activations per rank {:?})\n",
            files.len(),
            output.display(),
            rep.ops,
            rep.messages,
            rep.peak_activations
        );
    }
    if let Some(dir) = &args.ptx {
        let arch = args
            .arch
            .as_deref()
            .unwrap_or(schedc_cuda::nvrtc::DEFAULT_ARCH);
        use schedc_cuda::api::DType;
        // NVRTC missing is the environment's (2); a kernel it does not compile, ours (1).
        if let Some(why) = schedc_cuda::nvrtc::unavailable() {
            let _ = emit(&said);
            eprintln!("error: {why}");
            return ExitCode::from(2);
        }
        let files = match schedc_cuda::nvrtc::compile_each(arch, &[DType::F32, DType::Bf16]) {
            Ok(f) => f,
            Err(e) => {
                let _ = emit(&said);
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        };
        if let Err(e) = write_dir_atomically(dir, |tmp| {
            std::fs::create_dir(tmp).map_err(|e| e.to_string())?;
            for (name, ptx) in &files {
                std::fs::write(tmp.join(name), ptx).map_err(|e| format!("{name}: {e}"))?;
            }
            Ok(())
        }) {
            // The programs written above are reported first, then the error.
            let _ = emit(&said);
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
        said += &format!(
            "NVRTC compiled {} kernels ({} kernel sources for f32 and bf16) for {arch} into {}\n",
            files.len(),
            files.len() / 2,
            dir.display()
        );
    }
    emit_then(&said, ExitCode::SUCCESS)
}

/// Moves the complete directory `tmp` to `dst`: over an empty directory directly; over an
/// earlier output by moving that aside first and deleting it once the new one is in place.
fn replace_dir(tmp: &Path, dst: &Path) -> std::io::Result<()> {
    let empty = std::fs::read_dir(dst)
        .map(|mut d| d.next().is_none())
        .unwrap_or(true);
    if !dst.exists() || empty {
        if dst.exists() {
            std::fs::remove_dir(dst)?;
        }
        return std::fs::rename(tmp, dst);
    }
    let old = temp_sibling(dst, "old");
    std::fs::rename(dst, &old)?;
    // Not registered for removal on a signal: until the new output is in place, `old` is
    // the only copy of the earlier one.
    if let Err(e) = std::fs::rename(tmp, dst) {
        // Put the earlier output back.
        let _ = std::fs::rename(&old, dst);
        return Err(e);
    }
    std::fs::remove_dir_all(&old)
}
