//! Pass 3: communication lowering of a compute-only program.
//!
//! Walks all ranks' compute lists together and emits one global interleaving in which every
//! op runs only after its dependencies have been emitted. When an op whose output crosses
//! ranks is emitted, its send goes right after it on the producing rank and the matching
//! receive is appended to the consuming rank's program at that same moment (the sender
//! places the receive, as torch's `_add_send_recv` does). Every rank's program is then a
//! projection of one sequential execution in which each send and its receive are posted
//! together, so the result is deadlock-free under rendezvous sends, FIFO matching and a
//! single in-order communication stream (pass 4 re-proves it).
//!
//! Consecutive stages held by one rank (the fold of a V) hand over in memory, with no
//! message; DualPipe's two directions never hand over to each other. Idle slots are dropped.
//!
//! Cost: O(ops + P) time: a rank that cannot go on waits on the one op it needs and is woken
//! when that op is emitted.
//!
//! If no interleaving exists (two ranks each wait for the other's later op), the pass returns
//! the wait-for cycle.

use super::{compute_str, is_first_part, is_last_part, Pos};
use schedc_ir::{Comm, Compute, Instr, Kind, Payload, PayloadKind, Program};

/// One step of a cycle: `rank` is stuck at `at` waiting for `needs`, which rank `on` runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LowerWait {
    /// The stuck rank and its position in the compute-only program.
    pub at: Pos,
    /// What it needs, e.g. "F(0,1)".
    pub needs: String,
    /// The rank that runs it.
    pub on: u32,
}

/// Lowering failed: the compute order admits no execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LowerError {
    /// A wait-for cycle among ranks.
    Cycle(Vec<LowerWait>),
    /// A rank waits for an op that no rank runs (reported as missing by pass 1).
    Missing(LowerWait),
}

/// Key of a dependency: (payload kind, stage, mb) flattened.
#[inline]
fn key(kind: PayloadKind, s: u32, m: u32, m_n: u32, s_n: u32) -> usize {
    (kind as usize) * (s_n as usize * m_n as usize) + (s * m_n + m) as usize
}

/// What compute op `c` needs before it can start: `(payload key)`, if anything.
#[inline]
fn need_of(p: &Program, c: &Compute) -> Option<(PayloadKind, u32)> {
    if !is_first_part(c) {
        return None;
    }
    let pl = &p.pipeline;
    match c.kind {
        Kind::F => pl.prev_stage(c.stage).map(|ps| (PayloadKind::Act, ps)),
        Kind::B | Kind::BW => match pl.next_stage(c.stage) {
            Some(ns) => Some((PayloadKind::Grad, ns)),
            // Last stage: the loss comes from its own forward.
            None => Some((PayloadKind::Act, c.stage)),
        },
        Kind::W => None,
    }
}

/// What compute op `c` produces when it completes.
#[inline]
fn produce_of(c: &Compute) -> Option<PayloadKind> {
    if !is_last_part(c) {
        return None;
    }
    match c.kind {
        Kind::F => Some(PayloadKind::Act),
        Kind::B | Kind::BW => Some(PayloadKind::Grad),
        Kind::W => None,
    }
}

/// Lowers a compute-only program (pass 1 must have accepted its ranges). Existing
/// communication ops are kept in place; idle slots are dropped.
///
/// The global interleaving follows the unit-time schedule (pass 7): ops are emitted in order
/// of their unit-time end, so each rank's communication stream lists its messages in the
/// order their data becomes ready and the program runs at the unit-time makespan when
/// communication is free. Use [`lower_timed`] to follow other durations.
pub fn lower(p: &Program) -> Result<Program, LowerError> {
    lower_with(p, super::makespan::unit_timing(p).as_ref())
}

/// [`lower`] with the unit-time schedule already computed (`None`: the order admits no
/// execution), so that `schedc check` schedules once for this pass and pass 7.
pub fn lower_with(
    p: &Program,
    timing: Option<&super::makespan::Timing>,
) -> Result<Program, LowerError> {
    use super::makespan::unit_cost;
    // Key each op by its unit-time end: that is when its messages are posted, so every
    // communication stream lists its messages in the order their data becomes ready.
    let ends = timing.map(|t| {
        p.ranks
            .iter()
            .zip(&t.starts)
            .map(|(instrs, st)| {
                instrs
                    .iter()
                    .zip(st)
                    .map(|(i, s)| {
                        let mut d = 0.0;
                        i.for_each_compute(|c| d += unit_cost(c));
                        s + d
                    })
                    .collect::<Vec<f64>>()
            })
            .collect::<Vec<_>>()
    });
    lower_timed(p, ends.as_deref())
}

/// Lowers with a given time key per instruction (`keys[r][i]`: when its messages are posted,
/// e.g. its end under [`super::makespan::schedule_with`]; NaN for non-compute instructions);
/// `None` emits rank by rank.
pub fn lower_timed(p: &Program, keys: Option<&[Vec<f64>]>) -> Result<Program, LowerError> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let pl = &p.pipeline;
    let (s_n, m_n) = (pl.stages, pl.microbatches);
    let np = p.ranks.len();
    let mut done = vec![false; 2 * s_n as usize * m_n as usize];
    let mut waiters: Vec<u32> = vec![u32::MAX; done.len()]; // head of a linked list of ranks
    let mut next_waiter: Vec<u32> = vec![u32::MAX; np];
    let mut waiting_on: Vec<usize> = vec![usize::MAX; np];
    let mut out: Vec<Vec<Instr>> = p
        .ranks
        .iter()
        .map(|r| Vec::with_capacity(r.len() * 2))
        .collect();
    let mut ptr = vec![0usize; np];
    // The time key of rank r's next compute op (non-negative floats order as their bits).
    let key_of = |r: usize, from: usize| -> u64 {
        let Some(st) = keys else { return 0 };
        st.get(r)
            .and_then(|v| v[from.min(v.len())..].iter().find(|t| !t.is_nan()))
            .map_or(u64::MAX, |t| t.max(0.0).to_bits())
    };
    let mut work: BinaryHeap<Reverse<(u64, u32)>> =
        (0..np).map(|r| Reverse((key_of(r, 0), r as u32))).collect();
    let in_range = |c: &Compute| c.stage < s_n && c.mb < m_n;

    while let Some(Reverse((_, r))) = work.pop() {
        let r = r as usize;
        let mut emitted_compute = false;
        'rank: while ptr[r] < p.ranks[r].len() {
            // One compute op per turn, so that ranks interleave in time order.
            if emitted_compute && p.ranks[r][ptr[r]].is_compute() {
                work.push(Reverse((key_of(r, ptr[r]), r as u32)));
                break 'rank;
            }
            let ins = &p.ranks[r][ptr[r]];
            // Readiness.
            let mut blocked = None;
            ins.for_each_compute(|c| {
                if blocked.is_some() || !in_range(c) {
                    return;
                }
                if let Some((k, s)) = need_of(p, c) {
                    let kk = key(k, s, c.mb, m_n, s_n);
                    // The loss dependency of the last stage is local program order.
                    let local_loss = c.kind != Kind::F && k == PayloadKind::Act;
                    let in_overlap_self = matches!(ins, Instr::Overlap { fwd, .. } if local_loss && fwd.stage == c.stage && fwd.mb == c.mb);
                    if !done[kk] && !in_overlap_self {
                        blocked = Some(kk);
                    }
                }
            });
            if let Some(kk) = blocked {
                waiting_on[r] = kk;
                next_waiter[r] = waiters[kk];
                waiters[kk] = r as u32;
                break 'rank;
            }
            waiting_on[r] = usize::MAX;
            match ins {
                Instr::Idle => {}
                other => out[r].push(other.clone()),
            }
            let mut produced: [Option<(Compute, PayloadKind)>; 2] = [None, None];
            let mut n_prod = 0;
            ins.for_each_compute(|c| {
                if let Some(k) = produce_of(c) {
                    if in_range(c) {
                        produced[n_prod] = Some((*c, k));
                        n_prod += 1;
                    }
                }
            });
            for (c, k) in produced.iter().flatten() {
                let kk = key(*k, c.stage, c.mb, m_n, s_n);
                // Loss availability on the last stage is a separate key space entry only for
                // F; mark it too (F's Act key doubles as "loss ready").
                done[kk] = true;
                let dst_stage = match k {
                    PayloadKind::Act => pl.next_stage(c.stage),
                    PayloadKind::Grad => pl.prev_stage(c.stage),
                    // Never produced here: a schedule writes its LEND/RETURN messages itself.
                    PayloadKind::Lend | PayloadKind::Return => None,
                };
                if let Some(ds) = dst_stage {
                    let dst = pl.rank_of(ds) as usize;
                    if dst != r && dst < np {
                        let payload = Payload {
                            kind: *k,
                            stage: c.stage,
                            mb: c.mb,
                        };
                        out[r].push(Instr::Comm(Comm::Send {
                            payload,
                            peer: dst as u32,
                            channel: 0,
                        }));
                        out[dst].push(Instr::Comm(Comm::Recv {
                            payload,
                            peer: r as u32,
                            channel: 0,
                        }));
                    }
                }
                // Wake everyone waiting on this key.
                let mut w = std::mem::replace(&mut waiters[kk], u32::MAX);
                while w != u32::MAX {
                    let nx = next_waiter[w as usize];
                    next_waiter[w as usize] = u32::MAX;
                    work.push(Reverse((key_of(w as usize, ptr[w as usize]), w)));
                    w = nx;
                }
            }
            if ins.is_compute() {
                emitted_compute = true;
            }
            ptr[r] += 1;
        }
    }

    // Stuck ranks?
    let stuck: Vec<usize> = (0..np).filter(|&r| ptr[r] < p.ranks[r].len()).collect();
    if let Some(&start) = stuck.first() {
        let wait_of = |r: usize| -> (LowerWait, Option<usize>) {
            let kk = waiting_on[r];
            let half = s_n as usize * m_n as usize;
            let (kind, rest) = if kk >= half {
                (PayloadKind::Grad, kk - half)
            } else {
                (PayloadKind::Act, kk)
            };
            let (s, m) = ((rest / m_n as usize) as u32, (rest % m_n as usize) as u32);
            let producer_rank = pl.rank_of(s) as usize;
            let needs = match kind {
                PayloadKind::Act => compute_str(&Compute::new(Kind::F, s, m)),
                PayloadKind::Grad => format!("the backward of stage {s}, micro-batch {m}"),
                PayloadKind::Lend | PayloadKind::Return => format!("the stash of F({s},{m})"),
            };
            // Does the producer rank still have that op ahead of it?
            let has_ahead = producer_rank < np
                && p.ranks[producer_rank][ptr[producer_rank]..]
                    .iter()
                    .any(|i| {
                        let mut hit = false;
                        i.for_each_compute(|c| {
                            if c.stage == s && c.mb == m && produce_of(c) == Some(kind) {
                                hit = true;
                            }
                        });
                        hit
                    });
            (
                LowerWait {
                    at: Pos {
                        rank: r as u32,
                        pos: ptr[r] as u32,
                    },
                    needs,
                    on: producer_rank as u32,
                },
                if has_ahead { Some(producer_rank) } else { None },
            )
        };
        // Follow the chain from the first stuck rank until it repeats.
        let mut seen = vec![usize::MAX; np];
        let mut chain = Vec::new();
        let mut r = start;
        loop {
            if seen[r] != usize::MAX {
                let cyc = chain[seen[r]..].to_vec();
                return Err(LowerError::Cycle(cyc));
            }
            seen[r] = chain.len();
            let (w, next) = wait_of(r);
            match next {
                Some(q) if waiting_on[q] != usize::MAX || ptr[q] < p.ranks[q].len() => {
                    chain.push(w);
                    r = q;
                }
                _ => return Err(LowerError::Missing(w)),
            }
        }
    }
    Ok(Program {
        pipeline: p.pipeline.clone(),
        ranks: out,
    })
}
