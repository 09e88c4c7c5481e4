//! `schedc check` on a production-size schedule: PyTorch's `ScheduleInterleaved1F1B` for 64
//! ranks, 2 stages per rank, 1024 micro-batches (262,144 compute ops; lowering inserts about a
//! million communication ops), from `shared/reference/torch/large`.
//!
//! * `check/compute_csv`: import of the compute-only CSV plus every pass (lowering included);
//!   the headline figure.
//! * `check/comms_csv`: import plus every pass on torch's own lowered CSV.
//! * `check/compute_csv_moe`: import, the `--moe` split (every F and BW in four MoE parts:
//!   four times the compute ops) and every pass: `schedc check --moe`.
//! * `phase/*`: the compute CSV's cost, pass by pass.
//! * `baseline/read_and_split`: read the compute CSV and split it into cells, the cost floor
//!   of touching the input; report the others as multiples of it.
//!
//! Run with `cargo bench -p schedc --bench check`. When the shared file is missing the bench
//! prints a note and does nothing.

use criterion::{Criterion, SamplingMode, Throughput};
use schedc::check::{check, Options};
use schedc::import::torch::{parse_csv, TorchOptions};
use schedc::passes::{deadlock, deps, liveness, lower, makespan, warmup, wellformed, OpIndex};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

const STEM: &str = "ScheduleInterleaved1F1B_P64_M1024_V2";

fn large_dir() -> PathBuf {
    // compiler/ -> workspace root -> ../shared (the checkout sits next to `shared/`).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let candidates = [
        root.join("../shared/reference/torch/large"),
        root.join("shared/reference/torch/large"),
        PathBuf::from("/work/shared/reference/torch/large"),
    ];
    candidates
        .iter()
        .find(|d| d.join(format!("{STEM}.compute.csv")).is_file())
        .cloned()
        .unwrap_or_else(|| candidates[0].clone())
}

fn group<'a>(
    c: &'a mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(name);
    // Each iteration takes from milliseconds to seconds: flat sampling keeps it at
    // 10 samples of the same iteration count instead of criterion's 55-iteration minimum.
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    g
}

fn main() {
    let dir = large_dir();
    let compute_path = dir.join(format!("{STEM}.compute.csv"));
    let comms_path = dir.join(format!("{STEM}.comms.csv"));
    let (Ok(compute), Ok(comms)) = (
        std::fs::read_to_string(&compute_path),
        std::fs::read_to_string(&comms_path),
    ) else {
        eprintln!(
            "note: {} or its .comms.csv is missing; skipping the check benchmarks",
            compute_path.display()
        );
        return;
    };
    let opts = TorchOptions::default();
    let copts = Options::default();

    // The inputs of each phase, and the sizes to quote ops/s against.
    let program = parse_csv(&compute, &opts)
        .expect("the compute CSV imports")
        .program;
    let lowered = lower::lower(&program).expect("the compute CSV lowers");
    let comms_program = parse_csv(&comms, &opts)
        .expect("the comms CSV imports")
        .program;
    let outcome = check(&program, None, &copts);
    eprintln!(
        "compute CSV: {} instrs ({} compute ops); lowered: {} instrs ({} compute + {} comm ops); verdict {:?}",
        program.len(),
        program.compute_ops(),
        lowered.len(),
        lowered.compute_ops(),
        lowered.comm_ops(),
        outcome.report.verdict,
    );
    eprintln!(
        "comms CSV: {} instrs ({} compute + {} comm ops); verdict {:?}",
        comms_program.len(),
        comms_program.compute_ops(),
        comms_program.comm_ops(),
        check(&comms_program, None, &copts).report.verdict,
    );
    drop(outcome);

    let mut c = Criterion::default().configure_from_args();

    {
        let mut g = group(&mut c, "baseline");
        g.throughput(Throughput::Elements(program.compute_ops() as u64));
        g.bench_function("read_and_split", |b| {
            b.iter(|| {
                let text = std::fs::read_to_string(&compute_path).expect("readable");
                let cells: usize = text.lines().map(|l| l.split(',').count()).sum();
                black_box(cells)
            })
        });
        g.finish();
    }

    {
        let mut g = group(&mut c, "check");
        g.throughput(Throughput::Elements(program.compute_ops() as u64));
        g.bench_function("compute_csv", |b| {
            b.iter(|| {
                let t = parse_csv(black_box(&compute), &opts).expect("imports");
                check(&t.program, Some(&t.spans), &copts)
            })
        });
        g.bench_function("compute_csv_moe", |b| {
            b.iter(|| {
                let t = parse_csv(black_box(&compute), &opts).expect("imports");
                let (p, spans) = schedc::input::apply_moe(
                    &t.program,
                    Some(&t.spans),
                    &schedc::moe::MoeStages::All,
                )
                .expect("splits");
                check(&p, spans.as_ref(), &copts)
            })
        });
        g.throughput(Throughput::Elements(comms_program.len() as u64));
        g.bench_function("comms_csv", |b| {
            b.iter(|| {
                let t = parse_csv(black_box(&comms), &opts).expect("imports");
                check(&t.program, Some(&t.spans), &copts)
            })
        });
        g.finish();
    }

    {
        let mut g = group(&mut c, "phase");
        g.throughput(Throughput::Elements(program.compute_ops() as u64));
        g.bench_function("import", |b| {
            b.iter(|| parse_csv(black_box(&compute), &opts).expect("imports"))
        });
        g.bench_function("lower", |b| {
            b.iter(|| lower::lower(black_box(&program)).expect("lowers"))
        });
        g.bench_function("deadlock", |b| {
            b.iter(|| deadlock::check(black_box(&lowered), deadlock::Semantics::default()))
        });
        g.bench_function("liveness", |b| {
            b.iter(|| liveness::analyze(black_box(&program), None))
        });
        g.bench_function("warmup", |b| {
            b.iter(|| warmup::analyze(black_box(&program)))
        });
        g.bench_function("makespan", |b| {
            b.iter(|| makespan::analyze(black_box(&program)))
        });
        g.bench_function("wellformed+deps", |b| {
            b.iter(|| {
                let p = black_box(&program);
                let idx = OpIndex::build(p);
                (wellformed::check(p, &idx), deps::check(p, &idx))
            })
        });
        g.finish();
    }

    c.final_summary();
}
