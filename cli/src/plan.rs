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
    /// Model: a preset (dsv3, dense70b) or a TOML file with the fields of `ModelSpec`.
    #[arg(long)]
    pub model: String,
    /// Inter-node links: ib800, ib400, ib200, roce100.
    #[arg(long, default_value = "ib400")]
    pub interconnect: String,
    /// Memory per GPU, GB.
    #[arg(long, default_value_t = 80.0)]
    pub gpu_memory: f64,
    /// Peak dense bf16 TFLOP/s per GPU.
    #[arg(long, default_value_t = 989.0)]
    pub peak_tflops: f64,
    /// Model FLOPs utilization assumed for compute.
    #[arg(long, default_value_t = 0.4)]
    pub mfu: f64,
    /// Tokens per optimizer step.
    #[arg(long, default_value_t = 16.0e6)]
    pub global_batch_tokens: f64,
    /// Expert-parallel degree (MoE; default: GPUs per node).
    #[arg(long)]
    pub ep: Option<u32>,
    /// Where the specs are.
    #[arg(long, default_value = "specs")]
    pub specs: String,
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
        gpu_memory,
        peak_tflops,
        mfu,
        global_batch_tokens,
        ep,
        specs,
        format,
    } = args;
    let spec = match schedc::plan::preset(&model) {
        Some(m) => m,
        None => match std::fs::read_to_string(&model) {
            Ok(t) => match toml::from_str::<schedc::plan::ModelSpec>(&t) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("error: {model}: {e}");
                    return ExitCode::from(2);
                }
            },
            Err(_) => {
                eprintln!("error: unknown model `{model}`: presets are dsv3 and dense70b, or give a TOML file");
                return ExitCode::from(2);
            }
        },
    };
    if let Err(e) = spec.validate() {
        eprintln!("error: model `{model}`: {e}");
        return ExitCode::from(2);
    }
    let Some((bw, lat)) = schedc::plan::interconnect(&interconnect) else {
        eprintln!("error: unknown interconnect `{interconnect}`: ib800, ib400, ib200, roce100");
        return ExitCode::from(2);
    };
    if gpus == 0 || gpus_per_node == 0 || gpus % gpus_per_node != 0 {
        eprintln!("error: --gpus must be a positive multiple of --gpus-per-node");
        return ExitCode::from(2);
    }
    if ep == Some(0) {
        eprintln!("error: --ep must be at least 1");
        return ExitCode::from(2);
    }
    if !(mfu > 0.0 && mfu <= 1.0) {
        eprintln!("error: --mfu must be in (0, 1]");
        return ExitCode::from(2);
    }
    let cluster = schedc::plan::Cluster {
        gpus,
        gpus_per_node,
        gpu_memory: gpu_memory * 1e9,
        peak_flops: peak_tflops * 1e12,
        mfu,
        inter_bw: bw,
        latency: lat,
        global_batch_tokens,
        ep,
    };
    let p = match schedc::plan::plan(&spec, &cluster, &specs) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match format {
        OutFormat::Json => emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(&p).expect("json")
        )),
        OutFormat::Human => emit(&schedc::plan::report(&spec, &cluster, &p)),
    }
    ExitCode::SUCCESS
}
