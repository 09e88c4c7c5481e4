//! The simulator reproduces the published bubble formulas exactly, in the cost regimes where
//! they are exact (see the book's chapter "The simulator").

use schedc::check::{check, Verdict};
use schedc::input::{load_spec, Overrides};
use schedc::sim::cost::CostModel;
use schedc::sim::{simulate, SimResult};

fn run(spec: &str, pp: u32, mb: u32, cost: &str) -> SimResult {
    run_with_program(spec, pp, mb, cost).0
}

fn run_with_program(spec: &str, pp: u32, mb: u32, cost: &str) -> (SimResult, schedc_ir::Program) {
    let path = schedc_tests::conform::root()
        .join("specs")
        .join(format!("{spec}.sched"));
    let text = std::fs::read_to_string(path).unwrap();
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        ..Default::default()
    };
    let e = load_spec(&text, &ov).unwrap_or_else(|_| panic!("{spec} P={pp} M={mb}"));
    let out = check(&e.program, None, &Default::default());
    assert_eq!(out.report.verdict, Verdict::Accepted);
    let model = CostModel::resolve(cost).unwrap();
    let prog = out.checked.unwrap();
    (simulate(&prog, &model).unwrap(), prog)
}

fn assert_idle(r: &SimResult, want: f64, what: &str) {
    for x in &r.ranks {
        assert!(
            (x.idle - want).abs() < 1e-9,
            "{what}: rank {} idle {} != {want}",
            x.rank,
            x.idle
        );
        assert!(
            x.exposed_comm.abs() < 1e-12,
            "{what}: free communication is never exposed"
        );
    }
}

/// DualPipe README: bubble (PP/2 - 1)(F&B + B - 3W), B the full backward, here F = B = W = 1
/// (full backward 2) and F&B = 3: idle per rank P - 2 for DualPipe on P ranks.
#[test]
fn dualpipe_matches_the_readme_formula() {
    for pp in [4u32, 8, 16] {
        for mb in [2 * pp, 3 * pp, 4 * pp + 2] {
            let r = run("dualpipe", pp, mb, "dualpipe-readme");
            let (f, b_full, w, fb) = (1.0, 2.0, 1.0, 3.0);
            let want = (pp as f64 / 2.0 - 1.0) * (fb + b_full - 3.0 * w);
            assert_idle(&r, want, &format!("DualPipe P={pp} M={mb}"));
            let _ = f;
        }
    }
}

/// DualPipeV: the same formula with PP = 2P stages on P ranks.
#[test]
fn dualpipev_matches_the_readme_formula() {
    for stages in [4u32, 8, 16] {
        let pp = stages / 2;
        for mb in [stages, 2 * stages + 1] {
            let r = run("dualpipev", pp, mb, "dualpipe-readme");
            let want = (stages as f64 / 2.0 - 1.0) * (3.0 + 2.0 - 3.0);
            assert_idle(&r, want, &format!("DualPipeV PP={stages} M={mb}"));
        }
    }
}

/// 1F1B: idle (P - 1)(F + B + W) for any F, B, W (B the input-gradient backward; the fused
/// backward BW = B + W).
#[test]
fn one_f_one_b_idle() {
    for (f, b, w) in [(1.0, 1.0, 1.0), (1.0, 2.0, 1.5), (2.0, 1.0, 0.5)] {
        for pp in [2u32, 4, 8] {
            let r = run("1f1b", pp, 3 * pp, &format!("F={f},B={b},W={w}"));
            assert_idle(
                &r,
                (pp - 1) as f64 * (f + b + w),
                &format!("1F1B P={pp} F={f} B={b} W={w}"),
            );
        }
    }
}

/// ZB-H1 (Zero Bubble, arXiv 2401.10241 §3.1): idle (P - 1)(F + B - W), exact when
/// W <= min(F, B) (the deferred W then fits the wait it fills).
#[test]
fn zb_h1_idle() {
    for (f, b, w) in [
        (1.0, 1.0, 1.0),
        (1.0, 1.5, 0.5),
        (1.5, 1.0, 1.0),
        (1.0, 2.0, 0.9),
        (2.0, 1.0, 0.5),
    ] {
        for pp in [2u32, 4, 8] {
            let r = run("zb_h1", pp, 3 * pp, &format!("F={f},B={b},W={w}"));
            assert_idle(
                &r,
                (pp - 1) as f64 * (f + b - w),
                &format!("ZB-H1 P={pp} F={f} B={b} W={w}"),
            );
        }
    }
}

/// GPipe and 1F1B: bubble fraction (P - 1)/(M + P - 1) with equal costs (GPipe, Huang et al.
/// 2019, §2.3), in the idle / (busy + idle) convention; idle / busy is (P - 1)/M.
#[test]
fn gpipe_and_1f1b_bubble_fraction() {
    for spec in ["gpipe", "1f1b"] {
        for pp in [2u32, 4, 8] {
            for mb in [pp, 4 * pp, 4 * pp + 3] {
                let r = run(spec, pp, mb, "unit");
                let want = (pp - 1) as f64 / (mb + pp - 1) as f64;
                assert!(
                    (r.bubble_ratio - want).abs() < 1e-12,
                    "{spec} P={pp} M={mb}"
                );
                assert!((r.bubble_ratio_busy - (pp - 1) as f64 / mb as f64).abs() < 1e-12);
            }
        }
    }
}

/// Communication costs: the critical path crosses P - 1 links forward and P - 1 back, so a
/// latency c per message adds at least 2(P - 1)c; on one in-order communication stream per
/// rank (the checker's model) a rank's sends and receives also queue behind each other, which
/// adds more, and the compute streams see it as exposed communication.
#[test]
fn latency_on_the_critical_path() {
    for spec in ["gpipe", "1f1b"] {
        for pp in [2u32, 4, 8] {
            let free = run(spec, pp, 8, "unit");
            let slow = run(spec, pp, 8, "F=1,B=1,W=1,latency=0.25");
            let floor = free.makespan + 2.0 * (pp - 1) as f64 * 0.25;
            assert!(
                slow.makespan >= floor - 1e-9,
                "{spec} P={pp}: {} < {floor}",
                slow.makespan
            );
            assert!(slow.ranks.iter().any(|r| r.exposed_comm > 0.0));
            // Bandwidth: the same through message size.
            let bw = run(spec, pp, 8, "F=1,B=1,W=1,bytes=1000,bandwidth=4000");
            assert!((bw.makespan - slow.makespan).abs() < 1e-9);
        }
    }
    // With P = 2 there is one link and nothing else on it: exactly 2c more.
    let free = run("gpipe", 2, 8, "unit");
    let slow = run("gpipe", 2, 8, "F=1,B=1,W=1,latency=0.25");
    assert!((slow.makespan - free.makespan - 0.5).abs() < 1e-9);
}

/// Memory: activation bytes follow the liveness pass; DualPipe holds two stages per rank.
#[test]
fn memory_accounting() {
    let r = run(
        "1f1b",
        4,
        8,
        "F=1,B=1,W=1,activation_bytes=100,param_bytes=1000",
    );
    // Rank 0 holds 4 activations at its peak and one stage's parameters.
    assert_eq!(r.ranks[0].peak_memory_bytes, 1000.0 + 4.0 * 100.0);
    assert_eq!(r.ranks[3].peak_memory_bytes, 1000.0 + 100.0);
    let d = run(
        "dualpipe",
        4,
        8,
        "F=1,B=1,W=1,activation_bytes=100,param_bytes=1000",
    );
    assert_eq!(d.ranks[0].peak_memory_bytes, 2.0 * 1000.0 + 5.0 * 100.0);
}

/// The pictures: Chrome trace (one process per rank, compute and communication threads,
/// flow arrows from each send to its receive), the SVG Gantt chart, the ASCII timeline.
#[test]
fn pictures() {
    let (r, prog) = run_with_program("dualpipe", 4, 8, "dualpipe-readme");
    let trace: serde_json::Value =
        serde_json::from_str(&schedc::sim::render::chrome_trace(&r, &prog)).unwrap();
    let ev = trace["traceEvents"].as_array().unwrap();
    let x = ev.iter().filter(|e| e["ph"] == "X").count();
    assert_eq!(x, r.events.len());
    let starts = ev.iter().filter(|e| e["ph"] == "s").count();
    let ends = ev.iter().filter(|e| e["ph"] == "f").count();
    assert_eq!(starts, ends);
    assert_eq!(starts, r.flows.len());
    assert!(starts > 0);
    let names: Vec<&str> = ev
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["rank 0", "rank 1", "rank 2", "rank 3"]);
    let svg = schedc::sim::render::svg(&r, &prog, "DualPipe, P=4, M=8");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(!svg.contains("F&B "), "text must be escaped");
    // Background, one lane per rank, one box per event that takes time (free messages take
    // none), one swatch per kind in the legend.
    let drawn = r.events.iter().filter(|e| e.end > e.start).count();
    let kinds: std::collections::HashSet<_> = r
        .events
        .iter()
        .filter(|e| e.end > e.start)
        .map(|e| e.kind)
        .collect();
    assert_eq!(svg.matches("<rect").count(), 1 + 4 + drawn + kinds.len());
    insta::assert_snapshot!(schedc::sim::render::text_report(&r, 78));
}

/// schedc's lowering lists each rank's messages in the order their data becomes ready, so
/// with free communication nothing is exposed and the makespan is the unit-time one; PyTorch's
/// own lowering (its compute_comms CSVs) posts receives early on one stream and does expose
/// some (pytorch/pytorch#165664, #188833).
#[test]
fn lowering_exposes_no_communication_when_it_is_free() {
    let Some(shared) = schedc_tests::shared_dir() else {
        return;
    };
    let dir = shared.join("reference/torch");
    let cost = CostModel::resolve("unit").unwrap();
    let mut torch_exposed = 0.0;
    for name in [
        "ScheduleInterleaved1F1B_P4_M8_V2",
        "ScheduleInterleaved1F1B_P8_M16_V2",
        "ScheduleInterleavedZeroBubble_P4_M8_V2",
        "ScheduleZBVZeroBubble_P4_M8_V2",
        "ScheduleDualPipeV_P4_M8_V2",
    ] {
        for form in ["compute", "comms"] {
            let path = dir.join(format!("{name}.{form}.csv"));
            let l = schedc::input::load_path(path.to_str().unwrap(), &Default::default()).unwrap();
            let out = check(&l.program, None, &Default::default());
            assert_eq!(out.report.verdict, Verdict::Accepted, "{name} {form}");
            let r = simulate(out.checked.as_ref().unwrap(), &cost).unwrap();
            let exposed: f64 = r.ranks.iter().map(|x| x.exposed_comm).sum();
            if form == "compute" {
                assert_eq!(Some(r.makespan), out.report.makespan, "{name}");
                assert_eq!(exposed, 0.0, "{name}");
            } else {
                assert!(r.makespan >= out.report.makespan.unwrap());
                torch_exposed += exposed;
            }
        }
    }
    assert!(torch_exposed > 0.0);
}

/// Issue 11, items 26 and 33: the report and the SVG carry units, a V schedule's second
/// chunk is shaded, and a trace without MoE declares no all-to-all thread.
#[test]
fn pictures_carry_units_and_chunks() {
    let (r, prog) = run_with_program("zbv", 4, 8, "unit");
    let svg = schedc::sim::render::svg(&r, &prog, "ZB-V");
    assert!(svg.contains(">time (s)</text>"), "no axis label");
    assert!(
        svg.contains(&format!("makespan {:.4} s", r.makespan)),
        "no unit in the title"
    );
    assert!(svg.contains("second and later chunks"), "no chunk legend");
    // Chunk 0's forwards in the base colour, chunk 1's in the darker shade.
    assert!(svg.contains("fill=\"#4e79a7\"") && svg.contains("fill=\"#2c4a6e\""));
    // 1F1B has one chunk per rank: no shading, no legend line for it.
    let (r1, p1) = run_with_program("1f1b", 4, 8, "unit");
    let svg1 = schedc::sim::render::svg(&r1, &p1, "1F1B");
    assert!(!svg1.contains("second and later chunks") && !svg1.contains("#2c4a6e"));
    let trace = schedc::sim::render::chrome_trace(&r1, &p1);
    assert!(!trace.contains("ep all-to-all"), "empty EP thread declared");
    // Memory in GB when the cost model has figures, `-` when it has none.
    let m = run("1f1b", 4, 8, "activation_bytes=2e9,param_bytes=1e9");
    let text = schedc::sim::render::text_report(&m, 40);
    assert!(
        text.contains("peak_memory (GB)") && text.contains("9.00"),
        "{text}"
    );
    assert!(!text.contains("no [memory] figures"), "{text}");
    let text = schedc::sim::render::text_report(&r1, 40);
    assert!(text.contains("makespan 33.000000 s") && text.contains("no [memory] figures"));
}
