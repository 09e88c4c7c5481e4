//! `schedc sim`: simulate a schedule under a cost model.

use crate::common::*;
use schedc::check::{self, Verdict};
use schedc::diag;
use std::io::IsTerminal;
use std::process::ExitCode;

/// `schedc sim`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// Cost model: a preset (unit, dualpipe-readme, dsv3-h800), a TOML file, or inline
    /// overrides such as F=1,B=1,W=1,FB=3.
    #[arg(long, value_name = "FILE|PRESET|K=V,...", default_value = "unit")]
    pub cost: std::ffi::OsString,
    /// Further inline overrides applied on top of --cost (e.g. --set latency=1e-5).
    #[arg(long = "set", value_name = "K=V,...")]
    pub set: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
    /// Reject (exit 1, after the report) a rank whose peak device memory
    /// (`peak_memory_bytes`, from the cost model's `[memory]` sizes, required, or from
    /// --model) exceeds BYTES (a number, or with K, M, G, T: binary, 80G = 80GiB = 80 x 2^30).
    #[arg(long, value_name = "BYTES", value_parser = parse_max_memory)]
    pub max_memory: Option<u64>,
    /// Write a Chrome trace (open in Perfetto or chrome://tracing); `-` is standard output
    /// (instead of the report).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,
    /// Write an SVG Gantt chart; `-` is standard output (instead of the report).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<std::path::PathBuf>,
    /// Overwrite existing --trace/--svg files.
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

/// Runs `schedc sim`.
pub fn run(args: Args) -> ExitCode {
    let Args {
        input,
        cost,
        set,
        format,
        max_memory,
        trace,
        svg,
        force,
        cluster,
    } = args;
    if let Err(e) = cluster.check_without_model() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    if cluster.given() && cost != "unit" {
        eprintln!("error: --model derives the op times; give --cost or --model, not both (--set K=V overrides what --model derives)");
        return ExitCode::from(2);
    }
    let mut model = match resolve_cost(&cost, set.as_deref()) {
        Ok(m) => m,
        Err(c) => return c,
    };
    // With --model, the cost model depends on the program's shape: derive it from a quiet
    // first load, so that a spec's `list` block and `:list` parts are ordered under it.
    let mut scenario = None;
    if cluster.given() {
        match crate::cluster::probe_scenario(&input, &cluster, set.as_deref()) {
            Ok(Some(sc)) => {
                model = sc.cost.clone();
                scenario = Some(sc);
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    }
    if !cluster.given() {
        let sizes = if max_memory.is_some() {
            require_memory_sizes(&model)
        } else {
            Ok(())
        };
        if let Err(e) = sizes.and_then(|()| require_sizes_for_host_budget(&model)) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    let cost_name = match &cluster.model {
        Some(m) => format!("derived from --model {m}"),
        None => cost.to_string_lossy().into_owned(),
    };
    if let (Some(sc), Some(_)) = (&scenario, &input.moe) {
        if sc.derived.chunks.iter().all(|c| c.moe_layers == 0) {
            eprintln!(
                "error: --moe splits MoE ops into all-to-all parts, but `{}` has no MoE layer in this layout: drop --moe",
                sc.model
            );
            return ExitCode::from(2);
        }
    }
    // With --model and an input that does not load, the load below says why.
    if input.moe.is_some() && (scenario.is_some() || !cluster.given()) {
        if let Err(c) = require_moe_costs(&model, &cost_name) {
            return c;
        }
    }
    let to_stdout = [&trace, &svg]
        .into_iter()
        .flatten()
        .filter(|f| is_stdout(f))
        .count();
    if to_stdout > 1 {
        eprintln!("error: only one of --trace and --svg can be standard output (`-`)");
        return ExitCode::from(2);
    }
    if to_stdout == 1 && format == OutFormat::Json {
        eprintln!("error: --format json prints the report on standard output; write the trace or SVG to a file");
        return ExitCode::from(2);
    }
    if trace.is_some() && trace == svg {
        eprintln!("error: --trace and --svg name the same file");
        return ExitCode::from(2);
    }
    for f in [&trace, &svg].into_iter().flatten() {
        if let Err(c) = check_output(f, force) {
            return c;
        }
    }
    // A spec's `list` block is scheduled under the same cost model.
    let loaded = match load_for_under(&input, Some(Work::Sim), Some((&model, &cost_name))) {
        Ok(l) => l,
        Err(f) => return f.code(),
    };
    if let Err(e) = check_stage_overrides(&model, loaded.program.pipeline.stages) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    if let (Some(sc), true) = (&mut scenario, cluster.given()) {
        // The quiet load and this one must agree on the shape the costs were derived for.
        if sc.derived.chunks.len() as u32 != loaded.program.pipeline.stages_per_direction() {
            eprintln!("error: the program's shape changed between loads; run `schedc check` on it");
            return ExitCode::from(2);
        }
    }
    // Op times are for a stage of 1/P of the model, as `compare` charges them: a stage of a
    // V-way split takes 1/V.
    let model = model.for_pipeline(&loaded.program.pipeline);
    if let Some(k) = model.op_scale.filter(|&k| k != 1.0) {
        eprintln!(
            "note: op times are for a stage of 1/P of the model: each of this schedule's {} stages per direction is charged {k} of them (as `compare` charges it)",
            loaded.program.pipeline.stages_per_direction()
        );
    }
    let mut checked = check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
    // The spec's expectations are the check's; its timing ones must hold under this model.
    let structural = checked.report.verdict != Verdict::Accepted;
    // Under a part reordering, the expectations describe the spec's own order: checked there.
    if loaded.expect_program.is_some() {
        eprintln!("note: {}: {}", loaded.name, schedc::input::REORDER_NOTE);
    }
    match &loaded.expect_program {
        Some(before) => check::check_expectations_on(
            &mut checked.report,
            before,
            &loaded.spec_expects,
            Some(&model),
        ),
        None => check::check_expectations(&mut checked.report, &loaded.spec_expects),
    }
    if structural {
        eprintln!("error: the schedule does not pass `schedc check`; run it for the diagnostics");
        return ExitCode::from(1);
    }
    let prog = checked.checked.expect("accepted schedules are lowered");
    let res = match schedc::sim::simulate(&prog, &model) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            // A cost model whose times overflow is unusable input (2), not a schedule that
            // failed (1).
            return ExitCode::from(if e.starts_with(schedc::sim::NOT_FINITE) {
                2
            } else {
                1
            });
        }
    };
    // A file that cannot be written after all (the disk filled up since the check above)
    // does not throw the simulation away: the report is printed first, then the error.
    let mut write_errors = Vec::new();
    let mut put = |f: &std::path::Path, t: String| -> Result<(), ExitCode> {
        if is_stdout(f) {
            write_output(f, t.as_bytes(), force)
        } else {
            if let Err(e) = try_write_output(f, t.as_bytes(), force) {
                write_errors.push(e);
            }
            Ok(())
        }
    };
    if let Some(f) = &trace {
        if let Err(c) = put(f, schedc::sim::render::chrome_trace(&res, &prog)) {
            return c;
        }
    }
    if let Some(f) = &svg {
        let title = format!(
            "{} — P={}, {} micro-batches",
            loaded.name,
            prog.pipeline.pp,
            prog.pipeline.total_microbatches()
        );
        if let Err(c) = put(f, schedc::sim::render::svg(&res, &prog, &title)) {
            return c;
        }
    }
    if loaded.expect_program.is_none() {
        check::check_timing_expectations(
            &mut checked.report,
            &loaded.spec_expects,
            Some(&res),
            &model,
        );
    }
    // Memory budgets (issue 27): --max-memory and [memory] host_bytes.
    let budget_errors = check::memory_budget_diagnostics(
        &loaded.program,
        loaded.spans.as_ref(),
        &prog,
        &res,
        max_memory,
    );
    let n_budget = budget_errors.len();
    checked.report.diagnostics.extend(budget_errors);
    let failed: Vec<_> = checked
        .report
        .diagnostics
        .iter_mut()
        .filter(|d| d.is_error())
        .collect();
    let n_failed = failed.len() - n_budget;
    for d in failed {
        d.locate(&loaded.name, &loaded.text);
        eprint!(
            "{}",
            diag::render_color(
                d,
                Some((loaded.name.as_str(), loaded.text.as_str())),
                std::io::stderr().is_terminal()
            )
        );
    }
    if n_failed > 0 {
        eprintln!("error: {n_failed} expectation(s) of the spec do not hold under this cost model");
    }
    if n_budget > 0 {
        eprintln!("error: the schedule does not fit its memory budget(s) under this cost model");
    }
    let code = if n_failed + n_budget > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    };
    let errors: Vec<&diag::Diagnostic> = checked
        .report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .collect();
    let exposed: f64 = res.ranks.iter().map(|r| r.exposed_comm).sum();
    // Only without all-to-all time: with it, a rank also waits for a peer held up by its
    // all-to-alls, which is not the message order's doing.
    if exposed > 0.0 && model.message_time() == 0.0 && model.moe.a2a == 0.0 && res.a2a.total == 0.0
    {
        eprintln!(
            "note: {exposed:.4} s of communication is exposed although messages are free: this program's message order makes ranks wait on one in-order stream per channel (schedc's lowering of the compute-only form orders messages as their data becomes ready)"
        );
    }
    let step = scenario
        .as_ref()
        .map(|sc| crate::cluster::step_report(sc, &prog.pipeline, &res));
    // A model that does not fit is a rejection (exit 1), after the report.
    let code = match &step {
        Some(st) if !st.fits => {
            let (r, b) = st
                .memory_bytes
                .iter()
                .enumerate()
                .fold((0, 0.0f64), |a, (i, &b)| if b > a.1 { (i, b) } else { a });
            eprintln!(
                "error: rank {r} needs {:.1} GB, over the GPU's {:.1} GB: the model does not fit this layout",
                b / 1e9,
                st.gpu_memory_bytes / 1e9
            );
            ExitCode::from(1)
        }
        _ => code,
    };
    let code = if to_stdout == 1 {
        code
    } else {
        match format {
            OutFormat::Json => {
                let mut v = serde_json::to_value(&res).expect("json");
                if let (false, Some(obj)) = (errors.is_empty(), v.as_object_mut()) {
                    obj.insert(
                        "errors".into(),
                        serde_json::to_value(&errors).expect("json"),
                    );
                }
                if let (Some(st), Some(obj)) = (&step, v.as_object_mut()) {
                    if let serde_json::Value::Object(extra) =
                        serde_json::to_value(st).expect("json")
                    {
                        obj.extend(extra);
                    }
                }
                let mut j = serde_json::to_string_pretty(&v).expect("json");
                j.push('\n');
                emit_then(&j, code)
            }
            OutFormat::Human => {
                let mut t = schedc::sim::render::text_report(&res, 100);
                if let (Some(sc), Some(st)) = (&scenario, &step) {
                    t.push_str(&crate::cluster::step_text(sc, st));
                }
                emit_then(&t, code)
            }
        }
    };
    if write_errors.is_empty() {
        return code;
    }
    for e in write_errors {
        eprintln!("error: {e}");
    }
    ExitCode::from(2)
}

/// Refuses `[compute.stage.N]` overrides for stages the schedule does not have (they would
/// be ignored silently). Errors: the message.
pub fn check_stage_overrides(
    model: &schedc::sim::cost::CostModel,
    stages: u32,
) -> Result<(), String> {
    for k in model.compute.stage.keys() {
        if let Ok(s) = k.parse::<u32>() {
            if s >= stages {
                return Err(format!(
                    "the cost model sets [compute.stage.{s}], but the schedule has {stages} stage(s) (0..={})",
                    stages.saturating_sub(1)
                ));
            }
        }
    }
    Ok(())
}
