//! The table of the reference data: every `zb1p`, `zb2p`, `vauto1p` and `vauto2p`
//! configuration of `shared/reference/zb/`, at its memory limit and placement: the authors'
//! from-start makespan and the search's, given the authors' schedule as its input (as
//! `schedc optimize their-schedule` runs it: every construction of the search competes with
//! it), the simulator's figure for the result (after `schedc check`), the lower bound, and
//! whether the result descends from the authors' order or from the search's own
//! constructions.
//!
//! "authors optimal" says the authors' makespan meets a lower bound: `bound.rs`'s or the
//! root bound of branch and bound ([`root_bound`]); there no schedule can be strictly lower.
//!
//! `cargo run --release -p schedc-optimize --example zb_reference -- [EFFORT] [FILTER]`

use schedc_optimize::exact::root_bound;
use schedc_optimize::refdata::{read_all, zb_dir};
use schedc_optimize::search::{optimize, Options};
use schedc_optimize::verify;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let effort: f64 = args.get(1).and_then(|x| x.parse().ok()).unwrap_or(1.0);
    let filter = args.get(2).cloned().unwrap_or_default();
    let dir = zb_dir().expect("shared/reference/zb");
    let cfgs = read_all(&dir, &["zb1p", "zb2p", "vauto1p", "vauto2p"]).unwrap();
    println!(
        "| config | cap | authors | optimized | lower bound | below authors | authors optimal | from | seconds |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let (mut n, mut le, mut lt, mut lt_own, mut opt) = (0, 0, 0, 0, 0);
    for c in cfgs.iter().filter(|c| c.id.contains(&filter)) {
        let t = std::time::Instant::now();
        let inst = c.instance().unwrap();
        // The CLI's default: branch and bound (and the multi-seed local search) on instances
        // of at most `AUTO_EXACT_MAX_OPS` ops (`--exact auto`).
        let opts = Options {
            effort,
            ..Options::cli_default()
        };
        let out = optimize(
            &inst,
            &[("authors".into(), c.sched.clone())],
            &opts,
            &|_| {},
        );
        let mk = verify(&inst, &c.cost, &out.best).unwrap().sim.makespan;
        let a = c.makespan_from_t0;
        let tol = 1e-6;
        let own = !out.found_by.starts_with("authors");
        let lb = out
            .lower_bound
            .max(root_bound(&inst).unwrap_or(f64::NEG_INFINITY));
        let authors_opt = lb >= a - tol;
        opt += authors_opt as usize;
        n += 1;
        if mk <= a + tol {
            le += 1;
        }
        if mk < a - tol {
            lt += 1;
            if own {
                lt_own += 1;
            }
        }
        println!(
            "| {} | {} | {:.4} | {:.4} | {:.4} | {} | {} | {} | {:.1} |",
            c.id,
            c.memory_limit.unwrap_or(0),
            a,
            mk,
            lb,
            if mk < a - tol { "yes" } else { "" },
            if authors_opt { "yes" } else { "" },
            if own { "own" } else { "authors'" },
            t.elapsed().as_secs_f64()
        );
    }
    println!(
        "\n{n} configurations: at most the authors' on {le}, strictly lower on {lt} ({lt_own} of them found from the search's own constructions), the authors' proved optimal by a lower bound on {opt}, unknown {} (effort {effort})",
        n - lt - opt
    );
}
