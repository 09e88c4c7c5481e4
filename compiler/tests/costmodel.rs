//! The model-level cost model: configs read as published, parameter and FLOP counts against
//! the published ones, and the published cluster measurements it is held against (the
//! book's "Against real clusters" chapter; `cargo run --release -p schedc --example
//! calibrate` prints the whole table).

use schedc::costmodel::{arch, clusters, Efficiency};

fn params(name: &str) -> (f64, f64) {
    let a = arch::preset(name).unwrap();
    (
        a.total_params() as f64 / 1e9,
        a.active_params() as f64 / 1e9,
    )
}

#[test]
fn preset_parameter_counts_match_the_published_ones() {
    // DeepSeek-V3: 671B total, 37B active (arXiv 2412.19437 §1), without the 14B MTP module.
    let (t, a) = params("dsv3");
    assert!((t - 671.0).abs() / 671.0 < 0.01, "dsv3 total {t}");
    assert!((a - 37.0).abs() / 37.0 < 0.03, "dsv3 active {a}");
    // Qwen3-235B-A22B: 235B total, 22B active (its model card).
    let (t, a) = params("qwen3-235b-a22b");
    assert!((t - 235.0).abs() / 235.0 < 0.01, "qwen3 total {t}");
    assert!((a - 22.0).abs() / 22.0 < 0.03, "qwen3 active {a}");
    // Llama 3: 8.03B and 70.6B.
    let (t, _) = params("llama3-8b");
    assert!((t - 8.03).abs() < 0.05, "llama3-8b {t}");
    let (t, _) = params("llama3-70b");
    assert!((t - 70.55).abs() < 0.3, "llama3-70b {t}");
}

/// Model FLOPs per token (forward and backward) as the cost model counts them.
fn flops_per_token(name: &str, seq: u64, chunks: u32, layout: Option<&str>) -> f64 {
    use schedc::costmodel::{derive, hardware::Hardware, layout as lay, Training};
    let a = arch::preset(name).unwrap();
    let h = Hardware::preset("h100").unwrap();
    let tr = Training {
        mesh: lay::Mesh {
            tp: 1,
            pp: chunks,
            ep: 1,
            dp: 1,
            cp: 1,
        },
        seq,
        micro_batch_size: 1,
        recompute: lay::Recompute::None,
        distributed_optimizer: true,
        dtype: lay::Dtype::Bf16,
        layout: layout.map(str::to_string),
        flash_attention: true,
        a2a: Default::default(),
    };
    let d = derive(&a, &h, &tr, chunks, 1, &Efficiency::default()).unwrap();
    d.model_flops_per_step / d.tokens_per_step
}

#[test]
fn model_flops_per_token_match_megatron_bridge_published_figures() {
    // Megatron-Bridge's H100 table (docs/performance-summary-archive.md) reports tokens/s
    // and model TFLOP/s from Megatron-LM's num_floating_point_operations; their quotient is
    // the FLOPs per token it counts: Qwen3-235B-A22B 253e12 / 1712, DeepSeek-V3 (with its
    // MTP module) 338e12 / 1297, Llama3-70B 719e12 / 1602, Llama3-8B 744e12 / 14451.
    for (name, seq, chunks, layout, published) in [
        ("qwen3-235b-a22b", 4096, 32, None, 253e12 / 1712.0),
        ("dsv3", 4096, 32, Some("Et|(tt|)*30mL"), 338e12 / 1297.0),
        ("llama3-70b", 8192, 40, None, 719e12 / 1602.0),
        ("llama3-8b", 8192, 1, None, 744e12 / 14451.0),
    ] {
        let ours = flops_per_token(name, seq, chunks, layout);
        let err = (ours - published).abs() / published;
        assert!(
            err < 0.01,
            "{name}: {:.2} GFLOP per token, published {:.2} ({:.2}% off)",
            ours / 1e9,
            published / 1e9,
            100.0 * err
        );
    }
}

#[test]
fn the_default_efficiencies_are_the_fit() {
    // The three fitted figures reproduce their measurements (the fit itself:
    // `cargo run --release -p schedc --example calibrate`).
    let eff = Efficiency::default();
    let f = clusters::zb_issue21(&eff, "1f1b");
    assert!(
        (f.samples_per_second() - 55.0).abs() < 0.2,
        "{}",
        f.samples_per_second()
    );
    let mem = f.run.step.peak_memory_bytes / 1e9;
    assert!((mem - 48.0).abs() < 0.5, "{mem}");
    let d = clusters::dsv3_h800(&eff, "dualpipe");
    assert!(
        (d.tokens_per_gpu_second() - 1543.2).abs() < 5.0,
        "{}",
        d.tokens_per_gpu_second()
    );
}

#[test]
fn sail_sg_issue_21_throughput_ratios_within_10_percent_and_memory_within_15() {
    // sail-sg/zero-bubble-pipeline-parallelism#21, 8 x H800: samples/s and memory per GPU.
    let eff = Efficiency::default();
    let base = clusters::zb_issue21(&eff, "1f1b").samples_per_second();
    for (name, sps, mem) in [
        ("1f1b", 55.0, 48.0),
        ("interleaved_1f1b", 66.0, 57.0),
        ("zb_h2", 67.0, 79.0),
        ("zbv", 64.0, 53.0),
    ] {
        let r = clusters::zb_issue21(&eff, name);
        let ratio = r.samples_per_second() / base;
        let measured = sps / 55.0;
        assert!(
            (ratio / measured - 1.0).abs() < 0.10,
            "{name}: ratio to 1F1B {ratio:.3}, measured {measured:.3}"
        );
        let m = r.run.step.peak_memory_bytes / 1e9;
        assert!(
            (m / mem - 1.0).abs() < 0.15,
            "{name}: {m:.1} GB, measured {mem}"
        );
    }
}

#[test]
fn zero_bubble_paper_a100_ratios_and_memory_held_out() {
    // arXiv 2401.10241 Table 4 (6.2B, 8 x A100, micro-batch 3, m = 24): not used by the fit.
    let eff = Efficiency::default();
    let base = clusters::zb_paper_a100(&eff, "1f1b", 24).samples_per_second();
    for (name, sps, mem) in [
        ("1f1b", 3.50, 39.0),
        ("interleaved_1f1b", 4.01, 48.0),
        ("zb_h1", 3.88, 42.0),
        ("zb_h2", 4.32, 70.0),
    ] {
        let r = clusters::zb_paper_a100(&eff, name, 24);
        let ratio = r.samples_per_second() / base;
        assert!(
            (ratio / (sps / 3.50) - 1.0).abs() < 0.10,
            "{name}: ratio {ratio:.3}, measured {:.3}",
            sps / 3.50
        );
        let m = r.run.step.peak_memory_bytes / 1e9;
        assert!(
            (m / mem - 1.0).abs() < 0.15,
            "{name}: {m:.1} GB, measured {mem}"
        );
    }
}

#[test]
fn deepep_bandwidths_are_reproduced() {
    // DeepEP README (legacy table), H800: the model's all-to-all time over the bytes DeepEP
    // counts gives its figures back, dispatch fp8 and combine bf16.
    for (ep, d, c) in [
        (8, 153.0, 158.0),
        (16, 43.0, 43.0),
        (32, 58.0, 57.0),
        (64, 51.0, 50.0),
    ] {
        let pd = clusters::deepep_bandwidth(ep, false);
        let pc = clusters::deepep_bandwidth(ep, true);
        assert!(
            (pd - d).abs() < 0.5 && (pc - c).abs() < 0.5,
            "EP{ep}: {pd} {pc}"
        );
    }
}

#[test]
fn deepseek_v3_dualpipe_hides_all_to_all_that_1f1b_exposes() {
    let eff = Efficiency::default();
    let dp = clusters::dsv3_h800(&eff, "dualpipe");
    let f1 = clusters::dsv3_h800(&eff, "1f1b");
    // 1F1B runs every all-to-all exposed; DualPipe's overlapped pairs hide most of them.
    assert!(f1.run.sim.a2a.exposed_fraction() > 0.99);
    assert!(dp.run.sim.a2a.exposed_fraction() < 0.4);
    assert!(dp.run.step.step_seconds < 0.75 * f1.run.step.step_seconds);
    // It fits H800's 80 GB with DualPipe's two parameter copies.
    assert!(dp.run.step.fits, "{}", dp.run.step.peak_memory_bytes);
}

fn config_err(json: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    arch::from_config(&v, "config.json").unwrap_err()
}

#[test]
fn a_bad_config_is_refused_naming_the_field() {
    let e = config_err(r#"{"model_type": "gpt2", "n_layer": 12}"#);
    assert!(
        e.contains("unknown architecture `model_type: gpt2`") && e.contains("llama"),
        "{e}"
    );
    let e = config_err(r#"{"hidden_size": 8}"#);
    assert!(e.contains("missing field `model_type`"), "{e}");
    let e = config_err(
        r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "vocab_size": 32000}"#,
    );
    assert!(
        e.contains("missing field `intermediate_size`") && e.contains("llama"),
        "{e}"
    );
    let e = config_err(
        r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": "32",
            "num_attention_heads": 32, "vocab_size": 32000, "intermediate_size": 11008}"#,
    );
    assert!(
        e.contains("`num_hidden_layers` must be a positive integer"),
        "{e}"
    );
    let e = config_err(
        r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 5, "vocab_size": 32000,
            "intermediate_size": 11008}"#,
    );
    assert!(e.contains("`num_key_value_heads` (5) must divide"), "{e}");
    let e = config_err(
        r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 4,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 9,
            "moe_intermediate_size": 768}"#,
    );
    assert!(e.contains("`num_experts_per_tok` (9) exceeds the 8"), "{e}");
    let e = config_err(
        r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 4,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 768, "mlp_only_layers": [4]}"#,
    );
    assert!(
        e.contains("`mlp_only_layers` names layer 4") && e.contains("0..=3"),
        "{e}"
    );
    let e = config_err(
        r#"{"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
            "num_attention_heads": 128, "vocab_size": 129280, "intermediate_size": 18432,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "v_head_dim": 128}"#,
    );
    assert!(
        e.contains("missing field `qk_rope_head_dim`") && e.contains("deepseek_v3"),
        "{e}"
    );
}

#[test]
fn configs_read_their_families_layers() {
    // Qwen3-MoE: mlp_only_layers and decoder_sparse_step; DeepSeek: first_k_dense_replace.
    let v: serde_json::Value = serde_json::from_str(
        r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 6,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 768, "intermediate_size": 6144,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]}"#,
    )
    .unwrap();
    let a = arch::from_config(&v, "x").unwrap();
    assert_eq!(a.moe_layers, vec![false, true, false, false, false, true]);
    let d = arch::preset("dsv3").unwrap();
    assert_eq!(d.moe_layers.iter().filter(|&&m| !m).count(), 3);
    assert!(!d.moe_layers[2] && d.moe_layers[3]);
    assert_eq!(d.moe.as_ref().unwrap().max_nodes, Some(4));
}

#[test]
fn moe_routing_fields_are_checked() {
    let ds = |extra: &str| {
        config_err(&format!(
            r#"{{"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
            "num_attention_heads": 128, "vocab_size": 129280, "intermediate_size": 18432,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, {extra}}}"#
        ))
    };
    let e = ds(r#""n_group": 8, "topk_group": 9"#);
    assert!(e.contains("`topk_group` (9) must be in 1..=8"), "{e}");
    let e = ds(r#""n_group": 7, "topk_group": 4"#);
    assert!(e.contains("`n_group` (7) does not divide the 256"), "{e}");
    let e = ds(r#""moe_layer_freq": 0"#);
    assert!(e.contains("`moe_layer_freq` must be at least 1"), "{e}");
    let e = ds(r#""first_k_dense_replace": 100"#);
    assert!(
        e.contains("`first_k_dense_replace` (100) exceeds the 61 layers"),
        "{e}"
    );
    let e = config_err(
        r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 4,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 768, "decoder_sparse_step": 0}"#,
    );
    assert!(
        e.contains("`decoder_sparse_step` must be at least 1"),
        "{e}"
    );
    assert_eq!(arch::preset("dsv3").unwrap().mtp_layers, 1);
}

/// `--a2a flat` against the default two-level all-to-all (issue 23, item 4): DeepSeek-V3's
/// top-8 routing limited to 4 nodes, EP 64 over 8 H800 nodes. Two-level dispatch sends a
/// token over the network once per destination node other than its own: 4 nodes at most,
/// `4 * 7/8` copies; flat sends every copy bound off the node, `8 * 7/8`: twice the network
/// bytes. Within one node the two are the same all-to-all.
#[test]
fn flat_all_to_all_crosses_the_network_twice_as_often_for_dsv3_routing() {
    use schedc::costmodel::{all_to_all_seconds, hardware::Hardware, layout as lay, AllToAll};
    let a = arch::preset("dsv3").unwrap();
    let h = Hardware::preset("h800").unwrap();
    let eff = Efficiency::default();
    let mesh = |ep| lay::Mesh {
        tp: 1,
        pp: 1,
        ep,
        dp: ep,
        cp: 1,
    };
    let at = |ep, a2a| {
        let m = mesh(ep);
        let q = AllToAll {
            mesh: &m,
            tokens: 4096.0,
            dtype: lay::Dtype::Bf16,
            combine: false,
            a2a,
        };
        all_to_all_seconds(&a, &h, &q, &eff)
    };
    let (th, net_h, nvl_h) = at(64, lay::A2a::Hierarchical);
    let (tf, net_f, nvl_f) = at(64, lay::A2a::Flat);
    // bf16 rows of 7168 values: 4096 tokens x 3.5 copies x 14336 bytes.
    assert_eq!(net_h, 4096.0 * 3.5 * 14336.0);
    assert_eq!(net_f, 4096.0 * 7.0 * 14336.0);
    assert!((net_f / net_h - 2.0).abs() < 1e-12);
    assert!(tf > 1.9 * th, "flat {tf} s, two-level {th} s");
    // Flat forwards nothing over NVLink: only the copies to the 7 other GPUs of the node.
    assert!((nvl_f - 4096.0 * 8.0 * 7.0 / 64.0 * 14336.0).abs() < 1e-3);
    assert!(nvl_h > nvl_f);
    // One node: the same all-to-all.
    assert_eq!(at(8, lay::A2a::Hierarchical), at(8, lay::A2a::Flat));
    assert_eq!(lay::A2a::parse("flat"), Ok(lay::A2a::Flat));
    assert_eq!(
        lay::A2a::parse("ring"),
        Err("--a2a: `ring` is not flat or hierarchical".to_string())
    );
}
