//! insta snapshots of the human rendering of each error kind (rustc-style, with the source
//! excerpt), so a change in wording or location shows up in review.

use schedc::check::{check, Options};
use schedc::diag::{render, Code};
use schedc_ir::text::parse;

/// Checks `src` and renders every error of kind `code`.
fn rendered(name: &str, src: &str, code: Code, opts: &Options) -> String {
    let p = parse(src).unwrap_or_else(|e| panic!("{name}: {e}"));
    let out = check(&p.program, Some(&p.spans), opts);
    let ds: Vec<_> = out
        .report
        .diagnostics
        .iter()
        .filter(|d| d.code == code)
        .collect();
    assert!(
        !ds.is_empty(),
        "{name}: no `{}` diagnostic; got {:?}",
        code.as_str(),
        out.report.diagnostics
    );
    ds.iter()
        .map(|d| render(d, Some((name, src)), 100))
        .collect::<Vec<_>>()
        .join("\n")
}

fn snap(name: &str, src: &str, code: Code) -> String {
    rendered(name, src, code, &Options::default())
}

#[test]
fn deadlock() {
    let src = "pp 2\nstages 2\nmicrobatches 2\nplacement loop\n\
rank 0: F(0,0) SA(0,0->1) F(0,1) SA(0,1->1) RG(1,0<-1) BW(0,0) RG(1,1<-1) BW(0,1)\n\
rank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0) RA(0,1<-0) F(1,1) BW(1,1) SG(1,1->0)\n";
    insta::assert_snapshot!(snap("naive-1f1b.ir", src, Code::Deadlock));
}

#[test]
fn deadlock_names_the_ranks_blocked_behind_it() {
    // Ranks 0 and 1 deadlock as in `deadlock`; rank 2 waits for rank 1's activation, which
    // rank 1 never sends: it is blocked behind the cycle.
    let src = "pp 3\nstages 3\nmicrobatches 2\nplacement loop\n\
rank 0: F(0,0) SA(0,0->1) F(0,1) SA(0,1->1) RG(1,0<-1) BW(0,0) RG(1,1<-1) BW(0,1)\n\
rank 1: RA(0,0<-0) F(1,0) SG(1,0->0) SA(1,0->2) RA(0,1<-0) F(1,1) SA(1,1->2) RG(2,0<-2) BW(1,0) RG(2,1<-2) BW(1,1)\n\
rank 2: RA(1,0<-1) F(2,0) BW(2,0) SG(2,0->1) RA(1,1<-1) F(2,1) BW(2,1) SG(2,1->1)\n";
    insta::assert_snapshot!(snap("behind.ir", src, Code::Deadlock));
}

#[test]
fn deadlock_in_compute_order() {
    // Rank 0 runs F(0,1) only after BW(0,0); rank 1 wants F(1,1) before BW(1,0): no execution.
    let src = "pp 2\nstages 2\nmicrobatches 2\nplacement loop\n\
rank 0: F(0,0) BW(0,0) F(0,1) BW(0,1)\n\
rank 1: F(1,0) F(1,1) BW(1,0) BW(1,1)\n";
    insta::assert_snapshot!(snap("cycle.ir", src, Code::Deadlock));
}

#[test]
fn stall() {
    let src = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\n\
rank 0: F(0,0) SA(0,0->1) RG(1,0<-1) RG(1,0<-1) BW(0,0)\n\
rank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n";
    insta::assert_snapshot!(snap("extra-recv.ir", src, Code::Stall));
}

#[test]
fn label_mismatch() {
    let src = "pp 2\nstages 2\nmicrobatches 2\nplacement loop\n\
rank 0: F(0,0) F(0,1) SA(0,1->1) SA(0,0->1) RG(1,0<-1) BW(0,0) RG(1,1<-1) BW(0,1)\n\
rank 1: RA(0,0<-0) RA(0,1<-0) F(1,0) BW(1,0) SG(1,0->0) F(1,1) BW(1,1) SG(1,1->0)\n";
    insta::assert_snapshot!(snap("swapped-sends.ir", src, Code::LabelMismatch));
}

#[test]
fn unmatched() {
    let src = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\n\
rank 0: F(0,0) SA(0,0->1) BW(0,0)\n\
rank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n";
    insta::assert_snapshot!(snap("no-grad-recv.ir", src, Code::Unmatched));
}

#[test]
fn missing_op() {
    let src = "pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) F(0,1) B(0,0) W(0,0) B(0,1)\n";
    insta::assert_snapshot!(snap("missing-w.ir", src, Code::MissingOp));
}

#[test]
fn duplicate_op() {
    let src = "pp 1\nstages 1\nmicrobatches 1\nplacement loop\nrank 0: F(0,0) F(0,0) BW(0,0)\n";
    insta::assert_snapshot!(snap("dup.ir", src, Code::DuplicateOp));
}

#[test]
fn order() {
    let src = "pp 1\nstages 1\nmicrobatches 1\nplacement loop\nrank 0: F(0,0) W(0,0) B(0,0)\n";
    insta::assert_snapshot!(snap("w-before-b.ir", src, Code::Order));
}

#[test]
fn order_moe_parts() {
    let src = "pp 1\nstages 1\nmicrobatches 1\nplacement loop\nrank 0: F(0,0).attn F(0,0).mlp F(0,0).dispatch F(0,0).combine BW(0,0)\n";
    insta::assert_snapshot!(snap("moe.ir", src, Code::Order));
}

#[test]
fn placement() {
    let src = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\nrank 0: F(0,0) F(1,0) BW(1,0) BW(0,0)\nrank 1:\n";
    insta::assert_snapshot!(snap("wrong-rank.ir", src, Code::Placement));
}

#[test]
fn range() {
    let src = "pp 1\nstages 1\nmicrobatches 1\nplacement loop\nrank 0: F(0,0) F(0,1) BW(0,0)\n";
    insta::assert_snapshot!(snap("mb-range.ir", src, Code::Range));
}

#[test]
fn memory() {
    let src = "pp 1\nstages 1\nmicrobatches 3\nplacement loop\nbudget activations 2\nrank 0: F(0,0) F(0,1) F(0,2) BW(0,0) BW(0,1) BW(0,2)\n";
    let p = parse(src).unwrap();
    let opts = Options {
        max_activations: p.budget_activations,
        ..Default::default()
    };
    insta::assert_snapshot!(rendered("gpipe.ir", src, Code::Memory, &opts));
}

#[test]
fn collective_order() {
    let src = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\ngroup ep 0 1\n\
rank 0: F(0,0) SA(0,0->1) A2A(ep,a) A2A(ep,b) RG(1,0<-1) BW(0,0)\n\
rank 1: RA(0,0<-0) F(1,0) A2A(ep,b) A2A(ep,a) BW(1,0) SG(1,0->0)\n";
    insta::assert_snapshot!(snap("a2a.ir", src, Code::CollectiveOrder));
}

#[test]
fn syntax_error() {
    let src = "pp 2\nrank 0: F(0,0) I(0,0)\n";
    let e = parse(src).unwrap_err();
    let d = schedc::diag::syntax(&e);
    insta::assert_snapshot!(format!(
        "{}:{}: {}\n{}",
        e.line,
        e.col,
        e.message,
        render(&d, Some(("torch-letters.ir", src)), 100)
    ));
}

/// A wait whose stage or micro-batch is out of range is one range error: pass 2 does not
/// also report that no such receive or send comes before it.
#[test]
fn out_of_range_wait_is_a_range_error_only() {
    for (w, what) in [
        ("WAIT_RG(5,9)", "stage 5 is out of range 0..2"),
        ("WAIT_RA(0,9)", "micro-batch 9 is out of range 0..1"),
        ("WAIT_SG(1,3)", "micro-batch 3 is out of range 0..1"),
        ("WAIT_SA(7,0)", "stage 7 is out of range 0..2"),
    ] {
        let src = format!(
            "pp 2\nstages 2\nmicrobatches 1\nplacement loop\n\
rank 0: F(0,0) SA(0,0->1) {w} RG(1,0<-1) BW(0,0)\n\
rank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n"
        );
        let p = parse(&src).unwrap();
        let out = check(&p.program, Some(&p.spans), &Options::default());
        let errors: Vec<(Code, &str)> = out
            .report
            .diagnostics
            .iter()
            .filter(|d| d.is_error())
            .map(|d| (d.code, d.message.as_str()))
            .collect();
        assert_eq!(errors, vec![(Code::Range, what)], "{w}");
    }
}

/// A wait in a compute-only program: its receive is placed by the lowering, after pass 2, so
/// the error says to write the receive (and with it every message) before the wait.
#[test]
fn wait_in_a_compute_only_program() {
    let src = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\n\
rank 0: F(0,0) WAIT_RG(1,0) BW(0,0)\n\
rank 1: WAIT_RA(0,0) F(1,0) BW(1,0)\n";
    insta::assert_snapshot!(snap("compute-only-wait.ir", src, Code::Order));
    // With the messages written, a wait before its receive has no such help.
    let src = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\n\
rank 0: F(0,0) SA(0,0->1) WAIT_RG(1,0) RG(1,0<-1) BW(0,0)\n\
rank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n";
    let p = parse(src).unwrap();
    let out = check(&p.program, Some(&p.spans), &Options::default());
    let order: Vec<_> = out
        .report
        .diagnostics
        .iter()
        .filter(|d| d.code == Code::Order)
        .collect();
    assert_eq!(order.len(), 1, "{:?}", out.report.diagnostics);
    assert_eq!(order[0].help, None);
}
