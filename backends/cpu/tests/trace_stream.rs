//! A traced run streams its spans (breakit 2026-12-04, finding 7): with a sink, each rank's
//! spans of a step reach it as the step ends, nothing is kept in the result, the events
//! written are those of `chrome_trace`, and the memory estimate counts about a step of
//! spans instead of every step's.

use schedc_cpu::exec::{
    chrome_trace, execute, ChromeTraceWriter, Data, ExecOptions, Optimizer, Span, SpanSink,
};
use schedc_cpu::model::ModelConfig;
use schedc_cpu::run::{
    estimate_memory_of, RunConfig, TRACE_BYTES_PER_INSTRUCTION, TRACE_BYTES_PER_STEP_INSTRUCTION,
};
use schedc_program::mesh::Mesh;
use schedc_program::{LowerOptions, ProgramSet};
use std::sync::{Arc, Mutex};

fn set() -> ProgramSet {
    let path = format!("{}/../../specs/1f1b.sched", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let ov = schedc::input::Overrides {
        pp: Some(2),
        microbatches: Some(2),
        ..Default::default()
    };
    let e = schedc::input::load_spec(&text, &ov).unwrap();
    let mesh: Mesh = "pp=2".parse().unwrap();
    ProgramSet::lower(
        &e.program,
        &mesh,
        &ModelConfig::tiny(),
        LowerOptions::default(),
    )
    .unwrap()
}

#[test]
fn finding07_trace_is_streamed_per_step() {
    let set = set();
    let batches: Arc<Mutex<Vec<Vec<Span>>>> = Arc::default();
    let b = batches.clone();
    let sink: SpanSink = Arc::new(Mutex::new(move |s: &[Span]| {
        b.lock().unwrap().push(s.to_vec())
    }));
    let opts = |sink: Option<SpanSink>| ExecOptions {
        steps: 3,
        optimizer: Optimizer::Sgd { lr: 0.1 },
        trace: true,
        trace_sink: sink,
        ..ExecOptions::default()
    };
    let streamed = execute::<f64>(&set, &Data::builtin(), &opts(Some(sink))).unwrap();
    assert!(streamed.trace.is_empty(), "a streamed trace is not kept");
    let batches = batches.lock().unwrap().clone();
    // One batch per rank and step, each of one rank and one step.
    assert_eq!(batches.len(), 2 * 3);
    for b in &batches {
        assert!(!b.is_empty());
        assert!(b.iter().all(|s| (s.rank, s.step) == (b[0].rank, b[0].step)));
    }
    // The same spans as a kept trace (times aside), and the writer's JSON is chrome_trace's.
    let kept = execute::<f64>(&set, &Data::builtin(), &opts(None)).unwrap();
    let all: Vec<Span> = batches.into_iter().flatten().collect();
    let key = |s: &Span| (s.rank, s.step, s.stream, s.name.clone());
    let mut a: Vec<_> = all.iter().map(key).collect();
    let mut k: Vec<_> = kept.trace.iter().map(key).collect();
    a.sort();
    k.sort();
    assert_eq!(a, k);
    let mut w = ChromeTraceWriter::new(Vec::new()).unwrap();
    w.push(&all[..3]).unwrap();
    w.push(&all[3..]).unwrap();
    let written = String::from_utf8(w.finish().unwrap()).unwrap();
    assert_eq!(written, chrome_trace(&all));
    let v: serde_json::Value = serde_json::from_str(&written).unwrap();
    // Two ranks' names, their streams' names, and one event per span.
    let events = v["traceEvents"].as_array().unwrap();
    assert_eq!(events.iter().filter(|e| e["ph"] == "X").count(), all.len());
    assert_eq!(
        events
            .iter()
            .filter(|e| e["name"] == "process_name")
            .count(),
        2
    );
}

#[test]
fn finding07_estimate_counts_the_trace() {
    let size = schedc::limits::Size {
        ranks: 4,
        stages: 4,
        microbatches: 8,
        compute_ops: 64,
        comm_ops: 0,
    };
    let model = ModelConfig::small();
    let cfg = |steps: usize, trace: bool, sink: bool| RunConfig {
        steps,
        trace,
        trace_sink: sink.then(|| {
            let s: SpanSink = Arc::new(Mutex::new(|_: &[Span]| {}));
            s
        }),
        model: model.clone(),
        ..RunConfig::default()
    };
    let instructions = 64 * 20 * model.layers_per_stage as u64;
    let plain = |steps| estimate_memory_of(&size, 4, &cfg(steps, false, false));
    // Streamed: about one step of spans, whatever the number of steps.
    for steps in [1, 1000] {
        assert_eq!(
            estimate_memory_of(&size, 4, &cfg(steps, true, true)) - plain(steps),
            instructions * TRACE_BYTES_PER_STEP_INSTRUCTION
        );
    }
    // Kept whole: every step's.
    assert_eq!(
        estimate_memory_of(&size, 4, &cfg(1000, true, false)) - plain(1000),
        instructions * TRACE_BYTES_PER_INSTRUCTION * 1000
    );
}
