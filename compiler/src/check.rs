//! The check pipeline: passes 1-7 in order over one program, every error collected.

use crate::diag::{Code, Diagnostic};
use crate::passes::{
    deadlock, deps, liveness, lower, makespan, warmup, wellformed, Ctx, OpIndex, Pos,
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
    /// True if the input had no communication and pass 3 inserted it.
    pub lowered: bool,
    /// Unit-time makespan; `null` if the order admits no execution.
    pub makespan: Option<f64>,
    /// Unit-time bubble fraction, idle / (busy + idle) over all ranks.
    pub bubble: Option<f64>,
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
    let compute_only = p.is_compute_only();
    let mut checked = None;
    if p.ranks.len() == p.pipeline.pp as usize && !structural {
        let target = if compute_only {
            match lower::lower(p) {
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
                let lcx = Ctx::new(&t);
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
    // Unit-time figures mean something only for a well-formed schedule.
    let ut = if wf.is_empty() {
        makespan::analyze(p)
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
            ranks,
            diagnostics: diags,
        },
        checked,
    }
}

/// Checks a spec's expectations against a report: one `expectation` error per `expect`
/// line that fails on some rank, naming the ranks (up to eight) with their figures.
pub fn check_expectations(report: &mut Report, expects: &[crate::dsl::elab::Expectation]) {
    use crate::dsl::ast::ExpectKind;
    for e in expects {
        let mut bad: Vec<String> = Vec::new();
        let (what, rel) = match e.kind {
            ExpectKind::Warmup => ("warmup", "=="),
            ExpectKind::PeakActivations => ("peak activations", "<="),
            ExpectKind::PeakActivationsExact => ("peak activations", "=="),
            ExpectKind::Idle => ("unit-time idle", "=="),
        };
        for (r, rr) in report.ranks.iter().enumerate() {
            let want = e.values[r];
            let (ok, got) = match e.kind {
                ExpectKind::Warmup => (rr.warmup as i64 == want, rr.warmup.to_string()),
                ExpectKind::PeakActivations => (
                    rr.peak_activations as i64 <= want,
                    rr.peak_activations.to_string(),
                ),
                ExpectKind::PeakActivationsExact => (
                    rr.peak_activations as i64 == want,
                    rr.peak_activations.to_string(),
                ),
                ExpectKind::Idle => match rr.idle {
                    Some(i) => ((i - want as f64).abs() < 1e-9, i.to_string()),
                    None => (false, "undefined".to_string()),
                },
            };
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
