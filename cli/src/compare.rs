//! `schedc compare`: schedules side by side at one size under one cost model (the logic is
//! `schedc::compare`).

use crate::common::*;
use std::process::ExitCode;

/// `schedc compare`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Spec files, directories of specs, or other schedule files (IR, torch CSV, DualPipe
    /// traces, at their own size); default: the standard library, which is built into
    /// schedc, so that compare works from any directory.
    pub inputs: Vec<std::path::PathBuf>,
    /// Pipeline ranks.
    #[arg(long)]
    pub pp: u32,
    /// Micro-batches per step.
    #[arg(long)]
    pub mb: u32,
    /// Virtual stages per rank for specs whose V is free (interleaved schedules).
    #[arg(long, default_value_t = 2)]
    pub vpp: u32,
    /// A spec parameter, NAME=VALUE, given to the specs that declare it (repeatable).
    #[arg(long = "param", value_name = "NAME=VALUE", value_parser = parse_param)]
    pub params: Vec<(String, i64)>,
    /// Split the MoE stages into parts, as for `check` (needs a cost model with [moe]);
    /// `--moe=STAGES:adjacent` also interleaves consecutive independent plain ops.
    #[arg(long, value_name = "STAGES", num_args = 0..=1, default_missing_value = "auto", require_equals = true)]
    pub moe: Option<schedc::moe::MoeStages>,
    /// Cost model (as for `sim`).
    #[arg(long, default_value = "unit")]
    pub cost: std::ffi::OsString,
    /// Further inline overrides applied on top of --cost.
    #[arg(long = "set", value_name = "K=V,...")]
    pub set: Option<String>,
    /// A directory of specs (the same as naming it as an input).
    #[arg(long, value_name = "DIR")]
    pub specs: Option<std::path::PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
    /// Derive each row's op times and memory from a model (as `sim --model`): each
    /// schedule's stages hold their own layers, so no op is scaled by P / stages.
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
    /// Most device bytes per rank (`80G` = 80 x 2^30): rows whose simulated peak
    /// (`peak_memory_bytes`, as `sim --max-memory` bounds it) is over it, or that overflow
    /// `[memory] host_bytes`, are marked `(over)` and listed; they still rank by makespan and
    /// the exit status does not change. Needs memory sizes (`[memory]`, `--set
    /// activation_bytes=...`, or `--model`).
    #[arg(long, value_name = "BYTES", value_parser = parse_max_memory)]
    pub max_memory: Option<u64>,
}

/// Runs `schedc compare`: exit 0 when every input was simulated with its expectations
/// holding (or is outside its family at this size), 1 when one is rejected, fails an
/// expectation or does not elaborate, 2 on bad usage or an instance over the memory limit.
pub fn run(args: Args) -> ExitCode {
    let Args {
        mut inputs,
        pp,
        mb,
        vpp,
        params,
        moe,
        cost,
        set,
        specs,
        format,
        cluster,
        max_memory,
    } = args;
    if pp == 0 || mb == 0 || vpp == 0 {
        eprintln!("error: --pp, --mb and --vpp must be at least 1");
        return ExitCode::from(2);
    }
    if let Err(e) = cluster.check_without_model() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    if cluster.given() && cost != "unit" {
        eprintln!("error: --model derives the op times; give --cost or --model, not both (--set K=V overrides what --model derives)");
        return ExitCode::from(2);
    }
    let model = match resolve_cost(&cost, set.as_deref()) {
        Ok(m) => m,
        Err(c) => return c,
    };
    if max_memory.is_some() && !cluster.given() {
        if let Err(e) = require_memory_sizes(&model) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    let derive = if cluster.given() {
        // Refuse a bad --model, --hardware or --mesh once, before any row.
        if let Err(e) = cluster.resolve_names() {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
        let set = set.clone();
        let cl = cluster.clone();
        Some(schedc::compare::Deriver(std::sync::Arc::new(
            move |pl: &schedc_ir::Pipeline| {
                let mut sc = cl.scenario(pl)?;
                if let Some(kv) = &set {
                    sc.cost.apply_overrides_everywhere(kv)?;
                }
                Ok((sc.derived, sc.cost))
            },
        )))
    } else {
        None
    };
    let cost = match &cluster.model {
        Some(m) => format!("derived from --model {m}"),
        None => cost.to_string_lossy().into_owned(),
    };
    if moe.is_some() && derive.is_none() {
        if let Err(c) = require_moe_costs(&model, &cost) {
            return c;
        }
    }
    // The largest instance compare builds from a spec: V = --vpp, or 2 for the V-shaped
    // specs.
    if let Err(e) = schedc::limits::within_limit(
        &format!("comparing at --pp {pp} --mb {mb} --vpp {vpp}"),
        schedc::limits::estimate(
            Work::Sim,
            &schedc::limits::spec_size_lower_bound(pp, mb, Some(vpp.max(2))),
        ),
    ) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    inputs.extend(specs);
    let files = if inputs.is_empty() {
        schedc::compare::standard_library()
    } else {
        match schedc::compare::expand(&inputs) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    };
    let opts = schedc::compare::Options {
        pp,
        mb,
        vpp,
        params,
        moe,
        cost: model,
        cost_name: cost,
        derive,
        max_memory,
    };
    let report = match schedc::compare::compare(&files, &opts) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // As `check` and `sim` print them, once per input.
    for row in &report.rows {
        for n in &row.notes {
            eprintln!("note: {}: {n}", row.path);
        }
    }
    let code = if report.has_failures() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    };
    match format {
        OutFormat::Json => emit_then(
            &format!("{}\n", serde_json::to_string_pretty(&report).expect("json")),
            code,
        ),
        OutFormat::Human => emit_then(&schedc::compare::render(&report), code),
    }
}
