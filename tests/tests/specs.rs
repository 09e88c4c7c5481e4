//! The standard library of schedules in specs/: conformance with PyTorch 2.15 and DeepSeek's
//! DualPipe reference, and `schedc check` with each spec's expectations over a sweep.

use schedc::check::{check, check_expectations, Options, Verdict};
use schedc_tests::conform;

fn assert_conformant(diffs: Vec<String>, n: usize, what: &str) {
    println!("{what}: {n} configs compared, {} differences", diffs.len());
    assert!(
        diffs.is_empty(),
        "{what}: {} differences:\n{}",
        diffs.len(),
        diffs
            .iter()
            .take(15)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

macro_rules! torch_conformance {
    ($test:ident, $spec:literal, $class:literal, $shift:literal) => {
        #[test]
        fn $test() {
            let (d, n) = conform::torch($spec, $class, $shift);
            assert_conformant(d, n, concat!($spec, " vs torch ", $class));
        }
    };
}

torch_conformance!(gpipe_matches_torch, "gpipe", "ScheduleGPipe", false);
torch_conformance!(one_f_one_b_matches_torch, "1f1b", "Schedule1F1B", true);

/// Every instance over P in `pps` and M in 1..=8P (or the spec's allowed values) passes
/// `schedc check` with the spec's expectations; refused instances are counted.
fn sweep(spec: &str, pps: impl Iterator<Item = u32>, vpp: Option<u32>) -> (usize, usize) {
    let (mut ok, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for pp in pps {
        for mb in 1..=8 * pp {
            let path = conform::root().join("specs").join(format!("{spec}.sched"));
            let text = std::fs::read_to_string(&path).unwrap();
            let ov = schedc::input::Overrides {
                pp: Some(pp),
                microbatches: Some(mb),
                vpp,
                ..Default::default()
            };
            match schedc::input::load_spec(&text, &ov) {
                Err(schedc::input::LoadError::Spec { refused: true, .. }) => refused += 1,
                Err(_) => failures.push(format!("P={pp} M={mb}: does not elaborate")),
                Ok(e) => {
                    let mut out = check(&e.program, Some(&e.spans), &Options::default());
                    check_expectations(&mut out.report, &e.expects);
                    if out.report.verdict == Verdict::Accepted {
                        ok += 1;
                    } else {
                        let d = out
                            .report
                            .diagnostics
                            .iter()
                            .find(|d| d.is_error())
                            .unwrap();
                        failures.push(format!(
                            "P={pp} M={mb}: [{}] {}",
                            d.code.as_str(),
                            d.message
                        ));
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{spec}: {} failing instances:\n{}",
        failures.len(),
        failures
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    println!(
        "{spec}: {ok} instances accepted with their expectations, {refused} refused by `require`"
    );
    (ok, refused)
}

#[test]
fn gpipe_sweep() {
    sweep("gpipe", 2..=16, None);
}

#[test]
fn one_f_one_b_sweep() {
    let (ok, refused) = sweep("1f1b", 2..=16, None);
    assert_eq!(refused, 0, "1f1b accepts M < P");
    assert!(ok > 1000);
}
