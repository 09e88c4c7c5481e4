//! CPU executor benchmarks.
//!
//! * `overhead/*`: executor overhead per instruction. A model with almost no arithmetic
//!   (hidden 2, one head, MLA ranks and head widths 2, 2 experts, top-1, 1 token,
//!   vocabulary 128) runs 4 steps of
//!   1F1B at P=4, M=8 on 4 threads; throughput is in instructions, so criterion's time per
//!   element is the cost of one instruction (interpretation, buffers, events, messages,
//!   thread wake-ups), an upper bound on the overhead.
//! * `step/*`: one training step of the default model (`ModelConfig::small`: d=32, T=32) for
//!   DualPipe at P=4, M=8: the pipelined executor (4 threads) against the sequential
//!   reference, measured in the same run.
//!
//! Run with `cargo bench -p schedc-cpu --bench exec`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use schedc::input::{load_spec, Overrides};
use schedc_cpu::exec::{execute, reference, Batching, Data, ExecOptions, Optimizer};
use schedc_cpu::model::ModelConfig;
use schedc_program::mesh::Mesh;
use schedc_program::{LowerOptions, ProgramSet};
use std::hint::black_box;
use std::time::Duration;

fn program(name: &str, pp: u32, mb: u32) -> schedc_ir::Program {
    let path = format!("{}/../../specs/{name}.sched", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).expect("the spec exists");
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        ..Default::default()
    };
    load_spec(&text, &ov)
        .unwrap_or_else(|_| panic!("the spec refuses {name} P={pp} M={mb}"))
        .program
}

fn overhead(c: &mut Criterion) {
    let cfg = ModelConfig {
        hidden: 2,
        heads: 1,
        q_lora_rank: 2,
        kv_lora_rank: 2,
        qk_nope_head_dim: 2,
        qk_rope_head_dim: 2,
        v_head_dim: 2,
        seq_len: 1,
        experts: 2,
        top_k: 1,
        expert_hidden: 2,
        shared_expert: false,
        ..ModelConfig::tiny()
    };
    let src = program("1f1b", 4, 8);
    let set = ProgramSet::lower(&src, &Mesh::pipeline(4), &cfg, LowerOptions::default()).unwrap();
    let data = Data::builtin();
    let steps = 4;
    let opts = ExecOptions {
        steps,
        ..ExecOptions::default()
    };
    let mut g = c.benchmark_group("overhead");
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements((set.len() * steps) as u64));
    g.bench_function("per_instruction/1f1b_P4_M8", |b| {
        b.iter(|| black_box(execute::<f64>(&set, &data, &opts).unwrap()))
    });
    g.finish();
}

fn step(c: &mut Criterion) {
    let cfg = ModelConfig::small();
    let src = program("dualpipe", 4, 8);
    let set = ProgramSet::lower(&src, &Mesh::pipeline(4), &cfg, LowerOptions::default()).unwrap();
    let data = Data::builtin();
    let opts = ExecOptions::default();
    let batching = Batching {
        shards: 1,
        microbatches: 8,
        sp: 1,
    };
    let mut g = c.benchmark_group("step");
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    g.bench_function("pipelined/dualpipe_P4_M8", |b| {
        b.iter(|| black_box(execute::<f64>(&set, &data, &opts).unwrap()))
    });
    g.bench_function("sequential/dualpipe_P4_M8", |b| {
        b.iter(|| {
            black_box(
                reference::<f64>(&cfg, 4, batching, &data, 1, &Optimizer::Sgd { lr: 0.1 }).unwrap(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, overhead, step);
criterion_main!(benches);
