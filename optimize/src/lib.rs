//! # schedc-optimize: searching for shorter pipeline schedules under an activation cap
//!
//! Given a pipeline (ranks, stages, micro-batches, placement), a cost model and a cap on live
//! activations per rank, find per-rank op orders with the smallest simulated makespan. The
//! placement is kept; the search may split a fused backward into B + W or fuse them, defer
//! W, and pair a forward with a backward as one overlapped chunk when the cost model makes
//! pairs faster.
//!
//! The pieces:
//!
//! * [`instance`]: the problem and its validation (a cap below the minimum, a cost model
//!   without times).
//! * [`sched`]: schedules as per-rank token sequences, micro-batches labelled in order.
//! * [`eval`]: the inner-loop evaluator, equal to the simulator on the lowered program.
//! * [`lower`]: tokens to a lowered program (messages in time order, one channel per stage
//!   boundary when messages take time).
//! * [`bound`]: lower bounds on the makespan.
//! * [`greedy`]: the Zero Bubble auto-scheduler's greedy (Qi et al., arXiv 2401.10241,
//!   §3.1), the published baseline, re-implemented.
//! * [`list`]: parameterised list scheduling and its rollout, the constructive heuristics.
//! * [`periodic`]: building blocks repeated once per micro-batch, searched by their offsets.
//! * [`local`]: local search over token sequences.
//! * [`memops`]: offloads and recomputes inserted into a lowered program until it fits a cap
//!   on device bytes (`--max-memory`).
//! * [`rewrite`]: equality saturation (egg) over windows of a rank's ops, extracted with the
//!   evaluator in the loop.
//! * [`exact`]: branch and bound for small instances: the optimum and a proof.
//! * [`rank_bound`]: the one-rank relaxation (one rank a single machine with its cap, the
//!   others plain delays) solved exactly, a lower bound branch and bound starts from.
//! * [`refdata`]: the Zero Bubble reference data in `shared/reference/zb/`.
//! * [`report`]: the rows `schedc optimize` prints: start, specs, greedy, result.
//! * [`search`]: the driver that runs them under a budget and a time limit.
//!
//! Every result is checked by `schedc check` and scored by `schedc::sim::simulate`
//! ([`verify`]); the evaluator only steers the search.

#![warn(missing_docs)]

pub mod bound;
pub mod eval;
pub mod exact;
pub mod greedy;
pub mod instance;
pub mod list;
pub mod local;
pub mod lower;
pub mod memops;
pub mod moe_bound;
pub mod periodic;
pub mod rank_bound;
pub mod refdata;
pub mod report;
pub mod rewrite;
pub mod sched;
pub mod search;

pub use instance::{Instance, ProblemError};
pub use sched::{Sched, Tok};
pub use search::{optimize, Options, Outcome, Progress};

use schedc::check::{self, Verdict};
use schedc::sim::{cost::CostModel, SimResult};
use schedc_ir::Program;

/// A schedule checked and simulated.
pub struct Verified {
    /// The lowered program (sends and receives in place).
    pub program: Program,
    /// `schedc check`'s report on it, with the cap as its activation budget.
    pub report: check::Report,
    /// The simulation under the cost model.
    pub sim: SimResult,
}

/// Lowers `sc`, runs every pass of `schedc check` on it with the instance's cap as
/// `--max-activations`, and simulates it.
///
/// Errors: the tokens are not a schedule, `check` rejects the program (the first error is
/// quoted), or the simulation does not run to the end.
pub fn verify(inst: &Instance, cost: &CostModel, sc: &Sched) -> Result<Verified, String> {
    let program = lower::lower(inst, sc)?;
    let opts = check::Options {
        max_activations: (inst.cap != u64::MAX).then_some(inst.cap),
        ..Default::default()
    };
    let out = check::check(&program, None, &opts);
    if out.report.verdict != Verdict::Accepted {
        let first = out
            .report
            .diagnostics
            .iter()
            .find(|d| d.severity == schedc::diag::Severity::Error)
            .map(|d| d.message.clone())
            .unwrap_or_default();
        return Err(format!("schedc check rejects the schedule: {first}"));
    }
    let sim = schedc::sim::simulate(&program, cost)?;
    Ok(Verified {
        program,
        report: out.report,
        sim,
    })
}
