//! Where the default `schedc optimize` spends its time: for each placement it tries (loop
//! with one stage per rank, V with two, interleaved loop with two; the specs of that
//! placement as starts), the lower bound, the best cheap construction, every phase's time
//! and result without pruning; then the driver the CLI runs
//! (`search::optimize_placements`, pruning on) and its total time. A probe for profiling,
//! not a benchmark (the benchmark is `benches/optimize.rs`).
//!
//! `cargo run --release -p schedc-optimize --example placements -- P M COST CAP [EFFORT]`

use schedc::sim::cost::CostModel;
use schedc_optimize::report::{cap_for, load_specs, scaled_cost};
use schedc_optimize::search::{default_pipelines, optimize_placements, Options, Search};
use schedc_optimize::Instance;
use std::path::Path;
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let p: u32 = a[1].parse().unwrap();
    let m: u32 = a[2].parse().unwrap();
    let cost = CostModel::resolve(&a[3]).unwrap();
    let cap: u64 = a[4].parse().unwrap();
    let effort: f64 = a.get(5).and_then(|x| x.parse().ok()).unwrap_or(1.0);
    let t = Instant::now();
    let specs = load_specs(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs"),
        p,
        m,
        2,
    );
    println!("load_specs: {:.3} s", t.elapsed().as_secs_f64());
    let opts = Options {
        effort,
        ..Options::cli_default()
    };
    let mut problems = Vec::new();
    for pl in default_pipelines(p, m) {
        let c = scaled_cost(&cost, p, &pl);
        let Ok(inst) = Instance::new(&pl, &c, Some(cap_for(cap, p, &pl))) else {
            continue;
        };
        let starts: Vec<_> = specs
            .iter()
            .filter(|s| s.pipeline == pl)
            .map(|s| (format!("spec {}", s.name), s.sched.clone()))
            .collect();
        problems.push((inst, starts));
    }
    for (inst, starts) in &problems {
        let t = Instant::now();
        let s = Search::new(inst, starts, &opts);
        let cheap = t.elapsed().as_secs_f64();
        let (lb, best) = (s.lower_bound(), s.best());
        let out = s.finish(f64::INFINITY, &|_| {});
        println!(
            "{:?} S={}: lower bound {lb:.4}, cheap constructions {best:.4} in {cheap:.3} s, result {:.4} in {:.3} s",
            inst.pipeline.placement,
            inst.s,
            out.makespan,
            t.elapsed().as_secs_f64()
        );
        for ph in &out.phases {
            println!(
                "    {:<18} best {:.4}, {} evaluations, {:.3} s",
                ph.name, ph.best, ph.evals, ph.seconds
            );
        }
    }
    let refs: Vec<_> = problems.iter().map(|(i, s)| (i, s.as_slice())).collect();
    let t = Instant::now();
    let outs = optimize_placements(&refs, &opts, true, &|_, _| {});
    println!(
        "optimize_placements (pruning): {:.3} s, results {:?}",
        t.elapsed().as_secs_f64(),
        outs.iter().map(|o| o.makespan).collect::<Vec<_>>()
    );
}
