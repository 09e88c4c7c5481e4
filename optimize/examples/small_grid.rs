//! Small instances: the heuristic search (branch and bound off) against the exact optimum
//! from branch and bound, over P in {2, 3, 4}, M in 1..=6, three cost sets and caps {P, 2P},
//! for the loop placement (one stage per rank) and the V placement (two).
//!
//! Also, per instance: the search as `schedc optimize` runs it by default (`--exact auto`:
//! branch and bound inside the search, 2 M nodes, on instances of at most 150 ops), and the
//! root bound of branch and bound with the one-rank relaxation ([`root_bound_with`], 500,000
//! nodes per rank), checked to be at most the optimum on every proved instance (a soundness
//! check of the bounds at sizes brute force cannot reach).
//!
//! `cargo run --release -p schedc-optimize --example small_grid -- [loop|v] [NODES]`

use schedc_optimize::exact::{root_bound_with, solve};
use schedc_optimize::refdata::{small_instance, COST_SETS};
use schedc_optimize::search::{optimize, Options};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let v_place = args.get(1).is_some_and(|x| x == "v");
    let nodes: u64 = args
        .get(2)
        .and_then(|x| x.parse().ok())
        .unwrap_or(20_000_000);
    println!(
        "| P | M | cost | cap | heuristic | --exact auto | exact | proved | nodes | root bound |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let (mut total, mut proved, mut equal, mut gaps) = (0, 0, 0, Vec::new());
    let (mut auto_equal, mut auto_gaps, mut unsound) = (0, Vec::new(), Vec::new());
    for p in 2..=4u32 {
        for m in 1..=6u32 {
            for (cn, _) in COST_SETS {
                for cap in [p as u64, 2 * p as u64] {
                    let placement = if v_place { "v" } else { "loop" };
                    let (inst, _) = small_instance(placement, p, m, cn, cap).unwrap();
                    let h = optimize(
                        &inst,
                        &[],
                        &Options {
                            exact_max_ops: 0,
                            ..Options::default()
                        },
                        &|_| {},
                    );
                    let a = optimize(&inst, &[], &Options::cli_default(), &|_| {});
                    let (inc, inc_mk) = if a.makespan < h.makespan {
                        (&a.best, a.makespan)
                    } else {
                        (&h.best, h.makespan)
                    };
                    let e = solve(&inst, Some((inc, inc_mk)), nodes, None).unwrap();
                    let rb = root_bound_with(&inst, 500_000).unwrap();
                    total += 1;
                    if e.proved {
                        proved += 1;
                        if rb > e.makespan + 1e-9 {
                            unsound
                                .push(format!("P={p} M={m} {cn} cap {cap}: {rb} > {}", e.makespan));
                        }
                        if (e.makespan - a.makespan).abs() < 1e-9 {
                            auto_equal += 1;
                        } else {
                            auto_gaps.push(format!(
                                "P={p} M={m} {cn} cap {cap}: {} vs {}",
                                a.makespan, e.makespan
                            ));
                        }
                        if (e.makespan - h.makespan).abs() < 1e-9 {
                            equal += 1;
                        } else {
                            gaps.push(format!(
                                "P={p} M={m} {cn} cap {cap}: {} vs {}",
                                h.makespan, e.makespan
                            ));
                        }
                    }
                    println!(
                        "| {p} | {m} | {cn} | {cap} | {:.4} | {:.4} | {:.4} | {} | {} | {:.4} |",
                        h.makespan,
                        a.makespan,
                        e.makespan,
                        if e.proved { "yes" } else { "no" },
                        e.nodes,
                        rb
                    );
                }
            }
        }
    }
    println!(
        "\n{} placement: {total} instances, {proved} proved optimal by branch and bound, heuristic equal to the optimum on {equal} of them",
        if v_place { "V" } else { "loop" }
    );
    println!("with --exact auto: equal to the optimum on {auto_equal} of the proved");
    println!(
        "root bound at most the optimum on {} of the proved",
        proved - unsound.len()
    );
    for g in gaps {
        println!("gap: {g}");
    }
    for g in auto_gaps {
        println!("gap with --exact auto: {g}");
    }
    for g in unsound {
        println!("UNSOUND root bound: {g}");
    }
}
