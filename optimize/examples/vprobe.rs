//! One V instance at a cap: the root bound of branch and bound, the search's best, each
//! rank's one-rank relaxation ([`schedc_optimize::rank_bound`]) searched below that best,
//! the best schedule's start times per rank, and, with NODES > 0, branch and bound from it.
//!
//! `cargo run --release -p schedc-optimize --example vprobe -- P M COST CAP [NODES]`, e.g.
//! `-- 4 6 F=1,B=1,W=1 4`. Environment: `PAIRS=1` also tries every set of two ranks
//! (20 M nodes each); `NR=n` sets the per-node relaxation budget of branch and bound
//! (default 20,000; 0 turns it off).
use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::eval::Evaluator;
use schedc_optimize::exact::root_bound;
use schedc_optimize::search::{optimize, Options};
use schedc_optimize::{Instance, Tok};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let p: u32 = a[1].parse().unwrap();
    let m: u32 = a[2].parse().unwrap();
    let cost = CostModel::resolve(&a[3]).unwrap();
    let cap: u64 = a[4].parse().unwrap();
    let nodes: u64 = a.get(5).and_then(|x| x.parse().ok()).unwrap_or(0);
    let pl = Pipeline::new(p, 2 * p, m, PlacementKind::V).unwrap();
    let inst = Instance::new(&pl, &cost, Some(cap)).unwrap();
    println!("root bound {}", root_bound(&inst).unwrap());
    let out = optimize(&inst, &[], &Options::default(), &|_| {});
    println!("best {} by {}", out.makespan, out.found_by);
    for r in 0..inst.p {
        let t = std::time::Instant::now();
        let rb = schedc_optimize::rank_bound::rank_bound(&inst, r, out.makespan, 50_000_000, None);
        println!("rank {r}: {:?} {:?}", rb, t.elapsed());
    }
    if std::env::var("PAIRS").is_ok() {
        for a in 0..inst.p {
            for b in a + 1..inst.p {
                let t = std::time::Instant::now();
                let rb = schedc_optimize::rank_bound::ranks_bound(
                    &inst,
                    &[a, b],
                    out.makespan,
                    20_000_000,
                    None,
                );
                println!("ranks {a},{b}: {:?} {:?}", rb, t.elapsed());
            }
        }
    }
    let mut ev = Evaluator::new(&inst);
    let (_, st) = ev.eval_starts(&out.best).unwrap();
    for (r, starts) in st.iter().enumerate() {
        let s: Vec<String> = out.best.ranks[r]
            .iter()
            .zip(starts)
            .map(|(t, x)| {
                let n = match t {
                    Tok::F(s) => format!("F{s}"),
                    Tok::B(s) => format!("B{s}"),
                    Tok::W(s) => format!("W{s}"),
                    Tok::BW(s) => format!("X{s}"),
                    _ => "P".into(),
                };
                format!("{n}@{x}")
            })
            .collect();
        println!("r{r}: {}", s.join(" "));
    }
    if nodes > 0 {
        let t = std::time::Instant::now();
        let nr: u64 = std::env::var("NR")
            .ok()
            .and_then(|x| x.parse().ok())
            .unwrap_or(20_000);
        let e = schedc_optimize::exact::solve_with(
            &inst,
            Some((&out.best, out.makespan)),
            schedc_optimize::exact::SolveOptions {
                max_nodes: nodes,
                node_relax_nodes: nr,
                ..Default::default()
            },
        )
        .unwrap();
        println!(
            "exact {} proved {} nodes {} {:?} relax {:?} cuts {} relax nodes {}",
            e.makespan,
            e.proved,
            e.nodes,
            t.elapsed(),
            e.relaxation,
            e.relax_cuts,
            e.relax_nodes
        );
    }
}
