//! The table of the reference data: every `zb1p`, `zb2p`, `vauto1p` and `vauto2p`
//! configuration of `shared/reference/zb/`, at its memory limit and placement: the authors'
//! from-start makespan, the search's from scratch (no start given) and from the authors'
//! schedule (as `schedc optimize their-schedule` would), the simulator's figure for each
//! result (after `schedc check`) and the lower bound.
//!
//! `cargo run --release -p schedc-optimize --example zb_reference -- [EFFORT] [FILTER]`

use schedc_optimize::refdata::{read_all, zb_dir};
use schedc_optimize::search::{optimize, Options};
use schedc_optimize::verify;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let effort: f64 = args.get(1).and_then(|x| x.parse().ok()).unwrap_or(1.0);
    let filter = args.get(2).cloned().unwrap_or_default();
    let dir = zb_dir().expect("shared/reference/zb");
    let cfgs = read_all(&dir, &["zb1p", "zb2p", "vauto1p", "vauto2p"]).unwrap();
    println!("| config | cap | authors | scratch | from theirs | lower bound | best < authors |");
    println!("|---|---|---|---|---|---|---|");
    let (mut n, mut le, mut lt, mut lt_scratch, mut le_scratch) = (0, 0, 0, 0, 0);
    for c in cfgs.iter().filter(|c| c.id.contains(&filter)) {
        let inst = c.instance().unwrap();
        let opts = Options {
            effort,
            ..Options::default()
        };
        let scratch = optimize(&inst, &[], &opts, &|_| {});
        let seeded = optimize(
            &inst,
            &[("authors".into(), c.sched.clone())],
            &opts,
            &|_| {},
        );
        let s1 = verify(&inst, &c.cost, &scratch.best).unwrap().sim.makespan;
        let s2 = verify(&inst, &c.cost, &seeded.best).unwrap().sim.makespan;
        let best = s1.min(s2);
        let a = c.makespan_from_t0;
        n += 1;
        let tol = 1e-6;
        if best <= a + tol {
            le += 1;
        }
        if best < a - tol {
            lt += 1;
        }
        if s1 <= a + tol {
            le_scratch += 1;
        }
        if s1 < a - tol {
            lt_scratch += 1;
        }
        println!(
            "| {} | {} | {:.4} | {:.4} | {:.4} | {:.4} | {} |",
            c.id,
            c.memory_limit.unwrap_or(0),
            a,
            s1,
            s2,
            scratch.lower_bound,
            if best < a - tol { "yes" } else { "" }
        );
    }
    println!(
        "\n{n} configurations: at most the authors' on {le}, strictly lower on {lt}; from scratch alone: at most on {le_scratch}, strictly lower on {lt_scratch} (effort {effort})"
    );
}
