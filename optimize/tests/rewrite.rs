//! The egg window rewrites, rule by rule (in egg's style: run the rule on a start term and
//! check which terms the e-graph then holds), and the beam extraction with the evaluator.

use egg::{RecExpr, Rewrite, Runner};
use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::eval::Evaluator;
use schedc_optimize::local::score;
use schedc_optimize::rewrite::{depends, expr_tokens, extract, rules, saturate, window_expr, Win};
use schedc_optimize::{Instance, Sched, Tok};

fn inst(cost: &str, v: u32) -> Instance {
    let pl = if v == 1 {
        Pipeline::new(2, 2, 4, PlacementKind::Loop).unwrap()
    } else {
        Pipeline::new(2, 4, 4, PlacementKind::V).unwrap()
    };
    Instance::new(&pl, &CostModel::resolve(cost).unwrap(), None).unwrap()
}

fn rule(inst: &Instance, name: &str) -> Vec<Rewrite<Win, ()>> {
    rules(inst)
        .into_iter()
        .filter(|r| r.name.as_str() == name)
        .collect()
}

fn e(s: &str) -> RecExpr<Win> {
    s.parse().unwrap()
}

/// Runs `rules` on `start`; asserts each of `yes` is equivalent to it and none of `no`.
fn check(rules: &[Rewrite<Win, ()>], start: &str, yes: &[&str], no: &[&str]) {
    let runner = Runner::default()
        .with_iter_limit(20)
        .with_node_limit(10_000)
        .with_expr(&e(start))
        .run(rules);
    let eg = &runner.egraph;
    let root = eg.find(runner.roots[0]);
    for y in yes {
        let id = eg.lookup_expr(&e(y)).map(|i| eg.find(i));
        assert_eq!(id, Some(root), "{start} should equal {y}");
    }
    for n in no {
        let id = eg.lookup_expr(&e(n)).map(|i| eg.find(i));
        assert_ne!(id, Some(root), "{start} must not equal {n}");
    }
}

#[test]
fn window_terms_round_trip() {
    let toks = vec![
        Tok::F(0),
        Tok::B(1),
        Tok::W(1),
        Tok::BW(0),
        Tok::Pair {
            f: 0,
            b: 1,
            fused: false,
        },
    ];
    assert_eq!(expr_tokens(&window_expr(&toks)), toks);
    assert_eq!(window_expr(&toks[..2]).to_string(), "(seq F0 (seq B1 nil))");
}

#[test]
fn swap_exchanges_independent_ops() {
    let i = inst("F=1,B=1,W=1", 1);
    let r = rule(&i, "swap");
    // A forward and a weight gradient of another micro-batch: independent.
    check(&r, "(seq W0 (seq F0 nil))", &["(seq F0 (seq W0 nil))"], &[]);
    // Three independent ops: every order.
    check(
        &r,
        "(seq F0 (seq W0 (seq B0 nil)))",
        &[
            "(seq W0 (seq F0 (seq B0 nil)))",
            "(seq B0 (seq W0 (seq F0 nil)))",
        ],
        &[],
    );
}

#[test]
fn swap_keeps_same_rank_dependencies() {
    let i = inst("F=1,B=1,W=1", 1);
    let r = rule(&i, "swap");
    // W after its B.
    check(&r, "(seq B1 (seq W1 nil))", &[], &["(seq W1 (seq B1 nil))"]);
    // The loss: the last stage's backward after its forward.
    check(&r, "(seq F1 (seq B1 nil))", &[], &["(seq B1 (seq F1 nil))"]);
    // Two copies of one op are not swapped: the e-graph stays the one term.
    let runner = Runner::default()
        .with_expr(&e("(seq F0 (seq F0 nil))"))
        .run(&r);
    assert_eq!(runner.egraph.number_of_classes(), 4);
    // The V's turn: stage 1 -> 2 on one rank (P = 2, V placement: rank 1 holds 1 and 2).
    let v = inst("F=1,B=1,W=1", 2);
    assert!(depends(&v, Tok::F(1), Tok::F(2)));
    assert!(depends(&v, Tok::B(2), Tok::B(1)));
    check(
        &rule(&v, "swap"),
        "(seq F1 (seq F2 nil))",
        &[],
        &["(seq F2 (seq F1 nil))"],
    );
}

#[test]
fn split_makes_b_then_w() {
    let i = inst("F=1,B=1,W=1", 1);
    check(
        &rule(&i, "split"),
        "(seq BW0 (seq F0 nil))",
        &["(seq B0 (seq W0 (seq F0 nil)))"],
        &[],
    );
}

#[test]
fn fuse_only_when_bw_is_faster() {
    let slow = inst("F=1,B=1,W=1", 1);
    assert!(rule(&slow, "fuse").is_empty(), "BW = B + W: no fuse rule");
    let fast = inst("F=1,B=1,W=1,BW=1.5", 1);
    let r = rule(&fast, "fuse");
    check(&r, "(seq B0 (seq W0 nil))", &["(seq BW0 nil)"], &[]);
    // Not across stages.
    check(
        &r,
        "(seq B0 (seq W1 nil))",
        &[],
        &["(seq BW0 nil)", "(seq BW1 nil)"],
    );
}

#[test]
fn pair_and_unpair_only_when_pairs_are_faster() {
    let plain = inst("F=1,B=1,W=1", 1);
    assert!(rule(&plain, "pair").is_empty());
    let fast = inst("F=1,B=1,W=1,FB=1.5", 1);
    check(
        &rule(&fast, "pair"),
        "(seq F0 (seq B1 nil))",
        &["(seq (pair F0 B1) nil)"],
        &[],
    );
    check(
        &rule(&fast, "pair-bf"),
        "(seq B1 (seq F0 nil))",
        &["(seq (pair F0 B1) nil)"],
        &[],
    );
    // A weight gradient does not pair.
    check(
        &rule(&fast, "pair"),
        "(seq F0 (seq W1 nil))",
        &[],
        &["(seq (pair F0 W1) nil)"],
    );
    check(
        &rule(&fast, "unpair"),
        "(seq (pair F0 BW1) nil)",
        &["(seq F0 (seq BW1 nil))"],
        &[],
    );
}

#[test]
fn extraction_moves_a_weight_gradient_into_a_wait() {
    // P = 2, M = 2, rank 0 runs W(0,0) before F(0,1) and so delays micro-batch 1's
    // forward; the better order runs F(0,1) first and the W in the wait for the gradient.
    let pl = Pipeline::new(2, 2, 2, PlacementKind::Loop).unwrap();
    let i = Instance::new(&pl, &CostModel::resolve("F=1,B=1,W=1").unwrap(), None).unwrap();
    let sc = Sched {
        ranks: vec![
            vec![
                Tok::F(0),
                Tok::B(0),
                Tok::W(0),
                Tok::F(0),
                Tok::B(0),
                Tok::W(0),
            ],
            vec![
                Tok::F(1),
                Tok::B(1),
                Tok::W(1),
                Tok::F(1),
                Tok::B(1),
                Tok::W(1),
            ],
        ],
    };
    let mut ev = Evaluator::new(&i);
    let before = score(&mut ev, &sc);
    let win = sc.ranks[0].clone();
    let (eg, root) = saturate(&win, &rules(&i), 10_000);
    let (new, s) = extract(&mut ev, &sc, 0, 0, win.len(), &eg, root, 8).unwrap();
    assert!(
        s.makespan < before.makespan,
        "{} < {}",
        s.makespan,
        before.makespan
    );
    let mut better = sc.clone();
    better.ranks[0] = new;
    assert_eq!(score(&mut ev, &better), s);
    // The extracted order is a valid order of the same ops.
    let mut a = better.ranks[0].clone();
    let mut b = sc.ranks[0].clone();
    a.sort();
    b.sort();
    assert_eq!(a, b);
}
