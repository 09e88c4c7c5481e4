//! Criterion benchmark of `schedc check` on schedules with memory ops (issue 27: "check with
//! the new ops at P = 64, V = 2, M = 1024 under 1 s"), each against the same schedule without
//! them, measured in the same run:
//!
//! * `recompute/interleaved_k128` against `recompute/interleaved_k0`: `specs/interleaved_1f1b.sched`
//!   at P = 64, V = 2, M = 1024 with `--param recompute=128` (every one of its 131,072
//!   forwards checkpointed, `F(s,m)!`, and as many `RECOMPUTE`s) and with the default 0:
//!   elaboration plus every pass of `check`, what `schedc check SPEC` runs after reading the
//!   file.
//! * `offload/v_half_capped` against `offload/v_half`: `check` (every pass, no elaboration)
//!   of the program of `specs/v_half.sched` at P = 64, M = 1024 with its cap halved to
//!   `memory <= (P + 2) / 2` and `memory offload` (the list scheduler's memory rule: 47,034
//!   `OFFLOAD`s and as many `RELOAD`s), against the spec's own program. Both programs are
//!   built once, outside the timing (list scheduling takes about a second at this size).
//!
//! Run with `cargo bench -p schedc --bench memops`. Flat sampling, 10 samples.

use criterion::{black_box, Criterion, SamplingMode};
use schedc::check::{check, Options};
use schedc::dsl::{elaborate, parse_file, Instance};
use std::time::Duration;

fn main() {
    let spec = |name: &str| schedc::specs::get(name).expect("a standard spec");
    let interleaved = parse_file(spec("interleaved_1f1b")).expect("interleaved_1f1b parses");
    let inst = |params: Vec<(String, i64)>| Instance {
        pp: 64,
        mb: 1024,
        vpp: Some(2),
        params,
    };
    let k0 = inst(Vec::new());
    let k128 = inst(vec![("recompute".to_string(), 128)]);
    // v_half with half its cap, offloading at the cap; its `expect` lines are for the full cap.
    let capped: String = spec("v_half")
        .replace(
            "memory <= 2 * ((P + 2) / 2)",
            "memory <= (P + 2) / 2\n    memory offload",
        )
        .lines()
        .filter(|l| !l.starts_with("expect"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        capped.contains("memory offload"),
        "v_half's cap line changed"
    );
    let v_half = elaborate(
        &parse_file(spec("v_half")).expect("v_half parses"),
        &inst(Vec::new()),
    )
    .expect("v_half elaborates");
    let v_capped = elaborate(
        &parse_file(&capped).expect("the capped v_half parses"),
        &inst(Vec::new()),
    )
    .expect("the capped v_half elaborates");
    let opts = Options::default();
    for (name, e) in [("v_half", &v_half), ("v_half_capped", &v_capped)] {
        let mem_ops = e
            .program
            .ranks
            .iter()
            .flatten()
            .filter(|i| matches!(i, schedc_ir::Instr::Mem(_)))
            .count();
        eprintln!(
            "{name}: {} compute ops, {mem_ops} memory ops; verdict {:?}",
            e.program.compute_ops(),
            check(&e.program, Some(&e.spans), &opts).report.verdict
        );
    }

    let mut c = Criterion::default().configure_from_args();
    {
        let mut g = c.benchmark_group("recompute");
        g.sample_size(10)
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(5));
        for (name, i) in [("interleaved_k0", &k0), ("interleaved_k128", &k128)] {
            g.bench_function(name, |b| {
                b.iter(|| {
                    let e = elaborate(black_box(&interleaved), i).expect("elaborates");
                    check(&e.program, Some(&e.spans), &opts)
                })
            });
        }
        g.finish();
    }
    {
        let mut g = c.benchmark_group("offload");
        g.sample_size(10)
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(5));
        for (name, e) in [("v_half", &v_half), ("v_half_capped", &v_capped)] {
            g.bench_function(name, |b| {
                b.iter(|| check(black_box(&e.program), Some(&e.spans), &opts))
            });
        }
        g.finish();
    }
    c.final_summary();
}
