//! The cost-model simulator: an event-driven run of a lowered program.
//!
//! Each rank has a compute stream (compute ops in program order), a communication stream
//! (its sends, receives and collectives, group by group, in program order) and, when
//! `[moe] overlap = true`, an expert-parallel stream for the dispatch and combine parts of
//! MoE ops. A compute op starts when its stream is free and the receives that feed it have
//! completed; a group is posted when its stream is free and the ops producing its payloads
//! have finished; groups matched with each other (FIFO per rank pair, transitively) complete
//! together, `latency + bytes / bandwidth` after the last of them is posted — the
//! rendezvous semantics of `schedc check` (pass 4), so a program that passes the check runs
//! to the end here.
//!
//! Outputs per rank: busy (compute-stream time), idle = makespan - busy (the bubble of that
//! rank), exposed communication (compute-stream waiting beyond what the producers' compute
//! alone would cause), exposed all-to-all (the MoE dispatch and combine time during which the
//! rank computes nothing), peak memory.
//!
//! A lent stash (BPipe's `LEND`/`RETURN` messages) is a point-to-point message priced at
//! `p2p.latency + activation_bytes / p2p.bandwidth` ([`cost::CostModel::stash_message_time`]);
//! it is posted once the rank's compute stream has run the op before it in program order
//! (the schedule decides when a stash moves), and its bytes leave the sender's device and
//! count on the receiver's when the message completes. The owner's backward waits for the
//! `RETURN`.
//!
//! ## MoE parts
//!
//! A dispatch or combine part runs on the rank's EP stream (`[moe] overlap = true`), after the
//! previous part of its op; the next part waits for it. An op — whole, or the first part of a
//! split one — starts only once every op whose last part comes before it in program order has
//! completed, all-to-alls included: two ops overlap only where the program interleaves their
//! parts, as the `--moe` lowering does for an overlapped pair (`crate::moe`). A plain split op
//! therefore exposes its all-to-alls, as a chunk of several MoE layers does (each layer's
//! all-to-all waits for that layer's compute and feeds the next), and a pair hides each
//! all-to-all under the other op's compute.
//!
//! ## Bubble conventions
//!
//! Every bubble figure names its convention ([`Bubble`]); all three are computed:
//!
//! * `from_start`: one step with a barrier at both ends, every rank charged from time 0 to
//!   the makespan: `1 - Σ busy / (P * makespan)`. GPipe's `(P-1)/(M+P-1)` is this.
//! * `per_rank_span`: each rank from its first op to its last, the convention of the DualPipe
//!   README's table and of the Zero Bubble generators (`max_stage_span`):
//!   `1 - Σ busy / (P * max span)`, the `bubble_rate_span` of `shared/reference/zb`.
//! * `steady_state`: consecutive steps with no barrier between them (Zero Bubble's optimizer
//!   post-validation, arXiv 2401.10241 §4: the next step's warmup overlaps this step's
//!   cooldown). The simulator runs the step again with every stream starting where the
//!   previous step left it, until one step shifts every stream's end by the same time `T`
//!   (then, the schedule being shift-invariant, every later step does too) or 8 steps have
//!   run; `T` is the per-step increment of the makespan and the bubble is
//!   `1 - Σ busy / (P * T)`.
//!
//! Also kept for compatibility: `bubble_ratio` (= `from_start`) and `bubble_ratio_busy`
//! (Σ idle / Σ busy, Megatron's `(P-1)/M`).

// Index loops over parallel arrays (ops, groups) read better than zipped iterators here.
#![allow(clippy::needless_range_loop)]

pub mod cost;
pub mod render;

use crate::passes::{is_first_part, is_last_part};
use cost::CostModel;
use schedc_ir::text::instr_to_string;
use schedc_ir::{Comm, Compute, Instr, Kind, MemKind, MemOp, Part, Program};
use serde::Serialize;
use std::collections::HashMap;

/// Which stream an event ran on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamKind {
    /// Compute.
    Compute,
    /// Point-to-point communication and collectives.
    Comm,
    /// Expert-parallel all-to-alls (MoE dispatch and combine).
    Ep,
    /// The device-to-host copy stream: `OFFLOAD` of saved activations. PCIe is full
    /// duplex, so offloads and reloads have a stream each and run at the same time.
    Host,
    /// The host-to-device copy stream: `RELOAD` of offloaded activations.
    #[serde(rename = "host_to_device")]
    HostToDevice,
}

/// What an event is, for colours and legends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum EventKind {
    /// Forward.
    F,
    /// Input-gradient backward.
    B,
    /// Weight-gradient backward.
    W,
    /// Fused backward.
    BW,
    /// Overlapped F&B pair.
    Overlap,
    /// MoE dispatch or combine.
    A2a,
    /// Sends and receives.
    Comm,
    /// A host copy (`OFFLOAD`, `RELOAD`) or a recompute (`RECOMPUTE`).
    Mem,
    /// Anything else (REDUCE_GRAD, waits).
    Other,
}

/// One interval on one stream.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Rank.
    pub rank: u32,
    /// Stream.
    pub stream: StreamKind,
    /// Kind.
    pub kind: EventKind,
    /// Index of the instruction in the rank's program (render its text with
    /// [`Event::name`]).
    pub pos: u32,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
    /// Micro-batch of a compute op (for labels); for an overlapped pair, the forward's.
    pub mb: Option<u32>,
    /// For an overlapped pair, the backward's micro-batch.
    pub mb2: Option<u32>,
    /// Direction of a bidirectional (DualPipe) compute op: 0 or 1.
    pub direction: u8,
}

impl Event {
    /// The label: the IR text of the instruction, from the simulated program.
    pub fn name(&self, p: &Program) -> String {
        p.ranks
            .get(self.rank as usize)
            .and_then(|r| r.get(self.pos as usize))
            .map(instr_to_string)
            .unwrap_or_default()
    }
}

/// Per-rank results.
#[derive(Clone, Debug, Serialize)]
pub struct RankSim {
    /// Rank.
    pub rank: u32,
    /// Compute-stream busy time, seconds (compute only: an all-to-all that runs on the compute
    /// stream, `[moe] overlap = false`, is exposed communication, not busy time).
    pub busy: f64,
    /// makespan - busy, seconds (the `from_start` idle of the rank).
    pub idle: f64,
    /// From the start of the rank's first op to the end of its last (compute and EP streams),
    /// seconds; `span - busy` is the rank's `per_rank_span` idle.
    pub span: f64,
    /// Time the compute stream waited on communication beyond its producers, seconds
    /// (point-to-point and all-to-all).
    pub exposed_comm: f64,
    /// Seconds of MoE all-to-all (dispatch and combine parts) the rank issues.
    pub a2a: f64,
    /// All-to-all time during which the rank's compute stream computes nothing, seconds:
    /// the part of `a2a` not hidden under compute.
    pub exposed_a2a: f64,
    /// Peak memory: parameters, gradients and optimizer state of the stages held, plus the
    /// peak of live activations, bytes.
    pub peak_memory_bytes: f64,
    /// Peak of live activation bytes.
    pub peak_activation_bytes: f64,
    /// Peak of the activation bytes offloaded to the rank's host memory: an `OFFLOAD`'s bytes
    /// count from its end, until the end of the `RELOAD` (or the start of the `RECOMPUTE`)
    /// that brings them back.
    pub peak_host_bytes: f64,
    /// The first instant the rank's live activation bytes reach their peak, seconds (0 when
    /// nothing is live): where a memory pass looks for activations to move
    /// (`schedc_optimize::memops`). Not in the JSON.
    #[serde(skip)]
    pub peak_memory_at: f64,
}

/// An `OFFLOAD` that takes the rank's host memory over `[memory] host_bytes`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostOverflow {
    /// Rank.
    pub rank: u32,
    /// Position of the `OFFLOAD` in the rank's simulated program.
    pub pos: u32,
    /// Its stage.
    pub stage: u32,
    /// Its micro-batch.
    pub mb: u32,
    /// Bytes it offloads.
    pub needs: f64,
    /// Bytes already on the rank's host when it ends.
    pub held: f64,
    /// The budget, `[memory] host_bytes`.
    pub budget: f64,
}

/// The bubble fraction under each convention (module docs), each in `[0, 1]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Bubble {
    /// One step, barrier at both ends: `1 - Σ busy / (P * makespan)`.
    pub from_start: f64,
    /// Each rank from its first op to its last: `1 - Σ busy / (P * max span)`.
    pub per_rank_span: f64,
    /// Consecutive steps without a barrier: `1 - Σ busy / (P * T)`, `T` the per-step time.
    pub steady_state: f64,
}

/// A bubble convention, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Convention {
    /// [`Bubble::from_start`].
    FromStart,
    /// [`Bubble::per_rank_span`].
    PerRankSpan,
    /// [`Bubble::steady_state`].
    SteadyState,
}

impl Convention {
    /// Every convention, in report order.
    pub const ALL: [Convention; 3] = [
        Convention::FromStart,
        Convention::PerRankSpan,
        Convention::SteadyState,
    ];
    /// The name used in reports, JSON and `expect bubble(NAME)`.
    pub fn as_str(self) -> &'static str {
        match self {
            Convention::FromStart => "from_start",
            Convention::PerRankSpan => "per_rank_span",
            Convention::SteadyState => "steady_state",
        }
    }
    /// Parses a name.
    pub fn from_name(s: &str) -> Option<Self> {
        Convention::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl Bubble {
    /// The fraction under `c`.
    pub fn get(&self, c: Convention) -> f64 {
        match c {
            Convention::FromStart => self.from_start,
            Convention::PerRankSpan => self.per_rank_span,
            Convention::SteadyState => self.steady_state,
        }
    }
}

/// MoE all-to-all time over all ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct A2aStats {
    /// Seconds of dispatch and combine parts, summed over ranks.
    pub total: f64,
    /// Seconds of it not hidden under the issuing rank's compute, summed over ranks.
    pub exposed: f64,
}

impl A2aStats {
    /// `exposed / total`, 0 without all-to-alls.
    pub fn exposed_fraction(&self) -> f64 {
        if self.total > 0.0 {
            self.exposed / self.total
        } else {
            0.0
        }
    }
}

/// The result of a simulation.
#[derive(Clone, Debug, Serialize)]
pub struct SimResult {
    /// Latest end over all streams, seconds.
    pub makespan: f64,
    /// Σ idle / (Σ busy + Σ idle) over all ranks (= `bubble.from_start`).
    pub bubble_ratio: f64,
    /// Σ idle / Σ busy over all ranks.
    pub bubble_ratio_busy: f64,
    /// The bubble under each convention.
    pub bubble: Bubble,
    /// MoE all-to-all totals.
    pub a2a: A2aStats,
    /// Seconds per step in the steady state (`T` of [`Bubble::steady_state`]).
    pub steady_step: f64,
    /// Per rank.
    pub ranks: Vec<RankSim>,
    /// The first `OFFLOAD` on each rank that takes it over `[memory] host_bytes` (empty
    /// without a budget): the program does not fit that host memory.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub host_overflows: Vec<HostOverflow>,
    /// Every interval.
    #[serde(skip)]
    pub events: Vec<Event>,
    /// Send-to-receive arrows: (event of the send's group, event of the receive's group).
    #[serde(skip)]
    pub flows: Vec<(usize, usize)>,
}

use crate::passes::streams::{Streams, NONE};

fn kind_of(c: &Compute) -> EventKind {
    if c.part.is_all_to_all() {
        return EventKind::A2a;
    }
    match c.kind {
        Kind::F => EventKind::F,
        Kind::B => EventKind::B,
        Kind::W => EventKind::W,
        Kind::BW => EventKind::BW,
    }
}

fn find(parent: &mut [u32], mut x: u32) -> u32 {
    while parent[x as usize] != x {
        parent[x as usize] = parent[parent[x as usize] as usize];
        x = parent[x as usize];
    }
    x
}

fn kind_ix(k: Kind) -> usize {
    match k {
        Kind::F => 0,
        Kind::B => 1,
        Kind::W => 2,
        Kind::BW => 3,
    }
}

/// A flattened program with its matching: what every run of the event loop shares.
struct Prepared<'p> {
    flat: Streams<'p>,
    partner: Vec<u32>,
    comp_root: Vec<u32>,
    comp_size: Vec<u32>,
    comp_never: Vec<bool>,
    comp_dur: Vec<f64>,
    comp_start: Vec<u32>,
    comp_members: Vec<u32>,
}

fn prepare<'p>(p: &'p Program, cost: &CostModel) -> Prepared<'p> {
    let msg_time = cost.message_time();
    let flat = crate::passes::streams::flatten(p);
    let (op_comm, op_rank, op_group, g_ops) =
        (&flat.comm, &flat.op_rank, &flat.op_group, &flat.g_ops);
    let ng = flat.g_rank.len();
    let mut partner = vec![NONE; op_comm.len()];
    let chans = flat.channels();
    let mut colls: HashMap<&str, HashMap<u32, Vec<u32>>> = HashMap::new();
    for (id, c) in op_comm.iter().enumerate() {
        if let Comm::Collective(col) = c {
            colls
                .entry(col.comm.as_str())
                .or_default()
                .entry(op_rank[id])
                .or_default()
                .push(id as u32);
        }
    }
    let mut parent: Vec<u32> = (0..ng as u32).collect();
    let mut never = vec![false; ng];
    for (sends, recvs) in chans.values() {
        for (k, &s) in sends.iter().enumerate() {
            match recvs.get(k) {
                Some(&rv) => {
                    partner[s as usize] = rv;
                    partner[rv as usize] = s;
                    let (a, b) = (
                        find(&mut parent, op_group[s as usize]),
                        find(&mut parent, op_group[rv as usize]),
                    );
                    if a != b {
                        parent[a as usize] = b;
                    }
                }
                None => never[op_group[s as usize] as usize] = true,
            }
        }
        for &rv in recvs.iter().skip(sends.len()) {
            never[op_group[rv as usize] as usize] = true;
        }
    }
    for per_rank in colls.values() {
        let longest = per_rank.values().map(Vec::len).max().unwrap_or(0);
        let seqs: Vec<&Vec<u32>> = per_rank.values().collect();
        for k in 0..longest {
            let set: Vec<u32> = seqs.iter().filter_map(|s| s.get(k).copied()).collect();
            if set.len() < seqs.len() {
                for &id in &set {
                    never[op_group[id as usize] as usize] = true;
                }
            }
            for w in set.windows(2) {
                let (a, b) = (
                    find(&mut parent, op_group[w[0] as usize]),
                    find(&mut parent, op_group[w[1] as usize]),
                );
                if a != b {
                    parent[a as usize] = b;
                }
            }
        }
    }
    let mut comp_root = vec![0u32; ng];
    let mut comp_size = vec![0u32; ng];
    let mut comp_never = vec![false; ng];
    let mut comp_dur = vec![0f64; ng];
    for g in 0..ng {
        let root = find(&mut parent, g as u32);
        comp_root[g] = root;
        comp_size[root as usize] += 1;
        comp_never[root as usize] |= never[g];
        let (a, b) = g_ops[g];
        for id in a..b {
            let d = match op_comm[id as usize] {
                Comm::Collective(_) => cost.moe.a2a,
                Comm::Send { payload, .. } | Comm::Recv { payload, .. }
                    if payload.kind.is_stash() =>
                {
                    cost.stash_message_time(payload.stage)
                }
                _ => msg_time,
            };
            comp_dur[root as usize] = comp_dur[root as usize].max(d);
        }
    }
    // Members of each component, as CSR arrays indexed by the root.
    let mut comp_start = vec![0u32; ng + 1];
    for g in 0..ng {
        comp_start[comp_root[g] as usize + 1] += 1;
    }
    for g in 0..ng {
        comp_start[g + 1] += comp_start[g];
    }
    let mut comp_members = vec![0u32; ng];
    let mut fill = comp_start.clone();
    for g in 0..ng {
        let r = comp_root[g] as usize;
        comp_members[fill[r] as usize] = g as u32;
        fill[r] += 1;
    }
    Prepared {
        flat,
        partner,
        comp_root,
        comp_size,
        comp_never,
        comp_dur,
        comp_start,
        comp_members,
    }
}

/// Where every stream is free: compute streams (one per rank), EP streams (one per rank),
/// communication streams (one per rank and channel, as flattened).
#[derive(Clone, Debug, PartialEq)]
struct Clocks {
    compute: Vec<f64>,
    ep: Vec<f64>,
    comm: Vec<f64>,
    /// Host-copy streams, two per rank: `2 r` device-to-host (offloads), `2 r + 1`
    /// host-to-device (reloads).
    host: Vec<f64>,
}

/// What one run of the event loop yields.
struct Run {
    makespan: f64,
    busy: Vec<f64>,
    exposed: Vec<f64>,
    exposed_a2a: Vec<f64>,
    a2a: Vec<f64>,
    first: Vec<f64>,
    last: Vec<f64>,
    end: Clocks,
    /// Which streams ran something (compute, EP, comm), for the periodicity test.
    used: Clocks,
    events: Vec<Event>,
    g_event: Vec<usize>,
    mem: Vec<Vec<(f64, f64)>>,
    /// Host-memory events per rank: (time, delta bytes, position of the op).
    host_mem: Vec<Vec<(f64, f64, u32)>>,
}

/// One step of the program from the stream clocks `init`. `record` keeps events and memory.
fn run(
    p: &Program,
    cost: &CostModel,
    prep: &Prepared<'_>,
    init: &Clocks,
    record: bool,
) -> Result<Run, String> {
    let pl = &p.pipeline;
    let np = p.ranks.len();
    let flat = &prep.flat;
    let (op_group, g_rank, g_pos, g_prod) =
        (&flat.op_group, &flat.g_rank, &flat.g_pos, &flat.g_producer);
    let (stream_groups, rank_streams) = (&flat.stream_groups, &flat.rank_streams);
    let (items, waits) = (&flat.items, &flat.waits);
    let partner = &prep.partner;
    let ng = g_rank.len();
    let (s_n, m_n) = (pl.stages as usize, pl.microbatches as usize);
    let per_dir = pl.stages_per_direction();
    let bidir = pl.directions() == 2;

    let mut events: Vec<Event> = Vec::new();
    let mut g_event = vec![usize::MAX; if record { ng } else { 0 }];
    let mut cpos = vec![0usize; np];
    let ns = stream_groups.len();
    let mut spos = vec![0usize; ns];
    let mut cfree = init.compute.clone();
    let mut mfree = init.comm.clone();
    let mut epfree = init.ep.clone();
    let mut busy = vec![0f64; np];
    let mut exposed = vec![0f64; np];
    let mut a2a = vec![0f64; np];
    // Busy intervals of each rank's compute stream and all-to-all intervals, each in time
    // order (in-order streams), for the exposed all-to-all (recorded runs only).
    let mut comp_iv: Vec<Vec<(f64, f64)>> = vec![Vec::new(); np];
    let mut a2a_iv: Vec<Vec<(f64, f64)>> = vec![Vec::new(); np];
    // Latest end of the ops closed so far on each rank (see the start rule below).
    let mut closed = init.compute.clone();
    let mut first = vec![f64::INFINITY; np];
    let mut last = vec![f64::NEG_INFINITY; np];
    let mut used = Clocks {
        compute: vec![0.0; np],
        ep: vec![0.0; np],
        comm: vec![0.0; ns],
        host: vec![0.0; 2 * np],
    };
    // The host-copy streams of each rank (one per direction: `2 r` offloads, `2 r + 1`
    // reloads), and per (stage, mb): the end of its forward (or
    // recompute), of its offload, and when its activations are back on the device (a
    // reload's end; a backward waits for it).
    let mut hfree = init.host.clone();
    let nk = s_n * m_n;
    let act_key = |s: u32, m: u32| {
        (s < pl.stages && m < pl.microbatches).then(|| s as usize * m_n + m as usize)
    };
    let has_mem = p.ranks.iter().flatten().any(|i| matches!(i, Instr::Mem(_)));
    let mut f_end = vec![0f64; if has_mem { nk } else { 0 }];
    let mut off_end = vec![0f64; if has_mem { nk } else { 0 }];
    let mut back_on = vec![0f64; if has_mem { nk } else { 0 }];
    // Per (stage, mb), as fractions of the stage's activation bytes: what its B and W have
    // still to release (`need`: 1 after F, `1 - released_at_b` after a split B, 0 after W or
    // BW), what of it is on the device (`dev`) and on the host (`host`). An offload moves
    // `dev` (after a split B only the W's part is left), a reload brings `host` back, a
    // recompute rebuilds `need`.
    let mut need = vec![0f64; if has_mem { nk } else { 0 }];
    let mut dev = vec![0f64; if has_mem { nk } else { 0 }];
    let mut host = vec![0f64; if has_mem { nk } else { 0 }];
    let mut makespan = f64::NEG_INFINITY;
    let mut item_end: Vec<Vec<f64>> = items.iter().map(|v| vec![f64::NAN; v.len()]).collect();
    let mut posted = vec![false; ng];
    let mut post_time = vec![0f64; ng];
    let mut ready_time = vec![0f64; ng]; // producer end of the group's sends
    let mut complete = vec![f64::NAN; ng];
    let mut posted_cnt = vec![0u32; ng];
    // End of the latest part of each split op (kind, stage, mb); NaN before its first part.
    let has_parts = p
        .ranks
        .iter()
        .flatten()
        .any(|i| matches!(i, Instr::Compute(c) if c.part != Part::Whole));
    let mut part_end: Vec<f64> = vec![f64::NAN; if has_parts { 4 * s_n * m_n } else { 0 }];
    let part_key = |c: &Compute| {
        (c.stage < pl.stages && c.mb < pl.microbatches)
            .then(|| kind_ix(c.kind) * s_n * m_n + c.stage as usize * m_n + c.mb as usize)
    };
    // Memory events: (time, delta bytes) per rank.
    let mut mem: Vec<Vec<(f64, f64)>> = vec![Vec::new(); if record { np } else { 0 }];
    // Host bytes per rank, and the bytes of each (stage, mb) now on its owner's host.
    let mut host_mem: Vec<Vec<(f64, f64, u32)>> = vec![Vec::new(); if record { np } else { 0 }];
    let mut on_host = vec![0f64; if has_mem && record { nk } else { 0 }];
    let mem_model = &cost.memory;
    let mut in_work = vec![true; np];
    let mut work: Vec<u32> = (0..np as u32).rev().collect();

    while let Some(r) = work.pop() {
        let r = r as usize;
        in_work[r] = false;
        loop {
            let mut progressed = false;
            while cpos[r] < items[r].len() {
                let (pos, (a, b)) = items[r][cpos[r]];
                let ws = &waits[a as usize..b as usize];
                if !ws
                    .iter()
                    .all(|&id| !complete[op_group[id as usize] as usize].is_nan())
                {
                    break;
                }
                let data = ws
                    .iter()
                    .map(|&id| complete[op_group[id as usize] as usize])
                    .fold(0.0, f64::max);
                let producers = ws
                    .iter()
                    .map(|&id| {
                        let pt = partner[id as usize];
                        if pt == NONE {
                            0.0
                        } else {
                            ready_time[op_group[pt as usize] as usize]
                        }
                    })
                    .fold(0.0, f64::max);
                let ins = &p.ranks[r][pos as usize];
                let before = cfree[r];
                // An op starts only once every op closed before it in program order (its last
                // part issued) has completed, all-to-alls included: ops overlap only where the
                // program interleaves their parts.
                let opens = match ins {
                    Instr::Compute(c) => is_first_part(c),
                    Instr::WaitRecv(_) => false,
                    _ => true,
                };
                let gate = if opens { closed[r] } else { 0.0 };
                // What a memory op moves, as a fraction of its stage's activation (below).
                let mut moved = 1.0f64;
                // (start, end, on the EP stream)
                let (start, end, on_ep) = match ins {
                    Instr::Compute(c) => {
                        let key = if c.part == Part::Whole {
                            None
                        } else {
                            part_key(c)
                        };
                        let pe = key.map_or(f64::NAN, |k| part_end[k]);
                        let mut pe = if pe.is_nan() { gate } else { pe.max(gate) };
                        // A backward waits for its activations' reload (or recompute); that
                        // wait is the host copy's, not exposed communication.
                        let mut reload = 0.0f64;
                        if has_mem && c.kind != Kind::F {
                            if let Some(k) = act_key(c.stage, c.mb) {
                                reload = back_on[k];
                                pe = pe.max(reload);
                            }
                        }
                        let d = cost.compute_time(c);
                        let a2a_part = c.part.is_all_to_all();
                        let (s, e, ep) = if a2a_part && cost.moe.overlap {
                            let s2 = epfree[r].max(data).max(pe);
                            epfree[r] = s2 + d;
                            used.ep[r] = 1.0;
                            (s2, s2 + d, true)
                        } else {
                            let base = before.max(data);
                            let start = base.max(pe);
                            exposed[r] += (start - before.max(producers).max(reload)).max(0.0);
                            if a2a_part {
                                // On the compute stream: the stream waits all of it.
                                exposed[r] += d;
                            } else {
                                busy[r] += d;
                                if d > 0.0 && record {
                                    comp_iv[r].push((start, start + d));
                                }
                            }
                            cfree[r] = start + d;
                            used.compute[r] = 1.0;
                            (start, start + d, false)
                        };
                        if a2a_part {
                            a2a[r] += d;
                            if d > 0.0 && record {
                                a2a_iv[r].push((s, e));
                            }
                        }
                        if let Some(k) = key {
                            part_end[k] = e;
                        }
                        if has_mem && c.kind == Kind::F && is_last_part(c) {
                            if let Some(k) = act_key(c.stage, c.mb) {
                                f_end[k] = e;
                            }
                        }
                        if is_last_part(c) {
                            closed[r] = closed[r].max(e);
                        }
                        (s, e, ep)
                    }
                    Instr::Overlap { fwd, bwd } => {
                        let base = before.max(data);
                        let mut start = base.max(gate);
                        let mut reload = 0.0f64;
                        if has_mem {
                            if let Some(k) = act_key(bwd.stage, bwd.mb) {
                                reload = back_on[k];
                                start = start.max(reload);
                            }
                        }
                        exposed[r] += (start - before.max(producers).max(reload)).max(0.0);
                        let d = cost.pair_time(fwd, bwd);
                        busy[r] += d;
                        if d > 0.0 && record {
                            comp_iv[r].push((start, start + d));
                        }
                        cfree[r] = start + d;
                        closed[r] = closed[r].max(start + d);
                        used.compute[r] = 1.0;
                        if has_mem {
                            if let Some(k) = act_key(fwd.stage, fwd.mb) {
                                f_end[k] = start + d;
                            }
                        }
                        (start, start + d, false)
                    }
                    Instr::Mem(op) => {
                        let k = act_key(op.stage, op.mb).ok_or_else(|| {
                            format!(
                                "rank {r}: `{}` names a stage or micro-batch out of range",
                                instr_to_string(ins)
                            )
                        })?;
                        // The fraction of the stage's activation bytes this op moves or
                        // rebuilds (see `need`).
                        moved = match op.kind {
                            MemKind::Offload => std::mem::take(&mut dev[k]),
                            MemKind::Reload => {
                                let h = std::mem::take(&mut host[k]);
                                dev[k] += h;
                                h
                            }
                            MemKind::Recompute => {
                                let add = (need[k] - dev[k]).max(0.0);
                                dev[k] = need[k];
                                add
                            }
                        };
                        if op.kind == MemKind::Offload {
                            host[k] += moved;
                        }
                        match op.kind {
                            // On the host-copy stream of its direction (offloads device to
                            // host, reloads host to device: PCIe is full duplex), once the
                            // compute stream reaches the op (the end of the op before it),
                            // the stream is free, and the forward (offload) or the offload
                            // (reload) has finished; the compute stream goes on without
                            // waiting.
                            MemKind::Offload | MemKind::Reload => {
                                let (after, h) = if op.kind == MemKind::Offload {
                                    (f_end[k], 2 * r)
                                } else {
                                    (off_end[k], 2 * r + 1)
                                };
                                let start = hfree[h].max(after).max(before);
                                let d = cost.memory.copy_time(op.kind, op.stage) * moved;
                                hfree[h] = start + d;
                                used.host[h] = 1.0;
                                if op.kind == MemKind::Offload {
                                    off_end[k] = start + d;
                                } else {
                                    back_on[k] = start + d;
                                }
                                (start, start + d, false)
                            }
                            // A forward of the stage again, on the compute stream.
                            MemKind::Recompute => {
                                let start = before.max(data).max(gate);
                                let d = cost.compute_time(&Compute {
                                    kind: Kind::F,
                                    stage: op.stage,
                                    mb: op.mb,
                                    part: Part::Whole,
                                    checkpoint: false,
                                });
                                busy[r] += d;
                                if d > 0.0 && record {
                                    comp_iv[r].push((start, start + d));
                                }
                                cfree[r] = start + d;
                                closed[r] = closed[r].max(start + d);
                                used.compute[r] = 1.0;
                                back_on[k] = start + d;
                                (start, start + d, false)
                            }
                        }
                    }
                    _ => {
                        let base = before.max(data);
                        let start = base.max(gate);
                        exposed[r] += (start - before.max(producers)).max(0.0);
                        cfree[r] = start;
                        (start, start, false)
                    }
                };
                if has_mem {
                    ins.for_each_compute(|c| {
                        let Some(k) = act_key(c.stage, c.mb) else {
                            return;
                        };
                        let rel_b = mem_model.released_at_b_at(c.stage);
                        if c.kind == Kind::F && is_first_part(c) {
                            need[k] = 1.0;
                            dev[k] = 1.0;
                        }
                        if is_last_part(c) {
                            let freed = match c.kind {
                                Kind::B => rel_b,
                                Kind::W => 1.0 - rel_b,
                                Kind::BW => 1.0,
                                Kind::F => 0.0,
                            };
                            need[k] = (need[k] - freed).max(0.0);
                            dev[k] = (dev[k] - freed).max(0.0);
                            if c.kind == Kind::F && c.checkpoint {
                                dev[k] = 0.0;
                            }
                        }
                    });
                }
                if ins.is_compute() {
                    first[r] = first[r].min(start);
                    last[r] = last[r].max(end);
                }
                makespan = makespan.max(end);
                if record {
                    let mut mbv = None;
                    let mut mb2 = None;
                    let mut direction = 0u8;
                    let mut kind = EventKind::Other;
                    ins.for_each_compute(|c| {
                        if mbv.is_none() {
                            mbv = Some(c.mb);
                            direction = u8::from(bidir && c.stage >= per_dir);
                        } else {
                            mb2 = Some(c.mb);
                        }
                        kind = kind_of(c);
                        // Memory accounting.
                        let act = mem_model.activation_bytes_at(c.stage);
                        let rel_b = mem_model.released_at_b_at(c.stage);
                        if c.kind == Kind::F && is_first_part(c) {
                            mem[r].push((start, act));
                        }
                        if is_last_part(c) {
                            match c.kind {
                                Kind::B => mem[r].push((end, -act * rel_b)),
                                Kind::W => mem[r].push((end, -act * (1.0 - rel_b))),
                                Kind::BW => mem[r].push((end, -act)),
                                // `F(s,m)!` drops its saved tensors when it ends.
                                Kind::F if c.checkpoint => mem[r].push((end, -act)),
                                Kind::F => {}
                            }
                        }
                    });
                    if matches!(ins, Instr::Overlap { .. }) {
                        kind = EventKind::Overlap;
                    }
                    if let Instr::Mem(op) = ins {
                        kind = EventKind::Mem;
                        mbv = Some(op.mb);
                        let act = mem_model.activation_bytes_at(op.stage) * moved;
                        // The device copy is freed when the offload completes, allocated
                        // again when a reload or recompute starts.
                        match op.kind {
                            MemKind::Offload => mem[r].push((end, -act)),
                            MemKind::Reload | MemKind::Recompute => mem[r].push((start, act)),
                        }
                        // The host copy holds from the offload's end until the reload has
                        // copied it back (or a recompute drops it, at its start).
                        if let Some(k) = act_key(op.stage, op.mb) {
                            match op.kind {
                                MemKind::Offload => {
                                    on_host[k] = act;
                                    host_mem[r].push((end, act, pos));
                                }
                                MemKind::Reload | MemKind::Recompute if on_host[k] > 0.0 => {
                                    let at = if op.kind == MemKind::Reload {
                                        end
                                    } else {
                                        start
                                    };
                                    host_mem[r].push((at, -on_host[k], pos));
                                    on_host[k] = 0.0;
                                }
                                _ => {}
                            }
                        }
                    }
                    if kind != EventKind::Other || end > start {
                        events.push(Event {
                            rank: r as u32,
                            stream: if on_ep {
                                StreamKind::Ep
                            } else if matches!(
                                ins,
                                Instr::Mem(MemOp {
                                    kind: MemKind::Offload,
                                    ..
                                })
                            ) {
                                StreamKind::Host
                            } else if matches!(
                                ins,
                                Instr::Mem(MemOp {
                                    kind: MemKind::Reload,
                                    ..
                                })
                            ) {
                                StreamKind::HostToDevice
                            } else {
                                StreamKind::Compute
                            },
                            kind,
                            pos,
                            start,
                            end,
                            mb: mbv,
                            mb2,
                            direction,
                        });
                    }
                }
                item_end[r][cpos[r]] = end;
                cpos[r] += 1;
                progressed = true;
            }
            for &k in &rank_streams[r] {
                while spos[k] < stream_groups[k].len() {
                    let g = stream_groups[k][spos[k]] as usize;
                    if !posted[g] {
                        let prod = g_prod[g];
                        if prod != NONE && (cpos[r] as u32) <= prod {
                            break;
                        }
                        let pe = if prod == NONE {
                            0.0
                        } else {
                            item_end[r][prod as usize]
                        };
                        ready_time[g] = pe;
                        post_time[g] = mfree[k].max(pe);
                        posted[g] = true;
                        progressed = true;
                        let root = prep.comp_root[g] as usize;
                        posted_cnt[root] += 1;
                        if posted_cnt[root] == prep.comp_size[root] && !prep.comp_never[root] {
                            let members = &prep.comp_members[prep.comp_start[root] as usize
                                ..prep.comp_start[root + 1] as usize];
                            let t = members
                                .iter()
                                .map(|&h| post_time[h as usize])
                                .fold(0.0, f64::max)
                                + prep.comp_dur[root];
                            for &h in members {
                                let h = h as usize;
                                complete[h] = t;
                                let hr = g_rank[h] as usize;
                                if hr != r && !in_work[hr] {
                                    in_work[hr] = true;
                                    work.push(hr as u32);
                                }
                            }
                        }
                    }
                    if !complete[g].is_nan() {
                        let t = complete[g];
                        mfree[k] = t;
                        used.comm[k] = 1.0;
                        makespan = makespan.max(t);
                        if record {
                            // A lent stash moves when its message completes: the sender's
                            // device frees it, the receiver's holds it.
                            let (a, b) = flat.g_ops[g];
                            for id in a..b {
                                match flat.comm[id as usize] {
                                    Comm::Send { payload, .. } if payload.kind.is_stash() => mem[r]
                                        .push((t, -mem_model.activation_bytes_at(payload.stage))),
                                    Comm::Recv { payload, .. } if payload.kind.is_stash() => mem[r]
                                        .push((t, mem_model.activation_bytes_at(payload.stage))),
                                    _ => {}
                                }
                            }
                            g_event[g] = events.len();
                            events.push(Event {
                                rank: r as u32,
                                stream: StreamKind::Comm,
                                kind: EventKind::Comm,
                                pos: g_pos[g],
                                start: post_time[g],
                                end: t,
                                mb: None,
                                mb2: None,
                                direction: 0,
                            });
                        }
                        spos[k] += 1;
                        progressed = true;
                    } else {
                        break;
                    }
                }
            }
            if !progressed {
                break;
            }
        }
    }
    let stuck_stream = (0..ns).find(|&k| spos[k] < stream_groups[k].len());
    if let Some(r) = (0..np)
        .find(|&r| cpos[r] < items[r].len())
        .or(stuck_stream.map(|k| g_rank[stream_groups[k][spos[k]] as usize] as usize))
    {
        return Err(format!(
            "the program does not run to the end (rank {r} stops); run `schedc check` for the diagnosis"
        ));
    }
    let exposed_a2a = (0..np)
        .map(|r| uncovered(&a2a_iv[r], &comp_iv[r]))
        .collect();
    Ok(Run {
        makespan: if makespan == f64::NEG_INFINITY {
            0.0
        } else {
            makespan
        },
        busy,
        exposed,
        exposed_a2a,
        a2a,
        first,
        last,
        end: Clocks {
            compute: cfree,
            ep: epfree,
            comm: mfree,
            host: hfree,
        },
        used,
        events,
        g_event,
        mem,
        host_mem,
    })
}

/// Total length of the intervals `a` not covered by the intervals `b`; both lists are in
/// time order and non-overlapping (one in-order stream each). Linear.
fn uncovered(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let mut j = 0;
    let mut total = 0.0;
    for &(s, e) in a {
        let mut t = s;
        while j < b.len() && b[j].1 <= t {
            j += 1;
        }
        let mut k = j;
        while t < e {
            match b.get(k) {
                Some(&(bs, be)) if bs < e => {
                    if bs > t {
                        total += bs - t;
                    }
                    t = t.max(be);
                    k += 1;
                }
                _ => {
                    total += e - t;
                    break;
                }
            }
        }
    }
    total
}

/// The most steps the steady-state search runs (the first included).
const MAX_STEADY_STEPS: usize = 8;

/// True if every stream that ran something ended `t` later in `b` than in `a`.
fn shifted_by(a: &Clocks, b: &Clocks, used: &Clocks, t: f64) -> bool {
    let tol = 1e-9 * t.abs().max(1.0);
    let same = |x: &[f64], y: &[f64], u: &[f64]| {
        x.iter()
            .zip(y)
            .zip(u)
            .all(|((x, y), u)| *u == 0.0 || ((y - x) - t).abs() <= tol)
    };
    same(&a.compute, &b.compute, &used.compute)
        && same(&a.ep, &b.ep, &used.ep)
        && same(&a.comm, &b.comm, &used.comm)
        && same(&a.host, &b.host, &used.host)
}

/// What [`simulate_with`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimOptions {
    /// Run further steps for the `steady_state` bubble (typically one more run of the event
    /// loop, about doubling the cost). Without it `bubble.steady_state` and `steady_step`
    /// are NaN (JSON `null`).
    pub steady_state: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions { steady_state: true }
    }
}

/// Simulates a lowered program (one that passes `schedc check`; compute-only input must be
/// lowered first with `passes::lower`): the timeline, per-rank figures, the bubble under
/// every convention (the steady state runs the step again, typically once more), the
/// all-to-all totals. O(instructions) per run of the step.
///
/// Errors: a program that cannot run to the end (unmatched messages or a deadlock: run
/// `schedc check` for the diagnosis).
pub fn simulate(p: &Program, cost: &CostModel) -> Result<SimResult, String> {
    simulate_with(p, cost, SimOptions::default())
}

/// The start of [`simulate_with`]'s error when the step's end overflows to infinity (a cost
/// model whose copy, message or op times are too large): unusable input.
pub const NOT_FINITE: &str = "the simulated step does not end in finite time";

/// [`simulate`] with options: an optimizer's inner loop that needs no steady-state figure
/// turns it off.
pub fn simulate_with(p: &Program, cost: &CostModel, opts: SimOptions) -> Result<SimResult, String> {
    let pl = &p.pipeline;
    let np = p.ranks.len();
    let prep = prepare(p, cost);
    let zero = Clocks {
        compute: vec![0.0; np],
        ep: vec![0.0; np],
        comm: vec![0.0; prep.flat.stream_groups.len()],
        host: vec![0.0; 2 * np],
    };
    let one = run(p, cost, &prep, &zero, true)?;
    if !one.makespan.is_finite() {
        return Err(format!(
            "{NOT_FINITE} (makespan {}): a copy, message or op time of the cost model is too large (latency, bandwidth, pcie_bandwidth, offload and reload included)",
            one.makespan
        ));
    }

    // Steady state: run further steps from where the previous one left every stream.
    let mut prev_end = one.end.clone();
    let mut prev_makespan = one.makespan;
    let mut step = if opts.steady_state {
        one.makespan
    } else {
        f64::NAN
    };
    for _ in 1..if opts.steady_state {
        MAX_STEADY_STEPS
    } else {
        1
    } {
        let next = run(p, cost, &prep, &prev_end, false)?;
        step = next.makespan - prev_makespan;
        let periodic = shifted_by(&prev_end, &next.end, &one.used, step);
        prev_end = next.end;
        prev_makespan = next.makespan;
        if periodic {
            break;
        }
    }

    // Flows: each send's group to its receive's group.
    let flat = &prep.flat;
    let mut flows = Vec::new();
    for (id, c) in flat.comm.iter().enumerate() {
        if matches!(c, Comm::Send { .. }) && prep.partner[id] != NONE {
            let (a, b) = (
                one.g_event[flat.op_group[id] as usize],
                one.g_event[flat.op_group[prep.partner[id] as usize] as usize],
            );
            if a != usize::MAX && b != usize::MAX {
                flows.push((a, b));
            }
        }
    }
    let makespan = one.makespan;
    let mut mem = one.mem;
    let mut host_mem = one.host_mem;
    let budget = cost.memory.host_bytes;
    let mut host_overflows = Vec::new();
    let by_rank = pl.stages_by_rank();
    let ranks: Vec<RankSim> = (0..np)
        .map(|r| {
            let stat: f64 = by_rank.get(r).map_or(0.0, |v| {
                v.iter().map(|&s| cost.memory.static_bytes_at(s)).sum()
            });
            let mut ev = std::mem::take(&mut mem[r]);
            // A free at the instant of an allocation happens first (the op that frees ends
            // as the next one starts); an overlapped pair allocates at its start and frees at
            // its end, so it still holds both.
            ev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
            let (mut live, mut peak, mut peak_at) = (0f64, 0f64, 0f64);
            for (t, d) in ev {
                live += d;
                if live > peak {
                    peak = live;
                    peak_at = t;
                }
            }
            // Host bytes: a free at the instant of an offload's end happens first.
            let mut hev = std::mem::take(&mut host_mem[r]);
            hev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
            let (mut held, mut host_peak) = (0f64, 0f64);
            let mut over = None;
            for (_, d, pos) in hev {
                if budget > 0.0 && d > 0.0 && held + d > budget && over.is_none() {
                    let (stage, mb) = match p.ranks[r].get(pos as usize) {
                        Some(Instr::Mem(op)) => (op.stage, op.mb),
                        _ => (0, 0),
                    };
                    over = Some(HostOverflow {
                        rank: r as u32,
                        pos,
                        stage,
                        mb,
                        needs: d,
                        held,
                        budget,
                    });
                }
                held += d;
                host_peak = host_peak.max(held);
            }
            host_overflows.extend(over);
            let span = if one.last[r] >= one.first[r] {
                one.last[r] - one.first[r]
            } else {
                0.0
            };
            RankSim {
                rank: r as u32,
                busy: one.busy[r],
                idle: makespan - one.busy[r],
                span,
                exposed_comm: one.exposed[r],
                a2a: one.a2a[r],
                exposed_a2a: one.exposed_a2a[r],
                peak_memory_bytes: stat + peak,
                peak_activation_bytes: peak,
                peak_host_bytes: host_peak,
                peak_memory_at: peak_at,
            }
        })
        .collect();
    let tb: f64 = ranks.iter().map(|r| r.busy).sum();
    let ti: f64 = ranks.iter().map(|r| r.idle).sum();
    let max_span = ranks.iter().map(|r| r.span).fold(0.0, f64::max);
    let frac = |window: f64| {
        if window.is_nan() {
            f64::NAN
        } else if window > 0.0 && np > 0 {
            (1.0 - tb / (np as f64 * window)).max(0.0)
        } else {
            0.0
        }
    };
    let bubble = Bubble {
        from_start: frac(makespan),
        per_rank_span: frac(max_span),
        steady_state: frac(step),
    };
    Ok(SimResult {
        makespan,
        bubble_ratio: if tb + ti > 0.0 { ti / (tb + ti) } else { 0.0 },
        bubble_ratio_busy: if tb > 0.0 { ti / tb } else { 0.0 },
        bubble,
        a2a: A2aStats {
            total: ranks.iter().map(|r| r.a2a).sum(),
            exposed: ranks.iter().map(|r| r.exposed_a2a).sum(),
        },
        steady_step: step,
        ranks,
        host_overflows,
        events: one.events,
        flows,
    })
}

/// Lowers (if needed) and simulates.
pub fn simulate_any(p: &Program, cost: &CostModel) -> Result<SimResult, String> {
    if !p.has_p2p() {
        let l = crate::passes::lower::lower(p).map_err(|_| {
            "the compute order admits no execution; run `schedc check` for the cycle".to_string()
        })?;
        simulate(&l, cost)
    } else {
        simulate(p, cost)
    }
}
