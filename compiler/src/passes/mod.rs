//! The verifier: one module per pass, each with its own typed errors, all collected.
//!
//! | pass | module | proves | codes |
//! |---|---|---|---|
//! | 1 | [`wellformed`] | every (stage, mb) has one F and one BW or one B then one W (a split op: its four MoE parts once each); no duplicates; ids in range; ops on the rank holding their stage; MoE parts only on MoE stages; messages addressed to the right rank; collectives on a declared communicator the rank belongs to | `missing-op`, `duplicate-op`, `range`, `placement`, `collective-order` |
//! | 2 | [`deps`] | same-rank order: F after the previous stage's F, backward after the next stage's backward (or after the loss), W after B, MoE parts in order, sends after their producer, consumers after their receive, REDUCE_GRAD after the stage's last W/BW; cross-rank dependencies carried by a message | `order`, `unmatched` |
//! | 3 | [`lower`] | (compute-only input) inserts sends and receives from one global interleaving, so the result is deadlock-free by construction; V folds hand over in memory | `deadlock` (when no interleaving exists) |
//! | 4 | [`deadlock`] | FIFO matching with labels compared, collective order, and a stream-level simulation under the stated semantics: no wait-for cycle | `label-mismatch`, `unmatched`, `collective-order`, `deadlock`, `stall` |
//! | 5 | [`warmup`] | forwards before the first backward, steady and cooldown lengths, per rank and per stage | — |
//! | 6 | [`liveness`] | peak live (stage, mb) activations per rank and where; the budget | `memory` |
//! | 6b | [`memory`] | every B/W/BW finds its activations on the device (stashed, reloaded after an OFFLOAD, or recomputed); no OFFLOAD twice, RELOAD without OFFLOAD, or RECOMPUTE of stashed activations | `memory` |
//! | 7 | [`makespan`] | unit-time makespan and idle per rank (F=B=W=1, BW=2) | — |
//!
//! Passes 5-7 return facts, not only errors: these are what reports and back ends consume.

pub mod deadlock;
pub mod deps;
pub mod liveness;
pub mod lower;
pub mod makespan;
pub mod memory;
pub mod streams;
pub mod warmup;
pub mod wellformed;

use crate::diag::Loc;
use schedc_ir::text::{instr_to_string, SourceMap};
use schedc_ir::{Compute, Instr, Kind, Part, Program};

/// What the passes share: the program and where its instructions came from.
pub struct Ctx<'a> {
    /// The program under check.
    pub program: &'a Program,
    /// Spans of its instructions, when it was read from a file.
    pub spans: Option<&'a SourceMap>,
}

impl<'a> Ctx<'a> {
    /// A context without spans.
    pub fn new(program: &'a Program) -> Self {
        Ctx {
            program,
            spans: None,
        }
    }
    /// The location of rank `r`'s instruction `pos`.
    pub fn loc(&self, r: usize, pos: usize) -> Loc {
        let op = self
            .program
            .ranks
            .get(r)
            .and_then(|v| v.get(pos))
            .map(instr_to_string)
            .unwrap_or_default();
        // An op a spec's `def` emitted: the uses it was expanded from.
        let mut via = Vec::new();
        if let (Some(s), Some(i)) = (
            self.spans.filter(|s| !s.expanded.is_empty()),
            self.program.ranks.get(r).and_then(|v| v.get(pos)),
        ) {
            let mut first = None;
            i.for_each_compute(|c| {
                first.get_or_insert((c.kind, c.stage, c.mb));
            });
            if let Some((k, st, mb)) = first {
                via = s
                    .expanded
                    .get(&(r as u32, k, st, mb))
                    .cloned()
                    .unwrap_or_default();
            }
        }
        Loc {
            rank: r as u32,
            position: pos,
            op,
            span: self.spans.and_then(|s| s.get(r, pos)),
            location: None,
            via,
        }
    }
}

/// A position: (rank, index in the rank's instruction list).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Pos {
    /// Rank.
    pub rank: u32,
    /// Index.
    pub pos: u32,
}

impl Pos {
    /// "Absent" marker.
    pub const NONE: Pos = Pos {
        rank: u32::MAX,
        pos: u32::MAX,
    };
    /// True unless [`Pos::NONE`].
    #[inline]
    pub fn is_some(self) -> bool {
        self.rank != u32::MAX
    }
}

/// Where each compute op of each (kind, stage, mb) is. For an op split in MoE parts, `first`
/// is the position of its first part in execution order and `last` that of its last.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    /// First (or only) occurrence.
    pub first: Pos,
    /// Last part (equal to `first` for a whole op).
    pub last: Pos,
    /// Whole-op occurrences.
    pub whole: u16,
    /// Occurrences of each part, in [`Part::FORWARD_ORDER`] order.
    pub parts: [u16; 4],
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            first: Pos::NONE,
            last: Pos::NONE,
            whole: 0,
            parts: [0; 4],
        }
    }
}

impl Slot {
    /// True if the op occurs at all.
    pub fn present(&self) -> bool {
        self.first.is_some()
    }
}

/// Index of the compute ops by (kind, stage, mb): O(1) look-ups for every pass.
///
/// Out-of-range ops are skipped (pass 1 reports them).
pub struct OpIndex {
    /// S.
    pub stages: u32,
    /// M.
    pub mbs: u32,
    slots: [Vec<Slot>; 4],
}

fn kind_ix(k: Kind) -> usize {
    match k {
        Kind::F => 0,
        Kind::B => 1,
        Kind::W => 2,
        Kind::BW => 3,
    }
}

fn part_ix(p: Part) -> usize {
    match p {
        Part::Whole | Part::Attn => 0,
        Part::Dispatch => 1,
        Part::Mlp => 2,
        Part::Combine => 3,
    }
}

impl OpIndex {
    /// Builds the index in one pass over the program.
    pub fn build(p: &Program) -> Self {
        let s = p.pipeline.stages;
        let m = p.pipeline.microbatches;
        let n = s as usize * m as usize;
        let mut slots: [Vec<Slot>; 4] = std::array::from_fn(|_| vec![Slot::default(); n]);
        for (r, instrs) in p.ranks.iter().enumerate() {
            for (i, ins) in instrs.iter().enumerate() {
                ins.for_each_compute(|c| {
                    if c.stage >= s || c.mb >= m {
                        return;
                    }
                    let here = Pos {
                        rank: r as u32,
                        pos: i as u32,
                    };
                    let slot = &mut slots[kind_ix(c.kind)][(c.stage * m + c.mb) as usize];
                    if !slot.first.is_some() {
                        slot.first = here;
                        slot.last = here;
                    }
                    if c.part == Part::Whole {
                        slot.whole += 1;
                    } else {
                        slot.parts[part_ix(c.part)] += 1;
                        let ex = c.part.exec_index(c.kind);
                        if ex == 0 {
                            slot.first = here;
                        }
                        if ex == 3 {
                            slot.last = here;
                        }
                    }
                });
            }
        }
        OpIndex {
            stages: s,
            mbs: m,
            slots,
        }
    }

    /// The slot of (kind, stage, mb); `None` if out of range.
    #[inline]
    pub fn get(&self, kind: Kind, stage: u32, mb: u32) -> Option<&Slot> {
        if stage >= self.stages || mb >= self.mbs {
            return None;
        }
        Some(&self.slots[kind_ix(kind)][(stage * self.mbs + mb) as usize])
    }

    /// The input-gradient backward of (stage, mb): its BW if present, else its B.
    #[inline]
    pub fn backward_input(&self, stage: u32, mb: u32) -> Option<&Slot> {
        let bw = self.get(Kind::BW, stage, mb)?;
        if bw.present() {
            return Some(bw);
        }
        let b = self.get(Kind::B, stage, mb)?;
        if b.present() {
            Some(b)
        } else {
            None
        }
    }

    /// The op that releases (stage, mb)'s activation: BW, or W when the backward is split.
    #[inline]
    pub fn release(&self, stage: u32, mb: u32) -> Option<&Slot> {
        let bw = self.get(Kind::BW, stage, mb)?;
        if bw.present() {
            return Some(bw);
        }
        let w = self.get(Kind::W, stage, mb)?;
        if w.present() {
            Some(w)
        } else {
            None
        }
    }
}

/// A hasher for small integer keys (ids, ranks, packed tuples): one multiply per word
/// (Fibonacci hashing) instead of SipHash. Keys come from the program, not from an
/// adversary who could choose collisions; a schedule has millions of them.
#[derive(Default)]
pub struct PackedHasher(u64);

impl std::hash::Hasher for PackedHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
}

/// A `HashMap` with [`PackedHasher`].
pub type PackedMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<PackedHasher>>;

/// True if `c` is the first part (in execution order) of its op, or a whole op.
#[inline]
pub fn is_first_part(c: &Compute) -> bool {
    c.part.exec_index(c.kind) == 0
}

/// True if `c` is the last part (in execution order) of its op, or a whole op.
#[inline]
pub fn is_last_part(c: &Compute) -> bool {
    c.part == Part::Whole || c.part.exec_index(c.kind) + 1 == Part::count(c.kind)
}

/// Text of a compute op.
pub fn compute_str(c: &Compute) -> String {
    let mut s = String::new();
    schedc_ir::text::write_compute(&mut s, c);
    s
}

/// True if the instruction is a compute, overlap, or other op that runs on the compute
/// stream (REDUCE_GRAD, WAIT_SEND, WAIT_RECV), or is issued from it in program order (the
/// memory ops: a RECOMPUTE runs there, an OFFLOAD or RELOAD is launched from it onto the
/// host-copy stream).
pub fn on_compute_stream(i: &Instr) -> bool {
    matches!(
        i,
        Instr::Compute(_)
            | Instr::Overlap { .. }
            | Instr::ReduceGrad(_)
            | Instr::WaitSend(_)
            | Instr::WaitRecv(_)
            | Instr::Mem(_)
    )
}
