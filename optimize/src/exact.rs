//! Branch and bound: the optimal makespan of a small instance, and a proof.
//!
//! **What is enumerated.** A schedule is a token sequence per rank ([`crate::sched`]: the
//! k-th op of a kind on a stage is micro-batch k, which loses nothing) run as early as
//! possible (semi-active: each op starts when its rank is free and its inputs have
//! arrived); every schedule worth having is one of these. Each is built exactly once by
//! placing ops in order of (start time, rank): a node extends the partial schedule by one
//! op whose start, on its rank after the ops already placed there, is no earlier than the
//! last op placed (a later rank on ties). Any semi-active schedule sorted by (start, rank)
//! is such a sequence of extensions, because an op starts after every op it depends on and
//! after the op before it on its rank (durations are positive).
//!
//! **Bounds.** At a node every op still to place starts no earlier than the last op placed,
//! so (1) each rank needs its remaining work after `max(its clock, last start)`; (2) every
//! op still to place has an earliest start (its inputs' earliest arrivals, the ops of its
//! kind before it on its stage) and a tail (the chain of ops that must follow it: the rest
//! of the forward, the whole backward back to the first stage, its weight gradient). A node
//! whose bound is no better than the best schedule known is cut. (3) With a cap, the j-th
//! forward a rank runs beyond its free memory starts no earlier than the end of its j-th
//! release (`W` or `BW`) to come, bounded below from the backwards' earliest starts; the
//! earliest starts are recomputed with this (twice). (4) Each rank is one machine whose
//! remaining ops have heads (earliest starts) and tails: Jackson's preemptive schedule is the
//! optimum of that relaxation (Carlier, EJOR 1982). (5) At the root, each rank alone as a
//! single machine with its cap, the other ranks' ops as plain delays, solved exactly
//! ([`crate::rank_bound`]): its optimum bounds every schedule, so when it reaches the
//! incumbent nothing is expanded, and otherwise a schedule that meets it ends the search. A node's children are explored in order of
//! their bounds. States met twice (same
//! counts, clocks, memory, pending messages and last placement) are explored once.
//!
//! **Scope.** Every op whole (no MoE parts) and no overlapped pairs; a fused backward is
//! an alternative only when the cost model makes `BW` faster than `B + W` (otherwise
//! splitting never hurts, [`Instance::split_dominates`]).

use crate::instance::Instance;
use crate::local::EPS;
use crate::rank_bound::{best_rank_bound, NodeRelax, RankBound};
use crate::sched::{Sched, Tok};
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::time::Instant;

/// The result of branch and bound.
#[derive(Clone, Debug)]
pub struct ExactResult {
    /// The best schedule found (the incumbent given if none was better).
    pub best: Option<Sched>,
    /// Its makespan, seconds.
    pub makespan: f64,
    /// True if the search finished: `makespan` is the optimum.
    pub proved: bool,
    /// Nodes expanded.
    pub nodes: u64,
    /// Complete schedules reached (leaves of the tree).
    pub leaves: u64,
    /// Nodes whose bound exceeded the best completion below them (with
    /// [`SolveOptions::audit`]; always 0 for a sound bound).
    pub bound_violations: u64,
    /// The one-rank relaxation run at the root ([`crate::rank_bound`]), when it ended: its
    /// bound holds for every schedule. When it reaches the incumbent the search proves it
    /// optimal without expanding a node; otherwise it ends the search as soon as a
    /// schedule meets it.
    pub relaxation: Option<RankBound>,
    /// Nodes cut by the one-rank relaxation at nodes.
    pub relax_cuts: u64,
    /// Nodes the one-rank relaxations at nodes expanded in all.
    pub relax_nodes: u64,
}

/// Switches and limits of branch and bound (the defaults are what [`solve`] uses; tests
/// turn the cuts off one by one).
#[derive(Clone, Copy, Debug)]
pub struct SolveOptions {
    /// Cut nodes whose lower bound is no better than the best known.
    pub bound: bool,
    /// Explore states met twice once.
    pub table: bool,
    /// In the bound, hold back forwards that need memory a release must free first.
    pub memory: bool,
    /// In the bound, each rank's Jackson preemptive schedule (heads and tails).
    pub jackson: bool,
    /// Explore a node's children in order of their bounds (best first).
    pub order: bool,
    /// Keep going after the first optimum-length schedule (to count every leaf).
    pub all: bool,
    /// Nodes to expand at most.
    pub max_nodes: u64,
    /// Wall-clock deadline.
    pub deadline: Option<Instant>,
    /// Check the bound at every node against the best completion found below it (needs
    /// `all` and no table: then the subtree's best is its optimum); violations are counted
    /// in [`ExactResult::bound_violations`].
    pub audit: bool,
    /// Node budget of the one-rank relaxation ([`crate::rank_bound`]) per rank at the root
    /// (0: not run). It runs only with `bound` on and `all` off.
    pub relax_nodes: u64,
    /// Node budget of the same relaxation at every node, from the node's heads (0: not
    /// run; a rank whose search runs out adds nothing). Only with `bound` on, `all` off and
    /// every backward split (or with `audit`). Off by default: it cuts nodes (P = 3, M = 5,
    /// unit, V, cap 3: 18,929 nodes against 94,644) but costs more time than it saves there.
    pub node_relax_nodes: u64,
}

impl Default for SolveOptions {
    fn default() -> Self {
        SolveOptions {
            bound: true,
            table: true,
            memory: true,
            jackson: true,
            order: true,
            all: false,
            max_nodes: 2_000_000,
            deadline: None,
            audit: false,
            relax_nodes: 500_000,
            node_relax_nodes: 0,
        }
    }
}

/// Why the exact search does not apply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExactError {
    /// Overlapped pairs would help (not enumerated).
    #[error(
        "the cost model makes overlapped pairs faster; branch and bound does not enumerate pairs"
    )]
    Pairs,
}

struct Bnb<'a> {
    inst: &'a Instance,
    m: usize,
    fuse: bool,
    act_cross: Vec<bool>,
    grad_cross: Vec<bool>,
    fc: Vec<u32>,
    bic: Vec<u32>,
    wc: Vec<u32>,
    splitc: Vec<u32>,
    clock: Vec<f64>,
    live: Vec<i64>,
    arr_a: Vec<f64>,
    arr_g: Vec<f64>,
    last_a: Vec<f64>,
    last_g: Vec<f64>,
    seq: Vec<Vec<Tok>>,
    remaining: usize,
    best: f64,
    best_seq: Option<Sched>,
    nodes: u64,
    max_nodes: u64,
    deadline: Option<Instant>,
    aborted: bool,
    /// A bound on every schedule (the root relaxation's); a schedule meeting it ends the
    /// search, proved.
    global_lb: f64,
    /// The search ended early because a schedule met `global_lb`.
    met: bool,
    seen: HashSet<u64>,
    leaves: u64,
    bound_violations: u64,
    opts: SolveOptions,
    // Static tails.
    tail_f: Vec<f64>,
    tail_b: Vec<f64>,
    // Scratch for bounds.
    est_f: Vec<f64>,
    est_b: Vec<f64>,
    /// Per rank, lower bounds on the ends of its coming releases.
    rel: Vec<Vec<f64>>,
    /// Per stage, the stages of the same rank before it in its direction.
    earlier: Vec<Vec<u32>>,
    jobs: Vec<(f64, f64, f64)>,
    /// Per rank, the one-rank relaxation at nodes (empty when off).
    relax: Vec<NodeRelax>,
    relax_cnt: Vec<usize>,
    relax_h: Vec<f64>,
    /// Nodes cut by the one-rank relaxation, and its nodes in all.
    pub relax_cuts: u64,
    relax_work: u64,
}

#[derive(Clone, Copy)]
struct Undo {
    r: usize,
    clock: f64,
    live: i64,
    last: f64,
    link: Option<(bool, usize)>,
}

impl<'a> Bnb<'a> {
    fn new(inst: &'a Instance, fuse: bool) -> Self {
        let (s, m, p) = (inst.s, inst.m, inst.p);
        let act_cross: Vec<bool> = (0..s)
            .map(|x| inst.next[x].is_some_and(|n| inst.rank_of[n as usize] != inst.rank_of[x]))
            .collect();
        let grad_cross: Vec<bool> = (0..s)
            .map(|x| inst.prev[x].is_some_and(|n| inst.rank_of[n as usize] != inst.rank_of[x]))
            .collect();
        let bmin = |x: usize| inst.d_b[x].min(if fuse { inst.d_bw[x] } else { f64::INFINITY });
        // tail_b[s]: after the input-gradient backward of (s, k) ends.
        let mut tail_b = vec![0.0; s];
        for x in 0..s {
            let own_w = if fuse { 0.0 } else { inst.d_w[x] };
            tail_b[x] = own_w;
            if let Some(pv) = inst.prev[x] {
                let pv = pv as usize;
                let lat = if grad_cross[x] { inst.lat } else { 0.0 };
                tail_b[x] = tail_b[x].max(lat + bmin(pv) + tail_b[pv]);
            }
        }
        let mut tail_f = vec![0.0; s];
        for x in (0..s).rev() {
            tail_f[x] = match inst.next[x] {
                None => bmin(x) + tail_b[x],
                Some(n) => {
                    let n = n as usize;
                    let lat = if act_cross[x] { inst.lat } else { 0.0 };
                    lat + inst.d_f[n] + tail_f[n]
                }
            };
        }
        Bnb {
            inst,
            m,
            fuse,
            act_cross,
            grad_cross,
            fc: vec![0; s],
            bic: vec![0; s],
            wc: vec![0; s],
            splitc: vec![0; s],
            clock: vec![0.0; p],
            live: vec![0; p],
            arr_a: vec![f64::NAN; s * m],
            arr_g: vec![f64::NAN; s * m],
            last_a: vec![0.0; s],
            last_g: vec![0.0; s],
            seq: vec![Vec::new(); p],
            remaining: 0,
            best: f64::INFINITY,
            best_seq: None,
            nodes: 0,
            max_nodes: u64::MAX,
            deadline: None,
            aborted: false,
            global_lb: f64::NEG_INFINITY,
            met: false,
            seen: HashSet::new(),
            leaves: 0,
            bound_violations: 0,
            opts: SolveOptions::default(),
            tail_f,
            tail_b,
            est_f: vec![0.0; s * m],
            est_b: vec![0.0; s * m],
            rel: vec![Vec::new(); p],
            earlier: (0..s)
                .map(|x| {
                    let mut v = Vec::new();
                    let mut c = inst.prev[x];
                    while let Some(y) = c {
                        if inst.rank_of[y as usize] == inst.rank_of[x] {
                            v.push(y);
                        }
                        c = inst.prev[y as usize];
                    }
                    v
                })
                .collect(),
            jobs: Vec::new(),
            relax: Vec::new(),
            relax_cnt: Vec::new(),
            relax_h: Vec::new(),
            relax_cuts: 0,
            relax_work: 0,
        }
    }

    /// The one-rank relaxation of every rank from this node (the last rank first), stopping
    /// at the first that reaches the best known; the largest bound found.
    fn node_relax(&mut self, t_last: f64) -> f64 {
        let inst = self.inst;
        let m = self.m;
        self.bound(t_last);
        let mut lb = f64::NEG_INFINITY;
        for r in (0..inst.p).rev() {
            let b0 = self.clock[r].max(t_last);
            let nk = self.relax[r].stages.len() * 3;
            self.relax_cnt.clear();
            self.relax_h.clear();
            self.relax_h.resize(nk * m, f64::NEG_INFINITY);
            for (i, &s) in self.relax[r].stages.iter().enumerate() {
                let s = s as usize;
                self.relax_cnt.push(self.fc[s] as usize);
                self.relax_cnt.push(self.bic[s] as usize);
                self.relax_cnt.push(self.wc[s] as usize);
                for k in self.fc[s] as usize..m {
                    self.relax_h[3 * i * m + k] = self.est_f[s * m + k];
                }
                for k in self.bic[s] as usize..m {
                    self.relax_h[(3 * i + 1) * m + k] = self.est_b[s * m + k];
                    self.relax_h[(3 * i + 2) * m + k] = self.est_b[s * m + k] + inst.d_b[s];
                }
                for k in self.wc[s] as usize..self.splitc[s] as usize {
                    self.relax_h[(3 * i + 2) * m + k] = b0;
                }
            }
            let got = self.relax[r].solve(
                &self.relax_cnt,
                &self.relax_h,
                b0,
                self.live[r],
                self.best,
                self.opts.node_relax_nodes,
            );
            self.relax_work += self.relax[r].nodes();
            if let Some(v) = got {
                lb = lb.max(v);
                if v >= self.best - EPS {
                    break;
                }
            }
        }
        lb
    }

    fn ready_f(&self, s: usize) -> Option<f64> {
        let inst = self.inst;
        let k = self.fc[s] as usize;
        if k >= self.m {
            return None;
        }
        match inst.prev[s] {
            None => Some(0.0),
            Some(ps) => {
                let ps = ps as usize;
                if self.fc[ps] as usize > k {
                    Some(if self.act_cross[ps] {
                        self.arr_a[ps * self.m + k]
                    } else {
                        0.0
                    })
                } else {
                    None
                }
            }
        }
    }

    fn ready_b(&self, s: usize) -> Option<f64> {
        let inst = self.inst;
        let k = self.bic[s] as usize;
        if k >= self.m {
            return None;
        }
        match inst.next[s] {
            None => (self.fc[s] as usize > k).then_some(0.0),
            Some(ns) => {
                let ns = ns as usize;
                if self.bic[ns] as usize > k {
                    Some(if self.grad_cross[ns] {
                        self.arr_g[ns * self.m + k]
                    } else {
                        0.0
                    })
                } else {
                    None
                }
            }
        }
    }

    fn apply(&mut self, r: usize, t: Tok, start: f64) -> Undo {
        let inst = self.inst;
        let mut u = Undo {
            r,
            clock: self.clock[r],
            live: self.live[r],
            last: 0.0,
            link: None,
        };
        let end = start + t.time(inst);
        self.clock[r] = end;
        match t {
            Tok::F(s) => {
                let s = s as usize;
                let k = self.fc[s] as usize;
                self.fc[s] += 1;
                self.live[r] += 1;
                if self.act_cross[s] {
                    u.last = self.last_a[s];
                    u.link = Some((true, s));
                    let a = end.max(self.last_a[s]) + inst.lat;
                    self.last_a[s] = a;
                    self.arr_a[s * self.m + k] = a;
                }
            }
            Tok::B(s) | Tok::BW(s) => {
                let s = s as usize;
                let k = self.bic[s] as usize;
                self.bic[s] += 1;
                if matches!(t, Tok::BW(_)) {
                    self.live[r] -= 1;
                } else {
                    self.splitc[s] += 1;
                }
                if self.grad_cross[s] {
                    u.last = self.last_g[s];
                    u.link = Some((false, s));
                    let a = end.max(self.last_g[s]) + inst.lat;
                    self.last_g[s] = a;
                    self.arr_g[s * self.m + k] = a;
                }
            }
            Tok::W(s) => {
                self.wc[s as usize] += 1;
                self.live[r] -= 1;
            }
            Tok::Pair { .. } => unreachable!("pairs are not enumerated"),
        }
        self.seq[r].push(t);
        self.remaining -= if matches!(t, Tok::BW(_)) { 2 } else { 1 };
        u
    }

    fn undo(&mut self, t: Tok, u: Undo) {
        let r = u.r;
        self.clock[r] = u.clock;
        self.live[r] = u.live;
        match t {
            Tok::F(s) => {
                let s = s as usize;
                self.fc[s] -= 1;
                if let Some((_, s2)) = u.link {
                    self.last_a[s2] = u.last;
                    self.arr_a[s * self.m + self.fc[s] as usize] = f64::NAN;
                }
            }
            Tok::B(s) | Tok::BW(s) => {
                let s = s as usize;
                self.bic[s] -= 1;
                if matches!(t, Tok::B(_)) {
                    self.splitc[s] -= 1;
                }
                if let Some((_, s2)) = u.link {
                    self.last_g[s2] = u.last;
                    self.arr_g[s * self.m + self.bic[s] as usize] = f64::NAN;
                }
            }
            Tok::W(s) => self.wc[s as usize] -= 1,
            Tok::Pair { .. } => unreachable!(),
        }
        self.seq[r].pop();
        self.remaining += if matches!(t, Tok::BW(_)) { 2 } else { 1 };
    }

    /// Earliest starts of the forwards still to place, stage by stage along each direction
    /// (stage ids increase along a direction). With `rel`, the j-th forward a rank still
    /// has to run beyond its free memory also waits for its j-th release (`rel[r][j]`).
    fn pass_f(&mut self, t_last: f64, rel: bool) {
        let inst = self.inst;
        let m = self.m;
        let cap = inst.cap.min(i64::MAX as u64) as i64;
        for s in 0..inst.s {
            let r = inst.rank_of[s] as usize;
            let b0 = self.clock[r].max(t_last);
            let free = (cap - self.live[r]).max(0) as usize;
            let mut prev_end = f64::NEG_INFINITY;
            for k in self.fc[s] as usize..m {
                let mut e = b0.max(prev_end);
                if let Some(ps) = inst.prev[s] {
                    let ps = ps as usize;
                    if (self.fc[ps] as usize) > k {
                        if self.act_cross[ps] {
                            e = e.max(self.arr_a[ps * m + k]);
                        }
                    } else {
                        let lat = if self.act_cross[ps] { inst.lat } else { 0.0 };
                        e = e.max(self.est_f[ps * m + k] + inst.d_f[ps] + lat);
                    }
                }
                if rel {
                    // Forwards of this rank that must run before F(s, k): the earlier ones
                    // of s, and micro-batches 0..=k of the rank's earlier stages of the
                    // direction.
                    let mut idx = k - self.fc[s] as usize;
                    for &e2 in &self.earlier[s] {
                        idx += (k + 1).saturating_sub(self.fc[e2 as usize] as usize);
                    }
                    if idx >= free {
                        if let Some(&t) = self.rel[r].get(idx - free) {
                            e = e.max(t);
                        }
                    }
                }
                self.est_f[s * m + k] = e;
                prev_end = e + inst.d_f[s];
            }
        }
    }

    /// Earliest starts of the backwards still to place (from the last stage back).
    fn pass_b(&mut self, t_last: f64) {
        let inst = self.inst;
        let m = self.m;
        for s in (0..inst.s).rev() {
            let r = inst.rank_of[s] as usize;
            let b0 = self.clock[r].max(t_last);
            let db = self.db_min(s);
            let mut prev_end = f64::NEG_INFINITY;
            for k in self.bic[s] as usize..m {
                let mut e = b0.max(prev_end);
                match inst.next[s] {
                    None => {
                        if (self.fc[s] as usize) <= k {
                            e = e.max(self.est_f[s * m + k] + inst.d_f[s]);
                        }
                    }
                    Some(ns) => {
                        let ns = ns as usize;
                        if (self.bic[ns] as usize) > k {
                            if self.grad_cross[ns] {
                                e = e.max(self.arr_g[ns * m + k]);
                            }
                        } else {
                            let lat = if self.grad_cross[ns] { inst.lat } else { 0.0 };
                            e = e.max(self.est_b[ns * m + k] + self.db_min(ns) + lat);
                        }
                    }
                }
                self.est_b[s * m + k] = e;
                prev_end = e + db;
            }
        }
    }

    /// The quickest input-gradient op of a stage (`B`, or `BW` when fusing is allowed).
    fn db_min(&self, s: usize) -> f64 {
        if self.fuse {
            self.inst.d_b[s].min(self.inst.d_bw[s])
        } else {
            self.inst.d_b[s]
        }
    }

    /// Per rank, lower bounds on the end of its j-th release (`W` or `BW`) from now, sorted
    /// and spaced by the quickest release (they run one after another). Returns true if
    /// some rank has more forwards to run than free memory.
    fn releases(&mut self, t_last: f64) -> bool {
        let inst = self.inst;
        let m = self.m;
        let cap = inst.cap.min(i64::MAX as u64) as i64;
        let mut binds = false;
        for r in 0..inst.p {
            let b0 = self.clock[r].max(t_last);
            let mut v = std::mem::take(&mut self.rel[r]);
            v.clear();
            let mut n_f = 0i64;
            let mut dmin = f64::INFINITY;
            for &s in &inst.stages_of[r] {
                let s = s as usize;
                n_f += (m - self.fc[s] as usize) as i64;
                let whole = if self.fuse {
                    (inst.d_b[s] + inst.d_w[s]).min(inst.d_bw[s])
                } else {
                    inst.d_b[s] + inst.d_w[s]
                };
                let rd = if self.fuse {
                    inst.d_w[s].min(inst.d_bw[s])
                } else {
                    inst.d_w[s]
                };
                dmin = dmin.min(rd);
                for _ in self.wc[s]..self.splitc[s] {
                    v.push(b0 + inst.d_w[s]);
                }
                for k in self.bic[s] as usize..m {
                    v.push(self.est_b[s * m + k] + whole);
                }
            }
            if n_f > cap - self.live[r] {
                binds = true;
            }
            v.sort_by(f64::total_cmp);
            for j in 1..v.len() {
                v[j] = v[j].max(v[j - 1] + dmin);
            }
            self.rel[r] = v;
        }
        binds
    }

    /// A lower bound on any completion; every op left starts no earlier than `t_last`.
    fn bound(&mut self, t_last: f64) -> f64 {
        let inst = self.inst;
        let m = self.m;
        let base = |r: usize, clock: &[f64]| clock[r].max(t_last);
        let mut lb: f64 = 0.0;
        // Per-rank work.
        for r in 0..inst.p {
            let mut work = 0.0;
            for &s in &inst.stages_of[r] {
                let s = s as usize;
                let left_b = (m - self.bic[s] as usize) as f64;
                let bw = if self.fuse {
                    (inst.d_b[s] + inst.d_w[s]).min(inst.d_bw[s])
                } else {
                    inst.d_b[s] + inst.d_w[s]
                };
                work += (m - self.fc[s] as usize) as f64 * inst.d_f[s]
                    + left_b * bw
                    + (self.splitc[s] - self.wc[s]) as f64 * inst.d_w[s];
            }
            if work > 0.0 {
                lb = lb.max(base(r, &self.clock) + work);
            } else {
                lb = lb.max(self.clock[r]);
            }
        }
        // Earliest starts, then (with a cap that binds) forwards held back by memory.
        self.pass_f(t_last, false);
        self.pass_b(t_last);
        if self.opts.memory && inst.cap != u64::MAX {
            for _ in 0..2 {
                if !self.releases(t_last) {
                    break;
                }
                self.pass_f(t_last, true);
                self.pass_b(t_last);
            }
        }
        // Earliest start plus tail of every op, and each rank as one machine.
        let mut jobs = std::mem::take(&mut self.jobs);
        for r in 0..inst.p {
            jobs.clear();
            let b0 = base(r, &self.clock);
            for &s in &inst.stages_of[r] {
                let s = s as usize;
                for k in self.fc[s] as usize..m {
                    let e = self.est_f[s * m + k];
                    lb = lb.max(e + inst.d_f[s] + self.tail_f[s]);
                    jobs.push((e, inst.d_f[s], self.tail_f[s]));
                }
                let db = self.db_min(s);
                for k in self.bic[s] as usize..m {
                    let e = self.est_b[s * m + k];
                    lb = lb.max(e + db + self.tail_b[s]);
                    jobs.push((e, db, self.tail_b[s]));
                    if !self.fuse {
                        jobs.push((e + db, inst.d_w[s], 0.0));
                    }
                }
                for _ in self.wc[s]..self.splitc[s] {
                    jobs.push((b0, inst.d_w[s], 0.0));
                }
            }
            if self.opts.jackson && !jobs.is_empty() {
                lb = lb.max(crate::rank_bound::jackson(&mut jobs));
            }
        }
        self.jobs = jobs;
        // The root relaxation's floor (`global_lb`) is below the best known whenever a node
        // is expanded, so it would cut nothing here; it is left out so that the children's
        // order (best bound first) keeps its information.
        lb
    }

    fn state_hash(&self, t_last: f64, r_last: usize) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.fc.hash(&mut h);
        self.bic.hash(&mut h);
        self.wc.hash(&mut h);
        self.splitc.hash(&mut h);
        for c in &self.clock {
            c.to_bits().hash(&mut h);
        }
        self.live.hash(&mut h);
        // Pending messages: produced, not yet consumed.
        let m = self.m;
        for s in 0..self.inst.s {
            if self.act_cross[s] {
                let n = self.inst.next[s].unwrap() as usize;
                for k in self.fc[n] as usize..self.fc[s] as usize {
                    self.arr_a[s * m + k].to_bits().hash(&mut h);
                }
            }
            if self.grad_cross[s] {
                let n = self.inst.prev[s].unwrap() as usize;
                for k in self.bic[n] as usize..self.bic[s] as usize {
                    self.arr_g[s * m + k].to_bits().hash(&mut h);
                }
            }
        }
        t_last.to_bits().hash(&mut h);
        r_last.hash(&mut h);
        h.finish()
    }

    /// Returns the best makespan of a complete schedule reached below this node (infinite
    /// if none).
    fn dfs(&mut self, t_last: f64, r_last: usize, checked: bool) -> f64 {
        if self.aborted {
            return f64::INFINITY;
        }
        self.nodes += 1;
        if self.nodes > self.max_nodes
            || (self.nodes.is_multiple_of(4096)
                && self.deadline.is_some_and(|d| Instant::now() >= d))
        {
            self.aborted = true;
            return f64::INFINITY;
        }
        if self.remaining == 0 {
            self.leaves += 1;
            let mk = self.clock.iter().copied().fold(0.0, f64::max);
            if mk < self.best - EPS {
                self.best = mk;
                self.best_seq = Some(Sched {
                    ranks: self.seq.clone(),
                });
                if mk <= self.global_lb + EPS && !self.opts.all {
                    // Nothing is shorter: stop, proved.
                    self.met = true;
                    self.aborted = true;
                }
            }
            return mk;
        }
        if !checked && self.opts.bound && !self.opts.all && self.bound(t_last) >= self.best - EPS {
            return f64::INFINITY;
        }
        let audit = self.opts.audit.then(|| {
            let b = self.bound(t_last);
            if self.relax.is_empty() {
                b
            } else {
                b.max(self.node_relax(t_last))
            }
        });
        if self.opts.table
            && self.seen.len() < 8_000_000
            && !self.seen.insert(self.state_hash(t_last, r_last))
        {
            return f64::INFINITY;
        }
        if !self.relax.is_empty() && !self.opts.all && self.node_relax(t_last) >= self.best - EPS {
            self.relax_cuts += 1;
            return f64::INFINITY;
        }
        let inst = self.inst;
        let cap = inst.cap.min(i64::MAX as u64) as i64;
        let mut cands: Vec<(f64, u8, usize, Tok)> = Vec::new();
        for r in 0..inst.p {
            for &s in &inst.stages_of[r] {
                let su = s as usize;
                if let Some(a) = self.ready_b(su) {
                    let st = self.clock[r].max(a);
                    cands.push((st, 0, r, Tok::B(s)));
                    if self.fuse {
                        cands.push((st, 1, r, Tok::BW(s)));
                    }
                }
                if self.live[r] < cap {
                    if let Some(a) = self.ready_f(su) {
                        cands.push((self.clock[r].max(a), 2, r, Tok::F(s)));
                    }
                }
                if self.splitc[su] > self.wc[su] {
                    cands.push((self.clock[r], 3, r, Tok::W(s)));
                }
            }
        }
        cands.retain(|&(st, _, r, _)| {
            st > t_last + EPS || ((st - t_last).abs() <= EPS && r > r_last)
        });
        cands.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        // Children in order of their bounds (ties: the order above), each bound computed
        // once here; a child whose bound is no better than the best known is cut.
        let ordered = self.opts.order && self.opts.bound && !self.opts.all;
        let mut kids: Vec<(f64, f64, usize, Tok)> = Vec::with_capacity(cands.len());
        for (st, _, r, t) in cands {
            let lbc = if ordered {
                let u = self.apply(r, t, st);
                let b = self.bound(st);
                self.undo(t, u);
                b
            } else {
                f64::NEG_INFINITY
            };
            kids.push((lbc, st, r, t));
        }
        if ordered {
            kids.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        let mut below = f64::INFINITY;
        for (lbc, st, r, t) in kids {
            if ordered && lbc >= self.best - EPS {
                break;
            }
            let u = self.apply(r, t, st);
            below = below.min(self.dfs(st, r, ordered));
            self.undo(t, u);
            if self.aborted {
                return below;
            }
        }
        if audit.is_some_and(|lb| lb > below + EPS) {
            self.bound_violations += 1;
        }
        below
    }
}

/// Searches for the optimum from the incumbent `incumbent` (its makespan cuts the tree;
/// `None`: no schedule known). Stops after `max_nodes` nodes or at `deadline` (then
/// `proved` is false).
///
/// Errors: [`ExactError::Pairs`] when overlapped pairs would help.
pub fn solve(
    inst: &Instance,
    incumbent: Option<(&Sched, f64)>,
    max_nodes: u64,
    deadline: Option<Instant>,
) -> Result<ExactResult, ExactError> {
    solve_with(
        inst,
        incumbent,
        SolveOptions {
            max_nodes,
            deadline,
            ..SolveOptions::default()
        },
    )
}

/// [`solve`] with every switch.
///
/// Errors: [`ExactError::Pairs`].
pub fn solve_with(
    inst: &Instance,
    incumbent: Option<(&Sched, f64)>,
    opts: SolveOptions,
) -> Result<ExactResult, ExactError> {
    if inst.pairs_help() {
        return Err(ExactError::Pairs);
    }
    let fuse = !inst.split_dominates();
    let mut b = Bnb::new(inst, fuse);
    // Work units: F, B and W one each, a fused BW two.
    b.remaining = inst.s * inst.m * 3;
    b.max_nodes = opts.max_nodes;
    b.deadline = opts.deadline;
    b.opts = opts;
    if let Some((_, mk)) = incumbent {
        // Look for strictly better schedules only.
        b.best = mk;
    }
    let relaxation = if opts.relax_nodes > 0 && opts.bound && !opts.all {
        best_rank_bound(inst, b.best, opts.relax_nodes, opts.deadline)
    } else {
        None
    };
    if let Some(rb) = relaxation {
        b.global_lb = rb.bound;
    }
    if opts.node_relax_nodes > 0 && !fuse && (opts.audit || (opts.bound && !opts.all)) {
        b.relax = (0..inst.p).map(|r| NodeRelax::new(inst, r)).collect();
    }
    if b.global_lb < b.best - EPS {
        b.dfs(f64::NEG_INFINITY, 0, false);
    }
    let found = b.best_seq.take();
    Ok(ExactResult {
        makespan: b.best,
        best: found.or_else(|| incumbent.map(|(s, _)| s.clone())),
        proved: !b.aborted || b.met,
        nodes: b.nodes,
        leaves: b.leaves,
        bound_violations: b.bound_violations,
        relaxation,
        relax_cuts: b.relax_cuts,
        relax_nodes: b.relax_work,
    })
}

/// The bound of branch and bound at its root: a lower bound on the makespan of every
/// schedule of `inst` within its cap (seconds), at least [`crate::bound::lower_bound`]'s
/// per-op arguments and tighter with a cap that binds (forwards held back until releases
/// free memory, each rank's Jackson preemptive schedule). `None` when overlapped pairs would
/// help (branch and bound does not apply).
pub fn root_bound(inst: &Instance) -> Option<f64> {
    root_bound_with(inst, 0)
}

/// [`root_bound`], raised by the one-rank relaxation ([`crate::rank_bound`]) where its
/// search ends within `relax_nodes` nodes per rank (0: not run).
pub fn root_bound_with(inst: &Instance, relax_nodes: u64) -> Option<f64> {
    if inst.pairs_help() {
        return None;
    }
    let mut b = Bnb::new(inst, !inst.split_dominates());
    let lb = b.bound(f64::NEG_INFINITY);
    let relax = if relax_nodes > 0 {
        best_rank_bound(inst, f64::INFINITY, relax_nodes, None).map_or(lb, |r| r.bound)
    } else {
        lb
    };
    Some(lb.max(relax))
}
