//! Property tests: random valid schedules are accepted; every single mutation from the fault
//! kinds of `schedc_tests::Mutation` is rejected with the right error code.

use proptest::prelude::*;
use schedc::check::{check, Options, Verdict};
use schedc_tests::{mutate, random_pipeline, random_schedule, Mutation, Rng};

fn codes(p: &schedc_ir::Program) -> (Verdict, Vec<&'static str>) {
    let out = check(p, None, &Options::default());
    let v = out.report.verdict;
    let c = out
        .report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .map(|d| d.code.as_str())
        .collect();
    (v, c)
}

fn lowered(p: &schedc_ir::Program) -> schedc_ir::Program {
    schedc::passes::lower::lower(p).expect("valid schedules lower")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource("regressions"))), ..ProptestConfig::default() })]

    #[test]
    fn random_valid_schedules_are_accepted(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let pl = random_pipeline(&mut rng);
        let p = random_schedule(&mut rng, pl);
        let (v, c) = codes(&p);
        prop_assert_eq!(v, Verdict::Accepted, "compute-only rejected: {:?}\n{}", c, schedc_ir::text::print(&p));
        let l = lowered(&p);
        let (v, c) = codes(&l);
        prop_assert_eq!(v, Verdict::Accepted, "lowered rejected: {:?}\n{}", c, schedc_ir::text::print(&l));
    }

    #[test]
    fn every_mutant_is_rejected_with_its_code(seed in any::<u64>(), which in 0usize..7) {
        let mut rng = Rng::new(seed);
        let pl = random_pipeline(&mut rng);
        let p = random_schedule(&mut rng, pl);
        let mu = Mutation::ALL[which];
        let base = if mu.needs_comms() { lowered(&p) } else { p };
        if let Some(m) = mutate(&base, mu, &mut rng) {
            let (v, c) = codes(&m);
            prop_assert_eq!(v, Verdict::Rejected, "{:?} not detected\n{}", mu, schedc_ir::text::print(&m));
            prop_assert!(c.contains(&mu.expected_code()), "{:?}: expected {} got {:?}\n{}", mu, mu.expected_code(), c, schedc_ir::text::print(&m));
        }
    }
}

/// The detection rate over 10,500 mutants (1,500 per fault kind), printed for the record and
/// required to be 100%.
#[test]
fn detection_rate_over_ten_thousand_mutants() {
    let mut rng = Rng::new(0x5eed);
    let mut tried = [0u32; 7];
    let mut caught = [0u32; 7];
    let mut misses = Vec::new();
    while tried.iter().any(|&t| t < 1500) {
        let pl = random_pipeline(&mut rng);
        let p = random_schedule(&mut rng, pl);
        let l = lowered(&p);
        for (k, mu) in Mutation::ALL.iter().enumerate() {
            if tried[k] >= 1500 {
                continue;
            }
            let base = if mu.needs_comms() { &l } else { &p };
            let Some(m) = mutate(base, *mu, &mut rng) else {
                continue;
            };
            tried[k] += 1;
            let (v, c) = codes(&m);
            if v == Verdict::Rejected && c.contains(&mu.expected_code()) {
                caught[k] += 1;
            } else if misses.len() < 3 {
                misses.push(format!("{mu:?}: {c:?}\n{}", schedc_ir::text::print(&m)));
            }
        }
    }
    let total: u32 = tried.iter().sum();
    let hit: u32 = caught.iter().sum();
    for (k, mu) in Mutation::ALL.iter().enumerate() {
        println!("{mu:?}: {}/{} detected", caught[k], tried[k]);
    }
    println!(
        "detection rate: {hit}/{total} = {:.4}",
        hit as f64 / total as f64
    );
    assert!(total >= 10_000);
    assert_eq!(hit, total, "missed mutants:\n{}", misses.join("\n"));
}
