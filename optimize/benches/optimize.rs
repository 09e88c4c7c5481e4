//! How long the default `schedc optimize --pp P --mb M --cost C --max-activations P` takes
//! (no input, no `--placement`: loop, V and interleaved placements, the specs of `specs/` as
//! starts and rows), against the Zero Bubble greedy at the same size measured in the same
//! run (report the ratio; the machines are shared and noisy).
//!
//! `command` runs what `cli/src/optimize.rs` runs, minus argument parsing and printing:
//! `report::load_specs`, the instances of `search::default_pipelines`, the search through
//! `search::optimize_placements` with the CLI's options (branch and bound on at most 150
//! ops, pruning under the from-start objective), `verify` of every placement's result, and
//! the rows of the specs within the cap and of the greedy.
//!
//! Sizes (cost F = 1, B = 1.1, W = 0.9, 0.05 per message, cap P): P = 8, M = 16 and P = 16,
//! M = 64 (default search); P = 32, M = 256 (`--heuristic`: list scheduling and the greedy
//! only). And the headline, P = 8, M = 16 under the unit cost with cap 8.
//!
//! `cargo bench -p schedc-optimize --bench optimize`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::greedy::zero_bubble_greedy;
use schedc_optimize::report::{cap_for, evaluate, load_specs, scaled_cost};
use schedc_optimize::search::{default_pipelines, optimize_placements, Options};
use schedc_optimize::{verify, Instance};
use std::path::Path;
use std::time::Duration;

/// The default command's work; returns the best makespan.
fn command(p: u32, m: u32, cost: &CostModel, cap: u64, heuristic: bool) -> f64 {
    let specs = load_specs(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs"),
        p,
        m,
        2,
    );
    let mut cands = Vec::new();
    for pl in default_pipelines(p, m) {
        let c = scaled_cost(cost, p, &pl);
        let Ok(inst) = Instance::new(&pl, &c, Some(cap_for(cap, p, &pl))) else {
            continue;
        };
        let starts: Vec<_> = specs
            .iter()
            .filter(|s| s.pipeline == pl)
            .map(|s| (format!("spec {}", s.name), s.sched.clone()))
            .collect();
        cands.push((inst, c, starts));
    }
    let opts = Options {
        construct_only: heuristic,
        ..Options::cli_default()
    };
    let problems: Vec<_> = cands.iter().map(|(i, _, s)| (i, s.as_slice())).collect();
    let outs = optimize_placements(&problems, &opts, true, &|_, _| {});
    let mut best = f64::INFINITY;
    for ((inst, c, _), out) in cands.iter().zip(outs) {
        if out.makespan.is_finite() {
            best = best.min(verify(inst, c, &out.best).unwrap().sim.makespan);
        }
    }
    for s in &specs {
        let _ = evaluate(&s.name, &s.pipeline, &s.sched, cost, p, cap);
    }
    let gpl = Pipeline::new(p, p, m, PlacementKind::Loop).unwrap();
    let gi = Instance::new(&gpl, cost, Some(cap)).unwrap();
    let g = zero_bubble_greedy(&gi).unwrap();
    let _ = evaluate("greedy", &gpl, &g.sched, cost, p, cap);
    best
}

fn bench(c: &mut Criterion) {
    let prof_a = CostModel::resolve("F=1,B=1.1,W=0.9,latency=0.05").unwrap();
    let unit = CostModel::resolve("unit").unwrap();
    let mut g = c.benchmark_group("optimize");
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(100));
    g.measurement_time(Duration::from_secs(5));
    for (p, m, cost, cname, heuristic) in [
        (8u32, 16u32, &unit, "unit", false),
        (8, 16, &prof_a, "profA", false),
        (16, 64, &prof_a, "profA", false),
        (32, 256, &prof_a, "profA", true),
    ] {
        let cap = p as u64;
        let pl = Pipeline::new(p, p, m, PlacementKind::Loop).unwrap();
        let inst = Instance::new(&pl, cost, Some(cap)).unwrap();
        let id = format!("P{p}_M{m}_{cname}");
        g.bench_with_input(BenchmarkId::new("greedy", &id), &inst, |b, i| {
            b.iter(|| zero_bubble_greedy(i).unwrap())
        });
        g.bench_function(
            BenchmarkId::new(
                if heuristic {
                    "command_heuristic"
                } else {
                    "command"
                },
                &id,
            ),
            |b| b.iter(|| command(p, m, cost, cap, heuristic)),
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
