//! The grid: P in {4, 8, 16}, M in {2P, 4P}, three cost sets, caps {P, 2P} (activations of
//! one stage per rank; a V stage counts half, as `schedc compare` scales it). At each point:
//! the best spec of specs/ within the cap, the Zero Bubble greedy, and the search on the
//! loop (one stage per rank), V (two) and interleaved loop (two) placements with the specs
//! of that placement as starts, through `search::optimize_placements` as `schedc optimize --pp P
//! --mb M --cost C --max-activations N` runs it (shared budget, pruning, branch and bound on
//! instances of at most 150 ops).
//! Every figure is the simulator's, after `schedc check`.
//!
//! `cargo run --release -p schedc-optimize --example grid -- [EFFORT] [P...]`

use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::report::{cap_for, evaluate, load_specs, scaled_cost};
use schedc_optimize::search::{optimize_placements, Options};
use schedc_optimize::{verify, Instance};
use std::path::Path;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let effort: f64 = args.get(1).and_then(|x| x.parse().ok()).unwrap_or(1.0);
    let ps: Vec<u32> = if args.len() > 2 {
        args[2..].iter().map(|x| x.parse().unwrap()).collect()
    } else {
        vec![4, 8, 16]
    };
    let specs_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    println!("| P | M | cost | cap | best spec | greedy | optimized | placement | seconds |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let (mut n, mut le_spec, mut le_greedy, mut strict) = (0, 0, 0, 0);
    for &p in &ps {
        for m in [2 * p, 4 * p] {
            let specs = load_specs(&specs_dir, p, m, 2);
            for (cn, cs) in schedc_optimize::refdata::COST_SETS {
                let cost = CostModel::resolve(cs).unwrap();
                for cap in [p as u64, 2 * p as u64] {
                    let t = std::time::Instant::now();
                    // Best spec within the cap.
                    let mut best_spec: Option<(f64, String)> = None;
                    for s in &specs {
                        if let Ok((r, _)) = evaluate(&s.name, &s.pipeline, &s.sched, &cost, p, cap)
                        {
                            if r.fits && best_spec.as_ref().is_none_or(|b| r.makespan < b.0) {
                                best_spec = Some((r.makespan, s.name.clone()));
                            }
                        }
                    }
                    // Greedy.
                    let gpl = Pipeline::new(p, p, m, PlacementKind::Loop).unwrap();
                    let gi = Instance::new(&gpl, &cost, Some(cap)).unwrap();
                    let greedy = schedc_optimize::greedy::zero_bubble_greedy(&gi)
                        .ok()
                        .map(|g| verify(&gi, &cost, &g.sched).unwrap().sim.makespan);
                    // The search on the three placements, as the CLI runs it.
                    let mut problems = Vec::new();
                    for (name, pl) in [
                        ("loop", gpl.clone()),
                        ("v", Pipeline::new(p, 2 * p, m, PlacementKind::V).unwrap()),
                        (
                            "loop V=2",
                            Pipeline::new(p, 2 * p, m, PlacementKind::Loop).unwrap(),
                        ),
                    ] {
                        let c = scaled_cost(&cost, p, &pl);
                        let Ok(inst) = Instance::new(&pl, &c, Some(cap_for(cap, p, &pl))) else {
                            continue;
                        };
                        let starts: Vec<_> = specs
                            .iter()
                            .filter(|s| s.pipeline == pl)
                            .map(|s| (format!("spec {}", s.name), s.sched.clone()))
                            .collect();
                        problems.push((name, inst, c, starts));
                    }
                    let refs: Vec<_> = problems
                        .iter()
                        .map(|(_, i, _, s)| (i, s.as_slice()))
                        .collect();
                    let opts = Options {
                        effort,
                        ..Options::cli_default()
                    };
                    let outs = optimize_placements(&refs, &opts, true, &|_, _| {});
                    let mut best: Option<(f64, &str)> = None;
                    for ((name, inst, c, _), out) in problems.iter().zip(outs) {
                        if !out.makespan.is_finite() {
                            continue;
                        }
                        let mk = verify(inst, c, &out.best).unwrap().sim.makespan;
                        if best.is_none_or(|b| mk < b.0) {
                            best = Some((mk, name));
                        }
                    }
                    let (mk, place) = best.unwrap();
                    let tol = 1e-6;
                    n += 1;
                    let bs = best_spec.as_ref().map_or(f64::INFINITY, |b| b.0);
                    let gr = greedy.unwrap_or(f64::INFINITY);
                    if mk <= bs + tol {
                        le_spec += 1;
                    }
                    if mk <= gr + tol {
                        le_greedy += 1;
                    }
                    if mk < bs.min(gr) - tol {
                        strict += 1;
                    }
                    println!(
                        "| {p} | {m} | {cn} | {cap} | {} | {} | {mk:.4}{} | {place} | {:.1} |",
                        best_spec
                            .as_ref()
                            .map_or("none".into(), |b| format!("{:.4} ({})", b.0, b.1)),
                        greedy.map_or("n/a".into(), |g| format!("{g:.4}")),
                        if mk < bs.min(gr) - tol { " **" } else { "" },
                        t.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }
    println!(
        "\n{n} points: at most the best spec within the cap on {le_spec}, at most the greedy on {le_greedy}, strictly below both on {strict} (effort {effort})"
    );
}
