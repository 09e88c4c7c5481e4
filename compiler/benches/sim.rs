//! Criterion benchmark of the simulator on PyTorch's interleaved 1F1B at P = 64, V = 2,
//! M = 1024 (262,144 compute ops; about 1.3 million instructions once lowered), against two
//! same-run baselines: one pass over the lowered program counting its instructions, and
//! reading the compute CSV and splitting it into cells (the baseline of the check benchmark).
//!
//! * `simulate/interleaved_1f1b_p64_m1024_v2`: the lowered program, unit costs.
//! * `simulate/interleaved_1f1b_p64_m1024_v2_moe`: the same split with `--moe` (every F and
//!   BW in four parts: four times the compute ops) and lowered, under
//!   `shared/costs/moe-1to1.toml`: `schedc sim --moe` without the import and the check.
//!
//! Each simulation includes the steady-state runs of the step (the `steady_state` bubble).

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::path::PathBuf;
use std::time::Duration;

fn shared(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared")
        .join(rel)
}

fn large() -> Option<String> {
    let p = shared("reference/torch/large/ScheduleInterleaved1F1B_P64_M1024_V2.compute.csv");
    match std::fs::read_to_string(&p) {
        Ok(s) => Some(s),
        Err(_) => {
            eprintln!(
                "note: {} not found; skipping the simulator benchmark",
                p.display()
            );
            None
        }
    }
}

fn bench(c: &mut Criterion) {
    let Some(src) = large() else { return };
    let csv = shared("reference/torch/large/ScheduleInterleaved1F1B_P64_M1024_V2.compute.csv");
    let imp = schedc::import::torch::parse_csv(&src, &Default::default()).expect("imports");
    let lowered = schedc::passes::lower::lower(&imp.program).expect("lowers");
    let cost = schedc::sim::cost::CostModel::resolve("unit").expect("preset");
    let (split, _) =
        schedc::input::apply_moe(&imp.program, None, &schedc::moe::MoeStages::All).expect("splits");
    let lowered_moe = schedc::passes::lower::lower(&split).expect("lowers");
    let moe_cost = shared("costs/moe-1to1.toml");
    let moe_cost = schedc::sim::cost::CostModel::resolve(&moe_cost.display().to_string())
        .expect("moe-1to1.toml");
    let n = lowered.len();
    eprintln!(
        "simulating {n} instructions ({} compute ops); with --moe {} instructions ({} compute ops)",
        lowered.compute_ops(),
        lowered_moe.len(),
        lowered_moe.compute_ops()
    );
    let mut g = c.benchmark_group("sim");
    g.sample_size(10).measurement_time(Duration::from_secs(20));
    g.bench_function("baseline/walk_instructions", |b| {
        b.iter(|| {
            let mut k = 0usize;
            for r in &lowered.ranks {
                for i in r {
                    k += usize::from(i.is_compute()) + i.comms().len();
                }
            }
            black_box(k)
        })
    });
    g.bench_function("baseline/read_and_split", |b| {
        b.iter(|| {
            let text = std::fs::read_to_string(&csv).expect("readable");
            let cells: usize = text.lines().map(|l| l.split(',').count()).sum();
            black_box(cells)
        })
    });
    g.bench_function("simulate/interleaved_1f1b_p64_m1024_v2", |b| {
        b.iter(|| {
            black_box(
                schedc::sim::simulate(&lowered, &cost)
                    .expect("runs")
                    .makespan,
            )
        })
    });
    g.bench_function("simulate/interleaved_1f1b_p64_m1024_v2_moe", |b| {
        b.iter(|| {
            black_box(
                schedc::sim::simulate(&lowered_moe, &moe_cost)
                    .expect("runs")
                    .makespan,
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
