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
//! kernel. With a group of one, an all-to-all hands the packet to the rank itself.
//!
//! One step: `alloc weight_grad` (zeroed) for every local stage; the schedule's compute ops
//! and messages; `ReplicaSum` (DualPipe: ranks `r` and `P-1-r` exchange and add the
//! gradients of the model stage they both hold), `AllReduce` of the dense gradients over
//! `dp x ep x sp` and of the expert gradients over `dp x sp`; `OptimizerStep`. Every
//! replica then holds the sum over the whole global batch and takes the same step.
//!
//! ## Verification ([`verify`])
//!
//! * every `wait` has exactly one `record` of its event on the rank;
//! * per rank, under happens-before (stream order plus record→wait edges): every buffer is
//!   allocated once before any use and freed once after every use, every read has a write
//!   before it, and no two accesses of which one writes are unordered (no race between
//!   streams);
//! * all ranks together run to completion (sends eager, receives and collectives
//!   blocking): every message and collective is matched, no wait-for cycle;
//! * the source IR program passes schedc's checker (deadlock freedom under rendezvous
//!   semantics, which the programs keep: each rank's messages are in the IR's order).

use crate::mesh::{Coords, Fit, Mesh, MeshError};
use crate::model::{ModelConfig, Scope};
use schedc_ir::{Comm, Instr, Kind, Part as IrPart, Payload, PayloadKind, PlacementKind, Program};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::fmt;

/// Version of the JSON format written by [`ProgramSet::write_dir`].
pub const FORMAT_VERSION: u32 = 1;

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
}

impl fmt::Display for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Buf::Act { stage, mb } => write!(f, "act({stage},{mb})"),
            Buf::Grad { stage, mb } => write!(f, "grad({stage},{mb})"),
            Buf::Stash { stage, mb } => write!(f, "stash({stage},{mb})"),
            Buf::WeightGrad { stage } => write!(f, "weight_grad({stage})"),
        }
    }
}

impl Buf {
    fn of_payload(p: &Payload) -> Buf {
        match p.kind {
            PayloadKind::Act => Buf::Act {
                stage: p.stage,
                mb: p.mb,
            },
            PayloadKind::Grad => Buf::Grad {
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
}

impl fmt::Display for StreamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StreamKind::Compute => f.write_str("compute"),
            StreamKind::Comm { channel: 0 } => f.write_str("comm"),
            StreamKind::Comm { channel } => write!(f, "comm@{channel}"),
        }
    }
}

/// Forward, input gradient, weight gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Pass {
    /// Forward.
    F,
    /// Input gradient.
    B,
    /// Weight gradient.
    W,
}

/// Which piece of a stage a kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "part", rename_all = "snake_case")]
pub enum Part {
    /// Token embedding (first stage, forward).
    Embed,
    /// Norm and the token-local projections of a layer's multi-head latent attention
    /// (local index): queries, the key/value latent `c_KV` and the shared RoPE key `k_pe`
    /// (the CPU model's `fwd_qkv`); the backward sums the local chunk's
    /// latent and RoPE-key gradients and returns the layer's input gradient.
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
    /// Every weight gradient of the stage (pass `W`).
    Weights,
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
    /// [`ModelConfig::kv_gather_width`]) to every member (an all-gather); the per-head keys
    /// and values are up-projected after it.
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
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let part = match self.part {
            Part::Embed => "embed".to_string(),
            Part::Qkv { layer } => format!("qkv[{layer}]"),
            Part::Attn { layer } => format!("attn[{layer}]"),
            Part::Experts { layer } => format!("experts[{layer}]"),
            Part::Combine { layer } => format!("combine[{layer}]"),
            Part::Head => "head".to_string(),
            Part::Weights => "weights".to_string(),
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
            Op::AllToAll { stage, mb, .. } => {
                let b = Buf::Stash {
                    stage: *stage,
                    mb: *mb,
                };
                (vec![b], vec![b])
            }
            Op::ReplicaSum { stage, .. } | Op::AllReduce { stage, .. } => {
                let b = Buf::WeightGrad { stage: *stage };
                (vec![b], vec![b])
            }
            Op::OptimizerStep { stage } => (vec![Buf::WeightGrad { stage: *stage }], vec![]),
            Op::Alloc { .. } | Op::Free { .. } | Op::Record { .. } | Op::Wait { .. } => {
                (vec![], vec![])
            }
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
    /// increasing channel order.
    pub streams: Vec<Stream>,
    /// Number of events (ids `0..events`).
    pub events: u32,
}

/// What every rank program shares.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
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
    /// The model the kernels belong to.
    pub model: ModelConfig,
    /// The mesh.
    pub mesh: Mesh,
    /// Global ranks.
    pub world: u32,
    /// Files written by [`ProgramSet::write_dir`], rank order.
    pub files: Vec<String>,
}

/// Every rank's program and the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgramSet {
    /// Shared facts.
    pub manifest: Manifest,
    /// Rank `g` at index `g`.
    pub ranks: Vec<RankProgram>,
}

/// Lowering switches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// Injected bug (tests only): DualPipe's two copies of a stage keep their own
    /// gradients instead of summing them.
    pub bug_skip_replica_sum: bool,
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

/// The first error diagnostics of a rejected check, joined.
fn rejected(out: &schedc::check::Outcome) -> Option<String> {
    let errs: Vec<String> = out
        .report
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .take(3)
        .map(|d| d.message.clone())
        .collect();
    (out.report.verdict == schedc::check::Verdict::Rejected).then(|| errs.join("; "))
}

impl ProgramSet {
    /// Lowers a schedule (compute-only IR, which schedc lowers first, or already lowered)
    /// for `mesh` and `model`. Errors: the schedule fails schedc's checker; the mesh does
    /// not fit; the schedule has ops this backend does not run (MoE part-split ops, IR
    /// collectives); the model config is invalid.
    pub fn lower(
        source: &Program,
        mesh: &Mesh,
        model: &ModelConfig,
        opts: LowerOptions,
    ) -> Result<ProgramSet, ProgramError> {
        model.validate().map_err(ProgramError::Model)?;
        let out = schedc::check::check(source, None, &Default::default());
        if let Some(why) = rejected(&out) {
            return Err(ProgramError::Rejected(why));
        }
        let ir = out
            .checked
            .ok_or_else(|| ProgramError::Rejected("no checked program".into()))?;
        let pl = &ir.pipeline;
        mesh.validate(
            None,
            &Fit {
                pp: pl.pp,
                experts: model.experts as u32,
                heads: model.heads as u32,
                hidden: model.hidden as u32,
                expert_hidden: model.expert_hidden as u32,
                seq_len: model.seq_len as u32,
            },
        )?;
        for (r, instrs) in ir.ranks.iter().enumerate() {
            for ins in instrs {
                let mut bad = None;
                ins.for_each_compute(|c| {
                    if c.part != IrPart::Whole {
                        bad = Some(format!(
                            "rank {r} has an MoE part-split op ({}); the CPU backend runs whole-stage ops and makes the all-to-alls itself",
                            schedc::passes::compute_str(c)
                        ));
                    }
                });
                if ins.comms().iter().any(|c| matches!(c, Comm::Collective(_))) {
                    bad = Some(format!(
                        "rank {r} has an IR collective; the CPU backend makes the expert-parallel all-to-alls itself"
                    ));
                }
                if let Some(b) = bad {
                    return Err(ProgramError::Unsupported(b));
                }
            }
        }
        let world = mesh.world();
        let ranks = (0..world)
            .map(|g| lower_rank(&ir, mesh, model, g, opts))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ProgramSet {
            manifest: Manifest {
                format_version: FORMAT_VERSION,
                pp: pl.pp,
                stages: pl.stages,
                microbatches: pl.microbatches,
                directions: pl.directions(),
                placement: pl.placement,
                stage_to_rank: pl.stage_to_rank.clone(),
                model_stages: pl.stages_per_direction(),
                model: model.clone(),
                mesh: mesh.clone(),
                world,
                files: (0..world).map(|g| format!("rank{g}.json")).collect(),
            },
            ranks,
        })
    }

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

struct Builder {
    compute: Vec<Op>,
    comm: Vec<Op>,
    channels: std::collections::BTreeMap<u32, Vec<Op>>,
    events: u32,
}

impl Builder {
    fn event(&mut self) -> u32 {
        self.events += 1;
        self.events - 1
    }

    /// The op list of communication stream `channel` (0: the default comm stream).
    fn comm_stream(&mut self, channel: u32) -> &mut Vec<Op> {
        if channel == 0 {
            &mut self.comm
        } else {
            self.channels.entry(channel).or_default()
        }
    }
}

fn lower_rank(
    ir: &Program,
    mesh: &Mesh,
    model: &ModelConfig,
    g: u32,
    opts: LowerOptions,
) -> Result<RankProgram, ProgramError> {
    let pl = &ir.pipeline;
    let coords = mesh.coords(g)?;
    let r = coords.pp;
    let ep = mesh.size(crate::mesh::Dim::Ep);
    let per = model.experts as u32 / ep;
    let bidir = pl.placement == PlacementKind::Bidir;
    let n_model = pl.stages_per_direction();
    let lps = model.layers_per_stage as u32;
    let mut stages: Vec<LocalStage> = pl
        .stages_of(r)
        .into_iter()
        .map(|s| {
            let (model_stage, direction) = if bidir {
                (s % pl.pp, s / pl.pp)
            } else {
                (s, 0)
            };
            Ok(LocalStage {
                stage: s,
                model_stage,
                direction,
                first: model_stage == 0,
                last: model_stage + 1 == n_model,
                expert_lo: coords.ep * per,
                expert_hi: (coords.ep + 1) * per,
                replica_peer: if bidir {
                    Some(mesh.pipeline_peer(g, pl.pp - 1 - r)?)
                } else {
                    None
                },
            })
        })
        .collect::<Result<_, MeshError>>()?;
    stages.sort_by_key(|s| (s.model_stage, s.direction));
    let info = |s: u32| stages.iter().find(|x| x.stage == s).cloned();
    let peer = |pp_rank: u32| mesh.pipeline_peer(g, pp_rank);
    let ep_group = mesh.ep_group(g)?;
    let sp_group = mesh.sp_group(g)?;

    let mut b = Builder {
        compute: Vec::new(),
        comm: Vec::new(),
        channels: Default::default(),
        events: 0,
    };
    // Which payloads travel: events for receives (recorded by comm) and sends (recorded by
    // compute after the producing kernel).
    let mut recv_ev: HashMap<Buf, u32> = HashMap::new();
    let mut send_ev: HashMap<Buf, u32> = HashMap::new();
    for ins in &ir.ranks[r as usize] {
        for c in ins.comms() {
            match c {
                Comm::Send { payload, .. } => {
                    let e = b.event();
                    send_ev.insert(Buf::of_payload(payload), e);
                }
                Comm::Recv { payload, .. } => {
                    let e = b.event();
                    recv_ev.insert(Buf::of_payload(payload), e);
                }
                Comm::Collective(_) => {}
            }
        }
    }
    for s in &stages {
        b.compute.push(Op::Alloc {
            buf: Buf::WeightGrad { stage: s.stage },
            zero: true,
        });
    }
    for ins in &ir.ranks[r as usize] {
        match ins {
            Instr::Compute(_) | Instr::Overlap { .. } => {
                let mut cs = Vec::new();
                ins.for_each_compute(|c| cs.push(*c));
                for c in cs {
                    let st = info(c.stage).ok_or_else(|| {
                        ProgramError::Rejected(format!("stage {} is not held by rank {r}", c.stage))
                    })?;
                    emit_compute(
                        &mut b, pl, &st, c.kind, c.mb, lps, &ep_group, &sp_group, &recv_ev,
                        &send_ev,
                    );
                }
            }
            Instr::Comm(_) | Instr::Group(_) => {
                // Sends first: they never block on this rank's receives (eager), so a
                // group posted at once keeps its meaning.
                let comms = ins.comms();
                for c in comms {
                    if let Comm::Send {
                        payload,
                        peer: p,
                        channel,
                    } = c
                    {
                        let buf = Buf::of_payload(payload);
                        let ops = b.comm_stream(*channel);
                        ops.push(Op::Wait {
                            event: send_ev[&buf],
                        });
                        ops.push(Op::Send {
                            buf,
                            peer: peer(*p)?,
                        });
                        ops.push(Op::Free { buf });
                    }
                }
                for c in comms {
                    if let Comm::Recv {
                        payload,
                        peer: p,
                        channel,
                    } = c
                    {
                        let buf = Buf::of_payload(payload);
                        let ops = b.comm_stream(*channel);
                        ops.push(Op::Alloc { buf, zero: false });
                        ops.push(Op::Recv {
                            buf,
                            peer: peer(*p)?,
                        });
                        ops.push(Op::Record {
                            event: recv_ev[&buf],
                        });
                    }
                }
            }
            // Torch's lowered extras carry nothing this backend needs: the reductions and
            // the optimizer come at the end of the step.
            Instr::ReduceGrad(_)
            | Instr::WaitReduceGrad(_)
            | Instr::Unshard(_)
            | Instr::Reshard(_)
            | Instr::WaitSend(_)
            | Instr::Idle => {}
        }
    }
    // End of step.
    let done = b.event();
    b.compute.push(Op::Record { event: done });
    b.comm.push(Op::Wait { event: done });
    let dense = mesh.dense_dp_group(g)?;
    let expert = mesh.expert_dp_group(g)?;
    for s in &stages {
        if let (Some(p), false) = (s.replica_peer, opts.bug_skip_replica_sum) {
            b.comm.push(Op::ReplicaSum {
                stage: s.stage,
                model_stage: s.model_stage,
                peer: p,
            });
        }
        if dense.len() > 1 {
            b.comm.push(Op::AllReduce {
                stage: s.stage,
                scope: Scope::Dense,
                group: dense.clone(),
            });
        }
        if expert.len() > 1 {
            b.comm.push(Op::AllReduce {
                stage: s.stage,
                scope: Scope::Expert,
                group: expert.clone(),
            });
        }
    }
    let reduced = b.event();
    b.comm.push(Op::Record { event: reduced });
    b.compute.push(Op::Wait { event: reduced });
    for s in &stages {
        b.compute.push(Op::OptimizerStep { stage: s.stage });
        b.compute.push(Op::Free {
            buf: Buf::WeightGrad { stage: s.stage },
        });
    }
    let mut streams = vec![
        Stream {
            kind: StreamKind::Compute,
            ops: b.compute,
        },
        Stream {
            kind: StreamKind::Comm { channel: 0 },
            ops: b.comm,
        },
    ];
    for (channel, ops) in b.channels {
        streams.push(Stream {
            kind: StreamKind::Comm { channel },
            ops,
        });
    }
    Ok(RankProgram {
        rank: g,
        coords,
        data_shard: mesh.data_shard(&coords),
        stages,
        streams,
        events: b.events,
    })
}

#[allow(clippy::too_many_arguments)]
fn emit_compute(
    b: &mut Builder,
    pl: &schedc_ir::Pipeline,
    st: &LocalStage,
    kind: Kind,
    mb: u32,
    layers: u32,
    ep_group: &[u32],
    sp_group: &[u32],
    recv_ev: &HashMap<Buf, u32>,
    send_ev: &HashMap<Buf, u32>,
) {
    let s = st.stage;
    let stash = Buf::Stash { stage: s, mb };
    let wg = Buf::WeightGrad { stage: s };
    let kernel = |pass, part, reads: Vec<Buf>, writes: Vec<Buf>| {
        Op::Kernel(Kernel {
            pass,
            stage: s,
            mb,
            part,
            reads,
            writes,
        })
    };
    let a2a = |layer, phase| Op::AllToAll {
        stage: s,
        mb,
        layer,
        phase,
        group: if matches!(phase, A2a::GatherKv | A2a::ScatterKvGrad) {
            sp_group.to_vec()
        } else {
            ep_group.to_vec()
        },
    };
    match kind {
        Kind::F => {
            let input = pl.prev_stage(s).map(|p| Buf::Act { stage: p, mb });
            let output = pl.next_stage(s).map(|_| Buf::Act { stage: s, mb });
            if let Some(e) = input.and_then(|i| recv_ev.get(&i)) {
                b.compute.push(Op::Wait { event: *e });
            }
            b.compute.push(Op::Alloc {
                buf: stash,
                zero: false,
            });
            if let Some(o) = output {
                b.compute.push(Op::Alloc {
                    buf: o,
                    zero: false,
                });
            }
            if st.first {
                b.compute
                    .push(kernel(Pass::F, Part::Embed, vec![], vec![stash]));
            }
            for l in 0..layers {
                let mut reads = if l == 0 && !st.first {
                    vec![input.expect("a non-first stage has a previous stage")]
                } else {
                    vec![stash]
                };
                reads.sort();
                b.compute
                    .push(kernel(Pass::F, Part::Qkv { layer: l }, reads, vec![stash]));
                if l == 0 && !st.first {
                    b.compute.push(Op::Free {
                        buf: input.expect("checked"),
                    });
                }
                b.compute.push(a2a(l, A2a::GatherKv));
                b.compute.push(kernel(
                    Pass::F,
                    Part::Attn { layer: l },
                    vec![stash],
                    vec![stash, wg],
                ));
                b.compute.push(a2a(l, A2a::Dispatch));
                b.compute.push(kernel(
                    Pass::F,
                    Part::Experts { layer: l },
                    vec![stash],
                    vec![stash],
                ));
                b.compute.push(a2a(l, A2a::Combine));
                let mut writes = vec![stash];
                if l + 1 == layers {
                    writes.extend(output);
                }
                b.compute.push(kernel(
                    Pass::F,
                    Part::Combine { layer: l },
                    vec![stash],
                    writes,
                ));
            }
            if st.last {
                b.compute
                    .push(kernel(Pass::F, Part::Head, vec![stash], vec![stash]));
            }
            if let Some(e) = output.and_then(|o| send_ev.get(&o)) {
                b.compute.push(Op::Record { event: *e });
            }
        }
        Kind::B | Kind::BW => {
            let gin = pl.next_stage(s).map(|n| Buf::Grad { stage: n, mb });
            let gout = pl.prev_stage(s).map(|_| Buf::Grad { stage: s, mb });
            if let Some(e) = gin.and_then(|i| recv_ev.get(&i)) {
                b.compute.push(Op::Wait { event: *e });
            }
            if let Some(o) = gout {
                b.compute.push(Op::Alloc {
                    buf: o,
                    zero: false,
                });
            }
            if st.last {
                b.compute
                    .push(kernel(Pass::B, Part::Head, vec![stash], vec![stash]));
            }
            for l in (0..layers).rev() {
                let mut reads = vec![stash];
                if l + 1 == layers && !st.last {
                    reads.push(gin.expect("a non-last stage has a next stage"));
                }
                b.compute.push(kernel(
                    Pass::B,
                    Part::Combine { layer: l },
                    reads,
                    vec![stash],
                ));
                if l + 1 == layers && !st.last {
                    b.compute.push(Op::Free {
                        buf: gin.expect("checked"),
                    });
                }
                b.compute.push(a2a(l, A2a::CombineGrad));
                b.compute.push(kernel(
                    Pass::B,
                    Part::Experts { layer: l },
                    vec![stash],
                    vec![stash],
                ));
                b.compute.push(a2a(l, A2a::DispatchGrad));
                b.compute.push(kernel(
                    Pass::B,
                    Part::Attn { layer: l },
                    vec![stash],
                    vec![stash],
                ));
                b.compute.push(a2a(l, A2a::ScatterKvGrad));
                let mut writes = vec![stash];
                if l == 0 {
                    writes.extend(gout);
                }
                b.compute
                    .push(kernel(Pass::B, Part::Qkv { layer: l }, vec![stash], writes));
            }
            if let Some(e) = gout.and_then(|o| send_ev.get(&o)) {
                b.compute.push(Op::Record { event: *e });
            }
            if kind == Kind::BW {
                emit_weights(b, s, mb);
            }
        }
        Kind::W => emit_weights(b, s, mb),
    }
}

fn emit_weights(b: &mut Builder, s: u32, mb: u32) {
    let stash = Buf::Stash { stage: s, mb };
    let wg = Buf::WeightGrad { stage: s };
    b.compute.push(Op::Kernel(Kernel {
        pass: Pass::W,
        stage: s,
        mb,
        part: Part::Weights,
        reads: vec![stash, wg],
        writes: vec![wg],
    }));
    b.compute.push(Op::Free { buf: stash });
}

// ---------------------------------------------------------------------------------------
// Verification.

/// What [`verify`] found (on success).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// Instructions over all ranks.
    pub ops: usize,
    /// Messages (sends).
    pub messages: usize,
    /// Collective instances.
    pub collectives: usize,
    /// Per rank, the most `stash` buffers live at once (the activation peak).
    pub peak_stash: Vec<u32>,
}

/// Verifies a program set against its source IR program (see the module docs).
pub fn verify(set: &ProgramSet, source: &Program) -> Result<VerifyReport, ProgramError> {
    let out = schedc::check::check(source, None, &Default::default());
    if let Some(why) = rejected(&out) {
        return Err(ProgramError::Rejected(why));
    }
    if set.ranks.len() != set.manifest.world as usize {
        return Err(ProgramError::Deadlock(format!(
            "{} rank programs for a world of {}",
            set.ranks.len(),
            set.manifest.world
        )));
    }
    let mut peak_stash = Vec::new();
    for rp in &set.ranks {
        peak_stash.push(verify_rank(rp)?);
    }
    let (messages, collectives) = simulate(set)?;
    Ok(VerifyReport {
        ops: set.len(),
        messages,
        collectives,
        peak_stash,
    })
}

fn invalid(rp: &RankProgram, s: usize, i: usize, why: String) -> ProgramError {
    ProgramError::Invalid {
        rank: rp.rank,
        stream: rp.streams[s].kind,
        index: i,
        op: rp.streams[s].ops[i].to_string(),
        why,
    }
}

/// Events, buffers and races of one rank; returns its stash peak.
fn verify_rank(rp: &RankProgram) -> Result<u32, ProgramError> {
    let ns = rp.streams.len();
    let kinds: Vec<StreamKind> = rp.streams.iter().map(|s| s.kind).collect();
    let mut last_channel = 0;
    let channels_ok = kinds.len() >= 2
        && kinds[0] == StreamKind::Compute
        && kinds[1] == (StreamKind::Comm { channel: 0 })
        && kinds[2..].iter().all(|k| match k {
            StreamKind::Comm { channel } if *channel > last_channel => {
                last_channel = *channel;
                true
            }
            _ => false,
        });
    if !channels_ok {
        return Err(ProgramError::Buffer {
            rank: rp.rank,
            why: format!(
                "a rank program has a compute stream, a comm stream for channel 0, then one per other channel in increasing order; got {kinds:?}"
            ),
        });
    }
    // Events: exactly one record each; every wait has it.
    let mut rec: HashMap<u32, (usize, usize)> = HashMap::new();
    for (s, st) in rp.streams.iter().enumerate() {
        for (i, op) in st.ops.iter().enumerate() {
            if let Op::Record { event } = op {
                if *event >= rp.events {
                    return Err(invalid(rp, s, i, format!("event {event} >= {}", rp.events)));
                }
                if rec.insert(*event, (s, i)).is_some() {
                    return Err(invalid(rp, s, i, "the event is recorded twice".into()));
                }
            }
        }
    }
    for (s, st) in rp.streams.iter().enumerate() {
        for (i, op) in st.ops.iter().enumerate() {
            if let Op::Wait { event } = op {
                if !rec.contains_key(event) {
                    return Err(invalid(rp, s, i, "no stream records this event".into()));
                }
            }
        }
    }
    // Happens-before by vector clocks: run the streams (messages assumed to complete);
    // vc[s][i][t] = ops of stream t that happen before or at op i of stream s.
    let mut vc: Vec<Vec<Vec<u32>>> = rp
        .streams
        .iter()
        .map(|st| vec![vec![]; st.ops.len()])
        .collect();
    let mut ptr = vec![0usize; ns];
    let mut clock = vec![vec![0u32; ns]; ns];
    let mut ev_clock: HashMap<u32, Vec<u32>> = HashMap::new();
    loop {
        let mut moved = false;
        for s in 0..ns {
            while ptr[s] < rp.streams[s].ops.len() {
                let i = ptr[s];
                let op = &rp.streams[s].ops[i];
                if let Op::Wait { event } = op {
                    let Some(c) = ev_clock.get(event) else { break };
                    for t in 0..ns {
                        clock[s][t] = clock[s][t].max(c[t]);
                    }
                }
                clock[s][s] = i as u32 + 1;
                vc[s][i] = clock[s].clone();
                if let Op::Record { event } = op {
                    ev_clock.insert(*event, clock[s].clone());
                }
                ptr[s] += 1;
                moved = true;
            }
        }
        if (0..ns).all(|s| ptr[s] == rp.streams[s].ops.len()) {
            break;
        }
        if !moved {
            let s = (0..ns)
                .find(|&s| ptr[s] < rp.streams[s].ops.len())
                .unwrap_or(0);
            return Err(invalid(
                rp,
                s,
                ptr[s],
                "the rank's streams wait for each other's events in a cycle".into(),
            ));
        }
    }
    let hb = |a: (usize, usize), b: (usize, usize)| vc[b.0][b.1][a.0] > a.1 as u32;
    // Buffer accesses.
    #[derive(Clone, Copy, PartialEq)]
    enum Acc {
        Alloc(bool),
        Free,
        Read,
        Write,
    }
    type Uses = Vec<(Acc, (usize, usize))>;
    let mut acc: HashMap<Buf, Uses> = HashMap::new();
    for (s, st) in rp.streams.iter().enumerate() {
        for (i, op) in st.ops.iter().enumerate() {
            match op {
                Op::Alloc { buf, zero } => acc
                    .entry(*buf)
                    .or_default()
                    .push((Acc::Alloc(*zero), (s, i))),
                Op::Free { buf } => acc.entry(*buf).or_default().push((Acc::Free, (s, i))),
                _ => {
                    let (r, w) = op.access();
                    for b in r {
                        acc.entry(b).or_default().push((Acc::Read, (s, i)));
                    }
                    for b in w {
                        acc.entry(b).or_default().push((Acc::Write, (s, i)));
                    }
                }
            }
        }
    }
    let mut bufs: Vec<&Buf> = acc.keys().collect();
    bufs.sort();
    let err = |why: String| ProgramError::Buffer { rank: rp.rank, why };
    let loc = |p: (usize, usize)| {
        format!(
            "{} op #{} `{}`",
            rp.streams[p.0].kind, p.1, rp.streams[p.0].ops[p.1]
        )
    };
    for buf in bufs {
        let list = &acc[buf];
        let allocs: Vec<_> = list
            .iter()
            .filter(|(a, _)| matches!(a, Acc::Alloc(_)))
            .collect();
        let frees: Vec<_> = list.iter().filter(|(a, _)| *a == Acc::Free).collect();
        if allocs.len() != 1 {
            return Err(err(format!("{buf} is allocated {} times", allocs.len())));
        }
        if frees.len() != 1 {
            return Err(err(format!("{buf} is freed {} times", frees.len())));
        }
        let (Acc::Alloc(zero), ap) = *allocs[0] else {
            unreachable!()
        };
        let fp = frees[0].1;
        let uses: Vec<(Acc, (usize, usize))> = list
            .iter()
            .filter(|(a, _)| matches!(a, Acc::Read | Acc::Write))
            .copied()
            .collect();
        if !hb(ap, fp) {
            return Err(err(format!(
                "{buf} is freed at {} before its allocation",
                loc(fp)
            )));
        }
        for &(a, p) in &uses {
            if !hb(ap, p) {
                return Err(err(format!(
                    "{buf} is used at {} before its allocation",
                    loc(p)
                )));
            }
            if !hb(p, fp) {
                return Err(err(format!(
                    "{buf} is used at {} after (or unordered with) its release at {}",
                    loc(p),
                    loc(fp)
                )));
            }
            if a == Acc::Read && !zero {
                let written = uses
                    .iter()
                    .any(|&(b, q)| b == Acc::Write && q != p && hb(q, p));
                if !written {
                    return Err(err(format!("{buf} is read at {} before any write", loc(p))));
                }
            }
        }
        for (x, &(a, p)) in uses.iter().enumerate() {
            for &(b, q) in &uses[x + 1..] {
                if p != q && (a == Acc::Write || b == Acc::Write) && !hb(p, q) && !hb(q, p) {
                    return Err(err(format!(
                        "{buf}: {} and {} are not ordered, and one writes (a race between streams)",
                        loc(p),
                        loc(q)
                    )));
                }
            }
        }
    }
    // Stash peak in compute-stream order.
    let (mut live, mut peak) = (0u32, 0u32);
    for op in &rp.streams[0].ops {
        match op {
            Op::Alloc {
                buf: Buf::Stash { .. },
                ..
            } => {
                live += 1;
                peak = peak.max(live);
            }
            Op::Free {
                buf: Buf::Stash { .. },
            } => live -= 1,
            _ => {}
        }
    }
    Ok(peak)
}

/// Key of a collective instance.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum CollKey {
    A2a(u32, u32, u32, A2a, Vec<u32>),
    Replica(u32, Vec<u32>),
    AllReduce(u32, Scope, Vec<u32>),
}

fn coll_key(rank: u32, op: &Op) -> Option<(CollKey, Vec<u32>)> {
    match op {
        Op::AllToAll {
            stage,
            mb,
            layer,
            phase,
            group,
        } => Some((
            CollKey::A2a(*stage, *mb, *layer, *phase, group.clone()),
            group.clone(),
        )),
        Op::ReplicaSum {
            model_stage, peer, ..
        } => {
            let mut g = vec![rank, *peer];
            g.sort_unstable();
            Some((CollKey::Replica(*model_stage, g.clone()), g))
        }
        Op::AllReduce {
            stage,
            scope,
            group,
        } => Some((
            CollKey::AllReduce(*stage, *scope, group.clone()),
            group.clone(),
        )),
        _ => None,
    }
}

/// Runs every rank's streams together (sends eager; receives wait for their send;
/// collectives for every member); returns (messages, collectives).
// Index loops over parallel arrays (streams, pointers) read better than zipped iterators.
#[allow(clippy::needless_range_loop)]
fn simulate(set: &ProgramSet) -> Result<(usize, usize), ProgramError> {
    let n = set.ranks.len();
    let mut ptr: Vec<Vec<usize>> = set.ranks.iter().map(|r| vec![0; r.streams.len()]).collect();
    let mut recorded: Vec<HashSet<u32>> = vec![HashSet::new(); n];
    let mut sent: HashMap<(u32, u32, Buf), u32> = HashMap::new();
    let mut received: HashMap<(u32, u32, Buf), u32> = HashMap::new();
    let mut arrived: HashMap<CollKey, HashSet<u32>> = HashMap::new();
    let mut messages = 0usize;
    for (g, rp) in set.ranks.iter().enumerate() {
        if rp.rank != g as u32 {
            return Err(ProgramError::Deadlock(format!(
                "rank program {g} says it is rank {}",
                rp.rank
            )));
        }
    }
    loop {
        let mut moved = false;
        for g in 0..n {
            let rp = &set.ranks[g];
            for s in 0..rp.streams.len() {
                while ptr[g][s] < rp.streams[s].ops.len() {
                    let op = &rp.streams[s].ops[ptr[g][s]];
                    let ready = match op {
                        Op::Wait { event } => recorded[g].contains(event),
                        Op::Recv { buf, peer } => {
                            let k = (*peer, g as u32, *buf);
                            sent.get(&k).copied().unwrap_or(0)
                                > received.get(&k).copied().unwrap_or(0)
                        }
                        _ => match coll_key(g as u32, op) {
                            Some((key, group)) => {
                                if !group.contains(&(g as u32)) {
                                    return Err(invalid(
                                        rp,
                                        s,
                                        ptr[g][s],
                                        "the rank is not in the collective's group".into(),
                                    ));
                                }
                                let a = arrived.entry(key).or_default();
                                a.insert(g as u32);
                                group.iter().all(|m| a.contains(m))
                            }
                            None => true,
                        },
                    };
                    if !ready {
                        break;
                    }
                    match op {
                        Op::Record { event } => {
                            recorded[g].insert(*event);
                        }
                        Op::Send { buf, peer } => {
                            if *peer as usize >= n {
                                return Err(invalid(rp, s, ptr[g][s], "no such rank".into()));
                            }
                            *sent.entry((g as u32, *peer, *buf)).or_default() += 1;
                            messages += 1;
                        }
                        Op::Recv { buf, peer } => {
                            *received.entry((*peer, g as u32, *buf)).or_default() += 1;
                        }
                        _ => {}
                    }
                    ptr[g][s] += 1;
                    moved = true;
                }
            }
        }
        let done = (0..n).all(|g| {
            (0..set.ranks[g].streams.len()).all(|s| ptr[g][s] == set.ranks[g].streams[s].ops.len())
        });
        if done {
            break;
        }
        if !moved {
            let stuck: Vec<String> = (0..n)
                .flat_map(|g| {
                    let rp = &set.ranks[g];
                    let ptr = &ptr;
                    (0..rp.streams.len()).filter_map(move |s| {
                        rp.streams[s].ops.get(ptr[g][s]).map(|op| {
                            format!(
                                "rank {g} {} stream at op #{} `{op}`",
                                rp.streams[s].kind, ptr[g][s]
                            )
                        })
                    })
                })
                .take(8)
                .collect();
            return Err(ProgramError::Deadlock(format!(
                "stuck: {}",
                stuck.join("; ")
            )));
        }
    }
    for (k, c) in &sent {
        if received.get(k) != Some(c) {
            return Err(ProgramError::Deadlock(format!(
                "rank {} sends {} to rank {} that is never received",
                k.0, k.2, k.1
            )));
        }
    }
    Ok((messages, arrived.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedc::input::{load_spec, Overrides};

    pub(crate) fn spec(name: &str, pp: u32, mb: u32, vpp: Option<u32>) -> Program {
        let path = format!("{}/../../specs/{name}.sched", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let ov = Overrides {
            pp: Some(pp),
            microbatches: Some(mb),
            vpp,
            ..Default::default()
        };
        match load_spec(&text, &ov) {
            Ok(e) => e.program,
            Err(_) => panic!("spec {name} refuses P={pp} M={mb}"),
        }
    }

    #[test]
    fn lowers_and_verifies_every_spec() {
        let cfg = ModelConfig::tiny();
        for (name, pp, mb, vpp) in [
            ("gpipe", 4, 4, None),
            ("1f1b", 4, 6, None),
            ("interleaved_1f1b", 2, 4, Some(2)),
            ("zbv", 2, 4, None),
            ("dualpipev", 2, 4, None),
            ("dualpipe", 4, 8, None),
            ("zb_h1", 2, 3, None),
            ("zb_h2", 2, 3, None),
            ("looped_bfs", 2, 2, Some(2)),
            ("interleaved_zb", 2, 4, Some(2)),
        ] {
            let src = spec(name, pp, mb, vpp);
            for mesh in [
                format!("pp={pp}"),
                format!("pp={pp},dp=2,ep=2"),
                format!("sp=2,pp={pp},ep=2"),
            ] {
                let mesh: Mesh = mesh.parse().unwrap();
                let set = ProgramSet::lower(&src, &mesh, &cfg, LowerOptions::default()).unwrap();
                let rep = verify(&set, &src).unwrap_or_else(|e| panic!("{name}: {e}"));
                // The stash peak of every rank is schedc's activation peak.
                let (live, _) = schedc::passes::liveness::analyze(&src, None);
                for (g, rp) in set.ranks.iter().enumerate() {
                    assert_eq!(
                        rep.peak_stash[g] as u64, live[rp.coords.pp as usize].peak,
                        "{name} rank {g}"
                    );
                }
                assert!(rep.messages > 0 && rep.collectives > 0);
            }
        }
    }

    #[test]
    fn program_shape_1f1b() {
        let src = spec("1f1b", 2, 2, None);
        let set = ProgramSet::lower(
            &src,
            &Mesh::pipeline(2),
            &ModelConfig::tiny(),
            LowerOptions::default(),
        )
        .unwrap();
        let r0 = &set.ranks[0];
        let comm: Vec<String> = r0.streams[1].ops.iter().map(|o| o.to_string()).collect();
        // Rank 0 sends act(0,0), act(0,1) and receives grad(1,0), grad(1,1): 1F1B's order.
        let sends: Vec<&String> = comm
            .iter()
            .filter(|s| s.starts_with("send") || s.starts_with("recv"))
            .collect();
        assert_eq!(
            sends,
            vec![
                "send act(0,0) to rank 1",
                "send act(0,1) to rank 1",
                "recv grad(1,0) from rank 1",
                "recv grad(1,1) from rank 1"
            ]
        );
        // Compute: F(0,0) embeds, attends, dispatches ... and records the send event.
        let compute: Vec<String> = r0.streams[0].ops.iter().map(|o| o.to_string()).collect();
        assert_eq!(compute[0], "alloc weight_grad(0) (zeroed)");
        assert_eq!(compute[1], "alloc stash(0,0)");
        assert_eq!(compute[2], "alloc act(0,0)");
        assert_eq!(compute[3], "F(0,0).embed");
        assert_eq!(compute[4], "F(0,0).qkv[0]");
        assert!(compute[5].starts_with("all_to_all GatherKv(0,0)[0] over [0]"));
        assert_eq!(compute[6], "F(0,0).attn[0]");
        assert!(compute[7].starts_with("all_to_all Dispatch(0,0)[0]"));
        assert!(compute.iter().any(|c| c == "W(0,1).weights"));
        assert_eq!(compute.last().unwrap(), "free weight_grad(0)");
        // JSON round trip.
        let json = serde_json::to_string(&set).unwrap();
        let back: ProgramSet = serde_json::from_str(&json).unwrap();
        assert_eq!(back, set);
        assert!(json.contains("\"op\":\"kernel\""), "{}", &json[..400]);
    }

    #[test]
    fn write_and_read_dir() {
        let src = spec("gpipe", 2, 2, None);
        let mesh: Mesh = "pp=2,ep=2".parse().unwrap();
        let set =
            ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default()).unwrap();
        let dir = std::env::temp_dir().join(format!("schedc-cpu-prog-{}", std::process::id()));
        let files = set.write_dir(&dir).unwrap();
        assert_eq!(files.len(), 5);
        let back = ProgramSet::read_dir(&dir).unwrap();
        assert_eq!(back, set);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dualpipe_replica_sum_pairs_mirror_ranks() {
        let src = spec("dualpipe", 4, 8, None);
        let set = ProgramSet::lower(
            &src,
            &Mesh::pipeline(4),
            &ModelConfig::tiny(),
            LowerOptions::default(),
        )
        .unwrap();
        for rp in &set.ranks {
            let sums: Vec<(u32, u32)> = rp.streams[1]
                .ops
                .iter()
                .filter_map(|o| match o {
                    Op::ReplicaSum {
                        model_stage, peer, ..
                    } => Some((*model_stage, *peer)),
                    _ => None,
                })
                .collect();
            let r = rp.rank;
            let mut want = vec![(r, 3 - r), (3 - r, 3 - r)];
            want.sort();
            assert_eq!(sums, want, "rank {r}");
        }
        let bug = ProgramSet::lower(
            &src,
            &Mesh::pipeline(4),
            &ModelConfig::tiny(),
            LowerOptions {
                bug_skip_replica_sum: true,
            },
        )
        .unwrap();
        assert!(!bug
            .ranks
            .iter()
            .flat_map(|r| &r.streams[1].ops)
            .any(|o| matches!(o, Op::ReplicaSum { .. })));
    }

    fn first_index(rp: &RankProgram, s: usize, f: impl Fn(&Op) -> bool) -> usize {
        rp.streams[s].ops.iter().position(f).unwrap()
    }

    #[test]
    fn verifier_catches_broken_programs() {
        let src = spec("1f1b", 2, 2, None);
        let set = ProgramSet::lower(
            &src,
            &Mesh::pipeline(2),
            &ModelConfig::tiny(),
            LowerOptions::default(),
        )
        .unwrap();
        verify(&set, &src).unwrap();

        // A wait without its record.
        let mut bad = set.clone();
        let i = first_index(&bad.ranks[0], 0, |o| matches!(o, Op::Record { .. }));
        bad.ranks[0].streams[0].ops.remove(i);
        let e = verify(&bad, &src).unwrap_err().to_string();
        assert!(e.contains("no stream records this event"), "{e}");

        // A send that no longer waits for its producer: a race on act(0,0).
        let mut bad = set.clone();
        let i = first_index(&bad.ranks[0], 1, |o| matches!(o, Op::Wait { .. }));
        bad.ranks[0].streams[1].ops.remove(i);
        let e = verify(&bad, &src).unwrap_err().to_string();
        assert!(
            e.contains("rank 0: act(0,0) is freed at comm op #1")
                && e.contains("before its allocation"),
            "{e}"
        );

        // A stash freed twice.
        let mut bad = set.clone();
        let i = first_index(&bad.ranks[1], 0, |o| {
            matches!(
                o,
                Op::Free {
                    buf: Buf::Stash { .. }
                }
            )
        });
        let op = bad.ranks[1].streams[0].ops[i].clone();
        bad.ranks[1].streams[0].ops.push(op);
        let e = verify(&bad, &src).unwrap_err().to_string();
        assert!(e.contains("freed 2 times"), "{e}");

        // A buffer read after its release.
        let mut bad = set.clone();
        let ops = &mut bad.ranks[1].streams[0].ops;
        let f = ops
            .iter()
            .position(|o| {
                matches!(
                    o,
                    Op::Free {
                        buf: Buf::Stash { stage: 1, mb: 0 }
                    }
                )
            })
            .unwrap();
        let k = ops[..f]
            .iter()
            .rposition(|o| matches!(o, Op::Kernel(_)))
            .unwrap();
        ops.swap(f, k);
        let e = verify(&bad, &src).unwrap_err().to_string();
        assert!(e.contains("after (or unordered with) its release"), "{e}");

        // A receive whose message never comes: the programs deadlock.
        let mut bad = set.clone();
        let i = first_index(&bad.ranks[0], 1, |o| matches!(o, Op::Send { .. }));
        bad.ranks[0].streams[1].ops[i] = Op::Record { event: 999 };
        bad.ranks[0].events = 1000;
        let e = verify(&bad, &src).unwrap_err().to_string();
        assert!(
            e.contains("deadlock") && e.contains("recv act(0,0) from rank 0"),
            "{e}"
        );

        // The source must verify too.
        let mut wrong = src.clone();
        wrong.ranks[0].swap(0, 2);
        let e = verify(&set, &wrong).unwrap_err().to_string();
        assert!(e.contains("does not verify"), "{e}");
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        let src = spec("1f1b", 2, 2, None);
        let mesh: Mesh = "pp=2,ep=3".parse().unwrap();
        let e = ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default())
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("ep=3 does not divide the model's 4 experts"),
            "{e}"
        );
        let mesh: Mesh = "pp=4".parse().unwrap();
        let e = ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default())
            .unwrap_err();
        assert!(
            e.to_string().contains("pp=4, but the schedule has 2"),
            "{e}"
        );
    }
}
