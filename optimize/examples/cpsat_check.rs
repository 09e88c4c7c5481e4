//! `schedc optimize` against CP-SAT's proved optima on the small grid
//! (`optimize/tests/data/cpsat_small.jsonl`, see `optimize/cpsat/README.md`): the search with
//! the CLI's default options (`--exact auto`: branch and bound on instances of at most 150
//! ops; seed 0) on the instance's placement with no starting schedule, per instance, and
//! whether it equals the optimum. Also branch and bound's root bound
//! with the one-rank relaxation ([`root_bound_with`], 500,000 nodes per rank), which must
//! not exceed the optimum.
//!
//! `cargo run --release -p schedc-optimize --example cpsat_check -- [v|loop|all]`
use schedc_optimize::exact::root_bound_with;
use schedc_optimize::refdata::small_instance;
use schedc_optimize::search::{optimize, Options};

const DATA: &str = include_str!("../tests/data/cpsat_small.jsonl");

fn main() {
    let which = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    println!("| placement | P | M | cost | cap | optimize | CP-SAT optimum | equal | root bound | seconds |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let (mut n, mut equal, mut misses, mut unsound) = (0, 0, Vec::new(), Vec::new());
    for line in DATA.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let placement = v["placement"].as_str().unwrap();
        if which != "all" && which != placement {
            continue;
        }
        let (p, m, cap) = (
            v["P"].as_u64().unwrap() as u32,
            v["M"].as_u64().unwrap() as u32,
            v["cap"].as_u64().unwrap(),
        );
        let cn = v["cost"].as_str().unwrap();
        let (inst, _) = small_instance(placement, p, m, cn, cap).unwrap();
        let opt = v["cpsat"].as_f64().unwrap();
        let proved = v["proved"].as_bool().unwrap();
        let t = std::time::Instant::now();
        let out = optimize(&inst, &[], &Options::cli_default(), &|_| {});
        let secs = t.elapsed().as_secs_f64();
        let rb = root_bound_with(&inst, 500_000).unwrap_or(f64::NEG_INFINITY);
        let label = format!("{placement} P={p} M={m} {cn} cap {cap}");
        let eq = proved && (out.makespan - opt).abs() < 1e-9;
        n += 1;
        if eq {
            equal += 1;
        } else {
            misses.push(format!("{label}: {} vs {opt}", out.makespan));
        }
        if proved && rb > opt + 1e-9 {
            unsound.push(format!("{label}: {rb} > {opt}"));
        }
        println!(
            "| {placement} | {p} | {m} | {cn} | {cap} | {:.4} | {opt:.4}{} | {} | {rb:.4} | {secs:.2} |",
            out.makespan,
            if proved { "" } else { " (not proved)" },
            if eq { "yes" } else { "**no**" },
        );
    }
    println!("\n{n} instances: schedc optimize equals CP-SAT's proved optimum on {equal}");
    for x in misses {
        println!("miss: {x}");
    }
    for x in unsound {
        println!("UNSOUND root bound: {x}");
    }
}
