//! Criterion benchmark of the simulator on PyTorch's interleaved 1F1B at P = 64, V = 2,
//! M = 1024 (262,144 compute ops; about 1.3 million instructions once lowered), against a
//! same-run baseline: one pass over the lowered program counting its instructions.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::path::PathBuf;
use std::time::Duration;

fn large() -> Option<String> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(
        "../../shared/reference/torch/large/ScheduleInterleaved1F1B_P64_M1024_V2.compute.csv",
    );
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
    let imp = schedc::import::torch::parse_csv(&src, &Default::default()).expect("imports");
    let lowered = schedc::passes::lower::lower(&imp.program).expect("lowers");
    let cost = schedc::sim::cost::CostModel::resolve("unit").expect("preset");
    let n = lowered.len();
    eprintln!(
        "simulating {n} instructions ({} compute ops)",
        lowered.compute_ops()
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
    g.bench_function("simulate/interleaved_1f1b_p64_m1024_v2", |b| {
        b.iter(|| {
            black_box(
                schedc::sim::simulate(&lowered, &cost)
                    .expect("runs")
                    .makespan,
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
