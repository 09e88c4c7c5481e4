//! Criterion benchmark of list scheduling (`list r { }`, `compiler/src/dsl/list.rs`) on
//! V-Half (`specs/v_half.sched`: `memory <=` and `defer W`, so four greedy runs and their
//! replays) at P = 64, 128, 256 and 512 ranks, M = 2P micro-batches, V = 2: 6PM compute ops
//! (49,152 to 3,145,728), under unit op times (what `schedc check` and `convert` build).
//!
//! * `list/v_half_pP`: elaboration of the spec at the instance, list scheduling included.
//! * `baseline/zbv_pP`: elaboration of `specs/zbv.sched` at the same instance, a rank
//!   program with the same ops and placement: the cost of building the program without the
//!   list scheduler. Report each `list` figure as a multiple of its baseline.
//!
//! Run with `cargo bench -p schedc --bench list` (a name filter such as `v_half_p64` picks
//! one size). Flat sampling, 10 samples: the P = 512 instance takes seconds per iteration.

use criterion::{black_box, Criterion, SamplingMode};
use schedc::dsl::{elaborate, parse_file, Instance};
use std::time::Duration;

const SIZES: [u32; 4] = [64, 128, 256, 512];

fn main() {
    let v_half = parse_file(schedc::specs::get("v_half").expect("v_half is a standard spec"))
        .expect("v_half parses");
    let zbv =
        parse_file(schedc::specs::get("zbv").expect("zbv is a standard spec")).expect("zbv parses");
    let inst = |p: u32| Instance {
        pp: p,
        mb: 2 * p,
        ..Default::default()
    };
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("list");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for p in SIZES {
        g.bench_function(format!("baseline/zbv_p{p}"), |b| {
            b.iter(|| elaborate(black_box(&zbv), &inst(p)).expect("zbv elaborates"))
        });
        g.bench_function(format!("v_half_p{p}"), |b| {
            b.iter(|| elaborate(black_box(&v_half), &inst(p)).expect("v_half elaborates"))
        });
    }
    g.finish();
    c.final_summary();
}
