//! A lower bound from one rank solved exactly: every other rank is given unlimited compute
//! and memory, so its ops become plain delays in each micro-batch's chain, and the one rank
//! left is a single machine with release times, time lags between its own ops, tails and
//! its activation cap. The optimum of that relaxation is at most the optimum of the
//! instance (every schedule of the instance, restricted to the rank, is a schedule of the
//! relaxation with the same or a larger makespan).
//!
//! **Why.** On the V placement at the tightest cap (P activations per rank), the rank that
//! holds the turn (stages `P - 1` and `P`) keeps two activations of a micro-batch live from
//! its `F(P)` until its `W(P)`, a window of at least `2P + 1` op times that the other ranks'
//! chain ops fill; how many micro-batches it can have in that window at once is what limits
//! the whole pipeline. The heads-and-tails bounds of [`crate::exact`] do not see it (at
//! P = 4, M = 6, unit costs, cap 4: 41 against an optimum of 47); this relaxation alone
//! gives 47.
//!
//! **The relaxation.** One micro-batch's ops form a chain `F(c0) .. F(cn) B(cn) .. B(c0)`
//! (the stages of its direction) with each `W(s)` after `B(s)`. For an op of rank `r` in
//! that chain, the nearest op of rank `r` before it is its predecessor, with a lag: the
//! durations of the ops from the predecessor (inclusive) up to it, plus one message time on
//! every cross-rank edge (a message waits at least that). An op with no predecessor on the
//! rank has a release time, the same sum from the chain's start. Its tail is the longest
//! chain after it (ops and messages, each `B` followed by its `W`). `W(s)` follows `B(s)`
//! with the lag `B(s)`. The rank runs one op at a time and never holds more than the cap
//! (forwards minus weight gradients so far, as pass 6 counts them). Micro-batches are
//! interchangeable in the relaxation too, so the k-th op of a kind on a stage is
//! micro-batch k ([`crate::sched`]).
//!
//! **The search.** Depth first over the rank's op sequence, each op started as early as
//! its rank, its predecessor's lag and its release allow (every single-machine schedule is
//! one such sequence or is no better than one), children earliest start first; a node is
//! cut when Jackson's preemptive schedule of the ops left (heads, tails; Carlier, EJOR 1982)
//! is no better than the best known, and states met twice are explored once.
//!
//! **Scope.** Whole ops only: `None` when overlapped pairs would help or a fused `BW` is
//! quicker than `B + W` (the relaxation enumerates split backwards only).

use crate::instance::Instance;
use crate::local::EPS;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::time::Instant;

/// What the relaxation of one rank found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankBound {
    /// The rank relaxed to a single machine.
    pub rank: usize,
    /// A lower bound on every schedule's makespan, seconds: the relaxation's optimum, or
    /// the `cutoff` given when the search proved that nothing below it exists.
    pub bound: f64,
    /// True if `bound` is the relaxation's optimum (not just the cutoff).
    pub exact: bool,
    /// Nodes expanded.
    pub nodes: u64,
}

/// One kind of op on the rank: `F`, `B` or `W` of one of its stages.
#[derive(Clone, Debug)]
struct Kind {
    /// Seconds.
    d: f64,
    /// +1 for a forward, -1 for a weight gradient, 0 for `B`.
    mem: i64,
    /// The kind of the rank's op before it in a micro-batch's chain, and the lag from that
    /// op's start to this op's start.
    pred: Option<(usize, f64)>,
    /// Earliest start when there is no predecessor on the rank.
    head: f64,
    /// Seconds that must follow its end.
    tail: f64,
    /// Index of its rank in the relaxed set.
    ri: usize,
}

struct Relax {
    kinds: Vec<Kind>,
    /// Kinds in an order where each kind's predecessor comes first.
    topo: Vec<usize>,
    m: usize,
    cap: i64,
    cnt: Vec<usize>,
    /// `start[t * m + k]`: start of the k-th op of kind t (minus infinity for an op placed
    /// before the search began).
    start: Vec<f64>,
    /// `h[t * m + k]`: earliest start of the k-th op of kind t apart from its lag.
    h: Vec<f64>,
    /// Per rank of the set: when it is free, and its live activations.
    clock: Vec<f64>,
    live: Vec<i64>,
    /// Start and rank of the op placed last: ops are placed in order of (start, rank).
    t_last: f64,
    r_last: usize,
    cur: f64,
    best: f64,
    nodes: u64,
    max_nodes: u64,
    deadline: Option<Instant>,
    aborted: bool,
    seen: HashSet<u64>,
    est: Vec<f64>,
    jobs: Vec<(f64, f64, f64)>,
}

impl Relax {
    fn new(inst: &Instance, set: &[usize]) -> Relax {
        let rank = |s: usize| inst.rank_of[s] as usize;
        let stages: Vec<u32> = set
            .iter()
            .flat_map(|&r| inst.stages_of[r].iter().copied())
            .collect();
        let in_set = |s: usize| set.contains(&rank(s));
        let kind_of = |k: u8, s: usize| -> usize {
            let i = stages.iter().position(|&x| x as usize == s).unwrap();
            3 * i + k as usize
        };
        let mut kinds = Vec::new();
        for &s in &stages {
            let s = s as usize;
            let ri = set.iter().position(|&r| r == rank(s)).unwrap();
            kinds.push(Kind {
                d: inst.d_f[s],
                mem: 1,
                pred: None,
                head: 0.0,
                tail: 0.0,
                ri,
            });
            kinds.push(Kind {
                d: inst.d_b[s],
                mem: 0,
                pred: None,
                head: 0.0,
                tail: inst.d_w[s],
                ri,
            });
            kinds.push(Kind {
                d: inst.d_w[s],
                mem: -1,
                pred: Some((3 * (kinds.len() / 3) + 1, inst.d_b[s])),
                head: 0.0,
                tail: 0.0,
                ri,
            });
        }
        // Every chain: F along the direction, then B back.
        for c0 in 0..inst.s {
            if inst.prev[c0].is_some() {
                continue;
            }
            let mut fwd = vec![c0];
            while let Some(n) = inst.next[*fwd.last().unwrap()] {
                fwd.push(n as usize);
            }
            let mut ops: Vec<(u8, usize)> = fwd.iter().map(|&s| (0u8, s)).collect();
            ops.extend(fwd.iter().rev().map(|&s| (1u8, s)));
            let dur = |&(k, s): &(u8, usize)| if k == 0 { inst.d_f[s] } else { inst.d_b[s] };
            let link = |i: usize| {
                if rank(ops[i].1) != rank(ops[i + 1].1) {
                    inst.lat
                } else {
                    0.0
                }
            };
            // Tails: the longest path after each op's end.
            let n = ops.len();
            let mut tail = vec![0.0; n];
            for i in (0..n).rev() {
                let own_w = if ops[i].0 == 1 {
                    inst.d_w[ops[i].1]
                } else {
                    0.0
                };
                tail[i] = own_w;
                if i + 1 < n {
                    tail[i] = tail[i].max(link(i) + dur(&ops[i + 1]) + tail[i + 1]);
                }
            }
            let mut acc = 0.0;
            let mut last: Option<(usize, f64)> = None;
            for i in 0..n {
                let (k, s) = ops[i];
                if in_set(s) {
                    let t = kind_of(k, s);
                    match last {
                        None => kinds[t].head = acc,
                        Some((pt, at)) => kinds[t].pred = Some((pt, acc - at)),
                    }
                    kinds[t].tail = kinds[t].tail.max(tail[i]);
                    last = Some((t, acc));
                }
                acc += dur(&ops[i]);
                if i + 1 < n {
                    acc += link(i);
                }
            }
        }
        let mut topo = Vec::new();
        let mut placed = vec![false; kinds.len()];
        while topo.len() < kinds.len() {
            for t in 0..kinds.len() {
                if !placed[t] && kinds[t].pred.is_none_or(|(p, _)| placed[p]) {
                    placed[t] = true;
                    topo.push(t);
                }
            }
        }
        let nk = kinds.len();
        let m = inst.m;
        Relax {
            kinds,
            topo,
            m,
            cap: inst.cap.min(i64::MAX as u64) as i64,
            cnt: vec![0; nk],
            start: vec![f64::NEG_INFINITY; nk * m],
            h: vec![f64::NEG_INFINITY; nk * m],
            clock: vec![f64::NEG_INFINITY; set.len()],
            live: vec![0; set.len()],
            t_last: f64::NEG_INFINITY,
            r_last: 0,
            cur: 0.0,
            best: f64::INFINITY,
            nodes: 0,
            max_nodes: u64::MAX,
            deadline: None,
            aborted: false,
            seen: HashSet::new(),
            est: vec![0.0; nk * m],
            jobs: Vec::new(),
        }
    }

    /// Earliest start of the next op of kind `t`, or `None` if its predecessor is not
    /// placed yet (or the cap is reached for a forward, or the kind is done).
    fn ready(&self, t: usize) -> Option<f64> {
        let k = self.cnt[t];
        if k >= self.m {
            return None;
        }
        let kd = &self.kinds[t];
        if kd.mem > 0 && self.live[kd.ri] >= self.cap {
            return None;
        }
        let mut rel = self.h[t * self.m + k];
        if let Some((p, lag)) = kd.pred {
            if self.cnt[p] <= k {
                return None;
            }
            rel = rel.max(self.start[p * self.m + k] + lag);
        }
        Some(rel.max(self.clock[kd.ri]))
    }

    /// Jackson's preemptive schedule of the ops left, with heads propagated along the lags
    /// from the ops placed.
    fn bound(&mut self) -> f64 {
        let m = self.m;
        let mut jobs = std::mem::take(&mut self.jobs);
        jobs.clear();
        let mut lb = self.cur;
        for &t in &self.topo {
            let kd = &self.kinds[t];
            let mut prev_end = f64::NEG_INFINITY;
            let b0 = self.clock[kd.ri].max(self.t_last);
            for k in self.cnt[t]..m {
                let mut e = b0.max(prev_end).max(self.h[t * m + k]);
                if let Some((p, lag)) = kd.pred {
                    e = e.max(if self.cnt[p] > k {
                        self.start[p * m + k] + lag
                    } else {
                        self.est[p * m + k] + lag
                    });
                }
                self.est[t * m + k] = e;
                prev_end = e + kd.d;
                lb = lb.max(e + kd.d + kd.tail);
            }
        }
        for ri in 0..self.clock.len() {
            jobs.clear();
            for (t, kd) in self.kinds.iter().enumerate() {
                if kd.ri == ri {
                    for k in self.cnt[t]..m {
                        jobs.push((self.est[t * m + k], kd.d, kd.tail));
                    }
                }
            }
            if !jobs.is_empty() {
                lb = lb.max(jackson(&mut jobs));
            }
        }
        self.jobs = jobs;
        lb
    }

    fn key(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.cnt.hash(&mut h);
        for c in &self.clock {
            c.to_bits().hash(&mut h);
        }
        self.t_last.to_bits().hash(&mut h);
        self.r_last.hash(&mut h);
        self.cur.to_bits().hash(&mut h);
        // Starts of placed ops whose successors are not placed yet.
        for (t, kd) in self.kinds.iter().enumerate() {
            if let Some((p, _)) = kd.pred {
                for k in self.cnt[t]..self.cnt[p] {
                    self.start[p * self.m + k].to_bits().hash(&mut h);
                }
            }
        }
        h.finish()
    }

    fn dfs(&mut self, left: usize) {
        if self.aborted {
            return;
        }
        self.nodes += 1;
        if self.nodes > self.max_nodes
            || (self.nodes.is_multiple_of(4096)
                && self.deadline.is_some_and(|d| Instant::now() >= d))
        {
            self.aborted = true;
            return;
        }
        if left == 0 {
            if self.cur < self.best {
                self.best = self.cur;
            }
            return;
        }
        if self.bound() >= self.best - EPS {
            return;
        }
        if self.seen.len() < 20_000_000 && !self.seen.insert(self.key()) {
            return;
        }
        let (t_last, r_last) = (self.t_last, self.r_last);
        let mut kids: Vec<(f64, usize)> = (0..self.kinds.len())
            .filter_map(|t| self.ready(t).map(|s| (s, t)))
            .filter(|&(st, t)| {
                st > t_last + EPS || ((st - t_last).abs() <= EPS && self.kinds[t].ri > r_last)
            })
            .collect();
        kids.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (st, t) in kids {
            let k = self.cnt[t];
            let (d, mem, ri, tail) = {
                let kd = &self.kinds[t];
                (kd.d, kd.mem, kd.ri, kd.tail)
            };
            let (clock, cur) = (self.clock[ri], self.cur);
            self.start[t * self.m + k] = st;
            self.clock[ri] = st + d;
            self.cur = self.cur.max(st + d + tail);
            self.live[ri] += mem;
            self.cnt[t] += 1;
            self.t_last = st;
            self.r_last = ri;
            self.dfs(left - 1);
            self.cnt[t] -= 1;
            self.clock[ri] = clock;
            self.cur = cur;
            self.live[ri] -= mem;
            self.t_last = t_last;
            self.r_last = r_last;
            if self.aborted {
                return;
            }
        }
    }
}

/// The relaxation of one rank from a node of branch and bound: the ops the node has placed
/// are done, each op left has an earliest start (the node's heads) on top of its lag.
pub(crate) struct NodeRelax {
    x: Relax,
    /// The rank's stages, in kind order (kind `3 i + {0: F, 1: B, 2: W}` is of `stages[i]`).
    pub(crate) stages: Vec<u32>,
}

impl NodeRelax {
    pub(crate) fn new(inst: &Instance, r: usize) -> NodeRelax {
        NodeRelax {
            x: Relax::new(inst, &[r]),
            stages: inst.stages_of[r].clone(),
        }
    }

    /// Searches for a completion of the rank below `cutoff` from the counts `cnt` (per
    /// kind: ops placed), heads `h` (per kind and micro-batch), the rank's clock and live
    /// activations. Returns the relaxation's optimum, `cutoff` if nothing is below it, or
    /// `None` if `max_nodes` ran out.
    pub(crate) fn solve(
        &mut self,
        cnt: &[usize],
        h: &[f64],
        clock: f64,
        live: i64,
        cutoff: f64,
        max_nodes: u64,
    ) -> Option<f64> {
        let x = &mut self.x;
        x.cnt.copy_from_slice(cnt);
        x.h.copy_from_slice(h);
        x.start.fill(f64::NEG_INFINITY);
        x.clock[0] = clock;
        x.live[0] = live;
        x.t_last = f64::NEG_INFINITY;
        x.r_last = 0;
        x.cur = f64::NEG_INFINITY;
        x.best = cutoff;
        x.nodes = 0;
        x.max_nodes = max_nodes;
        x.aborted = false;
        x.seen.clear();
        let left = x.kinds.len() * x.m - cnt.iter().sum::<usize>();
        x.dfs(left);
        (!x.aborted).then_some(x.best)
    }

    /// Nodes the last [`NodeRelax::solve`] expanded.
    pub(crate) fn nodes(&self) -> u64 {
        self.x.nodes
    }
}

/// Jackson's preemptive schedule of jobs `(head, processing, tail)` on one machine: the
/// optimum of `max (end + tail)` with preemption (Carlier, EJOR 1982), a lower bound on it
/// without.
pub(crate) fn jackson(jobs: &mut [(f64, f64, f64)]) -> f64 {
    jobs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let n = jobs.len();
    let mut left: Vec<f64> = jobs.iter().map(|j| j.1).collect();
    let mut avail: Vec<usize> = Vec::with_capacity(n);
    let (mut i, mut t, mut lb) = (0usize, f64::NEG_INFINITY, 0.0f64);
    loop {
        if avail.is_empty() {
            if i == n {
                break;
            }
            t = t.max(jobs[i].0);
        }
        while i < n && jobs[i].0 <= t {
            avail.push(i);
            i += 1;
        }
        let (ai, &j) = avail
            .iter()
            .enumerate()
            .max_by(|a, b| jobs[*a.1].2.total_cmp(&jobs[*b.1].2))
            .unwrap();
        let next = if i < n { jobs[i].0 } else { f64::INFINITY };
        let run = left[j].min(next - t);
        t += run;
        left[j] -= run;
        if left[j] <= 1e-12 {
            lb = lb.max(t + jobs[j].2);
            avail.swap_remove(ai);
        }
    }
    lb
}

/// The relaxation of rank `r` (module docs), searched for a makespan below `cutoff`
/// (seconds; `f64::INFINITY` for the plain optimum) within `max_nodes` nodes and before
/// `deadline`.
///
/// Returns `None` when the relaxation does not apply (overlapped pairs help, or a fused
/// backward is quicker than `B + W`) or the node budget or the deadline ran out before the
/// search ended. Otherwise its bound: the relaxation's optimum when one below `cutoff`
/// exists, else `cutoff` (no schedule of the instance is shorter than `cutoff` by more than
/// [`EPS`], the tolerance branch and bound compares makespans with).
pub fn rank_bound(
    inst: &Instance,
    r: usize,
    cutoff: f64,
    max_nodes: u64,
    deadline: Option<Instant>,
) -> Option<RankBound> {
    if inst.stages_of[r].is_empty() {
        return None;
    }
    ranks_bound(inst, &[r], cutoff, max_nodes, deadline)
}

/// The relaxation of a set of ranks at once (each a single machine with its cap, the other
/// ranks as delays), as [`rank_bound`]; its `rank` is the set's first. Ops are placed in
/// order of (start, rank), as branch and bound places them.
pub fn ranks_bound(
    inst: &Instance,
    set: &[usize],
    cutoff: f64,
    max_nodes: u64,
    deadline: Option<Instant>,
) -> Option<RankBound> {
    if inst.pairs_help() || !inst.split_dominates() || set.is_empty() {
        return None;
    }
    let mut x = Relax::new(inst, set);
    for t in 0..x.kinds.len() {
        if x.kinds[t].pred.is_none() {
            let hd = x.kinds[t].head;
            x.h[t * x.m..(t + 1) * x.m].fill(hd);
        }
    }
    x.best = cutoff;
    x.max_nodes = max_nodes;
    x.deadline = deadline;
    let total = x.kinds.len() * x.m;
    x.dfs(total);
    if x.aborted {
        return None;
    }
    Some(RankBound {
        rank: set[0],
        bound: x.best,
        exact: x.best < cutoff,
        nodes: x.nodes,
    })
}

/// The largest of [`rank_bound`] over every rank (each within `max_nodes` nodes; a rank
/// whose search does not end adds nothing), or `None` if no rank's search ended. Ranks are
/// tried from both ends inwards, the last first (the turn of a V placement and the first
/// rank of a loop are the usual bottlenecks), and the loop stops at the first that reaches
/// `cutoff`.
pub fn best_rank_bound(
    inst: &Instance,
    cutoff: f64,
    max_nodes: u64,
    deadline: Option<Instant>,
) -> Option<RankBound> {
    let mut best: Option<RankBound> = None;
    let p = inst.p;
    for i in 0..p {
        let r = if i % 2 == 0 { p - 1 - i / 2 } else { i / 2 };
        if let Some(b) = rank_bound(inst, r, cutoff, max_nodes, deadline) {
            if best.is_none_or(|x| b.bound > x.bound) {
                best = Some(b);
            }
            if !b.exact {
                break;
            }
        }
    }
    best
}
