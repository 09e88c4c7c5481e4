//! List scheduling and rollout: the constructive heuristics.
//!
//! A [`Builder`] is a discrete-event run of all ranks at once. Whenever a rank is free it
//! takes a [`Decision`]: which of the ops whose inputs have arrived runs next, or whether to
//! wait for an input still on its way. Decisions are taken in time order (a rank decides at
//! time t only once every op that could deliver an input before t has been placed), so each
//! sees every arrival it could use.
//!
//! A [`Policy`] takes decisions by rule: input-gradient backwards first (they are on the
//! critical path, Qi et al., arXiv 2401.10241, §2), then forwards within the cap, then
//! weight gradients to fill waits (§3.1: "insert W to fill the bubble"); a rank may wait for
//! an input about to arrive rather than start something that would delay it.
//!
//! [`rollout`] improves a policy (Bertsekas, Tsitsiklis and Wu, "Rollout algorithms for
//! combinatorial optimization", J. Heuristics 3, 1997): at every decision each alternative
//! is completed by the policy and the one with the shortest completed makespan is taken. It
//! is never worse than the policy alone (the policy's own choice is an alternative, kept on
//! ties) and finds what one rule cannot, such as holding a forward back to keep memory for
//! the steady state under a tight cap.
//!
//! Memory: a forward that starts a new micro-batch on a rank is admitted only if the rank
//! can still hold the forwards its micro-batches in flight owe to its later stages of the
//! same direction (V and interleaved placements), counting the weight gradients it could run
//! to free memory, so a policy never deadlocks on the cap.

use crate::instance::Instance;
use crate::sched::{Sched, Tok};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

/// A small deterministic random generator (SplitMix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Which of several ready stages of one rank goes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// The one whose input arrived first (lowest stage on ties).
    Earliest,
    /// The highest stage id.
    Later,
    /// The lowest stage id.
    Earlier,
}

/// The knobs of one list-scheduling policy.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Prefer a ready forward over a ready backward.
    pub f_first: bool,
    /// Wait for a backward arriving within this many forward-times instead of starting a
    /// forward (0: never wait).
    pub f_wait: f64,
    /// Run a `W` if it ends no later than this many `W`-times after the next known arrival
    /// (`INFINITY`: always fill).
    pub w_slack: f64,
    /// Order among ready forwards.
    pub pick_f: Pick,
    /// Order among ready backwards.
    pub pick_b: Pick,
    /// Order among pending weight gradients.
    pub pick_w: Pick,
    /// Fuse every backward (`BW`) instead of splitting it.
    pub fuse: bool,
    /// Issue a ready forward and a ready backward as one overlapped pair.
    pub pair: bool,
    /// Probability of a random ready op instead of the rule's.
    pub noise: f64,
    /// Memory a new micro-batch reserves on its rank's later stages of the same direction:
    /// all the forwards its micro-batches in flight still owe (never stuck), or one (more in
    /// flight; a run may get stuck and is then dropped).
    pub reserve_all: bool,
    /// Priorities: when set, the ready op with the smallest key runs (a periodic block's
    /// offsets, see [`crate::periodic`]), within the cap and the reservation rule.
    pub keys: Option<Arc<Keys>>,
}

/// Priority keys of a periodic block: op of micro-batch k of stage s has key
/// `off[s] + k * period`.
#[derive(Clone, Debug, PartialEq)]
pub struct Keys {
    /// Forward offsets per stage, seconds.
    pub f: Vec<f64>,
    /// Backward offsets per stage.
    pub b: Vec<f64>,
    /// Weight-gradient offsets per stage.
    pub w: Vec<f64>,
    /// Interval between micro-batches.
    pub period: f64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            f_first: false,
            f_wait: 0.0,
            w_slack: 0.0,
            pick_f: Pick::Earliest,
            pick_b: Pick::Earliest,
            pick_w: Pick::Earliest,
            fuse: false,
            pair: false,
            noise: 0.0,
            reserve_all: true,
            keys: None,
        }
    }
}

/// The portfolio of policies the search starts from (deterministic, a few dozen).
pub fn portfolio(inst: &Instance) -> Vec<Policy> {
    let mut v = Vec::new();
    let multi = inst.stages_of.iter().any(|s| s.len() > 1);
    let picks: &[(Pick, Pick)] = if multi {
        &[
            (Pick::Earliest, Pick::Earliest),
            (Pick::Later, Pick::Earlier),
            (Pick::Later, Pick::Later),
            (Pick::Earlier, Pick::Earlier),
        ]
    } else {
        &[(Pick::Earliest, Pick::Earliest)]
    };
    let fuses: &[bool] = if inst.split_dominates() {
        &[false]
    } else {
        &[false, true]
    };
    let pairs: &[bool] = if inst.pairs_help() {
        &[false, true]
    } else {
        &[false]
    };
    let reserves: &[bool] = if multi { &[true, false] } else { &[true] };
    for &reserve_all in reserves {
        for &(pick_f, pick_b) in picks {
            for &f_first in &[false, true] {
                for &f_wait in &[0.0, 0.5, 1.0] {
                    if f_first && f_wait > 0.0 {
                        continue;
                    }
                    for &w_slack in &[0.0, 0.5, f64::INFINITY] {
                        for &fuse in fuses {
                            for &pair in pairs {
                                v.push(Policy {
                                    f_first,
                                    f_wait,
                                    w_slack,
                                    pick_f,
                                    pick_b,
                                    pick_w: Pick::Earliest,
                                    fuse,
                                    pair,
                                    noise: 0.0,
                                    reserve_all,
                                    keys: None,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    v
}

/// What a free rank may do.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Choice {
    /// A forward of a stage, its input arrived at the time given.
    F(u32, f64),
    /// A backward (B, or BW when the builder fuses) of a stage.
    B(u32, f64),
    /// An overlapped pair: forward stage, backward stage, the later arrival.
    Pair(u32, u32, f64),
    /// A weight gradient of a stage.
    W(u32),
    /// Decide again at this time (an input known to arrive then).
    Wait(f64),
    /// Decide again when an input arrives.
    Sleep,
}

/// A free rank and what it may do.
#[derive(Clone, Debug)]
pub struct Decision {
    /// The rank.
    pub rank: usize,
    /// The decision time, seconds.
    pub now: f64,
    /// Backwards whose input has arrived: (stage, arrival).
    pub b: Vec<(u32, f64)>,
    /// Admissible forwards whose input has arrived.
    pub f: Vec<(u32, f64)>,
    /// Stages with a pending weight gradient.
    pub w: Vec<u32>,
    /// The next known arrival after `now` (`INFINITY` if none is known).
    pub future: f64,
    /// A forward has arrived but the cap keeps it out.
    pub f_blocked_by_cap: bool,
}

struct Shared {
    /// Per rank: each stage with the stages of the same direction after it on the rank
    /// (non-empty only for the first of them).
    later_same_dir: Vec<Vec<(u32, Vec<u32>)>>,
    total: Vec<usize>,
}

/// The state of a list-scheduling run (cheap to clone for rollouts).
#[derive(Clone)]
pub struct Builder<'a> {
    inst: &'a Instance,
    sh: Arc<Shared>,
    fuse: bool,
    reserve_all: bool,
    fc: Vec<u32>,
    bic: Vec<u32>,
    wc: Vec<u32>,
    splitc: Vec<u32>,
    arr_a: Vec<f64>,
    arr_g: Vec<f64>,
    last_a: Vec<f64>,
    last_g: Vec<f64>,
    clock: Vec<f64>,
    live: Vec<i64>,
    toks: Vec<Vec<Tok>>,
    done: Vec<usize>,
    key: Vec<f64>,
    version: Vec<u32>,
    sleeping: Vec<bool>,
    heap: BinaryHeap<Reverse<(u64, u32, u32)>>,
}

#[inline]
fn bits(t: f64) -> u64 {
    t.max(0.0).to_bits()
}

impl<'a> Builder<'a> {
    /// A fresh run; `fuse` makes every backward a `BW`; `reserve_all` as in [`Policy`].
    pub fn new(inst: &'a Instance, fuse: bool, reserve_all: bool) -> Self {
        let (s_n, m, p) = (inst.s, inst.m, inst.p);
        let per = inst.pipeline.stages_per_direction();
        let later_same_dir = (0..p)
            .map(|r| {
                let st = &inst.stages_of[r];
                st.iter()
                    .map(|&s| {
                        let first = !st.iter().any(|&o| o < s && o / per == s / per);
                        let later = if first {
                            st.iter()
                                .copied()
                                .filter(|&o| o > s && o / per == s / per)
                                .collect()
                        } else {
                            Vec::new()
                        };
                        (s, later)
                    })
                    .collect()
            })
            .collect();
        // Work units per rank: F, B and W one each, BW two.
        let total = (0..p).map(|r| inst.stages_of[r].len() * m * 3).collect();
        let mut heap = BinaryHeap::with_capacity(2 * p);
        for r in 0..p {
            heap.push(Reverse((0, r as u32, 0)));
        }
        Builder {
            inst,
            sh: Arc::new(Shared {
                later_same_dir,
                total,
            }),
            fuse,
            reserve_all,
            fc: vec![0; s_n],
            bic: vec![0; s_n],
            wc: vec![0; s_n],
            splitc: vec![0; s_n],
            arr_a: vec![f64::NAN; s_n * m],
            arr_g: vec![f64::NAN; s_n * m],
            last_a: vec![0.0; s_n],
            last_g: vec![0.0; s_n],
            clock: vec![0.0; p],
            live: vec![0; p],
            toks: vec![Vec::new(); p],
            done: vec![0; p],
            key: vec![0.0; p],
            version: vec![0; p],
            sleeping: vec![false; p],
            heap,
        }
    }

    fn cross(&self, a: usize, b: usize) -> bool {
        self.inst.rank_of[a] != self.inst.rank_of[b]
    }

    /// Ready time of the next forward of `s`: `Some(Some(t))` arrived (or will at t),
    /// `Some(None)` not produced yet, `None` impossible for now.
    fn ready_f(&self, s: usize) -> Option<Option<f64>> {
        let m = self.inst.m;
        let k = self.fc[s] as usize;
        if k >= m {
            return None;
        }
        match self.inst.prev[s] {
            None => Some(Some(0.0)),
            Some(ps) => {
                let ps = ps as usize;
                if self.fc[ps] as usize > k {
                    Some(Some(if self.cross(ps, s) {
                        self.arr_a[ps * m + k]
                    } else {
                        0.0
                    }))
                } else if self.cross(ps, s) {
                    Some(None)
                } else {
                    None
                }
            }
        }
    }

    fn ready_b(&self, s: usize) -> Option<Option<f64>> {
        let m = self.inst.m;
        let k = self.bic[s] as usize;
        if k >= m {
            return None;
        }
        match self.inst.next[s] {
            None => (self.fc[s] as usize > k).then_some(Some(0.0)),
            Some(ns) => {
                let ns = ns as usize;
                if self.bic[ns] as usize > k {
                    Some(Some(if self.cross(ns, s) {
                        self.arr_g[ns * m + k]
                    } else {
                        0.0
                    }))
                } else if self.cross(ns, s) {
                    Some(None)
                } else {
                    None
                }
            }
        }
    }

    /// The next decision, in time order; `None` when no rank has one (done, or stuck).
    pub fn next_decision(&mut self) -> Option<Decision> {
        let cap = self.inst.cap.min(i64::MAX as u64) as i64;
        while let Some(Reverse((kb, r, ver))) = self.heap.pop() {
            let r = r as usize;
            if ver != self.version[r] || self.done[r] >= self.sh.total[r] {
                continue;
            }
            let now = f64::from_bits(kb);
            let pending_w: i64 = self.inst.stages_of[r]
                .iter()
                .map(|&s| (self.splitc[s as usize] - self.wc[s as usize]) as i64)
                .sum();
            let mut d = Decision {
                rank: r,
                now,
                b: Vec::new(),
                f: Vec::new(),
                w: Vec::new(),
                future: f64::INFINITY,
                f_blocked_by_cap: false,
            };
            let sh = Arc::clone(&self.sh);
            for (s, later) in &sh.later_same_dir[r] {
                let su = *s as usize;
                if let Some(x) = self.ready_b(su) {
                    match x {
                        Some(a) if a <= now => d.b.push((*s, a)),
                        Some(a) => d.future = d.future.min(a),
                        None => {}
                    }
                }
                if self.splitc[su] > self.wc[su] {
                    d.w.push(*s);
                }
                if let Some(x) = self.ready_f(su) {
                    let mut owed: i64 = later
                        .iter()
                        .map(|&o| (self.fc[su] - self.fc[o as usize]) as i64 + 1)
                        .sum();
                    if !self.reserve_all {
                        owed = owed.min(later.len() as i64);
                    }
                    let ok = self.live[r] < cap
                        && (later.is_empty()
                            || self.live[r] + 1 + owed <= cap.saturating_add(pending_w));
                    if !ok {
                        if matches!(x, Some(a) if a <= now) {
                            d.f_blocked_by_cap = true;
                        }
                        continue;
                    }
                    match x {
                        Some(a) if a <= now => d.f.push((*s, a)),
                        Some(a) => d.future = d.future.min(a),
                        None => {}
                    }
                }
            }
            return Some(d);
        }
        None
    }

    /// The choice `pol` makes.
    pub fn policy_choice(&self, d: &Decision, pol: &Policy, rng: &mut Rng) -> Choice {
        let pick = |v: &[(u32, f64)], how: Pick| -> (u32, f64) {
            match how {
                Pick::Earliest => *v
                    .iter()
                    .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
                    .unwrap(),
                Pick::Later => *v.iter().max_by_key(|x| x.0).unwrap(),
                Pick::Earlier => *v.iter().min_by_key(|x| x.0).unwrap(),
            }
        };
        let t = self.clock[d.rank];
        let n = d.b.len() + d.f.len() + d.w.len();
        if let Some(keys) = &pol.keys {
            let per = keys.period;
            let mut best: Option<(f64, u8, Choice)> = None;
            let mut consider = |k: f64, pri: u8, c: Choice| {
                if best.as_ref().is_none_or(|b| (k, pri) < (b.0, b.1)) {
                    best = Some((k, pri, c));
                }
            };
            for &(s, a) in &d.b {
                let su = s as usize;
                consider(keys.b[su] + self.bic[su] as f64 * per, 0, Choice::B(s, a));
            }
            for &(s, a) in &d.f {
                let su = s as usize;
                consider(keys.f[su] + self.fc[su] as f64 * per, 1, Choice::F(s, a));
            }
            for &s in &d.w {
                let su = s as usize;
                consider(keys.w[su] + self.wc[su] as f64 * per, 2, Choice::W(s));
            }
            return match best {
                Some((_, _, c)) => c,
                None if d.future.is_finite() => Choice::Wait(d.future),
                None => Choice::Sleep,
            };
        }
        let choice = if pol.noise > 0.0 && n > 0 && rng.unit() < pol.noise {
            let i = rng.below(n);
            if i < d.b.len() {
                Choice::B(d.b[i].0, d.b[i].1)
            } else if i < d.b.len() + d.f.len() {
                let x = d.f[i - d.b.len()];
                Choice::F(x.0, x.1)
            } else {
                Choice::W(d.w[i - d.b.len() - d.f.len()])
            }
        } else if !d.b.is_empty() && !d.f.is_empty() && pol.pair {
            let (sb, ab) = pick(&d.b, pol.pick_b);
            let (sf, af) = pick(&d.f, pol.pick_f);
            Choice::Pair(sf, sb, ab.max(af))
        } else if !d.b.is_empty() && (!pol.f_first || d.f.is_empty()) {
            let (s, a) = pick(&d.b, pol.pick_b);
            Choice::B(s, a)
        } else if !d.f.is_empty() {
            let (s, a) = pick(&d.f, pol.pick_f);
            let df = self.inst.d_f[s as usize];
            if pol.f_wait > 0.0 && d.future < t.max(a) + pol.f_wait * df && d.b.is_empty() {
                Choice::Wait(d.future)
            } else {
                Choice::F(s, a)
            }
        } else if !d.w.is_empty() {
            let s = match pol.pick_w {
                Pick::Later => *d.w.iter().max().unwrap(),
                _ => *d.w.iter().min().unwrap(),
            };
            let dw = self.inst.d_w[s as usize];
            if d.f_blocked_by_cap
                || !d.future.is_finite()
                || t + dw <= d.future.max(t) + pol.w_slack * dw
            {
                Choice::W(s)
            } else {
                Choice::Wait(d.future)
            }
        } else if d.future.is_finite() {
            Choice::Wait(d.future)
        } else {
            Choice::Sleep
        };
        choice
    }

    /// Every alternative at `d` (each ready op, each pending weight gradient, waiting).
    pub fn options(&self, d: &Decision) -> Vec<Choice> {
        let mut v = Vec::new();
        for &(s, a) in &d.b {
            v.push(Choice::B(s, a));
        }
        for &(s, a) in &d.f {
            v.push(Choice::F(s, a));
        }
        if self.inst.pairs_help() {
            for &(sb, ab) in &d.b {
                for &(sf, af) in &d.f {
                    v.push(Choice::Pair(sf, sb, ab.max(af)));
                }
            }
        }
        for &s in &d.w {
            v.push(Choice::W(s));
        }
        if d.future.is_finite() {
            v.push(Choice::Wait(d.future));
        } else if !d.f.is_empty() || !d.w.is_empty() {
            v.push(Choice::Sleep);
        }
        v
    }

    /// Carries out `c` for the decision `d` (taken from [`Builder::next_decision`] on this
    /// state).
    pub fn apply(&mut self, d: &Decision, c: Choice) {
        let inst = self.inst;
        let r = d.rank;
        let t = self.clock[r];
        let m = inst.m;
        let mut produced: [(bool, usize, usize, f64); 2] = [(false, usize::MAX, 0, 0.0); 2];
        match c {
            Choice::Wait(at) => {
                self.version[r] += 1;
                self.key[r] = at;
                self.heap
                    .push(Reverse((bits(at), r as u32, self.version[r])));
                return;
            }
            Choice::Sleep => {
                self.version[r] += 1;
                self.sleeping[r] = true;
                return;
            }
            Choice::F(s, a) => {
                let su = s as usize;
                let end = t.max(a) + inst.d_f[su];
                produced[0] = (true, su, self.fc[su] as usize, end);
                self.fc[su] += 1;
                self.live[r] += 1;
                self.clock[r] = end;
                self.toks[r].push(Tok::F(s));
                self.done[r] += 1;
            }
            Choice::B(s, a) => {
                let su = s as usize;
                let end = t.max(a) + inst.bwd_time(s, self.fuse);
                produced[0] = (false, su, self.bic[su] as usize, end);
                self.bic[su] += 1;
                if self.fuse {
                    self.live[r] -= 1;
                    self.done[r] += 2;
                    self.toks[r].push(Tok::BW(s));
                } else {
                    self.splitc[su] += 1;
                    self.done[r] += 1;
                    self.toks[r].push(Tok::B(s));
                }
                self.clock[r] = end;
            }
            Choice::Pair(sf, sb, a) => {
                let fused = self.fuse;
                let end = t.max(a) + inst.pair_time(sf, sb, fused);
                produced[0] = (true, sf as usize, self.fc[sf as usize] as usize, end);
                produced[1] = (false, sb as usize, self.bic[sb as usize] as usize, end);
                self.fc[sf as usize] += 1;
                self.bic[sb as usize] += 1;
                self.live[r] += 1;
                if fused {
                    self.live[r] -= 1;
                    self.done[r] += 1;
                } else {
                    self.splitc[sb as usize] += 1;
                }
                self.done[r] += 2;
                self.clock[r] = end;
                self.toks[r].push(Tok::Pair {
                    f: sf,
                    b: sb,
                    fused,
                });
            }
            Choice::W(s) => {
                let su = s as usize;
                self.wc[su] += 1;
                self.live[r] -= 1;
                self.clock[r] = t + inst.d_w[su];
                self.toks[r].push(Tok::W(s));
                self.done[r] += 1;
            }
        }
        for &(act, s, k, end) in &produced {
            if s == usize::MAX {
                continue;
            }
            let nb = if act { inst.next[s] } else { inst.prev[s] };
            let Some(nb) = nb.map(|x| x as usize) else {
                continue;
            };
            if !self.cross(s, nb) {
                continue;
            }
            let (arr, last) = if act {
                (&mut self.arr_a, &mut self.last_a)
            } else {
                (&mut self.arr_g, &mut self.last_g)
            };
            let at = end.max(last[s]) + inst.lat;
            last[s] = at;
            arr[s * m + k] = at;
            let cr = inst.rank_of[nb] as usize;
            if self.done[cr] < self.sh.total[cr] {
                let kk = at.max(self.clock[cr]);
                if self.sleeping[cr] || kk < self.key[cr] {
                    self.sleeping[cr] = false;
                    self.version[cr] += 1;
                    self.key[cr] = kk;
                    self.heap
                        .push(Reverse((bits(kk), cr as u32, self.version[cr])));
                }
            }
        }
        if self.done[r] < self.sh.total[r] {
            self.version[r] += 1;
            self.key[r] = self.clock[r];
            self.heap
                .push(Reverse((bits(self.clock[r]), r as u32, self.version[r])));
        }
    }

    /// Runs `pol` to the end. False if the run gets stuck.
    pub fn complete(&mut self, pol: &Policy, rng: &mut Rng) -> bool {
        while let Some(d) = self.next_decision() {
            let c = self.policy_choice(&d, pol, rng);
            self.apply(&d, c);
        }
        self.finished()
    }

    /// True if every op has been placed.
    pub fn finished(&self) -> bool {
        (0..self.inst.p).all(|r| self.done[r] >= self.sh.total[r])
    }

    /// The latest end so far, seconds.
    pub fn makespan(&self) -> f64 {
        self.clock.iter().copied().fold(0.0, f64::max)
    }

    /// The tokens placed.
    pub fn into_sched(self) -> Sched {
        Sched { ranks: self.toks }
    }
}

/// Runs one policy. `None` if the run gets stuck (admission keeps room, so it should not).
pub fn build(inst: &Instance, pol: &Policy, rng: &mut Rng) -> Option<Sched> {
    let mut b = Builder::new(inst, pol.fuse, pol.reserve_all);
    b.complete(pol, rng).then(|| b.into_sched())
}

/// The rollout of `pol`: at every decision, each alternative completed by `pol`, the best
/// taken (the policy's own on ties). `None` if the policy itself gets stuck. `deadline`
/// stops the lookahead (the rest is completed by the policy).
pub fn rollout(
    inst: &Instance,
    pol: &Policy,
    deadline: Option<std::time::Instant>,
) -> Option<Sched> {
    let mut rng = Rng::new(0);
    let mut st = Builder::new(inst, pol.fuse, pol.reserve_all);
    let mut steps = 0u64;
    while let Some(d) = st.next_decision() {
        let base = st.policy_choice(&d, pol, &mut rng);
        steps += 1;
        let late =
            steps.is_multiple_of(32) && deadline.is_some_and(|dl| std::time::Instant::now() >= dl);
        if late {
            st.apply(&d, base);
            if !st.complete(pol, &mut rng) {
                return None;
            }
            break;
        }
        let opts = st.options(&d);
        if opts.len() <= 1 {
            st.apply(&d, base);
            continue;
        }
        let eval = |c: Choice| -> f64 {
            let mut s2 = st.clone();
            s2.apply(&d, c);
            let mut r2 = Rng::new(0);
            if s2.complete(pol, &mut r2) {
                s2.makespan()
            } else {
                f64::INFINITY
            }
        };
        let mut best = (eval(base), base);
        for c in opts {
            if c == base {
                continue;
            }
            let mk = eval(c);
            if mk < best.0 - 1e-9 {
                best = (mk, c);
            }
        }
        st.apply(&d, best.1);
    }
    st.finished().then(|| st.into_sched())
}
