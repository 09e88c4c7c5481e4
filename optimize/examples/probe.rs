use schedc::input::{load_spec, Overrides};
use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::eval::Evaluator;
use schedc_optimize::search::{optimize, Options};
use schedc_optimize::{Instance, Sched};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let p: u32 = a[1].parse().unwrap();
    let m: u32 = a[2].parse().unwrap();
    let v: u32 = a[3].parse().unwrap();
    let cost = CostModel::resolve(&a[4]).unwrap();
    let cap: u64 = a[5].parse().unwrap();
    let pl = if v == 1 {
        Pipeline::new(p, p, m, PlacementKind::Loop).unwrap()
    } else {
        Pipeline::new(p, v * p, m, PlacementKind::V).unwrap()
    };
    let inst = Instance::new(&pl, &cost, Some(cap)).unwrap();
    let mut starts = Vec::new();
    for f in &a[6..] {
        let text = std::fs::read_to_string(f).unwrap();
        let ov = Overrides {
            pp: Some(p),
            microbatches: Some(m),
            ..Default::default()
        };
        let e = load_spec(&text, &ov).unwrap();
        let sc = Sched::from_program(&e.program).unwrap();
        let r = Evaluator::new(&inst).eval(&sc);
        println!("{f}: {:?}", r.map(|e| (e.makespan, e.peak)));
        starts.push((f.clone(), sc));
    }
    println!("lb {}", schedc_optimize::bound::lower_bound(&inst));
    let t = std::time::Instant::now();
    let out = optimize(&inst, &starts, &Options::default(), &|_| {});
    println!(
        "best {} lb {} by {} in {:?}",
        out.makespan,
        out.lower_bound,
        out.found_by,
        t.elapsed()
    );
    for ph in &out.phases {
        println!(
            "  {} best {} evals {} {:.2}s",
            ph.name, ph.best, ph.evals, ph.seconds
        );
    }
    if std::env::var("EXACT").is_ok() {
        let t = std::time::Instant::now();
        let r =
            schedc_optimize::exact::solve(&inst, Some((&out.best, out.makespan)), 50_000_000, None)
                .unwrap();
        println!(
            "exact: {} proved {} nodes {} in {:?}",
            r.makespan,
            r.proved,
            r.nodes,
            t.elapsed()
        );
    }
    if std::env::var("SHOW").is_ok() {
        for r in 0..inst.p {
            println!("{}", out.best.rank_text(&inst, r));
        }
    }
}
