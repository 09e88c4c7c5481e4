//! # schedc: the schedule compiler
//!
//! Front ends ([`import`]) read schedules into the IR of `schedc_ir`; the verifier
//! ([`passes`]) proves what can be proved about them and collects every error as a
//! [`diag::Diagnostic`] with its location; [`check`] runs the whole pipeline and returns the
//! facts (warmup, peak activations, idle) that reports and back ends need.

#![warn(missing_docs)]

pub mod casefile;
pub mod check;
pub mod compare;
pub mod diag;
pub mod dsl;
pub mod import;
pub mod input;
pub mod moe;
pub mod passes;
pub mod plan;
pub mod sim;

pub use schedc_ir as ir;
