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
torch_conformance!(zbv_matches_torch, "zbv", "ScheduleZBVZeroBubble", false);

/// Every instance over P in `pps` and M in 1..=8P (or the spec's allowed values) passes
/// `schedc check` with the spec's expectations, the timing ones (makespan, bubble) under unit
/// times included; refused instances are counted.
fn sweep(spec: &str, pps: impl Iterator<Item = u32>, vpp: Option<u32>) -> (usize, usize) {
    sweep_with(spec, pps, vpp, &[])
}

/// [`sweep`] with `--param` values.
fn sweep_with(
    spec: &str,
    pps: impl Iterator<Item = u32>,
    vpp: Option<u32>,
    params: &[(&str, i64)],
) -> (usize, usize) {
    let unit = schedc::sim::cost::CostModel::resolve("unit").unwrap();
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
                params: params.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                ..Default::default()
            };
            match schedc::input::load_spec(&text, &ov) {
                Err(schedc::input::LoadError::Spec { refused: true, .. }) => refused += 1,
                Err(_) => failures.push(format!("P={pp} M={mb}: does not elaborate")),
                Ok(e) => {
                    let mut out = check(&e.program, Some(&e.spans), &Options::default());
                    check_expectations(&mut out.report, &e.expects);
                    // The timing expectations (makespan, bubble, exposed communication)
                    // under unit times, as `schedc check` evaluates them.
                    schedc::check::evaluate_timing_expectations(
                        &mut out.report,
                        out.checked.as_ref(),
                        &e.expects,
                        &unit,
                    );
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

/// Issue 27: BPipe (1F1B with lent stashes) passes `check` with its expectations (peak
/// activations per pair, 1F1B's idle) for P up to 16 and M up to 8P.
#[test]
fn bpipe_sweep() {
    let (ok, refused) = sweep("bpipe", 2..=16, None);
    assert_eq!(refused, 0, "bpipe accepts every P, M");
    assert!(ok > 1000);
}

torch_conformance!(
    interleaved_1f1b_matches_torch,
    "interleaved_1f1b",
    "ScheduleInterleaved1F1B",
    false
);
torch_conformance!(
    looped_bfs_matches_torch,
    "looped_bfs",
    "ScheduleLoopedBFS",
    false
);
torch_conformance!(
    interleaved_zb_matches_torch,
    "interleaved_zb",
    "ScheduleInterleavedZeroBubble",
    false
);

#[test]
fn dualpipe_matches_deepseek() {
    let (d, n) = conform::dualpipe("dualpipe", "dualpipe");
    assert_conformant(d, n, "dualpipe vs DeepSeek dualpipe.py");
}

#[test]
fn dualpipev_matches_deepseek() {
    let (d, n) = conform::dualpipe("dualpipev", "dualpipev");
    assert_conformant(d, n, "dualpipev vs DeepSeek dualpipev.py");
}

torch_conformance!(
    dualpipev_matches_torch,
    "dualpipev",
    "ScheduleDualPipeV",
    false
);

#[test]
fn dualpipe_sweep() {
    let (ok, refused) = sweep("dualpipe", (2..=16).step_by(2), None);
    // Accepted: the even M in 2P..=8P, 3P + 1 per P; refused: the other 5P - 1.
    assert_eq!((ok, refused), (224, 352));
}

#[test]
fn dualpipev_sweep() {
    let (ok, refused) = sweep("dualpipev", 2..=16, None);
    // Accepted: M in 2P..=8P, 6P + 1 per P; refused: M < 2P.
    assert_eq!((ok, refused), (825, 255));
}

#[test]
fn zbv_sweep() {
    let (ok, refused) = sweep("zbv", 2..=16, None);
    assert_eq!(refused, 0, "zbv accepts every M >= 1, as torch does");
    assert!(ok > 1000);
}

#[test]
fn zb_h1_sweep() {
    let (ok, refused) = sweep("zb_h1", 2..=16, None);
    assert_eq!(refused, 0, "zb_h1's order is legal for M < P too");
    assert!(ok > 1000);
}

#[test]
fn zb_h2_sweep() {
    let (ok, refused) = sweep("zb_h2", 2..=16, None);
    assert_eq!(refused, 0, "zb_h2's order is legal for M < 2P - 1 too");
    assert!(ok > 1000);
}

/// Instances of P in `pps`, M in 1..=8P that torch's rounds rule (Interleaved1F1B,
/// InterleavedZeroBubble) refuses: M is not a multiple of max(1, M / P).
fn torch_rounds_refusals(pps: impl Iterator<Item = u32>) -> usize {
    pps.map(|p| (1..=8 * p).filter(|m| m % (m / p).max(1) != 0).count())
        .sum()
}

#[test]
fn interleaved_1f1b_sweep() {
    // V = 3 (odd) on P <= 8 only: debug builds are slow.
    for (v, pmax) in [(2, 16), (4, 16), (3, 8)] {
        let (ok, refused) = sweep("interleaved_1f1b", 2..=pmax, Some(v));
        let want = torch_rounds_refusals(2..=pmax);
        assert_eq!(refused, want, "only the rounds rule refuses");
        assert!(ok > 100);
    }
}

#[test]
fn looped_bfs_sweep() {
    for (v, pmax) in [(2, 16), (4, 16), (3, 8)] {
        let (ok, refused) = sweep("looped_bfs", 2..=pmax, Some(v));
        assert_eq!(refused, 0, "looped_bfs accepts every M >= 1, as torch does");
        assert!(ok > 200);
    }
}

#[test]
fn interleaved_zb_sweep() {
    // V = 3 (odd) on P <= 8 only: debug builds are slow.
    for (v, pmax) in [(2, 16), (4, 16), (3, 8)] {
        let (ok, refused) = sweep("interleaved_zb", 2..=pmax, Some(v));
        let want = torch_rounds_refusals(2..=pmax);
        assert_eq!(refused, want, "only the rounds rule refuses");
        assert!(ok > 100);
    }
}

#[test]
fn v_half_sweep() {
    let (ok, refused) = sweep("v_half", 2..=16, None);
    assert_eq!((ok, refused), (1080, 0), "v_half accepts every M >= 1");
}

#[test]
fn v_min_sweep() {
    let (ok, refused) = sweep("v_min", 2..=16, None);
    assert_eq!((ok, refused), (1080, 0), "v_min accepts every M >= 1");
}

#[test]
fn chimera_sweep() {
    let (ok, refused) = sweep("chimera", (2..=16).step_by(2), None);
    // Accepted: the even M in 1..=8P, 4P per P; refused: the odd ones.
    assert_eq!((ok, refused), (288, 288));
}

#[test]
fn chimera_direct_sweep() {
    let (ok, refused) = sweep("chimera_direct", (2..=16).step_by(2), None);
    // Accepted: M in {P, 2P, ..., 8P}, 8 per P.
    assert_eq!((ok, refused), (64, 512));
}

#[test]
fn hanayo_sweep() {
    // Waves W = 2 and 3 (V = 4 and 6); W = 3 on P <= 8 only: debug builds are slow.
    for (w, pmax) in [(2, 16), (3, 8)] {
        let (ok, refused) = sweep_with("hanayo", 2..=pmax, None, &[("waves", w)]);
        assert_eq!(refused, 0, "hanayo accepts every M >= 1");
        assert!(ok > 200);
    }
}

/// Elaborates `specs/<spec>.sched` with `--param`s, list-scheduling under `cost`.
fn instance(
    spec: &str,
    pp: u32,
    mb: u32,
    vpp: Option<u32>,
    params: &[(&str, i64)],
    cost: &schedc::sim::cost::CostModel,
) -> schedc::dsl::Elaborated {
    let path = conform::root().join("specs").join(format!("{spec}.sched"));
    let text = std::fs::read_to_string(&path).unwrap();
    let ov = schedc::input::Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        vpp,
        params: params.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        ..Default::default()
    };
    match schedc::input::load_spec_with(&text, &ov, cost) {
        Ok(e) => e,
        Err(e) => panic!("{spec} P={pp} M={mb}: {e:?}"),
    }
}

/// Unit-time idle of every rank (F = B = W = 1, BW = 2), as `schedc check` reports it.
fn unit_idle(p: &schedc_ir::Program) -> Vec<f64> {
    let out = check(p, None, &Options::default());
    assert_eq!(
        out.report.verdict,
        Verdict::Accepted,
        "{:?}",
        out.report.diagnostics
    );
    out.report
        .ranks
        .iter()
        .map(|r| r.idle.expect("unit-time idle"))
        .collect()
}

/// Chimera's claim (Li and Hoefler, SC 2021, §3.2): with forward and backward of equal cost,
/// one unit of D = P micro-batches leaves D - 2 idle slots on every worker. Measured from
/// time 0 with F = BW = 1 on both Chimera specs, scheduled under the same costs.
#[test]
fn chimera_idles_d_minus_2_at_f_equal_bw() {
    let f_eq_bw =
        schedc::sim::cost::CostModel::from_toml("[compute]\nF = 1.0\nB = 0.5\nW = 0.5\n").unwrap();
    for pp in (2..=16).step_by(2) {
        for spec in ["chimera", "chimera_direct"] {
            let e = instance(spec, pp, pp, None, &[], &f_eq_bw);
            let t = schedc::passes::makespan::schedule_with(&e.program, &|_| 1.0, &|_, _| 2.0)
                .expect("runs");
            let idle: Vec<f64> = t.busy.iter().map(|b| t.makespan - b).collect();
            assert!(
                idle.iter().all(|&i| i == (pp - 2) as f64),
                "{spec} P={pp}: idle {idle:?}, want D - 2 = {}",
                pp - 2
            );
        }
    }
}

/// Hanayo's bubble (Liu et al., SC 2023) in unit time (F = 1, BW = 2 per chunk), against
/// interleaved 1F1B at the same V = 2W and against the ratio (P - 1)/(2WM + P - 1) that the
/// paper's construction gives, in the convention idle / (busy + idle) (the Zero Bubble
/// README's): 3(P - 1) idle per rank.
#[test]
fn hanayo_bubble_vs_interleaved_1f1b_and_formula() {
    let unit = schedc::sim::cost::CostModel::default();
    for pp in 4..=16u32 {
        for mb in [2 * pp, 3 * pp, 4 * pp, 8 * pp] {
            let w = 2i64;
            let h = instance("hanayo", pp, mb, None, &[("waves", w)], &unit);
            let i = instance("interleaved_1f1b", pp, mb, Some(2 * w as u32), &[], &unit);
            let (hi, ii) = (unit_idle(&h.program), unit_idle(&i.program));
            let want = 3.0 * (pp - 1) as f64;
            assert!(
                ii.iter().all(|&x| x == want),
                "interleaved P={pp} M={mb}: {ii:?}"
            );
            if pp % 2 == 1 {
                // Odd P: one or two slots more (the V's turn falls mid-rank differently).
                let slack = if mb == 2 * pp { 2.0 } else { 1.0 };
                assert!(
                    hi.iter().all(|&x| x > want && x <= want + slack),
                    "hanayo P={pp} M={mb}: {hi:?}"
                );
                continue;
            }
            assert!(
                hi.iter().all(|&x| x == want),
                "hanayo P={pp} M={mb}: {hi:?}"
            );
            // Busy per rank: M micro-batches x 2W chunks x (F + BW) = 6WM.
            let busy = 6.0 * w as f64 * mb as f64;
            let ratio = hi[0] / (busy + hi[0]);
            let paper = (pp - 1) as f64 / (2.0 * w as f64 * mb as f64 + (pp - 1) as f64);
            assert!(
                (ratio - paper).abs() < 1e-12,
                "P={pp} M={mb}: {ratio} vs {paper}"
            );
        }
        // M = P: one round; Hanayo idles 4(P - 1) (even P), interleaved 1F1B 3(P - 1).
        if pp % 2 == 0 {
            let h = instance("hanayo", pp, pp, None, &[("waves", 2)], &unit);
            let hi = unit_idle(&h.program);
            assert!(
                hi.iter().all(|&x| x == 4.0 * (pp - 1) as f64),
                "M=P={pp}: {hi:?}"
            );
        }
    }
    // One and three waves: within 2 of 3(P - 1) per rank once M >= 4P.
    for w in [1i64, 3] {
        for pp in (4..=8u32).step_by(2) {
            for mb in [4 * pp, 8 * pp] {
                let h = instance("hanayo", pp, mb, None, &[("waves", w)], &unit);
                let hi = unit_idle(&h.program);
                let want = 3.0 * (pp - 1) as f64;
                assert!(
                    hi.iter().all(|&x| x >= want && x <= want + 2.0),
                    "hanayo W={w} P={pp} M={mb}: {hi:?}"
                );
            }
        }
    }
}

/// A spec, a line start to replace, its replacement, and the `--param`s.
type Mutation = (
    &'static str,
    &'static str,
    &'static str,
    &'static [(&'static str, i64)],
);

/// Issue 15, bug 11: a legal but worse schedule fails its spec. Each new spec, with one
/// priority made worse (or, for `chimera`, run `strict`ly, which is the authors' direct
/// concatenation), is still a legal schedule, but its unit-time makespan or idle
/// expectation rejects it; the spec as written passes the same instance.
#[test]
fn worse_priorities_fail_their_spec() {
    use schedc::sim::cost::CostModel;
    let unit = CostModel::resolve("unit").unwrap();
    let errors = |text: &str, pp: u32, mb: u32, params: &[(&str, i64)]| -> Vec<String> {
        let ov = schedc::input::Overrides {
            pp: Some(pp),
            microbatches: Some(mb),
            params: params.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            ..Default::default()
        };
        let e = schedc::input::load_spec(text, &ov).expect("the mutated spec elaborates");
        let mut out = check(&e.program, Some(&e.spans), &Options::default());
        check_expectations(&mut out.report, &e.expects);
        schedc::check::evaluate_timing_expectations(
            &mut out.report,
            out.checked.as_ref(),
            &e.expects,
            &unit,
        );
        out.report
            .diagnostics
            .iter()
            .filter(|d| d.is_error())
            .map(|d| format!("{}: {}", d.code.as_str(), d.message))
            .collect()
    };
    let cases: [Mutation; 5] = [
        ("v_half", "    F(c, m) = 6 * m", "    F(c, m) = 12 * m", &[]),
        ("v_min", "    F(c, m) = 6 * m", "    F(c, m) = 12 * m", &[]),
        ("hanayo", "    F(c, m) = 4 * m", "    F(c, m) = 8 * m", &[]),
        ("chimera", "    memory <=", "    strict\n    memory <=", &[]),
        (
            "chimera_direct",
            "    BW(c, m) = base(m)",
            "    BW(c, m) = 3 * base(m)",
            &[],
        ),
    ];
    for (spec, from, to, params) in cases {
        let path = conform::root().join("specs").join(format!("{spec}.sched"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{spec}: the mutation point moved");
        let worse = text.replacen(from, to, 1);
        let (pp, mb) = (8, 32);
        let good = errors(&text, pp, mb, params);
        assert!(good.is_empty(), "{spec} {params:?}: {good:?}");
        let bad = errors(&worse, pp, mb, params);
        println!("{spec} {params:?} with `{}`: {bad:?}", to.trim());
        assert!(
            !bad.is_empty(),
            "{spec} {params:?}: the worse schedule passes"
        );
        assert!(
            bad.iter().all(|m| m.starts_with("expectation")),
            "{spec}: rejected for something other than an expectation: {bad:?}"
        );
    }
}

/// Megatron-Core's interleaved schedule with `--overlap-moe-expert-parallel-comm`, rank `r`,
/// written from NVIDIA/Megatron-LM @d98e8a64 `schedules.py`: `get_schedule_table` (groups of
/// `microbatch_group_size_per_vp_stage`, default P, micro-batches per chunk),
/// `get_pp_rank_microbatches` (warmup `2(P - 1 - r) + (V - 1)N`, plus one with the overlap,
/// at most `MV`) and `forward_backward_pipelining_with_interleaving` (warmup forwards, then
/// forward `k + warmup` combined with backward `k`, then the backwards left). The backward of
/// virtual micro-batch `k` runs chunk `V - 1 - chunk(k)`.
fn megatron_combined_1f1b(pp: u32, vpp: u32, mb: u32, r: u32) -> Vec<schedc_ir::Instr> {
    use schedc_ir::{Compute, Instr, Kind};
    let group = pp;
    let mut table = Vec::new();
    for first in (0..mb).step_by(group as usize) {
        let end = if first + group >= mb {
            mb
        } else {
            first + group
        };
        for c in 0..vpp {
            for m in first..end {
                table.push((m, c));
            }
        }
    }
    let total = mb * vpp;
    let warmup = (2 * (pp - 1 - r) + (vpp - 1) * group + 1).min(total);
    let f = |k: u32| Compute::new(Kind::F, table[k as usize].1 * pp + r, table[k as usize].0);
    let b = |k: u32| {
        let (m, c) = table[k as usize];
        Compute::new(Kind::BW, (vpp - 1 - c) * pp + r, m)
    };
    let mut out: Vec<Instr> = (0..warmup).map(|k| Instr::Compute(f(k))).collect();
    for k in 0..total - warmup {
        out.push(Instr::Overlap {
            fwd: f(k + warmup),
            bwd: b(k),
        });
    }
    out.extend((total - warmup..total).map(|k| Instr::Compute(b(k))));
    out
}

/// issue 22 item 7: `interleaved_1f1b_a2a` is Megatron-Core's combined 1F1B op for op (each
/// rank's forwards, overlapped F&B pairs and backwards, with their stages and micro-batches).
#[test]
fn interleaved_1f1b_a2a_is_megatron_combined_1f1b_op_for_op() {
    let text =
        std::fs::read_to_string(conform::root().join("specs/interleaved_1f1b_a2a.sched")).unwrap();
    let mut n = 0;
    for pp in 2..=8u32 {
        for vpp in 2..=4u32 {
            for mb in [pp, 2 * pp, 3 * pp, 4 * pp] {
                let ov = schedc::input::Overrides {
                    pp: Some(pp),
                    microbatches: Some(mb),
                    vpp: Some(vpp),
                    ..Default::default()
                };
                let e = schedc::input::load_spec(&text, &ov).unwrap();
                for r in 0..pp {
                    assert_eq!(
                        e.program.ranks[r as usize],
                        megatron_combined_1f1b(pp, vpp, mb, r),
                        "P={pp} V={vpp} M={mb} rank {r}"
                    );
                }
                n += 1;
            }
        }
    }
    assert_eq!(n, 7 * 3 * 4);
    // P = 1 (Megatron's `combined_1f1b_schedule_for_no_pipelining`: the first forward alone,
    // then backward i with forward i + 1, the last backward alone).
    for mb in 1..=4u32 {
        let ov = schedc::input::Overrides {
            pp: Some(1),
            microbatches: Some(mb),
            vpp: Some(1),
            ..Default::default()
        };
        let e = schedc::input::load_spec(&text, &ov).unwrap();
        assert_eq!(e.program.ranks[0], megatron_combined_1f1b(1, 1, mb, 0));
        assert_eq!(e.program.ranks[0].len() as u32, mb + 1, "M={mb}");
    }
}

/// issue 22 item 7: every instance P in 2..=8, M in 1..=8P, V in 2..=4 that Megatron accepts
/// (P | M) passes `schedc check` with the spec's expectations; V = 1 with P > 1 is refused
/// (Megatron asserts virtual pipelining for the overlap with PP > 1).
#[test]
fn interleaved_1f1b_a2a_sweep() {
    for v in 2..=4 {
        let (ok, refused) = sweep("interleaved_1f1b_a2a", 2..=8, Some(v));
        // M in 1..=8P: the 8 multiples of P are accepted.
        assert_eq!(ok, 7 * 8, "V={v}");
        assert_eq!(refused, (2..=8).map(|p| 8 * p - 8).sum::<u32>() as usize);
    }
    let (ok, refused) = sweep("interleaved_1f1b_a2a", 2..=4, Some(1));
    assert_eq!(
        (ok, refused),
        (0, (2..=4).map(|p| 8 * p).sum::<u32>() as usize)
    );
}
