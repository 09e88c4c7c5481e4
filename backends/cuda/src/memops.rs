//! The IR's memory ops on the device (issue 27): the pinned host pool of the offloads
//! ([`HostPool`]), the copies of `OFFLOAD(s,m)` / `RELOAD(s,m)` on the rank's copy stream
//! ([`offload`], [`reload`]), and the sizes of the stashes a rank holds for another
//! (BPipe's `LEND`/`RETURN`: [`lent_stashes`]).
//!
//! The ordering is the program's (see `schedc_program::format`): the copy stream waits for
//! the event the compute stream records where the IR issues the op; an offload copies
//! `stash(s,m)` into `host(s,m)` and the `free` after it returns the device block to the
//! stream-ordered [`crate::pool::Pool`] at that point of the copy stream (the next
//! allocation of the block, on any stream, waits for it); a reload takes a block again on
//! the copy stream, copies `host(s,m)` back into it, and the compute stream waits for the
//! event recorded after it before the backward. Host blocks are taken and released only on
//! the copy stream, so that stream's order alone keeps a block from being overwritten
//! before the copy out of it has run: they need no events.
//!
//! A recompute (`Pass::Recompute`) runs the forward's kernels again with
//! [`crate::model::Io::recompute`] set: the router loads go to a scratch block and the
//! loss is not summed, so that the rebuilt stash is the only effect.

use crate::api::{DevPtr, Gpu, GpuError, HostPtr, StreamId};
use crate::layout::{Dims, StashLayout};
use schedc_program::{Buf, Op, ProgramSet, RankProgram};
use std::collections::{BTreeMap, HashMap};

/// Page-locked host blocks for offloaded stashes, by size, kept until the run ends (like
/// [`crate::pool::Pool`], but without events: see the module docs).
#[derive(Debug, Default)]
pub struct HostPool {
    free: HashMap<usize, Vec<HostPtr>>,
    blocks: Vec<HostPtr>,
    held: usize,
    in_use: usize,
    peak: usize,
}

impl HostPool {
    /// A block of `bytes` (a free one, else a new [`Gpu::alloc_host`]). Errors: the
    /// device's.
    pub fn take(&mut self, gpu: &dyn Gpu, bytes: usize) -> Result<HostPtr, GpuError> {
        let p = match self.free.get_mut(&bytes).and_then(|v| v.pop()) {
            Some(p) => p,
            None => {
                let p = gpu.alloc_host(bytes)?;
                self.blocks.push(p);
                self.held += bytes;
                p
            }
        };
        self.in_use += bytes;
        self.peak = self.peak.max(self.in_use);
        Ok(p)
    }

    /// Returns a block of `bytes` (at this point of the copy stream).
    pub fn give(&mut self, p: HostPtr, bytes: usize) {
        self.in_use = self.in_use.saturating_sub(bytes);
        self.free.entry(bytes).or_default().push(p);
    }

    /// Pinned host bytes the pool took.
    pub fn held(&self) -> usize {
        self.held
    }

    /// The most pinned bytes in use at once.
    pub fn peak(&self) -> usize {
        self.peak
    }

    /// Frees every block (after every stream is idle).
    pub fn release(&mut self, gpu: &dyn Gpu) -> Result<(), GpuError> {
        for p in self.blocks.drain(..) {
            gpu.free_host(p)?;
        }
        self.free.clear();
        self.held = 0;
        self.in_use = 0;
        Ok(())
    }
}

/// `OFFLOAD(s,m)`: the `bytes` of the stash at `stash` into the host block `host`, on the
/// copy stream `s`. Errors: the device's.
pub fn offload(
    gpu: &dyn Gpu,
    s: StreamId,
    host: HostPtr,
    stash: DevPtr,
    bytes: usize,
) -> Result<(), GpuError> {
    gpu.dtoh_async(s, host, stash, bytes)
}

/// `RELOAD(s,m)`: the host block `host` back into the stash block `stash`, on the copy
/// stream `s`. Errors: the device's.
pub fn reload(
    gpu: &dyn Gpu,
    s: StreamId,
    stash: DevPtr,
    host: HostPtr,
    bytes: usize,
) -> Result<(), GpuError> {
    gpu.htod_async(s, stash, host, bytes)
}

/// The stages whose stashes rank `prog` receives or sends without holding the stage (it
/// holds them for their owner: BPipe's `LEND`/`RETURN`), with the bytes of one stash, as
/// the owner lays it out. Errors: a peer outside the world, or a peer that does not hold
/// the stage either.
pub fn lent_stashes(
    set: &ProgramSet,
    prog: &RankProgram,
    dims: &Dims,
) -> Result<BTreeMap<u32, usize>, String> {
    let mut out = BTreeMap::new();
    for op in prog.streams.iter().flat_map(|s| &s.ops) {
        let (stage, peer) = match op {
            Op::Send {
                buf: Buf::Stash { stage, .. },
                peer,
            }
            | Op::Recv {
                buf: Buf::Stash { stage, .. },
                peer,
            } => (*stage, *peer),
            _ => continue,
        };
        if prog.stages.iter().any(|x| x.stage == stage) || out.contains_key(&stage) {
            continue;
        }
        let owner = set
            .ranks
            .get(peer as usize)
            .ok_or_else(|| format!("rank {}: `{op}`: no rank {peer}", prog.rank))?;
        let info = owner
            .stages
            .iter()
            .find(|x| x.stage == stage)
            .ok_or_else(|| {
                format!(
                    "rank {}: `{op}`: neither this rank nor rank {peer} holds stage {stage}",
                    prog.rank
                )
            })?;
        out.insert(stage, StashLayout::new(dims, info).bytes);
    }
    Ok(out)
}
