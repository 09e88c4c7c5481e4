//! `schedc plan`: recommends a pipeline degree and schedule for a cluster and a model, from
//! the specs in `specs/`, `schedc check` and the simulator, with the reasoning shown.
//!
//! The estimate, in order (every constant is printed with the plan):
//! * **Parallelism.** Dense models use tensor parallelism across a node (TP = GPUs per node);
//!   MoE models shard the routed experts across a node (EP = GPUs per node, TP = 1).
//!   Pipeline degree PP in {1, 2, 4, ...} dividing the node count; data parallelism
//!   DP = GPUs / (PP * TP).
//! * **Micro-batches.** M = global batch tokens / (DP * sequence length) per pipeline.
//! * **Compute.** Forward FLOPs per token = 2 * active parameters (Kaplan et al. 2020, §2.1);
//!   input-gradient backward B = forward and weight-gradient backward W = forward (the
//!   backward is 2x the forward). A stage holds 1/PP of the layers; time = FLOPs / (GPUs
//!   sharing the stage * peak * MFU).
//! * **MoE all-to-all.** Dispatch and combine each move `tokens * hidden * top_k * 2 bytes`
//!   across the interconnect per micro-batch (forward and backward). Schedules without an
//!   overlapped F&B pay them on the critical path; DualPipe's F&B chunk hides them under the
//!   other micro-batch's compute: F&B = max(F + BW, all-to-all time of both).
//! * **Pipeline messages.** One activation (`tokens * hidden * 2 bytes`) per stage boundary.
//! * **Memory per GPU.** Weights and gradients (bf16, 2 + 2 bytes per parameter) and Adam
//!   state with fp32 master weights (12 bytes) of the parameters it holds (the non-expert
//!   share /TP and the expert share /EP, per stage); DualPipe and DualPipeV hold two stages,
//!   DualPipe two copies of the same layers (2x weights and gradients). Activations:
//!   `34 * seq * hidden` bytes per layer per micro-batch (Korthikanti et al. 2022, eq. 2,
//!   without recomputation, /TP), times the peak live (stage, micro-batch) count that
//!   `schedc check` proves for the schedule.
//! * **Step time** from the simulator; GPU-hours per million tokens = GPUs * step / 3600 /
//!   (tokens per step / 1e6).

use crate::check::{check, Verdict};
use crate::input::{load_spec, Overrides};
use crate::sim::cost::{CostModel, Memory, OpCosts};
use crate::sim::simulate;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// A model, as far as the plan needs it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Name.
    pub name: String,
    /// Transformer layers.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Sequence length (tokens per micro-batch).
    pub seq: u32,
    /// All parameters.
    pub total_params: f64,
    /// Parameters active per token (all, for a dense model).
    pub active_params: f64,
    /// Parameters in routed experts (0 for a dense model).
    #[serde(default)]
    pub expert_params: f64,
    /// Routed experts per MoE layer (0 for dense).
    #[serde(default)]
    pub experts: u32,
    /// Experts each token is routed to.
    #[serde(default)]
    pub top_k: u32,
}

impl ModelSpec {
    /// Checks the figures: sizes positive, expert parameters within the total, top-k within
    /// the experts. Errors name the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.layers == 0 || self.hidden == 0 || self.seq == 0 {
            return Err("layers, hidden and seq must be at least 1".into());
        }
        for (n, v) in [
            ("total_params", self.total_params),
            ("active_params", self.active_params),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("`{n}` must be a positive number, got {v}"));
            }
        }
        if !(self.expert_params.is_finite()
            && self.expert_params >= 0.0
            && self.expert_params < self.total_params)
        {
            return Err(format!(
                "`expert_params` must be at least 0 and below total_params, got {}",
                self.expert_params
            ));
        }
        if self.active_params > self.total_params {
            return Err("`active_params` cannot exceed `total_params`".into());
        }
        if self.experts > 0 && (self.top_k == 0 || self.top_k > self.experts) {
            return Err(format!(
                "`top_k` must be in 1..={} for {} experts",
                self.experts, self.experts
            ));
        }
        Ok(())
    }

    /// True for MoE.
    pub fn is_moe(&self) -> bool {
        self.experts > 0
    }
}

/// The shipped model presets.
pub fn preset(name: &str) -> Option<ModelSpec> {
    match name {
        // DeepSeek-V3 (arXiv 2412.19437, §2 and §4.2): 671B total, 37B active, 61 layers,
        // hidden 7168, 256 routed experts of which 8 active (plus one shared expert).
        // Routed-expert parameters: 58 MoE layers * 256 experts * 3 * 7168 * 2048.
        "dsv3" | "deepseek-v3" => Some(ModelSpec {
            name: "DeepSeek-V3-like MoE (671B total, 37B active)".into(),
            layers: 61,
            hidden: 7168,
            seq: 4096,
            total_params: 671e9,
            active_params: 37e9,
            expert_params: 58.0 * 256.0 * 3.0 * 7168.0 * 2048.0,
            experts: 256,
            top_k: 8,
        }),
        // Llama-2/3-70B-like dense model: 80 layers, hidden 8192.
        "dense70b" | "llama70b" => Some(ModelSpec {
            name: "70B dense".into(),
            layers: 80,
            hidden: 8192,
            seq: 4096,
            total_params: 70e9,
            active_params: 70e9,
            expert_params: 0.0,
            experts: 0,
            top_k: 0,
        }),
        _ => None,
    }
}

/// The cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// GPUs in all.
    pub gpus: u32,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Memory per GPU, bytes.
    pub gpu_memory: f64,
    /// Peak dense bf16 throughput per GPU, FLOP/s.
    pub peak_flops: f64,
    /// Model FLOPs utilization assumed for compute.
    pub mfu: f64,
    /// Inter-node bandwidth per GPU, bytes/s.
    pub inter_bw: f64,
    /// Per-message latency, seconds.
    pub latency: f64,
    /// Tokens per optimizer step.
    pub global_batch_tokens: f64,
    /// Expert-parallel degree for MoE models (default: GPUs per node).
    pub ep: Option<u32>,
}

/// An interconnect by name: (bytes/s per GPU, latency s).
pub fn interconnect(name: &str) -> Option<(f64, f64)> {
    match name {
        "ib400" => Some((50e9, 5e-6)),
        "ib200" => Some((25e9, 5e-6)),
        "roce100" => Some((12.5e9, 1e-5)),
        "ib800" => Some((100e9, 4e-6)),
        _ => None,
    }
}

/// One evaluated option.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    /// Spec name.
    pub schedule: String,
    /// Pipeline degree (GPUs per pipeline).
    pub pp: u32,
    /// Micro-batches per step.
    pub microbatches: u32,
    /// Step time, seconds.
    pub step_seconds: f64,
    /// Bubble, idle / (busy + idle).
    pub bubble: f64,
    /// Peak memory per GPU, bytes.
    pub memory_bytes: f64,
    /// Whether it fits.
    pub fits: bool,
    /// GPU-hours per million tokens.
    pub gpu_hours_per_mtok: f64,
}

/// The plan.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// All candidates evaluated.
    pub candidates: Vec<Candidate>,
    /// Index of the recommendation in `candidates`.
    pub best: Option<usize>,
    /// The reasoning, one line each.
    pub reasoning: Vec<String>,
}

const SCHEDULES: &[&str] = &[
    "1f1b",
    "zb_h1",
    "interleaved_1f1b",
    "zbv",
    "dualpipe",
    "dualpipev",
];

/// Bytes of weights, gradients and optimizer state per parameter (bf16 weights and
/// gradients, fp32 master weights and Adam moments).
const BYTES_WG: f64 = 4.0;
const BYTES_OPT: f64 = 12.0;

/// Evaluates every schedule and pipeline degree; `specs` is the spec directory.
///
/// Errors: an unreadable spec directory.
pub fn plan(model: &ModelSpec, c: &Cluster, specs: &str) -> Result<Plan, String> {
    let mut why = Vec::new();
    let moe = model.is_moe();
    let g = c.gpus_per_node;
    let (tp, ep) = if moe {
        (1, c.ep.unwrap_or(g).min(model.experts.max(1)))
    } else {
        (g, 1)
    };
    why.push(format!(
        "{}: {} layers, hidden {}, {:.0}B parameters ({:.0}B active){}",
        model.name,
        model.layers,
        model.hidden,
        model.total_params / 1e9,
        model.active_params / 1e9,
        if moe {
            format!(
                ", {:.0}B in {} routed experts (top-{})",
                model.expert_params / 1e9,
                model.experts,
                model.top_k
            )
        } else {
            String::new()
        }
    ));
    why.push(if moe {
        format!("MoE: routed experts sharded over EP = {ep} GPUs, no tensor parallelism")
    } else {
        format!("dense: tensor parallelism across each node (TP = {tp})")
    });
    let nodes = (c.gpus / g).max(1);
    let tokens_mb = model.seq as f64;
    let flops_tok = 2.0 * model.active_params;
    let dense_params = model.total_params - model.expert_params;
    let mut out = Vec::new();
    let mut pp = 1u32;
    while pp <= nodes.min(model.layers) {
        if !nodes.is_multiple_of(pp) {
            pp *= 2;
            continue;
        }
        let dp = c.gpus / (pp * tp);
        let m = (c.global_batch_tokens / (dp as f64 * tokens_mb))
            .round()
            .max(1.0) as u32;
        for &sched in SCHEDULES {
            // DualPipeV runs 2*pp' stages on pp' GPUs: to compare at equal stage count it
            // uses pp GPUs with 2pp stages, like ZB-V.
            let (stages_per_gpu, copies) = match sched {
                "interleaved_1f1b" | "zbv" | "dualpipev" => (2.0, 1.0),
                "dualpipe" => (2.0, 2.0),
                _ => (1.0, 1.0),
            };
            let stage_frac = if sched == "dualpipe" {
                1.0 / pp as f64
            } else {
                1.0 / (pp as f64 * stages_per_gpu)
            };
            let width = tp as f64; // GPUs sharing one stage's compute
            let f = flops_tok * tokens_mb * stage_frac / (width * c.peak_flops * c.mfu);
            let msg = tokens_mb * model.hidden as f64 * 2.0 / tp as f64;
            let a2a = if moe {
                // dispatch + combine, forward; the same again in the backward.
                let layers_stage = model.layers as f64 * stage_frac;
                2.0 * layers_stage * tokens_mb * model.hidden as f64 * model.top_k as f64 * 2.0
                    / c.inter_bw
            } else {
                0.0
            };
            let overlapped = matches!(sched, "dualpipe" | "dualpipev");
            let cost = CostModel {
                compute: crate::sim::cost::ComputeCosts {
                    all: OpCosts {
                        f: Some(f + if overlapped { 0.0 } else { a2a }),
                        b: Some(f + if overlapped { 0.0 } else { a2a }),
                        w: Some(f),
                        bw: None,
                        fb: if overlapped {
                            Some((3.0 * f).max(2.0 * a2a))
                        } else {
                            None
                        },
                    },
                    stage: Default::default(),
                },
                p2p: crate::sim::cost::P2p {
                    latency: c.latency,
                    bandwidth: c.inter_bw,
                    bytes: Some(msg),
                },
                model: None,
                moe: Default::default(),
                memory: Memory {
                    activation_bytes: 34.0
                        * tokens_mb
                        * model.hidden as f64
                        * model.layers as f64
                        * stage_frac
                        / tp as f64,
                    released_at_b: 0.5,
                    param_bytes: 0.0,
                    grad_bytes: 0.0,
                    optimizer_bytes: 0.0,
                },
                op_scale: None,
            };
            let ranks = pp;
            let path = std::path::Path::new(specs).join(format!("{sched}.sched"));
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            // DualPipe sends half the micro-batches each way: an even M.
            let m = if sched == "dualpipe" && m % 2 == 1 {
                (m - 1).max(2)
            } else {
                m
            };
            let ov = Overrides {
                pp: Some(ranks),
                microbatches: Some(m),
                vpp: if sched == "interleaved_1f1b" {
                    Some(2)
                } else {
                    None
                },
                ..Default::default()
            };
            let Ok(e) = load_spec(&text, &ov) else {
                continue;
            };
            let chk = check(&e.program, None, &Default::default());
            if chk.report.verdict != Verdict::Accepted {
                continue;
            }
            let Ok(res) = simulate(chk.checked.as_ref().expect("lowered"), &cost) else {
                continue;
            };
            let stage_params_dense = dense_params * stage_frac / tp as f64;
            let stage_params_exp = model.expert_params * stage_frac / ep as f64;
            let per_stage = stage_params_dense + stage_params_exp;
            let held = stages_per_gpu.max(1.0);
            let static_b = per_stage * held * BYTES_WG + per_stage * held / copies * BYTES_OPT;
            let act = res
                .ranks
                .iter()
                .map(|r| r.peak_activation_bytes)
                .fold(0.0, f64::max);
            let mem = static_b + act;
            let tokens_step = m as f64 * tokens_mb * dp as f64;
            out.push(Candidate {
                schedule: sched.to_string(),
                pp,
                microbatches: m,
                step_seconds: res.makespan,
                bubble: res.bubble_ratio,
                memory_bytes: mem,
                fits: mem <= c.gpu_memory,
                gpu_hours_per_mtok: c.gpus as f64 * res.makespan / 3600.0 / (tokens_step / 1e6),
            });
        }
        pp *= 2;
    }
    let best = out
        .iter()
        .enumerate()
        .filter(|(_, x)| x.fits && x.pp > 1)
        .min_by(|a, b| a.1.step_seconds.total_cmp(&b.1.step_seconds))
        .map(|(i, _)| i);
    why.push(format!(
        "compute: 2 x {:.0}B active FLOPs per token at {:.0}% MFU of {:.0} TFLOP/s; B = W = F",
        model.active_params / 1e9,
        c.mfu * 100.0,
        c.peak_flops / 1e12
    ));
    why.push(format!(
        "{} GPUs, {} per node, {:.0} GB each; {:.1} M tokens per step",
        c.gpus,
        g,
        c.gpu_memory / 1e9,
        c.global_batch_tokens / 1e6
    ));
    Ok(Plan {
        candidates: out,
        best,
        reasoning: why,
    })
}

/// The parameter overhead of DualPipe's second copy per GPU: bytes of weights and gradients
/// of one more copy of the rank's stages.
pub fn dualpipe_overhead(model: &ModelSpec, pp: u32, gpus_per_node: u32, ep: Option<u32>) -> f64 {
    let (tp, ep) = if model.is_moe() {
        (1, ep.unwrap_or(gpus_per_node).min(model.experts.max(1)))
    } else {
        (gpus_per_node, 1)
    };
    let dense = (model.total_params - model.expert_params) / pp as f64 / tp as f64;
    let experts = model.expert_params / pp as f64 / ep as f64;
    (dense + experts) * BYTES_WG
}

/// The human report.
pub fn report(model: &ModelSpec, c: &Cluster, p: &Plan) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "reasoning:");
    for w in &p.reasoning {
        let _ = writeln!(o, "  - {w}");
    }
    let _ = writeln!(
        o,
        "\n{:>4} {:<18} {:>6} {:>10} {:>8} {:>10} {:>6} {:>14}",
        "PP", "schedule", "M", "step (s)", "bubble", "mem (GB)", "fits", "GPU-h / Mtok"
    );
    let mut rows: Vec<&Candidate> = p.candidates.iter().collect();
    rows.sort_by_key(|a| (a.pp, a.step_seconds.to_bits()));
    for x in rows {
        let _ = writeln!(
            o,
            "{:>4} {:<18} {:>6} {:>10.3} {:>7.1}% {:>10.1} {:>6} {:>14.3}",
            x.pp,
            x.schedule,
            x.microbatches,
            x.step_seconds,
            100.0 * x.bubble,
            x.memory_bytes / 1e9,
            if x.fits { "yes" } else { "no" },
            x.gpu_hours_per_mtok
        );
    }
    match p.best {
        Some(i) => {
            let b = &p.candidates[i];
            let base = p
                .candidates
                .iter()
                .find(|x| x.pp == b.pp && x.schedule == "1f1b")
                .map(|x| x.gpu_hours_per_mtok);
            let _ = writeln!(
                o,
                "\nrecommendation: PP = {} with {}: step {:.3} s, bubble {:.1}%, {:.1} GB per GPU",
                b.pp,
                b.schedule,
                b.step_seconds,
                100.0 * b.bubble,
                b.memory_bytes / 1e9
            );
            if let Some(base) = base {
                let _ = writeln!(
                    o,
                    "  saves {:.3} GPU-hours per million tokens against 1F1B at the same PP ({:.1}%)",
                    base - b.gpu_hours_per_mtok,
                    100.0 * (base - b.gpu_hours_per_mtok) / base
                );
            }
            let extra = dualpipe_overhead(model, b.pp, c.gpus_per_node, c.ep);
            let base_mem = p
                .candidates
                .iter()
                .find(|x| x.pp == b.pp && x.schedule == "1f1b")
                .map(|x| x.memory_bytes);
            let _ = writeln!(
                o,
                "  DualPipe's second parameter copy at PP = {}: {:.2} GB per GPU (weights and gradients){}{}",
                b.pp,
                extra / 1e9,
                match base_mem {
                    Some(m) => format!(", {:.1}% of 1F1B's {:.1} GB per GPU", 100.0 * extra / m, m / 1e9),
                    None => String::new(),
                },
                if model.is_moe() { "; small because the experts, most of the parameters, are sharded by EP" } else { "" }
            );
        }
        None => {
            let _ = writeln!(
                o,
                "\nno pipelined configuration fits in {:.0} GB per GPU",
                c.gpu_memory / 1e9
            );
        }
    }
    o
}
