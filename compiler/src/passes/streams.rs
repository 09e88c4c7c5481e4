//! A lowered program flattened into the streams that pass 4 and the simulator run: every
//! communication op with its rank, position and group; groups with their producer and the
//! communication stream (one per rank and channel) they run on; each rank's compute-stream
//! items with the communication ops they wait for.

use super::{is_first_part, is_last_part, on_compute_stream};
use schedc_ir::{Comm, Instr, Kind, PayloadKind, Program};

/// "None" in the index arrays.
pub const NONE: u32 = u32::MAX;

/// (sender, receiver, channel): the unit of FIFO matching.
pub type ChannelKey = (u32, u32, u32);

/// The flattened program. Op ids index the `op_*` arrays, group ids the `g_*` arrays.
pub struct Streams<'p> {
    /// Each communication op, in rank then program order.
    pub comm: Vec<&'p Comm>,
    /// Rank of each op.
    pub op_rank: Vec<u32>,
    /// Instruction position of each op.
    pub op_pos: Vec<u32>,
    /// Group of each op.
    pub op_group: Vec<u32>,
    /// Rank of each group.
    pub g_rank: Vec<u32>,
    /// Instruction position of each group.
    pub g_pos: Vec<u32>,
    /// Op id range of each group.
    pub g_ops: Vec<(u32, u32)>,
    /// The compute item that must have run before the group is posted (it produces the
    /// latest of the group's send payloads), or [`NONE`].
    pub g_producer: Vec<u32>,
    /// Communication stream of each group (that of its first op's channel).
    pub g_stream: Vec<u32>,
    /// Rank of each communication stream.
    pub stream_rank: Vec<u32>,
    /// Groups of each communication stream, in program order.
    pub stream_groups: Vec<Vec<u32>>,
    /// Communication streams of each rank.
    pub rank_streams: Vec<Vec<usize>>,
    /// Per rank, its compute-stream items: (instruction position, range into `waits`).
    pub items: Vec<Vec<(u32, (u32, u32))>>,
    /// The op ids compute items wait for: the receives feeding them, the send a `WAIT_SA/SG`
    /// waits for, the receive a `WAIT_RA/RG` waits for.
    pub waits: Vec<u32>,
}

impl Streams<'_> {
    /// Sends and receives by (sender, receiver, channel), each in program order: the k-th send
    /// pairs with the k-th receive.
    pub fn channels(&self) -> super::PackedMap<ChannelKey, (Vec<u32>, Vec<u32>)> {
        let mut chans: super::PackedMap<ChannelKey, (Vec<u32>, Vec<u32>)> =
            super::PackedMap::default();
        for (id, c) in self.comm.iter().enumerate() {
            let r = self.op_rank[id];
            match c {
                Comm::Send { peer, channel, .. } => chans
                    .entry((r, *peer, *channel))
                    .or_default()
                    .0
                    .push(id as u32),
                Comm::Recv { peer, channel, .. } => chans
                    .entry((*peer, r, *channel))
                    .or_default()
                    .1
                    .push(id as u32),
                Comm::Collective(_) => {}
            }
        }
        chans
    }
}

/// Flattens `p` in one pass per rank, O(instructions).
pub fn flatten(p: &Program) -> Streams<'_> {
    let pl = &p.pipeline;
    let (s_n, m_n) = (pl.stages, pl.microbatches);
    let np = p.ranks.len();
    let n = s_n as usize * m_n as usize;
    let pk = |k: PayloadKind, s: u32, m: u32| -> Option<usize> {
        (s < s_n && m < m_n).then(|| k as usize * n + (s * m_n + m) as usize)
    };
    let mut st = Streams {
        comm: Vec::new(),
        op_rank: Vec::new(),
        op_pos: Vec::new(),
        op_group: Vec::new(),
        g_rank: Vec::new(),
        g_pos: Vec::new(),
        g_ops: Vec::new(),
        g_producer: Vec::new(),
        g_stream: Vec::new(),
        stream_rank: Vec::new(),
        stream_groups: Vec::new(),
        rank_streams: vec![Vec::new(); np],
        items: Vec::with_capacity(np),
        waits: Vec::new(),
    };
    let mut stream_of: super::PackedMap<(u32, u32), usize> = super::PackedMap::default();
    // Per-rank scratch, indexed by payload: the first receive and send of it, the item that
    // produces it. Reset after each rank.
    let mut prod_item = vec![NONE; 4 * n];
    let mut recv_op = vec![NONE; 4 * n];
    let mut send_op = vec![NONE; 4 * n];
    // The `RETURN` receives of this rank, by stash: (position, op), in program order (a stash
    // may be lent and returned more than once; a backward waits for the latest before it).
    let mut returns: std::collections::HashMap<usize, Vec<(u32, u32)>> = Default::default();
    for (r, instrs) in p.ranks.iter().enumerate() {
        let g0 = st.g_rank.len();
        let mut touched = Vec::new();
        for (i, ins) in instrs.iter().enumerate() {
            let cs = ins.comms();
            if cs.is_empty() {
                continue;
            }
            let gid = st.g_rank.len() as u32;
            let start = st.comm.len() as u32;
            let k = *stream_of
                .entry((r as u32, cs[0].channel()))
                .or_insert_with(|| {
                    st.stream_rank.push(r as u32);
                    st.stream_groups.push(Vec::new());
                    st.rank_streams[r].push(st.stream_groups.len() - 1);
                    st.stream_groups.len() - 1
                });
            st.stream_groups[k].push(gid);
            st.g_stream.push(k as u32);
            for m in cs {
                let id = st.comm.len() as u32;
                st.comm.push(m);
                st.op_group.push(gid);
                st.op_rank.push(r as u32);
                st.op_pos.push(i as u32);
                let table = match m {
                    Comm::Recv { payload, .. } => Some((&mut recv_op, payload)),
                    Comm::Send { payload, .. } => Some((&mut send_op, payload)),
                    Comm::Collective(_) => None,
                };
                if let Comm::Recv { payload, .. } = m {
                    if payload.kind == PayloadKind::Return {
                        if let Some(k) = pk(PayloadKind::Return, payload.stage, payload.mb) {
                            returns.entry(k).or_default().push((i as u32, id));
                        }
                    }
                }
                if let Some((t, payload)) = table {
                    if let Some(k) = pk(payload.kind, payload.stage, payload.mb) {
                        if t[k] == NONE {
                            t[k] = id;
                            touched.push(k);
                        }
                    }
                }
            }
            st.g_rank.push(r as u32);
            st.g_pos.push(i as u32);
            st.g_ops.push((start, st.comm.len() as u32));
            st.g_producer.push(NONE);
        }
        let mut its = Vec::new();
        for (i, ins) in instrs.iter().enumerate() {
            if !on_compute_stream(ins) {
                continue;
            }
            let item = its.len() as u32;
            let w0 = st.waits.len() as u32;
            ins.for_each_compute(|c| {
                if c.stage >= s_n || c.mb >= m_n {
                    return;
                }
                let need = match c.kind {
                    Kind::F => pl.prev_stage(c.stage).map(|ps| (PayloadKind::Act, ps)),
                    Kind::B | Kind::BW => pl.next_stage(c.stage).map(|ns| (PayloadKind::Grad, ns)),
                    Kind::W => None,
                };
                if let Some((k, s)) = need {
                    if pl.rank_of(s) as usize != r {
                        if let Some(kk) = pk(k, s, c.mb) {
                            if recv_op[kk] != NONE {
                                st.waits.push(recv_op[kk]);
                            }
                        }
                    }
                }
                // A backward of a stash that was lent waits for it to come back.
                if c.kind != Kind::F && is_first_part(c) {
                    if let Some(v) =
                        pk(PayloadKind::Return, c.stage, c.mb).and_then(|k| returns.get(&k))
                    {
                        if let Some(&(_, id)) = v.iter().rev().find(|(p, _)| *p < i as u32) {
                            st.waits.push(id);
                        }
                    }
                }
                // The stash a LEND sends exists once the forward has run.
                if c.kind == Kind::F && is_last_part(c) {
                    if let Some(kk) = pk(PayloadKind::Lend, c.stage, c.mb) {
                        prod_item[kk] = item;
                        touched.push(kk);
                    }
                }
                if is_last_part(c) {
                    let prod = match c.kind {
                        Kind::F => Some(PayloadKind::Act),
                        Kind::B | Kind::BW => Some(PayloadKind::Grad),
                        Kind::W => None,
                    };
                    if let Some(kk) = prod.and_then(|k| pk(k, c.stage, c.mb)) {
                        prod_item[kk] = item;
                        touched.push(kk);
                    }
                }
            });
            if let Instr::WaitSend(pl_) | Instr::WaitRecv(pl_) = ins {
                let table = if matches!(ins, Instr::WaitSend(_)) {
                    &send_op
                } else {
                    &recv_op
                };
                if let Some(id) = pk(pl_.kind, pl_.stage, pl_.mb)
                    .map(|k| table[k])
                    .filter(|&id| id != NONE)
                {
                    st.waits.push(id);
                }
            }
            its.push((i as u32, (w0, st.waits.len() as u32)));
        }
        // A group is posted once the latest producer of its sends' payloads has run.
        for g in g0..st.g_rank.len() {
            let (a, b) = st.g_ops[g];
            let mut need = NONE;
            for id in a..b {
                if let Comm::Send { payload, .. } = st.comm[id as usize] {
                    if let Some(kk) = pk(payload.kind, payload.stage, payload.mb) {
                        let it = prod_item[kk];
                        if it != NONE && (need == NONE || it > need) {
                            need = it;
                        }
                    }
                }
            }
            // A LEND/RETURN group is issued when the program reaches it: after the compute
            // item before it in program order (a stash moves when the schedule says, not as
            // early as the stream allows).
            let stash = (a..b).any(|id| match st.comm[id as usize] {
                Comm::Send { payload, .. } | Comm::Recv { payload, .. } => payload.kind.is_stash(),
                Comm::Collective(_) => false,
            });
            if stash {
                let at = st.g_pos[g];
                let k = its.partition_point(|&(pos, _)| pos < at);
                if k > 0 {
                    let it = (k - 1) as u32;
                    if need == NONE || it > need {
                        need = it;
                    }
                }
            }
            st.g_producer[g] = need;
        }
        for k in touched {
            prod_item[k] = NONE;
            recv_op[k] = NONE;
            send_op[k] = NONE;
        }
        returns.clear();
        st.items.push(its);
    }
    st
}
