//! `schedc optimize`: search for a shorter schedule under an activation cap.

use crate::common::*;
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use schedc::input::PlacementArg;
use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind, Program};
use schedc_optimize::report::{cap_for, evaluate_timed, load_specs_noting, scale_of, Row};
use schedc_optimize::search::{optimize_placements, Options, Outcome};
use schedc_optimize::{verify, Instance, Sched};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// What the search minimises.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Objective {
    /// Makespan from time 0, when every rank may start.
    #[value(name = "from_start", alias = "from-start")]
    FromStart,
    /// The step time when steps run back to back (the simulator's steady-state convention):
    /// the search's result and every starting schedule within the cap (the input, the specs
    /// of this placement) are ranked by it, ties broken by the from-start makespan.
    #[value(name = "steady_state", alias = "steady-state")]
    SteadyState,
}

/// When to run branch and bound.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum ExactMode {
    /// On instances of at most 150 ops.
    Auto,
    /// Always (it may not finish: the node budget then stops it).
    On,
    /// Never.
    Off,
}

/// The output's form.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum OutKind {
    /// IR text of the lowered program (sends and receives in place).
    IrText,
    /// A `.sched` spec in `schedc fmt`'s form: a family in M (P fixed) when the found order
    /// has a periodic steady state, checked before it is written; else the lowered program
    /// (sends, receives, channels) in a `literal { }` block for this P and M. The report says
    /// which.
    Spec,
    /// PyTorch's compute_only CSV (torch's `I` is our B, its `B` our BW). It carries the
    /// ops' order only: `schedc sim` re-inserts the messages, and the report gives the
    /// makespan that gives.
    TorchCsv,
}

/// `schedc optimize`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The starting schedule (a spec, IR text or JSON, torch CSV, a DualPipe trace); its
    /// placement is kept. Without it: the standard placements (loop with one stage per
    /// rank, V with two, interleaved loop with two) unless --placement or --vpp picks one.
    pub input: Option<String>,
    /// Pipeline ranks P (a spec's instance, or the pipeline to search without input).
    #[arg(long, value_name = "P")]
    pub pp: Option<u32>,
    /// Micro-batches M.
    #[arg(long = "mb", value_name = "M")]
    pub mb: Option<u32>,
    /// Virtual stages per rank V.
    #[arg(long, value_name = "V")]
    pub vpp: Option<u32>,
    /// A spec parameter, NAME=VALUE (repeatable).
    #[arg(long = "param", value_name = "NAME=VALUE", value_parser = parse_param)]
    pub params: Vec<(String, i64)>,
    /// Placement: loop, v, bidir, or a list such as 0,1,1,0.
    #[arg(long, value_name = "PLACEMENT")]
    pub placement: Option<PlacementArg>,
    /// Cost model: a preset (unit, dualpipe-readme, dsv3-h800), a TOML file, or inline
    /// overrides such as F=1,B=1.1,W=0.9,latency=0.05. Times are for a stage of 1/P of the
    /// model, as `schedc sim` charges them: a stage of a V-way split takes 1/V of them (the
    /// message latency is per message), so every figure reported is what `schedc sim` gives.
    #[arg(long, value_name = "FILE|PRESET|K=V,...", default_value = "unit")]
    pub cost: String,
    /// Further inline overrides applied on top of --cost.
    #[arg(long = "set", value_name = "K=V,...")]
    pub set: Option<String>,
    /// Derive the op times from a model, a GPU and a layout (`schedc sim --model`'s options)
    /// for the input's stages; needs an input. Rows of other shapes (specs, the greedy) are
    /// not compared under it.
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
    /// Most live activations per rank, in stages of the input (one stage per rank without
    /// input; a V schedule's half stages count half). The report's `written` line gives the
    /// cap `schedc check --max-activations` takes on the file, in its own stages.
    #[arg(long, value_name = "N")]
    pub max_activations: u64,
    /// Most device bytes per rank (`80G`, `80GB`, `80GiB` are 80 x 2^30 bytes): the
    /// simulated `peak_memory_bytes` that `schedc check --max-memory` and `schedc sim
    /// --max-memory` bound. Needs a cost model with memory sizes (`[memory]`, `--set
    /// activation_bytes=...`, or `--model`). Where the schedule found exceeds it, activations
    /// are offloaded (OFFLOAD after the forward, RELOAD just in time before the backward) or
    /// recomputed (`F(s,m)!`, RECOMPUTE before the backward), chosen by simulated makespan
    /// (`schedc_optimize::memops`); rows over the cap are marked. Not with --moe or --to
    /// torch-csv.
    #[arg(long, value_name = "BYTES", value_parser = parse_max_memory)]
    pub max_memory: Option<u64>,
    /// What to minimise.
    #[arg(long, value_enum, default_value = "from_start")]
    pub objective: Objective,
    /// Stop after this many seconds: loading the specs (at most half), the search, and the
    /// rows still to simulate count; the best schedule so far is reported. `inf`, or a
    /// value too large for the clock (1e19), is no limit.
    #[arg(long, value_name = "SECONDS")]
    pub time_limit: Option<f64>,
    /// Seed of the search's random choices (same input and seed, same output).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Scales every evaluation budget (0.1 quick, 1 default, 10 thorough; at most 1000
    /// without --time-limit).
    #[arg(long, default_value_t = 1.0)]
    pub effort: f64,
    /// Branch and bound: on small instances (auto; never under --heuristic), always, or never.
    #[arg(long, value_enum, default_value = "auto")]
    pub exact: ExactMode,
    /// Heuristic mode for very large instances: list scheduling and the greedy only (no
    /// branch and bound unless `--exact on`).
    #[arg(long)]
    pub heuristic: bool,
    /// Write the schedule here (default: not written; `-` for standard output).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<String>,
    /// Form of the written schedule.
    #[arg(long, value_enum, default_value = "ir-text")]
    pub to: OutKind,
    /// Overwrite an existing output file.
    #[arg(long)]
    pub force: bool,
    /// Report format.
    #[arg(long, value_enum, default_value = "human")]
    pub format: OutFormat,
    /// Where the specs to compare with are.
    #[arg(long, default_value = "specs")]
    pub specs: String,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Score with the ops of the MoE stages split into attention, dispatch, MLP and combine
    /// parts (all-to-alls on the expert-parallel stream; the cost model needs `[moe]`). The
    /// search runs on a whole-op proxy (`schedc_optimize::report::moe_proxy`); its result
    /// and every start within the cap are then ranked, and every row reported, by the split
    /// simulation, in plain `--moe`'s part order. STAGES as for `check --moe`, without a
    /// `:adjacent` or `:list` suffix (refused).
    #[arg(long, value_name = "STAGES", num_args = 0..=1, default_missing_value = "auto", require_equals = true)]
    pub moe: Option<schedc::moe::MoeStages>,
}

/// The largest `--effort` accepted without `--time-limit`: the budgets scale with it, and
/// beyond this the search would not end in any useful time.
pub const MAX_EFFORT_WITHOUT_LIMIT: f64 = 1000.0;

/// The instant `--time-limit` ends, counted from `start`. `None` without a limit, and for
/// a limit too large to be a deadline (`inf`, `1e19`: beyond what the clock can add, which
/// is hundreds of years): no limit then, as the book says.
///
/// Errors: a limit that is 0, negative or not a number.
pub fn time_limit_deadline(limit: Option<f64>, start: Instant) -> Result<Option<Instant>, String> {
    let Some(t) = limit else {
        return Ok(None);
    };
    if t.is_nan() || t <= 0.0 {
        return Err(format!(
            "--time-limit must be a positive number of seconds, got {t}"
        ));
    }
    Ok(Duration::try_from_secs_f64(t)
        .ok()
        .and_then(|d| start.checked_add(d)))
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {msg}");
    ExitCode::from(2)
}

/// A pipeline's placement and V, as the report names it (`v V=2`).
fn pipeline_label(pl: &Pipeline) -> String {
    schedc_optimize::report::placement_label(pl)
}

/// The smallest `--max-activations` (user units) that [`cap_for`] turns into at least `min`
/// of the pipeline's own activations, where one of them is `scale` of a user-unit stage.
fn min_cap_in_user_units(min: u64, scale: f64) -> u64 {
    (min as f64 * scale - 1e-9).ceil().max(0.0) as u64
}

/// The error for a cap below a placement's minimum, in the user's units: `need` user-unit
/// activations, `min` of the pipeline's own stages on `rank`, each `scale` of a user-unit
/// stage.
fn cap_below_minimum(
    given: u64,
    need: u64,
    min: u64,
    rank: u32,
    scale: f64,
    input: bool,
) -> String {
    if (scale - 1.0).abs() < 1e-12 {
        return schedc_optimize::ProblemError::CapBelowMinimum {
            cap: given,
            min,
            rank,
        }
        .to_string();
    }
    let units = if input {
        "the input"
    } else {
        "one stage per rank"
    };
    format!(
        "--max-activations {given} is below the minimum any schedule on this placement needs: {need} (stage units of {units}): rank {rank} holds {min} virtual stages of one direction, {scale} of a stage each, that one micro-batch passes through before its first backward"
    )
}

/// The report's word on optimality: nothing, `optimal` when the makespan meets the lower
/// bound, and the reason when branch and bound proved it above the bound (a bare `lower
/// bound 15, optimal` next to a makespan of 21.5 reads as a contradiction). When a listed
/// row within the cap ranks first (`faster`: a spec of a placement not searched), the
/// proof covers only the placements searched, and the report says so and names the row.
fn optimality(out: &Outcome, faster: &[&Row], searched: &[String]) -> String {
    if !out.optimal {
        String::new()
    } else if let Some(r) = faster.iter().find(|r| searched.contains(&r.placement)) {
        // A faster schedule on a placement searched: it uses what the search does not model
        // (offloads, lent stashes, its own message order), so the proof says nothing.
        format!(
            ", not optimal: faster in the table: {} [{}] at {} (the search does not model its memory ops or message order)",
            r.name,
            r.placement,
            secs(r.makespan)
        )
    } else if let Some(r) = faster.first() {
        format!(
            ", optimal on the placements searched ({}); faster in the table: {} [{}] at {}",
            searched.join(", "),
            r.name,
            r.placement,
            secs(r.makespan)
        )
    } else if out.makespan <= out.lower_bound + 1e-9 {
        ", optimal".into()
    } else {
        ", optimal: branch and bound proved no schedule on this placement is shorter".into()
    }
}

/// One pipeline to search, with its cost, cap and starting schedules.
struct Candidate {
    pipeline: Pipeline,
    inst: Instance,
    /// The cost the search and `verify` use (the `--moe` proxy under `--moe`), scaled.
    cost: CostModel,
    /// The cost model as given, scaled (for the `--moe` simulation).
    real_cost: CostModel,
    starts: Vec<(String, Sched)>,
    scale: f64,
}

/// Runs `schedc optimize`.
pub fn run(a: Args) -> ExitCode {
    // Every phase counts against --time-limit from here: loading the specs, the search,
    // verifying and simulating the rows (the book's "Determinism, time limit, progress").
    let t_start = Instant::now();
    let deadline = match time_limit_deadline(a.time_limit, t_start) {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    if !(a.effort.is_finite() && a.effort > 0.0) {
        return fail(format!("--effort must be positive, got {}", a.effort));
    }
    if a.effort > MAX_EFFORT_WITHOUT_LIMIT && deadline.is_none() {
        return fail(format!(
            "--effort {:e} without --time-limit would run for days: at most {MAX_EFFORT_WITHOUT_LIMIT} (10 is thorough), or give --time-limit SECONDS to bound it",
            a.effort
        ));
    }
    if a.vpp == Some(0) {
        return fail("--vpp must be at least 1 (virtual stages per rank)");
    }
    match (&a.placement, a.vpp) {
        (Some(PlacementArg::Kind(PlacementKind::Bidir)), Some(v)) if v != 2 => {
            return fail(format!(
                "--placement bidir has two stages per rank (one per direction); --vpp {v} does not apply (drop it, or give --vpp 2)"
            ));
        }
        (Some(PlacementArg::Map(m)), Some(v)) if a.input.is_none() => {
            return fail(format!(
                "--vpp {v} does not apply to a --placement list: its {} entries are the stages",
                m.len()
            ));
        }
        _ => {}
    }
    let mut cost = match CostModel::resolve(&a.cost) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if let Some(kv) = &a.set {
        if let Err(e) = cost.apply_overrides(kv) {
            return fail(e);
        }
    }
    if !schedc_optimize::instance::has_times(&cost) {
        return fail(schedc_optimize::ProblemError::NoTimes);
    }
    // The search and its report simulate the parts in plain `--moe`'s order; a `:list` or
    // `:adjacent` suffix was silently ignored.
    if let Some(sel) = &a.moe {
        if sel.interleave() != schedc::moe::Interleave::None {
            return fail(
                "optimize simulates the MoE parts in plain `--moe`'s order; `:adjacent`, `:list` and `:listN` are not supported here. Give the stages only (e.g. --moe=all), then order the result's parts with `schedc sim OUT --moe=STAGES:list --cost ...`",
            );
        }
    }
    if let Err(e) = a.cluster.check_without_model() {
        return fail(e);
    }
    if a.cluster.given() {
        if a.input.is_none() {
            return fail(
                "--model derives the op times for the input's stages: give an input schedule (without one, the placements searched have different stages, each needing its own costs)",
            );
        }
        if a.cost != "unit" {
            return fail(
                "give --cost or --model, not both (--set K=V overrides what --model derives)",
            );
        }
    }
    if a.moe.is_some() && !a.cluster.given() {
        if let Err(e) = schedc::moe::require_moe_costs(&cost, &a.cost) {
            return fail(e);
        }
    }
    if a.max_memory.is_some() {
        if a.moe.is_some() {
            return fail(
                "--max-memory places offloads and recomputes on whole ops; with --moe the MoE parts are not supported yet: drop one of them",
            );
        }
        if a.output.is_some() && a.to == OutKind::TorchCsv {
            return fail(
                "--max-memory may add OFFLOAD, RELOAD and RECOMPUTE, which torch's schedule CSV cannot express: write --to ir-text or --to spec",
            );
        }
    }
    if let Some(o) = &a.output {
        if o == "-" && a.format == OutFormat::Json {
            return fail(
                "`-o -` and `--format json` would both write to standard output (the schedule, then the report), which no JSON reader accepts: write the schedule to a file with -o FILE",
            );
        }
        // An existing file, a missing or unwritable directory: refused before the search.
        if let Err(c) = check_output(std::path::Path::new(o), a.force) {
            return c;
        }
    }

    // The pipelines to search and their starting schedules; the input's own program (its
    // messages as written), for its row.
    let mut start: Option<(Pipeline, Sched)> = None;
    let mut input_program: Option<Program> = None;
    let (ref_stages, pipelines, pp, mb): (u32, Vec<Pipeline>, u32, u32) = match &a.input {
        Some(input) => {
            let args = InputArgs {
                input: input.into(),
                mb: a.mb.map(RangeArg::one),
                pp: a.pp.map(RangeArg::one),
                vpp: a.vpp.map(RangeArg::one),
                params: a.params.clone(),
                placement: a.placement.clone(),
                moe: None,
            };
            // A spec's `list` block ordered under the cost, as `schedc sim --cost` orders it.
            let list_cost = (!a.cluster.given()).then_some(&cost);
            let loaded = match load_keeping_parts(&args, Some(Work::Check), list_cost) {
                Ok(l) => l,
                Err(f) => return f.code(),
            };
            if loaded.moe.is_some() {
                // Loaded without `--moe`: the spec's own `parts` item split its MoE stages.
                let item = loaded
                    .parts_item
                    .clone()
                    .unwrap_or_else(|| format!("{input}: its `parts` item"));
                return fail(format!(
                    "{item}: the spec's `parts` item splits its MoE stages into parts, and the search orders whole ops{}: give the spec without the item{}",
                    if a.moe.is_some() {
                        " (the item is the spec's part order; --moe does not replace it here)"
                    } else {
                        ""
                    },
                    if a.moe.is_some() {
                        ", keeping --moe (the search scores the parts with it)"
                    } else {
                        " (add --moe[=STAGES] to score with the MoE parts)"
                    }
                ));
            }
            let p: Program = loaded.program;
            let sc = match Sched::from_program(&p) {
                Ok(s) => s,
                Err(e) => return fail(format!("{input}: {e}")),
            };
            let pl = p.pipeline.clone();
            start = Some((pl.clone(), sc));
            input_program = Some(p);
            (
                pl.stages_per_direction(),
                vec![pl.clone()],
                pl.pp,
                pl.total_microbatches(),
            )
        }
        None => {
            let (Some(pp), Some(mb)) = (a.pp, a.mb) else {
                return fail("without an input schedule, --pp and --mb are required");
            };
            if pp == 0 || mb == 0 {
                return fail("--pp and --mb must be at least 1");
            }
            let mut v = Vec::new();
            let make = |kind: &PlacementArg, vpp: u32| -> Result<Pipeline, String> {
                match kind {
                    PlacementArg::Kind(k) => {
                        let stages = if *k == PlacementKind::Bidir {
                            2 * pp
                        } else {
                            pp * vpp
                        };
                        let m = if *k == PlacementKind::Bidir {
                            if mb % 2 != 0 {
                                return Err(
                                    "a bidirectional placement needs an even --mb".to_string()
                                );
                            }
                            mb / 2
                        } else {
                            mb
                        };
                        Pipeline::new(pp, stages, m, *k).map_err(|e| e.to_string())
                    }
                    PlacementArg::Map(map) => {
                        // A rank with no stage has nothing to schedule: the search would
                        // report a pipeline of P ranks that runs on fewer.
                        if let Some(r) = (0..pp).find(|r| !map.contains(r)) {
                            return Err(format!(
                                "--placement {}: rank {r} holds no stage (--pp {pp}); give every rank at least one stage, or a smaller --pp",
                                map.iter()
                                    .map(|r| r.to_string())
                                    .collect::<Vec<_>>()
                                    .join(",")
                            ));
                        }
                        Pipeline::explicit(pp, mb, map.clone()).map_err(|e| e.to_string())
                    }
                }
            };
            match (&a.placement, a.vpp) {
                (None, None) => {
                    v = schedc_optimize::search::default_pipelines(pp, mb);
                    if v.is_empty() {
                        return fail(format!("no placement exists for --pp {pp} --mb {mb}"));
                    }
                }
                (pl, vpp) => {
                    let kind = pl
                        .clone()
                        .unwrap_or(PlacementArg::Kind(PlacementKind::Loop));
                    // The V placement is two stages per rank (one down, one back); V = 1
                    // would be the loop placement under another name.
                    let v_default = match kind {
                        PlacementArg::Kind(PlacementKind::V) => 2,
                        _ => 1,
                    };
                    match make(&kind, vpp.unwrap_or(v_default)) {
                        Ok(p) => v.push(p),
                        Err(e) => return fail(e),
                    }
                }
            }
            (pp, v, pp, mb)
        }
    };

    // With --model: the costs of the input's stages (the one pipeline searched).
    let mut gpu_memory: Option<(f64, f64)> = None;
    if a.cluster.given() {
        let sc = match a.cluster.scenario(&pipelines[0]) {
            Ok(sc) => sc,
            Err(e) => return fail(e),
        };
        gpu_memory = Some((sc.derived.gpu_memory, sc.derived.overhead_bytes));
        cost = sc.cost;
        if let Some(kv) = &a.set {
            if let Err(e) = cost.apply_overrides_everywhere(kv) {
                return fail(e);
            }
        }
        if a.moe.is_some() {
            if let Err(e) = schedc::moe::require_moe_costs(&cost, "derived from --model") {
                return fail(e);
            }
        }
    }
    if a.max_memory.is_some() {
        if let Err(e) = require_memory_sizes(&cost) {
            return fail(e);
        }
    }
    let model_shape =
        |pl: &Pipeline| !a.cluster.given() || pl.stage_to_rank == pipelines[0].stage_to_rank;
    // Specs of the standard library at this size (V = 2 for those whose V is free).
    if !std::path::Path::new(&a.specs).is_dir() {
        eprintln!(
            "note: `{}` is not a directory: no spec is compared (--specs DIR names the specs; the default `specs` is relative to the current directory)",
            a.specs
        );
    }
    // Without an input nothing has been sized yet: refuse an instance over the memory limit
    // before elaborating the specs at this size (as `check` does before elaborating one).
    if a.input.is_none() {
        for pl in &pipelines {
            let size = schedc::limits::Size {
                ranks: pl.pp as u64,
                stages: pl.stages as u64,
                microbatches: pl.total_microbatches() as u64,
                compute_ops: 2 * pl.stages as u64 * pl.microbatches as u64,
                comm_ops: 0,
            };
            if let Err(e) = schedc::limits::within_limit(
                &format!(
                    "the instance --pp {pp} --mb {mb} ({}, {} stages)",
                    pipeline_label(pl),
                    pl.stages
                ),
                schedc::limits::estimate(Work::Check, &size),
            ) {
                return fail(e);
            }
        }
    }
    // Loading the specs gets at most half of --time-limit; those not elaborated by then are
    // named in a note and not compared.
    let spec_deadline = deadline.map(|d| t_start + (d - t_start) / 2);
    let loaded_specs = load_specs_noting(std::path::Path::new(&a.specs), pp, mb, 2, spec_deadline);
    for n in &loaded_specs.notes {
        eprintln!("note: {n}");
    }
    let specs = loaded_specs.specs;
    let mut candidates = Vec::new();
    // The smallest minimum cap (user units) among placements skipped for a cap below it.
    let mut below: Option<(u64, String)> = None;
    for pl in &pipelines {
        // Times as `schedc sim` charges the file written: a stage of a V-way split 1/V.
        let real_cost = cost.for_pipeline(pl);
        let c = match &a.moe {
            Some(sel) => match sel.resolve(pl) {
                Ok(st) => schedc_optimize::report::moe_proxy(&cost, &st).for_pipeline(pl),
                Err(e) => return fail(e),
            },
            None => real_cost.clone(),
        };
        let cap = cap_for(a.max_activations, ref_stages, pl);
        let inst = match Instance::new(pl, &c, Some(cap)) {
            Ok(i) => i,
            Err(schedc_optimize::ProblemError::CapBelowMinimum { min, rank, .. }) => {
                let need = min_cap_in_user_units(min, scale_of(ref_stages, pl));
                if pipelines.len() > 1 {
                    let label = pipeline_label(pl);
                    if below.as_ref().is_none_or(|(n, _)| need < *n) {
                        below = Some((need, label));
                    }
                    continue;
                }
                return fail(cap_below_minimum(
                    a.max_activations,
                    need,
                    min,
                    rank,
                    scale_of(ref_stages, pl),
                    a.input.is_some(),
                ));
            }
            Err(e) => return fail(e),
        };
        let mut starts = Vec::new();
        if let Some((spl, sc)) = &start {
            if spl == pl {
                starts.push(("the input".to_string(), sc.clone()));
            }
        }
        for s in &specs {
            if s.pipeline == *pl {
                starts.push((format!("spec {}", s.name), s.sched.clone()));
            }
        }
        // Under --max-memory the byte cap may bind on any order: the search also runs under
        // up to three lower activation caps (steps of a quarter of the cap), whose orders
        // need fewer memory ops; every result is fitted and the fastest kept.
        let mut lower = Vec::new();
        if a.max_memory.is_some() {
            let step = (cap / 4).max(1);
            for j in 1..=3u64 {
                let Some(k) = cap.checked_sub(j * step).filter(|k| *k >= 1) else {
                    break;
                };
                match Instance::new(pl, &c, Some(k)) {
                    Ok(i) => lower.push(i),
                    Err(_) => break,
                }
            }
        }
        for inst in std::iter::once(inst).chain(lower) {
            candidates.push(Candidate {
                pipeline: pl.clone(),
                inst,
                cost: c.clone(),
                real_cost: real_cost.clone(),
                starts: starts.clone(),
                scale: scale_of(ref_stages, pl),
            });
        }
    }
    if candidates.is_empty() {
        let (need, label) = below.unwrap_or((0, String::new()));
        return fail(format!(
            "--max-activations {} is below the minimum of every placement tried; the smallest is {need} ({label}), in stage units of one stage per rank",
            a.max_activations
        ));
    }

    // Search.
    let show = !a.no_progress && a.format == OutFormat::Human && std::io::stderr().is_terminal();
    let bar = if show {
        let b = ProgressBar::new_spinner();
        b.set_style(ProgressStyle::with_template("{spinner} [{elapsed}] {msg}").unwrap());
        b.enable_steady_tick(Duration::from_millis(120));
        b
    } else {
        ProgressBar::hidden()
    };
    let opts = Options {
        seed: a.seed,
        // What is left of --time-limit after loading the specs.
        time_limit: deadline.map(|d| d.saturating_duration_since(Instant::now())),
        effort: a.effort,
        exact_max_ops: match a.exact {
            // --heuristic is list scheduling and the greedy only: branch and bound only when
            // asked for by name.
            ExactMode::Auto if a.heuristic => 0,
            ExactMode::Auto => schedc_optimize::search::AUTO_EXACT_MAX_OPS,
            ExactMode::On => usize::MAX,
            ExactMode::Off => 0,
        },
        construct_only: a.heuristic,
        ..Options::default()
    };
    // Every placement under one time limit and one shared evaluation budget, the cheap
    // constructions first; under the from-start objective without --moe a placement whose
    // lower bound cannot beat the best found skips the expensive phases
    // (`schedc_optimize::search::optimize_placements`).
    let labels: Vec<String> = candidates
        .iter()
        .map(|c| pipeline_label(&c.pipeline))
        .collect();
    let progress = |i: usize, p: &schedc_optimize::Progress| {
        bar.set_message(format!(
            "{}: {}: best makespan {:.4} (lower bound {:.4})",
            labels[i], p.phase, p.best, p.lower_bound
        ));
    };
    let problems: Vec<(&Instance, &[(String, Sched)])> = candidates
        .iter()
        .map(|c| (&c.inst, c.starts.as_slice()))
        .collect();
    // Under --max-memory the memory ops change the makespans: no placement is pruned by a
    // bound on orders without them.
    let prune = a.objective == Objective::FromStart && a.moe.is_none() && a.max_memory.is_none();
    let mut results: Vec<(usize, Outcome)> =
        optimize_placements(&problems, &opts, prune, &progress)
            .into_iter()
            .enumerate()
            .collect();
    bar.finish_and_clear();
    // Under the from-start makespan (no --moe) the evaluator's makespan is the simulator's:
    // verify the placements' results shortest first and stop once the rest cannot win
    // (each verification is a check and a simulation: 0.6 s at P = 64, M = 512).
    if prune {
        results.sort_by(|x, y| x.1.makespan.total_cmp(&y.1.makespan).then(x.0.cmp(&y.0)));
    }

    // The best verified result: by from-start makespan, or under `steady_state` by the
    // steady-state step over the search's results and every start within the cap.
    // Under --moe the scores come from the split simulation.
    let steady = a.objective == Objective::SteadyState;
    let key = |s: &schedc::sim::SimResult| {
        if steady {
            (s.steady_step, s.makespan)
        } else {
            (s.makespan, 0.0)
        }
    };
    let better = |s: &schedc::sim::SimResult, b: &schedc::sim::SimResult| {
        let (k, kb) = (key(s), key(b));
        k.0 < kb.0 - 1e-9 || (k.0 <= kb.0 + 1e-9 && k.1 < kb.1 - 1e-9)
    };
    type Best = (
        usize,
        Outcome,
        schedc_optimize::Verified,
        schedc::sim::SimResult,
        Option<(usize, usize)>,
    );
    let mut best: Option<Best> = None;
    // Under --max-memory: why the search's own result could not be fitted (reported when no
    // candidate fits).
    let mut unfitted: Option<String> = None;
    for (i, out) in results {
        let c = &candidates[i];
        if !out.makespan.is_finite() {
            continue;
        }
        // Under --max-memory the memory ops change the makespans: no early stop.
        if prune
            && a.max_memory.is_none()
            && best
                .as_ref()
                .is_some_and(|b| out.makespan > b.3.makespan + 1e-9)
        {
            break;
        }
        let mut tries = vec![out.clone()];
        if steady || a.moe.is_some() || a.max_memory.is_some() {
            for (name, sc) in &c.starts {
                tries.push(Outcome {
                    best: sc.clone(),
                    found_by: format!(
                        "{name} (ranked by the {}{})",
                        if a.moe.is_some() { "--moe " } else { "" },
                        if steady {
                            "steady-state step"
                        } else {
                            "makespan"
                        }
                    ),
                    optimal: false,
                    ..out.clone()
                });
            }
        }
        for (k, mut t) in tries.into_iter().enumerate() {
            match verify(&c.inst, &c.cost, &t.best) {
                Ok(mut v) => {
                    let mut s = match &a.moe {
                        Some(sel) => {
                            match schedc_optimize::report::simulate_moe(&v, &c.real_cost, sel) {
                                Ok(s) => s,
                                Err(e) => {
                                    eprintln!("error: the --moe simulation fails: {e}");
                                    return ExitCode::from(1);
                                }
                            }
                        }
                        None => v.sim.clone(),
                    };
                    // Under --max-memory: offloads and recomputes where the order exceeds
                    // the byte cap (`schedc_optimize::memops`), then checked and simulated
                    // again as `schedc sim` does; each candidate is ranked as fitted.
                    let mut ops = None;
                    if let Some(bytes) = a.max_memory {
                        match fit_to_bytes(&v, &cost, bytes, c.inst.cap, deadline) {
                            Ok(None) => {}
                            Ok(Some((fv, fs, counts))) => {
                                let (off, rec) = counts;
                                t.found_by = format!(
                                    "{}, then {off} activation(s) offloaded and {rec} recomputed to fit --max-memory",
                                    t.found_by
                                );
                                // The search's proof is on orders without memory ops.
                                t.optimal = false;
                                v = fv;
                                s = fs;
                                ops = Some(counts);
                            }
                            Err(e) => {
                                if k == 0 && unfitted.is_none() {
                                    unfitted = Some(e);
                                }
                                continue;
                            }
                        }
                    }
                    if best.as_ref().is_none_or(|(.., bs, _)| better(&s, bs)) {
                        best = Some((i, t, v, s, ops));
                    }
                }
                // A start over the cap is no candidate; the search's own result must verify.
                Err(_) if k > 0 => {}
                Err(e) => {
                    eprintln!("error: the schedule found does not verify: {e}");
                    return ExitCode::from(1);
                }
            }
        }
    }
    let Some((ci, out, ver, ver_sim, memory_ops)) = best else {
        match unfitted {
            Some(e) => eprintln!("error: {e}"),
            None => eprintln!("error: no schedule within the cap was found"),
        }
        return ExitCode::from(1);
    };
    let cand = &candidates[ci];
    let cap = a.max_activations;
    let over_bytes = |r: &Row| a.max_memory.is_some_and(|b| r.peak_memory_bytes > b as f64);
    let mut opt_row =
        schedc_optimize::report::row_with("optimized", &ver, &ver_sim, cand.scale, cap);
    opt_row.fits &= !over_bytes(&opt_row);

    // Under --moe on a V placement: the lower bound on the per-rank span (rank 0's warmup
    // and cooldown must expose all-to-all; schedc_optimize::moe_bound).
    let moe_bound = a.moe.as_ref().and_then(|_| {
        schedc_optimize::moe_bound::v_span_bound(&cand.pipeline, &cand.real_cost, cand.inst.cap)
    });

    // Rows to compare with, each only while --time-limit has time left (the rest are named
    // in a note).
    let past = || deadline.is_some_and(|d| Instant::now() >= d);
    let mut not_simulated: Vec<String> = Vec::new();
    let mut rows: Vec<Row> = vec![opt_row.clone()];
    if let Some(p) = &input_program {
        // The input as `schedc sim` gives it under the same flags: its own program, messages
        // as written (not the search's re-lowering of its op order).
        match simulate_as_sim(p, &cost, a.moe.as_ref()) {
            Ok((sim, peak)) => {
                let mut r = schedc_optimize::report::row_of_sim(
                    "start (the input)",
                    &p.pipeline,
                    &sim,
                    peak,
                    scale_of(ref_stages, &p.pipeline),
                    cap,
                );
                r.fits &= !over_bytes(&r);
                rows.push(r);
            }
            Err(e) => eprintln!("note: the input does not simulate: {e}"),
        }
    }
    let greedy_pl = Pipeline::new(pp, pp, mb, PlacementKind::Loop).ok();
    let mut greedy_row = None;
    if let Some(gpl) = greedy_pl.as_ref().filter(|g| model_shape(g)) {
        let c = cost.for_pipeline(gpl);
        if past() {
            not_simulated.push("greedy".into());
        } else if let Ok(gi) = Instance::new(gpl, &c, Some(cap_for(cap, ref_stages, gpl))) {
            if let Ok(g) = schedc_optimize::greedy::zero_bubble_greedy(&gi) {
                if let Ok((r, _)) = evaluate_timed(
                    "greedy (Zero Bubble, best of 8)",
                    gpl,
                    &g.sched,
                    &c,
                    scale_of(ref_stages, gpl),
                    cap,
                    a.moe.as_ref(),
                ) {
                    let mut r = r;
                    r.fits &= !over_bytes(&r);
                    greedy_row = Some(r.clone());
                    rows.push(r);
                }
            }
        }
    }
    let mut spec_rows = Vec::new();
    let mut other_shape = Vec::new();
    for s in &specs {
        if !model_shape(&s.pipeline) {
            other_shape.push(s.name.clone());
            continue;
        }
        if past() {
            not_simulated.push(format!("spec {}", s.name));
            continue;
        }
        // The spec as `schedc sim` gives it under the same flags: its own messages, memory
        // ops and lent stashes, its `list` block ordered under the cost, `check`'s peak.
        let list_cost = (!a.cluster.given()).then_some(&cost);
        let Ok(p) = s.program_under(list_cost) else {
            continue;
        };
        if let Ok((sim, peak)) = simulate_as_sim(&p, &cost, a.moe.as_ref()) {
            let mut r = schedc_optimize::report::row_of_sim(
                &format!("spec {}", s.name),
                &p.pipeline,
                &sim,
                peak,
                scale_of(ref_stages, &p.pipeline),
                cap,
            );
            r.fits &= !over_bytes(&r);
            if r.fits {
                spec_rows.push(r.clone());
                rows.push(r);
            }
        }
    }
    if !other_shape.is_empty() {
        eprintln!(
            "note: under --model only schedules of the input's placement are compared (the derived costs are per stage): not listed: {}",
            other_shape.join(", ")
        );
    }
    if !not_simulated.is_empty() {
        eprintln!(
            "note: --time-limit ran out before these rows were simulated, so they are not listed: {}",
            not_simulated.join(", ")
        );
    }

    // "optimal" is branch and bound's (or the lower bound's) word on the placements
    // searched; a listed schedule within the cap that ranks first withdraws it (a spec of a
    // placement not searched, such as chimera's bidirectional one).
    let faster: Vec<&Row> = rows[1..]
        .iter()
        .filter(|r| r.fits && better_row(r, &opt_row, steady))
        .collect();
    let optimal = out.optimal && faster.is_empty();
    // The user's own input within the caps and faster than the result: the search orders
    // whole ops without the input's memory ops, lent stashes or message order, so what it
    // writes can be slower than what it was given (newcomer round 5, finding 10).
    if let Some(inp) = faster.iter().find(|r| r.name == "start (the input)") {
        eprintln!(
            "note: the input is faster than the schedule found ({} against {}) and within the caps: the search orders whole ops without the input's memory ops, lent stashes and message order; keep the input",
            secs(inp.makespan),
            secs(opt_row.makespan)
        );
    }
    let mut searched: Vec<String> = Vec::new();
    for c in &candidates {
        let l = pipeline_label(&c.pipeline);
        if !searched.contains(&l) {
            searched.push(l);
        }
    }

    // The schedule in the form written (the IR text when nothing is written), and what
    // `schedc sim` and `schedc check` say of that file: the figures the user can reproduce.
    let form = a.to;
    let file_pl = &ver.program.pipeline;
    let shown_path = match a.output.as_deref() {
        Some("-") => "-".to_string(),
        None => match form {
            OutKind::IrText => "optimized.ir",
            OutKind::Spec => "optimized.sched",
            OutKind::TorchCsv => "optimized.csv",
        }
        .to_string(),
        Some(o) => o.to_string(),
    };
    let figures_form = if a.output.is_some() {
        form
    } else {
        OutKind::IrText
    };
    let mut family_note: Option<String> = None;
    let text = match figures_form {
        OutKind::IrText => schedc_ir::text::print(&ver.program),
        OutKind::TorchCsv => match schedc::import::torch::write_csv(
            &out_program(&cand.inst, &out.best),
            schedc::import::torch::TorchFormat::ComputeOnly,
        ) {
            Ok(t) => t,
            Err(e) => return fail(e),
        },
        OutKind::Spec => {
            // A family in M where the found order is periodic, checked before it is written;
            // else the one instance.
            let valid = |text: &str, m: u32| family_instance(text, file_pl, m, cand.inst.cap);
            match crate::family::family(&ver.program, &valid) {
                Ok(f) => {
                    family_note = Some(f.note());
                    f.text
                }
                Err(why) => {
                    family_note = Some(if why.starts_with("periodic") {
                        format!("wrote one instance: {why}")
                    } else {
                        format!("not periodic: wrote one instance ({why})")
                    });
                    spec_body(&ver.program)
                }
            }
        }
    };
    // The times are `schedc sim`'s on the file (`CostModel::for_pipeline`); the activations
    // count in stages of the input (one stage per rank without input), the file's in its
    // own: the same units when `cand.scale` is 1.
    let same_units = (cand.scale - 1.0).abs() < 1e-12;
    let figs = if figures_form == OutKind::IrText {
        // The IR text is the verified program itself (printing and parsing it is exact), and
        // the optimized row its simulation under `schedc sim`'s times: no second check and
        // simulation (they take seconds at P = 20000).
        Figures {
            makespan: ver_sim.makespan,
            steady_step: ver_sim.steady_step,
            peak: ver
                .report
                .ranks
                .iter()
                .map(|r| r.peak_activations)
                .max()
                .unwrap_or(0),
            cap: cand.inst.cap,
            pp: file_pl.pp,
            mb: file_pl.total_microbatches(),
            peak_bytes: peak_bytes(&ver_sim),
        }
    } else {
        match simulate_written(
            figures_form,
            &text,
            file_pl,
            &cost,
            a.moe.as_ref(),
            cand.inst.cap,
            a.max_memory,
        ) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("error: the schedule as written does not check or simulate: {e}");
                return ExitCode::from(1);
            }
        }
    };
    let text = match figures_form {
        OutKind::Spec => spec_with_header(&text, &a, &out, &figs, &shown_path),
        OutKind::IrText => format!(
            "{}{text}",
            header_comment(&a, &out, &figs, OutKind::IrText, &shown_path)
        ),
        OutKind::TorchCsv => text,
    };
    let sim_cmd = figs.sim_command(figures_form, &shown_path, &a);
    let check_cmd = figs.check_command(figures_form, &shown_path, &a);
    let to_stdout = a.output.as_deref() == Some("-");
    // A file that cannot be written after all does not throw the search away: the report is
    // printed, then the error (`report_then`).
    let mut write_error = None;
    if let Some(o) = &a.output {
        if to_stdout {
            if let Err(c) = emit(&text) {
                return c;
            }
        } else {
            // Whole or absent: a temporary sibling renamed into place.
            write_error = try_write_output(std::path::Path::new(o), text.as_bytes(), a.force).err();
        }
    }

    // Under --model, a schedule whose memory exceeds the GPU's is rejected (exit 1) after
    // the report, as `schedc sim --model` does.
    let does_not_fit = gpu_memory.is_some_and(|(mem, over)| {
        let need = opt_row.peak_memory_bytes + over;
        if need > mem {
            eprintln!(
                "error: the optimized schedule needs {:.1} GB on its busiest rank, over the GPU's {:.1} GB: it does not fit this layout (lower --max-activations, or recompute)",
                need / 1e9,
                mem / 1e9
            );
            true
        } else {
            false
        }
    });
    let fit_code = |c: ExitCode| {
        if does_not_fit && c == ExitCode::SUCCESS {
            ExitCode::from(1)
        } else {
            c
        }
    };
    match a.format {
        OutFormat::Json => {
            let j = serde_json::json!({
                "makespan": opt_row.makespan,
                "objective": if steady { "steady_state" } else { "from_start" },
                "steady_step": opt_row.steady_step,
                "moe": a.moe.is_some(),
                "moe_span_bound": moe_bound.as_ref().map(|b| serde_json::json!({
                    "span": b.span, "busy": b.busy, "warmup_idle": b.warmup_idle,
                    "cooldown_idle": b.cooldown_idle, "per_rank_span_bubble": b.bubble,
                })),
                "bubble": {
                    "from_start": opt_row.bubble_from_start,
                    "from_start_per_busy": opt_row.bubble_from_start_per_busy,
                    "per_rank_span": opt_row.bubble_per_rank_span,
                    "steady_state": opt_row.bubble_steady_state,
                },
                "peak_activations": opt_row.peak_activations,
                "peak_memory_bytes": opt_row.peak_memory_bytes,
                "max_activations": cap,
                "max_memory": a.max_memory,
                "memory_ops": memory_ops.map(|(off, rec)| serde_json::json!({
                    "offloaded": off, "recomputed": rec,
                })),
                "placement": opt_row.placement,
                "lower_bound": out.lower_bound,
                "optimal": optimal,
                "optimal_on_placements_searched": out.optimal
                    && !faster.iter().any(|r| searched.contains(&r.placement)),
                "placements_searched": searched,
                "faster_listed": faster.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
                "found_by": out.found_by,
                "timed_out": out.timed_out || !not_simulated.is_empty(),
                "not_simulated": not_simulated,
                "seed": a.seed,
                "written": {
                    "form": figures_form.to_possible_value().map(|v| v.get_name().to_string()),
                    "path": a.output,
                    "makespan": figs.makespan,
                    "steady_step": figs.steady_step,
                    "max_activations": cand.inst.cap,
                    "peak_activations": figs.peak,
                    "peak_memory_bytes": figs.peak_bytes,
                    "stages": file_pl.stages,
                    "same_units_as_rows": same_units,
                    "sim": sim_cmd,
                    "check": check_cmd,
                    "family": family_note,
                },
                "phases": out.phases.iter().map(|p| serde_json::json!({
                    "name": p.name, "best": p.best, "evaluations": p.evals, "seconds": p.seconds
                })).collect::<Vec<_>>(),
                "start": rows.iter().find(|r| r.name.starts_with("start")),
                "greedy": greedy_row,
                "specs": spec_rows,
            });
            fit_code(report_then(
                &format!("{}\n", serde_json::to_string_pretty(&j).expect("json")),
                write_error,
            ))
        }
        OutFormat::Human => {
            use std::fmt::Write as _;
            let mut o = String::new();
            let _ = writeln!(
                o,
                "P = {pp}, M = {mb}, cost `{}`{}, at most {cap} live activations per rank (stage units of {})",
                if a.cluster.given() {
                    format!("derived from{}", a.cluster.flags())
                } else {
                    a.cost.clone()
                },
                if a.moe.is_some() {
                    ", --moe (MoE stages split into attention, dispatch, MLP, combine; the search on a whole-op proxy)"
                } else {
                    ""
                },
                if a.input.is_some() { "the input" } else { "one stage per rank" }
            );
            if let Some(b) = a.max_memory {
                let _ = writeln!(
                    o,
                    "at most {b} bytes of device memory per rank (--max-memory): {}; rows over it are marked `over --max-memory`",
                    match memory_ops {
                        Some((off, rec)) => format!(
                            "the order found exceeded it, so {off} activation(s) are offloaded and {rec} recomputed (chosen by simulated makespan)"
                        ),
                        None => "the order found fits without memory ops".to_string(),
                    }
                );
            }
            let _ = writeln!(
                o,
                "optimized{}: makespan {} ({}; lower bound {}{}), found by {}",
                if steady {
                    format!(" for steady_state: step {}", secs(opt_row.steady_step))
                } else {
                    String::new()
                },
                secs(opt_row.makespan),
                opt_row.placement,
                secs(out.lower_bound),
                optimality(&out, &faster, &searched),
                out.found_by
            );
            let _ = writeln!(
                o,
                "{}\n",
                written_line(
                    &a,
                    figures_form,
                    &figs,
                    &sim_cmd,
                    &check_cmd,
                    same_units,
                    file_pl,
                    opt_row.makespan
                )
            );
            if let Some(n) = &family_note {
                let _ = writeln!(o, "{n}\n");
            }
            let _ = writeln!(
                o,
                "bubble: idle fraction under each convention — from_start (one step, barrier at both ends), per_rank_span (each rank from its first op to its last), steady_state (steps back to back, no barrier); bubble/busy is idle / busy from start\n"
            );
            let _ = writeln!(
                o,
                "{:<44} {:>10} {:>11} {:>13} {:>12} {:>11} {:>10} {:>10} {:>12}",
                "schedule",
                "makespan",
                "from_start",
                "per_rank_span",
                "steady_state",
                "bubble/busy",
                "step",
                "peak_act",
                "peak_bytes"
            );
            let _ = writeln!(
                o,
                "{:<44} {:>10} {:>11} {:>13} {:>12} {:>11} {:>10} {:>10} {:>12}",
                "", "(s)", "(bubble)", "(bubble)", "(bubble)", "", "(steady)", "", ""
            );
            for r in &rows {
                let _ = writeln!(
                    o,
                    "{:<44} {:>10} {:>10.1}% {:>12.1}% {:>11.1}% {:>10.1}% {:>10} {:>10.1} {:>12}",
                    format!("{} [{}]", r.name, r.placement),
                    secs(r.makespan),
                    100.0 * r.bubble_from_start,
                    100.0 * r.bubble_per_rank_span,
                    100.0 * r.bubble_steady_state,
                    100.0 * r.bubble_from_start_per_busy,
                    secs(r.steady_step),
                    r.peak_activations,
                    if over_bytes(r) {
                        format!("{:.3e} over --max-memory", r.peak_memory_bytes)
                    } else if r.peak_memory_bytes > 0.0 {
                        format!("{:.3e}", r.peak_memory_bytes)
                    } else {
                        // The cost model gives no memory figures (as `schedc sim` prints).
                        "-".to_string()
                    }
                );
            }
            if let Some(b) = &moe_bound {
                let _ = writeln!(
                    o,
                    "\nlower bound under --moe on this placement and cap (rank 0's forced idle: warmup {:.4} s, cooldown {:.4} s): largest per-rank span >= {:.4} s, per_rank_span bubble >= {:.1}%",
                    b.warmup_idle,
                    b.cooldown_idle,
                    b.span,
                    100.0 * b.bubble
                );
            }
            if out.timed_out {
                let _ = writeln!(o, "\nthe time limit stopped the search");
            }
            if to_stdout {
                // Standard output carries the schedule: the report goes to standard error,
                // so that `-o - | schedc check -` reads the schedule alone.
                eprint!("{o}");
                fit_code(ExitCode::SUCCESS)
            } else {
                fit_code(report_then(&o, write_error))
            }
        }
    }
}

/// `v` fitted to `bytes` of device memory per rank (`schedc_optimize::memops::fit_bytes`):
/// `None` when it fits as it is, else the rewritten program checked with `--max-activations
/// cap` and simulated as `schedc sim` does, with the number of activations offloaded and
/// recomputed.
///
/// Errors: no rewrite fits (the message names the rank and its bytes), or the rewritten
/// program does not check or simulate.
#[allow(clippy::type_complexity)]
fn fit_to_bytes(
    v: &schedc_optimize::Verified,
    cost: &CostModel,
    bytes: u64,
    cap: u64,
    deadline: Option<Instant>,
) -> Result<
    Option<(
        schedc_optimize::Verified,
        schedc::sim::SimResult,
        (usize, usize),
    )>,
    String,
> {
    let fitted = schedc_optimize::memops::fit_bytes(&v.program, cost, bytes as f64, deadline)?;
    if fitted.rewrites.is_empty() {
        return Ok(None);
    }
    let counts = fitted.counts();
    let checked = schedc::check::check(
        &fitted.program,
        None,
        &schedc::check::Options {
            max_activations: Some(cap),
            ..Default::default()
        },
    );
    let report = checked.report.clone();
    let (sim, _) = simulate_checked(checked, cost)
        .map_err(|e| format!("the schedule with memory ops does not verify: {e}"))?;
    Ok(Some((
        schedc_optimize::Verified {
            program: fitted.program,
            report,
            sim: sim.clone(),
        },
        sim,
        counts,
    )))
}

/// True if row `r` ranks before `b`: a shorter makespan, or under `steady_state` a shorter
/// steady-state step (ties by the makespan), beyond 1e-9 relative.
fn better_row(r: &Row, b: &Row, steady: bool) -> bool {
    let tol = |x: f64| 1e-9 * x.abs().max(1e-300);
    let (k, kb, t, tb) = if steady {
        (r.steady_step, b.steady_step, r.makespan, b.makespan)
    } else {
        (r.makespan, b.makespan, 0.0, 0.0)
    };
    k < kb - tol(kb) || (k <= kb + tol(kb) && t < tb - tol(tb))
}

/// Seconds as the report prints them: four decimals, or four significant digits in
/// scientific notation when that would print 0 or more than 13 digits (`F=1e-300`,
/// `F=1e300`).
pub fn secs(x: f64) -> String {
    if x == 0.0 || !x.is_finite() || (1e-3..1e9).contains(&x.abs()) {
        format!("{x:.4}")
    } else {
        format!("{x:.4e}")
    }
}

/// What `schedc sim` and `schedc check` give on the written file.
struct Figures {
    /// `schedc sim FILE --cost COST [--moe]`'s makespan, seconds.
    makespan: f64,
    /// Its steady-state step, seconds.
    steady_step: f64,
    /// `schedc check`'s peak live activations on the worst rank, in the file's own stages.
    peak: u64,
    /// The cap `schedc check --max-activations` accepts it under, in the file's stages.
    cap: u64,
    /// `--pp P --mb M` for a spec.
    pp: u32,
    /// Micro-batches, both directions together.
    mb: u32,
    /// `schedc sim`'s peak device memory on the worst rank, bytes (`peak_memory_bytes`).
    peak_bytes: f64,
}

/// The largest `peak_memory_bytes` over the ranks of `s`.
fn peak_bytes(s: &schedc::sim::SimResult) -> f64 {
    s.ranks
        .iter()
        .map(|r| r.peak_memory_bytes)
        .fold(0.0, f64::max)
}

/// ` --cost C [--set S]` as given: the cost flags `schedc check` takes for `--max-memory`.
fn cost_flags(a: &Args) -> String {
    format!(
        " --cost {}{}",
        a.cost,
        a.set
            .as_ref()
            .map(|s| format!(" --set {s}"))
            .unwrap_or_default()
    )
}

impl Figures {
    fn sim_command(&self, form: OutKind, path: &str, a: &Args) -> String {
        format!(
            "schedc sim {path}{}{}{}{}{}",
            self.size_flags(form),
            if a.cluster.given() {
                a.cluster.flags()
            } else {
                format!(" --cost {}", a.cost)
            },
            a.set
                .as_ref()
                .map(|s| format!(" --set {s}"))
                .unwrap_or_default(),
            if a.moe.is_some() {
                // As given on the command line (`--moe` or `--moe=STAGES`).
                std::env::args()
                    .find(|x| x == "--moe" || x.starts_with("--moe="))
                    .map(|x| format!(" {x}"))
                    .unwrap_or_else(|| " --moe".into())
            } else {
                String::new()
            },
            a.max_memory
                .map(|b| format!(" --max-memory {b}"))
                .unwrap_or_default()
        )
    }
    /// Under `--max-memory` (without `--model`, which `check` does not take) the command also
    /// bounds the bytes, with the cost model that sizes them.
    fn check_command(&self, form: OutKind, path: &str, a: &Args) -> String {
        format!(
            "schedc check {path}{} --max-activations {}{}",
            self.size_flags(form),
            self.cap,
            match a.max_memory {
                Some(b) if !a.cluster.given() => format!(" --max-memory {b}{}", cost_flags(a)),
                _ => String::new(),
            }
        )
    }
    fn size_flags(&self, form: OutKind) -> String {
        if form == OutKind::Spec {
            format!(" --pp {} --mb {}", self.pp, self.mb)
        } else {
            String::new()
        }
    }
}

/// Loads `text` as `schedc sim` loads a file of `form` (with `--pp`/`--mb` for a spec and
/// `--moe` as given), checks it with `--max-activations cap` and simulates it under `cost`
/// as `schedc sim` charges it (`CostModel::for_pipeline`: a stage of a V-way split 1/V).
///
/// Errors: the text does not load, `check` rejects it, or the simulation fails.
fn simulate_written(
    form: OutKind,
    text: &str,
    pl: &Pipeline,
    cost: &CostModel,
    moe: Option<&schedc::moe::MoeStages>,
    cap: u64,
    max_memory: Option<u64>,
) -> Result<Figures, String> {
    let (name, spec) = match form {
        OutKind::IrText => ("optimized.ir", false),
        OutKind::Spec => ("optimized.sched", true),
        OutKind::TorchCsv => ("optimized.csv", false),
    };
    let mb = pl.total_microbatches();
    let ov = schedc::input::Overrides {
        pp: spec.then_some(pl.pp),
        microbatches: spec.then_some(mb),
        moe: moe.cloned(),
        list_cost: Some(cost.clone()),
        ..Default::default()
    };
    let loaded = schedc::input::load_str(name, text.to_string(), &ov)
        .map_err(|e| crate::common::load_error_text(&e, name))?;
    let checked = schedc::check::check(
        &loaded.program,
        loaded.spans.as_ref(),
        &schedc::check::Options {
            max_activations: Some(cap),
            ..Default::default()
        },
    );
    // As `schedc sim` times the file: a stage of a V-way split charged 1/V.
    let (sim, peak) = simulate_checked(checked, cost)?;
    if let Some(b) = max_memory {
        if peak_bytes(&sim) > b as f64 || !sim.host_overflows.is_empty() {
            return Err(format!(
                "it needs {} bytes of device memory on its busiest rank, over --max-memory {b}{}",
                peak_bytes(&sim).round() as u64,
                if sim.host_overflows.is_empty() {
                    ""
                } else {
                    ", or overflows [memory] host_bytes"
                }
            ));
        }
    }
    Ok(Figures {
        makespan: sim.makespan,
        steady_step: sim.steady_step,
        peak,
        cap,
        pp: pl.pp,
        mb,
        peak_bytes: peak_bytes(&sim),
    })
}

/// The report's line on the schedule as written (or, without `-o`, as IR text would be):
/// the figures `schedc sim` and `schedc check` give on the file, with why they differ from
/// the table's when they do.
#[allow(clippy::too_many_arguments)]
fn written_line(
    a: &Args,
    form: OutKind,
    f: &Figures,
    sim_cmd: &str,
    check_cmd: &str,
    same_units: bool,
    pl: &Pipeline,
    row_makespan: f64,
) -> String {
    let what = match (a.output.as_deref(), form) {
        (None, _) => "the schedule (not written; as IR text)".to_string(),
        (Some("-"), OutKind::IrText) => "written to standard output (IR text)".into(),
        (Some("-"), OutKind::Spec) => "written to standard output (spec)".into(),
        (Some("-"), OutKind::TorchCsv) => {
            "written to standard output (torch compute-only CSV)".into()
        }
        (Some(p), OutKind::IrText) => format!("written `{p}` (IR text)"),
        (Some(p), OutKind::Spec) => format!("written `{p}` (spec)"),
        (Some(p), OutKind::TorchCsv) => format!("written `{p}` (torch compute-only CSV)"),
    };
    let mut s = format!(
        "{what}: makespan {} by `{sim_cmd}`{}; peak {} live activations, `{check_cmd}` accepts it",
        secs(f.makespan),
        if a.objective == Objective::SteadyState {
            format!(" (steady-state step {})", secs(f.steady_step))
        } else {
            String::new()
        },
        f.peak
    );
    if let Some(b) = a.max_memory {
        s.push_str(&format!(
            "\n  (peak device memory {} bytes on the busiest rank, within --max-memory {b})",
            f.peak_bytes.round() as u64
        ));
    }
    if !same_units {
        s.push_str(&format!(
            "\n  (activations in the file's own units: its {} stages count one activation each, where the table counts {} of one; the times are the table's, `schedc sim` charging a stage of a V-way split 1/V of the cost's stage time as the table does)",
            pl.stages,
            if pl.stages_per_direction() == 2 * pl.pp { "half" } else { "a fraction" }
        ));
    }
    if form == OutKind::TorchCsv {
        let differs = (f.makespan - row_makespan).abs() > 1e-9 * row_makespan.abs().max(1.0);
        s.push_str(&format!(
            "\n  (a compute-only CSV carries the ops' order, not the messages': `schedc sim` re-inserts the sends and receives in its own order{}; write --to ir-text or --to spec to keep the searched order; a CSV has no header to say so)",
            if differs {
                format!(
                    ", which gives {} rather than the optimized row's {}",
                    secs(f.makespan),
                    secs(row_makespan)
                )
            } else {
                String::new()
            }
        ));
    }
    s
}

fn out_program(inst: &Instance, sc: &Sched) -> Program {
    sc.to_program(inst)
}

/// The spec form's program part: the pipeline, `require`s for this P and M, and the lowered
/// program (sends, receives and their channels in the searched order) in a `literal { }`
/// block, so that `schedc check` keeps the messages as written instead of re-inserting them.
fn spec_body(p: &Program) -> String {
    use std::fmt::Write as _;
    let pl = &p.pipeline;
    let mut s = spec_header(p);
    let _ = writeln!(
        s,
        "require P == {}, \"this schedule was found for P = {}\"",
        pl.pp, pl.pp
    );
    let _ = writeln!(
        s,
        "require M == {}, \"this schedule was found for M = {}\"",
        pl.total_microbatches(),
        pl.total_microbatches()
    );
    s.push_str("literal {\n");
    let text = schedc_ir::text::print(p);
    for line in text
        .lines()
        .filter(|l| l.starts_with("rank ") || l.starts_with("group ") || l.starts_with("moe "))
    {
        let _ = writeln!(s, "{line}");
    }
    s.push_str("}\n");
    s
}

/// The spec form's first lines: its name, V and placement (as `stages` and a list for an
/// explicit placement).
pub(crate) fn spec_header(p: &Program) -> String {
    use std::fmt::Write as _;
    let pl = &p.pipeline;
    let mut s = String::new();
    let _ = writeln!(s, "schedule \"optimized\"");
    let v = pl.stages / pl.pp.max(1);
    match pl.placement {
        PlacementKind::Loop => {
            let _ = writeln!(s, "vpp {v}\nplacement loop");
        }
        PlacementKind::V => {
            let _ = writeln!(s, "vpp {v}\nplacement v");
        }
        PlacementKind::Bidir => s.push_str("placement bidir\n"),
        PlacementKind::Explicit => {
            let _ = writeln!(
                s,
                "stages {}\nplacement [{}]",
                pl.stages,
                pl.stage_to_rank
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    s
}

/// Elaborates the spec `text` at P = `pl.pp` and `m` micro-batches (no `--moe`) and checks
/// it with at most `cap` live activations: its program if `schedc check` accepts it.
///
/// Errors: the instance is refused, does not elaborate or is rejected (the first error).
fn family_instance(text: &str, pl: &Pipeline, m: u32, cap: u64) -> Result<Program, String> {
    let ov = schedc::input::Overrides {
        pp: Some(pl.pp),
        microbatches: Some(m),
        ..Default::default()
    };
    let loaded = schedc::input::load_str("optimized.sched", text.to_string(), &ov)
        .map_err(|e| crate::common::load_error_text(&e, "optimized.sched"))?;
    let checked = schedc::check::check(
        &loaded.program,
        loaded.spans.as_ref(),
        &schedc::check::Options {
            max_activations: Some(cap),
            ..Default::default()
        },
    );
    if checked.report.verdict != schedc::check::Verdict::Accepted {
        let first = checked
            .report
            .diagnostics
            .iter()
            .find(|d| d.severity == schedc::diag::Severity::Error)
            .map(|d| d.message.clone())
            .unwrap_or_default();
        return Err(format!("schedc check rejects it: {first}"));
    }
    Ok(loaded.program)
}

/// The `#` comment heading a written spec or IR text: how it was found, and the makespan
/// `schedc sim` gives and the cap `schedc check` accepts, in the file's own units.
fn header_comment(a: &Args, out: &Outcome, f: &Figures, form: OutKind, path: &str) -> String {
    format!(
        "# Found by `schedc optimize` (seed {}), {}.\n# `{}`\n# gives makespan {:.6};\n# `{}` accepts it.\n",
        a.seed,
        out.found_by,
        f.sim_command(form, path, a),
        f.makespan,
        f.check_command(form, path, a),
    )
}

/// The spec as written: a header comment with the figures `schedc sim` and `schedc check`
/// give on it, then `body`, in `schedc fmt`'s canonical form (so `schedc fmt --check`
/// passes).
fn spec_with_header(body: &str, a: &Args, out: &Outcome, f: &Figures, path: &str) -> String {
    let text = format!("{}{body}", header_comment(a, out, f, OutKind::Spec, path));
    match schedc::dsl::parse_file(&text) {
        Ok(parsed) => schedc::dsl::fmt::format_file(&parsed, &text),
        Err(_) => text,
    }
}

/// Simulates `p` (a loaded input, its messages as written) as `schedc sim` does under `cost`
/// and `--moe` as given: the MoE stages split (a `:list` ordered under `cost`), `check`'s
/// lowering, and `cost` for the pipeline (a stage of a V-way split charged 1/V). Returns the
/// simulation and `check`'s peak live activations on the worst rank, in `p`'s stages.
///
/// Errors: the selection does not fit, `check` rejects the program, or the simulation fails.
fn simulate_as_sim(
    p: &Program,
    cost: &CostModel,
    moe: Option<&schedc::moe::MoeStages>,
) -> Result<(schedc::sim::SimResult, u64), String> {
    let split;
    let p = match moe {
        Some(sel) => {
            split = schedc::input::apply_moe_under(p, None, sel, Some(cost))?.0;
            &split
        }
        None => p,
    };
    let checked = schedc::check::check(p, None, &Default::default());
    simulate_checked(checked, cost)
}

/// `check`'s outcome simulated as `schedc sim` does (`cost` for the pipeline: a stage of a
/// V-way split charged 1/V), with `check`'s peak live activations on the worst rank.
///
/// Errors: `check` rejected the program (its first error), or the simulation fails.
fn simulate_checked(
    checked: schedc::check::Outcome,
    cost: &CostModel,
) -> Result<(schedc::sim::SimResult, u64), String> {
    if checked.report.verdict != schedc::check::Verdict::Accepted {
        let first = checked
            .report
            .diagnostics
            .iter()
            .find(|d| d.severity == schedc::diag::Severity::Error)
            .map(|d| d.message.clone())
            .unwrap_or_default();
        return Err(format!("schedc check rejects it: {first}"));
    }
    let peak = checked
        .report
        .ranks
        .iter()
        .map(|r| r.peak_activations)
        .max()
        .unwrap_or(0);
    let prog = checked.checked.ok_or("no checked program")?;
    let sim = schedc::sim::simulate(&prog, &cost.for_pipeline(&prog.pipeline))?;
    Ok((sim, peak))
}
