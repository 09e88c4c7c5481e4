//! `schedc plan`: a pipeline degree and schedule for a cluster and a model.

use crate::common::*;
use std::process::ExitCode;

/// `schedc plan`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// GPUs in all.
    #[arg(long)]
    pub gpus: u32,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: u32,
    /// Model: a preset (dsv3, dense70b) or a TOML file with the fields of `ModelSpec`
    /// (name, layers, hidden, seq, total_params, active_params, expert_params, experts,
    /// top_k).
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// Inter-node links: ib800, ib400, ib200, roce100.
    #[arg(long, default_value = "ib400")]
    pub interconnect: String,
    /// Intra-node (NVLink) bandwidth per GPU, GB/s: what an expert-parallel all-to-all
    /// within a node runs at.
    #[arg(long, value_name = "GB/S", default_value_t = 160.0)]
    pub intra_node_bandwidth: f64,
    /// Memory per GPU, GB.
    #[arg(long, default_value_t = 80.0)]
    pub gpu_memory: f64,
    /// Peak dense bf16 TFLOP/s per GPU.
    #[arg(long, default_value_t = 989.0)]
    pub peak_tflops: f64,
    /// Model FLOPs utilization assumed for compute, in (0, 1].
    #[arg(long, default_value_t = 0.4)]
    pub mfu: f64,
    /// Tokens per optimizer step.
    #[arg(long, default_value_t = 16.0e6)]
    pub global_batch_tokens: f64,
    /// Expert-parallel degree (MoE models only; it must divide the routed experts; default:
    /// GPUs per node).
    #[arg(long)]
    pub ep: Option<u32>,
    /// A directory of specs to plan with instead of the standard library (which is built
    /// into schedc, so that plan works from any directory).
    #[arg(long, value_name = "DIR")]
    pub specs: Option<std::path::PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
}

/// Runs `schedc plan`.
pub fn run(args: Args) -> ExitCode {
    let Args {
        gpus,
        gpus_per_node,
        model,
        interconnect,
        intra_node_bandwidth,
        gpu_memory,
        peak_tflops,
        mfu,
        global_batch_tokens,
        ep,
        specs,
        format,
    } = args;
    let model_name = model.to_string_lossy().into_owned();
    let preset = model.to_str().and_then(schedc::plan::preset);
    let spec = match preset {
        Some(m) => m,
        None => match std::fs::read_to_string(&model) {
            Ok(t) => match toml::from_str::<schedc::plan::ModelSpec>(&t) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("error: {model_name}: {e}");
                    return ExitCode::from(2);
                }
            },
            Err(e) if model.exists() => {
                eprintln!("error: cannot read `{model_name}`: {e}");
                return ExitCode::from(2);
            }
            Err(_) => {
                eprintln!("error: unknown model `{model_name}`: presets are dsv3 and dense70b, or give a TOML file");
                return ExitCode::from(2);
            }
        },
    };
    if let Err(e) = spec.validate() {
        eprintln!("error: model `{model_name}`: {e}");
        return ExitCode::from(2);
    }
    let Some((bw, lat)) = schedc::plan::interconnect(&interconnect) else {
        eprintln!("error: unknown interconnect `{interconnect}`: ib800, ib400, ib200, roce100");
        return ExitCode::from(2);
    };
    let cluster = schedc::plan::Cluster {
        gpus,
        gpus_per_node,
        gpu_memory: gpu_memory * 1e9,
        peak_flops: peak_tflops * 1e12,
        mfu,
        inter_bw: bw,
        intra_bw: intra_node_bandwidth * 1e9,
        latency: lat,
        global_batch_tokens,
        ep,
    };
    if let Err(e) = cluster.validate(&spec) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let library = match &specs {
        None => schedc::specs::standard_library_owned(),
        Some(d) => match schedc::specs::from_dir(d) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let p = match schedc::plan::plan(&spec, &cluster, &library) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let o = match format {
        OutFormat::Json => format!("{}\n", serde_json::to_string_pretty(&p).expect("json")),
        OutFormat::Human => schedc::plan::report(&spec, &cluster, &p),
    };
    // No pipelined configuration fits: the report says so, and the status says there is no
    // recommendation (1, like a rejection), so that a script does not take the table for one.
    let code = if p.best.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    emit_then(&o, code)
}
