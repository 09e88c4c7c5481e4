//! `schedc compile`: per-rank stream programs written to a directory.

use crate::common::*;
use crate::run::{mesh, program_error_code};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `schedc compile`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// The device mesh, e.g. `pp=4,dp=2,ep=2,tp=1,sp=1` (default: `pp=P`).
    #[arg(long)]
    pub mesh: Option<String>,
    /// Output directory. It is written whole or not at all (a temporary directory renamed
    /// into place); an existing non-empty directory is refused unless --force.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Replace an existing output directory that holds an earlier `schedc compile`'s output
    /// (manifest.json and rankN.json files only; anything else is refused).
    #[arg(long)]
    pub force: bool,
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

/// Runs `schedc compile`.
pub fn run(args: Args) -> ExitCode {
    let output = args.output;
    let shown = output.display().to_string();
    if is_stdout(&output) {
        eprintln!("error: compile writes a directory of files; `-` (standard output) cannot hold them: give -o DIR");
        return ExitCode::from(2);
    }
    // Refuse before any work what cannot be written.
    let existing = std::fs::symlink_metadata(&output).is_ok();
    if existing {
        if !output.is_dir() {
            eprintln!("error: `{shown}` exists and is not a directory");
            return ExitCode::from(2);
        }
        let empty = std::fs::read_dir(&output)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if !empty && !args.force {
            eprintln!(
                "error: `{shown}` exists and is not empty; not writing into it (pass --force to replace an earlier compile's output)"
            );
            return ExitCode::from(2);
        }
        if !empty && !is_compile_output(&output) {
            eprintln!(
                "error: `{shown}` holds files that `schedc compile` did not write; not replacing it, even with --force"
            );
            return ExitCode::from(2);
        }
    } else if let Some(parent) = output.parent() {
        if !parent.as_os_str().is_empty() && !parent.is_dir() {
            eprintln!(
                "error: cannot write `{shown}`: the directory `{}` does not exist",
                parent.display()
            );
            return ExitCode::from(2);
        }
    }
    let mesh = match mesh(&args.mesh) {
        Ok(m) => m,
        Err(c) => return c,
    };
    let model = schedc_program::ModelConfig::small();
    // Refuse what cannot fit before the spec is elaborated.
    if let Err(c) = pre_check(&args.input, "compiling", |size| {
        let world = mesh.as_ref().map_or(size.ranks, |m| m.world() as u64);
        schedc_program::estimate_memory(size, world, &model)
    }) {
        return c;
    }
    let program = match load(&args.input, None) {
        Ok(l) => l.program,
        Err(c) => return c,
    };
    let world = mesh
        .as_ref()
        .map_or(program.pipeline.pp as u64, |m| m.world() as u64);
    let size = schedc::limits::Size::of(&program);
    if let Err(e) = schedc::limits::within_limit(
        &format!("compiling {} for {world} global ranks", args.input.name()),
        schedc_program::estimate_memory(&size, world, &model),
    ) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let (set, rep) = match schedc_program::lower_verified(&program, mesh.as_ref(), &model) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(program_error_code(&e));
        }
    };
    // Write into a temporary sibling directory, then rename it into place.
    let tmp = temp_sibling(&output, "dir");
    let files = match set.write_dir(&tmp) {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            eprintln!("error: cannot write the programs to `{shown}`: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = replace_dir(&tmp, &output) {
        let _ = std::fs::remove_dir_all(&tmp);
        eprintln!("error: cannot write `{shown}`: {e}");
        return ExitCode::from(2);
    }
    emit_then(
        &format!(
            "wrote {} files to {shown} (verified: {} instructions, {} messages, peak stash per rank {:?})\n",
            files.len(),
            rep.ops,
            rep.messages,
            rep.peak_stash
        ),
        ExitCode::SUCCESS,
    )
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
    if let Err(e) = std::fs::rename(tmp, dst) {
        // Put the earlier output back.
        let _ = std::fs::rename(&old, dst);
        return Err(e);
    }
    std::fs::remove_dir_all(&old)
}
