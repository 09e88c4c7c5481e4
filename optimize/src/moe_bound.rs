//! A lower bound on the per-rank span under `--moe`, for the question whether any
//! schedule on DualPipeV's placement and memory halves DualPipeV's bubble.
//!
//! **Setting.** A V placement (`2P` stages, rank `r` holds stages `r` and `2P - 1 - r`), every
//! stage an MoE stage, the same op times on every stage, the ops split by `--moe` into
//! attention, dispatch, MLP and combine parts (`schedc::moe::split`). A plain (unpaired) F, B
//! or BW runs its parts one after another: its compute stream waits for its dispatch and
//! combine (`a` seconds together), as the simulator does (1F1B exposes 100% of its
//! all-to-all in the book's MoE chapter). Only an overlapped F&B pair
//! hides them. The argument is about rank 0, which holds the first stage and the last.
//!
//! **Warmup.** Let `t0` start rank 0's first op. No backward exists before the first
//! `F(2P-1, ·)` ends; that forward ends at least `L_F = 2P (F + a) + h·msg` after `t0`
//! (its micro-batch's chain of plain forwards from stage 0, `h` boundaries between ranks).
//! Until then rank 0 runs only plain forwards, idle `a / (F + a)` of the time:
//! at least `L_F · a / (F + a)`.
//!
//! **Cooldown.** Let `t_L` end rank 0's last forward, an `F(2P-1, m)` (every `F(s, m)`
//! precedes `F(2P-1, m)`, which is on rank 0), so no forward runs anywhere after it and
//! every backward after it is plain. Rank 0 then ends no earlier than `t_L + L_B`,
//! `L_B = 2P (B + a) + h·msg` (the chain of `m`'s backwards). In that window rank 0 runs
//! `k` plain backwards (idle `a` each, `k >= 2`: `B(2P-1, m)` and `B(0, m)`) and at most
//! `cap` weight gradients (each frees one of at most `cap` live activations), so its idle
//! there is at least `min over k in [2, cap] of max(k a, L_B - k B - cap W)`.
//!
//! The two windows do not overlap when `M >= 2` (the first and the last `F(2P-1, ·)` differ),
//! so rank 0's span is at least its compute plus both idles, and the `per_rank_span` bubble,
//! `1 - Σ busy / (P · max span)`, at least `1 - busy / that`.
//!
//! **Scope.** Schedules whose parts come from whole ops and pairs (what `--moe` splits and
//! what `schedc optimize` writes); a schedule written part by part could interleave two
//! plain ops' parts, which this argument does not cover.

use schedc::sim::cost::CostModel;
use schedc_ir::{Kind, Part, Pipeline, PlacementKind};

/// The bound and its terms, seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct SpanBound {
    /// Rank 0's compute per step.
    pub busy: f64,
    /// Idle forced in the warmup.
    pub warmup_idle: f64,
    /// Idle forced in the cooldown.
    pub cooldown_idle: f64,
    /// `busy + warmup_idle + cooldown_idle`: no schedule's largest per-rank span is shorter.
    pub span: f64,
    /// The smallest `per_rank_span` bubble any schedule can have, `1 - busy / span` (every
    /// rank has the same compute here).
    pub bubble: f64,
}

/// The bound of the module docs for `pl` under `cost` (times already scaled to `pl`'s
/// stages, as `report::scaled_cost` gives them) and a cap of `cap` live activations per rank
/// (in `pl`'s stages). `None` when the setting does not apply: not a V placement, fewer
/// than two micro-batches, stages with different times, or no all-to-all time.
pub fn v_span_bound(pl: &Pipeline, cost: &CostModel, cap: u64) -> Option<SpanBound> {
    if pl.placement != PlacementKind::V || pl.total_microbatches() < 2 || cap < 2 {
        return None;
    }
    let scale = cost.op_scale.unwrap_or(1.0);
    let t = |k: Kind, s: u32| scale * cost.op_time(k, s);
    let (f, b, w, bw) = (t(Kind::F, 0), t(Kind::B, 0), t(Kind::W, 0), t(Kind::BW, 0));
    if (0..pl.stages).any(|s| {
        [Kind::F, Kind::B, Kind::W, Kind::BW]
            .iter()
            .zip([f, b, w, bw])
            .any(|(&k, v)| (t(k, s) - v).abs() > 1e-12)
    }) {
        return None;
    }
    let a = scale * (cost.a2a_time(Part::Dispatch) + cost.a2a_time(Part::Combine));
    if a <= 0.0 {
        return None;
    }
    let n = pl.stages as f64;
    let hops = (0..pl.stages.saturating_sub(1))
        .filter(|&s| pl.stage_to_rank[s as usize] != pl.stage_to_rank[s as usize + 1])
        .count() as f64;
    let msg = cost.message_time();
    // A fused BW is a plain backward too: the cheaper of B and BW bounds the chain.
    let bmin = b.min(bw);
    let l_f = n * (f + a) + hops * msg;
    let l_b = n * (bmin + a) + hops * msg;
    let m = pl.total_microbatches() as f64;
    let held = pl.stages_of(0).len() as f64;
    let busy = m * held * (f + (b + w).min(bw));
    let warmup_idle = l_f * a / (f + a);
    let cap_f = cap as f64;
    let cooldown_idle = (2..=cap)
        .map(|k| {
            let k = k as f64;
            (k * a).max(l_b - k * b.max(bw) - cap_f * w)
        })
        .fold(f64::INFINITY, f64::min)
        .max(2.0 * a);
    let span = busy + warmup_idle + cooldown_idle;
    Some(SpanBound {
        busy,
        warmup_idle,
        cooldown_idle,
        span,
        bubble: 1.0 - busy / span,
    })
}
