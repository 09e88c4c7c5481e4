//! Pass 6b: memory ops (`OFFLOAD`, `RELOAD`, `RECOMPUTE`) against the activations' state.
//!
//! On each rank, the saved activations of forward `F(s,m)` go through the states
//! *not yet produced* → (`F`) *on the device* → (`OFFLOAD`) *on the host* → (`RELOAD` or
//! `RECOMPUTE`) *on the device* → ... → (the releasing `BW`, or `W` of a split backward)
//! *released*. The pass proves, per rank and in program order:
//!
//! * every `B`, `W` and `BW` of `(s,m)` finds the activations on the device: stashed and not
//!   offloaded, reloaded after their offload, or recomputed;
//! * `OFFLOAD(s,m)` only while they are on the device (after `F`, not offloaded twice, not
//!   after their release);
//! * `RELOAD(s,m)` only while they are on the host (after an `OFFLOAD`);
//! * `RECOMPUTE(s,m)` only while they are not on the device (after an `OFFLOAD` that was not
//!   reloaded, the host copy is then dropped; or after a checkpointed `F(s,m)!`, which keeps
//!   only its input): recomputing what is still stashed is an error;
//! * the backward of a checkpointed `F(s,m)!` comes after a `RECOMPUTE(s,m)`, and such a
//!   forward is never offloaded or reloaded (it has nothing saved to move).
//!
//! Lending (BPipe, `LEND`/`RETURN` messages): on the owner, `LEND(s,m->r)` moves the stash
//! from *on the device* to *lent*, and `RETURN(s,m<-h)` back; a backward that finds it lent,
//! a second `LEND` of it, or a `RETURN` receive of a stash that was not lent is an error. On
//! the holder, `RETURN(s,m->o)` needs an earlier `LEND(s,m<-o)` (a RETURN without LEND).
//!
//! Memory ops of a stage the rank does not hold, or out of range, are pass 1's errors and are
//! skipped here. Errors carry the rank and the position (step) of the offending op.

use super::{Ctx, Pos};
use crate::diag::{Code, Diagnostic};
use schedc_ir::{Comm, Instr, Kind, MemKind, PayloadKind, Program};

/// Where a forward's saved activations are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Where {
    /// No `F` yet.
    NotYet,
    /// On the device (stashed, reloaded or recomputed).
    Device,
    /// Offloaded to host memory.
    Host,
    /// Dropped after a checkpointed forward `F(s,m)!`: only its input is kept.
    Input,
    /// Released by the backward.
    Released,
    /// Lent to another rank (`LEND(s,m->r)`) and not returned yet.
    Lent,
    /// On a rank that does not own the stage: no stash of it held (no `LEND(s,m<-o)`
    /// received, or already returned).
    NotHeld,
    /// On a rank that does not own the stage: received with `LEND(s,m<-o)` and never sent
    /// back (a LEND without its RETURN; the error is at the LEND's receive).
    Held,
    /// Offloaded after its split backward's `B` ran: what `W` still needs is `B`'s part of
    /// the stash, which a `RECOMPUTE` (a forward) cannot rebuild; only a `RELOAD` brings it
    /// back.
    HostAfterB,
}

impl Where {
    fn describe(self) -> &'static str {
        match self {
            Where::NotYet => "not produced yet (no F before it on this rank)",
            Where::Device => "already on the device",
            Where::Host => "offloaded to the host and not reloaded",
            Where::Input => {
                "not saved: F(s,m)! kept only its input, and no RECOMPUTE rebuilt them yet"
            }
            Where::Released => "already released by the backward",
            Where::Lent => "lent to another rank and not returned",
            Where::NotHeld => "not held by this rank: no LEND of them was received before it (RETURN without LEND)",
            Where::Held => "held here and never returned to their owner (LEND without RETURN)",
            Where::HostAfterB => {
                "offloaded after B ran: W needs what B left, which a recompute (a forward) cannot rebuild"
            }
        }
    }
}

/// A memory-op error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemError {
    /// The offending op (a memory op, or a B/W/BW that does not find its activations).
    pub at: Pos,
    /// The forward's stage.
    pub stage: u32,
    /// The forward's micro-batch.
    pub mb: u32,
    /// The state of the activations there.
    pub state: Where,
    /// For a backward after an offload: the position of that `OFFLOAD`; after a
    /// checkpointed forward: the position of that `F(s,m)!`.
    pub offloaded_at: Option<u32>,
    /// For a backward (or a memory op) after a `LEND`: (its position, the holder rank).
    pub lent_at: Option<(u32, u32)>,
    /// For the owner's `RETURN` receive from a rank the stash was not lent to: that rank
    /// (`lent_at` names the holder).
    pub returned_by: Option<u32>,
}

impl MemError {
    /// Converts to a diagnostic (code `memory`).
    pub fn to_diagnostic(&self, cx: &Ctx<'_>) -> Diagnostic {
        let loc = cx.loc(self.at.rank as usize, self.at.pos as usize);
        if let (Some((o, h)), Some(x)) = (self.lent_at, self.returned_by) {
            return Diagnostic::error(
                Code::Memory,
                format!(
                    "rank {} step {}: `{}` receives the activations of F({},{}) back from rank {x}, but they were lent to rank {h} at step {o}",
                    self.at.rank, self.at.pos, loc.op, self.stage, self.mb
                ),
            )
            .at(loc)
            .with_help(format!(
                "receive them from their holder: `RETURN({},{}<-{h})`",
                self.stage, self.mb
            ));
        }
        if let Some((o, h)) = self.lent_at {
            return Diagnostic::error(
                Code::Memory,
                format!(
                    "rank {} step {}: `{}` needs the activations of F({},{}) on this device, but they were lent to rank {h} at step {o} and not returned",
                    self.at.rank, self.at.pos, loc.op, self.stage, self.mb
                ),
            )
            .at(loc)
            .with_help(format!(
                "have rank {h} send them back (`RETURN({},{}->{})`) and receive them here (`RETURN({},{}<-{h})`) before it",
                self.stage, self.mb, self.at.rank, self.stage, self.mb
            ));
        }
        let msg = match self.offloaded_at {
            Some(o) if self.state == Where::Input => format!(
                "rank {} step {}: `{}` reads the activations of F({},{}), checkpointed at step {} \
                 (`F({},{})!` saves only its input) and never recomputed",
                self.at.rank, self.at.pos, loc.op, self.stage, self.mb, o, self.stage, self.mb
            ),
            Some(o) if self.state == Where::HostAfterB => format!(
                "rank {} step {}: `{}` reads the activations of F({},{}), offloaded at step {} \
                 after its B and never reloaded",
                self.at.rank, self.at.pos, loc.op, self.stage, self.mb, o
            ),
            Some(o) => format!(
                "rank {} step {}: `{}` reads the activations of F({},{}), offloaded at step {} \
                 and never reloaded or recomputed",
                self.at.rank, self.at.pos, loc.op, self.stage, self.mb, o
            ),
            None => format!(
                "rank {} step {}: `{}` is not valid here: the activations of F({},{}) are {}",
                self.at.rank,
                self.at.pos,
                loc.op,
                self.stage,
                self.mb,
                self.state.describe()
            ),
        };
        let help = if self.state == Where::HostAfterB {
            format!(
                "put RELOAD({},{}) before W({},{}): a RECOMPUTE cannot rebuild what B({},{}) kept for it",
                self.stage, self.mb, self.stage, self.mb, self.stage, self.mb
            )
        } else if self.state == Where::Input && self.offloaded_at.is_some() {
            format!(
                "put RECOMPUTE({},{}) before the backward on this rank",
                self.stage, self.mb
            )
        } else if self.offloaded_at.is_some() {
            format!(
                "put RELOAD({},{}) (or RECOMPUTE({},{})) before the backward",
                self.stage, self.mb, self.stage, self.mb
            )
        } else if self.state == Where::Held {
            format!(
                "send them back before the step ends: `RETURN({},{}->{})` on this rank",
                self.stage,
                self.mb,
                cx.program.pipeline.rank_of(self.stage)
            )
        } else if self.state == Where::NotHeld {
            format!(
                "a rank returns only a stash it was lent: receive it first with `LEND({},{}<-{})`",
                self.stage,
                self.mb,
                cx.program.pipeline.rank_of(self.stage)
            )
        } else if loc.op.starts_with("RETURN") {
            format!(
                "RETURN({},{}) without LEND: the owner receives back only a stash it lent with `LEND({},{}->r)`",
                self.stage, self.mb, self.stage, self.mb
            )
        } else {
            "OFFLOAD and LEND need stashed activations, RELOAD and RECOMPUTE an earlier OFFLOAD, RETURN an earlier LEND".into()
        };
        Diagnostic::error(Code::Memory, msg).at(loc).with_help(help)
    }
}

/// Checks every rank's memory ops; returns all errors, in rank then program order. A program
/// without memory ops is never rejected here.
pub fn check(p: &Program) -> Vec<MemError> {
    let pl = &p.pipeline;
    let m_n = pl.microbatches as usize;
    let s_n = pl.stages as usize;
    let mut errs = Vec::new();
    let checkpointed = |i: &Instr| {
        let mut c = false;
        i.for_each_compute(|x| c |= x.checkpoint);
        c
    };
    if !p
        .ranks
        .iter()
        .flatten()
        .any(|i| matches!(i, Instr::Mem(_)) || checkpointed(i))
        && !p.has_lending()
    {
        return errs;
    }
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut state = vec![Where::NotYet; s_n * m_n];
        let mut off_at = vec![0u32; s_n * m_n];
        // Lent stashes: (position of the LEND, holder); on a holder, whether it holds (s,m).
        let mut lent = vec![(0u32, 0u32); s_n * m_n];
        let mut held = vec![false; s_n * m_n];
        let mut held_at = vec![0u32; s_n * m_n];
        // Whether (s,m) has a split backward (its W releases it, not its B), and whether
        // its B has run (an offload after it holds what W needs).
        let mut split = vec![false; s_n * m_n];
        let mut backed = vec![false; s_n * m_n];
        for ins in instrs {
            ins.for_each_compute(|c| {
                if (c.stage as usize) < s_n && (c.mb as usize) < m_n && c.kind == Kind::W {
                    split[c.stage as usize * m_n + c.mb as usize] = true;
                }
            });
        }
        for (i, ins) in instrs.iter().enumerate() {
            let at = Pos {
                rank: r as u32,
                pos: i as u32,
            };
            let key = |s: u32, m: u32| -> Option<usize> {
                ((s as usize) < s_n && (m as usize) < m_n).then(|| s as usize * m_n + m as usize)
            };
            match ins {
                Instr::Mem(op) => {
                    let Some(k) = key(op.stage, op.mb) else {
                        continue;
                    };
                    if pl.rank_of(op.stage) as usize != r {
                        continue;
                    }
                    let (need, next) = match op.kind {
                        MemKind::Offload if backed[k] => (Where::Device, Where::HostAfterB),
                        MemKind::Offload => (Where::Device, Where::Host),
                        MemKind::Reload if state[k] == Where::HostAfterB => {
                            (Where::HostAfterB, Where::Device)
                        }
                        MemKind::Reload => (Where::Host, Where::Device),
                        MemKind::Recompute if state[k] == Where::Input => {
                            (Where::Input, Where::Device)
                        }
                        MemKind::Recompute => (Where::Host, Where::Device),
                    };
                    if state[k] == need {
                        state[k] = next;
                        if op.kind == MemKind::Offload {
                            off_at[k] = i as u32;
                        }
                    } else {
                        errs.push(MemError {
                            at,
                            stage: op.stage,
                            mb: op.mb,
                            state: state[k],
                            offloaded_at: None,
                            lent_at: (state[k] == Where::Lent).then_some(lent[k]),
                            returned_by: None,
                        });
                    }
                }
                Instr::Comm(_) | Instr::Group(_) => {
                    for m in ins.comms() {
                        let (payload, peer, send) = match m {
                            Comm::Send { payload, peer, .. } => (payload, *peer, true),
                            Comm::Recv { payload, peer, .. } => (payload, *peer, false),
                            Comm::Collective(_) => continue,
                        };
                        if !payload.kind.is_stash() || peer as usize >= p.ranks.len() {
                            continue;
                        }
                        let Some(k) = key(payload.stage, payload.mb) else {
                            continue;
                        };
                        let owner = pl.rank_of(payload.stage) as usize;
                        let lend = payload.kind == PayloadKind::Lend;
                        // Pass 1 reports an end on the wrong rank.
                        if (lend == send) != (owner == r) {
                            continue;
                        }
                        let bad = |state: Where| MemError {
                            at,
                            stage: payload.stage,
                            mb: payload.mb,
                            state,
                            offloaded_at: None,
                            lent_at: None,
                            returned_by: None,
                        };
                        match (lend, send) {
                            // Owner lends: the stash must be on its device.
                            (true, true) => {
                                if state[k] == Where::Device {
                                    state[k] = Where::Lent;
                                    lent[k] = (i as u32, peer);
                                } else {
                                    let mut e = bad(state[k]);
                                    e.lent_at = (state[k] == Where::Lent).then_some(lent[k]);
                                    errs.push(e);
                                }
                            }
                            // Owner receives it back: it must have lent it.
                            (false, false) => {
                                if state[k] == Where::Lent && lent[k].1 != peer {
                                    let mut e = bad(Where::Lent);
                                    e.lent_at = Some(lent[k]);
                                    e.returned_by = Some(peer);
                                    errs.push(e);
                                    state[k] = Where::Device;
                                } else if state[k] == Where::Lent {
                                    state[k] = Where::Device;
                                } else {
                                    errs.push(bad(state[k]));
                                }
                            }
                            // Holder receives: it must not hold it already.
                            (true, false) => {
                                if held[k] {
                                    errs.push(bad(Where::Device));
                                }
                                held[k] = true;
                                held_at[k] = i as u32;
                            }
                            // Holder returns: it must hold it.
                            (false, true) => {
                                if !held[k] {
                                    errs.push(bad(Where::NotHeld));
                                }
                                held[k] = false;
                            }
                        }
                    }
                }
                _ => {
                    let mut reported = false;
                    ins.for_each_compute(|c| {
                        let Some(k) = key(c.stage, c.mb) else {
                            return;
                        };
                        match c.kind {
                            Kind::F => {
                                if state[k] == Where::NotYet {
                                    if c.checkpoint {
                                        state[k] = Where::Input;
                                        off_at[k] = i as u32;
                                    } else {
                                        state[k] = Where::Device;
                                    }
                                }
                            }
                            Kind::B | Kind::W | Kind::BW => {
                                if c.kind == Kind::B && super::is_last_part(c) {
                                    backed[k] = true;
                                }
                                let gone = matches!(
                                    state[k],
                                    Where::Host | Where::Input | Where::HostAfterB
                                );
                                if gone && !reported {
                                    reported = true;
                                    errs.push(MemError {
                                        at,
                                        stage: c.stage,
                                        mb: c.mb,
                                        state: state[k],
                                        offloaded_at: Some(off_at[k]),
                                        lent_at: None,
                                        returned_by: None,
                                    });
                                }
                                if state[k] == Where::Lent && !reported {
                                    reported = true;
                                    errs.push(MemError {
                                        at,
                                        stage: c.stage,
                                        mb: c.mb,
                                        state: Where::Lent,
                                        offloaded_at: None,
                                        lent_at: Some(lent[k]),
                                        returned_by: None,
                                    });
                                }
                                let releases = super::is_last_part(c)
                                    && (c.kind == Kind::BW || (c.kind == Kind::W && split[k]));
                                if releases {
                                    state[k] = Where::Released;
                                }
                            }
                        }
                    });
                }
            }
        }
        // A stash lent here and never sent back: at its LEND's receive.
        for (k, _) in held.iter().enumerate().filter(|(_, &h)| h) {
            errs.push(MemError {
                at: Pos {
                    rank: r as u32,
                    pos: held_at[k],
                },
                stage: (k / m_n) as u32,
                mb: (k % m_n) as u32,
                state: Where::Held,
                offloaded_at: None,
                lent_at: None,
                returned_by: None,
            });
        }
    }
    errs.sort_by_key(|e| (e.at.rank, e.at.pos));
    errs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prog(src: &str) -> Program {
        schedc_ir::text::parse(src).unwrap().program
    }

    /// Newcomer round 5, finding 1: an offload after a split backward's B holds what its W
    /// needs (B's part of the stash); a RECOMPUTE (a forward) cannot rebuild that, so only a
    /// RELOAD may bring it back (`run` failed on the program `check` had accepted).
    #[test]
    fn recompute_after_an_offload_that_follows_b_is_rejected() {
        let bad = prog("pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) F(0,1) B(0,0) OFFLOAD(0,0) B(0,1) RECOMPUTE(0,0) W(0,0) W(0,1)\n");
        let e = check(&bad);
        assert_eq!(e.len(), 2, "{e:?}");
        assert_eq!(e[0].at, Pos { rank: 0, pos: 5 });
        assert_eq!(e[0].state, Where::HostAfterB);
        // The W that follows does not find its activations either.
        assert_eq!(e[1].at, Pos { rank: 0, pos: 6 });
        let ok = prog("pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) F(0,1) B(0,0) OFFLOAD(0,0) B(0,1) RELOAD(0,0) W(0,0) W(0,1)\n");
        assert_eq!(check(&ok), vec![]);
        // Before B, a recompute of the offloaded stash stays valid.
        let before = prog("pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) OFFLOAD(0,0) F(0,1) B(0,1) RECOMPUTE(0,0) B(0,0) W(0,0) W(0,1)\n");
        assert_eq!(check(&before), vec![]);
    }

    #[test]
    fn backward_after_offload_without_reload_is_rejected_with_rank_and_step() {
        let p = prog("pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) OFFLOAD(0,0) F(0,1) BW(0,1) BW(0,0)\n");
        let e = check(&p);
        assert_eq!(
            e,
            vec![MemError {
                at: Pos { rank: 0, pos: 4 },
                stage: 0,
                mb: 0,
                state: Where::Host,
                offloaded_at: Some(1),
                lent_at: None,
                returned_by: None,
            }]
        );
        let d = e[0].to_diagnostic(&Ctx::new(&p));
        assert_eq!(
            d.message,
            "rank 0 step 4: `BW(0,0)` reads the activations of F(0,0), offloaded at step 1 and never reloaded or recomputed"
        );
    }

    #[test]
    fn reload_or_recompute_before_the_backward_is_accepted() {
        let p = prog("pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) OFFLOAD(0,0) F(0,1) OFFLOAD(0,1) RELOAD(0,0) B(0,0) W(0,0) RECOMPUTE(0,1) BW(0,1)\n");
        assert_eq!(check(&p), vec![]);
    }

    #[test]
    fn double_offload_reload_without_offload_and_recompute_of_stashed_are_rejected() {
        let p = prog("pp 1\nstages 1\nmicrobatches 3\nplacement loop\nrank 0: F(0,0) OFFLOAD(0,0) OFFLOAD(0,0) RELOAD(0,0) BW(0,0) F(0,1) RELOAD(0,1) BW(0,1) F(0,2) RECOMPUTE(0,2) BW(0,2) OFFLOAD(0,2)\n");
        let e: Vec<(u32, Where)> = check(&p).iter().map(|e| (e.at.pos, e.state)).collect();
        assert_eq!(
            e,
            vec![
                (2, Where::Host),
                (6, Where::Device),
                (9, Where::Device),
                (11, Where::Released)
            ]
        );
    }
}

#[cfg(test)]
mod checkpoint_tests {
    use super::*;

    fn prog(src: &str) -> Program {
        schedc_ir::text::parse(src).unwrap().program
    }

    #[test]
    fn checkpointed_forward_without_recompute_is_rejected_naming_the_forward() {
        let p = prog("pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0)! F(0,1) BW(0,1) BW(0,0)\n");
        let e = check(&p);
        assert_eq!(
            e,
            vec![MemError {
                at: Pos { rank: 0, pos: 3 },
                stage: 0,
                mb: 0,
                state: Where::Input,
                offloaded_at: Some(0),
                lent_at: None,
                returned_by: None,
            }]
        );
        let d = e[0].to_diagnostic(&Ctx::new(&p));
        assert_eq!(
            d.message,
            "rank 0 step 3: `BW(0,0)` reads the activations of F(0,0), checkpointed at step 0 (`F(0,0)!` saves only its input) and never recomputed"
        );
        assert_eq!(
            d.help.as_deref(),
            Some("put RECOMPUTE(0,0) before the backward on this rank")
        );
    }

    #[test]
    fn checkpointed_forward_with_recompute_is_accepted_and_cannot_be_offloaded() {
        let ok = prog("pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0)! F(0,1)! RECOMPUTE(0,1) BW(0,1) RECOMPUTE(0,0) B(0,0) W(0,0)\n");
        assert_eq!(check(&ok), vec![]);
        let bad = prog("pp 1\nstages 1\nmicrobatches 1\nplacement loop\nrank 0: F(0,0)! OFFLOAD(0,0) RECOMPUTE(0,0) BW(0,0)\n");
        let e: Vec<(u32, Where)> = check(&bad).iter().map(|e| (e.at.pos, e.state)).collect();
        assert_eq!(e, vec![(1, Where::Input)]);
    }
}
