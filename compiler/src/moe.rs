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
//! ## Which stages are MoE
//!
//! [`MoeStages`]: `all` (every stage), `dense-ends` (the first and the last stage of each
//! direction stay dense: the embedding and the head), `declared` (the input's own `moe`
//! declaration: the `moe` item of a spec, the `moe` header of IR text), or a list of stage ids
//! and ranges (`1-6,9`). `auto` (what a bare `--moe` means) is `declared` when the input
//! declares MoE stages and `all` otherwise.
//!
//! ## What the lowered IR holds (for back ends)
//!
//! No collectives are added. A `.dispatch` or `.combine` part is one all-to-all among the
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
}

impl std::str::FromStr for MoeStages {
    type Err = String;
    /// `auto`, `all`, `dense-ends`, `declared`, or stage ids and inclusive ranges separated by
    /// commas (`1-6,9`).
    fn from_str(s: &str) -> Result<Self, String> {
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
                        "--moe names stage {s}, but the schedule has {} stages",
                        pl.stages
                    ));
                }
                v.clone()
            }
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
    if cost.moe.present {
        if cost.a2a_time(Part::Dispatch) > 0.0 || cost.a2a_time(Part::Combine) > 0.0 {
            return Ok(());
        }
        return Err(format!(
            "--moe with the cost model `{name}`, whose [moe] section gives the all-to-alls no time (dispatch = combine = 0 s, and no EP bandwidth with [model] sizes to derive them): every schedule would look as good as DualPipe. Give their times ([moe] dispatch = S, combine = S, or [moe] bandwidth = BYTES_PER_S with [model]), e.g. --cost ../shared/costs/moe-1to1.toml"
        ));
    }
    Err(format!(
        "--moe with the cost model `{name}`, which has no [moe] section: its dispatch and combine all-to-alls would take no time. Give their times ([moe] dispatch = S, combine = S, or an EP bandwidth: [moe] bandwidth = BYTES_PER_S with [model]), e.g. --cost ../shared/costs/moe-1to1.toml, or --set dispatch=S,combine=S"
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

/// Splits every whole F, B and BW of the stages in `moe` (increasing ids) into MoE parts in
/// the documented order (module docs), and records `moe` as the pipeline's MoE stages.
/// `spans`, when given, is mapped to the new instructions (each part gets its op's span).
///
/// Linear in the program's size. Never fails: ops out of range are copied unchanged for
/// pass 1 to report.
pub fn split(p: &Program, spans: Option<&SourceMap>, moe: &[u32]) -> (Program, Option<SourceMap>) {
    let mut is_moe = vec![false; p.pipeline.stages as usize];
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
    let mut ranks = Vec::with_capacity(p.ranks.len());
    let mut span_ranks = Vec::with_capacity(p.ranks.len());
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut out = Vec::with_capacity(instrs.len() * 3);
        let mut sp: Vec<Span> = Vec::new();
        for (i, ins) in instrs.iter().enumerate() {
            let before = out.len();
            match ins {
                Instr::Compute(c) if splits(c) => plain(c, &mut out),
                Instr::Overlap { fwd, bwd } if splits(fwd) || splits(bwd) => {
                    let (f, b) = (fwd, bwd);
                    if f.stage == b.stage && f.mb == b.mb {
                        // The loss stage's own forward and backward: no overlap possible.
                        for c in [f, b] {
                            if splits(c) {
                                plain(c, &mut out);
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
            if let Some(m) = spans {
                let s = m.get(r, i).unwrap_or_default();
                sp.extend(std::iter::repeat_n(s, out.len() - before));
            }
        }
        ranks.push(out);
        span_ranks.push(sp);
    }
    let mut pipeline = p.pipeline.clone();
    pipeline.moe_stages = Some(moe.to_vec());
    (
        Program { pipeline, ranks },
        spans.map(|_| SourceMap { ranks: span_ranks }),
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
