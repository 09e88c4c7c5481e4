//! Criterion benchmark of the model-level cost model (issue 22): `sim --model` on
//! DeepSeek-V3 and `plan` over 2048 GPUs, each against a baseline measured in the same run.
//!
//! * `baseline/simulate_zbv_p16_m256_moe`: the simulator alone on ZB-V at P = 16, V = 2,
//!   M = 256 with `--moe` (every F, B and BW in parts), under the costs derived for
//!   DeepSeek-V3 on H800 (tp=1 pp=16 ep=64 dp=128, fp8, selective recomputation, ZeRO-1):
//!   the program loaded, split and lowered beforehand.
//! * `sim_model/evaluate_zbv_p16_m256_moe`: `costmodel::evaluate` on the same instance,
//!   what `schedc sim specs/zbv.sched --pp 16 --mb 256 --moe --model dsv3 --hardware h800`
//!   computes: the spec loaded twice (shape, then under the derived costs), the costs
//!   derived, `schedc check`, the simulation and the step report.
//! * `plan/dsv3_2048_h800`: `plan --gpus 2048 --model dsv3 --hardware h800` (the standard
//!   library, the default batch of 4096 sequences).

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use schedc::costmodel::{
    arch, evaluate, hardware::Hardware, layout, Efficiency, Instance, Training,
};
use std::time::Duration;

fn training() -> Training {
    Training {
        mesh: layout::Mesh {
            tp: 1,
            pp: 16,
            ep: 64,
            dp: 128,
            cp: 1,
        },
        seq: 4096,
        micro_batch_size: 1,
        recompute: layout::Recompute::Selective,
        distributed_optimizer: true,
        dtype: layout::Dtype::Fp8,
        // 61 layers over 32 chunks: the plan's layout (the even split does not divide).
        layout: Some(schedc::plan::balanced_layout(61, 32)),
        flash_attention: true,
        a2a: Default::default(),
    }
}

fn bench(c: &mut Criterion) {
    let a = arch::preset("dsv3").expect("preset");
    let hw = Hardware::preset("h800").expect("preset");
    let eff = Efficiency::default();
    let tr = training();
    let text = schedc::specs::get("zbv").expect("zbv");
    let inst = Instance {
        name: "zbv",
        text,
        pp: 16,
        mb: 256,
        vpp: None,
        moe: Some("auto"),
    };
    let ev = evaluate(&inst, &a, &hw, &tr, &eff).expect("evaluates");
    eprintln!(
        "zbv P=16 M=256 --moe on dsv3/h800: step {:.3} s, {:.0} tokens/s",
        ev.step.step_seconds, ev.step.tokens_per_second
    );
    // The same program, loaded, split and lowered once, for the simulator alone.
    let ov = schedc::input::Overrides {
        pp: Some(16),
        microbatches: Some(256),
        moe: Some("auto".parse().expect("moe")),
        list_cost: Some(ev.derived.cost_model(32, 32)),
        ..Default::default()
    };
    let loaded = schedc::input::load_str("zbv", text.to_string(), &ov).expect("loads");
    let out = schedc::check::check(&loaded.program, None, &Default::default());
    let prog = out.checked.expect("accepted");
    let cost = ev
        .derived
        .cost_model(prog.pipeline.stages, prog.pipeline.stages_per_direction());
    let req = schedc::plan::Request {
        gpus: 2048,
        arch: a.clone(),
        hardware: hw.clone(),
        seq: 4096,
        micro_batch_size: 1,
        global_batch: 4096,
        recompute: layout::Recompute::None,
        dtype: layout::Dtype::Bf16,
        distributed_optimizer: false,
        flash_attention: true,
        a2a: Default::default(),
        fixed: Default::default(),
        efficiency: eff.clone(),
        max_memory: None,
    };
    let lib = schedc::specs::standard_library_owned();
    let mut g = c.benchmark_group("model");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    g.bench_function("baseline/simulate_zbv_p16_m256_moe", |b| {
        b.iter(|| black_box(schedc::sim::simulate(&prog, &cost).expect("runs").makespan))
    });
    g.bench_function("sim_model/evaluate_zbv_p16_m256_moe", |b| {
        b.iter(|| {
            black_box(
                evaluate(&inst, &a, &hw, &tr, &eff)
                    .expect("evaluates")
                    .step
                    .step_seconds,
            )
        })
    });
    g.bench_function("plan/dsv3_2048_h800", |b| {
        b.iter(|| black_box(schedc::plan::plan(&req, &lib).expect("plans").simulations))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
