//! Pass 2: dependencies.
//!
//! Proves, on each rank, that every op comes after what it depends on in program order:
//! * `F(s,m)` after `F(s-1,m)` when both stages are on the rank (the fold of a V);
//! * the backward (`B` or `BW`) of `(s,m)` after its own `F(s,m)` (on the last stage: after the
//!   loss, computed by that forward) and after the backward of `(s+1,m)` when that is on the
//!   rank;
//! * `W(s,m)` after `B(s,m)`;
//! * the parts of an MoE-split op in execution order (forward: attn, dispatch, mlp, combine;
//!   backward: the reverse);
//! * in a program with communication: every send after the op that produces its payload, every
//!   compute op that consumes a message after the receive of that message, and every
//!   cross-rank dependency carried by a receive on the consuming rank (else `unmatched`);
//! * `REDUCE_GRAD(s)` after every W/BW of stage `s`; `WAIT_SA/SG` after its send.
//!
//! Cross-rank order (a forward on rank 1 that waits for rank 0) is not an order error: it is
//! what communication is for, and passes 3 and 4 prove it can be met.

use super::{compute_str, Ctx, OpIndex, Pos};
use crate::diag::{Code, Diagnostic};
use schedc_ir::{Comm, Compute, Instr, Kind, Part, Payload, PayloadKind, Program};
use std::collections::HashMap;

/// A dependency error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DepError {
    /// `later` must come after `earlier` on the same rank, but does not.
    Order {
        /// The op that comes too early.
        at: Pos,
        /// The op it depends on.
        dep: Pos,
        /// Explanation, e.g. "B(0,1) runs before its forward F(0,1)".
        why: String,
    },
    /// A `WAIT_RA/RG/SA/SG` with no receive or send of its payload before it on its rank.
    Wait {
        /// The wait.
        at: Pos,
        /// Explanation.
        why: String,
        /// What to write, for a compute-only program (whose messages the lowering places
        /// after this pass).
        help: Option<String>,
    },
    /// A cross-rank dependency without a receive on the consuming rank.
    NoMessage {
        /// The consumer.
        at: Pos,
        /// Explanation.
        why: String,
    },
}

impl DepError {
    /// Converts to a diagnostic.
    pub fn to_diagnostic(&self, cx: &Ctx<'_>) -> Diagnostic {
        let loc = |p: &Pos| cx.loc(p.rank as usize, p.pos as usize);
        match self {
            DepError::Order { at, dep, why } => {
                let mut d = Diagnostic::error(Code::Order, why.clone()).at(loc(at));
                if dep.is_some() {
                    d = d.with_related(loc(dep), "it depends on this");
                }
                d
            }
            DepError::Wait { at, why, help } => {
                let d = Diagnostic::error(Code::Order, why.clone()).at(loc(at));
                match help {
                    Some(h) => d.with_help(h.clone()),
                    None => d,
                }
            }
            DepError::NoMessage { at, why } => {
                Diagnostic::error(Code::Unmatched, why.clone()).at(loc(at))
            }
        }
    }
}

/// The help of a wait in a compute-only program: its `what` ("receives" or "sends") are
/// placed by the lowering (pass 3), after this pass, so a hand-written wait needs `msg`
/// written before it (and then every message: a program with one written is not lowered).
fn written_by_lowering(what: &str, msg: &str) -> String {
    format!(
        "this program has no message written, so its {what} are placed by the lowering (pass 3), after this check: a hand-written wait needs its message, {msg} here, written before it, and a program with one message written is not lowered, so every send and receive must then be written (`schedc convert INPUT --lowered --to ir-text` of the program without its waits writes them; `--moe=...:list` writes its own waits with them)"
    )
}

#[inline]
fn before(a: Pos, b: Pos) -> bool {
    a.rank == b.rank && a.pos < b.pos
}

/// Runs pass 2.
pub fn check(p: &Program, idx: &OpIndex) -> Vec<DepError> {
    let pl = &p.pipeline;
    let (s_n, m_n) = (pl.stages, pl.microbatches);
    let mut errs = Vec::new();
    let lowered = p.has_p2p();
    let n = s_n as usize * m_n as usize;
    // Receive and send positions by payload (first occurrence).
    let mut recv_at: [Vec<Pos>; 4] = std::array::from_fn(|_| vec![Pos::NONE; n]);
    let mut send_at: [Vec<Pos>; 4] = std::array::from_fn(|_| vec![Pos::NONE; n]);
    if lowered {
        for (r, instrs) in p.ranks.iter().enumerate() {
            for (i, ins) in instrs.iter().enumerate() {
                for m in ins.comms() {
                    let (pl_, tbl) = match m {
                        Comm::Send { payload, .. } => (payload, &mut send_at),
                        Comm::Recv { payload, .. } => (payload, &mut recv_at),
                        Comm::Collective(_) => continue,
                    };
                    if pl_.stage >= s_n || pl_.mb >= m_n {
                        continue;
                    }
                    let k = (pl_.stage * m_n + pl_.mb) as usize;
                    let t = &mut tbl[pl_.kind as usize];
                    if !t[k].is_some() {
                        t[k] = Pos {
                            rank: r as u32,
                            pos: i as u32,
                        };
                    }
                }
            }
        }
    }
    let name = |k: Kind, s: u32, m: u32| compute_str(&Compute::new(k, s, m));
    for s in 0..s_n {
        let r_s = pl.rank_of(s);
        for m in 0..m_n {
            let f = *idx.get(Kind::F, s, m).expect("in range");
            if f.present() {
                if let Some(ps) = pl.prev_stage(s) {
                    let fp = idx.get(Kind::F, ps, m).expect("in range");
                    if pl.rank_of(ps) == r_s {
                        if fp.present() && f.first.rank == fp.last.rank && !before(fp.last, f.first)
                        {
                            errs.push(DepError::Order {
                                at: f.first,
                                dep: fp.last,
                                why: format!(
                                    "{} runs before {}, whose output it consumes (both on rank {})",
                                    name(Kind::F, s, m),
                                    name(Kind::F, ps, m),
                                    r_s
                                ),
                            });
                        }
                    } else if lowered && f.first.rank == r_s {
                        let rp = recv_at[PayloadKind::Act as usize][(ps * m_n + m) as usize];
                        if !rp.is_some() || rp.rank != r_s {
                            errs.push(DepError::NoMessage {
                                at: f.first,
                                why: format!(
                                    "{} needs the activation of stage {ps} from rank {}, but rank {r_s} never receives it (no RA({ps},{m}<-{}))",
                                    name(Kind::F, s, m),
                                    pl.rank_of(ps),
                                    pl.rank_of(ps)
                                ),
                            });
                        } else if !before(rp, f.first) {
                            errs.push(DepError::Order {
                                at: f.first,
                                dep: rp,
                                why: format!(
                                    "{} runs before the receive of its input activation",
                                    name(Kind::F, s, m)
                                ),
                            });
                        }
                    }
                }
            }
            // The input-gradient backward.
            let bi = idx.backward_input(s, m).copied();
            if let Some(bi) = bi {
                let bk = if idx.get(Kind::BW, s, m).expect("in range").present() {
                    Kind::BW
                } else {
                    Kind::B
                };
                if f.present() && bi.first.rank == f.last.rank && !before(f.last, bi.first) {
                    errs.push(DepError::Order {
                        at: bi.first,
                        dep: f.last,
                        why: format!(
                            "{} runs before its forward {}",
                            name(bk, s, m),
                            name(Kind::F, s, m)
                        ),
                    });
                }
                if let Some(ns) = pl.next_stage(s) {
                    if pl.rank_of(ns) == r_s {
                        if let Some(bn) = idx.backward_input(ns, m) {
                            if bn.last.rank == bi.first.rank && !before(bn.last, bi.first) {
                                errs.push(DepError::Order {
                                    at: bi.first,
                                    dep: bn.last,
                                    why: format!(
                                        "{} runs before the backward of stage {ns}, whose input gradient it consumes (both on rank {r_s})",
                                        name(bk, s, m)
                                    ),
                                });
                            }
                        }
                    } else if lowered && bi.first.rank == r_s {
                        let rp = recv_at[PayloadKind::Grad as usize][(ns * m_n + m) as usize];
                        if !rp.is_some() || rp.rank != r_s {
                            errs.push(DepError::NoMessage {
                                at: bi.first,
                                why: format!(
                                    "{} needs the input gradient of stage {ns} from rank {}, but rank {r_s} never receives it (no RG({ns},{m}<-{}))",
                                    name(bk, s, m),
                                    pl.rank_of(ns),
                                    pl.rank_of(ns)
                                ),
                            });
                        } else if !before(rp, bi.first) {
                            errs.push(DepError::Order {
                                at: bi.first,
                                dep: rp,
                                why: format!(
                                    "{} runs before the receive of its output gradient",
                                    name(bk, s, m)
                                ),
                            });
                        }
                    }
                }
            }
            let b = idx.get(Kind::B, s, m).expect("in range");
            let w = idx.get(Kind::W, s, m).expect("in range");
            if b.present() && w.present() && w.first.rank == b.last.rank && !before(b.last, w.first)
            {
                errs.push(DepError::Order {
                    at: w.first,
                    dep: b.last,
                    why: format!(
                        "{} runs before {}: the weight gradient needs the input-gradient backward first",
                        name(Kind::W, s, m),
                        name(Kind::B, s, m)
                    ),
                });
            }
        }
    }
    // Per-rank scans: MoE part order, sends after producers, REDUCE_GRAD, WAIT_SEND.
    // Keyed by (kind, stage, mb) packed in a u64, with a multiplicative hash: a split
    // program has millions of parts, and SipHash was a tenth of `check --moe`.
    let mut part_seen: HashMap<
        u64,
        (usize, Pos),
        std::hash::BuildHasherDefault<super::PackedHasher>,
    > = HashMap::default();
    // Receives are tracked only for a program that waits for one (`WAIT_RA/RG`).
    let waits_for_receives = p
        .ranks
        .iter()
        .flatten()
        .any(|i| matches!(i, Instr::WaitRecv(_)));
    for (r, instrs) in p.ranks.iter().enumerate() {
        part_seen.clear();
        let mut sent: HashMap<Payload, Pos> = HashMap::new();
        let mut received: HashMap<Payload, Pos> = HashMap::new();
        for (i, ins) in instrs.iter().enumerate() {
            let at = Pos {
                rank: r as u32,
                pos: i as u32,
            };
            ins.for_each_compute(|c| {
                if c.part == Part::Whole {
                    return;
                }
                let ex = c.part.exec_index(c.kind);
                let key = ((c.kind as u64) << 62) | (u64::from(c.stage) << 31) | u64::from(c.mb);
                let e = part_seen.entry(key).or_insert((ex, at));
                if ex < e.0 {
                    errs.push(DepError::Order {
                        at,
                        dep: e.1,
                        why: format!(
                            "{} runs after a later part of the same {}: MoE parts run {}",
                            compute_str(c),
                            c.kind.as_str(),
                            match c.kind {
                                Kind::F => "attn, dispatch, mlp, combine",
                                Kind::W => "mlp, attn in a weight gradient",
                                _ => "combine, mlp, dispatch, attn in a backward",
                            }
                        ),
                    });
                } else {
                    *e = (ex, at);
                }
            });
            match ins {
                Instr::Comm(_) | Instr::Group(_) => {
                    for m in ins.comms() {
                        if let (Comm::Recv { payload, .. }, true) = (m, waits_for_receives) {
                            received.entry(*payload).or_insert(at);
                        }
                        if let Comm::Send { payload, .. } = m {
                            if payload.stage >= s_n || payload.mb >= m_n {
                                continue;
                            }
                            sent.entry(*payload).or_insert(at);
                            let prod = match payload.kind {
                                PayloadKind::Act => {
                                    idx.get(Kind::F, payload.stage, payload.mb).copied()
                                }
                                PayloadKind::Grad => {
                                    idx.backward_input(payload.stage, payload.mb).copied()
                                }
                                // A lent stash exists once its forward has run on the owner
                                // (pass 6b checks the rest); a returned one comes from the
                                // holder's receive.
                                PayloadKind::Lend => {
                                    idx.get(Kind::F, payload.stage, payload.mb).copied()
                                }
                                PayloadKind::Return => None,
                            };
                            if let Some(pr) = prod {
                                if pr.present() && pr.last.rank == at.rank && !before(pr.last, at) {
                                    errs.push(DepError::Order {
                                        at,
                                        dep: pr.last,
                                        why: format!(
                                            "this send runs before the op that produces its payload ({} of stage {}, micro-batch {})",
                                            match payload.kind { PayloadKind::Grad => "input gradient", PayloadKind::Act => "activation", _ => "stash" },
                                            payload.stage,
                                            payload.mb
                                        ),
                                    });
                                }
                            }
                        }
                    }
                }
                Instr::ReduceGrad(s) if *s < s_n => {
                    for m in 0..m_n {
                        if let Some(rel) = idx.release(*s, m) {
                            if rel.last.rank == at.rank && !before(rel.last, at) {
                                errs.push(DepError::Order {
                                    at,
                                    dep: rel.last,
                                    why: format!(
                                        "REDUCE_GRAD({s}) runs before the last weight gradient of stage {s} (micro-batch {m})"
                                    ),
                                });
                                break;
                            }
                        }
                    }
                }
                // An out-of-range wait is pass 1's range error alone.
                Instr::WaitRecv(pl_) | Instr::WaitSend(pl_)
                    if pl_.stage >= s_n || pl_.mb >= m_n => {}
                Instr::WaitRecv(pl_) if !received.contains_key(pl_) => {
                    let (ir, what) = match pl_.kind {
                        schedc_ir::PayloadKind::Act => ("RA", "activation"),
                        schedc_ir::PayloadKind::Grad => ("RG", "gradient"),
                        schedc_ir::PayloadKind::Lend => ("LEND", "lent stash"),
                        schedc_ir::PayloadKind::Return => ("RETURN", "returned stash"),
                    };
                    let from = pl.rank_of(pl_.stage);
                    errs.push(DepError::Wait {
                        at,
                        why: format!(
                            "this waits for the receive of the {what} of stage {}, micro-batch {} (`{ir}({},{}<-…)`), but rank {} posts no such receive before it: the receive is missing or comes after the wait",
                            pl_.stage, pl_.mb, pl_.stage, pl_.mb, at.rank
                        ),
                        help: (!lowered && !pl_.kind.is_stash()).then(|| written_by_lowering(
                            "receives",
                            &format!("`{ir}({},{}<-{from})`", pl_.stage, pl_.mb),
                        )),
                    });
                }
                Instr::WaitSend(pl_) if !sent.contains_key(pl_) => {
                    let (ir, torch, what) = match pl_.kind {
                        schedc_ir::PayloadKind::Act => ("SA", "SEND_F", "activation"),
                        schedc_ir::PayloadKind::Grad => ("SG", "SEND_B", "gradient"),
                        schedc_ir::PayloadKind::Lend => {
                            ("LEND", "(no torch action) ", "lent stash")
                        }
                        schedc_ir::PayloadKind::Return => {
                            ("RETURN", "(no torch action) ", "returned stash")
                        }
                    };
                    let to = match pl_.kind {
                        schedc_ir::PayloadKind::Act => pl.next_stage(pl_.stage),
                        schedc_ir::PayloadKind::Grad => pl.prev_stage(pl_.stage),
                        _ => None,
                    }
                    .map_or("…".to_string(), |s| pl.rank_of(s).to_string());
                    errs.push(DepError::Wait {
                        at,
                        why: format!(
                            "this waits for the send of the {what} of stage {}, micro-batch {} (`{ir}({},{}->…)`, torch's `{}{torch}{}`), but rank {} issues no such send before it: the send is missing or comes after the wait",
                            pl_.stage, pl_.mb, pl_.stage, pl_.mb, pl_.stage, pl_.mb, at.rank
                        ),
                        help: (!lowered && !pl_.kind.is_stash()).then(|| written_by_lowering(
                            "sends",
                            &format!("`{ir}({},{}->{to})`", pl_.stage, pl_.mb),
                        )),
                    });
                }
                _ => {}
            }
        }
    }
    errs
}
