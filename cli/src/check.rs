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
    /// Reject a rank whose peak device memory, as `schedc sim` computes it under --cost
    /// (`[memory]` sizes, required), exceeds BYTES (a number, or with K, M, G, T: binary,
    /// 80G = 80GiB = 80 x 2^30).
    #[arg(long, value_name = "BYTES", value_parser = parse_max_memory)]
    pub max_memory: Option<u64>,
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
    pub cost: Option<std::ffi::OsString>,
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
        max_memory,
        buffer_slots,
        eager_sends,
        per_op_groups,
        cost,
        set,
    } = args;
    let model = match resolve_cost(
        cost.as_deref().unwrap_or(std::ffi::OsStr::new("unit")),
        set.as_deref(),
    ) {
        Ok(m) => m,
        Err(c) => return c,
    };
    if let (Some(_), Some(name)) = (&input.moe, &cost) {
        if let Err(c) = require_moe_costs(&model, &name.to_string_lossy()) {
            return c;
        }
    }
    let sizes = if max_memory.is_some() {
        require_memory_sizes(&model)
    } else {
        Ok(())
    };
    {
        if let Err(e) = sizes.and_then(|()| require_sizes_for_host_budget(&model)) {
            eprintln!("error: {e}");
            if format == OutFormat::Json {
                let v = serde_json::json!({"input": input.name(), "error": format!("error: {e}\n"), "exit": 2});
                return emit_then(&format!("{v}\n"), ExitCode::from(2));
            }
            return ExitCode::from(2);
        }
    }
    if input.is_sweep() {
        return sweep(
            &input,
            eager_sends,
            per_op_groups,
            buffer_slots,
            max_activations,
            max_memory,
            format,
            &model,
            cost.as_ref().map(|c| c.to_string_lossy().into_owned()),
        );
    }
    // With --cost, a spec's `list` block is scheduled under that model (as `sim --cost`).
    let cost_name = cost.as_ref().map(|n| n.to_string_lossy().into_owned());
    let loaded = match load_for_under(
        &input,
        Some(Work::Check),
        cost_name.as_deref().map(|n| (&model, n)),
    ) {
        Ok(l) => l,
        Err(f) => {
            // With --format json, standard output still carries one object, with the message.
            if format == OutFormat::Json {
                let v = serde_json::json!({
                    "verdict": f.verdict,
                    "input": input.name(),
                    "error": f.message,
                    "exit": f.exit,
                    "diagnostics": f.diagnostics,
                });
                return emit_then(&format!("{v}\n"), f.code());
            }
            return f.code();
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
    // Timing expectations under `sim`'s convention: a stage of a V-way split takes 1/V.
    let model = model.for_pipeline(&loaded.program.pipeline);
    memory_budgets(
        &mut out,
        &loaded.program,
        loaded.spans.as_ref(),
        &model,
        max_memory,
    );
    // Under a part reordering, the expectations describe the spec's own order: checked there.
    if loaded.expect_program.is_some() {
        eprintln!("note: {}: {}", loaded.name, schedc::input::REORDER_NOTE);
    }
    match &loaded.expect_program {
        Some(before) if out.report.verdict == Verdict::Accepted => {
            check::check_expectations_on(
                &mut out.report,
                before,
                &loaded.spec_expects,
                Some(&model),
            );
        }
        Some(_) => {}
        None => {
            check::check_expectations(&mut out.report, &loaded.spec_expects);
            check::evaluate_timing_expectations(
                &mut out.report,
                out.checked.as_ref(),
                &loaded.spec_expects,
                &model,
            );
        }
    }
    if loaded.spans.is_some() {
        for d in &mut out.report.diagnostics {
            d.locate(&loaded.name, &loaded.text);
        }
    }
    let rep = &out.report;
    let code = if rep.verdict == Verdict::Accepted {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    match format {
        OutFormat::Json => emit_then(
            &format!(
                "{}\n",
                serde_json::to_string_pretty(rep).expect("report serializes")
            ),
            code,
        ),
        OutFormat::Human => emit_then(&print_human(&loaded, rep), code),
    }
}

/// `--max-memory` and `[memory] host_bytes` (issue 27): an accepted schedule is simulated
/// under `model` and rejected where a rank's peak device memory or host memory is over its
/// budget. Nothing to do without either budget, or for a rejected schedule.
fn memory_budgets(
    out: &mut check::Outcome,
    program: &schedc_ir::Program,
    spans: Option<&schedc_ir::text::SourceMap>,
    model: &schedc::sim::cost::CostModel,
    max_memory: Option<u64>,
) {
    if max_memory.is_none() && model.memory.host_bytes <= 0.0 {
        return;
    }
    let Some(sim_prog) = out.checked.as_ref() else {
        return;
    };
    if out.report.verdict != Verdict::Accepted {
        return;
    }
    let diags = match schedc::sim::simulate_with(
        sim_prog,
        model,
        schedc::sim::SimOptions {
            steady_state: false,
        },
    ) {
        Ok(res) => check::memory_budget_diagnostics(program, spans, sim_prog, &res, max_memory),
        Err(e) => vec![schedc::diag::Diagnostic::error(
            diag::Code::Memory,
            format!("the memory budgets cannot be checked: {e}"),
        )],
    };
    if !diags.is_empty() {
        out.report.verdict = Verdict::Rejected;
        out.report.diagnostics.extend(diags);
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
    match rep.makespan {
        Some(m) => {
            let _ = writeln!(
                o,
                "unit-time makespan {m} (F=B=W=1, BW=2), bubble {:.1}% (from_start)",
                100.0 * rep.bubble.unwrap_or(0.0)
            );
        }
        None if rep
            .diagnostics
            .iter()
            .any(|d| d.code == diag::Code::Deadlock) =>
        {
            o.push_str("no unit-time makespan: the schedule does not run to the end\n");
        }
        None => {}
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
    // Only a schedule that offloads has host figures (issue 27).
    if rep.ranks.iter().any(|r| r.peak_host_activations > 0) {
        let host: Vec<String> = rep
            .ranks
            .iter()
            .map(|r| r.peak_host_activations.to_string())
            .collect();
        let _ = writeln!(
            o,
            "peak activations offloaded to the host, per rank: {} (peak_act counts the device)",
            host.join(" ")
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

/// One instance's outcome.
#[derive(Clone, Debug)]
enum Outcome {
    /// Every pass and expectation holds.
    Passed,
    /// Outside the family (a `require` refuses it).
    Refused,
    /// Rejected by a pass or an expectation (exit 1).
    Failed(String),
    /// The spec is read but does not elaborate for it (exit 1: the instance is rejected, as
    /// for a single instance).
    Unelaborated(String),
    /// Unreadable for it: bad usage (a `--param`), or over the memory limit (exit 2).
    Broken(String),
}

/// (P, M, V) and the outcome.
type SweepResult = (u32, u32, Option<u32>, Outcome);

/// `schedc check SPEC` over ranges of `--pp`, `--mb`, `--vpp`: every instance in parallel,
/// failures smallest first. With `list_under_model`, a `list` block is scheduled under
/// `model` (`--cost` given), else under unit op times.
#[allow(clippy::too_many_arguments)]
fn sweep(
    input: &InputArgs,
    eager: bool,
    per_op: bool,
    slots: Option<u32>,
    max_act: Option<u64>,
    max_memory: Option<u64>,
    format: OutFormat,
    model: &schedc::sim::cost::CostModel,
    cost_name: Option<String>,
) -> ExitCode {
    let list_under_model = cost_name.is_some();
    use indicatif::{ProgressBar, ProgressStyle};
    use rayon::prelude::*;
    let name = input.name();
    let refuse = |msg: String| -> ExitCode {
        eprintln!("error: {msg}");
        if format == OutFormat::Json {
            let v =
                serde_json::json!({"input": name, "error": format!("error: {msg}\n"), "exit": 2});
            return emit_then(&format!("{v}\n"), ExitCode::from(2));
        }
        ExitCode::from(2)
    };
    if let Err(e) = unique_params(&input.params) {
        return refuse(e);
    }
    if input.placement.is_some() {
        return refuse("--placement does not apply to a spec: its `placement` item decides".into());
    }
    let (Some(pps), Some(mbs)) = (input.pp, input.mb) else {
        return refuse("a sweep needs both --pp and --mb".into());
    };
    for (flag, r) in [
        ("--pp", Some(pps)),
        ("--mb", Some(mbs)),
        ("--vpp", input.vpp),
    ] {
        if let Some(r) = r {
            if r.start == 0 {
                return refuse(format!("{flag} must be at least 1; the range starts at 0"));
            }
        }
    }
    let count = pps
        .len()
        .saturating_mul(mbs.len())
        .saturating_mul(input.vpp.map_or(1, |r| r.len()));
    if count > MAX_SWEEP_INSTANCES {
        return refuse(format!(
            "the sweep has {count} instances ({} values of --pp x {} of --mb{}), more than the limit of {MAX_SWEEP_INSTANCES}; narrow the ranges or add a step (2..=64:2)",
            pps.len(),
            mbs.len(),
            input.vpp.map_or(String::new(), |r| format!(" x {} of --vpp", r.len()))
        ));
    }
    // The largest instance, on each of the threads that run at once, must fit.
    let largest = schedc::limits::spec_size_lower_bound(pps.end, mbs.end, input.vpp.map(|r| r.end));
    let threads = rayon::current_num_threads() as u64;
    if let Err(e) = schedc::limits::within_limit(
        &format!(
            "the sweep's largest instance (--pp {} --mb {}), on {threads} threads at once,",
            pps.end, mbs.end
        ),
        schedc::limits::estimate(schedc::limits::Work::Check, &largest).saturating_mul(threads),
    ) {
        return refuse(e);
    }
    let text = match read_spec_text(&input.input) {
        Ok(t) => t,
        Err(e) => return refuse(e),
    };
    // A `parts` item under --cost needs all-to-all times, as --moe does (one instance:
    // `schedc::input::require_part_costs`).
    if let (None, Some(cn), Some(item)) = (
        &input.moe,
        &cost_name,
        schedc::input::parts_item(&name, &text),
    ) {
        if let Err(e) = schedc::input::require_parts_item_costs(&item, model, cn) {
            return refuse(e);
        }
    }
    let vpps: Vec<Option<u32>> = match &input.vpp {
        None => vec![None],
        Some(r) => r.iter().map(Some).collect(),
    };
    let bar = ProgressBar::new(count);
    if std::io::stderr().is_terminal() {
        bar.set_style(
            ProgressStyle::with_template(
                "{wide_bar} {pos}/{len} instances, {elapsed} elapsed, eta {eta}",
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
    let insts = pps
        .iter()
        .flat_map(|p| mbs.iter().map(move |m| (p, m)))
        .flat_map(|(p, m)| vpps.iter().map(move |&v| (p, m, v)));
    let results: Vec<SweepResult> = insts
        .par_bridge()
        .map(|(p, m, v)| {
            let ov = Overrides {
                microbatches: Some(m),
                pp: Some(p),
                vpp: v,
                params: input.params.clone(),
                placement: None,
                list_cost: list_under_model.then(|| model.clone()),
                moe: None,
            };
            let loaded = match &ov.list_cost {
                Some(c) => schedc::input::load_spec_with(&text, &ov, c),
                None => schedc::input::load_spec(&text, &ov),
            };
            let r = match loaded {
                Err(LoadError::Spec { refused: true, .. }) => Outcome::Refused,
                Err(e @ LoadError::Spec { .. }) => {
                    let LoadError::Spec { diags, .. } = &e else {
                        unreachable!()
                    };
                    let msg = diags.first().map(|d| d.message.clone()).unwrap_or_default();
                    if e.exit_code() == 1 {
                        Outcome::Unelaborated(msg)
                    } else {
                        Outcome::Broken(msg)
                    }
                }
                Err(LoadError::Usage(u)) | Err(LoadError::Io(u)) => Outcome::Broken(u),
                Err(LoadError::Parse(e)) => Outcome::Broken(e.message),
                Ok(e) => {
                    let size = schedc::limits::Size::of(&e.program);
                    // `:list` orders the parts under the sweep's cost model, as `check
                    // --cost` does on one instance; the expectations describe the spec's
                    // own order (plain `--moe`) where the parts are reordered.
                    // A spec's `parts` item where no `--moe` is given, as in one instance.
                    let moe = input.moe.clone().or(e.parts.clone());
                    let before = match &moe {
                        Some(sel) => schedc::input::expectations_program(&e.program, sel),
                        None => Ok(None),
                    };
                    let split = match &moe {
                        Some(sel) => schedc::input::apply_moe_under(
                            &e.program,
                            Some(&e.spans),
                            sel,
                            list_under_model.then_some(model),
                        )
                        .map(|(p, s)| (p, s.unwrap_or_default())),
                        None => Ok((e.program, e.spans)),
                    };
                    let split = split.and_then(|x| before.map(|b| (x, b)));
                    match schedc::limits::within_limit(
                        "this instance",
                        schedc::limits::estimate(schedc::limits::Work::Check, &size),
                    )
                    .and(split)
                    {
                        Err(msg) => Outcome::Broken(msg),
                        Ok(((prog, spans), before)) => {
                            let mut out = check::check(&prog, Some(&spans), &opts);
                            let model = &model.for_pipeline(&prog.pipeline);
                            memory_budgets(&mut out, &prog, Some(&spans), model, max_memory);
                            match &before {
                                Some(b) if out.report.verdict == Verdict::Accepted => {
                                    check::check_expectations_on(
                                        &mut out.report,
                                        b,
                                        &e.expects,
                                        Some(model),
                                    );
                                }
                                Some(_) => {}
                                None => {
                                    check::check_expectations(&mut out.report, &e.expects);
                                    check::evaluate_timing_expectations(
                                        &mut out.report,
                                        out.checked.as_ref(),
                                        &e.expects,
                                        model,
                                    );
                                }
                            }
                            match out.report.diagnostics.iter().find(|d| d.is_error()) {
                                None => Outcome::Passed,
                                Some(d) => {
                                    Outcome::Failed(format!("[{}] {}", d.code.as_str(), d.message))
                                }
                            }
                        }
                    }
                }
            };
            bar.inc(1);
            (p, m, v, r)
        })
        .collect();
    bar.finish_and_clear();
    let bad = |o: &Outcome| {
        matches!(
            o,
            Outcome::Failed(_) | Outcome::Unelaborated(_) | Outcome::Broken(_)
        )
    };
    let errored = |o: &Outcome| matches!(o, Outcome::Unelaborated(_) | Outcome::Broken(_));
    let mut failed: Vec<&SweepResult> = results.iter().filter(|r| bad(&r.3)).collect();
    failed.sort_by_key(|r| (r.0, r.1, r.2));
    let passed = results
        .iter()
        .filter(|r| matches!(r.3, Outcome::Passed))
        .count();
    let refused = results
        .iter()
        .filter(|r| matches!(r.3, Outcome::Refused))
        .count();
    let broken = results.iter().filter(|r| errored(&r.3)).count();
    let unreadable = results
        .iter()
        .filter(|r| matches!(r.3, Outcome::Broken(_)))
        .count();
    let why = |o: &Outcome| match o {
        Outcome::Failed(m) | Outcome::Unelaborated(m) | Outcome::Broken(m) => m.clone(),
        _ => String::new(),
    };
    let inst_str = |p: u32, m: u32, v: Option<u32>| match v {
        Some(v) => format!("--pp {p} --mb {m} --vpp {v}"),
        None => format!("--pp {p} --mb {m}"),
    };
    let code = if unreadable > 0 {
        ExitCode::from(2)
    } else if failed.is_empty() && passed > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    if passed == 0 && failed.is_empty() {
        eprintln!("error: every instance is outside the family: nothing was checked");
    }
    match format {
        OutFormat::Json => {
            let v = serde_json::json!({
                "input": name,
                "instances": results.len(),
                "passed": passed,
                "refused": refused,
                "failed": failed.iter().map(|(p, m, v, r)| serde_json::json!({
                    "pp": p, "mb": m, "vpp": v, "error": why(r),
                    "kind": match r {
                        Outcome::Unelaborated(_) => "does not elaborate",
                        Outcome::Broken(_) => "unreadable",
                        _ => "rejected",
                    },
                })).collect::<Vec<_>>(),
            });
            emit_then(
                &format!("{}\n", serde_json::to_string_pretty(&v).expect("json")),
                code,
            )
        }
        OutFormat::Human => {
            use std::fmt::Write as _;
            let mut o = String::new();
            for (p, m, v, r) in failed.iter().take(20) {
                let tag = if errored(r) { "ERROR" } else { "FAIL" };
                let _ = writeln!(o, "{tag} {}: {}", inst_str(*p, *m, *v), why(r));
            }
            if failed.len() > 20 {
                let _ = writeln!(o, "... and {} more failing instances", failed.len() - 20);
            }
            let _ = writeln!(
                o,
                "{name}: {} instances: {passed} passed, {} failed{}, {refused} outside the family (refused by `require`)",
                results.len(),
                failed.len() - broken,
                if broken > 0 {
                    format!(", {broken} not checked (the spec does not elaborate, or over the memory limit)")
                } else {
                    String::new()
                }
            );
            emit_then(&o, code)
        }
    }
}

/// The text of a spec to sweep: a `.sched` file, or a file or standard input whose content
/// reads as a spec. Errors: unreadable, or not a spec.
fn read_spec_text(path: &std::path::Path) -> Result<String, String> {
    let name = path.to_string_lossy();
    let text = schedc::input::read_text(path).map_err(|e| match e {
        LoadError::Io(m) | LoadError::Usage(m) => m,
        LoadError::Parse(p) => p.message,
        LoadError::Spec { .. } => String::new(),
    })?;
    if schedc::input::detect(&name, &text) != schedc::input::Format::Spec {
        return Err(format!(
            "ranges of --pp/--mb/--vpp sweep a .sched spec; `{name}` is a single schedule"
        ));
    }
    Ok(text)
}
