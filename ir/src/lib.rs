//! # schedc-ir: the schedule IR
//!
//! A pipeline-parallel schedule as data: a [`Pipeline`] (P ranks, S stages, M micro-batches and
//! a placement of stages on ranks) and one program per rank, a list of [`Instr`]s executed in
//! order. Front ends (the `.sched` DSL, PyTorch CSV, DeepSeek DualPipe traces, the `.case` test
//! format) produce this IR; passes in the `schedc` crate check it; back ends lower it.
//!
//! ## Semantics, in brief (the book's chapter "The IR" has the full text)
//!
//! * A **stage** is a contiguous slice of the model's layers. Stage ids run `0..S`. With
//!   [`PlacementKind::Bidir`] (DualPipe) there are two *directions*, each a full copy of the
//!   model's `S/2` stages: stage id `s < S/2` is stage `s` of direction 0 (entering at rank 0),
//!   and stage id `S/2 + j` is stage `j` of direction 1 (entering at rank P-1). Dependencies run
//!   along each direction separately ([`Pipeline::next_stage`]).
//! * A **micro-batch** id runs `0..M`; every stage processes all `M` (for DualPipe, `M` is the
//!   number of micro-batches *per direction*, half of DualPipe's `num_chunks`).
//! * **Compute ops** ([`Compute`]): `F(s,m)` forward; `B(s,m)` gradient w.r.t. the stage's input
//!   (torch's `I`); `W(s,m)` gradient w.r.t. the stage's weights; `BW(s,m)` the fused full
//!   backward (torch's `B`). An MoE stage's F/B/BW may be split into four [`Part`]s (attention,
//!   dispatch, MLP, combine), each issued as its own op.
//! * **Communication** ([`Comm`]): sends and receives of a [`Payload`] (activation or gradient
//!   of a (stage, micro-batch)) to or from a peer rank; collectives on a named communicator.
//!   [`Instr::Group`] posts several at once (one NCCL group, torch `batch_isend_irecv`).
//! * **Memory ops** ([`Instr::Mem`], [`MemKind`]): `OFFLOAD(s,m)` / `RELOAD(s,m)` copy the
//!   activations saved by `F(s,m)` to host memory and back on a host-copy stream of the rank's
//!   own; `RECOMPUTE(s,m)` rebuilds them with a second forward before the backward.
//! * **Lending** (BPipe): `LEND(s,m->r)` sends the stash of `F(s,m)` from its owner to rank
//!   `r`, which receives it with `LEND(s,m<-o)` and holds it on its device; `RETURN(s,m->o)`
//!   sends it back, received by the owner with `RETURN(s,m<-h)` before the backward. They are
//!   point-to-point messages ([`PayloadKind::Lend`], [`PayloadKind::Return`]) that match and
//!   deadlock like the others; a schedule writes both ends (the lowering adds none).
//! * The remaining instructions mirror torch's lowered form (`REDUCE_GRAD`, `UNSHARD`, ...) and
//!   idle slots ([`Instr::Idle`], torch's empty CSV cell), which carry no semantics for the
//!   checks but are kept so that a file round-trips exactly.
//!
//! The execution model under which programs are checked (streams, rendezvous sends, FIFO
//! matching) is documented in `schedc::passes::deadlock`.

#![warn(missing_docs)]

pub mod text;

use serde::{Deserialize, Serialize};

/// A pipeline rank (0-based index into the PP group).
pub type Rank = u32;
/// A stage id, `0..S`.
pub type Stage = u32;
/// A micro-batch id, `0..M`.
pub type Mb = u32;

/// How stages are placed on ranks; `stage_to_rank` in [`Pipeline`] is the resolved map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementKind {
    /// Stage `s` on rank `s mod P` (GPipe, 1F1B, interleaved 1F1B).
    Loop,
    /// PyTorch's zigzag `style="v"`: ranks run `0..P`, then `P-1..0`, then `0..P`, ...; with
    /// `S = 2P` this is stage `s` on rank `s` for `s < P` and on `2P-1-s` after (ZB-V,
    /// DualPipeV). Requires `S` to be a multiple of `P`.
    V,
    /// DualPipe: `S = 2P` stage ids forming two directions of `P` stages each. Direction 0's
    /// stage `s` (id `s`) is on rank `s`; direction 1's stage `j` (id `P + j`) is on rank
    /// `P-1-j`. Rank `r` therefore holds stage `r` of direction 0 and stage `P-1-r` of
    /// direction 1: two copies of every stage's parameters.
    Bidir,
    /// An explicit map: the rank of stage 0, 1, ..., S-1.
    Explicit,
}

/// The shape of a pipeline: ranks, stages, micro-batches, placement.
///
/// Invariant (checked by [`Pipeline::new`]): `stage_to_rank.len() == stages` and every entry
/// is `< pp`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pipeline {
    /// P: number of pipeline ranks.
    pub pp: u32,
    /// S: number of stage ids (for [`PlacementKind::Bidir`], both directions: `2P`).
    pub stages: u32,
    /// M: micro-batches processed by every stage (per direction for `Bidir`).
    pub microbatches: u32,
    /// The placement's kind (how `stage_to_rank` was obtained; used when printing).
    pub placement: PlacementKind,
    /// The rank of each stage, `stages` entries.
    pub stage_to_rank: Vec<Rank>,
    /// Communicators for collectives (MoE expert-parallel groups and the like).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub communicators: Vec<Communicator>,
    /// The MoE stages (increasing ids), whose F, B and BW may be split into [`Part`]s; the
    /// other stages are dense and run whole. `None` (the default) declares nothing: any stage
    /// may be split, and `schedc --moe` splits every stage. Text header: `moe 1 2 3`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_stages: Option<Vec<Stage>>,
}

/// A named set of ranks that issue collectives together (e.g. `A2A` on an EP group).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Communicator {
    /// The name used in `A2A(<name>,<label>)`.
    pub name: String,
    /// Member ranks, in the order given.
    pub ranks: Vec<Rank>,
}

/// Errors building a [`Pipeline`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PipelineError {
    /// P = 0, S = 0 or M = 0.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// The placement does not fit P and S.
    #[error("placement: {0}")]
    Placement(String),
}

impl Pipeline {
    /// Builds a pipeline with a standard placement (`Loop`, `V`, `Bidir`).
    ///
    /// Errors: [`PipelineError::Zero`] for an empty dimension; [`PipelineError::Placement`]
    /// when `V` is asked with `S` not a multiple of `P`, or `Bidir` with `S != 2P`, or when
    /// `Explicit` is asked here (use [`Pipeline::explicit`]).
    pub fn new(
        pp: u32,
        stages: u32,
        microbatches: u32,
        placement: PlacementKind,
    ) -> Result<Self, PipelineError> {
        if pp == 0 {
            return Err(PipelineError::Zero("pp"));
        }
        if stages == 0 {
            return Err(PipelineError::Zero("stages"));
        }
        if microbatches == 0 {
            return Err(PipelineError::Zero("microbatches"));
        }
        let stage_to_rank = match placement {
            PlacementKind::Loop => (0..stages).map(|s| s % pp).collect(),
            PlacementKind::V => {
                if !stages.is_multiple_of(pp) {
                    return Err(PipelineError::Placement(format!(
                        "V placement needs the number of stages ({stages}) to be a multiple of pp ({pp})"
                    )));
                }
                (0..stages)
                    .map(|s| {
                        let round = s / pp;
                        let i = s % pp;
                        if round.is_multiple_of(2) {
                            i
                        } else {
                            pp - 1 - i
                        }
                    })
                    .collect()
            }
            PlacementKind::Bidir => {
                if stages != 2 * pp {
                    return Err(PipelineError::Placement(format!(
                        "bidirectional placement needs stages = 2 * pp ({}), got {stages}",
                        2 * pp
                    )));
                }
                (0..stages)
                    .map(|s| if s < pp { s } else { 2 * pp - 1 - s })
                    .collect()
            }
            PlacementKind::Explicit => {
                return Err(PipelineError::Placement(
                    "an explicit placement needs its map; use Pipeline::explicit".into(),
                ))
            }
        };
        Ok(Pipeline {
            pp,
            stages,
            microbatches,
            placement,
            stage_to_rank,
            communicators: Vec::new(),
            moe_stages: None,
        })
    }

    /// Builds a pipeline with an explicit stage-to-rank map (`map[s]` = rank of stage `s`).
    ///
    /// Errors: [`PipelineError::Zero`]; [`PipelineError::Placement`] if a rank is `>= pp`.
    pub fn explicit(pp: u32, microbatches: u32, map: Vec<Rank>) -> Result<Self, PipelineError> {
        if pp == 0 {
            return Err(PipelineError::Zero("pp"));
        }
        if map.is_empty() {
            return Err(PipelineError::Zero("stages"));
        }
        if microbatches == 0 {
            return Err(PipelineError::Zero("microbatches"));
        }
        if let Some((s, r)) = map.iter().enumerate().find(|(_, &r)| r >= pp) {
            return Err(PipelineError::Placement(format!(
                "stage {s} is placed on rank {r}, but pp is {pp}"
            )));
        }
        Ok(Pipeline {
            pp,
            stages: map.len() as u32,
            microbatches,
            placement: PlacementKind::Explicit,
            stage_to_rank: map,
            communicators: Vec::new(),
            moe_stages: None,
        })
    }

    /// Number of directions: 2 for [`PlacementKind::Bidir`], else 1.
    pub fn directions(&self) -> u32 {
        if self.placement == PlacementKind::Bidir {
            2
        } else {
            1
        }
    }

    /// Stages per direction (`S` or `S/2`).
    pub fn stages_per_direction(&self) -> u32 {
        self.stages / self.directions()
    }

    /// Micro-batches in one training step over all directions (`M`, or `2M` for DualPipe).
    pub fn total_microbatches(&self) -> u32 {
        self.microbatches * self.directions()
    }

    /// The rank holding stage `s`. Panics if `s >= S` (callers range-check first).
    #[inline]
    pub fn rank_of(&self, s: Stage) -> Rank {
        self.stage_to_rank[s as usize]
    }

    /// The stage that consumes `s`'s output, or `None` if `s` is the last stage of its
    /// direction (where the loss is computed).
    #[inline]
    pub fn next_stage(&self, s: Stage) -> Option<Stage> {
        let per = self.stages_per_direction();
        if (s + 1).is_multiple_of(per) {
            None
        } else {
            Some(s + 1)
        }
    }

    /// The stage whose output `s` consumes, or `None` if `s` is the first stage of its
    /// direction.
    #[inline]
    pub fn prev_stage(&self, s: Stage) -> Option<Stage> {
        let per = self.stages_per_direction();
        if s.is_multiple_of(per) {
            None
        } else {
            Some(s - 1)
        }
    }

    /// True if stage `s` may be split into MoE parts: it is listed in
    /// [`Pipeline::moe_stages`], or nothing is declared.
    pub fn is_moe_stage(&self, s: Stage) -> bool {
        match &self.moe_stages {
            None => true,
            Some(v) => v.binary_search(&s).is_ok(),
        }
    }

    /// The stages held by rank `r`, in increasing id order. O(S): for every rank at once,
    /// use [`Pipeline::stages_by_rank`].
    pub fn stages_of(&self, r: Rank) -> Vec<Stage> {
        (0..self.stages).filter(|&s| self.rank_of(s) == r).collect()
    }

    /// The stages of every rank, each in increasing id order, in one pass over the stages
    /// (O(P + S), where calling [`Pipeline::stages_of`] per rank is O(P * S)).
    pub fn stages_by_rank(&self) -> Vec<Vec<Stage>> {
        let mut out = vec![Vec::new(); self.pp as usize];
        for s in 0..self.stages {
            if let Some(v) = out.get_mut(self.rank_of(s) as usize) {
                v.push(s);
            }
        }
        out
    }
}

/// The four kinds of compute op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Kind {
    /// Forward.
    F,
    /// Backward for the stage's input only (torch `I`, zero-bubble `B`).
    B,
    /// Backward for the stage's weights only; comes after `B` of the same (stage, mb).
    W,
    /// Fused full backward: input and weights together (torch `B`).
    BW,
}

impl Kind {
    /// True for `B` and `BW`: the ops that produce the input gradient.
    pub fn is_backward_input(self) -> bool {
        matches!(self, Kind::B | Kind::BW)
    }
    /// The text spelling: `F`, `B`, `W`, `BW`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::F => "F",
            Kind::B => "B",
            Kind::W => "W",
            Kind::BW => "BW",
        }
    }
}

/// Which part of an MoE stage's forward or backward an op covers.
///
/// Forward order: `Attn`, `Dispatch` (all-to-all of tokens to their experts), `Mlp` (the
/// experts), `Combine` (all-to-all of expert outputs back). A backward runs them in reverse:
/// `Combine`, `Mlp`, `Dispatch`, `Attn` (the gradient of combine is a dispatch-shaped
/// all-to-all and vice versa).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// The whole stage.
    #[default]
    Whole,
    /// Attention (and everything before the MoE layer's router).
    Attn,
    /// Dispatch all-to-all within the expert-parallel group.
    Dispatch,
    /// Expert MLPs.
    Mlp,
    /// Combine all-to-all within the expert-parallel group.
    Combine,
}

impl Part {
    /// The four parts in forward order.
    pub const FORWARD_ORDER: [Part; 4] = [Part::Attn, Part::Dispatch, Part::Mlp, Part::Combine];
    /// The text suffix (`attn`, ...); empty for `Whole`.
    pub fn as_str(self) -> &'static str {
        match self {
            Part::Whole => "",
            Part::Attn => "attn",
            Part::Dispatch => "dispatch",
            Part::Mlp => "mlp",
            Part::Combine => "combine",
        }
    }
    /// True for the all-to-all parts.
    pub fn is_all_to_all(self) -> bool {
        matches!(self, Part::Dispatch | Part::Combine)
    }
    /// How many parts an op of `kind` splits into: 4 for `F`, `B` and `BW` (attention,
    /// dispatch, MLP, combine), 2 for `W` (the weight gradients of the experts, `Mlp`, then
    /// of the attention side, `Attn`: a weight gradient moves no tokens).
    pub fn count(kind: Kind) -> usize {
        if kind == Kind::W {
            2
        } else {
            4
        }
    }
    /// The parts of an op of `kind`, in execution order.
    pub fn order(kind: Kind) -> &'static [Part] {
        match kind {
            Kind::F => &Self::FORWARD_ORDER,
            Kind::W => &[Part::Mlp, Part::Attn],
            Kind::B | Kind::BW => &[Part::Combine, Part::Mlp, Part::Dispatch, Part::Attn],
        }
    }
    /// Index of the part in execution order for `kind` (forward order for `F`, reverse for
    /// `B` and `BW`: 0..4; `Mlp` then `Attn` for `W`: 0..2); 0 for `Whole` (and for an
    /// all-to-all part of a `W`, which pass 1 refuses).
    pub fn exec_index(self, kind: Kind) -> usize {
        if kind == Kind::W {
            return usize::from(self == Part::Attn);
        }
        let fwd = match self {
            Part::Whole | Part::Attn => 0,
            Part::Dispatch => 1,
            Part::Mlp => 2,
            Part::Combine => 3,
        };
        if self == Part::Whole || kind == Kind::F {
            fwd
        } else {
            3 - fwd
        }
    }
}

/// One compute op: `kind` on (`stage`, `mb`), possibly one MoE [`Part`] of it.
///
/// Equality and hashing ignore [`Compute::checkpoint`]: `F(s,m)!` is the same op as
/// `F(s,m)` for every pass that matches ops (messages, dependencies, positions).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compute {
    /// F, B, W or BW.
    pub kind: Kind,
    /// The stage id.
    pub stage: Stage,
    /// The micro-batch id.
    pub mb: Mb,
    /// `Whole` unless the op is one part of an MoE stage.
    #[serde(default, skip_serializing_if = "is_whole")]
    pub part: Part,
    /// `F(s,m)!` (activation checkpointing): the forward saves nothing but its input; its
    /// saved tensors are dropped when it ends, and its backward must be preceded by a
    /// `RECOMPUTE(s,m)` on the rank (pass 6b rejects it otherwise). Whole forwards only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checkpoint: bool,
}

impl PartialEq for Compute {
    fn eq(&self, o: &Self) -> bool {
        (self.kind, self.stage, self.mb, self.part) == (o.kind, o.stage, o.mb, o.part)
    }
}

impl Eq for Compute {}

impl std::hash::Hash for Compute {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (self.kind, self.stage, self.mb, self.part).hash(h)
    }
}

fn is_zero(c: &u32) -> bool {
    *c == 0
}

fn is_whole(p: &Part) -> bool {
    *p == Part::Whole
}

impl Compute {
    /// A whole-stage op.
    pub fn new(kind: Kind, stage: Stage, mb: Mb) -> Self {
        Compute {
            kind,
            stage,
            mb,
            part: Part::Whole,
            checkpoint: false,
        }
    }

    /// A checkpointed forward `F(stage,mb)!` (see [`Compute::checkpoint`]).
    pub fn checkpointed(stage: Stage, mb: Mb) -> Self {
        Compute {
            checkpoint: true,
            ..Compute::new(Kind::F, stage, mb)
        }
    }
}

/// What a message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PayloadKind {
    /// The activation (output) of `F(stage, mb)`, consumed by the next stage's forward.
    Act,
    /// The input gradient produced by the backward of `(stage, mb)`, consumed by the previous
    /// stage's backward.
    Grad,
    /// The saved activations (the stash) of `F(stage, mb)` lent by the rank that holds the
    /// stage (the *owner*) to another rank (the *holder*), BPipe's hand-off: text
    /// `LEND(s,m->r)` on the owner, `LEND(s,m<-o)` on the holder. The owner's device no
    /// longer holds the stash once the send is issued; the holder's holds it from its receive.
    /// Valid only while the stash is on the owner's device (after `F`, before the backward).
    Lend,
    /// The stash of `F(stage, mb)` sent back by its holder to the owner before the backward
    /// that reads it: text `RETURN(s,m->o)` on the holder, `RETURN(s,m<-h)` on the owner. The
    /// holder frees it once the send is issued; the owner's `B`/`W`/`BW` of `(stage, mb)`
    /// waits for the receive.
    Return,
}

impl PayloadKind {
    /// True for [`PayloadKind::Lend`] and [`PayloadKind::Return`]: the messages that move a
    /// forward's stash between ranks (they carry no data to another stage).
    pub fn is_stash(self) -> bool {
        matches!(self, PayloadKind::Lend | PayloadKind::Return)
    }
    /// The letter used in `WAIT_S?`/`WAIT_R?` text: `A`, `G`, `L` (lend), `T` (return).
    pub fn letter(self) -> char {
        match self {
            PayloadKind::Act => 'A',
            PayloadKind::Grad => 'G',
            PayloadKind::Lend => 'L',
            PayloadKind::Return => 'T',
        }
    }
}

/// A message label: the producer's (kind, stage, mb).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Payload {
    /// Activation or gradient.
    pub kind: PayloadKind,
    /// The *producing* stage.
    pub stage: Stage,
    /// The micro-batch.
    pub mb: Mb,
}

/// A communication op.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Comm {
    /// Send `payload` to `peer` (text `SA(s,m->r)`, `SG(s,m->r)`; on channel c:
    /// `SA(s,m->r@c)`).
    Send {
        /// What is sent.
        payload: Payload,
        /// The receiving rank.
        peer: Rank,
        /// The channel (communicator) the message travels on; 0 unless given. Messages match
        /// FIFO per (sender, receiver, channel), and each channel of a rank is its own
        /// in-order communication stream.
        #[serde(default, skip_serializing_if = "is_zero")]
        channel: u32,
    },
    /// Receive `payload` from `peer` (text `RA(s,m<-r)`, `RG(s,m<-r)`; on channel c:
    /// `RA(s,m<-r@c)`).
    Recv {
        /// What is received.
        payload: Payload,
        /// The sending rank.
        peer: Rank,
        /// The channel; see [`Comm::Send`].
        #[serde(default, skip_serializing_if = "is_zero")]
        channel: u32,
    },
    /// A collective on a communicator (text `A2A(<comm>,<label>)`); every member must issue
    /// the same sequence of labels.
    Collective(Box<Collective>),
}

/// A collective call.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Collective {
    /// Communicator name (declared in [`Pipeline::communicators`]).
    pub comm: String,
    /// Free-form label identifying the call (e.g. `d0.3` for dispatch of micro-batch 3).
    pub label: String,
}

impl Comm {
    /// A send on channel 0.
    pub fn send(payload: Payload, peer: Rank) -> Self {
        Comm::Send {
            payload,
            peer,
            channel: 0,
        }
    }
    /// A receive on channel 0.
    pub fn recv(payload: Payload, peer: Rank) -> Self {
        Comm::Recv {
            payload,
            peer,
            channel: 0,
        }
    }
    /// The peer rank of a send or receive.
    pub fn peer(&self) -> Option<Rank> {
        match self {
            Comm::Send { peer, .. } | Comm::Recv { peer, .. } => Some(*peer),
            Comm::Collective(_) => None,
        }
    }
    /// The channel of a send or receive (0 for a collective).
    pub fn channel(&self) -> u32 {
        match self {
            Comm::Send { channel, .. } | Comm::Recv { channel, .. } => *channel,
            Comm::Collective(_) => 0,
        }
    }
}

/// One instruction of a rank's program.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Instr {
    /// A compute op.
    Compute(Compute),
    /// A forward and a backward of different micro-batches issued together so that their
    /// compute and communication overlap (DualPipe's F&B chunk, torch `OVERLAP_F_B`). The
    /// forward's activation is allocated before the backward releases its own.
    Overlap {
        /// The forward.
        fwd: Compute,
        /// The backward (`B` or `BW`).
        bwd: Compute,
    },
    /// A lone communication op (a group of one, text without braces).
    Comm(Comm),
    /// Communication ops posted together and completing as a unit (text `{...}`).
    Group(Vec<Comm>),
    /// Data-parallel reduction of a stage's gradients; after every W/BW of the stage.
    ReduceGrad(Stage),
    /// Wait for an earlier `ReduceGrad` (torch `WAIT_REDUCE_GRAD`); no check semantics.
    WaitReduceGrad(Stage),
    /// FSDP all-gather of a stage's parameters (torch `UNSHARD`); no check semantics.
    Unshard(Stage),
    /// FSDP release of a stage's parameters (torch `RESHARD`); no check semantics.
    Reshard(Stage),
    /// Wait until an earlier send of this payload has completed (torch `WAIT_SEND_F/B`).
    WaitSend(Payload),
    /// The compute stream waits until an earlier receive of this payload has completed
    /// (text `WAIT_RA(s,m)`, `WAIT_RG(s,m)`; a CUDA stream waiting on the receive's event).
    /// It holds back the compute ops after it, not only those that read the payload: an
    /// overlapped pair waits for both of its inputs, as DeepSeek's DualPipe does before
    /// launching one, and a weight gradient can be timed to run under the all-to-all of the
    /// op that payload feeds (`--moe=STAGES:list`). Torch has no such action.
    WaitRecv(Payload),
    /// A memory op on a forward's saved activations (text `OFFLOAD(s,m)`, `RELOAD(s,m)`,
    /// `RECOMPUTE(s,m)`); see [`MemOp`].
    Mem(MemOp),
    /// An idle slot (torch's empty CSV cell); spacing only.
    Idle,
}

/// What a [`MemOp`] does with the saved activations of forward `F(s,m)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemKind {
    /// `OFFLOAD(s,m)`: copy the activations `F(s,m)` stashed on the device to host memory and
    /// free them on the device. The copy runs on the rank's device-to-host copy stream, its
    /// own stream beside compute, communication and the host-to-device stream of reloads; the device memory counts as free once the op is
    /// issued (one activation unit fewer on the device, one more on the host). Valid only while
    /// the activations are stashed on the device (after `F(s,m)`, before its `B`/`BW`, not
    /// already offloaded).
    Offload,
    /// `RELOAD(s,m)`: copy the offloaded activations of `F(s,m)` back to the device on the
    /// rank's host-to-device copy stream (PCIe is full duplex: it runs beside offloads). The device holds them again from the moment the op is issued (a unit
    /// is allocated); the `B`/`BW(s,m)` that reads them waits for the copy to finish. Valid only
    /// after an `OFFLOAD(s,m)` and before the backward.
    Reload,
    /// `RECOMPUTE(s,m)`: run the forward of stage `s` on micro-batch `m` again, on the compute
    /// stream, to rebuild the saved activations from the stage's input before its `B`/`BW`
    /// (activation checkpointing). Valid only when the activations are not on the device:
    /// after an `OFFLOAD(s,m)` that was not reloaded (the host copy is then dropped).
    Recompute,
}

/// A memory op: [`MemKind`] applied to the saved activations of forward `F(stage,mb)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemOp {
    /// What to do.
    pub kind: MemKind,
    /// The forward's stage.
    pub stage: Stage,
    /// The forward's micro-batch.
    pub mb: Mb,
}

impl MemKind {
    /// The text name (`OFFLOAD`, `RELOAD`, `RECOMPUTE`).
    pub fn name(self) -> &'static str {
        match self {
            MemKind::Offload => "OFFLOAD",
            MemKind::Reload => "RELOAD",
            MemKind::Recompute => "RECOMPUTE",
        }
    }
}

impl Instr {
    /// Calls `f` for each compute op in the instruction (forward first for an overlap).
    #[inline]
    pub fn for_each_compute(&self, mut f: impl FnMut(&Compute)) {
        match self {
            Instr::Compute(c) => f(c),
            Instr::Overlap { fwd, bwd } => {
                f(fwd);
                f(bwd);
            }
            _ => {}
        }
    }

    /// The communication ops of this instruction (one for `Comm`, all of a `Group`).
    #[inline]
    pub fn comms(&self) -> &[Comm] {
        match self {
            Instr::Comm(c) => std::slice::from_ref(c),
            Instr::Group(g) => g,
            _ => &[],
        }
    }

    /// True for `Compute` and `Overlap`.
    pub fn is_compute(&self) -> bool {
        matches!(self, Instr::Compute(_) | Instr::Overlap { .. })
    }
}

/// A whole schedule: the pipeline and one program per rank.
///
/// Invariant: `ranks.len() == pipeline.pp` (enforced by the front ends; passes report a
/// violation rather than panic).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Program {
    /// The pipeline shape.
    pub pipeline: Pipeline,
    /// `ranks[r]` is rank r's instruction list, in program order.
    pub ranks: Vec<Vec<Instr>>,
}

impl Program {
    /// True if no rank has a send, receive or collective (the input of the lowering pass).
    pub fn is_compute_only(&self) -> bool {
        self.ranks.iter().all(|r| {
            r.iter()
                .all(|i| !matches!(i, Instr::Comm(_) | Instr::Group(_)))
        })
    }

    /// True if some rank sends or receives an activation or a gradient (collectives alone
    /// do not count, nor do the `LEND`/`RETURN` messages of a stash, which a schedule writes
    /// itself: a program whose only communication is those still needs its point-to-point
    /// messages inserted by the lowering pass).
    pub fn has_p2p(&self) -> bool {
        self.ranks.iter().flatten().any(|i| {
            i.comms().iter().any(|c| match c {
                Comm::Send { payload, .. } | Comm::Recv { payload, .. } => !payload.kind.is_stash(),
                Comm::Collective(_) => false,
            })
        })
    }

    /// True if some rank lends a stash (`LEND`/`RETURN` messages, see [`PayloadKind::Lend`]).
    pub fn has_lending(&self) -> bool {
        self.ranks.iter().flatten().any(|i| {
            i.comms().iter().any(|c| match c {
                Comm::Send { payload, .. } | Comm::Recv { payload, .. } => payload.kind.is_stash(),
                Comm::Collective(_) => false,
            })
        })
    }

    /// Total number of instructions over all ranks (idle slots included).
    pub fn len(&self) -> usize {
        self.ranks.iter().map(Vec::len).sum()
    }

    /// True if no rank has an instruction.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of compute ops (an overlap counts 2).
    pub fn compute_ops(&self) -> usize {
        self.ranks
            .iter()
            .flatten()
            .map(|i| match i {
                Instr::Compute(_) => 1,
                Instr::Overlap { .. } => 2,
                _ => 0,
            })
            .sum()
    }

    /// Number of communication ops (sends, receives, collectives; a group counts its members).
    pub fn comm_ops(&self) -> usize {
        self.ranks.iter().flatten().map(|i| i.comms().len()).sum()
    }

    /// Serializes to pretty JSON (the `ir-json` format).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("IR serializes")
    }

    /// Parses the `ir-json` format. Errors: serde's message with line and column.
    pub fn from_json(s: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(s)
    }
}
