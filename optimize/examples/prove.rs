//! Branch and bound on the reference configurations the search does not beat: from the
//! search's best (which is at most the authors'), prove it optimal within a node budget.
//!
//! `cargo run --release -p schedc-optimize --example prove -- NODES CONFIG_ID...`

use schedc_optimize::exact::solve;
use schedc_optimize::refdata::{read, zb_dir};
use schedc_optimize::search::{optimize, Options};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nodes: u64 = args[1].parse().unwrap();
    let dir = zb_dir().expect("shared/reference/zb");
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
