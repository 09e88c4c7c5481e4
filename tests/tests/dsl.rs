//! The schedule language: `fmt` round-trips (property test over random syntax trees), the
//! errors users are most likely to hit (snapshots), and elaboration semantics.

use proptest::prelude::*;
use schedc::dsl::ast::*;
use schedc::dsl::{elaborate, fmt::format_file, parse_file, Instance};
use schedc::input::{elab_diag, load_spec, LoadError, Overrides};
use schedc_ir::Kind;

fn sp() -> Sp {
    Sp::default()
}

// ------------------------------------------------------------------ generators

fn name() -> impl Strategy<Value = String> {
    prop::sample::select(vec!["a", "b", "x", "warmup", "k2", "n_1"]).prop_map(str::to_string)
}

fn expr() -> impl Strategy<Value = Expr> {
    let leaf = prop_oneof![
        (0i64..1000).prop_map(|v| Expr::Int(v, sp())),
        any::<bool>().prop_map(|b| Expr::Bool(b, sp())),
        name().prop_map(|n| Expr::Var(n, sp())),
        prop::sample::select(vec!["P", "M", "V", "S", "r"]).prop_map(|n| Expr::Var(n.into(), sp())),
    ];
    leaf.prop_recursive(4, 24, 3, |inner| {
        let ops = prop::sample::select(vec![
            BinOp::Or,
            BinOp::And,
            BinOp::Eq,
            BinOp::Ne,
            BinOp::Lt,
            BinOp::Le,
            BinOp::Gt,
            BinOp::Ge,
            BinOp::Add,
            BinOp::Sub,
            BinOp::Mul,
            BinOp::Div,
            BinOp::Mod,
        ]);
        prop_oneof![
            inner.clone().prop_map(|e| Expr::Neg(Box::new(e), sp())),
            inner.clone().prop_map(|e| Expr::Not(Box::new(e), sp())),
            (ops, inner.clone(), inner.clone()).prop_map(|(o, a, b)| Expr::Bin(
                o,
                Box::new(a),
                Box::new(b),
                sp()
            )),
            (
                prop::sample::select(vec!["min", "max"]),
                prop::collection::vec(inner.clone(), 1..3)
            )
                .prop_map(|(n, v)| Expr::Call(
                    n.into(),
                    v.into_iter().map(Arg::Expr).collect(),
                    sp()
                )),
            (
                prop::sample::select(vec![Kind::F, Kind::B, Kind::W, Kind::BW]),
                inner.clone()
            )
                .prop_map(|(k, c)| Expr::Call(
                    "left".into(),
                    vec![Arg::Kind(k, sp()), Arg::Expr(c)],
                    sp()
                )),
            (inner.clone(), inner.clone(), inner.clone()).prop_map(|(c, a, b)| Expr::If(
                Box::new(c),
                Box::new(a),
                Box::new(b),
                sp()
            )),
            inner.prop_map(|c| Expr::Call("stage".into(), vec![Arg::Expr(c)], sp())),
        ]
    })
}

fn op() -> impl Strategy<Value = OpStmt> {
    let kind = prop::sample::select(vec![Kind::F, Kind::B, Kind::W, Kind::BW]);
    let target = prop_oneof![
        Just(Target::Next(None)),
        expr().prop_map(|e| Target::Next(Some(e))),
        (expr(), expr()).prop_map(|(a, b)| Target::Chunk(a, b)),
        (expr(), expr()).prop_map(|(a, b)| Target::Stage(a, b)),
    ];
    (kind, any::<bool>(), target, any::<bool>()).prop_map(|(kind, optional, target, ck)| {
        OpStmt {
            kind,
            optional,
            target,
            // `!` marks whole forwards only.
            checkpoint: ck && kind == schedc_ir::Kind::F,
            sp: sp(),
        }
    })
}

fn comm() -> impl Strategy<Value = CommStmt> {
    (
        prop::sample::select(vec!["SA", "RA", "SG", "RG"]),
        expr(),
        expr(),
        expr(),
    )
        .prop_map(|(o, s, m, p)| CommStmt {
            op: o.into(),
            stage: s,
            mb: m,
            peer: p,
            sp: sp(),
        })
}

fn stmt() -> impl Strategy<Value = Stmt> {
    let leaf = prop_oneof![
        (name(), expr()).prop_map(|(n, e)| Stmt::Let(n, e, sp())),
        (name(), expr()).prop_map(|(n, e)| Stmt::Var(n, e, sp())),
        (name(), expr()).prop_map(|(n, e)| Stmt::Assign(n, e, sp())),
        op().prop_map(Stmt::Op),
        (op(), op()).prop_map(|(a, b)| Stmt::Overlap(a, b, sp())),
        comm().prop_map(Stmt::Comm),
        prop::collection::vec(comm(), 1..3).prop_map(|v| Stmt::Group(v, sp())),
        Just(Stmt::Idle(sp())),
        (name(), prop::collection::vec(expr(), 0..3)).prop_map(|(n, a)| Stmt::Call(n, a, sp())),
    ];
    leaf.prop_recursive(3, 20, 4, |inner| {
        let body = prop::collection::vec(inner, 0..4);
        prop_oneof![
            (
                name(),
                expr(),
                expr(),
                any::<bool>(),
                prop::option::of(expr()),
                body.clone()
            )
                .prop_map(|(var, from, to, inclusive, step, body)| Stmt::For {
                    var,
                    from,
                    to,
                    inclusive,
                    step,
                    body,
                    sp: sp()
                }),
            (expr(), body.clone()).prop_map(|(e, b)| Stmt::Repeat(e, b, sp())),
            (expr(), body.clone(), body).prop_map(|(c, a, b)| Stmt::If(c, a, b, sp())),
        ]
    })
}

fn list_rule() -> impl Strategy<Value = ListRule> {
    prop_oneof![
        (name(), expr()).prop_map(|(n, e)| ListRule::Let(n, e, sp())),
        (
            prop::sample::select(vec![Kind::F, Kind::B, Kind::W, Kind::BW]),
            name(),
            name(),
            expr()
        )
            .prop_map(|(kind, chunk, mb, expr)| ListRule::Priority {
                kind,
                chunk,
                mb,
                expr,
                sp: sp()
            }),
        expr().prop_map(|e| ListRule::Memory(e, sp())),
        expr().prop_map(|e| ListRule::Inflight(e, sp())),
        Just(ListRule::Defer(Kind::W, sp())),
        Just(ListRule::Strict(sp())),
    ]
}

fn item() -> impl Strategy<Value = Item> {
    prop_oneof![
        "[a-z][a-z0-9_ ]{0,10}".prop_map(|s| Item::Name(s, sp())),
        (name(), prop::option::of(expr())).prop_map(|(n, d)| Item::Param(n, d, sp())),
        expr().prop_map(|e| Item::Vpp(e, sp())),
        expr().prop_map(|e| Item::VppDefault(e, sp())),
        (name(), prop::collection::vec(list_rule(), 0..5)).prop_map(|(n, rules)| Item::List(
            n,
            rules,
            sp()
        )),
        expr().prop_map(|e| Item::Stages(e, sp())),
        expr().prop_map(|e| Item::Microbatches(e, sp())),
        prop_oneof![
            Just(PlacementSpec::Loop),
            Just(PlacementSpec::V),
            Just(PlacementSpec::Bidir),
            prop::collection::vec(expr(), 0..4).prop_map(PlacementSpec::List),
            (name(), expr()).prop_map(|(n, e)| PlacementSpec::Map(n, e)),
        ]
        .prop_map(|p| Item::Placement(p, sp())),
        (name(), expr()).prop_map(|(n, e)| Item::Let(n, e, sp())),
        (name(), prop::collection::vec(name(), 0..3), expr()).prop_map(|(n, ps, e)| Item::Fn(
            n,
            ps,
            e,
            sp()
        )),
        (expr(), "[a-zA-Z0-9 ,.()=<>+-]{0,20}").prop_map(|(e, m)| Item::Require(e, m, sp())),
        (name(), prop::collection::vec(stmt(), 0..5)).prop_map(|(n, b)| Item::Rank(n, b, sp())),
        (
            name(),
            prop::collection::vec(name(), 0..3),
            prop::collection::vec(stmt(), 0..4)
        )
            .prop_map(|(n, ps, b)| Item::Def(n, ps, b, sp())),
        prop_oneof![
            Just(PartsOrder::List(None)),
            expr().prop_map(|e| PartsOrder::List(Some(e))),
            Just(PartsOrder::Adjacent),
        ]
        .prop_map(|o| Item::Parts(o, sp())),
        Just(Item::Literal(
            "\nrank 0: F(0,0) {SA(0,0->1) RG(1,0<-1)} BW(0,0)\n".into(),
            sp()
        )),
        (
            prop::sample::select(vec![
                ExpectKind::Warmup(Rel::Eq),
                ExpectKind::PeakActivations(Rel::Le),
                ExpectKind::PeakActivations(Rel::Ge),
                ExpectKind::Idle(Rel::Eq),
                ExpectKind::Idle(Rel::Le),
                ExpectKind::Warmup(Rel::Ge),
            ]),
            expr(),
            prop::option::of(expr())
        )
            .prop_map(|(k, e, g)| Item::Expect(k, e, g, sp())),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource("regressions"))), ..ProptestConfig::default() })]

    /// Formatting any syntax tree and parsing the text gives the same tree; formatting is
    /// idempotent.
    #[test]
    fn fmt_round_trips(items in prop::collection::vec(item(), 0..6)) {
        // A use of a def needs a `def` of its name in the file (else it is a syntax error):
        // one, empty, for each name the generator uses.
        let mut all: Vec<Item> = ["a", "b", "x", "warmup", "k2", "n_1"]
            .iter()
            .map(|n| Item::Def(n.to_string(), Vec::new(), Vec::new(), sp()))
            .collect();
        all.extend(items);
        let file = File { items: all };
        let text = format_file(&file, "");
        let back = parse_file(&text).map_err(|e| TestCaseError::fail(format!("{e:?}\n{text}")))?;
        prop_assert_eq!(&back, &file, "\n{}", text);
        prop_assert_eq!(format_file(&back, &text), text);
    }
}

#[test]
fn fmt_keeps_comments_and_every_spec_is_canonical() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "sched") {
            continue;
        }
        n += 1;
        let text = std::fs::read_to_string(&p).unwrap();
        let f = parse_file(&text).unwrap_or_else(|e| panic!("{}: {e:?}", p.display()));
        let out = format_file(&f, &text);
        assert_eq!(
            out,
            text,
            "{} is not in canonical layout (run `schedc fmt --write`)",
            p.display()
        );
        let comments_in = text
            .lines()
            .filter(|l| l.trim_start().starts_with('#'))
            .count();
        let comments_out = out
            .lines()
            .filter(|l| l.trim_start().starts_with('#'))
            .count();
        assert_eq!(comments_in, comments_out);
        assert!(
            text.lines().count() <= 70,
            "{} is longer than ~60 lines",
            p.display()
        );
    }
    assert!(n >= 2);
}

// ------------------------------------------------------------------ diagnostics

/// The rendered error for a spec and an instance.
fn spec_error(name: &str, src: &str, pp: u32, mb: u32) -> String {
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        ..Default::default()
    };
    match load_spec(src, &ov) {
        Ok(_) => panic!("{name}: no error"),
        Err(LoadError::Spec { diags, text, .. }) => diags
            .iter()
            .map(|d| schedc::diag::render(d, Some((name, &text)), 100))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(LoadError::Usage(u)) => u,
        Err(e) => panic!("{name}: {e:?}"),
    }
}

#[test]
fn error_missing_brace() {
    insta::assert_snapshot!(spec_error(
        "brace.sched",
        "placement loop\nrank r {\n    F(0)\n    BW(0)\n",
        2,
        2
    ));
}

#[test]
fn error_torch_letter() {
    insta::assert_snapshot!(spec_error(
        "letters.sched",
        "rank r {\n    F(0)\n    I(0)\n}\n",
        2,
        2
    ));
}

#[test]
fn error_assignment_in_require() {
    insta::assert_snapshot!(spec_error(
        "req.sched",
        "require M = 2 * P, \"need 2P micro-batches\"\n",
        2,
        4
    ));
}

#[test]
fn error_missing_message() {
    insta::assert_snapshot!(spec_error(
        "req2.sched",
        "require M >= P\nrank r { F(0) BW(0) }\n",
        2,
        4
    ));
}

#[test]
fn error_unknown_name() {
    insta::assert_snapshot!(spec_error(
        "name.sched",
        "rank r {\n    repeat warmup { F(0) }\n}\n",
        2,
        2
    ));
}

#[test]
fn error_microbatches_exhausted() {
    insta::assert_snapshot!(spec_error(
        "exhausted.sched",
        "rank r {\n    repeat M + 1 { F(0) }\n    repeat M { BW(0) }\n}\n",
        2,
        3
    ));
}

#[test]
fn error_chunk_out_of_range() {
    insta::assert_snapshot!(spec_error(
        "chunk.sched",
        "placement loop\nrank r {\n    F(1)\n}\n",
        2,
        2
    ));
}

#[test]
fn error_require_refuses() {
    insta::assert_snapshot!(spec_error(
        "req3.sched",
        "require M % 2 == 0, \"DualPipe splits the micro-batches in two halves: M must be even\"\nrequire M >= 2 * P, \"needs at least 2P micro-batches\"\n",
        4,
        5
    ));
}

#[test]
fn error_fixed_vpp() {
    let ov = Overrides {
        pp: Some(2),
        microbatches: Some(4),
        vpp: Some(3),
        ..Default::default()
    };
    let src = "vpp 2\nplacement v\nrank r { }\n";
    let Err(LoadError::Spec {
        diags,
        text,
        refused,
    }) = load_spec(src, &ov)
    else {
        panic!()
    };
    assert!(refused);
    insta::assert_snapshot!(schedc::diag::render(
        &diags[0],
        Some(("v.sched", &text)),
        100
    ));
}

#[test]
fn error_not_mutable() {
    insta::assert_snapshot!(spec_error(
        "let.sched",
        "rank r {\n    let n = 0\n    n = n + 1\n}\n",
        2,
        2
    ));
}

#[test]
fn error_division_by_zero() {
    insta::assert_snapshot!(spec_error(
        "div.sched",
        "let k = M / (P - 2)\nrank r { }\n",
        2,
        2
    ));
}

#[test]
fn error_spec_without_instance() {
    let ov = Overrides::default();
    let Err(LoadError::Usage(u)) = load_spec("rank r { }\n", &ov) else {
        panic!()
    };
    assert!(u.contains("--pp P --mb M"), "{u}");
}

#[test]
fn error_failed_expectation_points_at_the_expect_line() {
    let src = "placement loop\nrank r {\n    repeat M { F(0) }\n    repeat M { BW(0) }\n}\nexpect warmup == M - 1\n";
    let ov = Overrides {
        pp: Some(2),
        microbatches: Some(3),
        ..Default::default()
    };
    let e = load_spec(src, &ov).unwrap();
    let mut out = schedc::check::check(&e.program, Some(&e.spans), &Default::default());
    schedc::check::check_expectations(&mut out.report, &e.expects);
    let d: Vec<String> = out
        .report
        .diagnostics
        .iter()
        .map(|d| schedc::diag::render(d, Some(("expect.sched", src)), 100))
        .collect();
    insta::assert_snapshot!(d.join("\n"));
}

#[test]
fn check_errors_point_into_the_spec() {
    // A spec whose order is wrong: the backward before the forward on every rank.
    let src = "placement loop\nrank r {\n    repeat M {\n        BW(0)\n        F(0)\n    }\n}\n";
    let ov = Overrides {
        pp: Some(1),
        microbatches: Some(1),
        ..Default::default()
    };
    let e = load_spec(src, &ov).unwrap();
    let out = schedc::check::check(&e.program, Some(&e.spans), &Default::default());
    let d = out
        .report
        .diagnostics
        .iter()
        .find(|d| d.code == schedc::diag::Code::Order)
        .unwrap();
    insta::assert_snapshot!(schedc::diag::render(d, Some(("order.sched", src)), 100));
}

// ------------------------------------------------------------------ semantics

fn run(src: &str, pp: u32, mb: u32) -> Vec<Vec<String>> {
    let f = parse_file(src).unwrap();
    let e = elaborate(
        &f,
        &Instance {
            pp,
            mb,
            vpp: None,
            params: vec![],
        },
    )
    .map_err(|e| {
        e.iter()
            .map(elab_diag)
            .map(|d| d.message)
            .collect::<Vec<_>>()
    })
    .unwrap();
    e.program
        .ranks
        .iter()
        .map(|r| r.iter().map(schedc_ir::text::instr_to_string).collect())
        .collect()
}

#[test]
fn floor_division_and_modulo_on_negatives() {
    let src = "rank r {\n  if -7 / 2 == -4 && -7 % 2 == 1 && 7 / -2 == -4 && 7 % -2 == -1 && -7 % -2 == -1 { F(0) }\n}\n";
    assert_eq!(run(src, 1, 1), vec![vec!["F(0,0)".to_string()]]);
}

#[test]
fn chunks_counters_and_the_pending_w_queue() {
    // Two chunks on a loop placement: chunk 1 is stage P + r.
    let src = "vpp 2\nplacement loop\nrank r {\n  F(0) F(1) F(0) B(1) B(0) W(0) W() F(1, 1) W(1, 1) B(stage r, 1)\n}\n";
    let got = run(src, 2, 2);
    assert_eq!(
        got[1],
        [
            "F(1,0)", "F(3,0)", "F(1,1)", "B(3,0)", "B(1,0)", "W(1,0)", "W(3,0)", "F(3,1)",
            "W(3,1)", "B(1,1)"
        ]
    );
}

#[test]
fn optional_ops_stop_at_the_last_micro_batch() {
    let src = "rank r {\n  repeat 5 { F?(0) }\n  repeat M { BW(0) }\n  W?()\n}\n";
    let got = run(src, 1, 2);
    assert_eq!(got[0], ["F(0,0)", "F(0,1)", "BW(0,0)", "BW(0,1)"]);
}

#[test]
fn loops_vars_and_else_if() {
    let src = "rank r {\n  var n = 0\n  for i in 0..=6 step 3 { n = n + i }\n  if n == 9 { F(0) } else if n == 0 { idle } else { idle idle }\n  for i in 0..0 { F(0) }\n  BW(0)\n}\n";
    assert_eq!(run(src, 1, 1)[0], ["F(0,0)", "BW(0,0)"]);
}

#[test]
fn placements() {
    let src =
        "stages 3\nplacement s => (s + 1) % P\nrank r {\n  for c in 0..chunks() { F(c) }\n}\n";
    let f = parse_file(src).unwrap();
    let e = elaborate(
        &f,
        &Instance {
            pp: 2,
            mb: 1,
            vpp: None,
            params: vec![],
        },
    )
    .unwrap();
    assert_eq!(e.program.pipeline.stage_to_rank, vec![1, 0, 1]);
    let src = "placement bidir\nrank r { F(0) F(1) }\n";
    let f = parse_file(src).unwrap();
    let e = elaborate(
        &f,
        &Instance {
            pp: 2,
            mb: 4,
            vpp: None,
            params: vec![],
        },
    )
    .unwrap();
    assert_eq!(e.program.pipeline.microbatches, 2);
    assert_eq!(e.program.ranks[0].len(), 2);
    // Rank 0 holds direction 0's stage 0 (id 0) and direction 1's last stage (id 3).
    assert_eq!(
        schedc_ir::text::instr_to_string(&e.program.ranks[0][1]),
        "F(3,0)"
    );
}

#[test]
fn params_and_unknown_params() {
    let src = "param extra = 1\nrank r {\n  repeat extra { F(0) }\n}\n";
    let f = parse_file(src).unwrap();
    let inst = Instance {
        pp: 1,
        mb: 4,
        vpp: None,
        params: vec![("extra".into(), 3)],
    };
    assert_eq!(elaborate(&f, &inst).unwrap().program.ranks[0].len(), 3);
    let inst = Instance {
        pp: 1,
        mb: 4,
        vpp: None,
        params: vec![("nope".into(), 3)],
    };
    let e = elaborate(&f, &inst).unwrap_err();
    assert!(e[0].message.contains("unknown parameter `nope`"));
    assert!(e[0].help.as_ref().unwrap().contains("extra"));
}

#[test]
fn literal_blocks_are_ir_text() {
    let src = "placement loop\nliteral {\nrank 0: F(0,0) SA(0,0->1) RG(1,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n}\n";
    let got = run(src, 2, 1);
    assert_eq!(got[1], ["RA(0,0<-0)", "F(1,0)", "BW(1,0)", "SG(1,0->0)"]);
}

#[test]
fn functions_and_descending_ranges() {
    let src = "let k = 2\nfn twice(x) = k * x\nfn warm(r) = min(P - r, M)\nrank r {\n  for i in warm(r)..=1 step -1 { F(0, i - 1) }\n  for i in 0..twice(0) { idle }\n}\nexpect warmup == warm(r)\n";
    let f = parse_file(src).unwrap();
    let e = elaborate(
        &f,
        &Instance {
            pp: 3,
            mb: 2,
            vpp: None,
            params: vec![],
        },
    )
    .unwrap();
    let r0: Vec<String> = e.program.ranks[0]
        .iter()
        .map(schedc_ir::text::instr_to_string)
        .collect();
    assert_eq!(r0, ["F(0,1)", "F(0,0)"]);
    assert_eq!(e.expects[0].values, vec![2, 2, 1]);
    // A function cannot shadow a built-in, and runaway recursion is an error, not a crash.
    let f = parse_file("fn min(a) = a\n").unwrap();
    assert!(elaborate(
        &f,
        &Instance {
            pp: 1,
            mb: 1,
            vpp: None,
            params: vec![]
        }
    )
    .is_err());
    let f = parse_file("fn f(x) = f(x + 1)\nlet y = f(0)\n").unwrap();
    let err = elaborate(
        &f,
        &Instance {
            pp: 1,
            mb: 1,
            vpp: None,
            params: vec![],
        },
    )
    .unwrap_err();
    assert!(err[0].message.contains("too deeply"), "{}", err[0].message);
    // Arity.
    let f = parse_file("fn f(x) = x\nlet y = f(1, 2)\n").unwrap();
    let err = elaborate(
        &f,
        &Instance {
            pp: 1,
            mb: 1,
            vpp: None,
            params: vec![],
        },
    )
    .unwrap_err();
    assert!(
        err[0].message.contains("takes 1 argument"),
        "{}",
        err[0].message
    );
}

// ------------------------------------------------------------------ issue 15 and 11 fixes

fn elab(src: &str, pp: u32, mb: u32, params: Vec<(String, i64)>) -> schedc::dsl::Elaborated {
    let f = parse_file(src).unwrap_or_else(|e| panic!("{e:?}"));
    elaborate(
        &f,
        &Instance {
            pp,
            mb,
            vpp: None,
            params,
        },
    )
    .unwrap_or_else(|e| panic!("{:?}", e))
}

/// Issue 15 item 1: `stage(c)` is a built-in function although `stage` is a keyword.
#[test]
fn stage_of_a_chunk_parses() {
    let src = "vpp 2\nplacement v\nrank r {\n  if stage(1) == 2 * P - 1 - r { F(0) F(1) }\n}\n";
    let got = run(src, 2, 1);
    assert_eq!(got[0], ["F(0,0)", "F(3,0)"]);
    assert_eq!(got[1], ["F(1,0)", "F(2,0)"]);
}

/// Issue 15 item 2: items are evaluated in file order, `vpp` included.
#[test]
fn vpp_is_evaluated_in_file_order() {
    let src = "param waves = 2\nvpp 2 * waves\nplacement v\nlet s = S\nrank r { }\n";
    let e = elab(src, 2, 1, vec![]);
    assert_eq!(e.program.pipeline.stages, 8);
    let e = elab(src, 2, 1, vec![("waves".into(), 3)]);
    assert_eq!(e.program.pipeline.stages, 12);
    // V used before the `vpp` item: an error that says where V comes from.
    insta::assert_snapshot!(spec_error(
        "order.sched",
        "let chunks_per_rank = V\nvpp 2\nrank r { }\n",
        2,
        2
    ));
}

/// Issue 15 item 4: conditional expressions; only the chosen branch is evaluated.
#[test]
fn if_expressions() {
    let src = "let a = if P > 2 { 10 } else if P == 2 { 20 } else { 1 / 0 }\nrank r {\n  repeat if r == 0 { a / 10 } else { 0 } { F(0) }\n}\n";
    assert_eq!(run(src, 3, 1)[0], ["F(0,0)"]);
    let e = elab(
        "let a = if P > 2 { 10 } else if P == 2 { 20 } else { 1 / 0 }\nrank r { }\nexpect warmup == a\n",
        2,
        1,
        vec![],
    );
    assert_eq!(e.expects[0].values, vec![20, 20]);
    let e = elaborate(
        &parse_file("let a = if P > 0 { true } else { 1 }\nrank r { repeat a { F(0) } }\n")
            .unwrap(),
        &Instance {
            pp: 1,
            mb: 1,
            vpp: None,
            params: vec![],
        },
    )
    .unwrap_err();
    assert!(e[0]
        .message
        .contains("expected an integer, found a boolean"));
    // An `if` expression needs both branches.
    insta::assert_snapshot!(spec_error("if.sched", "let a = if P > 2 { 1 }\n", 2, 2));
}

/// Issue 15 item 6: a missing op points at the spec (the end of its rank's program).
#[test]
fn missing_op_has_a_location() {
    let src =
        "placement loop\nrank r {\n    repeat M - 1 { F(0) }\n    repeat M - 1 { BW(0) }\n}\n";
    insta::assert_snapshot!(checked("missing.sched", src, 2, 3));
}

/// Issue 15 item 7 (issue 11 item 33): one mistake, one error, not one per micro-batch.
#[test]
fn order_errors_of_one_statement_are_grouped() {
    let src = "placement loop\nrank r {\n    repeat M {\n        BW(0)\n        F(0)\n    }\n}\n";
    let out = checked("order.sched", src, 1, 8);
    assert_eq!(out.matches("schedc::order").count(), 1, "{out}");
    insta::assert_snapshot!(out);
}

/// Issue 15 item 8: elaboration errors name the loop iteration; after an explicit
/// `F(c, m)` the counter error says which micro-batches are still missing.
#[test]
fn elaboration_errors_name_the_iteration() {
    insta::assert_snapshot!(spec_error(
        "iter.sched",
        "vpp 2\nrank r {\n    for c in 0..3 {\n        repeat 2 {\n            F(c)\n        }\n    }\n}\n",
        2,
        2
    ));
    insta::assert_snapshot!(spec_error(
        "explicit.sched",
        "rank r {\n    F(0, 1)\n    F(0)\n}\n",
        2,
        2
    ));
}

/// Issue 11 item 19: a spec states its default V; without one, V = 1 is said.
#[test]
fn default_vpp() {
    let src = "vpp default 2\nplacement loop\nrank r { for c in 0..V { F(c) } }\n";
    let e = elab(src, 2, 1, vec![]);
    assert_eq!(e.program.pipeline.stages, 4);
    assert!(e.notes.is_empty());
    let f = parse_file(src).unwrap();
    let e = elaborate(
        &f,
        &Instance {
            pp: 2,
            mb: 1,
            vpp: Some(3),
            params: vec![],
        },
    )
    .unwrap();
    assert_eq!(e.program.pipeline.stages, 6);
    let e = elab("placement loop\nrank r { F(0) }\n", 2, 1, vec![]);
    assert_eq!(
        e.notes,
        ["V = 1 virtual stage per rank: this spec states no default V (pass --vpp)"]
    );
    let f = parse_file("vpp 2\nvpp default 2\nrank r { }\n").unwrap();
    assert!(elaborate(
        &f,
        &Instance {
            pp: 1,
            mb: 1,
            vpp: None,
            params: vec![]
        }
    )
    .is_err());
}

/// Issue 11 item 20: `fmt` keeps a comment at the end of its line and a block's last
/// comment inside the block.
#[test]
fn fmt_keeps_trailing_comments_in_place() {
    let src = "let a = 1 # the a\n\nrank r {\n    F(0) # fwd\n    repeat M {\n        BW(0) # inner\n        # last in the repeat\n    } # after\n    if r == 0 { BW(0) } else { BW(0) } # one line\n    # last in rank\n}\n\nlist q {\n    F(c, m) = m # fp\n    # last rule\n}\n";
    let f = parse_file(src).unwrap();
    assert_eq!(format_file(&f, src), src);
}

/// Issue 11 item 23: an integer literal that does not fit says so; the nesting limit on a
/// very long line keeps its file:line:col.
#[test]
fn literal_too_large_and_nesting_on_a_long_line() {
    insta::assert_snapshot!(spec_error(
        "big.sched",
        "let a = 99999999999999999999\n",
        2,
        2
    ));
    let deep = format!("let a = {}1{}\n", "(".repeat(200), ")".repeat(200));
    let src = format!("{}\n{deep}", "# ".repeat(3000));
    let e = spec_error("deep.sched", &src, 2, 2);
    assert!(e.contains("too complex"), "{e}");
    assert!(e.contains("deep.sched:2:"), "{e}");
}

/// The rendered check diagnostics of a spec instance.
fn checked(name: &str, src: &str, pp: u32, mb: u32) -> String {
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        ..Default::default()
    };
    let e = load_spec(src, &ov).unwrap();
    let out = schedc::check::check(&e.program, Some(&e.spans), &Default::default());
    out.report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(|d| schedc::diag::render(d, Some((name, src)), 100))
        .collect::<Vec<_>>()
        .join("\n")
}

// ------------------------------------------------------------------ list scheduling

/// A list block with 1F1B's priorities, run strictly, gives specs/1f1b.sched's orders; with
/// backfilling under 1F1B's memory (`memory <= w`) it gives the same (without the cap the
/// greedy would run the forwards early, GPipe-like, at no cost in time).
#[test]
fn list_scheduling_reproduces_1f1b() {
    let want = run(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/1f1b.sched"),
        )
        .unwrap(),
        4,
        8,
    );
    for rule in ["strict", "memory <= w"] {
        let src = format!(
            "vpp 1\nlist r {{\n    let w = min(P - r, M)\n    F(c, m) = if m < w {{ 2 * m }} else {{ 2 * m + 1 }}\n    BW(c, m) = 2 * (m + w)\n    {rule}\n}}\n"
        );
        assert_eq!(run(&src, 4, 8), want, "{rule}");
    }
}

/// The greedy that cannot finish says why, at the rule that blocks.
#[test]
fn list_scheduling_stuck_is_an_error_at_the_rule() {
    insta::assert_snapshot!(spec_error(
        "stuck.sched",
        "vpp 2\nplacement v\nlist r {\n    F(c, m) = m\n    BW(c, m) = 100 + m\n    memory <= 1\n}\n",
        2,
        2
    ));
}

/// A list block's lines are checked: the kinds it needs, duplicates, what can be deferred.
#[test]
fn list_rules_are_checked() {
    let cases = [
        (
            "list r {\n    BW(c, m) = m\n}\n",
            "no priority for the forwards",
        ),
        (
            "list r {\n    F(c, m) = m\n}\n",
            "no priority for the backwards",
        ),
        (
            "list r {\n    F(c, m) = m\n    BW(c, m) = m\n    B(c, m) = m\n}\n",
            "either fused backwards",
        ),
        (
            "list r {\n    F(c, m) = m\n    BW(c, m) = m\n    defer W\n}\n",
            "needs split backwards",
        ),
        (
            "list r {\n    F(c, m) = m\n    F(c, m) = 2 * m\n    BW(c, m) = m\n}\n",
            "a second `F(c, m) =` line",
        ),
        (
            "list r {\n    F(c, m) = m\n    B(c, m) = m\n    defer F\n}\n",
            "only `W` can be deferred",
        ),
        (
            "list r {\n    F(c, m) = m\n    BW(c, m) = m\n    memory <= 0\n}\n",
            "at least 1",
        ),
        (
            "rank r { }\nlist r {\n    F(c, m) = m\n    BW(c, m) = m\n}\n",
            "not two",
        ),
        (
            "list r {\n    F(c, m) = true\n    BW(c, m) = m\n}\n",
            "priority of F(c = 0, m = 0)",
        ),
    ];
    for (src, want) in cases {
        let f = parse_file(src).unwrap_or_else(|e| panic!("{src}: {e:?}"));
        let e = elaborate(
            &f,
            &Instance {
                pp: 2,
                mb: 2,
                vpp: None,
                params: vec![],
            },
        )
        .unwrap_err();
        assert!(e[0].message.contains(want), "{src}: {}", e[0].message);
    }
}

/// `W(c, m)` without `defer W` orders weight gradients like any op; `defer W` lets them fill
/// bubbles: ZB-H1's bubble (P - 1 in unit time) from 1F1B-like priorities.
#[test]
fn list_scheduling_defers_w_into_bubbles() {
    let src = "vpp 1\nlist r {\n    let w = min(P - r, M)\n    F(c, m) = if m < w { 2 * m } else { 2 * m + 1 }\n    B(c, m) = 2 * (m + w)\n    defer W\n}\n";
    let ov = Overrides {
        pp: Some(4),
        microbatches: Some(8),
        ..Default::default()
    };
    let e = load_spec(src, &ov).unwrap();
    let out = schedc::check::check(&e.program, Some(&e.spans), &Default::default());
    assert_eq!(out.report.verdict, schedc::check::Verdict::Accepted);
    let idle: Vec<f64> = out.report.ranks.iter().map(|r| r.idle.unwrap()).collect();
    assert!(idle.iter().all(|&i| i <= 3.0), "{idle:?}");
}

/// Loads a list-scheduled spec at (pp, mb), scheduled under `cost`, and checks it with its
/// expectations (timing ones under the same cost): the error messages, none if accepted.
fn list_check(src: &str, pp: u32, mb: u32, cost: &str) -> Vec<String> {
    let model = schedc::sim::cost::CostModel::resolve(cost).unwrap();
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        list_cost: Some(model.clone()),
        ..Default::default()
    };
    let e = match load_spec(src, &ov) {
        Ok(e) => e,
        Err(LoadError::Spec { diags, .. }) => {
            return diags.iter().map(|d| d.message.clone()).collect()
        }
        Err(e) => panic!("{e:?}"),
    };
    let mut out = schedc::check::check(&e.program, Some(&e.spans), &Default::default());
    schedc::check::check_expectations(&mut out.report, &e.expects);
    schedc::check::evaluate_timing_expectations(
        &mut out.report,
        out.checked.as_ref(),
        &e.expects,
        &model,
    );
    out.report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(|d| d.message.clone())
        .collect()
}

fn std_spec(name: &str) -> String {
    std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../specs")
            .join(format!("{name}.sched")),
    )
    .unwrap()
}

// Break-it pass: an op time of zero (or below the scheduler's resolution) frees the rank at
// the same instant; the greedy used to report itself stuck at time 0.
#[test]
fn list_scheduling_with_zero_op_times() {
    for spec in ["v_half", "v_min", "hanayo", "chimera"] {
        let src = std_spec(spec);
        for cost in ["F=0", "F=1e-12", "B=0", "F=0,B=1,W=1", "W=0"] {
            let errs = list_check(&src, 4, 8, cost);
            assert!(errs.is_empty(), "{spec} --cost {cost}: {errs:?}");
        }
    }
}

// Break-it pass: under `inflight <= k` a micro-batch may enter out of order while a slot
// stays free for the next in order (priorities that start micro-batch 1 first used to be
// stuck "at 0 in flight, cap 8").
#[test]
fn inflight_admits_out_of_order_entry_with_a_free_slot() {
    let src = "schedule \"x\"\nlist r {\n    F(c, m) = if m == 1 { 0 } else { m + 1 }\n    BW(c, m) = 100 + m\n    inflight <= 8\n}\n";
    assert_eq!(list_check(src, 2, 4, "unit"), Vec::<String>::new());
    // At cap 1 only the next in order may enter; the stuck message says why.
    let errs = list_check(&src.replace("<= 8", "<= 1"), 2, 4, "unit");
    assert!(
        errs.iter().any(|e| e.contains("list scheduling is stuck")),
        "{errs:?}"
    );
}

// Break-it pass: a rank program's progress functions mean nothing in a list block.
#[test]
fn list_priorities_refuse_progress_functions() {
    for f in ["pending()", "done(F, 0)", "left(F, 0)"] {
        let src = format!(
            "schedule \"x\"\nlist r {{\n    F(c, m) = m + {f}\n    BW(c, m) = 100 + m\n}}\n"
        );
        let e = spec_error("x.sched", &src, 2, 4);
        assert!(e.contains("is not defined in a `list` block"), "{f}: {e}");
    }
}

// Break-it pass: the measured makespan bounds of v_half, v_min and hanayo are claimed only
// with free messages (`MSG == 0` in their guard); under a latency they state nothing.
#[test]
fn measured_bounds_are_not_claimed_under_latency() {
    for spec in ["v_half", "v_min", "hanayo"] {
        let src = std_spec(spec);
        for (pp, mb) in [(3, 8), (4, 12), (6, 6)] {
            let errs = list_check(&src, pp, mb, "F=1,B=1,W=1,latency=0.3");
            assert!(errs.is_empty(), "{spec} P={pp} M={mb}: {errs:?}");
        }
    }
}

/// The `expect` errors of a rank-program spec at (pp, mb) under `cost`.
fn expect_errors(src: &str, pp: u32, mb: u32, cost: &str) -> Vec<String> {
    list_check(src, pp, mb, cost)
}

const GPIPE_BODY: &str =
    "placement loop\nrank r {\n    repeat M { F(0) }\n    repeat M { BW(0) }\n}\n";

// Issue (expect grammar): every figure takes `<=`, `==` and `>=`.
#[test]
fn expect_every_figure_takes_le_eq_ge() {
    // GPipe at P = 2, M = 3: warmup 3, peak 3, unit idle 3 (P - 1 = 1 F + 2 BW... per rank).
    let ok = format!(
        "{GPIPE_BODY}expect warmup >= M\nexpect warmup <= M\nexpect peak_activations >= M\nexpect idle >= 3 * (P - 1)\nexpect idle <= 3 * (P - 1)\nexpect makespan >= 1\n"
    );
    assert_eq!(expect_errors(&ok, 2, 3, "unit"), Vec::<String>::new());
    let bad = format!("{GPIPE_BODY}expect warmup >= M + 1\nexpect idle <= 2\n");
    assert_eq!(
        expect_errors(&bad, 2, 3, "unit"),
        vec![
            "warmup does not hold on 2 rank(s): rank 0: 3, expected >= 4; rank 1: 3, expected >= 4"
                .to_string(),
            "unit-time idle does not hold on 2 rank(s): rank 0: 3, expected <= 2; rank 1: 3, expected <= 2"
                .to_string(),
        ]
    );
    let timing = format!("{GPIPE_BODY}expect makespan >= 100\n");
    assert_eq!(
        expect_errors(&timing, 2, 3, "unit"),
        vec!["makespan is 12.000000, expected >= 100.000000".to_string()]
    );
}

// Issue (expect grammar): `if COND` limits a line to where COND holds: per rank for the
// per-rank figures, under the cost model for the timing ones.
#[test]
fn expect_if_guard_applies_where_it_holds() {
    // Only rank 0 is claimed (wrongly for rank 1 too, were the guard ignored).
    let per_rank = format!(
        "{GPIPE_BODY}expect warmup == 99 if r == 1 && P == 3\nexpect idle == 0 if r == 5\n"
    );
    assert_eq!(expect_errors(&per_rank, 2, 3, "unit"), Vec::<String>::new());
    assert_eq!(
        expect_errors(&per_rank, 3, 3, "unit"),
        vec!["warmup does not hold on 1 rank(s): rank 1: 3, expected == 99".to_string()]
    );
    // A guard on the cost model: the bound applies only with equal F and B.
    let timing = format!("{GPIPE_BODY}expect makespan <= 4 * (F + BW) if F == B\n");
    assert_eq!(expect_errors(&timing, 2, 3, "unit"), Vec::<String>::new());
    assert_eq!(
        expect_errors(&timing, 2, 3, "F=1,B=2,W=1"),
        Vec::<String>::new()
    );
    let tight = format!("{GPIPE_BODY}expect makespan <= F if F == B\n");
    assert_eq!(
        expect_errors(&tight, 2, 3, "unit"),
        vec!["makespan is 12.000000, expected <= 1.000000".to_string()]
    );
    assert_eq!(
        expect_errors(&tight, 2, 3, "F=1,B=2,W=1"),
        Vec::<String>::new()
    );
    // Where the guard fails the bound is not evaluated (it may be undefined there).
    let undefined = format!("{GPIPE_BODY}expect idle == 1 / (P - 2) if P != 2\n");
    assert_eq!(
        expect_errors(&undefined, 2, 3, "unit"),
        Vec::<String>::new()
    );
    // A guard that is not a condition is an error at the guard.
    let not_bool = format!("{GPIPE_BODY}expect idle == 3 if P\n");
    let ov = Overrides {
        pp: Some(2),
        microbatches: Some(3),
        ..Default::default()
    };
    let Err(LoadError::Spec { diags, .. }) = load_spec(&not_bool, &ov) else {
        panic!("a non-boolean guard elaborated")
    };
    assert!(diags[0].message.contains("bool"), "{}", diags[0].message);
}

// Issue (expect grammar): `fmt` prints the relations and the guard, and reads them back.
#[test]
fn expect_relations_and_guard_round_trip_through_fmt() {
    let src = "rank r {\n    F(0)\n}\n\nexpect warmup >= 1 if r == 0\nexpect peak_activations <= M\nexpect idle >= 0\nexpect makespan <= 2 * F if F == B && MSG == 0\nexpect bubble(from_start) >= 0\nexpect exposed_comm <= 0 if P > 1\n";
    let f = parse_file(src).unwrap();
    assert_eq!(format_file(&f, src), src);
    let Item::Expect(kind, _, guard, _) = &f.items[1] else {
        panic!("{:?}", f.items[1])
    };
    assert_eq!(*kind, ExpectKind::Warmup(Rel::Ge));
    assert!(guard.is_some());
    // `=` gets the old hint; an unknown relation names the three.
    let e = parse_file("expect warmup < 1\n").unwrap_err();
    assert!(e.message.contains("`<=`, `==` or `>=`"), "{}", e.message);
}

// Breakit item 23: `fmt` keeps a comment at the end of a block's header line on that line
// and one after ops on their line, instead of moving it into the block.
#[test]
fn item23_fmt_keeps_header_and_line_comments_in_place() {
    for (src, want) in [
        (
            "rank r {\n    F?(0); BW(0) # pair\n    for i in 0..M { # loop head\n        F(0)\n        BW(0)\n    }\n}\n",
            "rank r {\n    F?(0) BW(0) # pair\n    for i in 0..M { # loop head\n        F(0)\n        BW(0)\n    }\n}\n",
        ),
        (
            "rank r # after rank r\n{ # after brace\n    F(0) BW(0)\n}\n",
            "rank r { # after rank r\n    # after brace\n    F(0)\n    BW(0)\n}\n",
        ),
        (
            "rank r {\n    repeat M { F?(0); BW(0) # pair\n    }\n    if r == 0 { # first\n        F(0)\n    }\n}\n",
            "rank r {\n    repeat M {\n        F?(0) BW(0) # pair\n    }\n    if r == 0 { # first\n        F(0)\n    }\n}\n",
        ),
        (
            "list r { # greedy\n    F(c, m) = m\n    BW(c, m) = m\n}\n",
            "list r { # greedy\n    F(c, m) = m\n    BW(c, m) = m\n}\n",
        ),
    ] {
        let f = parse_file(src).unwrap();
        let out = format_file(&f, src);
        assert_eq!(out, want, "{src}");
        // Idempotent, and the same program.
        let back = parse_file(&out).unwrap();
        assert_eq!(format_file(&back, &out), out);
        assert_eq!(back, f);
    }
}

/// Rank 0's ops of a one-rank spec at M = `mb`, as text.
fn rank0_ops(src: &str, mb: u32) -> Vec<String> {
    let ov = Overrides {
        pp: Some(1),
        microbatches: Some(mb),
        ..Default::default()
    };
    let e = load_spec(src, &ov).unwrap_or_else(|e| panic!("{e:?}"));
    e.program.ranks[0]
        .iter()
        .map(schedc_ir::text::instr_to_string)
        .collect()
}

// Issue (`done`): `done(K, c)` is chunk c's counter for K, the micro-batch the next `K(c)`
// takes (the count run when ops run in order), as the language chapter now says; an explicit
// `K(c, m)` moves it past m; `left(K, c)` is M minus it; `done(W, c)` counts the Ws run.
#[test]
fn done_is_the_chunk_counter_as_the_language_chapter_says() {
    let src = "placement loop\nrank r {\n    F(0, 2)\n    F(0, done(F, 0) - 3)\n    F(0, left(F, 0))\n    F(0)\n    B(0, done(B, 0) + 1)\n    B(0, 0)\n    W(0)\n    B(0, done(W, 0) + 1)\n    B(0)\n    repeat 4 - done(W, 0) { W(0) }\n}\n";
    assert_eq!(
        rank0_ops(src, 4),
        [
            "F(0,2)", "F(0,0)", "F(0,1)", "F(0,3)", "B(0,1)", "B(0,0)", "W(0,1)", "B(0,2)",
            "B(0,3)", "W(0,0)", "W(0,2)", "W(0,3)"
        ]
    );
}

// Breakit#5 (list scheduling grew as P^3): the greedy's lower bounds are now computed only
// where a decision reads them, and memoized per state. The orders must not change: the
// FNV-1a hash of each program's IR text, pinned from the greedy before the change (the
// same programs as `schedc convert SPEC --pp P --mb M --cost C --to ir-text`).
#[test]
fn list_scheduled_orders_are_unchanged_by_the_incremental_bounds() {
    let fnv = |s: &str| {
        s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    let profa = "F=1,B=1.1,W=0.9,latency=0.05";
    // (spec, P, M, parameters, cost, hash)
    type Case<'a> = (&'a str, u32, u32, &'a [(&'a str, i64)], &'a str, u64);
    let cases: [Case; 8] = [
        ("v_half", 16, 32, &[], "unit", 0xab9c_77c9_089b_0e4c),
        ("v_half", 8, 24, &[], profa, 0x2509_dc98_36bf_f88a),
        (
            "v_half",
            7,
            5,
            &[],
            "F=1,B=2,W=1,latency=0.3",
            0x3a4f_c5a7_d49f_443e,
        ),
        ("v_min", 12, 30, &[], profa, 0xf298_a85d_8bb0_77b7),
        ("hanayo", 8, 16, &[], "unit", 0xe0db_97ee_7aab_4c97),
        (
            "hanayo",
            6,
            13,
            &[("waves", 3)],
            profa,
            0xde94_0616_1abc_4ff1,
        ),
        (
            "chimera",
            8,
            16,
            &[],
            "F=1,B=2,W=1,latency=0.3",
            0xe7ba_69fc_4292_5ca0,
        ),
        ("chimera_direct", 4, 8, &[], "unit", 0x97d2_4889_07f4_6905),
    ];
    let mut got = Vec::new();
    for (spec, pp, mb, params, cost, _) in cases {
        let ov = Overrides {
            pp: Some(pp),
            microbatches: Some(mb),
            params: params.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            list_cost: Some(schedc::sim::cost::CostModel::resolve(cost).unwrap()),
            ..Default::default()
        };
        let e = load_spec(&std_spec(spec), &ov).unwrap_or_else(|e| panic!("{spec}: {e:?}"));
        got.push(fnv(&schedc_ir::text::print(&e.program)));
    }
    let want: Vec<u64> = cases.iter().map(|c| c.5).collect();
    assert_eq!(got, want, "{got:#x?}");
}

/// Issue 27: `schedc fmt` keeps the checkpoint mark of `F(c)!` (it dropped it, turning a
/// recomputed forward into a stored one).
#[test]
fn fmt_keeps_the_checkpoint_mark_of_a_forward() {
    let text = "schedule \"c\"\nvpp 1\nplacement loop\n\nrank r {\n    F(0, 0)!\n    RECOMPUTE(0, 0)\n    BW(0, 0)\n}\n";
    let f = parse_file(text).unwrap();
    let out = format_file(&f, text);
    assert!(out.contains("    F(0, 0)!\n"), "{out}");
}
