//! The `--moe` lowering: every F, B and BW of an MoE stage becomes its four parts (attention,
//! dispatch all-to-all, expert MLP, combine all-to-all), so that any schedule — every spec in
//! `specs/`, a torch CSV, a DualPipe trace — charges and overlaps its all-to-alls without being
//! rewritten.
//!
//! ## Part order
//!
//! The chunk split is the DeepSeek-V3 report's (arXiv 2412.19437, §3.2.1): "we divide each
//! chunk into four components: attention, all-to-all dispatch, MLP, and all-to-all combine".
//!
//! * **A plain forward** `F(s,m)`: `attn, dispatch, mlp, combine` — the data order.
//! * **A plain backward** `B(s,m)` or `BW(s,m)`: the mirror, `combine, mlp, dispatch, attn`: the
//!   gradient of combine (a dispatch-shaped all-to-all) first, then the MLP backward, then the
//!   gradient of dispatch (combine-shaped), then the attention backward.
//! * **An overlapped pair** `F(s,m)&B(t,k)` (DualPipe's F&B chunk, torch's `OVERLAP_F_B`) with
//!   both stages MoE, eight parts in the order of the report's Figure 4 ("overlapping strategy
//!   for a pair of individual forward and backward chunks"), the order Megatron-Core's
//!   `combined_1f1b` also uses:
//!
//!   ```text
//!   B.combine  F.attn  F.dispatch  B.mlp  B.dispatch  F.mlp  F.combine  B.attn
//!   ```
//!
//!   On the compute stream that is `F.attn, B.mlp, F.mlp, B.attn`; on the expert-parallel
//!   stream `B.combine, F.dispatch, B.dispatch, F.combine`; each all-to-all runs under the
//!   other chunk's compute: B's combine under F's attention, F's dispatch under B's MLP, B's
//!   dispatch under F's MLP, F's combine under B's attention. With every all-to-all no longer
//!   than the part it hides under, the pair takes exactly its compute time.
//! * A pair with one MoE op and one dense op keeps the dense op whole and hides one
//!   all-to-all under it: `F.attn F.dispatch B F.mlp F.combine` (dense backward) or
//!   `B.combine F B.mlp B.dispatch B.attn` (dense forward). A pair of one op's own forward and
//!   backward (the loss stage) runs its forward's parts, then its backward's.
//! * `W` stays whole (it has no all-to-all); ops already given in parts are kept as written.
//!
//! Dense stages (those not in the MoE set) are kept whole. Sends and receives keep their
//! places: a send written after an op follows its last part, a receive before it precedes its
//! first. Each part keeps the source span of the op it comes from, so a check error in a part
//! points at the spec statement that emitted the op.
//!
//! ## Interleaving consecutive plain ops (`--moe=STAGES:adjacent`, opt-in)
//!
//! By default ([`Interleave::None`]) a plain op runs its four parts back to back and the next
//! op starts after its last all-to-all: only `&` pairs overlap. With
//! [`Interleave::Adjacent`], each run of consecutive whole ops on a rank (no pair, no
//! communication op between them; `W` and dense ops included, as one part each) is emitted in
//! the order of a two-stream list schedule at unit durations (a part 1, a whole op 2): compute
//! parts on the compute stream, all-to-alls on the EP stream, each part after its op's
//! previous part, at most two ops in flight (op `k + 2` starts after op `k` ends), ties to an
//! op's first part, then to the earlier op. So op `k + 1`'s attention can run while op `k`'s
//! dispatch is in flight, and a backward's first all-to-all under the previous op's compute;
//! each stream keeps a fixed order, which is what a runtime with one compute and one EP stream
//! per rank executes. For example two forwards on a rank whose inputs are there:
//!
//! ```text
//! F(0,0).attn F(0,1).attn F(0,0).dispatch F(0,0).mlp F(0,1).dispatch F(0,0).combine F(0,1).mlp F(0,1).combine
//! ```
//!
//! Part orders are therefore no longer per-op blocks: a back end must follow the parts in
//! program order, each after its op's previous part, and not assume that an op's parts are
//! contiguous (an `&` pair's already were not). The CPU back end's lowering
//! (`backends/program/src/lower.rs`) groups interleaved parts into windows that close when
//! every op begun in them is complete; a rolling interleave can keep a window open for a
//! whole warmup, so the lowering runs a forward's tail (and, with several layers per stage,
//! its remaining layers) before a later op's wait for a receive that its rank posts after the
//! forward's send; DualPipe, DualPipeV and 1F1B (P = 4, M = 8) run it and equal sequential
//! training.
//!
//! An op joins the op before it only when
//! * it reads nothing that op writes (a different micro-batch, or the other direction of a
//!   bidirectional pipeline), and
//! * its cross-rank input (the previous stage's forward, the next stage's backward) has
//!   finished, in an as-soon-as-possible schedule of the unsplit program, by the time the
//!   previous op starts. That schedule charges unit time per op (`F = B = W = 1`, `BW = 2`),
//!   twice that for a plain MoE op (its all-to-alls exposed, the 1:1 regime), a pair the sum
//!   of its ops.
//!
//! The second condition keeps the result deadlock-free: every new in-stream order (a part of
//! op `k + 1` before a part of op `k`) enters op `k + 1` from data that was ready before op
//! `k` started and leaves through op `k`'s or a later op's outputs, which are consumed after
//! op `k` ended, so no wait-for cycle can close through it (pass 4 proves it on every
//! program). It also keeps a joined op from waiting for its data at the head of the compute
//! stream, mostly: the schedule is unit-time, so with other costs an interleaved op can still
//! hold the previous op's next compute part back. Programs with communication ops already in
//! them (IR, traces) are not interleaved.
//!
//! Costs of the choice: one activation more in flight (peak activations and a spec's
//! `expect warmup`/`peak_activations` grow by one on the ranks that interleave), and pass 7's
//! unit-time idle, which runs all parts on one stream, grows; the simulator times the EP
//! stream concurrently and is the figure to read.
//!
//! ## Cost-aware part order (`--moe=STAGES:list`, `:listN`, opt-in)
//!
//! With [`Interleave::List`] each rank's forwards and backwards enter, in their input order,
//! a sliding window of `N` ops (2 for a bare `:list`), whose parts are ordered by a greedy
//! list schedule simulated under the cost model across all ranks ([`crate::moe_list`]): a part of
//! a later op runs before the parts of an earlier op when its inputs are there and it holds no
//! older op back; `&` pairs keep DeepSeek's order inside and start when both inputs are in;
//! the `BW`s outside pairs become `B` + `W`, and every `W` is split into `W.mlp` and `W.attn`,
//! run under other ops' all-to-alls (with a `WAIT_RA/RG` where the all-to-all waits for a
//! receive). The result comes with its point-to-point messages already placed in the order of
//! the simulated times (a lowered program). Without a cost model (`check --moe=all:list` with
//! no `--cost`) it schedules under unit times, 1:1.
//!
//! Measured (`compare --moe=all:list --cost ../shared/costs/moe-1to1.toml`, P = 8; the book's
//! MoE chapter has the table): exposed all-to-all of DualPipe 23.7% at M = 16 and 5.9% at
//! M = 64 (default order: 64.0%, 19.8%), DualPipeV 20.9% and 5.3% (65.1%, 23.7%), at the
//! default order's peak activations for both and in shorter steps; `:list3` 16.5% / 4.1% and
//! 13.6% / 3.4% with one activation more.
//!
//! ## Which stages are MoE
//!
//! [`MoeStages`]: `all` (every stage), `dense-ends` (the first and the last stage of each
//! direction stay dense: the embedding and the head), `declared` (the input's own `moe`
//! declaration: the `moe` item of a spec, the `moe` header of IR text), or a list of stage ids
//! and ranges (`1-6,9`). `auto` (what a bare `--moe` means) is `declared` when the input
//! declares MoE stages and `all` otherwise. Any of them followed by `:adjacent` interleaves
//! consecutive plain ops (above); a bare `--moe=:adjacent` is `auto:adjacent`.
//!
//! ## What the lowered IR holds (for back ends)
//!
//! No collectives are added (and, except in the `:list` mode, no point-to-point messages:
//! pass 3 places them). A `.dispatch` or `.combine` part is one all-to-all among the
//! rank's expert-parallel peers: the copies of that pipeline rank at the other EP positions of
//! the device mesh, which run the same program, so all-to-all order agrees across the EP group
//! by construction. The simulator and the CPU back end run these parts on the rank's EP
//! stream. The pipeline's `moe_stages` records the MoE set.

use schedc_ir::text::{SourceMap, Span};
use schedc_ir::{Compute, Instr, Kind, Part, Pipeline, Program};

/// Which stages `--moe` splits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MoeStages {
    /// The input's declaration when it has one, else every stage.
    Auto,
    /// Every stage.
    All,
    /// All but the first and last stage of each direction (embedding and head stay dense).
    DenseEnds,
    /// The input's `moe` declaration (an error when it has none).
    Declared,
    /// These stage ids.
    List(Vec<u32>),
    /// The inner selection, lowered with [`Interleave::Adjacent`] (`STAGES:adjacent`).
    Adjacent(Box<MoeStages>),
    /// The inner selection, lowered with [`Interleave::List`] (`STAGES:list`, or
    /// `STAGES:listN` for `N` ops in flight per rank).
    Listed(Box<MoeStages>, u8),
}

impl std::str::FromStr for MoeStages {
    type Err = String;
    /// `auto`, `all`, `dense-ends`, `declared`, or stage ids and inclusive ranges separated by
    /// commas (`1-6,9`); any of them followed by `:adjacent` ([`MoeStages::Adjacent`]; a bare
    /// `:adjacent` is `auto:adjacent`) or by `:list` / `:listN`, `N` in 1..=8
    /// ([`MoeStages::Listed`], [`crate::moe_list::DEFAULT_WINDOW`] ops in flight without `N`).
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some((sel, mode)) = s.trim().rsplit_once(':') {
            let mode = mode.trim();
            // One lowering only: `all:list3:adjacent` silently ran `:adjacent`.
            if sel.contains(':') {
                return Err(format!(
                    "invalid --moe `{s}`: one lowering after the stages (`:adjacent`, `:list` or `:listN`), not several"
                ));
            }
            if let Some(n) = mode.strip_prefix("list") {
                let window = if n.is_empty() {
                    crate::moe_list::DEFAULT_WINDOW as u8
                } else {
                    match n.parse::<u8>() {
                        Ok(k @ 1..=8) => k,
                        _ => {
                            return Err(format!(
                                "invalid --moe `{s}`: `{mode}`: the ops in flight of `:listN` must be 1 to 8"
                            ))
                        }
                    }
                };
                return Ok(MoeStages::Listed(Box::new(sel.parse()?), window));
            }
            return match mode {
                "adjacent" => Ok(MoeStages::Adjacent(Box::new(sel.parse()?))),
                other => Err(format!(
                    "invalid --moe `{s}`: unknown lowering `{other}` after `:` (expected adjacent, list or listN)"
                )),
            };
        }
        match s.trim() {
            "" | "auto" => Ok(MoeStages::Auto),
            "all" => Ok(MoeStages::All),
            "dense-ends" => Ok(MoeStages::DenseEnds),
            "declared" => Ok(MoeStages::Declared),
            list => {
                let bad = || {
                    format!(
                        "invalid --moe `{s}`: expected auto, all, dense-ends, declared, or stage ids and ranges such as 1-6,9"
                    )
                };
                let mut v = Vec::new();
                for part in list.split(',').map(str::trim) {
                    match part.split_once('-') {
                        Some((a, b)) => {
                            let a: u32 = a.trim().parse().map_err(|_| bad())?;
                            let b: u32 = b.trim().parse().map_err(|_| bad())?;
                            if b < a || b - a > 1 << 20 {
                                return Err(bad());
                            }
                            v.extend(a..=b);
                        }
                        None => v.push(part.parse().map_err(|_| bad())?),
                    }
                }
                v.sort_unstable();
                v.dedup();
                Ok(MoeStages::List(v))
            }
        }
    }
}

impl MoeStages {
    /// How the selection orders the parts of consecutive plain ops.
    pub fn interleave(&self) -> Interleave {
        match self {
            MoeStages::Adjacent(_) => Interleave::Adjacent,
            MoeStages::Listed(_, k) => Interleave::List(*k),
            _ => Interleave::None,
        }
    }

    /// The MoE stage ids for `pl`, increasing.
    ///
    /// Errors: `declared` on a pipeline that declares nothing; a listed stage out of range.
    pub fn resolve(&self, pl: &Pipeline) -> Result<Vec<u32>, String> {
        let all = || (0..pl.stages).collect::<Vec<_>>();
        Ok(match self {
            MoeStages::Auto => pl.moe_stages.clone().unwrap_or_else(all),
            MoeStages::All => all(),
            MoeStages::DenseEnds => (0..pl.stages)
                .filter(|&s| pl.prev_stage(s).is_some() && pl.next_stage(s).is_some())
                .collect(),
            MoeStages::Declared => pl.moe_stages.clone().ok_or_else(|| {
                "--moe declared: the input declares no MoE stages (a spec's `moe` item, an IR file's `moe` header)".to_string()
            })?,
            MoeStages::List(v) => {
                if let Some(s) = v.iter().find(|&&s| s >= pl.stages) {
                    return Err(format!(
                        "--moe names stage {s}, but the schedule's stage ids are 0..={} ({} stages)",
                        pl.stages.saturating_sub(1),
                        pl.stages
                    ));
                }
                v.clone()
            }
            MoeStages::Adjacent(inner) | MoeStages::Listed(inner, _) => inner.resolve(pl)?,
        })
    }
}

/// Refuses a cost model without all-to-all costs for `--moe`: its dispatch and combine
/// parts would be free, and every schedule would look as good as DualPipe.
///
/// Errors: the model has no `[moe]` section (and no `dispatch=`/`combine=`/`ep_bandwidth=`
/// override), or its dispatch and combine both take 0 s ([`CostModel::a2a_time`]: no time
/// given and none derivable from a bandwidth and `[model]` sizes); the message names the
/// model.
///
/// [`CostModel::a2a_time`]: crate::sim::cost::CostModel::a2a_time
pub fn require_moe_costs(cost: &crate::sim::cost::CostModel, name: &str) -> Result<(), String> {
    require_moe_costs_for(cost, name, "--moe")
}

/// [`require_moe_costs`] for what splits the parts: `what` opens the message (`--moe`, or a
/// spec's `parts` item with its location, which splits them as `--moe=auto:list` does).
///
/// Errors: as [`require_moe_costs`].
pub fn require_moe_costs_for(
    cost: &crate::sim::cost::CostModel,
    name: &str,
    what: &str,
) -> Result<(), String> {
    if cost.moe.present {
        if cost.a2a_time(Part::Dispatch) > 0.0
            || cost.a2a_time(Part::Combine) > 0.0
            || cost
                .moe
                .stage
                .values()
                .any(|s| s.dispatch.is_some_and(|t| t > 0.0) || s.combine.is_some_and(|t| t > 0.0))
        {
            return Ok(());
        }
        return Err(format!(
            "{what} with the cost model `{name}`, whose [moe] section gives the all-to-alls no time (dispatch = combine = 0 s, and no EP bandwidth with [model] sizes to derive them): every schedule would look as good as DualPipe. Give their times ([moe] dispatch = S, combine = S, or [moe] bandwidth = BYTES_PER_S with [model]), e.g. --cost ../shared/costs/moe-1to1.toml"
        ));
    }
    Err(format!(
        "{what} with the cost model `{name}`, which has no [moe] section: its dispatch and combine all-to-alls would take no time. Give their times ([moe] dispatch = S, combine = S, or an EP bandwidth: [moe] bandwidth = BYTES_PER_S with [model]), e.g. --cost ../shared/costs/moe-1to1.toml, or --set dispatch=S,combine=S"
    ))
}

fn part(c: &Compute, p: Part) -> Instr {
    Instr::Compute(Compute { part: p, ..*c })
}

/// The parts of a plain (not overlapped) op, in execution order.
fn plain(c: &Compute, out: &mut Vec<Instr>) {
    let order = if c.kind == Kind::F {
        [Part::Attn, Part::Dispatch, Part::Mlp, Part::Combine]
    } else {
        [Part::Combine, Part::Mlp, Part::Dispatch, Part::Attn]
    };
    out.extend(order.iter().map(|&p| part(c, p)));
}

/// How [`split_with`] orders the parts of consecutive plain (not overlapped) ops on a rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Interleave {
    /// Each plain op runs its parts back to back: its all-to-alls are exposed unless the
    /// schedule overlaps it with another op (`&`).
    #[default]
    None,
    /// Consecutive independent ops on a rank interleave at part level, at most two ops in
    /// flight (module docs, "Interleaving consecutive plain ops").
    Adjacent,
    /// Each rank's parts in the order of a greedy list schedule simulated under the cost
    /// model across ranks, at most this many ops in flight per rank ([`crate::moe_list`]).
    List(u8),
}

/// One op of a rank's program in a run of consecutive plain ops: its parts in execution order.
struct Chain {
    parts: Vec<Instr>,
    /// The micro-batch and direction whose data the op reads and writes.
    key: usize,
    /// Whether the op may run alongside the previous op of its run (its cross-rank inputs are
    /// ready, in the unit-time schedule of the unsplit program, when that op ends).
    joins: bool,
    span: Span,
}

/// Unit durations of the static interleaving: a part takes 1, a whole op 2 (attention + MLP).
fn unit(i: &Instr) -> u64 {
    match i {
        Instr::Compute(c) if c.part == Part::Whole => 2,
        _ => 1,
    }
}

/// Emits the parts of `run` (consecutive plain ops of one rank, in program order) in the
/// order of a two-stream list schedule at unit durations: compute parts on the compute
/// stream, all-to-alls on the EP stream, each part after its op's previous part, at most two
/// ops in flight (op `i + 2` starts after op `i` has ended), an op that reads data an earlier
/// op writes (the same micro-batch and direction) only after that op has ended. Ties go to the
/// earlier op. Linear in the run's parts; `last_end` is scratch of one slot per key.
fn interleave_run(
    run: &mut Vec<Chain>,
    last_end: &mut [u64],
    out: &mut Vec<Instr>,
    sp: &mut Vec<Span>,
) {
    let n = run.len();
    if n <= 1 {
        for ch in run.drain(..) {
            sp.extend(std::iter::repeat_n(ch.span, ch.parts.len()));
            out.append(&mut { ch.parts });
        }
        return;
    }
    let mut next = vec![0usize; n];
    let mut ready = vec![0u64; n];
    let (mut cfree, mut efree) = (0u64, 0u64);
    let mut lo = 0usize;
    let mut opened = 0usize; // ops whose ready time holds their dependencies
    while lo < n {
        let hi = if lo + 1 < n && run[lo + 1].joins && run[lo + 1].key != run[lo].key {
            lo + 2
        } else {
            lo + 1
        };
        while opened < hi {
            ready[opened] = ready[opened].max(last_end[run[opened].key]);
            opened += 1;
        }
        // (start, whether the part is not its op's first, op): at equal starts an op's first
        // part goes before the other op's part, which may be its last and would gate it.
        let mut best: Option<(u64, bool, usize)> = None;
        for j in lo..hi {
            if let Some(ins) = run[j].parts.get(next[j]) {
                let ep = matches!(ins, Instr::Compute(c) if c.part.is_all_to_all());
                let s = ready[j].max(if ep { efree } else { cfree });
                let cand = (s, next[j] > 0, j);
                if best.is_none_or(|b| cand < b) {
                    best = Some(cand);
                }
            }
        }
        let (s, _, j) = best.expect("an op in the window has a part left");
        let ins = &run[j].parts[next[j]];
        let e = s + unit(ins);
        if matches!(ins, Instr::Compute(c) if c.part.is_all_to_all()) {
            efree = e;
        } else {
            cfree = e;
        }
        ready[j] = e;
        out.push(ins.clone());
        sp.push(run[j].span);
        next[j] += 1;
        if next[j] == run[j].parts.len() {
            last_end[run[j].key] = last_end[run[j].key].max(e);
        }
        while lo < n && next[lo] == run[lo].parts.len() {
            lo += 1;
        }
    }
    for ch in run.iter() {
        last_end[ch.key] = 0;
    }
    run.clear();
}

/// Appends the parts of `ins` in the default order (module docs): a plain op of an MoE
/// stage as its four parts, a pair in DeepSeek's order, anything else unchanged.
fn emit(ins: &Instr, splits: &dyn Fn(&Compute) -> bool, out: &mut Vec<Instr>) {
    match ins {
        Instr::Compute(c) if splits(c) => plain(c, out),
        Instr::Overlap { fwd, bwd } if splits(fwd) || splits(bwd) => {
            let (f, b) = (fwd, bwd);
            if f.stage == b.stage && f.mb == b.mb {
                // The loss stage's own forward and backward: no overlap possible.
                for c in [f, b] {
                    if splits(c) {
                        plain(c, out);
                    } else {
                        out.push(Instr::Compute(*c));
                    }
                }
            } else if splits(f) && splits(b) {
                use Part::*;
                for (c, p_) in [
                    (b, Combine),
                    (f, Attn),
                    (f, Dispatch),
                    (b, Mlp),
                    (b, Dispatch),
                    (f, Mlp),
                    (f, Combine),
                    (b, Attn),
                ] {
                    out.push(part(c, p_));
                }
            } else if splits(f) {
                out.push(part(f, Part::Attn));
                out.push(part(f, Part::Dispatch));
                out.push(Instr::Compute(*b));
                out.push(part(f, Part::Mlp));
                out.push(part(f, Part::Combine));
            } else {
                out.push(part(b, Part::Combine));
                out.push(Instr::Compute(*f));
                out.push(part(b, Part::Mlp));
                out.push(part(b, Part::Dispatch));
                out.push(part(b, Part::Attn));
            }
        }
        other => out.push(other.clone()),
    }
}

/// [`split_with`] at the default [`Interleave`].
pub fn split(p: &Program, spans: Option<&SourceMap>, moe: &[u32]) -> (Program, Option<SourceMap>) {
    split_with(p, spans, moe, Interleave::default())
}

/// Splits every whole F, B and BW of the stages in `moe` (increasing ids) into MoE parts in
/// the documented order (module docs), and records `moe` as the pipeline's MoE stages.
/// `spans`, when given, is mapped to the new instructions (each part gets its op's span).
///
/// Linear in the program's size. Never fails: ops out of range are copied unchanged for
/// pass 1 to report.
pub fn split_with(
    p: &Program,
    spans: Option<&SourceMap>,
    moe: &[u32],
    interleave: Interleave,
) -> (Program, Option<SourceMap>) {
    split_timed(p, spans, moe, interleave, None)
}

/// [`split_with`], with the cost model that [`Interleave::List`] schedules under (`None`:
/// unit times, [`crate::moe_list`]); the other modes ignore it.
pub fn split_timed(
    p: &Program,
    spans: Option<&SourceMap>,
    moe: &[u32],
    interleave: Interleave,
    cost: Option<&crate::sim::cost::CostModel>,
) -> (Program, Option<SourceMap>) {
    // Idle slots (`_`, torch's empty cells) are spacing only, and the lowering drops them; the
    // reordering modes drop them first (with them, `:list` and `:adjacent` silently fell back
    // to the default order).
    if interleave != Interleave::None && p.ranks.iter().flatten().any(|i| matches!(i, Instr::Idle))
    {
        let mut q = p.clone();
        let mut m = spans.cloned();
        for (r, instrs) in q.ranks.iter_mut().enumerate() {
            let keep: Vec<bool> = instrs.iter().map(|i| !matches!(i, Instr::Idle)).collect();
            let mut k = keep.iter();
            instrs.retain(|_| *k.next().unwrap_or(&true));
            if let Some(v) = m.as_mut().and_then(|m| m.ranks.get_mut(r)) {
                let mut k = keep.iter();
                v.retain(|_| *k.next().unwrap_or(&true));
            }
        }
        return split_timed(&q, m.as_ref(), moe, interleave, cost);
    }
    let pl = &p.pipeline;
    let mut is_moe = vec![false; pl.stages as usize];
    for &s in moe {
        if let Some(x) = is_moe.get_mut(s as usize) {
            *x = true;
        }
    }
    let splits = |c: &Compute| {
        c.part == Part::Whole
            && c.kind != Kind::W
            && is_moe.get(c.stage as usize).copied().unwrap_or(false)
    };
    if let Interleave::List(window) = interleave {
        let moe_stage = |s: u32| is_moe.get(s as usize).copied().unwrap_or(false);
        let units_of = |ins: &Instr| {
            let mut v = Vec::with_capacity(8);
            emit(ins, &splits, &mut v);
            v
        };
        let no_spans = Vec::new();
        let sp = spans.map_or(&no_spans, |m| &m.ranks);
        // Op times per stage-chunk, as `compare` scales them (1/P of the model per stage).
        let scaled = cost.map(|c| c.for_pipeline(pl));
        if let Some(orders) = crate::moe_list::order(
            p,
            sp,
            &units_of,
            scaled.as_ref(),
            window as usize,
            &moe_stage,
        ) {
            let (ranks, span_ranks): (Vec<_>, Vec<_>) = orders.into_iter().unzip();
            let mut pipeline = p.pipeline.clone();
            pipeline.moe_stages = Some(moe.to_vec());
            return (
                Program { pipeline, ranks },
                spans.map(|m| SourceMap {
                    ranks: span_ranks,
                    expanded: m.expanded.clone(),
                }),
            );
        }
        return split_timed(p, spans, moe, Interleave::None, None);
    }
    let per_dir = pl.stages_per_direction().max(1);
    let key_of = |c: &Compute| {
        (c.mb.min(pl.microbatches) as usize) * 2
            + usize::from(c.stage >= per_dir && pl.directions() == 2)
    };
    let mut last_end = vec![0u64; 2 * (pl.microbatches as usize + 1)];
    // The unit-time schedule of the unsplit program: when each op ends (`ends[r][i]`) and
    // when each forward and input-gradient backward (kind class 0, 1) ends (`done`).
    let timing = (interleave != Interleave::None
        && p.ranks
            .iter()
            .flatten()
            .all(|i| matches!(i, Instr::Compute(_) | Instr::Overlap { .. })))
    .then(|| {
        use crate::passes::makespan::{schedule_with, unit_cost};
        // A plain MoE op is charged its compute and as long again for its exposed all-to-alls
        // (the 1:1 regime the interleaving is for); a pair its compute.
        let plain = |c: &Compute| unit_cost(c) * if splits(c) { 2.0 } else { 1.0 };
        schedule_with(p, &plain, &|f, b| unit_cost(f) + unit_cost(b))
    })
    .flatten();
    let interleave = if timing.is_some() {
        interleave
    } else {
        Interleave::None
    };
    let (s_n, m_n) = (pl.stages as usize, pl.microbatches as usize);
    let slot = |class: usize, s: u32, m: u32| {
        ((s as usize) < s_n && (m as usize) < m_n)
            .then(|| (class * s_n + s as usize) * m_n + m as usize)
    };
    let mut done = vec![f64::INFINITY; if timing.is_some() { 2 * s_n * m_n } else { 0 }];
    let mut ends: Vec<Vec<f64>> = Vec::new();
    let starts: &[Vec<f64>] = timing.as_ref().map_or(&[], |t| &t.starts);
    if let Some(t) = &timing {
        use crate::passes::makespan::unit_cost;
        for (instrs, st) in p.ranks.iter().zip(&t.starts) {
            let mut e = Vec::with_capacity(instrs.len());
            for (ins, &s0) in instrs.iter().zip(st) {
                let d = match ins {
                    Instr::Compute(c) => unit_cost(c) * if splits(c) { 2.0 } else { 1.0 },
                    Instr::Overlap { fwd, bwd } => unit_cost(fwd) + unit_cost(bwd),
                    _ => 0.0,
                };
                let end = s0 + d;
                ins.for_each_compute(|c| {
                    let class = match c.kind {
                        Kind::F => Some(0),
                        Kind::B | Kind::BW => Some(1),
                        Kind::W => None,
                    };
                    if let Some(k) = class.and_then(|cl| slot(cl, c.stage, c.mb)) {
                        done[k] = end;
                    }
                });
                e.push(end);
            }
            ends.push(e);
        }
    }
    // The end of the cross-rank input of `c` on rank `r` in the unit-time schedule (0 without).
    let input_end = |c: &Compute, r: usize| -> f64 {
        let src = match c.kind {
            Kind::F => pl.prev_stage(c.stage).map(|s| (0, s)),
            Kind::B | Kind::BW => pl.next_stage(c.stage).map(|s| (1, s)),
            Kind::W => None,
        };
        match src {
            Some((cl, s)) if pl.rank_of(s) as usize != r => {
                slot(cl, s, c.mb).map_or(f64::INFINITY, |k| done[k])
            }
            _ => 0.0,
        }
    };
    let mut ranks = Vec::with_capacity(p.ranks.len());
    let mut span_ranks = Vec::with_capacity(p.ranks.len());
    let mut run: Vec<Chain> = Vec::new();
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut out = Vec::with_capacity(instrs.len() * 3);
        let mut sp: Vec<Span> = Vec::new();
        for (i, ins) in instrs.iter().enumerate() {
            let span = spans.and_then(|m| m.get(r, i)).unwrap_or_default();
            if interleave != Interleave::None {
                if let Instr::Compute(c) = ins {
                    if c.part == Part::Whole {
                        let mut parts = Vec::with_capacity(4);
                        if splits(c) {
                            plain(c, &mut parts);
                        } else {
                            parts.push(ins.clone());
                        }
                        let joins = i > 0 && input_end(c, r) <= starts[r][i - 1];
                        run.push(Chain {
                            parts,
                            key: key_of(c),
                            joins,
                            span,
                        });
                        continue;
                    }
                }
                interleave_run(&mut run, &mut last_end, &mut out, &mut sp);
            }
            let before = out.len();
            emit(ins, &splits, &mut out);
            if spans.is_some() {
                sp.extend(std::iter::repeat_n(span, out.len() - before));
            }
        }
        interleave_run(&mut run, &mut last_end, &mut out, &mut sp);
        if spans.is_none() {
            sp.clear();
        }
        ranks.push(out);
        span_ranks.push(sp);
    }
    let mut pipeline = p.pipeline.clone();
    pipeline.moe_stages = Some(moe.to_vec());
    (
        Program { pipeline, ranks },
        spans.map(|m| SourceMap {
            ranks: span_ranks,
            expanded: m.expanded.clone(),
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedc_ir::text::{instr_to_string, parse};

    fn texts(p: &Program, r: usize) -> Vec<String> {
        p.ranks[r].iter().map(instr_to_string).collect()
    }

    #[test]
    fn plain_ops_and_the_overlapped_pair() {
        let src = "pp 1\nstages 2\nmicrobatches 2\nplacement 0 0\nrank 0: F(0,0) F(1,0) F(0,1)&BW(1,0) B(1,1) W(1,1) BW(0,0) F(1,1)&B(0,1) W(0,1)\n";
        let p = parse(src).unwrap().program;
        let (q, _) = split(&p, None, &[0, 1]);
        assert_eq!(
            texts(&q, 0).join(" "),
            "F(0,0).attn F(0,0).dispatch F(0,0).mlp F(0,0).combine \
             F(1,0).attn F(1,0).dispatch F(1,0).mlp F(1,0).combine \
             BW(1,0).combine F(0,1).attn F(0,1).dispatch BW(1,0).mlp BW(1,0).dispatch F(0,1).mlp F(0,1).combine BW(1,0).attn \
             B(1,1).combine B(1,1).mlp B(1,1).dispatch B(1,1).attn W(1,1) \
             BW(0,0).combine BW(0,0).mlp BW(0,0).dispatch BW(0,0).attn \
             B(0,1).combine F(1,1).attn F(1,1).dispatch B(0,1).mlp B(0,1).dispatch F(1,1).mlp F(1,1).combine B(0,1).attn W(0,1)"
        );
        assert_eq!(q.pipeline.moe_stages, Some(vec![0, 1]));
    }

    #[test]
    fn dense_stages_stay_whole_and_mixed_pairs_hide_one_all_to_all() {
        let src = "pp 1\nstages 2\nmicrobatches 2\nplacement 0 0\nrank 0: F(0,0) F(1,0) F(0,1)&BW(1,0) BW(1,1) F(1,1)&BW(0,0) BW(0,1)\n";
        let p = parse(src).unwrap().program;
        let (q, _) = split(&p, None, &[1]);
        assert_eq!(
            texts(&q, 0).join(" "),
            "F(0,0) F(1,0).attn F(1,0).dispatch F(1,0).mlp F(1,0).combine \
             BW(1,0).combine F(0,1) BW(1,0).mlp BW(1,0).dispatch BW(1,0).attn \
             BW(1,1).combine BW(1,1).mlp BW(1,1).dispatch BW(1,1).attn \
             F(1,1).attn F(1,1).dispatch BW(0,0) F(1,1).mlp F(1,1).combine BW(0,1)"
        );
    }

    #[test]
    fn adjacent_interleaves_independent_ops_only() {
        // Rank 0 has its inputs: its forwards interleave, then its backwards (different
        // micro-batches). On rank 1 F(1,0) and BW(1,0) share a micro-batch: no interleaving;
        // F(1,1)'s input comes from rank 0's second forward, which the unit-time schedule
        // has ready before BW(1,0) starts, so F(1,1) runs its attention first.
        let src = "pp 2\nstages 2\nmicrobatches 3\nrank 0: F(0,0) F(0,1) F(0,2) BW(0,0) BW(0,1) BW(0,2)\nrank 1: F(1,0) BW(1,0) F(1,1) BW(1,1) F(1,2) BW(1,2)\n";
        let p = parse(src).unwrap().program;
        let (q, _) = split_with(&p, None, &[0, 1], Interleave::Adjacent);
        assert_eq!(
            texts(&q, 0).join(" "),
            "F(0,0).attn F(0,1).attn F(0,0).dispatch F(0,0).mlp F(0,1).dispatch F(0,0).combine \
             F(0,2).attn F(0,1).mlp F(0,2).dispatch F(0,1).combine F(0,2).mlp F(0,2).combine \
             BW(0,0).combine BW(0,0).mlp BW(0,0).dispatch BW(0,0).attn \
             BW(0,1).combine BW(0,1).mlp BW(0,1).dispatch BW(0,1).attn \
             BW(0,2).combine BW(0,2).mlp BW(0,2).dispatch BW(0,2).attn"
        );
        assert_eq!(
            texts(&q, 1).join(" "),
            "F(1,0).attn F(1,0).dispatch F(1,0).mlp F(1,0).combine \
             F(1,1).attn BW(1,0).combine BW(1,0).mlp F(1,1).dispatch BW(1,0).dispatch F(1,1).mlp BW(1,0).attn F(1,1).combine \
             BW(1,1).combine F(1,2).attn BW(1,1).mlp F(1,2).dispatch BW(1,1).dispatch F(1,2).mlp BW(1,1).attn F(1,2).combine \
             BW(1,2).combine BW(1,2).mlp BW(1,2).dispatch BW(1,2).attn"
        );
        // The default keeps every op's parts together.
        let (d, _) = split(&p, None, &[0, 1]);
        assert!(texts(&d, 0)
            .join(" ")
            .starts_with("F(0,0).attn F(0,0).dispatch F(0,0).mlp F(0,0).combine F(0,1).attn"));
        assert_eq!(
            ":adjacent".parse::<MoeStages>().unwrap(),
            MoeStages::Adjacent(Box::new(MoeStages::Auto))
        );
        assert_eq!(
            "1-2:adjacent".parse::<MoeStages>().unwrap().interleave(),
            Interleave::Adjacent
        );
        assert!("all:overlap".parse::<MoeStages>().is_err());
    }

    #[test]
    fn list_keeps_both_streams_full_on_a_stream_of_forwards() {
        // Unit times (no cost model), 1:1: two forwards in flight fill the compute stream
        // (attn attn mlp mlp ...) and the EP stream (disp disp comb comb ...); the backwards
        // follow their forwards' order, each after its own forward (the loss stage).
        let src = "pp 1\nstages 1\nmicrobatches 4\nrank 0: F(0,0) F(0,1) F(0,2) F(0,3) BW(0,0) BW(0,1) BW(0,2) BW(0,3)\n";
        let p = parse(src).unwrap().program;
        let (q, _) = split_timed(&p, None, &[0], Interleave::List(2), None);
        let t = texts(&q, 0);
        let stream = |ep: bool| {
            t.iter()
                .filter(|s| (s.ends_with(".dispatch") || s.ends_with(".combine")) == ep)
                .take(8)
                .cloned()
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(
            stream(false),
            "F(0,0).attn F(0,1).attn F(0,0).mlp F(0,1).mlp F(0,2).attn F(0,3).attn F(0,2).mlp F(0,3).mlp"
        );
        assert_eq!(
            stream(true),
            "F(0,0).dispatch F(0,1).dispatch F(0,0).combine F(0,1).combine F(0,2).dispatch F(0,3).dispatch F(0,2).combine F(0,3).combine"
        );
        // Each BW is split into its B (four parts) and its W (`mlp`, then `attn`).
        assert_eq!(t.len(), 16 + 4 * 6);
        assert!(!t.iter().any(|s| s.starts_with("BW(")));
        for m in 0..4 {
            let at = |x: &str| t.iter().position(|s| s == x).unwrap();
            assert!(at(&format!("B(0,{m}).attn")) < at(&format!("W(0,{m}).mlp")));
            assert!(at(&format!("W(0,{m}).mlp")) < at(&format!("W(0,{m}).attn")));
        }
        assert_eq!(
            "all:list".parse::<MoeStages>().unwrap().interleave(),
            Interleave::List(2)
        );
        assert_eq!(
            ":list3".parse::<MoeStages>().unwrap(),
            MoeStages::Listed(Box::new(MoeStages::Auto), 3)
        );
        assert!("all:list0".parse::<MoeStages>().is_err());
        assert!("all:list9".parse::<MoeStages>().is_err());
        // One lowering only: these used to parse, the last one silently winning.
        for s in ["all:list3:adjacent", "all:adjacent:list", "all:list:list"] {
            let e = s.parse::<MoeStages>().unwrap_err();
            assert!(e.contains("one lowering after the stages"), "{s}: {e}");
        }
    }

    /// Idle slots carry no semantics: `:list` and `:adjacent` order a program with them as
    /// they order it without (they used to fall back to the default order).
    #[test]
    fn reordering_modes_ignore_idle_slots() {
        let with = "pp 2\nstages 2\nmicrobatches 2\nrank 0: F(0,0) F(0,1) _ _ BW(0,0) BW(0,1)\nrank 1: _ F(1,0) F(1,1) BW(1,0) BW(1,1)\n";
        let without = with.replace(" _", "");
        let a = parse(with).unwrap();
        let b = parse(&without).unwrap();
        for mode in [
            Interleave::List(2),
            Interleave::List(3),
            Interleave::Adjacent,
        ] {
            let (qa, ma) = split_timed(&a.program, Some(&a.spans), &[0, 1], mode, None);
            let (qb, _) = split_timed(&b.program, Some(&b.spans), &[0, 1], mode, None);
            assert_eq!(qa, qb, "{mode:?}");
            let plain = split_timed(&b.program, None, &[0, 1], Interleave::None, None).0;
            assert_ne!(qb, plain, "{mode:?} reorders this program");
            // One span per instruction, each a span of the text.
            let ma = ma.unwrap();
            for (r, v) in ma.ranks.iter().enumerate() {
                assert_eq!(v.len(), qa.ranks[r].len());
                assert!(v.iter().all(|s| s.len > 0));
            }
        }
    }

    #[test]
    fn spans_follow_the_parts() {
        let src = "pp 1\nstages 1\nmicrobatches 1\nrank 0: F(0,0) BW(0,0)\n";
        let parsed = parse(src).unwrap();
        let (q, m) = split(&parsed.program, Some(&parsed.spans), &[0]);
        let m = m.unwrap();
        assert_eq!(q.ranks[0].len(), 8);
        for i in 0..4 {
            assert_eq!(m.get(0, i), parsed.spans.get(0, 0));
            assert_eq!(m.get(0, 4 + i), parsed.spans.get(0, 1));
        }
    }

    #[test]
    fn stage_selections() {
        let p = Pipeline::new(4, 8, 2, schedc_ir::PlacementKind::V).unwrap();
        assert_eq!(
            MoeStages::All.resolve(&p).unwrap(),
            (0..8).collect::<Vec<_>>()
        );
        assert_eq!(
            MoeStages::DenseEnds.resolve(&p).unwrap(),
            (1..7).collect::<Vec<_>>()
        );
        let b = Pipeline::new(4, 8, 2, schedc_ir::PlacementKind::Bidir).unwrap();
        assert_eq!(MoeStages::DenseEnds.resolve(&b).unwrap(), vec![1, 2, 5, 6]);
        assert_eq!(
            "1-3,6".parse::<MoeStages>().unwrap(),
            MoeStages::List(vec![1, 2, 3, 6])
        );
        assert!("1-x".parse::<MoeStages>().is_err());
        assert!(MoeStages::List(vec![9]).resolve(&p).is_err());
        assert!(MoeStages::Declared.resolve(&p).is_err());
        assert_eq!(MoeStages::Auto.resolve(&p).unwrap().len(), 8);
    }
}
