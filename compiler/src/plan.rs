//! `schedc plan`: a layout (mesh `tp`, `pp`, `ep`, `dp`), a schedule and its micro-batch
//! count for a model on a cluster, found by a search in which every candidate is priced by
//! the simulator under the model-level cost model ([`crate::costmodel::evaluate`]: the same
//! figures `schedc sim SPEC --model ... --hardware ... --mesh ...` prints). The plan has no
//! formula of its own.
//!
//! ## The search
//!
//! * **Meshes.** Tensor parallelism `tp` in {1, 2, 4, 8}, within a node, dividing the
//!   attention heads (and the key-value heads, or a multiple of them); pipeline degree `pp`
//!   any divisor of `GPUs / tp` up to the layer count; `dp = GPUs / (tp * pp)`; for an MoE
//!   model every expert-parallel degree `ep` that divides the routed experts and `tp * dp`
//!   (the EP group folded into a stage's GPUs); no context parallelism (`cp = 1`).
//!   `--mesh` fixes any of them.
//! * **Layers per stage.** Megatron-LM's even split ([`layout::default_split`]); where it
//!   does not divide, [`balanced_layout`] (the remainder on the middle stages, not on the
//!   embedding's and the head's), shown with the candidate.
//! * **Schedules.** Every spec of the standard library (or `--specs DIR`), with `V` in
//!   1..=4 where the spec leaves V free (at most one layer per stage); M = global batch /
//!   (dp * micro-batch size); a spec that refuses that M gets the nearest M it accepts
//!   within a quarter of it (noted, and its tokens per step are its own). A spec with memory
//!   ops (`OFFLOAD`, `RELOAD`, `RECOMPUTE`) is listed as skipped: the derived cost model does
//!   not price host copies yet.
//! * **Memory.** A candidate fits when the simulator's largest rank (weights, gradients,
//!   optimizer state, the peak of live activations, the per-GPU overhead) fits the GPU.
//! * **Ranking.** By tokens per second (step time, exposed DP reduction and optimizer
//!   included); ties by memory.
//!
//! ## Pruning (so that 2048 GPUs plan in seconds)
//!
//! Before any simulation each mesh gets two bounds from [`costmodel::derive`] alone (a
//! closed form, no schedule):
//!
//! * **memory:** the weights, gradients and optimizer state of the whole pipeline over `pp`
//!   ranks plus the overhead, a lower bound on the largest rank under any schedule; a mesh
//!   over the GPU's memory is skipped;
//! * **throughput:** every rank's compute (F + B + W of its stages, all-to-alls and
//!   bubbles left out) averaged over the `pp` ranks is a lower bound on the makespan of any
//!   schedule at any M, so `dp * micro-batch size * seq * pp / sum of F + B + W over the
//!   stages` is an upper bound on the tokens per second.
//!
//! Meshes are simulated best bound first; a mesh whose bound is at most the best fitting
//! candidate's tokens per second cannot hold a better one and is not simulated (listed
//! as pruned, with its bound). Within a mesh the specs whose V is free try V = 1, 2, ...
//! and stop at the first V that is slower than the one before (the bubble shrinks with V
//! while the messages and per-stage costs grow; a heuristic). Screening, another heuristic:
//! after the first [`SCREEN_MESHES`] meshes, a schedule never within [`SCREEN_RATIO`] of
//! the best tokens/s at a mesh simulated so far is not simulated again (the reasoning lists
//! it); 1F1B is simulated on the recommended mesh regardless, as the report's baseline.

use crate::costmodel::{
    self,
    arch::Arch,
    hardware::Hardware,
    layout::{self, Dtype, Mesh, Recompute},
    Efficiency, Instance, Training,
};
use crate::input::{load_str, LoadError, Overrides};
use serde::Serialize;
use std::fmt::Write as _;

/// Mesh dimensions fixed by `--mesh` (the others are searched).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Fixed {
    /// Tensor-parallel degree.
    pub tp: Option<u32>,
    /// Pipeline-parallel degree.
    pub pp: Option<u32>,
    /// Expert-parallel degree.
    pub ep: Option<u32>,
    /// Data-parallel degree.
    pub dp: Option<u32>,
}

impl Fixed {
    /// Parses `tp=2,pp=8,ep=32,dp=16` (any subset, any order; `cp=1` is accepted, the plan
    /// does not search context parallelism). Errors name `--mesh`: an unknown or repeated
    /// key, a value that is not a positive integer, `cp` other than 1.
    pub fn parse(s: &str) -> Result<Fixed, String> {
        // The syntax is `sim --mesh`'s; the keys given are the fixed dimensions.
        let m = Mesh::parse(s, 1)?;
        let given = |k: &str| {
            s.split(',')
                .filter_map(|p| p.split_once('='))
                .any(|(key, _)| key.trim() == k)
        };
        if m.cp != 1 {
            return Err(format!(
                "--mesh cp={}: plan does not search context parallelism; evaluate a cp layout with `schedc sim --mesh`",
                m.cp
            ));
        }
        Ok(Fixed {
            tp: given("tp").then_some(m.tp),
            pp: given("pp").then_some(m.pp),
            ep: given("ep").then_some(m.ep),
            dp: given("dp").then_some(m.dp),
        })
    }
}

/// What to plan for.
#[derive(Clone, Debug)]
pub struct Request {
    /// GPUs in all.
    pub gpus: u32,
    /// The model.
    pub arch: Arch,
    /// The GPU and its links.
    pub hardware: Hardware,
    /// Tokens per sequence.
    pub seq: u64,
    /// Sequences per micro-batch.
    pub micro_batch_size: u64,
    /// Sequences per optimizer step over all GPUs.
    pub global_batch: u64,
    /// Recomputation.
    pub recompute: Recompute,
    /// GEMM number format.
    pub dtype: Dtype,
    /// ZeRO-1 over the data-parallel group.
    pub distributed_optimizer: bool,
    /// FlashAttention (else eager attention).
    pub flash_attention: bool,
    /// The EP all-to-all across nodes (`--a2a`).
    pub a2a: layout::A2a,
    /// Dimensions fixed by `--mesh`.
    pub fixed: Fixed,
    /// The cost model's efficiencies.
    pub efficiency: Efficiency,
    /// `--max-memory BYTES`: a candidate fits only when, besides fitting the GPU, its
    /// simulated `peak_memory_bytes` (the largest rank's weights, gradients, optimizer state
    /// and live activations, without the per-GPU overhead: the figure `schedc sim
    /// --max-memory` bounds) is at most this.
    pub max_memory: Option<u64>,
}

impl Request {
    /// Checks the figures against each other. Errors name the option: `--gpus` (zero, or
    /// neither within a node nor whole nodes), `--seq`, `--micro-batch-size`,
    /// `--global-batch` (zero), `--mesh` (dimensions that do not multiply to the GPUs, an
    /// `ep` that does not divide the experts or that a dense model cannot have, a `tp`
    /// beyond a node).
    pub fn validate(&self) -> Result<(), String> {
        let g = self.gpus;
        let gpn = self.hardware.gpus_per_node;
        if g == 0 {
            return Err("--gpus must be at least 1".into());
        }
        if g > gpn && !g.is_multiple_of(gpn) {
            return Err(format!(
                "--gpus {g} is not a multiple of the {gpn} GPUs per node of --hardware {}",
                self.hardware.name
            ));
        }
        if self.seq == 0 || self.micro_batch_size == 0 || self.global_batch == 0 {
            return Err("--seq, --micro-batch-size and --global-batch must be at least 1".into());
        }
        let f = &self.fixed;
        let given: u64 = [f.tp, f.pp, f.dp]
            .iter()
            .flatten()
            .map(|&x| x as u64)
            .product();
        let dims = [("tp", f.tp), ("pp", f.pp), ("dp", f.dp)]
            .iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
            .collect::<Vec<_>>()
            .join(" x ");
        if f.tp.is_some() && f.pp.is_some() && f.dp.is_some() && given != g as u64 {
            return Err(format!("--mesh {dims} is {given} GPUs, but --gpus is {g}"));
        }
        if !(g as u64).is_multiple_of(given) {
            return Err(format!(
                "--mesh {dims} = {given} does not divide --gpus {g}"
            ));
        }
        if let Some(tp) = f.tp {
            if tp > gpn {
                return Err(format!(
                    "--mesh tp={tp} spans more than a node of {gpn} GPUs"
                ));
            }
        }
        match (&self.arch.moe, f.ep) {
            (None, Some(ep)) if ep > 1 => {
                return Err(format!(
                    "--mesh ep={ep}: `{}` is dense (no routed experts)",
                    self.arch.name
                ))
            }
            (Some(m), Some(ep)) if !m.experts.is_multiple_of(ep as u64) => {
                return Err(format!(
                    "--mesh ep={ep} does not divide the model's {} routed experts",
                    m.experts
                ))
            }
            _ => {}
        }
        Ok(())
    }

    fn training(&self, mesh: Mesh, layout: Option<String>) -> Training {
        Training {
            mesh,
            seq: self.seq,
            micro_batch_size: self.micro_batch_size,
            recompute: self.recompute,
            distributed_optimizer: self.distributed_optimizer,
            dtype: self.dtype,
            layout,
            flash_attention: self.flash_attention,
            a2a: self.a2a,
        }
    }

    /// The layout string for `chunks` model chunks: `None` (the even split) where
    /// [`layout::default_split`] divides, else [`balanced_layout`].
    fn layout_for(&self, chunks: u32) -> Option<String> {
        match layout::default_split(self.arch.layers(), chunks) {
            Ok(_) => None,
            Err(_) => Some(balanced_layout(self.arch.layers(), chunks)),
        }
    }
}

pub use crate::costmodel::layout::balanced_layout;

/// One simulated candidate.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    /// Spec name.
    pub schedule: String,
    /// The V asked of a spec that leaves it free (`None`: the spec's own).
    pub vpp: Option<u32>,
    /// Stages per rank (2 for DualPipe's two directions and for V-shaped specs).
    pub stages_per_rank: u32,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Pipeline degree.
    pub pp: u32,
    /// Expert-parallel degree.
    pub ep: u32,
    /// Data-parallel degree.
    pub dp: u32,
    /// The layout string when the even split does not divide (else `None`).
    pub layout: Option<String>,
    /// Micro-batches per step (per pipeline).
    pub microbatches: u32,
    /// Tokens per step over all GPUs.
    pub tokens_per_step: f64,
    /// Step time, seconds.
    pub step_seconds: f64,
    /// Tokens per second over all GPUs.
    pub tokens_per_second: f64,
    /// Model TFLOP/s per GPU.
    pub tflops_per_gpu: f64,
    /// Model FLOPs utilization against the dtype's dense peak.
    pub mfu: f64,
    /// Bubble, `from_start` convention (idle / (busy + idle), barrier at both ends).
    pub bubble: f64,
    /// Share of the MoE all-to-all time not hidden under compute (0 for a dense model).
    pub a2a_exposed: f64,
    /// The largest rank's memory, bytes.
    pub memory_bytes: f64,
    /// Whether it fits in the GPU's memory.
    pub fits: bool,
    /// An M other than the batch's, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Candidate {
    /// `tp=1 pp=16 ep=64 dp=128`.
    pub fn mesh_text(&self) -> String {
        mesh_text(self.tp, self.pp, self.ep, self.dp)
    }
    /// `dualpipe`, `interleaved_1f1b V=2`.
    pub fn schedule_text(&self) -> String {
        match self.vpp {
            Some(v) => format!("{} V={v}", self.schedule),
            None => self.schedule.clone(),
        }
    }
}

fn mesh_text(tp: u32, pp: u32, ep: u32, dp: u32) -> String {
    format!("tp={tp} pp={pp} ep={ep} dp={dp}")
}

/// What was not simulated, and why.
#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    /// The mesh (`tp=.. pp=.. ep=.. dp=..`), or the dimension refused (`tp=16`).
    pub mesh: String,
    /// The spec (`*`: every one).
    pub schedule: String,
    /// Why.
    pub why: String,
}

/// A mesh within memory by its weights, gradients and optimizer state, with its bounds.
#[derive(Clone, Debug, Serialize)]
pub struct MeshBound {
    /// The mesh.
    pub mesh: String,
    /// Upper bound on the tokens per second of any schedule on it.
    pub bound_tokens_per_second: f64,
    /// Lower bound on the largest rank's memory, bytes.
    pub memory_lower_bound_bytes: f64,
    /// Simulated (else pruned: its bound is at most the best found before it).
    pub simulated: bool,
}

/// The plan.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// Every simulated candidate: those that fit by tokens per second (best first), then
    /// those that do not.
    pub candidates: Vec<Candidate>,
    /// The recommendation: index in `candidates` (the first, when something fits).
    pub best: Option<usize>,
    /// Schedules not simulated at a mesh by screening (see [`SCREEN_RATIO`]).
    pub screened_out: Vec<Skipped>,
    /// What was not simulated, and why.
    pub skipped: Vec<Skipped>,
    /// Every mesh within memory by its static bytes, best bound first: simulated, or
    /// pruned by its throughput bound.
    pub meshes: Vec<MeshBound>,
    /// Simulations run.
    pub simulations: usize,
    /// The reasoning, one line each.
    pub reasoning: Vec<String>,
}

/// Whether a spec fixes its V (anything but `vpp default N`, which leaves it to `--vpp`)
/// and whether it is bidirectional.
fn spec_shape(text: &str) -> (bool, bool) {
    use crate::dsl::ast::{Item, PlacementSpec};
    match crate::dsl::parse_file(text) {
        Ok(f) => (
            !f.items.iter().any(|i| matches!(i, Item::VppDefault(..))),
            f.items
                .iter()
                .any(|i| matches!(i, Item::Placement(PlacementSpec::Bidir, _))),
        ),
        Err(_) => (true, false),
    }
}

/// Micro-batch counts to try for a spec, the batch's own first: the nearest even M for a
/// bidirectional spec, then multiples of P below and above (interleaved rounds), then 2P
/// (DualPipeV's least), each only within a quarter of the batch's M.
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
    let slack = (m / 4).max(1);
    v.retain(|&x| x.abs_diff(m) <= slack);
    v
}

/// Meshes at which every schedule is simulated before screening starts.
pub const SCREEN_MESHES: usize = 3;

/// A schedule that never came within this share of the best tokens/s at a mesh simulated
/// so far is not simulated at later meshes (screening; a heuristic, not a bound).
pub const SCREEN_RATIO: f64 = 0.9;

/// One mesh to simulate, with its bounds.
struct MeshCase {
    mesh: Mesh,
    m: u32,
    bound_tps: f64,
    statics: f64,
}

/// Plans `req` over `specs` (`(name, text)`, e.g. [`crate::specs`]'s standard library).
///
/// Errors: what [`Request::validate`] refuses, or no mesh at all (every one listed with its
/// reason). A plan in which nothing fits is not an error (`best` is `None`).
pub fn plan(req: &Request, specs: &[(String, String)]) -> Result<Plan, String> {
    req.validate()?;
    let arch = &req.arch;
    let hw = &req.hardware;
    let eff = &req.efficiency;
    let layers = arch.layers();
    let heads = arch.attention.heads();
    let kvh = arch.attention.kv_heads();
    let mut skipped = Vec::new();
    let mut cases = Vec::new();
    let mut memory_skipped = 0usize;
    let mut limit_err: Option<String> = None;
    let skip = |skipped: &mut Vec<Skipped>, mesh: String, why: String| {
        skipped.push(Skipped {
            mesh,
            schedule: "*".into(),
            why,
        })
    };
    for tp in [1u32, 2, 4, 8] {
        if req.fixed.tp.is_some_and(|t| t != tp) {
            continue;
        }
        if tp > hw.gpus_per_node || !req.gpus.is_multiple_of(tp) {
            continue;
        }
        if !heads.is_multiple_of(tp as u64)
            || !(kvh.is_multiple_of(tp as u64) || (tp as u64).is_multiple_of(kvh))
        {
            skip(
                &mut skipped,
                format!("tp={tp}"),
                format!("does not divide the {heads} attention heads ({kvh} key-value heads)"),
            );
            continue;
        }
        let rest = req.gpus / tp;
        for pp in (1..=rest.min(layers)).filter(|p| rest.is_multiple_of(*p)) {
            if req.fixed.pp.is_some_and(|p| p != pp) {
                continue;
            }
            let dp = rest / pp;
            if req.fixed.dp.is_some_and(|d| d != dp) {
                continue;
            }
            let eps: Vec<u32> = match &arch.moe {
                None => vec![1],
                Some(moe) => (1..=(tp * dp).min(moe.experts as u32))
                    .filter(|e| moe.experts.is_multiple_of(*e as u64))
                    .filter(|e| (tp * dp).is_multiple_of(*e))
                    .filter(|e| req.fixed.ep.is_none_or(|f| f == *e))
                    .collect(),
            };
            if eps.is_empty() {
                if let Some(ep) = req.fixed.ep {
                    skip(
                        &mut skipped,
                        format!("tp={tp} pp={pp} dp={dp}"),
                        format!(
                            "--mesh ep={ep} does not divide tp * dp = {} (the expert-parallel group is folded into a stage's GPUs)",
                            tp * dp
                        ),
                    );
                }
            }
            let per = dp as u64 * req.micro_batch_size;
            for ep in eps {
                let mesh = Mesh {
                    tp,
                    pp,
                    ep,
                    dp,
                    cp: 1,
                };
                let name = mesh_text(tp, pp, ep, dp);
                if !req.global_batch.is_multiple_of(per) {
                    skip(
                        &mut skipped,
                        name,
                        format!(
                            "the global batch of {} sequences is not a multiple of dp x micro-batch size = {per}",
                            req.global_batch
                        ),
                    );
                    continue;
                }
                let m = req.global_batch / per;
                // The memory limit at the batch's M, before anything is built.
                let bound =
                    crate::limits::spec_size_lower_bound(pp, m.min(u32::MAX as u64) as u32, None);
                if let Err(e) = crate::limits::within_limit(
                    &format!("planning at {name}, M = {m}"),
                    crate::limits::estimate(crate::limits::Work::Sim, &bound),
                ) {
                    limit_err.get_or_insert(e.clone());
                    skip(&mut skipped, name, e);
                    continue;
                }
                let m = m as u32;
                // The bounds, from the closed-form costs of the mesh's pp stages.
                let tr = req.training(mesh, req.layout_for(pp));
                let d = match costmodel::derive(arch, hw, &tr, pp, m, eff) {
                    Ok(d) => d,
                    Err(e) => {
                        skip(&mut skipped, name, e);
                        continue;
                    }
                };
                let statics: f64 = d
                    .chunks
                    .iter()
                    .map(|c| c.param_bytes + c.grad_bytes + c.optimizer_bytes)
                    .sum::<f64>()
                    / pp as f64
                    + d.overhead_bytes;
                // Under --max-memory the average statics without the overhead bound the
                // largest rank's `peak_memory_bytes` from below too.
                if let Some(cap) = req
                    .max_memory
                    .filter(|c| statics - d.overhead_bytes > *c as f64)
                {
                    memory_skipped += 1;
                    skip(
                        &mut skipped,
                        name,
                        format!(
                            "weights, gradients and optimizer state alone need {:.1} GB per GPU (averaged over the {pp} pipeline ranks), over --max-memory {:.1} GB",
                            (statics - d.overhead_bytes) / 1e9,
                            cap as f64 / 1e9
                        ),
                    );
                    continue;
                }
                if statics > hw.hbm_bytes {
                    memory_skipped += 1;
                    skip(
                        &mut skipped,
                        name,
                        format!(
                            "weights, gradients and optimizer state alone need {:.1} GB per GPU (averaged over the {pp} pipeline ranks, with the {:.0} GB overhead), over the GPU's {:.1} GB",
                            statics / 1e9,
                            d.overhead_bytes / 1e9,
                            hw.hbm_bytes / 1e9
                        ),
                    );
                    continue;
                }
                let work: f64 = d.chunks.iter().map(|c| c.f + c.b + c.w).sum();
                let bound_tps = if work > 0.0 {
                    dp as f64 * req.micro_batch_size as f64 * req.seq as f64 * pp as f64 / work
                } else {
                    f64::INFINITY
                };
                cases.push(MeshCase {
                    mesh,
                    m,
                    bound_tps,
                    statics,
                });
            }
        }
    }
    let memory_skips = memory_skipped;
    if cases.is_empty() && memory_skips == 0 {
        return Err(no_candidate(req, &skipped));
    }
    // Best bound first; ties: fewer pipeline ranks (less memory per rank for activations is
    // not implied, but fewer messages), then smaller ep.
    cases.sort_by(|a, b| {
        b.bound_tps
            .total_cmp(&a.bound_tps)
            .then(a.mesh.pp.cmp(&b.mesh.pp))
            .then(a.mesh.ep.cmp(&b.mesh.ep))
    });
    // The derived cost model prices no host copy (no PCIe bandwidth yet): a spec that
    // offloads would look free, so it is listed as skipped instead (issue 27).
    let mut kept: Vec<(String, String)> = Vec::with_capacity(specs.len());
    for (n, t) in specs {
        if ["OFFLOAD(", "RELOAD(", "RECOMPUTE("]
            .iter()
            .any(|op| t.contains(op))
        {
            skipped.push(Skipped {
                mesh: "every mesh".into(),
                schedule: n.clone(),
                why: "moves activations (OFFLOAD/RELOAD/RECOMPUTE), which `plan`'s cost model does not price yet".into(),
            });
        } else {
            kept.push((n.clone(), t.clone()));
        }
    }
    let specs = &kept[..];
    let shapes: Vec<(bool, bool)> = specs.iter().map(|(_, t)| spec_shape(t)).collect();
    let moe = arch.moe.is_some();
    let mut out: Vec<Candidate> = Vec::new();
    let mut meshes = Vec::new();
    let mut best_tps = 0.0f64;
    let mut simulations = 0usize;
    let mut screened = 0usize;
    let mut family_best: std::collections::HashMap<String, f64> = Default::default();
    let mut screened_out: Vec<Skipped> = Vec::new();
    for case in &cases {
        let mesh = case.mesh;
        let name = mesh_text(mesh.tp, mesh.pp, mesh.ep, mesh.dp);
        let simulated = case.bound_tps > best_tps;
        meshes.push(MeshBound {
            mesh: name.clone(),
            bound_tokens_per_second: case.bound_tps,
            memory_lower_bound_bytes: case.statics,
            simulated,
        });
        if !simulated {
            continue;
        }
        let first_here = out.len();
        for ((sched, text), &(fixed_v, bidir)) in specs.iter().zip(&shapes) {
            // Screening: after the first meshes, a schedule that was never within
            // SCREEN_RATIO of the best at a mesh simulated so far is not simulated again.
            if screened >= SCREEN_MESHES {
                if let Some(&r) = family_best.get(sched.as_str()) {
                    if r < SCREEN_RATIO {
                        screened_out.push(Skipped {
                            mesh: name.clone(),
                            schedule: sched.clone(),
                            why: format!(
                                "screened out: at most {:.0}% of the best tokens/s at each of the meshes simulated before",
                                100.0 * r
                            ),
                        });
                        continue;
                    }
                }
            }
            let vs: Vec<Option<u32>> = if fixed_v {
                vec![None]
            } else {
                let (fit, over): (Vec<u32>, Vec<u32>) =
                    (1..=4u32).partition(|v| mesh.pp * v <= layers);
                if let Some(&v) = over.first() {
                    skipped.push(Skipped {
                        mesh: name.clone(),
                        schedule: format!("{sched} V>={v}"),
                        why: format!("{} stages or more for {layers} layers", mesh.pp * v),
                    });
                }
                fit.into_iter().map(Some).collect()
            };
            let mut last: Option<f64> = None;
            for vpp in vs {
                let r = one(
                    req,
                    mesh,
                    case.m,
                    sched,
                    text,
                    vpp,
                    bidir,
                    moe,
                    &mut simulations,
                );
                match r {
                    Ok(c) => {
                        let tps = c.tokens_per_second;
                        if c.fits {
                            best_tps = best_tps.max(tps);
                        }
                        out.push(c);
                        // V = 1, 2, ...: stop at the first V slower than the one before.
                        if last.is_some_and(|l| tps < l) {
                            break;
                        }
                        last = Some(tps);
                    }
                    Err(why) => {
                        if why.contains(crate::limits::LIMIT_VAR) && limit_err.is_none() {
                            limit_err = Some(why.clone());
                        }
                        skipped.push(Skipped {
                            mesh: name.clone(),
                            schedule: match vpp {
                                Some(v) => format!("{sched} V={v}"),
                                None => sched.clone(),
                            },
                            why,
                        });
                    }
                }
            }
        }
        let here = &out[first_here..];
        let top = here.iter().map(|c| c.tokens_per_second).fold(0.0, f64::max);
        if top > 0.0 {
            screened += 1;
            for c in here {
                let r = family_best.entry(c.schedule.clone()).or_insert(0.0);
                *r = r.max(c.tokens_per_second / top);
            }
        }
    }
    // Nothing simulated: an instance over the memory limit is an error (exit 2), as it is for
    // every command; so is a search that found nothing to simulate, unless meshes were
    // refused for memory (then the plan says that nothing fits).
    if out.is_empty() {
        if let Some(e) = limit_err {
            return Err(e);
        }
        if memory_skips == 0 {
            return Err(no_candidate(req, &skipped));
        }
    }
    // 1F1B on the recommended mesh, the baseline the report compares with, if screening
    // left it out.
    if let Some(b) = out
        .iter()
        .filter(|c| c.fits)
        .max_by(|a, b| a.tokens_per_second.total_cmp(&b.tokens_per_second))
        .cloned()
    {
        let same = |c: &Candidate| c.tp == b.tp && c.pp == b.pp && c.ep == b.ep && c.dp == b.dp;
        if !out.iter().any(|c| same(c) && c.schedule == "1f1b") {
            if let Some((n, t)) = specs.iter().find(|(n, _)| n == "1f1b") {
                let mesh = Mesh {
                    tp: b.tp,
                    pp: b.pp,
                    ep: b.ep,
                    dp: b.dp,
                    cp: 1,
                };
                let m = (req.global_batch / (b.dp as u64 * req.micro_batch_size)) as u32;
                if let Ok(c) = one(req, mesh, m, n, t, None, false, moe, &mut simulations) {
                    out.push(c);
                }
            }
        }
    }
    out.sort_by(|a, b| {
        b.fits
            .cmp(&a.fits)
            .then(b.tokens_per_second.total_cmp(&a.tokens_per_second))
            .then(a.memory_bytes.total_cmp(&b.memory_bytes))
    });
    let best = out.first().filter(|c| c.fits).map(|_| 0);
    let mut why = Vec::new();
    why.push(format!(
        "{}: {} layers, hidden {}, {:.1}B parameters ({:.1}B active){}",
        arch.name,
        layers,
        arch.hidden,
        arch.total_params() as f64 / 1e9,
        arch.active_params() as f64 / 1e9,
        match &arch.moe {
            Some(m) => format!(
                ", {} routed experts (top-{}), {:.1}B parameters in them",
                m.experts,
                m.top_k,
                arch.expert_params() as f64 / 1e9
            ),
            None => String::new(),
        }
    ));
    why.push(format!(
        "{} GPUs of {} ({:.0} GB, {} per node); {} sequences of {} tokens per step, micro-batch size {}, {}, recompute {}, {}",
        req.gpus,
        hw.name,
        hw.hbm_bytes / 1e9,
        hw.gpus_per_node,
        req.global_batch,
        req.seq,
        req.micro_batch_size,
        match req.dtype {
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        },
        match req.recompute {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        },
        if req.distributed_optimizer {
            "distributed optimizer (ZeRO-1)"
        } else {
            "optimizer state replicated over DP"
        }
    ));
    why.push(format!(
        "{} meshes within memory by weights, gradients and optimizer state; {} simulated ({} simulations{}), {} pruned: their compute bound cannot beat the best found",
        cases.len(),
        meshes.iter().filter(|m| m.simulated).count(),
        simulations,
        if moe { ", MoE ops split into attention, dispatch, expert MLP and combine (--moe=auto)" } else { "" },
        meshes.iter().filter(|m| !m.simulated).count()
    ));
    {
        let mut names: Vec<(String, f64)> = Vec::new();
        for x in &screened_out {
            if !names.iter().any(|(n, _)| *n == x.schedule) {
                names.push((x.schedule.clone(), family_best[&x.schedule]));
            }
        }
        if !names.is_empty() {
            why.push(format!(
                "screening (a heuristic): after the first {SCREEN_MESHES} meshes, a schedule never within {:.0}% of the best tokens/s at a mesh simulated so far is not simulated again: {} ({} simulations saved)",
                100.0 * SCREEN_RATIO,
                names
                    .iter()
                    .map(|(n, r)| format!("{n} (at most {:.0}%)", 100.0 * r))
                    .collect::<Vec<_>>()
                    .join(", "),
                screened_out.len()
            ));
        }
    }
    Ok(Plan {
        candidates: out,
        best,
        screened_out,
        skipped,
        meshes,
        simulations,
        reasoning: why,
    })
}

/// The error of a search with nothing to simulate: each distinct reason once (at most
/// ten), with a mesh it holds for.
fn no_candidate(req: &Request, skipped: &[Skipped]) -> String {
    let mut reasons: Vec<String> = Vec::new();
    for s in skipped {
        let line = format!("{} at {}: {}", s.schedule, s.mesh, s.why);
        if !reasons.iter().any(|r| r.ends_with(&s.why)) {
            reasons.push(line);
        }
    }
    let more = reasons.len().saturating_sub(10);
    reasons.truncate(10);
    if more > 0 {
        reasons.push(format!("and {more} more reasons"));
    }
    format!(
        "no candidate of {} GPUs for {} can be simulated:\n  {}",
        req.gpus,
        req.arch.name,
        if reasons.is_empty() {
            "no tp in {1, 2, 4, 8} with a pp dividing the GPUs matches --mesh".to_string()
        } else {
            reasons.join("\n  ")
        }
    )
}

/// Evaluates one spec at one mesh: its candidate, or why it has none.
#[allow(clippy::too_many_arguments)]
fn one(
    req: &Request,
    mesh: Mesh,
    m: u32,
    sched: &str,
    text: &str,
    vpp: Option<u32>,
    bidir: bool,
    moe: bool,
    simulations: &mut usize,
) -> Result<Candidate, String> {
    let mut refusal: Option<String> = None;
    let mut found = None;
    for mm in m_candidates(m, mesh.pp, bidir) {
        let bound = crate::limits::spec_size_lower_bound(mesh.pp, mm, vpp);
        if let Err(e) = crate::limits::within_limit(
            &format!("{sched} at pp = {}, M = {mm}", mesh.pp),
            crate::limits::estimate(crate::limits::Work::Sim, &bound),
        ) {
            refusal.get_or_insert(e);
            continue;
        }
        let ov = Overrides {
            pp: Some(mesh.pp),
            microbatches: Some(mm),
            vpp,
            ..Default::default()
        };
        match load_str(sched, text.to_string(), &ov) {
            Ok(l) => {
                let pl = &l.program.pipeline;
                found = Some((mm, pl.stages_per_direction(), pl.stages / pl.pp.max(1)));
                break;
            }
            Err(LoadError::Spec { diags, .. }) => {
                refusal.get_or_insert(
                    diags
                        .first()
                        .map(|d| d.message.clone())
                        .unwrap_or_else(|| "does not elaborate".into()),
                );
            }
            Err(LoadError::Usage(u)) | Err(LoadError::Io(u)) => {
                refusal.get_or_insert(u);
            }
            Err(LoadError::Parse(p)) => {
                refusal.get_or_insert(format!(
                    "syntax error at {}:{}: {}",
                    p.line, p.col, p.message
                ));
            }
        }
    }
    let Some((mm, chunks, per_rank)) = found else {
        return Err(format!(
            "at M = {m}: {}",
            refusal.unwrap_or_else(|| "refused".into())
        ));
    };
    if chunks > req.arch.layers() {
        return Err(format!(
            "{chunks} stages per direction for {} layers",
            req.arch.layers()
        ));
    }
    let layout = req.layout_for(chunks);
    let tr = req.training(mesh, layout.clone());
    let inst = Instance {
        name: sched,
        text,
        pp: mesh.pp,
        mb: mm,
        vpp,
        moe: moe.then_some("auto"),
    };
    *simulations += 1;
    let ev = costmodel::evaluate(&inst, &req.arch, &req.hardware, &tr, &req.efficiency)?;
    let st = &ev.step;
    Ok(Candidate {
        schedule: sched.to_string(),
        vpp,
        stages_per_rank: per_rank,
        tp: mesh.tp,
        pp: mesh.pp,
        ep: mesh.ep,
        dp: mesh.dp,
        layout,
        microbatches: mm,
        tokens_per_step: st.tokens_per_step,
        step_seconds: st.step_seconds,
        tokens_per_second: st.tokens_per_second,
        tflops_per_gpu: st.tflops_per_gpu,
        mfu: st.mfu,
        bubble: ev.sim.bubble.from_start,
        a2a_exposed: ev.sim.a2a.exposed_fraction(),
        memory_bytes: st.peak_memory_bytes,
        fits: st.fits
            && req.max_memory.is_none_or(|cap| {
                ev.sim
                    .ranks
                    .iter()
                    .all(|r| r.peak_memory_bytes <= cap as f64)
            }),
        note: (mm != m)
            .then(|| format!("M = {mm} instead of {m}: {}", refusal.unwrap_or_default())),
    })
}

/// The human report: the reasoning, the recommendation and why, the top `top` candidates
/// that fit, what did not fit, what was skipped and pruned.
pub fn report(req: &Request, p: &Plan, top: usize) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "reasoning:");
    for w in &p.reasoning {
        let _ = writeln!(o, "  - {w}");
    }
    let fits: Vec<&Candidate> = p.candidates.iter().filter(|c| c.fits).collect();
    match p.best.map(|i| &p.candidates[i]) {
        Some(b) => {
            let _ = writeln!(
                o,
                "\nrecommendation: {} with {}, M = {}{}",
                b.mesh_text(),
                b.schedule_text(),
                b.microbatches,
                b.layout
                    .as_ref()
                    .map(|l| format!(", layout \"{l}\""))
                    .unwrap_or_default()
            );
            let _ = writeln!(
                o,
                "  step {:.3} s, {:.0} tokens/s ({:.0} per GPU), {:.1} TFLOP/s per GPU, MFU {:.1}%, {:.1} of {:.1} GB per GPU",
                b.step_seconds,
                b.tokens_per_second,
                b.tokens_per_second / req.gpus as f64,
                b.tflops_per_gpu,
                100.0 * b.mfu,
                b.memory_bytes / 1e9,
                req.hardware.hbm_bytes / 1e9
            );
            let _ = writeln!(
                o,
                "  bubble {:.1}% (from_start){}",
                100.0 * b.bubble,
                if req.arch.moe.is_some() {
                    format!(
                        ", {:.1}% of the all-to-all time exposed",
                        100.0 * b.a2a_exposed
                    )
                } else {
                    String::new()
                }
            );
            let same_mesh = |c: &&Candidate| {
                c.tp == b.tp && c.pp == b.pp && c.ep == b.ep && c.dp == b.dp && c.fits
            };
            if let Some(base) = p
                .candidates
                .iter()
                .filter(same_mesh)
                .find(|c| c.schedule == "1f1b")
            {
                let _ = writeln!(
                    o,
                    "  against 1f1b on the same mesh: {:+.1}% tokens/s (1f1b: {:.3} s, bubble {:.1}%)",
                    100.0 * (b.tokens_per_second / base.tokens_per_second - 1.0),
                    base.step_seconds,
                    100.0 * base.bubble
                );
            }
            if let Some(next) = fits
                .iter()
                .find(|c| !(c.tp == b.tp && c.pp == b.pp && c.ep == b.ep && c.dp == b.dp))
            {
                let _ = writeln!(
                    o,
                    "  the best other mesh, {} with {}: {:.0} tokens/s ({:+.1}%)",
                    next.mesh_text(),
                    next.schedule_text(),
                    next.tokens_per_second,
                    100.0 * (next.tokens_per_second / b.tokens_per_second - 1.0)
                );
            }
            if let Some(n) = &b.note {
                let _ = writeln!(o, "  {n}");
            }
        }
        None => {
            let _ = writeln!(
                o,
                "\nno candidate fits in {:.1} GB per GPU{}",
                req.hardware.hbm_bytes / 1e9,
                req.max_memory
                    .map(|c| format!(
                        " within --max-memory {:.1} GB (without the overhead)",
                        c as f64 / 1e9
                    ))
                    .unwrap_or_default()
            );
        }
    }
    if !fits.is_empty() {
        let _ = writeln!(
            o,
            "\ntop {} of {} that fit:",
            top.min(fits.len()),
            fits.len()
        );
        // The schedule column fits the longest name shown (`interleaved_1f1b_a2a V=4` is 24
        // characters).
        let w = fits
            .iter()
            .take(top)
            .map(|c| c.schedule_text().chars().count())
            .max()
            .unwrap_or(0)
            .max(22);
        let _ = writeln!(
            o,
            "{:<28} {:<w$} {:>5} {:>9} {:>11} {:>8} {:>6} {:>8} {:>6} {:>9}",
            "mesh",
            "schedule",
            "M",
            "step (s)",
            "tokens/s",
            "TFLOP/s",
            "MFU",
            "bubble",
            "a2a",
            "mem (GB)"
        );
        for c in fits.iter().take(top) {
            let _ = writeln!(
                o,
                "{:<28} {:<w$} {:>5} {:>9.3} {:>11.0} {:>8.1} {:>5.1}% {:>7.1}% {:>6} {:>9.1}{}",
                c.mesh_text(),
                c.schedule_text(),
                c.microbatches,
                c.step_seconds,
                c.tokens_per_second,
                c.tflops_per_gpu,
                100.0 * c.mfu,
                100.0 * c.bubble,
                if req.arch.moe.is_some() {
                    format!("{:.0}%", 100.0 * c.a2a_exposed)
                } else {
                    "-".into()
                },
                c.memory_bytes / 1e9,
                if c.note.is_some() { " *" } else { "" }
            );
        }
        if fits.iter().take(top).any(|c| c.note.is_some()) {
            let _ = writeln!(
                o,
                "  * M adjusted to one the schedule accepts (its own tokens per step)"
            );
        }
    }
    let over: Vec<&Candidate> = p.candidates.iter().filter(|c| !c.fits).collect();
    if !over.is_empty() {
        let _ = writeln!(o, "\ndo not fit ({}), the smallest first:", over.len());
        let mut v = over.clone();
        v.sort_by(|a, b| a.memory_bytes.total_cmp(&b.memory_bytes));
        for c in v.iter().take(top) {
            let _ = writeln!(
                o,
                "  {} with {}: {:.1} GB",
                c.mesh_text(),
                c.schedule_text(),
                c.memory_bytes / 1e9
            );
        }
    }
    if !p.skipped.is_empty() {
        let _ = writeln!(o, "\nnot simulated:");
        // One line per (schedule, reason), with the meshes it holds for.
        let mut groups: Vec<(String, String, Vec<String>)> = Vec::new();
        for s in &p.skipped {
            match groups
                .iter_mut()
                .find(|(n, w, _)| *n == s.schedule && *w == s.why)
            {
                Some(g) => g.2.push(s.mesh.clone()),
                None => groups.push((s.schedule.clone(), s.why.clone(), vec![s.mesh.clone()])),
            }
        }
        for (n, w, meshes) in groups {
            let shown: Vec<String> = meshes.iter().take(3).cloned().collect();
            let _ = writeln!(
                o,
                "  {} at {}{}: {w}",
                if n == "*" {
                    "every schedule"
                } else {
                    n.as_str()
                },
                shown.join("; "),
                if meshes.len() > 3 {
                    format!(" and {} more", meshes.len() - 3)
                } else {
                    String::new()
                }
            );
        }
    }
    let pruned: Vec<&MeshBound> = p.meshes.iter().filter(|m| !m.simulated).collect();
    if let Some(first) = pruned.first() {
        let _ = writeln!(
            o,
            "\npruned: {} meshes whose compute bound (at most {:.0} tokens/s, {}) is below the best found",
            pruned.len(),
            first.bound_tokens_per_second,
            first.mesh
        );
    }
    o
}
