//! # schedc-cpu: the CPU backend
//!
//! Runs the per-rank stream programs of `schedc-program` on the CPU, exactly:
//!
//! * [`model`]: a small DeepSeek-V3-style MoE transformer, forward / input gradient / weight
//!   gradient written by hand, in `f32` and `f64` (its sizes are
//!   [`schedc_program::ModelConfig`]);
//! * [`tensor`]: the dense kernels it is built from;
//! * [`exec`]: one thread per global rank, each a [`schedc_program::interp::Device`] run by
//!   the device-neutral interpreter, with real message passing; the sequential reference and
//!   the comparison of the two;
//! * [`run`](mod@run): the entry point of `schedc run ... --backend cpu`.

#![warn(missing_docs)]

pub mod exec;
pub mod model;
pub mod run;
pub mod tensor;

pub use run::{run, DType, RunConfig, RunError, RunReport, Tolerance, Verification, Worst};
