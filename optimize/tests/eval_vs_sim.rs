//! The evaluator agrees with `schedc::sim::simulate` on the lowered program, and every
//! lowered program passes `schedc check`, over random schedules, placements and cost models.

use schedc::sim::cost::CostModel;
use schedc_optimize::eval::Evaluator;
use schedc_optimize::{verify, Instance, Sched, Tok};
use schedc_tests::{random_pipeline, random_schedule, Rng};

fn costs() -> Vec<(&'static str, CostModel)> {
    let mut v = Vec::new();
    for (name, spec) in [
        ("unit", "F=1,B=1,W=1"),
        ("profA", "F=1,B=1.1,W=0.9,latency=0.05"),
        ("profB", "F=1,B=2,W=1"),
        ("slow-links", "F=1,B=1,W=1,latency=0.7"),
        (
            "bandwidth",
            "F=0.3,B=0.5,W=0.2,latency=0.01,bandwidth=1e9,bytes=2e8",
        ),
        ("pairs", "F=1,B=1,W=1,FB=1.5,latency=0.05"),
    ] {
        v.push((name, CostModel::resolve(spec).unwrap()));
    }
    // Per-stage times.
    let mut m = CostModel::resolve("F=1,B=1.2,W=0.8,latency=0.1").unwrap();
    m.compute.stage.insert(
        "0".into(),
        schedc::sim::cost::OpCosts {
            f: Some(1.7),
            b: Some(0.4),
            w: None,
            bw: Some(1.5),
            fb: None,
        },
    );
    v.push(("per-stage", m));
    v
}

/// Pairs some adjacent forward and backward tokens of a rank into overlapped chunks (the
/// evaluator rejects the pairs that break an order; those are put back).
fn pair_some(rng: &mut Rng, inst: &Instance, sc: &mut Sched) {
    let mut ev = Evaluator::new(inst);
    for r in 0..sc.ranks.len() {
        let mut i = 0;
        while i + 1 < sc.ranks[r].len() {
            let (a, b) = (sc.ranks[r][i], sc.ranks[r][i + 1]);
            let pair = match (a, b) {
                (Tok::F(f), Tok::B(b)) => Some(Tok::Pair { f, b, fused: false }),
                (Tok::F(f), Tok::BW(b)) => Some(Tok::Pair { f, b, fused: true }),
                _ => None,
            };
            if let Some(t) = pair.filter(|_| rng.chance(1, 2)) {
                let old = sc.ranks[r].clone();
                sc.ranks[r].splice(i..i + 2, [t]);
                if ev.eval(sc).is_err() {
                    sc.ranks[r] = old;
                }
            }
            i += 1;
        }
    }
}

#[test]
fn evaluator_equals_simulator_on_random_schedules() {
    let mut rng = Rng::new(0x5eed_0013);
    let costs = costs();
    let mut compared = 0;
    let mut with_pairs = 0;
    for case in 0..400 {
        let pl = random_pipeline(&mut rng);
        let prog = random_schedule(&mut rng, pl.clone());
        let (name, cost) = &costs[case % costs.len()];
        let inst = Instance::new(&pl, cost, None).unwrap();
        let mut sc = Sched::from_program(&prog).unwrap();
        if *name == "pairs" {
            pair_some(&mut rng, &inst, &mut sc);
            if sc
                .ranks
                .iter()
                .flatten()
                .any(|t| matches!(t, Tok::Pair { .. }))
            {
                with_pairs += 1;
            }
        }
        let mut ev = Evaluator::new(&inst);
        let e = ev
            .eval(&sc)
            .unwrap_or_else(|f| panic!("case {case}: a relabelled valid schedule fails: {f:?}"));
        let v = verify(&inst, cost, &sc).unwrap_or_else(|err| {
            panic!(
                "case {case} ({name}): {err}\n{}",
                schedc_ir::text::print(&sc.to_program(&inst))
            )
        });
        let tol = 1e-9 * e.makespan.max(1.0);
        assert!(
            (v.sim.makespan - e.makespan).abs() <= tol,
            "case {case} ({name}, {:?} P={} S={} M={}): simulator {} evaluator {}\n{}",
            pl.placement,
            pl.pp,
            pl.stages,
            pl.microbatches,
            v.sim.makespan,
            e.makespan,
            schedc_ir::text::print(&v.program)
        );
        for (r, rr) in v.report.ranks.iter().enumerate() {
            assert_eq!(
                rr.peak_activations, e.peak[r] as u64,
                "case {case}: rank {r} peak"
            );
        }
        compared += 1;
    }
    assert_eq!(compared, 400);
    assert!(with_pairs >= 10, "only {with_pairs} schedules with pairs");
}

#[test]
fn relabelling_never_delays() {
    // The evaluator runs the order-relabelled schedule; the simulator on the original program
    // (lowered by check with the same message order rules) is never faster.
    let mut rng = Rng::new(7);
    let cost = CostModel::resolve("F=1,B=1.1,W=0.9").unwrap();
    for _ in 0..200 {
        let pl = random_pipeline(&mut rng);
        let prog = random_schedule(&mut rng, pl.clone());
        let inst = Instance::new(&pl, &cost, None).unwrap();
        let sc = Sched::from_program(&prog).unwrap();
        let e = Evaluator::new(&inst).eval(&sc).unwrap();
        let orig = schedc::sim::simulate_any(&prog, &cost).unwrap();
        assert!(
            e.makespan <= orig.makespan + 1e-9,
            "{} > {}",
            e.makespan,
            orig.makespan
        );
    }
}
