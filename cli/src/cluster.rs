//! `--model`, `--hardware`, `--mesh` and the training options shared by `sim` and
//! `compare`: the model-level cost model of [`schedc::costmodel`], and the step-level report
//! (step time, tokens/s, TFLOP/s per GPU, MFU, memory in bytes) it adds to the simulator's.

use schedc::costmodel::{
    self, arch, hardware::Hardware, layout, Derived, Efficiency, StepReport, Training,
};
use schedc::sim::SimResult;
use schedc_ir::Pipeline;

/// The model, the cluster and the layout.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ClusterArgs {
    /// Derive op times and memory from a model: a Hugging Face config.json (Llama, Qwen2/3,
    /// Qwen3-MoE, Mixtral, DeepSeek-V2/V3) or a preset (dsv3, qwen3-235b-a22b,
    /// qwen3-30b-a3b, llama3-8b, llama3-70b, dense70b, zb-6.2b). Replaces --cost.
    #[arg(long, value_name = "CONFIG.JSON|PRESET")]
    pub model: Option<String>,
    /// GPU and links with --model: a100, h100, h200, h800, b200, or a TOML file (default
    /// h100).
    #[arg(long, value_name = "PRESET|FILE")]
    pub hardware: Option<String>,
    /// The device mesh with --model, e.g. tp=2,pp=8,ep=32,dp=16,cp=1 (pp defaults to the
    /// schedule's P; ep is folded into tp*cp*dp; cp splits the sequence, its key-value
    /// exchange is not priced).
    #[arg(long, value_name = "tp=,pp=,ep=,dp=,cp=")]
    pub mesh: Option<String>,
    /// Tokens per sequence with --model (default 4096).
    #[arg(long, value_name = "TOKENS")]
    pub seq: Option<u64>,
    /// Sequences per micro-batch with --model (default 1).
    #[arg(long, value_name = "SEQS")]
    pub micro_batch_size: Option<u64>,
    /// Sequences per optimizer step with --model: `sim` and `compare` check it against
    /// micro-batch size x micro-batches x dp; `plan` derives the micro-batches from it.
    #[arg(long, value_name = "SEQS")]
    pub global_batch: Option<u64>,
    /// Recomputation with --model: none, selective, full (default none).
    #[arg(long, value_name = "POLICY")]
    pub recompute: Option<String>,
    /// Shard the optimizer state over the data-parallel group (ZeRO-1), with --model.
    #[arg(long)]
    pub distributed_optimizer: bool,
    /// GEMM precision with --model: bf16 or fp8 (default bf16).
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// Layers per stage with --model, a Megatron-LM layout string such as "Et|(tt|)*30mL"
    /// (default: an even split, the embedding and loss counted as layers where that
    /// divides).
    #[arg(long, value_name = "LAYOUT")]
    pub layout: Option<String>,
    /// Attention kernel with --model: flash (FlashAttention, the default) or eager (the
    /// scores stored: Megatron-LM before FlashAttention).
    #[arg(long, value_name = "KERNEL")]
    pub attention: Option<String>,
    /// The EP all-to-all across nodes with --model: hierarchical (each token crosses the
    /// network once per destination node, DeepEP's two-level kernels; the default) or flat
    /// (each copy to an expert on another node crosses it), as `run --a2a` executes them.
    #[arg(long, value_name = "flat|hierarchical")]
    pub a2a: Option<String>,
}

/// What `--model` derived for one program.
pub struct Scenario {
    /// The derived costs.
    pub derived: Derived,
    /// The simulator's cost model.
    pub cost: schedc::sim::cost::CostModel,
    /// The model's name.
    pub model: String,
    /// The GPU.
    pub hardware: Hardware,
    /// The training options.
    pub training: Training,
}

impl ClusterArgs {
    /// True when `--model` is given.
    pub fn given(&self) -> bool {
        self.model.is_some()
    }

    /// The options as flags (` --model X --hardware Y ...`, those given), for a command
    /// line that reproduces a figure.
    pub fn flags(&self) -> String {
        let mut f = String::new();
        let mut add = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                f.push_str(&format!(" --{k} {v}"));
            }
        };
        add("model", &self.model);
        add("hardware", &self.hardware);
        add("mesh", &self.mesh);
        add("seq", &self.seq.map(|x| x.to_string()));
        add(
            "micro-batch-size",
            &self.micro_batch_size.map(|x| x.to_string()),
        );
        add("global-batch", &self.global_batch.map(|x| x.to_string()));
        add("recompute", &self.recompute);
        add("dtype", &self.dtype);
        add("layout", &self.layout.as_ref().map(|l| format!("\"{l}\"")));
        add("attention", &self.attention);
        add("a2a", &self.a2a);
        if self.distributed_optimizer {
            f.push_str(" --distributed-optimizer");
        }
        f
    }

    /// Refuses the options that only mean something with `--model` when it is absent.
    pub fn check_without_model(&self) -> Result<(), String> {
        if self.model.is_some() {
            return Ok(());
        }
        let stray = [
            ("--hardware", self.hardware.is_some()),
            ("--mesh", self.mesh.is_some()),
            ("--seq", self.seq.is_some()),
            ("--micro-batch-size", self.micro_batch_size.is_some()),
            ("--global-batch", self.global_batch.is_some()),
            ("--recompute", self.recompute.is_some()),
            ("--distributed-optimizer", self.distributed_optimizer),
            ("--dtype", self.dtype.is_some()),
            ("--layout", self.layout.is_some()),
            ("--attention", self.attention.is_some()),
            ("--a2a", self.a2a.is_some()),
        ];
        match stray.iter().find(|(_, on)| *on) {
            Some((flag, _)) => Err(format!(
                "{flag} describes the cluster of --model; give --model (a config.json or a preset) with it"
            )),
            None => Ok(()),
        }
    }

    /// Resolves `--model` and `--hardware` and parses `--mesh`, `--recompute`, `--dtype` and
    /// `--attention` once, so that a command deriving costs per schedule (`compare`)
    /// refuses a bad one before any row. Errors: the message, naming the option (exit 2).
    pub fn resolve_names(&self) -> Result<(), String> {
        if let Some(m) = &self.model {
            arch::resolve(m).map_err(|e| format!("--model: {e}"))?;
        }
        Hardware::resolve(self.hardware.as_deref().unwrap_or("h100"))
            .map_err(|e| format!("--hardware: {e}"))?;
        layout::Mesh::parse(self.mesh.as_deref().unwrap_or(""), 1)?;
        layout::Recompute::parse(self.recompute.as_deref().unwrap_or("none"))?;
        layout::Dtype::parse(self.dtype.as_deref().unwrap_or("bf16"))?;
        layout::A2a::parse(self.a2a.as_deref().unwrap_or("hierarchical"))?;
        match self.attention.as_deref().unwrap_or("flash") {
            "flash" | "eager" => Ok(()),
            other => Err(format!("--attention: `{other}` is not flash or eager")),
        }
    }

    /// Derives the cost model for a program of shape `pl`. Errors: the message, naming the
    /// option or the config field (exit 2).
    pub fn scenario(&self, pl: &Pipeline) -> Result<Scenario, String> {
        let name = self.model.as_deref().expect("--model given");
        let a = arch::resolve(name)?;
        let hw = Hardware::resolve(self.hardware.as_deref().unwrap_or("h100"))?;
        let mesh = layout::Mesh::parse(self.mesh.as_deref().unwrap_or(""), pl.pp)?;
        if mesh.pp != pl.pp {
            return Err(format!(
                "--mesh pp={} but the schedule has {} pipeline ranks (--pp)",
                mesh.pp, pl.pp
            ));
        }
        let seq = self.seq.unwrap_or(4096);
        let mbs = self.micro_batch_size.unwrap_or(1);
        if seq == 0 || mbs == 0 {
            return Err("--seq and --micro-batch-size must be at least 1".into());
        }
        let training = Training {
            mesh,
            seq,
            micro_batch_size: mbs,
            recompute: layout::Recompute::parse(self.recompute.as_deref().unwrap_or("none"))?,
            distributed_optimizer: self.distributed_optimizer,
            dtype: layout::Dtype::parse(self.dtype.as_deref().unwrap_or("bf16"))?,
            layout: self.layout.clone(),
            flash_attention: match self.attention.as_deref().unwrap_or("flash") {
                "flash" => true,
                "eager" => false,
                other => return Err(format!("--attention: `{other}` is not flash or eager")),
            },
            a2a: layout::A2a::parse(self.a2a.as_deref().unwrap_or("hierarchical"))?,
        };
        let total_mb = pl.total_microbatches();
        if let Some(g) = self.global_batch {
            let have = mbs * total_mb as u64 * mesh.dp as u64;
            if g != have {
                return Err(format!(
                    "--global-batch {g} sequences, but micro-batch size {mbs} x {total_mb} micro-batches x dp {} = {have}; change --mb, --micro-batch-size or dp",
                    mesh.dp
                ));
            }
        }
        let chunks = pl.stages_per_direction();
        let derived =
            costmodel::derive(&a, &hw, &training, chunks, total_mb, &Efficiency::default())?;
        let cost = derived.cost_model(pl.stages, chunks);
        Ok(Scenario {
            derived,
            cost,
            model: a.name.clone(),
            hardware: hw,
            training,
        })
    }
}

/// Builds the step report of a simulation under `sc`'s derived costs.
pub fn step_report(sc: &Scenario, pl: &Pipeline, res: &SimResult) -> StepReport {
    sc.derived.step_report(pl, res)
}

/// The human lines of the step report.
pub fn step_text(sc: &Scenario, rep: &StepReport) -> String {
    use std::fmt::Write as _;
    let m = &sc.training.mesh;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model {} on {} x {} (tp={} pp={} ep={} dp={} cp={}), seq {}, micro-batch {}",
        sc.model,
        rep.gpus,
        sc.hardware.name,
        m.tp,
        m.pp,
        m.ep,
        m.dp,
        m.cp,
        sc.training.seq,
        sc.training.micro_batch_size
    );
    let _ = writeln!(
        s,
        "step {:.4} s (makespan + {:.4} s of exposed DP reduction and optimizer), {:.0} tokens/s, {:.1} TFLOP/s per GPU, MFU {:.1}%",
        rep.step_seconds,
        rep.step_tail_seconds,
        rep.tokens_per_second,
        rep.tflops_per_gpu,
        100.0 * rep.mfu
    );
    let _ = writeln!(
        s,
        "memory: peak {:.1} GB of {:.1} GB{} (per rank: {})",
        rep.peak_memory_bytes / 1e9,
        rep.gpu_memory_bytes / 1e9,
        if rep.fits { "" } else { " — does not fit" },
        rep.memory_bytes
            .iter()
            .map(|b| format!("{:.1}", b / 1e9))
            .collect::<Vec<_>>()
            .join(" ")
    );
    s
}

/// Loads `input` quietly (no notes, errors left to the real load) to learn the program's
/// shape, and derives the cost model for it; `set` overrides apply to every stage.
/// `Ok(None)`: the input does not load (the real load reports why). Errors: what
/// [`ClusterArgs::scenario`] refuses, or a bad `--set`.
pub fn probe_scenario(
    input: &crate::common::InputArgs,
    cluster: &ClusterArgs,
    set: Option<&str>,
) -> Result<Option<Scenario>, String> {
    let Ok(mut ov) = input.overrides() else {
        return Ok(None);
    };
    // The shape alone: MoE parts do not change it (and `:list` needs the costs).
    ov.moe = None;
    let Ok(loaded) = schedc::input::load_path(&input.input, &ov) else {
        return Ok(None);
    };
    let mut sc = cluster.scenario(&loaded.program.pipeline)?;
    if let Some(kv) = set {
        sc.cost.apply_overrides_everywhere(kv)?;
    }
    Ok(Some(sc))
}
