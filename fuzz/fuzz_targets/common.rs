//! Shared by every fuzz target: run the whole check pipeline on an imported program, when it
//! is small enough that the passes stay fast.

use schedc_ir::text::SourceMap;
use schedc_ir::Program;

/// At most this many instructions over all ranks are checked.
const MAX_INSTRS: usize = 20_000;
/// The passes allocate O(stages * microbatches) tables; keep the shape bounded.
const MAX_PP: u32 = 64;
const MAX_STAGES: u32 = 256;
const MAX_MICROBATCHES: u32 = 4096;

/// True if `p` is small enough to run every pass on.
pub fn checkable(p: &Program) -> bool {
    let pl = &p.pipeline;
    p.len() <= MAX_INSTRS
        && p.ranks.len() <= MAX_PP as usize
        && pl.pp <= MAX_PP
        && pl.stages <= MAX_STAGES
        && pl.microbatches <= MAX_MICROBATCHES
        && pl.total_microbatches() <= 2 * MAX_MICROBATCHES
}

/// Runs `schedc::check::check` (passes 1-7, lowering included) with default options.
pub fn check(p: &Program, spans: Option<&SourceMap>) {
    if checkable(p) {
        let out = schedc::check::check(p, spans, &Default::default());
        std::hint::black_box(&out.report);
    }
}
