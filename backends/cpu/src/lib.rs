//! # schedc-cpu: per-rank programs and a CPU executor
//!
//! * [`mesh`]: global ranks as coordinates over `pp, dp, ep, tp, sp`, and their groups.
//! * [`program`]: the per-rank stream programs a backend runs (streams, events, buffers),
//!   lowered from a verified IR program, and their verifier.
//! * [`model`]: a small DeepSeek-V3-style MoE transformer, forward / input gradient / weight
//!   gradient written by hand, in `f32` and `f64`.
//! * [`exec`]: one thread per global rank running its program with real message passing,
//!   the sequential reference, and the comparison of the two.
//! * [`run`](mod@run): the entry points of `schedc run ... --backend cpu` and `schedc compile`.

#![warn(missing_docs)]

pub mod exec;
pub mod mesh;
pub mod model;
pub mod program;
pub mod run;
pub mod tensor;

pub use run::{compile, run, DType, RunConfig, RunError, RunReport};
