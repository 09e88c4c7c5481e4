//! MoE in the schedule language (issue 10, item 1): parts on ops, the overlapped pair written
//! by parts, `A2A` statements and `communicator`/`moe` items, `literal` communicators; the
//! `fmt` round trip of the new syntax; and every "Bad input" of the issue as the user sees it
//! (snapshots naming the spec line).

use proptest::prelude::*;
use schedc::check::{check, check_expectations, Verdict};
use schedc::diag::Code;
use schedc::dsl::ast::*;
use schedc::dsl::{fmt::format_file, parse_file};
use schedc::input::{apply_moe, load_spec, Overrides};
use schedc::moe::MoeStages;
use schedc_ir::text::instr_to_string;
use schedc_ir::{Kind, Part, Program};

fn ov(pp: u32, mb: u32) -> Overrides {
    Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        ..Default::default()
    }
}

fn texts(p: &Program) -> Vec<Vec<String>> {
    p.ranks
        .iter()
        .map(|r| r.iter().map(instr_to_string).collect())
        .collect()
}

fn spec(name: &str) -> String {
    std::fs::read_to_string(schedc_tests::conform::root().join("specs").join(name)).unwrap()
}

/// Plain 1F1B with every op written in parts: the order `--moe` gives `specs/1f1b.sched`.
const ONE_F_ONE_B_PARTS: &str = r#"schedule "1f1b-moe"
vpp 1
moe all

rank r {
    let warmup = min(P - r, M)
    repeat warmup { F(0).attn F(0).dispatch F(0).mlp F(0).combine }
    repeat M - warmup {
        BW(0).combine BW(0).mlp BW(0).dispatch BW(0).attn
        F(0).attn F(0).dispatch F(0).mlp F(0).combine
    }
    repeat warmup { BW(0).combine BW(0).mlp BW(0).dispatch BW(0).attn }
}

expect warmup == min(P - r, M)
"#;

#[test]
fn plain_1f1b_in_parts_is_the_moe_lowering_of_1f1b() {
    for (pp, mb) in [(2, 4), (4, 8), (4, 3)] {
        let written = load_spec(ONE_F_ONE_B_PARTS, &ov(pp, mb)).unwrap();
        let whole = load_spec(&spec("1f1b.sched"), &ov(pp, mb)).unwrap();
        let (lowered, _) = apply_moe(&whole.program, None, &MoeStages::All).unwrap();
        assert_eq!(texts(&written.program), texts(&lowered), "P={pp} M={mb}");
        assert_eq!(written.program.pipeline, lowered.pipeline);
        let mut out = check(&written.program, Some(&written.spans), &Default::default());
        check_expectations(&mut out.report, &written.expects);
        assert_eq!(out.report.verdict, Verdict::Accepted, "P={pp} M={mb}");
    }
}

/// DualPipeV's steady state with its F&B pairs written part by part, in DeepSeek-V3's order
/// (Figure 4 of arXiv 2412.19437): the same program as `--moe` gives for `F(0) & BW(1)`.
#[test]
fn the_overlapped_pair_written_by_parts_is_the_moe_lowering_of_the_pair() {
    let by_parts = spec("dualpipev.sched")
        .replace(
            "if i == 0 && r == P - 1 { F(0) BW(1) } else { F(0) & BW(1) }",
            "if i == 0 && r == P - 1 { F(0) BW(1) } else {\n            BW(1).combine F(0).attn F(0).dispatch BW(1).mlp\n            BW(1).dispatch F(0).mlp F(0).combine BW(1).attn\n        }",
        )
        .replace(
            "        F(1) & BW(0)\n",
            "        BW(0).combine F(1).attn F(1).dispatch BW(0).mlp\n        BW(0).dispatch F(1).mlp F(1).combine BW(0).attn\n",
        );
    assert_ne!(by_parts, spec("dualpipev.sched"));
    for (pp, mb) in [(2, 4), (4, 8), (4, 11)] {
        let written = load_spec(&by_parts, &ov(pp, mb)).unwrap();
        let (written_moe, _) = apply_moe(&written.program, None, &MoeStages::All).unwrap();
        let whole = load_spec(&spec("dualpipev.sched"), &ov(pp, mb)).unwrap();
        let (lowered, _) = apply_moe(&whole.program, None, &MoeStages::All).unwrap();
        assert_eq!(texts(&written_moe), texts(&lowered), "P={pp} M={mb}");
        // The written pairs are already parts.
        let parts = written.program.ranks[0]
            .iter()
            .filter(|i| matches!(i, schedc_ir::Instr::Compute(c) if c.part != Part::Whole))
            .count();
        assert!(parts >= 8, "P={pp} M={mb}");
        let mut out = check(&written_moe, None, &Default::default());
        check_expectations(&mut out.report, &written.expects);
        assert_eq!(out.report.verdict, Verdict::Accepted, "P={pp} M={mb}");
    }
}

#[test]
fn parts_take_micro_batches_like_whole_ops_and_join_the_open_op() {
    // A later part joins the oldest op of its chunk and kind still missing it; the pending-W
    // queue sees a B given in parts.
    let src = "vpp 1\nrank r {\n  F(0).attn F(0).attn F(0).dispatch F(0).dispatch F(0).mlp F(0).combine F(0).mlp F(0).combine\n  B(0).combine B(0).mlp B(0).dispatch B(0).attn W()\n  BW(0, 1).combine BW(0, 1).mlp BW(0, 1).dispatch BW(0, 1).attn\n}\n";
    let e = load_spec(src, &ov(1, 2)).unwrap();
    assert_eq!(
        texts(&e.program)[0].join(" "),
        "F(0,0).attn F(0,1).attn F(0,0).dispatch F(0,1).dispatch F(0,0).mlp F(0,0).combine F(0,1).mlp F(0,1).combine \
         B(0,0).combine B(0,0).mlp B(0,0).dispatch B(0,0).attn W(0,0) \
         BW(0,1).combine BW(0,1).mlp BW(0,1).dispatch BW(0,1).attn"
    );
    let out = check(&e.program, Some(&e.spans), &Default::default());
    assert_eq!(out.report.verdict, Verdict::Accepted);
}

#[test]
fn collectives_and_communicators() {
    let src = r#"placement loop
communicator ep r => r < 2
communicator all_ranks all
rank r {
    F(0)
    A2A(ep, "dispatch.{r}0")
    A2A(all_ranks, "sync")
    BW(0)
}
"#;
    // Each rank writes its own label: the members disagree, and rank 2 is no member of ep.
    let e = load_spec(src, &ov(3, 1)).unwrap();
    assert_eq!(e.program.pipeline.communicators.len(), 2);
    assert_eq!(e.program.pipeline.communicators[0].ranks, vec![0, 1]);
    assert_eq!(e.program.pipeline.communicators[1].ranks, vec![0, 1, 2]);
    assert_eq!(texts(&e.program)[1][1], "A2A(ep,dispatch.10)");
    let out = check(&e.program, Some(&e.spans), &Default::default());
    let codes: Vec<Code> = out.report.diagnostics.iter().map(|d| d.code).collect();
    assert!(codes.contains(&Code::CollectiveOrder), "{codes:?}");
    // The same label on every member, only members issuing: accepted (collectives alone do
    // not stop the lowering from inserting the messages).
    let ok = src
        .replace("\"dispatch.{r}0\"", "\"dispatch\"")
        .replace("    A2A(ep,", "    if r < 2 { A2A(ep,")
        .replace("\"dispatch\")", "\"dispatch\") }");
    let e = load_spec(&ok, &ov(3, 1)).unwrap();
    let out = check(&e.program, Some(&e.spans), &Default::default());
    assert_eq!(
        out.report.verdict,
        Verdict::Accepted,
        "{:?}",
        out.report.diagnostics
    );
    assert!(out.report.lowered);
}

/// Issue 15, item 3: a `group` (or `communicator`) line inside `literal` declares the
/// communicator; it was silently dropped.
#[test]
fn literal_blocks_declare_their_communicators() {
    for word in ["group", "communicator"] {
        let src = format!(
            "placement loop\nliteral {{\n{word} ep 0 1\nmoe 0 1\nrank 0: F(0,0) A2A(ep,x) BW(0,0)\nrank 1: F(1,0) A2A(ep,x) BW(1,0)\n}}\n"
        );
        let e = load_spec(&src, &ov(2, 1)).unwrap();
        assert_eq!(e.program.pipeline.communicators[0].name, "ep");
        assert_eq!(e.program.pipeline.moe_stages, Some(vec![0, 1]));
        let out = check(&e.program, Some(&e.spans), &Default::default());
        assert_eq!(
            out.report.verdict,
            Verdict::Accepted,
            "{word}: {:?}",
            out.report.diagnostics
        );
    }
}

#[test]
fn moe_item_declares_the_moe_stages() {
    let src = "placement loop\nmoe s => s > 0 && s < S - 1\nrank r { F(0) BW(0) }\n";
    let e = load_spec(src, &ov(4, 1)).unwrap();
    assert_eq!(e.program.pipeline.moe_stages, Some(vec![1, 2]));
    // `--moe` (auto) then splits the declared stages only.
    let (p, _) = apply_moe(&e.program, None, &MoeStages::Auto).unwrap();
    assert_eq!(texts(&p)[0], ["F(0,0)", "BW(0,0)"]);
    assert_eq!(texts(&p)[1][0], "F(1,0).attn");
    assert_eq!(texts(&p)[3], ["F(3,0)", "BW(3,0)"]);
    for sel in [MoeStages::Declared, MoeStages::DenseEnds] {
        assert_eq!(apply_moe(&e.program, None, &sel).unwrap().0, p);
    }
}

// ------------------------------------------------------------------ timing expectations

#[test]
fn timing_expectations_see_the_cost_model() {
    use schedc::sim::cost::CostModel;
    let src = "vpp 1\nrank r {\n    let warmup = min(P - r, M)\n    repeat warmup { F(0) }\n    repeat M - warmup { BW(0) F(0) }\n    repeat warmup { BW(0) }\n}\nfn fill(p) = (p - 1) * (F + BW)\nexpect makespan == M * (F + BW) + fill(P)\nexpect bubble(from_start) == (P - 1) / (M + P - 1)\nexpect bubble(steady_state) <= (P - 1) / (M + P - 1)\nexpect exposed_a2a <= 0\n";
    for cost in ["unit", "F=1,B=2,W=0.5", "F=0.3,BW=1.1"] {
        let model = CostModel::resolve(cost).unwrap();
        let e = load_spec(src, &ov(4, 8)).unwrap();
        let mut out = check(&e.program, Some(&e.spans), &Default::default());
        schedc::check::evaluate_timing_expectations(
            &mut out.report,
            out.checked.as_ref(),
            &e.expects,
            &model,
        );
        assert_eq!(
            out.report.verdict,
            Verdict::Accepted,
            "{cost}: {:?}",
            out.report.diagnostics
        );
    }
    // With the all-to-alls of --moe exposed, the bubble bound fails and names the convention.
    let model = CostModel::resolve(
        &schedc_tests::conform::root()
            .join("../shared/costs/moe-1to1.toml")
            .display()
            .to_string(),
    )
    .unwrap();
    let e = load_spec(src, &ov(4, 8)).unwrap();
    let (p, spans) = apply_moe(&e.program, Some(&e.spans), &MoeStages::All).unwrap();
    let mut out = check(&p, spans.as_ref(), &Default::default());
    schedc::check::evaluate_timing_expectations(
        &mut out.report,
        out.checked.as_ref(),
        &e.expects,
        &model,
    );
    let msgs: Vec<&str> = out
        .report
        .diagnostics
        .iter()
        .map(|d| d.message.as_str())
        .collect();
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("bubble (from_start convention) is")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter().any(|m| m.starts_with("exposed all-to-all")),
        "{msgs:?}"
    );
}

/// A timing bound may be an `if` expression (issue 15 items 4 and 11): its condition compares
/// the cost model's seconds, and only the chosen branch is evaluated.
#[test]
fn timing_bounds_take_if_expressions() {
    use schedc::sim::cost::CostModel;
    let prog = "vpp 1\nrank r {\n    let warmup = min(P - r, M)\n    repeat warmup { F(0) }\n    repeat M - warmup { BW(0) F(0) }\n    repeat warmup { BW(0) }\n}\n";
    let verdict = |bound: &str, cost: &str| {
        let src = format!("{prog}expect makespan == {bound}\n");
        let e = load_spec(&src, &ov(4, 8)).unwrap();
        let mut out = check(&e.program, Some(&e.spans), &Default::default());
        schedc::check::evaluate_timing_expectations(
            &mut out.report,
            out.checked.as_ref(),
            &e.expects,
            &CostModel::resolve(cost).unwrap(),
        );
        let msgs: Vec<String> = out
            .report
            .diagnostics
            .iter()
            .filter(|d| d.is_error())
            .map(|d| d.message.clone())
            .collect();
        (out.report.verdict, msgs)
    };
    // The exact 1F1B makespan where F < BW, else 0 (a false bound) or a division by zero.
    let bound = "if F < BW && !(BW == 0) { (M + P - 1) * (F + BW) } else { 0 }";
    assert_eq!(verdict(bound, "F=0.3,BW=1.1").0, Verdict::Accepted);
    assert_eq!(verdict(bound, "unit").0, Verdict::Accepted);
    let (v, msgs) = verdict(bound, "F=2,BW=1");
    assert_eq!(v, Verdict::Rejected);
    assert!(msgs[0].starts_with("makespan"), "{msgs:?}");
    let lazy = "if F < BW { (M + P - 1) * (F + BW) } else { 1 / 0 }";
    assert_eq!(verdict(lazy, "unit").0, Verdict::Accepted);
    // The condition is a comparison or a boolean, not a number.
    let (v, msgs) = verdict("if F { 1 } else { 2 }", "unit");
    assert_eq!(v, Verdict::Rejected);
    assert!(
        msgs.iter().any(|m| m.contains("`if` condition")),
        "{msgs:?}"
    );
}

/// Issue 10, item 5: a warmup one short in Megatron's shape is legal but has a larger
/// bubble; `expect bubble(...)` makes the spec fail.
#[test]
fn a_legal_but_worse_schedule_fails_its_bubble_expectation() {
    let good = "vpp 1\nrank r {\n    let warmup = min(P - r - 1, M)\n    repeat warmup { F(0) }\n    repeat M - warmup { F(0) BW(0) }\n    repeat warmup { BW(0) }\n}\nexpect bubble(from_start) <= (P - 1) / (M + P - 1)\n";
    let bad = good.replace("min(P - r - 1, M)", "min(max(P - r - 2, 0), M)");
    let model = schedc::sim::cost::CostModel::resolve("unit").unwrap();
    let verdict = |src: &str| {
        let e = load_spec(src, &ov(4, 8)).unwrap();
        let mut out = check(&e.program, Some(&e.spans), &Default::default());
        let structural = out.report.verdict;
        schedc::check::evaluate_timing_expectations(
            &mut out.report,
            out.checked.as_ref(),
            &e.expects,
            &model,
        );
        (structural, out.report.verdict, out.report.diagnostics)
    };
    assert_eq!(verdict(good).1, Verdict::Accepted);
    let (structural, v, d) = verdict(&bad);
    assert_eq!(structural, Verdict::Accepted, "the short warmup is legal");
    assert_eq!(v, Verdict::Rejected);
    assert_eq!(d[0].code, Code::Expectation);
}

// ------------------------------------------------------------------ fmt

fn sp() -> Sp {
    Sp::default()
}

fn small_expr() -> impl Strategy<Value = Expr> {
    prop_oneof![
        (0i64..100).prop_map(|v| Expr::Int(v, sp())),
        prop::sample::select(vec!["P", "M", "r", "s", "k"]).prop_map(|n| Expr::Var(n.into(), sp())),
    ]
    .prop_recursive(2, 8, 2, |inner| {
        (
            prop::sample::select(vec![BinOp::Add, BinOp::Mul, BinOp::Div, BinOp::Lt]),
            inner.clone(),
            inner,
        )
            .prop_map(|(o, a, b)| Expr::Bin(o, Box::new(a), Box::new(b), sp()))
    })
}

fn part_stmt() -> impl Strategy<Value = Stmt> {
    let kind = prop::sample::select(vec![Kind::F, Kind::B, Kind::BW]);
    let part = prop::sample::select(vec![Part::Attn, Part::Dispatch, Part::Mlp, Part::Combine]);
    let target = prop_oneof![
        small_expr().prop_map(|e| Target::Next(Some(e))),
        (small_expr(), small_expr()).prop_map(|(a, b)| Target::Chunk(a, b)),
        (small_expr(), small_expr()).prop_map(|(a, b)| Target::Stage(a, b)),
    ];
    prop_oneof![
        (kind, any::<bool>(), target, part).prop_map(|(kind, optional, target, p)| Stmt::Part(
            OpStmt {
                kind,
                optional,
                target,
                checkpoint: false,
                sp: sp()
            },
            p,
            sp()
        )),
        (
            prop::sample::select(vec!["ep", "ep_1", "g"]),
            "[a-z0-9_.{}]{1,12}"
        )
            .prop_map(|(c, l)| Stmt::Collective(CollStmt {
                comm: c.into(),
                label: l,
                sp: sp()
            })),
    ]
}

fn set_spec() -> impl Strategy<Value = SetSpec> {
    prop_oneof![
        Just(SetSpec::All),
        prop::collection::vec(small_expr(), 0..4).prop_map(SetSpec::List),
        small_expr().prop_map(|e| SetSpec::Where("s".into(), e)),
    ]
}

fn new_item() -> impl Strategy<Value = Item> {
    let rel = prop::sample::select(vec![Rel::Le, Rel::Eq, Rel::Ge]);
    let conv = prop::sample::select(schedc::sim::Convention::ALL.to_vec());
    prop_oneof![
        (prop::sample::select(vec!["ep", "ep2", "world"]), set_spec())
            .prop_map(|(n, s)| Item::Communicator(n.into(), s, sp())),
        set_spec().prop_map(|s| Item::Moe(s, sp())),
        prop::collection::vec(part_stmt(), 0..6).prop_map(|b| Item::Rank("r".into(), b, sp())),
        (
            prop_oneof![
                rel.clone().prop_map(ExpectKind::Makespan),
                (conv, rel.clone()).prop_map(|(c, r)| ExpectKind::Bubble(c, r)),
                rel.clone().prop_map(ExpectKind::ExposedA2a),
                rel.prop_map(ExpectKind::ExposedComm),
            ],
            small_expr(),
            prop::option::of(small_expr())
        )
            .prop_map(|(k, e, g)| Item::Expect(k, e, g, sp())),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource("regressions"))), ..ProptestConfig::default() })]

    /// The new syntax formats and parses back to the same tree; formatting is idempotent.
    #[test]
    fn fmt_round_trips_the_moe_syntax(items in prop::collection::vec(new_item(), 0..5)) {
        let file = File { items };
        let text = format_file(&file, "");
        let back = parse_file(&text).map_err(|e| TestCaseError::fail(format!("{e:?}\n{text}")))?;
        prop_assert_eq!(&back, &file, "\n{}", text);
        prop_assert_eq!(format_file(&back, &text), text);
    }
}

// ------------------------------------------------------------------ bad input (issue 10)

/// Every error of a spec instance after `check` (with `--moe` when asked), rendered.
fn rendered(name: &str, src: &str, pp: u32, mb: u32, moe: Option<MoeStages>) -> String {
    let e = load_spec(src, &ov(pp, mb)).unwrap_or_else(|_| panic!("{name} elaborates"));
    let (p, spans) = match &moe {
        Some(sel) => apply_moe(&e.program, Some(&e.spans), sel).unwrap(),
        None => (e.program, Some(e.spans)),
    };
    let mut out = check(&p, spans.as_ref(), &Default::default());
    check_expectations(&mut out.report, &e.expects);
    assert_eq!(out.report.verdict, Verdict::Rejected, "{name}");
    out.report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(|d| schedc::diag::render(d, Some((name, src)), 100))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn bad_input_part_out_of_order() {
    let src = "vpp 1\nrank r {\n    repeat M {\n        F(0).attn\n        F(0).mlp\n        F(0).dispatch\n        F(0).combine\n        BW(0)\n    }\n}\n";
    insta::assert_snapshot!(rendered("order.sched", src, 1, 1, None));
}

#[test]
fn bad_input_all_to_all_outside_its_communicator() {
    let src = "vpp 1\ncommunicator ep [0, 1]\nrank r {\n    F(0)\n    A2A(ep, \"dispatch\")\n    BW(0)\n}\n";
    insta::assert_snapshot!(rendered("member.sched", src, 3, 1, None));
}

#[test]
fn bad_input_all_to_all_orders_disagree() {
    let src = "vpp 1\ncommunicator ep all\nrank r {\n    F(0)\n    if r == 0 {\n        A2A(ep, \"dispatch\")\n        A2A(ep, \"combine\")\n    } else {\n        A2A(ep, \"combine\")\n        A2A(ep, \"dispatch\")\n    }\n    BW(0)\n}\n";
    insta::assert_snapshot!(rendered("order_a2a.sched", src, 2, 1, None));
}

/// An all-to-all entered before the send its EP peer waits for: the wait-for cycle runs
/// through the collective and the point-to-point message, and each step names its line.
#[test]
fn bad_input_all_to_all_and_a_receive_wait_for_each_other() {
    let src = "vpp 1\ncommunicator ep all\nrank r {\n    if r == 0 {\n        F(0)\n        A2A(ep, \"x\")\n        SA(0, 0 -> 1)\n        RG(1, 0 <- 1)\n        BW(0)\n    } else {\n        RA(0, 0 <- 0)\n        F(0)\n        A2A(ep, \"x\")\n        BW(0)\n        SG(1, 0 -> 0)\n    }\n}\n";
    let out = rendered("cycle.sched", src, 2, 1, None);
    assert!(out.contains("deadlock"), "{out}");
    insta::assert_snapshot!(out);
}

#[test]
fn bad_input_moe_part_on_a_dense_stage() {
    let src = "vpp 1\nmoe s => s > 0\nrank r {\n    F(0).attn F(0).dispatch F(0).mlp F(0).combine\n    BW(0)\n}\n";
    insta::assert_snapshot!(rendered("dense.sched", src, 2, 1, None));
}

#[test]
fn bad_input_moe_without_moe_costs() {
    let unit = schedc::sim::cost::CostModel::resolve("unit").unwrap();
    let e = schedc::moe::require_moe_costs(&unit, "unit").unwrap_err();
    insta::assert_snapshot!(e);
    let with = schedc::sim::cost::CostModel::resolve("dispatch=0.1,combine=0.1").unwrap();
    assert!(schedc::moe::require_moe_costs(&with, "inline").is_ok());
    // A [moe] section that gives the all-to-alls no time (zero times, or a bandwidth with no
    // [model] sizes to derive them from) is refused too: they would still be free.
    for free in ["dispatch=0,combine=0", "ep_bandwidth=1e9"] {
        let m = schedc::sim::cost::CostModel::resolve(free).unwrap();
        assert!(m.moe.present, "{free}");
        let e = schedc::moe::require_moe_costs(&m, free).unwrap_err();
        assert!(e.contains("gives the all-to-alls no time"), "{free}: {e}");
    }
}
