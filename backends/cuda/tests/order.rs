//! The host driver against the recording fake of the device API: on every rank and every
//! stream, the device calls follow the verified program exactly (marks in program order;
//! `record e` / `wait e` as the rank's events for `e`; every kernel issues device work;
//! sends, receives and all-to-alls as NCCL calls on the stream's own communicator), and
//! NCCL groups are symmetric across ranks (every grouped send has its receive in the
//! matching group of the peer, with the same size).

use schedc::input::{load_spec, Overrides};
use schedc_cuda::api::{DType, EventId, StreamId};
use schedc_cuda::driver::{execute_on, execute_rank, stream_kinds, ExecOptions};
use schedc_cuda::layout::{Dims, StashLayout};
use schedc_cuda::record::{Call, Recorder};
use schedc_program::data::Data;
use schedc_program::mesh::Mesh;
use schedc_program::{Buf, LowerOptions, ModelConfig, Op, ProgramSet, RankProgram};
use std::collections::HashMap;

/// A spec of `specs/`, or a file of the shared reference data (`ref:PATH`, e.g. DeepSeek's
/// DualPipe traces, whose `COMM{...}` groups hold crossing sends).
fn lower(name: &str, pp: u32, mb: u32, mesh: &str) -> ProgramSet {
    lower_opts(name, pp, mb, mesh, LowerOptions::default())
}

/// `lower` with lowering options (`--sequence-parallel`).
fn lower_opts(name: &str, pp: u32, mb: u32, mesh: &str, opts: LowerOptions) -> ProgramSet {
    let root = env!("CARGO_MANIFEST_DIR");
    let src = if let Some(r) = name.strip_prefix("ref:") {
        let path = format!("{root}/../../../shared/reference/{r}");
        schedc::input::load_path(&path, &Overrides::default())
            .unwrap_or_else(|e| panic!("{path}: {e:?}"))
            .program
    } else {
        let text = std::fs::read_to_string(format!("{root}/../../specs/{name}.sched")).unwrap();
        let ov = Overrides {
            pp: Some(pp),
            microbatches: Some(mb),
            ..Default::default()
        };
        load_spec(&text, &ov).unwrap().program
    };
    let mesh: Mesh = mesh.parse().unwrap();
    ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), opts).unwrap()
}

const STEPS: usize = 2;

/// The calls of stream `s` in order, cut at its marks: `(mark, calls after it)`.
fn segments(log: &[(Option<StreamId>, Call)], s: usize) -> Vec<(String, Vec<Call>)> {
    let mut out: Vec<(String, Vec<Call>)> = Vec::new();
    for (st, c) in log {
        if *st != Some(StreamId(s as u32)) {
            continue;
        }
        match c {
            Call::Mark(m) => out.push((m.clone(), Vec::new())),
            other => {
                if let Some(last) = out.last_mut() {
                    last.1.push(other.clone());
                }
            }
        }
    }
    out
}

/// Checks one rank's log against its program (see the module docs). `nccl`: the
/// transport's calls are NCCL's; else the single-GPU copies.
fn check_rank(
    set: &ProgramSet,
    prog: &RankProgram,
    log: &[(Option<StreamId>, Call)],
    nccl: bool,
) -> Result<(), String> {
    let model = set
        .manifest
        .model
        .as_ref()
        .ok_or("a model-granularity program has schedc's model")?;
    // With Megatron sequence parallelism the messages carry the TP shard's rows.
    let m = &set.manifest;
    let dims =
        Dims::with_sequence_parallel(model, &m.mesh, DType::F32, m.sequence_parallel.then_some(0))?;
    let kinds = stream_kinds(set);
    let r = prog.rank;
    // The bytes of a message's buffer: an activation or gradient, or (BPipe) a stash as
    // the stage's owner lays it out.
    let msg_bytes = |b: &Buf| match b {
        Buf::Stash { stage, .. } | Buf::Host { stage, .. } => set
            .ranks
            .iter()
            .flat_map(|p| &p.stages)
            .find(|x| x.stage == *stage)
            .map(|x| StashLayout::new(&dims, x).bytes)
            .unwrap_or(0),
        _ => dims.act_bytes(),
    };
    for (s, stream) in prog.streams.iter().enumerate() {
        // The copy stream (memory ops) sends nothing and has no communicator of its own.
        let comm = match kinds.iter().position(|k| *k == stream.kind) {
            Some(c) => c,
            None if stream.kind == schedc_program::StreamKind::Copy => 0,
            None => panic!("rank {r}: no communicator for the {} stream", stream.kind),
        };
        let segs = segments(log, s);
        let want: Vec<String> = (0..STEPS)
            .flat_map(|_| stream.ops.iter().map(|o| o.to_string()))
            .collect();
        let got: Vec<String> = segs.iter().map(|x| x.0.clone()).collect();
        if got != want {
            let at = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(want.len()));
            return Err(format!(
                "rank {r}, {} stream: call {at} is {:?}, the program has {:?}",
                stream.kind,
                got.get(at),
                want.get(at)
            ));
        }
        let all: Vec<&Op> = (0..STEPS).flat_map(|_| stream.ops.iter()).collect();
        let is_msg = |o: &Op| matches!(o, Op::Send { .. } | Op::Recv { .. });
        for (k, ((_, own), op)) in segs.iter().zip(&all).enumerate() {
            // In NCCL mode a run of adjacent messages (one IR group) is posted at its first
            // message: its calls are those of the whole run.
            let mut calls = own.clone();
            if nccl && is_msg(op) {
                let first = (0..=k)
                    .rev()
                    .take_while(|&j| is_msg(all[j]))
                    .last()
                    .unwrap_or(k);
                calls = (first..all.len())
                    .take_while(|&j| is_msg(all[j]))
                    .flat_map(|j| segs[j].1.clone())
                    .collect();
            }
            let calls = &calls;
            let bad = |why: &str| {
                Err(format!(
                    "rank {r}, {} stream, `{op}`: {why}; calls {calls:?}",
                    stream.kind
                ))
            };
            match op {
                Op::Record { event } if calls.first() != Some(&Call::Record(EventId(*event))) => {
                    return bad("not recorded as its own event");
                }
                Op::Wait { event } if calls.first() != Some(&Call::Wait(EventId(*event))) => {
                    return bad("not waited as its own event");
                }
                Op::Kernel(_) => {
                    if !calls
                        .iter()
                        .any(|c| matches!(c, Call::Launch(_) | Call::Gemm(..)))
                    {
                        return bad("no device work");
                    }
                    if calls
                        .iter()
                        .any(|c| matches!(c, Call::Record(_) | Call::Wait(_)))
                    {
                        return bad("a kernel records or waits");
                    }
                }
                Op::Send { peer, buf } => {
                    let ok = if nccl {
                        calls.contains(&Call::Send {
                            comm,
                            peer: *peer,
                            bytes: msg_bytes(buf),
                        })
                    } else {
                        calls.contains(&Call::Dtod(msg_bytes(buf)))
                            && calls.iter().any(|c| matches!(c, Call::Record(_)))
                    };
                    if !ok {
                        return bad(
                            "not a send of the activation's size on the stream's communicator",
                        );
                    }
                }
                Op::Recv { peer, buf } => {
                    let ok = if nccl {
                        calls.contains(&Call::Recv {
                            comm,
                            peer: *peer,
                            bytes: msg_bytes(buf),
                        })
                    } else {
                        matches!(calls.first(), Some(Call::Wait(_)))
                            && calls.contains(&Call::Dtod(msg_bytes(buf)))
                    };
                    if !ok {
                        return bad("not a receive of the activation's size");
                    }
                }
                Op::AllToAll { group, .. } => {
                    let others = group.iter().filter(|m| **m != r);
                    for m in others {
                        let ok = if nccl {
                            calls.contains(&Call::Send {
                                comm,
                                peer: *m,
                                bytes: dims.slot_bytes,
                            }) && calls.contains(&Call::Recv {
                                comm,
                                peer: *m,
                                bytes: dims.slot_bytes,
                            })
                        } else {
                            true
                        };
                        if !ok {
                            return bad("a member is missing from the all-to-all");
                        }
                    }
                    let copies = calls
                        .iter()
                        .filter(|c| **c == Call::Dtod(dims.slot_bytes))
                        .count();
                    let want = if nccl { 1 } else { group.len() };
                    if copies != want {
                        return bad(&format!("{copies} slot copies, expected {want}"));
                    }
                }
                Op::Offload { stage, mb } | Op::Reload { stage, mb } => {
                    let n = msg_bytes(&Buf::Stash {
                        stage: *stage,
                        mb: *mb,
                    });
                    let want = if matches!(op, Op::Offload { .. }) {
                        Call::DtohAsync(n)
                    } else {
                        Call::HtodAsync(n)
                    };
                    if calls != &vec![want] || stream.kind != schedc_program::StreamKind::Copy {
                        return bad("not one asynchronous copy of the stash on the copy stream");
                    }
                }
                Op::TpCollective { group, .. } if nccl => {
                    // A group-order sum: a send to and a receive from every other member, on
                    // the tp stream's communicator.
                    for m in group.iter().filter(|m| **m != r) {
                        let to = calls
                            .iter()
                            .any(|c| matches!(c, Call::Send { comm: k, peer, .. } if *k == comm && peer == m));
                        let from = calls
                            .iter()
                            .any(|c| matches!(c, Call::Recv { comm: k, peer, .. } if *k == comm && peer == m));
                        if !(to && from) {
                            return bad("a TP member is missing from the all-reduce");
                        }
                    }
                    if stream.kind != schedc_program::StreamKind::Tp {
                        return bad("a TP all-reduce off the tp stream");
                    }
                }
                Op::ReplicaSum { peer, .. }
                    if nccl
                        && !calls
                            .iter()
                            .any(|c| matches!(c, Call::Send { peer: p, .. } if p == peer)) =>
                {
                    return bad("the gradients are not sent to the other copy");
                }
                _ => {}
            }
        }
    }
    Ok(())
}

fn nccl_logs(set: &ProgramSet) -> Vec<Vec<(Option<StreamId>, Call)>> {
    let data = Data::builtin();
    let opts = ExecOptions {
        steps: STEPS,
        ..ExecOptions::default()
    };
    set.ranks
        .iter()
        .map(|prog| {
            let rec = Recorder::new(prog.rank, DType::F32);
            execute_rank(&rec, &rec, set, prog.rank, &data, &opts).unwrap();
            rec.log()
        })
        .collect()
}

const CASES: [(&str, u32, u32, &str); 8] = [
    ("ref:dualpipe/dualpipe_P4_N8.json", 4, 8, "pp=4"),
    ("1f1b", 4, 8, "pp=4"),
    ("zb_h1", 4, 8, "pp=4"),
    ("dualpipe", 4, 8, "pp=4"),
    ("interleaved_1f1b", 2, 4, "pp=2,ep=2,dp=2"),
    ("dualpipe", 2, 4, "pp=2,sp=2,ep=2"),
    // Tensor parallelism: the TP all-reduces on the `tp` stream's own communicator.
    ("1f1b", 2, 4, "pp=2,tp=2"),
    ("dualpipe", 2, 4, "pp=2,tp=2,ep=2"),
];

#[test]
fn nccl_mode_issues_every_stream_in_program_order() {
    for (name, pp, mb, mesh) in CASES {
        let set = lower(name, pp, mb, mesh);
        let logs = nccl_logs(&set);
        for (prog, log) in set.ranks.iter().zip(&logs) {
            check_rank(&set, prog, log, true).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        }
        let calls: usize = logs.iter().map(|l| l.len()).sum();
        println!("order {name} P={pp} M={mb} mesh {mesh} (NCCL mode): {} ranks, {calls} device calls, program order on every stream", set.ranks.len());
    }
}

#[test]
fn single_gpu_mode_issues_every_stream_in_program_order() {
    for (name, pp, mb, mesh) in CASES {
        let set = lower(name, pp, mb, mesh);
        let recs: Vec<Recorder> = set
            .ranks
            .iter()
            .map(|p| Recorder::new(p.rank, DType::F32))
            .collect();
        let gpus: Vec<&dyn schedc_cuda::api::Gpu> = recs
            .iter()
            .map(|r| r as &dyn schedc_cuda::api::Gpu)
            .collect();
        let opts = ExecOptions {
            steps: STEPS,
            ..ExecOptions::default()
        };
        execute_on(&gpus, &set, &Data::builtin(), &opts).unwrap();
        for (prog, rec) in set.ranks.iter().zip(&recs) {
            check_rank(&set, prog, &rec.log(), false)
                .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        }
        println!("order {name} P={pp} M={mb} mesh {mesh} (single-GPU mode): program order on every stream");
    }
}

/// Issue 23: Megatron sequence parallelism's all-gathers and reduce-scatters in NCCL mode
/// (grouped sends and receives over the TP group, on the `tp` stream's communicator) and
/// the replicated-weight gradient sum (on the comm stream): program order on every stream
/// in both modes, every NCCL group symmetric across ranks, and every call completes under
/// rendezvous semantics.
#[test]
fn megatron_sequence_parallel_issues_program_order_and_symmetric_nccl_groups() {
    let opts = LowerOptions {
        sequence_parallel: true,
        ..LowerOptions::default()
    };
    for (name, mesh) in [("1f1b", "pp=2,tp=2,sp=2"), ("dualpipe", "pp=2,tp=2,ep=2")] {
        let set = lower_opts(name, 2, 4, mesh, opts);
        assert!(set.manifest.sequence_parallel);
        let logs = nccl_logs(&set);
        for (prog, log) in set.ranks.iter().zip(&logs) {
            check_rank(&set, prog, log, true).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        }
        let n = check_symmetric(&logs).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        let u = rendezvous(&logs).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        let recs: Vec<Recorder> = set
            .ranks
            .iter()
            .map(|p| Recorder::new(p.rank, DType::F32))
            .collect();
        let gpus: Vec<&dyn schedc_cuda::api::Gpu> = recs
            .iter()
            .map(|r| r as &dyn schedc_cuda::api::Gpu)
            .collect();
        let eo = ExecOptions {
            steps: STEPS,
            ..ExecOptions::default()
        };
        execute_on(&gpus, &set, &Data::builtin(), &eo).unwrap();
        for (prog, rec) in set.ranks.iter().zip(&recs) {
            check_rank(&set, prog, &rec.log(), false)
                .unwrap_or_else(|e| panic!("{name} {mesh} single: {e}"));
        }
        println!("order {name} mesh {mesh} --sequence-parallel: program order in both modes, {n} NCCL messages symmetric, {u} NCCL units complete");
    }
}

/// One NCCL group of a rank (or a lone call): its sends and receives, `(is_send, comm,
/// peer, bytes)`.
type Group = Vec<(bool, usize, u32, usize)>;

fn groups(log: &[(Option<StreamId>, Call)]) -> Vec<Group> {
    let mut out = Vec::new();
    let mut open: Option<Group> = None;
    for (_, c) in log {
        let item = match c {
            Call::GroupStart => {
                open = Some(Vec::new());
                continue;
            }
            Call::GroupEnd => {
                out.push(open.take().unwrap_or_default());
                continue;
            }
            Call::Send { comm, peer, bytes } => (true, *comm, *peer, *bytes),
            Call::Recv { comm, peer, bytes } => (false, *comm, *peer, *bytes),
            _ => continue,
        };
        match &mut open {
            Some(g) => g.push(item),
            None => out.push(vec![item]),
        }
    }
    out
}

/// Checks that groups are symmetric across ranks: messages from `r` to `q` on a
/// communicator match one to one, in order and size, and all messages between two groups
/// go both ways between the same two groups.
fn check_symmetric(logs: &[Vec<(Option<StreamId>, Call)>]) -> Result<usize, String> {
    let gs: Vec<Vec<Group>> = logs.iter().map(|l| groups(l)).collect();
    // (comm, from, to, n) -> (group index on the sender, bytes); likewise for receives.
    let mut sends: HashMap<(usize, u32, u32, usize), (usize, usize)> = HashMap::new();
    let mut recvs: HashMap<(usize, u32, u32, usize), (usize, usize)> = HashMap::new();
    for (r, rg) in gs.iter().enumerate() {
        let mut ns: HashMap<(usize, u32), usize> = HashMap::new();
        let mut nr: HashMap<(usize, u32), usize> = HashMap::new();
        for (gi, g) in rg.iter().enumerate() {
            for &(is_send, comm, peer, bytes) in g {
                let (map, count, key) = if is_send {
                    (&mut sends, &mut ns, (comm, r as u32, peer))
                } else {
                    (&mut recvs, &mut nr, (comm, peer, r as u32))
                };
                let n = count.entry((comm, peer)).or_default();
                map.insert((key.0, key.1, key.2, *n), (gi, bytes));
                *n += 1;
            }
        }
    }
    if sends.len() != recvs.len() {
        return Err(format!(
            "{} sends but {} receives",
            sends.len(),
            recvs.len()
        ));
    }
    // Group pairing: (rank, group) -> (peer, peer's group), the same for every message.
    let mut pair: HashMap<(u32, usize, u32), usize> = HashMap::new();
    for (&(comm, from, to, n), &(gs_, bytes)) in &sends {
        let &(gr, rb) = recvs.get(&(comm, from, to, n)).ok_or(format!(
            "send {n} from rank {from} to {to} on communicator {comm} is never received"
        ))?;
        if rb != bytes {
            return Err(format!(
                "rank {from} sends {bytes} bytes, rank {to} receives {rb}"
            ));
        }
        for (a, ga, b, gb) in [(from, gs_, to, gr), (to, gr, from, gs_)] {
            if let Some(prev) = pair.insert((a, ga, b), gb) {
                if prev != gb {
                    return Err(format!(
                        "group {ga} of rank {a} exchanges with two different groups of rank {b} ({prev} and {gb})"
                    ));
                }
            }
        }
    }
    Ok(sends.len())
}

/// NCCL's rendezvous semantics on the recorded calls: each rank's stream is a queue of
/// units (a group, or a lone send or receive), and a unit completes once every message in
/// it meets its counterpart in a unit at the head of the peer's stream. Returns the units
/// completed, or the units left when nothing can move (a deadlock). Events between streams
/// are not modelled (they only remove orders; the program verifier covers them).
fn rendezvous(logs: &[Vec<(Option<StreamId>, Call)>]) -> Result<usize, String> {
    type Msg = (usize, u32, u32, usize); // (comm, from, to, n)
    let mut queues: Vec<Vec<std::collections::VecDeque<Vec<Msg>>>> = Vec::new();
    for (r, log) in logs.iter().enumerate() {
        let mut per: HashMap<u32, std::collections::VecDeque<Vec<Msg>>> = HashMap::new();
        let mut n: HashMap<(usize, u32, u32), usize> = HashMap::new();
        let mut open: Option<(u32, Vec<Msg>)> = None;
        for (st, c) in log {
            let (comm, from, to) = match c {
                Call::GroupStart => {
                    open = Some((u32::MAX, Vec::new()));
                    continue;
                }
                Call::GroupEnd => {
                    if let Some((s, g)) = open.take() {
                        per.entry(s).or_default().push_back(g);
                    }
                    continue;
                }
                Call::Send { comm, peer, .. } => (*comm, r as u32, *peer),
                Call::Recv { comm, peer, .. } => (*comm, *peer, r as u32),
                _ => continue,
            };
            let k = n.entry((comm, from, to)).or_default();
            let m = (comm, from, to, *k);
            *k += 1;
            let s = st.map_or(0, |x| x.0);
            match &mut open {
                Some((gs, g)) => {
                    *gs = s;
                    g.push(m);
                }
                None => per.entry(s).or_default().push_back(vec![m]),
            }
        }
        let mut v: Vec<(u32, std::collections::VecDeque<Vec<Msg>>)> = per.into_iter().collect();
        v.sort_by_key(|x| x.0);
        queues.push(v.into_iter().map(|x| x.1).collect());
    }
    let mut done = 0;
    loop {
        let heads: std::collections::HashSet<(usize, Msg)> = queues
            .iter()
            .enumerate()
            .flat_map(|(r, qs)| {
                qs.iter()
                    .filter_map(move |q| q.front().map(move |u| (r, u)))
            })
            .flat_map(|(r, u)| u.iter().map(move |m| (r, *m)))
            .collect();
        let mut moved = false;
        for (r, qs) in queues.iter_mut().enumerate() {
            for q in qs.iter_mut() {
                let ready = q.front().is_some_and(|u| {
                    u.iter().all(|m| {
                        let peer = if m.1 as usize == r { m.2 } else { m.1 } as usize;
                        heads.contains(&(peer, *m))
                    })
                });
                if ready {
                    q.pop_front();
                    done += 1;
                    moved = true;
                }
            }
        }
        if !moved {
            break;
        }
    }
    let left: Vec<String> = queues
        .iter()
        .enumerate()
        .flat_map(|(r, qs)| {
            qs.iter()
                .filter_map(move |q| q.front().map(|u| format!("rank {r}: {u:?}")))
        })
        .collect();
    if left.is_empty() {
        Ok(done)
    } else {
        Err(format!("NCCL deadlock: {}", left.join("; ")))
    }
}

#[test]
fn nccl_calls_complete_under_rendezvous_semantics() {
    for (name, pp, mb, mesh) in CASES {
        let set = lower(name, pp, mb, mesh);
        let logs = nccl_logs(&set);
        let n = rendezvous(&logs).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        println!("order {name} mesh {mesh}: {n} NCCL units complete under rendezvous semantics");
    }
    // Two lone crossing sends deadlock; the same messages in one group each do not.
    let lone = |r: u32, p: u32| {
        vec![
            (
                Some(StreamId(1)),
                Call::Send {
                    comm: 1,
                    peer: p,
                    bytes: 8,
                },
            ),
            (
                Some(StreamId(1)),
                Call::Recv {
                    comm: 1,
                    peer: p,
                    bytes: 8,
                },
            ),
        ]
        .into_iter()
        .filter(move |_| r != p)
        .collect::<Vec<_>>()
    };
    let crossing = vec![lone(0, 1), lone(1, 0)];
    assert!(rendezvous(&crossing).unwrap_err().contains("deadlock"));
    let grouped: Vec<Vec<(Option<StreamId>, Call)>> = crossing
        .into_iter()
        .map(|l| {
            let mut g = vec![(None, Call::GroupStart)];
            g.extend(l);
            g.push((None, Call::GroupEnd));
            g
        })
        .collect();
    assert_eq!(rendezvous(&grouped), Ok(2));
}

#[test]
fn nccl_groups_are_symmetric_across_ranks() {
    for (name, pp, mb, mesh) in CASES {
        let set = lower(name, pp, mb, mesh);
        let logs = nccl_logs(&set);
        let n = check_symmetric(&logs).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        println!("order {name} mesh {mesh}: {n} NCCL messages, every group symmetric");
    }
}

#[test]
fn the_checks_catch_a_reordered_stream_and_an_asymmetric_group() {
    let set = lower("1f1b", 2, 4, "pp=2,ep=2");
    let logs = nccl_logs(&set);
    // The program with two instructions of a stream swapped no longer matches the calls.
    let mut swapped = set.clone();
    let ops = &mut swapped.ranks[0].streams[0].ops;
    let k = ops.iter().position(|o| matches!(o, Op::Kernel(_))).unwrap();
    ops.swap(k, k + 1);
    let e = check_rank(&swapped, &swapped.ranks[0], &logs[0], true).unwrap_err();
    assert!(e.contains("the program has"), "{e}");
    // A group that loses one receive is not symmetric.
    let mut broken = logs.clone();
    let at = broken[1]
        .iter()
        .position(|(_, c)| matches!(c, Call::Recv { .. }))
        .unwrap();
    broken[1].remove(at);
    assert!(check_symmetric(&broken).is_err());
}

/// Stage-granularity programs (`schedc compile --granularity stage`, for a runtime of the
/// user's model) have no schedc model: the driver refuses them on every rank with a sentence
/// naming the granularity, before any device work.
#[test]
fn stage_granularity_programs_are_refused() {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/../../specs/dualpipev.sched")).unwrap();
    let ov = Overrides {
        pp: Some(2),
        microbatches: Some(4),
        ..Default::default()
    };
    let src = load_spec(&text, &ov).unwrap().program;
    let opts = LowerOptions {
        granularity: schedc_program::Granularity::Stage,
        ..Default::default()
    };
    let mesh: Mesh = "pp=2".parse().unwrap();
    let set = ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), opts).unwrap();
    assert!(set.manifest.model.is_none());
    let recs: Vec<Recorder> = set
        .ranks
        .iter()
        .map(|p| Recorder::new(p.rank, DType::F32))
        .collect();
    let gpus: Vec<&dyn schedc_cuda::api::Gpu> = recs
        .iter()
        .map(|r| r as &dyn schedc_cuda::api::Gpu)
        .collect();
    let Err(err) = execute_on(&gpus, &set, &Data::builtin(), &ExecOptions::default()) else {
        panic!("a stage-granularity program must be refused");
    };
    let msg = err.to_string();
    assert!(
        msg.contains("stage granularity") && msg.contains("model-granularity"),
        "{msg}"
    );
}

// Issue 24, item 5: every peer pair is connected in one grouped exchange before the first
// step, and the whole run (that exchange included) completes under NCCL's rendezvous
// semantics: no pair of ranks can block.
#[test]
fn nccl_mode_preconnects_every_peer_pair_in_one_group_first() {
    for (name, pp, mb, mesh) in [
        ("dualpipe", 4, 8, "pp=4"),
        ("dualpipe", 2, 4, "pp=2,tp=2,ep=2"),
        ("1f1b", 2, 4, "pp=2,ep=2,dp=2"),
    ] {
        let set = lower(name, pp, mb, mesh);
        let logs = nccl_logs(&set);
        for (prog, log) in set.ranks.iter().zip(&logs) {
            let gs = groups(log);
            let first = &gs[0];
            let peers = schedc_cuda::driver::p2p_peers(&set, prog);
            let mut want: Vec<(bool, usize, u32, usize)> = Vec::new();
            for (comm, ps) in &peers {
                for &p in ps {
                    want.push((true, *comm, p, 1));
                    want.push((false, *comm, p, 1));
                }
            }
            assert_eq!(first, &want, "{name} {mesh} rank {}", prog.rank);
            assert!(!want.is_empty());
            // Every later message goes to a peer connected here.
            for g in &gs[1..] {
                for &(_, comm, peer, _) in g {
                    assert!(
                        want.contains(&(true, comm, peer, 1)),
                        "{name} {mesh} rank {}: a message to {peer} on communicator {comm} was not pre-connected",
                        prog.rank
                    );
                }
            }
        }
        // DualPipe P=4: rank 0 talks to rank 1 (its pipeline neighbour) and rank 3 (the
        // other copy of its stages, ReplicaSum) on their communicators.
        if mesh == "pp=4" {
            let all: Vec<u32> = schedc_cuda::driver::p2p_peers(&set, &set.ranks[0])
                .into_iter()
                .flat_map(|(_, p)| p)
                .collect::<std::collections::BTreeSet<u32>>()
                .into_iter()
                .collect();
            assert_eq!(all, vec![1, 3]);
        }
        let units = rendezvous(&logs).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        check_symmetric(&logs).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        println!("order {name} mesh {mesh}: pre-connected first, {units} NCCL units complete");
    }
}

#[test]
fn a_failed_nccl_rank_aborts_its_communicators() {
    let set = lower("dualpipe", 4, 8, "pp=4");
    let opts = ExecOptions {
        steps: 1,
        timeout: std::time::Duration::from_secs(5),
        ..ExecOptions::default()
    };
    // The third send fails (after the pre-connect group), as a dead peer would make it.
    let rec = Recorder::new(1, DType::F32).failing_send(3);
    let e = execute_rank(&rec, &rec, &set, 1, &Data::builtin(), &opts).unwrap_err();
    assert!(e.to_string().contains("remote process exited"), "{e}");
    let log = rec.log();
    assert_eq!(
        log.last(),
        Some(&(None, Call::Abort)),
        "the last call is the abort"
    );
    assert_eq!(log.iter().filter(|c| c.1 == Call::Abort).count(), 1);
    // A rank that succeeds does not abort.
    let ok = Recorder::new(1, DType::F32);
    execute_rank(&ok, &ok, &set, 1, &Data::builtin(), &opts).unwrap();
    assert!(!ok.log().iter().any(|c| c.1 == Call::Abort));
}

/// Issue 27, item 5: the memory ops and BPipe's lent stashes in both modes: offloads and
/// reloads as one asynchronous copy each on the copy stream, a lent stash sent and received
/// with the owner's stash size (in NCCL mode `ncclSend`/`ncclRecv` on channel 1's
/// communicator, grouped like every message, symmetric and free of deadlock under
/// rendezvous semantics).
#[test]
fn memory_ops_and_lent_stashes_follow_the_program_in_both_modes() {
    for (name, pp, mb, mesh) in [
        ("1f1b_offload", 4, 8, "pp=4"),
        ("zb_offload", 4, 8, "pp=4"),
        ("1f1b_recompute", 4, 8, "pp=4"),
        ("bpipe", 4, 8, "pp=4"),
    ] {
        let set = lower(name, pp, mb, mesh);
        let logs = nccl_logs(&set);
        for (prog, log) in set.ranks.iter().zip(&logs) {
            check_rank(&set, prog, log, true).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        }
        let units = rendezvous(&logs).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        let n = check_symmetric(&logs).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        let recs: Vec<Recorder> = set
            .ranks
            .iter()
            .map(|p| Recorder::new(p.rank, DType::F32))
            .collect();
        let gpus: Vec<&dyn schedc_cuda::api::Gpu> = recs
            .iter()
            .map(|r| r as &dyn schedc_cuda::api::Gpu)
            .collect();
        let opts = ExecOptions {
            steps: STEPS,
            ..ExecOptions::default()
        };
        execute_on(&gpus, &set, &Data::builtin(), &opts).unwrap();
        for (prog, rec) in set.ranks.iter().zip(&recs) {
            check_rank(&set, prog, &rec.log(), false)
                .unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
        }
        let stash_msgs = logs
            .iter()
            .flatten()
            .filter(|(_, c)| matches!(c, Call::Send { bytes, .. } if *bytes > 40_000))
            .count();
        println!("order {name} P={pp} M={mb}: program order in both modes, {n} NCCL messages symmetric ({stash_msgs} of a stash's size), {units} units under rendezvous");
        if name == "bpipe" {
            // 24 lends and returns per step (see the equivalence test), two steps.
            assert_eq!(stash_msgs, 48);
        }
    }
}
