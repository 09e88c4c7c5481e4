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
}

/// Runs `schedc sim`.
pub fn run(args: Args) -> ExitCode {
    let Args {
        input,
        cost,
        set,
        format,
        trace,
        svg,
        force,
    } = args;
    let model = match resolve_cost(&cost, set.as_deref()) {
        Ok(m) => m,
        Err(c) => return c,
    };
    if input.moe.is_some() {
        if let Err(c) = require_moe_costs(&model, &cost.to_string_lossy()) {
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
    let loaded = match load_for_under(&input, Some(Work::Sim), Some(&model)) {
        Ok(l) => l,
        Err(f) => return f.code(),
    };
    if let Err(e) = check_stage_overrides(&model, loaded.program.pipeline.stages) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let mut checked = check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
    // The spec's expectations are the check's; its timing ones must hold under this model.
    let structural = checked.report.verdict != Verdict::Accepted;
    check::check_expectations(&mut checked.report, &loaded.spec_expects);
    if structural {
        eprintln!("error: the schedule does not pass `schedc check`; run it for the diagnostics");
        return ExitCode::from(1);
    }
    let prog = checked.checked.expect("accepted schedules are lowered");
    let res = match schedc::sim::simulate(&prog, &model) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
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
    check::check_timing_expectations(
        &mut checked.report,
        &loaded.spec_expects,
        Some(&res),
        &model,
    );
    let failed: Vec<_> = checked
        .report
        .diagnostics
        .iter_mut()
        .filter(|d| d.is_error())
        .collect();
    let n_failed = failed.len();
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
    let code = if n_failed > 0 {
        eprintln!("error: {n_failed} expectation(s) of the spec do not hold under this cost model");
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    };
    let exposed: f64 = res.ranks.iter().map(|r| r.exposed_comm).sum();
    // Only without all-to-all time: with it, a rank also waits for a peer held up by its
    // all-to-alls, which is not the message order's doing.
    if exposed > 0.0 && model.message_time() == 0.0 && model.moe.a2a == 0.0 && res.a2a.total == 0.0
    {
        eprintln!(
            "note: {exposed:.4} s of communication is exposed although messages are free: this program's message order makes ranks wait on one in-order stream per channel (schedc's lowering of the compute-only form orders messages as their data becomes ready)"
        );
    }
    let code = if to_stdout == 1 {
        code
    } else {
        match format {
            OutFormat::Json => {
                let mut j = serde_json::to_string_pretty(&res).expect("json");
                j.push('\n');
                emit_then(&j, code)
            }
            OutFormat::Human => emit_then(&schedc::sim::render::text_report(&res, 100), code),
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
