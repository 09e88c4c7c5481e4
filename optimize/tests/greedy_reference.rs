//! The re-implemented Zero Bubble greedy reproduces the authors' generator: on every `zb1p`
//! and `zb2p` configuration in `shared/reference/zb/`, the same per-rank orders, the same
//! `best_time` (longest stage span) and the same makespan from time 0.

use schedc_optimize::eval::Evaluator;
use schedc_optimize::greedy::zero_bubble_greedy;
use schedc_optimize::refdata::{read_all, zb_dir};

#[test]
fn greedy_matches_the_authors_generator() {
    let Some(dir) = zb_dir() else {
        assert!(
            std::env::var_os("SCHEDC_REQUIRE_SHARED").is_none(),
            "shared/reference/zb is required"
        );
        eprintln!("skipped: ../shared/reference/zb not found");
        return;
    };
    let cfgs = read_all(&dir, &["zb1p", "zb2p"]).unwrap();
    assert_eq!(cfgs.len(), 72);
    let mut mismatched = Vec::new();
    for c in &cfgs {
        let inst = c.instance().unwrap();
        let g = zero_bubble_greedy(&inst).unwrap();
        let e = Evaluator::new(&inst).eval(&g.sched).unwrap();
        let same_order = g.sched == c.sched;
        let tol = 1e-6;
        let same_span = (g.span - c.best_time.unwrap()).abs() < tol;
        let same_makespan = (e.makespan - c.makespan_from_t0).abs() < tol;
        if !(same_order && same_span && same_makespan) {
            mismatched.push(format!(
                "{}: order {same_order}, span {} vs {:?}, makespan {} vs {}",
                c.id, g.span, c.best_time, e.makespan, c.makespan_from_t0
            ));
        }
    }
    assert!(mismatched.is_empty(), "{}", mismatched.join("\n"));
}

#[test]
fn reference_orders_evaluate_to_the_authors_figures() {
    let Some(dir) = zb_dir() else {
        eprintln!("skipped: ../shared/reference/zb not found");
        return;
    };
    let cfgs = read_all(&dir, &["zb1p", "zb2p", "vauto1p", "vauto2p"]).unwrap();
    assert_eq!(cfgs.len(), 144);
    for c in &cfgs {
        let inst = c.instance().unwrap();
        let e = Evaluator::new(&inst)
            .eval(&c.sched)
            .unwrap_or_else(|f| panic!("{}: {f:?}", c.id));
        assert!(
            (e.makespan - c.makespan_from_t0).abs() < 1e-6,
            "{}: {} vs {}",
            c.id,
            e.makespan,
            c.makespan_from_t0
        );
        assert_eq!(
            e.peak.iter().copied().max().unwrap() as f64,
            c.peak,
            "{}",
            c.id
        );
    }
}
