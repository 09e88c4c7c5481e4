//! Pass 4: matching and deadlock freedom of a lowered program.
//!
//! ## The execution model (default semantics)
//!
//! Each rank runs two in-order streams:
//! * a **compute stream**: its compute ops (F, B, W, BW, overlapped pairs, MoE parts,
//!   `REDUCE_GRAD`, `WAIT_SA/SG`) in program order. A compute op waits only for the receives
//!   that feed it (the activation of the previous stage for a forward, the gradient of the
//!   next stage for a backward, when those stages are on another rank); `WAIT_SA/SG` waits for
//!   its send to complete.
//! * a **communication stream**: its sends, receives and collectives in program order, as
//!   *groups*: a lone op is a group of one, `{...}` a group posted at once. A group is
//!   *posted* once the previous group on the stream has completed and every op that produces
//!   one of its sends' payloads has run on the compute stream.
//!
//! Matching is FIFO per ordered rank pair: the k-th send from a to b pairs with the k-th
//! receive on b from a, and their labels (kind, stage, micro-batch) must agree
//! (`label-mismatch` otherwise, even if the program would run to the end; `unmatched` for a
//! surplus op). The k-th collective of a communicator on each member matches the k-th of
//! every other member; their labels must agree (`collective-order`).
//!
//! Sends are **rendezvous**: a group completes, as a unit, only once every group connected to
//! it through matched pairs (transitively) has been posted. Passing under rendezvous implies
//! passing with any amount of buffering.
//!
//! [`Semantics`] relaxes one rule at a time: `eager` sends (a send completes as soon as it is
//! posted, a group once its receives' partners are posted), `per_op_groups` (a group is still
//! posted at once, but each of its ops completes on its own as soon as its partner is posted,
//! rather than the group completing as a unit with everything matched to it),
//! `buffer_slots = K` (the k-th send on a pair completes once receive k-K is posted).
//!
//! ## Algorithm
//!
//! Matching: one pass over all communication ops, O(ops). Simulation: a worklist of ranks;
//! a rank advances its streams as far as it can and is woken when a group it waits on
//! completes; each op is visited O(1) times: O(ops + P) overall. If ranks remain unfinished,
//! each blocked stream waits for exactly one other stream; following those edges from any
//! blocked stream ends in a cycle (`deadlock`, reported with every step) or in an op that
//! can never complete (`stall`, e.g. a receive without a send).

// Index loops over parallel arrays (ops, groups) read better than zipped iterators here.
#![allow(clippy::needless_range_loop)]

use super::streams::{flatten, Streams, NONE};
use super::{Ctx, Pos};
use crate::diag::{Code, Diagnostic};
use schedc_ir::text::{instr_to_string, write_comm};
use schedc_ir::{Comm, Program};
use std::collections::HashMap;

/// Communication semantics. The default is the strictest (rendezvous, groups as written).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Semantics {
    /// Sends complete once posted (unbounded buffering).
    pub eager: bool,
    /// Each op of a group completes on its own once its partner is posted (the group is
    /// still posted at once).
    pub per_op_groups: bool,
    /// K buffer slots per ordered rank pair (`None`: rendezvous unless `eager`).
    pub buffer_slots: Option<u32>,
}

/// Which stream of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Compute stream.
    Compute,
    /// Communication stream.
    Comm,
}

/// One step of a wait-for chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitStep {
    /// The blocked stream's rank.
    pub rank: u32,
    /// Which stream.
    pub stream: Stream,
    /// The instruction it is blocked at.
    pub at: Pos,
    /// What it waits for, in words.
    pub waits_for: String,
}

/// A pass-4 error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommError {
    /// FIFO-matched pair with different labels.
    LabelMismatch {
        /// The send.
        send: Pos,
        /// Its FIFO partner.
        recv: Pos,
        /// Send text.
        send_op: String,
        /// Receive text.
        recv_op: String,
    },
    /// A send or receive with no partner.
    Unmatched {
        /// Where.
        at: Pos,
        /// The op text.
        op: String,
        /// Explanation.
        why: String,
    },
    /// Collectives issued in different orders.
    CollectiveOrder {
        /// Where.
        at: Pos,
        /// Explanation.
        why: String,
        /// The member's call it disagrees with, if any.
        other: Option<Pos>,
    },
    /// A wait-for cycle.
    Deadlock(Vec<WaitStep>),
    /// A chain ending in an op that can never complete.
    Stall(Vec<WaitStep>),
}

impl CommError {
    /// Converts to a diagnostic.
    pub fn to_diagnostic(&self, cx: &Ctx<'_>) -> Diagnostic {
        let loc = |p: &Pos| cx.loc(p.rank as usize, p.pos as usize);
        match self {
            CommError::LabelMismatch {
                send,
                recv,
                send_op,
                recv_op,
            } => Diagnostic::error(
                Code::LabelMismatch,
                format!(
                    "FIFO matching pairs receive `{recv_op}` on rank {} with send `{send_op}` on rank {}, whose payload differs",
                    recv.rank, send.rank
                ),
            )
            .at(loc(recv))
            .with_related(loc(send), "matched with this send")
            .with_note("sends and receives between two ranks pair in program order; reorder them so the k-th send and the k-th receive carry the same payload"),
            CommError::Unmatched { at, why, .. } => {
                Diagnostic::error(Code::Unmatched, why.clone()).at(loc(at))
            }
            CommError::CollectiveOrder { at, why, other } => {
                let d = Diagnostic::error(Code::CollectiveOrder, why.clone()).at(loc(at));
                match other {
                    Some(o) => d.with_related(
                        loc(o),
                        format!("rank {}'s call at the same place in its sequence", o.rank),
                    ),
                    None => d,
                }
            }
            CommError::Deadlock(steps) | CommError::Stall(steps) => {
                let dl = matches!(self, CommError::Deadlock(_));
                let first = &steps[0];
                let ranks: Vec<String> = steps
                    .iter()
                    .map(|s| format!("{}", s.rank))
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect();
                let mut d = Diagnostic::error(
                    if dl { Code::Deadlock } else { Code::Stall },
                    if dl && ranks.len() == 1 {
                        format!(
                            "deadlock: rank {} waits on its own communication stream in a cycle",
                            ranks[0]
                        )
                    } else if dl {
                        format!(
                            "deadlock: ranks {} wait for each other in a cycle",
                            ranks.join(", ")
                        )
                    } else {
                        format!(
                            "rank {} can never finish: it waits for an op that never completes",
                            first.rank
                        )
                    },
                )
                .at(loc(&first.at));
                for s in steps {
                    let stream = match s.stream {
                        Stream::Compute => "compute",
                        Stream::Comm => "comm",
                    };
                    d = d.with_note(format!(
                        "rank {} ({stream} stream) is blocked at position {} `{}`: {}",
                        s.rank,
                        s.at.pos,
                        loc(&s.at).op,
                        s.waits_for
                    ));
                }
                for s in steps.iter().skip(1) {
                    d = d.with_related(loc(&s.at), format!("rank {} blocked here", s.rank));
                }
                d
            }
        }
    }

    /// The steps of a deadlock or stall.
    pub fn steps(&self) -> Option<&[WaitStep]> {
        match self {
            CommError::Deadlock(s) | CommError::Stall(s) => Some(s),
            _ => None,
        }
    }
}

/// Flattened communication ops.
struct Ops {
    rank: Vec<u32>,
    pos: Vec<u32>,
    group: Vec<u32>,
    partner: Vec<u32>,
    /// For sends: index within its (src, dst) channel.
    chan_ix: Vec<u32>,
}

struct Groups {
    rank: Vec<u32>,
    pos: Vec<u32>,
    ops: Vec<(u32, u32)>,
    /// Compute-stream item index that must have run before the group is posted (exclusive
    /// bound: requires `cpos > producer`), or NONE.
    producer: Vec<u32>,
}

fn op_text(c: &Comm) -> String {
    let mut s = String::new();
    write_comm(&mut s, c);
    s
}

/// Runs pass 4 on a lowered program. Returns the errors (empty if the program is proven
/// deadlock-free with labels agreeing).
pub fn check(p: &Program, sem: Semantics) -> Vec<CommError> {
    let pl = &p.pipeline;
    let np = p.ranks.len();
    let mut errs = Vec::new();

    // ---- Flatten comm ops into groups; compute items per rank. ----
    let flat = flatten(p);
    let chans = flat.channels();
    let Streams {
        comm: comm_ref,
        op_rank,
        op_pos,
        op_group,
        g_rank,
        g_pos,
        g_ops,
        g_producer,
        g_stream,
        stream_rank,
        stream_groups,
        rank_streams,
        items,
        waits,
    } = flat;
    let n_ops = comm_ref.len();
    let mut ops = Ops {
        rank: op_rank,
        pos: op_pos,
        group: op_group,
        partner: vec![NONE; n_ops],
        chan_ix: vec![0; n_ops],
    };
    let groups = Groups {
        rank: g_rank,
        pos: g_pos,
        ops: g_ops,
        producer: g_producer,
    };
    for (sends, recvs) in chans.values() {
        for list in [sends, recvs] {
            for (ix, &id) in list.iter().enumerate() {
                ops.chan_ix[id as usize] = ix as u32;
            }
        }
    }

    // ---- FIFO matching per ordered pair. ----
    let mut chan_keys: Vec<_> = chans.keys().copied().collect();
    chan_keys.sort_unstable();
    const CAP: usize = 50;
    let mut n_mismatch = 0usize;
    let mut n_unmatched = 0usize;
    for key in &chan_keys {
        let (sends, recvs) = &chans[key];
        for (k, (&s, &rv)) in sends.iter().zip(recvs.iter()).enumerate() {
            let _ = k;
            ops.partner[s as usize] = rv;
            ops.partner[rv as usize] = s;
            let (Comm::Send { payload: ps, .. }, Comm::Recv { payload: pr, .. }) =
                (comm_ref[s as usize], comm_ref[rv as usize])
            else {
                unreachable!("channel lists hold sends and receives")
            };
            if ps != pr {
                n_mismatch += 1;
                if n_mismatch <= CAP {
                    errs.push(CommError::LabelMismatch {
                        send: Pos {
                            rank: ops.rank[s as usize],
                            pos: ops.pos[s as usize],
                        },
                        recv: Pos {
                            rank: ops.rank[rv as usize],
                            pos: ops.pos[rv as usize],
                        },
                        send_op: op_text(comm_ref[s as usize]),
                        recv_op: op_text(comm_ref[rv as usize]),
                    });
                }
            }
        }
        let (a, b) = (sends.len(), recvs.len());
        let surplus: &[u32] = if a > b { &sends[b..] } else { &recvs[a..] };
        for &id in surplus {
            n_unmatched += 1;
            if n_unmatched <= CAP {
                let c = comm_ref[id as usize];
                let (r, peer) = (ops.rank[id as usize], c.peer().unwrap_or(0));
                let why = match c {
                    Comm::Send { .. } => format!(
                        "send `{}` on rank {r} has no matching receive: rank {peer} posts {} receive(s) from rank {r} but rank {r} posts {} send(s) to it",
                        op_text(c), b, a
                    ),
                    _ => format!(
                        "receive `{}` on rank {r} has no matching send: rank {peer} posts {} send(s) to rank {r} but rank {r} posts {} receive(s) from it",
                        op_text(c), a, b
                    ),
                };
                errs.push(CommError::Unmatched {
                    at: Pos {
                        rank: r,
                        pos: ops.pos[id as usize],
                    },
                    op: op_text(c),
                    why,
                });
            }
        }
    }

    // ---- Collectives: per communicator, per member, sequences must agree. ----
    // coll_sets[k] = the op ids of one matched collective (one per member).
    let mut coll_sets: Vec<Vec<u32>> = Vec::new();
    let mut coll_never: Vec<bool> = Vec::new();
    {
        let mut per_comm: HashMap<&str, HashMap<u32, Vec<u32>>> = HashMap::new();
        for (id, c) in comm_ref.iter().enumerate() {
            if let Comm::Collective(col) = c {
                per_comm
                    .entry(col.comm.as_str())
                    .or_default()
                    .entry(ops.rank[id])
                    .or_default()
                    .push(id as u32);
            }
        }
        let mut names: Vec<&str> = per_comm.keys().copied().collect();
        names.sort_unstable();
        for name in names {
            let members: Vec<u32> = pl
                .communicators
                .iter()
                .find(|g| g.name == name)
                .map(|g| g.ranks.clone())
                .unwrap_or_default();
            let seqs = &per_comm[name];
            let empty = Vec::new();
            let longest = members
                .iter()
                .map(|r| seqs.get(r).map_or(0, Vec::len))
                .max()
                .unwrap_or(0);
            let label = |id: u32| match comm_ref[id as usize] {
                Comm::Collective(c) => c.label.as_str(),
                _ => "",
            };
            let mut reported = std::collections::HashSet::new();
            for k in 0..longest {
                let mut set = Vec::new();
                let mut never = false;
                let mut ref_label: Option<(&str, u32)> = None;
                for &m in &members {
                    let seq = seqs.get(&m).unwrap_or(&empty);
                    match seq.get(k) {
                        Some(&id) => {
                            set.push(id);
                            let l = label(id);
                            match ref_label {
                                None => ref_label = Some((l, id)),
                                Some((rl, rid)) if rl != l && reported.insert(m) => {
                                    let other = Pos {
                                        rank: ops.rank[rid as usize],
                                        pos: ops.pos[rid as usize],
                                    };
                                    errs.push(CommError::CollectiveOrder {
                                            at: Pos { rank: m, pos: ops.pos[id as usize] },
                                            why: format!(
                                                "collective #{k} on communicator `{name}` is `{l}` on rank {m} but `{rl}` on rank {}: members must issue the same sequence",
                                                other.rank
                                            ),
                                            other: Some(other),
                                        });
                                }
                                _ => {}
                            }
                        }
                        None => {
                            never = true;
                            if reported.insert(m) {
                                let at = set
                                    .first()
                                    .map(|&id| Pos {
                                        rank: ops.rank[id as usize],
                                        pos: ops.pos[id as usize],
                                    })
                                    .unwrap_or(Pos { rank: m, pos: 0 });
                                errs.push(CommError::CollectiveOrder {
                                    at,
                                    why: format!(
                                        "rank {m} issues {} collective(s) on communicator `{name}`, fewer than the {longest} of other members",
                                        seq.len()
                                    ),
                                    other: None,
                                });
                            }
                        }
                    }
                }
                coll_sets.push(set);
                coll_never.push(never);
            }
        }
    }

    // ---- Group requirements. ----
    let ng = groups.rank.len();
    // Zero buffer slots is plain rendezvous.
    let sem = Semantics {
        buffer_slots: sem.buffer_slots.filter(|&k| k > 0),
        ..sem
    };
    let rendezvous = !sem.eager && sem.buffer_slots.is_none() && !sem.per_op_groups;
    // Outside rendezvous mode, each send/receive completes on its own once the group named
    // here is posted (NONE: at once; NEVER: never).
    const NEVER: u32 = u32::MAX - 1;
    let mut op_req: Vec<u32> = if rendezvous {
        Vec::new()
    } else {
        vec![NONE; comm_ref.len()]
    };
    // never[g]: some op of g has no partner it must wait for.
    let mut never = vec![false; ng];
    // Union-find for rendezvous components.
    let mut parent: Vec<u32> = (0..ng as u32).collect();
    fn find(parent: &mut [u32], mut x: u32) -> u32 {
        while parent[x as usize] != x {
            parent[x as usize] = parent[parent[x as usize] as usize];
            x = parent[x as usize];
        }
        x
    }
    // reqs for non-rendezvous: list of groups that must be posted.
    let mut reqs: Vec<Vec<u32>> = if rendezvous {
        Vec::new()
    } else {
        vec![Vec::new(); ng]
    };
    for id in 0..comm_ref.len() {
        let g = ops.group[id];
        let part = ops.partner[id];
        match comm_ref[id] {
            Comm::Send { .. } => {
                if rendezvous {
                    if part == NONE {
                        never[g as usize] = true;
                    } else {
                        let (a, b) = (
                            find(&mut parent, g),
                            find(&mut parent, ops.group[part as usize]),
                        );
                        if a != b {
                            parent[a as usize] = b;
                        }
                    }
                } else if sem.eager {
                    // Buffered: completes once posted.
                } else if let Some(k) = sem.buffer_slots {
                    let ix = ops.chan_ix[id];
                    if ix >= k {
                        // needs receive ix-k on this channel to be posted
                        let (src, dst) = (ops.rank[id], comm_ref[id].peer().unwrap_or(0));
                        let recvs = &chans[&(src, dst, comm_ref[id].channel())].1;
                        match recvs.get((ix - k) as usize) {
                            Some(&rid) => {
                                reqs[g as usize].push(ops.group[rid as usize]);
                                op_req[id] = ops.group[rid as usize];
                            }
                            None => {
                                never[g as usize] = true;
                                op_req[id] = NEVER;
                            }
                        }
                    }
                } else if part == NONE {
                    // Per-op completion, rendezvous per op.
                    never[g as usize] = true;
                    op_req[id] = NEVER;
                } else {
                    reqs[g as usize].push(ops.group[part as usize]);
                    op_req[id] = ops.group[part as usize];
                }
            }
            Comm::Recv { .. } => {
                if part == NONE {
                    never[g as usize] = true;
                    if !rendezvous {
                        op_req[id] = NEVER;
                    }
                } else if rendezvous {
                    let (a, b) = (
                        find(&mut parent, g),
                        find(&mut parent, ops.group[part as usize]),
                    );
                    if a != b {
                        parent[a as usize] = b;
                    }
                } else {
                    reqs[g as usize].push(ops.group[part as usize]);
                    op_req[id] = ops.group[part as usize];
                }
            }
            Comm::Collective(_) => {}
        }
    }
    for (set, nev) in coll_sets.iter().zip(&coll_never) {
        for &id in set {
            let g = ops.group[id as usize];
            if *nev {
                never[g as usize] = true;
            }
            for &other in set {
                let h = ops.group[other as usize];
                if rendezvous {
                    let (a, b) = (find(&mut parent, g), find(&mut parent, h));
                    if a != b {
                        parent[a as usize] = b;
                    }
                } else if h != g {
                    reqs[g as usize].push(h);
                }
            }
        }
    }
    // Components.
    let mut comp_size = vec![0u32; if rendezvous { ng } else { 0 }];
    let mut comp_never = vec![false; if rendezvous { ng } else { 0 }];
    let mut comp_root = vec![0u32; if rendezvous { ng } else { 0 }];
    // CSR of members per root.
    let mut comp_start = vec![0u32; if rendezvous { ng + 1 } else { 0 }];
    let mut comp_members = vec![0u32; if rendezvous { ng } else { 0 }];
    if rendezvous {
        for g in 0..ng {
            let r = find(&mut parent, g as u32);
            comp_root[g] = r;
            comp_size[r as usize] += 1;
            if never[g] {
                comp_never[r as usize] = true;
            }
        }
        let mut acc = 0u32;
        for g in 0..ng {
            comp_start[g] = acc;
            acc += comp_size[g];
        }
        comp_start[ng] = acc;
        let mut fill = comp_start.clone();
        for g in 0..ng {
            let r = comp_root[g] as usize;
            comp_members[fill[r] as usize] = g as u32;
            fill[r] += 1;
        }
    }
    let mut rev_reqs: Vec<Vec<u32>> = if rendezvous {
        Vec::new()
    } else {
        vec![Vec::new(); ng]
    };
    if !rendezvous {
        for g in 0..ng {
            for &h in &reqs[g] {
                rev_reqs[h as usize].push(g as u32);
            }
        }
    }

    // ---- Simulation. ----
    let mut cpos = vec![0u32; np];
    let ns = stream_groups.len();
    // Position of each communication stream in its list of groups.
    let mut spos: Vec<usize> = vec![0; ns];
    // The group at the head of stream k (valid while spos[k] < len).
    let head_of = |k: usize, spos: &[usize]| stream_groups[k][spos[k]] as usize;
    let mut posted = vec![false; ng];
    let mut complete = vec![false; ng];
    let mut posted_cnt = vec![0u32; if rendezvous { ng } else { 0 }];
    let mut in_work = vec![true; np];
    let mut work: Vec<u32> = (0..np as u32).rev().collect();

    let op_done = |id: u32, posted: &[bool], complete: &[bool]| -> bool {
        let g = ops.group[id as usize] as usize;
        if rendezvous {
            return complete[g];
        }
        if !posted[g] {
            return false;
        }
        match op_req[id as usize] {
            NONE => true,
            NEVER => false,
            h => posted[h as usize],
        }
    };
    while let Some(r) = work.pop() {
        let r = r as usize;
        in_work[r] = false;
        loop {
            let mut progressed = false;
            // Compute stream.
            let items = &items[r];
            while (cpos[r] as usize) < items.len() {
                let (_, (a, b)) = items[cpos[r] as usize];
                let ready = waits[a as usize..b as usize]
                    .iter()
                    .all(|&id| op_done(id, &posted, &complete));
                if !ready {
                    break;
                }
                cpos[r] += 1;
                progressed = true;
            }
            // Comm streams (one per channel).
            for &k in &rank_streams[r] {
                while spos[k] < stream_groups[k].len() {
                    let g = stream_groups[k][spos[k]] as usize;
                    if !posted[g] {
                        let prod = groups.producer[g];
                        if prod != NONE && cpos[r] <= prod {
                            break;
                        }
                        posted[g] = true;
                        progressed = true;
                        if rendezvous {
                            let root = comp_root[g] as usize;
                            posted_cnt[root] += 1;
                            if posted_cnt[root] == comp_size[root] && !comp_never[root] {
                                for &h in &comp_members
                                    [comp_start[root] as usize..comp_start[root + 1] as usize]
                                {
                                    complete[h as usize] = true;
                                    let hr = groups.rank[h as usize] as usize;
                                    if hr != r && !in_work[hr] {
                                        in_work[hr] = true;
                                        work.push(hr as u32);
                                    }
                                }
                            }
                        } else {
                            // Check g and everything that waits on g.
                            let mut to_check = vec![g as u32];
                            to_check.extend_from_slice(&rev_reqs[g]);
                            for h in to_check {
                                let h = h as usize;
                                if posted[h]
                                    && !complete[h]
                                    && !never[h]
                                    && reqs[h].iter().all(|&x| posted[x as usize])
                                {
                                    complete[h] = true;
                                    let hr = groups.rank[h] as usize;
                                    if hr != r && !in_work[hr] {
                                        in_work[hr] = true;
                                        work.push(hr as u32);
                                    }
                                }
                            }
                            // Ops that wait on g (receives whose partner is in g) may be done
                            // now even if their group is not: wake their ranks' compute streams.
                            for &h in &rev_reqs[g] {
                                let hr = groups.rank[h as usize] as usize;
                                if hr != r && !in_work[hr] {
                                    in_work[hr] = true;
                                    work.push(hr as u32);
                                }
                            }
                        }
                    }
                    if complete[g] {
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

    // ---- Stuck? ----
    let blocked_c = |r: usize, cpos: &[u32]| (cpos[r] as usize) < items[r].len();
    let blocked_m = |k: usize, spos: &[usize]| spos[k] < stream_groups[k].len();
    let any_stuck = (0..np).any(|r| blocked_c(r, &cpos)) || (0..ns).any(|k| blocked_m(k, &spos));
    if !any_stuck {
        return errs;
    }
    // Node ids: r = compute stream of rank r; np + k = communication stream k.
    let comm_at = |g: usize| Pos {
        rank: groups.rank[g],
        pos: groups.pos[g],
    };
    let instr_txt = |pos: Pos| instr_to_string(&p.ranks[pos.rank as usize][pos.pos as usize]);
    let step_of = |node: usize, parent: &mut Vec<u32>| -> (WaitStep, Option<usize>) {
        if node < np {
            let r = node;
            let it = cpos[r] as usize;
            let at = Pos {
                rank: r as u32,
                pos: items[r][it].0,
            };
            let (a, b) = items[r][it].1;
            let id = waits[a as usize..b as usize]
                .iter()
                .copied()
                .find(|&id| !op_done(id, &posted, &complete))
                .expect("blocked item has an incomplete wait");
            let g = ops.group[id as usize] as usize;
            let k = g_stream[g] as usize;
            let head = head_of(k, &spos);
            let what = op_text(comm_ref[id as usize]);
            let waits_for = if head == g {
                format!("its input `{what}` has not completed")
            } else {
                format!(
                    "its input `{what}` (position {}) is queued on the communication stream behind `{}` (position {})",
                    groups.pos[g],
                    instr_txt(comm_at(head)),
                    groups.pos[head]
                )
            };
            (
                WaitStep {
                    rank: r as u32,
                    stream: Stream::Compute,
                    at,
                    waits_for,
                },
                Some(np + k),
            )
        } else {
            let k = node - np;
            let r = stream_rank[k] as usize;
            let g = head_of(k, &spos);
            let at = comm_at(g);
            if !posted[g] {
                let prod = groups.producer[g] as usize;
                let ppos = Pos {
                    rank: r as u32,
                    pos: items[r][prod].0,
                };
                let waits_for = format!(
                    "it sends the output of `{}` (position {}), which has not run on the compute stream",
                    instr_txt(ppos),
                    ppos.pos
                );
                return (
                    WaitStep {
                        rank: r as u32,
                        stream: Stream::Comm,
                        at,
                        waits_for,
                    },
                    Some(r),
                );
            }
            // Posted, not complete: find an unposted group it needs.
            let mut need: Option<usize> = None;
            if rendezvous {
                let root = find(parent, g as u32) as usize;
                let _ = root;
                let root = comp_root[g] as usize;
                let members =
                    &comp_members[comp_start[root] as usize..comp_start[root + 1] as usize];
                // A member queued behind this group on its own stream blocks it for good.
                need = members
                    .iter()
                    .map(|&h| h as usize)
                    .find(|&h| !posted[h] && g_stream[h] as usize == k)
                    .or_else(|| members.iter().map(|&h| h as usize).find(|&h| !posted[h]));
            } else {
                need = reqs[g]
                    .iter()
                    .map(|&h| h as usize)
                    .find(|&h| !posted[h])
                    .or(need);
            }
            match need {
                Some(h) => {
                    let q = groups.rank[h] as usize;
                    let via = if rendezvous { match_path(g, h, &groups, &ops) } else { Vec::new() };
                    let via_txt = if via.len() > 2 {
                        format!(
                            " (matched with it through {})",
                            via[1..via.len() - 1]
                                .iter()
                                .map(|&x| format!("rank {} `{}` (position {})", groups.rank[x], instr_txt(comm_at(x)), groups.pos[x]))
                                .collect::<Vec<_>>()
                                .join(", then ")
                        )
                    } else {
                        String::new()
                    };
                    let qk = g_stream[h] as usize;
                    let qhead = head_of(qk, &spos);
                    let partner_txt = instr_txt(comm_at(h));
                    let waits_for = if qk == k {
                        format!(
                            "it completes only together with `{partner_txt}` (position {}) on its own stream{via_txt}, which cannot be posted before this group completes",
                            groups.pos[h]
                        )
                    } else if qhead == h {
                        format!(
                            "rank {q} has not posted its matching `{partner_txt}` (position {}){via_txt}",
                            groups.pos[h]
                        )
                    } else {
                        format!(
                            "rank {q} has not posted its matching `{partner_txt}` (position {}){via_txt}, queued behind `{}` (position {})",
                            groups.pos[h],
                            instr_txt(comm_at(qhead)),
                            groups.pos[qhead]
                        )
                    };
                    (
                        WaitStep {
                            rank: r as u32,
                            stream: Stream::Comm,
                            at,
                            waits_for,
                        },
                        Some(np + qk),
                    )
                }
                None => (
                    WaitStep {
                        rank: r as u32,
                        stream: Stream::Comm,
                        at,
                        waits_for: "one of its ops has no partner (see the matching errors), so it can never complete".into(),
                    },
                    None,
                ),
            }
        }
    };
    let mut reported_cycles: std::collections::HashSet<Vec<usize>> = Default::default();
    let mut reported_comps: std::collections::HashSet<u32> = Default::default();
    let mut visited = vec![false; np + ns];
    let mut n_reports = 0;
    for start in 0..np + ns {
        let blocked = if start < np {
            blocked_c(start, &cpos)
        } else {
            blocked_m(start - np, &spos)
        };
        if !blocked || visited[start] {
            continue;
        }
        let mut chain: Vec<(usize, WaitStep)> = Vec::new();
        let mut idx_in_chain: HashMap<usize, usize> = HashMap::new();
        let mut node = start;
        loop {
            if let Some(&i) = idx_in_chain.get(&node) {
                let cyc: Vec<(usize, WaitStep)> = chain[i..].to_vec();
                let mut key: Vec<usize> = cyc.iter().map(|c| c.0).collect();
                key.sort_unstable();
                // Under rendezvous, cycles through the same matched set of groups are one
                // fault seen from several ranks: report it once.
                let comps: Vec<u32> = if rendezvous {
                    cyc.iter()
                        .filter(|c| c.0 >= np)
                        .map(|c| comp_root[head_of(c.0 - np, &spos)])
                        .collect()
                } else {
                    Vec::new()
                };
                let seen_comp =
                    !comps.is_empty() && comps.iter().all(|c| reported_comps.contains(c));
                reported_comps.extend(comps);
                if !seen_comp && reported_cycles.insert(key) && n_reports < 10 {
                    n_reports += 1;
                    // Rotate so the lowest rank's step comes first.
                    let mut steps: Vec<WaitStep> = cyc.into_iter().map(|c| c.1).collect();
                    let min_i = steps
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, s)| (s.rank, s.stream == Stream::Compute))
                        .map(|(i, _)| i)
                        .unwrap_or(0);
                    steps.rotate_left(min_i);
                    errs.push(CommError::Deadlock(steps));
                }
                break;
            }
            if visited[node] {
                break; // joins a chain already reported
            }
            visited[node] = true;
            idx_in_chain.insert(node, chain.len());
            let (step, next) = step_of(node, &mut parent);
            chain.push((node, step));
            match next {
                Some(nx) => node = nx,
                None => {
                    if n_reports < 10 {
                        n_reports += 1;
                        errs.push(CommError::Stall(chain.into_iter().map(|c| c.1).collect()));
                    }
                    break;
                }
            }
        }
    }
    errs
}

/// Shortest chain of groups from `g` to `h` through matched pairs (for explanations).
fn match_path(g: usize, h: usize, groups: &Groups, ops: &Ops) -> Vec<usize> {
    let mut prev: HashMap<usize, usize> = HashMap::new();
    let mut queue = std::collections::VecDeque::from([g]);
    prev.insert(g, g);
    while let Some(x) = queue.pop_front() {
        if x == h {
            break;
        }
        let (a, b) = groups.ops[x];
        for id in a..b {
            let pt = ops.partner[id as usize];
            if pt == NONE {
                continue;
            }
            let y = ops.group[pt as usize] as usize;
            if let std::collections::hash_map::Entry::Vacant(e) = prev.entry(y) {
                e.insert(x);
                queue.push_back(y);
            }
        }
    }
    if !prev.contains_key(&h) {
        return vec![g, h];
    }
    let mut path = vec![h];
    let mut x = h;
    while x != g {
        x = prev[&x];
        path.push(x);
    }
    path.reverse();
    path
}
