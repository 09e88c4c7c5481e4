//! `schedc plan` (issue 22): a search over meshes and schedules, each candidate priced by
//! `costmodel::evaluate`; the recommendation is the fastest that fits, and the bounds that
//! prune the search hold for every candidate simulated.

use schedc::costmodel::{
    arch, evaluate, hardware::Hardware, layout, Efficiency, Instance, Training,
};
use schedc::plan::{plan, Fixed, Request};

fn request(model: &str, hw: &str, gpus: u32, global_batch: u64) -> Request {
    Request {
        gpus,
        arch: arch::preset(model).unwrap(),
        hardware: Hardware::preset(hw).unwrap(),
        seq: 4096,
        micro_batch_size: 1,
        global_batch,
        recompute: layout::Recompute::None,
        dtype: layout::Dtype::Bf16,
        distributed_optimizer: false,
        flash_attention: true,
        a2a: Default::default(),
        fixed: Fixed::default(),
        efficiency: Efficiency::default(),
        max_memory: None,
    }
}

fn specs(names: &[&str]) -> Vec<(String, String)> {
    schedc::specs::standard_library_owned()
        .into_iter()
        .filter(|(n, _)| names.contains(&n.as_str()))
        .collect()
}

#[test]
fn plan_candidates_are_the_simulators_and_the_best_is_the_fastest_that_fits() {
    let req = request("llama3-8b", "h100", 4, 16);
    let lib = specs(&["1f1b", "zbv", "interleaved_1f1b"]);
    let p = plan(&req, &lib).unwrap();
    let b = &p.candidates[p.best.expect("something fits")];
    assert!(b.fits);
    for c in p.candidates.iter().filter(|c| c.fits) {
        assert!(c.tokens_per_second <= b.tokens_per_second, "{c:?}");
    }
    // Each candidate is `evaluate` on the same instance, figure for figure.
    for c in p.candidates.iter().take(4) {
        let tr = Training {
            mesh: layout::Mesh {
                tp: c.tp,
                pp: c.pp,
                ep: c.ep,
                dp: c.dp,
                cp: 1,
            },
            seq: 4096,
            micro_batch_size: 1,
            recompute: layout::Recompute::None,
            distributed_optimizer: false,
            dtype: layout::Dtype::Bf16,
            layout: c.layout.clone(),
            flash_attention: true,
            a2a: Default::default(),
        };
        let text = schedc::specs::get(&c.schedule).unwrap();
        let inst = Instance {
            name: &c.schedule,
            text,
            pp: c.pp,
            mb: c.microbatches,
            vpp: c.vpp,
            moe: None,
        };
        let e = evaluate(&inst, &req.arch, &req.hardware, &tr, &Efficiency::default()).unwrap();
        assert_eq!(e.step.step_seconds, c.step_seconds, "{c:?}");
        assert_eq!(e.step.peak_memory_bytes, c.memory_bytes, "{c:?}");
    }
}

// The pruning is sound: no simulated candidate beats its mesh's throughput bound or comes
// in under its memory bound.
#[test]
fn plan_bounds_hold_for_every_candidate() {
    for (model, gpus, batch) in [("llama3-8b", 8, 32), ("qwen3-30b-a3b", 16, 64)] {
        let req = request(model, "h100", gpus, batch);
        let p = plan(&req, &specs(&["1f1b", "dualpipe", "zbv"])).unwrap();
        assert!(!p.candidates.is_empty(), "{model}");
        for c in &p.candidates {
            let m = p
                .meshes
                .iter()
                .find(|m| m.mesh == c.mesh_text())
                .unwrap_or_else(|| panic!("{model}: {} has no bound", c.mesh_text()));
            assert!(m.simulated);
            assert!(
                c.tokens_per_second <= m.bound_tokens_per_second * (1.0 + 1e-12),
                "{model} {c:?}: bound {}",
                m.bound_tokens_per_second
            );
            assert!(
                c.memory_bytes >= m.memory_lower_bound_bytes * (1.0 - 1e-12),
                "{model} {c:?}: bound {}",
                m.memory_lower_bound_bytes
            );
        }
        // Best bound first; a pruned mesh's bound is below the best found.
        let best = p.best.map_or(0.0, |i| p.candidates[i].tokens_per_second);
        for w in p.meshes.windows(2) {
            assert!(w[0].bound_tokens_per_second >= w[1].bound_tokens_per_second);
        }
        for m in p.meshes.iter().filter(|m| !m.simulated) {
            assert!(m.bound_tokens_per_second <= best, "{model} {m:?}");
        }
    }
}

#[test]
fn mesh_constraints_fix_dimensions() {
    assert_eq!(
        Fixed::parse("tp=2,ep=8").unwrap(),
        Fixed {
            tp: Some(2),
            pp: None,
            ep: Some(8),
            dp: None
        }
    );
    assert!(Fixed::parse("cp=2")
        .unwrap_err()
        .contains("context parallelism"));
    let mut req = request("llama3-8b", "h100", 8, 32);
    req.fixed = Fixed::parse("pp=4").unwrap();
    let p = plan(&req, &specs(&["1f1b"])).unwrap();
    assert!(p.candidates.iter().all(|c| c.pp == 4 && c.tp * c.dp == 2));
    req.fixed = Fixed::parse("tp=2,pp=2,dp=4").unwrap();
    assert_eq!(
        req.validate().unwrap_err(),
        "--mesh tp=2 x pp=2 x dp=4 is 16 GPUs, but --gpus is 8"
    );
    req.fixed = Fixed::parse("ep=2").unwrap();
    assert!(req.validate().unwrap_err().contains("is dense"));
}

#[test]
fn balanced_layout_keeps_the_remainder_off_the_embedding_and_head_stages() {
    assert_eq!(
        schedc::plan::balanced_layout(61, 16),
        "Et*3|(t*4|)*13t*3|t*3L"
    );
    // Every layer count over every stage count it can fill is a valid Megatron layout with
    // the first and last stages no heavier than the middle ones.
    for layers in 1..=70u32 {
        for chunks in 1..=layers {
            let s = schedc::plan::balanced_layout(layers, chunks);
            let c = layout::parse_layout(&s, layers, chunks)
                .unwrap_or_else(|e| panic!("{layers} over {chunks}: {s}: {e}"));
            let n: Vec<usize> = c.iter().map(|x| x.layers.len()).collect();
            let max = *n.iter().max().unwrap();
            let min = *n.iter().min().unwrap();
            assert!(max - min <= 1, "{s}");
            if chunks > 2 && layers % chunks <= chunks - 2 {
                assert_eq!(n[0], min, "{s}");
                assert_eq!(n[n.len() - 1], min, "{s}");
            }
        }
    }
}

/// issue 22 item 7: the table's schedule column fits the longest name shown
/// (`interleaved_1f1b_a2a V=2` is 24 characters): every row is as long as the header, so
/// the columns stay aligned.
#[test]
fn plan_table_fits_the_longest_schedule_name() {
    let mut req = request("llama3-8b", "h100", 4, 16);
    req.fixed = Fixed::parse("tp=2,pp=2").unwrap();
    let p = plan(&req, &specs(&["1f1b", "interleaved_1f1b_a2a"])).unwrap();
    assert!(p
        .candidates
        .iter()
        .any(|x| x.fits && x.schedule_text().starts_with("interleaved_1f1b_a2a V=")));
    let text = schedc::plan::report(&req, &p, 10);
    let mut lines = text.lines().skip_while(|l| !l.starts_with("mesh "));
    let header = lines.next().unwrap();
    let rows: Vec<&str> = lines
        .take_while(|l| l.starts_with("tp="))
        .map(|l| l.trim_end_matches(" *"))
        .collect();
    assert!(rows.len() >= 2, "{text}");
    for r in rows {
        assert_eq!(r.len(), header.len(), "{r}\n{header}");
    }
}
