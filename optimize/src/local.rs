//! Local search over token sequences: late-acceptance hill climbing (Burke and Bykov, "The
//! late acceptance hill-climbing heuristic", EJOR 258(1), 2017) with moves on one rank's
//! sequence, every candidate scored by the evaluator.
//!
//! Moves:
//!
//! * swap two adjacent tokens of a rank;
//! * move one token up to `reach` positions earlier or later (a deferred `W` into a gap, a
//!   forward across a backward);
//! * split a `BW` into `B` then `W`, or fuse a `B` with its own `W` right after it (only when
//!   the cost model makes `BW` faster than `B + W`);
//! * pair an adjacent forward and backward into an overlapped chunk, or unpair one (only
//!   when the cost model makes pairs faster).
//!
//! The score is the makespan, ties broken by the mean of the ranks' end times (a schedule
//! whose other ranks finish earlier has more room to move the critical one). Moves that break
//! an order, deadlock or exceed the cap are rejected by the evaluator.

use crate::eval::Evaluator;
use crate::instance::Instance;
use crate::list::Rng;
use crate::sched::{Sched, Tok};
use std::time::Instant;

/// The score of a schedule: makespan, then mean rank end (lower is better).
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct Score {
    /// Makespan, seconds.
    pub makespan: f64,
    /// Mean of the ranks' end times, seconds.
    pub mean_end: f64,
}

impl Score {
    /// The worst score (not a schedule).
    pub const INFEASIBLE: Score = Score {
        makespan: f64::INFINITY,
        mean_end: f64::INFINITY,
    };

    /// Lexicographic "no worse than", with a tolerance on makespans.
    pub fn le(&self, o: &Score) -> bool {
        if self.makespan < o.makespan - EPS {
            return true;
        }
        if self.makespan > o.makespan + EPS {
            return false;
        }
        self.mean_end <= o.mean_end + EPS
    }

    /// Strictly better.
    pub fn lt(&self, o: &Score) -> bool {
        self.le(o) && !o.le(self)
    }
}

/// Tolerance on times, seconds.
pub const EPS: f64 = 1e-9;

/// Scores `sc`.
pub fn score(ev: &mut Evaluator<'_>, sc: &Sched) -> Score {
    match ev.eval(sc) {
        Ok(e) => Score {
            makespan: e.makespan,
            mean_end: e.end.iter().sum::<f64>() / e.end.len().max(1) as f64,
        },
        Err(_) => Score::INFEASIBLE,
    }
}

/// Limits of one local search.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Candidate evaluations.
    pub evals: u64,
    /// Stop after this many evaluations without a new best.
    pub stall: u64,
    /// Wall-clock deadline.
    pub deadline: Option<Instant>,
    /// Stop once the makespan reaches this (a lower bound).
    pub target: f64,
}

/// One move on rank `r`, applied in place; returns false if it does not apply.
fn apply(inst: &Instance, sc: &mut Sched, r: usize, rng: &mut Rng, reach: usize) -> bool {
    let n = sc.ranks[r].len();
    if n < 2 {
        return false;
    }
    let kind = rng.below(10);
    let toks = &mut sc.ranks[r];
    match kind {
        0..=4 => {
            let i = rng.below(n - 1);
            if toks[i] == toks[i + 1] {
                return false;
            }
            toks.swap(i, i + 1);
            true
        }
        5..=8 => {
            let i = rng.below(n);
            let d = 1 + rng.below(reach.max(1));
            let j = if rng.below(2) == 0 {
                i.saturating_sub(d)
            } else {
                (i + d).min(n - 1)
            };
            if i == j {
                return false;
            }
            let t = toks.remove(i);
            toks.insert(j, t);
            true
        }
        _ => {
            let i = rng.below(n);
            structural(inst, toks, i)
        }
    }
}

/// Split, fuse, pair or unpair at position `i` when the cost model makes it worth trying.
fn structural(inst: &Instance, toks: &mut Vec<Tok>, i: usize) -> bool {
    let fuse_helps = !inst.split_dominates();
    let pairs = inst.pairs_help();
    let next_is_f = i + 1 < toks.len() && matches!(toks[i + 1], Tok::F(_));
    let next_is_bwd = i + 1 < toks.len() && matches!(toks[i + 1], Tok::B(_) | Tok::BW(_));
    match toks[i] {
        Tok::F(f) if pairs && next_is_bwd => {
            let (b, fused) = match toks[i + 1] {
                Tok::B(b) => (b, false),
                Tok::BW(b) => (b, true),
                _ => unreachable!(),
            };
            toks[i] = Tok::Pair { f, b, fused };
            toks.remove(i + 1);
            true
        }
        Tok::B(b) | Tok::BW(b) if pairs && next_is_f && i.is_multiple_of(2) => {
            let fused = matches!(toks[i], Tok::BW(_));
            let Tok::F(f) = toks[i + 1] else {
                unreachable!()
            };
            toks[i] = Tok::Pair { f, b, fused };
            toks.remove(i + 1);
            true
        }
        Tok::BW(s) => {
            toks[i] = Tok::B(s);
            toks.insert(i + 1, Tok::W(s));
            true
        }
        Tok::B(s) if fuse_helps && i + 1 < toks.len() && toks[i + 1] == Tok::W(s) => {
            // Fuse only with its own W: as many W(s) as split B(s) before it.
            let split_before = toks[..i].iter().filter(|&&t| t == Tok::B(s)).count()
                + toks[..i]
                    .iter()
                    .filter(|&&t| matches!(t, Tok::Pair { b, fused: false, .. } if b == s))
                    .count();
            let w_before = toks[..i].iter().filter(|&&t| t == Tok::W(s)).count();
            if split_before != w_before {
                return false;
            }
            toks[i] = Tok::BW(s);
            toks.remove(i + 1);
            true
        }
        Tok::Pair { f, b, fused } => {
            toks[i] = Tok::F(f);
            toks.insert(i + 1, if fused { Tok::BW(b) } else { Tok::B(b) });
            true
        }
        _ => false,
    }
}

/// Result of a local search.
#[derive(Clone, Debug)]
pub struct Improved {
    /// The best schedule seen.
    pub sched: Sched,
    /// Its score.
    pub score: Score,
    /// Candidates evaluated.
    pub evals: u64,
}

/// Late-acceptance hill climbing from `start` (history length `hist`).
pub fn improve(
    inst: &Instance,
    start: &Sched,
    budget: Budget,
    seed: u64,
    on_best: &mut dyn FnMut(f64),
) -> Improved {
    let mut ev = Evaluator::new(inst);
    let mut rng = Rng::new(seed);
    let mut cur = start.clone();
    let mut cur_s = score(&mut ev, &cur);
    let mut best = cur.clone();
    let mut best_s = cur_s;
    let hist = 64usize;
    let mut history = vec![cur_s; hist];
    let mut since_best = 0u64;
    let mut evals = 0u64;
    let ops_per_rank = (start.len() / inst.p.max(1)).max(2);
    let reach = (ops_per_rank / 4).clamp(2, 24);
    let mut backup: Vec<Tok> = Vec::new();
    while evals < budget.evals && since_best < budget.stall {
        if best_s.makespan <= budget.target + EPS {
            break;
        }
        if evals.is_multiple_of(256) {
            if let Some(d) = budget.deadline {
                if Instant::now() >= d {
                    break;
                }
            }
        }
        let r = rng.below(inst.p);
        backup.clone_from(&cur.ranks[r]);
        if !apply(inst, &mut cur, r, &mut rng, reach) {
            cur.ranks[r].clone_from(&backup);
            continue;
        }
        evals += 1;
        since_best += 1;
        let s = score(&mut ev, &cur);
        let slot = (evals as usize) % hist;
        if s.makespan.is_infinite() {
            cur.ranks[r].clone_from(&backup);
            continue;
        }
        if !(s.le(&cur_s) || s.le(&history[slot])) {
            cur.ranks[r].clone_from(&backup);
        } else {
            cur_s = s;
            if cur_s.lt(&best_s) {
                if cur_s.makespan < best_s.makespan - EPS {
                    on_best(cur_s.makespan);
                }
                best.clone_from(&cur);
                best_s = cur_s;
                since_best = 0;
            }
        }
        if cur_s.le(&history[slot]) {
            history[slot] = cur_s;
        }
    }
    Improved {
        sched: best,
        score: best_s,
        evals,
    }
}
