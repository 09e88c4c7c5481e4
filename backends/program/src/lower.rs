//! Lowering a verified IR program onto a mesh: one [`RankProgram`] per global rank (the
//! format and what each stream holds are described in [`crate::format`]).

use crate::format::*;
use crate::mesh::{Dim, Fit, Mesh, MeshError};
use crate::model::{ModelConfig, Scope};
use schedc_ir::{Comm, Instr, Kind, MemKind, Part as IrPart, PlacementKind, Program};
use std::collections::{HashMap, HashSet};

/// Lowering switches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// What the kernels are (default: schedc's model, per layer).
    pub granularity: Granularity,
    /// Injected bug (tests only): DualPipe's two copies of a stage keep their own
    /// gradients instead of summing them.
    pub bug_skip_replica_sum: bool,
    /// Megatron-LM's sequence parallelism inside the TP group ([`Manifest::sequence_parallel`];
    /// needs `tp > 1`, whole ops only).
    pub sequence_parallel: bool,
}

/// The first error diagnostics of a rejected check, joined.
pub(crate) fn rejected(out: &schedc::check::Outcome) -> Option<String> {
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
    /// for `mesh` and `model`.
    ///
    /// At [`Granularity::Model`] every op becomes schedc's own kernels (see the module docs
    /// of [`crate::format`]); at [`Granularity::Stage`] every F, B, W, BW (or MoE part of
    /// one) becomes one kernel on the user's stage, overlapped pairs become [`Op::Overlap`],
    /// and the schedule's collectives [`Op::Collective`]s (`model` is then not used).
    ///
    /// Errors: the schedule fails schedc's checker; the mesh does not fit (at stage
    /// granularity: only its pipeline size is checked, and `tp`, `sp` must be 1); at model
    /// granularity, the schedule has ops the model's kernels do not cover (see below) or the
    /// model config is invalid.
    ///
    /// MoE parts (`--moe`) at model granularity run as described in [`crate::format`]: layer
    /// by layer, their EP all-to-alls on the `ep` stream; refused there: IR collectives, a `W`
    /// in parts, interleaved parts of ops that depend on each other when a stage has more than
    /// one layer.
    pub fn lower(
        source: &Program,
        mesh: &Mesh,
        model: &ModelConfig,
        opts: LowerOptions,
    ) -> Result<ProgramSet, ProgramError> {
        let stage = opts.granularity == Granularity::Stage;
        if !stage {
            model.validate().map_err(ProgramError::Model)?;
        }
        let out = schedc::check::check(source, None, &Default::default());
        if let Some(why) = rejected(&out) {
            return Err(ProgramError::Rejected(why));
        }
        let ir = out
            .checked
            .ok_or_else(|| ProgramError::Rejected("no checked program".into()))?;
        let pl = &ir.pipeline;
        let fit = if stage {
            // `tp` and `sp` at stage granularity: the user's stage modules do their own
            // tensor and sequence parallelism over the groups the runtime hands them; the
            // program only sends each (tp, sp) rank's activations to the rank of the same
            // coordinates in the next stage.
            // The model is the user's: its sizes are checked by its own modules.
            let inner = mesh.size(Dim::Tp) * mesh.size(Dim::Sp);
            Fit {
                pp: pl.pp,
                experts: mesh.size(Dim::Ep),
                heads: inner,
                hidden: inner,
                expert_hidden: inner,
                seq_len: inner,
            }
        } else {
            Fit {
                pp: pl.pp,
                experts: model.experts as u32,
                heads: model.heads as u32,
                hidden: model.hidden as u32,
                expert_hidden: model.expert_hidden as u32,
                seq_len: model.seq_len as u32,
            }
        };
        mesh.validate(None, &fit)?;
        if opts.sequence_parallel {
            if stage || mesh.size(Dim::Tp) < 2 {
                return Err(ProgramError::Unsupported(
                    "--sequence-parallel is Megatron's sequence parallelism inside the TP group: it needs tp > 1 at model granularity (the mesh's `sp` is the other kind, which splits the sequence over its own ranks)".into(),
                ));
            }
            let chunk = model.seq_len as u32 / mesh.size(Dim::Sp);
            if !chunk.is_multiple_of(mesh.size(Dim::Tp)) {
                return Err(ProgramError::Mesh(MeshError::Fit {
                    mesh: mesh.to_string(),
                    why: format!(
                        "tp={} does not divide the {chunk} tokens of a sequence chunk (--sequence-parallel shards them over the TP group)",
                        mesh.size(Dim::Tp)
                    ),
                }));
            }
        }
        if !stage
            && model.micro_batch_size > 1
            && (mesh.size(Dim::Sp) > 1 || opts.sequence_parallel)
        {
            return Err(ProgramError::Unsupported(format!(
                "--micro-batch-size {} with sequence parallelism (--mesh sp={} / --sequence-parallel): the executors split one sequence per micro-batch over the SP ranks; give --micro-batch-size 1 or drop the sequence parallelism",
                model.micro_batch_size,
                mesh.size(Dim::Sp)
            )));
        }
        if !stage && mesh.size(Dim::Tp) > 1 && model.rope_keys_per_token() > 1 {
            return Err(ProgramError::Unsupported(
                "tensor parallelism with one RoPE key per head (the per-head-kpe bug): the TP kernels split the heads and share one RoPE key per token".into(),
            ));
        }
        // The model's kernels cover whole ops only; the user's stages take parts and
        // collectives too.
        for (r, instrs) in ir.ranks.iter().enumerate().filter(|_| !stage) {
            for ins in instrs {
                if ins.comms().iter().any(|c| matches!(c, Comm::Collective(_))) {
                    return Err(ProgramError::Unsupported(format!(
                        "rank {r} has an IR collective; the CPU backend makes the expert-parallel all-to-alls of MoE parts itself (over the mesh's EP group: lower with --moe instead of writing A2A)"
                    )));
                }
            }
        }
        let world = mesh.world();
        let by_rank = ir.pipeline.stages_by_rank();
        let ranks = (0..world)
            .map(|g| lower_rank(&ir, mesh, model, g, opts, &by_rank))
            .collect::<Result<Vec<_>, _>>()?;
        let (groups, channels) = groups_and_channels(&ranks);
        Ok(ProgramSet {
            manifest: Manifest {
                format_version: FORMAT_VERSION,
                granularity: opts.granularity,
                pp: pl.pp,
                stages: pl.stages,
                microbatches: pl.microbatches,
                directions: pl.directions(),
                placement: pl.placement,
                stage_to_rank: pl.stage_to_rank.clone(),
                model_stages: pl.stages_per_direction(),
                model: (!stage).then(|| model.clone()),
                mesh: mesh.clone(),
                world,
                files: (0..world).map(|g| format!("rank{g}.json")).collect(),
                groups,
                channels,
                sequence_parallel: opts.sequence_parallel,
            },
            ranks,
        })
    }
}

/// Every collective group of the rank programs (each sorted, each once) and every channel of
/// their comm streams (increasing, 0 included).
fn groups_and_channels(ranks: &[RankProgram]) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut groups = std::collections::BTreeSet::new();
    let mut channels = std::collections::BTreeSet::from([0u32]);
    for rp in ranks {
        for st in &rp.streams {
            if let StreamKind::Comm { channel } = st.kind {
                channels.insert(channel);
            }
            for op in &st.ops {
                match op {
                    Op::AllToAll { group, .. }
                    | Op::TpCollective { group, .. }
                    | Op::TpGradAllReduce { group, .. }
                    | Op::AllReduce { group, .. }
                    | Op::Collective { group, .. } => {
                        let mut g = group.clone();
                        g.sort_unstable();
                        groups.insert(g);
                    }
                    Op::ReplicaSum { peer, .. } => {
                        let mut g = vec![rp.rank, *peer];
                        g.sort_unstable();
                        groups.insert(g);
                    }
                    _ => {}
                }
            }
        }
    }
    (groups.into_iter().collect(), channels.into_iter().collect())
}

struct Builder {
    compute: Vec<Op>,
    comm: Vec<Op>,
    /// The expert-parallel stream (MoE parts' all-to-alls).
    ep: Vec<Op>,
    /// The tensor-parallel stream (`tp > 1`).
    tp: Vec<Op>,
    /// The host-copy stream (offloads and reloads).
    copy: Vec<Op>,
    channels: std::collections::BTreeMap<u32, Vec<Op>>,
    events: u32,
}

impl Builder {
    fn event(&mut self) -> u32 {
        self.events += 1;
        self.events - 1
    }

    /// A tensor-parallel all-reduce of layer `layer` of `(stage, mb)` on the TP stream,
    /// bracketed by events: after the compute stream's last kernel, before its next.
    /// Nothing with a TP group of one.
    fn tp_collective(&mut self, group: &[u32], stage: u32, mb: u32, layer: u32, phase: Tp) {
        if group.len() < 2 {
            return;
        }
        let ready = self.event();
        let done = self.event();
        self.compute.push(Op::Record { event: ready });
        self.tp.push(Op::Wait { event: ready });
        self.tp.push(Op::TpCollective {
            stage,
            mb,
            layer,
            phase,
            group: group.to_vec(),
        });
        self.tp.push(Op::Record { event: done });
        self.compute.push(Op::Wait { event: done });
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
    by_rank: &[Vec<u32>],
) -> Result<RankProgram, ProgramError> {
    let pl = &ir.pipeline;
    let coords = mesh.coords(g)?;
    let r = coords.pp;
    let ep = mesh.size(Dim::Ep);
    let stage_gran = opts.granularity == Granularity::Stage;
    // The user's model places its own experts.
    let per = if stage_gran {
        0
    } else {
        model.experts as u32 / ep
    };
    let bidir = pl.placement == PlacementKind::Bidir;
    let n_model = pl.stages_per_direction();
    let lps = model.layers_per_stage as u32;
    let mut stages: Vec<LocalStage> = by_rank
        .get(r as usize)
        .cloned()
        .unwrap_or_default()
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
    let tp_group = mesh.tp_group(g)?;

    let mut b = Builder {
        compute: Vec::new(),
        comm: Vec::new(),
        ep: Vec::new(),
        tp: Vec::new(),
        copy: Vec::new(),
        channels: Default::default(),
        events: 0,
    };
    // Which payloads travel: events for receives (recorded by comm) and sends (recorded by
    // compute after the producing kernel).
    let mut recv_ev: HashMap<Buf, u32> = HashMap::new();
    let mut send_ev: HashMap<Buf, u32> = HashMap::new();
    // The instruction index of each message: a stream posts its messages in this order
    // (sends before receives within one instruction).
    let mut comm_pos: HashMap<Buf, usize> = HashMap::new();
    // BPipe's lent stashes (LEND/RETURN): at model granularity the stash is schedc's own
    // saved tensors, moved whole to the holder and back; at stage granularity (the torch
    // runtime) the tensors autograd saved for the backward (caught by
    // `saved_tensors_hooks`), the graph itself staying on the owner.
    let mut lent_seen: std::collections::HashSet<(bool, Buf)> = Default::default();
    for (i, ins) in ir.ranks[r as usize].iter().enumerate() {
        for c in ins.comms() {
            if let Comm::Send { payload, .. } | Comm::Recv { payload, .. } = c {
                if payload.kind.is_stash() {
                    let send = matches!(c, Comm::Send { .. });
                    if !lent_seen.insert((send, Buf::of_payload(payload))) {
                        // A valid schedule (`check` accepts it) the executors do not run.
                        return Err(ProgramError::Unsupported(format!(
                            "rank {r}: `{}`: the stash of F({},{}) is {} twice by this rank; the \
                             executors move a stash to its holder and back once per step",
                            schedc_ir::text::instr_to_string(ins),
                            payload.stage,
                            payload.mb,
                            if send { "sent" } else { "received" }
                        )));
                    }
                }
            }
            match c {
                Comm::Send { payload, .. } => {
                    let e = b.event();
                    send_ev.insert(Buf::of_payload(payload), e);
                    comm_pos.insert(Buf::of_payload(payload), i);
                }
                Comm::Recv { payload, .. } => {
                    let e = b.event();
                    recv_ev.insert(Buf::of_payload(payload), e);
                    comm_pos.insert(Buf::of_payload(payload), i);
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
    let held = |s: u32| {
        info(s).ok_or_else(|| ProgramError::Rejected(format!("stage {s} is not held by rank {r}")))
    };
    // The forwards this rank recomputes keep their input (the received activation) until
    // the recompute has read it.
    let keep_input: HashSet<(u32, u32)> = ir.ranks[r as usize]
        .iter()
        .filter_map(|i| match i {
            Instr::Mem(m) if m.kind == MemKind::Recompute => Some((m.stage, m.mb)),
            _ => None,
        })
        .collect();
    // Recomputing an op split into MoE parts would rerun its all-to-alls with the EP group
    // and re-split its saved state part by part: refused. Offloads and reloads move the
    // whole stash between parts' windows, as for whole ops.
    let recomputes = ir.ranks[r as usize].iter().any(|i| {
        let mut c = matches!(i, Instr::Mem(m) if m.kind == MemKind::Recompute);
        i.for_each_compute(|x| c |= x.checkpoint);
        c
    });
    let parts = ir.ranks[r as usize].iter().any(|i| {
        let mut p = false;
        i.for_each_compute(|c| p |= c.part != IrPart::Whole);
        p
    });
    if recomputes && parts {
        return Err(ProgramError::Unsupported(format!(
            "rank {r} recomputes forwards (RECOMPUTE, F(s,m)!) that are split into MoE parts: the executors recompute whole ops only (offloads and reloads of MoE parts run)"
        )));
    }
    // Per (stage, mb): the event the copy stream records after an offload (the stash is
    // released) and after a reload (the stash holds the saved tensors again).
    let mut offloaded: HashMap<(u32, u32), u32> = HashMap::new();
    let mut reloaded: HashMap<(u32, u32), u32> = HashMap::new();
    let cx = PartCtx {
        keep_input: &keep_input,
        pl,
        layers: lps,
        ep_group: &ep_group,
        sp_group: &sp_group,
        tp_group: &tp_group,
        seq_par: opts.sequence_parallel,
        recv_ev: &recv_ev,
        send_ev: &send_ev,
        comm_pos: &comm_pos,
    };
    let mut win = Window::default();
    // Stashes lent and not back yet: (stage, mb) -> the event of their RETURN's receive,
    // which the compute stream waits for before the first backward of that (stage, mb).
    let mut returning: HashMap<(u32, u32), u32> = HashMap::new();
    // The receives of lent stashes (the holder's LEND, the owner's RETURN): the event the
    // compute stream records where the program reaches them, which the receive waits for (a
    // stash that arrived early would occupy memory before the backward that frees a slot
    // for it, above the IR's peak).
    let mut recv_gate: HashMap<Buf, u32> = HashMap::new();
    for ins in &ir.ranks[r as usize] {
        if !returning.is_empty() {
            let mut waits = Vec::new();
            ins.for_each_compute(|c| {
                if c.kind != Kind::F {
                    if let Some(e) = returning.remove(&(c.stage, c.mb)) {
                        waits.push(e);
                    }
                }
            });
            for event in waits {
                b.compute.push(Op::Wait { event });
            }
        }
        if ins.is_compute() {
            // The first op of a (stage, mb) after its RELOAD waits for the copy.
            let mut keys = Vec::new();
            ins.for_each_compute(|c| keys.push((c.stage, c.mb)));
            for k in keys {
                if let Some(e) = reloaded.remove(&k) {
                    if !win.items.is_empty() {
                        return Err(ProgramError::Unsupported(format!(
                            "rank {r}: a RELOAD before an op split into MoE parts: the executors move saved activations of whole ops only"
                        )));
                    }
                    b.compute.push(Op::Wait { event: e });
                }
            }
        }
        // `F(s,m)!`: its saved tensors go when it ends (its input stays for the recompute).
        let mut dropped = Vec::new();
        ins.for_each_compute(|c| {
            if c.checkpoint && c.kind == Kind::F {
                dropped.push(Buf::Stash {
                    stage: c.stage,
                    mb: c.mb,
                });
            }
        });
        match ins {
            Instr::Compute(c) if stage_gran => {
                let keep = keep_input.contains(&(c.stage, c.mb));
                let (pre, k, post) = stage_op(pl, &held(c.stage)?, c, &recv_ev, &send_ev, keep);
                b.compute.extend(pre);
                b.compute.push(Op::Kernel(k));
                b.compute.extend(post);
            }
            Instr::Overlap { fwd, bwd } if stage_gran => {
                let keep = keep_input.contains(&(fwd.stage, fwd.mb));
                let (pf, kf, qf) = stage_op(pl, &held(fwd.stage)?, fwd, &recv_ev, &send_ev, keep);
                let (pb, kb, qb) = stage_op(pl, &held(bwd.stage)?, bwd, &recv_ev, &send_ev, false);
                let pair = fwd.part == IrPart::Whole
                    && bwd.part == IrPart::Whole
                    && (fwd.stage, fwd.mb) != (bwd.stage, bwd.mb);
                if pair {
                    b.compute.extend(pf);
                    b.compute.extend(pb);
                    b.compute.push(Op::Overlap { fwd: kf, bwd: kb });
                    b.compute.extend(qf);
                    b.compute.extend(qb);
                } else {
                    // Parts, or a stage's own forward and backward: one after the other.
                    b.compute.extend(pf);
                    b.compute.push(Op::Kernel(kf));
                    b.compute.extend(qf);
                    b.compute.extend(pb);
                    b.compute.push(Op::Kernel(kb));
                    b.compute.extend(qb);
                }
            }
            Instr::Compute(_) | Instr::Overlap { .. } => {
                let mut cs = Vec::new();
                ins.for_each_compute(|c| cs.push(*c));
                for c in cs {
                    let st = info(c.stage).ok_or_else(|| {
                        ProgramError::Rejected(format!("stage {} is not held by rank {r}", c.stage))
                    })?;
                    if c.kind == Kind::W && c.part != IrPart::Whole {
                        // A weight gradient's part has no all-to-all: it runs where it
                        // stands, like a whole op (inside a window, in the window's order).
                        if !win.items.is_empty() {
                            win.items.push((c, st));
                        } else {
                            emit_weights_part(&mut b, st.stage, c.mb, c.part);
                        }
                    } else if c.part != IrPart::Whole {
                        win.push_part(c, st);
                        if win.open == 0 {
                            flush_window(&mut b, &cx, &mut win, r)?;
                        }
                    } else if !win.items.is_empty() {
                        win.items.push((c, st));
                    } else {
                        emit_compute(&mut b, &cx, &st, c.kind, c.mb);
                    }
                }
            }
            Instr::Comm(_) | Instr::Group(_) => {
                // Per channel: the waits of the sends and the allocations of the receives,
                // then the messages, sends first (they never block on this rank's receives
                // (eager), so a group posted at once keeps its meaning), then the sends'
                // releases and the receives' records. The messages of one instruction are
                // thereby adjacent on their stream, and only they are (a lone message has
                // a wait or an allocation before it and a release or a record after it),
                // so a backend whose sends are rendezvous (NCCL) posts each run as one
                // group, as the IR's `{...}` means.
                //
                // The schedule's collectives (stage granularity; the model granularity
                // refused them) go on channel 0's stream between its sends and its
                // receives: posted with the group's messages, they never wait for this
                // rank's receives, and a backend posts the run of sends, collectives and
                // receives at once.
                let comms = ins.comms();
                // A lent stash moves when the program reaches it: the compute stream records
                // the send's event here (after the forward that wrote the stash, or, on the
                // holder, after the LEND's receive it returns), and the owner's backward waits
                // for the RETURN's receive.
                for c in comms {
                    match c {
                        Comm::Send { payload, .. } if payload.kind.is_stash() => {
                            let buf = Buf::of_payload(payload);
                            // A stash lent after its RELOAD goes once the copy is back.
                            if let Some(event) = reloaded.remove(&(payload.stage, payload.mb)) {
                                b.compute.push(Op::Wait { event });
                            }
                            if payload.kind == schedc_ir::PayloadKind::Return {
                                if let Some(&event) = recv_ev.get(&buf) {
                                    b.compute.push(Op::Wait { event });
                                }
                            }
                            b.compute.push(Op::Record {
                                event: send_ev[&buf],
                            });
                        }
                        Comm::Recv { payload, .. } if payload.kind.is_stash() => {
                            let buf = Buf::of_payload(payload);
                            if payload.kind == schedc_ir::PayloadKind::Return {
                                returning.insert((payload.stage, payload.mb), recv_ev[&buf]);
                            }
                            let event = b.event();
                            b.compute.push(Op::Record { event });
                            recv_gate.insert(buf, event);
                        }
                        _ => {}
                    }
                }
                let mut channels: Vec<u32> = Vec::new();
                for c in comms {
                    let ch = match c {
                        Comm::Send { channel, .. } | Comm::Recv { channel, .. } => *channel,
                        Comm::Collective(_) => 0,
                    };
                    if !channels.contains(&ch) {
                        channels.push(ch);
                    }
                }
                let mut collectives = Vec::new();
                for c in comms {
                    if let Comm::Collective(col) = c {
                        let members = pl
                            .communicators
                            .iter()
                            .find(|x| x.name == col.comm)
                            .ok_or_else(|| {
                                ProgramError::Rejected(format!(
                                    "communicator `{}` is not declared",
                                    col.comm
                                ))
                            })?;
                        let group = members
                            .ranks
                            .iter()
                            .map(|&p| peer(p))
                            .collect::<Result<Vec<_>, _>>()?;
                        collectives.push(Op::Collective {
                            comm: col.comm.clone(),
                            label: col.label.clone(),
                            group,
                        });
                    }
                }
                for ch in channels {
                    let mut sends = Vec::new();
                    let mut recvs = Vec::new();
                    for c in comms {
                        match c {
                            Comm::Send {
                                payload,
                                peer: p,
                                channel,
                            } if *channel == ch => {
                                sends.push((Buf::of_payload(payload), peer(*p)?))
                            }
                            Comm::Recv {
                                payload,
                                peer: p,
                                channel,
                            } if *channel == ch => {
                                recvs.push((Buf::of_payload(payload), peer(*p)?))
                            }
                            _ => {}
                        }
                    }
                    let ops = b.comm_stream(ch);
                    for (buf, _) in &sends {
                        ops.push(Op::Wait {
                            event: send_ev[buf],
                        });
                    }
                    for (buf, _) in &recvs {
                        if let Some(event) = recv_gate.remove(buf) {
                            ops.push(Op::Wait { event });
                        }
                    }
                    // The owner of a lent stash keeps its slot (empty while lent: the CPU
                    // backend moves the tensors out): no allocation for the RETURN's receive,
                    // no release after the LEND's send; its forward allocates the slot and
                    // its backward releases it, as for a stash never lent.
                    let own = |buf: &Buf| matches!(buf, Buf::Stash { stage, .. } if pl.rank_of(*stage) == r);
                    for (buf, _) in &recvs {
                        if own(buf) {
                            continue;
                        }
                        ops.push(Op::Alloc {
                            buf: *buf,
                            zero: false,
                        });
                    }
                    for (buf, p) in &sends {
                        ops.push(Op::Send {
                            buf: *buf,
                            peer: *p,
                        });
                    }
                    if ch == 0 {
                        ops.append(&mut collectives);
                    }
                    for (buf, p) in &recvs {
                        ops.push(Op::Recv {
                            buf: *buf,
                            peer: *p,
                        });
                    }
                    for (buf, _) in &sends {
                        if own(buf) {
                            continue;
                        }
                        ops.push(Op::Free { buf: *buf });
                    }
                    for (buf, _) in &recvs {
                        ops.push(Op::Record {
                            event: recv_ev[buf],
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
            Instr::Mem(m) => {
                if !win.items.is_empty() {
                    return Err(ProgramError::Unsupported(format!(
                        "rank {r}: `{}` inside ops split into MoE parts: the executors move saved activations of whole ops only",
                        schedc_ir::text::instr_to_string(ins)
                    )));
                }
                let st = held(m.stage)?;
                emit_mem(
                    &mut b,
                    &cx,
                    &st,
                    m,
                    &mut offloaded,
                    &mut reloaded,
                    stage_gran,
                );
            }
            Instr::WaitRecv(payload) => {
                // The compute stream waits for the receive's event (inside a window, before
                // the window's next item, after the forward tails that receive's sender
                // may be waiting for).
                let buf = Buf::of_payload(payload);
                let Some(&event) = recv_ev.get(&buf) else {
                    return Err(ProgramError::Rejected(format!(
                        "rank {r}: `{}` waits for a receive the rank does not post",
                        schedc_ir::text::instr_to_string(ins)
                    )));
                };
                if win.items.is_empty() {
                    b.compute.push(Op::Wait { event });
                } else {
                    win.waits.push((win.items.len(), buf, event));
                }
            }
        }
        for buf in dropped {
            b.compute.push(Op::Free { buf });
        }
    }
    if !win.items.is_empty() {
        return Err(ProgramError::Rejected(format!(
            "rank {r} ends inside an op split into MoE parts (its parts are incomplete)"
        )));
    }
    // End of step.
    let done = b.event();
    b.compute.push(Op::Record { event: done });
    b.comm.push(Op::Wait { event: done });
    let dense = mesh.dense_dp_group(g)?;
    let expert = mesh.expert_dp_group(g)?;
    for s in &stages {
        if opts.sequence_parallel && tp_group.len() > 1 {
            b.comm.push(Op::TpGradAllReduce {
                stage: s.stage,
                group: tp_group.clone(),
            });
        }
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
    if !b.ep.is_empty() {
        streams.push(Stream {
            kind: StreamKind::Ep,
            ops: b.ep,
        });
    }
    if !b.tp.is_empty() {
        streams.push(Stream {
            kind: StreamKind::Tp,
            ops: b.tp,
        });
    }
    if !b.copy.is_empty() {
        streams.push(Stream {
            kind: StreamKind::Copy,
            ops: b.copy,
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

/// A whole op of `st` (with `tp > 1`, each layer adds the TP all-reduces and the `attn_post`
/// and `qkv_post` kernels after them; see [`crate::format`]).
fn emit_compute(b: &mut Builder, cx: &PartCtx<'_>, st: &LocalStage, kind: Kind, mb: u32) {
    emit_compute_as(b, cx, st, kind, mb, false)
}

/// [`emit_compute`]; `recompute` (with `kind` F): the forward's kernels as
/// [`Pass::Recompute`], which rebuild the stash from the kept input and write nothing else.
fn emit_compute_as(
    b: &mut Builder,
    cx: &PartCtx<'_>,
    st: &LocalStage,
    kind: Kind,
    mb: u32,
    recompute: bool,
) {
    let (pl, layers, ep_group, sp_group, tp_group) =
        (cx.pl, cx.layers, cx.ep_group, cx.sp_group, cx.tp_group);
    let (recv_ev, send_ev) = (cx.recv_ev, cx.send_ev);
    let tp = tp_group.len() > 1;
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
            let output = pl
                .next_stage(s)
                .filter(|_| !recompute)
                .map(|_| Buf::Act { stage: s, mb });
            let fpass = if recompute { Pass::Recompute } else { Pass::F };
            // A recompute leaves the gradient accumulator (the router loads) alone.
            let stash_wg = if recompute {
                vec![stash]
            } else {
                vec![stash, wg]
            };
            if let Some(e) = input.filter(|_| !recompute).and_then(|i| recv_ev.get(&i)) {
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
                    .push(kernel(fpass, Part::Embed, vec![], vec![stash]));
            }
            for l in 0..layers {
                let mut reads = if l == 0 && !st.first {
                    vec![input.expect("a non-first stage has a previous stage")]
                } else {
                    vec![stash]
                };
                reads.sort();
                b.compute
                    .push(kernel(fpass, Part::Qkv { layer: l }, reads, vec![stash]));
                if l == 0 && !st.first && (recompute || !cx.keep_input.contains(&(s, mb))) {
                    b.compute.push(Op::Free {
                        buf: input.expect("checked"),
                    });
                }
                if cx.seq_par {
                    b.tp_collective(tp_group, s, mb, l, Tp::LatentGather);
                    b.compute.push(kernel(
                        fpass,
                        Part::QkvPost { layer: l },
                        vec![stash],
                        vec![stash],
                    ));
                }
                b.compute.push(a2a(l, A2a::GatherKv));
                b.compute.push(kernel(
                    fpass,
                    Part::Attn { layer: l },
                    vec![stash],
                    stash_wg.clone(),
                ));
                if cx.seq_par {
                    b.tp_collective(tp_group, s, mb, l, Tp::AttnOutScatter);
                    b.compute.push(kernel(
                        fpass,
                        Part::AttnPost { layer: l },
                        vec![stash],
                        stash_wg.clone(),
                    ));
                    b.tp_collective(tp_group, s, mb, l, Tp::MlpInGather);
                    b.compute.push(kernel(
                        fpass,
                        Part::Shared { layer: l },
                        vec![stash],
                        vec![stash],
                    ));
                    b.tp_collective(tp_group, s, mb, l, Tp::MlpOutScatter);
                } else if tp {
                    b.tp_collective(tp_group, s, mb, l, Tp::AttnOut);
                    b.compute.push(kernel(
                        fpass,
                        Part::AttnPost { layer: l },
                        vec![stash],
                        stash_wg.clone(),
                    ));
                    b.tp_collective(tp_group, s, mb, l, Tp::MlpOut);
                }
                b.compute.push(a2a(l, A2a::Dispatch));
                b.compute.push(kernel(
                    fpass,
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
                    fpass,
                    Part::Combine { layer: l },
                    vec![stash],
                    writes,
                ));
            }
            if st.last {
                b.compute
                    .push(kernel(fpass, Part::Head, vec![stash], vec![stash]));
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
                if cx.seq_par {
                    b.tp_collective(tp_group, s, mb, l, Tp::MlpOutGradGather);
                    b.compute.push(kernel(
                        Pass::B,
                        Part::Shared { layer: l },
                        vec![stash],
                        vec![stash],
                    ));
                    b.tp_collective(tp_group, s, mb, l, Tp::MlpInGradScatter);
                } else {
                    b.tp_collective(tp_group, s, mb, l, Tp::MlpInGrad);
                }
                b.compute.push(a2a(l, A2a::CombineGrad));
                b.compute.push(kernel(
                    Pass::B,
                    Part::Experts { layer: l },
                    vec![stash],
                    vec![stash],
                ));
                b.compute.push(a2a(l, A2a::DispatchGrad));
                if cx.seq_par {
                    b.compute.push(kernel(
                        Pass::B,
                        Part::AttnPost { layer: l },
                        vec![stash],
                        vec![stash],
                    ));
                    b.tp_collective(tp_group, s, mb, l, Tp::AttnOutGradGather);
                }
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
                if tp {
                    b.compute.push(kernel(
                        Pass::B,
                        Part::Qkv { layer: l },
                        vec![stash],
                        vec![stash],
                    ));
                    let phase = if cx.seq_par {
                        Tp::LatentGradScatter
                    } else {
                        Tp::AttnInGrad
                    };
                    b.tp_collective(tp_group, s, mb, l, phase);
                    b.compute.push(kernel(
                        Pass::B,
                        Part::QkvPost { layer: l },
                        vec![stash],
                        writes,
                    ));
                } else {
                    b.compute
                        .push(kernel(Pass::B, Part::Qkv { layer: l }, vec![stash], writes));
                }
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

/// A memory op of the IR (`OFFLOAD`, `RELOAD`, `RECOMPUTE` of `F(st.stage, m.mb)`), where
/// the IR issues it:
///
/// * `OFFLOAD`: the compute stream records an event; the copy stream waits for it,
///   allocates `host(s,m)`, runs [`Op::Offload`], releases `stash(s,m)` and records the
///   event a later `RECOMPUTE` waits for;
/// * `RELOAD`: the compute stream records an event; the copy stream waits for it,
///   allocates `stash(s,m)`, runs [`Op::Reload`], releases `host(s,m)` and records the
///   event that the next compute op of `(s,m)` (its backward) waits for;
/// * `RECOMPUTE`: after an offload, the copy stream drops the host copy and the compute
///   stream waits until the offload has released the stash; then the forward's kernels as
///   [`Pass::Recompute`] (one [`Part::Stage`] kernel at stage granularity), which read the
///   kept input and release it.
fn emit_mem(
    b: &mut Builder,
    cx: &PartCtx<'_>,
    st: &LocalStage,
    m: &schedc_ir::MemOp,
    offloaded: &mut HashMap<(u32, u32), u32>,
    reloaded: &mut HashMap<(u32, u32), u32>,
    stage_gran: bool,
) {
    let (s, mb) = (st.stage, m.mb);
    let stash = Buf::Stash { stage: s, mb };
    let host = Buf::Host { stage: s, mb };
    // The copy stream starts where the IR issues the op.
    let issue = |b: &mut Builder| {
        let e = b.event();
        b.compute.push(Op::Record { event: e });
        b.copy.push(Op::Wait { event: e });
    };
    match m.kind {
        MemKind::Offload => {
            issue(b);
            b.copy.push(Op::Alloc {
                buf: host,
                zero: false,
            });
            b.copy.push(Op::Offload { stage: s, mb });
            b.copy.push(Op::Free { buf: stash });
            let done = b.event();
            b.copy.push(Op::Record { event: done });
            offloaded.insert((s, mb), done);
        }
        MemKind::Reload => {
            issue(b);
            b.copy.push(Op::Alloc {
                buf: stash,
                zero: false,
            });
            b.copy.push(Op::Reload { stage: s, mb });
            b.copy.push(Op::Free { buf: host });
            let done = b.event();
            b.copy.push(Op::Record { event: done });
            reloaded.insert((s, mb), done);
        }
        MemKind::Recompute => {
            if let Some(done) = offloaded.remove(&(s, mb)) {
                issue(b);
                b.copy.push(Op::Free { buf: host });
                b.compute.push(Op::Wait { event: done });
            }
            if stage_gran {
                let input = cx.pl.prev_stage(s).map(|p| Buf::Act { stage: p, mb });
                b.compute.push(Op::Alloc {
                    buf: stash,
                    zero: false,
                });
                b.compute.push(kernel_op(
                    Pass::Recompute,
                    s,
                    mb,
                    Part::Stage { moe: IrPart::Whole },
                    input.into_iter().collect(),
                    vec![stash],
                ));
                if let Some(i) = input {
                    b.compute.push(Op::Free { buf: i });
                }
            } else {
                emit_compute_as(b, cx, st, Kind::F, mb, true);
            }
        }
    }
}

/// One part of a split weight gradient: `W.mlp` (the expert weights, `Part::WeightsMlp`),
/// then `W.attn` (every other weight of the stage, `Part::WeightsAttn`), which releases the
/// stash; `Whole` is [`emit_weights`].
fn emit_weights_part(b: &mut Builder, s: u32, mb: u32, part: IrPart) {
    let stash = Buf::Stash { stage: s, mb };
    let wg = Buf::WeightGrad { stage: s };
    let (kpart, last) = match part {
        IrPart::Mlp => (Part::WeightsMlp, false),
        IrPart::Attn => (Part::WeightsAttn, true),
        _ => return emit_weights(b, s, mb),
    };
    b.compute.push(Op::Kernel(Kernel {
        pass: Pass::W,
        stage: s,
        mb,
        part: kpart,
        reads: vec![stash, wg],
        writes: vec![wg],
    }));
    if last {
        b.compute.push(Op::Free { buf: stash });
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

/// Stage granularity: what one compute op (or MoE part) of `st` runs on the compute stream:
/// the waits and allocations before its kernel, the kernel, the releases and send events
/// after it.
///
/// A forward's first piece (the whole op, or its `attn` part) waits for its received input,
/// allocates the stash and releases the input; its last piece (whole, or `combine`) writes
/// the output activation and records the event its send waits for. A backward's first
/// piece (whole, or `combine`, the parts' reverse order) waits for and releases the
/// received gradient; its last piece (whole, or `attn`) writes the input gradient; a `BW`
/// accumulates into `weight_grad` in every piece and releases the stash after its last; a
/// `W` (always whole) releases the stash.
fn stage_op(
    pl: &schedc_ir::Pipeline,
    st: &LocalStage,
    c: &schedc_ir::Compute,
    recv_ev: &HashMap<Buf, u32>,
    send_ev: &HashMap<Buf, u32>,
    keep_input: bool,
) -> (Vec<Op>, Kernel, Vec<Op>) {
    let s = st.stage;
    let mb = c.mb;
    let stash = Buf::Stash { stage: s, mb };
    let wg = Buf::WeightGrad { stage: s };
    let (mut pre, mut post) = (Vec::new(), Vec::new());
    let (mut reads, mut writes) = (Vec::new(), Vec::new());
    let whole = c.part == IrPart::Whole;
    let pass = match c.kind {
        Kind::F => Pass::F,
        Kind::B => Pass::B,
        Kind::W => Pass::W,
        Kind::BW => Pass::BW,
    };
    match c.kind {
        Kind::F => {
            let first = whole || c.part == IrPart::Attn;
            let last = whole || c.part == IrPart::Combine;
            let input = pl.prev_stage(s).map(|p| Buf::Act { stage: p, mb });
            let output = pl.next_stage(s).map(|_| Buf::Act { stage: s, mb });
            if first {
                if let Some(e) = input.and_then(|i| recv_ev.get(&i)) {
                    pre.push(Op::Wait { event: *e });
                }
                pre.push(Op::Alloc {
                    buf: stash,
                    zero: false,
                });
                reads.extend(input);
                if let Some(i) = input.filter(|_| !keep_input) {
                    post.push(Op::Free { buf: i });
                }
            } else {
                reads.push(stash);
            }
            writes.push(stash);
            if last {
                if let Some(o) = output {
                    pre.push(Op::Alloc {
                        buf: o,
                        zero: false,
                    });
                    writes.push(o);
                    if let Some(e) = send_ev.get(&o) {
                        post.push(Op::Record { event: *e });
                    }
                }
            }
        }
        Kind::B | Kind::BW => {
            let first = whole || c.part == IrPart::Combine;
            let last = whole || c.part == IrPart::Attn;
            let gin = pl.next_stage(s).map(|n| Buf::Grad { stage: n, mb });
            let gout = pl.prev_stage(s).map(|_| Buf::Grad { stage: s, mb });
            reads.push(stash);
            writes.push(stash);
            if first {
                if let Some(g) = gin {
                    if let Some(e) = recv_ev.get(&g) {
                        pre.push(Op::Wait { event: *e });
                    }
                    reads.push(g);
                    post.push(Op::Free { buf: g });
                }
            }
            if last {
                if let Some(o) = gout {
                    pre.push(Op::Alloc {
                        buf: o,
                        zero: false,
                    });
                    writes.push(o);
                    if let Some(e) = send_ev.get(&o) {
                        post.push(Op::Record { event: *e });
                    }
                }
            }
            if c.kind == Kind::BW {
                reads.push(wg);
                writes.push(wg);
                if last {
                    post.push(Op::Free { buf: stash });
                }
            }
        }
        Kind::W => {
            reads.extend([stash, wg]);
            writes.push(wg);
            // Split (`W.mlp`, then `W.attn`): the stash goes after the last part.
            if whole || c.part == IrPart::Attn {
                post.push(Op::Free { buf: stash });
            }
        }
    }
    reads.sort();
    writes.sort();
    (
        pre,
        Kernel {
            pass,
            stage: s,
            mb,
            part: Part::Stage { moe: c.part },
            reads,
            writes,
        },
        post,
    )
}

// ---------------------------------------------------------------------------------------
// MoE parts (`--moe`): see the format's docs.

/// What the parts of one rank need besides the builder.
struct PartCtx<'a> {
    /// The forwards whose input stays allocated until their `RECOMPUTE`.
    keep_input: &'a HashSet<(u32, u32)>,
    pl: &'a schedc_ir::Pipeline,
    layers: u32,
    ep_group: &'a [u32],
    sp_group: &'a [u32],
    /// The TP group (one member: no tensor parallelism).
    tp_group: &'a [u32],
    /// Megatron sequence parallelism inside the TP group.
    seq_par: bool,
    recv_ev: &'a HashMap<Buf, u32>,
    send_ev: &'a HashMap<Buf, u32>,
    /// The instruction index of each message of the rank (sends and receives).
    comm_pos: &'a HashMap<Buf, usize>,
}

/// A group of interleaved MoE parts: from the first part of an op until every op begun in
/// it has all four parts. Whole ops written among the parts (a dense op of a mixed pair)
/// belong to it too.
#[derive(Default)]
struct Window {
    /// Parts and whole ops, in program order.
    items: Vec<(schedc_ir::Compute, LocalStage)>,
    /// The split ops: `(kind, stage, mb)` and how many parts have come.
    ops: Vec<(Kind, u32, u32, u8)>,
    /// Split ops still missing parts.
    open: usize,
    /// Compute-stream waits for receives (`WAIT_RA/RG`): before item `.0`, the receive of
    /// buffer `.1`, its event `.2`.
    waits: Vec<(usize, Buf, u32)>,
}

impl Window {
    fn push_part(&mut self, c: schedc_ir::Compute, st: LocalStage) {
        let key = (c.kind, c.stage, c.mb);
        match self
            .ops
            .iter_mut()
            .find(|o| (o.0, o.1, o.2) == key && o.3 < 4)
        {
            Some(o) => {
                o.3 += 1;
                if o.3 == 4 {
                    self.open -= 1;
                }
            }
            None => {
                self.ops.push((c.kind, c.stage, c.mb, 1));
                self.open += 1;
            }
        }
        self.items.push((c, st));
    }
}

/// Per split op of a window: the event the compute stream waits for before the op's next
/// compute kernel (the all-to-all in flight), and the forward's `combine` kernel still to
/// run (its layer), which waits for the combine all-to-all.
#[derive(Clone, Copy, Default)]
struct PartState {
    wait: Option<u32>,
    pending_combine: Option<u32>,
    /// A forward's tail has run.
    tail_done: bool,
}

fn kernel_op(pass: Pass, stage: u32, mb: u32, part: Part, reads: Vec<Buf>, writes: Vec<Buf>) -> Op {
    Op::Kernel(Kernel {
        pass,
        stage,
        mb,
        part,
        reads,
        writes,
    })
}

/// Emits a complete window: its part order once per layer (a forward's layer `l` in
/// round `l`, a backward's layer `L-1-l`), whole ops in the first round, then each
/// forward's last `combine` kernel (and `head`, and the event of its output's send), then
/// each backward's tail (`BW`: the weight gradient). A forward whose output's send the
/// rank posts no later than a receive that a later op of the window waits for runs its
/// remaining layers and its tail before that wait (else the rank's compute and
/// communication streams wait for each other). Errors: with more than one layer per
/// stage, two ops of the window of which one needs the other's result (layer-by-layer
/// rounds would run them out of order).
fn flush_window(
    b: &mut Builder,
    cx: &PartCtx<'_>,
    win: &mut Window,
    r: u32,
) -> Result<(), ProgramError> {
    let items = std::mem::take(&mut win.items);
    let waits = std::mem::take(&mut win.waits);
    win.ops.clear();
    win.open = 0;
    let layers = cx.layers;
    // A weight gradient's part (`W.mlp`, `W.attn`) runs in the window's order with one layer
    // per stage; with more, the window runs layer by layer and its backward may still have
    // layers to go, so the part runs after the window's rounds.
    let w_part = |c: &schedc_ir::Compute| c.kind == Kind::W && c.part != IrPart::Whole;
    if layers > 1 {
        let related = |a: &schedc_ir::Compute, c: &schedc_ir::Compute| {
            a.mb == c.mb
                && (a.stage == c.stage
                    || cx.pl.next_stage(a.stage) == Some(c.stage)
                    || cx.pl.prev_stage(a.stage) == Some(c.stage))
        };
        for (i, (a, _)) in items.iter().enumerate() {
            for (c, _) in &items[i + 1..] {
                if !w_part(a)
                    && !w_part(c)
                    && (a.kind, a.stage, a.mb) != (c.kind, c.stage, c.mb)
                    && related(a, c)
                {
                    return Err(ProgramError::Unsupported(format!(
                        "rank {r}: the MoE parts of {} and {} interleave, but one needs the other's result; with {layers} layers per stage the CPU backend runs interleaved parts layer by layer, so only independent ops may interleave",
                        schedc::passes::compute_str(&schedc_ir::Compute { part: IrPart::Whole, ..*a }),
                        schedc::passes::compute_str(&schedc_ir::Compute { part: IrPart::Whole, ..*c }),
                    )));
                }
            }
        }
    }
    let mut state: HashMap<(Kind, u32, u32), PartState> = HashMap::new();
    // Before `c` runs: the tail of every forward of the window whose result it reads (its
    // previous stage's output, or its own stage's stash for a backward or W), so that a
    // deferred `combine` kernel never runs after its reader (one layer per stage only: with
    // more, such ops were refused above).
    let producers_first = |b: &mut Builder,
                           state: &mut HashMap<(Kind, u32, u32), PartState>,
                           c: &schedc_ir::Compute| {
        for (x, xst) in &items {
            if x.kind != Kind::F || x.part == IrPart::Whole || x.mb != c.mb {
                continue;
            }
            let reads = if c.kind == Kind::F {
                cx.pl.next_stage(x.stage) == Some(c.stage)
            } else {
                x.stage == c.stage
            };
            if reads {
                let ps = state.entry((x.kind, x.stage, x.mb)).or_default();
                forward_tail(b, cx, xst, x.mb, ps);
            }
        }
    };
    // Before `c` (at `layer`; a whole op at layer 0) waits for a receive: the tail of every
    // forward of the window whose output's send the rank's program posts no later than that
    // receive. The send waits for the tail on its communication stream, which posts the
    // receive only after the send, so a tail deferred past the receive's wait would be a
    // cycle between the rank's own streams (DualPipeV P = 4 under `--moe=all:list`, where a
    // rolling interleave keeps the window open across a forward's send and a later op's
    // receive).
    //
    // Such a wait comes in round 0 (a forward's first layer, a backward's last). With more
    // than one layer per stage the forward's later layers are still to come: they run
    // there, in their part order, before the tail (the forward is independent of every other
    // op of the window, checked above, and its EP peers lower the same program, so their
    // all-to-alls stay in one order), and the later rounds skip it.
    let recv_of = |c: &schedc_ir::Compute, layer: u32| match (c.kind, c.part) {
        (Kind::F, IrPart::Whole | IrPart::Attn) if layer == 0 => cx
            .pl
            .prev_stage(c.stage)
            .map(|p| Buf::Act { stage: p, mb: c.mb }),
        (Kind::B | Kind::BW, IrPart::Whole) => cx
            .pl
            .next_stage(c.stage)
            .map(|n| Buf::Grad { stage: n, mb: c.mb }),
        (Kind::B | Kind::BW, IrPart::Combine) if layer + 1 == layers => cx
            .pl
            .next_stage(c.stage)
            .map(|n| Buf::Grad { stage: n, mb: c.mb }),
        _ => None,
    };
    let sends_first = |b: &mut Builder,
                       state: &mut HashMap<(Kind, u32, u32), PartState>,
                       finished: &mut Vec<(Kind, u32, u32)>,
                       recv: Option<Buf>| {
        let Some(at) = recv
            .filter(|x| cx.recv_ev.contains_key(x))
            .and_then(|x| cx.comm_pos.get(&x))
        else {
            return;
        };
        for (x, xst) in &items {
            if x.kind != Kind::F || x.part != IrPart::Combine {
                continue;
            }
            let key = (x.kind, x.stage, x.mb);
            let sent = cx
                .comm_pos
                .get(&Buf::Act {
                    stage: x.stage,
                    mb: x.mb,
                })
                .is_some_and(|p| p <= at);
            if !sent || finished.contains(&key) {
                continue;
            }
            let ps = state.entry(key).or_default();
            // Its first-round combine has run (all its parts come before its send); a tail
            // already run (a reader's `producers_first`) leaves nothing to do.
            let Some(next) = ps.pending_combine.filter(|_| !ps.tail_done).map(|l| l + 1) else {
                continue;
            };
            for l in next..layers {
                for (y, yst) in &items {
                    if (y.kind, y.stage, y.mb) == key && y.part != IrPart::Whole {
                        emit_part(b, cx, yst, y, l, ps);
                    }
                }
            }
            forward_tail(b, cx, xst, x.mb, ps);
            finished.push(key);
        }
    };
    let mut finished: Vec<(Kind, u32, u32)> = Vec::new();
    // Before item `i` (round 0): its compute-stream waits for receives, after the forward
    // tails those receives' senders may be waiting for.
    let waits_before = |b: &mut Builder,
                        state: &mut HashMap<(Kind, u32, u32), PartState>,
                        finished: &mut Vec<(Kind, u32, u32)>,
                        i: usize| {
        for &(_, buf, event) in waits.iter().filter(|w| w.0 == i) {
            sends_first(b, state, finished, Some(buf));
            b.compute.push(Op::Wait { event });
        }
    };
    for round in 0..layers {
        for (i, (c, st)) in items.iter().enumerate() {
            if round == 0 {
                waits_before(b, &mut state, &mut finished, i);
            }
            if w_part(c) {
                if round == 0 && layers == 1 {
                    producers_first(b, &mut state, c);
                    emit_weights_part(b, st.stage, c.mb, c.part);
                }
                continue;
            }
            if c.part == IrPart::Whole {
                if round == 0 {
                    sends_first(b, &mut state, &mut finished, recv_of(c, 0));
                    producers_first(b, &mut state, c);
                    emit_compute(b, cx, st, c.kind, c.mb);
                }
                continue;
            }
            let layer = if c.kind == Kind::F {
                round
            } else {
                layers - 1 - round
            };
            if finished.contains(&(c.kind, c.stage, c.mb)) {
                continue;
            }
            sends_first(b, &mut state, &mut finished, recv_of(c, layer));
            if round == 0 {
                producers_first(b, &mut state, c);
            }
            let ps = state.entry((c.kind, c.stage, c.mb)).or_default();
            emit_part(b, cx, st, c, layer, ps);
        }
    }
    waits_before(b, &mut state, &mut finished, items.len());
    if layers > 1 {
        for (c, st) in items.iter().filter(|(c, _)| w_part(c)) {
            emit_weights_part(b, st.stage, c.mb, c.part);
        }
    }
    // Tails: forwards first (their outputs go to the next stage), then backwards.
    let mut done: Vec<(Kind, u32, u32)> = Vec::new();
    for fwd in [true, false] {
        for (c, st) in &items {
            let key = (c.kind, c.stage, c.mb);
            if c.part == IrPart::Whole || (c.kind == Kind::F) != fwd || done.contains(&key) {
                continue;
            }
            done.push(key);
            let ps = state.entry(key).or_default();
            if c.kind == Kind::F {
                forward_tail(b, cx, st, c.mb, ps);
            } else if c.kind == Kind::BW {
                emit_weights(b, st.stage, c.mb);
            }
        }
    }
    Ok(())
}

/// The end of a forward in parts (once): its last `combine` kernel, `head` on the last
/// stage, and the event its output's send waits for.
fn forward_tail(b: &mut Builder, cx: &PartCtx<'_>, st: &LocalStage, mb: u32, ps: &mut PartState) {
    if ps.tail_done {
        return;
    }
    ps.tail_done = true;
    flush_combine(b, cx, st, mb, ps);
    let s = st.stage;
    let stash = Buf::Stash { stage: s, mb };
    if st.last {
        b.compute.push(kernel_op(
            Pass::F,
            s,
            mb,
            Part::Head,
            vec![stash],
            vec![stash],
        ));
    }
    let output = cx.pl.next_stage(s).map(|_| Buf::Act { stage: s, mb });
    if let Some(e) = output.and_then(|o| cx.send_ev.get(&o)) {
        b.compute.push(Op::Record { event: *e });
    }
}

/// The forward's deferred `combine` kernel, after the combine all-to-all it waits for.
fn flush_combine(b: &mut Builder, cx: &PartCtx<'_>, st: &LocalStage, mb: u32, ps: &mut PartState) {
    let Some(l) = ps.pending_combine.take() else {
        return;
    };
    let s = st.stage;
    let stash = Buf::Stash { stage: s, mb };
    if let Some(e) = ps.wait.take() {
        b.compute.push(Op::Wait { event: e });
    }
    let mut writes = vec![stash];
    if l + 1 == cx.layers {
        writes.extend(cx.pl.next_stage(s).map(|_| Buf::Act { stage: s, mb }));
    }
    b.compute.push(kernel_op(
        Pass::F,
        s,
        mb,
        Part::Combine { layer: l },
        vec![stash],
        writes,
    ));
}

/// One part of one layer (see the table in [`crate::format`]).
fn emit_part(
    b: &mut Builder,
    cx: &PartCtx<'_>,
    st: &LocalStage,
    c: &schedc_ir::Compute,
    l: u32,
    ps: &mut PartState,
) {
    let (s, mb) = (st.stage, c.mb);
    let stash = Buf::Stash { stage: s, mb };
    let wg = Buf::WeightGrad { stage: s };
    let k = |pass, part, reads, writes| kernel_op(pass, s, mb, part, reads, writes);
    let a2a = |phase| Op::AllToAll {
        stage: s,
        mb,
        layer: l,
        phase,
        group: if matches!(phase, A2a::GatherKv | A2a::ScatterKvGrad) {
            cx.sp_group.to_vec()
        } else {
            cx.ep_group.to_vec()
        },
    };
    // An EP all-to-all: after the compute stream's last kernel of this op, on the EP
    // stream; the op's next compute kernel waits for it.
    let ep_a2a = |b: &mut Builder, ps: &mut PartState, phase| {
        let ready = b.event();
        b.compute.push(Op::Record { event: ready });
        let done = b.event();
        b.ep.push(Op::Wait { event: ready });
        b.ep.push(a2a(phase));
        b.ep.push(Op::Record { event: done });
        ps.wait = Some(done);
    };
    let wait = |b: &mut Builder, ps: &mut PartState| {
        if let Some(e) = ps.wait.take() {
            b.compute.push(Op::Wait { event: e });
        }
    };
    let last_layer = l + 1 == cx.layers;
    match (c.kind, c.part) {
        (Kind::F, IrPart::Attn) => {
            let input = cx.pl.prev_stage(s).map(|p| Buf::Act { stage: p, mb });
            if l == 0 {
                if let Some(e) = input.and_then(|i| cx.recv_ev.get(&i)) {
                    b.compute.push(Op::Wait { event: *e });
                }
                b.compute.push(Op::Alloc {
                    buf: stash,
                    zero: false,
                });
                if let Some(o) = cx.pl.next_stage(s).map(|_| Buf::Act { stage: s, mb }) {
                    b.compute.push(Op::Alloc {
                        buf: o,
                        zero: false,
                    });
                }
                if st.first {
                    b.compute.push(k(Pass::F, Part::Embed, vec![], vec![stash]));
                }
            }
            flush_combine(b, cx, st, mb, ps);
            wait(b, ps);
            let reads = if l == 0 && !st.first {
                vec![input.expect("a non-first stage has a previous stage")]
            } else {
                vec![stash]
            };
            b.compute
                .push(k(Pass::F, Part::Qkv { layer: l }, reads, vec![stash]));
            if l == 0 && !st.first {
                b.compute.push(Op::Free {
                    buf: input.expect("checked"),
                });
            }
            if cx.seq_par {
                b.tp_collective(cx.tp_group, s, mb, l, Tp::LatentGather);
                b.compute.push(k(
                    Pass::F,
                    Part::QkvPost { layer: l },
                    vec![stash],
                    vec![stash],
                ));
            }
            b.compute.push(a2a(A2a::GatherKv));
            b.compute.push(k(
                Pass::F,
                Part::Attn { layer: l },
                vec![stash],
                vec![stash, wg],
            ));
            if cx.seq_par {
                b.tp_collective(cx.tp_group, s, mb, l, Tp::AttnOutScatter);
                b.compute.push(k(
                    Pass::F,
                    Part::AttnPost { layer: l },
                    vec![stash],
                    vec![stash, wg],
                ));
                b.tp_collective(cx.tp_group, s, mb, l, Tp::MlpInGather);
                b.compute.push(k(
                    Pass::F,
                    Part::Shared { layer: l },
                    vec![stash],
                    vec![stash],
                ));
                b.tp_collective(cx.tp_group, s, mb, l, Tp::MlpOutScatter);
            } else if cx.tp_group.len() > 1 {
                b.tp_collective(cx.tp_group, s, mb, l, Tp::AttnOut);
                b.compute.push(k(
                    Pass::F,
                    Part::AttnPost { layer: l },
                    vec![stash],
                    vec![stash, wg],
                ));
                b.tp_collective(cx.tp_group, s, mb, l, Tp::MlpOut);
            }
        }
        (Kind::F, IrPart::Dispatch) => ep_a2a(b, ps, A2a::Dispatch),
        (Kind::F, IrPart::Mlp) => {
            wait(b, ps);
            b.compute.push(k(
                Pass::F,
                Part::Experts { layer: l },
                vec![stash],
                vec![stash],
            ));
        }
        (Kind::F, IrPart::Combine) => {
            ep_a2a(b, ps, A2a::Combine);
            ps.pending_combine = Some(l);
        }
        (_, IrPart::Combine) => {
            // B or BW, from the last layer.
            let gin = cx.pl.next_stage(s).map(|n| Buf::Grad { stage: n, mb });
            let gout = cx.pl.prev_stage(s).map(|_| Buf::Grad { stage: s, mb });
            if last_layer {
                if let Some(e) = gin.and_then(|i| cx.recv_ev.get(&i)) {
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
                        .push(k(Pass::B, Part::Head, vec![stash], vec![stash]));
                }
            }
            wait(b, ps);
            let mut reads = vec![stash];
            if last_layer && !st.last {
                reads.push(gin.expect("a non-last stage has a next stage"));
            }
            b.compute
                .push(k(Pass::B, Part::Combine { layer: l }, reads, vec![stash]));
            if last_layer && !st.last {
                b.compute.push(Op::Free {
                    buf: gin.expect("checked"),
                });
            }
            if cx.seq_par {
                b.tp_collective(cx.tp_group, s, mb, l, Tp::MlpOutGradGather);
                b.compute.push(k(
                    Pass::B,
                    Part::Shared { layer: l },
                    vec![stash],
                    vec![stash],
                ));
                b.tp_collective(cx.tp_group, s, mb, l, Tp::MlpInGradScatter);
            } else {
                b.tp_collective(cx.tp_group, s, mb, l, Tp::MlpInGrad);
            }
            ep_a2a(b, ps, A2a::CombineGrad);
        }
        (_, IrPart::Mlp) => {
            wait(b, ps);
            b.compute.push(k(
                Pass::B,
                Part::Experts { layer: l },
                vec![stash],
                vec![stash],
            ));
        }
        (_, IrPart::Dispatch) => ep_a2a(b, ps, A2a::DispatchGrad),
        (_, IrPart::Attn) => {
            wait(b, ps);
            if cx.seq_par {
                b.compute.push(k(
                    Pass::B,
                    Part::AttnPost { layer: l },
                    vec![stash],
                    vec![stash],
                ));
                b.tp_collective(cx.tp_group, s, mb, l, Tp::AttnOutGradGather);
            }
            b.compute.push(k(
                Pass::B,
                Part::Attn { layer: l },
                vec![stash],
                vec![stash],
            ));
            b.compute.push(a2a(A2a::ScatterKvGrad));
            let gout = cx.pl.prev_stage(s).map(|_| Buf::Grad { stage: s, mb });
            let mut writes = vec![stash];
            if l == 0 {
                writes.extend(gout);
            }
            if cx.tp_group.len() > 1 {
                b.compute
                    .push(k(Pass::B, Part::Qkv { layer: l }, vec![stash], vec![stash]));
                let phase = if cx.seq_par {
                    Tp::LatentGradScatter
                } else {
                    Tp::AttnInGrad
                };
                b.tp_collective(cx.tp_group, s, mb, l, phase);
                b.compute
                    .push(k(Pass::B, Part::QkvPost { layer: l }, vec![stash], writes));
            } else {
                b.compute
                    .push(k(Pass::B, Part::Qkv { layer: l }, vec![stash], writes));
            }
            if l == 0 {
                if let Some(e) = gout.and_then(|o| cx.send_ev.get(&o)) {
                    b.compute.push(Op::Record { event: *e });
                }
            }
        }
        (_, IrPart::Whole) => unreachable!("whole ops are emitted by emit_compute"),
    }
}
