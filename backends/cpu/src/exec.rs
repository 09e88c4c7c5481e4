//! The CPU executor: one OS thread per global rank runs its [`RankProgram`] with real
//! message passing (`std::sync::mpsc`), and the plain sequential reference it is checked
//! against.
//!
//! ## How a rank runs its streams
//! Each rank's thread runs its program with [`schedc_program::interp::run_rank`], the
//! device-neutral interpreter (streams, events, buffer lifetimes, blocking, timeouts); the
//! rank is the interpreter's [`Device`]: buffers are tensors in a map, a `recv` is ready
//! when its message is in the mailbox, a collective when every member's message has
//! arrived. Sends are eager (unbounded channels). Collectives are two-phase: the first visit
//! posts this rank's messages, the op completes once every member's message is in.
//!
//! ## Faults
//! Every rank shares an [`Abort`] flag. A rank that panics (caught with `catch_unwind`),
//! fails a kernel, or waits longer than [`ExecOptions::timeout`] without running any
//! instruction, records the error (rank, step, stream, instruction, what it waited for) and
//! raises the flag; every other rank sees it within [`POLL`] and stops. The run returns the
//! first error and the list of ranks stopped: never a hang.
//!
//! ## The reference
//! [`reference`](fn@reference) trains the whole model on one thread: for every data shard and every
//! micro-batch (both directions' for DualPipe) the full forward and backward with all
//! experts local, gradients summed, then the same optimizer and balancing update. Same
//! initial weights (by name), same data, same routing groups (one micro-batch of one
//! shard), so in exact arithmetic it computes the same numbers as any schedule; in floating
//! point only the order of the gradient sums differs.

use crate::model::{
    stage_backward_local, stage_forward_local, Grads, ModelConfig, Packet, RouterState, Scope,
    StageKernels, StageParams, Stash, WeightSet,
};
use crate::model::{tp_shard_name, tp_split};
use crate::tensor::{add_into, Real};
pub use schedc_program::data::{Batching, Data};
use schedc_program::interp::{self, Cursor, Device, InterpOptions, Ready};
pub use schedc_program::interp::{Abort, At, ExecError, RunFailure, POLL};
use schedc_program::mesh::Dim;
use schedc_program::{A2a, Buf, LocalStage, Op, Part, Pass, ProgramSet, RankProgram, Tp, TpKind};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Optimizer {
    /// `p -= lr g`.
    Sgd {
        /// Learning rate.
        lr: f64,
    },
    /// Adam (Kingma & Ba, arXiv 1412.6980, Algorithm 1) with bias correction.
    Adam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator epsilon.
        eps: f64,
    },
}

impl Optimizer {
    /// Adam with the usual constants and learning rate `lr`.
    pub fn adam(lr: f64) -> Self {
        Optimizer::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// Optimizer state of one stage copy: Adam's moments per tensor (visit order).
#[derive(Clone, Debug, Default)]
struct OptState<T> {
    m: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
    t: u32,
}

fn optimizer_step<T: Real>(
    opt: &Optimizer,
    st: &mut OptState<T>,
    p: &mut StageParams<T>,
    g: &StageParams<T>,
) {
    let mut grads: Vec<Vec<T>> = Vec::new();
    g.visit(&mut |_, _, t| grads.push(t.to_vec()));
    st.t += 1;
    let mut i = 0;
    match *opt {
        Optimizer::Sgd { lr } => {
            let lr = T::of(lr);
            p.visit_mut(&mut |_, _, w| {
                for (x, d) in w.iter_mut().zip(&grads[i]) {
                    *x = *x - lr * *d;
                }
                i += 1;
            });
        }
        Optimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => {
            if st.m.is_empty() {
                st.m = grads.iter().map(|g| vec![T::zero(); g.len()]).collect();
                st.v = st.m.clone();
            }
            let c1 = T::of(1.0 - beta1.powi(st.t as i32));
            let c2 = T::of(1.0 - beta2.powi(st.t as i32));
            let (b1, b2, lr, eps) = (T::of(beta1), T::of(beta2), T::of(lr), T::of(eps));
            let (ms, vs) = (&mut st.m, &mut st.v);
            p.visit_mut(&mut |_, _, w| {
                for (j, x) in w.iter_mut().enumerate() {
                    let d = grads[i][j];
                    let m = b1 * ms[i][j] + (T::one() - b1) * d;
                    let v = b2 * vs[i][j] + (T::one() - b2) * d * d;
                    ms[i][j] = m;
                    vs[i][j] = v;
                    *x = *x - lr * (m / c1) / ((v / c2).sqrt() + eps);
                }
                i += 1;
            });
        }
    }
}

/// A callback after each step: `(step, loss)`.
pub type OnStep = Arc<dyn Fn(usize, f64) + Send + Sync>;

/// Executor options.
#[derive(Clone)]
pub struct ExecOptions {
    /// Training steps (each runs the whole schedule once).
    pub steps: usize,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Longest a rank may wait without running an instruction before it fails.
    pub timeout: Duration,
    /// Record every reduced gradient and the final parameters (for [`compare`]).
    pub record: bool,
    /// Injected faults (tests).
    pub faults: Faults,
    /// Record when every instruction ran ([`ExecResult::trace`], [`chrome_trace`]).
    pub trace: bool,
    /// Called after every step with (step, loss) from the main thread (progress).
    pub on_step: Option<OnStep>,
    /// With [`ExecOptions::trace`]: where the spans go while the run goes, each rank's
    /// spans of a step once it finishes the step (on the thread that called [`execute`]);
    /// [`ExecResult::trace`] then stays empty, so that a long traced run holds about one
    /// step of spans rather than all of them. `None`: they are collected in
    /// [`ExecResult::trace`].
    pub trace_sink: Option<SpanSink>,
    /// How the expert-parallel all-to-alls travel between nodes (`run --a2a`).
    pub a2a: A2aMode,
}

/// How the expert-parallel all-to-alls (dispatch, combine and their gradients) travel
/// (`run --a2a`). Both deliver the same packets, so training is identical; they differ in
/// the messages on the inter-node network ([`Traffic`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum A2aMode {
    /// Every member sends its packet for every other member directly.
    #[default]
    Flat,
    /// DeepSeek-V3's two-level dispatch (arXiv 2412.19437, §3.2.2): a member sends one
    /// message per other node, to its peer there (the member of that node with the same
    /// index among the group's members of its node), carrying each distinct row once
    /// however many of that node's members want it (a token routed to several experts on
    /// one node crosses the network once); the peer scatters the rows inside its node.
    /// Combine and the gradients take the same two hops (their rows are distinct per
    /// expert, so only the number of messages drops).
    Hierarchical,
}

impl std::str::FromStr for A2aMode {
    type Err = String;
    /// `flat` or `hierarchical`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "flat" => Ok(A2aMode::Flat),
            "hierarchical" => Ok(A2aMode::Hierarchical),
            _ => Err(format!(
                "unknown all-to-all `{s}`: expected flat or hierarchical"
            )),
        }
    }
}

/// Bytes and messages a run moved between ranks, summed over every rank and step
/// (messages a rank sends itself are not counted). A row of `n` values of the run's
/// precision is `n` times 4 (f32) or 8 (f64) bytes; expert ids and row indices 4 bytes each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Traffic {
    /// Expert-parallel all-to-alls: bytes between ranks of one node.
    pub a2a_intra_bytes: u64,
    /// Expert-parallel all-to-alls: bytes between nodes.
    pub a2a_inter_bytes: u64,
    /// Expert-parallel all-to-alls: messages inside a node.
    pub a2a_intra_messages: u64,
    /// Expert-parallel all-to-alls: messages between nodes.
    pub a2a_inter_messages: u64,
    /// Of [`Traffic::a2a_inter_bytes`], the forward dispatch's (token rows to their
    /// experts: what the hierarchical all-to-all sends once per node).
    pub dispatch_inter_bytes: u64,
    /// Tensor-parallel all-reduces: bytes sent (each member sends its partial sums to every
    /// other member).
    pub tp_bytes: u64,
    /// Tensor-parallel all-reduces: bytes of those that crossed nodes.
    pub tp_inter_bytes: u64,
}

impl Traffic {
    fn add(&mut self, o: &Traffic) {
        self.a2a_intra_bytes += o.a2a_intra_bytes;
        self.a2a_inter_bytes += o.a2a_inter_bytes;
        self.a2a_intra_messages += o.a2a_intra_messages;
        self.a2a_inter_messages += o.a2a_inter_messages;
        self.dispatch_inter_bytes += o.dispatch_inter_bytes;
        self.tp_bytes += o.tp_bytes;
        self.tp_inter_bytes += o.tp_inter_bytes;
    }
}

/// Receives a traced run's spans as the ranks finish each step ([`ExecOptions::trace_sink`]).
pub type SpanSink = Arc<Mutex<dyn FnMut(&[Span]) + Send>>;

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            steps: 1,
            optimizer: Optimizer::Sgd { lr: 0.1 },
            timeout: Duration::from_secs(60),
            record: false,
            faults: Faults::default(),
            trace: false,
            on_step: None,
            trace_sink: None,
            a2a: A2aMode::Flat,
        }
    }
}

/// Faults to inject (tests of the failure paths).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// `(rank, step, index)`: the rank panics when it reaches that compute-stream
    /// instruction of that step.
    pub panic_at: Option<(u32, usize, usize)>,
    /// `(from, to, n)`: the `n`-th message (0-based, over the run) from `from` to `to` is
    /// never delivered.
    pub drop_message: Option<(u32, u32, usize)>,
}

/// Named tensors, in a fixed order.
pub type Named = Vec<(String, Vec<f64>)>;

/// What one executor run produced.
#[derive(Clone, Debug, Default)]
pub struct ExecResult {
    /// Loss of each step (the global batch's mean token loss).
    pub losses: Vec<f64>,
    /// With [`ExecOptions::record`]: per step, per rank and stage copy, the reduced
    /// gradients (`(rank, stage, tensors)`).
    pub grads: Vec<Vec<(u32, u32, Named)>>,
    /// With [`ExecOptions::record`]: the final parameters of every copy.
    pub params: Vec<(u32, u32, Named)>,
    /// Seconds of the whole run (threads started to joined).
    pub seconds: f64,
    /// Instructions executed over all ranks.
    pub instructions: u64,
    /// With [`ExecOptions::trace`]: every instruction that touches data (kernels,
    /// messages, collectives, the optimizer), by rank, in the order each rank finished them.
    pub trace: Vec<Span>,
    /// What the collectives moved ([`ExecOptions::a2a`]).
    pub traffic: Traffic,
}

/// When one instruction ran on one stream of one rank ([`ExecOptions::trace`]). An
/// asynchronous instruction (an all-to-all, a reduction) spans from its posting to the turn
/// of its stream that took its completion; the others are their execution.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Span {
    /// Global rank.
    pub rank: u32,
    /// Step.
    pub step: usize,
    /// Index of the stream in the rank program.
    pub stream: usize,
    /// The stream's name (`compute`, `comm`, `comm@c`, `ep`).
    pub stream_name: String,
    /// The instruction's text.
    pub name: String,
    /// `kernel`, `all_to_all`, `p2p`, `reduce` or `optimizer`.
    pub cat: &'static str,
    /// The chunk the instruction belongs to, `F(s,m)`, `B(s,m)` or `W(s,m)` (an all-to-all
    /// of `dispatch`, `combine`, `gather_kv` is the forward's, the others the backward's);
    /// `None` for messages, reductions and the optimizer.
    pub chunk: Option<String>,
    /// Microseconds from the start of the run.
    pub start_us: f64,
    /// Microseconds.
    pub dur_us: f64,
}

impl Span {
    /// True if the two spans share some time (open intervals).
    pub fn overlaps(&self, o: &Span) -> bool {
        self.start_us < o.start_us + o.dur_us && o.start_us < self.start_us + self.dur_us
    }
}

fn span_of(op: &Op) -> (&'static str, Option<String>) {
    match op {
        Op::Kernel(k) => (
            "kernel",
            Some(format!("{:?}({},{})", k.pass, k.stage, k.mb)),
        ),
        Op::AllToAll {
            stage, mb, phase, ..
        } => {
            let pass = match phase {
                A2a::GatherKv | A2a::Dispatch | A2a::Combine => "F",
                A2a::ScatterKvGrad | A2a::CombineGrad | A2a::DispatchGrad => "B",
            };
            ("all_to_all", Some(format!("{pass}({stage},{mb})")))
        }
        Op::TpCollective {
            stage, mb, phase, ..
        } => {
            let pass = if phase.forward() { "F" } else { "B" };
            ("tp", Some(format!("{pass}({stage},{mb})")))
        }
        Op::Send { .. } | Op::Recv { .. } => ("p2p", None),
        Op::Offload { stage, mb } | Op::Reload { stage, mb } => {
            ("copy", Some(format!("F({stage},{mb})")))
        }
        Op::ReplicaSum { .. } | Op::AllReduce { .. } | Op::TpGradAllReduce { .. } => {
            ("reduce", None)
        }
        _ => ("optimizer", None),
    }
}

/// Chrome trace JSON (Perfetto, chrome://tracing) of a traced run: one process per global
/// rank, one thread per stream (`compute`, `comm`, ..., `ep`), a complete event per
/// [`Span`] with its chunk and step in `args`; times in microseconds.
pub fn chrome_trace(spans: &[Span]) -> String {
    let mut w = ChromeTraceWriter::new(Vec::new()).expect("a Vec takes the header");
    w.push(spans).expect("a Vec takes the events");
    String::from_utf8(w.finish().expect("a Vec takes the end")).expect("JSON is UTF-8")
}

/// [`chrome_trace`] written as the spans come (a streamed trace: [`ExecOptions::trace_sink`]):
/// the header at once, each span's event (after its rank's and stream's name records, the
/// first time they appear) as it is pushed, the end by [`ChromeTraceWriter::finish`]. The
/// memory it holds is the set of named (rank, stream) pairs.
pub struct ChromeTraceWriter<W: std::io::Write> {
    out: W,
    named: HashSet<(u32, usize)>,
    first: bool,
}

impl<W: std::io::Write> ChromeTraceWriter<W> {
    /// Writes the header to `out`. Errors: the write's.
    pub fn new(mut out: W) -> std::io::Result<Self> {
        out.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")?;
        Ok(ChromeTraceWriter {
            out,
            named: HashSet::new(),
            first: true,
        })
    }

    fn event(&mut self, v: serde_json::Value) -> std::io::Result<()> {
        if !self.first {
            self.out.write_all(b",")?;
        }
        self.first = false;
        serde_json::to_writer(&mut self.out, &v).map_err(std::io::Error::other)
    }

    /// Writes the events of `spans`. Errors: the write's.
    pub fn push(&mut self, spans: &[Span]) -> std::io::Result<()> {
        use serde_json::json;
        for s in spans {
            if self.named.insert((s.rank, usize::MAX)) {
                self.event(json!({"name": "process_name", "ph": "M", "pid": s.rank, "args": {"name": format!("rank {}", s.rank)}}))?;
            }
            if self.named.insert((s.rank, s.stream)) {
                self.event(json!({"name": "thread_name", "ph": "M", "pid": s.rank, "tid": s.stream, "args": {"name": s.stream_name}}))?;
            }
            self.event(json!({
                "name": s.name, "cat": s.cat, "ph": "X", "pid": s.rank, "tid": s.stream,
                "ts": s.start_us, "dur": s.dur_us,
                "args": {"chunk": s.chunk, "step": s.step},
            }))?;
        }
        Ok(())
    }

    /// Writes the end of the JSON and flushes; returns the writer. Errors: the write's.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.write_all(b"]}")?;
        self.out.flush()?;
        Ok(self.out)
    }
}

// ---------------------------------------------------------------------------------------
// Messages.

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Tag {
    P2p(Buf),
    A2a(u32, u32, u32, A2a),
    /// Hierarchical all-to-all: a member's bundle for a node, to its peer there.
    A2aHop(u32, u32, u32, A2a),
    /// Hierarchical all-to-all: the packet of original source `.4`, forwarded inside the
    /// node by its peer.
    A2aFwd(u32, u32, u32, A2a, u32),
    Tp(u32, u32, u32, Tp),
    TpGrad(u32),
    Replica(u32),
    AllReduce(u32, Scope),
}

enum Body<T> {
    Tensor(Vec<T>),
    /// A forward's saved tensors lent to another rank and back (LEND/RETURN).
    Stash(Box<Stash<T>>),
    Packet(Packet<T>),
    Bundle(Bundle<T>),
}

/// A hierarchical all-to-all's message for one node: its distinct rows once, and per
/// destination member the indices of its rows and their expert ids.
struct Bundle<T> {
    rows: Vec<T>,
    width: usize,
    dests: Vec<(u32, Vec<u32>, Vec<u32>)>,
}

struct Msg<T> {
    from: u32,
    step: usize,
    tag: Tag,
    body: Body<T>,
}

type Key = (u32, usize, Tag);

enum Report {
    Loss(usize, u32, f64),
    Grads(usize, u32, u32, Named),
    Params(u32, u32, Named),
    Ops(u64),
    Traffic(Traffic),
    Trace(Vec<Span>),
    Exit,
}

struct Shared<'a, T> {
    set: &'a ProgramSet,
    data: &'a Data,
    batching: Batching,
    opts: &'a ExecOptions,
    senders: Vec<Sender<Msg<T>>>,
    abort: Abort,
    reports: Mutex<Sender<Report>>,
    /// The start of the run (trace times).
    t0: Instant,
}

enum Value<T> {
    Empty,
    Tensor(Vec<T>),
    Stash(Box<Stash<T>>),
    Grads(Box<Grads<T>>),
}

struct StageState<T> {
    info: LocalStage,
    params: StageParams<T>,
    routers: Vec<RouterState<T>>,
    opt: OptState<T>,
}

struct Rank<'a, T> {
    sh: &'a Shared<'a, T>,
    prog: &'a RankProgram,
    cfg: &'a ModelConfig,
    ep: usize,
    sp: usize,
    /// Size of the TP group.
    tp: usize,
    /// Megatron sequence parallelism inside the TP group.
    seq_par: bool,
    stages: Vec<StageState<T>>,
    bufs: HashMap<Buf, Value<T>>,
    /// The host pool: the saved tensors an `offload` moved off the device, by their
    /// `host(s,m)` buffer, until a `reload` moves them back (the device-side `bufs` then no
    /// longer hold them: a backward that runs without the reload finds an empty stash).
    host: HashMap<Buf, Box<Stash<T>>>,
    mailbox: HashMap<Key, VecDeque<Body<T>>>,
    rx: Receiver<Msg<T>>,
    sent_to: HashMap<u32, usize>,
    step: usize,
    loss: f64,
    /// With [`ExecOptions::trace`]: finished spans, and per stream when the instruction at
    /// its head was posted.
    spans: Vec<Span>,
    posted_at: Vec<Option<Instant>>,
    traffic: Traffic,
}

impl<'a, T: Real> Rank<'a, T> {
    fn stage_ix(&self, s: u32) -> Result<usize, String> {
        self.stages
            .iter()
            .position(|x| x.info.stage == s)
            .ok_or_else(|| format!("stage {s} is not held by this rank"))
    }

    fn drain(&mut self) {
        while let Ok(m) = self.rx.try_recv() {
            self.deposit(m);
        }
    }

    fn deposit(&mut self, m: Msg<T>) {
        self.mailbox
            .entry((m.from, m.step, m.tag))
            .or_default()
            .push_back(m.body);
    }

    fn take(&mut self, from: u32, tag: &Tag) -> Option<Body<T>> {
        let k = (from, self.step, tag.clone());
        let q = self.mailbox.get_mut(&k)?;
        let b = q.pop_front();
        if q.is_empty() {
            self.mailbox.remove(&k);
        }
        b
    }

    fn has(&self, from: u32, tag: &Tag) -> bool {
        self.mailbox.contains_key(&(from, self.step, tag.clone()))
    }

    /// Drains the transport, then lists the members of `group` whose `tag` message has not
    /// arrived (in group order).
    fn missing_from(&mut self, group: &[u32], tag: &Tag) -> Vec<u32> {
        self.drain();
        group
            .iter()
            .copied()
            .filter(|m| !self.has(*m, tag))
            .collect()
    }

    fn send(&mut self, to: u32, tag: Tag, body: Body<T>) {
        let me = self.prog.rank;
        if to == me {
            self.deposit(Msg {
                from: me,
                step: self.step,
                tag,
                body,
            });
            return;
        }
        let n = self.sent_to.entry(to).or_default();
        let nth = *n;
        *n += 1;
        if self.sh.opts.faults.drop_message == Some((me, to, nth)) {
            return;
        }
        if let Some(s) = self.sh.senders.get(to as usize) {
            // A closed channel means the peer has stopped; its error is reported.
            let _ = s.send(Msg {
                from: me,
                step: self.step,
                tag,
                body,
            });
        }
    }

    fn tensor(&self, b: &Buf) -> Result<Vec<T>, String> {
        match self.bufs.get(b) {
            Some(Value::Tensor(t)) => Ok(t.clone()),
            Some(_) => Err(format!("{b} holds no tensor")),
            None => Err(format!("{b} is not allocated")),
        }
    }

    fn take_stash(&mut self, b: Buf) -> Result<Box<Stash<T>>, String> {
        match self.bufs.insert(b, Value::Empty) {
            Some(Value::Stash(s)) => Ok(s),
            Some(_) => Err(format!("{b} holds no stash")),
            None => {
                self.bufs.remove(&b);
                Err(format!("{b} is not allocated"))
            }
        }
    }

    fn take_grads(&mut self, stage: u32) -> Result<Box<Grads<T>>, String> {
        let b = Buf::WeightGrad { stage };
        match self.bufs.insert(b, Value::Empty) {
            Some(Value::Grads(g)) => Ok(g),
            _ => Err(format!("{b} is not allocated")),
        }
    }

    fn put(&mut self, b: Buf, v: Value<T>) -> Result<(), String> {
        match self.bufs.get_mut(&b) {
            Some(slot) => {
                *slot = v;
                Ok(())
            }
            None => Err(format!("{b} is written but not allocated")),
        }
    }

    fn new_stash(&self, si: usize, mb: u32) -> Result<Stash<T>, String> {
        let st = &self.stages[si];
        let m = self.sh.set.manifest.microbatches as usize;
        let gmb = st.info.direction as usize * m + mb as usize;
        let idx = self
            .sh
            .batching
            .index(self.step, self.prog.data_shard as usize, gmb);
        let (tokens, targets) =
            self.sh
                .data
                .micro_batch(idx, self.cfg.seq_len, self.cfg.micro_batch_size)?;
        // This rank's sequence-parallel chunk.
        let mut c = self.cfg.seq_len / self.sp;
        let mut lo = self.prog.coords.sp as usize * c;
        if self.seq_par {
            // This TP member's shard of the chunk.
            c /= self.tp;
            lo += self.prog.coords.tp as usize * c;
        }
        // Each of the micro-batch's sequences contributes its rows `lo..lo + c`.
        let t = self.cfg.seq_len;
        let rows = |v: &[u32]| -> Vec<u32> {
            v.chunks(t)
                .flat_map(|q| q[lo..lo + c].iter().copied())
                .collect()
        };
        let (tokens, targets) = (rows(&tokens), rows(&targets));
        let scale = 1.0 / self.sh.batching.tokens(self.cfg.micro_batch_tokens()) as f64;
        let k = self.kernels(si);
        Ok(k.new_stash(
            if st.info.first { tokens } else { Vec::new() },
            if st.info.last { targets } else { Vec::new() },
            scale,
        ))
    }

    fn kernels(&self, si: usize) -> StageKernels<'_, T> {
        StageKernels {
            cfg: self.cfg,
            params: &self.stages[si].params,
            ep: self.ep,
            sp: self.sp,
            pos0: self.prog.coords.sp as usize * (self.cfg.seq_len / self.sp),
            route_groups: 1,
            tp: self.tp,
            tp_rank: self.prog.coords.tp as usize,
            sequence_parallel: self.seq_par,
        }
    }

    fn kernel(&mut self, k: &schedc_program::Kernel) -> Result<(), String> {
        let si = self.stage_ix(k.stage)?;
        let sb = Buf::Stash {
            stage: k.stage,
            mb: k.mb,
        };
        let cfg = self.cfg;
        // The stash: created by the first forward kernel.
        // A recompute runs the forward's kernels with no side effect but the stash: its
        // router loads go to a scratch accumulator, its loss and output are dropped.
        let recompute = k.pass == Pass::Recompute;
        let fwd = if recompute { Pass::F } else { k.pass };
        let mut st = match (fwd, k.part) {
            (Pass::F, Part::Embed) => Box::new(self.new_stash(si, k.mb)?),
            (Pass::F, Part::Qkv { layer: 0 }) if !self.stages[si].info.first => {
                let input = k
                    .reads
                    .iter()
                    .find(|b| matches!(b, Buf::Act { .. }))
                    .ok_or("the first layer's forward reads no input")?;
                let x = self.tensor(input)?;
                let mut s = self.new_stash(si, k.mb)?;
                s.x = x;
                if !matches!(self.bufs.get(&sb), Some(Value::Empty)) {
                    return Err(format!("{sb} is not allocated"));
                }
                Box::new(s)
            }
            _ => self.take_stash(sb)?,
        };
        let (ep, sp) = (self.ep, self.sp);
        let pos0 = self.prog.coords.sp as usize * (cfg.seq_len / sp);
        let stage = &self.stages[si];
        let kern = StageKernels {
            cfg,
            params: &stage.params,
            ep,
            sp,
            pos0,
            route_groups: 1,
            tp: self.tp,
            tp_rank: self.prog.coords.tp as usize,
            sequence_parallel: self.seq_par,
        };
        let mut out: Option<(Buf, Vec<T>)> = None;
        let mut scratch = vec![T::zero(); cfg.experts];
        match (fwd, k.part) {
            (Pass::F, Part::Embed) => kern.fwd_embed(&mut st)?,
            (Pass::F, Part::Attn { layer }) => {
                let l = layer as usize;
                let loads = if recompute {
                    &mut scratch[..]
                } else {
                    match self.bufs.get_mut(&Buf::WeightGrad { stage: k.stage }) {
                        Some(Value::Grads(g)) => &mut g.loads[l][..],
                        _ => return Err(format!("weight_grad({}) is not allocated", k.stage)),
                    }
                };
                kern.fwd_attn(l, &mut st, &stage.routers[l], loads)?;
            }
            (Pass::F, Part::AttnPost { layer }) => {
                let l = layer as usize;
                let loads = if recompute {
                    &mut scratch[..]
                } else {
                    match self.bufs.get_mut(&Buf::WeightGrad { stage: k.stage }) {
                        Some(Value::Grads(g)) => &mut g.loads[l][..],
                        _ => return Err(format!("weight_grad({}) is not allocated", k.stage)),
                    }
                };
                kern.fwd_attn_post(l, &mut st, &stage.routers[l], loads)?;
            }
            (Pass::F, Part::Qkv { layer }) => kern.fwd_qkv(layer as usize, &mut st),
            (Pass::F, Part::QkvPost { layer }) => kern.fwd_qkv_post(layer as usize, &mut st)?,
            (Pass::F, Part::Shared { layer }) => kern.fwd_shared(layer as usize, &mut st)?,
            (Pass::B, Part::Shared { layer }) => kern.bwd_shared(layer as usize, &mut st)?,
            (Pass::B, Part::AttnPost { layer }) => kern.bwd_attn_post(layer as usize, &mut st)?,
            (Pass::B, Part::Attn { layer }) if self.seq_par => {
                kern.bwd_attn_gathered(layer as usize, &mut st)?
            }
            (Pass::F, Part::Experts { layer }) => kern.fwd_experts(layer as usize, &mut st)?,
            (Pass::F, Part::Combine { layer }) => {
                kern.fwd_combine(layer as usize, &mut st)?;
                if let Some(b) = k.writes.iter().find(|b| matches!(b, Buf::Act { .. })) {
                    out = Some((*b, st.x.clone()));
                }
            }
            (Pass::F, Part::Head) => {
                let loss = kern.fwd_head(&mut st)?;
                if !recompute {
                    self.loss += loss;
                }
            }
            (Pass::B, Part::Head) => kern.bwd_head(&mut st)?,
            (Pass::B, Part::Combine { layer }) => {
                if let Some(b) = k.reads.iter().find(|b| matches!(b, Buf::Grad { .. })) {
                    st.grad = self.tensor(b)?;
                }
                kern.bwd_combine(layer as usize, &mut st)?;
            }
            (Pass::B, Part::Experts { layer }) => kern.bwd_experts(layer as usize, &mut st)?,
            (Pass::B, Part::Attn { layer }) => kern.bwd_attn(layer as usize, &mut st)?,
            (Pass::B, Part::Qkv { layer } | Part::QkvPost { layer }) => {
                if matches!(k.part, Part::Qkv { .. }) {
                    kern.bwd_qkv(layer as usize, &mut st)?;
                } else {
                    kern.bwd_qkv_post(layer as usize, &mut st)?;
                }
                if let Some(b) = k.writes.iter().find(|b| matches!(b, Buf::Grad { .. })) {
                    out = Some((*b, st.grad.clone()));
                }
            }
            (Pass::W, Part::Weights | Part::WeightsMlp | Part::WeightsAttn) => {
                let set = match k.part {
                    Part::WeightsMlp => WeightSet::Mlp,
                    Part::WeightsAttn => WeightSet::Attn,
                    _ => WeightSet::All,
                };
                let mut g = self.take_grads(k.stage)?;
                let r = self.kernels(si).weights_of(&st, &mut g.params, set);
                self.put(Buf::WeightGrad { stage: k.stage }, Value::Grads(g))?;
                r?;
            }
            (p, part) => return Err(format!("no kernel {p:?} {part:?}")),
        }
        self.put(sb, Value::Stash(st))?;
        if let Some((b, t)) = out {
            self.put(b, Value::Tensor(t))?;
        }
        Ok(())
    }

    /// Runs a data instruction of stream `stream` (see [`Device::exec`]).
    fn run_op(&mut self, stream: usize, op: &Op, posted: &mut bool) -> Result<Ready, String> {
        let me = self.prog.rank;
        match op {
            Op::Alloc { .. } | Op::Free { .. } | Op::Record { .. } | Op::Wait { .. } => {
                return Err(format!("`{op}` is the interpreter's"))
            }
            Op::Overlap { .. } | Op::Collective { .. } => {
                return Err(format!(
                    "`{op}` is a stage-granularity op; the CPU backend runs schedc's model"
                ))
            }
            Op::Kernel(k) => self.kernel(k)?,
            Op::Send {
                buf: buf @ Buf::Stash { .. },
                peer,
            } => {
                // BPipe's hand-off: the stash leaves this rank whole (the `free` after the
                // send drops the emptied slot).
                let st = self.take_stash(*buf)?;
                self.send(*peer, Tag::P2p(*buf), Body::Stash(st));
            }
            Op::Offload { stage, mb } => {
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
                // The device keeps an empty slot until the release that follows.
                let st = self.take_stash(sb)?;
                self.host.insert(hb, st);
            }
            Op::Reload { stage, mb } => {
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
                let st = self
                    .host
                    .remove(&hb)
                    .ok_or_else(|| format!("{hb} holds nothing (no offload before the reload)"))?;
                self.put(sb, Value::Stash(st))?;
            }
            Op::Send { buf, peer } => {
                let t = self.tensor(buf)?;
                self.send(*peer, Tag::P2p(*buf), Body::Tensor(t));
            }
            Op::Recv { buf, peer } => {
                let tag = Tag::P2p(*buf);
                if !self.has(*peer, &tag) {
                    self.drain();
                }
                match self.take(*peer, &tag) {
                    Some(Body::Tensor(t)) => self.put(*buf, Value::Tensor(t))?,
                    Some(Body::Stash(st)) => self.put(*buf, Value::Stash(st))?,
                    Some(Body::Packet(_) | Body::Bundle(_)) => {
                        return Err(format!("{buf} arrived as a packet"))
                    }
                    None => {
                        return Ok(Ready::blocked(|| {
                            format!("{} from rank {peer}", buf.describe())
                        }))
                    }
                }
            }
            Op::AllToAll {
                stage,
                mb,
                layer,
                phase,
                group,
            } if self.hierarchical(*phase, group) => {
                return self.hierarchical_a2a(*stage, *mb, *layer, *phase, group, posted)
            }
            Op::AllToAll {
                stage,
                mb,
                layer,
                phase,
                group,
            } => {
                let tag = Tag::A2a(*stage, *mb, *layer, *phase);
                let sb = Buf::Stash {
                    stage: *stage,
                    mb: *mb,
                };
                if !*posted {
                    let mut st = self.take_stash(sb)?;
                    let out = std::mem::take(&mut st.outbox);
                    self.put(sb, Value::Stash(st))?;
                    if out.len() != group.len() {
                        return Err(format!(
                            "{} packets for an all-to-all over {} ranks",
                            out.len(),
                            group.len()
                        ));
                    }
                    let ep = !matches!(phase, A2a::GatherKv | A2a::ScatterKvGrad);
                    for (to, pk) in group.iter().zip(out) {
                        if ep {
                            self.count_packet(*to, &pk, *phase);
                        }
                        self.send(*to, tag.clone(), Body::Packet(pk));
                    }
                    *posted = true;
                    if stream != 0 {
                        // Off the compute stream (MoE parts' EP stream) an all-to-all is
                        // asynchronous: the compute stream runs on, and its completion is
                        // taken at this stream's next turn.
                        return Ok(Ready::blocked(|| {
                            format!(
                            "the {phase:?} all-to-all of stage {stage}, micro-batch {mb}, layer {layer} (posted)"
                        )
                        }));
                    }
                }
                let missing = self.missing_from(group, &tag);
                if !missing.is_empty() {
                    return Ok(Ready::blocked(|| {
                        format!(
                        "the {phase:?} all-to-all of stage {stage}, micro-batch {mb}, layer {layer} from ranks {missing:?}"
                    )
                    }));
                }
                let mut inbox = Vec::with_capacity(group.len());
                for m in group {
                    match self.take(*m, &tag) {
                        Some(Body::Packet(p)) => inbox.push(p),
                        _ => return Err("an all-to-all message is not a packet".into()),
                    }
                }
                let mut st = self.take_stash(sb)?;
                st.inbox = inbox;
                self.put(sb, Value::Stash(st))?;
            }
            Op::TpCollective {
                stage,
                mb,
                layer,
                phase,
                group,
            } => {
                let tag = Tag::Tp(*stage, *mb, *layer, *phase);
                let sb = Buf::Stash {
                    stage: *stage,
                    mb: *mb,
                };
                if !*posted {
                    let mut st = self.take_stash(sb)?;
                    let part = std::mem::take(&mut st.tp_out);
                    self.put(sb, Value::Stash(st))?;
                    // A reduce-scatter's member needs only its shard of each partial.
                    let n = match phase.kind() {
                        TpKind::ReduceScatter => part.len() / group.len().max(1),
                        _ => part.len(),
                    };
                    let bytes = (n * std::mem::size_of::<T>()) as u64;
                    let mesh = &self.sh.set.manifest.mesh;
                    for to in group.iter().filter(|m| **m != me) {
                        self.traffic.tp_bytes += bytes;
                        if mesh.node_of(*to) != mesh.node_of(me) {
                            self.traffic.tp_inter_bytes += bytes;
                        }
                    }
                    for to in group {
                        self.send(*to, tag.clone(), Body::Tensor(part.clone()));
                    }
                    *posted = true;
                    if stream != 0 {
                        return Ok(Ready::blocked(|| {
                            format!(
                            "the {phase:?} tensor-parallel all-reduce of stage {stage}, micro-batch {mb}, layer {layer} (posted)"
                        )
                        }));
                    }
                }
                let missing = self.missing_from(group, &tag);
                if !missing.is_empty() {
                    return Ok(Ready::blocked(|| {
                        format!(
                        "the {phase:?} tensor-parallel collective of stage {stage}, micro-batch {mb}, layer {layer} from ranks {missing:?}"
                    )
                    }));
                }
                let mut parts = Vec::with_capacity(group.len());
                for m in group {
                    let Some(Body::Tensor(t)) = self.take(*m, &tag) else {
                        return Err("a tensor-parallel message is not a tensor".into());
                    };
                    parts.push(t);
                }
                let mut st = self.take_stash(sb)?;
                st.tp_in = tp_combine(*phase, parts, group, me)?;
                self.put(sb, Value::Stash(st))?;
            }
            Op::TpGradAllReduce { stage, group } => {
                let tag = Tag::TpGrad(*stage);
                if !*posted {
                    let g = self.take_grads(*stage)?;
                    let v = self.replicated_grads(&g);
                    self.put(Buf::WeightGrad { stage: *stage }, Value::Grads(g))?;
                    for m in group {
                        self.send(*m, tag.clone(), Body::Tensor(v.clone()));
                    }
                    *posted = true;
                }
                let missing = self.missing_from(group, &tag);
                if !missing.is_empty() {
                    return Ok(Ready::blocked(|| {
                        format!("the shard gradients of stage {stage} from TP ranks {missing:?}")
                    }));
                }
                let mut parts = Vec::with_capacity(group.len());
                for m in group {
                    let Some(Body::Tensor(t)) = self.take(*m, &tag) else {
                        return Err("a TP gradient message is not a tensor".into());
                    };
                    parts.push(t);
                }
                let sum = tp_combine(Tp::AttnOut, parts, group, me)?;
                let mut g = self.take_grads(*stage)?;
                self.set_replicated_grads(&mut g, &sum)?;
                self.put(Buf::WeightGrad { stage: *stage }, Value::Grads(g))?;
            }
            Op::ReplicaSum {
                stage,
                model_stage,
                peer,
            } => {
                let tag = Tag::Replica(*model_stage);
                if !*posted {
                    let g = self.take_grads(*stage)?;
                    let mut v = g.flatten(Scope::Dense);
                    v.extend(g.flatten(Scope::Expert));
                    self.put(Buf::WeightGrad { stage: *stage }, Value::Grads(g))?;
                    self.send(*peer, tag.clone(), Body::Tensor(v));
                    *posted = true;
                }
                self.drain();
                let Some(body) = self.take(*peer, &tag) else {
                    return Ok(Ready::blocked(|| {
                        format!(
                        "the gradients of model stage {model_stage} from its other copy on rank {peer}"
                    )
                    }));
                };
                let Body::Tensor(theirs) = body else {
                    return Err("a replica message is not a tensor".into());
                };
                let mut g = self.take_grads(*stage)?;
                let mut mine = g.flatten(Scope::Dense);
                let nd = mine.len();
                mine.extend(g.flatten(Scope::Expert));
                if theirs.len() != mine.len() {
                    return Err(format!(
                        "the other copy sent {} values, this one has {}",
                        theirs.len(),
                        mine.len()
                    ));
                }
                for (a, b) in mine.iter_mut().zip(&theirs) {
                    *a += *b;
                }
                g.unflatten(Scope::Dense, &mine[..nd]);
                g.unflatten(Scope::Expert, &mine[nd..]);
                self.put(Buf::WeightGrad { stage: *stage }, Value::Grads(g))?;
            }
            Op::AllReduce {
                stage,
                scope,
                group,
            } => {
                let tag = Tag::AllReduce(*stage, *scope);
                if !*posted {
                    let g = self.take_grads(*stage)?;
                    let v = g.flatten(*scope);
                    self.put(Buf::WeightGrad { stage: *stage }, Value::Grads(g))?;
                    for m in group {
                        self.send(*m, tag.clone(), Body::Tensor(v.clone()));
                    }
                    *posted = true;
                }
                let missing = self.missing_from(group, &tag);
                if !missing.is_empty() {
                    return Ok(Ready::blocked(|| {
                        format!("the {scope:?} gradients of stage {stage} from ranks {missing:?}")
                    }));
                }
                // Sum in group order: every member adds the same numbers in the same order.
                let mut sum: Option<Vec<T>> = None;
                for m in group {
                    let Some(Body::Tensor(t)) = self.take(*m, &tag) else {
                        return Err("an all-reduce message is not a tensor".into());
                    };
                    match &mut sum {
                        None => sum = Some(t),
                        Some(acc) => {
                            if acc.len() != t.len() {
                                return Err(format!(
                                    "rank {m} sent {} values, expected {}",
                                    t.len(),
                                    acc.len()
                                ));
                            }
                            for (a, b) in acc.iter_mut().zip(&t) {
                                *a += *b;
                            }
                        }
                    }
                }
                let mut g = self.take_grads(*stage)?;
                g.unflatten(*scope, &sum.unwrap_or_default());
                self.put(Buf::WeightGrad { stage: *stage }, Value::Grads(g))?;
            }
            Op::OptimizerStep { stage } => {
                let g = self.take_grads(*stage)?;
                let si = self.stage_ix(*stage)?;
                if self.sh.opts.record {
                    let named = self.named(&g.params);
                    self.report(Report::Grads(self.step, me, *stage, named));
                }
                let cfg = self.cfg;
                let opt = self.sh.opts.optimizer;
                let st = &mut self.stages[si];
                optimizer_step(&opt, &mut st.opt, &mut st.params, &g.params);
                for (r, load) in st.routers.iter_mut().zip(&g.loads) {
                    r.update(cfg, load);
                }
                self.put(Buf::WeightGrad { stage: *stage }, Value::Grads(g))?;
            }
        }
        Ok(Ready::Done)
    }

    /// True if the all-to-all `phase` over `group` runs hierarchically: an expert-parallel
    /// one under [`A2aMode::Hierarchical`] whose group spans more than one node.
    fn hierarchical(&self, phase: A2a, group: &[u32]) -> bool {
        let mesh = &self.sh.set.manifest.mesh;
        self.sh.opts.a2a == A2aMode::Hierarchical
            && !matches!(phase, A2a::GatherKv | A2a::ScatterKvGrad)
            && group
                .iter()
                .any(|m| mesh.node_of(*m) != mesh.node_of(group[0]))
    }

    /// Counts a packet sent to `to` in the expert-parallel traffic.
    fn count_packet(&mut self, to: u32, pk: &Packet<T>, phase: A2a) {
        let me = self.prog.rank;
        if to == me {
            return;
        }
        let bytes = (pk.data.len() * std::mem::size_of::<T>() + pk.meta.len() * 4) as u64;
        let mesh = &self.sh.set.manifest.mesh;
        if mesh.node_of(to) == mesh.node_of(me) {
            self.traffic.a2a_intra_bytes += bytes;
            self.traffic.a2a_intra_messages += 1;
        } else {
            self.count_inter(bytes, phase);
        }
    }

    fn count_inter(&mut self, bytes: u64, phase: A2a) {
        self.traffic.a2a_inter_bytes += bytes;
        self.traffic.a2a_inter_messages += 1;
        if phase == A2a::Dispatch {
            self.traffic.dispatch_inter_bytes += bytes;
        }
    }

    /// The member of `group` in `node` that relays `src`'s rows there: the one whose index
    /// among the group's members of `node` equals `src`'s index among those of its own node
    /// (modulo their number).
    fn relay(&self, group: &[u32], src: u32, node: u32) -> u32 {
        let mesh = &self.sh.set.manifest.mesh;
        let own: Vec<u32> = group
            .iter()
            .copied()
            .filter(|m| mesh.node_of(*m) == mesh.node_of(src))
            .collect();
        let there: Vec<u32> = group
            .iter()
            .copied()
            .filter(|m| mesh.node_of(*m) == node)
            .collect();
        let i = own.iter().position(|m| *m == src).unwrap_or(0);
        there[i % there.len()]
    }

    /// The hierarchical all-to-all ([`A2aMode::Hierarchical`]): posts one packet per member
    /// of the own node and one bundle per other node (to the member relaying for this rank
    /// there); relays the bundles it receives to their destinations in its node; completes
    /// when every member's packet has arrived (directly, or relayed), with the same inbox as
    /// the flat all-to-all.
    fn hierarchical_a2a(
        &mut self,
        stage: u32,
        mb: u32,
        layer: u32,
        phase: A2a,
        group: &[u32],
        posted: &mut bool,
    ) -> Result<Ready, String> {
        let me = self.prog.rank;
        let mesh = self.sh.set.manifest.mesh.clone();
        let my_node = mesh.node_of(me);
        let direct = Tag::A2a(stage, mb, layer, phase);
        let hop = Tag::A2aHop(stage, mb, layer, phase);
        let sb = Buf::Stash { stage, mb };
        let width = self.cfg.hidden;
        if !*posted {
            let mut st = self.take_stash(sb)?;
            let out = std::mem::take(&mut st.outbox);
            self.put(sb, Value::Stash(st))?;
            if out.len() != group.len() {
                return Err(format!(
                    "{} packets for an all-to-all over {} ranks",
                    out.len(),
                    group.len()
                ));
            }
            // Per other node: its bundle, and each distinct row's index in it (by bits).
            type Rows = HashMap<Vec<u64>, u32>;
            let mut bundles: Vec<(u32, Bundle<T>, Rows)> = Vec::new();
            for (to, pk) in group.iter().zip(out) {
                let node = mesh.node_of(*to);
                if node == my_node {
                    self.count_packet(*to, &pk, phase);
                    self.send(*to, direct.clone(), Body::Packet(pk));
                    continue;
                }
                let at = match bundles.iter().position(|b| b.0 == node) {
                    Some(i) => i,
                    None => {
                        bundles.push((
                            node,
                            Bundle {
                                rows: Vec::new(),
                                width,
                                dests: Vec::new(),
                            },
                            HashMap::new(),
                        ));
                        bundles.len() - 1
                    }
                };
                let (_, b, seen) = &mut bundles[at];
                if pk.data.len() % width != 0 {
                    return Err(format!(
                        "a packet of {} values is not rows of {width}",
                        pk.data.len()
                    ));
                }
                let mut idx = Vec::with_capacity(pk.data.len() / width);
                for row in pk.data.chunks(width) {
                    let key: Vec<u64> = row.iter().map(|x| x.f64().to_bits()).collect();
                    let n = (b.rows.len() / width) as u32;
                    let i = *seen.entry(key).or_insert_with(|| {
                        b.rows.extend_from_slice(row);
                        n
                    });
                    idx.push(i);
                }
                b.dests.push((*to, idx, pk.meta));
            }
            for (node, b, _) in bundles {
                let relay = self.relay(group, me, node);
                let idx: usize = b.dests.iter().map(|d| d.1.len() + d.2.len()).sum();
                let bytes = (b.rows.len() * std::mem::size_of::<T>() + idx * 4) as u64;
                self.count_inter(bytes, phase);
                self.send(relay, hop.clone(), Body::Bundle(b));
            }
            *posted = true;
        }
        // Relay the bundles that have come for this node.
        self.drain();
        for src in group.iter().copied() {
            if mesh.node_of(src) == my_node || self.relay(group, src, my_node) != me {
                continue;
            }
            if let Some(body) = self.take(src, &hop) {
                let Body::Bundle(b) = body else {
                    return Err("a relayed all-to-all message is not a bundle".into());
                };
                for (to, idx, meta) in b.dests {
                    let mut data = Vec::with_capacity(idx.len() * b.width);
                    for i in idx {
                        let i = i as usize;
                        data.extend_from_slice(&b.rows[i * b.width..(i + 1) * b.width]);
                    }
                    let pk = Packet { data, meta };
                    self.count_packet(to, &pk, phase);
                    self.send(
                        to,
                        Tag::A2aFwd(stage, mb, layer, phase, src),
                        Body::Packet(pk),
                    );
                }
            }
        }
        self.drain();
        let from = |r: &Self, src: u32| {
            if mesh.node_of(src) == my_node {
                (src, direct.clone())
            } else {
                (
                    r.relay(group, src, my_node),
                    Tag::A2aFwd(stage, mb, layer, phase, src),
                )
            }
        };
        let missing: Vec<u32> = group
            .iter()
            .copied()
            .filter(|src| {
                let (f, t) = from(self, *src);
                !self.has(f, &t)
            })
            .collect();
        if !missing.is_empty() {
            return Ok(Ready::blocked(|| {
                format!(
                "the {phase:?} all-to-all (hierarchical) of stage {stage}, micro-batch {mb}, layer {layer} from ranks {missing:?}"
            )
            }));
        }
        let mut inbox = Vec::with_capacity(group.len());
        for src in group.iter().copied() {
            let (f, t) = from(self, src);
            match self.take(f, &t) {
                Some(Body::Packet(p)) => inbox.push(p),
                _ => return Err("an all-to-all message is not a packet".into()),
            }
        }
        let mut st = self.take_stash(sb)?;
        st.inbox = inbox;
        self.put(sb, Value::Stash(st))?;
        Ok(Ready::Done)
    }

    /// The tensors of `g` that the TP group does not split (both scopes, visit order), then
    /// the load counts: what a sequence-parallel member computed on its shard only.
    fn replicated_grads(&self, g: &Grads<T>) -> Vec<T> {
        let mut v = Vec::new();
        g.params.visit(&mut |n, _, t| {
            if tp_split(self.cfg, n).is_none() {
                v.extend_from_slice(t);
            }
        });
        for l in &g.loads {
            v.extend_from_slice(l);
        }
        v
    }

    /// Inverse of [`Self::replicated_grads`].
    fn set_replicated_grads(&self, g: &mut Grads<T>, v: &[T]) -> Result<(), String> {
        let mut at = 0;
        let cfg = self.cfg;
        let mut short = false;
        g.params.visit_mut(&mut |n, _, t| {
            if tp_split(cfg, n).is_none() {
                let k = t.len();
                match v.get(at..at + k) {
                    Some(src) => t.copy_from_slice(src),
                    None => short = true,
                }
                at += k;
            }
        });
        for l in &mut g.loads {
            let k = l.len();
            match v.get(at..at + k) {
                Some(src) => l.copy_from_slice(src),
                None => short = true,
            }
            at += k;
        }
        if short || at != v.len() {
            return Err(format!(
                "the TP gradient sum has {} values, expected {at}",
                v.len()
            ));
        }
        Ok(())
    }

    /// Every tensor of `p` by name, as f64; with TP the split tensors under their
    /// [`tp_shard_name`].
    fn named(&self, p: &StageParams<T>) -> Named {
        let mut named = Vec::new();
        let j = self.prog.coords.tp as usize;
        p.visit(&mut |n, _, t| {
            let name = match tp_split(self.cfg, n).filter(|_| self.tp > 1) {
                Some(split) => tp_shard_name(n, split, j, self.tp),
                None => n.to_string(),
            };
            named.push((name, t.iter().map(|x| x.f64()).collect()))
        });
        named
    }

    fn report(&self, r: Report) {
        let tx = self.sh.reports.lock().unwrap_or_else(|p| p.into_inner());
        let _ = tx.send(r);
    }
}

impl<T: Real> Device for Rank<'_, T> {
    fn begin_step(&mut self, step: usize) -> Result<(), String> {
        self.step = step;
        self.loss = 0.0;
        Ok(())
    }

    fn end_step(&mut self, step: usize) -> Result<(), String> {
        // Every TP member computes the same loss: the first one reports it (with sequence
        // parallelism each computes its shard's).
        let loss = if self.prog.coords.tp == 0 || self.seq_par {
            self.loss
        } else {
            0.0
        };
        self.report(Report::Loss(step, self.prog.rank, loss));
        // A streamed trace holds a step of spans per rank, not the whole run's.
        if self.sh.opts.trace && !self.spans.is_empty() {
            let spans = std::mem::take(&mut self.spans);
            self.report(Report::Trace(spans));
        }
        Ok(())
    }

    fn before(&mut self, at: Cursor) {
        if at.stream == 0
            && self.sh.opts.faults.panic_at == Some((self.prog.rank, at.step, at.index))
        {
            panic!("injected fault");
        }
    }

    fn alloc(&mut self, buf: Buf, zero: bool) -> Result<(), String> {
        if let Buf::Host { .. } = buf {
            // The host pool fills at the offload.
            return Ok(());
        }
        let v = match (buf, zero) {
            (Buf::WeightGrad { stage }, true) => {
                let si = self.stage_ix(stage)?;
                Value::Grads(Box::new(Grads::zeros(self.cfg, &self.stages[si].params)))
            }
            _ => Value::Empty,
        };
        self.bufs.insert(buf, v);
        Ok(())
    }

    fn free(&mut self, buf: Buf) -> Result<(), String> {
        if let Buf::Host { .. } = buf {
            self.host.remove(&buf);
            return Ok(());
        }
        self.bufs.remove(&buf);
        Ok(())
    }

    fn exec(&mut self, stream: usize, op: &Op, issued: &mut bool) -> Result<Ready, String> {
        if !self.sh.opts.trace {
            return self.run_op(stream, op, issued);
        }
        let t = Instant::now();
        if !*issued {
            self.posted_at[stream] = Some(t);
        }
        let r = self.run_op(stream, op, issued);
        if let Ok(Ready::Done) = r {
            let start = self.posted_at[stream].take().unwrap_or(t);
            let (cat, chunk) = span_of(op);
            let us = |i: Instant| i.saturating_duration_since(self.sh.t0).as_secs_f64() * 1e6;
            self.spans.push(Span {
                rank: self.prog.rank,
                step: self.step,
                stream,
                stream_name: self.prog.streams[stream].kind.to_string(),
                name: op.to_string(),
                cat,
                chunk,
                start_us: us(start),
                dur_us: Instant::now()
                    .saturating_duration_since(start)
                    .as_secs_f64()
                    * 1e6,
            });
        }
        r
    }

    fn wait(&mut self, at_most: Duration) {
        match self.rx.recv_timeout(at_most) {
            Ok(m) => self.deposit(m),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {}
        }
    }
}

/// Runs one rank to the end of every step.
fn run_rank<T: Real>(
    sh: &Shared<'_, T>,
    g: usize,
    rx: Receiver<Msg<T>>,
    cursor: &Mutex<Cursor>,
) -> Result<(), ExecError> {
    let prog = &sh.set.ranks[g];
    let cfg = match (&sh.set.manifest.model, sh.set.manifest.granularity) {
        (Some(cfg), schedc_program::Granularity::Model) => cfg,
        (_, gran) => {
            return Err(ExecError::Failed {
                at: interp::at_of(prog, Cursor::default()),
                message: format!(
                    "the programs are at {gran} granularity, without schedc's model; the CPU backend runs model-granularity programs (`schedc compile` without `--granularity stage`)"
                ),
            })
        }
    };
    let n_model = sh.set.manifest.model_stages as usize;
    let tp = sh.set.manifest.mesh.size(Dim::Tp) as usize;
    let stages = prog
        .stages
        .iter()
        .map(|info| StageState {
            info: info.clone(),
            params: {
                let mut p = StageParams::init(
                    cfg,
                    info.model_stage as usize,
                    n_model,
                    info.expert_lo as usize,
                    info.expert_hi as usize,
                );
                p.shard_tp(cfg, prog.coords.tp as usize, tp);
                p
            },
            routers: (0..cfg.layers_per_stage)
                .map(|_| RouterState::new(cfg))
                .collect(),
            opt: OptState::default(),
        })
        .collect();
    let mut rank = Rank {
        sh,
        prog,
        cfg,
        ep: sh.set.manifest.mesh.size(Dim::Ep) as usize,
        sp: sh.set.manifest.mesh.size(Dim::Sp) as usize,
        tp,
        seq_par: sh.set.manifest.sequence_parallel,
        stages,
        bufs: HashMap::new(),
        host: HashMap::new(),
        mailbox: HashMap::new(),
        rx,
        sent_to: HashMap::new(),
        step: 0,
        loss: 0.0,
        spans: Vec::new(),
        posted_at: vec![None; prog.streams.len()],
        traffic: Traffic::default(),
    };
    let opts = InterpOptions {
        steps: sh.opts.steps,
        timeout: sh.opts.timeout,
    };
    let ops = interp::run_rank(prog, &mut rank, opts, &sh.abort, cursor)?;
    if sh.opts.record {
        for st in &rank.stages {
            let named = rank.named(&st.params);
            rank.report(Report::Params(prog.rank, st.info.stage, named));
        }
    }
    rank.report(Report::Ops(ops));
    rank.report(Report::Traffic(rank.traffic));
    if sh.opts.trace && !rank.spans.is_empty() {
        let spans = std::mem::take(&mut rank.spans);
        rank.report(Report::Trace(spans));
    }
    Ok(())
}

/// Spans reported by a rank: to the sink, or kept.
fn take_spans(opts: &ExecOptions, kept: &mut Vec<Span>, spans: Vec<Span>) {
    match &opts.trace_sink {
        Some(sink) => (sink.lock().unwrap_or_else(|p| p.into_inner()))(&spans),
        None => kept.extend(spans),
    }
}

/// Runs `opts.steps` training steps of `set` on one thread per global rank. Errors: the
/// first rank failure, with every other rank's stop ([`RunFailure`]). `set` should have
/// passed [`schedc_program::verify`] (as [`schedc_program::lower_verified`] does): a set
/// whose streams wait for each other in a cycle runs until the receive timeout.
pub fn execute<T: Real>(
    set: &ProgramSet,
    data: &Data,
    opts: &ExecOptions,
) -> Result<ExecResult, RunFailure> {
    let world = set.ranks.len();
    let batching = Batching {
        shards: set.manifest.mesh.data_shards() as usize,
        microbatches: (set.manifest.microbatches * set.manifest.directions) as usize,
        sp: set.manifest.mesh.size(Dim::Sp) as usize,
    };
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..world).map(|_| channel::<Msg<T>>()).unzip();
    let (rep_tx, rep_rx) = channel::<Report>();
    let sh = Shared {
        set,
        data,
        batching,
        opts,
        senders: txs,
        abort: Abort::default(),
        reports: Mutex::new(rep_tx),
        t0: Instant::now(),
    };
    let start = sh.t0;
    let mut result = ExecResult {
        losses: vec![0.0; opts.steps],
        grads: vec![Vec::new(); if opts.record { opts.steps } else { 0 }],
        ..ExecResult::default()
    };
    let mut stopped: Vec<(ExecError, Instant)> = Vec::new();
    let mut per_rank: Vec<Vec<(u32, f64)>> = vec![Vec::new(); opts.steps];
    std::thread::scope(|scope| {
        let sh = &sh;
        let handles: Vec<_> = rxs
            .into_iter()
            .enumerate()
            .map(|(g, rx)| {
                scope.spawn(move || {
                    let stop = interp::guarded(&sh.set.ranks[g], &sh.abort, |cursor| {
                        run_rank(sh, g, rx, cursor)
                    });
                    let _ = sh
                        .reports
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .send(Report::Exit);
                    stop
                })
            })
            .collect();
        // Progress: a step is done when every rank reported its loss.
        let mut seen = vec![0usize; opts.steps];
        let mut next_step = 0;
        let mut done_threads = 0;
        while done_threads < world {
            match rep_rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Report::Exit) => done_threads += 1,
                Ok(Report::Loss(step, r, l)) => {
                    result.losses[step] += l;
                    per_rank[step].push((r, l));
                    seen[step] += 1;
                    while next_step < opts.steps && seen[next_step] == world {
                        if let Some(f) = &opts.on_step {
                            f(next_step, result.losses[next_step]);
                        }
                        next_step += 1;
                    }
                }
                Ok(Report::Grads(step, r, s, named)) => result.grads[step].push((r, s, named)),
                Ok(Report::Params(r, s, named)) => result.params.push((r, s, named)),
                Ok(Report::Ops(n)) => result.instructions += n,
                Ok(Report::Traffic(t)) => result.traffic.add(&t),
                Ok(Report::Trace(t)) => take_spans(opts, &mut result.trace, t),
                Err(_) => {
                    // A thread that died without reporting (it cannot: the exit report is
                    // sent after catch_unwind) would otherwise be waited for forever.
                    if handles.iter().all(|h| h.is_finished()) {
                        break;
                    }
                }
            }
        }
        while let Ok(r) = rep_rx.try_recv() {
            match r {
                Report::Loss(step, r, l) => {
                    result.losses[step] += l;
                    per_rank[step].push((r, l));
                }
                Report::Grads(step, r, s, named) => result.grads[step].push((r, s, named)),
                Report::Params(r, s, named) => result.params.push((r, s, named)),
                Report::Ops(n) => result.instructions += n,
                Report::Traffic(t) => result.traffic.add(&t),
                Report::Trace(t) => take_spans(opts, &mut result.trace, t),
                Report::Exit => {}
            }
        }
        for h in handles {
            if let Ok(Some(e)) = h.join() {
                stopped.push(e);
            }
        }
    });
    result.seconds = start.elapsed().as_secs_f64();
    sh.abort.outcome(stopped)?;
    // The step loss summed in rank order (the running sum above, in arrival order, is only
    // for the progress callback), so that equal runs report equal losses bit for bit.
    for (step, mut v) in per_rank.into_iter().enumerate() {
        v.sort_by_key(|x| x.0);
        result.losses[step] = v.iter().map(|x| x.1).sum();
    }
    for p in result.grads.iter_mut() {
        p.sort_by_key(|(r, s, _)| (*r, *s));
    }
    result.params.sort_by_key(|(r, s, _)| (*r, *s));
    Ok(result)
}

// ---------------------------------------------------------------------------------------
// The sequential reference.

/// What the reference produced.
#[derive(Clone, Debug, Default)]
pub struct Reference {
    /// Loss per step.
    pub losses: Vec<f64>,
    /// Per step, every parameter's gradient (all model stages, all experts).
    pub grads: Vec<Named>,
    /// The final parameters.
    pub params: Named,
    /// Seconds.
    pub seconds: f64,
}

/// Plain sequential training of the whole model: `model_stages` stages, every expert
/// local, whole sequences (routed in `batching.sp` groups, as the SP ranks route their
/// chunks), the batching of the executor. Errors: data too short, a bad token.
pub fn reference<T: Real>(
    cfg: &ModelConfig,
    model_stages: usize,
    batching: Batching,
    data: &Data,
    steps: usize,
    optimizer: &Optimizer,
) -> Result<Reference, String> {
    let start = Instant::now();
    let mut params: Vec<StageParams<T>> = (0..model_stages)
        .map(|k| StageParams::init(cfg, k, model_stages, 0, cfg.experts))
        .collect();
    let mut routers: Vec<Vec<RouterState<T>>> = (0..model_stages)
        .map(|_| {
            (0..cfg.layers_per_stage)
                .map(|_| RouterState::new(cfg))
                .collect()
        })
        .collect();
    let mut opts: Vec<OptState<T>> = vec![OptState::default(); model_stages];
    let scale = 1.0 / batching.tokens(cfg.micro_batch_tokens()) as f64;
    let mut out = Reference::default();
    for step in 0..steps {
        let mut grads: Vec<Grads<T>> = params.iter().map(|p| Grads::zeros(cfg, p)).collect();
        let mut loss = 0.0;
        for shard in 0..batching.shards {
            for mb in 0..batching.microbatches {
                let (tokens, targets) = data.micro_batch(
                    batching.index(step, shard, mb),
                    cfg.seq_len,
                    cfg.micro_batch_size,
                )?;
                let mut stashes = Vec::with_capacity(model_stages);
                let mut x = None;
                for k in 0..model_stages {
                    let kern = StageKernels {
                        cfg,
                        params: &params[k],
                        ep: 1,
                        sp: 1,
                        pos0: 0,
                        route_groups: batching.sp.max(1),
                        tp: 1,
                        tp_rank: 0,
                        sequence_parallel: false,
                    };
                    let mut st = kern.new_stash(
                        if k == 0 { tokens.clone() } else { Vec::new() },
                        if k + 1 == model_stages {
                            targets.clone()
                        } else {
                            Vec::new()
                        },
                        scale,
                    );
                    stage_forward_local(
                        &kern,
                        &mut st,
                        x.take(),
                        &routers[k],
                        &mut grads[k].loads,
                    )?;
                    loss += st.loss;
                    x = Some(std::mem::take(&mut st.x));
                    stashes.push(st);
                }
                let mut dy = None;
                for k in (0..model_stages).rev() {
                    let kern = StageKernels {
                        cfg,
                        params: &params[k],
                        ep: 1,
                        sp: 1,
                        pos0: 0,
                        route_groups: batching.sp.max(1),
                        tp: 1,
                        tp_rank: 0,
                        sequence_parallel: false,
                    };
                    let st = &mut stashes[k];
                    stage_backward_local(&kern, st, dy.take())?;
                    kern.weights(st, &mut grads[k].params)?;
                    dy = Some(std::mem::take(&mut st.grad));
                }
            }
        }
        out.losses.push(loss);
        let mut named = Vec::new();
        for g in &grads {
            g.params.visit(&mut |n, _, t| {
                named.push((n.to_string(), t.iter().map(|x| x.f64()).collect()))
            });
        }
        out.grads.push(named);
        for k in 0..model_stages {
            optimizer_step(optimizer, &mut opts[k], &mut params[k], &grads[k].params);
            for (r, load) in routers[k].iter_mut().zip(&grads[k].loads) {
                r.update(cfg, load);
            }
        }
    }
    for p in &params {
        p.visit(&mut |n, _, t| {
            out.params
                .push((n.to_string(), t.iter().map(|x| x.f64()).collect()))
        });
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

/// How far an executor run is from the reference. A NaN anywhere (in the run or the
/// reference) makes the figure it enters NaN, which no tolerance accepts.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Comparison {
    /// Largest relative difference (infinity norm per tensor) of any gradient of any copy
    /// on any step.
    pub max_rel_grad_err: f64,
    /// Largest absolute difference of the step loss.
    pub max_abs_loss_err: f64,
    /// Largest relative difference of any parameter of any copy after the last step.
    pub max_rel_param_err: f64,
    /// Largest relative difference of the step loss, |run - reference| / |reference|.
    pub max_rel_loss_err: f64,
    /// [`Comparison::max_rel_grad_err`] over the first step only (both runs start from the
    /// same weights: only the order of summation differs).
    pub first_step_rel_grad_err: f64,
    /// [`Comparison::max_abs_loss_err`] of the first step only.
    pub first_step_abs_loss_err: f64,
    /// Where the largest gradient error is: `TENSOR at step S on rank R`.
    pub worst_grad: String,
    /// The step of the largest loss difference.
    pub worst_loss_step: usize,
    /// Where the largest parameter error is: `TENSOR on rank R` (after the last step).
    pub worst_param: String,
    /// Gradient tensors compared (over copies and steps).
    pub tensors_compared: usize,
}

/// True if `e` is worse than `worst`: larger, or NaN (a NaN is never replaced).
fn worse(e: f64, worst: f64) -> bool {
    !worst.is_nan() && (e.is_nan() || e > worst)
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    crate::tensor::rel_err(a, b, 1e-300)
}

/// Compares an executor run (recorded) with the reference. Errors: a tensor of the run
/// that the reference lacks, or a reference tensor no copy holds.
pub fn compare(run: &ExecResult, r: &Reference) -> Result<Comparison, String> {
    let mut c = Comparison::default();
    for (step, (a, b)) in run.losses.iter().zip(&r.losses).enumerate() {
        let e = (a - b).abs();
        if worse(e, c.max_abs_loss_err) {
            c.max_abs_loss_err = e;
            c.worst_loss_step = step;
        }
        let rel = e / b.abs().max(1e-300);
        if worse(rel, c.max_rel_loss_err) {
            c.max_rel_loss_err = rel;
        }
        if step == 0 {
            c.first_step_abs_loss_err = e;
        }
    }
    for (step, copies) in run.grads.iter().enumerate() {
        let want: HashMap<&str, &Vec<f64>> =
            r.grads[step].iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut covered: HashSet<&str> = HashSet::new();
        for (rank, _, named) in copies {
            for (n, t) in named {
                let (base, w) = expected(&want, n)?;
                covered.insert(w_name(&want, base));
                let e = rel(t, &w);
                c.tensors_compared += 1;
                if step == 0 && worse(e, c.first_step_rel_grad_err) {
                    c.first_step_rel_grad_err = e;
                }
                if worse(e, c.max_rel_grad_err) || c.worst_grad.is_empty() {
                    if worse(e, c.max_rel_grad_err) {
                        c.max_rel_grad_err = e;
                    }
                    c.worst_grad = format!("{n} at step {step} on rank {rank}");
                }
            }
        }
        if let Some(n) = want.keys().find(|n| !covered.contains(*n)) {
            return Err(format!("no rank holds {n}"));
        }
    }
    let want: HashMap<&str, &Vec<f64>> = r.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for (rank, _, named) in &run.params {
        for (n, t) in named {
            let (_, w) = expected(&want, n)?;
            let e = rel(t, &w);
            if worse(e, c.max_rel_param_err) || c.worst_param.is_empty() {
                if worse(e, c.max_rel_param_err) {
                    c.max_rel_param_err = e;
                }
                c.worst_param = format!("{n} on rank {rank}");
            }
        }
    }
    Ok(c)
}

/// What a TP collective leaves on member `me` from the members' partials (group order):
/// the sum (all-reduce, added in group order), the concatenation (all-gather), or `me`'s
/// shard of the sum (reduce-scatter). Errors: partials of different sizes.
fn tp_combine<T: Real>(
    phase: Tp,
    parts: Vec<Vec<T>>,
    group: &[u32],
    me: u32,
) -> Result<Vec<T>, String> {
    let n = parts.first().map_or(0, Vec::len);
    if parts.iter().any(|p| p.len() != n) {
        return Err(format!(
            "{phase:?}: the TP members sent partials of different sizes ({:?})",
            parts.iter().map(Vec::len).collect::<Vec<_>>()
        ));
    }
    Ok(match phase.kind() {
        TpKind::AllGather => parts.concat(),
        TpKind::AllReduce | TpKind::ReduceScatter => {
            let mut it = parts.into_iter();
            let mut acc = it.next().unwrap_or_default();
            for p in it {
                add_into(&mut acc, &p);
            }
            if phase.kind() == TpKind::ReduceScatter {
                let j = group.iter().position(|m| *m == me).unwrap_or(0);
                let per = acc.len() / group.len().max(1);
                acc[j * per..(j + 1) * per].to_vec()
            } else {
                acc
            }
        }
    })
}

/// The reference's tensor for the run's tensor named `n`: the whole tensor, or for a TP
/// member's slice ([`tp_shard_name`]) the same slice of it. Returns the base name too.
fn expected<'n>(
    want: &HashMap<&str, &Vec<f64>>,
    n: &'n str,
) -> Result<(&'n str, Vec<f64>), String> {
    let (base, shard) = match crate::model::parse_tp_shard_name(n) {
        Some((base, split, j, k)) => (base, Some((split, j, k))),
        None => (n, None),
    };
    let w = want
        .get(base)
        .ok_or_else(|| format!("the reference has no {base}"))?;
    Ok((
        base,
        match shard {
            Some((split, j, k)) => crate::model::tp_slice(w, split, j, k),
            None => w.to_vec(),
        },
    ))
}

fn w_name<'a>(want: &HashMap<&'a str, &Vec<f64>>, n: &str) -> &'a str {
    want.get_key_value(n).map_or("", |(k, _)| *k)
}
