//! Issue 27: memory ops (OFFLOAD, RELOAD, RECOMPUTE) in the checks and the simulator.

use schedc::check::{check, Options};
use schedc::sim::cost::CostModel;
use schedc::sim::{simulate_any, StreamKind};

fn prog(src: &str) -> schedc_ir::Program {
    schedc_ir::text::parse(src).unwrap().program
}

const HEAD: &str = "pp 1\nstages 1\nmicrobatches 2\nplacement loop\n";

fn cost() -> CostModel {
    // F = 1, BW = 2; an offload takes 0.5 s and a reload 3 s on the host-copy stream.
    CostModel::from_toml("[compute]\nF = 1.0\nB = 1.0\nW = 1.0\n[memory]\nactivation_bytes = 1.0\noffload = 0.5\nreload = 3.0\n").unwrap()
}

#[test]
fn sim_charges_host_copies_on_their_own_stream() {
    // F(0,0) [0,1]; OFFLOAD(0,0) on the host stream [1,1.5]; F(0,1) [1,2]; BW(0,1) [2,4];
    // RELOAD(0,0) issued after BW(0,1): [4,7]; BW(0,0) waits for it: [7,9].
    let late = prog(&format!(
        "{HEAD}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) RELOAD(0,0) BW(0,0)\n"
    ));
    let r = simulate_any(&late, &cost()).unwrap();
    assert_eq!(r.makespan, 9.0);
    assert_eq!(r.ranks[0].busy, 6.0);
    let host: Vec<(f64, f64)> = r
        .events
        .iter()
        .filter(|e| e.stream == StreamKind::Host)
        .map(|e| (e.start, e.end))
        .collect();
    assert_eq!(host, vec![(1.0, 1.5), (4.0, 7.0)]);
    // Issued before BW(0,1), the reload [2,5] runs under it [2,4]: BW(0,0) [5,7].
    let early = prog(&format!(
        "{HEAD}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) RELOAD(0,0) BW(0,1) BW(0,0)\n"
    ));
    assert_eq!(simulate_any(&early, &cost()).unwrap().makespan, 7.0);
}

#[test]
fn sim_charges_recompute_as_a_forward_and_peak_bytes_reflect_offload() {
    // RECOMPUTE(0,0) is a forward on the compute stream: 1 + 1 + 2 + 1 + 2 = 7 s.
    let p = prog(&format!(
        "{HEAD}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) RECOMPUTE(0,0) BW(0,0)\n"
    ));
    let r = simulate_any(&p, &cost()).unwrap();
    assert_eq!(r.makespan, 7.0);
    assert_eq!(r.ranks[0].busy, 7.0);
    // Three micro-batches: stashing holds 3 activations at once; offloading the first two
    // (freed at the end of each 0.5 s copy) keeps at most 2 on the device.
    let three = "pp 1\nstages 1\nmicrobatches 3\nplacement loop\n";
    let plain = prog(&format!(
        "{three}rank 0: F(0,0) F(0,1) F(0,2) BW(0,2) BW(0,1) BW(0,0)\n"
    ));
    let off = prog(&format!(
        "{three}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) OFFLOAD(0,1) F(0,2) BW(0,2) RELOAD(0,1) BW(0,1) RELOAD(0,0) BW(0,0)\n"
    ));
    assert_eq!(
        simulate_any(&plain, &cost()).unwrap().ranks[0].peak_activation_bytes,
        3.0
    );
    assert_eq!(
        simulate_any(&off, &cost()).unwrap().ranks[0].peak_activation_bytes,
        2.0
    );
}

#[test]
fn check_rejects_a_backward_after_an_offload_without_reload_naming_rank_and_step() {
    let p = prog(&format!(
        "{HEAD}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) BW(0,0)\n"
    ));
    let out = check(&p, None, &Options::default());
    let errs: Vec<&str> = out
        .report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(|d| d.message.as_str())
        .collect();
    assert_eq!(
        errs,
        vec!["rank 0 step 4: `BW(0,0)` reads the activations of F(0,0), offloaded at step 1 and never reloaded or recomputed"]
    );
    let ok = prog(&format!(
        "{HEAD}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) RELOAD(0,0) BW(0,0)\n"
    ));
    let out = check(&ok, None, &Options::default());
    assert!(out.report.diagnostics.iter().all(|d| !d.is_error()));
    assert_eq!(out.report.ranks[0].peak_activations, 1);
    assert_eq!(out.report.ranks[0].peak_host_activations, 1);
}

fn elab(src: &str, pp: u32, mb: u32) -> schedc_ir::Program {
    let f = schedc::dsl::parse_file(src).unwrap();
    let inst = schedc::dsl::Instance {
        pp,
        mb,
        vpp: None,
        params: vec![],
    };
    schedc::dsl::elaborate(&f, &inst).unwrap().program
}

#[test]
fn memory_ops_in_rank_programs_and_literal_blocks_elaborate_and_format() {
    let src = "rank r {\n    F(0, 0)\n    OFFLOAD(0, 0)\n    F(0, 1)\n    RELOAD(stage r, 0)\n    BW(0, 1)\n    BW(0, 0)\n}\n";
    let p = elab(src, 1, 2);
    assert_eq!(
        schedc_ir::text::print(&p).lines().last().unwrap(),
        "rank 0: F(0,0) OFFLOAD(0,0) F(0,1) RELOAD(0,0) BW(0,1) BW(0,0)"
    );
    // `fmt` keeps the statements as written.
    let f = schedc::dsl::parse_file(src).unwrap();
    let out = schedc::dsl::fmt::format_file(&f, src);
    assert!(
        out.contains("    OFFLOAD(0, 0)\n    F(0, 1)\n    RELOAD(stage r, 0)\n"),
        "{out}"
    );
    assert_eq!(schedc::dsl::parse_file(&out).unwrap(), f);
    // A literal block takes the IR text.
    let lit = "literal {\n  rank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) RECOMPUTE(0,0) BW(0,0)\n}\n";
    let p = elab(lit, 1, 2);
    assert_eq!(
        p.ranks[0][4],
        schedc_ir::Instr::Mem(schedc_ir::MemOp {
            kind: schedc_ir::MemKind::Recompute,
            stage: 0,
            mb: 0
        })
    );
    // A memory op needs the micro-batch.
    assert!(schedc::dsl::parse_file("rank r {\n    OFFLOAD(0)\n}\n").is_err());
}

#[test]
fn offload_1f1b_spec_holds_at_most_two_activations_where_1f1b_holds_p_minus_r() {
    let off = schedc::specs::get("1f1b_offload").unwrap();
    let plain = schedc::specs::get("1f1b").unwrap();
    for pp in 1..=8u32 {
        for mb in 1..=12u32 {
            let p = elab(off, pp, mb);
            let out = check(&p, None, &Options::default());
            assert!(
                out.report.diagnostics.iter().all(|d| !d.is_error()),
                "P={pp} M={mb}: {:?}",
                out.report.diagnostics
            );
            let q = check(&elab(plain, pp, mb), None, &Options::default());
            for (r, (a, b)) in out.report.ranks.iter().zip(&q.report.ranks).enumerate() {
                let w = (pp - r as u32).min(mb) as u64;
                assert_eq!(b.peak_activations, w);
                assert_eq!(a.peak_activations, w.min(2), "P={pp} M={mb} rank {r}");
                let host = if w >= 3 { w } else { 0 };
                assert_eq!(a.peak_host_activations, host, "P={pp} M={mb} rank {r}");
            }
        }
    }
}

#[test]
fn offload_1f1b_hides_copies_shorter_than_a_backward() {
    // P = 4, M = 8, F = 1, BW = 2: 1F1B's 33 s; a 1 s copy runs under the 2 s BW before the
    // backward that needs it, a 2 s one does not (39 s), and peak bytes fall from 4 to 2 units.
    let off = elab(schedc::specs::get("1f1b_offload").unwrap(), 4, 8);
    let plain = elab(schedc::specs::get("1f1b").unwrap(), 4, 8);
    let model = |o: f64| {
        CostModel::from_toml(&format!(
            "[memory]\nactivation_bytes = 1.0\noffload = {o}\n"
        ))
        .unwrap()
    };
    let a = simulate_any(&plain, &model(1.0)).unwrap();
    let b = simulate_any(&off, &model(1.0)).unwrap();
    assert_eq!((a.makespan, b.makespan), (33.0, 33.0));
    let peaks = |r: &schedc::sim::SimResult| {
        r.ranks
            .iter()
            .map(|x| x.peak_activation_bytes)
            .collect::<Vec<_>>()
    };
    assert_eq!(peaks(&a), vec![4.0, 3.0, 2.0, 1.0]);
    assert_eq!(peaks(&b), vec![2.0, 2.0, 2.0, 1.0]);
    assert_eq!(simulate_any(&off, &model(2.0)).unwrap().makespan, 39.0);
}

#[test]
fn torch_csv_export_refuses_memory_ops_naming_the_op() {
    let p = prog(&format!(
        "{HEAD}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) RELOAD(0,0) BW(0,0)\n"
    ));
    let e = schedc::import::torch::write_csv(&p, schedc::import::torch::TorchFormat::ComputeOnly)
        .unwrap_err();
    assert_eq!(
        e,
        "rank 0, instruction 1 (`OFFLOAD(0,0)`): torch's schedule CSV has no action for moving or recomputing saved activations (OFFLOAD, RELOAD, RECOMPUTE); the torch format cannot express a schedule that manages memory"
    );
}
