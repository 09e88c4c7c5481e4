//! What `schedc optimize` reports next to its result: the starting schedule, every spec of
//! the standard library that fits the cap, and the Zero Bubble greedy, each checked and
//! simulated under the same cost model.
//!
//! **Units across placements.** [`scaled_cost`] and [`evaluate`] take times in the cost
//! model for one stage of a *reference* pipeline of `ref_stages` stages per direction: a
//! schedule whose pipeline splits the model into more stages runs each op for
//! `reference stages / its stages` of that time (`CostModel::op_scale`, as `schedc compare`
//! does), and its live activations are counted in reference stages the same way, so a ZB-V
//! peak of 16 half-stage activations is 8. The cap is in those units too. With one stage
//! per rank as the reference these are `schedc sim`'s times; [`evaluate_timed`] takes a
//! cost already timed for the pipeline (`schedc optimize` gives `CostModel::for_pipeline`'s,
//! the times `schedc sim` charges the file it writes) and counts activations apart.

use crate::instance::{Instance, ProblemError};
use crate::sched::Sched;
use crate::{verify, Verified};
use schedc::input::{load_spec, LoadError, Overrides};
use schedc::moe::MoeStages;
use schedc::sim::cost::{CostModel, OpCosts};
use schedc::sim::SimResult;
use schedc_ir::{Kind, Part};
use schedc_ir::{Pipeline, PlacementKind};
use serde::Serialize;
use std::path::Path;

/// One row of the comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// What the row is: `optimized`, `start`, `greedy (Zero Bubble, best of 8)`, a spec name.
    pub name: String,
    /// The placement (`loop`, `v`, `bidir`, `explicit`) and stages per rank.
    pub placement: String,
    /// From-start makespan (simulator), seconds.
    pub makespan: f64,
    /// Bubble, idle / (busy + idle) summed over ranks, from time 0 to the makespan.
    pub bubble_from_start: f64,
    /// Bubble, idle / busy summed over ranks, from time 0 to the makespan (Megatron's).
    pub bubble_from_start_per_busy: f64,
    /// Bubble under the per-rank-span convention: each rank from its first op to its last
    /// (`schedc::sim::Bubble::per_rank_span`).
    pub bubble_per_rank_span: f64,
    /// Bubble under the steady-state convention: steps back to back, no barrier
    /// (`schedc::sim::Bubble::steady_state`).
    pub bubble_steady_state: f64,
    /// Seconds per step when steps run back to back (`SimResult::steady_step`).
    pub steady_step: f64,
    /// Peak live activations on the worst rank, in reference-stage units.
    pub peak_activations: f64,
    /// Peak memory on the worst rank (simulator, with the cost model's `[memory]`), bytes.
    pub peak_memory_bytes: f64,
    /// True if the peak fits the cap.
    pub fits: bool,
}

/// `reference stages / stages` of `pl` (per direction): how long its ops are relative to a
/// reference stage.
pub fn scale_of(ref_stages: u32, pl: &Pipeline) -> f64 {
    ref_stages as f64 / pl.stages_per_direction() as f64
}

/// The cost model for `pl` with op times scaled to its stage size.
pub fn scaled_cost(cost: &CostModel, ref_stages: u32, pl: &Pipeline) -> CostModel {
    let mut c = cost.clone();
    let s = scale_of(ref_stages, pl);
    c.op_scale = if (s - 1.0).abs() < 1e-12 {
        cost.op_scale
    } else {
        Some(cost.op_scale.unwrap_or(1.0) * s)
    };
    c
}

/// The cap in `pl`'s own (stage, micro-batch) activations, from reference units (rounded
/// down).
pub fn cap_for(cap_ref: u64, ref_stages: u32, pl: &Pipeline) -> u64 {
    let s = scale_of(ref_stages, pl);
    ((cap_ref as f64 / s) + 1e-9).floor() as u64
}

/// The row of a verified schedule.
pub fn row(name: &str, v: &Verified, scale: f64, cap_ref: u64) -> Row {
    row_with(name, v, &v.sim, scale, cap_ref)
}

/// The row of a verified schedule with its times from `sim` (the `--moe` simulation of
/// [`simulate_moe`], or `v.sim`); the peak activations come from `check`'s report.
pub fn row_with(name: &str, v: &Verified, sim: &SimResult, scale: f64, cap_ref: u64) -> Row {
    let peak = v
        .report
        .ranks
        .iter()
        .map(|r| r.peak_activations)
        .max()
        .unwrap_or(0);
    row_of_sim(name, &v.program.pipeline, sim, peak, scale, cap_ref)
}

/// The row of a schedule on `pl` simulated as `sim`, whose worst rank holds `peak` live
/// activations in `pl`'s own stages (`check`'s figure), each `scale` of a reference stage.
pub fn row_of_sim(
    name: &str,
    pl: &Pipeline,
    sim: &SimResult,
    peak: u64,
    scale: f64,
    cap_ref: u64,
) -> Row {
    let peak = peak as f64 * scale;
    Row {
        name: name.to_string(),
        placement: placement_label(pl),
        makespan: sim.makespan,
        bubble_from_start: sim.bubble_ratio,
        bubble_from_start_per_busy: sim.bubble_ratio_busy,
        bubble_per_rank_span: sim.bubble.per_rank_span,
        bubble_steady_state: sim.bubble.steady_state,
        steady_step: sim.steady_step,
        peak_activations: peak,
        peak_memory_bytes: sim
            .ranks
            .iter()
            .map(|r| r.peak_memory_bytes)
            .fold(0.0, f64::max),
        fits: peak <= cap_ref as f64 + 1e-9,
    }
}

/// The pipeline's placement as the report names it: `v V=2`, or for an explicit placement
/// whose stages do not divide evenly among the ranks `explicit, 4 stages on 3 ranks` (a
/// V would be a fraction).
pub fn placement_label(pl: &Pipeline) -> String {
    let pp = pl.pp.max(1);
    if !pl.stages.is_multiple_of(pp) {
        format!(
            "{}, {} stages on {} ranks",
            placement_name(pl.placement),
            pl.stages,
            pl.pp
        )
    } else {
        format!("{} V={}", placement_name(pl.placement), pl.stages / pp)
    }
}

/// The placement's name.
pub fn placement_name(k: PlacementKind) -> &'static str {
    match k {
        PlacementKind::Loop => "loop",
        PlacementKind::V => "v",
        PlacementKind::Bidir => "bidir",
        PlacementKind::Explicit => "explicit",
    }
}

/// Checks and simulates `sc` on `pl` without a cap (the row says whether it fits).
///
/// Errors: the cost model has no times, or the schedule does not verify.
pub fn evaluate(
    name: &str,
    pl: &Pipeline,
    sc: &Sched,
    cost: &CostModel,
    ref_stages: u32,
    cap_ref: u64,
) -> Result<(Row, Verified), String> {
    evaluate_moe(name, pl, sc, cost, ref_stages, cap_ref, None)
}

/// [`evaluate`], with the row's times from the `--moe` simulation when `moe` is given.
///
/// Errors: those of [`evaluate`] and [`simulate_moe`].
pub fn evaluate_moe(
    name: &str,
    pl: &Pipeline,
    sc: &Sched,
    cost: &CostModel,
    ref_stages: u32,
    cap_ref: u64,
    moe: Option<&MoeStages>,
) -> Result<(Row, Verified), String> {
    let c = scaled_cost(cost, ref_stages, pl);
    evaluate_timed(name, pl, sc, &c, scale_of(ref_stages, pl), cap_ref, moe)
}

/// [`evaluate_moe`] under `cost` as given, already the times of `pl`'s ops (such as
/// `CostModel::for_pipeline`'s, as `schedc sim` times a file), with the row's activations
/// counted `scale` reference stages each.
///
/// Errors: those of [`evaluate_moe`].
pub fn evaluate_timed(
    name: &str,
    pl: &Pipeline,
    sc: &Sched,
    cost: &CostModel,
    scale: f64,
    cap_ref: u64,
    moe: Option<&MoeStages>,
) -> Result<(Row, Verified), String> {
    let inst = Instance::new(pl, cost, None).map_err(|e: ProblemError| e.to_string())?;
    let v = verify(&inst, cost, sc)?;
    let r = match moe {
        Some(sel) => row_with(name, &v, &simulate_moe(&v, cost, sel)?, scale, cap_ref),
        None => row(name, &v, scale, cap_ref),
    };
    Ok((r, v))
}

/// Splits the verified program's MoE stages into attention, dispatch, MLP and combine parts
/// (`schedc::moe::split`, what `--moe` does to an input) and simulates it under `cost`, whose
/// `[moe]` section times the all-to-alls on the expert-parallel stream.
///
/// Errors: the stage selection does not fit the pipeline; the simulation does not finish.
pub fn simulate_moe(v: &Verified, cost: &CostModel, sel: &MoeStages) -> Result<SimResult, String> {
    let stages = sel.resolve(&v.program.pipeline)?;
    let (p, _) = schedc::moe::split(&v.program, None, &stages);
    schedc::sim::simulate(&p, cost)
}

/// The whole-op cost model the search uses under `--moe` (a proxy: the search's evaluator
/// has no expert-parallel stream). On each MoE stage a plain F, B or BW also takes its
/// dispatch and combine (`a` = their sum; the compute stream waits for them, as in the
/// simulator's plain ops), W none, and an overlapped pair takes `max(F + B, 2a)` when the
/// `[moe]` section overlaps (DeepSeek-V3's pair hides its all-to-alls under the other
/// op's compute), else `F + B + 2a`. A given `FB` is kept. Unscaled, like the model's own
/// times.
pub fn moe_proxy(cost: &CostModel, stages: &[u32]) -> CostModel {
    let a = cost.a2a_time(Part::Dispatch) + cost.a2a_time(Part::Combine);
    let mut c = cost.clone();
    for &s in stages {
        let (f, b, w, bw) = (
            cost.op_time(Kind::F, s),
            cost.op_time(Kind::B, s),
            cost.op_time(Kind::W, s),
            cost.op_time(Kind::BW, s),
        );
        let given_fb = cost
            .compute
            .stage
            .get(&s.to_string())
            .and_then(|o| o.fb)
            .or(cost.compute.all.fb);
        let fb = given_fb.unwrap_or(if cost.moe.overlap {
            (f + b).max(2.0 * a)
        } else {
            f + b + 2.0 * a
        });
        c.compute.stage.insert(
            s.to_string(),
            OpCosts {
                f: Some(f + a),
                b: Some(b + a),
                w: Some(w),
                bw: Some(bw + a),
                fb: Some(fb),
            },
        );
    }
    c
}

/// A spec of the standard library, elaborated at one size.
pub struct SpecInstance {
    /// File stem (`zb_h1`).
    pub name: String,
    /// The schedule.
    pub sched: Sched,
    /// Its pipeline.
    pub pipeline: Pipeline,
    /// The spec's text and the instance's overrides, to elaborate it again as `schedc sim`
    /// does ([`SpecInstance::program_under`]).
    text: String,
    overrides: Overrides,
}

impl SpecInstance {
    /// The spec's program at this instance with a `list` block scheduled under `cost` (as
    /// `schedc sim --cost` schedules it), or under unit op times with `None`.
    ///
    /// Errors: the spec does not elaborate under that cost (its message).
    pub fn program_under(&self, cost: Option<&CostModel>) -> Result<schedc_ir::Program, String> {
        let unit = CostModel::default();
        schedc::input::load_spec_with(&self.text, &self.overrides, cost.unwrap_or(&unit))
            .map(|e| e.program)
            .map_err(|e| match e {
                LoadError::Spec { diags, .. } => diags
                    .into_iter()
                    .next()
                    .map(|d| d.message)
                    .unwrap_or_default(),
                LoadError::Parse(p) => p.message,
                LoadError::Io(m) | LoadError::Usage(m) => m,
            })
    }
}

/// Every spec in `dir` that accepts P and M (specs whose V is free get `vpp`), sorted by
/// name. Specs that are refused, do not elaborate or use MoE parts are left out
/// ([`load_specs_noting`] says why).
pub fn load_specs(dir: &Path, pp: u32, mb: u32, vpp: u32) -> Vec<SpecInstance> {
    load_specs_noting(dir, pp, mb, vpp, None).specs
}

/// What [`load_specs_noting`] found.
pub struct SpecLoad {
    /// The specs that accept the instance, sorted by name.
    pub specs: Vec<SpecInstance>,
    /// One sentence per spec left out for a reason other than its `require`s or MoE parts
    /// (it does not parse, cannot be read or elaborated, or the deadline came first), and
    /// one for a directory without specs.
    pub notes: Vec<String>,
}

/// The files `*.sched` in `dir`, sorted; an unreadable directory has none.
fn spec_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<std::path::PathBuf> = match std::fs::read_dir(dir) {
        Ok(d) => d
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "sched"))
            .collect(),
        Err(_) => return Vec::new(),
    };
    files.sort();
    files
}

/// Loads one spec at P, M (V = `vpp` when the spec leaves it free): `Ok(None)` when a
/// `require` refuses the instance or it has MoE parts, `Err` with a located sentence when
/// it cannot be read, parsed or elaborated.
fn load_one(f: &Path, pp: u32, mb: u32, vpp: u32) -> Result<Option<SpecInstance>, String> {
    let shown = f.display().to_string();
    let text = std::fs::read_to_string(f).map_err(|e| format!("cannot be read: {e}"))?;
    let name = f
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("?")
        .to_string();
    let fixed_v = schedc::dsl::parse_file(&text)
        .map(|p| {
            p.items
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
    match load_spec(&text, &ov) {
        Ok(e) => Ok(Sched::from_program(&e.program).ok().map(|sc| SpecInstance {
            name,
            sched: sc,
            pipeline: e.program.pipeline,
            text,
            overrides: ov,
        })),
        Err(LoadError::Spec { refused: true, .. }) => Ok(None),
        Err(LoadError::Spec { diags, text, .. }) => {
            let syntax = diags.iter().any(|d| d.code == schedc::diag::Code::Syntax);
            let first = diags
                .into_iter()
                .find(|d| d.severity == schedc::diag::Severity::Error)
                .map(|mut d| {
                    d.locate(&shown, &text);
                    match d.location {
                        Some(l) => format!("{l}: {}", d.message),
                        None => d.message,
                    }
                })
                .unwrap_or_default();
            Err(if syntax {
                format!("it does not parse: {first}")
            } else {
                format!("it does not elaborate at P = {pp}, M = {mb}: {first}")
            })
        }
        Err(LoadError::Parse(p)) => Err(format!(
            "it does not parse: {shown}:{}:{}: {}",
            p.line, p.col, p.message
        )),
        Err(LoadError::Io(m)) | Err(LoadError::Usage(m)) => Err(m),
    }
}

/// [`load_specs`], saying what it leaves out: a spec that does not parse or elaborate (as
/// `schedc compare` lists it under "failed"), a directory without `*.sched` files, and,
/// with a `deadline`, the specs not elaborated by then. The specs are elaborated on a
/// thread of their own, one after the other; at the deadline the ones not done are left
/// out (the one being elaborated finishes in the background: elaboration cannot be
/// interrupted, and its result is dropped). A spec refused by its `require`s, or with MoE
/// parts, is left out silently.
pub fn load_specs_noting(
    dir: &Path,
    pp: u32,
    mb: u32,
    vpp: u32,
    deadline: Option<std::time::Instant>,
) -> SpecLoad {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    let files = spec_files(dir);
    let mut notes = Vec::new();
    if files.is_empty() {
        if dir.is_dir() {
            notes.push(format!(
                "`{}` holds no `*.sched` file: no spec is compared",
                dir.display()
            ));
        }
        return SpecLoad {
            specs: Vec::new(),
            notes,
        };
    }
    // Specs scheduled by a `list` block take far longer to elaborate at large P (about
    // cubic: `v_half` 0.7 s at P = 128, 44 s at 500): the others first, so that a deadline
    // leaves out the slow ones rather than whatever sorts last.
    let mut files = files;
    files.sort_by_key(|f| {
        let list = std::fs::read_to_string(f)
            .ok()
            .and_then(|t| schedc::dsl::parse_file(&t).ok())
            .is_some_and(|p| {
                p.items
                    .iter()
                    .any(|i| matches!(i, schedc::dsl::ast::Item::List(..)))
            });
        (list, f.clone())
    });
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let files = files.clone();
        let stop = stop.clone();
        // The elaborator recurses on the spec's syntax: the CLI's own stack size.
        std::thread::Builder::new()
            .name("load-specs".into())
            .stack_size(256 << 20)
            .spawn(move || {
                for f in files {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let r = load_one(&f, pp, mb, vpp);
                    if tx.send(r).is_err() {
                        break;
                    }
                }
            })
    };
    let mut specs = Vec::new();
    if worker.is_err() {
        // No thread to spare: elaborate here, without the deadline.
        for f in &files {
            match load_one(f, pp, mb, vpp) {
                Ok(Some(s)) => specs.push(s),
                Ok(None) => {}
                Err(e) => notes.push(format!("spec `{}` is not compared: {e}", f.display())),
            }
        }
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        return SpecLoad { specs, notes };
    }
    for (k, f) in files.iter().enumerate() {
        let got = match deadline {
            Some(d) => rx
                .recv_timeout(d.saturating_duration_since(std::time::Instant::now()))
                .ok(),
            None => rx.recv().ok(),
        };
        match got {
            Some(Ok(Some(s))) => specs.push(s),
            Some(Ok(None)) => {}
            Some(Err(e)) => notes.push(format!("spec `{}` is not compared: {e}", f.display())),
            None => {
                stop.store(true, Ordering::Relaxed);
                let left: Vec<String> = files[k..]
                    .iter()
                    .map(|f| {
                        f.file_stem()
                            .map(|s| s.to_string_lossy().into_owned())
                            .unwrap_or_default()
                    })
                    .collect();
                notes.push(format!(
                    "not compared, not elaborated at P = {pp}, M = {mb} within the time given to loading specs (half of --time-limit): {}",
                    left.join(", ")
                ));
                break;
            }
        }
    }
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    SpecLoad { specs, notes }
}
