//! The Zero Bubble auto-scheduler's greedy, re-implemented: the published baseline.
//!
//! Source: Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv 2401.10241),
//! §3.1 "Heuristic algorithm", and the authors' generator (`zb.py`, `manual_order` and
//! `initial_solution`, in sail-sg/zero-bubble-pipeline-parallelism at 39f2c186), whose
//! outputs are in `shared/reference/zb/` (`zb1p`, `zb2p`). One stage per rank, loop
//! placement; memory in (stage, micro-batch) activations: a forward adds one, `B` nothing, a
//! `W` frees one, at most `cap` live.
//!
//! The rules, in the paper's words and the generator's detail:
//!
//! * **Warmup.** Micro-batch 0's forward runs on every stage. Going up from the last stage,
//!   each stage adds forwards while the cap allows and while they fit before the first
//!   gradient can arrive (`allow_bubble_before_first_b`: a forward may also start just
//!   before it and delay it). A stage never keeps more extra forwards than the stage before
//!   it. Then the first backward runs on every stage, last to first.
//! * **Steady state.** Each round places one forward on every stage that still has
//!   forwards (all or none of a suffix of the stages, so each stage stays ahead of the next),
//!   then one backward on every stage, last to first. Before each op, `W`s fill the wait for
//!   its input when they fit; a `W` that does not fit still goes in if the wait would push
//!   the stage's idle time above the worst stage's (`no_bubble_greedy`), and `W`s run
//!   whenever the cap blocks a forward. With `prioritize_b`, a stage two or more forwards
//!   ahead of the next one skips its forward when it would delay the next stage's
//!   forward-backward pair.
//! * **Cooldown.** The remaining `W`s, in order. Stage 0 runs its remaining `W`s before its
//!   last backwards once it has no forward left.
//!
//! Eight variants (the three flags) run and the one with the shortest longest stage span
//! (first forward's start to last `W`'s end, the generator's `best_time`) is kept, the first
//! on ties, in the generator's loop order.

use crate::instance::Instance;
use crate::sched::{Sched, Tok};
use schedc_ir::PlacementKind;

/// The three flags of one variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    /// A warmup forward may start just before the first gradient arrives.
    pub allow_bubble_before_first_b: bool,
    /// A stage far ahead skips a forward that would delay the next stage.
    pub prioritize_b: bool,
    /// A `W` too long for a wait still goes in when the wait would make this stage the
    /// idlest.
    pub no_bubble_greedy: bool,
}

impl Variant {
    /// The eight variants in the generator's order.
    pub fn all() -> Vec<Variant> {
        let mut v = Vec::with_capacity(8);
        for a in [true, false] {
            for p in [true, false] {
                for n in [true, false] {
                    v.push(Variant {
                        allow_bubble_before_first_b: a,
                        prioritize_b: p,
                        no_bubble_greedy: n,
                    });
                }
            }
        }
        v
    }
}

/// One variant's result.
#[derive(Clone, Debug)]
pub struct GreedyRun {
    /// The flags.
    pub variant: Variant,
    /// The schedule.
    pub sched: Sched,
    /// Longest stage span (the generator's `best_time`), seconds.
    pub span: f64,
    /// End of the last op, seconds from time 0.
    pub makespan: f64,
}

/// Why the greedy does not apply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GreedyError {
    /// Not one stage per rank in a loop.
    #[error("the Zero Bubble greedy schedules one stage per rank (loop placement, V = 1)")]
    Placement,
    /// Every variant ran out of memory.
    #[error("no variant of the greedy fits the cap")]
    Cap,
}

struct State<'a> {
    inst: &'a Instance,
    n: usize,
    m: usize,
    f: Vec<usize>,
    b: Vec<usize>,
    w: Vec<usize>,
    mem: Vec<i64>,
    e: Vec<f64>,
    tf: Vec<f64>,
    tb: Vec<f64>,
    tw: Vec<f64>,
    bubble: Vec<f64>,
    order: Vec<Vec<Tok>>,
    cap: i64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum K {
    F,
    B,
    W,
}

impl State<'_> {
    fn cost(&self, k: K, j: usize) -> f64 {
        match k {
            K::F => self.inst.d_f[j],
            K::B => self.inst.d_b[j],
            K::W => self.inst.d_w[j],
        }
    }

    fn max_bubble(&self) -> f64 {
        self.bubble.iter().copied().fold(0.0, f64::max)
    }

    fn put(&mut self, j: usize, k: K) {
        let c = self.cost(k, j);
        let comm = self.inst.lat;
        let mut end = self.e[j] + c;
        let no_wait = end;
        match k {
            K::F => {
                let i = self.f[j];
                if j > 0 {
                    end = end.max(self.tf[(j - 1) * self.m + i] + comm + c);
                }
                if self.f[j] > 0 {
                    self.bubble[j] += end - no_wait;
                }
                self.tf[j * self.m + i] = end;
                self.f[j] += 1;
                self.mem[j] += 1;
                self.order[j].push(Tok::F(j as u32));
            }
            K::B => {
                let i = self.b[j];
                if j + 1 < self.n {
                    end = end.max(self.tb[(j + 1) * self.m + i] + comm + c);
                }
                if self.f[j] > 0 {
                    self.bubble[j] += end - no_wait;
                }
                self.tb[j * self.m + i] = end;
                self.b[j] += 1;
                self.order[j].push(Tok::B(j as u32));
            }
            K::W => {
                let i = self.w[j];
                if self.f[j] > 0 {
                    self.bubble[j] += end - no_wait;
                }
                self.tw[j * self.m + i] = end;
                self.w[j] += 1;
                self.mem[j] -= 1;
                self.order[j].push(Tok::W(j as u32));
            }
        }
        self.e[j] = end;
    }

    /// `W`s before an op of stage `j` whose input arrives at `arrive`: those that fit, then
    /// one more if the wait is long enough to matter.
    fn fill(&mut self, j: usize, arrive: f64, v: Variant) {
        while self.w[j] < self.b[j] && self.e[j] + self.cost(K::W, j) <= arrive {
            self.put(j, K::W);
        }
        if self.w[j] < self.b[j] && self.e[j] < arrive {
            if arrive - self.e[j] <= self.max_bubble() - self.bubble[j] {
                if v.no_bubble_greedy {
                    self.put(j, K::W);
                }
            } else {
                self.put(j, K::W);
            }
        }
    }

    /// `W`s until a forward fits the cap; `false` if none is left to free memory.
    fn make_room(&mut self, j: usize) -> bool {
        while self.mem[j] + 1 > self.cap {
            if self.w[j] >= self.b[j] {
                return false;
            }
            self.put(j, K::W);
        }
        true
    }
}

/// Runs one variant. `None` if it runs out of memory.
pub fn run_variant(inst: &Instance, v: Variant) -> Option<GreedyRun> {
    let n = inst.s;
    let m = inst.m;
    let comm = inst.lat;
    let cap = if inst.cap == u64::MAX {
        3 * m as i64
    } else {
        inst.cap.min(i64::MAX as u64) as i64
    };
    let mut st = State {
        inst,
        n,
        m,
        f: vec![0; n],
        b: vec![0; n],
        w: vec![0; n],
        mem: vec![0; n],
        e: vec![0.0; n],
        tf: vec![0.0; n * m],
        tb: vec![0.0; n * m],
        tw: vec![0.0; n * m],
        bubble: vec![0.0; n],
        order: vec![Vec::new(); n],
        cap,
    };
    for i in 0..m {
        if i == 0 {
            for j in 0..n {
                st.put(j, K::F);
            }
            let mut extra = vec![0usize; n];
            let mut last_t = 0.0;
            for j in (0..n).rev() {
                if j == n - 1 {
                    last_t = st.tf[j * m] + st.cost(K::B, j);
                    continue;
                }
                let mut mem = st.mem[j];
                let mut t = st.e[j];
                while st.f[j] + extra[j] < m && mem < cap {
                    let cf = st.cost(K::F, j);
                    let stop = if v.allow_bubble_before_first_b {
                        t + cf > last_t + comm
                    } else {
                        t >= last_t + comm
                    };
                    if stop {
                        break;
                    }
                    mem += 1;
                    t += cf;
                    extra[j] += 1;
                }
                last_t = t.max(last_t + comm) + st.cost(K::B, j);
            }
            for j in 1..n {
                while extra[j] > 0 && extra[j] >= extra[j - 1] && st.f[j] + extra[j] < m {
                    extra[j] -= 1;
                }
            }
            for (j, &x) in extra.iter().enumerate() {
                for _ in 0..x {
                    st.put(j, K::F);
                }
            }
            for j in (0..n).rev() {
                st.put(j, K::B);
            }
            continue;
        }
        let mut want = vec![false; n];
        #[allow(clippy::needless_range_loop)]
        for j in 0..n {
            if st.f[j] >= m {
                continue;
            }
            if v.prioritize_b && j + 1 < n && st.f[j] >= st.f[j + 1] + 2 {
                let next_fb = st.e[j + 1] + st.cost(K::F, j + 1) + st.cost(K::B, j + 1) + comm;
                if st.e[j] >= next_fb {
                    continue;
                }
                // Ws needed to make room for the forward.
                let mut w_cost = 0.0;
                let mut w_cnt = 0;
                let mut mem = st.mem[j] + 1;
                while mem > cap && st.w[j] + w_cnt < st.b[j] {
                    w_cost += st.cost(K::W, j);
                    mem -= 1;
                    w_cnt += 1;
                }
                if st.e[j] + st.cost(K::F, j) + w_cost <= next_fb {
                    want[j] = true;
                    continue;
                }
                if next_fb - st.e[j] <= st.max_bubble() - st.bubble[j] {
                    continue;
                }
            }
            want[j] = true;
        }
        for j in (0..n.saturating_sub(1)).rev() {
            want[j] = want[j] && want[j + 1];
        }
        #[allow(clippy::needless_range_loop)]
        for j in 0..n {
            if !want[j] {
                continue;
            }
            if !st.make_room(j) {
                return None;
            }
            if j > 0 {
                let arrive = st.tf[(j - 1) * m + st.f[j]] + comm;
                st.fill(j, arrive, v);
            }
            st.put(j, K::F);
        }
        for j in (0..n).rev() {
            if j + 1 < n {
                let arrive = st.tb[(j + 1) * m + i] + comm;
                st.fill(j, arrive, v);
            }
            if j == 0 && st.f[j] == m {
                while st.w[j] < st.b[j] {
                    st.put(j, K::W);
                }
            }
            st.put(j, K::B);
        }
    }
    for j in 0..n {
        while st.w[j] < m {
            st.put(j, K::W);
        }
    }
    let span = (0..n)
        .map(|j| st.tw[j * m + m - 1] - st.tf[j * m] + st.cost(K::F, j))
        .fold(0.0, f64::max);
    let makespan = st.e.iter().copied().fold(0.0, f64::max);
    Some(GreedyRun {
        variant: v,
        sched: Sched { ranks: st.order },
        span,
        makespan,
    })
}

/// The best of the eight variants by longest stage span, as the authors' generator picks
/// it (first on ties).
///
/// Errors: [`GreedyError::Placement`] unless one stage per rank in a loop;
/// [`GreedyError::Cap`] if every variant runs out of memory.
pub fn zero_bubble_greedy(inst: &Instance) -> Result<GreedyRun, GreedyError> {
    let runs = all_variants(inst)?;
    let mut best: Option<GreedyRun> = None;
    for r in runs {
        if best.as_ref().is_none_or(|b| r.span < b.span) {
            best = Some(r);
        }
    }
    best.ok_or(GreedyError::Cap)
}

/// Every variant that fits the cap, in the generator's order.
///
/// Errors: [`GreedyError::Placement`].
pub fn all_variants(inst: &Instance) -> Result<Vec<GreedyRun>, GreedyError> {
    if inst.s != inst.p
        || !matches!(
            inst.pipeline.placement,
            PlacementKind::Loop | PlacementKind::Explicit
        )
        || (0..inst.s).any(|s| inst.rank_of[s] as usize != s)
    {
        return Err(GreedyError::Placement);
    }
    Ok(Variant::all()
        .into_iter()
        .filter_map(|v| run_variant(inst, v))
        .collect())
}
