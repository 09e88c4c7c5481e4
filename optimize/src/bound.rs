//! Lower bounds on the makespan of any schedule of an instance (for the optimality gap and
//! to stop a search that has reached one).
//!
//! Three arguments, each over the stage graph with message times on cross-rank edges:
//!
//! 1. A rank cannot start before the first forward reaches its earliest stage, and then has
//!    all its work to do: `head_r + work_r`. For loop placements with F = B = W = 1 on the
//!    last rank this is `(P - 1) + 3M`, the bound ZB-H1 meets (Qi et al., arXiv 2401.10241,
//!    §2.1).
//! 2. A rank's forwards and input-gradient backwards all end before the gradient of its
//!    last backward has travelled back to the first stage: `head_r + Σ (F + B) + min tail`.
//! 3. The first stage of a direction runs its M forwards one after another and the last
//!    micro-batch then goes the whole way down and back; its M backwards cannot start
//!    before the first gradient returns.
//! 4. Memory (with a cap): until the first gradient can reach a rank, it can only run
//!    forwards, at most `cap` of them (nothing frees an activation before a backward); the
//!    rest of its work comes after. For 1F1B's memory (cap P) on a loop with F = 1, B = 2,
//!    W = 1 this is rank 0's `P F + (P - 1) B + M (F + B + W) - P F`: 78 at P = 8, M = 16,
//!    which ZB-H1 meets.
//!
//! **Overlapped pairs.** When the cost model's `FB` makes a pair quicker than its two ops
//! back to back, every argument runs on a relaxed instance whose op times are all scaled by
//! `ρ = min(1, min over stages f, b of FB_b / (F_f + max(B_b, BW_b)))`: a plain op then
//! takes at least its relaxed time and a pair (plain or fused) at least the relaxed times of
//! what it holds, so each argument stays a lower bound.

use crate::instance::Instance;

/// Per-stage heads and tails of one micro-batch's chain (seconds).
pub struct Chains {
    /// Earliest start of `F(s, 0)`.
    pub head_f: Vec<f64>,
    /// Earliest start of the backward of `(s, 0)`.
    pub head_b: Vec<f64>,
    /// Longest path after the backward of `(s, k)` ends, through the earlier stages'
    /// backwards (weight gradients excluded).
    pub tail_b: Vec<f64>,
    /// Longest path after `F(s, k)` ends.
    pub tail_f: Vec<f64>,
}

fn cross(inst: &Instance, a: usize, b: usize) -> f64 {
    if inst.rank_of[a] == inst.rank_of[b] {
        0.0
    } else {
        inst.lat
    }
}

/// The fastest backward-input op of stage `s`: `B`, or `BW` if that is quicker.
pub fn bmin(inst: &Instance, s: usize) -> f64 {
    inst.d_b[s].min(inst.d_bw[s])
}

impl Chains {
    /// Computes the chains.
    pub fn new(inst: &Instance) -> Self {
        let n = inst.s;
        let mut head_f = vec![0.0; n];
        // Stages of a direction are consecutive ids, prev = s - 1.
        for s in 0..n {
            if let Some(ps) = inst.prev[s] {
                let ps = ps as usize;
                head_f[s] = head_f[ps] + inst.d_f[ps] + cross(inst, ps, s);
            }
        }
        let mut head_b = vec![0.0; n];
        for s in (0..n).rev() {
            head_b[s] = match inst.next[s] {
                None => head_f[s] + inst.d_f[s],
                Some(ns) => {
                    let ns = ns as usize;
                    head_b[ns] + bmin(inst, ns) + cross(inst, ns, s)
                }
            };
        }
        let mut tail_b = vec![0.0; n];
        for s in 0..n {
            if let Some(ps) = inst.prev[s] {
                let ps = ps as usize;
                tail_b[s] = cross(inst, s, ps) + bmin(inst, ps) + tail_b[ps];
            }
        }
        let mut tail_f = vec![0.0; n];
        for s in (0..n).rev() {
            tail_f[s] = match inst.next[s] {
                None => bmin(inst, s) + tail_b[s],
                Some(ns) => {
                    let ns = ns as usize;
                    cross(inst, s, ns) + inst.d_f[ns] + tail_f[ns]
                }
            };
        }
        Chains {
            head_f,
            head_b,
            tail_b,
            tail_f,
        }
    }
}

/// The pair discount `ρ` of the module docs (1 when no pair is quicker than its ops).
pub fn pair_relaxation(inst: &Instance) -> f64 {
    let mut rho: f64 = 1.0;
    for b in 0..inst.s {
        if let Some(fb) = inst.d_fb[b] {
            for f in 0..inst.s {
                rho = rho.min(fb / (inst.d_f[f] + inst.d_b[b].max(inst.d_bw[b])));
            }
        }
    }
    rho
}

/// A lower bound on the makespan of every schedule of `inst` (any cap), seconds.
pub fn lower_bound(inst: &Instance) -> f64 {
    let rho = pair_relaxation(inst);
    if rho < 1.0 - 1e-12 {
        let mut relaxed = inst.clone();
        for d in [
            &mut relaxed.d_f,
            &mut relaxed.d_b,
            &mut relaxed.d_w,
            &mut relaxed.d_bw,
        ] {
            d.iter_mut().for_each(|x| *x *= rho);
        }
        relaxed.d_fb = vec![None; relaxed.s];
        return lower_bound_plain(&relaxed);
    }
    lower_bound_plain(inst)
}

fn lower_bound_plain(inst: &Instance) -> f64 {
    let c = Chains::new(inst);
    let m = inst.m as f64;
    let mut lb: f64 = 0.0;
    for r in 0..inst.p {
        let st = &inst.stages_of[r];
        if st.is_empty() {
            continue;
        }
        let head = st
            .iter()
            .map(|&s| c.head_f[s as usize])
            .fold(f64::INFINITY, f64::min);
        lb = lb.max(head + inst.work(r));
        let fb: f64 = st
            .iter()
            .map(|&s| m * (inst.d_f[s as usize] + bmin(inst, s as usize)))
            .sum();
        let tail = st
            .iter()
            .map(|&s| c.tail_b[s as usize])
            .fold(f64::INFINITY, f64::min);
        lb = lb.max(head + fb + tail);
    }
    if inst.cap != u64::MAX {
        for r in 0..inst.p {
            let st = &inst.stages_of[r];
            if st.is_empty() {
                continue;
            }
            let first_b = st
                .iter()
                .map(|&s| c.head_b[s as usize])
                .fold(f64::INFINITY, f64::min);
            let n_f = (st.len() * inst.m) as u64;
            let max_f = st.iter().map(|&s| inst.d_f[s as usize]).fold(0.0, f64::max);
            let early = inst.cap.min(n_f) as f64 * max_f;
            lb = lb.max(first_b + inst.work(r) - early);
        }
    }
    for s in 0..inst.s {
        if inst.prev[s].is_none() {
            // First stage of a direction.
            lb = lb.max((m - 1.0) * inst.d_f[s] + inst.d_f[s] + c.tail_f[s]);
            lb = lb.max(c.head_b[s] + m * bmin(inst, s));
        }
    }
    lb
}
