//! Pass 1: well-formedness.
//!
//! Proves, for every stage `s < S` and micro-batch `m < M`:
//! * exactly one `F(s,m)`, and either exactly one `BW(s,m)` or exactly one `B(s,m)` and one
//!   `W(s,m)` (an MoE-split op counts once when each of its four parts occurs exactly once);
//! * every op names a stage and micro-batch in range, and runs on the rank that holds its
//!   stage;
//! * every send and receive names a payload in range, is on the rank that produces (send) or
//!   consumes (receive) it, and names the right peer; no rank messages itself;
//! * every collective names a declared communicator of which the rank is a member;
//! * MoE parts only on MoE stages, when the pipeline declares them (`moe_stages`);
//! * `REDUCE_GRAD(s)` appears at most once, on the rank holding `s`.
//!
//! It does not look at order (pass 2) or matching (pass 4).

use super::{compute_str, Ctx, OpIndex, Pos};
use crate::diag::{Code, Diagnostic};
use schedc_ir::{Comm, Compute, Instr, Kind, Part, PayloadKind, Pipeline, Program};

/// A well-formedness error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WfError {
    /// A stage, micro-batch or rank out of range.
    Range {
        /// Where.
        at: Pos,
        /// What is out of range ("stage", "micro-batch", "peer rank").
        what: &'static str,
        /// The value.
        value: u32,
        /// The exclusive limit.
        limit: u32,
    },
    /// An op on a rank that does not hold its stage.
    WrongRank {
        /// Where.
        at: Pos,
        /// The stage.
        stage: u32,
        /// The rank that holds it.
        holder: u32,
    },
    /// A message to or from the wrong peer (or to itself).
    WrongPeer {
        /// Where.
        at: Pos,
        /// The peer it should name, if any.
        expected: Option<u32>,
        /// Why.
        why: String,
    },
    /// An op given twice.
    Duplicate {
        /// The second occurrence.
        at: Pos,
        /// The first.
        first: Pos,
        /// The op.
        op: Compute,
    },
    /// Missing op(s) for (stage, mb).
    Missing {
        /// Stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
        /// What is missing, e.g. "F", "a backward (BW, or B and W)", "W (B is at rank 0 position 3)".
        what: String,
        /// A related position (e.g. the B without its W).
        near: Option<Pos>,
    },
    /// A collective on an unknown communicator or by a non-member.
    Collective {
        /// Where.
        at: Pos,
        /// Why.
        why: String,
    },
    /// A non-compute instruction given twice (e.g. `REDUCE_GRAD(s)`).
    DuplicateOther {
        /// The second occurrence.
        at: Pos,
        /// The first.
        first: Pos,
        /// What, e.g. "REDUCE_GRAD(0)".
        what: String,
    },
    /// Both a fused BW and a split B or W for one (stage, mb).
    FusedAndSplit {
        /// The split op.
        at: Pos,
        /// The BW.
        bw: Pos,
        /// The split op's text.
        op: String,
        /// The BW's text.
        bw_op: String,
    },
    /// An MoE part of an op on a stage the pipeline declares dense.
    DenseStage {
        /// Where.
        at: Pos,
        /// The part.
        op: Compute,
    },
    /// The program's rank count differs from P.
    RankCount {
        /// Ranks in the program.
        got: usize,
        /// P.
        pp: u32,
    },
}

impl WfError {
    /// Converts to a diagnostic.
    pub fn to_diagnostic(&self, cx: &Ctx<'_>) -> Diagnostic {
        let loc = |p: &Pos| cx.loc(p.rank as usize, p.pos as usize);
        match self {
            WfError::Range {
                at,
                what,
                value,
                limit,
            } => Diagnostic::error(
                Code::Range,
                format!("{what} {value} is out of range 0..{limit}"),
            )
            .at(loc(at)),
            WfError::WrongRank { at, stage, holder } => Diagnostic::error(
                Code::Placement,
                format!(
                    "stage {stage} is placed on rank {holder}, but this op runs on rank {}",
                    at.rank
                ),
            )
            .at(loc(at)),
            WfError::WrongPeer { at, expected, why } => {
                let mut d = Diagnostic::error(Code::Placement, why.clone()).at(loc(at));
                if let Some(e) = expected {
                    d = d.with_help(format!("the peer should be rank {e}"));
                }
                d
            }
            WfError::Duplicate { at, first, op } => Diagnostic::error(
                Code::DuplicateOp,
                format!("{} appears more than once", compute_str(op)),
            )
            .at(loc(at))
            .with_related(loc(first), "first occurrence"),
            WfError::Missing {
                stage,
                mb,
                what,
                near,
            } => {
                let mut d = Diagnostic::error(
                    Code::MissingOp,
                    format!("stage {stage}, micro-batch {mb} has no {what}"),
                );
                if let Some(p) = near {
                    d = d.at(loc(p));
                } else {
                    d.rank = cx
                        .program
                        .pipeline
                        .stage_to_rank
                        .get(*stage as usize)
                        .copied();
                }
                d
            }
            WfError::DuplicateOther { at, first, what } => {
                Diagnostic::error(Code::DuplicateOp, format!("{what} appears more than once"))
                    .at(loc(at))
                    .with_related(loc(first), "first occurrence")
            }
            WfError::FusedAndSplit { at, bw, op, bw_op } => Diagnostic::error(
                Code::DuplicateOp,
                format!("{op} repeats work that {bw_op} already does: BW is the fused B + W"),
            )
            .at(loc(at))
            .with_related(loc(bw), "the fused backward")
            .with_help("keep either the fused BW or the split B and W"),
            WfError::Collective { at, why } => {
                Diagnostic::error(Code::CollectiveOrder, why.clone()).at(loc(at))
            }
            WfError::DenseStage { at, op } => {
                let moe = cx.program.pipeline.moe_stages.as_deref().unwrap_or(&[]);
                Diagnostic::error(
                    Code::Placement,
                    format!(
                        "{} is an MoE part, but stage {} is dense: only the MoE stages ({}) are split {}",
                        compute_str(op),
                        op.stage,
                        if moe.is_empty() {
                            "none".to_string()
                        } else {
                            moe.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                        },
                        if op.kind == Kind::W {
                            "(a weight gradient into mlp and attn)"
                        } else {
                            "into attention, dispatch, MLP and combine"
                        }
                    ),
                )
                .at(loc(at))
                .with_help(format!(
                    "run stage {} whole ({}), or declare it MoE (a spec's `moe` item, an IR file's `moe` line)",
                    op.stage,
                    compute_str(&Compute::new(op.kind, op.stage, op.mb))
                ))
            }
            WfError::RankCount { got, pp } => Diagnostic::error(
                Code::Range,
                format!("the program has {got} ranks but pp is {pp}"),
            ),
        }
    }
}

/// Where `c` (the same kind, stage, micro-batch and part) first occurs in `p`, ranks in
/// order.
fn first_copy(p: &Program, c: &Compute) -> Option<Pos> {
    for (r, instrs) in p.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            let mut hit = false;
            ins.for_each_compute(|x| {
                hit |= x.kind == c.kind && x.stage == c.stage && x.mb == c.mb && x.part == c.part;
            });
            if hit {
                return Some(Pos {
                    rank: r as u32,
                    pos: i as u32,
                });
            }
        }
    }
    None
}

/// Runs pass 1. `idx` must be built from the same program.
pub fn check(p: &Program, idx: &OpIndex) -> Vec<WfError> {
    let mut errs = Vec::new();
    let pl = &p.pipeline;
    let (s_n, m_n, pp) = (pl.stages, pl.microbatches, pl.pp);
    if p.ranks.len() != pp as usize {
        errs.push(WfError::RankCount {
            got: p.ranks.len(),
            pp,
        });
    }
    // Per-op checks: ranges, placement, peers, duplicates.
    let n = s_n as usize * m_n as usize;
    // Seen bitmaps per (kind, part) to find second occurrences in program order.
    let mut seen: Vec<Vec<u64>> = vec![vec![0u64; n.div_ceil(64)]; 4 * 5];
    let mut reduce_seen = vec![Pos::NONE; s_n as usize];
    // Which stages may be split (None: any).
    let moe_ok: Option<Vec<bool>> = pl
        .moe_stages
        .as_ref()
        .map(|_| (0..s_n).map(|s| pl.is_moe_stage(s)).collect());
    for (r, instrs) in p.ranks.iter().enumerate() {
        let r32 = r as u32;
        for (i, ins) in instrs.iter().enumerate() {
            let at = Pos {
                rank: r32,
                pos: i as u32,
            };
            let mut check_compute = |c: &Compute| {
                if let Some(e) = range_error(pl, at, c.stage, c.mb) {
                    errs.push(e);
                    return;
                }
                if c.part != Part::Whole && !moe_ok.as_ref().is_none_or(|v| v[c.stage as usize]) {
                    errs.push(WfError::DenseStage { at, op: *c });
                }
                let holder = pl.rank_of(c.stage);
                if holder != r32 {
                    errs.push(WfError::WrongRank {
                        at,
                        stage: c.stage,
                        holder,
                    });
                }
                let k = match c.kind {
                    Kind::F => 0,
                    Kind::B => 1,
                    Kind::W => 2,
                    Kind::BW => 3,
                };
                let pi = match c.part {
                    Part::Whole => 0,
                    Part::Attn => 1,
                    Part::Dispatch => 2,
                    Part::Mlp => 3,
                    Part::Combine => 4,
                };
                let key = (c.stage * m_n + c.mb) as usize;
                let bits = &mut seen[k * 5 + pi];
                let (w, b) = (key / 64, 1u64 << (key % 64));
                if bits[w] & b != 0 {
                    // The earlier copy of this very part (the index knows the op's first
                    // part only); a rare error, so a scan.
                    let first = first_copy(p, c)
                        .or_else(|| idx.get(c.kind, c.stage, c.mb).map(|s| s.first))
                        .unwrap_or(Pos::NONE);
                    errs.push(WfError::Duplicate { at, first, op: *c });
                } else {
                    bits[w] |= b;
                }
            };
            match ins {
                Instr::Compute(c) => check_compute(c),
                Instr::Overlap { fwd, bwd } => {
                    check_compute(fwd);
                    check_compute(bwd);
                }
                Instr::Comm(m) => check_comm(p, at, m, &mut errs),
                Instr::Group(g) => {
                    for m in g {
                        check_comm(p, at, m, &mut errs);
                    }
                }
                Instr::ReduceGrad(s) => {
                    if *s >= s_n {
                        errs.push(WfError::Range {
                            at,
                            what: "stage",
                            value: *s,
                            limit: s_n,
                        });
                    } else {
                        if pl.rank_of(*s) != r32 {
                            errs.push(WfError::WrongRank {
                                at,
                                stage: *s,
                                holder: pl.rank_of(*s),
                            });
                        }
                        if reduce_seen[*s as usize].is_some() {
                            errs.push(WfError::DuplicateOther {
                                at,
                                first: reduce_seen[*s as usize],
                                what: format!("REDUCE_GRAD({s})"),
                            });
                        } else {
                            reduce_seen[*s as usize] = at;
                        }
                    }
                }
                Instr::WaitReduceGrad(s) | Instr::Unshard(s) | Instr::Reshard(s) => {
                    if *s >= s_n {
                        errs.push(WfError::Range {
                            at,
                            what: "stage",
                            value: *s,
                            limit: s_n,
                        });
                    }
                }
                Instr::WaitSend(pl_) | Instr::WaitRecv(pl_) => {
                    errs.extend(range_error(pl, at, pl_.stage, pl_.mb));
                }
                Instr::Mem(op) => {
                    let n = errs.len();
                    errs.extend(range_error(pl, at, op.stage, op.mb));
                    if errs.len() == n && pl.rank_of(op.stage) != r32 {
                        errs.push(WfError::WrongRank {
                            at,
                            stage: op.stage,
                            holder: pl.rank_of(op.stage),
                        });
                    }
                }
                Instr::Idle => {}
            }
        }
    }
    // Completeness. A missing op is shown where its rank's program ends (the last compute op
    // of the rank holding the stage), so that a spec's error points at the statement that
    // emitted that op.
    let last_compute: Vec<Option<Pos>> = p
        .ranks
        .iter()
        .enumerate()
        .map(|(r, v)| {
            v.iter().rposition(Instr::is_compute).map(|i| Pos {
                rank: r as u32,
                pos: i as u32,
            })
        })
        .collect();
    let end_of = |s: u32| -> Option<Pos> {
        pl.stage_to_rank
            .get(s as usize)
            .and_then(|&r| last_compute.get(r as usize).copied().flatten())
    };
    for s in 0..s_n {
        for m in 0..m_n {
            let f = idx.get(Kind::F, s, m).expect("in range");
            let b = idx.get(Kind::B, s, m).expect("in range");
            let w = idx.get(Kind::W, s, m).expect("in range");
            let bw = idx.get(Kind::BW, s, m).expect("in range");
            if !f.present() {
                // Next to a backward of the same (stage, micro-batch), or where the rank's
                // program ends.
                let near = [b, bw, w]
                    .iter()
                    .find(|x| x.present())
                    .map(|x| x.first)
                    .or_else(|| end_of(s));
                errs.push(WfError::Missing {
                    stage: s,
                    mb: m,
                    what: if [b, bw, w].iter().any(|x| x.present()) {
                        "forward F".into()
                    } else {
                        format!(
                            "forward F (rank {}'s program ends without it)",
                            pl.stage_to_rank.get(s as usize).copied().unwrap_or(0)
                        )
                    },
                    near,
                });
            }
            for (kind, slot) in [(Kind::F, f), (Kind::B, b), (Kind::W, w), (Kind::BW, bw)] {
                if !slot.present() {
                    continue;
                }
                let any_part = slot.parts.iter().any(|&c| c > 0);
                if slot.whole > 0 && any_part {
                    errs.push(WfError::Duplicate {
                        at: slot.last,
                        first: slot.first,
                        op: Compute::new(kind, s, m),
                    });
                } else if any_part {
                    if kind == Kind::W && (slot.parts[1] > 0 || slot.parts[3] > 0) {
                        // A weight gradient moves no tokens: its parts are `mlp` and `attn`.
                        errs.push(WfError::Missing {
                            stage: s,
                            mb: m,
                            what:
                                "W split as W.mlp and W.attn (a W has no dispatch or combine part)"
                                    .into(),
                            near: Some(slot.first),
                        });
                        continue;
                    }
                    let missing: Vec<&str> = Part::FORWARD_ORDER
                        .iter()
                        .zip(slot.parts.iter())
                        .filter(|(p, &c)| c == 0 && Part::order(kind).contains(p))
                        .map(|(p, _)| p.as_str())
                        .collect();
                    if !missing.is_empty() {
                        errs.push(WfError::Missing {
                            stage: s,
                            mb: m,
                            what: format!(
                                "{} part(s) {} of its split {}",
                                kind.as_str(),
                                missing.join(", "),
                                kind.as_str()
                            ),
                            near: Some(slot.first),
                        });
                    }
                }
            }
            match (bw.present(), b.present(), w.present()) {
                (true, false, false) | (false, true, true) => {}
                (false, false, false) => errs.push(WfError::Missing {
                    stage: s,
                    mb: m,
                    what: if f.present() {
                        "backward (BW, or B then W) after its forward".into()
                    } else {
                        "backward (BW, or B then W)".into()
                    },
                    near: if f.present() {
                        Some(f.first)
                    } else {
                        end_of(s)
                    },
                }),
                (false, true, false) => errs.push(WfError::Missing {
                    stage: s,
                    mb: m,
                    what: "W after its B (the weight gradient is never computed)".into(),
                    near: Some(b.first),
                }),
                (false, false, true) => errs.push(WfError::Missing {
                    stage: s,
                    mb: m,
                    what: "B before its W (the input gradient is never computed)".into(),
                    near: Some(w.first),
                }),
                (true, _, _) => {
                    let (other, k) = if b.present() {
                        (b.first, Kind::B)
                    } else {
                        (w.first, Kind::W)
                    };
                    errs.push(WfError::FusedAndSplit {
                        at: other,
                        bw: bw.first,
                        op: compute_str(&Compute::new(k, s, m)),
                        bw_op: compute_str(&Compute::new(Kind::BW, s, m)),
                    });
                }
            }
        }
    }
    errs
}

/// The `range` error for a (stage, micro-batch) pair at `at`, stage checked first.
fn range_error(pl: &Pipeline, at: Pos, stage: u32, mb: u32) -> Option<WfError> {
    let (what, value, limit) = if stage >= pl.stages {
        ("stage", stage, pl.stages)
    } else if mb >= pl.microbatches {
        ("micro-batch", mb, pl.microbatches)
    } else {
        return None;
    };
    Some(WfError::Range {
        at,
        what,
        value,
        limit,
    })
}

/// The ends of a `LEND`/`RETURN` message: the owner of stage `s` (the rank that holds it)
/// sends `LEND` and receives `RETURN`; another rank, the holder, receives `LEND` and sends
/// `RETURN`, each naming the owner as its peer.
fn check_stash(
    p: &Program,
    at: Pos,
    send: bool,
    payload: &schedc_ir::Payload,
    peer: u32,
    errs: &mut Vec<WfError>,
) {
    let (s, m) = (payload.stage, payload.mb);
    let owner = p.pipeline.rank_of(s);
    let lend = payload.kind == PayloadKind::Lend;
    let op = if lend { "LEND" } else { "RETURN" };
    // Does this end belong on the owner?
    let on_owner = lend == send;
    let why = if peer == at.rank {
        Some(if lend && send {
            format!("LEND({s},{m}->{peer}): rank {peer} lends the stash of F({s},{m}) to itself; lend it to another rank (BPipe pairs rank r with rank P-1-r)")
        } else {
            format!("{op}({s},{m}): rank {peer} sends the stash of F({s},{m}) to itself")
        })
    } else if on_owner && at.rank != owner {
        Some(format!(
            "{op}({s},{m}) {} on rank {}, but the stash of F({s},{m}) belongs to rank {owner}, which holds stage {s}",
            if send { "sends" } else { "receives" },
            at.rank
        ))
    } else if !on_owner && peer != owner {
        Some(format!(
            "{op}({s},{m}) on rank {} names rank {peer}, but the stash of F({s},{m}) {} rank {owner}, which holds stage {s}",
            at.rank,
            if send { "goes back to" } else { "comes from" }
        ))
    } else {
        None
    };
    if let Some(why) = why {
        errs.push(WfError::WrongPeer {
            at,
            expected: None,
            why: format!("rank {} step {}: {why}", at.rank, at.pos),
        });
    }
}

fn check_comm(p: &Program, at: Pos, m: &Comm, errs: &mut Vec<WfError>) {
    let pl = &p.pipeline;
    let pp = pl.pp;
    match m {
        Comm::Send { payload, peer, .. } | Comm::Recv { payload, peer, .. } => {
            let send = matches!(m, Comm::Send { .. });
            if *peer >= pp {
                if payload.kind.is_stash() {
                    let (op, dir) = match (payload.kind, send) {
                        (schedc_ir::PayloadKind::Lend, true) => ("LEND", "lends the stash to"),
                        (schedc_ir::PayloadKind::Lend, false) => ("LEND", "receives the stash from"),
                        (_, true) => ("RETURN", "returns the stash to"),
                        (_, false) => ("RETURN", "receives the stash back from"),
                    };
                    errs.push(WfError::WrongPeer {
                        at,
                        expected: None,
                        why: format!(
                            "rank {} step {}: {op}({},{}): rank {} {dir} rank {peer}, which does not exist (the pipeline has ranks 0..{})",
                            at.rank,
                            at.pos,
                            payload.stage,
                            payload.mb,
                            at.rank,
                            pp.saturating_sub(1)
                        ),
                    });
                    return;
                }
                errs.push(WfError::Range {
                    at,
                    what: "peer rank",
                    value: *peer,
                    limit: pp,
                });
                return;
            }
            if let Some(e) = range_error(pl, at, payload.stage, payload.mb) {
                errs.push(e);
                return;
            }
            if payload.kind.is_stash() {
                check_stash(p, at, send, payload, *peer, errs);
                return;
            }
            if *peer == at.rank {
                errs.push(WfError::WrongPeer {
                    at,
                    expected: None,
                    why: format!("rank {} sends a message to itself", at.rank),
                });
                return;
            }
            let s = payload.stage;
            let producer = pl.rank_of(s);
            let consumer_stage = match payload.kind {
                PayloadKind::Act => pl.next_stage(s),
                _ => pl.prev_stage(s),
            };
            let what = match payload.kind {
                PayloadKind::Act => "activation",
                _ => "input gradient",
            };
            let Some(cs) = consumer_stage else {
                errs.push(WfError::WrongPeer {
                    at,
                    expected: None,
                    why: format!(
                        "the {what} of stage {s} is consumed by no stage (stage {s} is the {} stage of its direction)",
                        if payload.kind == PayloadKind::Act { "last" } else { "first" }
                    ),
                });
                return;
            };
            let consumer = pl.rank_of(cs);
            let (me_should, peer_should) = if send {
                (producer, consumer)
            } else {
                (consumer, producer)
            };
            if me_should != at.rank {
                errs.push(WfError::WrongPeer {
                    at,
                    expected: None,
                    why: format!(
                        "the {what} of stage {s} is {} by rank {me_should}, not rank {}",
                        if send { "sent" } else { "received" },
                        at.rank
                    ),
                });
            } else if *peer != peer_should {
                errs.push(WfError::WrongPeer {
                    at,
                    expected: Some(peer_should),
                    why: format!(
                        "the {what} of stage {s} goes {} rank {peer_should} (stage {}), not rank {peer}",
                        if send { "to" } else { "from" },
                        if send { cs } else { s }
                    ),
                });
            } else if producer == consumer {
                errs.push(WfError::WrongPeer {
                    at,
                    expected: None,
                    why: format!("stages {s} and {cs} share rank {producer}: they hand over in memory, with no message"),
                });
            }
        }
        Comm::Collective(c) => match pl.communicators.iter().find(|g| g.name == c.comm) {
            None => errs.push(WfError::Collective {
                at,
                why: format!(
                    "unknown communicator `{}` (declare it: in a spec, `communicator {} [ranks]`; in IR text or a `literal` block, `group {} <ranks>`)",
                    c.comm, c.comm, c.comm
                ),
            }),
            Some(g) => {
                if !g.ranks.contains(&at.rank) {
                    errs.push(WfError::Collective {
                        at,
                        why: format!(
                            "rank {} is not a member of communicator `{}`",
                            at.rank, c.comm
                        ),
                    });
                }
            }
        },
    }
}
