//! The Chrome trace of a run with MoE parts (issue 10, item 6): DualPipe's overlapped F&B
//! pairs run their expert-parallel all-to-alls on the `ep` stream under the other chunk's
//! compute; 1F1B, whose ops are plain, never does.

use schedc_cpu::exec::{chrome_trace, execute, Data, ExecOptions, Optimizer, Span};
use schedc_cpu::model::ModelConfig;
use schedc_program::mesh::Mesh;
use schedc_program::{LowerOptions, ProgramSet, StreamKind};

fn traced(name: &str, pp: u32, mb: u32, mesh: &str) -> (ProgramSet, Vec<Span>) {
    let path = format!("{}/../../specs/{name}.sched", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let ov = schedc::input::Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        moe: Some(schedc::moe::MoeStages::All),
        ..Default::default()
    };
    let e = schedc::input::load_spec(&text, &ov).unwrap();
    let (src, _) =
        schedc::input::apply_moe(&e.program, None, &schedc::moe::MoeStages::All).unwrap();
    let mesh: Mesh = mesh.parse().unwrap();
    let set =
        ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default()).unwrap();
    let opts = ExecOptions {
        steps: 1,
        optimizer: Optimizer::Sgd { lr: 0.1 },
        trace: true,
        ..ExecOptions::default()
    };
    let run = execute::<f64>(&set, &Data::builtin(), &opts).unwrap();
    (set, run.trace)
}

/// Every (EP all-to-all, compute kernel of another chunk) pair on one rank whose spans
/// share time.
fn hidden(spans: &[Span]) -> Vec<(&Span, &Span)> {
    let mut out = Vec::new();
    for a in spans
        .iter()
        .filter(|s| s.stream_name == "ep" && s.cat == "all_to_all")
    {
        for k in spans.iter().filter(|s| {
            s.rank == a.rank && s.stream == 0 && s.cat == "kernel" && s.chunk != a.chunk
        }) {
            if a.overlaps(k) {
                out.push((a, k));
            }
        }
    }
    out
}

#[test]
fn dualpipe_runs_an_all_to_all_under_the_other_chunks_compute() {
    let (set, spans) = traced("dualpipe", 2, 8, "pp=2,ep=2");
    // Every rank has an EP stream, last, holding only all-to-alls and events.
    for rp in &set.ranks {
        let ep = rp.streams.last().unwrap();
        assert_eq!(ep.kind, StreamKind::Ep);
        assert!(ep.ops.iter().all(|o| matches!(
            o,
            schedc_program::Op::AllToAll { .. }
                | schedc_program::Op::Wait { .. }
                | schedc_program::Op::Record { .. }
        )));
    }
    let ep: Vec<&Span> = spans.iter().filter(|s| s.stream_name == "ep").collect();
    // Two EP all-to-alls per split op (a forward's dispatch and combine, a backward's
    // combine_grad and dispatch_grad), one layer per stage (one `experts` kernel per op):
    // the trace has every one of them.
    let split_ops: usize = set
        .ranks
        .iter()
        .map(|r| {
            r.streams[0]
                .ops
                .iter()
                .filter(|o| {
                    matches!(o, schedc_program::Op::Kernel(k)
                        if matches!(k.part, schedc_program::Part::Experts { .. }))
                })
                .count()
        })
        .sum();
    assert_eq!(ep.len(), 2 * split_ops);
    let h = hidden(&spans);
    assert!(
        !h.is_empty(),
        "no all-to-all ran under another chunk's compute"
    );
    let (a, k) = h[0];
    let mut under: Vec<(u32, f64)> = h.iter().map(|(a, _)| (a.rank, a.start_us)).collect();
    under.dedup();
    println!(
        "dualpipe P=2 M=8 pp=2,ep=2: {} of {} EP all-to-alls ran under another chunk's compute; e.g. rank {}: `{}` ({}) {:.1}..{:.1} us under `{}` ({}) {:.1}..{:.1} us",
        under.len(),
        ep.len(),
        a.rank,
        a.name,
        a.chunk.as_deref().unwrap_or(""),
        a.start_us,
        a.start_us + a.dur_us,
        k.name,
        k.chunk.as_deref().unwrap_or(""),
        k.start_us,
        k.start_us + k.dur_us,
    );
    // On every rank: the pairs of the steady state hide some of their all-to-alls.
    for g in 0..set.ranks.len() as u32 {
        assert!(h.iter().any(|(a, _)| a.rank == g), "rank {g}");
    }
    // The Chrome trace names the ranks and streams and holds the spans.
    let json: serde_json::Value = serde_json::from_str(&chrome_trace(&spans)).unwrap();
    let ev = json["traceEvents"].as_array().unwrap();
    assert!(ev
        .iter()
        .any(|e| e["ph"] == "M" && e["args"]["name"] == "ep"));
    let x: Vec<_> = ev.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(x.len(), spans.len());
    assert!(x
        .iter()
        .any(|e| e["cat"] == "all_to_all" && e["args"]["chunk"] == a.chunk.clone().unwrap()));
}

#[test]
fn one_f_one_b_hides_no_all_to_all() {
    // Plain ops: each all-to-all is waited for by the next part of its own op.
    let (_, spans) = traced("1f1b", 2, 8, "pp=2,ep=2");
    let n = spans.iter().filter(|s| s.stream_name == "ep").count();
    assert!(n > 0);
    let h = hidden(&spans);
    println!(
        "1f1b P=2 M=8 pp=2,ep=2: {} of {n} EP all-to-alls ran under another chunk's compute",
        h.len()
    );
    assert!(h.is_empty(), "{:?}", h.first());
}
