//! List scheduling: per-rank orders built from a priority per op by a deterministic
//! cross-rank greedy under a cost model (the `list r { ... }` item of the schedule language).
//!
//! The input is the set of compute ops of a pipeline (every `F`, and `BW` or `B` and `W`, of
//! every (stage, micro-batch)), each with an integer priority, the rules of the block and the
//! op times. The output is one order per rank. The greedy simulates time:
//!
//! * Each rank has an **order**: its ops sorted by (priority, kind `F < B = BW < W`, stage,
//!   micro-batch), the smaller first. The first op of the order not yet run is the rank's
//!   **head**. An op is **ready** once its input exists: the forward of the previous stage
//!   (`F`); the backward of the next stage, or on a last stage its own forward (`B`, `BW`);
//!   its own `B` (`W`). Crossing ranks adds the message latency.
//! * A rank runs its head as soon as the rank is free and the head is ready and allowed by
//!   the rules.
//! * **Backfilling**: while the head cannot start, the rank may run a later op of its order
//!   that is ready and allowed, provided it ends before the head can possibly start (a lower
//!   bound computed along the head's chain of inputs, from the other ranks' clocks), so it
//!   never delays the head (conservative backfilling, Mu'alem and Feitelson, IEEE TPDS 12(6),
//!   2001). Ops of one kind on one stage keep their relative order: only the first not yet
//!   run of each (kind, stage) may backfill.
//! * `memory <= k`: a forward may start only if the rank then holds at most `k` live
//!   activations (chunk units: `F` allocates, `BW` or `W` frees, as `schedc check` counts);
//!   a forward taken out of order must also keep every later point of the order under `k`
//!   (the ops before it in the order, counting a backward's release as prompt).
//! * `inflight <= k`: at most `k` micro-batches in flight per rank (one is in flight from its
//!   first forward on the rank until its last backward there); a micro-batch enters a rank
//!   out of order (by micro-batch, then direction) only while a slot stays free for the next
//!   in order, so the oldest unfinished one can always enter.
//! * `defer W`: weight gradients leave the order; the rank runs one (smallest priority first
//!   among those whose `B` has run) only where it ends before the head and every backfill
//!   candidate can start (a bubble), when the memory cap blocks the head, or when nothing else
//!   is left — Zero Bubble's placement of W (Qi et al., ICLR 2024, §3). A second form is
//!   also tried (below): while the rank still has forwards to run, a ready `W` whose priority
//!   comes before the head's runs first, as if it were in the order (its priority places it
//!   in a building block's free slot, as the Controllable Memory authors' `put_w` does,
//!   `zbv_greedy.py`); from the rank's last forward on (the cooldown) it only fills bubbles.
//!   A `W` never waits for a slot: one whose `B` has not run does not hold the head back.
//! * `strict`: no backfilling; the order is run as it is (deferred W's still fill bubbles).
//! * `memory offload` / `memory recompute` (with `memory <= k`): instead of waiting, a rank
//!   whose next forward would exceed `k` offloads the live activation whose backward comes
//!   last in its order (reloading it before that backward, offloading another if needed), or
//!   runs forwards that would take its last free unit checkpointed (`F(s,m)!`, recomputed
//!   before the backward, whose time then includes the recompute). The orders come back as
//!   [`Step`]s; `early_reloads` then moves each reload one op ahead where the cap allows.
//!
//! Time advances from event to event (an op ends, a message arrives); at each event every idle
//! rank, lowest first, may start one op, so the result is the schedule a list scheduler
//! produces in simulated time. [`schedule`] runs the greedy in variants (backfilling any op,
//! or only backwards and weight gradients; with `defer W`, also each with `W` due at its
//! priority before the cooldown) and keeps the orders with the shortest makespan when run as
//! they are (from t0, each op as soon as its rank is free and its input has arrived);
//! `strict` runs it once without backfilling. Every choice is a pure function of the input:
//! the orders are deterministic.
//! A run makes one decision per idle rank per event: about one per op, plus the ranks that
//! wait. One decision costs `O(kinds x stages per rank)`, `O(log ops)` under a memory cap,
//! and the lower bound along a chain of inputs only where the decision reads it (a ready op
//! that might backfill, or a deferred W): first a quick bound (the chain's last input starting
//! now), and the walk along the chain, memoized per state, only when the quick bound cannot
//! decide. The decisions are those of the full computation (the bench `list` and the book's
//! "List scheduling" give the times; before, every idle rank walked its chain at every event,
//! which grew as P^3).

use crate::sim::cost::CostModel;
use schedc_ir::{Kind, Pipeline};
use std::cmp::Ordering;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// One op to schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    /// F, B, W or BW.
    pub kind: Kind,
    /// Stage id.
    pub stage: u32,
    /// Micro-batch.
    pub mb: u32,
    /// Priority: the smaller runs first.
    pub prio: i64,
}

/// The rules of a `list` block, per rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    /// `memory <= k`: live activations per rank (chunk units), one bound per rank.
    pub memory: Option<Vec<i64>>,
    /// `inflight <= k`: micro-batches in flight per rank, one bound per rank.
    pub inflight: Option<Vec<i64>>,
    /// `defer W`.
    pub defer_w: bool,
    /// `strict`: no backfilling; every rank runs its order as is.
    pub strict: bool,
    /// What a rank does when its next forward (or the reload or recompute before a
    /// backward) would exceed `memory` (`memory offload|recompute|wait`; `Wait` by default).
    pub policy: MemPolicy,
}

/// The `memory offload|recompute|wait` line of a `list` block: what a rank does when its
/// next op would exceed the `memory <=` cap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MemPolicy {
    /// Wait until a backward frees memory (the behaviour without the line).
    #[default]
    Wait,
    /// Offload (`OFFLOAD(s,m)`) the live activation whose backward comes last in the rank's
    /// order, run the forward, and reload it (`RELOAD(s,m)`) right before its backward.
    Offload,
    /// Keep the last unit under the cap free: a forward that would take it runs
    /// checkpointed (`F(s,m)!`, its unit held only while it runs) and its backward is
    /// preceded by `RECOMPUTE(s,m)`, which costs a forward of the stage.
    Recompute,
}

impl MemPolicy {
    /// The word of the `memory` line: `wait`, `offload` or `recompute`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemPolicy::Wait => "wait",
            MemPolicy::Offload => "offload",
            MemPolicy::Recompute => "recompute",
        }
    }
}

/// One step of a rank's order: a compute op, or a memory op on the activations of a forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The op (index into the ops).
    Op(usize),
    /// `OFFLOAD` of the activations of forward `ops[i]`.
    Offload(usize),
    /// `RELOAD` of the activations of forward `ops[i]`.
    Reload(usize),
    /// `RECOMPUTE` of forward `ops[i]` (checkpointed).
    Recompute(usize),
}

/// The orders [`schedule`] builds: per rank, its steps in execution order, and which
/// forwards run checkpointed (`F(s,m)!`), by op index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Orders {
    /// Per rank, the steps in execution order.
    pub ranks: Vec<Vec<Step>>,
    /// Per op: whether it is a checkpointed forward.
    pub checkpointed: Vec<bool>,
}

/// Why the greedy cannot finish: no rank can start anything, yet ops remain.
#[derive(Clone, Debug, PartialEq)]
pub struct Stuck {
    /// Simulated time at which every rank is stuck.
    pub time: f64,
    /// Ops run so far.
    pub done: usize,
    /// Per stuck rank: (rank, index of its head op, what blocks it).
    pub ranks: Vec<(u32, usize, Blocker)>,
}

/// What keeps a rank's head from starting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocker {
    /// The memory cap (`memory <= k`), at this many live activations.
    Memory(i64),
    /// The in-flight cap (`inflight <= k`), at this many micro-batches in flight.
    Inflight(i64),
    /// Its input: the op (index) that has not run.
    Input(usize),
}

const NONE: u32 = u32::MAX;
const EPS: f64 = 1e-9;

/// Class of a kind for dependencies: 0 forward, 1 backward (B or BW), 2 weight gradient.
fn class(k: Kind) -> usize {
    match k {
        Kind::F => 0,
        Kind::B | Kind::BW => 1,
        Kind::W => 2,
    }
}

/// Builds the per-rank orders of `ops` on pipeline `pl` (every op's stage must be in range;
/// the set must hold each (stage, micro-batch)'s `F` and either its `BW` or its `B` and `W`,
/// once). Op times come from `cost` (`CostModel::op_time`, seconds); a dependency between
/// two ranks adds `cost.message_time()`.
///
/// Returns, per rank, the indices into `ops` in execution order.
///
/// The greedy runs in variants: backfilling any op, or backfilling only backwards and weight
/// gradients (forwards keep their order); with `defer W`, each of these also with a ready `W`
/// due at its priority while the rank has forwards left (see the module doc). Each variant's
/// orders are run as they are, from t0 under the same op times and message latency, and the
/// shortest makespan is kept (on a tie, the earlier variant). Keeping the best of a few
/// deterministic greedy variants is what the Zero Bubble authors' scheduler does (`zb.py`,
/// eight variants). Under `memory <=` with `defer W`, two more variants (backfilling any op,
/// `W` deferred or due) count no release by the backwards ahead in a backfilled forward's
/// memory look-ahead. Unless the op times are already unit with free messages, every variant
/// is also simulated under unit op times and free messages (the slot model of the Controllable
/// Memory authors' generator), its orders again replayed under the real times.
///
/// Errors: [`Stuck`] when no rank can start an op (a memory or in-flight cap that the
/// priorities cannot meet) in every variant; the first variant's is returned.
pub fn schedule(
    pl: &Pipeline,
    ops: &[Op],
    rules: &Rules,
    cost: &CostModel,
) -> Result<Orders, Stuck> {
    let dur: Vec<f64> = ops.iter().map(|o| cost.op_time(o.kind, o.stage)).collect();
    let comm = cost.message_time();
    if rules.strict {
        return run(pl, ops, rules, &dur, comm, Variant::STRICT)
            .map(|r| early_reloads(ops, rules, r.0));
    }
    let pred = inputs(pl, ops);
    let mut best: Option<(Orders, f64)> = None;
    let mut first_err = None;
    // The greedy's own simulation under the real op times, then under unit op times with free
    // messages (the slot model of the Zero Bubble and Controllable Memory generators): the
    // orders from either are replayed under the real times.
    let unit: Vec<f64> = ops
        .iter()
        .map(|o| if o.kind == Kind::BW { 2.0 } else { 1.0 })
        .collect();
    let sims: [(&[f64], f64); 2] = [(&dur, comm), (&unit, 0.0)];
    // Under unit times already, the second simulation is the first.
    let nsims = if comm == 0.0 && dur == unit { 1 } else { 2 };
    let variants = sims[..nsims]
        .iter()
        .flat_map(|&(d, c)| Variant::ALL.into_iter().map(move |v| (d, c, v)));
    for (sim_dur, sim_comm, v) in variants {
        if (v.w_due || v.late_release) && !rules.defer_w || v.late_release && rules.memory.is_none()
        {
            continue;
        }
        match run(pl, ops, rules, sim_dur, sim_comm, v) {
            Ok((o, _)) => {
                let t = replay(&pred, &o.ranks, &dur, comm);
                if best.as_ref().is_none_or(|b| t < b.1 - EPS) {
                    best = Some((o, t));
                }
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match best {
        Some((o, _)) => Ok(early_reloads(ops, rules, o)),
        None => Err(first_err.expect("a variant ran")),
    }
}

/// The one input of each op (index into `ops`, or `NONE`): the forward of the previous
/// stage (`F`); the backward of the next stage, or on a last stage its own forward (`B`,
/// `BW`); its own `B` (`W`).
fn inputs(pl: &Pipeline, ops: &[Op]) -> Vec<u32> {
    let mbs = pl.microbatches as usize;
    let key = |c: usize, s: u32, m: u32| (c * pl.stages as usize + s as usize) * mbs + m as usize;
    let mut by_key = vec![NONE; 3 * pl.stages as usize * mbs];
    for (i, o) in ops.iter().enumerate() {
        by_key[key(class(o.kind), o.stage, o.mb)] = i as u32;
    }
    ops.iter()
        .map(|o| match o.kind {
            Kind::F => pl
                .prev_stage(o.stage)
                .map_or(NONE, |ps| by_key[key(0, ps, o.mb)]),
            Kind::B | Kind::BW => match pl.next_stage(o.stage) {
                Some(ns) => by_key[key(1, ns, o.mb)],
                None => by_key[key(0, o.stage, o.mb)],
            },
            Kind::W => by_key[key(1, o.stage, o.mb)],
        })
        .collect()
}

/// Moves each `RELOAD` one compute op earlier on its rank where the cap allows it (that op
/// run with one more unit live), or, where an `OFFLOAD` makes room for it, the pair (that op
/// then runs with one unit out and one in), so that the copy, on the host-copy stream, runs
/// under that op and the backward does not wait for it (just in time, as
/// `specs/1f1b_offload.sched` reloads one backward ahead). Live units are counted as `schedc check` counts them: a
/// forward allocates as it starts (`F(s,m)!` releases at its end), `OFFLOAD` frees,
/// `RELOAD` and `RECOMPUTE` allocate, `BW` and `W` free at their end.
fn early_reloads(ops: &[Op], rules: &Rules, mut orders: Orders) -> Orders {
    let Some(caps) = &rules.memory else {
        return orders;
    };
    for (r, steps) in orders.ranks.iter_mut().enumerate() {
        // Peak live units while each step runs.
        let mut live = 0i64;
        let mut peak = vec![0i64; steps.len()];
        for (j, st) in steps.iter().enumerate() {
            match *st {
                Step::Op(i) => {
                    let o = &ops[i];
                    peak[j] = live + i64::from(o.kind == Kind::F);
                    match o.kind {
                        Kind::F if !orders.checkpointed[i] => live += 1,
                        Kind::W | Kind::BW => live -= 1,
                        _ => {}
                    }
                }
                Step::Offload(_) => {
                    peak[j] = live;
                    live -= 1;
                }
                Step::Reload(_) | Step::Recompute(_) => {
                    live += 1;
                    peak[j] = live;
                }
            }
        }
        for j in 1..steps.len() {
            if !matches!(steps[j], Step::Reload(_)) {
                continue;
            }
            match steps[j - 1] {
                Step::Op(_) if peak[j - 1] < caps[r] => {
                    steps.swap(j - 1, j);
                    peak.swap(j - 1, j);
                    peak[j] += 1;
                }
                // The offload that makes room for the reload goes ahead with it (the op
                // between runs with one unit out and one in: the same peak), unless that op
                // is the offloaded forward itself.
                Step::Offload(v) if j >= 2 => {
                    if let Step::Op(p) = steps[j - 2] {
                        if p != v {
                            steps[j - 2..=j].rotate_right(1);
                            steps[j - 2..=j].rotate_right(1);
                            peak[j - 2..=j].rotate_right(2);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    orders
}

/// Per op, the index of the forward of its (stage, micro-batch); per forward, the index of
/// its backward (`B` or `BW`); `NONE` where there is none.
fn pairs(pl: &Pipeline, ops: &[Op]) -> (Vec<u32>, Vec<u32>) {
    let mbs = pl.microbatches as usize;
    let key = |s: u32, m: u32| s as usize * mbs + m as usize;
    let n = pl.stages as usize * mbs;
    let (mut f_by, mut b_by) = (vec![NONE; n], vec![NONE; n]);
    for (i, o) in ops.iter().enumerate() {
        match o.kind {
            Kind::F => f_by[key(o.stage, o.mb)] = i as u32,
            Kind::B | Kind::BW => b_by[key(o.stage, o.mb)] = i as u32,
            Kind::W => {}
        }
    }
    let fwd_of = ops.iter().map(|o| f_by[key(o.stage, o.mb)]).collect();
    let bwd_of = ops
        .iter()
        .map(|o| {
            if o.kind == Kind::F {
                b_by[key(o.stage, o.mb)]
            } else {
                NONE
            }
        })
        .collect();
    (fwd_of, bwd_of)
}

/// The makespan (seconds from the first op's start) of per-rank `orders` run eagerly: each
/// op starts once its rank is free and its input has ended (plus `comm` across ranks); a
/// `RECOMPUTE` takes its forward's time on the rank, an `OFFLOAD` or `RELOAD` none (its copy
/// runs on the host-copy stream, which the greedy does not model).
/// Orders that cannot run (a cycle) give infinity.
fn replay(pred: &[u32], orders: &[Vec<Step>], dur: &[f64], comm: f64) -> f64 {
    let mut op_rank = vec![0u32; pred.len()];
    for (r, o) in orders.iter().enumerate() {
        for st in o {
            if let Step::Op(i) = *st {
                op_rank[i] = r as u32;
            }
        }
    }
    let mut end = vec![f64::NAN; pred.len()];
    let mut pos = vec![0usize; orders.len()];
    let mut free = vec![0f64; orders.len()];
    let mut left: usize = orders.iter().map(Vec::len).sum();
    loop {
        let mut progress = false;
        for (r, o) in orders.iter().enumerate() {
            while let Some(&st) = o.get(pos[r]) {
                let i = match st {
                    Step::Op(i) => i,
                    Step::Recompute(f) => {
                        free[r] += dur[f];
                        pos[r] += 1;
                        left -= 1;
                        progress = true;
                        continue;
                    }
                    Step::Offload(_) | Step::Reload(_) => {
                        pos[r] += 1;
                        left -= 1;
                        progress = true;
                        continue;
                    }
                };
                let p = pred[i];
                let ready = if p == NONE {
                    0.0
                } else if end[p as usize].is_nan() {
                    break;
                } else if op_rank[p as usize] != r as u32 {
                    end[p as usize] + comm
                } else {
                    end[p as usize]
                };
                let s = ready.max(free[r]);
                end[i] = s + dur[i];
                free[r] = end[i];
                pos[r] += 1;
                left -= 1;
                progress = true;
            }
        }
        if left == 0 {
            return free.iter().copied().fold(0.0, f64::max);
        }
        if !progress {
            return f64::INFINITY;
        }
    }
}

/// The policy of one greedy run.
#[derive(Clone, Copy, Debug)]
struct Variant {
    /// Whether forwards may run out of order (backfill).
    backfill_forwards: bool,
    /// Whether a deferred `W` whose priority comes before the head runs first while the rank
    /// has forwards left.
    w_due: bool,
    /// Under `memory <= k` with `defer W`: a forward taken out of order must keep every later
    /// point of the order under `k` counting no release at all by the backwards ahead (their
    /// deferred `W` may run late), so that it never takes the memory a forward due before it
    /// needs. Without it the look-ahead counts each backward's `W` as prompt.
    late_release: bool,
}

impl Variant {
    const STRICT: Variant = Variant {
        backfill_forwards: false,
        w_due: false,
        late_release: false,
    };
    /// The variants [`schedule`] tries, in order (on a tie the earlier is kept).
    const ALL: [Variant; 6] = [
        Variant::new(true, false, false),
        Variant::new(false, false, false),
        Variant::new(true, true, false),
        Variant::new(false, true, false),
        Variant::new(true, false, true),
        Variant::new(true, true, true),
    ];
    const fn new(backfill_forwards: bool, w_due: bool, late_release: bool) -> Variant {
        Variant {
            backfill_forwards,
            w_due,
            late_release,
        }
    }
}

/// One greedy run with op times `dur` (seconds, per op), message latency `comm` and policy
/// `v`. Returns the orders and the simulated makespan.
fn run(
    pl: &Pipeline,
    ops: &[Op],
    rules: &Rules,
    dur: &[f64],
    comm: f64,
    v: Variant,
) -> Result<(Orders, f64), Stuck> {
    let Variant {
        backfill_forwards,
        w_due,
        late_release,
    } = v;
    let np = pl.pp as usize;
    let mbs = pl.microbatches as usize;
    let n = ops.len();
    let rank_of: Vec<u32> = ops.iter().map(|o| pl.rank_of(o.stage)).collect();
    let pred = inputs(pl, ops);
    let (fwd_of, bwd_of) = pairs(pl, ops);
    // Op times as the greedy runs them: a backward of a checkpointed forward also runs its
    // recompute (the forward's time).
    let mut dur_eff: Vec<f64> = dur.to_vec();
    let dur_in = dur;
    let policy = if rules.memory.is_some() {
        rules.policy
    } else {
        MemPolicy::Wait
    };
    // Checkpointed forwards, offloaded forwards, and per rank the forwards that may be
    // offloaded (on the device, backward not started), by their backward's position.
    let mut ckpt = vec![false; n];
    let mut evicted = vec![false; n];
    let mut victims: Vec<std::collections::BTreeSet<(u32, u32)>> =
        vec![std::collections::BTreeSet::new(); np];
    let mut succ_start = vec![0u32; n + 1];
    for &p in &pred {
        if p != NONE {
            succ_start[p as usize + 1] += 1;
        }
    }
    for i in 0..n {
        succ_start[i + 1] += succ_start[i];
    }
    let mut succ = vec![0u32; succ_start[n] as usize];
    let mut fill = succ_start.clone();
    for (i, &p) in pred.iter().enumerate() {
        if p != NONE {
            succ[fill[p as usize] as usize] = i as u32;
            fill[p as usize] += 1;
        }
    }
    drop(fill);
    let deferred = |o: &Op| rules.defer_w && o.kind == Kind::W;
    let cmp_ops = |a: u32, b: u32| {
        let (x, y) = (&ops[a as usize], &ops[b as usize]);
        (x.prio, class(x.kind), x.stage, x.mb).cmp(&(y.prio, class(y.kind), y.stage, y.mb))
    };
    // Per-rank order (non-deferred ops), per-rank queues per (class, stage), and each op's
    // position in its rank's order.
    let mut order: Vec<Vec<u32>> = vec![Vec::new(); np];
    for (i, o) in ops.iter().enumerate() {
        if !deferred(o) {
            order[rank_of[i] as usize].push(i as u32);
        }
    }
    for v in &mut order {
        v.sort_by(|&a, &b| cmp_ops(a, b));
    }
    let mut queues: Vec<Vec<Vec<u32>>> = Vec::with_capacity(np);
    let mut opos = vec![0u32; n];
    for v in &order {
        let mut qs: Vec<((usize, u32), Vec<u32>)> = Vec::new();
        for &i in v {
            let o = &ops[i as usize];
            let k = (class(o.kind), o.stage);
            match qs.iter_mut().find(|(kk, _)| *kk == k) {
                Some((_, q)) => q.push(i),
                None => qs.push((k, vec![i])),
            }
        }
        queues.push(qs.into_iter().map(|(_, q)| q).collect());
        for (k, &i) in v.iter().enumerate() {
            opos[i as usize] = k as u32;
        }
    }
    // Per rank, over its order: what each op not yet run will add to the live activations
    // (+1 a forward, -1 the op that frees it: BW, W, or B when W is deferred, counting its
    // W as prompt).
    let mem_delta = |o: &Op| match o.kind {
        Kind::F => 1,
        Kind::W | Kind::BW => -1,
        Kind::B if rules.defer_w && !late_release => -1,
        Kind::B => 0,
    };
    let mut mem_tree: Vec<PrefixMax> = order
        .iter()
        .map(|v| PrefixMax::new(v.iter().map(|&i| mem_delta(&ops[i as usize])).collect()))
        .collect();
    // Micro-batch windows: per rank, the backwards of each (direction, micro-batch) still to
    // run there, which ones have entered, and the next to enter.
    let dirs = pl.directions() as usize;
    let mbkey = |o: &Op| o.mb as usize * dirs + (o.stage / pl.stages_per_direction()) as usize;
    let mut bw_left: Vec<Vec<u32>> = vec![vec![0; mbs * dirs]; np];
    for (i, o) in ops.iter().enumerate() {
        if matches!(o.kind, Kind::B | Kind::BW) {
            bw_left[rank_of[i] as usize][mbkey(o)] += 1;
        }
    }
    let mut entered: Vec<Vec<bool>> = vec![vec![false; mbs * dirs]; np];
    // The next (direction, micro-batch) to enter each rank: the smallest that has ops there.
    let next_entry = |bw_left: &[u32], entered: &[bool], from: usize| {
        (from..mbs * dirs)
            .find(|&k| !entered[k] && bw_left[k] > 0)
            .unwrap_or(mbs * dirs)
    };
    let mut next_in: Vec<usize> = (0..np)
        .map(|r| next_entry(&bw_left[r], &entered[r], 0))
        .collect();

    let mut done = vec![false; n];
    let mut end = vec![f64::NAN; n];
    let mut free = vec![0f64; np];
    let mut live = vec![0i64; np];
    let mut inflight = vec![0i64; np];
    let mut head = vec![0usize; np];
    let mut qhead: Vec<Vec<usize>> = queues.iter().map(|q| vec![0; q.len()]).collect();
    let mut remaining: Vec<usize> = vec![0; np];
    let mut fwd_left: Vec<usize> = vec![0; np];
    for (i, r) in rank_of.iter().enumerate() {
        remaining[*r as usize] += 1;
        if ops[i].kind == Kind::F {
            fwd_left[*r as usize] += 1;
        }
    }
    // Deferred W's whose B has run, by priority.
    let mut wready: Vec<BinaryHeap<Reverse<(i64, u32)>>> = vec![BinaryHeap::new(); np];
    let mut out: Vec<Vec<Step>> = vec![Vec::new(); np];
    // Future event times (op ends, message arrivals).
    let mut events: BinaryHeap<Reverse<Time>> = BinaryHeap::new();
    let mut now = 0f64;
    let mut ndone = 0usize;
    let mut memo = BoundMemo::new(n);
    let nonneg = comm >= 0.0 && dur.iter().all(|&d| d >= 0.0);

    loop {
        // Passes over the ranks at `now` while one starts an op of zero (or below EPS)
        // duration: such an op frees its rank, and readies its successors, at `now` itself.
        let mut progressed = true;
        while progressed {
            progressed = false;
            for r in 0..np {
                if remaining[r] == 0 || free[r] > now + EPS {
                    continue;
                }
                let Some(i) = pick(
                    r,
                    now,
                    &Ctx {
                        ops,
                        rules,
                        order: &order[r],
                        queues: &queues[r],
                        qhead: &qhead[r],
                        head: head[r],
                        pred: &pred,
                        rank_of: &rank_of,
                        dur: &dur_eff,
                        opos: &opos,
                        policy,
                        fwd_of: &fwd_of,
                        comm,
                        backfill_forwards,
                        w_due,
                        nonneg,
                    },
                    &State {
                        done: &done,
                        end: &end,
                        free: &free,
                        live: live[r],
                        inflight: inflight[r],
                        entered: &entered[r],
                        next_in: next_in[r],
                        mbkey: &mbkey,
                        mem_tree: &mem_tree[r],
                        wready: &wready[r],
                        fwd_left: fwd_left[r],
                        ckpt: &ckpt,
                        evicted: &evicted,
                        victims: victims[r].len(),
                    },
                    &mut memo,
                ) else {
                    continue;
                };
                // Only an op that ends at `now` changes what a rank can start at `now`:
                // after other starts a further pass is skipped, so the schedule of
                // positive op times is the single pass's, as before.
                // The memory policy's steps before the op.
                let o = ops[i];
                let cap = rules.memory.as_ref().map_or(i64::MAX, |m| m[r]);
                let f = fwd_of[i] as usize;
                let refill = matches!(o.kind, Kind::B | Kind::BW) && (ckpt[f] || evicted[f]);
                let make_room = match o.kind {
                    Kind::F => policy == MemPolicy::Offload && live[r] + 1 > cap,
                    _ => refill && evicted[f] && live[r] + 1 > cap,
                };
                if make_room {
                    // Offload the activation whose backward comes last in the order; for a
                    // reload, not the forward that just ran if there is another (so that
                    // the offload and the reload can go ahead of it, see `early_reloads`).
                    let mut pick = *victims[r].last().expect("allows counted a victim");
                    if o.kind != Kind::F && out[r].last() == Some(&Step::Op(pick.1 as usize)) {
                        if let Some(&second) = victims[r].iter().rev().nth(1) {
                            pick = second;
                        }
                    }
                    victims[r].remove(&pick);
                    let v = pick.1;
                    let v = v as usize;
                    evicted[v] = true;
                    live[r] -= 1;
                    out[r].push(Step::Offload(v));
                    // Its backward now brings the unit back.
                    let b = bwd_of[v] as usize;
                    mem_tree[r].set(opos[b] as usize, mem_delta(&ops[b]) + 1);
                }
                if o.kind == Kind::F
                    && policy == MemPolicy::Recompute
                    && live[r] + 1 + keep_unit(&mem_tree[r], opos[i] as usize) > cap
                {
                    ckpt[i] = true;
                    let b = bwd_of[i] as usize;
                    dur_eff[b] += dur_in[i];
                    mem_tree[r].set(opos[b] as usize, mem_delta(&ops[b]) + 1);
                }
                if refill {
                    out[r].push(if ckpt[f] {
                        Step::Recompute(f)
                    } else {
                        Step::Reload(f)
                    });
                    live[r] += 1;
                }
                if matches!(o.kind, Kind::B | Kind::BW) && policy == MemPolicy::Offload {
                    victims[r].remove(&(opos[i], f as u32));
                }
                if dur_eff[i] <= EPS {
                    progressed = true;
                }
                let e = now + dur_eff[i];
                // The bounds read what has run and the ranks' clocks.
                memo.state += 1;
                done[i] = true;
                end[i] = e;
                free[r] = e;
                remaining[r] -= 1;
                ndone += 1;
                out[r].push(Step::Op(i));
                events.push(Reverse(Time(e)));
                let k = mbkey(&o);
                match o.kind {
                    Kind::F => {
                        if !ckpt[i] {
                            live[r] += 1;
                            if policy == MemPolicy::Offload {
                                victims[r].insert((opos[bwd_of[i] as usize], i as u32));
                            }
                        }
                        fwd_left[r] -= 1;
                        if !entered[r][k] {
                            entered[r][k] = true;
                            inflight[r] += 1;
                            next_in[r] = next_entry(&bw_left[r], &entered[r], next_in[r]);
                        }
                    }
                    Kind::B | Kind::BW => {
                        bw_left[r][k] -= 1;
                        if bw_left[r][k] == 0 {
                            inflight[r] -= 1;
                        }
                        if o.kind == Kind::BW {
                            live[r] -= 1;
                        }
                    }
                    Kind::W => live[r] -= 1,
                }
                if deferred(&o) {
                    wready[r].pop();
                } else {
                    mem_tree[r].set(opos[i] as usize, 0);
                }
                while head[r] < order[r].len() && done[order[r][head[r]] as usize] {
                    head[r] += 1;
                }
                for (q, k) in queues[r].iter().zip(qhead[r].iter_mut()) {
                    while *k < q.len() && done[q[*k] as usize] {
                        *k += 1;
                    }
                }
                for &s in &succ[succ_start[i] as usize..succ_start[i + 1] as usize] {
                    let s = s as usize;
                    let rs = rank_of[s] as usize;
                    if deferred(&ops[s]) {
                        wready[rs].push(Reverse((ops[s].prio, s as u32)));
                    }
                    if rs != r && comm > 0.0 {
                        events.push(Reverse(Time(e + comm)));
                    }
                    let _ = rs;
                }
            }
        }
        if ndone == n {
            let makespan = free.iter().cloned().fold(0.0, f64::max);
            return Ok((
                Orders {
                    ranks: out,
                    checkpointed: ckpt,
                },
                makespan,
            ));
        }
        // The next time something can change.
        let mut next = None;
        while let Some(Reverse(Time(t))) = events.pop() {
            if t > now + EPS {
                next = Some(t);
                break;
            }
        }
        match next {
            Some(t) => {
                now = t;
                memo.state += 1;
            }
            None => {
                // Every rank is idle and none can start: report each one's head.
                let mut stuck = Vec::new();
                for r in 0..np {
                    if remaining[r] == 0 {
                        continue;
                    }
                    let i = match order[r].get(head[r]) {
                        Some(&i) => i as usize,
                        None => match wready[r].peek() {
                            Some(Reverse((_, w))) => *w as usize,
                            None => continue,
                        },
                    };
                    let b = if pred[i] != NONE && !done[pred[i] as usize] {
                        Blocker::Input(pred[i] as usize)
                    } else if rules.memory.as_ref().is_some_and(|m| live[r] + 1 > m[r]) {
                        Blocker::Memory(live[r])
                    } else {
                        Blocker::Inflight(inflight[r])
                    };
                    stuck.push((r as u32, i, b));
                }
                return Err(Stuck {
                    time: now,
                    done: ndone,
                    ranks: stuck,
                });
            }
        }
    }
}

/// A time, ordered (never NaN).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0)
    }
}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// What does not change while one rank decides.
struct Ctx<'a> {
    ops: &'a [Op],
    rules: &'a Rules,
    order: &'a [u32],
    queues: &'a [Vec<u32>],
    qhead: &'a [usize],
    head: usize,
    pred: &'a [u32],
    rank_of: &'a [u32],
    dur: &'a [f64],
    opos: &'a [u32],
    /// The memory policy (`Wait` without a `memory <=` cap).
    policy: MemPolicy,
    /// Per op, the index of its (stage, micro-batch)'s forward.
    fwd_of: &'a [u32],
    comm: f64,
    backfill_forwards: bool,
    /// A deferred `W` whose priority comes before the head runs first (forwards left).
    w_due: bool,
    /// Every op time and the message latency are non-negative (as a validated cost model's
    /// are): a quick bound can then stand in for [`Ctx::lower_bound`] (see
    /// [`Ctx::ends_before`]).
    nonneg: bool,
}

/// The state a decision reads.
struct State<'a> {
    done: &'a [bool],
    end: &'a [f64],
    free: &'a [f64],
    live: i64,
    inflight: i64,
    entered: &'a [bool],
    next_in: usize,
    mbkey: &'a dyn Fn(&Op) -> usize,
    mem_tree: &'a PrefixMax,
    wready: &'a BinaryHeap<Reverse<(i64, u32)>>,
    /// Forwards this rank has still to run.
    fwd_left: usize,
    /// Per op: a forward run checkpointed.
    ckpt: &'a [bool],
    /// Per op: a forward whose activations are offloaded.
    evicted: &'a [bool],
    /// How many of this rank's activations may be offloaded.
    victims: usize,
}

/// Under `memory recompute`: 1 if a forward at position `k` of its rank's order must leave a
/// unit free (its next op in the order is not one that frees a unit: another forward, which
/// may have to run checkpointed and takes the unit while it runs, or a backward that reloads
/// or recomputes), else 0.
fn keep_unit(tree: &PrefixMax, k: usize) -> i64 {
    i64::from(k + 1 >= tree.len || tree.t[tree.n + k + 1].0 >= 0)
}

/// A segment tree over a sequence of small integers: point updates and the largest prefix
/// sum (the empty prefix counts, so it is at least 0) of the first `k` values.
struct PrefixMax {
    n: usize,
    /// The number of values (the leaves past it are padding).
    len: usize,
    /// (sum, largest prefix sum) per node; leaves at `n..2n`.
    t: Vec<(i64, i64)>,
}

impl PrefixMax {
    fn new(v: Vec<i64>) -> Self {
        let len = v.len();
        let n = v.len().next_power_of_two().max(1);
        let mut t = vec![(0, 0); 2 * n];
        for (k, x) in v.into_iter().enumerate() {
            t[n + k] = (x, x.max(0));
        }
        for k in (1..n).rev() {
            t[k] = Self::join(t[2 * k], t[2 * k + 1]);
        }
        PrefixMax { n, t, len }
    }
    fn join(a: (i64, i64), b: (i64, i64)) -> (i64, i64) {
        (a.0 + b.0, a.1.max(a.0 + b.1))
    }
    fn set(&mut self, k: usize, x: i64) {
        let mut k = k + self.n;
        self.t[k] = (x, x.max(0));
        while k > 1 {
            k /= 2;
            self.t[k] = Self::join(self.t[2 * k], self.t[2 * k + 1]);
        }
    }
    /// The largest prefix sum of the values at `0..k`.
    fn prefix_max(&self, k: usize) -> i64 {
        // Left-to-right over the canonical nodes covering 0..k: the left side's in the
        // order found, then the right side's in reverse (at most one per level each; no
        // allocation, as `allows` asks once per candidate and decision).
        let (mut lo, mut hi) = (self.n, self.n + k);
        let mut left = [0usize; 64];
        let mut right = [0usize; 64];
        let (mut nl, mut nr) = (0, 0);
        while lo < hi {
            if lo & 1 == 1 {
                left[nl] = lo;
                nl += 1;
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                right[nr] = hi;
                nr += 1;
            }
            lo /= 2;
            hi /= 2;
        }
        let mut acc = (0i64, 0i64);
        for &k in left[..nl].iter().chain(right[..nr].iter().rev()) {
            acc = Self::join(acc, self.t[k]);
        }
        acc.1
    }
}

impl Ctx<'_> {
    fn ready_at(&self, i: usize, end: &[f64]) -> f64 {
        let p = self.pred[i];
        if p == NONE {
            return 0.0;
        }
        let e = end[p as usize];
        if self.rank_of[p as usize] != self.rank_of[i] {
            e + self.comm
        } else {
            e
        }
    }

    /// A lower bound on when `i` can start, for an `i` whose input has not run: along its
    /// chain of inputs not yet run, each starts no earlier than `now` and its rank's clock.
    /// The value is the input's [`Ctx::end_bound`] plus the message latency across ranks.
    fn lower_bound(&self, i: usize, now: f64, st: &State<'_>, memo: &mut BoundMemo) -> f64 {
        let p = self.pred[i] as usize;
        let e = self.end_bound(p, now, st, memo);
        if self.rank_of[p] != self.rank_of[i] {
            e + self.comm
        } else {
            e
        }
    }

    /// Whether something that ends at `x` ends before `i` (whose input has not run) can
    /// start: `x <= lower_bound(i) + EPS`. Tested first against a quicker bound, `i`'s input
    /// starting at `now` or its rank's clock, whichever is later, whatever its own inputs:
    /// with non-negative times every step of the walk can only raise the bound (rounding is
    /// monotone), so the quick bound is at most the full one, and passing it passes. Only
    /// when it fails is the chain walked: the answer is the full bound's.
    fn ends_before(
        &self,
        x: f64,
        i: usize,
        now: f64,
        st: &State<'_>,
        memo: &mut BoundMemo,
    ) -> bool {
        if self.nonneg {
            let p = self.pred[i] as usize;
            let e = now.max(st.free[self.rank_of[p] as usize]) + self.dur[p];
            let quick = if self.rank_of[p] != self.rank_of[i] {
                e + self.comm
            } else {
                e
            };
            if x <= quick + EPS {
                return true;
            }
        }
        x <= self.lower_bound(i, now, st, memo) + EPS
    }

    /// A lower bound on when op `c`, not yet run, can end: it starts no earlier than `now`,
    /// its rank's clock and its input (its input's bound plus the message latency across
    /// ranks, when the input has not run either), and takes its op time.
    ///
    /// Memoized in `memo` for the current state (see [`BoundMemo`]): ranks whose heads
    /// share a chain of inputs walk it once per state, not once each. The arithmetic is the
    /// same, op by op, as a walk from the earliest op of the chain (the same values).
    fn end_bound(&self, c: usize, now: f64, st: &State<'_>, memo: &mut BoundMemo) -> f64 {
        if memo.stamp[c] == memo.state {
            return memo.val[c];
        }
        // Walk back to the earliest op of the chain not yet run, or to one already bounded.
        let mut chain = std::mem::take(&mut memo.chain);
        chain.clear();
        let mut cur = c;
        loop {
            chain.push(cur);
            let p = self.pred[cur];
            if p == NONE || st.done[p as usize] || memo.stamp[p as usize] == memo.state {
                break;
            }
            cur = p as usize;
        }
        for &x in chain.iter().rev() {
            let p = self.pred[x];
            let t = if p == NONE || st.done[p as usize] {
                self.ready_at(x, st.end).max(now)
            } else {
                let e = memo.val[p as usize];
                if self.rank_of[p as usize] != self.rank_of[x] {
                    e + self.comm
                } else {
                    e
                }
            };
            let s = t.max(st.free[self.rank_of[x] as usize]).max(now);
            memo.val[x] = s + self.dur[x];
            memo.stamp[x] = memo.state;
        }
        memo.chain = chain;
        memo.val[c]
    }

    /// May forward `i` start now, leaving room (memory) for the ops before it in the order,
    /// and entering its micro-batch in order (in-flight window)?
    ///
    /// With `memory offload` or `memory recompute`, the rank's `head` forward may also start
    /// where the policy makes room (an activation to offload; the last unit, which a
    /// checkpointed forward takes only while it runs). A backward whose activations must
    /// come back (reload or recompute) needs a free unit, or one to offload.
    fn allows(&self, i: usize, r: usize, st: &State<'_>, head: bool) -> bool {
        if self.ops[i].kind != Kind::F {
            if let (Some(m), false) = (&self.rules.memory, self.ops[i].kind == Kind::W) {
                let f = self.fwd_of[i] as usize;
                if (st.ckpt[f] || st.evicted[f]) && st.live + 1 > m[r] {
                    return self.policy == MemPolicy::Offload && st.victims > 0;
                }
            }
            return true;
        }
        // Running `i` now, before the ops ahead of it in the order, must keep every later
        // point of the order under the caps (the ops ahead run as if `i` had taken its
        // unit first). Under `memory recompute` a stored forward leaves one unit free.
        let k = self.opos[i] as usize;
        if let Some(m) = &self.rules.memory {
            let reserve = match self.policy {
                MemPolicy::Recompute if head => keep_unit(st.mem_tree, k),
                MemPolicy::Recompute => 1,
                _ => 0,
            };
            let ahead = st.mem_tree.prefix_max(k);
            if st.live + 1 + reserve + ahead > m[r] {
                let room = head
                    && match self.policy {
                        MemPolicy::Wait => false,
                        MemPolicy::Recompute => st.live + 1 + ahead <= m[r],
                        MemPolicy::Offload => st.victims > 0 && st.live + ahead <= m[r],
                    };
                if !room {
                    return false;
                }
            }
        }
        if let Some(m) = &self.rules.inflight {
            // A micro-batch new to this rank enters into a free slot; one out of order only
            // while a slot stays free for the next in order, so that the oldest unfinished
            // micro-batch can always enter.
            let key = (st.mbkey)(&self.ops[i]);
            let need = if key == st.next_in { 1 } else { 2 };
            if !st.entered[key] && st.inflight + need > m[r] {
                return false;
            }
        }
        true
    }
}

/// Memo of [`Ctx::end_bound`] per op: a value counts while its stamp equals `state`, the
/// number of the current state. `run` moves to a new number whenever the simulated time
/// advances or an op starts (everything a bound reads: what has run, when it ends, the
/// ranks' clocks, the time).
struct BoundMemo {
    val: Vec<f64>,
    stamp: Vec<u64>,
    state: u64,
    /// Scratch: a chain of inputs being walked.
    chain: Vec<usize>,
    /// Scratch: ops whose start bound `pick` may need.
    lazy: Vec<usize>,
}

impl BoundMemo {
    fn new(n: usize) -> Self {
        BoundMemo {
            val: vec![0.0; n],
            stamp: vec![0; n],
            state: 1,
            chain: Vec::new(),
            lazy: Vec::new(),
        }
    }
}

/// The op rank `r` starts at `now`, if any: with `w_due` and forwards left, a ready deferred
/// W whose priority comes before the head; else its head if ready and allowed; else the
/// smallest-priority backfill candidate that ends before the head can start; else a deferred
/// W (in a bubble, or to free memory the cap needs).
///
/// A lower bound along a chain of inputs is consulted only where a decision reads it: the
/// head's when a ready candidate may backfill before it, and, for a deferred W in a bubble,
/// each one until one shows that the W would not end in time, each through
/// [`Ctx::ends_before`] (a quick bound first). The W's test against the smallest bound,
/// `now + w <= min(bounds) + EPS`, is made bound by bound (rounding is monotone, so the two
/// agree): the decision is the one the full computation gives.
fn pick(r: usize, now: f64, cx: &Ctx<'_>, st: &State<'_>, memo: &mut BoundMemo) -> Option<usize> {
    let mut h = cx.head;
    while h < cx.order.len() && st.done[cx.order[h] as usize] {
        h += 1;
    }
    let head_op = cx.order.get(h).map(|&i| i as usize);
    if cx.w_due && st.fwd_left > 0 {
        if let Some(Reverse((p, w))) = st.wready.peek() {
            let before = match head_op {
                None => true,
                Some(i) => {
                    let (x, y) = (&cx.ops[*w as usize], &cx.ops[i]);
                    (*p, 2, x.stage, x.mb) < (y.prio, class(y.kind), y.stage, y.mb)
                }
            };
            if before {
                return Some(*w as usize);
            }
        }
    }
    let mut mem_blocked = false;
    // When the head can start: `horizon`, or, while `lazy_head`, the head's lower bound, not
    // yet computed.
    let mut lazy_head = None;
    // Under a memory policy, a ready W that frees memory runs before the policy offloads or
    // checkpoints.
    if let (Some(i), true) = (head_op, cx.policy != MemPolicy::Wait) {
        if !cx.allows(i, r, st, false) {
            if let Some(Reverse((_, w))) = st.wready.peek() {
                return Some(*w as usize);
            }
        }
    }
    let horizon = match head_op {
        None => f64::INFINITY,
        Some(i) if !cx.allows(i, r, st, true) => {
            mem_blocked = cx.rules.memory.as_ref().is_some_and(|m| st.live + 1 > m[r]);
            f64::INFINITY
        }
        Some(i) => {
            let t = cx.ready_at(i, st.end);
            if t.is_nan() {
                lazy_head = Some(i);
                f64::INFINITY
            } else if t <= now + EPS {
                return Some(i);
            } else {
                t
            }
        }
    };
    // Backfill: the first op not yet run of each (kind, stage) queue. A deferred W must not
    // delay any of them either: `w_horizon` is the smallest of their known start times, and
    // `lazy` the candidates whose start is a lower bound not yet computed.
    let mut lazy = std::mem::take(&mut memo.lazy);
    lazy.clear();
    let mut best: Option<(i64, usize)> = None;
    let mut w_horizon = horizon;
    for (q, &k) in cx.queues.iter().zip(cx.qhead.iter()) {
        if cx.rules.strict {
            break;
        }
        let mut k = k;
        while k < q.len() && st.done[q[k] as usize] {
            k += 1;
        }
        let Some(&i) = q.get(k) else { continue };
        let i = i as usize;
        if Some(i) == head_op || !cx.allows(i, r, st, false) {
            continue;
        }
        if !cx.backfill_forwards && cx.ops[i].kind == Kind::F {
            continue;
        }
        let t = cx.ready_at(i, st.end);
        if t.is_nan() {
            lazy.push(i);
            continue;
        }
        if t > now + EPS {
            w_horizon = w_horizon.min(t);
            continue;
        }
        let x = now + cx.dur[i];
        let fits = match lazy_head {
            Some(hd) => cx.ends_before(x, hd, now, st, memo),
            None => x <= horizon + EPS,
        };
        if !fits {
            continue;
        }
        let key = (cx.ops[i].prio, i);
        if best.is_none_or(|b| key < b) {
            best = Some(key);
        }
    }
    let pick_w = |memo: &mut BoundMemo, lazy: &[usize]| {
        if mem_blocked {
            if let Some(Reverse((_, w))) = st.wready.peek() {
                return Some(*w as usize);
            }
        }
        if let Some((_, i)) = best {
            return Some(i);
        }
        let Reverse((_, w)) = st.wready.peek()?;
        let w = *w as usize;
        if head_op.is_none() {
            return Some(w);
        }
        // `x <= min(bounds) + EPS` if and only if `x <= b + EPS` for every bound `b`.
        let x = now + cx.dur[w];
        // Not `x > ...`: an incomparable (NaN) bound refuses the W, as `<=` did.
        if x.partial_cmp(&(w_horizon + EPS))
            .is_none_or(|o| o == Ordering::Greater)
        {
            return None;
        }
        for &i in lazy_head.iter().chain(lazy) {
            if !cx.ends_before(x, i, now, st, memo) {
                return None;
            }
        }
        Some(w)
    };
    let out = pick_w(memo, &lazy);
    memo.lazy = lazy;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedc_ir::PlacementKind;

    /// V-Half's priorities (specs/v_half.sched) at P = 8, M = 24 under profA op times
    /// (F = 1, B = 1.1, W = 0.9, 0.05 per message; shared/reference/zb): the greedy with `W`s
    /// only deferred to bubbles runs `B B` back to back and idles 0.1 every second
    /// micro-batch (166.6 from t0); with `W` due at its building-block slot it keeps the
    /// authors' period of 6.0 (165.9, against the authors' 166.2), and `schedule` keeps it.
    #[test]
    fn w_due_at_its_slot_keeps_the_steady_state_period() {
        let (p, mbs) = (8u32, 24u32);
        let pl = Pipeline::new(p, 2 * p, mbs, PlacementKind::V).unwrap();
        let (pi, gap) = (p as i64, 3i64);
        let mut ops = Vec::new();
        for s in 0..2 * p {
            let r = pl.rank_of(s) as i64;
            let c = (s / p) as i64;
            let (b1, b0) = (3 * pi + gap + 2 * r - 1, 6 * pi + gap - r - 2);
            for m in 0..mbs {
                let m6 = 6 * m as i64;
                let f = m6 + if c == 0 { 2 * r } else { 3 * pi - r - 2 };
                let b = m6 + if c == 1 { b1 } else { b0 };
                let slip = if c == 0 && (pi + r) % 2 == 0 { 3 } else { 0 };
                for (kind, prio) in [(Kind::F, f), (Kind::B, b), (Kind::W, b + 1 + slip)] {
                    ops.push(Op {
                        kind,
                        stage: s,
                        mb: m,
                        prio,
                    });
                }
            }
        }
        let rules = Rules {
            memory: Some(vec![2 * ((pi + 2) / 2); p as usize]),
            defer_w: true,
            ..Default::default()
        };
        let dur: Vec<f64> = ops
            .iter()
            .map(|o| match o.kind {
                Kind::F => 1.0,
                Kind::B => 1.1,
                _ => 0.9,
            })
            .collect();
        let pred = inputs(&pl, &ops);
        let t = |w_due| {
            let (o, _) = run(
                &pl,
                &ops,
                &rules,
                &dur,
                0.05,
                Variant::new(true, w_due, false),
            )
            .unwrap();
            (replay(&pred, &o.ranks, &dur, 0.05), o)
        };
        let (deferred, _) = t(false);
        let (due, orders) = t(true);
        assert!((deferred - 166.6).abs() < 1e-6, "{deferred}");
        assert!((due - 165.9).abs() < 1e-6, "{due}");
        // On the last rank, in the steady state, each W right after its B.
        let last = &orders.ranks[p as usize - 1];
        for m in 4..16 {
            let at = |k: Kind, s: u32| {
                last.iter()
                    .position(|st| {
                        matches!(*st, Step::Op(i) if ops[i].kind == k && ops[i].stage == s && ops[i].mb == m)
                    })
                    .unwrap()
            };
            assert_eq!(at(Kind::W, p), at(Kind::B, p) + 1, "m = {m}");
            assert_eq!(at(Kind::W, p - 1), at(Kind::B, p - 1) + 1, "m = {m}");
        }
        let cost =
            CostModel::from_toml("[compute]\nF = 1\nB = 1.1\nW = 0.9\n[p2p]\nlatency = 0.05\n")
                .unwrap();
        let best = schedule(&pl, &ops, &rules, &cost).unwrap();
        assert_eq!(best, orders);
    }
}
