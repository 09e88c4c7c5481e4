//! `schedc compare`: every spec of the standard library simulated at one size.

use crate::common::*;
use schedc::check::{self, Verdict};
use schedc::input::{LoadError, Overrides};
use std::process::ExitCode;

/// `schedc compare`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Pipeline ranks.
    #[arg(long)]
    pub pp: u32,
    /// Micro-batches per step.
    #[arg(long)]
    pub mb: u32,
    /// Virtual stages per rank for specs whose V is free (interleaved schedules).
    #[arg(long, default_value_t = 2)]
    pub vpp: u32,
    /// Cost model (as for `sim`).
    #[arg(long, default_value = "unit")]
    pub cost: String,
    /// Where the specs are.
    #[arg(long, default_value = "specs")]
    pub specs: String,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
}

/// Runs `schedc compare`.
pub fn run(args: Args) -> ExitCode {
    let Args {
        pp,
        mb,
        vpp,
        cost,
        specs,
        format,
    } = args;
    compare(pp, mb, vpp, &cost, &specs, format)
}

/// `schedc compare`: every spec of `dir` that accepts (P, M), simulated under `cost`.
fn compare(pp: u32, mb: u32, vpp: u32, cost: &str, dir: &str, format: OutFormat) -> ExitCode {
    if pp == 0 || mb == 0 || vpp == 0 {
        eprintln!("error: --pp, --mb and --vpp must be at least 1");
        return ExitCode::from(2);
    }
    let model = match schedc::sim::cost::CostModel::resolve(cost) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut files: Vec<std::path::PathBuf> = match std::fs::read_dir(dir) {
        Ok(d) => d
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "sched"))
            .collect(),
        Err(e) => {
            eprintln!("error: cannot read the spec directory `{dir}`: {e} (run from the repository root or pass --specs DIR)");
            return ExitCode::from(2);
        }
    };
    files.sort();
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for f in &files {
        let name = f
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .to_string();
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        // Specs with a fixed V decide it; the others get --vpp.
        let fixed_v = schedc::dsl::parse_file(&text)
            .map(|f| {
                f.items
                    .iter()
                    .any(|i| matches!(i, schedc::dsl::ast::Item::Vpp(..)))
            })
            .unwrap_or(false);
        let ov = Overrides {
            pp: Some(pp),
            microbatches: Some(mb),
            vpp: if fixed_v { None } else { Some(vpp) },
            ..Default::default()
        };
        let e = match schedc::input::load_spec(&text, &ov) {
            Ok(e) => e,
            Err(LoadError::Spec {
                diags,
                refused: true,
                ..
            }) => {
                skipped.push((
                    name,
                    diags.first().map(|d| d.message.clone()).unwrap_or_default(),
                ));
                continue;
            }
            Err(_) => {
                skipped.push((name, "does not elaborate".into()));
                continue;
            }
        };
        let out = check::check(&e.program, None, &Default::default());
        if out.report.verdict != Verdict::Accepted {
            skipped.push((name, "does not pass schedc check".into()));
            continue;
        }
        let prog = out.checked.expect("lowered");
        let mut model = model.clone();
        model.op_scale =
            Some(prog.pipeline.pp as f64 / prog.pipeline.stages_per_direction() as f64);
        let res = match schedc::sim::simulate(&prog, &model) {
            Ok(r) => r,
            Err(err) => {
                skipped.push((name, err));
                continue;
            }
        };
        // Peak activations in units of one micro-batch on a stage of 1/P of the model.
        let peak = out
            .report
            .ranks
            .iter()
            .map(|r| r.peak_activations)
            .max()
            .unwrap_or(0) as f64
            * prog.pipeline.pp as f64
            / prog.pipeline.stages_per_direction() as f64;
        let copies = if prog.pipeline.directions() == 2 {
            2
        } else {
            1
        };
        let stages_per_rank = prog.pipeline.stages as f64 / prog.pipeline.pp as f64;
        rows.push(serde_json::json!({
            "schedule": name,
            "makespan": res.makespan,
            "bubble_ratio": res.bubble_ratio,
            "bubble_ratio_busy": res.bubble_ratio_busy,
            "peak_activations": peak,
            "param_copies": copies,
            "stages_per_rank": stages_per_rank,
        }));
    }
    rows.sort_by(|a, b| {
        a["makespan"]
            .as_f64()
            .unwrap_or(0.0)
            .total_cmp(&b["makespan"].as_f64().unwrap_or(0.0))
    });
    match format {
        OutFormat::Json => emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(&serde_json::json!({"pp": pp, "mb": mb, "schedules": rows, "skipped": skipped.iter().map(|(n, w)| serde_json::json!({"schedule": n, "why": w})).collect::<Vec<_>>()})).expect("json")
        )),
        OutFormat::Human => {
            use std::fmt::Write as _;
            let mut o = String::new();
            let _ = writeln!(
                o,
                "P = {pp}, M = {mb}, cost model `{cost}` (op times per stage of 1/P of the model; a stage of a V-way split takes 1/V)\n"
            );
            let _ = writeln!(
                o,
                "{:<18} {:>12} {:>14} {:>14} {:>10} {:>8}",
                "schedule", "makespan", "bubble/(b+i)", "bubble/busy", "peak_act", "params"
            );
            let _ = writeln!(o, "{:<18} {:>12} {:>14} {:>14} {:>10} {:>8}", "", "", "", "", "(1/P units)", "");
            for r in &rows {
                let _ = writeln!(
                    o,
                    "{:<18} {:>12.4} {:>13.1}% {:>13.1}% {:>10.1} {:>7}x",
                    r["schedule"].as_str().unwrap_or(""),
                    r["makespan"].as_f64().unwrap_or(0.0),
                    100.0 * r["bubble_ratio"].as_f64().unwrap_or(0.0),
                    100.0 * r["bubble_ratio_busy"].as_f64().unwrap_or(0.0),
                    r["peak_activations"].as_f64().unwrap_or(0.0),
                    r["param_copies"]
                );
            }
            if !skipped.is_empty() {
                let _ = writeln!(o, "\nnot applicable at this size:");
                for (n, w) in &skipped {
                    let _ = writeln!(o, "  {n}: {w}");
                }
            }
            emit(&o);
        }
    }
    ExitCode::SUCCESS
}
