//! Conformance with the Zero Bubble, Controllable Memory and Chimera authors' generators
//! (`shared/reference/zb`): identical per-rank orders, or, where the greedy breaks a tie
//! differently, a from-start makespan and a peak no worse than the authors'.

use schedc::input::{load_spec_with, Overrides};
use schedc_tests::{conform, zb};

/// Compares `spec` with every config of `generator`; returns (same orders, no worse,
/// worse) and prints one line per config.
fn compare(spec: &str, generator: &str) -> (usize, usize, Vec<String>) {
    let text = std::fs::read_to_string(conform::root().join("specs").join(format!("{spec}.sched")))
        .unwrap();
    let (mut same, mut better) = (0, 0);
    let mut worse = Vec::new();
    for c in zb::configs(generator) {
        let ov = Overrides {
            pp: Some(c.pp),
            microbatches: Some(c.mb),
            ..Default::default()
        };
        let e = match load_spec_with(&text, &ov, &zb::cost_model(c.cost)) {
            Ok(e) => e,
            Err(e) => {
                worse.push(format!("{}: does not elaborate: {e:?}", c.id));
                continue;
            }
        };
        let ours = zb::makespan(&e.program, c.cost).expect("our orders run");
        let theirs = zb::makespan(&c.program, c.cost).expect("reference orders run");
        assert!((theirs - c.makespan).abs() < 1e-6, "{}: timing model", c.id);
        let (pk, rpk) = (zb::peaks(&e.program), zb::peaks(&c.program));
        assert_eq!(rpk, c.peaks, "{}: peak model", c.id);
        let identical = e.program.ranks == c.program.ranks;
        let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
        let verdict = if identical {
            same += 1;
            "identical"
        } else if ours <= theirs + 1e-6 && max(&pk) <= max(&rpk) {
            better += 1;
            "no worse"
        } else {
            worse.push(format!(
                "{}: makespan {ours:.2} vs {theirs:.2}, peak {} vs {}",
                c.id,
                max(&pk),
                max(&rpk)
            ));
            "WORSE"
        };
        println!(
            "{:<22} makespan {:>8.2} (authors {:>8.2})  peak {:>3} (authors {:>3})  {verdict}",
            c.id,
            ours,
            theirs,
            max(&pk),
            max(&rpk)
        );
    }
    (same, better, worse)
}

/// V-Half: no worse than the authors' generator on all 36 configs (makespan from t0 and
/// peak). The three profA configs where the greedy's steady state once picked up a message
/// latency every second micro-batch (P8 M24, P12 M36, P16 M32) are now shorter: the variant
/// with `W` due at its building-block slot keeps the authors' period.
#[test]
fn v_half_vs_authors() {
    let (s, b, w) = compare("v_half", "vhalf");
    println!("v_half: {s} identical, {b} no worse, {} worse", w.len());
    assert!(w.is_empty(), "{}", w.join("\n"));
    assert_eq!(s + b, zb::configs("vhalf").len());
}

#[test]
fn v_min_vs_authors() {
    let (s, b, w) = compare("v_min", "vmin");
    println!("v_min: {s} identical, {b} no worse, {} worse", w.len());
    assert!(w.is_empty(), "{}", w.join("\n"));
}

/// `ZB_DUMP=spec:config_id cargo test --test zb dump -- --nocapture --ignored`: both orders.
#[test]
#[ignore]
fn dump() {
    let Ok(v) = std::env::var("ZB_DUMP") else {
        return;
    };
    let (spec, id) = v.split_once(':').unwrap();
    let gen = id.split('_').next().unwrap();
    let c = zb::configs(gen).into_iter().find(|c| c.id == id).unwrap();
    let text = std::fs::read_to_string(conform::root().join("specs").join(format!("{spec}.sched")))
        .unwrap();
    let ov = Overrides {
        pp: Some(c.pp),
        microbatches: Some(c.mb),
        ..Default::default()
    };
    let e = load_spec_with(&text, &ov, &zb::cost_model(c.cost)).unwrap();
    let (_, a) = zb::start_times(&e.program, c.cost).unwrap();
    let (_, b) = zb::start_times(&c.program, c.cost).unwrap();
    let mut late: Vec<_> = a
        .iter()
        .filter(|(k, t)| **t > b[k] + 1e-9)
        .map(|(k, t)| (b[k], *t, *k))
        .collect();
    late.sort_by(|x, y| x.partial_cmp(y).unwrap());
    for (tb, ta, k) in late.iter().take(40) {
        println!(
            "late: {:?} ours {ta} authors {tb} rank {}",
            k,
            c.program.pipeline.rank_of(k.1)
        );
    }
    for (name, p) in [("ours", &e.program), ("authors", &c.program)] {
        let (_, st) = zb::start_times(p, c.cost).unwrap();
        let dur = |k: schedc_ir::Kind| match k {
            schedc_ir::Kind::F => c.cost[0],
            schedc_ir::Kind::B => c.cost[1],
            schedc_ir::Kind::W => c.cost[2],
            schedc_ir::Kind::BW => c.cost[1] + c.cost[2],
        };
        for (r, ops) in p.ranks.iter().enumerate() {
            let mut t = 0.0;
            let mut gaps = Vec::new();
            for i in ops {
                if let schedc_ir::Instr::Compute(o) = i {
                    let s0 = st[&(o.kind, o.stage, o.mb)];
                    if s0 > t + 1e-9 {
                        gaps.push(format!("{:.2}+{:.2}", t, s0 - t));
                    }
                    t = s0 + dur(o.kind);
                }
            }
            println!("gaps {name} r{r}: {}", gaps.join(" "));
        }
        println!("{name}: makespan {:?}", zb::makespan(p, c.cost));
        println!("  ends {:?}", zb::finish_times(p, c.cost));
        let (_, st) = zb::start_times(p, c.cost).unwrap();
        for (r, ops) in p.ranks.iter().enumerate() {
            let s: Vec<String> = ops
                .iter()
                .map(|i| match i {
                    schedc_ir::Instr::Compute(o) => format!(
                        "{}@{:.2}",
                        schedc_ir::text::instr_to_string(i),
                        st[&(o.kind, o.stage, o.mb)]
                    ),
                    _ => String::new(),
                })
                .collect();
            println!("  {r:2}: {}", s.join(" "));
        }
    }
}

#[test]
fn chimera_vs_authors() {
    let (s, b, w) = compare("chimera", "chimera");
    println!("chimera: {s} identical, {b} no worse, {} worse", w.len());
    assert!(w.is_empty(), "{}", w.join("\n"));
}

#[test]
fn chimera_direct_is_the_authors_order() {
    let (s, b, w) = compare("chimera_direct", "chimera");
    println!(
        "chimera_direct: {s} identical, {b} no worse, {} worse",
        w.len()
    );
    assert_eq!((s, b, w.len()), (zb::configs("chimera").len(), 0, 0));
}

/// The reimplementation of the authors' V-Half / V-Min generator (`schedc_tests::zbv`)
/// gives exactly their per-rank orders on every `vhalf_*` and `vmin_*` file (72 files; the
/// makespans and peaks follow, and are checked too).
#[test]
fn authors_generator_reimplemented_on_all_72_files() {
    use schedc_tests::zbv::{program, Mode};
    let mut n = 0;
    for (gen, mode) in [("vhalf", Mode::Half), ("vmin", Mode::Min)] {
        for c in zb::configs(gen) {
            let ours = program(mode, c.pp, c.mb);
            assert_eq!(ours.ranks, c.program.ranks, "{}: orders", c.id);
            let t = zb::makespan(&ours, c.cost).unwrap();
            assert!((t - c.makespan).abs() < 1e-9, "{}: makespan", c.id);
            assert_eq!(zb::peaks(&ours), c.peaks, "{}: peaks", c.id);
            n += 1;
        }
    }
    if schedc_tests::shared_dir().is_some() {
        assert_eq!(n, 72);
    }
}

/// Issue 26 item 5: `spec` is no worse than the authors' generator (reimplemented,
/// `schedc_tests::zbv`) in makespan from t0 and in peak activations at every P in 2..=16 and
/// M in {P, P + 1, 2P, 3P, ..., 8P} (the full M range P..=8P takes 15 minutes in a debug
/// build; the example `family_sweep` covers it), under `profA` (F = 1, B = 1.1, W = 0.9, 0.05 per message) and `b1w5c1`
/// (F = B = 1, W = 0.5, 0.1 per message), the two cost sets where the greedy was worst
/// before (1,072 and 216 points worse over the whole grid). The example `family_sweep` runs
/// the same grid under all nine cost sets of `zbv::COSTS`.
fn families_hold_on_the_grid(spec: &str, mode: schedc_tests::zbv::Mode) {
    use schedc_tests::zbv::{sweep, COSTS};
    let text = std::fs::read_to_string(conform::root().join("specs").join(format!("{spec}.sched")))
        .unwrap();
    let costs: Vec<_> = COSTS
        .iter()
        .copied()
        .filter(|c| c.0 == "profA" || c.0 == "b1w5c1")
        .collect();
    let ms = |p: u32| {
        let mut v: Vec<u32> = (1..=8).map(|k| k * p).collect();
        v.insert(1, p + 1);
        v
    };
    let pts = sweep(&text, mode, 2..=16, &ms, &costs);
    assert_eq!(pts.len(), 2 * 15 * 9);
    let worse: Vec<String> = pts
        .iter()
        .filter(|x| x.makespan.0 > x.makespan.1 + 1e-9 || x.peak.0 > x.peak.1)
        .map(|x| {
            format!(
                "P{} M{} {}: makespan {:.3} vs {:.3}, peak {} vs {}",
                x.p, x.m, x.cost, x.makespan.0, x.makespan.1, x.peak.0, x.peak.1
            )
        })
        .collect();
    assert!(
        worse.is_empty(),
        "{spec}: {} worse\n{}",
        worse.len(),
        worse.join("\n")
    );
}

#[test]
fn v_half_no_worse_than_authors_generator_on_the_grid() {
    families_hold_on_the_grid("v_half", schedc_tests::zbv::Mode::Half);
}

#[test]
fn v_min_no_worse_than_authors_generator_on_the_grid() {
    families_hold_on_the_grid("v_min", schedc_tests::zbv::Mode::Min);
}
