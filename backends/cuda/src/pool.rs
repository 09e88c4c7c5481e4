//! Device memory for a rank's buffers: a stream-ordered pool ([`Pool`]) and a shared
//! source of events ([`Events`]).
//!
//! A buffer released on stream `a` may be handed to an allocation on stream `b` only once
//! `a` has passed the release: [`Pool::give`] records an event on the releasing stream and
//! keeps it with the block; [`Pool::take`] makes the allocating stream wait for it. The
//! program verifier guarantees that every use of a buffer happens before its release and
//! after its allocation, so with this rule a block is never written while a stream may
//! still read its previous contents. Blocks are kept by size (the program has a handful of
//! sizes: activations, stashes, gradient accumulators) and never returned to the device
//! before the run ends; [`Pool::held`] is the device memory the pool took.

use crate::api::{DevPtr, EventId, Gpu, GpuError, StreamId};
use std::collections::HashMap;
use std::sync::Mutex;

/// Events handed out and recycled once every wait on them has been issued (a CUDA wait
/// captures the event's last record when it is issued, so re-recording after that is
/// safe).
#[derive(Debug, Default)]
pub struct Events {
    free: Mutex<Vec<EventId>>,
    created: Mutex<usize>,
}

impl Events {
    /// An unused event (new if none is free).
    pub fn take(&self, gpu: &dyn Gpu) -> Result<EventId, GpuError> {
        if let Some(e) = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(e);
        }
        *self.created.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        gpu.new_event()
    }
    /// Returns an event whose waits have all been issued.
    pub fn give(&self, e: EventId) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(e);
    }
    /// Events created so far.
    pub fn created(&self) -> usize {
        *self.created.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A stream-ordered pool of device blocks, by size (see the module docs).
#[derive(Debug, Default)]
pub struct Pool {
    free: HashMap<usize, Vec<(DevPtr, Option<EventId>)>>,
    blocks: Vec<DevPtr>,
    held: usize,
    in_use: usize,
    peak: usize,
}

impl Pool {
    /// Allocates `count` blocks of `bytes` ahead of use (the program's planned peak).
    pub fn reserve(&mut self, gpu: &dyn Gpu, bytes: usize, count: usize) -> Result<(), GpuError> {
        for _ in 0..count {
            let p = gpu.alloc(bytes)?;
            self.blocks.push(p);
            self.held += bytes;
            self.free.entry(bytes).or_default().push((p, None));
        }
        Ok(())
    }

    /// A block of `bytes` for use on stream `s` (which waits for the block's release).
    pub fn take(
        &mut self,
        gpu: &dyn Gpu,
        ev: &Events,
        s: StreamId,
        bytes: usize,
    ) -> Result<DevPtr, GpuError> {
        let p = match self.free.get_mut(&bytes).and_then(|v| v.pop()) {
            Some((p, e)) => {
                if let Some(e) = e {
                    gpu.wait(s, e)?;
                    ev.give(e);
                }
                p
            }
            None => {
                let p = gpu.alloc(bytes)?;
                self.blocks.push(p);
                self.held += bytes;
                p
            }
        };
        self.in_use += bytes;
        self.peak = self.peak.max(self.in_use);
        Ok(p)
    }

    /// Releases a block of `bytes` at this point of stream `s`.
    pub fn give(
        &mut self,
        gpu: &dyn Gpu,
        ev: &Events,
        s: StreamId,
        p: DevPtr,
        bytes: usize,
    ) -> Result<(), GpuError> {
        let e = ev.take(gpu)?;
        gpu.record(s, e)?;
        self.in_use = self.in_use.saturating_sub(bytes);
        self.free.entry(bytes).or_default().push((p, Some(e)));
        Ok(())
    }

    /// Device bytes the pool took.
    pub fn held(&self) -> usize {
        self.held
    }

    /// The most bytes in use at once.
    pub fn peak(&self) -> usize {
        self.peak
    }

    /// Frees every block (after every stream is idle).
    pub fn release(&mut self, gpu: &dyn Gpu) -> Result<(), GpuError> {
        for p in self.blocks.drain(..) {
            gpu.free(p)?;
        }
        self.free.clear();
        self.held = 0;
        Ok(())
    }
}
