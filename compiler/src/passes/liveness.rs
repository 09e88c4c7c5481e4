//! Pass 6: activation lifetimes and peak memory in activations.
//!
//! On each rank, the activation of (stage, mb) is live from its `F` (its first MoE part)
//! through its release, inclusive: `BW`, or `W` when the backward is split (`B` does not
//! release it: the weight gradient still needs the stage's inputs). An overlapped pair
//! allocates its forward before it releases its backward. The peak is the largest number live
//! at once, in (stage, micro-batch) activations. This is the contract of torch 2.15's
//! `analyze_pipeline_activation_liveness(granularity="stage_microbatch")`, whose `num_slots`
//! equals this peak (optimal interval colouring).
//!
//! Memory ops move activations off and onto the device: `OFFLOAD(s,m)` frees one unit on the
//! device and holds one on the host from the moment it is issued; `RELOAD(s,m)` and
//! `RECOMPUTE(s,m)` allocate one on the device again (and drop the host copy). The peak is
//! that of device units; [`RankLiveness::host_peak`] is the peak of host units.
//!
//! A lent stash (BPipe's `LEND`/`RETURN` messages) counts on the device of the rank that
//! holds it: the sender frees one unit when it issues the send, the receiver allocates one
//! at its receive, so the owner's peak moves to its holder.
//!
//! `--max-activations N` (a `.case` file's `budget activations N`) rejects a schedule whose
//! peak exceeds N on any rank, naming the first op that goes over.

use super::{is_first_part, is_last_part, Ctx, Pos};
use crate::diag::{Code, Diagnostic};
use schedc_ir::{Comm, Compute, Instr, Kind, MemKind, Program};
use serde::Serialize;

/// Liveness figures for one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RankLiveness {
    /// Peak live activations (stage-microbatch units).
    pub peak: u64,
    /// Position of the first instruction at which the peak is reached.
    pub peak_at: Option<usize>,
    /// Peak activations offloaded to host memory at once (stage-microbatch units; 0 without
    /// `OFFLOAD`).
    pub host_peak: u64,
}

/// Over the activation budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverBudget {
    /// The first op that goes over.
    pub at: Pos,
    /// Live count there.
    pub live: u64,
    /// The rank's peak.
    pub peak: u64,
    /// The budget.
    pub budget: u64,
}

impl OverBudget {
    /// Converts to a diagnostic.
    pub fn to_diagnostic(&self, cx: &Ctx<'_>) -> Diagnostic {
        Diagnostic::error(
            Code::Memory,
            format!(
                "rank {} holds {} live activations here, over the budget of {} (its peak is {})",
                self.at.rank, self.live, self.budget, self.peak
            ),
        )
        .at(cx.loc(self.at.rank as usize, self.at.pos as usize))
        .with_help(
            "run backwards (or W) earlier, or lower the warmup, to release activations sooner",
        )
    }
}

fn allocates(c: &Compute) -> bool {
    c.kind == Kind::F && is_first_part(c)
}

fn releases(c: &Compute, split: bool) -> bool {
    is_last_part(c) && (c.kind == Kind::BW || (c.kind == Kind::W && split))
}

/// Computes per-rank peaks; returns the over-budget errors when `budget` is given (one per
/// rank, at the first op over).
pub fn analyze(p: &Program, budget: Option<u64>) -> (Vec<RankLiveness>, Vec<OverBudget>) {
    let mut out = Vec::with_capacity(p.ranks.len());
    let mut errs = Vec::new();
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut live: u64 = 0;
        let mut peak: u64 = 0;
        let mut peak_at = None;
        let mut over: Option<OverBudget> = None;
        let mut host: u64 = 0;
        let mut host_peak: u64 = 0;
        let mut on_host = std::collections::HashSet::new();
        for (i, ins) in instrs.iter().enumerate() {
            let mut alloc = 0u64;
            let mut rel = 0u64;
            let mut tally = |c: &Compute| {
                if allocates(c) {
                    alloc += 1;
                    // `F(s,m)!` holds its saved tensors only while it runs (its kept input
                    // is not counted: one tensor of the stage's input, against a stage's
                    // saved tensors); its RECOMPUTE allocates the unit again.
                    if c.checkpoint {
                        rel += 1;
                    }
                }
                if releases(c, true) {
                    rel += 1;
                }
            };
            match ins {
                Instr::Compute(c) => tally(c),
                Instr::Overlap { fwd, bwd } => {
                    tally(fwd);
                    tally(bwd);
                }
                Instr::Mem(op) => {
                    if op.kind == MemKind::Offload {
                        live = live.saturating_sub(1);
                        host += 1;
                        host_peak = host_peak.max(host);
                        on_host.insert((op.stage, op.mb));
                        continue;
                    }
                    // A recompute after `F(s,m)!` has no host copy to drop.
                    if on_host.remove(&(op.stage, op.mb)) {
                        host = host.saturating_sub(1);
                    }
                    alloc = 1;
                }
                Instr::Comm(_) | Instr::Group(_) => {
                    // A lent stash moves between devices: the sender frees it when the send
                    // is issued, the receiver holds it from its receive.
                    for m in ins.comms() {
                        match m {
                            Comm::Send { payload, .. } if payload.kind.is_stash() => {
                                live = live.saturating_sub(1);
                            }
                            Comm::Recv { payload, .. } if payload.kind.is_stash() => alloc += 1,
                            _ => {}
                        }
                    }
                    if alloc == 0 {
                        continue;
                    }
                }
                _ => continue,
            }
            live += alloc;
            if live > peak {
                peak = live;
                peak_at = Some(i);
            }
            if let Some(b) = budget {
                if live > b && over.is_none() {
                    over = Some(OverBudget {
                        at: Pos {
                            rank: r as u32,
                            pos: i as u32,
                        },
                        live,
                        peak: 0,
                        budget: b,
                    });
                }
            }
            live = live.saturating_sub(rel);
        }
        if let Some(mut o) = over {
            o.peak = peak;
            errs.push(o);
        }
        out.push(RankLiveness {
            peak,
            peak_at,
            host_peak,
        });
    }
    (out, errs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloaded_activations_count_on_the_host_not_the_device() {
        // 1F1B-like rank with 3 forwards in flight; two of them offloaded.
        let src = "pp 1\nstages 1\nmicrobatches 3\nplacement loop\nrank 0: F(0,0) OFFLOAD(0,0) F(0,1) OFFLOAD(0,1) F(0,2) BW(0,2) RELOAD(0,1) BW(0,1) RELOAD(0,0) BW(0,0)\n";
        let p = schedc_ir::text::parse(src).unwrap().program;
        let (l, _) = analyze(&p, None);
        assert_eq!(
            l,
            vec![RankLiveness {
                peak: 1,
                peak_at: Some(0),
                host_peak: 2
            }]
        );
        let plain = "pp 1\nstages 1\nmicrobatches 3\nplacement loop\nrank 0: F(0,0) F(0,1) F(0,2) BW(0,2) BW(0,1) BW(0,0)\n";
        let p = schedc_ir::text::parse(plain).unwrap().program;
        assert_eq!(analyze(&p, None).0[0].peak, 3);
    }

    #[test]
    fn a_lent_stash_counts_on_the_holder_not_the_owner() {
        // Rank 0 lends F(0,1) to rank 1 (which holds one of its own) and gets it back.
        let src = "pp 2\nstages 2\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) SA(0,0->1) F(0,1) SA(0,1->1) LEND(0,1->1@1) RG(1,0<-1) BW(0,0) RETURN(0,1<-1@1) RG(1,1<-1) BW(0,1)\nrank 1: RA(0,0<-0) F(1,0) LEND(0,1<-0@1) RA(0,1<-0) F(1,1) BW(1,0) SG(1,0->0) RETURN(0,1->0@1) BW(1,1) SG(1,1->0)\n";
        let p = schedc_ir::text::parse(src).unwrap().program;
        let peaks: Vec<u64> = analyze(&p, None).0.iter().map(|l| l.peak).collect();
        // Without the lend: 2 and 2. With it, rank 1 holds three at once (its two and the
        // lent one); rank 0 still reaches 2 at F(0,1), before the lend is issued.
        assert_eq!(peaks, vec![2, 3]);
        assert_eq!(
            analyze(&p, None).0[0].peak_at,
            Some(2),
            "rank 0's peak is at F(0,1)"
        );
    }
}

#[cfg(test)]
mod checkpoint_tests {
    use super::*;

    #[test]
    fn a_checkpointed_forward_holds_a_unit_only_while_it_runs_and_its_recompute_holds_one() {
        // Three forwards in flight, all checkpointed: the peak is the one recomputed
        // activation plus the forward running, 1 (plain 1F1B-like order: 3).
        let src = "pp 1\nstages 1\nmicrobatches 3\nplacement loop\nrank 0: F(0,0)! F(0,1)! F(0,2)! RECOMPUTE(0,2) BW(0,2) RECOMPUTE(0,1) BW(0,1) RECOMPUTE(0,0) BW(0,0)\n";
        let p = schedc_ir::text::parse(src).unwrap().program;
        let (l, _) = analyze(&p, None);
        assert_eq!(
            l,
            vec![RankLiveness {
                peak: 1,
                peak_at: Some(0),
                host_peak: 0
            }]
        );
    }
}
