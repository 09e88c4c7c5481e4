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
