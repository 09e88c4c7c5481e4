//! Branch and bound, rule by rule, against brute force on tiny instances: the (start, rank)
//! order reaches every schedule exactly once, the bound and the transposition table never
//! cut an optimum, the fused alternative is taken when `BW < B + W`, and the search finds
//! the brute-force optimum from no incumbent and proves a given optimal one.

use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::eval::Evaluator;
use schedc_optimize::exact::{solve, solve_with, SolveOptions};
use schedc_optimize::rank_bound::{rank_bound, ranks_bound};
use schedc_optimize::{Instance, Sched, Tok};

/// All distinct permutations of `v` (sorted first).
fn perms(mut v: Vec<Tok>) -> Vec<Vec<Tok>> {
    v.sort();
    let mut out = vec![v.clone()];
    loop {
        // next_permutation
        let n = v.len();
        let Some(i) = (0..n.saturating_sub(1)).rev().find(|&i| v[i] < v[i + 1]) else {
            break;
        };
        let j = (i + 1..n).rev().find(|&j| v[j] > v[i]).unwrap();
        v.swap(i, j);
        v[i + 1..].reverse();
        out.push(v.clone());
    }
    out
}

/// Every per-rank token multiset choice (each backward split, or fused when `fused`
/// alternatives are allowed), every order: (valid schedules, best makespan).
fn brute(inst: &Instance, fuse_choices: bool) -> (u64, f64) {
    let mut per_rank: Vec<Vec<Vec<Tok>>> = Vec::new();
    for r in 0..inst.p {
        let mut options = Vec::new();
        let stages = &inst.stages_of[r];
        let n_b = stages.len() * inst.m;
        let combos = if fuse_choices { 1usize << n_b } else { 1 };
        for mask in 0..combos {
            let mut toks = Vec::new();
            let mut bit = 0;
            for &s in stages {
                for _ in 0..inst.m {
                    toks.push(Tok::F(s));
                    if mask >> bit & 1 == 1 {
                        toks.push(Tok::BW(s));
                    } else {
                        toks.push(Tok::B(s));
                        toks.push(Tok::W(s));
                    }
                    bit += 1;
                }
            }
            toks.sort();
            let ps = perms(toks);
            for p in ps {
                if !options.contains(&p) {
                    options.push(p);
                }
            }
        }
        per_rank.push(options);
    }
    let mut ev = Evaluator::new(inst);
    let mut count = 0u64;
    let mut best = f64::INFINITY;
    let mut idx = vec![0usize; inst.p];
    loop {
        let sc = Sched {
            ranks: (0..inst.p).map(|r| per_rank[r][idx[r]].clone()).collect(),
        };
        if let Ok(e) = ev.eval(&sc) {
            count += 1;
            best = best.min(e.makespan);
        }
        let mut r = 0;
        loop {
            if r == inst.p {
                return (count, best);
            }
            idx[r] += 1;
            if idx[r] < per_rank[r].len() {
                break;
            }
            idx[r] = 0;
            r += 1;
        }
    }
}

fn inst(p: u32, m: u32, v: u32, cost: &str, cap: Option<u64>) -> Instance {
    let pl = if v == 1 {
        Pipeline::new(p, p, m, PlacementKind::Loop).unwrap()
    } else {
        Pipeline::new(p, v * p, m, PlacementKind::V).unwrap()
    };
    Instance::new(&pl, &CostModel::resolve(cost).unwrap(), cap).unwrap()
}

const NO_CUTS: SolveOptions = SolveOptions {
    bound: false,
    table: false,
    memory: true,
    jackson: true,
    order: true,
    all: true,
    max_nodes: u64::MAX,
    deadline: None,
    audit: false,
    relax_nodes: 0,
    node_relax_nodes: 0,
};

/// Every node of the uncut tree: the bound (earliest starts and tails, memory held back
/// until releases, each rank's Jackson preemptive schedule, and each rank's one-rank
/// relaxation from the node's heads) is at most the best complete schedule below the node;
/// at the root, each rank's relaxation is at most the optimum.
fn audit(p: u32, m: u32, v: u32, cost: &str, cap: Option<u64>) {
    let i = inst(p, m, v, cost, cap);
    let r = solve_with(
        &i,
        None,
        SolveOptions {
            audit: true,
            node_relax_nodes: 1_000_000,
            ..NO_CUTS
        },
    )
    .unwrap();
    assert!(r.proved);
    assert_eq!(
        r.bound_violations, 0,
        "P={p} M={m} V={v} {cost} cap {cap:?}: the bound exceeded the best completion at {} of {} nodes",
        r.bound_violations, r.nodes
    );
    if !i.split_dominates() {
        return;
    }
    // With every rank in the set, the relaxation is the instance itself but for messages
    // queueing on a link: the optimum when messages take no time, at most it otherwise.
    let all: Vec<usize> = (0..i.p).collect();
    let whole = ranks_bound(&i, &all, f64::INFINITY, u64::MAX, None).unwrap();
    assert!(whole.exact);
    if i.lat == 0.0 {
        assert!(
            (whole.bound - r.makespan).abs() < 1e-9,
            "P={p} M={m} V={v} {cost} cap {cap:?}: every rank relaxed {} against the optimum {}",
            whole.bound,
            r.makespan
        );
    } else {
        assert!(whole.bound <= r.makespan + 1e-9);
    }
    for rank in 0..i.p {
        let b = rank_bound(&i, rank, f64::INFINITY, u64::MAX, None).unwrap();
        assert!(b.exact);
        assert!(
            b.bound <= r.makespan + 1e-9,
            "P={p} M={m} V={v} {cost} cap {cap:?}: rank {rank}'s relaxation {} above the optimum {}",
            b.bound,
            r.makespan
        );
    }
}

/// The one-rank relaxation where the other bounds are loose: V placement, P = 4, M = 6,
/// unit costs, cap 4. Branch and bound's other bounds give 41 at the root; the turn rank
/// (rank 3) alone has no schedule shorter than 47, which the search reaches (47 is the
/// optimum), so branch and bound proves it without expanding a node.
#[test]
fn the_turn_rank_relaxation_proves_the_v_optimum_at_cap_p() {
    use schedc_optimize::exact::{root_bound, root_bound_with};
    let i = inst(4, 6, 2, "F=1,B=1,W=1", Some(4));
    assert_eq!(root_bound(&i), Some(41.0));
    let b = rank_bound(&i, 3, 47.0, 1_000_000, None).unwrap();
    assert!(!b.exact, "no relaxed schedule below 47");
    assert_eq!(b.bound, 47.0);
    // The relaxation's optimum itself.
    assert_eq!(root_bound_with(&i, 1_000_000), Some(47.0));
    // Below 47 there is nothing; a relaxed schedule of 48 exists.
    let b48 = rank_bound(&i, 3, 48.0, 1_000_000, None).unwrap();
    assert!(b48.exact && b48.bound == 47.0);
}

#[test]
fn the_bound_is_at_most_every_subtree_optimum() {
    for (p, m, v, cost, cap) in [
        (2, 2, 1, "F=1,B=1,W=1", Some(1)),
        (2, 3, 1, "F=1,B=2,W=1", Some(1)),
        (2, 3, 1, "F=1,B=1.1,W=0.9,latency=0.05", Some(2)),
        (3, 2, 1, "F=1,B=1.1,W=0.9,latency=0.05", Some(1)),
        (3, 2, 1, "F=1,B=2,W=1", Some(2)),
        (2, 1, 2, "F=1,B=1,W=1", Some(2)),
        (2, 1, 2, "F=1,B=1.1,W=0.9,latency=0.05", None),
        (2, 2, 2, "F=1,B=2,W=1", Some(2)),
        (2, 2, 2, "F=1,B=1.1,W=0.9,latency=0.05", Some(3)),
        (3, 1, 2, "F=1,B=1,W=1", Some(2)),
        (2, 2, 1, "F=1,B=1,W=1,BW=1.2", Some(1)),
    ] {
        audit(p, m, v, cost, cap);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
    /// The same on random op times and message latencies, loop and V, every cap.
    #[test]
    fn the_bound_is_sound_on_random_costs(
        f in 1u32..=20,
        b in 1u32..=30,
        w in 1u32..=20,
        lat in 0u32..=5,
        v in 1u32..=2,
        m in 1u32..=2,
        extra in 0u64..=2,
    ) {
        let cost = format!(
            "F={},B={},W={},latency={}",
            f as f64 / 10.0,
            b as f64 / 10.0,
            w as f64 / 10.0,
            lat as f64 / 10.0
        );
        audit(2, m, v, &cost, Some(v as u64 + extra));
    }
}

#[test]
fn the_start_rank_order_reaches_every_schedule_once() {
    for (p, m, v, cost, cap) in [
        (2, 2, 1, "F=1,B=1,W=1", None),
        (2, 2, 1, "F=1,B=1.1,W=0.9,latency=0.05", Some(2)),
        (3, 1, 1, "F=1,B=2,W=1", None),
        (2, 1, 2, "F=1,B=1,W=1", None),
        (2, 2, 1, "F=1,B=2,W=1", Some(1)),
    ] {
        let i = inst(p, m, v, cost, cap);
        let (count, best) = brute(&i, false);
        let r = solve_with(&i, None, NO_CUTS).unwrap();
        assert_eq!(
            r.leaves, count,
            "P={p} M={m} V={v} {cost} cap {cap:?}: every valid order once"
        );
        assert!((r.makespan - best).abs() < 1e-9, "{} vs {best}", r.makespan);
        assert!(r.proved);
    }
}

#[test]
fn the_bound_never_cuts_an_optimum() {
    for (p, m, v, cost, cap) in [
        (2, 2, 1, "F=1,B=1.1,W=0.9,latency=0.05", Some(2)),
        (3, 1, 1, "F=1,B=2,W=1", Some(1)),
        (2, 1, 2, "F=1,B=1,W=1", Some(2)),
        (2, 3, 1, "F=1,B=2,W=1", Some(1)),
    ] {
        let i = inst(p, m, v, cost, cap);
        let (_, best) = brute(&i, false);
        let only_bound = SolveOptions {
            bound: true,
            table: false,
            all: false,
            ..NO_CUTS
        };
        let r = solve_with(&i, None, only_bound).unwrap();
        assert!(
            (r.makespan - best).abs() < 1e-9,
            "bound: {} vs {best}",
            r.makespan
        );
        let plain = solve_with(&i, None, NO_CUTS).unwrap();
        assert!(r.nodes < plain.nodes, "the bound cuts nodes");
    }
}

#[test]
fn the_transposition_table_never_cuts_an_optimum() {
    for (p, m, v, cost, cap) in [
        (2, 2, 1, "F=1,B=1,W=1", Some(2)),
        (3, 1, 1, "F=1,B=1.1,W=0.9,latency=0.05", Some(3)),
        (2, 1, 2, "F=1,B=2,W=1", Some(3)),
        (2, 3, 1, "F=1,B=1.1,W=0.9,latency=0.05", Some(2)),
    ] {
        let i = inst(p, m, v, cost, cap);
        let (_, best) = brute(&i, false);
        let only_table = SolveOptions {
            bound: false,
            table: true,
            all: false,
            ..NO_CUTS
        };
        let r = solve_with(&i, None, only_table).unwrap();
        assert!(
            (r.makespan - best).abs() < 1e-9,
            "table: {} vs {best}",
            r.makespan
        );
    }
}

#[test]
fn a_faster_fused_backward_is_an_alternative() {
    // BW = 1.2 < B + W = 2: the optimum fuses.
    let i = inst(2, 2, 1, "F=1,B=1,W=1,BW=1.2", None);
    assert!(!i.split_dominates());
    let (count, best) = brute(&i, true);
    let r = solve_with(&i, None, NO_CUTS).unwrap();
    assert_eq!(r.leaves, count);
    assert!((r.makespan - best).abs() < 1e-9);
    let split_only = brute(&i, false).1;
    assert!(
        best < split_only - 1e-9,
        "fusing helps here: {best} < {split_only}"
    );
    let fast = solve(&i, None, u64::MAX, None).unwrap();
    assert!((fast.makespan - best).abs() < 1e-9);
}

#[test]
fn an_optimal_incumbent_is_proved_and_kept() {
    let i = inst(2, 3, 1, "F=1,B=2,W=1", Some(2));
    let (_, best) = brute(&i, false);
    let r0 = solve(&i, None, u64::MAX, None).unwrap();
    let sc = r0.best.clone().unwrap();
    let r = solve(&i, Some((&sc, r0.makespan)), u64::MAX, None).unwrap();
    assert!(r.proved);
    assert!((r.makespan - best).abs() < 1e-9);
    assert_eq!(
        r.best.unwrap(),
        sc,
        "no strictly better schedule: the incumbent stays"
    );
}

#[test]
fn a_node_budget_stops_without_a_proof() {
    let i = inst(4, 6, 1, "F=1,B=1.1,W=0.9,latency=0.05", Some(4));
    let r = solve(&i, None, 50, None).unwrap();
    assert!(!r.proved);
    assert!(r.nodes <= 51);
}

/// The root bound against the reference data: at most every authors' makespan (each is a
/// real schedule within its memory limit and placement), and equal to it where the book
/// counts the authors' schedule proved optimal by this bound.
#[test]
fn the_root_bound_is_below_every_reference_schedule_and_meets_seven() {
    use schedc_optimize::exact::root_bound;
    use schedc_optimize::refdata::{read_all, zb_dir};
    let Some(dir) = zb_dir() else {
        eprintln!("skipped: shared/reference/zb is not there");
        return;
    };
    let cfgs = read_all(&dir, &["zb1p", "zb2p", "vauto1p", "vauto2p"]).unwrap();
    assert_eq!(cfgs.len(), 144);
    let mut met = Vec::new();
    for c in &cfgs {
        let inst = c.instance().unwrap();
        let rb = root_bound(&inst).unwrap();
        let lb = schedc_optimize::bound::lower_bound(&inst);
        assert!(
            rb <= c.makespan_from_t0 + 1e-6,
            "{}: root bound {rb} above the authors' {}",
            c.id,
            c.makespan_from_t0
        );
        if rb >= c.makespan_from_t0 - 1e-6 && lb < c.makespan_from_t0 - 1e-6 {
            met.push(c.id.clone());
        }
    }
    met.sort();
    assert_eq!(
        met,
        [
            "zb1p_P16_M16_profA",
            "zb1p_P6_M6_profA",
            "zb2p_P12_M12_profA",
            "zb2p_P16_M16_profA",
            "zb2p_P4_M4_profA",
            "zb2p_P6_M6_profA",
            "zb2p_P8_M8_profA"
        ]
    );
}

/// The one-rank relaxation on the reference data: below every authors' schedule it is given
/// (each is a real schedule within its memory limit and placement), and where it finds no
/// relaxed schedule shorter than the authors', the authors' makespan is optimal: three
/// profA `zb1p` with M > P and two unit `vauto1p` that no other bound settles.
#[test]
fn the_relaxation_proves_reference_schedules_optimal() {
    use schedc_optimize::rank_bound::best_rank_bound;
    use schedc_optimize::refdata::{read, zb_dir};
    let Some(dir) = zb_dir() else {
        eprintln!("skipped: shared/reference/zb is not there");
        return;
    };
    let load = |id: &str| read(&dir.join(format!("{id}.json"))).unwrap();
    for id in [
        "vauto1p_P4_M4_unit",
        "vauto1p_P4_M4_profA",
        "vauto1p_P4_M4_profB",
        "zb1p_P4_M8_profA",
    ] {
        let c = load(id);
        let b = best_rank_bound(&c.instance().unwrap(), f64::INFINITY, 2_000_000, None).unwrap();
        assert!(b.exact);
        assert!(
            b.bound <= c.makespan_from_t0 + 1e-6,
            "{id}: relaxation {} above the authors' {}",
            b.bound,
            c.makespan_from_t0
        );
    }
    for id in [
        "zb1p_P4_M12_profA",
        "zb1p_P4_M16_profA",
        "zb1p_P6_M12_profA",
        "vauto1p_P4_M8_unit",
        "vauto1p_P4_M12_unit",
    ] {
        let c = load(id);
        let inst = c.instance().unwrap();
        assert!(
            schedc_optimize::exact::root_bound(&inst).unwrap() < c.makespan_from_t0 - 1e-6,
            "{id}: not settled by the root bound alone"
        );
        let b = best_rank_bound(&inst, c.makespan_from_t0, 2_000_000, None).unwrap();
        assert!(
            !b.exact && b.bound == c.makespan_from_t0,
            "{id}: the relaxation finds {} below the authors' {}",
            b.bound,
            c.makespan_from_t0
        );
    }
}
