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
        intra_bw: schedc::plan::DEFAULT_INTRA_BW,
        latency: lat,
        global_batch_tokens: 4e6,
        ep,
    }
}

fn specs() -> Vec<(String, String)> {
    schedc::specs::standard_library_owned()
}

#[test]
fn recommendations_fit_and_beat_1f1b() {
    for (model, gpus, ep) in [("dsv3", 2048, Some(64)), ("dense70b", 128, None)] {
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
        assert!(
            b.gpu_hours_per_mtok <= base.gpu_hours_per_mtok + 1e-12,
            "{model}"
        );
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

// Issue 11, item 1: an EP group must fit in the GPUs of one stage and divide the experts.
#[test]
fn ep_must_fit_in_a_stage_and_divide_the_experts() {
    let m = preset("dsv3").unwrap();
    let p = plan(&m, &cluster(256, Some(64)), &specs()).unwrap();
    // 256 GPUs: PP = 8 leaves 32 GPUs per stage, fewer than EP = 64.
    assert!(p.candidates.iter().all(|x| x.pp <= 4), "{:?}", p.candidates);
    for pp in [8, 16, 32] {
        let s = p
            .skipped
            .iter()
            .find(|s| s.pp == pp && s.schedule == "*")
            .unwrap_or_else(|| panic!("PP = {pp} not listed as skipped"));
        assert!(s.why.contains("EP = 64"), "{}", s.why);
    }
    // Nothing fits at PP <= 4 in 80 GB: no recommendation rather than an impossible one.
    assert_eq!(p.best, None);
    let err = |gpus, ep| cluster(gpus, Some(ep)).validate(&m).unwrap_err();
    assert!(err(8, 1000).contains("exceeds the 256 routed experts"));
    assert!(err(8, 3).contains("does not divide the 256"));
    assert!(err(8, 0).contains("at least 1"));
    assert!(cluster(8, Some(8)).validate(&m).is_ok());
}

// Item 2: the all-to-all goes over NVLink when the EP group fits in a node, and every F and
// B pays it except inside an overlapped F&B pair.
#[test]
fn all_to_all_pricing() {
    let m = preset("dsv3").unwrap();
    let mut c = cluster(512, Some(8));
    let bytes = 4096.0 * 7168.0 * 8.0 * 2.0;
    let (intra, why) = c.all_to_all(&m, 8);
    assert!(why.contains("fits in a node"), "{why}");
    assert!((intra - (bytes * 7.0 / 8.0 / 160e9 + c.latency)).abs() < 1e-12);
    let (inter, why) = c.all_to_all(&m, 64);
    assert!(why.contains("spans 8 nodes"), "{why}");
    assert!((inter - (bytes * 56.0 / 64.0 / 50e9 + c.latency)).abs() < 1e-12);
    // 64 GPUs per node: EP = 8 (and 64) within a node; the issue saw equal numbers.
    c.gpus_per_node = 64;
    assert_eq!(c.all_to_all(&m, 8).0, intra);
    assert!(c.all_to_all(&m, 64).0 < inter);
    // Op times are compute only; the all-to-alls are the simulator's [moe] figures: a
    // dispatch and a combine of every layer of the stage per op.
    let c = cluster(512, Some(8));
    let ops = schedc::plan::op_costs(&m, &c, 1.0 / 16.0);
    let f = 2.0 * 37e9 * 4096.0 / 16.0 / (989e12 * 0.4);
    assert!((ops.f.unwrap() - f).abs() < 1e-12);
    assert!((ops.b.unwrap() - f).abs() < 1e-12);
    assert!((ops.w.unwrap() - f).abs() < 1e-12);
    assert_eq!(ops.fb, None);
    let moe = schedc::plan::moe_costs(&m, &c, 1.0 / 16.0, 8);
    assert!(moe.present);
    assert!((moe.dispatch - 61.0 / 16.0 * intra).abs() < 1e-12);
    assert_eq!(moe.dispatch, moe.combine);
}

// Item 2: plan prices the all-to-all through the simulator's MoE model. Each candidate's
// step and exposed all-to-all are those of `schedc sim --moe=all` on the same instance and
// cost model; a plain schedule (1F1B) exposes all of it, DualPipe's overlapped pairs hide
// most of it, and an EP group within a node is faster than one across nodes.
#[test]
fn plan_prices_through_the_simulator() {
    let m = preset("dsv3").unwrap();
    let lib = specs();
    let few: Vec<(String, String)> = lib
        .iter()
        .filter(|(n, _)| n == "1f1b" || n == "dualpipe")
        .cloned()
        .collect();
    let c = cluster(256, Some(8));
    let p = plan(&m, &c, &few).unwrap();
    let at = |p: &schedc::plan::Plan, s: &str, pp: u32| {
        p.candidates
            .iter()
            .find(|x| x.schedule == s && x.pp == pp)
            .cloned()
            .unwrap_or_else(|| panic!("{s} at PP = {pp}"))
    };
    let one = at(&p, "1f1b", 8);
    let dual = at(&p, "dualpipe", 8);
    assert!((one.a2a_exposed - 1.0).abs() < 1e-9, "{}", one.a2a_exposed);
    assert!(dual.a2a_exposed < 0.5, "{}", dual.a2a_exposed);
    // The same instance simulated directly, in parts, with the plan's cost model.
    let text = &few.iter().find(|(n, _)| n == "1f1b").unwrap().1;
    let ov = schedc::input::Overrides {
        pp: Some(8),
        microbatches: Some(one.microbatches),
        ..Default::default()
    };
    let e = schedc::input::load_spec(text, &ov).unwrap();
    let (split, _) =
        schedc::input::apply_moe(&e.program, None, &schedc::moe::MoeStages::All).unwrap();
    let chk = schedc::check::check(&split, None, &Default::default());
    let stage_frac = 1.0 / 8.0;
    let cost = schedc::sim::cost::CostModel {
        compute: schedc::sim::cost::ComputeCosts {
            all: schedc::plan::op_costs(&m, &c, stage_frac),
            stage: Default::default(),
        },
        p2p: schedc::sim::cost::P2p {
            latency: c.latency,
            bandwidth: c.inter_bw,
            bytes: Some(4096.0 * 7168.0 * 2.0),
        },
        model: None,
        moe: schedc::plan::moe_costs(&m, &c, stage_frac, 8),
        memory: Default::default(),
        op_scale: None,
    };
    let res = schedc::sim::simulate(chk.checked.as_ref().unwrap(), &cost).unwrap();
    assert!(
        (res.makespan - one.step_seconds).abs() < 1e-9 * res.makespan,
        "{} vs {}",
        res.makespan,
        one.step_seconds
    );
    assert!((res.a2a.exposed_fraction() - one.a2a_exposed).abs() < 1e-12);
    // 64 GPUs per node: the EP group of 8 was already within a node, so nothing changes;
    // EP = 64 across nodes is slower than within a 64-GPU node.
    let mut wide = cluster(256, Some(64));
    let across = at(&plan(&m, &wide, &few).unwrap(), "1f1b", 4);
    wide.gpus_per_node = 64;
    let within = at(&plan(&m, &wide, &few).unwrap(), "1f1b", 4);
    assert!(
        within.step_seconds < across.step_seconds,
        "{} vs {}",
        within.step_seconds,
        across.step_seconds
    );
}

// Items 2 and 17: the reasoning states the all-to-all assumption, every spec of the library
// is either evaluated or listed with the reason, and the headline is recomputed from them.
#[test]
fn plan_lists_what_it_skipped_and_states_its_assumptions() {
    let m = preset("dsv3").unwrap();
    let c = cluster(2048, Some(64));
    let p = plan(&m, &c, &specs()).unwrap();
    let text = p.reasoning.join("\n");
    assert!(
        text.contains("MoE all-to-all") && text.contains("spans 8 nodes"),
        "{text}"
    );
    let pps: std::collections::BTreeSet<u32> = p
        .candidates
        .iter()
        .map(|x| x.pp)
        .chain(p.skipped.iter().map(|s| s.pp))
        .collect();
    for pp in pps {
        for (name, _) in specs() {
            let seen = p
                .candidates
                .iter()
                .any(|x| x.pp == pp && x.schedule == name)
                || p.skipped
                    .iter()
                    .any(|s| s.pp == pp && (s.schedule == name || s.schedule == "*"));
            assert!(seen, "{name} at PP = {pp} is neither evaluated nor listed");
        }
    }
    let report = schedc::plan::report(&m, &c, &p);
    assert!(report.contains("not evaluated:"), "{report}");
    let b = &p.candidates[p.best.unwrap()];
    let base = p
        .candidates
        .iter()
        .find(|x| x.pp == b.pp && x.schedule == "1f1b")
        .unwrap();
    let pct = 100.0 * (base.gpu_hours_per_mtok - b.gpu_hours_per_mtok) / base.gpu_hours_per_mtok;
    assert!(
        report.contains(&format!("against 1F1B at the same PP ({pct:.1}%)")),
        "{report}"
    );
}

// Item 18: bad inputs are refused instead of giving infinite times or another batch.
#[test]
fn bad_plan_inputs_are_refused() {
    let moe = preset("dsv3").unwrap();
    let dense = preset("dense70b").unwrap();
    let with = |f: &dyn Fn(&mut Cluster)| {
        let mut c = cluster(128, None);
        f(&mut c);
        c
    };
    assert!(with(&|c| c.peak_flops = 0.0).validate(&dense).is_err());
    assert!(with(&|c| c.gpu_memory = 0.0).validate(&dense).is_err());
    assert!(with(&|c| c.mfu = 1.5).validate(&dense).is_err());
    assert!(with(&|c| c.global_batch_tokens = f64::NAN)
        .validate(&dense)
        .is_err());
    let e = with(&|c| c.ep = Some(8)).validate(&dense).unwrap_err();
    assert!(e.contains("--ep applies to MoE models"), "{e}");
    // A batch smaller than one sequence per replica: no configuration, with the reason.
    let e = plan(&dense, &with(&|c| c.global_batch_tokens = 1.0), &specs()).unwrap_err();
    assert!(e.contains("less than one sequence"), "{e}");
    let e = plan(&moe, &with(&|c| c.gpus = 1 << 30), &specs()).unwrap_err();
    assert!(e.contains("less than one sequence"), "{e}");
}

/// issue 22 item 7: the table's schedule column fits the longest name of the standard library
/// (`interleaved_1f1b_a2a`, 20 characters, wider than the 18 it had): every row is as long as
/// the header, so the columns stay aligned.
#[test]
fn plan_table_fits_the_longest_schedule_name() {
    let m = preset("dsv3").unwrap();
    let c = cluster(2048, Some(64));
    let p = plan(&m, &c, &specs()).unwrap();
    assert!(p
        .candidates
        .iter()
        .any(|x| x.schedule == "interleaved_1f1b_a2a"));
    let text = schedc::plan::report(&m, &c, &p);
    let header = text.lines().find(|l| l.contains("GPU-h / Mtok")).unwrap();
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.split_whitespace().count() >= 9)
        .filter(|l| l.trim_start().starts_with(|ch: char| ch.is_ascii_digit()))
        .map(|l| l.trim_end_matches("  *"))
        .collect();
    assert!(rows.len() > 20, "{text}");
    for r in rows {
        assert_eq!(r.len(), header.len(), "{r}\n{header}");
    }
}
