//! The recording fake of the device API: every call is logged with its stream, nothing
//! runs. It implements both [`Gpu`] and [`Collectives`], so that the host driver's order of
//! launches, copies, records, waits, sends, receives and groups can be compared with the
//! verified program, stream by stream, and NCCL groups across ranks.
//!
//! Streams and events get consecutive ids from 0 in creation order, separately, so that a
//! rank driver's program stream `s` is `StreamId(s)` and its program event `e` is
//! `EventId(e)` (the driver creates them first).

use crate::api::*;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// One logged call.
#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    /// The driver's annotation: the program instruction whose calls follow.
    Mark(String),
    /// A zero-fill of `bytes`.
    Memset(usize),
    /// A host-to-device copy of `bytes`.
    Htod(usize),
    /// A device-to-host copy of `bytes`.
    Dtoh(usize),
    /// A device-to-device copy of `bytes`.
    Dtod(usize),
    /// An asynchronous device-to-pinned-host copy of `bytes` (an offload).
    DtohAsync(usize),
    /// An asynchronous pinned-host-to-device copy of `bytes` (a reload).
    HtodAsync(usize),
    /// A kernel launch.
    Launch(&'static str),
    /// A GEMM `m x n x k`, batch.
    Gemm(usize, usize, usize, usize),
    /// `cuEventRecord`.
    Record(EventId),
    /// `cuStreamWaitEvent`.
    Wait(EventId),
    /// A stream synchronization.
    Sync,
    /// `ncclGroupStart` (no stream).
    GroupStart,
    /// `ncclGroupEnd` (no stream).
    GroupEnd,
    /// `ncclSend` on communicator `comm` of `bytes` to `peer`.
    Send {
        /// Communicator.
        comm: usize,
        /// Destination.
        peer: u32,
        /// Bytes.
        bytes: usize,
    },
    /// `ncclRecv`.
    Recv {
        /// Communicator.
        comm: usize,
        /// Source.
        peer: u32,
        /// Bytes.
        bytes: usize,
    },
    /// `ncclAllReduce` of `count` floats.
    AllReduce {
        /// Communicator.
        comm: usize,
        /// Floats.
        count: usize,
    },
    /// `ncclCommAbort` of every communicator (no stream).
    Abort,
}

/// The recording fake (module docs).
pub struct Recorder {
    rank: u32,
    dtype: DType,
    log: Mutex<Vec<(Option<StreamId>, Call)>>,
    streams: AtomicU32,
    events: AtomicU32,
    next: AtomicU64,
    fail_send: Option<usize>,
    sends: AtomicU64,
}

impl Recorder {
    /// A fake device of global rank `rank` (its NCCL rank).
    pub fn new(rank: u32, dtype: DType) -> Self {
        Recorder {
            rank,
            dtype,
            log: Mutex::new(Vec::new()),
            streams: AtomicU32::new(0),
            events: AtomicU32::new(0),
            next: AtomicU64::new(0x1000),
            fail_send: None,
            sends: AtomicU64::new(0),
        }
    }

    /// The same fake whose `n`-th `ncclSend` (from 0) fails, as a peer's death would make
    /// it: for the error paths.
    pub fn failing_send(mut self, n: usize) -> Self {
        self.fail_send = Some(n);
        self
    }

    fn push(&self, s: Option<StreamId>, c: Call) {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((s, c));
    }

    /// Every call so far, in order, with its stream (`None` for calls without one).
    pub fn log(&self) -> Vec<(Option<StreamId>, Call)> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Gpu for Recorder {
    fn describe(&self) -> String {
        "recording fake".into()
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr, GpuError> {
        Ok(self
            .next
            .fetch_add(bytes.div_ceil(256) as u64 * 256 + 256, Ordering::Relaxed))
    }
    fn free(&self, _ptr: DevPtr) -> Result<(), GpuError> {
        Ok(())
    }
    fn new_stream(&self) -> Result<StreamId, GpuError> {
        Ok(StreamId(self.streams.fetch_add(1, Ordering::Relaxed)))
    }
    fn new_event(&self) -> Result<EventId, GpuError> {
        Ok(EventId(self.events.fetch_add(1, Ordering::Relaxed)))
    }
    fn memset(&self, s: StreamId, _ptr: DevPtr, bytes: usize) -> Result<(), GpuError> {
        self.push(Some(s), Call::Memset(bytes));
        Ok(())
    }
    fn htod(&self, s: StreamId, _dst: DevPtr, src: &[u8]) -> Result<(), GpuError> {
        self.push(Some(s), Call::Htod(src.len()));
        Ok(())
    }
    fn dtoh(&self, s: StreamId, _src: DevPtr, dst: &mut [u8]) -> Result<(), GpuError> {
        dst.fill(0);
        self.push(Some(s), Call::Dtoh(dst.len()));
        Ok(())
    }
    fn alloc_host(&self, bytes: usize) -> Result<HostPtr, GpuError> {
        self.alloc(bytes)
    }
    fn free_host(&self, _ptr: HostPtr) -> Result<(), GpuError> {
        Ok(())
    }
    fn dtoh_async(
        &self,
        s: StreamId,
        _dst: HostPtr,
        _src: DevPtr,
        bytes: usize,
    ) -> Result<(), GpuError> {
        self.push(Some(s), Call::DtohAsync(bytes));
        Ok(())
    }
    fn htod_async(
        &self,
        s: StreamId,
        _dst: DevPtr,
        _src: HostPtr,
        bytes: usize,
    ) -> Result<(), GpuError> {
        self.push(Some(s), Call::HtodAsync(bytes));
        Ok(())
    }
    fn dtod(&self, s: StreamId, _dst: DevPtr, _src: DevPtr, bytes: usize) -> Result<(), GpuError> {
        self.push(Some(s), Call::Dtod(bytes));
        Ok(())
    }
    fn launch(&self, s: StreamId, l: &Launch) -> Result<(), GpuError> {
        l.check()?;
        self.push(Some(s), Call::Launch(l.kernel));
        Ok(())
    }
    fn gemm(&self, s: StreamId, g: &Gemm) -> Result<(), GpuError> {
        self.push(Some(s), Call::Gemm(g.m, g.n, g.k, g.batch));
        Ok(())
    }
    fn record(&self, s: StreamId, e: EventId) -> Result<(), GpuError> {
        self.push(Some(s), Call::Record(e));
        Ok(())
    }
    fn wait(&self, s: StreamId, e: EventId) -> Result<(), GpuError> {
        self.push(Some(s), Call::Wait(e));
        Ok(())
    }
    fn sync(&self, s: StreamId, _timeout: Duration) -> Result<(), GpuError> {
        self.push(Some(s), Call::Sync);
        Ok(())
    }
    fn elapsed_ms(&self, _a: EventId, _b: EventId) -> Result<f32, GpuError> {
        Ok(0.0)
    }
    fn mark(&self, s: StreamId, what: &dyn std::fmt::Display) {
        self.push(Some(s), Call::Mark(what.to_string()));
    }
}

impl Collectives for Recorder {
    fn rank(&self) -> u32 {
        self.rank
    }
    fn group_start(&self) -> Result<(), GpuError> {
        self.push(None, Call::GroupStart);
        Ok(())
    }
    fn group_end(&self) -> Result<(), GpuError> {
        self.push(None, Call::GroupEnd);
        Ok(())
    }
    fn send(
        &self,
        comm: usize,
        s: StreamId,
        _p: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<(), GpuError> {
        let n = self.sends.fetch_add(1, Ordering::Relaxed) as usize;
        if self.fail_send == Some(n) {
            return Err(GpuError(format!(
                "ncclSend: remote process exited or there was a network error (send {n} to rank {peer}, injected)"
            )));
        }
        self.push(Some(s), Call::Send { comm, peer, bytes });
        Ok(())
    }
    fn recv(
        &self,
        comm: usize,
        s: StreamId,
        _p: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<(), GpuError> {
        self.push(Some(s), Call::Recv { comm, peer, bytes });
        Ok(())
    }
    fn all_reduce_f32(
        &self,
        comm: usize,
        s: StreamId,
        _p: DevPtr,
        count: usize,
    ) -> Result<(), GpuError> {
        self.push(Some(s), Call::AllReduce { comm, count });
        Ok(())
    }
    fn abort(&self) {
        self.push(None, Call::Abort);
    }
}
