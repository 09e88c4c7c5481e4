//! How ranks exchange data: point-to-point sends and receives, the all-to-alls of a layer,
//! and the gradient reductions.
//!
//! * [`Single`]: every rank of the run in one process and one CUDA context (one GPU runs
//!   `P` ranks, each with its own streams). A send copies the buffer into a staging block on
//!   the sender's stream and records an event; the receive makes its stream wait for that
//!   event and copies the block into its buffer (device-to-device copies ordered by events).
//!   An all-to-all is two phases: every member records that its outbox is ready, then every
//!   member copies its slot of every member's outbox, records, and waits until every member
//!   has copied before its outbox may change. A reduction sums the members' gradients in
//!   group order (the CPU backend's order) into a scratch block, then copies it back once
//!   every member has read every other's.
//! * [`Nccl`]: one process per GPU; sends and receives are `ncclSend` / `ncclRecv` on the
//!   stream's own communicator; an all-to-all is one NCCL group of a send and a receive per
//!   member (all-to-all-v as grouped point-to-point, every slot at its bound so that no
//!   count has to reach the host first); a reduction gathers the members' gradients with one
//!   group and sums them in group order on every member, which keeps every replica
//!   bit-identical and equal to the single-GPU mode.
//!
//! Both answer [`Ready::Blocked`] only while waiting for another rank's host-side progress
//! (single mode); NCCL calls are issued at once and the device waits.

use crate::api::*;
use crate::pool::{Events, Pool};
use schedc_program::interp::Ready;
use schedc_program::model::Scope;
use schedc_program::{A2a, Buf, Tp};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// What a transport call needs from its rank.
pub struct Cx<'a> {
    /// The device.
    pub gpu: &'a dyn Gpu,
    /// Events.
    pub events: &'a Events,
    /// The rank's pool (scratch blocks).
    pub pool: &'a mut Pool,
    /// Global rank.
    pub rank: u32,
    /// Step.
    pub step: usize,
    /// The stream of the instruction.
    pub s: StreamId,
    /// The communicator of that stream (NCCL mode).
    pub comm: usize,
}

/// Which collective (with the step and the group, it identifies one instance).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CollTag {
    /// An all-to-all of `(stage, mb, layer, phase)`.
    A2a(u32, u32, u32, A2a),
    /// DualPipe's sum of a model stage's two copies.
    Replica(u32),
    /// The all-reduce of a stage's gradients of one scope.
    AllReduce(u32, Scope),
    /// A tensor-parallel all-reduce of `(stage, mb, layer, phase)`.
    Tp(u32, u32, u32, Tp),
    /// Megatron sequence parallelism: the sum over the TP group of a stage's gradients of
    /// the tensors it does not split (and the load counts).
    TpGrad(u32),
}

/// Exchanges data between ranks (see the module docs). Every method runs on the rank's
/// thread; `issued` is the interpreter's per-instruction flag.
pub trait Transport: Send + Sync {
    /// Sends `bytes` at `ptr` (the buffer `buf`) to `peer`.
    fn send(
        &self,
        cx: &mut Cx,
        buf: Buf,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<Ready, String>;
    /// Receives `buf` from `peer` into `ptr`.
    fn recv(
        &self,
        cx: &mut Cx,
        buf: Buf,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<Ready, String>;
    /// The all-to-all over `group`: slot `j` of `outbox` to member `j`, slot `j` of `inbox`
    /// from member `j`; `slot_bytes` each.
    #[allow(clippy::too_many_arguments)]
    fn all_to_all(
        &self,
        cx: &mut Cx,
        tag: CollTag,
        group: &[u32],
        outbox: DevPtr,
        inbox: DevPtr,
        slot_bytes: usize,
        issued: &mut bool,
    ) -> Result<Ready, String>;
    /// Every member's `count` values at `ptr` replaced by their sum over `group`, added in
    /// group order. `dtype`: the values' type, [`DType::F32`] (gradients, f32 in every run)
    /// or the device's storage type (the TP all-reduces of activations and their gradients,
    /// bf16 in a bf16 run: each addition in f32, rounded to bf16, as the `add` kernel does).
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        cx: &mut Cx,
        tag: CollTag,
        group: &[u32],
        ptr: DevPtr,
        count: usize,
        dtype: DType,
        issued: &mut bool,
    ) -> Result<Ready, String>;
    /// Megatron sequence parallelism's all-gather over `group`: every member's `count`
    /// values at `src` into slot `j` (of `count` values) of every member's `dst`, member `j`'s
    /// in slot `j` (`dst` holds `group.len() count` values; `src` may not overlap it).
    /// By default the all-reduce ([`Transport::reduce`]) of `dst` with this member's values
    /// in its slot and zeros in the others': exact (`x + 0 = x`, in bf16 as well).
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &self,
        cx: &mut Cx,
        tag: CollTag,
        group: &[u32],
        (src, dst): (DevPtr, DevPtr),
        count: usize,
        dtype: DType,
        issued: &mut bool,
    ) -> Result<Ready, String> {
        let mi = member(group, cx.rank)?;
        let bytes = count * dtype.size();
        if !*issued {
            for j in 0..group.len() {
                let slot = dst + (j * bytes) as u64;
                if j == mi {
                    cx.gpu.dtod(cx.s, slot, src, bytes)?;
                } else {
                    cx.gpu.memset(cx.s, slot, bytes)?;
                }
            }
        }
        self.reduce(cx, tag, group, dst, group.len() * count, dtype, issued)
    }
    /// Megatron sequence parallelism's reduce-scatter over `group`: the sum over the
    /// members (in group order) of their `group.len() count` values at `src`, of which
    /// member `j` keeps slot `j` (`count` values) in `dst`. `src` is overwritten (scratch).
    /// By default the all-reduce of `src` in place, then this member's slot copied out: the
    /// CPU backend's order of additions.
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        cx: &mut Cx,
        tag: CollTag,
        group: &[u32],
        (src, dst): (DevPtr, DevPtr),
        count: usize,
        dtype: DType,
        issued: &mut bool,
    ) -> Result<Ready, String> {
        let mi = member(group, cx.rank)?;
        let bytes = count * dtype.size();
        let r = self.reduce(cx, tag, group, src, group.len() * count, dtype, issued)?;
        if r == Ready::Done {
            cx.gpu.dtod(cx.s, dst, src + (mi * bytes) as u64, bytes)?;
        }
        Ok(r)
    }
    /// Blocks until another rank may have made progress, at most `at_most`.
    fn wait(&self, at_most: Duration);
    /// True if adjacent messages of a stream (one IR group) must be posted together
    /// ([`Transport::post_group`]): NCCL's sends are rendezvous, so a group's crossing
    /// sends posted one at a time would deadlock.
    fn groups_messages(&self) -> bool {
        false
    }
    /// Posts the messages of one group at once: `(send?, buffer pointer, bytes, peer)`.
    fn post_group(
        &self,
        _cx: &mut Cx,
        _msgs: &[(bool, DevPtr, usize, u32)],
    ) -> Result<Ready, String> {
        Err("this transport posts messages one at a time".into())
    }
}

/// `y = a + b` over `n` values of `dtype` (`add_f32` for f32, else the storage type's
/// `add`), on `s`.
fn add_n(
    gpu: &dyn Gpu,
    s: StreamId,
    y: DevPtr,
    a: DevPtr,
    b: DevPtr,
    n: usize,
    dtype: DType,
) -> Result<(), GpuError> {
    gpu.launch(
        s,
        &Launch {
            kernel: if dtype == DType::F32 {
                "add_f32"
            } else {
                "add"
            },
            grid: [n.div_ceil(256).clamp(1, 4096) as u32, 1, 1],
            block: [256, 1, 1],
            args: vec![Arg::Ptr(y), Arg::Ptr(a), Arg::Ptr(b), Arg::I64(n as i64)],
        },
    )
}

/// The sum of `srcs` (each `n` values of `dtype`) in order into `acc`, on `s`.
fn sum_in_order(
    gpu: &dyn Gpu,
    s: StreamId,
    acc: DevPtr,
    srcs: &[DevPtr],
    n: usize,
    dtype: DType,
) -> Result<(), GpuError> {
    match srcs {
        [] => Ok(()),
        [one] => gpu.dtod(s, acc, *one, n * dtype.size()),
        [a, b, rest @ ..] => {
            add_n(gpu, s, acc, *a, *b, n, dtype)?;
            for r in rest {
                add_n(gpu, s, acc, acc, *r, n, dtype)?;
            }
            Ok(())
        }
    }
}

fn member(group: &[u32], rank: u32) -> Result<usize, String> {
    group
        .iter()
        .position(|&m| m == rank)
        .ok_or_else(|| format!("rank {rank} is not in the group {group:?}"))
}

/// Where [`Single::join`] left a collective for this member.
enum Joined {
    /// A member has not posted yet.
    Blocked(Ready),
    /// Every member has posted: their buffers, in member order, to read now.
    Pull(Vec<DevPtr>),
    /// This member has read them already.
    Pulled,
}

#[derive(Default)]
struct Coll {
    posted: Vec<Option<(DevPtr, EventId)>>,
    pulled: Vec<Option<EventId>>,
    scratch: Vec<Option<DevPtr>>,
    finished: usize,
}

impl Coll {
    fn new(n: usize) -> Self {
        Coll {
            posted: vec![None; n],
            pulled: vec![None; n],
            scratch: vec![None; n],
            finished: 0,
        }
    }
}

/// A message in flight, keyed by `(step, from, to, buffer)`: the staging block, its bytes,
/// and the event recorded after the copy into it.
type P2p = HashMap<(usize, u32, u32, Buf), (DevPtr, usize, EventId)>;

/// One collective instance: `(step, tag, group)`.
type CollKey = (usize, CollTag, Vec<u32>);

#[derive(Default)]
struct State {
    p2p: P2p,
    coll: HashMap<CollKey, Coll>,
    staging: Pool,
}

/// The single-GPU transport: every rank in one process and context (module docs).
#[derive(Default)]
pub struct Single {
    st: Mutex<State>,
    cv: Condvar,
}

impl Single {
    /// A transport for one run.
    pub fn new() -> Self {
        Single::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Frees the staging blocks (after every stream is idle).
    pub fn release(&self, gpu: &dyn Gpu) -> Result<(), GpuError> {
        self.lock().staging.release(gpu)
    }

    /// Device bytes held for messages in flight.
    pub fn staging_bytes(&self) -> usize {
        self.lock().staging.held()
    }

    fn missing(v: &[Option<impl Copy>], group: &[u32]) -> Vec<u32> {
        group
            .iter()
            .zip(v)
            .filter(|(_, x)| x.is_none())
            .map(|(m, _)| *m)
            .collect()
    }

    /// Phase one of a collective and the start of phase two: posts this member's `ptr` once
    /// (`issued`), then blocks while a member has not posted; once all have, and this
    /// member has not pulled yet, makes its stream wait for every member's posted event and
    /// returns their buffers in member order.
    fn join(
        &self,
        cx: &mut Cx,
        key: &CollKey,
        mi: usize,
        ptr: DevPtr,
        issued: &mut bool,
    ) -> Result<Joined, String> {
        if !*issued {
            self.post(cx, key, mi, ptr)?;
            *issued = true;
        }
        let (posted, mine) = {
            let st = self.lock();
            let c = &st.coll[key];
            (c.posted.clone(), c.pulled[mi])
        };
        if mine.is_some() {
            return Ok(Joined::Pulled);
        }
        let missing = Self::missing(&posted, &key.2);
        if !missing.is_empty() {
            return Ok(Joined::Blocked(Ready::blocked(|| {
                format!("{} from ranks {missing:?}", Self::describe(&key.1))
            })));
        }
        let mut srcs = Vec::with_capacity(posted.len());
        for p in &posted {
            let (src, e) = p.ok_or("a posted slot vanished")?;
            cx.gpu.wait(cx.s, e)?;
            srcs.push(src);
        }
        Ok(Joined::Pull(srcs))
    }

    /// Phase one of a collective: this member's pointer and a ready event.
    fn post(&self, cx: &mut Cx, key: &CollKey, mi: usize, ptr: DevPtr) -> Result<(), String> {
        let e = cx.events.take(cx.gpu)?;
        cx.gpu.record(cx.s, e)?;
        let mut st = self.lock();
        let c = st
            .coll
            .entry(key.clone())
            .or_insert_with(|| Coll::new(key.2.len()));
        c.posted[mi] = Some((ptr, e));
        self.cv.notify_all();
        Ok(())
    }

    /// The end of a collective: waits for every other member's second-phase event; the last
    /// member to finish recycles the events.
    fn finish(&self, cx: &mut Cx, key: &CollKey, mi: usize) -> Result<(), String> {
        let pulled: Vec<Option<EventId>> = self.lock().coll[key].pulled.clone();
        for (j, e) in pulled.iter().enumerate() {
            if j != mi {
                if let Some(e) = e {
                    cx.gpu.wait(cx.s, *e)?;
                }
            }
        }
        let mut st = self.lock();
        let done = {
            let c = st.coll.get_mut(key).ok_or("a collective vanished")?;
            c.finished += 1;
            c.finished == key.2.len()
        };
        if done {
            if let Some(c) = st.coll.remove(key) {
                for (_, e) in c.posted.into_iter().flatten() {
                    cx.events.give(e);
                }
                for e in c.pulled.into_iter().flatten() {
                    cx.events.give(e);
                }
            }
        }
        self.cv.notify_all();
        Ok(())
    }

    fn describe(tag: &CollTag) -> String {
        match tag {
            CollTag::A2a(s, m, l, p) => {
                format!("the {p:?} all-to-all of stage {s}, micro-batch {m}, layer {l}")
            }
            CollTag::Replica(ms) => {
                format!("the gradients of model stage {ms} from its other copy")
            }
            CollTag::AllReduce(s, scope) => format!("the {scope:?} gradients of stage {s}"),
            CollTag::Tp(s, m, l, p) => {
                format!("the {p:?} TP collective of stage {s}, micro-batch {m}, layer {l}")
            }
            CollTag::TpGrad(s) => {
                format!("the TP group's replicated-weight gradients of stage {s}")
            }
        }
    }
}

impl Transport for Single {
    fn send(
        &self,
        cx: &mut Cx,
        buf: Buf,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<Ready, String> {
        let blk = self.lock().staging.take(cx.gpu, cx.events, cx.s, bytes)?;
        cx.gpu.dtod(cx.s, blk, ptr, bytes)?;
        let e = cx.events.take(cx.gpu)?;
        cx.gpu.record(cx.s, e)?;
        let mut st = self.lock();
        if st
            .p2p
            .insert((cx.step, cx.rank, peer, buf), (blk, bytes, e))
            .is_some()
        {
            return Err(format!("{buf} is sent twice to rank {peer} in one step"));
        }
        self.cv.notify_all();
        Ok(Ready::Done)
    }

    fn recv(
        &self,
        cx: &mut Cx,
        buf: Buf,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<Ready, String> {
        let got = self.lock().p2p.remove(&(cx.step, peer, cx.rank, buf));
        let Some((blk, n, e)) = got else {
            return Ok(Ready::blocked(|| {
                format!("{} from rank {peer}", buf.describe())
            }));
        };
        if n != bytes {
            return Err(format!("{buf} arrived with {n} bytes, expected {bytes}"));
        }
        cx.gpu.wait(cx.s, e)?;
        cx.events.give(e);
        cx.gpu.dtod(cx.s, ptr, blk, bytes)?;
        self.lock()
            .staging
            .give(cx.gpu, cx.events, cx.s, blk, bytes)?;
        Ok(Ready::Done)
    }

    fn all_to_all(
        &self,
        cx: &mut Cx,
        tag: CollTag,
        group: &[u32],
        outbox: DevPtr,
        inbox: DevPtr,
        sb: usize,
        issued: &mut bool,
    ) -> Result<Ready, String> {
        let mi = member(group, cx.rank)?;
        let key = (cx.step, tag, group.to_vec());
        if let Some(srcs) = match self.join(cx, &key, mi, outbox, issued)? {
            Joined::Blocked(r) => return Ok(r),
            Joined::Pull(srcs) => Some(srcs),
            Joined::Pulled => None,
        } {
            for (j, src) in srcs.into_iter().enumerate() {
                cx.gpu
                    .dtod(cx.s, inbox + (j * sb) as u64, src + (mi * sb) as u64, sb)?;
            }
            let e = cx.events.take(cx.gpu)?;
            cx.gpu.record(cx.s, e)?;
            let mut st = self.lock();
            st.coll.get_mut(&key).ok_or("a collective vanished")?.pulled[mi] = Some(e);
            self.cv.notify_all();
        }
        let pulled = self.lock().coll[&key].pulled.clone();
        let missing = Self::missing(&pulled, group);
        if !missing.is_empty() {
            return Ok(Ready::blocked(|| {
                format!(
                    "ranks {missing:?} to copy their part of {}",
                    Self::describe(&key.1)
                )
            }));
        }
        self.finish(cx, &key, mi)?;
        Ok(Ready::Done)
    }

    fn reduce(
        &self,
        cx: &mut Cx,
        tag: CollTag,
        group: &[u32],
        ptr: DevPtr,
        count: usize,
        dtype: DType,
        issued: &mut bool,
    ) -> Result<Ready, String> {
        let mi = member(group, cx.rank)?;
        let bytes = count * dtype.size();
        let key = (cx.step, tag, group.to_vec());
        if let Some(srcs) = match self.join(cx, &key, mi, ptr, issued)? {
            Joined::Blocked(r) => return Ok(r),
            Joined::Pull(srcs) => Some(srcs),
            Joined::Pulled => None,
        } {
            let acc = cx.pool.take(cx.gpu, cx.events, cx.s, bytes)?;
            sum_in_order(cx.gpu, cx.s, acc, &srcs, count, dtype)?;
            let e = cx.events.take(cx.gpu)?;
            cx.gpu.record(cx.s, e)?;
            let mut st = self.lock();
            let c = st.coll.get_mut(&key).ok_or("a collective vanished")?;
            c.pulled[mi] = Some(e);
            c.scratch[mi] = Some(acc);
            self.cv.notify_all();
        }
        let (pulled, acc) = {
            let st = self.lock();
            let c = &st.coll[&key];
            (c.pulled.clone(), c.scratch[mi])
        };
        let missing = Self::missing(&pulled, group);
        if !missing.is_empty() {
            return Ok(Ready::blocked(|| {
                format!(
                    "ranks {missing:?} to read their part of {}",
                    Self::describe(&key.1)
                )
            }));
        }
        let acc = acc.ok_or("the sum vanished")?;
        // Every member has read this member's gradients: overwrite them with the sum.
        let others: Vec<EventId> = pulled
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != mi)
            .filter_map(|(_, e)| *e)
            .collect();
        for e in others {
            cx.gpu.wait(cx.s, e)?;
        }
        cx.gpu.dtod(cx.s, ptr, acc, bytes)?;
        cx.pool.give(cx.gpu, cx.events, cx.s, acc, bytes)?;
        self.finish(cx, &key, mi)?;
        Ok(Ready::Done)
    }

    fn wait(&self, at_most: Duration) {
        let g = self.lock();
        let _ = self.cv.wait_timeout(g, at_most);
    }
}

/// The NCCL transport of one process (module docs).
pub struct Nccl<'a> {
    /// NCCL.
    pub coll: &'a dyn Collectives,
}

impl Nccl<'_> {
    /// Runs `body` between `ncclGroupStart` and `ncclGroupEnd`; the group is ended even when
    /// `body` fails (never left open, never unwrapped), and the first error is returned.
    fn grouped(&self, body: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
        self.coll.group_start()?;
        let r = body();
        let end = self.coll.group_end();
        r?;
        end.map_err(String::from)
    }
}

impl Transport for Nccl<'_> {
    fn send(
        &self,
        cx: &mut Cx,
        _buf: Buf,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<Ready, String> {
        self.coll.send(cx.comm, cx.s, ptr, bytes, peer)?;
        Ok(Ready::Done)
    }

    fn recv(
        &self,
        cx: &mut Cx,
        _buf: Buf,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<Ready, String> {
        self.coll.recv(cx.comm, cx.s, ptr, bytes, peer)?;
        Ok(Ready::Done)
    }

    fn all_to_all(
        &self,
        cx: &mut Cx,
        _tag: CollTag,
        group: &[u32],
        outbox: DevPtr,
        inbox: DevPtr,
        sb: usize,
        _issued: &mut bool,
    ) -> Result<Ready, String> {
        let mi = member(group, cx.rank)?;
        let me = (inbox + (mi * sb) as u64, outbox + (mi * sb) as u64);
        cx.gpu.dtod(cx.s, me.0, me.1, sb)?;
        if group.len() > 1 {
            self.grouped(|| {
                for (j, &m) in group.iter().enumerate() {
                    if j == mi {
                        continue;
                    }
                    self.coll
                        .send(cx.comm, cx.s, outbox + (j * sb) as u64, sb, m)?;
                    self.coll
                        .recv(cx.comm, cx.s, inbox + (j * sb) as u64, sb, m)?;
                }
                Ok(())
            })?;
        }
        Ok(Ready::Done)
    }

    fn reduce(
        &self,
        cx: &mut Cx,
        tag: CollTag,
        group: &[u32],
        ptr: DevPtr,
        count: usize,
        dtype: DType,
        issued: &mut bool,
    ) -> Result<Ready, String> {
        let n = group.len();
        let bytes = count * dtype.size();
        // Slots 0..n: every member's gradients (gathered), slot n: the sum.
        let tmp = cx.pool.take(cx.gpu, cx.events, cx.s, (n + 1) * bytes)?;
        let slot = |j: usize| tmp + (j * bytes) as u64;
        self.all_gather(cx, tag, group, (ptr, tmp), count, dtype, issued)?;
        let srcs: Vec<DevPtr> = (0..n).map(slot).collect();
        sum_in_order(cx.gpu, cx.s, slot(n), &srcs, count, dtype)?;
        cx.gpu.dtod(cx.s, ptr, slot(n), bytes)?;
        cx.pool
            .give(cx.gpu, cx.events, cx.s, tmp, (n + 1) * bytes)?;
        Ok(Ready::Done)
    }

    /// One NCCL group: this member's values to every other member, theirs into their
    /// slots (the communicators span every rank, so a TP group's gather is grouped
    /// point-to-point, as its all-reduce is).
    fn all_gather(
        &self,
        cx: &mut Cx,
        _tag: CollTag,
        group: &[u32],
        (src, dst): (DevPtr, DevPtr),
        count: usize,
        dtype: DType,
        _issued: &mut bool,
    ) -> Result<Ready, String> {
        let mi = member(group, cx.rank)?;
        let bytes = count * dtype.size();
        let slot = |j: usize| dst + (j * bytes) as u64;
        cx.gpu.dtod(cx.s, slot(mi), src, bytes)?;
        self.grouped(|| {
            for (j, &m) in group.iter().enumerate() {
                if j == mi {
                    continue;
                }
                self.coll.send(cx.comm, cx.s, src, bytes, m)?;
                self.coll.recv(cx.comm, cx.s, slot(j), bytes, m)?;
            }
            Ok(())
        })?;
        Ok(Ready::Done)
    }

    /// One NCCL group: slot `j` of this member's partial sums to member `j`, every
    /// member's partial of this member's slot received, then summed in group order (the
    /// single-GPU mode's and the CPU backend's order).
    fn reduce_scatter(
        &self,
        cx: &mut Cx,
        _tag: CollTag,
        group: &[u32],
        (src, dst): (DevPtr, DevPtr),
        count: usize,
        dtype: DType,
        _issued: &mut bool,
    ) -> Result<Ready, String> {
        let mi = member(group, cx.rank)?;
        let n = group.len();
        let bytes = count * dtype.size();
        let tmp = cx.pool.take(cx.gpu, cx.events, cx.s, n * bytes)?;
        let slot = |j: usize| tmp + (j * bytes) as u64;
        let part = |j: usize| src + (j * bytes) as u64;
        cx.gpu.dtod(cx.s, slot(mi), part(mi), bytes)?;
        self.grouped(|| {
            for (j, &m) in group.iter().enumerate() {
                if j == mi {
                    continue;
                }
                self.coll.send(cx.comm, cx.s, part(j), bytes, m)?;
                self.coll.recv(cx.comm, cx.s, slot(j), bytes, m)?;
            }
            Ok(())
        })?;
        let srcs: Vec<DevPtr> = (0..n).map(slot).collect();
        sum_in_order(cx.gpu, cx.s, dst, &srcs, count, dtype)?;
        cx.pool.give(cx.gpu, cx.events, cx.s, tmp, n * bytes)?;
        Ok(Ready::Done)
    }

    fn wait(&self, at_most: Duration) {
        std::thread::sleep(at_most.min(Duration::from_millis(1)));
    }

    fn groups_messages(&self) -> bool {
        true
    }

    fn post_group(
        &self,
        cx: &mut Cx,
        msgs: &[(bool, DevPtr, usize, u32)],
    ) -> Result<Ready, String> {
        let post = || -> Result<(), String> {
            for &(is_send, p, bytes, peer) in msgs {
                if is_send {
                    self.coll.send(cx.comm, cx.s, p, bytes, peer)?;
                } else {
                    self.coll.recv(cx.comm, cx.s, p, bytes, peer)?;
                }
            }
            Ok(())
        };
        if msgs.len() == 1 {
            post()?;
        } else {
            self.grouped(post)?;
        }
        Ok(Ready::Done)
    }
}
