//! `schedc plan`: a mesh, a schedule and its micro-batches for a model on a cluster, each
//! candidate simulated under the model-level cost model (the logic is `schedc::plan`).

use crate::common::*;
use std::process::ExitCode;

/// `schedc plan`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// GPUs in all.
    #[arg(long)]
    pub gpus: u32,
    /// The model and the training options (--model is required; --mesh fixes any of tp, pp,
    /// ep, dp and leaves the others to the search; --global-batch defaults to 2^24 tokens,
    /// 2^24 / --seq sequences).
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
    /// A directory of specs to plan with instead of the standard library (which is built
    /// into schedc, so that plan works from any directory).
    #[arg(long, value_name = "DIR")]
    pub specs: Option<std::path::PathBuf>,
    /// Candidates shown in the table.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
    /// Most device bytes per GPU (`80G` = 80 x 2^30) besides the GPU's own memory: a
    /// candidate fits only when its simulated `peak_memory_bytes` (weights, gradients,
    /// optimizer state and live activations of the largest rank, without the per-GPU
    /// overhead: what `sim --max-memory` bounds) is within it; the others are listed under
    /// "do not fit".
    #[arg(long, value_name = "BYTES", value_parser = parse_max_memory)]
    pub max_memory: Option<u64>,
    /// Retired (the cluster comes from --hardware).
    #[arg(long, hide = true)]
    pub gpus_per_node: Option<String>,
    /// Retired.
    #[arg(long, hide = true)]
    pub interconnect: Option<String>,
    /// Retired.
    #[arg(long, hide = true)]
    pub intra_node_bandwidth: Option<String>,
    /// Retired.
    #[arg(long, hide = true)]
    pub gpu_memory: Option<String>,
    /// Retired.
    #[arg(long, hide = true)]
    pub peak_tflops: Option<String>,
    /// Retired.
    #[arg(long, hide = true)]
    pub mfu: Option<String>,
    /// Retired.
    #[arg(long, hide = true)]
    pub global_batch_tokens: Option<String>,
    /// Retired.
    #[arg(long, hide = true)]
    pub ep: Option<String>,
}

/// The flags of the formula-based plan, each with what replaces it.
fn retired(a: &Args) -> Option<String> {
    let r = [
        ("--gpus-per-node", a.gpus_per_node.is_some(), "the GPUs per node come from --hardware (a preset, or a TOML file with gpus_per_node)"),
        ("--interconnect", a.interconnect.is_some(), "the links come from --hardware (a TOML file with network_bandwidth and nvlink_bandwidth, bytes/s)"),
        ("--intra-node-bandwidth", a.intra_node_bandwidth.is_some(), "the links come from --hardware (a TOML file with nvlink_bandwidth, bytes/s)"),
        ("--gpu-memory", a.gpu_memory.is_some(), "the memory comes from --hardware (a TOML file with hbm_bytes)"),
        ("--peak-tflops", a.peak_tflops.is_some(), "the peak comes from --hardware (a TOML file with bf16_flops and fp8_flops)"),
        ("--mfu", a.mfu.is_some(), "op times are derived from the model and the GPU, not from an assumed MFU (the MFU is an output)"),
        ("--global-batch-tokens", a.global_batch_tokens.is_some(), "give --global-batch SEQS, sequences per step (tokens = SEQS x --seq)"),
        ("--ep", a.ep.is_some(), "give --mesh ep=N, or leave ep to the search"),
    ];
    r.iter()
        .find(|(_, on, _)| *on)
        .map(|(f, _, why)| format!("{f} is no longer an option of plan: {why}"))
}

/// Runs `schedc plan`: exit 0 with a recommendation, 1 when nothing fits (the report says
/// what was tried), 2 on bad input.
pub fn run(args: Args) -> ExitCode {
    if let Some(e) = retired(&args) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let Args {
        gpus,
        cluster,
        specs,
        top,
        format,
        max_memory,
        ..
    } = args;
    let req = match request(gpus, &cluster, max_memory) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let library = match &specs {
        None => schedc::specs::standard_library_owned(),
        Some(d) => match schedc::specs::from_dir(d) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: --specs: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let p = match schedc::plan::plan(&req, &library) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let o = match format {
        OutFormat::Json => format!("{}\n", serde_json::to_string_pretty(&p).expect("json")),
        OutFormat::Human => schedc::plan::report(&req, &p, top),
    };
    // Nothing fits: the report says so, and the status says there is no recommendation (1,
    // like a rejection), so that a script does not take the table for one.
    let code = if p.best.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    emit_then(&o, code)
}

/// The plan's request from the command line. Errors name the option.
fn request(
    gpus: u32,
    c: &crate::cluster::ClusterArgs,
    max_memory: Option<u64>,
) -> Result<schedc::plan::Request, String> {
    use schedc::costmodel::{arch, hardware::Hardware, layout};
    let Some(model) = c.model.as_deref() else {
        return Err(format!(
            "--model is required: a Hugging Face config.json or a preset ({})",
            arch::PRESETS.join(", ")
        ));
    };
    if c.layout.is_some() {
        return Err("--layout: plan picks the layers per stage for each pipeline degree (the even split, else the suggested layout); evaluate a layout of your own with `schedc sim --layout`".into());
    }
    let arch = arch::resolve(model).map_err(|e| format!("--model: {e}"))?;
    let hardware = Hardware::resolve(c.hardware.as_deref().unwrap_or("h100"))
        .map_err(|e| format!("--hardware: {e}"))?;
    let seq = c.seq.unwrap_or(4096);
    if seq == 0 {
        return Err("--seq must be at least 1".into());
    }
    let global_batch = c.global_batch.unwrap_or(((1u64 << 24) / seq).max(1));
    let req = schedc::plan::Request {
        gpus,
        arch,
        hardware,
        seq,
        micro_batch_size: c.micro_batch_size.unwrap_or(1),
        global_batch,
        recompute: layout::Recompute::parse(c.recompute.as_deref().unwrap_or("none"))?,
        dtype: layout::Dtype::parse(c.dtype.as_deref().unwrap_or("bf16"))?,
        distributed_optimizer: c.distributed_optimizer,
        flash_attention: match c.attention.as_deref().unwrap_or("flash") {
            "flash" => true,
            "eager" => false,
            other => return Err(format!("--attention: `{other}` is not flash or eager")),
        },
        a2a: layout::A2a::parse(c.a2a.as_deref().unwrap_or("hierarchical"))?,
        fixed: schedc::plan::Fixed::parse(c.mesh.as_deref().unwrap_or(""))?,
        efficiency: Default::default(),
        max_memory,
    };
    req.validate()?;
    Ok(req)
}
