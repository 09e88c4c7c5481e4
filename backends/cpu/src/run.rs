//! The entry point of `schedc run ... --backend cpu` ([`run`]).

use crate::exec::{
    compare, execute, reference, Batching, Data, ExecOptions, OnStep, Optimizer, RunFailure,
};
use crate::tensor::Real;
use schedc_ir::Program;
use schedc_program::mesh::{Dim, Mesh};
use schedc_program::{lower_verified, ModelConfig, ProgramError, ProgramSet, VerifyReport};
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
        }
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
    /// With `--verify`: the sequential reference's loss of each step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_loss: Option<Vec<f64>>,
    /// With `--verify`: largest relative gradient difference over all steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rel_grad_err: Option<f64>,
    /// With `--verify`: largest absolute loss difference.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_abs_loss_err: Option<f64>,
    /// With `--verify`: largest relative parameter difference after the last step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rel_param_err: Option<f64>,
    /// Wall seconds of the pipelined run.
    pub seconds: f64,
    /// With `--verify`: wall seconds of the sequential reference.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_seconds: Option<f64>,
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
        if let (Some(first), Some(last)) = (self.loss.first(), self.loss.last()) {
            s += &format!(
                "loss: {first:.4} (step 0) -> {last:.4} (step {})\n",
                self.loss.len() - 1
            );
        }
        s += &format!("pipelined: {:.3} s", self.seconds);
        if let Some(r) = self.reference_seconds {
            s += &format!(", sequential reference: {r:.3} s");
        }
        s += "\n";
        if let (Some(g), Some(l), Some(p)) = (
            self.max_rel_grad_err,
            self.max_abs_loss_err,
            self.max_rel_param_err,
        ) {
            s += &format!(
                "verify: max_rel_grad_err {g:.3e}, max_abs_loss_err {l:.3e}, max_rel_param_err {p:.3e}\n"
            );
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
}

/// `schedc run INPUT ... --backend cpu`: lowers and verifies the programs, trains
/// `cfg.steps` steps with one thread per global rank, and with `cfg.verify` compares with
/// sequential training. Errors: [`RunError`]; the CPU backend also refuses `tp > 1` (it
/// has no tensor-parallel kernels).
pub fn run(source: &Program, cfg: &RunConfig) -> Result<RunReport, RunError> {
    if let Some(m) = &cfg.mesh {
        if m.size(Dim::Tp) > 1 {
            return Err(RunError::Config(
                "the CPU backend has no tensor-parallel kernels: use tp=1 (the mesh builds the groups; the executor does not split weights)".into(),
            ));
        }
    }
    if cfg.steps == 0 {
        return Err(RunError::Config("--steps must be at least 1".into()));
    }
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
    let (set, verified) = lower_verified(source, cfg.mesh.as_ref(), &cfg.model)?;
    match cfg.dtype {
        DType::F32 => run_typed::<f32>(&set, verified, &data, cfg),
        DType::F64 => run_typed::<f64>(&set, verified, &data, cfg),
    }
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
        sp: m.mesh.size(Dim::Sp) as usize,
    };
    let bar = cfg.progress.then(|| {
        let b = indicatif::ProgressBar::new(cfg.steps as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {pos}/{len} steps {elapsed_precise} eta {eta} {msg}",
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
        on_step,
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
        tokens_per_step: batching.tokens(cfg.model.seq_len),
        instructions_per_step: set.len(),
        verified,
        loss: res.losses.clone(),
        reference_loss: None,
        max_rel_grad_err: None,
        max_abs_loss_err: None,
        max_rel_param_err: None,
        seconds: res.seconds,
        reference_seconds: None,
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
        report.reference_loss = Some(r.losses);
        report.reference_seconds = Some(r.seconds);
        report.max_rel_grad_err = Some(c.max_rel_grad_err);
        report.max_abs_loss_err = Some(c.max_abs_loss_err);
        report.max_rel_param_err = Some(c.max_rel_param_err);
    }
    Ok(report)
}
