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
    pub cost: String,
    /// Further inline overrides applied on top of --cost (e.g. --set latency=1e-5).
    #[arg(long = "set", value_name = "K=V,...")]
    pub set: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
    /// Write a Chrome trace (open in Perfetto or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<String>,
    /// Write an SVG Gantt chart.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<String>,
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
        if let Err(c) = require_moe_costs(&model, &cost) {
            return c;
        }
    }
    if trace.is_some() && trace == svg {
        eprintln!("error: --trace and --svg name the same file");
        return ExitCode::from(2);
    }
    for f in [&trace, &svg].into_iter().flatten() {
        if !force && std::path::Path::new(f).exists() {
            eprintln!("error: `{f}` exists; not overwriting it (pass --force to replace it)");
            return ExitCode::from(2);
        }
    }
    let loaded = match load(&input) {
        Ok(l) => l,
        Err(c) => return c,
    };
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
    if let Some(f) = &trace {
        if let Err(e) = std::fs::write(f, schedc::sim::render::chrome_trace(&res, &prog)) {
            eprintln!("error: cannot write `{f}`: {e}");
            return ExitCode::from(2);
        }
    }
    if let Some(f) = &svg {
        let title = format!(
            "{} — P={}, {} micro-batches",
            loaded.name,
            prog.pipeline.pp,
            prog.pipeline.total_microbatches()
        );
        if let Err(e) = std::fs::write(f, schedc::sim::render::svg(&res, &prog, &title)) {
            eprintln!("error: cannot write `{f}`: {e}");
            return ExitCode::from(2);
        }
    }
    match format {
        OutFormat::Json => {
            let mut j = serde_json::to_string_pretty(&res).expect("json");
            j.push('\n');
            emit(&j);
        }
        OutFormat::Human => emit(&schedc::sim::render::text_report(&res, 100)),
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
    if n_failed > 0 {
        eprintln!("error: {n_failed} expectation(s) of the spec do not hold under this cost model");
        return ExitCode::from(1);
    }
    let exposed: f64 = res.ranks.iter().map(|r| r.exposed_comm).sum();
    if exposed > 0.0 && model.message_time() == 0.0 && model.moe.a2a == 0.0 {
        eprintln!(
            "note: {exposed:.4} s of communication is exposed although messages are free: this program's message order makes ranks wait on one in-order stream per channel (schedc's lowering of the compute-only form orders messages as their data becomes ready)"
        );
    }
    ExitCode::SUCCESS
}
