//! The host driver: one [`RankDev`] per global rank implements the device-neutral
//! interpreter's [`Device`] (`schedc_program::interp`), so a rank's streams, events, buffer
//! lifetimes, blocking and timeouts are interpreted exactly as on the CPU backend, and
//! every instruction becomes device work on the rank's own CUDA stream for that program
//! stream:
//!
//! | instruction | on the device |
//! |---|---|
//! | `record e` / `wait e` | `cuEventRecord` / `cuStreamWaitEvent` with the rank's event for `e` |
//! | `alloc b` / `free b` | a block from / back to the stream-ordered [`Pool`] (zero-filled if asked) |
//! | kernel `(pass, part)` | the launches and GEMMs of [`Model::kernel`] |
//! | `send` / `recv` | [`Transport::send`] / [`Transport::recv`] |
//! | `all_to_all` | [`Transport::all_to_all`] of the stash's outbox into its inbox |
//! | `tp_collective` | [`Transport::reduce`] of a stash region in place (all-reduce phases), or, with Megatron sequence parallelism, [`Transport::all_gather`] / [`Transport::reduce_scatter`] between the member's rows and the chunk's |
//! | `tp_grad_all_reduce` | [`Transport::reduce`] over the TP group of the replicated tensors' gradients and the load counts, packed into one block |
//! | `replica_sum` / `all_reduce` | [`Transport::reduce`] of the `weight_grad` buffer (or one scope's range) |
//! | `optimizer_step` | Adam or SGD, the routers' balancing update, the bf16 compute copy |
//! | `offload` / `reload` (copy stream) | `cuMemcpyDtoHAsync` / `cuMemcpyHtoDAsync` of the stash to / from a pinned [`HostPool`] block |
//! | kernel `(recompute, part)` | the forward's launches, writing the stash only ([`Io::recompute`]) |
//!
//! BPipe's lent stashes (`send` / `recv` of a `stash` buffer) go through the transport like
//! any message: the borrower holds the stash's bytes in a block of its pool, sized as the
//! owner lays the stash out ([`lent_stashes`]).
//!
//! Nothing reads device memory during a step; the end of a step synchronizes every stream
//! (with the run's timeout), reads the rank's error word and its losses.

use crate::api::*;
use crate::layout::{Dims, ParamLayout, Region};
use crate::memops::{lent_stashes, HostPool};
use crate::model::{Io, Model, StageDev};
use crate::pool::{Events, Pool};
use crate::transport::{CollTag, Cx, Transport};
use schedc_cpu::exec::{Named, Optimizer};
use schedc_cpu::model::{tp_shard_name, tp_split};
use schedc_program::data::{Batching, Data};
use schedc_program::interp::{
    self, Abort, Cursor, Device, ExecError, InterpOptions, Ready, RunFailure,
};
use schedc_program::mesh::Dim;
use schedc_program::model::Scope;
use schedc_program::{Buf, Op, Part, Pass, ProgramSet, RankProgram, StreamKind, Tp, TpKind};
use schedc_program::{Granularity, ModelConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A callback after each step: `(step, loss)`.
pub type OnStep = Arc<dyn Fn(usize, f64) + Send + Sync>;

/// Driver options.
#[derive(Clone)]
pub struct ExecOptions {
    /// Training steps.
    pub steps: usize,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Longest a rank may wait without progress, and the longest wait for a stream at the
    /// end of a step.
    pub timeout: Duration,
    /// Record every step's reduced gradients and the final parameters.
    pub record: bool,
    /// Called after every step with the step's loss.
    pub on_step: Option<OnStep>,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            steps: 1,
            optimizer: Optimizer::Sgd { lr: 0.1 },
            timeout: Duration::from_secs(60),
            record: false,
            on_step: None,
        }
    }
}

/// Device memory of one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RankMemory {
    /// Global rank.
    pub rank: u32,
    /// Parameters (master, compute copy), optimizer and balancing state.
    pub params: usize,
    /// The buffer pool's blocks (activations, stashes, gradient accumulators, scratch).
    pub pool: usize,
    /// The most pool bytes in use at once.
    pub pool_peak_in_use: usize,
    /// What the program's liveness plan reserved ahead of the run.
    pub planned: usize,
    /// Page-locked host bytes the offloads took (the pinned host pool; host memory, not
    /// counted in [`RankMemory::total`]).
    pub pinned_host: usize,
    /// The most pinned host bytes in use at once.
    pub pinned_host_peak: usize,
}

impl RankMemory {
    /// Everything the rank took from the device.
    pub fn total(&self) -> usize {
        self.params + self.pool + 8
    }
}

/// What a run produced.
#[derive(Clone, Debug, Default)]
pub struct GpuResult {
    /// The loss of each step (mean token loss over the global batch).
    pub losses: Vec<f64>,
    /// With [`ExecOptions::record`]: per step, `(rank, stage, tensors)` of every copy's
    /// reduced gradients.
    pub grads: Vec<Vec<(u32, u32, Named)>>,
    /// With [`ExecOptions::record`]: the final parameters of every copy.
    pub params: Vec<(u32, u32, Named)>,
    /// Wall seconds.
    pub seconds: f64,
    /// Instructions run over all ranks and steps.
    pub instructions: u64,
    /// Device memory per rank.
    pub memory: Vec<RankMemory>,
}

/// The communicator index of every stream kind of the program set (the same list on every
/// rank): compute first, then the communication channels in order, then the EP stream of
/// MoE parts if any rank has one, then the TP stream (`tp > 1`) if any; one more, after them, carries the losses.
/// The copy stream of the memory ops sends nothing and has no communicator of its own (the
/// driver files it under compute's, index 0).
pub fn stream_kinds(set: &ProgramSet) -> Vec<StreamKind> {
    let mut kinds: Vec<StreamKind> = vec![StreamKind::Compute];
    let mut chans: Vec<u32> = set
        .ranks
        .iter()
        .flat_map(|r| &r.streams)
        .filter_map(|s| match s.kind {
            StreamKind::Comm { channel } => Some(channel),
            StreamKind::Compute | StreamKind::Ep | StreamKind::Tp | StreamKind::Copy => None,
        })
        .collect();
    chans.sort();
    chans.dedup();
    kinds.extend(
        chans
            .into_iter()
            .map(|channel| StreamKind::Comm { channel }),
    );
    if set
        .ranks
        .iter()
        .flat_map(|r| &r.streams)
        .any(|s| s.kind == StreamKind::Ep)
    {
        kinds.push(StreamKind::Ep);
    }
    if set
        .ranks
        .iter()
        .flat_map(|r| &r.streams)
        .any(|s| s.kind == StreamKind::Tp)
    {
        kinds.push(StreamKind::Tp);
    }
    kinds
}

/// Step losses of a run's ranks as each finishes a step: calls the run's `on_step` with a
/// step's loss (the sum over the ranks) once every rank has reported it, in step order.
pub struct Progress {
    st: Mutex<(Vec<f64>, Vec<usize>, usize)>,
    world: usize,
    on_step: Option<OnStep>,
}

impl Progress {
    /// For `world` reporting ranks and `steps` steps.
    pub fn new(world: usize, steps: usize, on_step: Option<OnStep>) -> Self {
        Progress {
            st: Mutex::new((vec![0.0; steps], vec![0; steps], 0)),
            world,
            on_step,
        }
    }

    /// One rank's loss of `step`.
    pub fn report(&self, step: usize, loss: f64) {
        let mut st = self.st.lock().unwrap_or_else(|p| p.into_inner());
        if step >= st.0.len() {
            return;
        }
        st.0[step] += loss;
        st.1[step] += 1;
        while st.2 < st.0.len() && st.1[st.2] == self.world {
            if let Some(f) = &self.on_step {
                f(st.2, st.0[st.2]);
            }
            st.2 += 1;
        }
    }
}

/// One rank on the device (see the module docs).
pub struct RankDev<'a> {
    gpu: &'a dyn Gpu,
    prog: &'a RankProgram,
    set: &'a ProgramSet,
    /// schedc's model the kernels belong to (model-granularity programs only).
    cfg: &'a ModelConfig,
    dims: Dims,
    streams: Vec<StreamId>,
    comms: Vec<usize>,
    events: Vec<EventId>,
    cur: usize,
    cur_index: usize,
    stages: Vec<StageDev>,
    bufs: HashMap<Buf, (DevPtr, usize)>,
    pool: Pool,
    /// The offloads' pinned host blocks (`host(s,m)`), used on the copy stream only.
    host: HostPool,
    host_bufs: HashMap<Buf, (HostPtr, usize)>,
    /// Stash bytes of the stages whose stashes this rank holds for their owner (BPipe).
    lent: std::collections::BTreeMap<u32, usize>,
    /// With recomputes: the scratch their router loads go to (after the losses, in the
    /// same block).
    scratch: Option<DevPtr>,
    ev: &'a Events,
    transport: &'a dyn Transport,
    data: &'a Data,
    batching: Batching,
    opts: &'a ExecOptions,
    step: usize,
    losses: DevPtr,
    err: DevPtr,
    /// With `Some(comm)`: the step's loss is summed over every rank on that communicator
    /// (NCCL mode, one rank per process).
    loss_reduce: Option<(&'a dyn Collectives, usize)>,
    /// Loss of each step (this rank's, or the global sum with `loss_reduce`).
    pub step_losses: Vec<f64>,
    /// Where each step's loss is reported as it ends.
    progress: Option<&'a Progress>,
    /// Recorded gradients: `(step, stage, tensors)`.
    pub grads: Vec<(usize, u32, Named)>,
    planned: usize,
    /// The packed replicated-weight gradients of a `TpGradAllReduce` in flight.
    tp_grad_scratch: Option<DevPtr>,
}

/// The region holding the gradient w.r.t. layer `l`'s output: the next layer's input
/// gradient, or the stage output's. `None`: no layer `l`.
fn r_dy(st: &crate::layout::StashLayout, l: usize) -> Option<Region> {
    if l + 1 < st.layers.len() {
        Some(st.layers[l + 1].dx)
    } else if l < st.layers.len() {
        Some(st.gout)
    } else {
        None
    }
}

fn issue(e: GpuError) -> String {
    e.0
}

impl<'a> RankDev<'a> {
    /// Sets up rank `prog` of `set` on `gpu`: streams, events, parameters, the pool
    /// reserved to the liveness plan. Errors: the device's.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &'a dyn Gpu,
        set: &'a ProgramSet,
        prog: &'a RankProgram,
        ev: &'a Events,
        transport: &'a dyn Transport,
        data: &'a Data,
        opts: &'a ExecOptions,
        loss_reduce: Option<(&'a dyn Collectives, usize)>,
    ) -> Result<RankDev<'a>, String> {
        let m = &set.manifest;
        let cfg = match (&m.model, m.granularity) {
            (Some(cfg), Granularity::Model) => cfg,
            (_, gran) => {
                return Err(format!(
                    "the programs are at {gran} granularity, without schedc's model; the CUDA backend runs model-granularity programs (`schedc compile` without `--granularity stage`)"
                ))
            }
        };
        if cfg.group_limit.is_some() {
            return Err("the CUDA backend's router has no group-limited (node-limited) routing: run it on the CPU backend (--backend cpu)".into());
        }
        // With Megatron sequence parallelism the rank's rows are its TP shard of the chunk.
        let dims = Dims::with_sequence_parallel(
            cfg,
            &m.mesh,
            gpu.dtype(),
            m.sequence_parallel.then_some(prog.coords.tp as usize),
        )?;
        let lent = lent_stashes(set, prog, &dims)?;
        let streams = prog
            .streams
            .iter()
            .map(|_| gpu.new_stream())
            .collect::<Result<Vec<_>, _>>()
            .map_err(issue)?;
        let kinds = stream_kinds(set);
        let comms = prog
            .streams
            .iter()
            .map(|s| kinds.iter().position(|k| *k == s.kind).unwrap_or(0))
            .collect();
        let events = (0..prog.events)
            .map(|_| gpu.new_event())
            .collect::<Result<Vec<_>, _>>()
            .map_err(issue)?;
        let s0 = streams[0];
        let stages = prog
            .stages
            .iter()
            .map(|info| {
                StageDev::new(
                    gpu,
                    s0,
                    cfg,
                    &dims,
                    info,
                    m.model_stages as usize,
                    &opts.optimizer,
                    prog.coords.tp as usize,
                )
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(issue)?;
        let mt = (m.microbatches * m.directions) as usize;
        let nl = (stages.len() * mt).max(1);
        let scratch_bytes = recompute_scratch_bytes(prog, &dims);
        let losses = gpu.alloc(nl * 4 + scratch_bytes).map_err(issue)?;
        let scratch = (scratch_bytes > 0).then_some(losses + (nl * 4) as u64);
        let err = gpu.alloc(4).map_err(issue)?;
        gpu.memset(s0, err, 4).map_err(issue)?;
        let mut pool = Pool::default();
        let mut planned = 0;
        for (bytes, count) in plan_rank_lent(prog, &dims, &stages, &lent)? {
            pool.reserve(gpu, bytes, count).map_err(issue)?;
            planned += bytes * count;
        }
        Ok(RankDev {
            gpu,
            prog,
            set,
            cfg,
            batching: Batching {
                shards: m.mesh.data_shards() as usize,
                microbatches: mt,
                sp: m.mesh.size(Dim::Sp) as usize,
            },
            dims,
            streams,
            comms,
            events,
            cur: 0,
            cur_index: 0,
            stages,
            bufs: HashMap::new(),
            pool,
            host: HostPool::default(),
            host_bufs: HashMap::new(),
            lent,
            scratch,
            ev,
            transport,
            data,
            opts,
            step: 0,
            losses,
            err,
            loss_reduce,
            step_losses: Vec::new(),
            progress: None,
            grads: Vec::new(),
            planned,
            tp_grad_scratch: None,
        })
    }

    /// Reports every step's loss to `p` as the step ends.
    pub fn set_progress(&mut self, p: &'a Progress) {
        self.progress = Some(p);
    }

    fn stage_ix(&self, s: u32) -> Result<usize, String> {
        self.stages
            .iter()
            .position(|x| x.info.stage == s)
            .ok_or_else(|| format!("stage {s} is not held by this rank"))
    }

    fn bytes_of(&self, b: Buf) -> Result<usize, String> {
        Ok(match b {
            Buf::Act { .. } | Buf::Grad { .. } => self.dims.act_bytes(),
            Buf::Stash { stage, .. } | Buf::Host { stage, .. } => match self.lent.get(&stage) {
                Some(b) => *b,
                None => self.stages[self.stage_ix(stage)?].stash.bytes,
            },
            Buf::WeightGrad { stage } => self.stages[self.stage_ix(stage)?].layout.grads() * 4,
        })
    }

    fn buf(&self, b: &Buf) -> Result<DevPtr, String> {
        self.bufs
            .get(b)
            .map(|x| x.0)
            .ok_or_else(|| format!("{b} is not allocated"))
    }

    fn model(&self) -> Model<'_> {
        let cfg = self.cfg;
        Model {
            gpu: self.gpu,
            dims: &self.dims,
            cfg,
            pos0: self.prog.coords.sp as usize * self.dims.tc,
            err: self.err,
        }
    }

    /// Tokens and targets of `(stage, mb)` this step (the CPU executor's data feed).
    fn feed(&self, si: usize, mb: u32) -> Result<(Vec<u32>, Vec<u32>), String> {
        let st = &self.stages[si].info;
        let m = self.set.manifest.microbatches as usize;
        let gmb = st.direction as usize * m + mb as usize;
        let idx = self
            .batching
            .index(self.step, self.prog.data_shard as usize, gmb);
        let cfg = self.cfg;
        let b = self.dims.seqs;
        let (tokens, targets) = self.data.micro_batch(idx, cfg.seq_len, b)?;
        // This rank's SP chunk of each of the B sequences; with Megatron sequence
        // parallelism, this TP member's shard of it (the data's own rows, whatever the
        // positions' bug does).
        let (tc, t) = (self.dims.tc / b, self.dims.t / b);
        let mut lo = self.prog.coords.sp as usize * tc;
        if self.dims.seq_par {
            lo += self.prog.coords.tp as usize * t;
        }
        let rows = |v: &[u32]| -> Vec<u32> {
            v.chunks(cfg.seq_len)
                .flat_map(|q| q[lo..lo + t].iter().copied())
                .collect()
        };
        Ok((
            if st.first { rows(&tokens) } else { Vec::new() },
            if st.last { rows(&targets) } else { Vec::new() },
        ))
    }

    fn kernel(&mut self, s: usize, k: &schedc_program::Kernel) -> Result<(), String> {
        let si = self.stage_ix(k.stage)?;
        let st = &self.stages[si];
        let find = |v: &Vec<Buf>, act: bool| {
            v.iter()
                .find(|b| {
                    if act {
                        matches!(b, Buf::Act { .. })
                    } else {
                        matches!(b, Buf::Grad { .. })
                    }
                })
                .copied()
        };
        let ptr = |b: Option<Buf>| -> Result<Option<DevPtr>, String> {
            b.map(|b| self.buf(&b)).transpose()
        };
        let mt = (self.set.manifest.microbatches * self.set.manifest.directions) as usize;
        let gmb =
            st.info.direction as usize * self.set.manifest.microbatches as usize + k.mb as usize;
        // A recompute is the forward's kernels again (its stash is a fresh block: the
        // tokens and targets go up again), writing the stash only.
        let recompute = k.pass == Pass::Recompute;
        let pass = if recompute { Pass::F } else { k.pass };
        let first_fwd = match (pass, k.part) {
            (Pass::F, Part::Embed) => true,
            (Pass::F, Part::Qkv { layer: 0 }) => !st.info.first,
            _ => false,
        };
        let scratch = if recompute {
            Some(
                self.scratch
                    .ok_or("a recompute kernel without the recompute scratch")?,
            )
        } else {
            None
        };
        let io = Io {
            stash: self.buf(&Buf::Stash {
                stage: k.stage,
                mb: k.mb,
            })?,
            grads: self.buf(&Buf::WeightGrad { stage: k.stage })?,
            act_in: ptr(find(&k.reads, true))?,
            act_out: ptr(find(&k.writes, true))?,
            grad_in: ptr(find(&k.reads, false))?,
            grad_out: ptr(find(&k.writes, false))?,
            loss: self.losses + ((si * mt + gmb) * 4) as u64,
            tokens: if first_fwd {
                Some(self.feed(si, k.mb)?)
            } else {
                None
            },
            scale: 1.0 / self.batching.tokens(self.dims.tk) as f64,
            recompute: scratch,
        };
        self.model()
            .kernel(self.streams[s], &self.stages[si], pass, k.part, &io)
            .map_err(issue)
    }

    /// Megatron sequence parallelism (`TpGradAllReduce`): the sum over the TP group, in
    /// group order, of stage `stage`'s gradients of the tensors the group does not split
    /// (each member computed them on its own shard of the tokens) and of the load counts,
    /// packed into one scratch block for one all-reduce (the CPU backend's
    /// `replicated_grads`) and unpacked into `weight_grad` once it is done.
    fn tp_grad_all_reduce(
        &mut self,
        stream: usize,
        stage: u32,
        group: &[u32],
        issued: &mut bool,
    ) -> Result<Ready, String> {
        let si = self.stage_ix(stage)?;
        let g = self.buf(&Buf::WeightGrad { stage })?;
        let lay = &self.stages[si].layout;
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        let replicated = lay
            .tensors
            .iter()
            .filter(|(n, _)| tp_split(self.cfg, n).is_none())
            .map(|(_, t)| (t.grad, t.len))
            .chain(std::iter::once((lay.dense, lay.loads)));
        for (at, len) in replicated {
            match ranges.last_mut() {
                Some(last) if last.0 + last.1 == at => last.1 += len,
                _ => ranges.push((at, len)),
            }
        }
        let n: usize = ranges.iter().map(|r| r.1).sum();
        let s = self.streams[stream];
        if !*issued {
            let scratch = self.pool.take(self.gpu, self.ev, s, n * 4).map_err(issue)?;
            let mut off = 0;
            for (at, len) in &ranges {
                self.gpu
                    .dtod(s, scratch + (off * 4) as u64, g + (at * 4) as u64, len * 4)
                    .map_err(issue)?;
                off += len;
            }
            self.tp_grad_scratch = Some(scratch);
        }
        let scratch = self
            .tp_grad_scratch
            .ok_or("the TP gradient sum lost its scratch block")?;
        let t = self.transport;
        let r = t.reduce(
            &mut self.cx(stream),
            CollTag::TpGrad(stage),
            group,
            scratch,
            n,
            DType::F32,
            issued,
        )?;
        if r == Ready::Done {
            let mut off = 0;
            for (at, len) in &ranges {
                self.gpu
                    .dtod(s, g + (at * 4) as u64, scratch + (off * 4) as u64, len * 4)
                    .map_err(issue)?;
                off += len;
            }
            self.pool
                .give(self.gpu, self.ev, s, scratch, n * 4)
                .map_err(issue)?;
            self.tp_grad_scratch = None;
        }
        Ok(r)
    }

    fn cx(&mut self, s: usize) -> Cx<'_> {
        Cx {
            gpu: self.gpu,
            events: self.ev,
            pool: &mut self.pool,
            rank: self.prog.rank,
            step: self.step,
            s: self.streams[s],
            comm: self.comms[s],
        }
    }

    fn optimizer_step(&mut self, s: usize, stage: u32) -> Result<(), String> {
        let si = self.stage_ix(stage)?;
        let grads = self.buf(&Buf::WeightGrad { stage })?;
        if self.opts.record {
            let n = self.stages[si].layout.grads();
            let mut b = vec![0u8; n * 4];
            self.gpu
                .dtoh(self.streams[s], grads, &mut b)
                .map_err(issue)?;
            let g = decode(DType::F32, &b);
            let named = self.tp_names(named(&self.stages[si].layout, &g, true));
            self.grads.push((self.step, stage, named));
        }
        let cfg = self.cfg;
        let m = Model {
            gpu: self.gpu,
            dims: &self.dims,
            cfg,
            pos0: 0,
            err: self.err,
        };
        let opt = self.opts.optimizer;
        m.optimizer_step(self.streams[s], &mut self.stages[si], grads, &opt)
            .map_err(issue)
    }

    /// The run of adjacent messages of `stream` holding the current instruction (one IR
    /// group: see the lowering), posted at once when the interpreter reaches its first
    /// message; the others are done already. A lent stash's message (BPipe's `LEND` /
    /// `RETURN`, a `send`/`recv` of a `stash` buffer) is a unit of its own: each is an IR
    /// instruction by itself, which its peer posts alone in the same order on that channel,
    /// while the lender's return and next lend can be adjacent in its stream without being
    /// one IR group (a group there would wait for a peer that posts them apart).
    fn post_group(&mut self, stream: usize) -> Result<Ready, String> {
        let ops = &self.prog.streams[stream].ops;
        let is_msg = |o: &Op| matches!(o, Op::Send { .. } | Op::Recv { .. });
        let lent = |o: &Op| {
            matches!(
                o,
                Op::Send {
                    buf: Buf::Stash { .. },
                    ..
                } | Op::Recv {
                    buf: Buf::Stash { .. },
                    ..
                }
            )
        };
        let joined = |a: &Op, b: &Op| is_msg(a) && is_msg(b) && !lent(a) && !lent(b);
        let i = self.cur_index;
        if i > 0 && joined(&ops[i - 1], &ops[i]) {
            return Ok(Ready::Done);
        }
        let mut msgs = Vec::new();
        let mut j = i;
        while j < ops.len() && (j == i || joined(&ops[j - 1], &ops[j])) {
            match &ops[j] {
                Op::Send { buf, peer } => {
                    msgs.push((true, self.buf(buf)?, self.bytes_of(*buf)?, *peer))
                }
                Op::Recv { buf, peer } => {
                    msgs.push((false, self.buf(buf)?, self.bytes_of(*buf)?, *peer))
                }
                _ => {}
            }
            j += 1;
        }
        let t = self.transport;
        t.post_group(&mut self.cx(stream), &msgs)
    }

    /// With `tp > 1`, the split tensors of `v` under the CPU backend's
    /// `tp_shard_name` (so that a comparison with the reference takes the same slice).
    fn tp_names(&self, mut v: Named) -> Named {
        let n = self.dims.tp;
        if n > 1 {
            let j = self.prog.coords.tp as usize;
            for (name, _) in &mut v {
                if let Some(split) = tp_split(self.cfg, name) {
                    *name = tp_shard_name(name, split, j, n);
                }
            }
        }
        v
    }

    /// The final parameters of every stage copy, named.
    pub fn params(&self) -> Result<Vec<(u32, Named)>, String> {
        let s = self.streams[0];
        self.stages
            .iter()
            .map(|st| {
                let n = st.layout.params();
                let mut b = vec![0u8; n * 4];
                self.gpu.dtoh(s, st.master, &mut b).map_err(issue)?;
                Ok((
                    st.info.stage,
                    self.tp_names(named(&st.layout, &decode(DType::F32, &b), false)),
                ))
            })
            .collect()
    }

    /// Device memory taken by the rank.
    pub fn memory(&self) -> RankMemory {
        RankMemory {
            rank: self.prog.rank,
            params: self.stages.iter().map(|s| s.bytes(&self.dims)).sum(),
            pool: self.pool.held(),
            pool_peak_in_use: self.pool.peak(),
            planned: self.planned,
            pinned_host: self.host.held(),
            pinned_host_peak: self.host.peak(),
        }
    }

    fn sync_all(&self) -> Result<(), String> {
        for s in &self.streams {
            self.gpu.sync(*s, self.opts.timeout).map_err(issue)?;
        }
        Ok(())
    }

    /// Waits for every stream and frees the rank's memory. A stream that does not finish
    /// in time leaves the memory to the process's end.
    pub fn release(&mut self) -> Result<(), String> {
        self.sync_all()?;
        for st in &self.stages {
            st.release(self.gpu).map_err(issue)?;
        }
        self.pool.release(self.gpu).map_err(issue)?;
        self.host.release(self.gpu).map_err(issue)?;
        self.gpu.free(self.losses).map_err(issue)?;
        self.gpu.free(self.err).map_err(issue)
    }
}

/// Tensors of a layout from a flat vector (`grads`: the gradient layout, else the
/// parameter layout), named as the CPU backend names them.
pub fn named(layout: &ParamLayout, v: &[f32], grads: bool) -> Named {
    layout
        .tensors
        .iter()
        .map(|(n, t)| {
            let at = if grads { t.grad } else { t.param };
            (
                n.clone(),
                v[at..at + t.len].iter().map(|x| *x as f64).collect(),
            )
        })
        .collect()
}

fn kernel_error(code: i32) -> String {
    match code {
        1 => "a token is outside the vocabulary".into(),
        2 => "an all-to-all packet holds more rows than its bound".into(),
        3 => "a rank received a row for an expert it does not hold".into(),
        4 => "an expert received more rows than its capacity bound".into(),
        5 => "a target is outside the vocabulary".into(),
        c => format!("a kernel reported error {c}"),
    }
}

impl Device for RankDev<'_> {
    fn begin_step(&mut self, step: usize) -> Result<(), String> {
        self.step = step;
        let mt = (self.set.manifest.microbatches * self.set.manifest.directions) as usize;
        let n = (self.stages.len() * mt).max(1);
        self.gpu
            .memset(self.streams[0], self.losses, n * 4)
            .map_err(issue)
    }

    fn end_step(&mut self, step: usize) -> Result<(), String> {
        self.sync_all()?;
        let mut b = [0u8; 4];
        self.gpu
            .dtoh(self.streams[0], self.err, &mut b)
            .map_err(issue)?;
        let code = i32::from_le_bytes(b);
        if code != 0 {
            return Err(kernel_error(code));
        }
        let mt = (self.set.manifest.microbatches * self.set.manifest.directions) as usize;
        let n = (self.stages.len() * mt).max(1);
        let mut lb = vec![0u8; n * 4];
        self.gpu
            .dtoh(self.streams[0], self.losses, &mut lb)
            .map_err(issue)?;
        let mut loss: f64 = decode(DType::F32, &lb).iter().map(|x| *x as f64).sum();
        // Every TP member computes the same loss: the first one reports it (with Megatron
        // sequence parallelism each computes its shard's, and all report).
        if self.prog.coords.tp != 0 && !self.dims.seq_par {
            loss = 0.0;
        }
        if let Some((coll, comm)) = self.loss_reduce {
            let s = self.streams[0];
            self.gpu
                .htod(s, self.losses, &(loss as f32).to_le_bytes())
                .map_err(issue)?;
            coll.all_reduce_f32(comm, s, self.losses, 1)
                .map_err(issue)?;
            self.gpu.dtoh(s, self.losses, &mut b).map_err(issue)?;
            loss = f32::from_le_bytes(b) as f64;
        }
        self.step_losses.push(loss);
        if let Some(p) = self.progress {
            p.report(step, loss);
        }
        Ok(())
    }

    fn before(&mut self, at: Cursor) {
        self.cur = at.stream;
        self.cur_index = at.index;
    }

    fn record(&mut self, stream: usize, event: u32) -> Result<(), String> {
        let s = self.streams[stream];
        self.gpu.mark(s, &format_args!("record e{event}"));
        let e = *self
            .events
            .get(event as usize)
            .ok_or(format!("event e{event} out of range"))?;
        self.gpu.record(s, e).map_err(issue)
    }

    fn wait_event(&mut self, stream: usize, event: u32) -> Result<(), String> {
        let s = self.streams[stream];
        self.gpu.mark(s, &format_args!("wait e{event}"));
        let e = *self
            .events
            .get(event as usize)
            .ok_or(format!("event e{event} out of range"))?;
        self.gpu.wait(s, e).map_err(issue)
    }

    fn alloc(&mut self, buf: Buf, zero: bool) -> Result<(), String> {
        let s = self.streams[self.cur];
        self.gpu.mark(s, &Op::Alloc { buf, zero });
        let bytes = self.bytes_of(buf)?;
        if let Buf::Host { .. } = buf {
            // Pinned host memory, on the copy stream only (see `memops`).
            let p = self.host.take(self.gpu, bytes).map_err(issue)?;
            self.host_bufs.insert(buf, (p, bytes));
            return Ok(());
        }
        let p = self.pool.take(self.gpu, self.ev, s, bytes).map_err(issue)?;
        if zero {
            self.gpu.memset(s, p, bytes).map_err(issue)?;
        }
        self.bufs.insert(buf, (p, bytes));
        Ok(())
    }

    fn free(&mut self, buf: Buf) -> Result<(), String> {
        let s = self.streams[self.cur];
        self.gpu.mark(s, &Op::Free { buf });
        if let Buf::Host { .. } = buf {
            let (p, bytes) = self
                .host_bufs
                .remove(&buf)
                .ok_or(format!("{buf} is not allocated"))?;
            self.host.give(p, bytes);
            return Ok(());
        }
        let (p, bytes) = self
            .bufs
            .remove(&buf)
            .ok_or(format!("{buf} is not allocated"))?;
        self.pool
            .give(self.gpu, self.ev, s, p, bytes)
            .map_err(issue)
    }

    fn exec(&mut self, stream: usize, op: &Op, issued: &mut bool) -> Result<Ready, String> {
        if !*issued {
            self.gpu.mark(self.streams[stream], op);
        }
        match op {
            Op::Alloc { .. } | Op::Free { .. } | Op::Record { .. } | Op::Wait { .. } => {
                Err(format!("`{op}` is the interpreter's"))
            }
            Op::Overlap { .. } | Op::Collective { .. } => Err(format!(
                "`{op}` is a stage-granularity op; the CUDA backend runs schedc's model"
            )),
            Op::TpGradAllReduce { stage, group } => {
                self.tp_grad_all_reduce(stream, *stage, group, issued)
            }
            Op::Offload { stage, mb } | Op::Reload { stage, mb } => {
                let (sb, hb) = (
                    Buf::Stash {
                        stage: *stage,
                        mb: *mb,
                    },
                    Buf::Host {
                        stage: *stage,
                        mb: *mb,
                    },
                );
                let (d, bytes) = (self.buf(&sb)?, self.bytes_of(sb)?);
                let h = self
                    .host_bufs
                    .get(&hb)
                    .map(|x| x.0)
                    .ok_or_else(|| format!("`{op}`: {hb} is not allocated"))?;
                let s = self.streams[stream];
                if matches!(op, Op::Offload { .. }) {
                    crate::memops::offload(self.gpu, s, h, d, bytes)
                } else {
                    crate::memops::reload(self.gpu, s, d, h, bytes)
                }
                .map_err(issue)?;
                Ok(Ready::Done)
            }
            Op::TpCollective {
                stage,
                mb,
                layer,
                phase,
                group,
            } => {
                let si = self.stage_ix(*stage)?;
                let stash = self.buf(&Buf::Stash {
                    stage: *stage,
                    mb: *mb,
                })?;
                let r = self.stages[si]
                    .stash
                    .layers
                    .get(*layer as usize)
                    .ok_or(format!("`{op}`: no layer {layer}"))?;
                let dm = &self.dims;
                let (t, tc, d) = (dm.t, dm.tc, dm.d);
                let lat = dm.qr + dm.kvr + dm.kw();
                // The phases' regions (the storage type: bf16 in a bf16 run). An all-reduce
                // sums the member's partials in place: `o W_O` in `h1`, the shared expert's
                // output in `sh_y`, its input gradient in `dn2`, `[dc_Q; dc_KV; dk^R]` packed
                // in `tpg`. Megatron sequence parallelism's all-gathers take the member's `t`
                // rows to the chunk's `tc`, its reduce-scatters the chunk's partial sums to
                // the member's rows.
                let dy = match r_dy(&self.stages[si].stash, *layer as usize) {
                    Some(x) => x,
                    None => return Err(format!("`{op}`: no layer {layer}")),
                };
                let (src, dst, count) = match phase {
                    Tp::AttnOut => (r.h1, r.h1, t * d),
                    Tp::MlpOut => (r.sh_y, r.sh_y, t * d),
                    Tp::MlpInGrad => (r.dn2, r.dn2, t * d),
                    Tp::AttnInGrad => (r.tpg, r.tpg, t * lat),
                    Tp::LatentGather => (r.tps, r.tpg, t * lat),
                    Tp::AttnOutScatter => (r.h1c, r.h1, t * d),
                    Tp::MlpInGather => (r.n2, r.n2c, t * d),
                    Tp::MlpOutScatter => (r.sh_y, r.ysh, t * d),
                    Tp::MlpOutGradGather => (dy, r.dyc, t * d),
                    Tp::MlpInGradScatter => (r.dn2c, r.dn2, t * d),
                    Tp::AttnOutGradGather => (r.dh1, r.dh1c, t * d),
                    Tp::LatentGradScatter => (r.tpg, r.tps, t * lat),
                };
                let kind = phase.kind();
                let n = group.len();
                let (need_src, need_dst) = match kind {
                    TpKind::AllReduce => (count, count),
                    TpKind::AllGather => (count, n * count),
                    TpKind::ReduceScatter => (n * count, count),
                };
                if kind != TpKind::AllReduce && (!dm.seq_par || n * t != tc) {
                    return Err(format!(
                        "`{op}`: a sequence-parallel collective over {n} members, in a run with {} (chunk of {tc} tokens, {t} per member)",
                        if dm.seq_par {
                            "Megatron sequence parallelism"
                        } else {
                            "no Megatron sequence parallelism (a manifest without `sequence_parallel`)"
                        }
                    ));
                }
                let dtype = dm.dtype;
                for (reg, need) in [(src, need_src), (dst, need_dst)] {
                    if reg.bytes < need * dtype.size() {
                        return Err(format!(
                            "`{op}`: {need} values do not fit the stash region of {} bytes",
                            reg.bytes
                        ));
                    }
                }
                let (src, dst) = (stash + src.off as u64, stash + dst.off as u64);
                let tag = CollTag::Tp(*stage, *mb, *layer, *phase);
                let t = self.transport;
                let cx = &mut self.cx(stream);
                match kind {
                    TpKind::AllReduce => t.reduce(cx, tag, group, dst, count, dtype, issued),
                    TpKind::AllGather => {
                        t.all_gather(cx, tag, group, (src, dst), count, dtype, issued)
                    }
                    TpKind::ReduceScatter => {
                        t.reduce_scatter(cx, tag, group, (src, dst), count, dtype, issued)
                    }
                }
            }
            Op::Kernel(k) => self.kernel(stream, k).map(|_| Ready::Done),
            Op::Send { .. } | Op::Recv { .. } if self.transport.groups_messages() => {
                self.post_group(stream)
            }
            Op::Send { buf, peer } => {
                let (p, bytes) = (self.buf(buf)?, self.bytes_of(*buf)?);
                let t = self.transport;
                t.send(&mut self.cx(stream), *buf, p, bytes, *peer)
            }
            Op::Recv { buf, peer } => {
                let (p, bytes) = (self.buf(buf)?, self.bytes_of(*buf)?);
                let t = self.transport;
                let r = t.recv(&mut self.cx(stream), *buf, p, bytes, *peer)?;
                if r != Ready::Done {
                    *issued = true;
                }
                Ok(r)
            }
            Op::AllToAll {
                stage,
                mb,
                layer,
                phase,
                group,
            } => {
                let si = self.stage_ix(*stage)?;
                let stash = self.buf(&Buf::Stash {
                    stage: *stage,
                    mb: *mb,
                })?;
                let sl = &self.stages[si].stash;
                let (ob, ib) = (stash + sl.outbox.off as u64, stash + sl.inbox.off as u64);
                let sb = self.dims.slot_bytes;
                let t = self.transport;
                t.all_to_all(
                    &mut self.cx(stream),
                    CollTag::A2a(*stage, *mb, *layer, *phase),
                    group,
                    ob,
                    ib,
                    sb,
                    issued,
                )
            }
            Op::ReplicaSum {
                stage,
                model_stage,
                peer,
            } => {
                let si = self.stage_ix(*stage)?;
                let g = self.buf(&Buf::WeightGrad { stage: *stage })?;
                let n = self.stages[si].layout.grads();
                let me = self.prog.rank;
                let group = vec![me.min(*peer), me.max(*peer)];
                let t = self.transport;
                t.reduce(
                    &mut self.cx(stream),
                    CollTag::Replica(*model_stage),
                    &group,
                    g,
                    n,
                    DType::F32,
                    issued,
                )
            }
            Op::AllReduce {
                stage,
                scope,
                group,
            } => {
                let si = self.stage_ix(*stage)?;
                let g = self.buf(&Buf::WeightGrad { stage: *stage })?;
                let lay = &self.stages[si].layout;
                let (off, n) = match scope {
                    Scope::Dense => (0, lay.dense + lay.loads),
                    Scope::Expert => (lay.dense + lay.loads, lay.expert),
                };
                let t = self.transport;
                t.reduce(
                    &mut self.cx(stream),
                    CollTag::AllReduce(*stage, *scope),
                    group,
                    g + (off * 4) as u64,
                    n,
                    DType::F32,
                    issued,
                )
            }
            Op::OptimizerStep { stage } => self.optimizer_step(stream, *stage).map(|_| Ready::Done),
        }
    }

    fn wait(&mut self, at_most: Duration) {
        self.transport.wait(at_most);
    }
}

/// A device for the liveness plan: runs nothing, never blocks, and counts the buffers of
/// each size alive at once.
struct Planner<'a> {
    sizes: &'a dyn Fn(Buf) -> Result<usize, String>,
    live: HashMap<usize, usize>,
    peak: HashMap<usize, usize>,
    bufs: HashMap<Buf, usize>,
}

impl Device for Planner<'_> {
    fn alloc(&mut self, buf: Buf, _zero: bool) -> Result<(), String> {
        if let Buf::Host { .. } = buf {
            // Pinned host memory: not the device pool's.
            return Ok(());
        }
        let b = (self.sizes)(buf)?;
        let n = self.live.entry(b).or_default();
        *n += 1;
        let p = self.peak.entry(b).or_default();
        *p = (*p).max(*n);
        self.bufs.insert(buf, b);
        Ok(())
    }
    fn free(&mut self, buf: Buf) -> Result<(), String> {
        if let Some(b) = self.bufs.remove(&buf) {
            *self.live.entry(b).or_default() -= 1;
        }
        Ok(())
    }
    fn exec(&mut self, _s: usize, _op: &Op, _issued: &mut bool) -> Result<Ready, String> {
        Ok(Ready::Done)
    }
    fn wait(&mut self, _at_most: Duration) {}
}

/// The liveness plan of one rank: for each buffer size, the most buffers of that size
/// alive at once when the rank's streams run in the interpreter's order with every message
/// already there. `(bytes, count)`, by size.
pub fn plan_rank(
    set: &ProgramSet,
    prog: &RankProgram,
    dims: &Dims,
    stages: &[StageDev],
) -> Result<Vec<(usize, usize)>, String> {
    plan_rank_lent(prog, dims, stages, &lent_stashes(set, prog, dims)?)
}

/// [`plan_rank`] with the stash sizes of the stages the rank holds for others (`lent`).
fn plan_rank_lent(
    prog: &RankProgram,
    dims: &Dims,
    stages: &[StageDev],
    lent: &std::collections::BTreeMap<u32, usize>,
) -> Result<Vec<(usize, usize)>, String> {
    let mut sizes: Vec<StageSizes> = stages
        .iter()
        .map(|s| StageSizes {
            stage: s.info.stage,
            stash: s.stash.bytes,
            grads: s.layout.grads() * 4,
        })
        .collect();
    sizes.extend(lent_sizes(lent));
    plan_rank_sizes(prog, dims, &sizes)
}

/// The [`StageSizes`] of stages whose stashes a rank only holds for their owner (no
/// gradient accumulator).
fn lent_sizes(lent: &std::collections::BTreeMap<u32, usize>) -> Vec<StageSizes> {
    lent.iter()
        .map(|(&stage, &stash)| StageSizes {
            stage,
            stash,
            grads: 0,
        })
        .collect()
}

/// Bytes of the scratch a rank's recomputes write their router loads to (`layers x experts`
/// f32, [`Io::recompute`]); 0 for a program without recomputes.
pub fn recompute_scratch_bytes(prog: &RankProgram, dims: &Dims) -> usize {
    let recomputes = prog
        .streams
        .iter()
        .flat_map(|s| &s.ops)
        .any(|op| matches!(op, Op::Kernel(k) if k.pass == Pass::Recompute));
    if recomputes {
        dims.layers * dims.e * 4
    } else {
        0
    }
}

/// The byte sizes of one stage copy's buffers, for [`plan_rank_sizes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageSizes {
    /// IR stage id.
    pub stage: u32,
    /// Bytes of one stash (a micro-batch's activations).
    pub stash: usize,
    /// Bytes of the weight-gradient accumulator (f32 gradients and load counts).
    pub grads: usize,
}

/// [`plan_rank`] from the stages' buffer sizes alone (nothing allocated): the pool's
/// `(block bytes, count)` at the rank's peak. Errors: a stage the rank does not hold, a
/// program the planner cannot run.
pub fn plan_rank_sizes(
    prog: &RankProgram,
    dims: &Dims,
    stages: &[StageSizes],
) -> Result<Vec<(usize, usize)>, String> {
    let ix = |s: u32| {
        stages
            .iter()
            .position(|x| x.stage == s)
            .ok_or(format!("stage {s} is not held"))
    };
    let sizes = |b: Buf| -> Result<usize, String> {
        Ok(match b {
            Buf::Act { .. } | Buf::Grad { .. } => dims.act_bytes(),
            Buf::Stash { stage, .. } | Buf::Host { stage, .. } => stages[ix(stage)?].stash,
            Buf::WeightGrad { stage } => stages[ix(stage)?].grads,
        })
    };
    let mut p = Planner {
        sizes: &sizes,
        live: HashMap::new(),
        peak: HashMap::new(),
        bufs: HashMap::new(),
    };
    interp::run_rank(
        prog,
        &mut p,
        InterpOptions {
            steps: 1,
            timeout: Duration::from_secs(10),
        },
        &Abort::default(),
        &Mutex::default(),
    )
    .map_err(|e| format!("planning the rank's memory: {e}"))?;
    let mut v: Vec<(usize, usize)> = p.peak.into_iter().collect();
    v.sort();
    Ok(v)
}

/// What each of `ranks` of `set` takes from the device in `dtype` under `optimizer`,
/// computed from the model's sizes and the programs alone, before anything is allocated:
/// per stage copy the `f32` master parameters, the compute copy (bf16), Adam's moments and
/// the balancing state ([`RankNeed::params`]); the pool the liveness plan reserves
/// ([`plan_rank_sizes`]) and the losses ([`RankNeed::activations`]). It equals what
/// [`RankMemory`] reports after the run (`params`, `planned` + the losses).
///
/// Errors: programs without schedc's model, sizes [`Dims::new`] refuses, a rank outside
/// the world.
pub fn rank_needs(
    set: &ProgramSet,
    ranks: &[u32],
    dtype: DType,
    optimizer: &Optimizer,
) -> Result<Vec<schedc_program::memory::RankNeed>, String> {
    let m = &set.manifest;
    let Some(cfg) = &m.model else {
        return Err("the programs have no model (stage granularity)".into());
    };
    // The stash sizes do not depend on the TP member's shard.
    let dims = Dims::with_sequence_parallel(cfg, &m.mesh, dtype, m.sequence_parallel.then_some(0))?;
    let adam = matches!(optimizer, Optimizer::Adam { .. });
    let mt = (m.microbatches * m.directions) as usize;
    ranks
        .iter()
        .map(|&r| {
            let prog = set
                .ranks
                .get(r as usize)
                .ok_or_else(|| format!("rank {r} is outside the world of {}", set.ranks.len()))?;
            let mut params = 0usize;
            let mut sizes = Vec::new();
            for info in &prog.stages {
                let n = cfg.stage_params(
                    info.first,
                    info.last,
                    (info.expert_hi - info.expert_lo) as usize,
                    dims.tp,
                ) as usize;
                let le = dims.layers * dims.e;
                params += n * 4 + 3 * le * 4;
                if dtype != DType::F32 {
                    params += n * dims.ts;
                }
                if adam {
                    params += 2 * n * 4;
                }
                sizes.push(StageSizes {
                    stage: info.stage,
                    stash: crate::layout::StashLayout::new(&dims, info).bytes,
                    grads: (n + le) * 4,
                });
            }
            sizes.extend(lent_sizes(&lent_stashes(set, prog, &dims)?));
            let pool: usize = plan_rank_sizes(prog, &dims, &sizes)?
                .iter()
                .map(|(b, c)| b * c)
                .sum();
            let losses =
                (prog.stages.len() * mt).max(1) * 4 + 4 + recompute_scratch_bytes(prog, &dims);
            Ok(schedc_program::memory::RankNeed {
                rank: r,
                params: params as u64,
                activations: (pool + losses) as u64,
            })
        })
        .collect()
}

/// Refuses, before anything is allocated, ranks `ranks` of `set` that do not fit on `gpu`
/// together (they share it): against `limit` if given, else the device's free memory
/// ([`Gpu::memory_free`]); a device that cannot say is not checked. Errors: the message of
/// [`schedc_program::memory::check_fit`], naming the rank, its need and the limit.
pub fn check_memory(
    gpu: &dyn Gpu,
    set: &ProgramSet,
    ranks: &[u32],
    optimizer: &Optimizer,
    limit: Option<u64>,
) -> Result<(), String> {
    let (limit, name) = match limit {
        Some(l) => (l, "--memory-limit".to_string()),
        None => match gpu.memory_free().map_err(|e| e.0)? {
            Some(f) => (f as u64, format!("the memory free on {}", gpu.describe())),
            None => return Ok(()),
        },
    };
    let needs = rank_needs(set, ranks, gpu.dtype(), optimizer)?;
    schedc_program::memory::check_fit(&needs, limit, &name, true)
}

/// Runs `opts.steps` steps of every rank of `set` in this process on one device (single
/// mode): one thread per rank, all sharing `gpu` and the [`crate::transport::Single`]
/// transport. Errors: the first rank failure, with every other rank's stop.
pub fn execute(
    gpu: &dyn Gpu,
    set: &ProgramSet,
    data: &Data,
    opts: &ExecOptions,
) -> Result<GpuResult, RunFailure> {
    execute_on(&[gpu], set, data, opts)
}

/// [`execute`] with one device for all ranks (`gpus.len() == 1`) or one per rank (the
/// recording fake gives every rank its own log).
pub fn execute_on(
    gpus: &[&dyn Gpu],
    set: &ProgramSet,
    data: &Data,
    opts: &ExecOptions,
) -> Result<GpuResult, RunFailure> {
    let transport = crate::transport::Single::new();
    let events = Events::default();
    let abort = Abort::default();
    let world = set.ranks.len();
    let results: Mutex<GpuResult> = Mutex::new(GpuResult {
        losses: vec![0.0; opts.steps],
        grads: vec![Vec::new(); if opts.record { opts.steps } else { 0 }],
        ..GpuResult::default()
    });
    let progress = Progress::new(world, opts.steps, opts.on_step.clone());
    let start = Instant::now();
    let mut stopped = Vec::new();
    std::thread::scope(|scope| {
        let handles: Vec<_> = set
            .ranks
            .iter()
            .map(|prog| {
                let (transport, events, abort, results, progress) =
                    (&transport, &events, &abort, &results, &progress);
                let gpu = gpus[(prog.rank as usize).min(gpus.len() - 1)];
                scope.spawn(move || {
                    interp::guarded(prog, abort, |cursor| {
                        let at0 = || interp::at_of(prog, Cursor::default());
                        let failed = |message: String| ExecError::Failed { at: at0(), message };
                        let mut dev =
                            RankDev::new(gpu, set, prog, events, transport, data, opts, None)
                                .map_err(failed)?;
                        dev.set_progress(progress);
                        let iopts = InterpOptions {
                            steps: opts.steps,
                            timeout: opts.timeout,
                        };
                        let run = interp::run_rank(prog, &mut dev, iopts, abort, cursor);
                        let n = match run {
                            Ok(n) => n,
                            Err(e) => {
                                let _ = dev.release();
                                return Err(e);
                            }
                        };
                        let params = if opts.record {
                            dev.params().map_err(failed)?
                        } else {
                            Vec::new()
                        };
                        let mem = dev.memory();
                        dev.release().map_err(failed)?;
                        let mut r = results.lock().unwrap_or_else(|p| p.into_inner());
                        for (step, l) in dev.step_losses.iter().enumerate() {
                            r.losses[step] += l;
                        }
                        for (step, stage, g) in std::mem::take(&mut dev.grads) {
                            r.grads[step].push((prog.rank, stage, g));
                        }
                        for (stage, p) in params {
                            r.params.push((prog.rank, stage, p));
                        }
                        r.instructions += n;
                        r.memory.push(mem);
                        Ok(())
                    })
                })
            })
            .collect();
        for h in handles {
            if let Ok(Some(e)) = h.join() {
                stopped.push(e);
            }
        }
    });
    let _ = transport.release(gpus[0]);
    abort.outcome(stopped)?;
    let mut r = results.into_inner().unwrap_or_else(|p| p.into_inner());
    r.seconds = start.elapsed().as_secs_f64();
    for g in r.grads.iter_mut() {
        g.sort_by_key(|(rk, s, _)| (*rk, *s));
    }
    r.params.sort_by_key(|(rk, s, _)| (*rk, *s));
    r.memory.sort_by_key(|m| m.rank);
    Ok(r)
}

/// NCCL mode: runs rank `rank` of `set` in this process on `gpu`, exchanging with the other
/// ranks' processes through `coll` (one communicator per stream kind of the set, plus one,
/// after them, for the losses: [`stream_kinds`]). Every step's loss is the sum over all
/// ranks. Errors: the rank's failure (where and why).
pub fn execute_rank(
    gpu: &dyn Gpu,
    coll: &dyn Collectives,
    set: &ProgramSet,
    rank: u32,
    data: &Data,
    opts: &ExecOptions,
) -> Result<GpuResult, RunFailure> {
    let prog = set.ranks.get(rank as usize).ok_or_else(|| RunFailure {
        cause: ExecError::Failed {
            at: interp::at_of(&set.ranks[0], Cursor::default()),
            message: format!("rank {rank} is outside the world of {}", set.ranks.len()),
        },
        stopped: Vec::new(),
        stop_seconds: 0.0,
    })?;
    let transport = crate::transport::Nccl { coll };
    let events = Events::default();
    let abort = Abort::default();
    let ctrl = stream_kinds(set).len();
    // The step's loss is already the sum over every rank (all-reduced).
    let progress = Progress::new(1, opts.steps, opts.on_step.clone());
    let start = Instant::now();
    let mut out = GpuResult::default();
    let stop = interp::guarded(prog, &abort, |cursor| {
        let failed = |message: String| ExecError::Failed {
            at: interp::at_of(prog, Cursor::default()),
            message,
        };
        let mut dev = RankDev::new(
            gpu,
            set,
            prog,
            &events,
            &transport,
            data,
            opts,
            Some((coll, ctrl)),
        )
        .map_err(failed)?;
        if let Err(e) = preconnect(gpu, coll, set, prog, dev.streams[0], opts.timeout) {
            let _ = dev.release();
            return Err(failed(e));
        }
        dev.set_progress(&progress);
        let iopts = InterpOptions {
            steps: opts.steps,
            timeout: opts.timeout,
        };
        let n = match interp::run_rank(prog, &mut dev, iopts, &abort, cursor) {
            Ok(n) => n,
            Err(e) => {
                let _ = dev.release();
                return Err(e);
            }
        };
        if opts.record {
            for (stage, p) in dev.params().map_err(failed)? {
                out.params.push((rank, stage, p));
            }
            out.grads = vec![Vec::new(); opts.steps];
            for (step, stage, g) in std::mem::take(&mut dev.grads) {
                out.grads[step].push((rank, stage, g));
            }
        }
        out.memory.push(dev.memory());
        dev.release().map_err(failed)?;
        out.losses = dev.step_losses.clone();
        out.instructions = n;
        Ok(())
    });
    if stop.is_some() {
        // The peers may be blocked in a message to or from this rank: abort the
        // communicators (issue 24, item 5) rather than leave them to a destroy that waits.
        coll.abort();
    }
    abort.outcome(stop.into_iter().collect())?;
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

/// The point-to-point peers of rank `prog` on each communicator of [`stream_kinds`]:
/// `(communicator, peers in increasing order)`, for the sends, receives, all-to-alls,
/// TP collectives, replica sums and all-reduces of its program (the NCCL transport carries
/// each as sends and receives between the members). Symmetric across ranks: `q` is a peer
/// of `r` on a communicator exactly when `r` is one of `q`.
pub fn p2p_peers(set: &ProgramSet, prog: &RankProgram) -> Vec<(usize, Vec<u32>)> {
    let kinds = stream_kinds(set);
    let mut per: std::collections::BTreeMap<usize, std::collections::BTreeSet<u32>> =
        std::collections::BTreeMap::new();
    for st in &prog.streams {
        let comm = kinds.iter().position(|k| *k == st.kind).unwrap_or(0);
        for op in &st.ops {
            let peers: Vec<u32> = match op {
                Op::Send { peer, .. } | Op::Recv { peer, .. } | Op::ReplicaSum { peer, .. } => {
                    vec![*peer]
                }
                Op::AllToAll { group, .. }
                | Op::TpCollective { group, .. }
                | Op::TpGradAllReduce { group, .. }
                | Op::AllReduce { group, .. } => group.clone(),
                _ => Vec::new(),
            };
            for p in peers.into_iter().filter(|&p| p != prog.rank) {
                per.entry(comm).or_default().insert(p);
            }
        }
    }
    per.into_iter()
        .map(|(c, s)| (c, s.into_iter().collect()))
        .collect()
}

/// NCCL mode, before the first step: connects rank `prog` to every peer of
/// [`p2p_peers`] in one grouped exchange (a byte each way per peer and communicator, on
/// stream `s`), then waits for it. NCCL connects a pair lazily at its first message; made
/// here, every connection exists before the schedule's first group, so that no step's
/// group waits on a connection that its peer makes in another order, and a missing peer
/// shows at once, named. Errors: NCCL's, or the wait's timeout.
pub fn preconnect(
    gpu: &dyn Gpu,
    coll: &dyn Collectives,
    set: &ProgramSet,
    prog: &RankProgram,
    s: StreamId,
    timeout: Duration,
) -> Result<(), String> {
    let peers = p2p_peers(set, prog);
    let n: usize = peers.iter().map(|(_, p)| p.len()).sum();
    if n == 0 {
        return Ok(());
    }
    let buf = gpu.alloc(n + 1).map_err(issue)?;
    gpu.memset(s, buf, n + 1).map_err(issue)?;
    coll.group_start().map_err(issue)?;
    let mut i = 0u64;
    let posted = (|| -> Result<(), GpuError> {
        for (comm, ps) in &peers {
            for &p in ps {
                coll.send(*comm, s, buf, 1, p)?;
                coll.recv(*comm, s, buf + 1 + i, 1, p)?;
                i += 1;
            }
        }
        Ok(())
    })();
    let end = coll.group_end();
    let r = posted
        .and(end)
        .map_err(|e| format!("connecting rank {} to its peers: {}", prog.rank, e.0))
        .and_then(|_| {
            gpu.sync(s, timeout).map_err(|e| {
                format!(
                    "connecting rank {} to its peers {:?}: {}",
                    prog.rank, peers, e.0
                )
            })
        });
    if r.is_ok() {
        // After a failure the stream may still hold the buffer: it is left to the context.
        gpu.free(buf).map_err(issue)?;
    }
    r
}
