//! The inner-loop evaluator: start and end of every token, per-rank peak activations and the
//! makespan, in O(tokens).
//!
//! It computes what [`schedc::sim::simulate`] computes for the program that
//! [`crate::lower::lower`] builds from the same tokens (a test checks it over many
//! schedules): each rank runs its tokens in order, each as soon as the rank is free and its
//! inputs have arrived. An input produced on another rank arrives over that stage boundary's
//! own in-order channel: the k-th message of a boundary completes at
//! `max(producer end, completion of message k-1) + message time`. Dependencies on the same
//! rank (the V's turn, the loss on a last stage, `W` after its `B`) are program order.
//!
//! Memory is pass 6's count in program order: a forward adds one live activation, `W` or
//! `BW` releases it, an overlapped pair allocates before it releases.

use crate::instance::Instance;
use crate::sched::{Sched, Tok};

/// Why a token schedule is not a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fail {
    /// Ranks wait on each other in a cycle.
    Deadlock,
    /// Token `pos` of `rank` breaks a same-rank order (a backward before the op it needs,
    /// a `W` before its `B`, a stage on the wrong rank, one op too many).
    Order {
        /// Rank.
        rank: u32,
        /// Token index.
        pos: u32,
    },
    /// Token `pos` of `rank` goes over the activation cap.
    OverCap {
        /// Rank.
        rank: u32,
        /// Token index.
        pos: u32,
    },
    /// Some op is missing.
    Incomplete,
}

/// The figures of one evaluated schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Eval {
    /// Latest end, seconds (from time 0, when every rank may start).
    pub makespan: f64,
    /// End of each rank's last token, seconds.
    pub end: Vec<f64>,
    /// Peak live activations per rank.
    pub peak: Vec<u32>,
}

const UNKNOWN: f64 = f64::NAN;
const NO_WAIT: u32 = u32::MAX;

/// Reusable evaluator (scratch buffers sized once per instance).
pub struct Evaluator<'a> {
    inst: &'a Instance,
    act_cross: Vec<bool>,
    grad_cross: Vec<bool>,
    fc: Vec<u32>,
    bic: Vec<u32>,
    wc: Vec<u32>,
    splitc: Vec<u32>,
    arr_a: Vec<f64>,
    arr_g: Vec<f64>,
    last_a: Vec<f64>,
    last_g: Vec<f64>,
    clock: Vec<f64>,
    ptr: Vec<usize>,
    live: Vec<i64>,
    peak: Vec<i64>,
    wait: Vec<u32>,
    work: Vec<u32>,
    /// Evaluations run (for reports).
    pub count: u64,
}

enum Step {
    Ran,
    Blocked(u32),
    Failed(Fail),
}

impl<'a> Evaluator<'a> {
    /// An evaluator for `inst`.
    pub fn new(inst: &'a Instance) -> Self {
        let (s, m, p) = (inst.s, inst.m, inst.p);
        let act_cross = (0..s)
            .map(|x| inst.next[x].is_some_and(|n| inst.rank_of[n as usize] != inst.rank_of[x]))
            .collect();
        let grad_cross = (0..s)
            .map(|x| inst.prev[x].is_some_and(|n| inst.rank_of[n as usize] != inst.rank_of[x]))
            .collect();
        Evaluator {
            inst,
            act_cross,
            grad_cross,
            fc: vec![0; s],
            bic: vec![0; s],
            wc: vec![0; s],
            splitc: vec![0; s],
            arr_a: vec![UNKNOWN; s * m],
            arr_g: vec![UNKNOWN; s * m],
            last_a: vec![0.0; s],
            last_g: vec![0.0; s],
            clock: vec![0.0; p],
            ptr: vec![0; p],
            live: vec![0; p],
            peak: vec![0; p],
            wait: vec![NO_WAIT; p],
            work: Vec::with_capacity(p),
            count: 0,
        }
    }

    /// The instance.
    pub fn inst(&self) -> &'a Instance {
        self.inst
    }

    /// Evaluates `sc`. Errors: see [`Fail`].
    pub fn eval(&mut self, sc: &Sched) -> Result<Eval, Fail> {
        self.run(sc, None)
    }

    /// Evaluates `sc` and returns the start time of every token too.
    pub fn eval_starts(&mut self, sc: &Sched) -> Result<(Eval, Vec<Vec<f64>>), Fail> {
        let mut starts: Vec<Vec<f64>> = sc.ranks.iter().map(|r| vec![UNKNOWN; r.len()]).collect();
        let e = self.run(sc, Some(&mut starts))?;
        Ok((e, starts))
    }

    /// Makespan only, `f64::INFINITY` when `sc` is not a schedule within the cap.
    pub fn makespan(&mut self, sc: &Sched) -> f64 {
        self.run(sc, None).map_or(f64::INFINITY, |e| e.makespan)
    }

    fn reset(&mut self) {
        self.fc.fill(0);
        self.bic.fill(0);
        self.wc.fill(0);
        self.splitc.fill(0);
        self.arr_a.fill(UNKNOWN);
        self.arr_g.fill(UNKNOWN);
        self.last_a.fill(0.0);
        self.last_g.fill(0.0);
        self.clock.fill(0.0);
        self.ptr.fill(0);
        self.live.fill(0);
        self.peak.fill(0);
        self.wait.fill(NO_WAIT);
        self.work.clear();
    }

    fn run(&mut self, sc: &Sched, mut starts: Option<&mut Vec<Vec<f64>>>) -> Result<Eval, Fail> {
        self.count += 1;
        let p = self.inst.p;
        if sc.ranks.len() != p {
            return Err(Fail::Incomplete);
        }
        self.reset();
        self.work.extend((0..p as u32).rev());
        while let Some(r) = self.work.pop() {
            let r = r as usize;
            self.wait[r] = NO_WAIT;
            let toks = &sc.ranks[r];
            while self.ptr[r] < toks.len() {
                let pos = self.ptr[r];
                match self.step(r, toks[pos], pos) {
                    Step::Ran => {
                        if let Some(st) = starts.as_deref_mut() {
                            st[r][pos] = self.clock[r] - toks[pos].time(self.inst);
                        }
                        self.ptr[r] += 1;
                    }
                    Step::Blocked(key) => {
                        self.wait[r] = key;
                        break;
                    }
                    Step::Failed(f) => return Err(f),
                }
            }
        }
        if (0..p).any(|r| self.ptr[r] < sc.ranks[r].len()) {
            return Err(Fail::Deadlock);
        }
        let m = self.inst.m as u32;
        for x in 0..self.inst.s {
            if self.fc[x] != m || self.bic[x] != m || self.wc[x] != self.splitc[x] {
                return Err(Fail::Incomplete);
            }
        }
        let makespan = self.clock.iter().copied().fold(0.0, f64::max);
        Ok(Eval {
            makespan,
            end: self.clock.clone(),
            peak: self.peak.iter().map(|&x| x as u32).collect(),
        })
    }

    /// The arrival time of the forward input of `F(s, k)` on rank `r`, `Ok(None)` if it is
    /// local and already run, `Err` to block or fail.
    #[inline]
    fn need_f(&self, r: usize, s: usize, k: u32, pos: usize) -> Result<f64, Step> {
        let inst = self.inst;
        if k as usize >= inst.m || inst.rank_of[s] as usize != r {
            return Err(order(r, pos));
        }
        match inst.prev[s] {
            None => Ok(0.0),
            Some(ps) => {
                let ps = ps as usize;
                if self.fc[ps] > k {
                    if inst.rank_of[ps] as usize == r {
                        Ok(0.0)
                    } else {
                        Ok(self.arr_a[ps * inst.m + k as usize])
                    }
                } else if inst.rank_of[ps] as usize == r {
                    Err(order(r, pos))
                } else {
                    Err(Step::Blocked((ps * inst.m) as u32 + k))
                }
            }
        }
    }

    #[inline]
    fn need_b(&self, r: usize, s: usize, k: u32, pos: usize) -> Result<f64, Step> {
        let inst = self.inst;
        if k as usize >= inst.m || inst.rank_of[s] as usize != r {
            return Err(order(r, pos));
        }
        match inst.next[s] {
            None => {
                if self.fc[s] > k {
                    Ok(0.0)
                } else {
                    Err(order(r, pos))
                }
            }
            Some(ns) => {
                let ns = ns as usize;
                if self.bic[ns] > k {
                    if inst.rank_of[ns] as usize == r {
                        Ok(0.0)
                    } else {
                        Ok(self.arr_g[ns * inst.m + k as usize])
                    }
                } else if inst.rank_of[ns] as usize == r {
                    Err(order(r, pos))
                } else {
                    Err(Step::Blocked(((inst.s + ns) * inst.m) as u32 + k))
                }
            }
        }
    }

    #[inline]
    fn alloc(&mut self, r: usize, pos: usize) -> Result<(), Step> {
        self.live[r] += 1;
        if self.live[r] > self.peak[r] {
            self.peak[r] = self.live[r];
            if self.peak[r] as u64 > self.inst.cap {
                return Err(Step::Failed(Fail::OverCap {
                    rank: r as u32,
                    pos: pos as u32,
                }));
            }
        }
        Ok(())
    }

    #[inline]
    fn produced_f(&mut self, s: usize, k: u32, end: f64) {
        if self.act_cross[s] {
            let a = end.max(self.last_a[s]) + self.inst.lat;
            self.last_a[s] = a;
            self.arr_a[s * self.inst.m + k as usize] = a;
            let cr = self.inst.rank_of[self.inst.next[s].unwrap() as usize] as usize;
            if self.wait[cr] == (s * self.inst.m) as u32 + k {
                self.wait[cr] = NO_WAIT;
                self.work.push(cr as u32);
            }
        }
    }

    #[inline]
    fn produced_b(&mut self, s: usize, k: u32, end: f64) {
        if self.grad_cross[s] {
            let a = end.max(self.last_g[s]) + self.inst.lat;
            self.last_g[s] = a;
            self.arr_g[s * self.inst.m + k as usize] = a;
            let cr = self.inst.rank_of[self.inst.prev[s].unwrap() as usize] as usize;
            if self.wait[cr] == ((self.inst.s + s) * self.inst.m) as u32 + k {
                self.wait[cr] = NO_WAIT;
                self.work.push(cr as u32);
            }
        }
    }

    #[inline]
    fn step(&mut self, r: usize, t: Tok, pos: usize) -> Step {
        let inst = self.inst;
        match t {
            Tok::F(s) => {
                let s = s as usize;
                let k = self.fc[s];
                let ready = match self.need_f(r, s, k, pos) {
                    Ok(x) => x,
                    Err(st) => return st,
                };
                if let Err(st) = self.alloc(r, pos) {
                    return st;
                }
                let end = self.clock[r].max(ready) + inst.d_f[s];
                self.clock[r] = end;
                self.fc[s] += 1;
                self.produced_f(s, k, end);
                Step::Ran
            }
            Tok::B(s) | Tok::BW(s) => {
                let fused = matches!(t, Tok::BW(_));
                let s = s as usize;
                let k = self.bic[s];
                let ready = match self.need_b(r, s, k, pos) {
                    Ok(x) => x,
                    Err(st) => return st,
                };
                let end = self.clock[r].max(ready) + inst.bwd_time(s as u32, fused);
                self.clock[r] = end;
                self.bic[s] += 1;
                if fused {
                    self.live[r] -= 1;
                } else {
                    self.splitc[s] += 1;
                }
                self.produced_b(s, k, end);
                Step::Ran
            }
            Tok::W(s) => {
                let s = s as usize;
                if inst.rank_of[s] as usize != r || self.splitc[s] <= self.wc[s] {
                    return order(r, pos);
                }
                self.clock[r] += inst.d_w[s];
                self.wc[s] += 1;
                self.live[r] -= 1;
                Step::Ran
            }
            Tok::Pair { f, b, fused } => {
                let (f, b) = (f as usize, b as usize);
                let kf = self.fc[f];
                let kb = self.bic[b];
                let rf = match self.need_f(r, f, kf, pos) {
                    Ok(x) => x,
                    Err(st) => return st,
                };
                let rb = match self.need_b(r, b, kb, pos) {
                    Ok(x) => x,
                    Err(st) => return st,
                };
                if let Err(st) = self.alloc(r, pos) {
                    return st;
                }
                let end = self.clock[r].max(rf).max(rb) + inst.pair_time(f as u32, b as u32, fused);
                self.clock[r] = end;
                self.fc[f] += 1;
                self.bic[b] += 1;
                if fused {
                    self.live[r] -= 1;
                } else {
                    self.splitc[b] += 1;
                }
                self.produced_f(f, kf, end);
                self.produced_b(b, kb, end);
                Step::Ran
            }
        }
    }
}

#[inline]
fn order(r: usize, pos: usize) -> Step {
    Step::Failed(Fail::Order {
        rank: r as u32,
        pos: pos as u32,
    })
}
