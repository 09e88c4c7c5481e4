//! Front ends: every input format schedc reads, each returning the IR and a source map.
//!
//! All importers report bad input as a [`schedc_ir::text::ParseError`] with its byte offset,
//! line and column; none panics.

pub mod dualpipe;
pub mod torch;
