//! The entry point of `schedc run ... --backend cuda` ([`run`]): lowers and verifies the
//! programs, opens the GPU (or reports why it cannot), trains, and reports like the CPU
//! backend, with the device, the mode and each rank's device memory.

use crate::api::{DType, Gpu};
use crate::cuda::{self, CudaGpu, CudaNccl};
use crate::driver::{
    execute, execute_rank, stream_kinds, ExecOptions, GpuResult, OnStep, RankMemory,
};
use crate::rendezvous::{self, Rendezvous};
use schedc_cpu::exec::{compare, reference, ExecResult, Optimizer};
use schedc_ir::Program;
use schedc_program::data::{Batching, Data};
use schedc_program::interp::RunFailure;
use schedc_program::mesh::{Dim, Mesh};
use schedc_program::{lower_verified_with, LowerOptions, ModelConfig, ProgramError, VerifyReport};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;

/// `--mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every rank in this process on one GPU (streams per rank, copies as transport).
    #[default]
    Single,
    /// One process per GPU, NCCL between them.
    Nccl,
}

/// NCCL mode's place of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclRank {
    /// Global rank.
    pub rank: u32,
    /// Where the ranks meet.
    pub rendezvous: Rendezvous,
}

/// What `schedc run --backend cuda` needs besides the schedule.
#[derive(Clone)]
pub struct RunConfig {
    /// `--mesh`; `None`: `pp=P`.
    pub mesh: Option<Mesh>,
    /// `--dtype` (storage of activations and weights).
    pub dtype: DType,
    /// `--mode`.
    pub mode: Mode,
    /// `--steps`.
    pub steps: usize,
    /// `--data FILE`; `None`: the built-in text.
    pub data: Option<PathBuf>,
    /// `--verify`: also train sequentially on the CPU (f32) and compare.
    pub verify: bool,
    /// The model.
    pub model: ModelConfig,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// How long a rank may wait without progress.
    pub timeout: Duration,
    /// A callback after each step (progress).
    pub on_step: Option<OnStep>,
    /// The GPU (ordinal) of this process.
    pub device: usize,
    /// `--arch` for NVRTC (default: the device's).
    pub arch: Option<String>,
    /// NCCL mode: this process's rank and the rendezvous.
    pub nccl: Option<NcclRank>,
    /// `--memory-limit`: the device memory the ranks of this process may take together;
    /// `None`: the device's free memory.
    pub memory_limit: Option<u64>,
    /// `--sequence-parallel`: Megatron-LM's sequence parallelism inside the TP group.
    pub sequence_parallel: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            mesh: None,
            dtype: DType::F32,
            mode: Mode::Single,
            steps: 1,
            data: None,
            verify: false,
            model: ModelConfig::small(),
            optimizer: Optimizer::adam(3e-3),
            timeout: Duration::from_secs(60),
            on_step: None,
            device: 0,
            arch: None,
            nccl: None,
            memory_limit: None,
            sequence_parallel: false,
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
    /// Global ranks.
    pub world: u32,
    /// `f32` or `bf16`.
    pub dtype: DType,
    /// `single` or `nccl`.
    pub mode: Mode,
    /// The GPU.
    pub device: String,
    /// Steps run.
    pub steps: usize,
    /// Tokens per step.
    pub tokens_per_step: usize,
    /// Instructions of one step over all ranks.
    pub instructions_per_step: usize,
    /// The checks of the lowered programs.
    pub verified: VerifyReport,
    /// Loss of each step.
    pub loss: Vec<f64>,
    /// With `--verify`: the comparison with the CPU's sequential f32 training, judged under
    /// the CPU backend's f32 tolerance ([`schedc_cpu::Tolerance::of`]), flattened into the
    /// JSON.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub verify: Option<schedc_cpu::Verification>,
    /// Device memory of each rank run by this process.
    pub memory: Vec<RankMemory>,
    /// The largest total over those ranks (bytes).
    pub peak_device_memory: usize,
    /// Wall seconds of the run (kernel compilation excluded).
    pub seconds: f64,
    /// Wall seconds of each step, from the previous step's end (the first from the start
    /// of the run, so with the setup: parameters initialized and uploaded, the pool
    /// reserved): the later steps give the throughput (`gpu-check.sh`'s tokens/s).
    pub step_seconds: Vec<f64>,
}

impl RunReport {
    /// The `--format json` text.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a run report serializes")
    }

    /// The `--format human` text: the CPU backend's lines, then the device's.
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
            self.dtype.name(),
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
        s += &format!("pipelined: {:.3} s", self.seconds);
        if let Some(v) = &self.verify {
            s += &format!(", sequential reference: {:.3} s", v.reference_seconds);
        }
        s += "\n";
        if let Some(v) = &self.verify {
            s += &v.to_human("f32: first-step gradients 1e-3, losses 2% relative");
        }
        s += &format!(
            "device: {} ({} mode), peak device memory per rank {:.1} MiB\n",
            self.device,
            match self.mode {
                Mode::Single => "single-GPU",
                Mode::Nccl => "NCCL",
            },
            self.peak_device_memory as f64 / (1u64 << 20) as f64
        );
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
    /// No usable GPU (no driver, no device, a missing library, a kernel that does not
    /// compile).
    #[error("{0}")]
    Device(String),
    /// A rank failed.
    #[error(transparent)]
    Failed(Box<RunFailure>),
    /// The model does not fit in the device's memory (checked before any allocation).
    #[error("{0}")]
    TooLarge(String),
}

/// `schedc run INPUT ... --backend cuda` (see the module docs). Errors: [`RunError`]; on a
/// machine without a GPU, [`RunError::Device`] starting "no CUDA driver" with the cause.
pub fn run(source: &Program, cfg: &RunConfig) -> Result<RunReport, RunError> {
    if cfg.steps == 0 {
        return Err(RunError::Config("--steps must be at least 1".into()));
    }
    if cfg.verify && cfg.mode == Mode::Nccl {
        return Err(RunError::Config(
            "--verify needs --mode single (in NCCL mode each process holds only its own ranks' gradients)".into(),
        ));
    }
    if cfg.verify && cfg.dtype != DType::F32 {
        return Err(RunError::Config(
            "--verify compares in f32: use --dtype f32".into(),
        ));
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
    let opts = LowerOptions {
        sequence_parallel: cfg.sequence_parallel,
        ..LowerOptions::default()
    };
    let (set, verified) = lower_verified_with(source, cfg.mesh.as_ref(), &cfg.model, opts)?;
    cuda::probe(cfg.mode == Mode::Nccl).map_err(RunError::Device)?;
    let gpu = CudaGpu::new(cfg.device, cfg.dtype, cfg.arch.as_deref()).map_err(RunError::Device)?;
    // Each step's end, for `step_seconds`.
    let marks = std::sync::Arc::new(std::sync::Mutex::new(Vec::with_capacity(cfg.steps)));
    let user = cfg.on_step.clone();
    let mk = marks.clone();
    let on_step: crate::driver::OnStep = std::sync::Arc::new(move |step: usize, loss: f64| {
        mk.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(std::time::Instant::now());
        if let Some(f) = &user {
            f(step, loss);
        }
    });
    let opts = ExecOptions {
        steps: cfg.steps,
        optimizer: cfg.optimizer,
        timeout: cfg.timeout,
        record: cfg.verify,
        on_step: Some(on_step),
    };
    // The ranks of this process share its device: all of them in single mode, one in NCCL
    // mode. Checked before any of the model is allocated (issue 24, item 1).
    let here: Vec<u32> = match (&cfg.mode, &cfg.nccl) {
        (Mode::Nccl, Some(nr)) => vec![nr.rank],
        _ => (0..set.manifest.world).collect(),
    };
    crate::driver::check_memory(&gpu, &set, &here, &cfg.optimizer, cfg.memory_limit)
        .map_err(RunError::TooLarge)?;
    let started = std::time::Instant::now();
    let res = match cfg.mode {
        Mode::Single => execute(&gpu, &set, &data, &opts),
        Mode::Nccl => {
            let nr = cfg.nccl.as_ref().ok_or_else(|| {
                RunError::Config(
                    "--mode nccl needs this process's --rank and a --rendezvous".into(),
                )
            })?;
            let world = set.manifest.world;
            let n = stream_kinds(&set).len() + 1;
            let ids = if nr.rank == 0 {
                Some(
                    (0..n)
                        .map(|_| cuda::nccl_unique_id())
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(RunError::Device)?,
                )
            } else {
                None
            };
            let ids = rendezvous::exchange(&nr.rendezvous, nr.rank, world, ids, cfg.timeout)
                .map_err(RunError::Device)?;
            let coll = CudaNccl::new(&gpu, nr.rank, world, &ids).map_err(RunError::Device)?;
            execute_rank(&gpu, &coll, &set, nr.rank, &data, &opts)
        }
    };
    let res = res.map_err(|e| RunError::Failed(Box::new(e)))?;
    let marks = marks.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let step_seconds = step_seconds(started, &marks);
    let mut r = report(
        &set.manifest,
        &set,
        verified,
        &res,
        cfg,
        gpu.describe(),
        &data,
    )?;
    r.step_seconds = step_seconds;
    Ok(r)
}

/// Seconds between consecutive step ends, the first from `start`.
fn step_seconds(start: std::time::Instant, ends: &[std::time::Instant]) -> Vec<f64> {
    let mut prev = start;
    ends.iter()
        .map(|&t| {
            let d = t.saturating_duration_since(prev).as_secs_f64();
            prev = t;
            d
        })
        .collect()
}

fn report(
    m: &schedc_program::Manifest,
    set: &schedc_program::ProgramSet,
    verified: VerifyReport,
    res: &GpuResult,
    cfg: &RunConfig,
    device: String,
    data: &Data,
) -> Result<RunReport, RunError> {
    let batching = reference_batching(m);
    let mut rep = RunReport {
        pp: m.pp,
        microbatches: m.microbatches,
        directions: m.directions,
        stages: m.stages,
        mesh: m.mesh.to_string(),
        world: m.world,
        dtype: cfg.dtype,
        mode: cfg.mode,
        device,
        steps: cfg.steps,
        tokens_per_step: batching.tokens(cfg.model.micro_batch_tokens()),
        instructions_per_step: set.len(),
        verified,
        loss: res.losses.clone(),
        verify: None,
        memory: res.memory.clone(),
        peak_device_memory: res.memory.iter().map(|x| x.total()).max().unwrap_or(0),
        seconds: res.seconds,
        step_seconds: Vec::new(),
    };
    if cfg.verify {
        let r = reference::<f32>(
            &cfg.model,
            m.model_stages as usize,
            batching,
            data,
            cfg.steps,
            &cfg.optimizer,
        )
        .map_err(RunError::Config)?;
        let ex = as_exec_result(res);
        let c = compare(&ex, &r).map_err(RunError::Config)?;
        rep.judge(c, &r);
    }
    Ok(rep)
}

impl RunReport {
    /// Records `--verify`'s comparison `c` with the sequential `reference` and its verdict
    /// under the CPU backend's f32 tolerance ([`schedc_cpu::Tolerance::of`]; a NaN
    /// difference never passes).
    pub fn judge(
        &mut self,
        c: schedc_cpu::exec::Comparison,
        reference: &schedc_cpu::exec::Reference,
    ) {
        self.verify = Some(schedc_cpu::Verification::judge(
            c,
            reference,
            schedc_cpu::Tolerance::of(schedc_cpu::DType::F32),
        ));
    }
}

/// The batching of `--verify`'s sequential reference for the programs of `m`: each SP
/// chunk (and with Megatron sequence parallelism each TP shard of it) routes alone, as on
/// the ranks.
pub fn reference_batching(m: &schedc_program::Manifest) -> Batching {
    Batching {
        shards: m.mesh.data_shards() as usize,
        microbatches: (m.microbatches * m.directions) as usize,
        sp: m.mesh.size(Dim::Sp) as usize
            * if m.sequence_parallel {
                m.mesh.size(Dim::Tp) as usize
            } else {
                1
            },
    }
}

/// A GPU run in the CPU executor's result type (for its comparisons).
pub fn as_exec_result(r: &GpuResult) -> ExecResult {
    ExecResult {
        losses: r.losses.clone(),
        grads: r.grads.clone(),
        params: r.params.clone(),
        seconds: r.seconds,
        instructions: r.instructions,
        trace: Vec::new(),
        traffic: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(loss: Vec<f64>) -> RunReport {
        RunReport {
            pp: 2,
            microbatches: 2,
            directions: 1,
            stages: 2,
            mesh: "pp=2".into(),
            world: 2,
            dtype: DType::F32,
            mode: Mode::Single,
            device: "test".into(),
            steps: loss.len(),
            tokens_per_step: 8,
            instructions_per_step: 10,
            verified: VerifyReport {
                ops: 10,
                messages: 2,
                collectives: 0,
                peak_stash: vec![2, 1],
                peak_activations: vec![2, 1],
            },
            loss,
            verify: None,
            memory: Vec::new(),
            peak_device_memory: 0,
            seconds: 0.5,
            step_seconds: Vec::new(),
        }
    }

    #[test]
    fn step_seconds_are_the_gaps_between_step_ends() {
        let t0 = std::time::Instant::now();
        let ms = std::time::Duration::from_millis;
        let ends = [t0 + ms(1500), t0 + ms(1750), t0 + ms(2000)];
        assert_eq!(super::step_seconds(t0, &ends), vec![1.5, 0.25, 0.25]);
    }

    fn reference() -> schedc_cpu::exec::Reference {
        schedc_cpu::exec::Reference {
            losses: vec![5.8131],
            grads: Vec::new(),
            params: Vec::new(),
            seconds: 0.25,
        }
    }

    fn comparison(grad: f64) -> schedc_cpu::exec::Comparison {
        schedc_cpu::exec::Comparison {
            max_rel_grad_err: grad,
            first_step_rel_grad_err: grad,
            worst_grad: "layer0.wq at step 0 on rank 1".into(),
            ..Default::default()
        }
    }

    // Issue 11, item 4 for the CUDA backend: --verify judges (NaN fails) and names the worst
    // tensor, step and rank; item 33: one step's loss is one figure.
    #[test]
    fn verify_verdict_and_one_step_loss() {
        let mut r = report(vec![5.8131]);
        r.judge(comparison(1e-5), &reference());
        assert_eq!(r.verify.as_ref().map(|v| v.verify_passed), Some(true));
        let h = r.to_human();
        assert!(h.contains("loss: 5.8131 (one step)"), "{h}");
        assert!(h.contains("verify passed"), "{h}");
        for bad in [2e-3, f64::NAN] {
            let mut r = report(vec![5.8131, 5.5]);
            r.judge(comparison(bad), &reference());
            assert_eq!(
                r.verify.as_ref().map(|v| v.verify_passed),
                Some(false),
                "{bad}"
            );
            let h = r.to_human();
            assert!(h.contains("verify FAILED"), "{h}");
            assert!(h.contains("layer0.wq at step 0 on rank 1"), "{h}");
            assert!(h.contains("(step 0) -> 5.5000 (step 1)"), "{h}");
        }
    }
}
