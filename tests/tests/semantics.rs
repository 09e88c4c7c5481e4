//! The communication model rule by rule: each relaxation flag accepts exactly the schedules
//! that depend on the rule it relaxes; lowering inserts exactly the messages a placement needs.

use schedc::check::{check, Options, Verdict};
use schedc::passes::deadlock::{self, CommError, Semantics, Stream};
use schedc_ir::text::parse;
use schedc_ir::{Comm, Instr, Pipeline, PlacementKind};

const NAIVE_1F1B: &str = "pp 2\nstages 2\nmicrobatches 2\nplacement loop\n\
rank 0: F(0,0) SA(0,0->1) F(0,1) SA(0,1->1) RG(1,0<-1) BW(0,0) RG(1,1<-1) BW(0,1)\n\
rank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0) RA(0,1<-0) F(1,1) BW(1,1) SG(1,1->0)\n";

/// Rank 3's lone receive is matched with rank 2's group, itself matched with a later group of
/// rank 3 (shared/cases/13d, reduced to two ranks).
const TRANSITIVE_GROUP: &str = "pp 2\nstages 2\nmicrobatches 2\nplacement loop\n\
rank 0: F(0,0) {SA(0,0->1) RG(1,0<-1)} BW(0,0) F(0,1) {SA(0,1->1) RG(1,1<-1)} BW(0,1)\n\
rank 1: RA(0,0<-0) F(1,0) BW(1,0) {SG(1,0->0) RA(0,1<-0)} F(1,1) BW(1,1) SG(1,1->0)\n";

fn verdict(src: &str, sem: Semantics) -> Verdict {
    let p = parse(src).unwrap();
    check(
        &p.program,
        None,
        &Options {
            semantics: sem,
            ..Default::default()
        },
    )
    .report
    .verdict
}

#[test]
fn rendezvous_sends_deadlock_head_to_head() {
    let p = parse(NAIVE_1F1B).unwrap().program;
    let errs = deadlock::check(&p, Semantics::default());
    assert_eq!(errs.len(), 1);
    let CommError::Deadlock(steps, _) = &errs[0] else {
        panic!("{errs:?}")
    };
    let at: Vec<(u32, Stream, u32)> = steps.iter().map(|s| (s.rank, s.stream, s.at.pos)).collect();
    assert_eq!(at, vec![(0, Stream::Comm, 3), (1, Stream::Comm, 3)]);
    assert!(
        steps[0].waits_for.contains("RA(0,1<-0)"),
        "{}",
        steps[0].waits_for
    );
}

#[test]
fn eager_sends_or_one_buffer_slot_relax_it() {
    assert_eq!(verdict(NAIVE_1F1B, Semantics::default()), Verdict::Rejected);
    let eager = Semantics {
        eager: true,
        ..Default::default()
    };
    assert_eq!(verdict(NAIVE_1F1B, eager), Verdict::Accepted);
    let one = Semantics {
        buffer_slots: Some(1),
        ..Default::default()
    };
    assert_eq!(verdict(NAIVE_1F1B, one), Verdict::Accepted);
    // Per-op completion changes nothing for lone ops.
    let per_op = Semantics {
        per_op_groups: true,
        ..Default::default()
    };
    assert_eq!(verdict(NAIVE_1F1B, per_op), Verdict::Rejected);
}

#[test]
fn zero_buffer_slots_is_rendezvous() {
    let zero = Semantics {
        buffer_slots: Some(0),
        ..Default::default()
    };
    assert_eq!(verdict(NAIVE_1F1B, zero), Verdict::Rejected);
}

#[test]
fn groups_complete_as_a_unit_transitively() {
    assert_eq!(
        verdict(TRANSITIVE_GROUP, Semantics::default()),
        Verdict::Rejected
    );
    let per_op = Semantics {
        per_op_groups: true,
        ..Default::default()
    };
    assert_eq!(verdict(TRANSITIVE_GROUP, per_op), Verdict::Accepted);
    let eager = Semantics {
        eager: true,
        ..Default::default()
    };
    assert_eq!(verdict(TRANSITIVE_GROUP, eager), Verdict::Accepted);
}

#[test]
fn a_receive_never_completes_without_its_send_even_when_eager() {
    let src = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\n\
rank 0: F(0,0) SA(0,0->1) RG(1,0<-1) BW(0,0)\n\
rank 1: RA(0,0<-0) F(1,0) BW(1,0)\n";
    for sem in [
        Semantics::default(),
        Semantics {
            eager: true,
            ..Default::default()
        },
    ] {
        let p = parse(src).unwrap().program;
        let errs = deadlock::check(&p, sem);
        assert!(
            errs.iter()
                .any(|e| matches!(e, CommError::Unmatched { .. })),
            "{errs:?}"
        );
        assert!(
            errs.iter().any(|e| matches!(e, CommError::Stall(_))),
            "{errs:?}"
        );
    }
}

fn count_messages(p: &schedc_ir::Program) -> usize {
    p.ranks
        .iter()
        .flatten()
        .filter(|i| matches!(i, Instr::Comm(Comm::Send { .. })))
        .count()
}

#[test]
fn lowering_inserts_one_message_per_cross_rank_edge_and_none_at_a_v_fold() {
    let mut rng = schedc_tests::Rng::new(7);
    for (pp, stages, kind) in [
        (4, 8, PlacementKind::V),
        (4, 8, PlacementKind::Loop),
        (3, 6, PlacementKind::Bidir),
        (1, 3, PlacementKind::Loop),
    ] {
        let pl = Pipeline::new(pp, stages, 5, kind).unwrap();
        let mut edges = 0;
        for s in 0..stages {
            if let Some(n) = pl.next_stage(s) {
                if pl.rank_of(n) != pl.rank_of(s) {
                    edges += 1;
                }
            }
        }
        let p = schedc_tests::random_schedule(&mut rng, pl);
        let l = schedc::passes::lower::lower(&p).unwrap();
        // One activation and one gradient per cross-rank edge and micro-batch.
        assert_eq!(count_messages(&l), 2 * edges * 5, "{kind:?}");
        assert!(deadlock::check(&l, Semantics::default()).is_empty());
    }
}

#[test]
fn warmup_per_stage_and_phases() {
    // Interleaved order on one rank holding stages 0 and 2 of a 4-stage loop placement.
    let src = "pp 2\nstages 4\nmicrobatches 2\nplacement loop\n\
rank 0: F(0,0) F(0,1) F(2,0) F(2,1) BW(2,0) BW(2,1) BW(0,0) BW(0,1)\n\
rank 1: F(1,0) F(1,1) F(3,0) BW(3,0) F(3,1) BW(3,1) BW(1,0) BW(1,1)\n";
    let p = parse(src).unwrap().program;
    let w = schedc::passes::warmup::analyze(&p);
    assert_eq!(w[0].phases.warmup, 4);
    assert_eq!(w[0].per_stage, vec![(0, 2), (2, 2)]);
    assert_eq!(
        (w[1].phases.warmup, w[1].phases.steady, w[1].phases.cooldown),
        (3, 2, 3)
    );
    assert_eq!(w[1].per_stage, vec![(1, 2), (3, 1)]);
}

/// issue 22 item 7: an overlapped pair split into MoE parts (`--moe` issues the backward's
/// combine before the forward's attention) keeps its forward inside the pair, as the unsplit
/// pair does; a forward after the whole backward does not count.
#[test]
fn warmup_counts_the_forward_of_a_split_pair() {
    let whole = "pp 1\nstages 2\nmicrobatches 2\nplacement 0 0\n\
rank 0: F(0,0) F(1,0) F(0,1)&BW(1,0) BW(0,0) F(1,1) BW(1,1) BW(0,1)\n";
    let split = "pp 1\nstages 2\nmicrobatches 2\nplacement 0 0\nmoe 0 1\n\
rank 0: F(0,0) F(1,0) BW(1,0).combine F(0,1).attn F(0,1).dispatch BW(1,0).mlp \
BW(1,0).dispatch F(0,1).mlp F(0,1).combine BW(1,0).attn BW(0,0) F(1,1) BW(1,1) BW(0,1)\n";
    for src in [whole, split] {
        let p = parse(src).unwrap().program;
        let w = schedc::passes::warmup::analyze(&p);
        assert_eq!(
            (w[0].phases.warmup, w[0].phases.steady, w[0].phases.cooldown),
            (3, 3, 2),
            "{src}"
        );
        assert_eq!(w[0].per_stage, vec![(0, 2), (1, 1)], "{src}");
    }
}

#[test]
fn unit_time_idle_of_1f1b_is_three_per_hop() {
    // 1F1B with the fused backward (BW = B + W = 2): idle (P-1)(F+B+W) = 3(P-1) on every rank
    // (Zero Bubble, arXiv 2401.10241, section 2).
    for pp in 2..=6u32 {
        let m = 2 * pp;
        let pl = Pipeline::new(pp, pp, m, PlacementKind::Loop).unwrap();
        let mut ranks = vec![Vec::new(); pp as usize];
        for r in 0..pp {
            // Megatron's 1F1B: warmup P-r-1 forwards, then one forward and one backward per
            // step, then the remaining backwards.
            let warm = (pp - r - 1).min(m);
            let code = &mut ranks[r as usize];
            let push =
                |code: &mut Vec<String>, k: &str, mb: u32| code.push(format!("{k}({r},{mb})"));
            for f in 0..warm {
                push(code, "F", f);
            }
            for b in 0..m {
                if b + warm < m {
                    push(code, "F", b + warm);
                }
                push(code, "BW", b);
            }
        }
        let mut src = format!("pp {pp}\nstages {pp}\nmicrobatches {m}\nplacement loop\n");
        for (r, ops) in ranks.iter().enumerate() {
            src.push_str(&format!("rank {r}: {}\n", ops.join(" ")));
        }
        let p = parse(&src).unwrap().program;
        assert_eq!(p.pipeline, pl);
        let ut = schedc::passes::makespan::analyze(&p).unwrap();
        for idle in &ut.idle {
            assert_eq!(*idle, 3.0 * (pp - 1) as f64, "P={pp}");
        }
        // Bubble fraction (P-1)/(M+P-1) with equal costs (GPipe, Huang et al. 2019).
        let busy: f64 = ut.busy.iter().sum();
        let idle: f64 = ut.idle.iter().sum();
        let frac = idle / (idle + busy);
        assert!((frac - (pp - 1) as f64 / (m + pp - 1) as f64).abs() < 1e-12);
    }
}
