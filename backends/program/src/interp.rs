//! The device-neutral interpretation of a [`RankProgram`]: in-order streams, events, buffer
//! lifetimes, blocking, timeouts and aborts. A backend supplies a [`Device`] that runs the
//! instructions that touch data (kernels, messages, collectives, the optimizer); everything
//! else is here, so every backend runs the same programs the same way.
//!
//! ## How a rank runs its streams ([`run_rank`])
//! The rank's thread interprets its streams cooperatively. In each round it runs, stream by
//! stream, the head instruction of every stream that is ready and moves on while the head
//! completes:
//!
//! * `record e` marks the event done; `wait e` is ready once `e` is recorded (CUDA's
//!   `cudaEventRecord` / `cudaStreamWaitEvent`). After a `record` the compute stream
//!   yields to the others for the rest of the round, so that a communication stream
//!   waiting for the event posts its work (an all-to-all) before the next kernel runs;
//! * `alloc b` / `free b` are checked here (a buffer allocated twice, freed or used while not
//!   allocated, or still allocated at the end of a step is an error naming the rank, step,
//!   stream and instruction) and then handed to [`Device::alloc`] / [`Device::free`];
//! * every other instruction goes to [`Device::exec`], which answers [`Ready::Done`] or
//!   [`Ready::Blocked`] with what it waits for. An instruction that starts asynchronous work
//!   (posts its messages) sets its `issued` flag on the first visit; the interpreter keeps
//!   the flag per stream and resets it when the instruction completes, so a collective is
//!   posted once and then polled.
//!
//! When no stream moved in a round, the rank calls [`Device::wait`] (which blocks until
//! something may have arrived, at most [`POLL`]), and fails with [`ExecError::Timeout`] after
//! `timeout` without progress, listing every blocked stream and what it waits for. Between
//! rounds it looks at the shared [`Abort`] flag and stops with [`ExecError::Aborted`] when
//! another rank has failed: a run never hangs.

use crate::format::{Buf, Op, RankProgram};
use serde::Serialize;
use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a blocked rank looks at the abort flag.
pub const POLL: Duration = Duration::from_millis(5);

/// Where a rank was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct At {
    /// Global rank.
    pub rank: u32,
    /// Step.
    pub step: usize,
    /// Stream name (`compute`, `comm`, `comm@c`).
    pub stream: String,
    /// Index in the stream.
    pub index: usize,
    /// The instruction.
    pub op: String,
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} at step {}, {} op #{} `{}`",
            self.rank, self.step, self.stream, self.index, self.op
        )
    }
}

/// Why a rank stopped.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ExecError {
    /// The rank panicked.
    Panic {
        /// Where.
        at: Box<At>,
        /// The panic message.
        message: String,
    },
    /// A kernel or message was invalid.
    Failed {
        /// Where.
        at: Box<At>,
        /// What.
        message: String,
    },
    /// The rank waited too long.
    Timeout {
        /// Where (a blocked instruction that waits for another rank, if any).
        at: Box<At>,
        /// What it waited for.
        waiting_for: String,
        /// The timeout.
        seconds: f64,
        /// Every blocked stream of the rank.
        blocked: Vec<String>,
    },
    /// The rank stopped because another failed.
    Aborted {
        /// Where it stopped.
        at: Box<At>,
        /// The failed rank.
        cause: u32,
    },
}

impl ExecError {
    /// The rank the error is about.
    pub fn rank(&self) -> u32 {
        match self {
            ExecError::Panic { at, .. }
            | ExecError::Failed { at, .. }
            | ExecError::Timeout { at, .. }
            | ExecError::Aborted { at, .. } => at.rank,
        }
    }
}

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExecError::Panic { at, message } => write!(f, "{at} panicked: {message}"),
            ExecError::Failed { at, message } => write!(f, "{at} failed: {message}"),
            ExecError::Timeout {
                at,
                waiting_for,
                seconds,
                ..
            } => write!(
                f,
                "{at} waited {seconds:.1} s for {waiting_for}, which never came"
            ),
            ExecError::Aborted { at, cause } => {
                write!(f, "{at} stopped because rank {cause} failed")
            }
        }
    }
}

/// A failed run: the first error and what every other rank did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunFailure {
    /// The root cause.
    pub cause: ExecError,
    /// The other ranks' stops.
    pub stopped: Vec<ExecError>,
    /// Seconds from the failure to the last rank's stop.
    pub stop_seconds: f64,
}

impl fmt::Display for RunFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.cause)?;
        if !self.stopped.is_empty() {
            let ranks: Vec<String> = self.stopped.iter().map(|e| e.rank().to_string()).collect();
            write!(
                f,
                "; ranks {} stopped within {:.2} s",
                ranks.join(", "),
                self.stop_seconds
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for RunFailure {}

/// The abort flag every rank of a run shares, with the first failure.
#[derive(Debug, Default)]
pub struct Abort {
    flag: AtomicBool,
    first: Mutex<Option<(ExecError, Instant)>>,
}

impl Abort {
    /// Records `e` as the run's failure (the first one wins) and raises the flag.
    pub fn fail(&self, e: ExecError) {
        let mut f = self.first.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            *f = Some((e, Instant::now()));
        }
        self.flag.store(true, Ordering::SeqCst);
    }

    /// True once a rank has failed.
    pub fn raised(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// The failed rank (`u32::MAX` if none).
    pub fn cause(&self) -> u32 {
        self.first
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(u32::MAX, |(e, _)| e.rank())
    }

    /// The first failure and when it was recorded.
    pub fn first(&self) -> Option<(ExecError, Instant)> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The run's outcome from every rank's stop (`(error, when)`, the root cause included):
    /// `Ok(())` if nothing failed, else the [`RunFailure`] with the other ranks' stops.
    pub fn outcome(&self, stopped: Vec<(ExecError, Instant)>) -> Result<(), RunFailure> {
        let Some((cause, t0)) = self.first() else {
            return Ok(());
        };
        let last = stopped.iter().map(|(_, t)| *t).max().unwrap_or(t0);
        let others = stopped
            .into_iter()
            .map(|(e, _)| e)
            .filter(|e| *e != cause)
            .collect();
        Err(RunFailure {
            cause,
            stopped: others,
            stop_seconds: last.saturating_duration_since(t0).as_secs_f64(),
        })
    }
}

/// The position a rank is at: step, stream index, instruction index. Kept outside a
/// rank's unwinding closure so that a panic can be located.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    /// Training step.
    pub step: usize,
    /// Stream index in [`RankProgram::streams`].
    pub stream: usize,
    /// Instruction index in the stream.
    pub index: usize,
}

/// The [`At`] of a cursor in `prog`.
pub fn at_of(prog: &RankProgram, c: Cursor) -> Box<At> {
    let op = prog
        .streams
        .get(c.stream)
        .and_then(|s| s.ops.get(c.index))
        .map(|o| o.to_string())
        .unwrap_or_default();
    Box::new(At {
        rank: prog.rank,
        step: c.step,
        stream: prog
            .streams
            .get(c.stream)
            .map_or("compute".into(), |s| s.kind.to_string()),
        index: c.index,
        op,
    })
}

/// The message of a caught panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// Runs one rank's `body` (typically a loop around [`run_rank`]) so that nothing escapes:
/// a panic becomes [`ExecError::Panic`] at the cursor `body` last set, and any failure but
/// [`ExecError::Aborted`] raises `abort` so that every other rank stops. Returns the rank's
/// stop (`None` if it finished) and when it happened, for [`Abort::outcome`].
pub fn guarded<F>(prog: &RankProgram, abort: &Abort, body: F) -> Option<(ExecError, Instant)>
where
    F: FnOnce(&Mutex<Cursor>) -> Result<(), ExecError>,
{
    let cursor = Mutex::new(Cursor::default());
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&cursor)));
    let err = match r {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(p) => Some(ExecError::Panic {
            at: at_of(prog, *cursor.lock().unwrap_or_else(|p| p.into_inner())),
            message: panic_message(&*p),
        }),
    };
    if let Some(e) = &err {
        if !matches!(e, ExecError::Aborted { .. }) {
            abort.fail(e.clone());
        }
    }
    err.map(|e| (e, Instant::now()))
}

/// What an instruction did when the interpreter offered it to the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ready {
    /// It ran (or its asynchronous work completed): the stream moves on.
    Done,
    /// It cannot complete yet; the text says what it waits for ("the activation of stage 1,
    /// micro-batch 3 from rank 2"). Empty while the interpreter polls (see
    /// [`Ready::blocked`]).
    Blocked(String),
}

thread_local! {
    /// Whether the interpreter on this thread wants the text of a [`Ready::Blocked`]: only
    /// when it reports a timeout.
    static DESCRIBE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Ready {
    /// [`Ready::Blocked`] with the text `what()`, formatted only when the interpreter asks
    /// for it (when it reports a timeout, it offers each blocked instruction once more to
    /// learn what it waits for at that moment); a poll of a blocked instruction otherwise
    /// formats and allocates nothing.
    pub fn blocked(what: impl FnOnce() -> String) -> Ready {
        Ready::Blocked(if DESCRIBE.with(|d| d.get()) {
            what()
        } else {
            String::new()
        })
    }
}

/// What a backend supplies to run rank programs: storage and the instructions that touch
/// data. Errors are messages; the interpreter adds where they happened.
pub trait Device {
    /// Called before the streams of `step` start.
    fn begin_step(&mut self, _step: usize) -> Result<(), String> {
        Ok(())
    }
    /// Called after every stream of `step` has run to its end (every buffer released).
    fn end_step(&mut self, _step: usize) -> Result<(), String> {
        Ok(())
    }
    /// Called before each instruction is offered (fault injection, tracing; a device with a
    /// stream-ordered allocator takes the stream of the next `alloc` / `free` from it).
    fn before(&mut self, _at: Cursor) {}
    /// Stream `stream` passed `record e`: a device with asynchronous streams records its
    /// event for `e` there (`cudaEventRecord`). Called once per record, in program order.
    fn record(&mut self, _stream: usize, _event: u32) -> Result<(), String> {
        Ok(())
    }
    /// Stream `stream` passed `wait e`, whose record has run: a device with asynchronous
    /// streams makes the stream wait for its event (`cudaStreamWaitEvent`). Called once per
    /// wait, only after the matching [`Device::record`], so the device never waits for an
    /// event that has not been recorded yet (which CUDA would treat as already complete).
    fn wait_event(&mut self, _stream: usize, _event: u32) -> Result<(), String> {
        Ok(())
    }
    /// Allocates `buf` (zero-filled if `zero`). The interpreter has checked that it is not
    /// allocated. The stream it runs on is the one of the last [`Device::before`].
    fn alloc(&mut self, buf: Buf, zero: bool) -> Result<(), String>;
    /// Releases `buf`. The interpreter has checked that it is allocated.
    fn free(&mut self, buf: Buf) -> Result<(), String>;
    /// Runs `op` of stream `stream` (never `alloc`, `free`, `record` or `wait`). `issued` is
    /// false on the first visit of this instruction; an instruction that starts asynchronous
    /// work sets it and returns [`Ready::Blocked`] until the work completes.
    fn exec(&mut self, stream: usize, op: &Op, issued: &mut bool) -> Result<Ready, String>;
    /// Called when no stream can move: block until something may have arrived, at most
    /// `at_most`.
    fn wait(&mut self, at_most: Duration);
}

/// Interpreter settings.
#[derive(Clone, Copy, Debug)]
pub struct InterpOptions {
    /// Steps to run (each runs every stream once from start to end).
    pub steps: usize,
    /// Longest a rank may go without running an instruction before it fails.
    pub timeout: Duration,
}

/// Runs `prog` for `opts.steps` steps on `dev` (see the module docs). `cursor` is updated
/// before every instruction so that a caller catching a panic can say where it happened.
/// Returns the number of instructions run over all steps. Errors: [`ExecError::Failed`]
/// for a device error or a broken buffer rule, [`ExecError::Timeout`],
/// [`ExecError::Aborted`] when `abort` is raised by another rank.
pub fn run_rank<D: Device>(
    prog: &RankProgram,
    dev: &mut D,
    opts: InterpOptions,
    abort: &Abort,
    cursor: &Mutex<Cursor>,
) -> Result<u64, ExecError> {
    let mut count = 0u64;
    let ns = prog.streams.len();
    let len = |s: usize| prog.streams[s].ops.len();
    let set_cursor = |c: Cursor| {
        *cursor.lock().unwrap_or_else(|p| p.into_inner()) = c;
    };
    let failed = |c: Cursor, message: String| ExecError::Failed {
        at: at_of(prog, c),
        message,
    };
    let mut live: HashSet<Buf> = HashSet::new();
    let mut recorded: HashSet<u32> = HashSet::new();
    for step in 0..opts.steps {
        let start = Cursor {
            step,
            stream: 0,
            index: 0,
        };
        dev.begin_step(step).map_err(|m| failed(start, m))?;
        recorded.clear();
        let mut ptr = vec![0usize; ns];
        let mut issued = vec![false; ns];
        let mut blocked: Vec<Option<String>> = vec![None; ns];
        let mut last_progress = Instant::now();
        loop {
            if abort.raised() {
                let s = (0..ns).find(|&s| ptr[s] < len(s)).unwrap_or(0);
                return Err(ExecError::Aborted {
                    at: at_of(
                        prog,
                        Cursor {
                            step,
                            stream: s,
                            index: ptr[s],
                        },
                    ),
                    cause: abort.cause(),
                });
            }
            let mut moved = false;
            for s in 0..ns {
                while ptr[s] < len(s) {
                    let c = Cursor {
                        step,
                        stream: s,
                        index: ptr[s],
                    };
                    set_cursor(c);
                    dev.before(c);
                    let op = &prog.streams[s].ops[ptr[s]];
                    let r = match op {
                        Op::Record { event } => {
                            recorded.insert(*event);
                            dev.record(s, *event).map(|_| Ready::Done)
                        }
                        Op::Wait { event } if !recorded.contains(event) => {
                            Ok(Ready::blocked(|| format!("event e{event}")))
                        }
                        Op::Wait { event } => dev.wait_event(s, *event).map(|_| Ready::Done),
                        Op::Alloc { buf, zero } => {
                            if live.insert(*buf) {
                                dev.alloc(*buf, *zero).map(|_| Ready::Done)
                            } else {
                                Err(format!("{buf} is allocated twice"))
                            }
                        }
                        Op::Free { buf } => {
                            if live.remove(buf) {
                                dev.free(*buf).map(|_| Ready::Done)
                            } else {
                                Err(format!("{buf} is freed but not allocated"))
                            }
                        }
                        _ => dev.exec(s, op, &mut issued[s]),
                    };
                    match r {
                        Ok(Ready::Done) => {
                            ptr[s] += 1;
                            count += 1;
                            issued[s] = false;
                            blocked[s] = None;
                            moved = true;
                            if s == 0 && matches!(op, Op::Record { .. }) {
                                // Let the streams that wait for it post their work (an
                                // all-to-all) before the next kernel runs.
                                break;
                            }
                        }
                        Ok(Ready::Blocked(what)) => {
                            blocked[s] = Some(what);
                            break;
                        }
                        Err(message) => return Err(failed(c, message)),
                    }
                }
            }
            if (0..ns).all(|s| ptr[s] == len(s)) {
                break;
            }
            if moved {
                last_progress = Instant::now();
                continue;
            }
            let waited = last_progress.elapsed();
            if waited >= opts.timeout {
                // What each blocked stream waits for now: its instruction offered once more,
                // with the text asked for (a poll that completes it changes nothing here: the
                // rank fails anyway).
                DESCRIBE.with(|d| d.set(true));
                for s in 0..ns {
                    if blocked[s].is_none() || ptr[s] >= len(s) {
                        continue;
                    }
                    let c = Cursor {
                        step,
                        stream: s,
                        index: ptr[s],
                    };
                    dev.before(c);
                    let what = match &prog.streams[s].ops[ptr[s]] {
                        Op::Wait { event } if !recorded.contains(event) => {
                            format!("event e{event}")
                        }
                        op @ (Op::Record { .. }
                        | Op::Wait { .. }
                        | Op::Alloc { .. }
                        | Op::Free { .. }) => {
                            format!("`{op}`")
                        }
                        op => match dev.exec(s, op, &mut issued[s]) {
                            Ok(Ready::Blocked(w)) => w,
                            Ok(Ready::Done) => "(it completed as the timeout was reported)".into(),
                            Err(m) => m,
                        },
                    };
                    blocked[s] = Some(what);
                }
                DESCRIBE.with(|d| d.set(false));
                // Report the stream that waits on another rank (not on an event).
                let s = (0..ns)
                    .find(|&s| {
                        blocked[s]
                            .as_ref()
                            .is_some_and(|w| !w.starts_with("event "))
                    })
                    .or_else(|| (0..ns).find(|&s| blocked[s].is_some()))
                    .unwrap_or(0);
                let here = |t: usize| Cursor {
                    step,
                    stream: t,
                    index: ptr[t],
                };
                let all = (0..ns)
                    .filter_map(|t| {
                        blocked[t].as_ref().map(|w| {
                            let a = at_of(prog, here(t));
                            format!("{} op #{} `{}` waits for {w}", a.stream, a.index, a.op)
                        })
                    })
                    .collect();
                return Err(ExecError::Timeout {
                    at: at_of(prog, here(s)),
                    waiting_for: blocked[s].clone().unwrap_or_default(),
                    seconds: opts.timeout.as_secs_f64(),
                    blocked: all,
                });
            }
            dev.wait(POLL.min(opts.timeout - waited));
        }
        let end = Cursor {
            step,
            stream: 0,
            index: len(0).saturating_sub(1),
        };
        if !live.is_empty() {
            let mut left: Vec<String> = live.iter().map(|b| b.to_string()).collect();
            left.sort();
            return Err(failed(
                end,
                format!(
                    "buffers still allocated at the end of the step: {}",
                    left.join(", ")
                ),
            ));
        }
        dev.end_step(step).map_err(|m| failed(end, m))?;
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Stream, StreamKind};
    use crate::mesh::Coords;

    /// A device that only counts what it is given, and blocks one instruction until its
    /// `ready` flag is set (a message that has not arrived).
    #[derive(Default)]
    struct Counter {
        allocs: Vec<Buf>,
        frees: Vec<Buf>,
        ops: Vec<String>,
        ready: bool,
        waits: u32,
    }

    impl Device for Counter {
        fn alloc(&mut self, buf: Buf, _zero: bool) -> Result<(), String> {
            self.allocs.push(buf);
            Ok(())
        }
        fn free(&mut self, buf: Buf) -> Result<(), String> {
            self.frees.push(buf);
            Ok(())
        }
        fn exec(&mut self, _s: usize, op: &Op, issued: &mut bool) -> Result<Ready, String> {
            if let Op::Recv { .. } = op {
                *issued = true;
                if !self.ready {
                    return Ok(Ready::blocked(|| "a message".into()));
                }
            }
            self.ops.push(op.to_string());
            Ok(Ready::Done)
        }
        fn wait(&mut self, _at_most: Duration) {
            self.waits += 1;
            self.ready = true;
        }
    }

    fn program(compute: Vec<Op>, comm: Vec<Op>, events: u32) -> RankProgram {
        RankProgram {
            rank: 0,
            coords: Coords::default(),
            data_shard: 0,
            stages: vec![],
            streams: vec![
                Stream {
                    kind: StreamKind::Compute,
                    ops: compute,
                },
                Stream {
                    kind: StreamKind::Comm { channel: 0 },
                    ops: comm,
                },
            ],
            events,
        }
    }

    fn opts() -> InterpOptions {
        InterpOptions {
            steps: 2,
            timeout: Duration::from_millis(200),
        }
    }

    const A: Buf = Buf::Act { stage: 0, mb: 0 };

    #[test]
    fn events_order_streams_and_buffers_are_checked() {
        // The comm stream receives into `A` and records e0; compute waits for e0, then
        // sends it on and frees it. The wait makes compute block until the comm stream ran.
        let prog = program(
            vec![
                Op::Alloc {
                    buf: A,
                    zero: false,
                },
                Op::Record { event: 1 },
                Op::Wait { event: 0 },
                Op::Send { buf: A, peer: 1 },
                Op::Free { buf: A },
            ],
            vec![
                Op::Wait { event: 1 },
                Op::Recv { buf: A, peer: 1 },
                Op::Record { event: 0 },
            ],
            2,
        );
        let mut dev = Counter::default();
        run_rank(
            &prog,
            &mut dev,
            opts(),
            &Abort::default(),
            &Mutex::default(),
        )
        .unwrap();
        assert_eq!(dev.allocs, vec![A, A]);
        assert_eq!(dev.frees, vec![A, A]);
        // Per step: the receive (after one wait for it to arrive), then the send.
        assert_eq!(
            dev.ops,
            vec![
                "recv act(0,0) from rank 1",
                "send act(0,0) to rank 1",
                "recv act(0,0) from rank 1",
                "send act(0,0) to rank 1"
            ]
        );
        assert_eq!(dev.waits, 1);
    }

    #[test]
    fn buffer_rules_are_errors_with_their_place() {
        let twice = program(
            vec![
                Op::Alloc {
                    buf: A,
                    zero: false,
                },
                Op::Alloc {
                    buf: A,
                    zero: false,
                },
            ],
            vec![],
            0,
        );
        let e = run_rank(
            &twice,
            &mut Counter::default(),
            opts(),
            &Abort::default(),
            &Mutex::default(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 0 at step 0, compute op #1 `alloc act(0,0)` failed: act(0,0) is allocated twice"
        );
        let leak = program(
            vec![Op::Alloc {
                buf: A,
                zero: false,
            }],
            vec![],
            0,
        );
        let e = run_rank(
            &leak,
            &mut Counter::default(),
            opts(),
            &Abort::default(),
            &Mutex::default(),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .ends_with("buffers still allocated at the end of the step: act(0,0)"),
            "{e}"
        );
        let free = program(vec![Op::Free { buf: A }], vec![], 0);
        let e = run_rank(
            &free,
            &mut Counter::default(),
            opts(),
            &Abort::default(),
            &Mutex::default(),
        )
        .unwrap_err();
        assert!(e
            .to_string()
            .ends_with("act(0,0) is freed but not allocated"));
    }

    #[test]
    fn a_wait_that_is_never_recorded_times_out_naming_every_blocked_stream() {
        let prog = program(vec![Op::Wait { event: 0 }], vec![Op::Wait { event: 1 }], 2);
        let e = run_rank(
            &prog,
            &mut Counter::default(),
            opts(),
            &Abort::default(),
            &Mutex::default(),
        )
        .unwrap_err();
        match e {
            ExecError::Timeout {
                waiting_for,
                blocked,
                ..
            } => {
                assert_eq!(waiting_for, "event e0");
                assert_eq!(
                    blocked,
                    vec![
                        "compute op #0 `wait e0` waits for event e0",
                        "comm op #0 `wait e1` waits for event e1"
                    ]
                );
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_raised_abort_stops_the_rank_with_the_cause() {
        let abort = Abort::default();
        abort.fail(ExecError::Failed {
            at: Box::new(At {
                rank: 7,
                step: 0,
                stream: "compute".into(),
                index: 0,
                op: String::new(),
            }),
            message: "boom".into(),
        });
        let prog = program(vec![Op::Wait { event: 0 }], vec![], 1);
        let e = run_rank(
            &prog,
            &mut Counter::default(),
            opts(),
            &abort,
            &Mutex::default(),
        )
        .unwrap_err();
        assert!(matches!(e, ExecError::Aborted { cause: 7, .. }), "{e}");
    }

    /// A device whose receive never completes and counts how often its waiting text is
    /// formatted.
    #[derive(Default)]
    struct Never {
        polls: u32,
        described: u32,
    }

    impl Device for Never {
        fn alloc(&mut self, _buf: Buf, _zero: bool) -> Result<(), String> {
            Ok(())
        }
        fn free(&mut self, _buf: Buf) -> Result<(), String> {
            Ok(())
        }
        fn exec(&mut self, _s: usize, _op: &Op, issued: &mut bool) -> Result<Ready, String> {
            *issued = true;
            self.polls += 1;
            let n = self.polls;
            let described = &mut self.described;
            Ok(Ready::blocked(|| {
                *described += 1;
                format!("the message of poll {n}")
            }))
        }
        fn wait(&mut self, _at_most: Duration) {}
    }

    /// Polling a blocked instruction formats nothing: its text is made once, when the
    /// timeout is reported, by offering the instruction once more (so it says what the
    /// instruction waits for at that moment); the other stream's wait for an event that
    /// is never recorded is described by the interpreter.
    #[test]
    fn blocked_texts_are_made_only_for_the_timeout() {
        let prog = program(
            vec![Op::Wait { event: 0 }],
            vec![Op::Recv { buf: A, peer: 1 }, Op::Record { event: 0 }],
            1,
        );
        let mut dev = Never::default();
        let opts = InterpOptions {
            steps: 1,
            timeout: Duration::from_millis(50),
        };
        let e = run_rank(&prog, &mut dev, opts, &Abort::default(), &Mutex::default()).unwrap_err();
        assert!(dev.polls > 2, "polled {} times", dev.polls);
        assert_eq!(dev.described, 1);
        let last = format!("the message of poll {}", dev.polls);
        assert!(
            e.to_string()
                .contains(&format!("for {last}, which never came")),
            "{e}"
        );
        let ExecError::Timeout { blocked, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(
            blocked,
            &vec![
                "compute op #0 `wait e0` waits for event e0".to_string(),
                format!("comm op #0 `recv act(0,0) from rank 1` waits for {last}"),
            ]
        );
    }
}
