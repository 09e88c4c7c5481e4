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
        .filter(|e| matches!(e.stream, StreamKind::Host | StreamKind::HostToDevice))
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
fn sim_runs_an_offload_and_a_reload_at_the_same_time_one_stream_per_direction() {
    // PCIe is full duplex: offloads run on the device-to-host stream, reloads on the
    // host-to-device one. Copies of 2 s: F(0,0) [0,1]; OFFLOAD(0,0) [1,3]; F(0,1) [1,2];
    // OFFLOAD(0,1) waits for the D2H stream: [3,5]; RELOAD(0,0) needs only its offload's end
    // and the H2D stream: [3,5], under OFFLOAD(0,1); BW(0,0) [5,7]; RELOAD(0,1) [7,9] (issued
    // after BW(0,0)); BW(0,1) [9,11]. On one shared stream the reload would wait for
    // OFFLOAD(0,1): [5,7], and everything after it 2 s later (13 s).
    let c = CostModel::from_toml(
        "[compute]\nF = 1.0\nB = 1.0\nW = 1.0\n[memory]\nactivation_bytes = 1.0\noffload = 2.0\n",
    )
    .unwrap();
    let p = prog(&format!(
        "{HEAD}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) OFFLOAD(0,1) RELOAD(0,0) BW(0,0) RELOAD(0,1) BW(0,1)\n"
    ));
    let r = simulate_any(&p, &c).unwrap();
    let on = |k: StreamKind| -> Vec<(f64, f64)> {
        r.events
            .iter()
            .filter(|e| e.stream == k)
            .map(|e| (e.start, e.end))
            .collect()
    };
    assert_eq!(on(StreamKind::Host), vec![(1.0, 3.0), (3.0, 5.0)]);
    assert_eq!(on(StreamKind::HostToDevice), vec![(3.0, 5.0), (7.0, 9.0)]);
    assert_eq!(r.makespan, 11.0);
    // The trace has a thread per direction.
    let trace = schedc::sim::render::chrome_trace(&r, &p);
    assert!(
        trace.contains("\"host copies (device to host)\""),
        "{trace}"
    );
    assert!(
        trace.contains("\"host copies (host to device)\""),
        "{trace}"
    );
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
fn offload_1f1b_hides_copies_no_longer_than_a_forward() {
    // P = 4, M = 8, F = 1, BW = 2: 1F1B's 33 s. A 1 s copy: each offload runs under the
    // next backward, each reload under the forward after the backward that freed a slot, so
    // rank 0 holds 2 units where 1F1B holds 4, at 1F1B's step.
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
    // Copies longer than a forward delay each backward by the difference.
    assert_eq!(simulate_any(&off, &model(2.0)).unwrap().makespan, 38.0);
    assert_eq!(simulate_any(&off, &model(3.0)).unwrap().makespan, 45.0);
    assert_eq!(simulate_any(&off, &model(4.0)).unwrap().makespan, 54.0);
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

// ---- BPipe's activation hand-off: LEND / RETURN ----

fn errors(p: &schedc_ir::Program) -> Vec<String> {
    check(p, None, &Options::default())
        .report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(|d| d.message.clone())
        .collect()
}

const PAIR: &str = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\n";

#[test]
fn lend_and_return_before_the_backward_is_accepted_and_moves_the_peak() {
    // Rank 0 lends F(0,0)'s stash to rank 1 on channel 1 and gets it back before BW(0,0).
    let p = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) LEND(0,0->1@1) RG(1,0<-1) RETURN(0,0<-1@1) BW(0,0)\nrank 1: RA(0,0<-0) LEND(0,0<-0@1) F(1,0) BW(1,0) SG(1,0->0) RETURN(0,0->0@1)\n"
    ));
    let out = check(&p, None, &Options::default());
    assert_eq!(errors(&p), Vec::<String>::new());
    let peaks: Vec<u64> = out
        .report
        .ranks
        .iter()
        .map(|r| r.peak_activations)
        .collect();
    assert_eq!(peaks, vec![1, 2]);
}

#[test]
fn backward_of_a_lent_stash_that_was_not_returned_is_rejected_with_rank_and_step() {
    let p = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) LEND(0,0->1@1) RG(1,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) LEND(0,0<-0@1) F(1,0) BW(1,0) SG(1,0->0)\n"
    ));
    // Both ends: the owner's backward, and the holder that never sends the stash back.
    assert_eq!(
        errors(&p),
        vec![
            "rank 0 step 4: `BW(0,0)` needs the activations of F(0,0) on this device, but they were lent to rank 1 at step 2 and not returned",
            "rank 1 step 1: `LEND(0,0<-0@1)` is not valid here: the activations of F(0,0) are held here and never returned to their owner (LEND without RETURN)"
        ]
    );
}

#[test]
fn return_without_lend_is_rejected_on_both_ends() {
    let p = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) RG(1,0<-1) RETURN(0,0<-1@1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0) RETURN(0,0->0@1)\n"
    ));
    assert_eq!(
        errors(&p),
        vec![
            "rank 0 step 3: `RETURN(0,0<-1@1)` is not valid here: the activations of F(0,0) are already on the device",
            "rank 1 step 4: `RETURN(0,0->0@1)` is not valid here: the activations of F(0,0) are not held by this rank: no LEND of them was received before it (RETURN without LEND)",
        ]
    );
}

#[test]
fn lend_to_a_rank_that_does_not_exist_or_to_itself_is_rejected() {
    let far = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) LEND(0,0->5@1) RG(1,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n"
    ));
    assert_eq!(
        errors(&far)[0],
        "rank 0 step 2: LEND(0,0): rank 0 lends the stash to rank 5, which does not exist (the pipeline has ranks 0..1)"
    );
    let me = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) LEND(0,0->0@1) RG(1,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n"
    ));
    assert_eq!(
        errors(&me)[0],
        "rank 0 step 2: LEND(0,0->0): rank 0 lends the stash of F(0,0) to itself; lend it to another rank (BPipe pairs rank r with rank P-1-r)"
    );
    // A LEND sent by a rank that does not hold the stage.
    let wrong = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) RG(1,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) LEND(0,0->0@1) BW(1,0) SG(1,0->0)\n"
    ));
    assert_eq!(
        errors(&wrong)[0],
        "rank 1 step 2: LEND(0,0) sends on rank 1, but the stash of F(0,0) belongs to rank 0, which holds stage 0"
    );
}

#[test]
fn deadlock_through_a_lending_message_is_found() {
    // On channel 0, rank 0 lends before receiving its gradient while rank 1 sends the
    // gradient before receiving the lend: both rendezvous sends wait for each other.
    let p = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) LEND(0,0->1) RG(1,0<-1) RETURN(0,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0) LEND(0,0<-0) RETURN(0,0->0)\n"
    ));
    let out = check(&p, None, &Options::default());
    let codes: Vec<String> = out
        .report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(|d| format!("{:?}", d.code))
        .collect();
    assert_eq!(codes, vec!["Deadlock"], "{:?}", out.report.diagnostics);
    // On a channel of their own, the same order runs.
    let ok = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) LEND(0,0->1@1) RG(1,0<-1) RETURN(0,0<-1@1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0) LEND(0,0<-0@1) RETURN(0,0->0@1)\n"
    ));
    assert_eq!(errors(&ok), Vec::<String>::new());
}

#[test]
fn sim_prices_a_lent_stash_as_a_point_to_point_message() {
    // F = 1, BW = 2; p2p latency 0.5 s, bandwidth 1 B/s; activation messages 1 B (1.5 s),
    // a stash of activation_bytes = 4 B: 4.5 s.
    let c = CostModel::from_toml(
        "[compute]\nF = 1.0\nB = 1.0\nW = 1.0\n[p2p]\nlatency = 0.5\nbandwidth = 1.0\nbytes = 1.0\n[memory]\nactivation_bytes = 4.0\n",
    )
    .unwrap();
    assert_eq!(c.stash_message_time(0), 4.5);
    let plain = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) RG(1,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0)\n"
    ));
    // F(0,0) [0,1], SA [1,2.5], F(1,0) [2.5,3.5], BW(1,0) [3.5,5.5], SG [5.5,7], BW(0,0) [7,9].
    assert_eq!(simulate_any(&plain, &c).unwrap().makespan, 9.0);
    // The lend [1,5.5] on channel 1 runs under the pipeline; the return, issued by rank 1
    // after BW(1,0) ends (5.5) and posted by rank 0 once the lend is done: [5.5,10];
    // BW(0,0) waits for it (not for RG, at 7): [10,12].
    let lent = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) LEND(0,0->1@1) RG(1,0<-1) RETURN(0,0<-1@1) BW(0,0)\nrank 1: RA(0,0<-0) LEND(0,0<-0@1) F(1,0) BW(1,0) SG(1,0->0) RETURN(0,0->0@1)\n"
    ));
    let r = simulate_any(&lent, &c).unwrap();
    assert_eq!(r.makespan, 12.0);
    // The stash reaches rank 1 at 5.5, as BW(1,0) frees rank 1's own 4 B, and leaves rank 0
    // then until 10: neither holds more than 4 B (check's units, in program order, count 2
    // on rank 1).
    let peaks: Vec<f64> = r.ranks.iter().map(|x| x.peak_activation_bytes).collect();
    assert_eq!(peaks, vec![4.0, 4.0]);
    let ev: Vec<(u32, f64, f64)> = r
        .events
        .iter()
        .filter(|e| {
            e.stream == StreamKind::Comm && matches!((e.rank, e.pos), (0, 2 | 4) | (1, 1 | 5))
        })
        .map(|e| (e.rank, e.start, e.end))
        .collect();
    // (rank, posted, completed), in the order they complete: the LEND's receive and send,
    // then the RETURN's receive and send.
    assert_eq!(
        ev,
        vec![(1, 0.0, 5.5), (0, 1.0, 5.5), (0, 5.5, 10.0), (1, 5.5, 10.0)]
    );
}

#[test]
fn bpipe_balances_peak_activations_across_each_pair() {
    let bp = schedc::specs::get("bpipe").unwrap();
    let plain = schedc::specs::get("1f1b").unwrap();
    for pp in 1..=8u32 {
        for mb in 1..=16u32 {
            let p = elab(bp, pp, mb);
            let out = check(&p, None, &Options::default());
            assert!(
                out.report.diagnostics.iter().all(|d| !d.is_error()),
                "P={pp} M={mb}: {:?}",
                out.report.diagnostics
            );
            let q = check(&elab(plain, pp, mb), None, &Options::default());
            let a: Vec<u64> = out
                .report
                .ranks
                .iter()
                .map(|r| r.peak_activations)
                .collect();
            let b: Vec<u64> = q.report.ranks.iter().map(|r| r.peak_activations).collect();
            // Never above 1F1B's heaviest rank; every pair's peaks within one of each other
            // when lending is worth it; same unit-time makespan as 1F1B.
            assert!(a.iter().max() <= b.iter().max(), "P={pp} M={mb}: {a:?}");
            if mb >= pp {
                assert_eq!(
                    *a.iter().max().unwrap(),
                    (pp as u64 + 2) / 2,
                    "P={pp} M={mb}: {a:?}"
                );
            }
            assert_eq!(out.report.makespan, q.report.makespan, "P={pp} M={mb}");
        }
    }
    let peaks = |pp, mb| -> Vec<u64> {
        check(&elab(bp, pp, mb), None, &Options::default())
            .report
            .ranks
            .iter()
            .map(|r| r.peak_activations)
            .collect()
    };
    assert_eq!(peaks(4, 8), vec![2, 2, 3, 3]);
    assert_eq!(peaks(8, 16), vec![4, 4, 4, 4, 5, 5, 5, 5]);
}

#[test]
fn lend_statements_elaborate_and_format() {
    let src = "rank r {\n    F(0, 0)\n    if r == 0 {\n        LEND(0, 0) to 1 @ 1\n        RETURN(0, 0) from 1 @ 1\n    } else {\n        LEND(stage 0, 0) from 0 @ 1\n        RETURN(stage 0, 0) to 0\n    }\n    BW(0, 0)\n}\n";
    let p = elab(src, 2, 1);
    let text = schedc_ir::text::print(&p);
    let lines: Vec<&str> = text.lines().rev().take(2).collect();
    assert_eq!(
        lines,
        vec![
            "rank 1: F(1,0) LEND(0,0<-0@1) RETURN(0,0->0) BW(1,0)",
            "rank 0: F(0,0) LEND(0,0->1@1) RETURN(0,0<-1@1) BW(0,0)",
        ]
    );
    let f = schedc::dsl::parse_file(src).unwrap();
    let out = schedc::dsl::fmt::format_file(&f, src);
    assert!(
        out.contains("        LEND(0, 0) to 1 @ 1\n        RETURN(0, 0) from 1 @ 1\n"),
        "{out}"
    );
    assert!(out.contains("        RETURN(stage 0, 0) to 0\n"), "{out}");
    assert_eq!(schedc::dsl::parse_file(&out).unwrap(), f);
    // A literal block takes the IR text.
    let lit = "literal {\n  rank 0: F(0,0) LEND(0,0->1@1) RETURN(0,0<-1@1) BW(0,0)\n  rank 1: LEND(0,0<-0@1) RETURN(0,0->0@1)\n}\n";
    let p = elab(lit, 2, 1);
    assert_eq!(
        schedc_ir::text::instr_to_string(&p.ranks[1][0]),
        "LEND(0,0<-0@1)"
    );
    // The direction is required.
    let e = schedc::dsl::parse_file("rank r {\n    LEND(0, 0) 1\n}\n").unwrap_err();
    assert!(
        format!("{e:?}").contains("`to` and the rank the stash goes to"),
        "{e:?}"
    );
}

#[test]
fn torch_csv_export_refuses_lend_and_return() {
    let p = prog(&format!(
        "{PAIR}rank 0: F(0,0) SA(0,0->1) LEND(0,0->1) RG(1,0<-1) RETURN(0,0<-1) BW(0,0)\nrank 1: RA(0,0<-0) LEND(0,0<-0) F(1,0) BW(1,0) SG(1,0->0) RETURN(0,0->0)\n"
    ));
    let e = schedc::import::torch::write_csv(&p, schedc::import::torch::TorchFormat::ComputeComms)
        .unwrap_err();
    assert!(
        e.contains("torch's schedule format has no action that lends a stage's saved activations to another rank (BPipe's LEND/RETURN)"),
        "{e}"
    );
}

#[test]
fn sim_tracks_host_bytes_per_rank_and_names_the_offload_over_the_host_budget() {
    let three = "pp 1\nstages 1\nmicrobatches 3\nplacement loop\n";
    // OFFLOAD(0,0) [1,1.5] and OFFLOAD(0,1) [2,2.5] hold 2 bytes on the host until
    // RELOAD(0,1) [5,8] and RELOAD(0,0) [10,13] end.
    let off = prog(&format!(
        "{three}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) OFFLOAD(0,1) F(0,2) BW(0,2) RELOAD(0,1) BW(0,1) RELOAD(0,0) BW(0,0)\n"
    ));
    let r = simulate_any(&off, &cost()).unwrap();
    assert_eq!(r.ranks[0].peak_host_bytes, 2.0);
    assert!(r.host_overflows.is_empty(), "no budget: unlimited");
    // A budget of exactly the peak holds; below it, the second offload is the offender.
    let mut c = cost();
    c.memory.host_bytes = 2.0;
    assert!(simulate_any(&off, &c).unwrap().host_overflows.is_empty());
    c.memory.host_bytes = 1.5;
    let r = simulate_any(&off, &c).unwrap();
    assert_eq!(
        r.host_overflows,
        vec![schedc::sim::HostOverflow {
            rank: 0,
            pos: 3,
            stage: 0,
            mb: 1,
            needs: 1.0,
            held: 1.0,
            budget: 1.5,
        }]
    );
    // A RECOMPUTE drops the host copy when it starts: the later offload fits a budget of 1.
    let drop = prog(&format!(
        "{HEAD}rank 0: F(0,0) OFFLOAD(0,0) F(0,1) RECOMPUTE(0,0) OFFLOAD(0,1) BW(0,0) RELOAD(0,1) BW(0,1)\n"
    ));
    c.memory.host_bytes = 1.0;
    let r = simulate_any(&drop, &c).unwrap();
    assert_eq!(r.ranks[0].peak_host_bytes, 1.0);
    assert!(r.host_overflows.is_empty());
    // A RECOMPUTE after a checkpointed forward frees nothing on the host.
    let ckpt = prog(&format!(
        "{HEAD}rank 0: F(0,0)! F(0,1) BW(0,1) RECOMPUTE(0,0) BW(0,0)\n"
    ));
    assert_eq!(
        simulate_any(&ckpt, &c).unwrap().ranks[0].peak_host_bytes,
        0.0
    );
}
