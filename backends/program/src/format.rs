//! Per-rank stream programs: what a backend runs for one training step on one global rank.
//!
//! ## The format
//!
//! A [`ProgramSet`] is a [`Manifest`] and one [`RankProgram`] per global rank of the
//! [`Mesh`]. A rank program has in-order **streams** (as on a GPU):
//!
//! * `compute`: [`Kernel`]s, the [`Op::AllToAll`]s between the parts of a layer (the
//!   sequence-parallel gather of the attention's latents `[c_KV; k_pe]` and reduce-scatter
//!   of their gradients, the
//!   expert-parallel dispatch and combine), buffer allocation and release, and the
//!   optimizer step;
//! * one `comm` stream per IR channel (channel 0 always): point-to-point
//!   [`Op::Send`]/[`Op::Recv`] of activations and gradients in the order of the verified IR
//!   program's messages on that channel; channel 0's stream then runs the gradient reductions
//!   ([`Op::ReplicaSum`] for DualPipe's two copies of a stage, [`Op::AllReduce`] over the
//!   data-parallel groups).
//!
//! * `copy` (issue 27, only when the schedule moves activations; the last stream): the
//!   [`Op::Offload`]s and [`Op::Reload`]s of the IR's `OFFLOAD(s,m)` and `RELOAD(s,m)`, each
//!   after a wait for the event the compute stream records where the IR issues it; a backward
//!   waits for its reload's event. `RECOMPUTE(s,m)` is the forward's kernels again as
//!   [`Pass::Recompute`] on the compute stream, reading the forward's input (kept allocated
//!   for it); a checkpointed `F(s,m)!` releases its stash after its kernels. A stash thus
//!   may live more than once (see the verifier).
//!
//! Streams synchronize only through **events**: [`Op::Record`] marks a point of one stream,
//! [`Op::Wait`] holds the other until that point has run (CUDA's `cudaEventRecord` /
//! `cudaStreamWaitEvent`). A send waits for the event recorded after the kernel that produces
//! its payload; the first kernel reading a received payload waits for the event recorded
//! after the receive.
//!
//! **Buffers** ([`Buf`]) are named by what they hold: `act(s, m)` the output of `F(s, m)`,
//! `grad(s, m)` the input gradient from the backward of `(s, m)` (the IR's payload names),
//! `stash(s, m)` everything `(s, m)`'s backward and weight gradient need from its forward
//! (live from its `F` through its `BW`, or its `W` when split, exactly the IR's activation
//! lifetime), and `weight_grad(s)` the stage's gradient accumulator (with the router's load
//! counts). [`Op::Alloc`] and [`Op::Free`] bracket each; every kernel lists the buffers it
//! reads and writes.
//!
//! A stage's forward on one micro-batch runs, per layer: `qkv`, all-to-all `gather_kv`
//! (SP group), `attn`, all-to-all `dispatch` (EP group), `experts`, all-to-all `combine`,
//! `combine`; the first stage starts with `embed`, the last ends with `head`. Its backward
//! runs the mirror image (`head`; per layer from the last: `combine`, `combine_grad`,
//! `experts`, `dispatch_grad`, `attn`, `scatter_kv_grad`, `qkv`); `W` is one `weights`
//! kernel, or, split by `--moe=STAGES:list` into `W.mlp` and `W.attn`, a `weights.mlp`
//! kernel (the expert and shared-expert weights of every layer) and then a `weights.attn`
//! kernel (every other weight: embedding, norms, attention, router, head), which releases the
//! stash. A `WAIT_RA/RG` of the IR is an [`Op::Wait`] on the compute stream for the
//! receive's event. With a group of one, an all-to-all hands the packet to the rank itself.
//!
//! ### Stage granularity ([`Granularity::Stage`])
//!
//! For a runtime that runs the user's own model (opaque to schedc), the kernels are the
//! schedule's ops themselves: one [`Kernel`] with [`Part::Stage`] per `F`, `B`, `W` and `BW`
//! of a (stage, micro-batch) (a `BW` stays one kernel, [`Pass::BW`]), or per MoE part
//! (`attn`, `dispatch`, `mlp`, `combine`) when the schedule splits the op, in the schedule's
//! order. A forward's first piece waits for its input and allocates the stash, its last
//! writes the output activation; a backward's first piece waits for the received gradient,
//! its last writes the input gradient; `BW` and `W` release the stash. An overlapped pair
//! (`F&BW`, DualPipe's F&B chunk) is one [`Op::Overlap`], which a runtime may interleave;
//! the schedule's own collectives (`A2A(comm, label)`) are [`Op::Collective`]s on the comm
//! stream, in program order. No [`Op::AllToAll`]: the user's MoE pieces do their own. The
//! manifest has no model; the mesh may have `pp`, `dp` and `ep` dimensions.
//!
//! **MoE parts** (a schedule lowered with `--moe`, `schedc::moe`): an op split into `attn`,
//! `dispatch`, `mlp` and `combine` runs the same kernels, but part by part and layer by
//! layer, and its four EP all-to-alls go to the [`StreamKind::Ep`] stream, bracketed by
//! events, so that the compute stream runs the other chunk's parts while they are in flight.
//! Per layer `l` (a forward from the first layer, a backward from the last):
//!
//! | part | forward | backward |
//! |---|---|---|
//! | `attn` | (`embed`,) the previous layer's `combine` kernel, `qkv`, `gather_kv`, `attn` | `attn`, `scatter_kv_grad`, `qkv` |
//! | `dispatch` | EP: `dispatch` | EP: `dispatch_grad` |
//! | `mlp` | `experts` | `experts` |
//! | `combine` | EP: `combine`; its `combine` kernel waits for the op's next compute part or the end of the group (then `head`) | (`head`,) `combine`, then EP: `combine_grad` |
//!
//! Parts that interleave (an overlapped F&B pair) form a group; the group's part order is
//! run once per layer, so each layer's all-to-alls hide under the other chunk's compute of
//! that layer.
//!
//! **Tensor parallelism** (`tp > 1`, Megatron-LM's split: each member holds `H/tp` heads of
//! MLA's up-projections and `W_O`, and `f/tp` of the shared expert): per layer, after `attn`
//! an [`Op::TpCollective`] [`Tp::AttnOut`], then an `attn_post` kernel (residual, norm,
//! router, dispatch, the member's slice of the shared expert), then [`Tp::MlpOut`]; in the
//! backward, after `combine` a [`Tp::MlpInGrad`], and after `qkv` a [`Tp::AttnInGrad`] then
//! a `qkv_post` kernel (norms and down-projections, the layer's input gradient). Each TP
//! collective is on the [`StreamKind::Tp`] stream between a record after the kernel before it
//! and a wait before the kernel after it (whole ops and MoE parts alike).
//!
//! One step: `alloc weight_grad` (zeroed) for every local stage; the schedule's compute ops
//! and messages; `ReplicaSum` (DualPipe: ranks `r` and `P-1-r` exchange and add the
//! gradients of the model stage they both hold), `AllReduce` of the dense gradients over
//! `dp x ep x sp` and of the expert gradients over `dp x sp`; `OptimizerStep`. Every
//! replica then holds the sum over the whole global batch and takes the same step.
//!
//! ## Verification ([`verify`](crate::verify()))
//!
//! * every `wait` has exactly one `record` of its event on the rank;
//! * per rank, under happens-before (stream order plus record→wait edges): every buffer's
//!   allocations and releases alternate (alloc, free, alloc, free, ...: a stash offloaded and
//!   reloaded, or dropped by `F(s,m)!` and recomputed, lives twice), every use falls inside
//!   one lifetime, every read has a write
//!   before it, and no two accesses of which one writes are unordered (no race between
//!   streams);
//! * all ranks together run to completion (sends eager, receives and collectives
//!   blocking): every message and collective is matched (the k-th [`Op::Collective`] of a
//!   communicator on one member with the k-th on every other), no wait-for cycle;
//! * the source IR program passes schedc's checker (deadlock freedom under rendezvous
//!   semantics, which the programs keep: each rank's messages are in the IR's order).

use crate::mesh::{Coords, Mesh, MeshError};
use crate::model::{ModelConfig, Scope};
use schedc_ir::{Payload, PayloadKind, PlacementKind};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Version of the JSON format written by [`ProgramSet::write_dir`].
///
/// 2: the manifest says its [`Granularity`] and lists every process group
/// ([`Manifest::groups`]) and channel ([`Manifest::channels`]); stage-granularity kernels
/// ([`Part::Stage`], [`Pass::BW`]), [`Op::Overlap`] and [`Op::Collective`].
pub const FORMAT_VERSION: u32 = 2;

/// What a kernel is: a piece of schedc's own model, or one whole stage of the user's model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Granularity {
    /// schedc's MoE transformer, per layer (`qkv`, `attn`, `experts`, `combine`, with the
    /// sequence- and expert-parallel all-to-alls): what the CPU backend runs.
    #[default]
    Model,
    /// One kernel per F, B, W or BW of a (stage, micro-batch), or per MoE part when the
    /// schedule splits the op into parts: the granularity of a runtime that runs the user's
    /// own, opaque model (`backends/torch/schedc_torch_runtime.py`).
    Stage,
}

impl fmt::Display for Granularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Granularity::Model => "model",
            Granularity::Stage => "stage",
        })
    }
}

impl std::str::FromStr for Granularity {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "model" => Ok(Granularity::Model),
            "stage" => Ok(Granularity::Stage),
            _ => Err(format!(
                "unknown granularity `{s}`: expected `model` (schedc's own model, per layer) or `stage` (one kernel per stage op, for the user's model)"
            )),
        }
    }
}

/// A buffer of a rank program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "buf", rename_all = "snake_case")]
pub enum Buf {
    /// The output activation of `F(stage, mb)` (the IR's `Act` payload).
    Act {
        /// Producing stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// The input gradient produced by the backward of `(stage, mb)` (the IR's `Grad`).
    Grad {
        /// Producing stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// Saved forward state of `(stage, mb)`.
    Stash {
        /// Stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// Gradient accumulator of a stage.
    WeightGrad {
        /// Stage.
        stage: u32,
    },
    /// The host-memory copy of `stash(stage, mb)` made by an [`Op::Offload`] (the IR's
    /// `OFFLOAD(s,m)`), live from the offload until the [`Op::Reload`] that brings it back
    /// (or the `RECOMPUTE` that drops it). On the copy stream only.
    Host {
        /// Stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
}

impl fmt::Display for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Buf::Act { stage, mb } => write!(f, "act({stage},{mb})"),
            Buf::Grad { stage, mb } => write!(f, "grad({stage},{mb})"),
            Buf::Stash { stage, mb } => write!(f, "stash({stage},{mb})"),
            Buf::WeightGrad { stage } => write!(f, "weight_grad({stage})"),
            Buf::Host { stage, mb } => write!(f, "host({stage},{mb})"),
        }
    }
}

impl Buf {
    pub(crate) fn of_payload(p: &Payload) -> Buf {
        match p.kind {
            PayloadKind::Act => Buf::Act {
                stage: p.stage,
                mb: p.mb,
            },
            PayloadKind::Grad => Buf::Grad {
                stage: p.stage,
                mb: p.mb,
            },
            // BPipe's lent stash: the saved activations of F(stage, mb) themselves.
            PayloadKind::Lend | PayloadKind::Return => Buf::Stash {
                stage: p.stage,
                mb: p.mb,
            },
        }
    }
    /// What a message carrying this buffer is, in words.
    pub fn describe(&self) -> String {
        match self {
            Buf::Act { stage, mb } => {
                format!("the activation of stage {stage}, micro-batch {mb}")
            }
            Buf::Grad { stage, mb } => format!("the gradient of stage {stage}, micro-batch {mb}"),
            other => other.to_string(),
        }
    }
}

/// Which stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamKind {
    /// Kernels, all-to-alls, allocation, optimizer.
    Compute,
    /// Point-to-point messages of one IR channel (channel 0: and the gradient reductions).
    Comm {
        /// The IR channel.
        channel: u32,
    },
    /// The expert-parallel stream: the dispatch and combine all-to-alls of MoE parts (a
    /// `--moe` schedule), so that they run under another chunk's compute. Present only in
    /// programs lowered from MoE parts; last but for the `tp` stream.
    Ep,
    /// The tensor-parallel stream: the [`Op::TpCollective`]s of a mesh with `tp > 1`, each
    /// bracketed by events (the compute stream records after the kernel that produced the
    /// partial sums and waits before the kernel that reads the reduced ones), so that a
    /// schedule may run other compute while one is in flight. Present only when `tp > 1`;
    /// always the last stream but for the copy stream.
    Tp,
    /// The host-copy stream: the [`Op::Offload`]s and [`Op::Reload`]s of the IR's memory ops
    /// (`OFFLOAD(s,m)`, `RELOAD(s,m)`), each started by a wait for the event the compute
    /// stream records where the IR issues the op, so that a copy runs under the compute
    /// that follows it. Present only when the schedule moves activations; always the last
    /// stream.
    Copy,
}

impl fmt::Display for StreamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StreamKind::Compute => f.write_str("compute"),
            StreamKind::Comm { channel: 0 } => f.write_str("comm"),
            StreamKind::Comm { channel } => write!(f, "comm@{channel}"),
            StreamKind::Ep => f.write_str("ep"),
            StreamKind::Tp => f.write_str("tp"),
            StreamKind::Copy => f.write_str("copy"),
        }
    }
}

/// Forward, input gradient, weight gradient, fused backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Pass {
    /// Forward.
    F,
    /// Input gradient (torch's `I`).
    B,
    /// Weight gradient.
    W,
    /// Input and weight gradients in one kernel (torch's `B`); stage granularity only (the
    /// model granularity lowers a `BW` into its `B` kernels and a `W` kernel).
    BW,
    /// The forward run again to rebuild `stash(s,m)` before its backward (the IR's
    /// `RECOMPUTE(s,m)`, activation checkpointing): the same kernels as [`Pass::F`], from the
    /// stage's input (the received `act` buffer, kept alive for it, or the data on the first
    /// stage), with no side effect but the stash: no loss, no router loads, no output
    /// activation.
    Recompute,
}

/// Which piece of a stage a kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "part", rename_all = "snake_case")]
pub enum Part {
    /// Token embedding (first stage, forward).
    Embed,
    /// Norm and the token-local projections of a layer's multi-head latent attention
    /// (local index): queries, the key/value latent `c_KV` and the shared RoPE key `k_pe`
    /// (the CPU model's `fwd_qkv`); the backward sums the local chunk's latent and
    /// RoPE-key gradients and returns the layer's input gradient.
    Qkv {
        /// Layer within the stage.
        layer: u32,
    },
    /// Up-projection of the gathered latents to every head's keys and values, attention,
    /// output projection, norm, router of a layer; builds the dispatch.
    Attn {
        /// Layer within the stage.
        layer: u32,
    },
    /// The local experts of a layer on the dispatched rows.
    Experts {
        /// Layer within the stage.
        layer: u32,
    },
    /// Weighted sum of the expert outputs, shared expert, residual.
    Combine {
        /// Layer within the stage.
        layer: u32,
    },
    /// Final norm, LM head, cross-entropy (last stage).
    Head,
    /// Tensor parallelism (`tp > 1`), forward, after the [`Tp::AttnOut`] all-reduce: the
    /// residual, the MoE norm, the router and the dispatch, and the local slice of the
    /// shared expert (its partial output goes to the [`Tp::MlpOut`] all-reduce). With
    /// `tp = 1` the `attn` kernel does all of this itself.
    AttnPost {
        /// Layer within the stage.
        layer: u32,
    },
    /// Tensor parallelism (`tp > 1`), backward, after the [`Tp::AttnInGrad`] all-reduce:
    /// the latents' norms, the down-projections `W_DQ`, `W_DKV`, `W_KR`, the attention norm
    /// and the residual; writes the layer's input gradient. With `tp = 1` the `qkv` kernel
    /// does all of this itself.
    QkvPost {
        /// Layer within the stage.
        layer: u32,
    },
    /// Megatron sequence parallelism: this member's slice of the shared expert of a layer on
    /// the TP group's gathered rows (F), or its backward on the gathered output gradient
    /// (B).
    Shared {
        /// Layer within the stage.
        layer: u32,
    },
    /// Every weight gradient of the stage (pass `W`).
    Weights,
    /// The expert (and shared-expert) weight gradients of every layer of the stage: a split
    /// `W`'s `mlp` part.
    WeightsMlp,
    /// Every other weight gradient of the stage (embedding, norms, attention, router, final
    /// norm and head): a split `W`'s `attn` part, after its `mlp` part.
    WeightsAttn,
    /// Stage granularity: the whole stage of the user's model for the kernel's pass, or one
    /// MoE part of it (`moe`: `attn`, `dispatch`, `mlp`, `combine`, the schedule's parts, in
    /// the order the schedule gives them; `whole` is left out of the JSON).
    Stage {
        /// The MoE part, or `whole`.
        #[serde(default, skip_serializing_if = "is_whole")]
        moe: schedc_ir::Part,
    },
}

fn is_whole(p: &schedc_ir::Part) -> bool {
    *p == schedc_ir::Part::Whole
}

/// A compute kernel on `(stage, mb)`, with the buffers it touches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kernel {
    /// F, B or W.
    pub pass: Pass,
    /// Stage id.
    pub stage: u32,
    /// Micro-batch.
    pub mb: u32,
    /// Which piece.
    #[serde(flatten)]
    pub part: Part,
    /// Buffers read.
    pub reads: Vec<Buf>,
    /// Buffers written.
    pub writes: Vec<Buf>,
}

/// The all-to-alls of a layer: four over the EP group (MoE), two over the SP group
/// (attention).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum A2a {
    /// Forward, SP group: every member's `[c_KV; k_pe]` (`d_c + d_h^R` values per token,
    /// [`crate::ModelConfig::kv_gather_width`]) to every member (an all-gather); the
    /// per-head keys and values are up-projected after it.
    GatherKv,
    /// Backward, SP group: each member's gradients of every chunk's `[c_KV; k_pe]` to the
    /// chunk's owner, who sums them (a reduce-scatter).
    ScatterKvGrad,
    /// Forward: token rows to their experts.
    Dispatch,
    /// Forward: expert outputs back.
    Combine,
    /// Backward of combine: output gradients to the experts.
    CombineGrad,
    /// Backward of dispatch: input gradients back.
    DispatchGrad,
}

/// The tensor-parallel collectives of a layer (Megatron-LM's `g` in the forward and `f`
/// in the backward, Shoeybi et al., arXiv 1909.08053, §3): each an all-reduce over the TP
/// group of partial sums that every member computed from its own heads or its own slice of
/// the shared expert; every member adds the members' partials in group order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tp {
    /// Forward: the output projection `o W_O` (row-parallel `W_O`, `t × d`).
    AttnOut,
    /// Forward: the shared expert's output (row-parallel `W2`, `t × d`).
    MlpOut,
    /// Backward: the shared expert's input gradient (column-parallel `W1`, `W3`, `t × d`).
    MlpInGrad,
    /// Backward: the gradients of the column-parallel up-projections' inputs, the query
    /// latent `c_Q`, the key/value latent `c_KV` and the RoPE key `k^R` (`t × (d_c' + d_c +
    /// d_h^R)`; `k^R` is shared by every head, so each member holds its heads' share).
    AttnInGrad,
    /// Sequence parallel, forward, all-gather: the shards' `[c_Q; c_KV; k^R]` rows.
    LatentGather,
    /// Sequence parallel, forward, reduce-scatter: `o W_O` (each member keeps its shard's
    /// rows of the sum).
    AttnOutScatter,
    /// Sequence parallel, forward, all-gather: the shards' MoE-norm rows (the shared
    /// expert's input).
    MlpInGather,
    /// Sequence parallel, forward, reduce-scatter: the shared expert's output.
    MlpOutScatter,
    /// Sequence parallel, backward, all-gather: the layer output's gradient (for the shared
    /// expert).
    MlpOutGradGather,
    /// Sequence parallel, backward, reduce-scatter: the shared expert's input gradient.
    MlpInGradScatter,
    /// Sequence parallel, backward, all-gather: the gradient of `h1` (for `W_O`).
    AttnOutGradGather,
    /// Sequence parallel, backward, reduce-scatter: `[dc_Q; dc_KV; dk^R]`.
    LatentGradScatter,
}

/// What a [`Tp`] phase does with the members' `tp_out`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpKind {
    /// Every member gets the sum.
    AllReduce,
    /// Every member gets the members' rows, concatenated in group order.
    AllGather,
    /// Member `j` gets rows `j/n` of the sum (`n` equal shards).
    ReduceScatter,
}

impl Tp {
    /// The collective the phase is.
    pub fn kind(self) -> TpKind {
        match self {
            Tp::AttnOut | Tp::MlpOut | Tp::MlpInGrad | Tp::AttnInGrad => TpKind::AllReduce,
            Tp::LatentGather | Tp::MlpInGather | Tp::MlpOutGradGather | Tp::AttnOutGradGather => {
                TpKind::AllGather
            }
            Tp::AttnOutScatter
            | Tp::MlpOutScatter
            | Tp::MlpInGradScatter
            | Tp::LatentGradScatter => TpKind::ReduceScatter,
        }
    }
    /// True for the forward's phases.
    pub fn forward(self) -> bool {
        matches!(
            self,
            Tp::AttnOut
                | Tp::MlpOut
                | Tp::LatentGather
                | Tp::AttnOutScatter
                | Tp::MlpInGather
                | Tp::MlpOutScatter
        )
    }
}

/// One instruction of a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Allocate a buffer (`zero`: filled with zeros, which counts as a write).
    Alloc {
        /// The buffer.
        buf: Buf,
        /// Zero-filled.
        zero: bool,
    },
    /// Release a buffer.
    Free {
        /// The buffer.
        buf: Buf,
    },
    /// Mark this point of the stream.
    Record {
        /// Event id (unique per rank).
        event: u32,
    },
    /// Hold the stream until the event's record has run.
    Wait {
        /// Event id.
        event: u32,
    },
    /// A compute kernel.
    Kernel(Kernel),
    /// Send a buffer to a global rank.
    Send {
        /// The buffer (its name is the message's label).
        buf: Buf,
        /// Destination global rank.
        peer: u32,
    },
    /// Receive a buffer from a global rank.
    Recv {
        /// The buffer.
        buf: Buf,
        /// Source global rank.
        peer: u32,
    },
    /// All-to-all over the EP group (MoE phases) or the SP group (attention phases); reads
    /// and writes `stash(stage, mb)`.
    AllToAll {
        /// Stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
        /// Layer within the stage.
        layer: u32,
        /// Which of the four.
        phase: A2a,
        /// The group, global ranks in order.
        group: Vec<u32>,
    },
    /// A tensor-parallel all-reduce ([`Tp`]) of layer `layer` of `(stage, mb)` over the TP
    /// group; reads and writes `stash(stage, mb)`. On the [`StreamKind::Tp`] stream.
    TpCollective {
        /// Stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
        /// Layer within the stage.
        layer: u32,
        /// Which of the four.
        phase: Tp,
        /// The TP group, global ranks in order.
        group: Vec<u32>,
    },
    /// Megatron sequence parallelism: sum over the TP group the gradients that each member
    /// computed on its own shard of the tokens: every tensor that is not split over the
    /// group (embedding, norms, down-projections, router, routed experts, head) and the
    /// load counts. On the comm stream before the data-parallel all-reduces.
    TpGradAllReduce {
        /// Stage.
        stage: u32,
        /// The TP group, global ranks in order.
        group: Vec<u32>,
    },
    /// DualPipe: exchange `weight_grad(stage)` with `peer`, which holds the same model
    /// stage in the other direction, and add.
    ReplicaSum {
        /// Local stage id.
        stage: u32,
        /// The model stage both copies hold.
        model_stage: u32,
        /// The global rank holding the other copy.
        peer: u32,
    },
    /// Sum `weight_grad(stage)`'s tensors of `scope` over `group` (every member ends with
    /// the same sum, added in group order).
    AllReduce {
        /// Stage.
        stage: u32,
        /// Dense (with the load counts) or expert tensors.
        scope: Scope,
        /// Global ranks, in order.
        group: Vec<u32>,
    },
    /// Apply the optimizer to the stage's parameters with `weight_grad(stage)`, and move
    /// its routers' bias with the summed loads.
    OptimizerStep {
        /// Stage.
        stage: u32,
    },
    /// Stage granularity: a forward and a backward of different (stage, micro-batch) that
    /// the schedule issues as one overlapped pair (DualPipe's F&B chunk, torch's
    /// `OVERLAP_F_B`). A runtime may interleave their pieces (the user's
    /// `overlapped_forward_backward`) or run `fwd` then `bwd`. Reads and writes what both
    /// kernels do.
    Overlap {
        /// The forward kernel.
        fwd: Kernel,
        /// The backward kernel (`B` or `BW`).
        bwd: Kernel,
    },
    /// The IR's `OFFLOAD(s,m)`, on the [`StreamKind::Copy`] stream: copies `stash(stage, mb)`
    /// into `host(stage, mb)` (allocated just before it); the stash is released after it, so
    /// that nothing on the device holds the saved tensors until a [`Op::Reload`] or a
    /// `RECOMPUTE` rebuilds them.
    Offload {
        /// Stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// The IR's `RELOAD(s,m)`, on the [`StreamKind::Copy`] stream: copies `host(stage, mb)`
    /// back into `stash(stage, mb)` (allocated again just before it) and releases the host
    /// copy; the compute stream waits for the event recorded after it before the first
    /// kernel of the backward that reads the stash.
    Reload {
        /// Stage.
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// Stage granularity: one of the schedule's own collectives (`A2A(comm, label)`) on
    /// communicator `comm`; every member issues the same sequence. Carries no buffer: a
    /// runtime synchronizes the group (or calls the user's hook for it).
    Collective {
        /// The communicator's name in the schedule.
        comm: String,
        /// The call's label.
        label: String,
        /// The members, global ranks in order.
        group: Vec<u32>,
    },
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let part = match self.part {
            Part::Embed => "embed".to_string(),
            Part::Qkv { layer } => format!("qkv[{layer}]"),
            Part::Attn { layer } => format!("attn[{layer}]"),
            Part::Experts { layer } => format!("experts[{layer}]"),
            Part::Combine { layer } => format!("combine[{layer}]"),
            Part::AttnPost { layer } => format!("attn_post[{layer}]"),
            Part::QkvPost { layer } => format!("qkv_post[{layer}]"),
            Part::Shared { layer } => format!("shared[{layer}]"),
            Part::Head => "head".to_string(),
            Part::Weights => "weights".to_string(),
            Part::WeightsMlp => "weights.mlp".to_string(),
            Part::WeightsAttn => "weights.attn".to_string(),
            Part::Stage { moe } => {
                return match moe {
                    schedc_ir::Part::Whole => {
                        write!(f, "{:?}({},{})", self.pass, self.stage, self.mb)
                    }
                    p => write!(
                        f,
                        "{:?}({},{}).{}",
                        self.pass,
                        self.stage,
                        self.mb,
                        p.as_str()
                    ),
                };
            }
        };
        write!(f, "{:?}({},{}).{part}", self.pass, self.stage, self.mb)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Alloc { buf, zero } => {
                write!(f, "alloc {buf}{}", if *zero { " (zeroed)" } else { "" })
            }
            Op::Free { buf } => write!(f, "free {buf}"),
            Op::Record { event } => write!(f, "record e{event}"),
            Op::Wait { event } => write!(f, "wait e{event}"),
            Op::Kernel(k) => write!(f, "{k}"),
            Op::Send { buf, peer } => write!(f, "send {buf} to rank {peer}"),
            Op::Recv { buf, peer } => write!(f, "recv {buf} from rank {peer}"),
            Op::AllToAll {
                stage,
                mb,
                layer,
                phase,
                group,
            } => write!(
                f,
                "all_to_all {phase:?}({stage},{mb})[{layer}] over {group:?}"
            ),
            Op::TpCollective {
                stage,
                mb,
                layer,
                phase,
                group,
            } => write!(
                f,
                "tp_{} {phase:?}({stage},{mb})[{layer}] over {group:?}",
                match phase.kind() {
                    TpKind::AllReduce => "all_reduce",
                    TpKind::AllGather => "all_gather",
                    TpKind::ReduceScatter => "reduce_scatter",
                }
            ),
            Op::ReplicaSum {
                stage,
                model_stage,
                peer,
            } => write!(
                f,
                "replica_sum weight_grad({stage}) (model stage {model_stage}) with rank {peer}"
            ),
            Op::AllReduce {
                stage,
                scope,
                group,
            } => write!(
                f,
                "all_reduce {scope:?} weight_grad({stage}) over {group:?}"
            ),
            Op::OptimizerStep { stage } => write!(f, "optimizer_step stage {stage}"),
            Op::TpGradAllReduce { stage, group } => {
                write!(f, "tp_grad_all_reduce weight_grad({stage}) over {group:?}")
            }
            Op::Overlap { fwd, bwd } => write!(f, "{fwd} & {bwd}"),
            Op::Collective { comm, label, group } => {
                write!(f, "collective {comm}:{label} over {group:?}")
            }
            Op::Offload { stage, mb } => write!(f, "offload stash({stage},{mb}) to host"),
            Op::Reload { stage, mb } => write!(f, "reload stash({stage},{mb}) from host"),
        }
    }
}

impl Op {
    /// `(reads, writes)` of the instruction (allocation and release excluded).
    pub fn access(&self) -> (Vec<Buf>, Vec<Buf>) {
        match self {
            Op::Kernel(k) => (k.reads.clone(), k.writes.clone()),
            Op::Send { buf, .. } => (vec![*buf], vec![]),
            Op::Recv { buf, .. } => (vec![], vec![*buf]),
            Op::AllToAll { stage, mb, .. } | Op::TpCollective { stage, mb, .. } => {
                let b = Buf::Stash {
                    stage: *stage,
                    mb: *mb,
                };
                (vec![b], vec![b])
            }
            Op::ReplicaSum { stage, .. }
            | Op::AllReduce { stage, .. }
            | Op::TpGradAllReduce { stage, .. } => {
                let b = Buf::WeightGrad { stage: *stage };
                (vec![b], vec![b])
            }
            Op::OptimizerStep { stage } => (vec![Buf::WeightGrad { stage: *stage }], vec![]),
            Op::Offload { stage, mb } => (
                vec![Buf::Stash {
                    stage: *stage,
                    mb: *mb,
                }],
                vec![Buf::Host {
                    stage: *stage,
                    mb: *mb,
                }],
            ),
            Op::Reload { stage, mb } => (
                vec![Buf::Host {
                    stage: *stage,
                    mb: *mb,
                }],
                vec![Buf::Stash {
                    stage: *stage,
                    mb: *mb,
                }],
            ),
            Op::Overlap { fwd, bwd } => {
                let mut r = fwd.reads.clone();
                r.extend(&bwd.reads);
                let mut w = fwd.writes.clone();
                w.extend(&bwd.writes);
                r.sort();
                r.dedup();
                w.sort();
                w.dedup();
                (r, w)
            }
            Op::Alloc { .. }
            | Op::Free { .. }
            | Op::Record { .. }
            | Op::Wait { .. }
            | Op::Collective { .. } => (vec![], vec![]),
        }
    }
}

/// One in-order stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stream {
    /// Which stream.
    pub kind: StreamKind,
    /// Its instructions.
    pub ops: Vec<Op>,
}

/// A stage held by a rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalStage {
    /// IR stage id.
    pub stage: u32,
    /// Model stage (`stage`, or `stage mod P` for DualPipe's direction 1).
    pub model_stage: u32,
    /// Direction (DualPipe), else 0.
    pub direction: u32,
    /// Holds the embedding.
    pub first: bool,
    /// Holds the LM head and the loss.
    pub last: bool,
    /// Global id of the first local expert.
    pub expert_lo: u32,
    /// One past the last local expert.
    pub expert_hi: u32,
    /// DualPipe: the global rank holding the same model stage in the other direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_peer: Option<u32>,
}

/// The program of one global rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankProgram {
    /// Global rank.
    pub rank: u32,
    /// Mesh coordinates.
    pub coords: Coords,
    /// Index of the data shard the rank reads (`dp * EP + ep`).
    pub data_shard: u32,
    /// The stages it holds, in reduction order (model stage, then direction).
    pub stages: Vec<LocalStage>,
    /// `compute`, then `comm` (channel 0), then the other channels' comm streams in
    /// increasing channel order, then (for MoE parts only) the `ep` stream, then (`tp > 1`)
    /// the `tp` stream, then (memory ops only) the `copy` stream.
    pub streams: Vec<Stream>,
    /// Number of events (ids `0..events`).
    pub events: u32,
}

/// What every rank program shares.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// What the kernels are: schedc's model per layer, or the user's stages.
    pub granularity: Granularity,
    /// Pipeline ranks P.
    pub pp: u32,
    /// IR stage ids S (both directions for DualPipe).
    pub stages: u32,
    /// Micro-batches per direction M.
    pub microbatches: u32,
    /// 2 for DualPipe, else 1.
    pub directions: u32,
    /// Placement kind.
    pub placement: PlacementKind,
    /// Pipeline rank of each IR stage.
    pub stage_to_rank: Vec<u32>,
    /// Model stages (stages per direction).
    pub model_stages: u32,
    /// The model the kernels belong to (model granularity; none at stage granularity, where
    /// the model is the user's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelConfig>,
    /// The mesh.
    pub mesh: Mesh,
    /// Global ranks.
    pub world: u32,
    /// Files written by [`ProgramSet::write_dir`], rank order.
    pub files: Vec<String>,
    /// Every group of global ranks some rank program runs a collective over (all-to-alls,
    /// replica sums, all-reduces, the schedule's collectives), sorted, each once: a runtime
    /// whose group creation is collective over the world (`torch.distributed.new_group`)
    /// creates them all, in this order, on every rank.
    #[serde(default)]
    pub groups: Vec<Vec<u32>>,
    /// The IR channels the rank programs' comm streams use (0 always), increasing: a runtime
    /// gives each its own in-order communicator.
    #[serde(default)]
    pub channels: Vec<u32>,
    /// Megatron-LM's sequence parallelism inside the TP group (`--sequence-parallel`, with
    /// `tp > 1`): each TP member holds `1/tp` of its chunk's tokens between the TP
    /// collectives, which are all-gathers and reduce-scatters.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sequence_parallel: bool,
}

/// Every rank's program and the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgramSet {
    /// Shared facts.
    pub manifest: Manifest,
    /// Rank `g` at index `g`.
    pub ranks: Vec<RankProgram>,
}

/// Why lowering or verification failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProgramError {
    /// The source program does not pass schedc's checker.
    #[error("the schedule does not verify: {0}")]
    Rejected(String),
    /// The mesh does not fit.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// The model config is invalid.
    #[error("{0}")]
    Model(String),
    /// Something the CPU backend does not run.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The lowered programs break a rule of the format.
    #[error("rank {rank}, {stream} stream, op #{index} `{op}`: {why}")]
    Invalid {
        /// Global rank.
        rank: u32,
        /// Stream.
        stream: StreamKind,
        /// Position in the stream.
        index: usize,
        /// The op's text.
        op: String,
        /// What is wrong.
        why: String,
    },
    /// A buffer rule broken (not tied to one op).
    #[error("rank {rank}: {why}")]
    Buffer {
        /// Global rank.
        rank: u32,
        /// What is wrong.
        why: String,
    },
    /// The programs cannot all run to the end.
    #[error("the rank programs deadlock: {0}")]
    Deadlock(String),
}

impl ProgramSet {
    /// Total instructions over all ranks and streams.
    pub fn len(&self) -> usize {
        self.ranks
            .iter()
            .flat_map(|r| &r.streams)
            .map(|s| s.ops.len())
            .sum()
    }

    /// True if no rank has an instruction.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes `manifest.json` and one `rankG.json` per rank into `dir` (created if
    /// missing); returns the paths written.
    pub fn write_dir(&self, dir: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
        std::fs::create_dir_all(dir)?;
        let mut out = Vec::new();
        let m = dir.join("manifest.json");
        std::fs::write(&m, serde_json::to_string_pretty(&self.manifest)?)?;
        out.push(m);
        for (r, f) in self.ranks.iter().zip(&self.manifest.files) {
            let p = dir.join(f);
            std::fs::write(&p, serde_json::to_string_pretty(r)?)?;
            out.push(p);
        }
        Ok(out)
    }

    /// Reads what [`ProgramSet::write_dir`] wrote. Errors: a missing file, invalid JSON, a
    /// format version other than [`FORMAT_VERSION`], or a rank file for the wrong rank.
    pub fn read_dir(dir: &std::path::Path) -> Result<ProgramSet, String> {
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .map_err(|e| format!("cannot read {}: {e}", dir.join(name).display()))
        };
        let manifest: Manifest = serde_json::from_str(&read("manifest.json")?)
            .map_err(|e| format!("manifest.json: {e}"))?;
        if manifest.format_version != FORMAT_VERSION {
            return Err(format!(
                "manifest.json has format version {}, this backend reads {FORMAT_VERSION}",
                manifest.format_version
            ));
        }
        let mut ranks = Vec::new();
        for (g, f) in manifest.files.iter().enumerate() {
            let r: RankProgram =
                serde_json::from_str(&read(f)?).map_err(|e| format!("{f}: {e}"))?;
            if r.rank != g as u32 {
                return Err(format!("{f} holds rank {}, expected {g}", r.rank));
            }
            ranks.push(r);
        }
        Ok(ProgramSet { manifest, ranks })
    }
}
