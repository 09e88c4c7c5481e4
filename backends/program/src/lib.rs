//! # schedc-program: per-rank stream programs, the contract between schedc and its backends
//!
//! A verified schedule (an IR [`Program`]) becomes one stream program per global rank of a
//! device [`Mesh`]; every backend runs exactly these programs: the CPU reference executor in
//! `schedc-cpu` at [`Granularity::Model`] (kernels of schedc's own model), the
//! `torch.distributed` runtime of `backends/torch/schedc_torch_runtime.py` at
//! [`Granularity::Stage`] (one kernel per op of the user's own stages).
//!
//! * [`format`](mod@format): the programs (streams, events, buffers, kernels, messages, collectives), the
//!   manifest and their JSON files (`schedc compile -o DIR`), with [`FORMAT_VERSION`];
//! * [`lower`](mod@lower): [`ProgramSet::lower`], from an IR program, a mesh and a
//!   [`ModelConfig`];
//! * [`verify`](mod@verify): the program verifier ([`verify()`]): events, buffers under
//!   happens-before, every rank runs to completion;
//! * [`mesh`]: global ranks as coordinates over `pp, dp, ep, tp, sp`, and their groups;
//! * [`model`]: the sizes and hyper-parameters of the model the kernels belong to;
//! * [`data`]: the training data and which sequence each micro-batch of each rank reads;
//! * [`interp`]: the device-neutral interpreter of a rank program (streams, events, buffer
//!   lifetimes, blocking, timeouts, aborts) behind the small [`interp::Device`] trait a
//!   backend implements.
//!
//! [`compile`] is `schedc compile`: lower, verify, write.

#![warn(missing_docs)]

pub mod data;
pub mod format;
pub mod interp;
pub mod lower;
pub mod memory;
pub mod mesh;
pub mod model;
pub mod verify;

#[cfg(test)]
mod tests;

pub use format::*;
pub use lower::LowerOptions;
pub use mesh::Mesh;
pub use model::ModelConfig;
pub use verify::{verify, VerifyReport};

use schedc_ir::Program;
use std::path::{Path, PathBuf};

/// Bytes per lowered instruction for lowering and verifying (the programs, the verifier's
/// happens-before clocks), measured: about 160 B (`schedc run specs/1f1b.sched --pp 4 --mb
/// 4096` peaks at 96 MB for 536 604 instructions), doubled.
pub const BYTES_PER_INSTRUCTION: u64 = 320;

/// Lowered instructions per compute op, per layer of a stage and per replica of the
/// pipeline (`world / pp`): measured 16.4 (`--pp 4 --mb 1024`, 134 172 instructions for 8192
/// compute ops) to 17.4 (`--pp 8 --mb 512 --mesh pp=8,dp=2,ep=2`), rounded up.
pub const INSTRUCTIONS_PER_COMPUTE_OP: u64 = 20;

/// The estimated peak memory of lowering and verifying an IR program of `size` for `world`
/// global ranks under `model` (`schedc compile`), bytes (saturating); the estimate
/// `schedc::limits` compares with the limit.
pub fn estimate_memory(size: &schedc::limits::Size, world: u64, model: &ModelConfig) -> u64 {
    let replicas = (world / size.ranks.max(1)).max(1);
    let instrs = size
        .compute_ops
        .saturating_mul(INSTRUCTIONS_PER_COMPUTE_OP)
        .saturating_mul(model.layers_per_stage.max(1) as u64)
        .saturating_mul(replicas);
    schedc::limits::estimate(schedc::limits::Work::Check, size)
        .saturating_add(instrs.saturating_mul(BYTES_PER_INSTRUCTION))
}

/// Why [`compile`] failed.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// Lowering or verifying the programs.
    #[error(transparent)]
    Program(#[from] ProgramError),
    /// Writing the programs.
    #[error("cannot write the programs: {0}")]
    Io(#[from] std::io::Error),
}

/// Lowers `source` for `mesh` (pipeline-only, `pp=P`, if `None`) and the model, and
/// verifies the result. Errors: see [`ProgramSet::lower`] and [`verify()`].
pub fn lower_verified(
    source: &Program,
    mesh: Option<&Mesh>,
    model: &ModelConfig,
) -> Result<(ProgramSet, VerifyReport), ProgramError> {
    lower_verified_with(source, mesh, model, LowerOptions::default())
}

/// [`lower_verified`] with lowering options (e.g. [`Granularity::Stage`]).
pub fn lower_verified_with(
    source: &Program,
    mesh: Option<&Mesh>,
    model: &ModelConfig,
    opts: LowerOptions,
) -> Result<(ProgramSet, VerifyReport), ProgramError> {
    let mesh = mesh
        .cloned()
        .unwrap_or_else(|| Mesh::pipeline(source.pipeline.pp));
    let set = ProgramSet::lower(source, &mesh, model, opts)?;
    let rep = verify(&set, source)?;
    Ok((set, rep))
}

/// `schedc compile INPUT ... [--granularity stage] -o DIR`: lowers, verifies, writes
/// `manifest.json` and one `rankG.json` per global rank ([`ProgramSet::write_dir`]);
/// returns the verification and the files written. Errors: [`CompileError`].
pub fn compile(
    source: &Program,
    mesh: Option<&Mesh>,
    model: &ModelConfig,
    opts: LowerOptions,
    dir: &Path,
) -> Result<(VerifyReport, Vec<PathBuf>), CompileError> {
    let (set, rep) = lower_verified_with(source, mesh, model, opts)?;
    let files = set.write_dir(dir)?;
    Ok((rep, files))
}
