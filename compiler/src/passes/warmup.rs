//! Pass 5: warmup, steady state and cooldown.
//!
//! Per rank (and per stage held by the rank), over its compute ops in program order:
//! * **warmup**: the number of forwards before the first backward (`B` or `BW`; a forward
//!   inside the same overlapped pair as that backward counts). This is the convention of
//!   `shared/reference/torch/expected.json` (torch's `warmup[r]`); Megatron's count for 1F1B
//!   (`P-r-1`, the forwards of its warm-up loop) is one less on every rank.
//! * **cooldown**: the compute ops after the last forward (backwards and weight gradients).
//! * **steady**: the compute ops in between (from the first backward up to and including the
//!   last forward).
//!
//! MoE parts count as one op: a forward at its first part in execution order, a backward at
//! its last, so that a forward whose parts interleave with a backward's (an overlapped pair
//! split by `--moe`, which issues `B.combine` before `F.attn`) counts as inside that pair,
//! as it does unsplit. W never starts the steady state. No errors: the figures are facts for
//! reports and expectations.

use super::{is_first_part, is_last_part};
use schedc_ir::{Instr, Kind, Program};
use serde::Serialize;

/// The phases of one rank, in compute ops.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Phases {
    /// Forwards before the first backward.
    pub warmup: u64,
    /// Compute ops from the first backward through the last forward.
    pub steady: u64,
    /// Compute ops after the last forward.
    pub cooldown: u64,
}

/// Warmup figures for one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RankWarmup {
    /// The rank's phases.
    pub phases: Phases,
    /// `(stage, warmup)` for each stage the rank runs, in stage order.
    pub per_stage: Vec<(u32, u64)>,
}

/// Computes the figures for every rank.
pub fn analyze(p: &Program) -> Vec<RankWarmup> {
    p.ranks
        .iter()
        .map(|instrs| {
            // Sequence of (is_forward, is_backward_input, stage) per op: a forward at its first
            // part, a backward (and W, which is whole) at its last.
            let mut seq: Vec<(bool, bool, u32)> = Vec::with_capacity(instrs.len());
            for ins in instrs {
                match ins {
                    Instr::Compute(c)
                        if (c.kind == Kind::F && is_first_part(c))
                            || (c.kind != Kind::F && is_last_part(c)) =>
                    {
                        seq.push((c.kind == Kind::F, c.kind.is_backward_input(), c.stage))
                    }
                    Instr::Overlap { fwd, bwd } => {
                        seq.push((true, false, fwd.stage));
                        seq.push((false, true, bwd.stage));
                    }
                    _ => {}
                }
            }
            let first_b = seq.iter().position(|x| x.1).unwrap_or(seq.len());
            let last_f = seq.iter().rposition(|x| x.0);
            let warmup = seq[..first_b].iter().filter(|x| x.0).count() as u64;
            let cooldown = match last_f {
                Some(l) => (seq.len() - l - 1) as u64,
                None => seq.len() as u64,
            };
            let steady = (seq.len() as u64).saturating_sub(cooldown + warmup_ops(&seq, first_b));
            let mut stages: Vec<u32> = seq.iter().map(|x| x.2).collect();
            stages.sort_unstable();
            stages.dedup();
            let per_stage = stages
                .into_iter()
                .map(|s| {
                    let mut w = 0u64;
                    for x in seq.iter().filter(|x| x.2 == s) {
                        if x.1 {
                            break;
                        }
                        if x.0 {
                            w += 1;
                        }
                    }
                    (s, w)
                })
                .collect();
            RankWarmup {
                phases: Phases {
                    warmup,
                    steady,
                    cooldown,
                },
                per_stage,
            }
        })
        .collect()
}

/// Ops before the first backward (forwards and any W).
fn warmup_ops(seq: &[(bool, bool, u32)], first_b: usize) -> u64 {
    first_b.min(seq.len()) as u64
}
