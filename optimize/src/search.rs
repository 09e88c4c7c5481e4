//! The driver: construct, improve, rewrite, prove.
//!
//! 1. **Construct.** The given starting schedules (the input, specs on the same placement),
//!    the Zero Bubble greedy's eight variants (one stage per rank), list scheduling under
//!    every policy of [`crate::list::portfolio`], periodic building blocks
//!    ([`crate::periodic`]) and rollouts of the best policies ([`crate::list::rollout`]).
//! 2. **Improve.** Local search ([`crate::local`]) from the best few distinct schedules, in
//!    parallel, each with its own seed.
//! 3. **Rewrite.** Equality saturation over windows of each rank's ops ([`crate::rewrite`]),
//!    extracted with the evaluator in the loop, then local search again.
//! 4. **Prove.** On small instances, branch and bound ([`crate::exact`]) from the best
//!    makespan found: it either proves it optimal or finds the optimum.
//!
//! Every phase stops early once the makespan reaches the lower bound ([`crate::bound`]).
//! Budgets are counted in evaluations, so the same input and seed give the same output; a
//! time limit cuts the search short (and then the result may depend on the machine).

use crate::bound::lower_bound;
use crate::eval::Evaluator;
use crate::instance::Instance;
use crate::list::{build, portfolio, rollout, Rng};
use crate::local::{improve, score, Budget, Score, EPS};
use crate::sched::Sched;
use rayon::prelude::*;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Branch and bound runs by default (`schedc optimize --exact auto`) on instances of at most
/// this many ops.
pub const AUTO_EXACT_MAX_OPS: usize = 150;

/// Local-search runs per start on instances of at most [`AUTO_EXACT_MAX_OPS`] ops (and at
/// most [`Options::exact_max_ops`]: not under `--exact off` or `--heuristic`).
pub const SMALL_RESTARTS: usize = 8;

/// How the search runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Seed of every random choice.
    pub seed: u64,
    /// Wall-clock limit (`None`: none; the evaluation budgets end the search).
    pub time_limit: Option<Duration>,
    /// Multiplies every evaluation budget (1 = default).
    pub effort: f64,
    /// Run the egg window rewrites.
    pub rewrite: bool,
    /// Run branch and bound when the instance has at most this many ops (0: never).
    pub exact_max_ops: usize,
    /// Nodes branch and bound may expand.
    pub exact_max_nodes: u64,
    /// Skip local search and rewrites (list scheduling and the greedy only): the heuristic
    /// mode for very large instances.
    pub construct_only: bool,
}

impl Options {
    /// What `schedc optimize` runs without search flags: [`Options::default`] with branch and
    /// bound (and the multi-seed local search) on instances of at most
    /// [`AUTO_EXACT_MAX_OPS`] ops (`--exact auto`). The library's default leaves branch and
    /// bound off.
    pub fn cli_default() -> Self {
        Options {
            exact_max_ops: AUTO_EXACT_MAX_OPS,
            ..Options::default()
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            seed: 0,
            time_limit: None,
            effort: 1.0,
            rewrite: true,
            exact_max_ops: 0,
            exact_max_nodes: 2_000_000,
            construct_only: false,
        }
    }
}

/// A progress report.
#[derive(Clone, Debug)]
pub struct Progress {
    /// The phase running.
    pub phase: &'static str,
    /// Best makespan so far, seconds.
    pub best: f64,
    /// The lower bound, seconds.
    pub lower_bound: f64,
    /// Fraction of the phase done, 0..=1.
    pub fraction: f64,
}

/// What one phase achieved.
#[derive(Clone, Debug)]
pub struct Phase {
    /// Its name.
    pub name: &'static str,
    /// Best makespan after it, seconds.
    pub best: f64,
    /// Evaluations it ran.
    pub evals: u64,
    /// Its wall-clock time, seconds.
    pub seconds: f64,
}

/// The search's result.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The best schedule.
    pub best: Sched,
    /// Its makespan by the evaluator, seconds.
    pub makespan: f64,
    /// Which start or phase found it.
    pub found_by: String,
    /// The lower bound, seconds.
    pub lower_bound: f64,
    /// True if the makespan is proved optimal (it meets the lower bound, or branch and bound
    /// finished).
    pub optimal: bool,
    /// The phases run.
    pub phases: Vec<Phase>,
    /// True if the time limit cut the search short.
    pub timed_out: bool,
}

struct Best {
    sched: Sched,
    score: Score,
    by: String,
}

/// Runs the search from the named starting schedules (those that are not schedules within
/// the cap are skipped). `progress` is called at phase boundaries and on every new best.
pub fn optimize(
    inst: &Instance,
    starts: &[(String, Sched)],
    opts: &Options,
    progress: &(dyn Fn(&Progress) + Sync),
) -> Outcome {
    Search::new(inst, starts, opts).finish(f64::INFINITY, progress)
}

/// A search after its cheap constructions (the starts, the Zero Bubble greedy, list
/// scheduling under every policy of the portfolio): its best so far is known, so a driver
/// over several placements can order them and skip those that cannot win
/// ([`optimize_placements`]).
pub struct Search<'a> {
    inst: &'a Instance,
    opts: Options,
    t0: Instant,
    lb: f64,
    ev: Evaluator<'a>,
    pool: Vec<(Score, Sched, String)>,
    by_policy: Vec<(Score, usize)>,
    pols: Vec<crate::list::Policy>,
}

impl<'a> Search<'a> {
    /// Runs the cheap constructions (the wall clock counts from here for
    /// `opts.time_limit`; past it, only the first list-scheduling rule of the portfolio
    /// runs).
    pub fn new(inst: &'a Instance, starts: &[(String, Sched)], opts: &Options) -> Self {
        Self::started_at(inst, starts, opts, Instant::now())
    }

    /// As [`Search::new`], with `opts.time_limit` counted from `t0` (a driver's start, so
    /// one limit covers every placement it searches).
    pub fn started_at(
        inst: &'a Instance,
        starts: &[(String, Sched)],
        opts: &Options,
        t0: Instant,
    ) -> Self {
        let lb = lower_bound(inst);
        let mut ev = Evaluator::new(inst);
        let mut pool: Vec<(Score, Sched, String)> = Vec::new();
        for (name, sc) in starts {
            let s = score(&mut ev, sc);
            if s.makespan.is_finite() {
                pool.push((s, sc.clone(), name.clone()));
            }
        }
        if let Ok(runs) = crate::greedy::all_variants(inst) {
            for (i, g) in runs.into_iter().enumerate() {
                let s = score(&mut ev, &g.sched);
                if s.makespan.is_finite() {
                    pool.push((s, g.sched, format!("zb-greedy variant {i}")));
                }
            }
        }
        let pols = portfolio(inst);
        // Past `opts.time_limit` only the first rule runs (every placement keeps one
        // construction; at P = 64, M = 512 the V placement's 96 rules take 10 s).
        let deadline = opts.time_limit.and_then(|d| t0.checked_add(d));
        let built: Vec<(usize, Option<Sched>)> = pols
            .par_iter()
            .enumerate()
            .map(|(i, pol)| {
                if i > 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                    return (i, None);
                }
                let mut rng = Rng::new(opts.seed.wrapping_add(i as u64));
                (i, build(inst, pol, &mut rng))
            })
            .collect();
        let mut by_policy: Vec<(Score, usize)> = Vec::new();
        for (i, sc) in built {
            if let Some(sc) = sc {
                let s = score(&mut ev, &sc);
                if s.makespan.is_finite() {
                    by_policy.push((s, i));
                    pool.push((s, sc, format!("list policy {i}")));
                }
            }
        }
        Search {
            inst,
            opts: opts.clone(),
            t0,
            lb,
            ev,
            pool,
            by_policy,
            pols,
        }
    }

    /// The best makespan the cheap constructions found, seconds (infinity if none fits).
    pub fn best(&self) -> f64 {
        self.pool
            .iter()
            .map(|x| x.0.makespan)
            .fold(f64::INFINITY, f64::min)
    }

    /// The instance's lower bound ([`crate::bound::lower_bound`]), seconds.
    pub fn lower_bound(&self) -> f64 {
        self.lb
    }

    /// Runs the rest of the search: periodic blocks, rollouts, local search, egg
    /// rewrites, branch and bound. When the lower bound is at least `cutoff` (a makespan
    /// already found elsewhere, seconds) none of them can beat it, and the best of the
    /// cheap constructions is returned at once.
    pub fn finish(self, cutoff: f64, progress: &(dyn Fn(&Progress) + Sync)) -> Outcome {
        let effort = self.opts.effort;
        self.finish_with(cutoff, effort, progress)
    }

    /// As [`Search::finish`], with `effort` in place of `opts.effort` (a driver's share of
    /// the budget for this placement).
    pub fn finish_with(
        self,
        cutoff: f64,
        effort: f64,
        progress: &(dyn Fn(&Progress) + Sync),
    ) -> Outcome {
        let Search {
            inst,
            mut opts,
            t0,
            lb,
            mut ev,
            mut pool,
            mut by_policy,
            pols,
        } = self;
        opts.effort = effort;
        let opts = &opts;
        let deadline = opts.time_limit.and_then(|d| t0.checked_add(d));
        let mut phases = Vec::new();
        let report = |phase: &'static str, best: f64, fraction: f64| {
            progress(&Progress {
                phase,
                best,
                lower_bound: lb,
                fraction,
            })
        };
        let pruned = lb >= cutoff - EPS;
        let construct_only = opts.construct_only || pruned;
        let pool_at_bound =
            |pool: &[(Score, Sched, String)]| pool.iter().any(|x| x.0.makespan <= lb + EPS);
        // Periodic blocks.
        if !construct_only && !pool_at_bound(&pool) {
            let fuses: Vec<bool> = if inst.split_dominates() {
                vec![false]
            } else {
                vec![false, true]
            };
            use crate::periodic::Decode;
            let decodes = [
                Decode::Sorted,
                Decode::List { reserve_all: true },
                Decode::List { reserve_all: false },
            ];
            let jobs: Vec<(bool, Decode)> = fuses
                .iter()
                .flat_map(|&f| decodes.iter().map(move |&d| (f, d)))
                .collect();
            // Each decode and evaluation costs O(ops): a fixed amount of work per block search.
            let n = (inst.s * inst.m * 3) as f64;
            let evals = (opts.effort * (2.0e6 / n).clamp(300.0, 20_000.0)) as u64;
            let found: Vec<(usize, Option<(Sched, Score)>)> = jobs
                .par_iter()
                .enumerate()
                .map(|(i, &(f, d))| {
                    let (b, _) = crate::periodic::search(
                        inst,
                        f,
                        d,
                        evals,
                        opts.seed.wrapping_add(1000 + i as u64),
                        deadline,
                        lb,
                    );
                    (i, b)
                })
                .collect();
            for (i, b) in found {
                if let Some((sc, s)) = b {
                    pool.push((s, sc, format!("periodic block search {i}")));
                }
            }
        }
        // Rollouts of the best few policies (O(ops^2): small and mid-size instances only).
        if !construct_only
            && !pool_at_bound(&pool)
            && (inst.s * inst.m * 3) as f64 <= 2500.0 * opts.effort.max(1.0)
        {
            by_policy.sort_by(|a, b| a.0.makespan.total_cmp(&b.0.makespan).then(a.1.cmp(&b.1)));
            let k = ((2.0 * opts.effort).round() as usize).clamp(1, by_policy.len().max(1));
            let rolled: Vec<(usize, Option<Sched>)> = by_policy
                .iter()
                .take(k)
                .collect::<Vec<_>>()
                .par_iter()
                .map(|(_, i)| (*i, rollout(inst, &pols[*i], deadline)))
                .collect();
            for (i, sc) in rolled {
                if let Some(sc) = sc {
                    let s = score(&mut ev, &sc);
                    if s.makespan.is_finite() {
                        pool.push((s, sc, format!("rollout of list policy {i}")));
                    }
                }
            }
        }
        pool.sort_by(|a, b| {
            a.0.makespan
                .total_cmp(&b.0.makespan)
                .then(a.0.mean_end.total_cmp(&b.0.mean_end))
        });
        pool.dedup_by(|a, b| a.1 == b.1);
        let construct_evals = ev.count;
        let Some(first) = pool.first() else {
            return Outcome {
                best: Sched { ranks: Vec::new() },
                makespan: f64::INFINITY,
                found_by: "nothing: no construction fits the cap".into(),
                lower_bound: lb,
                optimal: false,
                phases,
                timed_out: false,
            };
        };
        let best = Mutex::new(Best {
            sched: first.1.clone(),
            score: first.0,
            by: first.2.clone(),
        });
        phases.push(Phase {
            name: "construct",
            best: first.0.makespan,
            evals: construct_evals,
            seconds: t0.elapsed().as_secs_f64(),
        });
        report("construct", first.0.makespan, 1.0);
        let at_bound = |b: &Mutex<Best>| b.lock().unwrap().score.makespan <= lb + EPS;
        let timed_out = |d: Option<Instant>| d.is_some_and(|d| Instant::now() >= d);

        // 2. Improve.
        if !construct_only && !at_bound(&best) && !timed_out(deadline) {
            let t = Instant::now();
            let n_ops = first.1.len() as f64;
            let k = pool.len().min(4);
            // On instances small enough for branch and bound by default, each start is
            // searched from several seeds: a run costs under a second there, and late
            // acceptance from one seed can settle 0.3 s above the optimum (V, P = 4, M = 6,
            // profA, cap 4: 50.5 from seed 0, 50.2 from seed 1; CP-SAT proves 50.2 optimal).
            let restarts = if first.1.len() <= opts.exact_max_ops.min(AUTO_EXACT_MAX_OPS) {
                SMALL_RESTARTS
            } else {
                1
            };
            let starts: Vec<(Sched, String)> = (0..restarts)
                .flat_map(|_| pool[..k].iter().map(|(_, s, n)| (s.clone(), n.clone())))
                .collect();
            // About 3e7 op-steps per start (each evaluation is O(ops)).
            let evals = (opts.effort * (3.0e7 / n_ops).clamp(2_000.0, 200_000.0)) as u64;
            let budget = Budget {
                evals,
                stall: evals / 3 + 1000,
                deadline,
                target: lb,
            };
            let results: Vec<(crate::local::Improved, String)> = starts
                .par_iter()
                .enumerate()
                .map(|(i, (sc, name))| {
                    let seed = opts.seed.wrapping_mul(0x100).wrapping_add(i as u64);
                    let mut on_best = |m: f64| {
                        let b = best.lock().unwrap();
                        if m < b.score.makespan - EPS {
                            report("local search", m, 0.5);
                        }
                    };
                    (improve(inst, sc, budget, seed, &mut on_best), name.clone())
                })
                .collect();
            // Combined in start order, so that the result does not depend on thread timing.
            let mut total = 0;
            for (r, name) in results {
                total += r.evals;
                let mut b = best.lock().unwrap();
                if r.score.lt(&b.score) {
                    b.sched = r.sched;
                    b.score = r.score;
                    b.by = format!("{name}, then local search");
                }
            }
            let b = best.lock().unwrap();
            phases.push(Phase {
                name: "local search",
                best: b.score.makespan,
                evals: total,
                seconds: t.elapsed().as_secs_f64(),
            });
            report("local search", b.score.makespan, 1.0);
        }

        // 3. Rewrite windows with egg, then local search again from the result.
        if opts.rewrite && !construct_only && !at_bound(&best) && !timed_out(deadline) {
            let t = Instant::now();
            let mut sc = best.lock().unwrap().sched.clone();
            let egg_evals =
                (opts.effort * (1.0e8 / sc.len().max(1) as f64).clamp(2_000.0, 100_000.0)) as u64;
            let mut on_best = |m: f64| report("egg rewrite", m, 0.5);
            let mut evals = crate::rewrite::improve_windows(
                inst,
                &mut sc,
                6,
                6,
                egg_evals,
                opts.seed ^ 0xE66,
                deadline,
                &mut on_best,
            );
            let s = score(&mut ev, &sc);
            let budget = Budget {
                evals: (opts.effort * (5.0e7 / sc.len() as f64).clamp(1_000.0, 50_000.0)) as u64,
                stall: 20_000,
                deadline,
                target: lb,
            };
            let mut on_best2 = |m: f64| report("egg rewrite", m, 0.8);
            let r = improve(inst, &sc, budget, opts.seed ^ 0xE66, &mut on_best2);
            evals += r.evals;
            let mut b = best.lock().unwrap();
            if s.lt(&b.score) {
                b.sched = sc;
                b.score = s;
                b.by = format!("{}, then egg window rewrites", b.by);
            }
            if r.score.lt(&b.score) {
                b.sched = r.sched;
                b.score = r.score;
                b.by = format!("{}, then egg window rewrites and local search", b.by);
            }
            phases.push(Phase {
                name: "egg rewrite",
                best: b.score.makespan,
                evals,
                seconds: t.elapsed().as_secs_f64(),
            });
            report("egg rewrite", b.score.makespan, 1.0);
        }

        // 4. Branch and bound on small instances.
        let mut proved = false;
        if opts.exact_max_ops > 0 && !pruned && !at_bound(&best) && !timed_out(deadline) {
            let n_ops = inst.s * inst.m * 3;
            if n_ops <= opts.exact_max_ops {
                let t = Instant::now();
                let (sc, mk) = {
                    let b = best.lock().unwrap();
                    (b.sched.clone(), b.score.makespan)
                };
                if let Ok(res) =
                    crate::exact::solve(inst, Some((&sc, mk)), opts.exact_max_nodes, deadline)
                {
                    let mut b = best.lock().unwrap();
                    if res.makespan < b.score.makespan - EPS {
                        if let Some(s) = res.best {
                            b.score = score(&mut ev, &s);
                            b.sched = s;
                            b.by = "branch and bound".into();
                        }
                    }
                    proved = res.proved;
                    phases.push(Phase {
                        name: "branch and bound",
                        best: b.score.makespan,
                        evals: res.nodes,
                        seconds: t.elapsed().as_secs_f64(),
                    });
                    report("branch and bound", b.score.makespan, 1.0);
                }
            }
        }

        let b = best.into_inner().unwrap();
        let optimal = proved || b.score.makespan <= lb + EPS;
        Outcome {
            makespan: b.score.makespan,
            best: b.sched,
            found_by: b.by,
            lower_bound: lb,
            optimal,
            phases,
            timed_out: timed_out(deadline),
        }
    }
}

/// Searches several placements of one problem (the CLI's default: loop, V, interleaved),
/// one outcome per placement, in the order given, under one time limit.
///
/// The cheap constructions run first for every placement ([`Search::new`]); the expensive
/// phases then run placement by placement, the one with the best construction first. With
/// `prune`, a placement whose lower bound is at least the best makespan found so far on any
/// placement skips them (it cannot do better; its outcome is its best construction), which
/// is exact for the from-start makespan (the CLI prunes only under that objective: under
/// `steady_state` or `--moe` a schedule with a longer makespan may still rank first).
/// Makespans of the placements must be in the same seconds (the CLI scales V stages' times,
/// `crate::report::scaled_cost`).
///
/// The evaluation budgets are shared, so that trying several placements costs about what
/// one placement's search costs: the first placement searched gets half of `opts.effort`,
/// the others split the other half ([`placement_share`]); one placement alone gets all of
/// it.
///
/// Deterministic as [`optimize`] is: the order, the shares and the pruning depend only on
/// makespans.
/// `progress` gets the placement's index with each report.
pub fn optimize_placements(
    problems: &[(&Instance, &[(String, Sched)])],
    opts: &Options,
    prune: bool,
    progress: &(dyn Fn(usize, &Progress) + Sync),
) -> Vec<Outcome> {
    let t0 = Instant::now();
    let searches: Vec<Search<'_>> = problems
        .iter()
        .map(|(inst, starts)| Search::started_at(inst, starts, opts, t0))
        .collect();
    let mut order: Vec<(f64, usize)> = searches
        .iter()
        .enumerate()
        .map(|(i, s)| (s.best(), i))
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut best = order.first().map_or(f64::INFINITY, |x| x.0);
    let mut slots: Vec<Option<Search<'_>>> = searches.into_iter().map(Some).collect();
    let mut out: Vec<Option<Outcome>> = vec![None; problems.len()];
    let n = problems.len();
    for (rank, (_, i)) in order.into_iter().enumerate() {
        let s = slots[i].take().expect("each placement once");
        let cutoff = if prune { best } else { f64::INFINITY };
        let effort = opts.effort * placement_share(rank, n);
        let o = s.finish_with(cutoff, effort, &|p| progress(i, p));
        best = best.min(o.makespan);
        out[i] = Some(o);
    }
    out.into_iter()
        .map(|o| o.expect("every placement searched"))
        .collect()
}

/// The share of the evaluation budget that [`optimize_placements`] gives the `rank`-th
/// placement it searches (0: the one with the best cheap construction) out of `n`: all of
/// it when `n` is 1, else a half to the first and `1 / (2 (n - 1))` to each other.
pub fn placement_share(rank: usize, n: usize) -> f64 {
    match (n, rank) {
        (0 | 1, _) => 1.0,
        (_, 0) => 0.5,
        _ => 0.5 / (n - 1) as f64,
    }
}

/// The placements `schedc optimize` tries without an input, `--placement` or `--vpp`: loop
/// with one stage per rank, V with two, interleaved loop with two (those that exist for
/// `pp` ranks and `mb` micro-batches).
pub fn default_pipelines(pp: u32, mb: u32) -> Vec<schedc_ir::Pipeline> {
    use schedc_ir::{Pipeline, PlacementKind};
    [
        (pp, PlacementKind::Loop),
        (2 * pp, PlacementKind::V),
        (2 * pp, PlacementKind::Loop),
    ]
    .into_iter()
    .filter_map(|(stages, k)| Pipeline::new(pp, stages, mb, k).ok())
    .collect()
}
