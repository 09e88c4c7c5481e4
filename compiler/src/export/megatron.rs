//! Megatron-LM's flags for a schedule Megatron-Core runs (`schedc convert --to megatron`).
//!
//! Megatron-Core runs three pipeline schedules, chosen by its flags rather than described
//! op by op (NVIDIA/Megatron-LM @d98e8a64, `megatron/core/pipeline_parallel/schedules.py`):
//!
//! - **1F1B** (`forward_backward_pipelining_without_interleaving`; without pipelining,
//!   `forward_backward_no_pipelining`): warmup `P - 1 - r` forwards, then one forward and one
//!   backward — the order of `specs/1f1b.sched`;
//! - **interleaved 1F1B** (`forward_backward_pipelining_with_interleaving`, V model chunks
//!   per rank, `--num-virtual-stages-per-pipeline-rank` or a layout of `P V` stages): groups
//!   of `g` micro-batches per chunk (`get_schedule_table`, `g` from
//!   `--microbatch-group-size-per-virtual-pipeline-stage`, default P, which must lie in
//!   `[P, M]`), warmup `2 (P - 1 - r) + (V - 1) g` — the order of
//!   `specs/interleaved_1f1b.sched` with `g = M / max(1, M / P)`;
//! - **combined 1F1B** (`--overlap-moe-expert-parallel-comm --delay-wgrad-compute`): the
//!   interleaved schedule with `g = P`, one more warmup forward, and each steady-state forward
//!   issued with a backward as one overlapped pair — the order of
//!   `specs/interleaved_1f1b_a2a.sched`.
//!
//! [`detect`] finds which one a program is by comparing its compute order, rank by rank, with
//! the standard spec's at the same P, M and V (not by name: a schedule written by hand, a
//! CSV or IR text is recognised the same way); [`export`] writes the flags.

use super::{model_chunks, ExportError};
use crate::input::{load_spec, Overrides};
use schedc_ir::{Compute, Instr, Kind, Part, PlacementKind, Program};

/// A schedule Megatron-Core runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// 1F1B, one model chunk per rank.
    OneFOneB,
    /// Interleaved 1F1B, `group` micro-batches at a time on each virtual stage
    /// (`--microbatch-group-size-per-virtual-pipeline-stage`).
    Interleaved {
        /// Micro-batches run together on one virtual stage before the next.
        group: u32,
    },
    /// Interleaved 1F1B with the expert-parallel all-to-all overlapped (combined 1F1B).
    CombinedA2A,
}

impl Schedule {
    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::OneFOneB => "1F1B",
            Schedule::Interleaved { .. } => "interleaved 1F1B",
            Schedule::CombinedA2A => "combined 1F1B with EP all-to-all overlap",
        }
    }
}

/// What [`export`] needs beyond the program.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Transformer layers of the model (`--num-layers`); with it the export writes
    /// `--pipeline-model-parallel-layout`.
    pub layers: Option<u32>,
    /// A Megatron-LM layout string to use instead of schedc's split (needs `layers`).
    pub layout: Option<String>,
    /// Sequences per micro-batch (`--micro-batch-size`); 1 when `None`.
    pub micro_batch_size: Option<u64>,
    /// Data-parallel replicas, for `--global-batch-size`; 1 when `None`.
    pub dp: Option<u32>,
}

/// One step of a rank's compute order: an op, or an overlapped forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    One(Compute),
    Pair(Compute, Compute),
}

fn op_text(c: &Compute) -> String {
    let mut s = String::new();
    schedc_ir::text::write_compute(&mut s, c);
    s
}

fn step_text(s: Option<&Step>) -> String {
    match s {
        None => "nothing (the rank's end)".into(),
        Some(Step::One(c)) => op_text(c),
        Some(Step::Pair(f, b)) => format!("{} & {}", op_text(f), op_text(b)),
    }
}

/// The compute order of every rank (communication and gradient reductions left out).
fn compute_order(p: &Program) -> Vec<Vec<Step>> {
    p.ranks
        .iter()
        .map(|r| {
            r.iter()
                .filter_map(|i| match i {
                    Instr::Compute(c) => Some(Step::One(*c)),
                    Instr::Overlap { fwd, bwd } => Some(Step::Pair(*fwd, *bwd)),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// The first place two compute orders differ: (rank, step index).
fn first_difference(a: &[Vec<Step>], b: &[Vec<Step>]) -> Option<(usize, usize)> {
    for (r, (x, y)) in a.iter().zip(b).enumerate() {
        let n = x.len().max(y.len());
        for i in 0..n {
            if x.get(i) != y.get(i) {
                return Some((r, i));
            }
        }
    }
    None
}

/// The standard specs Megatron-Core's schedules are: (spec name, schedule) for V model
/// chunks per rank.
fn candidates(v: u32) -> Vec<(&'static str, Schedule)> {
    if v == 1 {
        vec![
            ("1f1b", Schedule::OneFOneB),
            ("interleaved_1f1b_a2a", Schedule::CombinedA2A),
        ]
    } else {
        vec![
            ("interleaved_1f1b", Schedule::Interleaved { group: 0 }),
            ("interleaved_1f1b_a2a", Schedule::CombinedA2A),
        ]
    }
}

/// Which of Megatron-Core's schedules `p` is.
///
/// Errors ([`ExportError::Unsupported`], with the reason): DualPipe's bidirectional placement,
/// a placement other than Megatron's loop (model chunk `k` on rank `k mod P`), MoE parts,
/// weight gradients split from the input backward (zero-bubble `B`/`W`), a compute order that
/// equals none of `specs/1f1b.sched`, `specs/interleaved_1f1b.sched` and
/// `specs/interleaved_1f1b_a2a.sched` at the program's P, M and V (the message names the
/// first rank and op where it differs from each), and what Megatron-Core refuses of an
/// order that matches: virtual stages without pipelining, an interleaved schedule with
/// fewer micro-batches than ranks.
pub fn detect(p: &Program) -> Result<Schedule, ExportError> {
    let pl = &p.pipeline;
    let unsupported = |s: String| Err(ExportError::Unsupported(s));
    if pl.placement == PlacementKind::Bidir {
        return unsupported("the schedule runs two copies of every stage in opposite directions (a bidirectional placement, as DualPipe's): Megatron-Core pipelines one direction only".into());
    }
    // Memory ops and lent stashes (issue 27) have no Megatron-Core argument: its schedules
    // keep every stash on its rank, and its --recompute-* flags recompute inside every layer
    // of every micro-batch, not the forwards this schedule picks.
    let moves = p.ranks.iter().enumerate().find_map(|(r, ins)| {
        ins.iter().find_map(|i| {
            let mut ck = false;
            i.for_each_compute(|c| ck |= c.checkpoint);
            let stash = |c: &schedc_ir::Comm| match c {
                schedc_ir::Comm::Send { payload, .. } | schedc_ir::Comm::Recv { payload, .. } => {
                    payload.kind.is_stash()
                }
                schedc_ir::Comm::Collective(_) => false,
            };
            let lends = match i {
                schedc_ir::Instr::Comm(c) => stash(c),
                schedc_ir::Instr::Group(g) => g.iter().any(stash),
                _ => false,
            };
            (ck || lends || matches!(i, schedc_ir::Instr::Mem(_)))
                .then(|| (r, schedc_ir::text::instr_to_string(i)))
        })
    });
    if let Some((r, op)) = moves {
        return unsupported(format!(
            "the program moves or recomputes activations (rank {r}: `{op}`; OFFLOAD, RELOAD, RECOMPUTE, F(s,m)!, LEND and RETURN): Megatron-Core's schedules keep every activation on its rank and its --recompute-* flags recompute every micro-batch alike, so the export would not be this schedule; export it without memory ops"
        ));
    }
    let (pp, s, m) = (pl.pp, pl.stages, pl.microbatches);
    if pp == 0 || !s.is_multiple_of(pp) {
        return unsupported(format!(
            "{s} stages on {pp} ranks: Megatron-Core gives every rank the same number of model chunks"
        ));
    }
    let v = s / pp;
    if let Some(st) = (0..s).find(|&st| pl.stage_to_rank[st as usize] != st % pp) {
        return unsupported(format!(
            "stage {st} is on rank {}, but Megatron-Core places model chunk k on rank k mod P ({}, the loop placement); a V-shaped or other placement (ZB-V, DualPipeV, ...) is not one it runs",
            pl.stage_to_rank[st as usize],
            st % pp
        ));
    }
    let order = compute_order(p);
    let ops = || {
        order.iter().flatten().flat_map(|s| match s {
            Step::One(c) => vec![*c],
            Step::Pair(f, b) => vec![*f, *b],
        })
    };
    if let Some(c) = ops().find(|c| c.part != Part::Whole) {
        return unsupported(format!(
            "the program splits MoE stages into parts ({}): Megatron-Core orders a layer's attention, dispatch, experts and combine inside its own overlapped pair; export the schedule without --moe",
            op_text(&c)
        ));
    }
    if let Some(c) = ops().find(|c| matches!(c.kind, Kind::B | Kind::W)) {
        return unsupported(format!(
            "the program splits a backward into its input and weight gradients ({}, zero-bubble B and W): Megatron-Core runs whole backwards (its --delay-wgrad-compute moves a weight gradient only inside the combined 1F1B pair)",
            op_text(&c)
        ));
    }
    let mut why = Vec::new();
    for (name, sched) in candidates(v) {
        let text = crate::specs::get(name).expect("a standard spec");
        let ov = Overrides {
            pp: Some(pp),
            microbatches: Some(m),
            vpp: (name != "1f1b").then_some(v),
            ..Default::default()
        };
        let std_order = match load_spec(text, &ov) {
            Ok(e) => compute_order(&e.program),
            Err(crate::input::LoadError::Spec { diags, .. }) => {
                why.push(format!(
                    "specs/{name}.sched (Megatron-Core's {}) does not run at P={pp}, M={m}, V={v}: {}",
                    sched.name(),
                    diags
                        .first()
                        .map(|d| d.message.clone())
                        .unwrap_or_default()
                ));
                continue;
            }
            Err(_) => continue,
        };
        match first_difference(&order, &std_order) {
            None => return accepted(sched, pp, m, v),
            Some((r, i)) => why.push(format!(
                "it is not Megatron-Core's {} (specs/{name}.sched at P={pp}, M={m}, V={v}): rank {r}'s compute op {} is {} here, {} there",
                sched.name(),
                i + 1,
                step_text(order[r].get(i)),
                step_text(std_order[r].get(i)),
            )),
        }
    }
    unsupported(format!(
        "the schedule is not one Megatron-Core runs: {}",
        why.join("; ")
    ))
}

/// What Megatron-Core refuses of an order that equals one of its schedules.
fn accepted(sched: Schedule, pp: u32, m: u32, v: u32) -> Result<Schedule, ExportError> {
    if v > 1 && pp == 1 {
        return Err(ExportError::Unsupported(format!(
            "{v} model chunks on one rank: Megatron-LM runs virtual pipeline stages only with a pipeline-parallel size above 1 (megatron/training/arguments.py: \"When interleaved schedule is used, pipeline-model-parallel size should be greater than 1\")"
        )));
    }
    match sched {
        Schedule::Interleaved { .. } => {
            if m < pp {
                return Err(ExportError::Unsupported(format!(
                    "Megatron-Core's interleaved 1F1B runs groups of at least P = {pp} micro-batches on each virtual stage (--microbatch-group-size-per-virtual-pipeline-stage must lie in [P, M]), but M = {m}: give at least {pp} micro-batches"
                )));
            }
            Ok(Schedule::Interleaved {
                group: m / (m / pp).max(1),
            })
        }
        s => Ok(s),
    }
}

/// Megatron-LM's flags for `p` as a bash array (`SCHEDC_MEGATRON_ARGS=( ... )`) with a comment
/// saying which schedule it is; `name` names the input in the comment.
///
/// Writes `--pipeline-model-parallel-size`; with [`Options::layers`], `--num-layers` and
/// `--pipeline-model-parallel-layout` (schedc's split or [`Options::layout`]), else
/// `--num-virtual-stages-per-pipeline-rank` for V > 1 (Megatron-LM accepts only one of the
/// two); `--microbatch-group-size-per-virtual-pipeline-stage` where the group is not P;
/// `--micro-batch-size` and `--global-batch-size` (M x micro-batch size x dp, so that
/// Megatron runs M micro-batches per step); for the combined 1F1B,
/// `--overlap-moe-expert-parallel-comm --delay-wgrad-compute`.
///
/// Errors: [`detect`]'s, and [`ExportError::Usage`] for a layout or layer count that does not
/// fit the P V model chunks (or a layout without a layer count).
pub fn export(p: &Program, name: &str, opts: &Options) -> Result<String, ExportError> {
    let sched = detect(p)?;
    let pl = &p.pipeline;
    let (pp, m) = (pl.pp, pl.microbatches);
    let v = pl.stages / pp;
    let mut args: Vec<String> = vec![format!("--pipeline-model-parallel-size {pp}")];
    match (opts.layers, &opts.layout) {
        (None, Some(_)) => {
            return Err(ExportError::Usage(
                "--layout needs the model's layer count: give --layers N or --model".into(),
            ))
        }
        (Some(n), layout) => {
            args.push(format!("--num-layers {n}"));
            if pl.stages > 1 {
                let (_, text) = model_chunks(n, pl.stages, layout.as_deref())?;
                args.push(format!("--pipeline-model-parallel-layout '{text}'"));
            }
        }
        (None, None) => {
            if v > 1 {
                args.push(format!("--num-virtual-stages-per-pipeline-rank {v}"));
            }
        }
    }
    if let Schedule::Interleaved { group } = sched {
        if group != pp {
            args.push(format!(
                "--microbatch-group-size-per-virtual-pipeline-stage {group}"
            ));
        }
    }
    let mbs = opts.micro_batch_size.unwrap_or(1);
    let dp = opts.dp.unwrap_or(1);
    let global = (m as u64)
        .checked_mul(mbs)
        .and_then(|g| g.checked_mul(dp as u64))
        .ok_or_else(|| {
            ExportError::Usage(format!(
                "the global batch, {m} micro-batches x --micro-batch-size {mbs} x --dp {dp}, does not fit 64 bits"
            ))
        })?;
    args.push(format!("--micro-batch-size {mbs}"));
    args.push(format!("--global-batch-size {global}"));
    if sched == Schedule::CombinedA2A {
        args.push("--overlap-moe-expert-parallel-comm".into());
        args.push("--delay-wgrad-compute".into());
    }
    let spec = match sched {
        Schedule::OneFOneB => "specs/1f1b.sched",
        Schedule::Interleaved { .. } => "specs/interleaved_1f1b.sched",
        Schedule::CombinedA2A => "specs/interleaved_1f1b_a2a.sched",
    };
    let mut out = String::new();
    out.push_str(&format!(
        "# Megatron-LM arguments for {name}: Megatron-Core's {} with P={pp}, V={v}, M={m}\n",
        sched.name()
    ));
    out.push_str(&format!(
        "# (every rank's compute order equals {spec} at that size). Written by `schedc convert --to megatron`.\n"
    ));
    out.push_str(&format!(
        "# M = global batch / (micro-batch size x data-parallel size) = {global} / ({mbs} x {dp}).\n"
    ));
    if sched == Schedule::CombinedA2A {
        out.push_str("# The overlap also needs expert parallelism (--expert-model-parallel-size above 1) and\n# --moe-token-dispatcher-type alltoall or flex.\n");
    }
    out.push_str("# Use: source this file; torchrun ... pretrain_gpt.py \"${SCHEDC_MEGATRON_ARGS[@]}\" ...\n");
    out.push_str("SCHEDC_MEGATRON_ARGS=(\n");
    for a in &args {
        out.push_str("    ");
        out.push_str(a);
        out.push('\n');
    }
    out.push_str(")\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron-Core's compute order on rank `r` (a model of schedules.py @d98e8a64:
    /// `get_pp_rank_microbatches` for the warmup, `get_schedule_table` for the interleaved
    /// order, the steady state's forward `k + warmup` issued with backward `k`, combined into
    /// one pair under the overlap), as (forward?, stage, micro-batch, paired with the next).
    fn megatron_order(p: u32, m: u32, v: u32, g: u32, overlap: bool, r: u32) -> Vec<Step> {
        let total = m * v;
        let mut table = Vec::new(); // (mb, chunk)
        if v == 1 {
            table.extend((0..m).map(|mb| (mb, 0)));
        } else {
            let mut lo = 0;
            while lo < m {
                let hi = if lo + g >= m { m } else { lo + g };
                for c in 0..v {
                    for mb in lo..hi {
                        table.push((mb, c));
                    }
                }
                lo += g;
            }
        }
        let mut warmup = if p == 1 {
            0
        } else if v == 1 {
            p - r - 1
        } else {
            2 * (p - r - 1) + (v - 1) * g
        };
        if overlap {
            warmup += 1;
        }
        let warmup = warmup.min(total);
        let f = |k: u32| {
            let (mb, c) = table[k as usize];
            Compute::new(Kind::F, c * p + r, mb)
        };
        let b = |k: u32| {
            let (mb, c) = table[k as usize];
            Compute::new(Kind::BW, (v - 1 - c) * p + r, mb)
        };
        let mut out: Vec<Step> = (0..warmup).map(|k| Step::One(f(k))).collect();
        for k in 0..total - warmup {
            if overlap {
                out.push(Step::Pair(f(k + warmup), b(k)));
            } else {
                out.push(Step::One(f(k + warmup)));
                out.push(Step::One(b(k)));
            }
        }
        out.extend((total - warmup..total).map(|k| Step::One(b(k))));
        out
    }

    fn spec_order(name: &str, p: u32, m: u32, v: Option<u32>) -> Option<Vec<Vec<Step>>> {
        let ov = Overrides {
            pp: Some(p),
            microbatches: Some(m),
            vpp: v,
            ..Default::default()
        };
        load_spec(crate::specs::get(name).unwrap(), &ov)
            .ok()
            .map(|e| compute_order(&e.program))
    }

    #[test]
    fn the_standard_specs_are_megatron_cores_orders() {
        let mut checked = 0;
        for p in 1..=5u32 {
            for m in 1..=12u32 {
                let o = spec_order("1f1b", p, m, None).unwrap();
                for r in 0..p {
                    assert_eq!(
                        o[r as usize],
                        megatron_order(p, m, 1, p, false, r),
                        "1f1b P={p} M={m} r={r}"
                    );
                }
                checked += 1;
                for v in 2..=3u32 {
                    // torch's interleaved order (the spec) needs M a multiple of its rounds.
                    if p > 1 && m >= p && m % (m / p).max(1) == 0 {
                        let g = m / (m / p).max(1);
                        let o = spec_order("interleaved_1f1b", p, m, Some(v)).unwrap();
                        for r in 0..p {
                            assert_eq!(
                                o[r as usize],
                                megatron_order(p, m, v, g, false, r),
                                "interleaved P={p} M={m} V={v} r={r}"
                            );
                        }
                        checked += 1;
                    }
                    if p > 1 && m % p == 0 {
                        let o = spec_order("interleaved_1f1b_a2a", p, m, Some(v)).unwrap();
                        for r in 0..p {
                            assert_eq!(
                                o[r as usize],
                                megatron_order(p, m, v, p, true, r),
                                "a2a P={p} M={m} V={v} r={r}"
                            );
                        }
                        checked += 1;
                    }
                }
                // P = 1: combined_1f1b_schedule_for_no_pipelining (first F alone, then pairs).
                if p == 1 {
                    let o = spec_order("interleaved_1f1b_a2a", 1, m, Some(1)).unwrap();
                    assert_eq!(o[0], megatron_order(1, m, 1, 1, true, 0), "a2a P=1 M={m}");
                }
            }
        }
        assert_eq!(checked, 5 * 12 + 2 * 28 + 2 * (6 + 4 + 3 + 2));
    }
}
