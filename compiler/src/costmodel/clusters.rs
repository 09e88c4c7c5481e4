//! Published measurements of real clusters, as runs of the cost model: each function sets up
//! the measured configuration (what the source leaves unsaid is an assumption, stated here
//! and in the book) and evaluates a standard-library schedule on it. The tests and the
//! `calibrate` example hold the predictions against the figures.

use super::{
    arch, evaluate, hardware::Hardware, layout, Efficiency, Evaluation, Instance, Training,
};

/// One evaluated configuration.
#[derive(Clone, Debug)]
pub struct Run {
    /// The evaluation.
    pub run: Evaluation,
    /// Sequences per step over all GPUs.
    pub sequences_per_step: f64,
}

impl Run {
    /// Sequences per second over all GPUs.
    pub fn samples_per_second(&self) -> f64 {
        self.sequences_per_step / self.run.step.step_seconds
    }
    /// Tokens per second per GPU.
    pub fn tokens_per_gpu_second(&self) -> f64 {
        self.run.step.tokens_per_second / self.run.derived.gpus as f64
    }
}

fn spec(name: &str) -> &'static str {
    crate::specs::get(name).unwrap_or_else(|| panic!("standard spec {name}"))
}

#[allow(clippy::too_many_arguments)]
fn run(
    model: &str,
    hw: &str,
    schedule: &str,
    vpp: Option<u32>,
    mb: u32,
    moe: bool,
    tr: Training,
    eff: &Efficiency,
) -> Run {
    let a = arch::preset(model).expect("model preset");
    let h = Hardware::preset(hw).expect("hardware preset");
    let inst = Instance {
        name: schedule,
        text: spec(schedule),
        pp: tr.mesh.pp,
        mb,
        vpp,
        moe: moe.then_some("auto"),
    };
    let r = evaluate(&inst, &a, &h, &tr, eff)
        .unwrap_or_else(|e| panic!("{model} {schedule} on {hw}: {e}"));
    let seqs = r.derived.tokens_per_step / tr.seq as f64;
    Run {
        run: r,
        sequences_per_step: seqs,
    }
}

fn mesh(tp: u32, pp: u32, ep: u32, dp: u32) -> layout::Mesh {
    layout::Mesh {
        tp,
        pp,
        ep,
        dp,
        cp: 1,
    }
}

/// sail-sg/zero-bubble-pipeline-parallelism#21: 8 x H800, "6.2B". The thread gives neither
/// the model's shape nor the batch; assumed: the Zero Bubble paper's 6.2B (arXiv 2401.10241
/// Table 3: 30 layers, 32 heads, hidden 4096, sequence 1024; the repository's script puts
/// one layer fewer on the first and last stage), PP 8, 24 micro-batches (the paper's and
/// the script's `3 * PP`), micro-batch size 4 (the one of 1, 2, 3, 4 whose 1F1B memory is
/// nearest the reported 48 GB), fp16, Megatron-LM's eager attention (the paper's memory
/// figures need stored scores), no recomputation, no distributed optimizer; interleaved
/// 1F1B at its maximum virtual stages (the reporter's words: one layer per chunk, V = 4);
/// ZB-2P as ZB-H2 (the handcrafted schedule at ZB-2P's 2P memory); ZB-V as `zbv`.
/// `schedule`: 1f1b, interleaved_1f1b, zb_h2 or zbv.
pub fn zb_issue21(eff: &Efficiency, schedule: &str) -> Run {
    zb_6_2b("h800", schedule, 4, 24, eff)
}

/// The Zero Bubble paper's 6.2B runs (arXiv 2401.10241 §5.1, Tables 3 and 4): 8 x A100
/// SXM 80GB, micro-batch size 3, `mb` in 24, 32, 64, eager attention (as
/// [`zb_issue21`]). `schedule`: 1f1b, interleaved_1f1b (one layer per chunk), zb_h1 (as
/// ZB-1p, the same memory) or zb_h2 (as ZB-2p).
pub fn zb_paper_a100(eff: &Efficiency, schedule: &str, mb: u32) -> Run {
    zb_6_2b("a100", schedule, 3, mb, eff)
}

fn zb_6_2b(hw: &str, schedule: &str, mbs: u64, mb: u32, eff: &Efficiency) -> Run {
    let tr = Training {
        mesh: mesh(1, 8, 1, 1),
        seq: 1024,
        micro_batch_size: mbs,
        recompute: layout::Recompute::None,
        distributed_optimizer: false,
        dtype: layout::Dtype::Bf16,
        layout: None,
        flash_attention: false,
        a2a: Default::default(),
    };
    let vpp = (schedule == "interleaved_1f1b").then_some(4);
    run("zb-6.2b", hw, schedule, vpp, mb, false, tr, eff)
}

/// DeepSeek-V3's pre-training (arXiv 2412.19437 §3.2, §4.2): 2048 H800, PP 16 under
/// DualPipe, EP 64 over 8 nodes, ZeRO-1 over DP 128, fp8, RMSNorm and MLA up-projections
/// recomputed, sequence 4096, 15360 sequences per step (120 micro-batches of one sequence
/// per pipeline: `--mb 120`, which DualPipe feeds 60 from each end), node-limited routing to 4 nodes. The
/// report gives no layer split for PP 16; assumed `Et*3|(t*4|)*14,t*2mL` (the MTP module
/// with the head, on the embedding's rank under DualPipe, as §3.2.3 says). `schedule`:
/// dualpipe, or 1f1b for the counterfactual.
pub fn dsv3_h800(eff: &Efficiency, schedule: &str) -> Run {
    let tr = Training {
        mesh: mesh(1, 16, 64, 128),
        seq: 4096,
        micro_batch_size: 1,
        recompute: layout::Recompute::Selective,
        distributed_optimizer: true,
        dtype: layout::Dtype::Fp8,
        layout: Some("Et*3|(t*4|)*14,t*2mL".into()),
        flash_attention: true,
        a2a: Default::default(),
    };
    run("dsv3", "h800", schedule, None, 120, true, tr, eff)
}

/// A Megatron-Bridge H100 performance row (docs/performance-summary-archive.md): FP8,
/// micro-batch size 1, the recipe's TP/PP/VP/EP; interleaved 1F1B (plain 1F1B without PP;
/// `interleaved_1f1b_a2a`, Megatron-Core's combined 1F1B, where the recipe overlaps the
/// all-to-all).
/// `which`: `qwen3-235b` (26.04.01: 256 GPUs, TP2 PP8 VP4 EP32, GBS 8192, seq 4096: 1712
/// tokens/s/GPU), `dsv3` (25.09: 1024 GPUs, TP2 PP8 VP4 EP64, GBS 8192, layout
/// `Et|(tt|)*30mL`, MLA up-projections and MLP recomputed: 1297), `llama3-70b` (25.11: 64
/// GPUs, TP4 PP8 VP5, GBS 128, seq 8192: 1602), `llama3-8b` (25.11: 8 GPUs, FSDP as DP 8
/// with the optimizer sharded, GBS 128, seq 8192: 14451).
pub fn bridge_h100(eff: &Efficiency, which: &str) -> Run {
    let base = |m: layout::Mesh, seq: u64| Training {
        mesh: m,
        seq,
        micro_batch_size: 1,
        recompute: layout::Recompute::None,
        distributed_optimizer: true,
        dtype: layout::Dtype::Fp8,
        layout: None,
        flash_attention: true,
        a2a: Default::default(),
    };
    match which {
        "qwen3-235b" => {
            let tr = base(mesh(2, 8, 32, 16), 4096);
            // The recipe overlaps the EP all-to-all (`overlap_moe_expert_parallel_comm`):
            // Megatron-Core's combined 1F1B.
            run(
                "qwen3-235b-a22b",
                "h100",
                "interleaved_1f1b_a2a",
                Some(4),
                512,
                true,
                tr,
                eff,
            )
        }
        "dsv3" => {
            let mut tr = base(mesh(2, 8, 64, 64), 4096);
            tr.layout = Some("Et|(tt|)*30mL".into());
            tr.recompute = layout::Recompute::Selective;
            run(
                "dsv3",
                "h100",
                "interleaved_1f1b",
                Some(4),
                128,
                true,
                tr,
                eff,
            )
        }
        "llama3-70b" => {
            let tr = base(mesh(4, 8, 1, 2), 8192);
            run(
                "llama3-70b",
                "h100",
                "interleaved_1f1b",
                Some(5),
                64,
                false,
                tr,
                eff,
            )
        }
        "llama3-8b" => {
            let tr = base(mesh(1, 1, 1, 8), 8192);
            run("llama3-8b", "h100", "1f1b", None, 16, false, tr, eff)
        }
        _ => panic!("unknown Megatron-Bridge row {which}"),
    }
}

/// DeepEP's benchmark (README legacy table): 4096 tokens per GPU, hidden 7168, top-8 of 256
/// experts in 4 of 8 node groups, fp8 dispatch, bf16 combine, on H800 with EP `ep` (8:
/// one node, NVLink; 16, 32, 64: across nodes, RDMA): the bandwidth DeepEP reports, the
/// bottleneck link's bytes over the all-to-all's time, GB/s.
pub fn deepep_bandwidth(ep: u32, combine: bool) -> f64 {
    let a = arch::preset("dsv3").expect("dsv3");
    let h = Hardware::preset("h800").expect("h800");
    let m = mesh(1, 1, ep, ep);
    let eff = Efficiency {
        latency: 0.0,
        ..Efficiency::default()
    };
    let dtype = layout::Dtype::Fp8;
    let q = super::AllToAll {
        mesh: &m,
        tokens: 4096.0,
        dtype,
        combine,
        a2a: layout::A2a::Hierarchical,
    };
    let (t, net, nvl) = super::all_to_all_seconds(&a, &h, &q, &eff);
    let bytes = if ep <= 8 { nvl } else { net };
    bytes / t / 1e9
}

/// The report's table: every row, measured against predicted.
pub fn table(eff: &Efficiency) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "sail-sg/zero-bubble-pipeline-parallelism#21 (8 x H800, 6.2B; assumptions in clusters::zb_issue21)");
    let _ = writeln!(s, "| schedule | samples/s measured | predicted | ratio to 1F1B measured | predicted | memory GB measured | predicted |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    let base = zb_issue21(eff, "1f1b").samples_per_second();
    for (name, label, sps, mem) in [
        ("1f1b", "1F1B", 55.0, 48.0),
        ("interleaved_1f1b", "interleaved 1F1B", 66.0, 57.0),
        ("zb_h2", "ZB-2P (as ZB-H2)", 67.0, 79.0),
        ("zbv", "ZB-V", 64.0, 53.0),
    ] {
        let r = zb_issue21(eff, name);
        let _ = writeln!(
            s,
            "| {label} | {sps:.0} | {:.1} | {:.3} | {:.3} | {mem:.0} | {:.1} |",
            r.samples_per_second(),
            sps / 55.0,
            r.samples_per_second() / base,
            r.run.step.peak_memory_bytes / 1e9
        );
    }
    let _ = writeln!(
        s,
        "\nZero Bubble paper, 6.2B on 8 x A100 (arXiv 2401.10241 Table 4; held out)"
    );
    let _ = writeln!(
        s,
        "| schedule | m | samples/GPU/s measured | predicted | memory GB measured | predicted |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for (name, label, vals, mem) in [
        ("1f1b", "1F1B", [3.50, 3.70, 4.03], 39.0),
        ("interleaved_1f1b", "1F1B-I", [4.01, 4.08, 4.19], 48.0),
        ("zb_h1", "ZB-1p (as ZB-H1)", [3.88, 4.00, 4.20], 42.0),
        ("zb_h2", "ZB-2p (as ZB-H2)", [4.32, 4.35, 4.39], 70.0),
    ] {
        for (i, m) in [24u32, 32, 64].into_iter().enumerate() {
            let r = zb_paper_a100(eff, name, m);
            let _ = writeln!(
                s,
                "| {label} | {m} | {:.2} | {:.2} | {mem:.0} | {:.1} |",
                vals[i],
                r.samples_per_second() / 8.0,
                r.run.step.peak_memory_bytes / 1e9
            );
        }
    }
    let _ = writeln!(s, "\nDeepEP normal kernels on H800 (README legacy table)");
    let _ = writeln!(
        s,
        "| EP | dispatch GB/s measured | predicted | combine GB/s measured | predicted |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|");
    for (ep, d, c) in [
        (8, 153.0, 158.0),
        (16, 43.0, 43.0),
        (32, 58.0, 57.0),
        (64, 51.0, 50.0),
    ] {
        let _ = writeln!(
            s,
            "| {ep} | {d:.0} | {:.1} | {c:.0} | {:.1} |",
            deepep_bandwidth(ep, false),
            deepep_bandwidth(ep, true)
        );
    }
    let _ = writeln!(
        s,
        "\nDeepSeek-V3 on 2048 x H800 (assumptions in clusters::dsv3_h800)"
    );
    let dp = dsv3_h800(eff, "dualpipe");
    let f1 = dsv3_h800(eff, "1f1b");
    let c = &dp.run.derived.chunks[4];
    let _ = writeln!(
        s,
        "a middle chunk: forward compute {:.2} ms against dispatch + combine {:.2} ms (ratio {:.2}; the report: about 1:1)",
        c.f * 1e3,
        (c.dispatch + c.combine) * 1e3,
        c.f / (c.dispatch + c.combine)
    );
    for (label, r) in [("DualPipe", &dp), ("1F1B", &f1)] {
        let _ = writeln!(
            s,
            "{label}: step {:.2} s, {:.0} tokens/s/GPU (measured under DualPipe: 1543), {:.0} TFLOP/s/GPU, exposed all-to-all {:.1}% of {:.1} s, peak memory {:.1} GB",
            r.run.step.step_seconds,
            r.tokens_per_gpu_second(),
            r.run.step.tflops_per_gpu,
            100.0 * r.run.sim.a2a.exposed_fraction(),
            r.run.sim.a2a.total,
            r.run.step.peak_memory_bytes / 1e9
        );
    }
    let _ = writeln!(
        s,
        "\nMegatron-Bridge on H100, FP8 (performance-summary-archive.md; held out)"
    );
    let _ = writeln!(
        s,
        "| model | tokens/s/GPU measured | predicted | TFLOP/s/GPU measured | predicted |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|");
    for (which, tok, tf) in [
        ("qwen3-235b", 1712.0, 253.0),
        ("dsv3", 1297.0, 338.0),
        ("llama3-70b", 1602.0, 719.0),
        ("llama3-8b", 14451.0, 744.0),
    ] {
        let r = bridge_h100(eff, which);
        let _ = writeln!(
            s,
            "| {which} | {tok:.0} | {:.0} | {tf:.0} | {:.0} |",
            r.tokens_per_gpu_second(),
            r.run.step.tflops_per_gpu
        );
    }
    s
}
