use schedc_optimize::refdata::read;
use schedc_optimize::search::{optimize, Options};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let c = read(std::path::Path::new(&a[1])).unwrap();
    let inst = c.instance().unwrap();
    let use_start = a.get(2).is_some_and(|x| x == "seed");
    let starts = if use_start {
        vec![("reference".to_string(), c.sched.clone())]
    } else {
        vec![]
    };
    let t = std::time::Instant::now();
    let eff: f64 = std::env::var("EFF")
        .ok()
        .and_then(|x| x.parse().ok())
        .unwrap_or(1.0);
    let out = optimize(
        &inst,
        &starts,
        &Options {
            effort: eff,
            ..Options::default()
        },
        &|_| {},
    );
    println!(
        "{}: authors {} best {} lb {} by {} in {:?}",
        c.id,
        c.makespan_from_t0,
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
}
