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
//! alone would cause), peak memory. Bubble ratio in both conventions of the literature:
//! idle / (busy + idle) (Zero Bubble's README) and idle / busy (Megatron's).

// Index loops over parallel arrays (ops, groups) read better than zipped iterators here.
#![allow(clippy::needless_range_loop)]

pub mod cost;
pub mod render;

use crate::passes::{is_first_part, is_last_part};
use cost::CostModel;
use schedc_ir::text::instr_to_string;
use schedc_ir::{Comm, Compute, Instr, Kind, Part, Program};
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
    /// Compute-stream busy time, seconds.
    pub busy: f64,
    /// makespan - busy, seconds.
    pub idle: f64,
    /// Time the compute stream waited on communication beyond its producers, seconds.
    pub exposed_comm: f64,
    /// Peak memory: parameters, gradients and optimizer state of the stages held, plus the
    /// peak of live activations, bytes.
    pub peak_memory_bytes: f64,
    /// Peak of live activation bytes.
    pub peak_activation_bytes: f64,
}

/// The result of a simulation.
#[derive(Clone, Debug, Serialize)]
pub struct SimResult {
    /// Latest end over all streams, seconds.
    pub makespan: f64,
    /// Σ idle / (Σ busy + Σ idle) over all ranks.
    pub bubble_ratio: f64,
    /// Σ idle / Σ busy over all ranks.
    pub bubble_ratio_busy: f64,
    /// Per rank.
    pub ranks: Vec<RankSim>,
    /// Every interval.
    #[serde(skip)]
    pub events: Vec<Event>,
    /// Send-to-receive arrows: (event of the send's group, event of the receive's group).
    #[serde(skip)]
    pub flows: Vec<(usize, usize)>,
}

use crate::passes::streams::NONE;

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

/// Simulates a lowered program (one that passes `schedc check`; compute-only input must be
/// lowered first with `passes::lower`).
///
/// Errors: a program that cannot run to the end (unmatched messages or a deadlock: run
/// `schedc check` for the diagnosis).
pub fn simulate(p: &Program, cost: &CostModel) -> Result<SimResult, String> {
    let pl = &p.pipeline;
    let np = p.ranks.len();
    let msg_time = cost.message_time();

    // ---- Flatten: comm ops and groups; compute items. ----
    let flat = crate::passes::streams::flatten(p);
    let op_comm = &flat.comm;
    let (op_rank, op_group) = (&flat.op_rank, &flat.op_group);
    let (g_rank, g_pos, g_ops, g_prod) = (&flat.g_rank, &flat.g_pos, &flat.g_ops, &flat.g_producer);
    let (stream_groups, rank_streams) = (&flat.stream_groups, &flat.rank_streams);
    let (items, waits) = (&flat.items, &flat.waits);

    // ---- FIFO matching and components. ----
    let ng = g_rank.len();
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
    let mut op_dur: Vec<f64> = op_comm
        .iter()
        .map(|c| match c {
            Comm::Collective(_) => cost.moe.a2a,
            _ => msg_time,
        })
        .collect();
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
            comp_dur[root as usize] = comp_dur[root as usize].max(op_dur[id as usize]);
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
    drop(fill);
    op_dur.clear();

    // ---- Run. ----
    let mut events: Vec<Event> = Vec::new();
    let mut g_event = vec![usize::MAX; ng];
    let mut cpos = vec![0usize; np];
    let ns = stream_groups.len();
    let mut spos = vec![0usize; ns];
    let mut cfree = vec![0f64; np];
    let mut mfree = vec![0f64; ns];
    let mut epfree = vec![0f64; np];
    let mut busy = vec![0f64; np];
    let mut exposed = vec![0f64; np];
    let mut item_end: Vec<Vec<f64>> = items.iter().map(|v| vec![f64::NAN; v.len()]).collect();
    let mut posted = vec![false; ng];
    let mut post_time = vec![0f64; ng];
    let mut ready_time = vec![0f64; ng]; // producer end of the group's sends
    let mut complete = vec![f64::NAN; ng];
    let mut posted_cnt = vec![0u32; ng];
    let mut part_end: HashMap<(Kind, u32, u32), f64> = HashMap::new();
    // Memory events: (time, delta bytes, is_free) per rank.
    let mut mem: Vec<Vec<(f64, f64)>> = vec![Vec::new(); np];
    let act = cost.memory.activation_bytes;
    let rel_b = cost.memory.released_at_b.clamp(0.0, 1.0);
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
                let mut start = before.max(data);
                let (end, on_ep) = match ins {
                    Instr::Compute(c) => {
                        if c.part != Part::Whole {
                            if let Some(&pe) = part_end.get(&(c.kind, c.stage, c.mb)) {
                                start = start.max(pe);
                            }
                        }
                        let d = cost.compute_time(c);
                        if c.part.is_all_to_all() && cost.moe.overlap {
                            let s2 = epfree[r].max(data).max(
                                part_end
                                    .get(&(c.kind, c.stage, c.mb))
                                    .copied()
                                    .unwrap_or(0.0),
                            );
                            (s2 + d, Some(s2))
                        } else {
                            (start + d, None)
                        }
                    }
                    Instr::Overlap { fwd, bwd } => (start + cost.pair_time(fwd, bwd), None),
                    _ => (start, None),
                };
                let (ev_start, stream) = match on_ep {
                    Some(s2) => {
                        epfree[r] = end;
                        (s2, StreamKind::Ep)
                    }
                    None => {
                        exposed[r] += (start - before.max(producers)).max(0.0);
                        busy[r] += end - start;
                        cfree[r] = end;
                        (start, StreamKind::Compute)
                    }
                };
                let mut mbv = None;
                let mut mb2 = None;
                let mut direction = 0u8;
                let per_dir = pl.stages_per_direction();
                let mut kind = EventKind::Other;
                ins.for_each_compute(|c| {
                    if mbv.is_none() {
                        mbv = Some(c.mb);
                        direction = u8::from(pl.directions() == 2 && c.stage >= per_dir);
                    } else {
                        mb2 = Some(c.mb);
                    }
                    kind = kind_of(c);
                    if c.part != Part::Whole {
                        part_end.insert((c.kind, c.stage, c.mb), end);
                    }
                    // Memory accounting.
                    if c.kind == Kind::F && is_first_part(c) {
                        mem[r].push((ev_start, act));
                    }
                    if is_last_part(c) {
                        match c.kind {
                            Kind::B => mem[r].push((end, -act * rel_b)),
                            Kind::W => mem[r].push((end, -act * (1.0 - rel_b))),
                            Kind::BW => mem[r].push((end, -act)),
                            Kind::F => {}
                        }
                    }
                });
                if matches!(ins, Instr::Overlap { .. }) {
                    kind = EventKind::Overlap;
                }
                if kind != EventKind::Other || end > ev_start {
                    events.push(Event {
                        rank: r as u32,
                        stream,
                        kind,
                        pos,
                        start: ev_start,
                        end,
                        mb: mbv,
                        mb2,
                        direction,
                    });
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
                        let root = comp_root[g] as usize;
                        posted_cnt[root] += 1;
                        if posted_cnt[root] == comp_size[root] && !comp_never[root] {
                            let members = &comp_members
                                [comp_start[root] as usize..comp_start[root + 1] as usize];
                            let t = members
                                .iter()
                                .map(|&h| post_time[h as usize])
                                .fold(0.0, f64::max)
                                + comp_dur[root];
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
    // Flows: each send's group to its receive's group.
    let mut flows = Vec::new();
    for (id, c) in op_comm.iter().enumerate() {
        if matches!(c, Comm::Send { .. }) && partner[id] != NONE {
            let (a, b) = (
                g_event[op_group[id] as usize],
                g_event[op_group[partner[id] as usize] as usize],
            );
            if a != usize::MAX && b != usize::MAX {
                flows.push((a, b));
            }
        }
    }
    let makespan = events.iter().map(|e| e.end).fold(0.0, f64::max);
    let by_rank = pl.stages_by_rank();
    let ranks: Vec<RankSim> = (0..np)
        .map(|r| {
            let held = by_rank.get(r).map_or(0, Vec::len) as f64;
            let stat = held
                * (cost.memory.param_bytes + cost.memory.grad_bytes + cost.memory.optimizer_bytes);
            let mut ev = std::mem::take(&mut mem[r]);
            // A free at the instant of an allocation happens first (the op that frees ends
            // as the next one starts); an overlapped pair allocates at its start and frees at
            // its end, so it still holds both.
            ev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
            let (mut live, mut peak) = (0f64, 0f64);
            for (_, d) in ev {
                live += d;
                peak = peak.max(live);
            }
            RankSim {
                rank: r as u32,
                busy: busy[r],
                idle: makespan - busy[r],
                exposed_comm: exposed[r],
                peak_memory_bytes: stat + peak,
                peak_activation_bytes: peak,
            }
        })
        .collect();
    let tb: f64 = ranks.iter().map(|r| r.busy).sum();
    let ti: f64 = ranks.iter().map(|r| r.idle).sum();
    Ok(SimResult {
        makespan,
        bubble_ratio: if tb + ti > 0.0 { ti / (tb + ti) } else { 0.0 },
        bubble_ratio_busy: if tb > 0.0 { ti / tb } else { 0.0 },
        ranks,
        events,
        flows,
    })
}

/// Lowers (if needed) and simulates.
pub fn simulate_any(p: &Program, cost: &CostModel) -> Result<SimResult, String> {
    if p.is_compute_only() {
        let l = crate::passes::lower::lower(p).map_err(|_| {
            "the compute order admits no execution; run `schedc check` for the cycle".to_string()
        })?;
        simulate(&l, cost)
    } else {
        simulate(p, cost)
    }
}
