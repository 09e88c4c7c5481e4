//! Issue 24, item 1: the model's size from a Hugging Face `config.json` (`--model`), run on
//! the host shim equal to the CPU backend, and the memory check made before any allocation.

use schedc::input::{load_spec, Overrides};
use schedc_cpu::exec::{execute as cpu_execute, ExecOptions as CpuOptions, Optimizer};
use schedc_cpu::tensor::rel_err;
use schedc_cuda::api::DType;
use schedc_cuda::driver::{check_memory, execute, rank_needs, ExecOptions};
use schedc_cuda::host::HostGpu;
use schedc_program::data::Data;
use schedc_program::mesh::Mesh;
use schedc_program::{LowerOptions, ModelConfig, ProgramSet};
use std::collections::HashMap;

/// A DeepSeek-V3-style config.json: hidden 256, 8 experts (top-2, hidden 128), MLA with
/// 4 heads, 2 layers (one per stage of a two-stage schedule: the shim is slow at this
/// size in a debug build), byte vocabulary.
const SMALL: &str = r#"{"model_type":"deepseek_v3","hidden_size":256,"num_hidden_layers":2,
"intermediate_size":512,"moe_intermediate_size":128,"n_routed_experts":8,
"n_shared_experts":1,"num_experts_per_tok":2,"first_k_dense_replace":0,"moe_layer_freq":1,
"q_lora_rank":96,"kv_lora_rank":64,"qk_nope_head_dim":32,"qk_rope_head_dim":16,
"v_head_dim":32,"num_attention_heads":4,"vocab_size":256,"tie_word_embeddings":false}"#;

fn small_model(seq: usize, stages: usize) -> ModelConfig {
    let v: serde_json::Value = serde_json::from_str(SMALL).unwrap();
    let arch = schedc::costmodel::arch::from_config(&v, "small.json").unwrap();
    let f = ModelConfig::from_arch(&arch, seq, stages).unwrap();
    assert!(f.notes.is_empty(), "{:?}", f.notes);
    f.model
}

fn lower(name: &str, pp: u32, mb: u32, mesh: &str, cfg: &ModelConfig) -> ProgramSet {
    let path = format!("{}/../../specs/{name}.sched", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        ..Default::default()
    };
    let src = load_spec(&text, &ov).unwrap().program;
    let mesh: Mesh = mesh.parse().unwrap();
    ProgramSet::lower(&src, &mesh, cfg, LowerOptions::default()).unwrap()
}

#[test]
fn a_config_json_maps_to_the_executors_model() {
    let m = small_model(256, 2);
    assert_eq!(
        (m.hidden, m.heads, m.q_lora_rank, m.kv_lora_rank),
        (256, 4, 96, 64)
    );
    assert_eq!(
        (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim),
        (32, 16, 32)
    );
    assert_eq!((m.experts, m.top_k, m.expert_hidden), (8, 2, 128));
    assert_eq!((m.seq_len, m.layers_per_stage, m.vocab), (256, 1, 256));
    assert!(m.shared_expert);
    // dsv3 over 4 stages: 61 layers become 16 per stage, with the notes saying so.
    let f =
        ModelConfig::from_arch(&schedc::costmodel::arch::preset("dsv3").unwrap(), 4096, 4).unwrap();
    assert_eq!(f.model.layers_per_stage, 16);
    assert_eq!(f.model.hidden, 7168);
    assert_eq!(f.model.experts, 256);
    assert_eq!(f.model.vocab, 129280);
    assert_eq!(f.notes.len(), 2, "{:?}", f.notes);
    // Not MLA: refused, naming the family.
    let e = ModelConfig::from_arch(
        &schedc::costmodel::arch::preset("llama3-8b").unwrap(),
        4096,
        4,
    )
    .unwrap_err();
    assert!(
        e.contains("model_type `llama`") && e.contains("grouped-query"),
        "{e}"
    );
}

#[test]
fn stage_params_equal_the_flattened_parameters() {
    // The count the memory check uses equals the executors' parameters, for every kind of
    // stage, with expert and tensor parallelism.
    let cfg = small_model(256, 2);
    for (first, last, lo, hi, tp) in [
        (true, false, 0, 8, 1),
        (false, true, 0, 8, 1),
        (true, true, 4, 8, 1),
        (false, false, 0, 4, 2),
        (true, true, 0, 8, 4),
    ] {
        // Stage 0, 1 or 2 of 3 (1 of 1 when both first and last).
        let (stage, stages) = match (first, last) {
            (true, true) => (0, 1),
            (true, false) => (0, 3),
            (false, false) => (1, 3),
            (false, true) => (2, 3),
        };
        let mut p = schedc_cpu::model::StageParams::<f32>::init(&cfg, stage, stages, lo, hi);
        p.shard_tp(&cfg, 0, tp);
        let want = schedc_cuda::layout::ParamLayout::of(&p, cfg.experts).params() as u64;
        assert_eq!(
            cfg.stage_params(first, last, hi - lo, tp),
            want,
            "first {first} last {last} experts {lo}..{hi} tp {tp}"
        );
    }
}

#[test]
fn the_shim_runs_a_config_json_model_equal_to_the_cpu() {
    let cfg = small_model(256, 2);
    let set = lower("1f1b", 2, 2, "pp=2", &cfg);
    let data = Data::builtin();
    let opt = Optimizer::Sgd { lr: 0.1 };
    let t0 = std::time::Instant::now();
    let cpu = cpu_execute::<f32>(
        &set,
        &data,
        &CpuOptions {
            steps: 1,
            optimizer: opt,
            record: true,
            ..CpuOptions::default()
        },
    )
    .unwrap();
    let t_cpu = t0.elapsed();
    let gpu = HostGpu::new(DType::F32).with_memory(1 << 30);
    let ranks: Vec<u32> = (0..set.manifest.world).collect();
    check_memory(&gpu, &set, &ranks, &opt, None).unwrap();
    let run = execute(
        &gpu,
        &set,
        &data,
        &ExecOptions {
            steps: 1,
            optimizer: opt,
            record: true,
            ..ExecOptions::default()
        },
    )
    .unwrap();
    println!("cpu {t_cpu:?}, shim {:?}", t0.elapsed() - t_cpu);
    let loss = (run.losses[0] - cpu.losses[0]).abs() / cpu.losses[0].abs();
    let want: HashMap<(u32, u32, &str), &Vec<f64>> = cpu.grads[0]
        .iter()
        .flat_map(|(r, s, named)| named.iter().map(move |(n, t)| ((*r, *s, n.as_str()), t)))
        .collect();
    let (mut worst, mut at, mut seen) = (0.0f64, String::new(), 0);
    for (r, s, named) in &run.grads[0] {
        for (n, t) in named {
            let e = rel_err(t, want[&(*r, *s, n.as_str())], 1e-8);
            seen += 1;
            if e.is_nan() || e > worst {
                worst = e;
                at = format!("{n} of stage {s} on rank {r}");
            }
        }
    }
    println!(
        "hidden 256, 8 experts, seq 256, 1F1B P=2 M=2 on the shim against the CPU (f32): loss {loss:.3e}, worst gradient {worst:.3e} ({at}) over {seen} tensors, loss {:.5}",
        run.losses[0]
    );
    assert_eq!(seen, want.len());
    assert!(loss <= 1e-5, "loss off by {loss:.3e}");
    assert!(worst <= 1e-5, "gradient {at} off by {worst:.3e}");
    // What the check predicted is what the ranks took.
    let needs = rank_needs(&set, &ranks, DType::F32, &opt).unwrap();
    for (n, m) in needs.iter().zip(&run.memory) {
        assert_eq!(n.rank, m.rank);
        assert_eq!(n.params, m.params as u64, "rank {}", m.rank);
        assert_eq!(
            n.activations,
            m.planned as u64 + 4 * 2 + 4,
            "rank {}",
            m.rank
        );
    }
}

#[test]
fn dsv3_is_refused_on_the_shim_before_any_allocation() {
    let f =
        ModelConfig::from_arch(&schedc::costmodel::arch::preset("dsv3").unwrap(), 4096, 4).unwrap();
    let set = lower("1f1b", 4, 8, "pp=4", &f.model);
    let gpu = HostGpu::new(DType::Bf16).with_memory(140 << 30);
    let t0 = std::time::Instant::now();
    let e = check_memory(&gpu, &set, &[0], &Optimizer::adam(1e-3), None).unwrap_err();
    assert_eq!(gpu.allocations(), 0);
    assert!(t0.elapsed().as_secs() < 20, "{:?}", t0.elapsed());
    // Rank 0 holds stage 0 of 4: 16 layers of 256 experts (bf16 weights with their f32
    // master copy, gradients and Adam's moments), the embedding, and its peak of stashes of
    // 16 layers at 4096 tokens (the untiled attention keeps heads x t x t scores).
    assert_eq!(
        e,
        "the model does not fit: rank 0 needs 3.4 TiB (2.4 TiB of parameters, gradients and optimizer state, 1.0 TiB of activations and buffers), more than the memory free on host shim (bf16, kernels run as C++ on the CPU) (140.0 GiB)"
    );
    // --memory-limit replaces the device's figure.
    let e = check_memory(&gpu, &set, &[0], &Optimizer::adam(1e-3), Some(1 << 40)).unwrap_err();
    assert!(e.contains("more than --memory-limit (1.0 TiB)"), "{e}");
    println!("{e}");
}

#[test]
fn the_real_size_model_of_gpu_check_fits_an_h200_by_the_check() {
    // gpu-check.sh's `realsize` step: hidden 2048, MLA, 64 experts top-6, four layers on
    // one stage, sequence 4096, 1F1B P=1 M=4, bf16, Adam.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/realsize.json");
    let arch = schedc::costmodel::arch::resolve(path).unwrap();
    let f = ModelConfig::from_arch(&arch, 4096, 1).unwrap();
    assert!(f.notes.is_empty(), "{:?}", f.notes);
    assert_eq!(
        (
            f.model.hidden,
            f.model.experts,
            f.model.top_k,
            f.model.layers_per_stage
        ),
        (2048, 64, 6, 4)
    );
    let set = lower("1f1b", 1, 4, "pp=1", &f.model);
    let needs = rank_needs(&set, &[0], DType::Bf16, &Optimizer::adam(1e-3)).unwrap();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "realsize on one H200: parameters and optimizer state {:.1} GiB, activations and buffers {:.1} GiB",
        gib(needs[0].params),
        gib(needs[0].activations)
    );
    let gpu = HostGpu::new(DType::Bf16).with_memory(140 << 30);
    check_memory(&gpu, &set, &[0], &Optimizer::adam(1e-3), None).unwrap();
    // Not in 40 GiB, with the figures.
    let gpu = HostGpu::new(DType::Bf16).with_memory(40 << 30);
    let e = check_memory(&gpu, &set, &[0], &Optimizer::adam(1e-3), None).unwrap_err();
    println!("{e}");
    assert_eq!(
        e,
        "the model does not fit: rank 0 needs 45.2 GiB (30.1 GiB of parameters, gradients and optimizer state, 15.0 GiB of activations and buffers), more than the memory free on host shim (bf16, kernels run as C++ on the CPU) (40.0 GiB)"
    );
}
