//! A reimplementation of the Controllable Memory authors' V-Half and V-Min generator (Qi et
//! al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024, arXiv 2405.15362, §4;
//! the algorithm of their `zbv_greedy.py`, sail-sg/zero-bubble-pipeline-parallelism
//! @39f2c18), written here from the paper and a reading of that algorithm, so that schedc's
//! `v_half` and `v_min` can be compared with it at any size, not only at the sizes of
//! `shared/reference/zb`.
//!
//! The algorithm works on unit time slots, per rank ("stage" below, as in the paper):
//!
//! 1. **Building block.** Micro-batch `m`'s four ops on rank `r` (chunk 0's forward, chunk
//!    1's forward, chunk 1's backward, chunk 0's backward) sit at `6m` plus an offset per
//!    rank and kind ([`pattern`]): the stable pattern of V-Min or V-Half.
//! 2. **W placement** (`put_w`): walking the slots in order, each free slot takes one pending
//!    weight gradient (pending: its backward has run); the rest go after the last slot.
//! 3. **Squeeze** (`reorder`), twice: once with the W's in their slots, once without them
//!    (W's then take the free slots implicitly). Ops are visited in slot order; each moves to
//!    the earliest free slot after its inputs' slots whose rank then stays within the peak
//!    live activations the block had before the squeeze (F and f +1, W -1). From chunk 0's
//!    first backward on rank 0 until the last micro-batch's first forward, ops keep their
//!    slots (the steady state); in the second squeeze, ops before that also keep them.
//!    After each squeeze the slots are replaced by the start times of an eager run at unit
//!    op times.
//! 4. The W's are placed again (chunk 1's first at each free slot), and each rank's order is
//!    its ops sorted by slot. The order does not depend on the op times: the costs only
//!    change the timing, which [`crate::zb::makespan`] computes.
//!
//! Validated by `tests/tests/zb.rs` (`authors_generator_reimplemented_on_all_72_files`):
//! the per-rank orders are identical to every `vhalf_*` and `vmin_*` file of
//! `shared/reference/zb` (hence so are the makespans and peaks).

use schedc_ir::{Compute, Instr, Kind, Pipeline, PlacementKind, Program};

/// Which building block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// V-Half (about half of 1F1B's activation memory).
    Half,
    /// V-Min (about a third).
    Min,
}

/// Slots per rank: `lists[type][mb]`, types 0 `F` chunk 0, 1 `F` chunk 1, 2 `B` chunk 1,
/// 3 `B` chunk 0, then W lists (one merged list, or 4 chunk 1 and 5 chunk 0 when split).
type Stage = Vec<Vec<i64>>;

/// The stable pattern: per rank, the slots of micro-batch 0's four ops.
pub fn pattern(mode: Mode, p: usize) -> Vec<[i64; 4]> {
    let n = p as i64;
    (0..n)
        .map(|i| match mode {
            Mode::Min => {
                let gap = if p.is_multiple_of(3) { 2 } else { 0 };
                [i, 2 * n - i - 1, 2 * n + gap + i, 4 * n + gap - i - 1]
            }
            Mode::Half => {
                let gap = if p.is_multiple_of(2) { 3 } else { 0 };
                [
                    2 * i,
                    3 * n - i - 2,
                    3 * n + gap + 2 * i - 1,
                    6 * n + gap - i - 2,
                ]
            }
        })
        .collect()
}

fn bound(s: &Stage) -> i64 {
    s.iter()
        .filter_map(|l| l.last())
        .copied()
        .max()
        .unwrap_or(0)
}

/// Slot-indexed events of a rank: `ev[t]` = the type at slot `t`, or -1.
fn events(s: &Stage) -> Vec<i8> {
    let mut ev = vec![-1i8; bound(s) as usize + 1];
    for (t, l) in s.iter().enumerate() {
        for &x in l {
            debug_assert_eq!(ev[x as usize], -1, "two ops in one slot");
            ev[x as usize] = t as i8;
        }
    }
    ev
}

/// Places the weight gradients in free slots (one merged list, or split per chunk).
fn put_w(s: &mut Stage, split: bool) {
    assert_eq!(s.len(), 4);
    let ev = events(s);
    s.push(Vec::new());
    if split {
        s.push(Vec::new());
    }
    let mut cnt = [0usize; 2];
    for (i, &e) in ev.iter().enumerate() {
        if e >= 0 {
            if e == 2 || e == 3 {
                cnt[if split { e as usize - 2 } else { 0 }] += 1;
            }
        } else if let Some(w) = (0..2).find(|&w| cnt[w] > 0) {
            s[4 + w].push(i as i64);
            cnt[w] -= 1;
        }
    }
    let mut i = ev.len() as i64 - 1;
    for (w, c) in cnt.into_iter().enumerate() {
        for _ in 0..c {
            i += 1;
            s[4 + w].push(i);
        }
    }
}

/// Peak live activations of a rank (F +1; W -1, implicit in free slots without W lists).
fn mem(ev: &[i8], has_w: bool) -> i64 {
    const DELTA: [i64; 5] = [1, 1, 0, 0, -1];
    let (mut cur, mut res, mut w) = (0i64, 0i64, 0usize);
    for &e in ev {
        if e >= 0 {
            cur += DELTA[e as usize];
            if e == 2 || e == 3 {
                w += 1;
            }
        } else if !has_w && w > 0 {
            cur -= 1;
            w -= 1;
        }
        res = res.max(cur);
    }
    res
}

/// The ops of all ranks in the order the authors visit them: by (slot, rank, type, mb).
fn visit_order(sr: &[Stage]) -> Vec<(i64, usize, usize, usize)> {
    let mut v = Vec::new();
    for (st, s) in sr.iter().enumerate() {
        for (t, l) in s.iter().enumerate() {
            for (m, &x) in l.iter().enumerate() {
                v.push((x, st, t, m));
            }
        }
    }
    v.sort_unstable();
    v
}

/// Start times of an eager run at unit op times and free messages (the authors'
/// `eager_execution_time` with costs 1).
fn eager_unit(sr: &[Stage]) -> Vec<Stage> {
    let n = sr.len();
    let mut end: Vec<Stage> = sr
        .iter()
        .map(|s| s.iter().map(|l| vec![0; l.len()]).collect())
        .collect();
    let mut last: Vec<Option<i64>> = vec![None; n];
    for (_, st, t, m) in visit_order(sr) {
        let mut d = 0i64;
        if (t == 0 || t == 2) && st > 0 {
            d = d.max(end[st - 1][t][m]);
        }
        if (t == 1 || t == 3) && st + 1 < n {
            d = d.max(end[st + 1][t][m]);
        }
        if t > 0 && t < 4 {
            d = d.max(end[st][t - 1][m]);
        }
        if m > 0 {
            d = d.max(end[st][t][m - 1]);
        }
        if let Some(l) = last[st] {
            d = d.max(l);
        }
        end[st][t][m] = d + 1;
        last[st] = Some(d + 1);
    }
    for s in &mut end {
        for l in s {
            for x in l {
                *x -= 1;
            }
        }
    }
    end
}

/// The squeeze.
fn reorder(mut sr: Vec<Stage>, consider_w: bool) -> Vec<Stage> {
    if consider_w {
        for s in &mut sr {
            put_w(s, false);
        }
    }
    let cap = sr
        .iter()
        .map(|s| mem(&events(s), consider_w))
        .max()
        .unwrap();
    let n = sr.len();
    let last_mb = sr[0][0].len() - 1;
    let mut occupied: Vec<Vec<bool>> = sr
        .iter()
        .map(|s| vec![false; bound(s) as usize + 1])
        .collect();
    // Slot events per rank, kept in step with `sr`.
    let mut ev: Vec<Vec<i8>> = sr.iter().map(events).collect();
    let mut phase = 0;
    for (next_time, st, t, m) in visit_order(&sr) {
        if t == 3 && st == 0 && phase == 0 {
            phase = 1;
        }
        let fixed = if phase == 1 {
            if t == 0 && m == last_mb {
                phase = 2;
            }
            true
        } else {
            phase == 0 && !consider_w
        };
        if fixed {
            occupied[st][next_time as usize] = true;
            continue;
        }
        let mut d = -1i64;
        if (t == 0 || t == 2) && st > 0 {
            d = d.max(sr[st - 1][t][m]);
        }
        if (t == 1 || t == 3) && st + 1 < n {
            d = d.max(sr[st + 1][t][m]);
        }
        if t > 0 && t < 4 {
            d = d.max(sr[st][t - 1][m]);
        }
        if t == 4 {
            let mut b: Vec<i64> = sr[st][2].iter().chain(&sr[st][3]).copied().collect();
            b.sort_unstable();
            d = d.max(b[m]);
        }
        if m > 0 {
            d = d.max(sr[st][t][m - 1]);
        }
        d += 1;
        assert!(d <= next_time, "an input after its op");
        let mut at = next_time;
        ev[st][next_time as usize] = -1;
        for pt in d..next_time {
            if occupied[st][pt as usize] {
                continue;
            }
            ev[st][pt as usize] = t as i8;
            if mem(&ev[st], consider_w) <= cap {
                at = pt;
                break;
            }
            ev[st][pt as usize] = -1;
        }
        ev[st][at as usize] = t as i8;
        sr[st][t][m] = at;
        occupied[st][at as usize] = true;
    }
    if !consider_w {
        for s in &mut sr {
            put_w(s, false);
        }
    }
    eager_unit(&sr)
}

/// The authors' per-rank orders for `p` ranks and `m` micro-batches (V placement, 2
/// chunks, split backwards), as a schedc program. Independent of op times.
pub fn program(mode: Mode, p: u32, m: u32) -> Program {
    let pat = pattern(mode, p as usize);
    let sr: Vec<Stage> = pat
        .iter()
        .map(|x| {
            x.iter()
                .map(|&o| (0..m as i64).map(|k| o + 6 * k).collect())
                .collect()
        })
        .collect();
    let r1: Vec<Stage> = reorder(sr, true)
        .into_iter()
        .map(|mut s| {
            s.truncate(4);
            s
        })
        .collect();
    let r2 = reorder(r1, false);
    let pipeline = Pipeline::new(p, 2 * p, m, PlacementKind::V).expect("a V pipeline");
    let ranks = r2
        .into_iter()
        .enumerate()
        .map(|(r, mut s)| {
            s.truncate(4);
            put_w(&mut s, true);
            let r = r as u32;
            let (c0, c1) = (r, 2 * p - 1 - r);
            let mut ops: Vec<(i64, Compute)> = Vec::new();
            for (t, l) in s.iter().enumerate() {
                let (kind, stage) = match t {
                    0 => (Kind::F, c0),
                    1 => (Kind::F, c1),
                    2 => (Kind::B, c1),
                    3 => (Kind::B, c0),
                    4 => (Kind::W, c1),
                    _ => (Kind::W, c0),
                };
                for (mb, &x) in l.iter().enumerate() {
                    ops.push((x, Compute::new(kind, stage, mb as u32)));
                }
            }
            ops.sort_by_key(|(x, _)| *x);
            ops.into_iter().map(|(_, c)| Instr::Compute(c)).collect()
        })
        .collect();
    Program { pipeline, ranks }
}

/// The sweep grid's cost sets, as (name, [F, B, W, comm]): the three of
/// `shared/reference/zb` (`unit`, `profA`, `profB`) and others of the same kind (B/F from 1
/// to 2, W/F from 0.5 to 1, message latency up to 0.1 F).
pub const COSTS: [(&str, [f64; 4]); 9] = [
    ("unit", [1.0, 1.0, 1.0, 0.0]),
    ("profA", [1.0, 1.1, 0.9, 0.05]),
    ("profB", [1.0, 2.0, 1.0, 0.0]),
    ("b15w75", [1.0, 1.5, 0.75, 0.0]),
    ("b2w5c05", [1.0, 2.0, 0.5, 0.05]),
    ("b1w5c1", [1.0, 1.0, 0.5, 0.1]),
    ("b2w1c1", [1.0, 2.0, 1.0, 0.1]),
    ("b12w8c02", [1.0, 1.2, 0.8, 0.02]),
    ("b18w6", [1.0, 1.8, 0.6, 0.0]),
];

/// One point of the sweep: schedc's family against the authors' generator.
#[derive(Clone, Debug)]
pub struct Point {
    /// Ranks, micro-batches, cost set name.
    pub p: u32,
    /// Micro-batches.
    pub m: u32,
    /// Cost set name.
    pub cost: &'static str,
    /// Makespan from t0 (the README's model, [`crate::zb::makespan`]): ours, the authors'.
    pub makespan: (f64, f64),
    /// Peak live activations over the ranks (chunk units): ours, the authors'.
    pub peak: (u64, u64),
}

impl Point {
    /// Ours / the authors' makespan.
    pub fn makespan_ratio(&self) -> f64 {
        self.makespan.0 / self.makespan.1
    }
    /// Ours / the authors' peak.
    pub fn peak_ratio(&self) -> f64 {
        self.peak.0 as f64 / self.peak.1 as f64
    }
}

/// Compares `spec` (the text of `specs/v_half.sched` or `specs/v_min.sched`) with the
/// authors' generator in `mode` at every P in `ps`, every M in `ms(P)`, and every cost set
/// of `costs`. The authors' orders do not depend on the costs, so they are built
/// once per (P, M).
pub fn sweep(
    spec: &str,
    mode: Mode,
    ps: impl IntoIterator<Item = u32>,
    ms: &dyn Fn(u32) -> Vec<u32>,
    costs: &[(&'static str, [f64; 4])],
) -> Vec<Point> {
    use schedc::input::{load_spec_with, Overrides};
    let mut out = Vec::new();
    for p in ps {
        for m in ms(p) {
            let theirs = program(mode, p, m);
            let tpk = crate::zb::peaks(&theirs).into_iter().max().unwrap();
            for &(name, c) in costs {
                let ov = Overrides {
                    pp: Some(p),
                    microbatches: Some(m),
                    ..Default::default()
                };
                let e = load_spec_with(spec, &ov, &crate::zb::cost_model(c))
                    .unwrap_or_else(|e| panic!("P{p} M{m} {name}: {e:?}"));
                let ours = crate::zb::makespan(&e.program, c).expect("our orders run");
                let tm = crate::zb::makespan(&theirs, c).expect("their orders run");
                let pk = crate::zb::peaks(&e.program).into_iter().max().unwrap();
                out.push(Point {
                    p,
                    m,
                    cost: name,
                    makespan: (ours, tm),
                    peak: (pk, tpk),
                });
            }
        }
    }
    out
}
