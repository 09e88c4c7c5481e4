//! `schedc plan`: recommends a pipeline degree and schedule for a cluster and a model, from
//! the standard library of specs (or a directory of them), `schedc check` and the simulator,
//! with the reasoning shown and every schedule it could not use listed with the reason.
//!
//! The estimate, in order (every constant is printed with the plan):
//! * **Parallelism.** Dense models use tensor parallelism across a node (TP = GPUs per node);
//!   MoE models shard the routed experts over EP GPUs of the same stage (TP = 1), so EP must
//!   divide the routed experts and the data-parallel degree DP of the stage (the EP group is
//!   made of DP ranks). Pipeline degree PP in {1, 2, 4, ...} dividing the node count (a stage
//!   owns whole nodes), at most the layer count; DP = GPUs / (PP * TP).
//! * **Micro-batches.** M = global batch tokens / (DP * sequence length) per pipeline,
//!   rounded; a schedule that refuses that M (DualPipe needs an even M, interleaved schedules
//!   rounds of P) gets the nearest M it accepts, and the tokens per step are reported.
//! * **Compute.** Forward FLOPs per token = 2 * active parameters (Kaplan et al. 2020, §2.1);
//!   input-gradient backward B = forward and weight-gradient backward W = forward (the
//!   backward is 2x the forward). A stage holds 1/S of the layers of its direction (S
//!   stages per direction); time = FLOPs / (GPUs sharing the stage * peak * MFU).
//! * **MoE all-to-all.** Each MoE layer's dispatch and combine each move `seq * hidden *
//!   top_k * 2` bytes (bf16) per GPU per micro-batch, of which the share (EP - 1) / EP leaves
//!   the GPU. An EP group within a node goes over the intra-node links (NVLink, default 160
//!   GB/s: DeepSeek-V3, arXiv 2412.19437, §3.2.2); one spanning nodes sends the share (EP -
//!   G) / EP bound for other nodes over the inter-node links, at the same time as the rest
//!   over NVLink (the slower of the two). The simulator prices them, not a second model of
//!   the plan's own: every F, B and BW of an MoE model is split into its parts (attention,
//!   dispatch, expert MLP, combine; [`crate::moe`]), a dispatch and a combine of an op move
//!   the tokens of every layer of its stage on the rank's expert-parallel stream, and W has
//!   none. A plain op waits for its all-to-alls; only an overlapped F&B pair (DualPipe,
//!   DualPipeV: DeepSeek-V3 §3.2.1, Figure 4) hides each under the other micro-batch's
//!   compute, as far as it fits. Attention and the expert MLP take half of an op's compute
//!   each.
//! * **Pipeline messages.** One activation (`seq * hidden * 2` bytes / TP) per stage
//!   boundary over the inter-node links.
//! * **Memory per GPU.** Weights and gradients (bf16, 2 + 2 bytes per parameter) and Adam
//!   state with fp32 master weights (12 bytes) of the parameters it holds (the non-expert
//!   share /TP and the expert share /EP, per stage; no ZeRO sharding); DualPipe's two
//!   directions hold two stages each with their own weights and gradients (one optimizer
//!   state per stage of the model). Activations: `34 * seq * hidden` bytes per layer per
//!   micro-batch (Korthikanti et al. 2022, eq. 2, without recomputation, /TP), times the
//!   peak live (stage, micro-batch) count of the simulated schedule.
//! * **Step time** from the simulator (`schedc::sim`) under these op times; GPU-hours per
//!   million tokens = GPUs * step / 3600 / (tokens per step / 1e6).

use crate::check::{check, Verdict};
use crate::input::{load_spec, LoadError, Overrides};
use crate::sim::cost::{CostModel, Memory, Moe, OpCosts};
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
        if self.experts == 0 && (self.top_k > 0 || self.expert_params > 0.0) {
            return Err("a dense model (experts = 0) has no `top_k` or `expert_params`".into());
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

/// The default intra-node (NVLink) bandwidth per GPU, bytes/s: H800's 160 GB/s as
/// DeepSeek-V3 reports it (arXiv 2412.19437, §3.2.2).
pub const DEFAULT_INTRA_BW: f64 = 160e9;

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
    /// Intra-node bandwidth per GPU (NVLink), bytes/s.
    pub intra_bw: f64,
    /// Per-message latency, seconds.
    pub latency: f64,
    /// Tokens per optimizer step.
    pub global_batch_tokens: f64,
    /// Expert-parallel degree for MoE models (default: GPUs per node, or the largest
    /// divisor of the expert count below it).
    pub ep: Option<u32>,
}

impl Cluster {
    /// Checks the figures against each other and the model. Errors: the message, naming the
    /// option (`--gpus`, `--ep`, ...).
    pub fn validate(&self, model: &ModelSpec) -> Result<(), String> {
        if self.gpus == 0
            || self.gpus_per_node == 0
            || !self.gpus.is_multiple_of(self.gpus_per_node)
        {
            return Err("--gpus must be a positive multiple of --gpus-per-node".into());
        }
        let pos = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be a positive number, got {v}"))
            }
        };
        pos("--gpu-memory", self.gpu_memory)?;
        pos("--peak-tflops", self.peak_flops)?;
        pos("the inter-node bandwidth", self.inter_bw)?;
        pos("--intra-node-bandwidth", self.intra_bw)?;
        if !(self.mfu > 0.0 && self.mfu <= 1.0) {
            return Err(format!("--mfu must be in (0, 1], got {}", self.mfu));
        }
        if !(self.global_batch_tokens.is_finite() && self.global_batch_tokens >= 1.0) {
            return Err(format!(
                "--global-batch-tokens must be a positive number of tokens, got {}",
                self.global_batch_tokens
            ));
        }
        if !(self.latency.is_finite() && self.latency >= 0.0) {
            return Err(format!(
                "the latency must be at least 0, got {}",
                self.latency
            ));
        }
        match (model.is_moe(), self.ep) {
            (false, Some(_)) => Err(format!(
                "--ep applies to MoE models; `{}` is dense (it uses tensor parallelism across a node)",
                model.name
            )),
            (true, Some(0)) => Err("--ep must be at least 1".into()),
            (true, Some(ep)) if ep > model.experts => Err(format!(
                "--ep {ep} exceeds the {} routed experts: each EP rank holds at least one",
                model.experts
            )),
            (true, Some(ep)) if !model.experts.is_multiple_of(ep) => Err(format!(
                "--ep {ep} does not divide the {} routed experts: each EP rank holds the same number",
                model.experts
            )),
            (true, Some(ep)) if ep > self.gpus => Err(format!(
                "--ep {ep} exceeds the {} GPUs",
                self.gpus
            )),
            _ => Ok(()),
        }
    }

    /// The expert-parallel degree: `--ep`, else the largest divisor of the expert count that
    /// is at most the GPUs per node. 1 for a dense model.
    pub fn ep_degree(&self, model: &ModelSpec) -> u32 {
        if !model.is_moe() {
            return 1;
        }
        self.ep.unwrap_or_else(|| {
            (1..=self.gpus_per_node.min(model.experts))
                .rev()
                .find(|d| model.experts.is_multiple_of(*d))
                .unwrap_or(1)
        })
    }

    /// Seconds of one all-to-all (a dispatch or a combine of one MoE layer, one micro-batch)
    /// per GPU, and the links it uses. See the module docs.
    pub fn all_to_all(&self, model: &ModelSpec, ep: u32) -> (f64, String) {
        if !model.is_moe() || ep <= 1 {
            return (0.0, "no all-to-all (EP = 1)".into());
        }
        let bytes = model.seq as f64 * model.hidden as f64 * model.top_k as f64 * 2.0;
        let e = ep as f64;
        let g = self.gpus_per_node as f64;
        if ep <= self.gpus_per_node {
            let t = bytes * (e - 1.0) / e / self.intra_bw + self.latency;
            (
                t,
                format!(
                    "the EP group of {ep} fits in a node: NVLink at {:.0} GB/s",
                    self.intra_bw / 1e9
                ),
            )
        } else {
            let inter = bytes * (e - g) / e / self.inter_bw;
            let intra = bytes * (g - 1.0) / e / self.intra_bw;
            (
                inter.max(intra) + self.latency,
                format!(
                    "the EP group of {ep} spans {} nodes: the share bound for other nodes, {:.0}%, over the inter-node links at {:.0} GB/s",
                    ep.div_ceil(self.gpus_per_node),
                    100.0 * (e - g) / e,
                    self.inter_bw / 1e9
                ),
            )
        }
    }
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
    /// Data-parallel degree.
    pub dp: u32,
    /// Micro-batches per step.
    pub microbatches: u32,
    /// Tokens per step (M * DP * sequence length).
    pub tokens_per_step: f64,
    /// Step time, seconds.
    pub step_seconds: f64,
    /// Bubble under the `from_start` convention: idle / (busy + idle) over all ranks, one
    /// step with a barrier at both ends (Zero Bubble's convention).
    pub bubble: f64,
    /// Share of the MoE all-to-all time not hidden under compute (0 for a dense model).
    pub a2a_exposed: f64,
    /// Peak memory per GPU, bytes.
    pub memory_bytes: f64,
    /// Whether it fits.
    pub fits: bool,
    /// GPU-hours per million tokens.
    pub gpu_hours_per_mtok: f64,
    /// What was adjusted (an M the schedule accepts), if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A schedule the plan could not evaluate at a pipeline degree, and why.
#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    /// Spec name (`*` for every schedule at this PP).
    pub schedule: String,
    /// Pipeline degree.
    pub pp: u32,
    /// Why.
    pub why: String,
}

/// The plan.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// All candidates evaluated.
    pub candidates: Vec<Candidate>,
    /// Index of the recommendation in `candidates`.
    pub best: Option<usize>,
    /// What could not be evaluated, and why.
    pub skipped: Vec<Skipped>,
    /// The reasoning, one line each.
    pub reasoning: Vec<String>,
}

/// Bytes of weights, gradients and optimizer state per parameter (bf16 weights and
/// gradients, fp32 master weights and Adam moments).
const BYTES_WG: f64 = 4.0;
const BYTES_OPT: f64 = 12.0;

/// What the plan needs of a spec's header: its V (fixed, or free: 2 is tried) and whether it
/// is bidirectional.
fn spec_shape(text: &str) -> (bool, bool) {
    use crate::dsl::ast::{Item, PlacementSpec};
    match crate::dsl::parse_file(text) {
        Ok(f) => (
            f.items.iter().any(|i| matches!(i, Item::Vpp(..))),
            f.items
                .iter()
                .any(|i| matches!(i, Item::Placement(PlacementSpec::Bidir, _))),
        ),
        Err(_) => (false, false),
    }
}

/// Micro-batch counts to try for a spec, the batch's own first: the nearest even M for a
/// bidirectional spec, then multiples of P below and above (interleaved rounds), then 2P
/// (DualPipe's least), each only within a quarter of the batch's M.
fn m_candidates(m: u32, pp: u32, bidir: bool) -> Vec<u32> {
    let mut v = vec![m];
    if bidir && m % 2 == 1 {
        if m > 1 {
            v.push(m - 1);
        }
        v.push(m + 1);
    }
    let down = m / pp * pp;
    let up = m.div_ceil(pp).saturating_mul(pp);
    for x in [down, up, 2 * pp] {
        if x >= 1 && !v.contains(&x) {
            v.push(x);
        }
    }
    // Only near the batch's own M: a schedule that needs a very different M does not fit
    // this batch.
    let slack = (m / 4).max(1);
    v.retain(|&x| x.abs_diff(m) <= slack);
    v
}

/// The compute times, seconds, of the ops of a stage holding `stage_frac` of the model's
/// layers (see the module docs): F = B = W = forward FLOPs / (GPUs sharing the stage * peak
/// * MFU); BW and overlapped pairs are left to the simulator (the sum of their parts).
pub fn op_costs(model: &ModelSpec, c: &Cluster, stage_frac: f64) -> OpCosts {
    let tp = if model.is_moe() { 1 } else { c.gpus_per_node };
    let f = 2.0 * model.active_params * model.seq as f64 * stage_frac
        / (tp as f64 * c.peak_flops * c.mfu);
    OpCosts {
        f: Some(f),
        b: Some(f),
        w: Some(f),
        bw: None,
        fb: None,
    }
}

/// The simulator's `[moe]` figures for an MoE model's stage holding `stage_frac` of the
/// layers: a dispatch (and a combine) of an F, B or BW op moves the tokens of every layer of
/// the stage, `layers * stage_frac` all-to-alls of [`Cluster::all_to_all`] seconds each, on
/// the rank's expert-parallel stream; attention and the expert MLP split the op's compute
/// half and half. The simulator (`--moe` lowering, [`crate::moe`]) charges them: exposed
/// for a plain op, hidden under the other micro-batch's compute inside an overlapped F&B
/// pair as far as they fit (DeepSeek-V3, arXiv 2412.19437, §3.2.1, Figure 4).
pub fn moe_costs(model: &ModelSpec, c: &Cluster, stage_frac: f64, ep: u32) -> Moe {
    let (a2a, _) = c.all_to_all(model, ep);
    let per_op = model.layers as f64 * stage_frac * a2a;
    Moe {
        present: true,
        dispatch: per_op,
        combine: per_op,
        attn_share: 0.5,
        overlap: true,
        ..Moe::default()
    }
}

/// Evaluates every schedule of `specs` (`(name, text)`, e.g. [`crate::specs`]'s standard
/// library) at every pipeline degree.
///
/// Errors: a cluster [`Cluster::validate`] refuses, an instance over the memory limit of
/// [`crate::limits`], or no pipeline degree that can be evaluated at all (each reason
/// listed).
pub fn plan(model: &ModelSpec, c: &Cluster, specs: &[(String, String)]) -> Result<Plan, String> {
    model.validate()?;
    c.validate(model)?;
    let mut why = Vec::new();
    let mut skipped = Vec::new();
    let moe = model.is_moe();
    let g = c.gpus_per_node;
    let ep = c.ep_degree(model);
    let tp = if moe { 1 } else { g };
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
        format!(
            "MoE: routed experts sharded over EP = {ep} GPUs of the same stage (EP divides DP), {} experts per GPU, no tensor parallelism",
            model.experts / ep
        )
    } else {
        format!("dense: tensor parallelism across each node (TP = {tp})")
    });
    let (a2a, a2a_why) = c.all_to_all(model, ep);
    if moe {
        why.push(format!(
            "MoE all-to-all: {a2a_why}; a dispatch or combine moves {:.1} MB per GPU per layer and micro-batch: {:.3} ms each. Priced by the simulator: every F, B and BW is split into attention, dispatch, expert MLP and combine (attention and MLP half of its compute each), the all-to-alls of every layer of its stage run on the expert-parallel stream, exposed in plain ops and hidden under the other micro-batch's compute inside an overlapped F&B pair (DualPipe, DualPipeV, Megatron-Core's combined 1F1B interleaved_1f1b_a2a) as far as they fit",
            model.seq as f64 * model.hidden as f64 * model.top_k as f64 * 2.0 / 1e6,
            a2a * 1e3
        ));
    }
    let nodes = c.gpus / g;
    let tokens_mb = model.seq as f64;
    let dense_params = model.total_params - model.expert_params;
    let mut out = Vec::new();
    let mut pps = Vec::new();
    let mut pp = 1u32;
    while pp <= nodes.min(model.layers) {
        if nodes.is_multiple_of(pp) {
            pps.push(pp);
        }
        pp = pp.saturating_mul(2);
        if pp == 0 || pp > (1 << 30) {
            break;
        }
    }
    for &pp in &pps {
        let dp = c.gpus / (pp * tp);
        if moe && (ep > dp || !dp.is_multiple_of(ep)) {
            skipped.push(Skipped {
                schedule: "*".into(),
                pp,
                why: format!(
                    "EP = {ep} needs {ep} GPUs of one stage for its group, and PP = {pp} leaves DP = {dp} per stage{}",
                    if ep <= dp { " (not a multiple of EP)" } else { "" }
                ),
            });
            continue;
        }
        let m_exact = c.global_batch_tokens / (dp as f64 * tokens_mb);
        if m_exact < 0.5 {
            skipped.push(Skipped {
                schedule: "*".into(),
                pp,
                why: format!(
                    "the global batch of {} is less than one sequence ({}) per data-parallel replica (DP = {dp})",
                    tokens_text(c.global_batch_tokens),
                    tokens_text(model.seq as f64)
                ),
            });
            continue;
        }
        // Saturates at u32::MAX: the memory limit below refuses such an instance.
        let m = m_exact.round().max(1.0) as u32;
        for (sched, text) in specs {
            let (fixed_v, bidir) = spec_shape(text);
            let vpp = if fixed_v { None } else { Some(2) };
            // The memory limit, before anything is built.
            let bound = crate::limits::spec_size_lower_bound(pp, m, vpp);
            crate::limits::within_limit(
                &format!("planning {sched} at PP = {pp}, M = {m}"),
                crate::limits::estimate(crate::limits::Work::Sim, &bound),
            )?;
            let mut refusal = None;
            let mut found = None;
            for mm in m_candidates(m, pp, bidir) {
                let ov = Overrides {
                    pp: Some(pp),
                    microbatches: Some(mm),
                    vpp,
                    ..Default::default()
                };
                match load_spec(text, &ov) {
                    Ok(e) => {
                        found = Some((mm, e));
                        break;
                    }
                    Err(LoadError::Spec { diags, .. }) => {
                        if refusal.is_none() {
                            refusal = Some(
                                diags
                                    .first()
                                    .map(|d| d.message.clone())
                                    .unwrap_or_else(|| "does not elaborate".into()),
                            );
                        }
                    }
                    Err(LoadError::Usage(u)) | Err(LoadError::Io(u)) => {
                        refusal.get_or_insert(u);
                    }
                    Err(LoadError::Parse(p)) => {
                        refusal.get_or_insert(p.message);
                    }
                }
            }
            let Some((mm, e)) = found else {
                skipped.push(Skipped {
                    schedule: sched.clone(),
                    pp,
                    why: format!(
                        "at M = {m}: {}",
                        refusal.unwrap_or_else(|| "refused".into())
                    ),
                });
                continue;
            };
            let pl = &e.program.pipeline;
            let per_dir = pl.stages_per_direction();
            if per_dir > model.layers {
                skipped.push(Skipped {
                    schedule: sched.clone(),
                    pp,
                    why: format!(
                        "{per_dir} stages per direction for {} layers: a stage would hold less than one layer",
                        model.layers
                    ),
                });
                continue;
            }
            // An MoE model's ops in parts, so that the simulator prices the all-to-alls.
            let program = if moe {
                match crate::input::apply_moe(&e.program, None, &crate::moe::MoeStages::All) {
                    Ok((p, _)) => p,
                    Err(err) => {
                        skipped.push(Skipped {
                            schedule: sched.clone(),
                            pp,
                            why: format!("cannot split its ops into MoE parts: {err}"),
                        });
                        continue;
                    }
                }
            } else {
                e.program.clone()
            };
            let chk = check(&program, None, &Default::default());
            if chk.report.verdict != Verdict::Accepted {
                skipped.push(Skipped {
                    schedule: sched.clone(),
                    pp,
                    why: format!("does not pass `schedc check` at M = {mm}"),
                });
                continue;
            }
            let stage_frac = 1.0 / per_dir as f64;
            let held = pl.stages as f64 / pl.pp as f64;
            let directions = pl.directions() as f64;
            let msg = tokens_mb * model.hidden as f64 * 2.0 / tp as f64;
            let cost = CostModel {
                compute: crate::sim::cost::ComputeCosts {
                    all: op_costs(model, c, stage_frac),
                    stage: Default::default(),
                },
                p2p: crate::sim::cost::P2p {
                    latency: c.latency,
                    bandwidth: c.inter_bw,
                    bytes: Some(msg),
                },
                model: None,
                moe: if moe {
                    moe_costs(model, c, stage_frac, ep)
                } else {
                    Moe::default()
                },
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
                    ..Memory::default()
                },
                op_scale: None,
            };
            let res = match simulate(chk.checked.as_ref().expect("lowered"), &cost) {
                Ok(r) => r,
                Err(err) => {
                    skipped.push(Skipped {
                        schedule: sched.clone(),
                        pp,
                        why: err,
                    });
                    continue;
                }
            };
            let stage_params_dense = dense_params * stage_frac / tp as f64;
            let stage_params_exp = model.expert_params * stage_frac / ep as f64;
            let per_stage = stage_params_dense + stage_params_exp;
            let static_b = per_stage * held * BYTES_WG + per_stage * held / directions * BYTES_OPT;
            let act = res
                .ranks
                .iter()
                .map(|r| r.peak_activation_bytes)
                .fold(0.0, f64::max);
            let mem = static_b + act;
            let tokens_step = mm as f64 * tokens_mb * dp as f64;
            out.push(Candidate {
                schedule: sched.clone(),
                pp,
                dp,
                microbatches: mm,
                tokens_per_step: tokens_step,
                step_seconds: res.makespan,
                bubble: res.bubble.from_start,
                a2a_exposed: res.a2a.exposed_fraction(),
                memory_bytes: mem,
                fits: mem <= c.gpu_memory,
                gpu_hours_per_mtok: c.gpus as f64 * res.makespan / 3600.0 / (tokens_step / 1e6),
                note: (mm != m).then(|| {
                    format!(
                        "M = {mm} instead of {m} ({})",
                        refusal.clone().unwrap_or_default()
                    )
                }),
            });
        }
    }
    if out.is_empty() {
        let reasons: Vec<String> = skipped
            .iter()
            .map(|s| format!("PP = {} ({}): {}", s.pp, s.schedule, s.why))
            .collect();
        return Err(format!(
            "no configuration can be evaluated:\n  {}",
            if reasons.is_empty() {
                format!(
                    "no pipeline degree divides the {nodes} node(s) within the {} layers",
                    model.layers
                )
            } else {
                reasons.join("\n  ")
            }
        ));
    }
    // The recommendation: the fastest per token among the pipelined configurations that fit
    // (GPU-hours per million tokens, since M may differ between schedules).
    let best = out
        .iter()
        .enumerate()
        .filter(|(_, x)| x.fits && x.pp > 1)
        .min_by(|a, b| a.1.gpu_hours_per_mtok.total_cmp(&b.1.gpu_hours_per_mtok))
        .map(|(i, _)| i);
    why.push(format!(
        "compute: 2 x {:.0}B active FLOPs per token at {:.0}% MFU of {:.0} TFLOP/s; B = W = F",
        model.active_params / 1e9,
        c.mfu * 100.0,
        c.peak_flops / 1e12
    ));
    why.push(format!(
        "{} GPUs, {} per node, {:.0} GB each; {} per step requested ({} per sequence)",
        c.gpus,
        g,
        c.gpu_memory / 1e9,
        tokens_text(c.global_batch_tokens),
        tokens_text(model.seq as f64)
    ));
    Ok(Plan {
        candidates: out,
        best,
        skipped,
        reasoning: why,
    })
}

/// `1 token`, `4096 tokens`, `16.0 M tokens`.
fn tokens_text(t: f64) -> String {
    if t >= 1e6 {
        format!("{:.1} M tokens", t / 1e6)
    } else if t == 1.0 {
        "1 token".into()
    } else {
        format!("{t} tokens")
    }
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
    // The schedule column fits the longest name (`interleaved_1f1b_a2a` is 20 characters).
    let w = p
        .candidates
        .iter()
        .map(|x| x.schedule.chars().count())
        .max()
        .unwrap_or(0)
        .max(18);
    let _ = writeln!(
        o,
        "\n{:>4} {:>5} {:<w$} {:>6} {:>10} {:>11} {:>12} {:>10} {:>6} {:>14}",
        "PP",
        "DP",
        "schedule",
        "M",
        "step (s)",
        "bubble",
        "a2a exposed",
        "mem (GB)",
        "fits",
        "GPU-h / Mtok"
    );
    let _ = writeln!(
        o,
        "{:>4} {:>5} {:<w$} {:>6} {:>10} {:>11} {:>12} {:>10} {:>6} {:>14}",
        "", "", "", "", "", "(from_start)", "(of a2a)", "", "", ""
    );
    let mut rows: Vec<&Candidate> = p.candidates.iter().collect();
    rows.sort_by(|a, b| {
        a.pp.cmp(&b.pp)
            .then(a.gpu_hours_per_mtok.total_cmp(&b.gpu_hours_per_mtok))
    });
    for x in rows {
        let _ = writeln!(
            o,
            "{:>4} {:>5} {:<w$} {:>6} {:>10.3} {:>10.1}% {:>12} {:>10.1} {:>6} {:>14.3}{}",
            x.pp,
            x.dp,
            x.schedule,
            x.microbatches,
            x.step_seconds,
            100.0 * x.bubble,
            if model.is_moe() {
                format!("{:.1}%", 100.0 * x.a2a_exposed)
            } else {
                "-".into()
            },
            x.memory_bytes / 1e9,
            if x.fits { "yes" } else { "no" },
            x.gpu_hours_per_mtok,
            if x.note.is_some() { "  *" } else { "" }
        );
    }
    let notes: Vec<&Candidate> = p.candidates.iter().filter(|x| x.note.is_some()).collect();
    if !notes.is_empty() {
        let _ = writeln!(o, "\n* M adjusted to one the schedule accepts:");
        for x in notes {
            let _ = writeln!(
                o,
                "  {} at PP = {}: {}",
                x.schedule,
                x.pp,
                x.note.as_deref().unwrap_or("")
            );
        }
    }
    if !p.skipped.is_empty() {
        let _ = writeln!(o, "\nnot evaluated:");
        // One line per (schedule, reason), with the pipeline degrees it holds for.
        let mut groups: Vec<(String, String, Vec<u32>)> = Vec::new();
        for s in &p.skipped {
            let why = s.why.clone();
            match groups
                .iter_mut()
                .find(|(n, w, _)| *n == s.schedule && *w == why)
            {
                Some(gr) => gr.2.push(s.pp),
                None => groups.push((s.schedule.clone(), why, vec![s.pp])),
            }
        }
        for (n, w, pps) in groups {
            let _ = writeln!(
                o,
                "  {} at PP = {}: {w}",
                if n == "*" {
                    "every schedule"
                } else {
                    n.as_str()
                },
                pps.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    match p.best {
        Some(i) => {
            let b = &p.candidates[i];
            let base = p
                .candidates
                .iter()
                .find(|x| x.pp == b.pp && x.schedule == "1f1b");
            let _ = writeln!(
                o,
                "\nrecommendation: PP = {} with {}: step {:.3} s, bubble {:.1}% (from_start), {:.1} GB per GPU",
                b.pp,
                b.schedule,
                b.step_seconds,
                100.0 * b.bubble,
                b.memory_bytes / 1e9
            );
            if let Some(base) = base {
                let saved = base.gpu_hours_per_mtok - b.gpu_hours_per_mtok;
                let _ = writeln!(
                    o,
                    "  {} {:.3} GPU-hours per million tokens against 1F1B at the same PP ({:.1}%)",
                    if saved >= 0.0 { "saves" } else { "costs" },
                    saved.abs(),
                    100.0 * saved.abs() / base.gpu_hours_per_mtok
                );
            }
            let extra = dualpipe_overhead(model, b.pp, c.gpus_per_node, Some(c.ep_degree(model)));
            let base_mem = base.map(|x| x.memory_bytes);
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
