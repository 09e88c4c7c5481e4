//! `schedc check`: verify one schedule, or sweep a spec over ranges of P, M, V.

use crate::common::*;
use schedc::check::{self, Verdict};
use schedc::diag;
use schedc::input::{LoadError, Loaded, Overrides};
use schedc::passes::deadlock::Semantics;
use std::io::IsTerminal;
use std::process::ExitCode;

/// `schedc check`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
    /// Reject a rank whose peak live activations exceed N.
    #[arg(long, value_name = "N")]
    pub max_activations: Option<u64>,
    /// K buffer slots per rank pair: a send completes once the receive K messages
    /// earlier is posted (relaxes rendezvous).
    #[arg(long, value_name = "K")]
    pub buffer_slots: Option<u32>,
    /// Sends complete as soon as they are posted (unbounded buffering).
    #[arg(long, conflicts_with = "buffer_slots")]
    pub eager_sends: bool,
    /// Cost model for a spec's timing expectations (`expect makespan`, `bubble(..)`,
    /// `exposed_a2a`, `exposed_comm`), as for `sim` (default: unit).
    #[arg(long, value_name = "FILE|PRESET|K=V,...")]
    pub cost: Option<String>,
    /// Further inline overrides applied on top of --cost (e.g. --set latency=0).
    #[arg(long = "set", value_name = "K=V,...")]
    pub set: Option<String>,
    /// A group's ops complete one by one, each once its partner is posted, instead of the
    /// group completing as a unit together with every group matched to it.
    #[arg(long)]
    pub per_op_groups: bool,
}

/// Runs `schedc check`.
pub fn run(args: Args) -> ExitCode {
    let Args {
        input,
        format,
        max_activations,
        buffer_slots,
        eager_sends,
        per_op_groups,
        cost,
        set,
    } = args;
    let model = match resolve_cost(cost.as_deref().unwrap_or("unit"), set.as_deref()) {
        Ok(m) => m,
        Err(c) => return c,
    };
    if let (Some(_), Some(name)) = (&input.moe, &cost) {
        if let Err(c) = require_moe_costs(&model, name) {
            return c;
        }
    }
    if input.is_sweep() {
        return sweep(
            &input,
            eager_sends,
            per_op_groups,
            buffer_slots,
            max_activations,
            format,
            &model,
        );
    }
    let loaded = match load(&input) {
        Ok(l) => l,
        Err(c) => {
            // With --format json, standard output still carries one object.
            if format == OutFormat::Json {
                let verdict = if c == ExitCode::from(1) {
                    "refused"
                } else {
                    "unreadable"
                };
                emit(&format!(
                    "{}\n",
                    serde_json::json!({"verdict": verdict, "input": input.input, "diagnostics": [], "note": "see standard error"})
                ));
            }
            return c;
        }
    };
    let opts = check::Options {
        semantics: Semantics {
            eager: eager_sends,
            per_op_groups,
            buffer_slots,
        },
        max_activations: max_activations.or(loaded.budget),
    };
    let mut out = check::check(&loaded.program, loaded.spans.as_ref(), &opts);
    check::check_expectations(&mut out.report, &loaded.spec_expects);
    check::evaluate_timing_expectations(
        &mut out.report,
        out.checked.as_ref(),
        &loaded.spec_expects,
        &model,
    );
    if loaded.spans.is_some() {
        for d in &mut out.report.diagnostics {
            d.locate(&loaded.name, &loaded.text);
        }
    }
    let rep = &out.report;
    match format {
        OutFormat::Json => {
            println!(
                "{}",
                serde_json::to_string_pretty(rep).expect("report serializes")
            );
        }
        OutFormat::Human => emit(&print_human(&loaded, rep)),
    }
    if rep.verdict == Verdict::Accepted {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn print_human(loaded: &Loaded, rep: &check::Report) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let color = std::io::stdout().is_terminal();
    let verdict = match rep.verdict {
        Verdict::Accepted => "accepted",
        Verdict::Rejected => "rejected",
    };
    let p = &loaded.program;
    let _ =
        writeln!(o,
        "{}: {verdict} — pp {}, {} stage{} ({} placement), {} micro-batch{}{}, {} compute ops{}",
        loaded.name,
        rep.pp,
        rep.stages,
        if rep.stages == 1 { "" } else { "s" },
        placement_name(rep.placement),
        rep.microbatches,
        if rep.microbatches == 1 { "" } else { "es" },
        if p.pipeline.directions() == 2 {
            format!(" ({} per direction)", p.pipeline.microbatches)
        } else {
            String::new()
        },
        p.compute_ops(),
        if rep.lowered {
            format!(
                ", {} comm ops inserted",
                rep.ranks.iter().map(|r| r.comm_ops).sum::<u64>()
            )
        } else {
            format!(", {} comm ops", p.comm_ops())
        }
    );
    if let Some(m) = rep.makespan {
        let _ = writeln!(
            o,
            "unit-time makespan {m} (F=B=W=1, BW=2), bubble {:.1}% (from_start)",
            100.0 * rep.bubble.unwrap_or(0.0)
        );
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "{:>5} {:>8} {:>7} {:>7} {:>9} {:>10} {:>9} {:>8}",
        "rank", "compute", "comm", "warmup", "steady", "cooldown", "peak_act", "idle"
    );
    for r in &rep.ranks {
        let _ = writeln!(
            o,
            "{:>5} {:>8} {:>7} {:>7} {:>9} {:>10} {:>9} {:>8}",
            r.rank,
            r.ops,
            r.comm_ops,
            r.warmup,
            r.steady,
            r.cooldown,
            r.peak_activations,
            r.idle.map_or("-".to_string(), |x| format!("{x}"))
        );
    }
    let errors = rep.diagnostics.iter().filter(|d| d.is_error()).count();
    let shown = 20;
    if !rep.diagnostics.is_empty() {
        o.push('\n');
    }
    let src = loaded
        .spans
        .as_ref()
        .map(|_| (loaded.name.as_str(), loaded.text.as_str()));
    for d in rep.diagnostics.iter().take(shown) {
        let _ = write!(o, "{}", diag::render_color(d, src, color));
    }
    if rep.diagnostics.len() > shown {
        let _ = writeln!(
            o,
            "... and {} more (use --format json for all)",
            rep.diagnostics.len() - shown
        );
    }
    if errors > 0 {
        let _ = writeln!(o, "{errors} error(s)");
    }
    o
}

/// One instance's outcome: (P, M, V, passed / refused by `require` / failed with a message).
type SweepResult = (u32, u32, Option<u32>, Result<bool, String>);

/// `schedc check SPEC` over ranges of `--pp`, `--mb`, `--vpp`: every instance in parallel,
/// failures smallest first.
fn sweep(
    input: &InputArgs,
    eager: bool,
    per_op: bool,
    slots: Option<u32>,
    max_act: Option<u64>,
    format: OutFormat,
    model: &schedc::sim::cost::CostModel,
) -> ExitCode {
    use indicatif::{ProgressBar, ProgressStyle};
    use rayon::prelude::*;
    if !input.input.ends_with(".sched") {
        eprintln!(
            "error: ranges of --pp/--mb/--vpp sweep a .sched spec; `{}` is a single schedule",
            input.input
        );
        return ExitCode::from(2);
    }
    let text = match std::fs::read_to_string(&input.input) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read `{}`: {e}", input.input);
            return ExitCode::from(2);
        }
    };
    let Some(pps) = input.pp.as_ref() else {
        eprintln!("error: a sweep needs --pp");
        return ExitCode::from(2);
    };
    let Some(mbs) = input.mb.as_ref() else {
        eprintln!("error: a sweep needs --mb");
        return ExitCode::from(2);
    };
    let vpps: Vec<Option<u32>> = match &input.vpp {
        None => vec![None],
        Some(r) => r.0.iter().map(|v| Some(*v)).collect(),
    };
    let mut insts = Vec::new();
    for &p in &pps.0 {
        for &m in &mbs.0 {
            for &v in &vpps {
                insts.push((p, m, v));
            }
        }
    }
    let bar = ProgressBar::new(insts.len() as u64);
    if std::io::stderr().is_terminal() {
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:40} {pos}/{len} instances, {elapsed} elapsed, eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let opts = check::Options {
        semantics: Semantics {
            eager,
            per_op_groups: per_op,
            buffer_slots: slots,
        },
        max_activations: max_act,
    };
    // (pp, mb, vpp, outcome): None = passed, Some(Ok(())) = refused by `require`, Some(Err(msg)) = failed.
    let results: Vec<SweepResult> = insts
        .par_iter()
        .map(|&(p, m, v)| {
            let ov = Overrides {
                microbatches: Some(m),
                pp: Some(p),
                vpp: v,
                params: input.params.clone(),
                placement: None,
                moe: None,
            };
            let r = match schedc::input::load_spec(&text, &ov) {
                Err(LoadError::Spec { refused: true, .. }) => Ok(false),
                Err(LoadError::Spec { diags, .. }) => {
                    Err(diags.first().map(|d| d.message.clone()).unwrap_or_default())
                }
                Err(LoadError::Usage(u)) | Err(LoadError::Io(u)) => Err(u),
                Err(LoadError::Parse(e)) => Err(e.message),
                Ok(e) => match &input.moe {
                    Some(sel) => schedc::input::apply_moe(&e.program, Some(&e.spans), sel)
                        .map(|(p, s)| (p, s.unwrap_or_default())),
                    None => Ok((e.program, e.spans)),
                }
                .and_then(|(prog, spans)| {
                    let mut out = check::check(&prog, Some(&spans), &opts);
                    check::check_expectations(&mut out.report, &e.expects);
                    check::evaluate_timing_expectations(
                        &mut out.report,
                        out.checked.as_ref(),
                        &e.expects,
                        model,
                    );
                    match out.report.diagnostics.iter().find(|d| d.is_error()) {
                        None => Ok(true),
                        Some(d) => Err(format!("[{}] {}", d.code.as_str(), d.message)),
                    }
                }),
            };
            bar.inc(1);
            (p, m, v, r)
        })
        .collect();
    bar.finish_and_clear();
    let mut failed: Vec<_> = results.iter().filter(|r| r.3.is_err()).collect();
    failed.sort_by_key(|r| (r.0, r.1, r.2));
    let passed = results.iter().filter(|r| matches!(r.3, Ok(true))).count();
    let refused = results.iter().filter(|r| matches!(r.3, Ok(false))).count();
    let inst_str = |p: u32, m: u32, v: Option<u32>| match v {
        Some(v) => format!("--pp {p} --mb {m} --vpp {v}"),
        None => format!("--pp {p} --mb {m}"),
    };
    match format {
        OutFormat::Json => {
            let v = serde_json::json!({
                "instances": results.len(),
                "passed": passed,
                "refused": refused,
                "failed": failed.iter().map(|(p, m, v, r)| serde_json::json!({
                    "pp": p, "mb": m, "vpp": v, "error": r.as_ref().err()
                })).collect::<Vec<_>>(),
            });
            emit(&format!(
                "{}\n",
                serde_json::to_string_pretty(&v).expect("json")
            ));
        }
        OutFormat::Human => {
            use std::fmt::Write as _;
            let mut o = String::new();
            for (p, m, v, r) in failed.iter().take(20) {
                let _ = writeln!(
                    o,
                    "FAIL {}: {}",
                    inst_str(*p, *m, *v),
                    r.as_ref().err().map_or("", String::as_str)
                );
            }
            if failed.len() > 20 {
                let _ = writeln!(o, "... and {} more failing instances", failed.len() - 20);
            }
            let _ = writeln!(
                o,
                "{}: {} instances: {passed} passed, {} failed, {refused} outside the family (refused by `require`)",
                input.input,
                results.len(),
                failed.len()
            );
            emit(&o);
        }
    }
    if failed.is_empty() && passed > 0 {
        ExitCode::SUCCESS
    } else {
        if passed == 0 && failed.is_empty() {
            eprintln!("error: every instance is outside the family: nothing was checked");
        }
        ExitCode::from(1)
    }
}
