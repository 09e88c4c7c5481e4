//! `schedc run`: train the model under a schedule on a backend.

use crate::common::*;
use clap::ValueEnum;
use schedc_cpu::{DType, RunConfig, RunError};
use schedc_program::mesh::Mesh;
use schedc_program::ProgramError;
use std::process::ExitCode;
use std::sync::Arc;

/// `--backend`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Backend {
    /// The CPU reference executor (one thread per global rank).
    Cpu,
    /// The CUDA/NCCL backend (kernels compiled by NVRTC at run time).
    Cuda,
}

/// `--dtype`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F64,
    Bf16,
}

/// `--mode` of the CUDA backend.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Mode {
    /// Every rank in this process on one GPU, each with its own streams.
    Single,
    /// One process per GPU, NCCL between them.
    Nccl,
}

/// `--a2a`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum A2a {
    /// Every rank sends to every rank of its EP group directly.
    Flat,
    /// Two-level: across nodes once per node, then inside the node.
    Hierarchical,
}

/// The model the executors build: `--model`, `--seq`, `--micro-batch-size` (`run`,
/// `compile`).
#[derive(clap::Args, Default)]
pub struct ModelArgs {
    /// The model to train: a Hugging Face config.json of a DeepSeek-V3-style model (MLA with
    /// query compression and routed experts: model_type deepseek_v2 or deepseek_v3) or the
    /// preset dsv3, as `sim --model` reads it. Its layers are spread evenly over the
    /// schedule's stages (rounded up); every layer runs as MLA + MoE with one shared expert.
    /// Default: schedc's small model (hidden 32, 4 experts, sequence 32).
    #[arg(long, value_name = "CONFIG.json|PRESET")]
    pub model: Option<String>,
    /// Tokens per sequence (default: 4096 with --model, else the small model's 32).
    #[arg(long)]
    pub seq: Option<u64>,
    /// Sequences per micro-batch B (default 1): a micro-batch is B independent sequences of
    /// --seq tokens (B·T rows; attention causal within each sequence, RoPE positions from 0
    /// in each). Not with sequence parallelism (--mesh sp=N, --sequence-parallel).
    #[arg(long, value_name = "B")]
    pub micro_batch_size: Option<u64>,
}

impl ModelArgs {
    /// Resolves `--model` early (before the schedule is loaded), so that a bad file or name
    /// is refused first. Errors: the message (exit 2).
    pub fn check(&self) -> Result<(), String> {
        if let Some(m) = &self.model {
            schedc::costmodel::arch::resolve(m).map_err(|e| format!("--model: {e}"))?;
        }
        if self.seq == Some(0) {
            return Err("--seq must be at least 1".into());
        }
        match self.micro_batch_size {
            Some(0) => Err("--micro-batch-size must be at least 1".into()),
            Some(b) if b > 1 << 20 => Err(format!(
                "--micro-batch-size {b}: at most {} sequences per micro-batch",
                1 << 20
            )),
            _ => Ok(()),
        }
    }

    /// The executors' model for a schedule of `model_stages` stages per direction, with
    /// notes on what runs differently from the config. Errors: the message (exit 2).
    pub fn config(
        &self,
        model_stages: u32,
    ) -> Result<(schedc_program::ModelConfig, Vec<String>), String> {
        self.check()?;
        match &self.model {
            None => {
                let mut m = schedc_program::ModelConfig::small();
                if let Some(t) = self.seq {
                    m.seq_len = t as usize;
                }
                m.micro_batch_size = self.micro_batch_size.unwrap_or(1) as usize;
                Ok((m, Vec::new()))
            }
            Some(name) => {
                let arch =
                    schedc::costmodel::arch::resolve(name).map_err(|e| format!("--model: {e}"))?;
                let f = schedc_program::ModelConfig::from_arch(
                    &arch,
                    self.seq.unwrap_or(4096) as usize,
                    model_stages as usize,
                )
                .map_err(|e| format!("--model: {e}"))?;
                let mut m = f.model;
                m.micro_batch_size = self.micro_batch_size.unwrap_or(1) as usize;
                Ok((m, f.notes))
            }
        }
    }
}

/// `schedc run`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub order_cost: OrderCostArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    /// The memory the model may take, e.g. 64G or 512M: CPU, every rank's parameters,
    /// gradients, optimizer state and activations together (default: the host's available
    /// memory); CUDA, the ranks of this process on its GPU (default: the GPU's free
    /// memory). Checked before anything is allocated; a model over it is refused (exit 2)
    /// with the rank that needs the most.
    #[arg(long, value_name = "BYTES")]
    pub memory_limit: Option<String>,
    /// The device mesh, e.g. `pp=4,dp=2,ep=2,tp=1,sp=1` (default: `pp=P`); `node=K` adds how
    /// many consecutive ranks share a node (default: all on one), for --a2a and the traffic
    /// figures. CPU and CUDA (f32): `tp` splits the attention heads and the shared expert
    /// over the TP group (Megatron-LM); `sp` splits each sequence (context-parallel style).
    #[arg(long)]
    pub mesh: Option<String>,
    /// CPU: how the expert-parallel all-to-alls cross nodes: `flat` (every rank to every
    /// rank) or `hierarchical` (DeepSeek-V3: one message per other node, each token's row
    /// once per node, scattered inside the node). Same training either way; the report
    /// gives the bytes by level (`a2a_bytes`).
    #[arg(long, value_enum, default_value = "flat")]
    pub a2a: A2a,
    /// CPU and CUDA: Megatron-LM's sequence parallelism inside the TP group (needs tp > 1 in
    /// --mesh): each TP rank keeps 1/tp of the tokens between the TP collectives (norms,
    /// residuals, router, routed experts on the shard), which become all-gathers and
    /// reduce-scatters. The mesh's `sp` is the other kind: it splits each sequence over its
    /// own ranks.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// CPU: routed experts per MoE layer of the model (default: 4).
    #[arg(long)]
    pub experts: Option<usize>,
    /// CPU: experts each token is routed to (default: 2).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// CPU: node-limited routing (DeepSeek-V3): each token's experts on at most M of the
    /// nodes its EP group spans (`--mesh ...,node=K`); the experts of each node form one
    /// routing group, and a token picks the M groups whose best top_k/M scores sum highest.
    #[arg(long, value_name = "M")]
    pub node_limit: Option<usize>,
    /// The backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: Backend,
    /// Floating-point precision (default: f64 on the CPU, f32 on CUDA; CUDA takes f32 or
    /// bf16 storage with f32 accumulation).
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// CUDA: all ranks on one GPU (`single`), or one process per GPU with NCCL (`nccl`;
    /// without --rank, this process starts one per rank on this node's GPUs).
    #[arg(long, value_enum, default_value = "single")]
    pub mode: Mode,
    /// CUDA NCCL mode: this process's global rank (with --rendezvous; one process per GPU,
    /// started by a cluster launcher). Default: torchrun's RANK (with LOCAL_RANK as the GPU
    /// and tcp://MASTER_ADDR:MASTER_PORT+1 as the rendezvous) or SLURM's SLURM_PROCID (with
    /// SLURM_LOCALID); the flags override the environment.
    #[arg(long)]
    pub rank: Option<u32>,
    /// CUDA NCCL mode: where the ranks meet, `tcp://HOST:PORT` (rank 0 listens) or
    /// `file:PATH` on a shared file system.
    #[arg(long)]
    pub rendezvous: Option<String>,
    /// CUDA: the GPU of this process (default: 0; with --rank, the rank modulo the GPUs).
    #[arg(long)]
    pub device: Option<usize>,
    /// CUDA: the GPU architecture NVRTC compiles for (default: the device's, e.g. sm_90).
    #[arg(long)]
    pub arch: Option<String>,
    /// Optimizer steps (at least 1).
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// Training text (bytes are tokens); default: a short built-in text.
    #[arg(long)]
    pub data: Option<std::path::PathBuf>,
    /// Also train sequentially on the same data and weights and compare: exit status 1 if
    /// a difference exceeds the dtype's tolerance or is NaN (f64: every loss, gradient and
    /// parameter to 1e-9; f32: the first step's gradients to 1e-3 and every loss to 2%).
    #[arg(long)]
    pub verify: bool,
    /// CPU: write the Chrome trace of the run (open in Perfetto or chrome://tracing): one
    /// process per global rank, a thread per stream (`ep`: the all-to-alls of MoE parts).
    /// It is written while the run goes (into a temporary file, renamed into place at the
    /// end); `-` is standard output, and the report then goes to standard error.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,
    /// Overwrite an existing --trace file.
    #[arg(long)]
    pub force: bool,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
}

/// Parses `--mesh`. Errors: exit 2 after printing why.
pub fn mesh(m: &Option<String>) -> Result<Option<Mesh>, ExitCode> {
    match m {
        None => Ok(None),
        Some(m) => m.parse().map(Some).map_err(|e| {
            eprintln!("error: --mesh: {e}");
            ExitCode::from(2)
        }),
    }
}

/// The exit status of a program error: 2 for what the command line got wrong (the mesh,
/// the model, something the backend does not run), 1 for a schedule the checks reject.
pub fn program_error_code(e: &ProgramError) -> u8 {
    match e {
        ProgramError::Mesh(_) | ProgramError::Model(_) | ProgramError::Unsupported(_) => 2,
        ProgramError::Rejected(_)
        | ProgramError::Invalid { .. }
        | ProgramError::Buffer { .. }
        | ProgramError::Deadlock(_) => 1,
    }
}

/// Prints an error: to standard error, and with `--format json` as `{"error": ..., "exit":
/// N}` on standard output. Returns the exit status.
fn fail(format: OutFormat, message: &str, code: u8) -> ExitCode {
    eprintln!("error: {message}");
    if format == OutFormat::Json {
        let v = serde_json::json!({"error": message, "exit": code});
        return emit_then(&format!("{v}\n"), ExitCode::from(code));
    }
    ExitCode::from(code)
}

/// Parses `--memory-limit` (`64G`, `512M`, bytes). Errors: the message.
fn memory_limit(s: &Option<String>) -> Result<Option<u64>, String> {
    s.as_deref()
        .map(|s| schedc::limits::parse_size(s).map_err(|e| format!("--memory-limit: {e}")))
        .transpose()
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("error: {msg}");
    ExitCode::from(2)
}

/// A progress bar on standard error, advanced by a step callback.
fn progress(
    steps: usize,
) -> (
    indicatif::ProgressBar,
    Arc<dyn Fn(usize, f64) + Send + Sync>,
) {
    let b = indicatif::ProgressBar::new(steps as u64);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{wide_bar} {pos}/{len} steps {elapsed_precise} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let bc = b.clone();
    (
        b,
        Arc::new(move |_step: usize, loss: f64| {
            bc.set_message(format!("loss {loss:.4}"));
            bc.inc(1);
        }),
    )
}

/// Runs `schedc run`.
pub fn run(args: Args) -> ExitCode {
    let format = args.format;
    let mesh = match args.mesh.as_ref().map(|m| m.parse::<Mesh>()).transpose() {
        Ok(m) => m,
        Err(e) => return fail(format, &format!("--mesh: {e}"), 2),
    };
    for w in mesh.iter().flat_map(Mesh::cross_node_warnings) {
        eprintln!("warning: --mesh: {w}");
    }
    if args.backend == Backend::Cuda {
        if args.trace.is_some() {
            return usage("--trace is for --backend cpu");
        }
        if args.a2a != A2a::Flat
            || args.experts.is_some()
            || args.top_k.is_some()
            || args.node_limit.is_some()
        {
            return usage("--a2a, --experts, --top-k and --node-limit are for --backend cpu");
        }
        // Before the schedule is loaded and before NVRTC is.
        if let Some(a) = &args.arch {
            if let Err(e) = schedc_cuda::nvrtc::validate_arch(a) {
                return fail(format, &e, 2);
            }
        }
        if let Err(e) = args.model.check() {
            return fail(format, &e, 2);
        }
        if let Err(e) = memory_limit(&args.memory_limit) {
            return fail(format, &e, 2);
        }
        let program = match load_program(&args.input, &args.order_cost, format) {
            Ok(p) => p,
            Err(c) => return c,
        };
        return run_cuda(args, program, mesh);
    }
    // The trace is streamed to its file (or standard output) while the run goes: a file
    // that cannot be written is found now, by creating its temporary file, not after the run.
    let trace_out = match &args.trace {
        None => None,
        Some(f) if is_stdout(f) => {
            if format == OutFormat::Json {
                return fail(
                    format,
                    "--trace - with --format json: standard output carries the JSON report; write the trace to a file",
                    2,
                );
            }
            Some(TraceTarget::Stdout(std::io::stdout()))
        }
        Some(f) => match OutputFile::create(f, args.force) {
            Ok(o) => Some(TraceTarget::File(o)),
            Err(e) => return fail(format, &e, 2),
        },
    };
    if args.mode != Mode::Single
        || args.rank.is_some()
        || args.rendezvous.is_some()
        || args.arch.is_some()
        || args.device.is_some()
    {
        return fail(
            format,
            "--mode, --rank, --rendezvous, --device and --arch are for --backend cuda",
            2,
        );
    }
    let dtype = match args.dtype.unwrap_or(Dtype::F64) {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::Bf16 => {
            return fail(
                format,
                "the CPU backend computes in f32 or f64, not bf16",
                2,
            )
        }
    };
    let trace = match trace_out.map(TraceStream::start).transpose() {
        Ok(t) => t,
        Err(e) => return fail(format, &e, 2),
    };
    if let Err(e) = args.model.check() {
        return fail(format, &e, 2);
    }
    if args.model.model.is_some() && (args.experts.is_some() || args.top_k.is_some()) {
        return fail(
            format,
            "--experts and --top-k change the small model; with --model the config.json says them",
            2,
        );
    }
    let memory_limit = match memory_limit(&args.memory_limit) {
        Ok(l) => l,
        Err(e) => return fail(format, &e, 2),
    };
    let mut model = RunConfig::default().model;
    model.micro_batch_size = args.model.micro_batch_size.unwrap_or(1) as usize;
    if let Some(e) = args.experts {
        model.experts = e;
    }
    if let Some(k) = args.top_k {
        model.top_k = k;
    }
    if let Err(e) = model.validate() {
        return fail(format, &format!("--experts/--top-k: {e}"), 2);
    }
    if let Some(max) = args.node_limit {
        // One routing group per node of the EP group (rank 0's; every EP group spans as
        // many nodes, the mesh's node size dividing ep or being a multiple of it).
        let groups = match &mesh {
            Some(m) => {
                let ep = m.ep_group(0).unwrap_or_default();
                let mut nodes: Vec<u32> = ep.iter().map(|r| m.node_of(*r)).collect();
                nodes.sort_unstable();
                nodes.dedup();
                nodes.len().max(1)
            }
            None => 1,
        };
        model.group_limit = Some(schedc_program::model::GroupLimit { groups, max });
        if let Err(e) = model.validate() {
            return fail(
                format,
                &format!("--node-limit: the EP group spans {groups} node(s): {e}"),
                2,
            );
        }
    }
    let cfg = RunConfig {
        mesh,
        dtype,
        model,
        sequence_parallel: args.sequence_parallel,
        a2a: match args.a2a {
            A2a::Flat => schedc_cpu::exec::A2aMode::Flat,
            A2a::Hierarchical => schedc_cpu::exec::A2aMode::Hierarchical,
        },
        steps: args.steps,
        data: args.data,
        verify: args.verify,
        progress: format == OutFormat::Human,
        trace: trace.is_some(),
        trace_sink: trace.as_ref().map(|t| t.sink()),
        memory_limit,
        ..RunConfig::default()
    };
    // Refuse what cannot fit before the spec is elaborated.
    if let Err(c) = pre_check(&args.input, "running", cfg.mesh.as_ref(), |size| {
        let world = cfg.mesh.as_ref().map_or(size.ranks, |m| m.world() as u64);
        schedc_cpu::run::estimate_memory_of(size, world, &cfg)
    }) {
        return c;
    }
    let program = match load_program(&args.input, &args.order_cost, format) {
        Ok(p) => p,
        Err(c) => return c,
    };
    let mut cfg = cfg;
    if args.model.model.is_some() || args.model.seq.is_some() {
        match args.model.config(program.pipeline.stages_per_direction()) {
            Ok((m, notes)) => {
                for n in notes {
                    eprintln!("note: --model: {n}");
                }
                let (e, k) = (cfg.model.experts, cfg.model.top_k);
                cfg.model = m;
                if args.model.model.is_none() {
                    (cfg.model.experts, cfg.model.top_k) = (e, k);
                }
            }
            Err(e) => return fail(format, &e, 2),
        }
    }
    match schedc_cpu::run(&program, &cfg) {
        Ok(r) => {
            // Whole or absent: the temporary file is renamed into place. If that fails, the
            // report is printed all the same, then the error (exit status 2).
            let trace_error = trace.and_then(|t| t.finish().err());
            let code = if r.verify.as_ref().is_some_and(|v| !v.verify_passed) {
                eprintln!(
                    "error: --verify: the pipelined run differs from sequential training by more than the {} tolerance",
                    match cfg.dtype {
                        DType::F32 => "f32",
                        DType::F64 => "f64",
                    }
                );
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            };
            let code = match format {
                OutFormat::Json => emit_then(&format!("{}\n", r.to_json()), code),
                // With `--trace -` the trace is standard output and the report goes to
                // standard error.
                OutFormat::Human if args.trace.as_deref().is_some_and(is_stdout) => {
                    eprint!("{}", r.to_human());
                    code
                }
                OutFormat::Human => emit_then(&r.to_human(), code),
            };
            match trace_error {
                Some(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
                None => code,
            }
        }
        Err(e) => {
            let code = match &e {
                RunError::Program(p) => program_error_code(p),
                RunError::Config(_) | RunError::TooLarge(_) => 2,
                RunError::Failed(_) => 1,
            };
            fail(format, &e.to_string(), code)
        }
    }
}

/// Where `--trace` goes.
enum TraceTarget {
    /// A file, through its temporary sibling.
    File(OutputFile),
    /// Standard output (`--trace -`).
    Stdout(std::io::Stdout),
}

impl std::io::Write for TraceTarget {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            TraceTarget::File(f) => f.write(buf),
            TraceTarget::Stdout(o) => o.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            TraceTarget::File(f) => f.flush(),
            TraceTarget::Stdout(o) => o.flush(),
        }
    }
}

/// The trace being written while the run goes (breakit finding 7: it was kept in memory
/// whole, about 2.4 MB per step of `dualpipe --pp 4 --mb 8`): the first write error is
/// kept, and the spans after it are dropped; a closed standard output ends it quietly.
struct TraceStream {
    state: Arc<std::sync::Mutex<TraceState>>,
}

struct TraceState {
    writer: Option<schedc_cpu::exec::ChromeTraceWriter<TraceTarget>>,
    error: Option<String>,
    name: String,
}

impl TraceStream {
    /// Writes the header. Errors: the message.
    fn start(target: TraceTarget) -> Result<TraceStream, String> {
        let name = match &target {
            TraceTarget::File(_) => "the trace file".to_string(),
            TraceTarget::Stdout(_) => "standard output".to_string(),
        };
        let writer = schedc_cpu::exec::ChromeTraceWriter::new(target)
            .map_err(|e| format!("cannot write the trace to {name}: {e}"))?;
        Ok(TraceStream {
            state: Arc::new(std::sync::Mutex::new(TraceState {
                writer: Some(writer),
                error: None,
                name,
            })),
        })
    }

    /// The sink the run streams its spans into.
    fn sink(&self) -> schedc_cpu::exec::SpanSink {
        let st = self.state.clone();
        Arc::new(std::sync::Mutex::new(
            move |spans: &[schedc_cpu::exec::Span]| {
                let mut g = st.lock().unwrap_or_else(|p| p.into_inner());
                let Some(w) = g.writer.as_mut() else { return };
                if let Err(e) = w.push(spans) {
                    if e.kind() != std::io::ErrorKind::BrokenPipe {
                        g.error = Some(format!("cannot write the trace to {}: {e}", g.name));
                    }
                    g.writer = None; // the temporary file is removed when dropped
                }
            },
        ))
    }

    /// Ends the JSON and renames the file into place. Errors: the first write error.
    fn finish(self) -> Result<(), String> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = g.error.take() {
            return Err(e);
        }
        let Some(w) = g.writer.take() else {
            return Ok(()); // standard output closed
        };
        match w.finish() {
            Ok(TraceTarget::File(f)) => f.commit(),
            Ok(TraceTarget::Stdout(_)) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            Err(e) => Err(format!("cannot write the trace to {}: {e}", g.name)),
        }
    }
}

/// Loads the schedule; with `--format json` a failure is also `{"error": ..., "exit": N,
/// "diagnostics": [...]}` on standard output (a `--cost`/`--set` that cannot be used:
/// `{"error": ..., "exit": 2}`).
fn load_program(
    input: &InputArgs,
    order_cost: &OrderCostArgs,
    format: OutFormat,
) -> Result<schedc_ir::Program, ExitCode> {
    // A cost model that cannot be read is bad usage (2), reported like the other errors.
    let model = order_cost
        .model_or_message(input)
        .map_err(|e| fail(format, &e, 2))?;
    let cost_name = order_cost.name();
    match load_for_under(input, None, model.as_ref().map(|m| (m, cost_name.as_str()))) {
        Ok(l) => Ok(l.program),
        Err(f) => {
            if format == OutFormat::Json {
                let v = serde_json::json!({
                    "error": f.message,
                    "exit": f.exit,
                    "diagnostics": f.diagnostics,
                });
                return Err(emit_then(&format!("{v}\n"), f.code()));
            }
            Err(f.code())
        }
    }
}

fn run_cuda(args: Args, program: schedc_ir::Program, mesh: Option<Mesh>) -> ExitCode {
    use schedc_cuda::run as cu;
    let dtype = match args.dtype.unwrap_or(Dtype::F32) {
        Dtype::F32 => schedc_cuda::api::DType::F32,
        Dtype::Bf16 => schedc_cuda::api::DType::Bf16,
        Dtype::F64 => {
            return usage("the CUDA backend computes in f32 or bf16 (f32 accumulation), not f64")
        }
    };
    let world = mesh.as_ref().map_or(program.pipeline.pp, |m| m.world());
    let placed = match args.mode {
        Mode::Single => {
            if args.rank.is_some() || args.rendezvous.is_some() {
                return usage("--rank and --rendezvous are for --mode nccl");
            }
            None
        }
        Mode::Nccl => {
            let flags = schedc_cuda::rendezvous::PlacementFlags {
                rank: args.rank,
                rendezvous: args.rendezvous.clone(),
                device: args.device,
            };
            match schedc_cuda::rendezvous::placement(&flags, &|k| std::env::var(k).ok(), world) {
                Ok(Some(p)) => {
                    for n in &p.notes {
                        eprintln!("note: {n}");
                    }
                    Some(p)
                }
                // No rank from the flags or a launcher: start one process per rank here.
                Ok(None) => return launch_local(world),
                Err(e) => return usage(&e),
            }
        }
    };
    let device = placed
        .as_ref()
        .map(|p| p.device)
        .or(args.device)
        .unwrap_or(0);
    let nccl = placed.map(|p| cu::NcclRank {
        rank: p.rank,
        rendezvous: p.rendezvous,
    });
    let (model, notes) = match args.model.config(program.pipeline.stages_per_direction()) {
        Ok(m) => m,
        Err(e) => return fail(args.format, &e, 2),
    };
    for n in notes {
        eprintln!("note: --model: {n}");
    }
    let memory_limit = match memory_limit(&args.memory_limit) {
        Ok(l) => l,
        Err(e) => return fail(args.format, &e, 2),
    };
    let bar = (args.format == OutFormat::Human).then(|| progress(args.steps));
    let cfg = cu::RunConfig {
        mesh,
        dtype,
        mode: match args.mode {
            Mode::Single => cu::Mode::Single,
            Mode::Nccl => cu::Mode::Nccl,
        },
        steps: args.steps,
        data: args.data,
        verify: args.verify,
        on_step: bar.as_ref().map(|b| b.1.clone()),
        device,
        arch: args.arch,
        nccl,
        model,
        memory_limit,
        sequence_parallel: args.sequence_parallel,
        ..cu::RunConfig::default()
    };
    let r = cu::run(&program, &cfg);
    if let Some((b, _)) = &bar {
        b.finish();
    }
    match r {
        Ok(r) => {
            let code = if r.verify.as_ref().is_some_and(|v| !v.verify_passed) {
                eprintln!("error: --verify: the GPU run differs from sequential training on the CPU by more than the f32 tolerance");
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            };
            match args.format {
                OutFormat::Json => emit_then(&format!("{}\n", r.to_json()), code),
                OutFormat::Human => emit_then(&r.to_human(), code),
            }
        }
        Err(e) => {
            // No driver, no GPU, NVRTC missing: the environment cannot run it (2).
            let code = match &e {
                cu::RunError::Program(p) => program_error_code(p),
                cu::RunError::Config(_) | cu::RunError::Device(_) | cu::RunError::TooLarge(_) => 2,
                cu::RunError::Failed(_) => 1,
            };
            fail(args.format, &e.to_string(), code)
        }
    }
}

/// Makes the child started by `c` receive SIGTERM when the thread that starts it ends (the
/// launcher's main thread: when the launcher exits or is killed). Linux only (prctl
/// `PR_SET_PDEATHSIG`); elsewhere nothing.
fn die_with_parent(c: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the child between fork and exec and calls only prctl,
        // which is async-signal-safe, and reads errno through last_os_error.
        unsafe {
            c.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = c;
}

/// NCCL mode without --rank: one process per rank on this node's GPUs (rank r on GPU r),
/// meeting through a file in a fresh temporary directory; rank 0's report is printed.
fn launch_local(world: u32) -> ExitCode {
    let gpus = match schedc_cuda::cuda::probe(true) {
        Ok(_) => schedc_cuda::cuda::device_count().unwrap_or(0),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if (gpus as u32) < world {
        eprintln!(
            "error: NCCL mode runs one process per GPU: {world} ranks, {gpus} GPU(s) here (run on a cluster with --rank and --rendezvous, or use --mode single to run every rank on one GPU)"
        );
        return ExitCode::from(2);
    }
    let dir = std::env::temp_dir().join(format!("schedc-nccl-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("error: cannot create {}: {e}", dir.display());
        return ExitCode::from(1);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find this executable to start the ranks: {e}");
            return ExitCode::from(1);
        }
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rdv = format!("file:{}", dir.join("ids").display());
    let mut children = Vec::new();
    for r in 0..world {
        let mut c = std::process::Command::new(&exe);
        c.args(&args).args([
            "--rank",
            &r.to_string(),
            "--rendezvous",
            &rdv,
            "--device",
            &r.to_string(),
        ]);
        if r != 0 {
            c.stdout(std::process::Stdio::null());
        }
        // A rank ends with this launcher (SIGTERM, SIGINT, a crash), so that none keeps a
        // GPU busy training alone (issue 11, item 8).
        die_with_parent(&mut c);
        match c.spawn() {
            Ok(ch) => children.push(ch),
            Err(e) => {
                eprintln!("error: cannot start rank {r}: {e}");
                for mut ch in children {
                    let _ = ch.kill();
                }
                return ExitCode::from(1);
            }
        }
    }
    let mut code = ExitCode::SUCCESS;
    for (r, mut ch) in children.into_iter().enumerate() {
        match ch.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("error: rank {r} exited with {s}");
                code = ExitCode::from(1);
            }
            Err(e) => {
                eprintln!("error: rank {r}: {e}");
                code = ExitCode::from(1);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    code
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    // Issue 11, item 8: a process started by the NCCL launcher ends when its starter does.
    // The starter here is a thread (PR_SET_PDEATHSIG follows the starting thread), so the
    // test needs no GPU and kills nothing but its own child.
    #[test]
    fn a_started_rank_ends_with_its_launcher() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut c = std::process::Command::new("sleep");
            c.arg("60");
            super::die_with_parent(&mut c);
            tx.send(c.spawn().unwrap()).unwrap();
        })
        .join()
        .unwrap();
        let mut child = rx.recv().unwrap();
        let t0 = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t0.elapsed() > std::time::Duration::from_secs(20) {
                let _ = child.kill();
                panic!("the child outlived its launcher by 20 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    }
}
