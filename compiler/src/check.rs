//! The check pipeline: passes 1-7 in order over one program, every error collected.

use crate::diag::{Code, Diagnostic};
use crate::passes::{
    deadlock, deps, liveness, lower, makespan, memory, warmup, wellformed, Ctx, OpIndex, Pos,
};
use schedc_ir::text::{SourceMap, Span};
use schedc_ir::{PlacementKind, Program};
use serde::Serialize;

/// Options of `schedc check`.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Communication semantics for pass 4.
    pub semantics: deadlock::Semantics,
    /// Reject a rank whose peak live activations exceed this (stage-microbatch units).
    pub max_activations: Option<u64>,
}

/// `accepted` or `rejected`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// No error.
    Accepted,
    /// At least one error.
    Rejected,
}

/// Per-rank facts.
#[derive(Clone, Debug, Serialize)]
pub struct RankReport {
    /// The rank.
    pub rank: u32,
    /// Forwards before the first backward (torch's `warmup[r]`).
    pub warmup: u64,
    /// Steady-state compute ops.
    pub steady: u64,
    /// Cooldown compute ops.
    pub cooldown: u64,
    /// Peak live activations (stage-microbatch units).
    pub peak_activations: u64,
    /// Position where the peak is first reached.
    pub peak_at: Option<usize>,
    /// Peak activations offloaded to host memory (stage-microbatch units; 0 without
    /// `OFFLOAD`). `peak_activations` counts device units only. JSON: present only when
    /// the rank offloads.
    #[serde(skip_serializing_if = "is_zero")]
    pub peak_host_activations: u64,
    /// Compute ops on the rank (an overlapped pair counts 2).
    pub ops: u64,
    /// Communication ops on the rank (after lowering, for compute-only input).
    pub comm_ops: u64,
    /// Unit-time idle (F=B=W=1, BW=2); `null` if the order admits no execution.
    pub idle: Option<f64>,
    /// Warmup of each stage the rank holds. JSON: `[{"stage": s, "warmup": w}, ...]`.
    #[serde(serialize_with = "ser_stage_warmup")]
    pub stage_warmup: Vec<(u32, u64)>,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

fn ser_stage_warmup<S: serde::Serializer>(v: &[(u32, u64)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(Some(v.len()))?;
    for (stage, w) in v {
        seq.serialize_element(&serde_json::json!({"stage": stage, "warmup": w}))?;
    }
    seq.end()
}

/// The result of `schedc check`.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Accepted or rejected.
    pub verdict: Verdict,
    /// P.
    pub pp: u32,
    /// S (stage ids; both directions for DualPipe).
    pub stages: u32,
    /// Micro-batches in one step (both directions for DualPipe).
    pub microbatches: u32,
    /// Placement kind.
    pub placement: PlacementKind,
    /// Rank of each stage.
    pub stage_to_rank: Vec<u32>,
    /// True if the input had no sends or receives and pass 3 inserted them.
    pub lowered: bool,
    /// Unit-time makespan; `null` if the order admits no execution.
    pub makespan: Option<f64>,
    /// Unit-time bubble fraction in the `from_start` convention: idle / (busy + idle) over
    /// all ranks, every rank charged from time 0 to the makespan.
    pub bubble: Option<f64>,
    /// The convention of `bubble`: always `from_start` (the simulator reports the others).
    pub bubble_convention: crate::sim::Convention,
    /// Per-rank facts.
    pub ranks: Vec<RankReport>,
    /// Every error and warning, in pass order.
    pub diagnostics: Vec<Diagnostic>,
}

/// The outcome: the report and, for compute-only input, the lowered program.
pub struct Outcome {
    /// The report.
    pub report: Report,
    /// The program that pass 4 checked (the lowered one for compute-only input).
    pub checked: Option<Program>,
}

/// The most (stage, micro-batch) pairs a schedule may have: the passes keep tables of that
/// size (a production schedule has well under a million; a typo such as
/// `microbatches 4000000000` must not exhaust memory).
pub const MAX_STAGE_MICROBATCHES: u64 = 1 << 22;

/// Merges errors that one source statement causes once per micro-batch (a spec's loop body
/// emits many ops from one statement): errors of the same code whose primary and related
/// spans are all equal become one, whose notes list the others (the first five, then a
/// count). Errors without a span (or with distinct spans, as in IR text, where every op has
/// its own) are kept as they are.
fn group_repeats(diags: Vec<Diagnostic>) -> Vec<Diagnostic> {
    type Key = (Code, (u32, u32), Vec<Option<(u32, u32)>>);
    let sp = |s: Span| (s.start, s.len);
    let key = |d: &Diagnostic| -> Option<Key> {
        Some((
            d.code,
            sp(d.span?),
            d.related.iter().map(|(l, _)| l.span.map(sp)).collect(),
        ))
    };
    let mut out: Vec<Diagnostic> = Vec::with_capacity(diags.len());
    let mut first_of: std::collections::HashMap<Key, (usize, usize)> =
        std::collections::HashMap::new();
    for d in diags {
        match key(&d) {
            Some(k) if d.is_error() => match first_of.get_mut(&k) {
                Some((at, more)) => {
                    *more += 1;
                    if *more <= 5 {
                        let what = match (d.rank, d.position, &d.op) {
                            (Some(r), Some(p), Some(op)) => {
                                format!("{} (rank {r}, position {p}, `{op}`)", d.message)
                            }
                            _ => d.message.clone(),
                        };
                        out[*at]
                            .notes
                            .push(format!("the same statement also: {what}"));
                    }
                }
                None => {
                    first_of.insert(k, (out.len(), 0));
                    out.push(d);
                }
            },
            _ => out.push(d),
        }
    }
    let mut groups: Vec<&(usize, usize)> = first_of.values().collect();
    groups.sort();
    for (at, more) in groups {
        if *more > 5 {
            out[*at]
                .notes
                .push(format!("... and {} more like these", more - 5));
        }
        if *more > 0 {
            let d = &mut out[*at];
            d.message = format!("{} ({} more like it from this statement)", d.message, more);
        }
    }
    out
}

/// Runs every pass. `spans` locates the program's instructions in its source file.
///
/// A schedule with more than [`MAX_STAGE_MICROBATCHES`] (stage, micro-batch) pairs, or whose
/// placement does not list one rank per stage, is rejected with one `range` error before any
/// pass runs.
pub fn check(p: &Program, spans: Option<&SourceMap>, opts: &Options) -> Outcome {
    let cx = Ctx { program: p, spans };
    let mut diags: Vec<Diagnostic> = Vec::new();
    let pl = &p.pipeline;
    let pairs = pl.stages as u64 * pl.microbatches as u64;
    if pairs > MAX_STAGE_MICROBATCHES || pl.stage_to_rank.len() != pl.stages as usize {
        let msg = if pairs > MAX_STAGE_MICROBATCHES {
            format!(
                "the schedule is too large to check: {} stages x {} micro-batches = {pairs} (stage, micro-batch) pairs, more than {MAX_STAGE_MICROBATCHES}",
                pl.stages, pl.microbatches
            )
        } else {
            format!(
                "the placement lists {} ranks for {} stages",
                pl.stage_to_rank.len(),
                pl.stages
            )
        };
        diags.push(Diagnostic::error(Code::Range, msg));
        return Outcome {
            report: Report {
                verdict: Verdict::Rejected,
                pp: pl.pp,
                stages: pl.stages,
                microbatches: pl.total_microbatches(),
                placement: pl.placement,
                stage_to_rank: pl.stage_to_rank.clone(),
                lowered: false,
                makespan: None,
                bubble: None,
                bubble_convention: crate::sim::Convention::FromStart,
                ranks: Vec::new(),
                diagnostics: diags,
            },
            checked: None,
        };
    }
    let idx = OpIndex::build(p);
    // Pass 1.
    let wf = wellformed::check(p, &idx);
    let structural = wf.iter().any(|e| {
        matches!(
            e,
            wellformed::WfError::Range { .. } | wellformed::WfError::RankCount { .. }
        )
    });
    diags.extend(wf.iter().map(|e| e.to_diagnostic(&cx)));
    // Pass 2.
    diags.extend(deps::check(p, &idx).iter().map(|e| e.to_diagnostic(&cx)));
    // Passes 3 and 4.
    // Collectives alone do not make a program lowered: its messages still need inserting.
    let compute_only = !p.has_p2p();
    let lowerable = p.ranks.len() == p.pipeline.pp as usize && !structural;
    // The unit-time schedule, computed once for the lowering (pass 3) and pass 7.
    let unit = if (compute_only && lowerable) || wf.is_empty() {
        makespan::unit_timing(p)
    } else {
        None
    };
    let mut checked = None;
    if lowerable {
        let target = if compute_only {
            match lower::lower_with(p, unit.as_ref()) {
                Ok(l) => Some(l),
                Err(lower::LowerError::Cycle(steps))
                    if steps.len() == 1 && diags.iter().any(|d| d.code == Code::Order) =>
                {
                    // A rank waiting for its own later op: the order error above says it.
                    None
                }
                Err(lower::LowerError::Cycle(steps)) => {
                    let ranks: std::collections::BTreeSet<u32> =
                        steps.iter().map(|s| s.at.rank).collect();
                    let msg = if ranks.len() == 1 {
                        format!(
                            "no execution exists: rank {} waits for an op it runs only later",
                            steps[0].at.rank
                        )
                    } else {
                        format!(
                            "no execution exists: ranks {} each wait for a compute op that the next one has queued behind its own",
                            ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
                        )
                    };
                    let mut d = Diagnostic::error(Code::Deadlock, msg)
                        .at(cx.loc(steps[0].at.rank as usize, steps[0].at.pos as usize));
                    for s in &steps {
                        d = d.with_note(format!(
                            "rank {} is blocked at position {} `{}`: it needs {} from rank {}",
                            s.at.rank,
                            s.at.pos,
                            cx.loc(s.at.rank as usize, s.at.pos as usize).op,
                            s.needs,
                            s.on
                        ));
                    }
                    for s in steps.iter().skip(1) {
                        d = d.with_related(
                            cx.loc(s.at.rank as usize, s.at.pos as usize),
                            format!("rank {} blocked here", s.at.rank),
                        );
                    }
                    diags.push(d);
                    None
                }
                Err(lower::LowerError::Missing(_)) => None, // reported by pass 1
            }
        } else {
            Some(p.clone())
        };
        if let Some(t) = target {
            let errs = deadlock::check(&t, opts.semantics);
            if compute_only {
                // Spans for the lowered program: its own instructions keep theirs, an inserted
                // message takes that of the op that sends or consumes it.
                let lspans = spans
                    .filter(|_| !errs.is_empty())
                    .map(|sm| lowered_spans(p, sm, &t));
                let lcx = Ctx {
                    program: &t,
                    spans: lspans.as_ref(),
                };
                diags.extend(errs.iter().map(|e| {
                    e.to_diagnostic(&lcx)
                        .with_note("positions refer to the lowered program (`schedc convert INPUT --lowered --to ir-text` prints it)")
                }));
            } else {
                diags.extend(errs.iter().map(|e| e.to_diagnostic(&cx)));
            }
            checked = Some(t);
        }
    }
    let mut diags = group_repeats(diags);
    // Passes 5-7.
    let wu = warmup::analyze(p);
    let (live, over) = liveness::analyze(p, opts.max_activations);
    diags.extend(over.iter().map(|e| e.to_diagnostic(&cx)));
    diags.extend(memory::check(p).iter().map(|e| e.to_diagnostic(&cx)));
    // Unit-time figures mean something only for a well-formed schedule that runs to the end
    // (a deadlock leaves no makespan to speak of).
    let deadlocks = diags.iter().any(|d| d.code == Code::Deadlock);
    let ut = if wf.is_empty() && !deadlocks {
        unit.as_ref().map(makespan::from_timing)
    } else {
        None
    };
    let verdict = if diags.iter().any(Diagnostic::is_error) {
        Verdict::Rejected
    } else {
        Verdict::Accepted
    };
    let comm_counts: Vec<u64> = match &checked {
        Some(t) => t
            .ranks
            .iter()
            .map(|r| r.iter().map(|i| i.comms().len() as u64).sum())
            .collect(),
        None => vec![0; p.ranks.len()],
    };
    let ranks = (0..p.ranks.len())
        .map(|r| RankReport {
            rank: r as u32,
            warmup: wu[r].phases.warmup,
            steady: wu[r].phases.steady,
            cooldown: wu[r].phases.cooldown,
            peak_activations: live[r].peak,
            peak_at: live[r].peak_at,
            peak_host_activations: live[r].host_peak,
            ops: p.ranks[r]
                .iter()
                .map(|i| match i {
                    schedc_ir::Instr::Compute(_) => 1,
                    schedc_ir::Instr::Overlap { .. } => 2,
                    _ => 0,
                })
                .sum(),
            comm_ops: comm_counts.get(r).copied().unwrap_or(0),
            idle: ut.as_ref().map(|u| u.idle[r]),
            stage_warmup: wu[r].per_stage.clone(),
        })
        .collect();
    let bubble = ut.as_ref().map(|u| {
        let idle: f64 = u.idle.iter().sum();
        let busy: f64 = u.busy.iter().sum();
        if idle + busy > 0.0 {
            idle / (idle + busy)
        } else {
            0.0
        }
    });
    let pl = &p.pipeline;
    let _ = Pos::NONE;
    Outcome {
        report: Report {
            verdict,
            pp: pl.pp,
            stages: pl.stages,
            microbatches: pl.total_microbatches(),
            placement: pl.placement,
            stage_to_rank: pl.stage_to_rank.clone(),
            lowered: compute_only && checked.is_some(),
            makespan: ut.as_ref().map(|u| u.makespan),
            bubble,
            bubble_convention: crate::sim::Convention::FromStart,
            ranks,
            diagnostics: diags,
        },
        checked,
    }
}

/// Source spans for `lowered`, the lowering of `orig` (pass 3 keeps `orig`'s instructions in
/// order, drops idle slots and inserts sends and receives): each kept instruction gets its
/// own span, a send that of the op before it (its producer), a receive that of the op on its
/// rank that consumes the payload.
fn lowered_spans(orig: &Program, spans: &SourceMap, lowered: &Program) -> SourceMap {
    use schedc_ir::{Comm, Instr, Kind, PayloadKind};
    use std::collections::HashMap;
    let pl = &orig.pipeline;
    let mut out = Vec::with_capacity(lowered.ranks.len());
    for (r, instrs) in lowered.ranks.iter().enumerate() {
        let src: Vec<(usize, &Instr)> = orig
            .ranks
            .get(r)
            .map(|v| {
                v.iter()
                    .enumerate()
                    .filter(|(_, i)| !matches!(i, Instr::Idle))
                    .collect()
            })
            .unwrap_or_default();
        // The first instruction of each op on this rank: (is backward-input, stage, mb).
        let mut first: HashMap<(bool, u32, u32), usize> = HashMap::new();
        for &(pos, ins) in &src {
            ins.for_each_compute(|c| {
                if c.kind != Kind::W {
                    first
                        .entry((c.kind != Kind::F, c.stage, c.mb))
                        .or_insert(pos);
                }
            });
        }
        let mut next = 0;
        let mut last = schedc_ir::text::Span::default();
        let mut v = Vec::with_capacity(instrs.len());
        for ins in instrs {
            let sp = match ins {
                Instr::Comm(Comm::Send { payload, .. }) if !payload.kind.is_stash() => last,
                Instr::Comm(Comm::Recv { payload, .. }) => {
                    let consumer = match payload.kind {
                        PayloadKind::Act => pl.next_stage(payload.stage).map(|s| (false, s)),
                        PayloadKind::Grad => pl.prev_stage(payload.stage).map(|s| (true, s)),
                        // A stash the schedule wrote itself: a kept instruction.
                        PayloadKind::Lend | PayloadKind::Return => None,
                    };
                    if payload.kind.is_stash() {
                        let sp = src
                            .get(next)
                            .and_then(|&(pos, _)| spans.get(r, pos))
                            .unwrap_or(last);
                        next += 1;
                        last = sp;
                        v.push(sp);
                        continue;
                    }
                    consumer
                        .and_then(|(b, s)| first.get(&(b, s, payload.mb)))
                        .and_then(|&pos| spans.get(r, pos))
                        .unwrap_or(last)
                }
                _ => {
                    let sp = src
                        .get(next)
                        .and_then(|&(pos, _)| spans.get(r, pos))
                        .unwrap_or(last);
                    next += 1;
                    last = sp;
                    sp
                }
            };
            v.push(sp);
        }
        out.push(v);
    }
    SourceMap {
        ranks: out,
        expanded: spans.expanded.clone(),
    }
}

/// Checks a spec's expectations against a report: one `expectation` error per `expect`
/// line that fails on some rank, naming the ranks (up to eight) with their figures.
pub fn check_expectations(report: &mut Report, expects: &[crate::dsl::elab::Expectation]) {
    use crate::dsl::ast::ExpectKind;
    for e in expects {
        if e.kind.is_timing() {
            // Evaluated under a cost model: `check_timing_expectations`.
            continue;
        }
        let mut bad: Vec<String> = Vec::new();
        let what = match e.kind {
            ExpectKind::Warmup(_) => "warmup",
            ExpectKind::PeakActivations(_) => "peak activations",
            ExpectKind::Idle(_) => "unit-time idle",
            _ => unreachable!("timing expectations are skipped above"),
        };
        let rel = e.kind.rel();
        for (r, rr) in report.ranks.iter().enumerate() {
            if !e.applies.get(r).copied().unwrap_or(true) {
                // The line's `if` guard does not hold on this rank.
                continue;
            }
            let want = e.values[r];
            let (ok, got) = match e.kind {
                ExpectKind::Warmup(_) => (
                    rel.holds(rr.warmup as f64, want as f64, 0.0),
                    rr.warmup.to_string(),
                ),
                ExpectKind::PeakActivations(_) => (
                    rel.holds(rr.peak_activations as f64, want as f64, 0.0),
                    rr.peak_activations.to_string(),
                ),
                ExpectKind::Idle(_) => match rr.idle {
                    Some(i) => (rel.holds(i, want as f64, 1e-9), i.to_string()),
                    None => (false, "undefined".to_string()),
                },
                _ => unreachable!("timing expectations are skipped above"),
            };
            let rel = rel.as_str();
            if !ok {
                bad.push(format!("rank {r}: {got}, expected {rel} {want}"));
            }
        }
        if bad.is_empty() {
            continue;
        }
        let n = bad.len();
        bad.truncate(8);
        let mut d = Diagnostic::error(
            Code::Expectation,
            format!(
                "{what} does not hold on {n} rank(s): {}{}",
                bad.join("; "),
                if n > 8 { "; ..." } else { "" }
            ),
        );
        d.span = Some(schedc_ir::text::Span {
            start: e.sp.start as u32,
            len: (e.sp.end - e.sp.start) as u32,
        });
        report.diagnostics.push(d);
    }
    if report.diagnostics.iter().any(Diagnostic::is_error) {
        report.verdict = Verdict::Rejected;
    }
}

/// True if some expectation is on the simulated timeline (makespan, bubble, exposed
/// communication): [`check_timing_expectations`] then needs a simulation.
pub fn has_timing_expectations(expects: &[crate::dsl::elab::Expectation]) -> bool {
    expects.iter().any(|e| e.kind.is_timing())
}

/// The names a timing expectation's bound sees for the cost model: seconds of a whole F, B,
/// W, BW (model-wide, scaled like the simulated ops), an unsplit overlapped pair FB, one
/// dispatch and one combine all-to-all (0 when `moe_parts` is false: a schedule without MoE
/// parts issues none), and one point-to-point message `MSG` (latency plus bytes over
/// bandwidth, [`crate::sim::cost::CostModel::message_time`]).
pub fn cost_names(cost: &crate::sim::cost::CostModel, moe_parts: bool) -> Vec<(&'static str, f64)> {
    use schedc_ir::{Compute, Kind, Part};
    // A stage id no per-stage override names: the model-wide times.
    let any = u32::MAX;
    let op = |k: Kind| cost.compute_time(&Compute::new(k, any, 0));
    let f = Compute::new(Kind::F, any, 0);
    let bw = Compute::new(Kind::BW, any, 0);
    let a2a = |p: Part| {
        if !moe_parts {
            return 0.0;
        }
        cost.compute_time(&Compute {
            part: p,
            ..Compute::new(Kind::F, any, 0)
        })
    };
    vec![
        ("F", op(Kind::F)),
        ("B", op(Kind::B)),
        ("W", op(Kind::W)),
        ("BW", op(Kind::BW)),
        ("FB", cost.pair_time(&f, &bw)),
        ("DISPATCH", a2a(Part::Dispatch)),
        ("COMBINE", a2a(Part::Combine)),
        ("MSG", cost.message_time()),
    ]
}

/// Checks a spec's timing expectations (makespan, bubble under a named convention, exposed
/// all-to-all, exposed communication) against a simulation under `cost`: one `expectation`
/// error per failing `expect` line, with the figure and the bound. A bound that cannot be
/// evaluated (an unknown name, a division by zero) is an `expectation` error too, pointing
/// at the expression.
///
/// `sim` is `None` when the schedule could not be simulated (it was rejected): the
/// expectations are then not checked (the rejection says why).
pub fn check_timing_expectations(
    report: &mut Report,
    expects: &[crate::dsl::elab::Expectation],
    sim: Option<&crate::sim::SimResult>,
    cost: &crate::sim::cost::CostModel,
) {
    use crate::dsl::ast::ExpectKind;
    let Some(sim) = sim else { return };
    let names = cost_names(cost, sim.a2a.total > 0.0);
    let span_of = |sp: crate::dsl::ast::Sp| schedc_ir::text::Span {
        start: sp.start as u32,
        len: (sp.end - sp.start) as u32,
    };
    for e in expects {
        let Some(f) = &e.formula else { continue };
        match f.applies(&names) {
            Ok(true) => {}
            // The line's `if` guard does not hold under this cost model.
            Ok(false) => continue,
            Err((sp, msg)) => {
                let mut d = Diagnostic::error(Code::Expectation, msg);
                d.span = Some(span_of(sp));
                report.diagnostics.push(d);
                continue;
            }
        }
        let bound = match f.eval(&names) {
            Ok(b) => b,
            Err((sp, msg)) => {
                let mut d = Diagnostic::error(Code::Expectation, msg);
                d.span = Some(span_of(sp));
                report.diagnostics.push(d);
                continue;
            }
        };
        let (what, got, rel) = match &e.kind {
            ExpectKind::Makespan(r) => ("makespan".to_string(), sim.makespan, *r),
            ExpectKind::Bubble(c, r) => (
                format!("bubble ({} convention)", c.as_str()),
                sim.bubble.get(*c),
                *r,
            ),
            ExpectKind::ExposedA2a(r) => (
                "exposed all-to-all (fraction of the all-to-all time)".to_string(),
                sim.a2a.exposed_fraction(),
                *r,
            ),
            ExpectKind::ExposedComm(r) => (
                "exposed communication (seconds, all ranks)".to_string(),
                sim.ranks.iter().map(|x| x.exposed_comm).sum(),
                *r,
            ),
            _ => continue,
        };
        let tol = 1e-9 * bound.abs().max(got.abs()).max(1e-12);
        let ok = rel.holds(got, bound, tol);
        if !ok {
            let mut d = Diagnostic::error(
                Code::Expectation,
                format!("{what} is {got:.6}, expected {} {bound:.6}", rel.as_str()),
            );
            d.span = Some(span_of(e.sp));
            report.diagnostics.push(d);
        }
    }
    if report.diagnostics.iter().any(Diagnostic::is_error) {
        report.verdict = Verdict::Rejected;
    }
}

/// Simulates `checked` under `cost` and checks the timing expectations, when `expects` has
/// any (otherwise nothing is simulated: `schedc check` stays as fast as the passes). A
/// program that does not simulate leaves the expectations unchecked.
pub fn evaluate_timing_expectations(
    report: &mut Report,
    checked: Option<&Program>,
    expects: &[crate::dsl::elab::Expectation],
    cost: &crate::sim::cost::CostModel,
) {
    if !has_timing_expectations(expects) || report.verdict == Verdict::Rejected {
        return;
    }
    let sim = checked.and_then(|p| crate::sim::simulate(p, cost).ok());
    check_timing_expectations(report, expects, sim.as_ref(), cost);
}

/// Checks a spec's expectations on `before`, the program they describe, where the program
/// checked is another one: the parts reordered by `--moe=...:list` or `:adjacent`
/// ([`crate::input::expectations_program`]). The per-rank ones (warmup, peak activations,
/// unit-time idle) are checked on `before`'s report; the timing ones on its simulation under
/// `cost` (none are checked without a model). The expectation errors go into `report`,
/// which is then rejected. A `before` that does not pass the passes (it should: it is the
/// spec's own order) adds a warning that the expectations were not checked.
pub fn check_expectations_on(
    report: &mut Report,
    before: &Program,
    expects: &[crate::dsl::elab::Expectation],
    cost: Option<&crate::sim::cost::CostModel>,
) {
    if expects.is_empty() {
        return;
    }
    let mut out = check(before, None, &Options::default());
    if out.report.verdict != Verdict::Accepted {
        let mut d = Diagnostic::error(
            Code::Expectation,
            "the spec's expectations were not checked: its own order (plain `--moe`) does not pass `schedc check`",
        );
        d.severity = crate::diag::Severity::Warning;
        report.diagnostics.push(d);
        return;
    }
    check_expectations(&mut out.report, expects);
    if let (Some(cost), Some(prog)) = (cost, out.checked.as_ref()) {
        if has_timing_expectations(expects) {
            let sim = crate::sim::simulate(prog, cost).ok();
            check_timing_expectations(&mut out.report, expects, sim.as_ref(), cost);
        }
    }
    let failed: Vec<Diagnostic> = out
        .report
        .diagnostics
        .into_iter()
        .filter(|d| d.is_error() && d.code == Code::Expectation)
        .collect();
    if !failed.is_empty() {
        report.diagnostics.extend(failed);
        report.verdict = Verdict::Rejected;
    }
}

/// Bytes in binary gigabytes (`--max-memory 80G` is 80 x 2^30 bytes: the cap and the peaks
/// compared with it are printed in the unit the flag takes).
fn gib(b: f64) -> String {
    format!("{:.1} GiB", b / (1u64 << 30) as f64)
}

/// Bytes as `N.N GB` (10^9 bytes), the unit of `schedc sim`'s report.
fn gb(b: f64) -> String {
    format!("{:.1} GB", b / 1e9)
}

/// Errors for a simulated program that does not fit its memory budgets (issue 27): one per
/// rank whose peak device memory (`peak_memory_bytes`) exceeds `max_memory` bytes
/// (`--max-memory`), and one at the first `OFFLOAD` of each rank that takes its host memory
/// over `[memory] host_bytes` ([`crate::sim::SimResult::host_overflows`]).
///
/// `simulated` is the program `res` simulated: `orig` itself, or its lowering (then an
/// `OFFLOAD`'s position is mapped back to `orig`'s by counting equal instructions before it on
/// the rank); `spans` locates `orig`'s instructions.
pub fn memory_budget_diagnostics(
    orig: &Program,
    spans: Option<&SourceMap>,
    simulated: &Program,
    res: &crate::sim::SimResult,
    max_memory: Option<u64>,
) -> Vec<Diagnostic> {
    let cx = Ctx {
        program: orig,
        spans,
    };
    let mut out = Vec::new();
    if let Some(cap) = max_memory {
        for r in res
            .ranks
            .iter()
            .filter(|r| r.peak_memory_bytes > cap as f64)
        {
            let mut d = Diagnostic::error(
                Code::Memory,
                format!(
                    "rank {} needs {} of device memory at its peak ({} bytes), over the --max-memory cap of {} ({cap} bytes)",
                    r.rank,
                    gib(r.peak_memory_bytes),
                    r.peak_memory_bytes.round() as u64,
                    gib(cap as f64),
                ),
            )
            .with_help("offload or recompute activations, or use a schedule that holds fewer micro-batches");
            d.rank = Some(r.rank);
            out.push(d);
        }
    }
    for o in &res.host_overflows {
        let r = o.rank as usize;
        let pos = source_position(orig, simulated, r, o.pos as usize);
        let mut d = Diagnostic::error(
            Code::Memory,
            format!(
                "rank {} step {}: OFFLOAD({},{}) needs {} of host memory, {} already offloaded, over the host budget of {}",
                o.rank,
                pos.unwrap_or(o.pos as usize),
                o.stage,
                o.mb,
                gb(o.needs),
                gb(o.held),
                gb(o.budget)
            ),
        )
        .with_note(format!(
            "{} + {} bytes > [memory] host_bytes = {}",
            o.held.round() as u64,
            o.needs.round() as u64,
            o.budget.round() as u64
        ))
        .with_help("reload or recompute earlier offloads before this one, or raise host_bytes");
        match pos {
            Some(p) => d = d.at(cx.loc(r, p)),
            None => d.rank = Some(o.rank),
        }
        out.push(d);
    }
    out
}

/// The position in `orig` of instruction `pos` of rank `r` of `simulated` (equal to `orig` or
/// its lowering, which keeps `orig`'s instructions in order): the same occurrence of an equal
/// instruction. `None` if `orig` has no such instruction.
fn source_position(orig: &Program, simulated: &Program, r: usize, pos: usize) -> Option<usize> {
    let sim = simulated.ranks.get(r)?;
    let ins = sim.get(pos)?;
    let nth = sim[..pos].iter().filter(|i| *i == ins).count();
    orig.ranks
        .get(r)?
        .iter()
        .enumerate()
        .filter(|(_, i)| *i == ins)
        .nth(nth)
        .map(|(p, _)| p)
}
