//! The search's representation of a schedule: per rank, a sequence of op tokens without
//! micro-batch labels.
//!
//! Micro-batches are interchangeable (same times, same memory), so the k-th forward a stage
//! runs can be taken to be micro-batch k, and likewise the k-th input-gradient backward
//! (`B` or `BW`) and, among the split ones, the k-th `W`. Relabelling any schedule this way
//! keeps every op's start time or makes it earlier: the k-th op of a kind on a stage needs
//! the k-th op it depends on, and by counting at least k of those have finished before it
//! starts. So a token sequence per rank loses no schedule worth having, and a search over
//! tokens never tries two labellings of one order.

use crate::instance::{Instance, ProblemError};
use schedc_ir::{Compute, Instr, Kind, Part, Program};

/// One compute op of a rank, without its micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tok {
    /// Forward of a stage.
    F(u32),
    /// Input-gradient backward of a stage (the weight gradient follows as a [`Tok::W`]).
    B(u32),
    /// Weight-gradient backward of a stage.
    W(u32),
    /// Fused backward of a stage.
    BW(u32),
    /// A forward and a backward issued as one overlapped chunk (DualPipe's F&B): forward of
    /// stage `f`, backward of stage `b`, fused (`BW`) or not (`B`).
    Pair {
        /// The forward's stage.
        f: u32,
        /// The backward's stage.
        b: u32,
        /// True if the backward is `BW`.
        fused: bool,
    },
}

impl Tok {
    /// The stage of a single op; the forward's stage for a pair.
    pub fn stage(self) -> u32 {
        match self {
            Tok::F(s) | Tok::B(s) | Tok::W(s) | Tok::BW(s) => s,
            Tok::Pair { f, .. } => f,
        }
    }

    /// True for `F`.
    pub fn is_f(self) -> bool {
        matches!(self, Tok::F(_))
    }

    /// True for `W`.
    pub fn is_w(self) -> bool {
        matches!(self, Tok::W(_))
    }

    /// Seconds this token takes.
    pub fn time(self, inst: &Instance) -> f64 {
        match self {
            Tok::F(s) => inst.d_f[s as usize],
            Tok::B(s) => inst.d_b[s as usize],
            Tok::W(s) => inst.d_w[s as usize],
            Tok::BW(s) => inst.d_bw[s as usize],
            Tok::Pair { f, b, fused } => inst.pair_time(f, b, fused),
        }
    }

    /// Change in live activations on its rank: +1 for a forward, -1 for a release (`W`,
    /// `BW`); a pair adds both.
    pub fn mem_delta(self) -> i32 {
        match self {
            Tok::F(_) => 1,
            Tok::W(_) | Tok::BW(_) => -1,
            Tok::B(_) => 0,
            Tok::Pair { fused, .. } => {
                if fused {
                    0
                } else {
                    1
                }
            }
        }
    }
}

/// A schedule as token sequences, one per rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sched {
    /// `ranks[r]`: rank r's tokens in program order.
    pub ranks: Vec<Vec<Tok>>,
}

impl Sched {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.ranks.iter().map(Vec::len).sum()
    }

    /// True if no rank has a token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads the compute ops of a program (communication, idle slots and gradient reductions
    /// are dropped: the lowering re-inserts the messages).
    ///
    /// Errors: MoE parts and collectives, which the search does not move yet.
    pub fn from_program(p: &Program) -> Result<Sched, ProblemError> {
        let mut ranks = Vec::with_capacity(p.ranks.len());
        for (r, instrs) in p.ranks.iter().enumerate() {
            let mut v = Vec::with_capacity(instrs.len());
            for (i, ins) in instrs.iter().enumerate() {
                match ins {
                    Instr::Compute(c) => {
                        if c.part != Part::Whole {
                            return Err(ProblemError::Unsupported(format!(
                                "rank {r}, op {i}: MoE parts are not searched yet; give the schedule with whole ops"
                            )));
                        }
                        v.push(match c.kind {
                            Kind::F => Tok::F(c.stage),
                            Kind::B => Tok::B(c.stage),
                            Kind::W => Tok::W(c.stage),
                            Kind::BW => Tok::BW(c.stage),
                        });
                    }
                    Instr::Overlap { fwd, bwd } => {
                        if fwd.part != Part::Whole || bwd.part != Part::Whole {
                            return Err(ProblemError::Unsupported(format!(
                                "rank {r}, op {i}: MoE parts are not searched yet"
                            )));
                        }
                        v.push(Tok::Pair {
                            f: fwd.stage,
                            b: bwd.stage,
                            fused: bwd.kind == Kind::BW,
                        });
                    }
                    Instr::Comm(schedc_ir::Comm::Collective(_)) | Instr::Group(_)
                        if ins
                            .comms()
                            .iter()
                            .any(|c| matches!(c, schedc_ir::Comm::Collective(_))) =>
                    {
                        return Err(ProblemError::Unsupported(format!(
                            "rank {r}, op {i}: collectives are not searched yet"
                        )));
                    }
                    _ => {}
                }
            }
            ranks.push(v);
        }
        Ok(Sched { ranks })
    }

    /// The compute-only program of this schedule, with micro-batches labelled in order (the
    /// k-th forward of a stage is micro-batch k, and so on).
    pub fn to_program(&self, inst: &Instance) -> Program {
        let mut f = vec![0u32; inst.s];
        let mut bi = vec![0u32; inst.s];
        let mut split: Vec<Vec<u32>> = vec![Vec::new(); inst.s];
        let mut w = vec![0usize; inst.s];
        let mut ranks = Vec::with_capacity(self.ranks.len());
        let fwd = |s: u32, f: &mut Vec<u32>| {
            let m = f[s as usize];
            f[s as usize] += 1;
            Compute::new(Kind::F, s, m)
        };
        let bwd = |s: u32, fused: bool, bi: &mut Vec<u32>, split: &mut Vec<Vec<u32>>| {
            let m = bi[s as usize];
            bi[s as usize] += 1;
            if !fused {
                split[s as usize].push(m);
            }
            Compute::new(if fused { Kind::BW } else { Kind::B }, s, m)
        };
        for toks in &self.ranks {
            let mut v = Vec::with_capacity(toks.len());
            for &t in toks {
                v.push(match t {
                    Tok::F(s) => Instr::Compute(fwd(s, &mut f)),
                    Tok::B(s) => Instr::Compute(bwd(s, false, &mut bi, &mut split)),
                    Tok::BW(s) => Instr::Compute(bwd(s, true, &mut bi, &mut split)),
                    Tok::W(s) => {
                        let j = w[s as usize];
                        w[s as usize] += 1;
                        // A W without a split backward before it: label it past the end so
                        // that `schedc check` reports it (the search never builds one).
                        let m = split[s as usize]
                            .get(j)
                            .copied()
                            .unwrap_or(inst.m as u32 + j as u32);
                        Instr::Compute(Compute::new(Kind::W, s, m))
                    }
                    Tok::Pair {
                        f: sf,
                        b: sb,
                        fused,
                    } => Instr::Overlap {
                        fwd: fwd(sf, &mut f),
                        bwd: bwd(sb, fused, &mut bi, &mut split),
                    },
                });
            }
            ranks.push(v);
        }
        Program {
            pipeline: inst.pipeline.clone(),
            ranks,
        }
    }

    /// Token counts: (forwards, backward-inputs, W) per stage.
    pub fn counts(&self, s: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let (mut f, mut b, mut w) = (vec![0; s], vec![0; s], vec![0; s]);
        for t in self.ranks.iter().flatten() {
            match *t {
                Tok::F(x) => f[x as usize] += 1,
                Tok::B(x) | Tok::BW(x) => b[x as usize] += 1,
                Tok::W(x) => w[x as usize] += 1,
                Tok::Pair { f: a, b: c, .. } => {
                    f[a as usize] += 1;
                    b[c as usize] += 1;
                }
            }
        }
        (f, b, w)
    }

    /// The IR text of the tokens of one rank, with micro-batch labels (for messages).
    pub fn rank_text(&self, inst: &Instance, r: usize) -> String {
        let p = self.to_program(inst);
        p.ranks[r]
            .iter()
            .map(schedc_ir::text::instr_to_string)
            .collect::<Vec<_>>()
            .join(" ")
    }
}
