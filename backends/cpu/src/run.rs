//! The entry point of `schedc run ... --backend cpu` ([`run`]).

use crate::exec::{
    compare, execute, reference, A2aMode, Batching, Comparison, Data, ExecOptions, OnStep,
    Optimizer, Reference, RunFailure, SpanSink,
};
use crate::tensor::Real;
use schedc_ir::Program;
use schedc_program::mesh::{Dim, Mesh};
use schedc_program::{
    lower_verified_with, LowerOptions, ModelConfig, ProgramError, ProgramSet, VerifyReport,
};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// `--dtype`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// Single precision.
    F32,
    /// Double precision (the default: the one the equivalence guarantees are stated in).
    #[default]
    F64,
}

impl std::str::FromStr for DType {
    type Err = String;
    /// `f32` or `f64`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(DType::F32),
            "f64" => Ok(DType::F64),
            _ => Err(format!("unknown dtype `{s}`: expected f32 or f64")),
        }
    }
}

/// What `schedc run` needs besides the schedule.
#[derive(Clone)]
pub struct RunConfig {
    /// `--mesh`; `None`: `pp=P` only.
    pub mesh: Option<Mesh>,
    /// `--dtype`.
    pub dtype: DType,
    /// `--steps`.
    pub steps: usize,
    /// `--data FILE` (bytes); `None`: a short built-in text.
    pub data: Option<PathBuf>,
    /// `--verify`: also train sequentially and compare.
    pub verify: bool,
    /// The model.
    pub model: ModelConfig,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// How long a rank may wait for a message before the run fails.
    pub timeout: Duration,
    /// Draw a progress bar on standard error.
    pub progress: bool,
    /// Record the Chrome trace of the pipelined run ([`RunReport::trace`]).
    pub trace: bool,
    /// With `trace`: stream the spans here as the run goes ([`ExecOptions::trace_sink`],
    /// e.g. a [`crate::exec::ChromeTraceWriter`] on the trace file) instead of keeping them
    /// all for [`RunReport::trace`] (which is then `None`).
    pub trace_sink: Option<SpanSink>,
    /// `--a2a`: how the expert-parallel all-to-alls cross nodes (the mesh's `node=K`).
    pub a2a: A2aMode,
    /// `--sequence-parallel`: Megatron-LM's sequence parallelism inside the TP group
    /// (needs `tp > 1`).
    pub sequence_parallel: bool,
    /// `--memory-limit`: the bytes the model (every rank's parameters, optimizer state and
    /// activations) may take; `None`: the host's available memory.
    pub memory_limit: Option<u64>,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            mesh: None,
            dtype: DType::F64,
            steps: 1,
            data: None,
            verify: false,
            model: ModelConfig::small(),
            optimizer: Optimizer::adam(3e-3),
            timeout: Duration::from_secs(60),
            progress: false,
            trace: false,
            trace_sink: None,
            a2a: A2aMode::Flat,
            sequence_parallel: false,
            memory_limit: None,
        }
    }
}

/// Bytes (or messages) by network level.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ByLevel {
    /// Between ranks of one node (NVLink).
    pub intra_node: u64,
    /// Between nodes (the scale-out network).
    pub inter_node: u64,
}

/// Where `--verify` found the largest differences.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Worst {
    /// The gradient: `TENSOR at step S on rank R`.
    pub grad: String,
    /// The step of the largest loss difference.
    pub loss_step: usize,
    /// The parameter after the last step: `TENSOR on rank R`.
    pub param: String,
}

/// The differences `--verify` accepts between the pipelined run and sequential training.
///
/// f64 holds every figure of every step to 1e-9 (the CPU backend measures 1e-13 or less
/// over hundreds of steps; `backends/cpu/tests/equivalence.rs` asserts 1e-10). In f32 the
/// two runs' different orders of summation change a top-k expert choice after some steps,
/// and from then on their trajectories differ: f32 holds the first step's gradients to 1e-3
/// and loss to 1e-4 (same weights, only the summation order differs), and every step's loss
/// to 2% (relative); its later gradients and final parameters are reported, not judged.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Tolerance {
    /// Largest relative gradient difference (infinity norm per tensor), over every step, or
    /// over the first only if `grads_first_step_only`.
    pub rel_grad: f64,
    /// The gradient tolerance applies to the first step only.
    pub grads_first_step_only: bool,
    /// Largest absolute loss difference of the first step.
    pub abs_loss_first_step: f64,
    /// Largest relative loss difference of any step.
    pub rel_loss: f64,
    /// Largest relative parameter difference after the last step (`None`: not judged).
    pub rel_param: Option<f64>,
}

impl Tolerance {
    /// The tolerance of a dtype (see the type's docs).
    pub fn of(dtype: DType) -> Tolerance {
        match dtype {
            DType::F64 => Tolerance {
                rel_grad: 1e-9,
                grads_first_step_only: false,
                abs_loss_first_step: 1e-9,
                rel_loss: 1e-9,
                rel_param: Some(1e-9),
            },
            DType::F32 => Tolerance {
                rel_grad: 1e-3,
                grads_first_step_only: true,
                abs_loss_first_step: 1e-4,
                rel_loss: 2e-2,
                rel_param: None,
            },
        }
    }

    /// Ok if every judged difference is within its tolerance; otherwise the first that is
    /// not, as `what: value > tolerance`. NaN never passes.
    pub fn judge(&self, c: &Comparison) -> Result<(), String> {
        let grad = if self.grads_first_step_only {
            c.first_step_rel_grad_err
        } else {
            c.max_rel_grad_err
        };
        let mut checks = vec![
            (
                if self.grads_first_step_only {
                    "relative gradient difference at the first step"
                } else {
                    "relative gradient difference"
                },
                grad,
                self.rel_grad,
            ),
            (
                "absolute loss difference at the first step",
                c.first_step_abs_loss_err,
                self.abs_loss_first_step,
            ),
            (
                "relative loss difference",
                c.max_rel_loss_err,
                self.rel_loss,
            ),
        ];
        if let Some(p) = self.rel_param {
            checks.push(("relative parameter difference", c.max_rel_param_err, p));
        }
        for (what, v, tol) in checks {
            // `!(v <= tol)` is true for NaN.
            if v.is_nan() || v > tol {
                return Err(format!("{what} {v:.3e} > {tol:.0e}"));
            }
        }
        Ok(())
    }
}

/// What `--verify` found: the sequential reference, the differences from it, and the
/// verdict. Shared by every backend's run report, where it is flattened into the report's
/// JSON (the keys below appear at the top level, absent without `--verify`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verification {
    /// The sequential reference's loss of each step.
    pub reference_loss: Vec<f64>,
    /// Largest relative gradient difference (infinity norm per tensor) over all steps.
    pub max_rel_grad_err: f64,
    /// Largest absolute loss difference.
    pub max_abs_loss_err: f64,
    /// Largest relative parameter difference after the last step.
    pub max_rel_param_err: f64,
    /// Where the largest differences are.
    pub worst: Worst,
    /// The tolerances judged.
    pub tolerance: Tolerance,
    /// True if every judged difference is within its tolerance (NaN never is); `schedc
    /// run` exits 1 otherwise.
    pub verify_passed: bool,
    /// When it failed: which difference, its value and its tolerance.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verify_failure: Option<String>,
    /// Wall seconds of the sequential reference.
    pub reference_seconds: f64,
}

impl Verification {
    /// Judges a comparison `c` of the pipelined run with the sequential `reference` under
    /// `tol` (a NaN difference never passes).
    pub fn judge(c: Comparison, reference: &Reference, tol: Tolerance) -> Verification {
        let judged = tol.judge(&c);
        Verification {
            reference_loss: reference.losses.clone(),
            max_rel_grad_err: c.max_rel_grad_err,
            max_abs_loss_err: c.max_abs_loss_err,
            max_rel_param_err: c.max_rel_param_err,
            worst: Worst {
                grad: c.worst_grad,
                loss_step: c.worst_loss_step,
                param: c.worst_param,
            },
            tolerance: tol,
            verify_passed: judged.is_ok(),
            verify_failure: judged.err(),
            reference_seconds: reference.seconds,
        }
    }

    /// The `--format human` lines: the verdict with the three differences, the tolerance
    /// (`tolerance`: how to describe it), the failure, and where the worst differences are.
    pub fn to_human(&self, tolerance: &str) -> String {
        let verdict = if self.verify_passed {
            "passed"
        } else {
            "FAILED"
        };
        let mut s = format!(
            "verify {verdict}: max_rel_grad_err {:.3e}, max_abs_loss_err {:.3e}, max_rel_param_err {:.3e} (tolerance {tolerance})\n",
            self.max_rel_grad_err, self.max_abs_loss_err, self.max_rel_param_err
        );
        if let Some(f) = &self.verify_failure {
            s += &format!("  failed: {f}\n");
        }
        // Where every difference is exactly 0 there is no worst one to name.
        let none = "none (all equal)";
        if self.max_rel_grad_err == 0.0
            && self.max_abs_loss_err == 0.0
            && self.max_rel_param_err == 0.0
        {
            s += "  every gradient, loss and parameter equals sequential training's exactly\n";
            return s;
        }
        s += &format!(
            "  worst gradient: {}; worst loss: {}; worst parameter: {}\n",
            if self.max_rel_grad_err == 0.0 {
                none.to_string()
            } else {
                self.worst.grad.clone()
            },
            if self.max_abs_loss_err == 0.0 {
                none.to_string()
            } else {
                format!("step {}", self.worst.loss_step)
            },
            if self.max_rel_param_err == 0.0 {
                none.to_string()
            } else {
                self.worst.param.clone()
            },
        );
        s
    }
}

/// The result of [`run`]; `--format json` prints it as is.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// Pipeline ranks P.
    pub pp: u32,
    /// Micro-batches per direction M.
    pub microbatches: u32,
    /// DualPipe's 2, else 1.
    pub directions: u32,
    /// IR stages.
    pub stages: u32,
    /// The mesh.
    pub mesh: String,
    /// Global ranks (threads).
    pub world: u32,
    /// `f32` or `f64`.
    pub dtype: DType,
    /// Steps run.
    pub steps: usize,
    /// Tokens per step (global batch).
    pub tokens_per_step: usize,
    /// Instructions of one step over all ranks.
    pub instructions_per_step: usize,
    /// The checks of the lowered programs.
    pub verified: VerifyReport,
    /// Loss of each step.
    pub loss: Vec<f64>,
    /// With `--verify`: the comparison with sequential training (flattened into the JSON).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Verification>,
    /// Wall seconds of the pipelined run.
    pub seconds: f64,
    /// `--a2a`.
    pub a2a: A2aMode,
    /// Bytes the expert-parallel all-to-alls moved over the whole run, by level (nodes of
    /// the mesh's `node=K`; a rank's packets for itself not counted).
    pub a2a_bytes: ByLevel,
    /// Messages of the expert-parallel all-to-alls, by level.
    pub a2a_messages: ByLevel,
    /// Of the inter-node bytes, the forward dispatch's.
    pub dispatch_inter_node_bytes: u64,
    /// Bytes the tensor-parallel all-reduces moved (each member's partial sums to every
    /// other member), by level.
    pub tp_bytes: ByLevel,
    /// With [`RunConfig::trace`]: the Chrome trace JSON of the pipelined run
    /// ([`crate::exec::chrome_trace`]); not part of the report's JSON.
    #[serde(skip)]
    pub trace: Option<String>,
}

impl RunReport {
    /// The `--format json` text.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a run report serializes")
    }

    /// The `--format human` text.
    pub fn to_human(&self) -> String {
        let mut s = format!(
            "ran {} step(s) on {} rank(s) (mesh {}), P={} M={}{}, {}: {} instructions per step, {} tokens per step\n",
            self.steps,
            self.world,
            self.mesh,
            self.pp,
            self.microbatches,
            if self.directions == 2 {
                format!(" per direction ({} in all)", 2 * self.microbatches)
            } else {
                String::new()
            },
            match self.dtype {
                DType::F32 => "f32",
                DType::F64 => "f64",
            },
            self.instructions_per_step,
            self.tokens_per_step,
        );
        match (self.loss.first(), self.loss.last()) {
            (Some(only), _) if self.loss.len() == 1 => {
                s += &format!("loss: {only:.4} (one step)\n")
            }
            (Some(first), Some(last)) => {
                s += &format!(
                    "loss: {first:.4} (step 0) -> {last:.4} (step {})\n",
                    self.loss.len() - 1
                )
            }
            _ => {}
        }
        if self.a2a_messages.intra_node + self.a2a_messages.inter_node > 0 {
            s += &format!(
                "all-to-all ({}): {} B inside nodes, {} B between nodes ({} messages; dispatch {} B)\n",
                match self.a2a {
                    A2aMode::Flat => "flat",
                    A2aMode::Hierarchical => "hierarchical",
                },
                self.a2a_bytes.intra_node,
                self.a2a_bytes.inter_node,
                self.a2a_messages.inter_node,
                self.dispatch_inter_node_bytes,
            );
        }
        if self.tp_bytes.intra_node + self.tp_bytes.inter_node > 0 {
            s += &format!(
                "tensor-parallel collectives: {} B inside nodes, {} B between nodes\n",
                self.tp_bytes.intra_node, self.tp_bytes.inter_node
            );
        }
        s += &format!("pipelined: {:.3} s", self.seconds);
        if let Some(v) = &self.verify {
            s += &format!(", sequential reference: {:.3} s", v.reference_seconds);
        }
        s += "\n";
        if let Some(v) = &self.verify {
            s += &v.to_human(match self.dtype {
                DType::F32 => "f32: first-step gradients 1e-3, losses 2% relative",
                DType::F64 => "f64: 1e-9",
            });
        }
        s
    }
}

/// Why [`run`] failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Lowering or verifying the programs.
    #[error(transparent)]
    Program(#[from] ProgramError),
    /// The data or the configuration.
    #[error("{0}")]
    Config(String),
    /// A rank failed.
    #[error(transparent)]
    Failed(Box<RunFailure>),
    /// The run's estimated memory exceeds the limit ([`estimate_memory`]).
    #[error("{0}")]
    TooLarge(String),
}

/// Resident bytes per global rank besides its instructions (the thread, its stack, the
/// stage's weights, gradients and Adam state, channels), measured: 604 MB for `schedc run
/// specs/1f1b.sched --pp 128 --mb 16` (128 ranks, 76 400 instructions), about 4.6 MB per
/// rank, rounded up to 8 MiB.
pub const BYTES_PER_RANK: u64 = 8 << 20;

/// An upper bound on the parameters of one stage of `m`: every stage counted with the
/// embedding and the output head.
pub fn params_per_stage(m: &ModelConfig) -> u64 {
    let (h, eh, v, e) = (
        m.hidden as u64,
        m.expert_hidden as u64,
        m.vocab as u64,
        m.experts as u64,
    );
    // Attention (MLA: low-rank query and key-value projections, bounded generously) plus
    // the routed experts, the shared expert, the router and the norms.
    let (ql, kvl, heads) = (m.q_lora_rank as u64, m.kv_lora_rank as u64, m.heads as u64);
    let head = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) as u64;
    let attn =
        h * (ql + kvl + m.qk_rope_head_dim as u64) + (ql + kvl + h) * heads * head + ql + kvl;
    let layer = attn.max(4 * h * h) + e * 3 * h * eh + 3 * h * eh + h * e + 2 * h + e;
    m.layers_per_stage as u64 * layer + 2 * v * h + h
}

/// Bytes a traced run holds per instruction of a step when the trace is streamed
/// ([`RunConfig::trace_sink`]): each rank's spans of the step it is running and of one step
/// waiting to be written. A span (its name, stream and chunk strings) measured about 250 B;
/// doubled, for two steps: 1 KiB.
pub const TRACE_BYTES_PER_STEP_INSTRUCTION: u64 = 1 << 10;

/// Bytes a traced run holds per instruction of every step when the trace is kept whole
/// ([`RunReport::trace`]): the spans, then the JSON. Measured: `schedc run
/// specs/dualpipe.sched --pp 4 --mb 8 --steps 400 --trace` peaked at 974 MB before the trace
/// was streamed, 2.2 KiB per instruction of a step (1096) per step; doubled: 4.5 KiB.
pub const TRACE_BYTES_PER_INSTRUCTION: u64 = 4608;

/// The estimated peak memory of [`run`], bytes (saturating): lowering and verifying the
/// programs ([`schedc_program::estimate_memory`]), [`BYTES_PER_RANK`] per global rank,
/// with `verify` the recorded gradients of every step (f64, on every rank and in the
/// sequential reference), and with `trace` the spans held: about two steps' when streamed
/// ([`TRACE_BYTES_PER_STEP_INSTRUCTION`]), every step's otherwise
/// ([`TRACE_BYTES_PER_INSTRUCTION`]).
pub fn estimate_memory(source: &Program, world: u64, cfg: &RunConfig) -> u64 {
    estimate_memory_of(&schedc::limits::Size::of(source), world, cfg)
}

/// [`estimate_memory`] from the size of the instance alone (for a spec, before it is
/// elaborated: see [`schedc::limits::spec_size_lower_bound`]).
pub fn estimate_memory_of(size: &schedc::limits::Size, world: u64, cfg: &RunConfig) -> u64 {
    let stages = size.stages.max(1);
    let mut b = schedc_program::estimate_memory(size, world, &cfg.model)
        .saturating_add(world.saturating_mul(BYTES_PER_RANK))
        .saturating_add((cfg.steps as u64).saturating_mul(16));
    if cfg.verify {
        let per_step = world
            .saturating_add(stages)
            .saturating_mul(params_per_stage(&cfg.model))
            .saturating_mul(8);
        b = b.saturating_add(per_step.saturating_mul(cfg.steps as u64));
    }
    if cfg.trace {
        let replicas = (world / size.ranks.max(1)).max(1);
        let instructions = size
            .compute_ops
            .saturating_mul(schedc_program::INSTRUCTIONS_PER_COMPUTE_OP)
            .saturating_mul(cfg.model.layers_per_stage.max(1) as u64)
            .saturating_mul(replicas);
        b = b.saturating_add(match cfg.trace_sink {
            Some(_) => instructions.saturating_mul(TRACE_BYTES_PER_STEP_INSTRUCTION),
            None => instructions
                .saturating_mul(TRACE_BYTES_PER_INSTRUCTION)
                .saturating_mul(cfg.steps as u64),
        });
    }
    b
}

/// `schedc run INPUT ... --backend cpu`: lowers and verifies the programs, trains
/// `cfg.steps` steps with one thread per global rank, and with `cfg.verify` compares with
/// sequential training. Errors: [`RunError`].
pub fn run(source: &Program, cfg: &RunConfig) -> Result<RunReport, RunError> {
    if cfg.steps == 0 {
        return Err(RunError::Config("--steps must be at least 1".into()));
    }
    let world = cfg
        .mesh
        .as_ref()
        .map_or(source.pipeline.pp as u64, |m| m.world() as u64);
    schedc::limits::within_limit(
        &format!(
            "running P={} M={}{} on {world} global ranks{} for {} step(s){}",
            source.pipeline.pp,
            source.pipeline.total_microbatches(),
            if source.pipeline.stages != source.pipeline.pp {
                format!(" with {} stages", source.pipeline.stages)
            } else {
                String::new()
            },
            cfg.mesh
                .as_ref()
                .map(|m| format!(" (mesh {m})"))
                .unwrap_or_default(),
            cfg.steps,
            if cfg.verify { " with --verify" } else { "" }
        ),
        estimate_memory(source, world, cfg),
    )
    .map_err(RunError::TooLarge)?;
    let opts = LowerOptions {
        sequence_parallel: cfg.sequence_parallel,
        ..LowerOptions::default()
    };
    let (set, verified) = lower_verified_with(source, cfg.mesh.as_ref(), &cfg.model, opts)?;
    // The model's memory, before any of it is allocated (issue 24, item 1).
    check_model_memory(&set, &verified, cfg)?;
    let data = match &cfg.data {
        Some(p) => Data::from_file(p).map_err(RunError::Config)?,
        None => Data::builtin(),
    };
    if data.vocab_needed() > cfg.model.vocab {
        return Err(RunError::Config(format!(
            "the data has token {} but the model's vocabulary is {}",
            data.vocab_needed() - 1,
            cfg.model.vocab
        )));
    }
    data.sequence(0, cfg.model.seq_len)
        .map_err(RunError::Config)?;
    match cfg.dtype {
        DType::F32 => run_typed::<f32>(&set, verified, &data, cfg),
        DType::F64 => run_typed::<f64>(&set, verified, &data, cfg),
    }
}

/// Checks that every rank's parameters, optimizer state and peak activations
/// ([`schedc_program::memory::cpu_needs`]) fit together in [`RunConfig::memory_limit`], or
/// else in the host's available memory. Errors: [`RunError::TooLarge`] naming the rank,
/// its need and the limit.
pub fn check_model_memory(
    set: &ProgramSet,
    verified: &VerifyReport,
    cfg: &RunConfig,
) -> Result<(), RunError> {
    let (limit, name) = match cfg.memory_limit {
        Some(l) => (l, "--memory-limit".to_string()),
        None => match schedc_program::memory::available_ram() {
            Some(a) => (a, "the memory available on this host".to_string()),
            None => return Ok(()),
        },
    };
    let elem = match cfg.dtype {
        DType::F32 => 4,
        DType::F64 => 8,
    };
    let needs =
        schedc_program::memory::cpu_needs(set, &verified.peak_activations, elem, cfg.verify);
    schedc_program::memory::check_fit(&needs, limit, &name, true).map_err(|e| {
        RunError::TooLarge(format!(
            "{e}: give a smaller --model, --seq, --micro-batch-size or mesh, or raise --memory-limit"
        ))
    })
}

fn run_typed<T: Real>(
    set: &ProgramSet,
    verified: VerifyReport,
    data: &Data,
    cfg: &RunConfig,
) -> Result<RunReport, RunError> {
    let m = &set.manifest;
    let batching = Batching {
        shards: m.mesh.data_shards() as usize,
        microbatches: (m.microbatches * m.directions) as usize,
        // Each SP chunk (and with --sequence-parallel each TP shard of it) routes alone.
        sp: m.mesh.size(Dim::Sp) as usize
            * if m.sequence_parallel {
                m.mesh.size(Dim::Tp) as usize
            } else {
                1
            },
    };
    let bar = cfg.progress.then(|| {
        let b = indicatif::ProgressBar::new(cfg.steps as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{wide_bar} {pos}/{len} steps {elapsed_precise} eta {eta} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let on_step: Option<OnStep> = bar.clone().map(|b| {
        Arc::new(move |_step: usize, loss: f64| {
            b.set_message(format!("loss {loss:.4}"));
            b.inc(1);
        }) as OnStep
    });
    let opts = ExecOptions {
        steps: cfg.steps,
        optimizer: cfg.optimizer,
        timeout: cfg.timeout,
        record: cfg.verify,
        trace: cfg.trace,
        trace_sink: cfg.trace_sink.clone(),
        on_step,
        a2a: cfg.a2a,
        ..ExecOptions::default()
    };
    let res = execute::<T>(set, data, &opts);
    if let Some(b) = &bar {
        b.finish();
    }
    let res = res.map_err(|e| RunError::Failed(Box::new(e)))?;
    let mut report = RunReport {
        pp: m.pp,
        microbatches: m.microbatches,
        directions: m.directions,
        stages: m.stages,
        mesh: m.mesh.to_string(),
        world: m.world,
        dtype: if T::NAME == "f32" {
            DType::F32
        } else {
            DType::F64
        },
        steps: cfg.steps,
        tokens_per_step: batching.tokens(cfg.model.micro_batch_tokens()),
        instructions_per_step: set.len(),
        verified,
        loss: res.losses.clone(),
        verify: None,
        seconds: res.seconds,
        a2a: cfg.a2a,
        a2a_bytes: ByLevel {
            intra_node: res.traffic.a2a_intra_bytes,
            inter_node: res.traffic.a2a_inter_bytes,
        },
        a2a_messages: ByLevel {
            intra_node: res.traffic.a2a_intra_messages,
            inter_node: res.traffic.a2a_inter_messages,
        },
        dispatch_inter_node_bytes: res.traffic.dispatch_inter_bytes,
        tp_bytes: ByLevel {
            intra_node: res.traffic.tp_bytes - res.traffic.tp_inter_bytes,
            inter_node: res.traffic.tp_inter_bytes,
        },
        trace: (cfg.trace && cfg.trace_sink.is_none())
            .then(|| crate::exec::chrome_trace(&res.trace)),
    };
    if cfg.verify {
        let r = reference::<T>(
            &cfg.model,
            m.model_stages as usize,
            batching,
            data,
            cfg.steps,
            &cfg.optimizer,
        )
        .map_err(RunError::Config)?;
        let c = compare(&res, &r).map_err(RunError::Config)?;
        report.verify = Some(Verification::judge(c, &r, Tolerance::of(report.dtype)));
    }
    Ok(report)
}
