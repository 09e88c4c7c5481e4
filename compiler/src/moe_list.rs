//! The cost-aware part-level order of `--moe=STAGES:list` ([`crate::moe::Interleave::List`]).
//!
//! Each rank's forwards and backwards enter a window of ops in flight in their input order (a
//! spec stays conformant op for op; within the window a later op's part may start before an
//! earlier op's, so a spec's unit-time `expect warmup` can fail); what this module chooses is the order of the *parts* (attention,
//! dispatch, MLP, combine of a forward; the mirror for a backward; a dense op whole; the
//! eight parts of an `&` pair in DeepSeek's fixed order, `crate::moe`) across the ops of a
//! sliding window, and where the weight gradients run, by a greedy list schedule simulated
//! under the cost model over all ranks at once:
//!
//! * every rank has a compute stream and an expert-parallel (EP) stream, each running its
//!   parts in the order chosen, as the simulator does (`crate::sim`);
//! * a part starts when its stream is free and its op's previous part has ended; an op's
//!   first part also waits for its cross-rank input (the previous stage's forward, the next
//!   stage's backward, ended on their ranks at their simulated times, plus the message time
//!   when they run on another rank), for its own rank's inputs (the loss stage's forward, a
//!   `W`'s `B`), and for every op whose last part was placed before it (the simulator's rule:
//!   ops overlap only where the program interleaves their parts); an `&` pair's forward
//!   attention also waits for the pair's backward input (the pair starts when both inputs
//!   are in, as DeepSeek's DualPipe launches it), through a `WAIT_RA/RG` when that input
//!   comes from another rank, so the backward's first all-to-all runs under it;
//! * a window of `window` consecutive ops per rank (weight gradients not counted) is open:
//!   op `k + window` may place its first part once op `k` has placed its last (at most
//!   `window` ops in flight);
//! * parts are placed one at a time, globally in order of their start time (a heap over
//!   ranks); on a rank the part that can start first wins, ties to the earlier op, except
//!   that a part opening its op on the other stream goes first (placed after a part that
//!   closes another op, it would wait for that op to end). A part of a younger op may not
//!   hold back an older op's part on its stream (conservative backfilling): it must end
//!   before that part can start, now or after the older op's part on the other stream.
//!   Without that rule the greedy fills the compute stream of a DualPipe steady state with
//!   the next pair's attention and lengthens the gradient chain (P = 8, M = 64: makespan
//!   +17%).
//! * weight gradients: every `BW` of an MoE stage outside a pair becomes its `B` and its `W`,
//!   and every `W` of an MoE stage two parts, `W.mlp` (expert weights) then `W.attn` (the
//!   rest), each an op of its own outside the window. A `W` reads only its own `B`'s saved
//!   state and sends nothing: where it runs adds no cross-rank dependency. The oldest ready
//!   `W` part runs where it spends at least half of itself under the rank's latest all-to-all
//!   and ends before every open part on the compute stream and every part that opens an op
//!   can start (it delays nothing); when it would start before that all-to-all and the
//!   all-to-all waited for a receive (a cooldown's backward waiting for its gradient), it
//!   waits for that receive too (`WAIT_RA/RG`). It runs at its earliest start instead when
//!   more than [`W_READY_MAX`] are ready, when the rank holds all the activations it may, or
//!   when nothing else is left;
//! * memory: a rank holds at most its input order's peak of activations plus one per op in
//!   flight beyond two; a forward whose first part would exceed it waits (and the `W`s run).
//!
//! The point-to-point messages are placed too (the result is a lowered program, which
//! `check` verifies as given): each rank's sends and receives in the order of their
//! simulated time (the producer's end), ties by one global sequence, a send right after the
//! part that produces its payload, a receive before the part that reads it. Left to pass 3,
//! which orders messages by a unit-time schedule of the parts on one stream, a rank's single
//! in-order communication stream would post receives that wait for late data ahead of sends
//! that are ready (DualPipeV P = 8, M = 16: makespan 1.040 s instead of the 0.958 s this
//! schedule predicts).
//!
//! So in a warmup a forward's attention runs while the previous forward's dispatch is in
//! flight, in a cooldown a backward's first all-to-all runs under the previous backward's
//! compute, and around an `&` pair a plain op's all-to-alls run under the pair's compute.
//! With one `F` = attention + MLP and dispatch + combine of equal time (1:1) and two ops in
//! flight, a stream of forwards keeps both streams full: compute `attn1 attn2 mlp1 mlp2 attn3
//! ...`, EP `disp1 disp2 comb1 comb2 ...`.
//!
//! **Cost.** `O(parts · window · log P)`: a placement re-evaluates the window (and the oldest
//! `2 · window` pending `W` parts) of its own rank and of the rank its output feeds.
//!
//! **Memory.** A forward allocates its activation when its first part starts and a `BW` or a
//! split `W` releases it with its last part, as check's pass 6 counts them: `:list` holds no
//! more than the input order, `:listN` `N - 2` more (check's `peak_activations` and a spec's
//! `expect peak_activations` count them).
//!
//! **Figures** (P = 8, moe-1to1.toml, `compare`'s scaling, `tests/tests/moe.rs`): DualPipe
//! exposes 23.7% (M = 16) and 5.9% (M = 64) of its all-to-all, DualPipeV 20.9% and 5.3%, at
//! their default order's peak and in shorter steps; before the `W` split and the waits,
//! 48.6%, 16.0%, 46.8% and 18.2%.
//!
//! **Deadlock freedom.** The order is that of an execution: every part is placed after what
//! it reads has been placed, so pass 3 finds an interleaving and pass 4 accepts it.
//!
//! Without a cost model with all-to-all times the schedule charges unit times: an attention,
//! MLP, dispatch or combine 1, a whole `F`, `B` or `W` 2, a whole `BW` 4, messages 0.

use crate::passes::{is_first_part, is_last_part};
use crate::sim::cost::CostModel;
use schedc_ir::text::Span;
use schedc_ir::{Comm, Compute, Instr, Kind, Part, Payload, PayloadKind, Program};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Ops in flight per rank when `:list` gives no number.
pub const DEFAULT_WINDOW: usize = 2;

/// How many ready `W` parts may wait for an all-to-all to run under (module docs, "Weight
/// gradients"): with one more ready, the oldest runs at its earliest start.
///
/// Measured at P = 8, M = 16 and 64 with moe-1to1.toml (`compare`'s scaling), DualPipe and
/// DualPipeV under `:list`: 1 gives the shortest steps (0.8898 s, 2.5912 s, 0.9341 s,
/// 2.6833 s); 2, 4 or no bound lengthen them by up to 1.2% for at most 0.9 points less
/// exposed all-to-all.
const W_READY_MAX: usize = 1;

/// Held activations a part adds: +1 for a forward's first part, -1 for the last part of a
/// `BW` or `W` (a split `B` releases nothing; its `W` does), as check's pass 6 counts them.
fn mem_delta(c: &Compute) -> i64 {
    match c.kind {
        Kind::F if is_first_part(c) => 1,
        Kind::BW | Kind::W if is_last_part(c) => -1,
        _ => 0,
    }
}

/// One schedulable piece: a part, a whole op, or a whole (dense) pair.
struct Unit {
    ins: Instr,
    ep: bool,
    dur: f64,
    /// The backward of an `&` pair, on the pair's forward attention: the pair starts once
    /// both of its inputs are in (DeepSeek's DualPipe receives both before launching the
    /// overlapped chunk), so the backward's first all-to-all runs under that attention.
    pair_bwd: Option<Compute>,
}

/// The units of one op of the input (a whole op, a split op, a pair), in their fixed order.
struct Op {
    units: Vec<Unit>,
    span: Span,
    /// A whole weight-gradient op (`W`): it may fill the compute stream out of op order.
    w: bool,
}

/// A message placed by [`order`]: (time: its producer's end, global sequence number, after
/// how many of the rank's parts it may go, the send or receive, its span).
type Message = (f64, u64, usize, Instr, Span);

/// Per-rank state of the greedy.
struct RankState {
    ops: Vec<Op>,
    next: Vec<usize>,
    lo: usize,
    cfree: f64,
    efree: f64,
    closed: f64,
    version: u64,
    /// The `W` ops not yet placed, in op order (candidates of the W fill).
    wq: Vec<usize>,
    /// The op whose next unit starts first, when, and the receive the compute stream waits
    /// for first (`WAIT_RA/RG`), if any.
    best: Option<(f64, usize, Option<Payload>)>,
    /// The latest all-to-all placed: start, end, and the payload whose arrival started it
    /// (its op's cross-rank input), if that arrival is what it waited for.
    ep_last: (f64, f64, Option<Payload>),
    /// Activations held now (a forward's first part allocates, the last part of a `BW` or
    /// `W` releases) and the most the rank may hold: the input order's peak plus
    /// `window - 1`.
    live: i64,
    mem_cap: i64,
    /// With hand-split ops in the input, the start of the rank's latest placed part: no later
    /// part starts before it (the messages are placed by time between the parts, which needs
    /// the starts in order; a hand-split op's parts, each an op of the window, could
    /// otherwise go back in time and leave a receive after the part that reads it). 0
    /// otherwise (the measured figures above are for inputs of whole ops).
    last_start: f64,
}

/// The per-rank part orders of the module docs, with each part's span, or `None` when the
/// program cannot be scheduled this way (communication ops already in it, an op out of
/// range, an op whose input no rank produces): the caller then keeps its default order.
///
/// `units_of` expands one instruction into its parts in their fixed order (the lowering's
/// plain and pair orders); `cost` times them (module docs for the unit fallback).
pub(crate) fn order(
    p: &Program,
    spans: &[Vec<Span>],
    units_of: &dyn Fn(&Instr) -> Vec<Instr>,
    cost: Option<&CostModel>,
    window: usize,
    moe_stage: &dyn Fn(u32) -> bool,
) -> Option<Vec<(Vec<Instr>, Vec<Span>)>> {
    let pl = &p.pipeline;
    let (s_n, m_n) = (pl.stages as usize, pl.microbatches as usize);
    let window = window.max(1);
    let timed = cost.filter(|c| c.a2a_time(Part::Dispatch) + c.a2a_time(Part::Combine) > 0.0);
    let msg = timed.map_or(0.0, |c| c.message_time());
    let dur = |ins: &Instr| -> f64 {
        match (timed, ins) {
            (Some(c), Instr::Compute(x)) => c.compute_time(x),
            (Some(c), Instr::Overlap { fwd, bwd }) => c.pair_time(fwd, bwd),
            (None, Instr::Compute(x)) => match (x.part, x.kind) {
                (Part::Whole, Kind::BW) => 4.0,
                (Part::Whole, _) => 2.0,
                _ => 1.0,
            },
            (None, Instr::Overlap { fwd, bwd }) => {
                let w = |k: Kind| if k == Kind::BW { 4.0 } else { 2.0 };
                w(fwd.kind) + w(bwd.kind)
            }
            _ => 0.0,
        }
    };
    let hand_split = p
        .ranks
        .iter()
        .flatten()
        .any(|i| matches!(i, Instr::Compute(c) if c.part != Part::Whole));
    let mut st: Vec<RankState> = Vec::with_capacity(p.ranks.len());
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut ops = Vec::with_capacity(instrs.len());
        for (i, ins) in instrs.iter().enumerate() {
            if !ins.is_compute() {
                return None;
            }
            let mut bad = false;
            ins.for_each_compute(|c| {
                bad |= c.stage as usize >= s_n || c.mb as usize >= m_n;
            });
            if bad {
                return None;
            }
            let span = spans
                .get(r)
                .and_then(|v| v.get(i))
                .copied()
                .unwrap_or_default();
            let unit = |u: Instr| Unit {
                ep: matches!(&u, Instr::Compute(c) if c.part.is_all_to_all()),
                dur: dur(&u),
                ins: u,
                pair_bwd: None,
            };
            // The W split: a whole `BW` of an MoE stage becomes its `B` and the two parts of
            // its `W`, a whole `W` its two parts, each part an op of its own.
            let wsplit = match ins {
                Instr::Compute(c)
                    if c.part == Part::Whole
                        && matches!(c.kind, Kind::BW | Kind::W)
                        && moe_stage(c.stage) =>
                {
                    Some(*c)
                }
                _ => None,
            };
            if let Some(c) = wsplit {
                if c.kind == Kind::BW {
                    let b = Instr::Compute(Compute { kind: Kind::B, ..c });
                    let units = units_of(&b).into_iter().map(unit).collect();
                    ops.push(Op {
                        w: false,
                        units,
                        span,
                    });
                }
                for &part in Part::order(Kind::W) {
                    let wp = Instr::Compute(Compute {
                        kind: Kind::W,
                        part,
                        ..c
                    });
                    ops.push(Op {
                        w: true,
                        units: vec![unit(wp)],
                        span,
                    });
                }
                continue;
            }
            let mut units: Vec<Unit> = units_of(ins).into_iter().map(unit).collect();
            if let Instr::Overlap { fwd, bwd } = ins {
                let first_f = units.iter_mut().find(
                    |u| matches!(&u.ins, Instr::Compute(c) if c.kind == Kind::F && c.mb == fwd.mb && c.stage == fwd.stage),
                );
                if let Some(u) = first_f {
                    if bwd.stage != fwd.stage || bwd.mb != fwd.mb {
                        u.pair_bwd = Some(*bwd);
                    }
                }
            }
            let w = matches!(ins, Instr::Compute(c) if c.kind == Kind::W);
            ops.push(Op { w, units, span });
        }
        let n = ops.len();
        let wq = (0..n).filter(|&j| ops[j].w).collect();
        // The input order's peak of held activations.
        let (mut live, mut peak) = (0i64, 0i64);
        for o in &ops {
            for u in &o.units {
                u.ins.for_each_compute(|c| {
                    live += mem_delta(c);
                    peak = peak.max(live);
                });
            }
        }
        let mem_cap = peak + window.max(2) as i64 - 2;
        st.push(RankState {
            wq,
            ops,
            next: vec![0; n],
            lo: 0,
            cfree: 0.0,
            efree: 0.0,
            closed: 0.0,
            version: 0,
            best: None,
            ep_last: (0.0, 0.0, None),
            live: 0,
            mem_cap,
            last_start: 0.0,
        });
    }
    // End of each stage's forward (`act`) and backward (`grad`) per micro-batch; NaN before.
    let slot = |s: u32, m: u32| s as usize * m_n + m as usize;
    let mut act = vec![f64::NAN; s_n * m_n];
    let mut grad = vec![f64::NAN; s_n * m_n];
    // End of the latest placed part of each op (kind, stage, mb).
    let op_key = |c: &Compute| {
        let k = match c.kind {
            Kind::F => 0,
            Kind::B => 1,
            Kind::W => 2,
            Kind::BW => 3,
        };
        k * s_n * m_n + slot(c.stage, c.mb)
    };
    // With how many of its parts placed: a hand-split op's parts are separate ops of the
    // input, and a later one may enter the window first; it waits for the part before it.
    let mut part_end = vec![(f64::NAN, 0u8); 4 * s_n * m_n];
    // Per rank: each placed part's start, and its messages (time, global sequence number,
    // after how many of the rank's parts, the op, span).
    let mut starts: Vec<Vec<f64>> = vec![Vec::new(); st.len()];
    let mut msgs: Vec<Vec<Message>> = vec![Vec::new(); st.len()];
    let mut seq = 0u64;
    let mut out: Vec<(Vec<Instr>, Vec<Span>)> = st
        .iter()
        .map(|s| {
            let n: usize = s.ops.iter().map(|o| o.units.len()).sum();
            (Vec::with_capacity(n), Vec::with_capacity(n))
        })
        .collect();

    // When an input that ends at `end` (seconds; NaN while not produced yet) on the rank of
    // stage `src` can be read on rank `r` (infinite while not produced), and whether it comes
    // from another rank: the producer's end, plus the message time when it does.
    let input_at = |end: f64, src: u32, r: usize| -> (f64, bool) {
        let cross = pl.rank_of(src) as usize != r;
        let at = if end.is_nan() {
            f64::INFINITY
        } else if cross {
            end + msg
        } else {
            end
        };
        (at, cross)
    };
    // When unit `u` of rank `r` can start (infinite while an input is missing).
    let start_of =
        |st: &RankState, u: &Unit, r: usize, act: &[f64], grad: &[f64], pe: &[(f64, u8)]| {
            let mut t = if u.ep { st.efree } else { st.cfree }.max(st.last_start);
            u.ins.for_each_compute(|c| {
                if !is_first_part(c) {
                    let (e, placed) = pe[op_key(c)];
                    let ready = !e.is_nan() && usize::from(placed) == c.part.exec_index(c.kind);
                    t = t.max(if ready { e } else { f64::INFINITY });
                    return;
                }
                t = t.max(st.closed);
                let mut need = |end: f64, s: u32| t = t.max(input_at(end, s, r).0);
                match c.kind {
                    Kind::F => {
                        if let Some(ps) = pl.prev_stage(c.stage) {
                            need(act[slot(ps, c.mb)], ps);
                        }
                    }
                    Kind::B | Kind::BW => {
                        need(act[slot(c.stage, c.mb)], c.stage);
                        if let Some(ns) = pl.next_stage(c.stage) {
                            need(grad[slot(ns, c.mb)], ns);
                        }
                    }
                    Kind::W => need(grad[slot(c.stage, c.mb)], c.stage),
                }
            });
            if let Some(b) = &u.pair_bwd {
                if let Some(ns) = pl.next_stage(b.stage) {
                    t = t.max(input_at(grad[slot(ns, b.mb)], ns, r).0);
                }
            }
            t
        };
    let evaluate = |s: &mut RankState, r: usize, act: &[f64], grad: &[f64], pe: &[(f64, u8)]| {
        // `lo`: the oldest open op that is not a `W` (those are placed below).
        while s.lo < s.ops.len() && (s.next[s.lo] == s.ops[s.lo].units.len() || s.ops[s.lo].w) {
            s.lo += 1;
        }
        // The window: `window` ops from the oldest open one, `W`s not counted.
        let mut hi = s.lo;
        let mut k = 0;
        while hi < s.ops.len() && k < window {
            k += usize::from(!s.ops[hi].w);
            hi += 1;
        }
        // (start, on the EP stream, opens its op, op, duration), window order.
        let mut cands: Vec<(f64, bool, bool, usize, f64)> = Vec::with_capacity(hi - s.lo);
        // The oldest ready `W` competes like a window op when it must run: more than
        // `W_READY_MAX` are ready, the rank holds all the activations it may, or nothing
        // else is left.
        let ready = |j: usize| start_of(s, &s.ops[j].units[0], r, act, grad, pe).is_finite();
        let forced_w = s.wq.first().copied().filter(|&j0| {
            ready(j0)
                && (s.lo == s.ops.len()
                    || s.live >= s.mem_cap
                    || s.wq.get(W_READY_MAX).is_some_and(|&j1| ready(j1)))
        });
        let from = forced_w.map_or(s.lo, |j| j.min(s.lo));
        for j in from..hi.max(forced_w.map_or(0, |j| j + 1)) {
            if (s.ops[j].w || j >= hi) && Some(j) != forced_w {
                continue;
            }
            if let Some(u) = s.ops[j].units.get(s.next[j]) {
                // Memory: a forward waits while the rank holds all it may.
                let mut alloc = 0;
                u.ins.for_each_compute(|c| alloc += mem_delta(c).max(0));
                if s.live + alloc > s.mem_cap {
                    continue;
                }
                let t = start_of(s, u, r, act, grad, pe);
                if t.is_finite() {
                    cands.push((t, u.ep, s.next[j] == 0, j, u.dur));
                }
            }
        }
        // A part of a younger op may not hold back an older op's part on its stream: it
        // must end before that part can start — now, or after the older
        // op's part on the other stream.
        let allowed = |k: usize| {
            let (t, ep, _, _, d) = cands[k];
            cands[..k].iter().all(|&(ti, epi, _, _, di)| {
                let bound = if epi == ep { ti } else { ti + di };
                t + d <= bound.max(t)
            })
        };
        let mut best: Option<usize> = None;
        for k in 0..cands.len() {
            if allowed(k) && best.is_none_or(|b| cands[k].0 < cands[b].0) {
                best = Some(k);
            }
        }
        // At an equal start, a part that opens its op on the other stream goes first: it
        // does not delay the chosen part, and placed after a closing part it would wait
        // for that op to end.
        if let Some(b) = best {
            if !cands[b].2 {
                if let Some(k) = (0..cands.len()).find(|&k| {
                    cands[k].2 && cands[k].1 != cands[b].1 && cands[k].0 <= cands[b].0 && allowed(k)
                }) {
                    best = Some(k);
                }
            }
        }
        let mut best = best.map(|k| (cands[k].0, cands[k].3, None));
        // Cover: the oldest ready `W` part that runs at least half under the rank's latest
        // all-to-all and ends before every open part on the compute stream and every part
        // that opens its op can start (it waits for the ops placed before it, the `W` among
        // them; nothing else waits for a `W`). When it would start before that all-to-all
        // and the all-to-all waited for a receive, the `W` waits for that receive too
        // (`WAIT_RA/RG`): on a rank draining backwards one at a time, the compute stream is
        // idle until the next backward's gradient arrives, and a `W` run then would not
        // cover that backward's first all-to-all.
        let limit = cands
            .iter()
            .filter(|c| !c.1 || c.2)
            .map(|c| c.0)
            .fold(f64::INFINITY, f64::min);
        let before = best.map_or(f64::INFINITY, |b| b.0);
        let (es, ee, gate) = s.ep_last;
        for &j in s.wq.iter().take(2 * window) {
            if Some(j) == forced_w {
                continue;
            }
            let u = &s.ops[j].units[0];
            let t0 = start_of(s, u, r, act, grad, pe);
            let (t, wait) = match gate {
                Some(g) if t0 < es => (es, Some(g)),
                _ => (t0, None),
            };
            let overlap = (t + u.dur).min(ee) - t.max(es);
            if t < before && overlap >= 0.5 * u.dur && t + u.dur <= limit {
                best = Some((t, j, wait));
                break;
            }
        }
        s.version += 1;
        s.best = best;
    };
    // Min-heap of (start bits, rank, version): starts are finite and >= 0, so their bit
    // patterns order as the numbers do.
    let mut heap: BinaryHeap<Reverse<(u64, u32, u64)>> = BinaryHeap::new();
    for (r, s) in st.iter_mut().enumerate() {
        evaluate(s, r, &act, &grad, &part_end);
        if let Some((t, _, _)) = s.best {
            heap.push(Reverse((t.max(0.0).to_bits(), r as u32, s.version)));
        }
    }
    while let Some(Reverse((_, r, ver))) = heap.pop() {
        let r = r as usize;
        if st[r].version != ver {
            continue;
        }
        let Some((t, j, wait)) = st[r].best else {
            continue;
        };
        let s = &mut st[r];
        let u = &s.ops[j].units[s.next[j]];
        let e = t + u.dur;
        if hand_split {
            s.last_start = t;
        }
        // The cross-rank input an op's first part reads, and when it arrives.
        let arrival = |c: &Compute| -> Option<(Payload, f64)> {
            let (kind, src, table) = match c.kind {
                Kind::F => (PayloadKind::Act, pl.prev_stage(c.stage)?, &act),
                Kind::B | Kind::BW => (PayloadKind::Grad, pl.next_stage(c.stage)?, &grad),
                Kind::W => return None,
            };
            let (at, cross) = input_at(table[slot(src, c.mb)], src, r);
            cross.then_some((
                Payload {
                    kind,
                    stage: src,
                    mb: c.mb,
                },
                at,
            ))
        };
        let mut waits: [Option<Payload>; 2] = [wait, None];
        if let Some(b) = &u.pair_bwd {
            waits[1] = arrival(b).map(|(p, _)| p);
        }
        if u.ep {
            s.efree = e;
            let mut gate = None;
            u.ins.for_each_compute(|c| {
                if is_first_part(c) {
                    gate = arrival(c)
                        .filter(|&(_, at)| (at - t).abs() <= 1e-9 * t.abs().max(1e-9))
                        .map(|(p, _)| p);
                }
            });
            s.ep_last = (t, e, gate);
        } else {
            s.cfree = e;
        }
        let mut feeds: [Option<usize>; 2] = [None, None];
        let mut sent: [Option<(Payload, usize)>; 2] = [None, None];
        u.ins.for_each_compute(|c| {
            s.live += mem_delta(c);
            let k = op_key(c);
            part_end[k] = (e, part_end[k].1.saturating_add(1));
            if is_last_part(c) {
                s.closed = s.closed.max(e);
                let (table, to) = match c.kind {
                    Kind::F => (Some(&mut act), pl.next_stage(c.stage)),
                    Kind::B | Kind::BW => (Some(&mut grad), pl.prev_stage(c.stage)),
                    Kind::W => (None, None),
                };
                if let Some(tb) = table {
                    tb[slot(c.stage, c.mb)] = e;
                }
                if let Some(to) = to {
                    let q = pl.rank_of(to) as usize;
                    if q != r {
                        let f = if feeds[0].is_none() { 0 } else { 1 };
                        feeds[f] = Some(q);
                        let kind = if c.kind == Kind::F {
                            PayloadKind::Act
                        } else {
                            PayloadKind::Grad
                        };
                        sent[f] = Some((
                            Payload {
                                kind,
                                stage: c.stage,
                                mb: c.mb,
                            },
                            q,
                        ));
                    }
                }
            }
        });
        let span = s.ops[j].span;
        for w in waits.into_iter().flatten() {
            out[r].0.push(Instr::WaitRecv(w));
            out[r].1.push(span);
            starts[r].push(t);
        }
        out[r].0.push(u.ins.clone());
        out[r].1.push(span);
        starts[r].push(t);
        s.next[j] += 1;
        if s.ops[j].w {
            if let Ok(i) = s.wq.binary_search(&j) {
                s.wq.remove(i);
            }
        }
        let placed = out[r].0.len();
        for (payload, q) in sent.into_iter().flatten() {
            if q < msgs.len() {
                let (peer_r, peer_q) = (r as u32, q as u32);
                msgs[r].push((
                    e,
                    seq,
                    placed,
                    Instr::Comm(Comm::Send {
                        payload,
                        peer: peer_q,
                        channel: 0,
                    }),
                    span,
                ));
                msgs[q].push((
                    e,
                    seq,
                    0,
                    Instr::Comm(Comm::Recv {
                        payload,
                        peer: peer_r,
                        channel: 0,
                    }),
                    span,
                ));
                seq += 1;
            }
        }
        for q in std::iter::once(r).chain(feeds.into_iter().flatten()) {
            if q < st.len() {
                evaluate(&mut st[q], q, &act, &grad, &part_end);
                if let Some((tq, _, _)) = st[q].best {
                    heap.push(Reverse((tq.max(0.0).to_bits(), q as u32, st[q].version)));
                }
            }
        }
    }
    // A rank left with parts waits for an input no rank produced: keep the default order.
    if st
        .iter()
        .any(|s| s.ops.iter().zip(&s.next).any(|(o, &n)| n < o.units.len()))
    {
        return None;
    }
    // Place the messages: each rank's sends and receives in one order, that of their time
    // (the producer's end) and then of their global sequence number, so that every rank's
    // communication stream is a projection of one global order (deadlock-free under
    // rendezvous, as pass 3's own lowering); a receive before the part that reads it (which
    // starts no earlier than its producer's end), a send after the part that produces it.
    let mut lowered = Vec::with_capacity(out.len());
    for (r, (parts, sps)) in out.into_iter().enumerate() {
        let mut m = std::mem::take(&mut msgs[r]);
        m.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut ins = Vec::with_capacity(parts.len() + m.len());
        let mut sp = Vec::with_capacity(parts.len() + m.len());
        let mut mi = m.into_iter().peekable();
        for (k, (part, span)) in parts.into_iter().zip(sps).enumerate() {
            while let Some((t, _, after, _, _)) = mi.peek() {
                if *t <= starts[r][k] && *after <= k {
                    let (_, _, _, c, s) = mi.next().expect("peeked");
                    ins.push(c);
                    sp.push(s);
                } else {
                    break;
                }
            }
            ins.push(part);
            sp.push(span);
        }
        for (_, _, _, c, s) in mi {
            ins.push(c);
            sp.push(s);
        }
        lowered.push((ins, sp));
    }
    Some(lowered)
}
