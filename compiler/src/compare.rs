//! `schedc compare`: several schedules at one size under one cost model, side by side.
//!
//! Each input — a `.sched` spec (instantiated at `--pp`, `--mb`, its own V or `--vpp`, the
//! `--param`s it declares), a directory (its `.sched` files), or any other schedule file
//! `schedc check` reads (IR text or JSON, torch CSV, a DualPipe trace, at its own size) — is
//! loaded, optionally split into MoE parts (`--moe`), checked, its expectations evaluated,
//! and simulated. The outcome of each is a [`Row`]: its figures, or why it has none:
//!
//! * [`Status::NotApplicable`]: a spec's `require` refuses the size (the family does not
//!   have this instance);
//! * [`Status::Rejected`]: `schedc check` rejects the instance (a deadlock, an order error,
//!   ...), with the first error's code and message;
//! * [`Status::Expectation`]: the schedule runs, but an `expect` line fails (its figures are
//!   shown, flagged);
//! * [`Status::Error`]: the input cannot be read, parsed or elaborated.
//!
//! Op times are for a stage of 1/P of the model: a schedule that splits the model into more,
//! smaller stages (interleaved, ZB-V, DualPipeV) has each op scaled by `P / stages per
//! direction` ([`crate::sim::cost::CostModel::op_scale`]), so all do the same work. With a
//! model ([`Options::derive`], `--model`), each row's costs are derived for its own stages
//! instead (each holds its own layers: no scaling), and the row gets the step-level figures
//! (step time, tokens/s, MFU, memory in bytes) of [`crate::costmodel::StepReport`].

use crate::check::{self, Verdict};
use crate::input::{self, LoadError, Overrides};
use crate::moe::MoeStages;
use crate::sim::cost::CostModel;
use crate::sim::{A2aStats, Bubble};
use serde::Serialize;
use std::path::PathBuf;

/// What `compare` is asked.
#[derive(Clone, Debug)]
pub struct Options {
    /// P for specs.
    pub pp: u32,
    /// M (micro-batches per step) for specs.
    pub mb: u32,
    /// V for specs whose V is free (default 2 on the command line).
    pub vpp: u32,
    /// `--param NAME=VALUE`: given to each spec that declares `NAME`.
    pub params: Vec<(String, i64)>,
    /// `--moe`.
    pub moe: Option<MoeStages>,
    /// The cost model.
    pub cost: CostModel,
    /// Its name, for the report.
    pub cost_name: String,
    /// Costs derived per row from a model (`--model`): given each row's program shape, its
    /// derived costs and the simulator's cost model (replacing `cost`; its `op_scale` of 1
    /// is kept). Errors: the message, shown as the row's error.
    pub derive: Option<Deriver>,
    /// `--max-memory BYTES`: each simulated row's largest `peak_memory_bytes` is compared
    /// with it (and its host memory with `[memory] host_bytes`); rows over it are marked
    /// ([`Figures::fits_max_memory`]), not failed.
    pub max_memory: Option<u64>,
}

/// What [`Deriver`] computes for a row's program shape: its derived costs and the
/// simulator's cost model, or the error.
pub type DeriveFn = dyn Fn(&schedc_ir::Pipeline) -> Result<(crate::costmodel::Derived, CostModel), String>
    + Send
    + Sync;

/// The function that derives a row's costs from its program shape (see
/// [`Options::derive`]).
#[derive(Clone)]
pub struct Deriver(pub std::sync::Arc<DeriveFn>);

impl std::fmt::Debug for Deriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Deriver(..)")
    }
}

/// The step-level figures of a row whose costs were derived from a model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepFigures {
    /// Step time (makespan, exposed DP reduction and optimizer), seconds.
    pub step_seconds: f64,
    /// Tokens per second over all GPUs.
    pub tokens_per_second: f64,
    /// Model TFLOP/s per GPU.
    pub tflops_per_gpu: f64,
    /// Model FLOPs utilization.
    pub mfu: f64,
    /// The largest rank's memory, bytes.
    pub peak_memory_bytes: f64,
    /// Whether every rank fits in the GPU.
    pub fits: bool,
}

/// Why a row has no figures, or what is wrong with them.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Status {
    /// Simulated; every expectation holds.
    Ok,
    /// Simulated, but these `expect` lines fail (messages).
    Expectation {
        /// One message per failing line.
        failed: Vec<String>,
    },
    /// The spec's `require` refuses this size.
    NotApplicable {
        /// The `require` message.
        why: String,
    },
    /// `schedc check` rejects the instance.
    Rejected {
        /// The first error's code (`deadlock`, `order`, ...).
        code: String,
        /// Its message.
        message: String,
        /// Errors in all.
        errors: usize,
    },
    /// Unreadable, unparsable or not elaborated.
    Error {
        /// Why.
        message: String,
    },
}

/// The figures of one simulated schedule.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Figures {
    /// P.
    pub pp: u32,
    /// Micro-batches per step.
    pub microbatches: u32,
    /// Seconds.
    pub makespan: f64,
    /// The bubble fraction under each convention.
    pub bubble: Bubble,
    /// Σ idle / Σ busy (`from_start` idle; Megatron's `(P-1)/M`).
    pub bubble_ratio_busy: f64,
    /// MoE all-to-all: seconds in all, seconds exposed.
    pub a2a: A2aStats,
    /// Communication the compute streams wait for, seconds over all ranks.
    pub exposed_comm: f64,
    /// Peak live activations, the largest over ranks, in units of one micro-batch on a stage
    /// of 1/P of the model.
    pub peak_activations: f64,
    /// Copies of the parameters (2 for DualPipe's two directions).
    pub param_copies: u32,
    /// Stages per rank.
    pub stages_per_rank: f64,
    /// With a model (`--model`): the step-level figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<StepFigures>,
    /// Under `--max-memory`: the largest rank's simulated device memory (`peak_memory_bytes`
    /// of `schedc sim`), bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<f64>,
    /// Under `--max-memory`: whether every rank is within it and no offload overflows
    /// `[memory] host_bytes` (what `schedc check --max-memory` accepts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fits_max_memory: Option<bool>,
}

/// One input's outcome.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// The schedule's name (the file stem).
    pub schedule: String,
    /// The file.
    pub path: String,
    /// The figures, when it was simulated.
    pub figures: Option<Figures>,
    /// The outcome.
    #[serde(flatten)]
    pub status: Status,
    /// Notes about how the input was read, as `check` and `sim` print them (e.g. that
    /// `--moe=...:list` keeps the default part order of an input with its messages written);
    /// absent from JSON when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// The whole comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// P asked.
    pub pp: u32,
    /// M asked.
    pub mb: u32,
    /// The cost model's name.
    pub cost: String,
    /// Whether `--moe` split the MoE stages.
    pub moe: bool,
    /// Whether the split interleaves consecutive plain ops (`--moe=STAGES:adjacent`).
    pub moe_adjacent: bool,
    /// Ops in flight per rank of a `--moe=STAGES:list` run (cost-aware part order), if any.
    pub moe_list: Option<u8>,
    /// Whether each row's costs were derived from a model (`--model`).
    pub derived: bool,
    /// `--max-memory`, bytes per rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory: Option<u64>,
    /// Every input, simulated ones by makespan first, then the others in input order.
    pub rows: Vec<Row>,
}

impl Report {
    /// True if some input failed: rejected, a failed expectation, or an error (not a
    /// refused size).
    pub fn has_failures(&self) -> bool {
        self.rows.iter().any(|r| {
            matches!(
                r.status,
                Status::Rejected { .. } | Status::Expectation { .. } | Status::Error { .. }
            )
        })
    }
}

/// One input of a comparison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A schedule file: a spec or any other format `schedc check` reads.
    File(PathBuf),
    /// A spec given as text: a spec of the standard library built into schedc
    /// ([`crate::specs`]), named without its `.sched`.
    Spec {
        /// The spec's name (`1f1b`).
        name: String,
        /// Its text.
        text: String,
    },
}

impl Source {
    /// The name shown in the report: the file stem or the spec's name.
    pub fn schedule(&self) -> String {
        match self {
            Source::File(f) => f
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "?".into()),
            Source::Spec { name, .. } => name.clone(),
        }
    }

    /// Where it comes from: the file, or `NAME.sched (built in)`.
    pub fn path(&self) -> String {
        match self {
            Source::File(f) => f.display().to_string(),
            Source::Spec { name, .. } => format!("{name}.sched (built in)"),
        }
    }

    /// Its text (empty when the file cannot be read; loading it then reports why).
    fn text(&self) -> String {
        match self {
            Source::File(f) => std::fs::read_to_string(f).unwrap_or_default(),
            Source::Spec { text, .. } => text.clone(),
        }
    }
}

/// The standard library built into schedc, as sources.
pub fn standard_library() -> Vec<Source> {
    crate::specs::standard_library()
        .iter()
        .map(|(n, t)| Source::Spec {
            name: n.to_string(),
            text: t.to_string(),
        })
        .collect()
}

/// The files to compare: each directory expands to its `.sched` files, sorted.
///
/// Errors: an unreadable directory or a path that does not exist.
pub fn expand(inputs: &[PathBuf]) -> Result<Vec<Source>, String> {
    let mut out = Vec::new();
    for p in inputs {
        let shown = p.display();
        if p.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| format!("cannot read the directory `{shown}`: {e}"))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "sched"))
                .collect();
            v.sort();
            if v.is_empty() {
                return Err(format!("the directory `{shown}` holds no `.sched` spec"));
            }
            out.extend(v.into_iter().map(Source::File));
        } else if p.exists() {
            out.push(Source::File(p.to_path_buf()));
        } else {
            return Err(format!("`{shown}` does not exist"));
        }
    }
    Ok(out)
}

/// Compares `files` (see [`expand`] and [`standard_library`]).
///
/// Errors (usage, the whole command fails): a `--param` that no spec declares; `--moe`
/// with a cost model that has no `[moe]` section ([`crate::moe::require_moe_costs`]).
pub fn compare(files: &[Source], opts: &Options) -> Result<Report, String> {
    if opts.moe.is_some() && opts.derive.is_none() {
        crate::moe::require_moe_costs(&opts.cost, &opts.cost_name)?;
    }
    // Each parameter must be declared by some spec.
    let declared: Vec<(&Source, Vec<String>, bool)> = files
        .iter()
        .map(|f| {
            let text = f.text();
            let parsed = is_spec(f, &text)
                .then(|| crate::dsl::parse_file(&text).ok())
                .flatten();
            let names = parsed
                .as_ref()
                .map(|p| {
                    p.items
                        .iter()
                        .filter_map(|i| match i {
                            crate::dsl::ast::Item::Param(n, _, _) => Some(n.clone()),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            let fixed_v = parsed.as_ref().is_some_and(|p| {
                p.items
                    .iter()
                    .any(|i| matches!(i, crate::dsl::ast::Item::Vpp(..)))
            });
            (f, names, fixed_v)
        })
        .collect();
    for (n, _) in &opts.params {
        if !declared.iter().any(|(_, names, _)| names.contains(n)) {
            return Err(format!(
                "--param {n}: no compared spec declares a parameter `{n}`"
            ));
        }
    }
    let mut rows: Vec<Row> = declared
        .iter()
        .map(|(f, names, fixed_v)| one(f, names, *fixed_v, opts))
        .collect();
    // Simulated rows by makespan, then the others in input order.
    rows.sort_by(|a, b| match (&a.figures, &b.figures) {
        (Some(x), Some(y)) => x.makespan.total_cmp(&y.makespan),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    });
    Ok(Report {
        pp: opts.pp,
        mb: opts.mb,
        max_memory: opts.max_memory,
        cost: opts.cost_name.clone(),
        moe: opts.moe.is_some(),
        derived: opts.derive.is_some(),
        moe_list: match opts.moe.as_ref().map(|m| m.interleave()) {
            Some(crate::moe::Interleave::List(k)) => Some(k),
            _ => None,
        },
        moe_adjacent: opts
            .moe
            .as_ref()
            .is_some_and(|m| m.interleave() == crate::moe::Interleave::Adjacent),
        rows,
    })
}

/// A spec by its extension or, for another name, by its content.
fn is_spec(f: &Source, text: &str) -> bool {
    match f {
        Source::Spec { .. } => true,
        Source::File(p) => {
            p.extension().is_some_and(|x| x == "sched") || input::looks_like_spec(text)
        }
    }
}

fn one(f: &Source, declared: &[String], fixed_v: bool, opts: &Options) -> Row {
    let schedule = f.schedule();
    let path = f.path();
    let row = |figures, status| Row {
        schedule: schedule.clone(),
        path: path.clone(),
        figures,
        status,
        notes: Vec::new(),
    };
    let spec = is_spec(f, &f.text());
    let ov = if spec {
        Overrides {
            pp: Some(opts.pp),
            microbatches: Some(opts.mb),
            vpp: if fixed_v { None } else { Some(opts.vpp) },
            params: opts
                .params
                .iter()
                .filter(|(n, _)| declared.contains(n))
                .cloned()
                .collect(),
            moe: opts.moe.clone(),
            placement: None,
            // A `list` block is scheduled under the cost model the rows are simulated with.
            list_cost: Some(opts.cost.clone()),
        }
    } else {
        Overrides {
            moe: opts.moe.clone(),
            ..Default::default()
        }
    };
    let load = |ov: &Overrides| match f {
        Source::File(p) => input::load_path(p, ov),
        Source::Spec { name, text } => input::load_str(&format!("{name}.sched"), text.clone(), ov),
    };
    // With a model, this row's costs: derived for the shape of a quiet first load (a load
    // that fails is reported by the real one below).
    let mut ov = ov;
    let mut derived = None;
    if let Some(d) = &opts.derive {
        let quiet = Overrides {
            list_cost: None,
            moe: None,
            ..ov.clone()
        };
        if let Ok(l) = load(&quiet) {
            match (d.0)(&l.program.pipeline) {
                Ok((dv, cost)) => {
                    if opts.moe.is_some() {
                        if let Err(e) = crate::moe::require_moe_costs(&cost, &opts.cost_name) {
                            return row(None, Status::Error { message: e });
                        }
                    }
                    if spec {
                        ov.list_cost = Some(cost.clone());
                    }
                    derived = Some((dv, cost));
                }
                Err(e) => return row(None, Status::Error { message: e }),
            }
        }
    }
    let loaded = match load(&ov) {
        Ok(l) => l,
        Err(LoadError::Spec {
            diags,
            refused: true,
            ..
        }) => {
            return row(
                None,
                Status::NotApplicable {
                    why: diags.first().map(|d| d.message.clone()).unwrap_or_default(),
                },
            )
        }
        Err(LoadError::Spec { diags, .. }) => {
            let d = diags.first();
            return row(
                None,
                Status::Error {
                    message: d
                        .map(|d| format!("{}: {}", d.code.as_str(), d.message))
                        .unwrap_or_default(),
                },
            );
        }
        Err(LoadError::Parse(e)) => {
            return row(
                None,
                Status::Error {
                    message: format!("syntax error at {}:{}: {}", e.line, e.col, e.message),
                },
            )
        }
        Err(LoadError::Io(m)) | Err(LoadError::Usage(m)) => {
            return row(None, Status::Error { message: m })
        }
    };
    // A spec's `parts` item splits its MoE stages as `--moe` does: it needs all-to-all times
    // from the cost model, as the flag does (the row says why where they are missing).
    let cost = derived.as_ref().map_or(&opts.cost, |d| &d.1);
    if let Err(message) = input::require_part_costs(&loaded, cost, &opts.cost_name) {
        return row(None, Status::Error { message });
    }
    Row {
        notes: loaded.notes.clone(),
        ..judge(&loaded, opts, derived.as_ref(), &row)
    }
}

/// Checks and simulates a loaded input: its row (without notes), built by `row`.
fn judge(
    loaded: &input::Loaded,
    opts: &Options,
    derived: Option<&(crate::costmodel::Derived, CostModel)>,
    row: &dyn Fn(Option<Figures>, Status) -> Row,
) -> Row {
    let mut out = check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
    let pl = &loaded.program.pipeline;
    let model = match derived {
        // Each stage's derived costs already hold its own layers (op_scale 1).
        Some((_, cost)) => cost.for_pipeline(pl),
        None => {
            let mut m = opts.cost.clone();
            m.op_scale = None;
            m.for_pipeline(pl)
        }
    };
    // Under a part reordering, the expectations describe the spec's own order: checked there.
    match &loaded.expect_program {
        Some(before) if out.report.verdict == Verdict::Accepted => check::check_expectations_on(
            &mut out.report,
            before,
            &loaded.spec_expects,
            Some(&model),
        ),
        Some(_) => {}
        None => check::check_expectations(&mut out.report, &loaded.spec_expects),
    }
    let sim = match (&out.checked, out.report.verdict) {
        (Some(prog), _)
            if out
                .report
                .diagnostics
                .iter()
                .all(|d| !d.is_error() || d.code == crate::diag::Code::Expectation) =>
        {
            Some(crate::sim::simulate(prog, &model))
        }
        _ => None,
    };
    if let (Some(Ok(s)), None) = (&sim, &loaded.expect_program) {
        check::check_timing_expectations(&mut out.report, &loaded.spec_expects, Some(s), &model);
    }
    let errors: Vec<_> = out
        .report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .collect();
    let structural = errors
        .iter()
        .find(|d| d.code != crate::diag::Code::Expectation);
    if let Some(d) = structural {
        return row(
            None,
            Status::Rejected {
                code: d.code.as_str().to_string(),
                message: d.message.clone(),
                errors: errors.len(),
            },
        );
    }
    let res = match sim {
        Some(Ok(r)) => r,
        Some(Err(e)) => return row(None, Status::Error { message: e }),
        None => {
            return row(
                None,
                Status::Error {
                    message: "the schedule was not lowered".into(),
                },
            )
        }
    };
    let per_dir = pl.stages_per_direction() as f64;
    let peak = out
        .report
        .ranks
        .iter()
        .map(|r| r.peak_activations)
        .max()
        .unwrap_or(0) as f64
        * pl.pp as f64
        / per_dir;
    let figures = Figures {
        pp: pl.pp,
        microbatches: pl.total_microbatches(),
        makespan: res.makespan,
        bubble: res.bubble,
        bubble_ratio_busy: res.bubble_ratio_busy,
        a2a: res.a2a,
        exposed_comm: res.ranks.iter().map(|r| r.exposed_comm).sum(),
        peak_activations: peak,
        param_copies: pl.directions(),
        stages_per_rank: pl.stages as f64 / pl.pp as f64,
        step: match (derived, &out.checked) {
            (Some((d, _)), Some(prog)) => {
                let st = d.step_report(&prog.pipeline, &res);
                Some(StepFigures {
                    step_seconds: st.step_seconds,
                    tokens_per_second: st.tokens_per_second,
                    tflops_per_gpu: st.tflops_per_gpu,
                    mfu: st.mfu,
                    peak_memory_bytes: st.peak_memory_bytes,
                    fits: st.fits,
                })
            }
            _ => None,
        },
        peak_memory_bytes: opts.max_memory.map(|_| {
            res.ranks
                .iter()
                .map(|r| r.peak_memory_bytes)
                .fold(0.0, f64::max)
        }),
        fits_max_memory: opts.max_memory.map(|cap| {
            res.host_overflows.is_empty()
                && res.ranks.iter().all(|r| r.peak_memory_bytes <= cap as f64)
        }),
    };
    let status = if errors.is_empty() {
        Status::Ok
    } else {
        debug_assert!(out.report.verdict == Verdict::Rejected);
        Status::Expectation {
            failed: errors.iter().map(|d| d.message.clone()).collect(),
        }
    };
    row(Some(figures), status)
}

/// The human table: one line per simulated schedule (bubble under each convention,
/// exposed all-to-all), then the failures and the sizes that do not apply.
pub fn render(r: &Report) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "P = {}, M = {}, cost model `{}`{}{} ({})",
        r.pp,
        r.mb,
        r.cost,
        if r.moe {
            ", --moe (MoE stages split into attention, dispatch, MLP, combine)"
        } else {
            ""
        },
        if r.moe_adjacent {
            ", consecutive independent plain ops interleaved (:adjacent)"
        } else {
            ""
        },
        if r.derived {
            "op times and memory derived per schedule: each stage holds its own layers"
        } else {
            "op times per stage of 1/P of the model; a stage of a V-way split takes 1/V"
        }
    );
    if let Some(k) = r.moe_list {
        let _ = writeln!(
            o,
            "parts ordered by a greedy list schedule under the cost model (:list, at most {k} ops in flight per rank; ops enter it in each rank's input order, weight gradients split and run under all-to-alls)"
        );
    }
    if r.moe_list.is_some() || r.moe_adjacent {
        let _ = writeln!(o, "a spec's `expect` lines describe its own order: they are checked on it with plain --moe, before the parts are reordered");
    }
    let _ = writeln!(
        o,
        "bubble: idle fraction under each convention — from_start (one step, barrier at both ends), per_rank_span (each rank from its first op to its last), steady_state (steps back to back, no barrier)\n"
    );
    // The schedule column is as wide as its longest name with its markers (at least 18), so
    // a long name such as `interleaved_1f1b (!)` does not push its row out of the columns.
    let names: Vec<String> = r
        .rows
        .iter()
        .filter(|row| row.figures.is_some())
        .map(|row| {
            let f = row.figures.as_ref().expect("filtered");
            let mut name = row.schedule.clone();
            if matches!(row.status, Status::Expectation { .. }) {
                name.push_str(" (!)");
            }
            // A fixed-size input (IR, torch CSV, case, trace) keeps its own P and M.
            if f.pp != r.pp || f.microbatches != r.mb {
                name.push_str(" (*)");
            }
            if f.fits_max_memory == Some(false) {
                name.push_str(" (over)");
            }
            name
        })
        .collect();
    let w = names
        .iter()
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(0)
        .max(18);
    let _ = writeln!(
        o,
        "{:<w$} {:>10} {:>11} {:>13} {:>12} {:>13} {:>9} {:>7}",
        "schedule",
        "makespan",
        "from_start",
        "per_rank_span",
        "steady_state",
        "a2a exposed",
        "peak_act",
        "params"
    );
    let _ = writeln!(
        o,
        "{:<w$} {:>10} {:>11} {:>13} {:>12} {:>13} {:>9} {:>7}",
        "", "(s)", "(bubble)", "(bubble)", "(bubble)", "(of a2a)", "(1/P)", ""
    );
    for (row, name) in r
        .rows
        .iter()
        .filter(|row| row.figures.is_some())
        .zip(&names)
    {
        let f = row.figures.as_ref().expect("filtered");
        let a2a = if f.a2a.total > 0.0 {
            format!("{:.1}%", 100.0 * f.a2a.exposed_fraction())
        } else {
            "-".to_string()
        };
        let _ = writeln!(
            o,
            "{:<w$} {:>10.4} {:>10.1}% {:>12.1}% {:>11.1}% {:>13} {:>9.1} {:>6}x",
            name,
            f.makespan,
            100.0 * f.bubble.from_start,
            100.0 * f.bubble.per_rank_span,
            100.0 * f.bubble.steady_state,
            a2a,
            f.peak_activations,
            f.param_copies
        );
    }
    if r.derived {
        let _ = writeln!(
            o,
            "\n{:<w$} {:>10} {:>12} {:>9} {:>7} {:>10} {:>5}",
            "schedule", "step (s)", "tokens/s", "TFLOP/s", "MFU", "mem (GB)", "fits"
        );
        for (row, name) in r
            .rows
            .iter()
            .filter(|row| row.figures.is_some())
            .zip(&names)
        {
            if let Some(st) = row.figures.as_ref().and_then(|f| f.step.as_ref()) {
                let _ = writeln!(
                    o,
                    "{:<w$} {:>10.4} {:>12.0} {:>9.1} {:>6.1}% {:>10.1} {:>5}",
                    name,
                    st.step_seconds,
                    st.tokens_per_second,
                    st.tflops_per_gpu,
                    100.0 * st.mfu,
                    st.peak_memory_bytes / 1e9,
                    if st.fits { "yes" } else { "no" }
                );
            }
        }
    }
    if let Some(cap) = r.max_memory {
        let over: Vec<String> = r
            .rows
            .iter()
            .filter_map(|x| {
                let f = x.figures.as_ref()?;
                (f.fits_max_memory == Some(false)).then(|| {
                    format!(
                        "{} ({:.2} GB)",
                        x.schedule,
                        f.peak_memory_bytes.unwrap_or(0.0) / 1e9
                    )
                })
            })
            .collect();
        let _ = writeln!(
            o,
            "\n(over) over --max-memory {cap} bytes ({:.2} GB) per rank (simulated peak device memory, or [memory] host_bytes overflowed): {}",
            cap as f64 / 1e9,
            if over.is_empty() {
                "none".to_string()
            } else {
                over.join(", ")
            }
        );
    }
    let other: Vec<String> = r
        .rows
        .iter()
        .filter_map(|x| {
            let f = x.figures.as_ref()?;
            (f.pp != r.pp || f.microbatches != r.mb)
                .then(|| format!("{} is P = {}, M = {}", x.schedule, f.pp, f.microbatches))
        })
        .collect();
    if !other.is_empty() {
        let _ = writeln!(
            o,
            "\n(*) not at the size asked, a fixed-size input: {}; its figures are not comparable with the others'",
            other.join("; ")
        );
    }
    let failed: Vec<&Row> = r
        .rows
        .iter()
        .filter(|x| {
            matches!(
                x.status,
                Status::Rejected { .. } | Status::Expectation { .. } | Status::Error { .. }
            )
        })
        .collect();
    if !failed.is_empty() {
        let _ = writeln!(o, "\nfailed:");
        for x in failed {
            match &x.status {
                Status::Rejected {
                    code,
                    message,
                    errors,
                } => {
                    let _ = writeln!(
                        o,
                        "  {}: rejected by `schedc check` ({errors} error(s)), first: [{code}] {message}",
                        x.schedule
                    );
                }
                Status::Expectation { failed } => {
                    for m in failed {
                        let _ = writeln!(o, "  {} (!): expectation fails: {m}", x.schedule);
                    }
                }
                Status::Error { message } => {
                    let _ = writeln!(o, "  {}: {message}", x.schedule);
                }
                _ => {}
            }
        }
    }
    let na: Vec<&Row> = r
        .rows
        .iter()
        .filter(|x| matches!(x.status, Status::NotApplicable { .. }))
        .collect();
    if !na.is_empty() {
        let _ = writeln!(
            o,
            "\nnot applicable at this size (refused by the spec's `require`):"
        );
        for x in na {
            if let Status::NotApplicable { why } = &x.status {
                let _ = writeln!(o, "  {}: {why}", x.schedule);
            }
        }
    }
    o
}
