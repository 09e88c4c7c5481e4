//! How long `schedc optimize` takes, against the Zero Bubble greedy at the same size
//! measured in the same run (report the ratio; the machines are shared and noisy).
//!
//! Sizes (loop placement, one stage per rank, cost F = 1, B = 1.1, W = 0.9, 0.05 per
//! message, cap P): P = 8, M = 16 (default search); P = 16, M = 64 (default search);
//! P = 32, M = 256 (heuristic mode: list scheduling and the greedy only).
//!
//! `cargo bench -p schedc-optimize --bench optimize`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::greedy::zero_bubble_greedy;
use schedc_optimize::search::{optimize, Options};
use schedc_optimize::Instance;
use std::time::Duration;

fn bench(c: &mut Criterion) {
    let cost = CostModel::resolve("F=1,B=1.1,W=0.9,latency=0.05").unwrap();
    let mut g = c.benchmark_group("optimize");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(20));
    for (p, m, heuristic) in [(8u32, 16u32, false), (16, 64, false), (32, 256, true)] {
        let pl = Pipeline::new(p, p, m, PlacementKind::Loop).unwrap();
        let inst = Instance::new(&pl, &cost, Some(p as u64)).unwrap();
        let id = format!("P{p}_M{m}");
        g.bench_with_input(BenchmarkId::new("greedy", &id), &inst, |b, i| {
            b.iter(|| zero_bubble_greedy(i).unwrap())
        });
        let opts = Options {
            construct_only: heuristic,
            ..Options::default()
        };
        g.bench_with_input(
            BenchmarkId::new(if heuristic { "heuristic" } else { "search" }, &id),
            &inst,
            |b, i| b.iter(|| optimize(i, &[], &opts, &|_| {})),
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
