//! Proofs on the reference configurations.
//!
//! `cargo run --release -p schedc-optimize --example prove -- NODES CONFIG_ID...`: branch
//! and bound from the search's best (which is at most the authors'), within a node budget.
//!
//! `cargo run --release -p schedc-optimize --example prove -- bounds`: for every `zb1p`,
//! `zb2p`, `vauto1p` and `vauto2p` configuration, the authors' makespan, the lower bound of
//! `bound.rs` and the root bound of branch and bound (no search): where either reaches the
//! authors' makespan, no schedule at that memory limit and placement is shorter.
//!
//! `-- relax NODES CONFIG_ID...`: the one-rank relaxation alone on the given configurations
//! (every rank, from both ends inwards; with `RANK=r` in the environment, rank `r` only).
//!
//! `-- bounds NODES`: also, where neither does, the one-rank relaxation
//! ([`best_rank_bound`]) searched for a schedule shorter than the authors' within NODES nodes
//! per rank: where it finds none, the authors' makespan is optimal.

use schedc_optimize::bound::lower_bound;
use schedc_optimize::exact::{root_bound, solve};
use schedc_optimize::rank_bound::{best_rank_bound, rank_bound};
use schedc_optimize::refdata::{read, read_all, zb_dir};
use schedc_optimize::search::{optimize, Options};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = zb_dir().expect("shared/reference/zb");
    if args[1] == "bounds" {
        let cfgs = read_all(&dir, &["zb1p", "zb2p", "vauto1p", "vauto2p"]).unwrap();
        let relax_nodes: u64 = args.get(2).and_then(|x| x.parse().ok()).unwrap_or(0);
        println!(
            "| config | cap | authors | lower bound | root bound | one-rank relaxation | authors optimal |"
        );
        println!("|---|---|---|---|---|---|---|");
        let mut proved = 0;
        for c in &cfgs {
            let inst = c.instance().unwrap();
            let lb = lower_bound(&inst);
            let rb = root_bound(&inst).unwrap_or(f64::NEG_INFINITY);
            let mut opt = lb.max(rb) >= c.makespan_from_t0 - 1e-6;
            let mut relax = String::from("-");
            if !opt && relax_nodes > 0 {
                let t = std::time::Instant::now();
                match best_rank_bound(&inst, c.makespan_from_t0, relax_nodes, None) {
                    Some(r) => {
                        opt = r.bound >= c.makespan_from_t0 - 1e-6;
                        relax = format!(
                            "{}{:.4} (rank {}, {} nodes, {:.2} s)",
                            if r.exact { "" } else { ">= " },
                            r.bound,
                            r.rank,
                            r.nodes,
                            t.elapsed().as_secs_f64()
                        );
                    }
                    None => relax = format!("unfinished ({relax_nodes} nodes per rank)"),
                }
            }
            proved += opt as usize;
            println!(
                "| {} | {} | {:.4} | {:.4} | {:.4} | {relax} | {} |",
                c.id,
                c.memory_limit.unwrap_or(0),
                c.makespan_from_t0,
                lb,
                rb,
                if opt { "yes" } else { "" }
            );
        }
        println!(
            "\n{} configurations: the authors' makespan meets a lower bound on {proved}",
            cfgs.len()
        );
        return;
    }
    if args[1] == "relax" {
        let nodes: u64 = args[2].parse().unwrap();
        println!("| config | authors | one-rank relaxation | authors optimal |");
        println!("|---|---|---|---|");
        for id in &args[3..] {
            let c = read(&dir.join(format!("{id}.json"))).unwrap();
            let inst = c.instance().unwrap();
            let t = std::time::Instant::now();
            // RANK=r: that rank alone (the turn of a V placement is P - 1).
            let only = std::env::var("RANK")
                .ok()
                .and_then(|x| x.parse::<usize>().ok());
            let got = match only {
                Some(r) => rank_bound(&inst, r.min(inst.p - 1), c.makespan_from_t0, nodes, None),
                None => best_rank_bound(&inst, c.makespan_from_t0, nodes, None),
            };
            let (relax, opt) = match got {
                Some(r) => (
                    format!(
                        "{}{:.4} (rank {}, {} nodes, {:.2} s)",
                        if r.exact { "" } else { ">= " },
                        r.bound,
                        r.rank,
                        r.nodes,
                        t.elapsed().as_secs_f64()
                    ),
                    r.bound >= c.makespan_from_t0 - 1e-6,
                ),
                None => (format!("unfinished ({nodes} nodes per rank)"), false),
            };
            println!(
                "| {id} | {:.4} | {relax} | {} |",
                c.makespan_from_t0,
                if opt { "yes" } else { "" }
            );
        }
        return;
    }
    let nodes: u64 = args[1].parse().unwrap();
    println!("| config | authors | optimized | exact | proved | nodes |");
    println!("|---|---|---|---|---|---|");
    for id in &args[2..] {
        let c = read(&dir.join(format!("{id}.json"))).unwrap();
        let inst = c.instance().unwrap();
        let out = optimize(
            &inst,
            &[("authors".into(), c.sched.clone())],
            &Options::default(),
            &|_| {},
        );
        let e = solve(&inst, Some((&out.best, out.makespan)), nodes, None).unwrap();
        println!(
            "| {id} | {:.4} | {:.4} | {:.4} | {} | {} |",
            c.makespan_from_t0,
            out.makespan,
            e.makespan,
            if e.proved { "yes" } else { "no" },
            e.nodes
        );
    }
}
