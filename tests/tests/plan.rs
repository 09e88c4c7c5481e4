//! `schedc plan`: the recommendation fits, beats or equals 1F1B, and DualPipe's second copy
//! costs the MoE model proportionally less than the dense one (experts sharded by EP).

use schedc::plan::{dualpipe_overhead, interconnect, plan, preset, Cluster};

fn cluster(gpus: u32, ep: Option<u32>) -> Cluster {
    let (bw, lat) = interconnect("ib400").unwrap();
    Cluster {
        gpus,
        gpus_per_node: 8,
        gpu_memory: 80e9,
        peak_flops: 989e12,
        mfu: 0.4,
        inter_bw: bw,
        latency: lat,
        global_batch_tokens: 4e6,
        ep,
    }
}

fn specs() -> String {
    schedc_tests::conform::root()
        .join("specs")
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn recommendations_fit_and_beat_1f1b() {
    for (model, gpus, ep) in [("dsv3", 256, Some(64)), ("dense70b", 128, None)] {
        let m = preset(model).unwrap();
        let c = cluster(gpus, ep);
        let p = plan(&m, &c, &specs()).unwrap();
        let b = &p.candidates[p.best.expect("a configuration fits")];
        assert!(b.fits && b.memory_bytes <= c.gpu_memory);
        let base = p
            .candidates
            .iter()
            .find(|x| x.pp == b.pp && x.schedule == "1f1b")
            .unwrap();
        assert!(b.step_seconds <= base.step_seconds + 1e-9, "{model}");
        // Every candidate's bubble is a fraction.
        assert!(p.candidates.iter().all(|x| (0.0..1.0).contains(&x.bubble)));
        assert!(!p.reasoning.is_empty());
    }
}

#[test]
fn dualpipe_copy_overhead_is_smaller_for_moe() {
    let moe = preset("dsv3").unwrap();
    let dense = preset("dense70b").unwrap();
    // The second copy per GPU, relative to a full copy of the rank's stage (parameters / PP,
    // 4 bytes of weights and gradients each): the MoE model's experts are sharded by EP, so
    // its copy is a much smaller share.
    for pp in [4u32, 8, 16] {
        let share = |m: &schedc::plan::ModelSpec, ep| {
            dualpipe_overhead(m, pp, 8, ep) / (m.total_params / pp as f64 * 4.0)
        };
        let (moe_share, dense_share) = (share(&moe, Some(64)), share(&dense, None));
        assert!(moe_share < 0.05, "{moe_share}");
        assert!(
            (dense_share - 1.0 / 8.0).abs() < 1e-12,
            "dense: 1/TP, {dense_share}"
        );
        assert!(moe_share < dense_share / 2.0);
    }
}
