//! Pass 7: unit-time makespan and idle per rank, a first bubble figure.
//!
//! Every compute op takes unit time (`F = B = W = 1`, `BW = 2`; an overlapped pair takes the
//! sum of its two ops; an MoE part a quarter of its op) and communication is free. Each rank
//! runs its compute ops in program order, each as soon as the rank is free and its
//! dependencies have finished: the previous stage's forward for `F`, the next stage's backward
//! (or, on a last stage, its own forward) for `B`/`BW`, its `B` for `W`.
//!
//! * makespan = the latest finish over all ranks;
//! * `idle[r]` = makespan - busy time of rank r (the bubble of rank r).
//!
//! For 1F1B with M micro-batches on P ranks this gives idle `(P-1)(F+B+W)` = `3(P-1)` on every
//! rank and bubble fraction `(P-1)/(M+P-1)` (GPipe paper, Huang et al. 2019, §2.3; Narayanan
//! et al. 2021, §2.2). The cost-model simulator generalizes this pass.

use super::{is_first_part, is_last_part};
use schedc_ir::{Compute, Instr, Kind, Part, Program};
use serde::Serialize;

/// Unit-time figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnitTime {
    /// Latest finish (unit time).
    pub makespan: f64,
    /// Busy time per rank.
    pub busy: Vec<f64>,
    /// Idle time per rank (`makespan - busy`).
    pub idle: Vec<f64>,
}

/// Unit duration of a compute op.
pub fn unit_cost(c: &Compute) -> f64 {
    let whole = match c.kind {
        Kind::F | Kind::B | Kind::W => 1.0,
        Kind::BW => 2.0,
    };
    if c.part == Part::Whole {
        whole
    } else {
        whole / 4.0
    }
}

/// Runs the unit-time schedule. Returns `None` if the compute order admits no execution
/// (a cross-rank cycle; pass 3 reports it) or if an op's stage or micro-batch is out of range.
pub fn analyze(p: &Program) -> Option<UnitTime> {
    unit_timing(p).as_ref().map(from_timing)
}

/// The unit-time schedule ([`schedule_with`] with [`unit_cost`]; a pair takes the sum).
pub fn unit_timing(p: &Program) -> Option<Timing> {
    schedule_with(p, &unit_cost, &|f, b| unit_cost(f) + unit_cost(b))
}

/// The figures of a unit-time schedule.
pub fn from_timing(t: &Timing) -> UnitTime {
    UnitTime {
        makespan: t.makespan,
        idle: t.busy.iter().map(|b| t.makespan - b).collect(),
        busy: t.busy.clone(),
    }
}

/// Start and end times of every instruction under given op durations.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// Latest end.
    pub makespan: f64,
    /// Busy time per rank.
    pub busy: Vec<f64>,
    /// `starts[r][i]`: start of rank r's instruction i (NaN for non-compute instructions).
    pub starts: Vec<Vec<f64>>,
}

/// Schedules the compute ops of `p` as early as possible in program order per rank with the
/// given durations (communication free): the unit-time rule with any costs. `None` when the
/// order admits no execution or an op is out of range.
pub fn schedule_with(
    p: &Program,
    dur: &dyn Fn(&Compute) -> f64,
    pair: &dyn Fn(&Compute, &Compute) -> f64,
) -> Option<Timing> {
    let pl = &p.pipeline;
    let (s_n, m_n) = (pl.stages, pl.microbatches);
    let n = s_n as usize * m_n as usize;
    let np = p.ranks.len();
    // end times: [F | backward-input | B-for-W], NaN = not yet.
    let mut end_f = vec![f64::NAN; n];
    let mut end_bi = vec![f64::NAN; n];
    let mut present_f = vec![false; n];
    let mut present_bi = vec![false; n];
    for instrs in &p.ranks {
        for ins in instrs {
            let mut bad = false;
            ins.for_each_compute(|c| {
                if c.stage >= s_n || c.mb >= m_n {
                    bad = true;
                    return;
                }
                let k = (c.stage * m_n + c.mb) as usize;
                match c.kind {
                    Kind::F => present_f[k] = true,
                    Kind::B | Kind::BW => present_bi[k] = true,
                    Kind::W => {}
                }
            });
            if bad {
                return None;
            }
        }
    }
    let mut starts: Vec<Vec<f64>> = p.ranks.iter().map(|r| vec![f64::NAN; r.len()]).collect();
    let mut clock = vec![0.0f64; np];
    let mut busy = vec![0.0f64; np];
    let mut ptr = vec![0usize; np];
    let mut part_start: Vec<f64> = vec![f64::NAN; np];
    let mut waiters: Vec<Vec<u32>> = vec![Vec::new(); 2 * n];
    let mut work: Vec<u32> = (0..np as u32).rev().collect();
    // dependency key: 0..n for F ends, n..2n for backward-input ends.
    let dep_of = |c: &Compute| -> Option<usize> {
        if !is_first_part(c) {
            return None;
        }
        match c.kind {
            Kind::F => pl
                .prev_stage(c.stage)
                .map(|ps| (ps * m_n + c.mb) as usize)
                .filter(|&k| present_f[k]),
            Kind::B | Kind::BW => match pl.next_stage(c.stage) {
                Some(ns) => Some(n + (ns * m_n + c.mb) as usize).filter(|&k| present_bi[k - n]),
                None => Some((c.stage * m_n + c.mb) as usize).filter(|&k| present_f[k]),
            },
            Kind::W => None,
        }
    };
    while let Some(r) = work.pop() {
        let r = r as usize;
        while ptr[r] < p.ranks[r].len() {
            let ins = &p.ranks[r][ptr[r]];
            let mut ready_at = clock[r];
            let mut blocked = None;
            ins.for_each_compute(|c| {
                if let Some(k) = dep_of(c) {
                    let t = if k < n { end_f[k] } else { end_bi[k - n] };
                    let self_loss = matches!(ins, Instr::Overlap { fwd, .. } if c.kind != Kind::F && fwd.stage == c.stage && fwd.mb == c.mb && k < n);
                    if t.is_nan() {
                        if !self_loss && blocked.is_none() {
                            blocked = Some(k);
                        }
                    } else {
                        ready_at = ready_at.max(t);
                    }
                }
            });
            if let Some(k) = blocked {
                waiters[k].push(r as u32);
                break;
            }
            let mut t = ready_at;
            let mut dur_total = 0.0;
            let mut ends: [(Option<usize>, f64); 2] = [(None, 0.0); 2];
            let mut ne = 0;
            let pair_total = match ins {
                Instr::Overlap { fwd, bwd } => Some(pair(fwd, bwd)),
                _ => None,
            };
            if ins.is_compute() {
                starts[r][ptr[r]] = ready_at;
            }
            ins.for_each_compute(|c| {
                let d = match pair_total {
                    // Both ops of a pair finish with the pair.
                    Some(total) => {
                        if c.kind == Kind::F {
                            total
                        } else {
                            0.0
                        }
                    }
                    None => dur(c),
                };
                if is_first_part(c) && c.part != Part::Whole {
                    part_start[r] = t;
                }
                t += d;
                dur_total += d;
                if is_last_part(c) {
                    let k = (c.stage * m_n + c.mb) as usize;
                    let key = match c.kind {
                        Kind::F => Some(k),
                        Kind::B | Kind::BW => Some(n + k),
                        Kind::W => None,
                    };
                    ends[ne] = (key, t);
                    ne += 1;
                }
            });
            clock[r] = t;
            busy[r] += dur_total;
            for (key, te) in ends.iter().take(ne) {
                if let Some(k) = key {
                    if k < &n {
                        end_f[*k] = *te;
                    } else {
                        end_bi[k - n] = *te;
                    }
                    for w in std::mem::take(&mut waiters[*k]) {
                        work.push(w);
                    }
                }
            }
            ptr[r] += 1;
        }
    }
    if (0..np).any(|r| ptr[r] < p.ranks[r].len()) {
        return None;
    }
    let makespan = clock.iter().cloned().fold(0.0, f64::max);
    Some(Timing {
        makespan,
        busy,
        starts,
    })
}
