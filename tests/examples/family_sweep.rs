//! The family sweep of issue 26 item 5: schedc's `v_half` and `v_min` against a
//! reimplementation of the authors' generator (`schedc_tests::zbv`) at every P in 2..=16, M
//! in P..=8P and every cost set of `schedc_tests::zbv::COSTS`.
//!
//! `cargo run --release -p schedc-tests --example family_sweep [P_MIN P_MAX [M_STEP]]`
//! prints, per family, the worst makespan and peak ratios (ours / the authors') and every
//! point where ours is worse.

use schedc_tests::zbv::{sweep, Mode, COSTS};

fn main() {
    let a: Vec<u32> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("a number"))
        .collect();
    let (lo, hi) = (
        a.first().copied().unwrap_or(2),
        a.get(1).copied().unwrap_or(16),
    );
    let step = a.get(2).copied().unwrap_or(1);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    for (spec, mode) in [("v_half", Mode::Half), ("v_min", Mode::Min)] {
        let text = std::fs::read_to_string(root.join(format!("{spec}.sched"))).unwrap();
        let t0 = std::time::Instant::now();
        let pts = sweep(
            &text,
            mode,
            lo..=hi,
            &|p| (p..=8 * p).step_by(step as usize).collect(),
            &COSTS,
        );
        let worse: Vec<_> = pts
            .iter()
            .filter(|x| x.makespan_ratio() > 1.0 + 1e-9 || x.peak_ratio() > 1.0)
            .collect();
        let wm = pts
            .iter()
            .max_by(|x, y| x.makespan_ratio().total_cmp(&y.makespan_ratio()))
            .unwrap();
        let wp = pts
            .iter()
            .max_by(|x, y| x.peak_ratio().total_cmp(&y.peak_ratio()))
            .unwrap();
        let bm = pts
            .iter()
            .min_by(|x, y| x.makespan_ratio().total_cmp(&y.makespan_ratio()))
            .unwrap();
        println!(
            "{spec}: {} points, {} worse; worst makespan ratio {:.4} (P{} M{} {}: {:.2} vs {:.2}); \
             worst peak ratio {:.3} (P{} M{} {}: {} vs {}); best makespan ratio {:.4} (P{} M{} {}); {:.1} s",
            pts.len(),
            worse.len(),
            wm.makespan_ratio(),
            wm.p,
            wm.m,
            wm.cost,
            wm.makespan.0,
            wm.makespan.1,
            wp.peak_ratio(),
            wp.p,
            wp.m,
            wp.cost,
            wp.peak.0,
            wp.peak.1,
            bm.makespan_ratio(),
            bm.p,
            bm.m,
            bm.cost,
            t0.elapsed().as_secs_f64()
        );
        for x in &worse {
            println!(
                "  worse: {spec} P{} M{} {}: makespan {:.3} vs {:.3} ({:.4}), peak {} vs {}",
                x.p,
                x.m,
                x.cost,
                x.makespan.0,
                x.makespan.1,
                x.makespan_ratio(),
                x.peak.0,
                x.peak.1
            );
        }
    }
}
