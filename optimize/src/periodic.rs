//! Periodic orders: a building block repeated once per micro-batch.
//!
//! The controllable-memory paper (Qi et al., "Pipeline Parallelism with Controllable
//! Memory", NeurIPS 2024, arXiv 2405.15362, §3) describes the usual schedules (1F1B, ZB-H1,
//! ZB-V, V-Min, V-Half) as one building block, the ops of micro-batch 0 with their times,
//! repeated with a fixed interval: micro-batch k's op runs at the block's time plus k times
//! the interval. The lifespan of an activation in the block (its forward to its release)
//! fixes the peak memory; the block's shape fixes the bubble.
//!
//! Here a block is an *offset* per (rank, op of a stage it holds); the per-rank order is
//! every op of every micro-batch sorted by `offset + k * period`, and the evaluator then
//! squeezes it (each op as early as its rank and inputs allow), which also builds the warmup
//! and cooldown. The search moves offsets (late-acceptance hill climbing) and scores the
//! squeezed schedule: makespan, plus a penalty per activation over the cap, so it can walk
//! through orders that need too much memory toward ones that fit.

use crate::bound::Chains;
use crate::eval::Evaluator;
use crate::instance::Instance;
use crate::list::{build, Keys, Policy, Rng};
use crate::local::{Score, EPS};
use crate::sched::{Sched, Tok};
use std::sync::Arc;
use std::time::Instant;

/// How a block becomes an order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decode {
    /// Every op of every micro-batch sorted by its key, per rank (the block repeated as is).
    Sorted,
    /// List scheduling with the keys as priorities: a free rank runs its ready op with the
    /// smallest key (so the warmup fills with forwards the block would start later), within
    /// the cap; `reserve_all` as in [`Policy`].
    List {
        /// See [`Policy::reserve_all`].
        reserve_all: bool,
    },
}

/// A building block: per stage, the offsets of its forward, backward and weight gradient
/// for micro-batch 0 (seconds), and the interval between micro-batches.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// The offsets; the interval is `keys.period`.
    pub keys: Keys,
    /// Fused backwards (`BW`; `keys.w` unused).
    pub fuse: bool,
}

impl Block {
    /// The block of the as-soon-as-possible times of micro-batch 0 (every stage's forward
    /// when its input arrives, the backward likewise, `W` right after its `B`), repeated
    /// every `period`.
    pub fn asap(inst: &Instance, fuse: bool, period: f64) -> Block {
        let c = Chains::new(inst);
        Block {
            keys: Keys {
                f: c.head_f.clone(),
                b: c.head_b.clone(),
                w: (0..inst.s).map(|s| c.head_b[s] + inst.d_b[s]).collect(),
                period,
            },
            fuse,
        }
    }

    /// The per-rank orders of the block (`None` if list decoding gets stuck).
    pub fn decode(&self, inst: &Instance, how: Decode) -> Option<Sched> {
        match how {
            Decode::Sorted => Some(self.sorted(inst)),
            Decode::List { reserve_all } => {
                let pol = Policy {
                    fuse: self.fuse,
                    reserve_all,
                    keys: Some(Arc::new(self.keys.clone())),
                    ..Policy::default()
                };
                build(inst, &pol, &mut Rng::new(0))
            }
        }
    }

    fn sorted(&self, inst: &Instance) -> Sched {
        let k = &self.keys;
        let mut ranks = Vec::with_capacity(inst.p);
        let mut keyed: Vec<(f64, u8, u32)> = Vec::new();
        for r in 0..inst.p {
            keyed.clear();
            for mb in 0..inst.m {
                let base = mb as f64 * k.period;
                for &s in &inst.stages_of[r] {
                    let su = s as usize;
                    keyed.push((k.f[su] + base, 1, s));
                    keyed.push((k.b[su] + base, 0, s));
                    if !self.fuse {
                        keyed.push((k.w[su] + base, 2, s));
                    }
                }
            }
            keyed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(b.2.cmp(&a.2)));
            ranks.push(
                keyed
                    .iter()
                    .map(|&(_, t, s)| match (t, self.fuse) {
                        (0, true) => Tok::BW(s),
                        (0, false) => Tok::B(s),
                        (1, _) => Tok::F(s),
                        _ => Tok::W(s),
                    })
                    .collect(),
            );
        }
        Sched { ranks }
    }
}

/// The busiest rank's work per micro-batch (seconds): the natural period.
pub fn natural_period(inst: &Instance, fuse: bool) -> f64 {
    (0..inst.p)
        .map(|r| {
            inst.stages_of[r]
                .iter()
                .map(|&s| {
                    let s = s as usize;
                    inst.d_f[s]
                        + if fuse {
                            inst.d_bw[s]
                        } else {
                            inst.d_b[s] + inst.d_w[s]
                        }
                })
                .sum::<f64>()
        })
        .fold(0.0, f64::max)
}

/// Scores a decoded block: the schedule's score if it fits the cap; else its makespan
/// with the cap lifted plus `penalty` per activation over the cap (summed over ranks), and
/// infinity if it is not a schedule.
fn score_block(
    ev_cap: &mut Evaluator<'_>,
    ev_free: &mut Evaluator<'_>,
    cap: u64,
    penalty: f64,
    sc: &Sched,
) -> (Score, bool) {
    match ev_cap.eval(sc) {
        Ok(e) => (
            Score {
                makespan: e.makespan,
                mean_end: e.end.iter().sum::<f64>() / e.end.len().max(1) as f64,
            },
            true,
        ),
        Err(crate::eval::Fail::OverCap { .. }) => match ev_free.eval(sc) {
            Ok(e) => {
                let over: f64 = e
                    .peak
                    .iter()
                    .map(|&p| (p as f64 - cap as f64).max(0.0))
                    .sum();
                (
                    Score {
                        makespan: e.makespan + penalty * over,
                        mean_end: f64::INFINITY,
                    },
                    false,
                )
            }
            Err(_) => (Score::INFEASIBLE, false),
        },
        Err(_) => (Score::INFEASIBLE, false),
    }
}

/// Searches block offsets from the as-soon-as-possible block, decoding with `how`.
/// Returns the best schedule within the cap, if any, its score and the evaluations run.
pub fn search(
    inst: &Instance,
    fuse: bool,
    how: Decode,
    evals: u64,
    seed: u64,
    deadline: Option<Instant>,
    target: f64,
) -> (Option<(Sched, Score)>, u64) {
    let period = natural_period(inst, fuse);
    let mut free = inst.clone();
    free.cap = u64::MAX;
    let mut ev_cap = Evaluator::new(inst);
    let mut ev_free = Evaluator::new(&free);
    let penalty = period;
    let mut rng = Rng::new(seed);
    let mut cur = Block::asap(inst, fuse, period);
    let score_of = |b: &Block, ev_cap: &mut Evaluator<'_>, ev_free: &mut Evaluator<'_>| match b
        .decode(inst, how)
    {
        Some(sc) => {
            let (s, ok) = score_block(ev_cap, ev_free, inst.cap, penalty, &sc);
            (s, ok, Some(sc))
        }
        None => (Score::INFEASIBLE, false, None),
    };
    let (mut cur_s, ok, sc0) = score_of(&cur, &mut ev_cap, &mut ev_free);
    let mut best: Option<(Sched, Score)> = if ok { sc0.map(|s| (s, cur_s)) } else { None };
    let hist = 50usize;
    let mut history = vec![cur_s; hist];
    let unit = inst
        .d_f
        .iter()
        .chain(&inst.d_b)
        .chain(&inst.d_w)
        .copied()
        .fold(f64::INFINITY, f64::min);
    let mut n = 0u64;
    while n < evals {
        if best.as_ref().is_some_and(|b| b.1.makespan <= target + EPS) {
            break;
        }
        if n.is_multiple_of(64) && deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let mut cand = cur.clone();
        let s = rng.below(inst.s);
        let which = rng.below(if fuse { 2 } else { 3 });
        let v = match which {
            0 => &mut cand.keys.f[s],
            1 => &mut cand.keys.b[s],
            _ => &mut cand.keys.w[s],
        };
        let sign = if rng.below(2) == 0 { -1.0 } else { 1.0 };
        match rng.below(3) {
            0 | 1 => *v += sign * (1 + rng.below(3)) as f64 * unit,
            _ => *v += sign * if rng.below(2) == 0 { 0.5 } else { 1.0 } * period,
        }
        n += 1;
        let (s, ok, sc) = score_of(&cand, &mut ev_cap, &mut ev_free);
        if s.makespan.is_infinite() {
            continue;
        }
        if ok && best.as_ref().is_none_or(|b| s.lt(&b.1)) {
            best = sc.map(|x| (x, s));
        }
        let slot = n as usize % hist;
        if s.le(&cur_s) || s.le(&history[slot]) {
            cur = cand;
            cur_s = s;
        }
        if cur_s.le(&history[slot]) {
            history[slot] = cur_s;
        }
    }
    (best, n)
}
