//! The schedule language: `.sched` files describe a *family* of schedules, parametric in the
//! number of ranks `P`, micro-batches `M`, virtual stages per rank `V` and user parameters;
//! [`elab::elaborate`] turns one instance into the IR, which `schedc check` then verifies.
//!
//! ```text
//! # 1F1B (PipeDream-Flush; Narayanan et al. 2021, section 2.2)
//! schedule "1f1b"
//! vpp 1
//! placement loop
//! require M >= 1, "1F1B needs at least one micro-batch"
//!
//! rank r {
//!     let warmup = min(P - r - 1, M)
//!     repeat warmup { F(0) }
//!     repeat M - warmup { F(0)  BW(0) }
//!     repeat warmup { BW(0) }
//! }
//!
//! expect warmup == min(P - r, M)
//! ```
//!
//! The book's chapter "The schedule language" is the reference: items, statements,
//! expressions (floor division and modulo), op counters per local chunk, the pending-W
//! queue, expectations.

pub mod ast;
pub mod elab;
pub mod fmt;
pub mod list;
pub mod parse;

pub use elab::{elaborate, ElabError, Elaborated, Instance};
pub use parse::{parse_file, SyntaxError};
