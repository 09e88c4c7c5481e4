//! Memory ops under a byte cap (`schedc optimize --max-memory`, issue 27).
//!
//! The search orders ops under a cap on live activations; a cap on device bytes may still
//! bind on the order it finds (parameters, gradients and optimizer state count too, and an
//! activation's bytes depend on its stage). [`fit_bytes`] then rewrites the lowered program
//! with the IR's memory ops ([The IR](../../book/src/ir.md), memory ops), one activation at a
//! time, until every rank's simulated peak (`peak_memory_bytes`) is within the cap:
//!
//! * on the rank furthest over the cap, at the first instant its live bytes peak, the
//!   activations live then and not yet read by their backward (nor moved before) are
//!   candidates, the one whose backward waits
//!   longest after its forward first (PipeOffload's rule, Wan et al., arXiv 2503.01328);
//! * two rewrites are simulated for it: **offload** (`OFFLOAD(s,m)` right after `F(s,m)`,
//!   `RELOAD(s,m)` just in time: before the latest op of the rank that the compute stream
//!   reaches at least a reload's time before the backward starts) and **recompute**
//!   (`F(s,m)!`, and `RECOMPUTE(s,m)` right before the backward). The simulator charges a
//!   copy on the host-copy stream of its direction at `[memory] offload`/`reload` or
//!   `activation_bytes / pcie_bandwidth`, a recompute as a forward on the compute stream;
//! * an activation offloaded before that is still on the device at the peak (its offload
//!   not done yet, or its reload started early) is a candidate once more, for a recompute
//!   instead, after the fresh ones;
//! * the rewrite that lowers the total excess over the cap (the sum over ranks of the bytes
//!   above it) with the shorter makespan is kept; one that keeps the excess is kept when
//!   none lowers it (another instant may peak as high); one that overflows `[memory]
//!   host_bytes` never. Each activation is considered once, so the loop ends.
//!
//! Once the program fits, each kept rewrite is undone again (last first) where the program
//! still fits without it and is not slower.

use schedc::sim::cost::CostModel;
use schedc::sim::{simulate_with, EventKind, SimOptions, SimResult, StreamKind};
use schedc_ir::{Comm, Compute, Instr, Kind, MemKind, MemOp, Part, Program};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// How one activation is kept off the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Move {
    /// `OFFLOAD` after the forward, `RELOAD` before the rank's instruction `reload_before`
    /// (an index into the original program's rank).
    Offload {
        /// The original instruction the `RELOAD` is inserted before.
        reload_before: usize,
    },
    /// `F(s,m)!` and `RECOMPUTE` right before the backward.
    Recompute,
}

/// One rewrite: an activation of `rank` (its forward at original index `f`, its first
/// backward at `b`) and how it moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rewrite {
    /// The rank.
    pub rank: usize,
    /// Index of `F(s,m)` in the original rank program.
    pub f: usize,
    /// Index of the backward (`B` or `BW`) that first reads the activation.
    pub b: usize,
    /// Its stage.
    pub stage: u32,
    /// Its micro-batch.
    pub mb: u32,
    /// Offload or recompute.
    pub how: Move,
}

/// A program that fits the cap, with what was done to it.
pub struct Fitted {
    /// The rewritten program (the input when it already fit).
    pub program: Program,
    /// Its simulation (without the steady state), under `cost.for_pipeline`.
    pub sim: SimResult,
    /// The rewrites kept, in the order applied.
    pub rewrites: Vec<Rewrite>,
}

impl Fitted {
    /// Activations offloaded and recomputed.
    pub fn counts(&self) -> (usize, usize) {
        let off = self
            .rewrites
            .iter()
            .filter(|r| matches!(r.how, Move::Offload { .. }))
            .count();
        (off, self.rewrites.len() - off)
    }
}

/// Applies `rw` to the lowered program `p`. Each rank's instructions keep their order; the
/// memory ops are inserted around them and rewritten forwards get `!`. Also returns, per
/// rank, the original index of each instruction of the result (`None` for an inserted one).
pub fn apply(p: &Program, rw: &[Rewrite]) -> (Program, Vec<Vec<Option<usize>>>) {
    let mut out = p.clone();
    let mut origin = Vec::with_capacity(p.ranks.len());
    for (r, prog) in p.ranks.iter().enumerate() {
        let mine: Vec<&Rewrite> = rw.iter().filter(|x| x.rank == r).collect();
        let mut v = Vec::with_capacity(prog.len() + 2 * mine.len());
        let mut o = Vec::with_capacity(prog.len() + 2 * mine.len());
        for (i, ins) in prog.iter().enumerate() {
            for x in &mine {
                let (at, kind) = match x.how {
                    Move::Offload { reload_before } => (reload_before, MemKind::Reload),
                    Move::Recompute => (x.b, MemKind::Recompute),
                };
                if at == i {
                    v.push(Instr::Mem(MemOp {
                        kind,
                        stage: x.stage,
                        mb: x.mb,
                    }));
                    o.push(None);
                }
            }
            let mut ins = ins.clone();
            let mut offload = None;
            if let Some(x) = mine.iter().find(|x| x.f == i) {
                if let Instr::Compute(c) = &mut ins {
                    match x.how {
                        Move::Recompute => c.checkpoint = true,
                        Move::Offload { .. } => {
                            offload = Some(Instr::Mem(MemOp {
                                kind: MemKind::Offload,
                                stage: x.stage,
                                mb: x.mb,
                            }))
                        }
                    }
                }
            }
            v.push(ins);
            o.push(Some(i));
            if let Some(m) = offload {
                v.push(m);
                o.push(None);
            }
        }
        out.ranks[r] = v;
        origin.push(o);
    }
    (out, origin)
}

/// Bytes above `cap` summed over ranks; `None` when an offload overflows the host budget.
fn excess(s: &SimResult, cap: f64) -> Option<f64> {
    if !s.host_overflows.is_empty() {
        return None;
    }
    Some(
        s.ranks
            .iter()
            .map(|r| (r.peak_memory_bytes - cap).max(0.0))
            .sum(),
    )
}

/// A rewrite tried: its excess over the cap, makespan, rewrites, program, simulation, and
/// the program's origin map (see [`apply`]).
type Trial = (
    f64,
    f64,
    Vec<Rewrite>,
    Program,
    SimResult,
    Vec<Vec<Option<usize>>>,
);

fn whole(ins: &Instr) -> Option<&Compute> {
    match ins {
        Instr::Compute(c) if c.part == Part::Whole => Some(c),
        _ => None,
    }
}

/// Rewrites `p` (a lowered program that `schedc check` accepts, without memory ops of its
/// own) with offloads and recomputes until every rank's simulated peak device memory is at
/// most `cap` bytes (module docs), under `cost` as `schedc sim` charges it
/// (`CostModel::for_pipeline`). `deadline` stops the rewriting (then an error).
///
/// Errors: the program does not simulate; it holds memory ops, lent stashes or MoE parts
/// already; or no rewrite brings it within the cap (the static bytes alone exceed it, every
/// activation at a peak has been tried, or the deadline passed): the message says which
/// rank needs how many bytes.
pub fn fit_bytes(
    p: &Program,
    cost: &CostModel,
    cap: f64,
    deadline: Option<Instant>,
) -> Result<Fitted, String> {
    let c = cost.for_pipeline(&p.pipeline);
    let sim = |q: &Program| {
        simulate_with(
            q,
            &c,
            SimOptions {
                steady_state: false,
            },
        )
    };
    let s0 = sim(p)?;
    let e0 = excess(&s0, cap).unwrap_or(f64::INFINITY);
    if e0 <= 0.0 {
        return Ok(Fitted {
            program: p.clone(),
            sim: s0,
            rewrites: Vec::new(),
        });
    }
    let stash = |c: &Comm| match c {
        Comm::Send { payload, .. } | Comm::Recv { payload, .. } => payload.kind.is_stash(),
        Comm::Collective(_) => false,
    };
    if p.ranks.iter().flatten().any(|i| match i {
        Instr::Mem(_) => true,
        Instr::Compute(c) => c.part != Part::Whole,
        Instr::Comm(c) => stash(c),
        Instr::Group(g) => g.iter().any(stash),
        _ => false,
    }) {
        return Err(
            "the schedule already moves activations (memory ops, lent stashes) or splits MoE parts: the byte cap is only fitted on whole ops without memory ops".into(),
        );
    }
    let mut kept: Vec<Rewrite> = Vec::new();
    let mut tried: HashSet<(usize, usize)> = HashSet::new();
    let mut switched: HashSet<(usize, usize)> = HashSet::new();
    let (mut cur, mut origin) = apply(p, &kept);
    // The input's largest peak, and the least largest peak any accepted rewrite reached
    // (the excess, summed over ranks, never grows, but one rank may rise while others fall):
    // what a failure reports.
    let input_peak = worst(&s0);
    let mut least = input_peak;
    let mut s = s0;
    let mut e = e0;
    let past = || deadline.is_some_and(|d| Instant::now() >= d);
    while e > 0.0 {
        if past() {
            return Err(over_message(
                &s,
                least,
                input_peak,
                cap,
                "the time limit ran out",
            ));
        }
        // The rank furthest over the cap, and the instant it first peaks.
        let (r, t) = match s
            .ranks
            .iter()
            .filter(|x| x.peak_memory_bytes > cap)
            .max_by(|a, b| a.peak_memory_bytes.total_cmp(&b.peak_memory_bytes))
        {
            Some(x) => (x.rank as usize, x.peak_memory_at),
            None => break, // host budget only: no rank over the device cap
        };
        // Compute-stream times of the rank's original instructions.
        let n = p.ranks[r].len();
        let mut start = vec![f64::NAN; n];
        let mut end = vec![f64::NAN; n];
        for ev in s.events.iter().filter(|ev| {
            ev.rank as usize == r && ev.stream == StreamKind::Compute && ev.kind != EventKind::Mem
        }) {
            if let Some(Some(i)) = origin[r].get(ev.pos as usize) {
                start[*i] = ev.start;
                end[*i] = ev.end;
            }
        }
        // When the offloads and reloads of the rank's activations end and start.
        let mut off_end: HashMap<(u32, u32), f64> = HashMap::new();
        let mut reload_start: HashMap<(u32, u32), f64> = HashMap::new();
        for ev in s.events.iter().filter(|ev| ev.rank as usize == r) {
            if let Some(Instr::Mem(op)) = cur.ranks[r].get(ev.pos as usize) {
                match ev.stream {
                    StreamKind::Host => {
                        off_end.insert((op.stage, op.mb), ev.end);
                    }
                    StreamKind::HostToDevice => {
                        reload_start.insert((op.stage, op.mb), ev.start);
                    }
                    _ => {}
                }
            }
        }
        // Activations live at t on the device, not tried yet, and offloaded ones live at t
        // (their offload not done, or reloaded early), not switched yet: (wait, f, b, the
        // offload's index in `kept`).
        let prog = &p.ranks[r];
        let mut cands: Vec<(f64, usize, usize, Option<usize>)> = Vec::new();
        for (f, ins) in prog.iter().enumerate() {
            let Some(fc) = whole(ins).filter(|c| c.kind == Kind::F) else {
                continue;
            };
            let moved = kept.iter().position(|x| x.rank == r && x.f == f);
            let switch = match moved {
                None if tried.contains(&(r, f)) => continue,
                None => None,
                Some(k) if matches!(kept[k].how, Move::Offload { .. }) => {
                    if switched.contains(&(r, f)) {
                        continue;
                    }
                    Some(k)
                }
                Some(_) => continue,
            };
            let same = |c: &Compute| c.stage == fc.stage && c.mb == fc.mb;
            let Some(b) = prog.iter().position(|i| {
                whole(i).is_some_and(|c| same(c) && matches!(c.kind, Kind::B | Kind::BW))
            }) else {
                continue;
            };
            // The last op that frees it: its BW, or its W after a B.
            let release = prog
                .iter()
                .enumerate()
                .filter(|(_, i)| whole(i).is_some_and(|c| same(c) && c.kind != Kind::F))
                .map(|(k, _)| end[k])
                .fold(f64::NEG_INFINITY, f64::max);
            // Live at t and movable: before its backward (after it, the bytes B left until
            // W stay on the device).
            if b < f || !(start[f] <= t && t < release.min(start[b])) {
                continue;
            }
            if switch.is_some() {
                let key = (fc.stage, fc.mb);
                let off = off_end.get(&key).copied().unwrap_or(f64::INFINITY);
                let back = reload_start.get(&key).copied().unwrap_or(f64::INFINITY);
                if !(t < off || back <= t) {
                    continue;
                }
            }
            cands.push((start[b] - end[f], f, b, switch));
        }
        // Fresh activations first, the longest wait first; then switches.
        cands.sort_by(|x, y| {
            (x.3.is_some())
                .cmp(&y.3.is_some())
                .then(y.0.total_cmp(&x.0))
                .then(x.1.cmp(&y.1))
        });
        let Some(&(_, f, b, switch)) = cands.first() else {
            return Err(over_message(
                &s,
                least,
                input_peak,
                cap,
                "every activation live at its peak has been offloaded or recomputed",
            ));
        };
        tried.insert((r, f));
        if switch.is_some() {
            switched.insert((r, f));
        }
        let fc = whole(&prog[f]).copied().expect("a forward");
        // The offload's reload point: the latest instruction the compute stream reaches at
        // least a reload's time before the backward starts (never before the forward's
        // successor, where the offload is).
        let copy = c.memory.copy_time(MemKind::Reload, fc.stage);
        let mut reach = end[f];
        let mut at = f + 1;
        for (i, e_i) in end.iter().enumerate().take(b + 1).skip(f + 1) {
            if reach + copy <= start[b] + 1e-12 {
                at = i;
            }
            if e_i.is_finite() {
                reach = reach.max(*e_i);
            }
        }
        let mut best: Option<Trial> = None;
        // An offloaded activation still live at the peak may only be recomputed instead.
        let hows: &[Move] = if switch.is_some() {
            &[Move::Recompute]
        } else {
            &[Move::Offload { reload_before: at }, Move::Recompute]
        };
        for &how in hows {
            let mut rw = kept.clone();
            let w = Rewrite {
                rank: r,
                f,
                b,
                stage: fc.stage,
                mb: fc.mb,
                how,
            };
            match switch {
                Some(k) => rw[k] = w,
                None => rw.push(w),
            }
            let (q, o) = apply(p, &rw);
            let Ok(sq) = sim(&q) else { continue };
            let Some(eq) = excess(&sq, cap) else { continue };
            if eq > e + 1e-6 {
                continue;
            }
            let progress = eq < e - 1e-6;
            let better = match &best {
                None => true,
                Some((be, bm, ..)) => {
                    let bprog = *be < e - 1e-6;
                    (progress && !bprog) || (progress == bprog && sq.makespan < bm - 1e-12)
                }
            };
            if better {
                best = Some((eq, sq.makespan, rw, q, sq, o));
            }
        }
        if let Some((eq, _, rw, q, sq, o)) = best {
            kept = rw;
            cur = q;
            origin = o;
            s = sq;
            e = eq;
            if let (Some(w), Some(l)) = (worst(&s), least) {
                if w.1 < l.1 {
                    least = Some(w);
                }
            }
        }
    }
    // Undo what the program no longer needs (last first), where it stays within the cap and
    // is not slower.
    let mut k = kept.len();
    while k > 0 && !past() {
        k -= 1;
        let mut rw = kept.clone();
        rw.remove(k);
        let (q, o) = apply(p, &rw);
        if let Ok(sq) = sim(&q) {
            if excess(&sq, cap) == Some(0.0) && sq.makespan <= s.makespan + 1e-12 {
                kept = rw;
                cur = q;
                origin = o;
                s = sq;
            }
        }
    }
    let _ = origin;
    Ok(Fitted {
        program: cur,
        sim: s,
        rewrites: kept,
    })
}

/// The rank with the largest simulated peak device memory, and that peak (bytes).
fn worst(s: &SimResult) -> Option<(u32, f64)> {
    s.ranks
        .iter()
        .max_by(|a, b| a.peak_memory_bytes.total_cmp(&b.peak_memory_bytes))
        .map(|w| (w.rank, w.peak_memory_bytes))
}

/// Why fitting failed: `s` is the last program tried, `least` the lowest largest peak any
/// accepted rewrite reached and `input` the input's, as (rank, bytes).
fn over_message(
    s: &SimResult,
    least: Option<(u32, f64)>,
    input: Option<(u32, f64)>,
    cap: f64,
    why: &str,
) -> String {
    match (least, input) {
        (Some(l), Some(i)) if l.1 > cap => format!(
            "no schedule within --max-memory {cap} bytes was found: with offloads and recomputes the lowest peak reached is {} bytes on rank {} (the input's: {} bytes on rank {}; a rank holds at least the activation of the op it runs) ({why})",
            l.1.round() as u64,
            l.0,
            i.1.round() as u64,
            i.0
        ),
        _ if s.host_overflows.is_empty() => format!(
            "no schedule within --max-memory {cap} bytes was found: every rank fits at some point of the search, but not all at once ({why})"
        ),
        _ => format!(
            "no schedule within --max-memory {cap} bytes was found: an offload would overflow [memory] host_bytes ({why})"
        ),
    }
}
