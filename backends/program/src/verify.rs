//! The program verifier (see the crate docs): events, buffers under happens-before, and
//! a run of all ranks to completion.

use crate::format::*;
use crate::lower::rejected;
use crate::model::Scope;
use schedc_ir::Program;
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// What [`verify`] found (on success).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// Instructions over all ranks.
    pub ops: usize,
    /// Messages (sends).
    pub messages: usize,
    /// Collective instances.
    pub collectives: usize,
    /// Per rank, the most `stash` buffers live at once in the compute stream's order (the
    /// activation peak of the rank's own forwards; a stash lent to another rank (BPipe's
    /// `LEND`) is still counted on its owner here, see `peak_activations`).
    pub peak_stash: Vec<u32>,
    /// Per rank, the peak of live activations as `schedc check` counts them (pass 6,
    /// `schedc::passes::liveness`): a lent stash on its holder from the `LEND` to the
    /// `RETURN`, an offloaded one off the device. What a rank holds at its peak, in stashes;
    /// memory estimates use it.
    pub peak_activations: Vec<u32>,
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
    let (live, _) = schedc::passes::liveness::analyze(source, None);
    let peak_activations = set
        .ranks
        .iter()
        .map(|rp| {
            live.get(rp.coords.pp as usize)
                .map_or(0, |l| u32::try_from(l.peak).unwrap_or(u32::MAX))
        })
        .collect();
    Ok(VerifyReport {
        ops: set.len(),
        messages,
        collectives,
        peak_stash,
        peak_activations,
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
    // The EP stream, when there is one, comes after the comm streams, then the TP stream.
    let mut comm_end = kinds.len();
    if comm_end > 0 && kinds[comm_end - 1] == StreamKind::Copy {
        comm_end -= 1;
    }
    if comm_end > 0 && kinds[comm_end - 1] == StreamKind::Tp {
        comm_end -= 1;
    }
    if comm_end > 0 && kinds[comm_end - 1] == StreamKind::Ep {
        comm_end -= 1;
    }
    let channels_ok = comm_end >= 2
        && kinds[0] == StreamKind::Compute
        && kinds[1] == (StreamKind::Comm { channel: 0 })
        && kinds[2..comm_end].iter().all(|k| match k {
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
                "a rank program has a compute stream, a comm stream for channel 0, then one per other channel in increasing order, then optionally the ep stream, then optionally the tp stream, then optionally the copy stream; got {kinds:?}"
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
        // Lifetimes: the allocations and releases alternate under happens-before,
        // alloc_1 < free_1 < alloc_2 < ... (a stash offloaded and reloaded, or recomputed,
        // lives twice); every use falls inside one lifetime.
        let mut allocs: Vec<(bool, (usize, usize))> = list
            .iter()
            .filter_map(|&(a, p)| match a {
                Acc::Alloc(z) => Some((z, p)),
                _ => None,
            })
            .collect();
        let mut frees: Vec<(usize, usize)> = list
            .iter()
            .filter(|(a, _)| *a == Acc::Free)
            .map(|&(_, p)| p)
            .collect();
        if allocs.is_empty() {
            return Err(err(format!("{buf} is allocated 0 times")));
        }
        if frees.len() != allocs.len() {
            return Err(err(format!(
                "{buf} is allocated {} times and freed {} times",
                allocs.len(),
                frees.len()
            )));
        }
        // A total order that extends happens-before (a strictly earlier op knows strictly
        // fewer ops in all); the chain is checked below.
        let weight = |p: (usize, usize)| -> u64 { vc[p.0][p.1].iter().map(|&c| c as u64).sum() };
        allocs.sort_by_key(|a| (weight(a.1), a.1));
        frees.sort_by_key(|&f| (weight(f), f));
        for (k, (&(_, ap), &fp)) in allocs.iter().zip(&frees).enumerate() {
            if !hb(ap, fp) {
                return Err(err(format!(
                    "{buf} is freed at {} before its allocation",
                    loc(fp)
                )));
            }
            if let Some(&(_, next)) = allocs.get(k + 1) {
                if !hb(fp, next) {
                    return Err(err(format!(
                        "{buf} is allocated again at {} before (or unordered with) its release at {}",
                        loc(next),
                        loc(fp)
                    )));
                }
            }
        }
        let uses: Vec<(Acc, (usize, usize))> = list
            .iter()
            .filter(|(a, _)| matches!(a, Acc::Read | Acc::Write))
            .copied()
            .collect();
        // The lifetime of each use.
        let mut life = Vec::with_capacity(uses.len());
        for &(_, p) in &uses {
            let k = allocs.iter().rposition(|&(_, ap)| hb(ap, p));
            let Some(k) = k else {
                return Err(err(format!(
                    "{buf} is used at {} before its allocation",
                    loc(p)
                )));
            };
            if !hb(p, frees[k]) {
                return Err(err(format!(
                    "{buf} is used at {} after (or unordered with) its release at {}",
                    loc(p),
                    loc(frees[k])
                )));
            }
            life.push(k);
        }
        for (x, &(a, p)) in uses.iter().enumerate() {
            if a == Acc::Read && !allocs[life[x]].0 {
                let written = uses
                    .iter()
                    .zip(&life)
                    .any(|(&(b, q), &l)| l == life[x] && b == Acc::Write && q != p && hb(q, p));
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
    // Stash peak in compute-stream order; the copy stream's allocations and releases count
    // where the compute stream issues them (its record of the event that copy block waits
    // for), as the IR counts an offload's memory free once the op is issued.
    let mut issued: HashMap<u32, Vec<i32>> = HashMap::new();
    if let Some(copy) = rp.streams.iter().find(|s| s.kind == StreamKind::Copy) {
        let mut cur: Option<u32> = None;
        for op in &copy.ops {
            match op {
                Op::Wait { event } => cur = Some(*event),
                Op::Alloc {
                    buf: Buf::Stash { .. },
                    ..
                } => issued.entry(cur.unwrap_or(u32::MAX)).or_default().push(1),
                Op::Free {
                    buf: Buf::Stash { .. },
                } => issued.entry(cur.unwrap_or(u32::MAX)).or_default().push(-1),
                _ => {}
            }
        }
    }
    let (mut live, mut peak) = (0i64, 0i64);
    let step = |d: i32, live: &mut i64, peak: &mut i64| {
        *live += d as i64;
        *peak = (*peak).max(*live);
    };
    for op in &rp.streams[0].ops {
        match op {
            Op::Alloc {
                buf: Buf::Stash { .. },
                ..
            } => step(1, &mut live, &mut peak),
            Op::Free {
                buf: Buf::Stash { .. },
            } => step(-1, &mut live, &mut peak),
            Op::Record { event } => {
                for d in issued.remove(event).unwrap_or_default() {
                    step(d, &mut live, &mut peak);
                }
            }
            _ => {}
        }
    }
    Ok(peak.max(0) as u32)
}

/// Key of a collective instance.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum CollKey {
    A2a(u32, u32, u32, A2a, Vec<u32>),
    Tp(u32, u32, u32, Tp, Vec<u32>),
    TpGrad(u32, Vec<u32>),
    Replica(u32, Vec<u32>),
    AllReduce(u32, Scope, Vec<u32>),
    /// The schedule's own collective: communicator, label, group, and which call of the
    /// communicator it is on the rank (the k-th matches the k-th of every member).
    Schedule(String, String, Vec<u32>, u32),
}

/// `occurrence`: for an [`Op::Collective`], how many collectives on its communicator the
/// rank issued before it.
fn coll_key(rank: u32, op: &Op, occurrence: u32) -> Option<(CollKey, Vec<u32>)> {
    match op {
        Op::Collective { comm, label, group } => Some((
            CollKey::Schedule(comm.clone(), label.clone(), group.clone(), occurrence),
            group.clone(),
        )),
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
        Op::TpCollective {
            stage,
            mb,
            layer,
            phase,
            group,
        } => Some((
            CollKey::Tp(*stage, *mb, *layer, *phase, group.clone()),
            group.clone(),
        )),
        Op::TpGradAllReduce { stage, group } => {
            Some((CollKey::TpGrad(*stage, group.clone()), group.clone()))
        }
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
///
/// A worklist of ranks: a rank runs until every stream is blocked, and is run again only
/// when something it may wait for happens (a send to it, the last member arriving at one
/// of its collectives), so the work is linear in the instructions plus the wake-ups, not
/// ranks x rounds.
// Index loops over parallel arrays (streams, pointers) read better than zipped iterators.
#[allow(clippy::needless_range_loop)]
fn simulate(set: &ProgramSet) -> Result<(usize, usize), ProgramError> {
    let n = set.ranks.len();
    let mut ptr: Vec<Vec<usize>> = set.ranks.iter().map(|r| vec![0; r.streams.len()]).collect();
    let mut recorded: Vec<HashSet<u32>> = vec![HashSet::new(); n];
    let mut sent: HashMap<(u32, u32, Buf), u32> = HashMap::new();
    let mut received: HashMap<(u32, u32, Buf), u32> = HashMap::new();
    // Keyed by the collective and how many identical ones the rank ran before it (a
    // recomputed forward runs its layer's all-to-alls a second time, as every member does).
    let mut arrived: HashMap<(CollKey, u32), HashSet<u32>> = HashMap::new();
    let repeat: Vec<HashMap<(usize, usize), u32>> = set
        .ranks
        .iter()
        .map(|rp| {
            let mut seen: HashMap<CollKey, u32> = HashMap::new();
            let mut out = HashMap::new();
            for (s, st) in rp.streams.iter().enumerate() {
                for (i, op) in st.ops.iter().enumerate() {
                    if matches!(op, Op::Collective { .. }) {
                        continue;
                    }
                    if let Some((k, _)) = coll_key(rp.rank, op, 0) {
                        let n = seen.entry(k).or_default();
                        out.insert((s, i), *n);
                        *n += 1;
                    }
                }
            }
            out
        })
        .collect();
    let mut messages = 0usize;
    // occurrence[g][(s, i)]: the k of the collective at stream s, op i of rank g.
    let occurrence: Vec<HashMap<(usize, usize), u32>> = set
        .ranks
        .iter()
        .map(|rp| {
            let mut seen: HashMap<&str, u32> = HashMap::new();
            let mut out = HashMap::new();
            for (s, st) in rp.streams.iter().enumerate() {
                for (i, op) in st.ops.iter().enumerate() {
                    if let Op::Collective { comm, .. } = op {
                        let k = seen.entry(comm.as_str()).or_default();
                        out.insert((s, i), *k);
                        *k += 1;
                    }
                }
            }
            out
        })
        .collect();
    for (g, rp) in set.ranks.iter().enumerate() {
        if rp.rank != g as u32 {
            return Err(ProgramError::Deadlock(format!(
                "rank program {g} says it is rank {}",
                rp.rank
            )));
        }
    }
    let mut queued = vec![true; n];
    let mut work: std::collections::VecDeque<usize> = (0..n).collect();
    let wake = |r: usize, queued: &mut Vec<bool>, work: &mut std::collections::VecDeque<usize>| {
        if r < queued.len() && !queued[r] {
            queued[r] = true;
            work.push_back(r);
        }
    };
    while let Some(g) = work.pop_front() {
        queued[g] = false;
        let rp = &set.ranks[g];
        loop {
            let mut moved = false;
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
                        _ => match coll_key(
                            g as u32,
                            op,
                            occurrence[g].get(&(s, ptr[g][s])).copied().unwrap_or(0),
                        ) {
                            Some((key, group)) => {
                                if !group.contains(&(g as u32)) {
                                    return Err(invalid(
                                        rp,
                                        s,
                                        ptr[g][s],
                                        "the rank is not in the collective's group".into(),
                                    ));
                                }
                                let nth = repeat[g].get(&(s, ptr[g][s])).copied().unwrap_or(0);
                                let a = arrived.entry((key, nth)).or_default();
                                let first_visit = a.insert(g as u32);
                                let all = group.iter().all(|m| a.contains(m));
                                if all && first_visit {
                                    // This rank completes the collective: the others waiting
                                    // at it can go on.
                                    for &m in &group {
                                        if m as usize != g {
                                            wake(m as usize, &mut queued, &mut work);
                                        }
                                    }
                                }
                                all
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
                            wake(*peer as usize, &mut queued, &mut work);
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
            if !moved {
                break;
            }
        }
    }
    let done = (0..n).all(|g| {
        (0..set.ranks[g].streams.len()).all(|s| ptr[g][s] == set.ranks[g].streams[s].ops.len())
    });
    if !done {
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
