//! The device API the host driver is written against: memory, streams, events, kernel
//! launches, GEMMs ([`Gpu`]) and NCCL's point-to-point calls ([`Collectives`]).
//!
//! Three implementations:
//! * [`crate::cuda::CudaGpu`]: the GPU, through cudarc (driver API, NVRTC, cuBLAS, NCCL),
//!   loaded dynamically;
//! * [`crate::host::HostGpu`]: the host shim, where every kernel source runs as C++ on the
//!   CPU and GEMMs are a reference loop (numerics tests without a GPU);
//! * [`crate::record::Recorder`]: records every call and runs nothing (the order tests).
//!
//! Everything is asynchronous on a stream except [`Gpu::alloc`], [`Gpu::free`],
//! [`Gpu::alloc_host`], [`Gpu::free_host`], [`Gpu::dtoh`] (which waits for its stream) and
//! [`Gpu::sync`]. The driver never reads
//! device data during a step, so nothing but the end of a step synchronizes the host.

use crate::kernels::{KernelInfo, Param, KERNELS};
use std::fmt;
use std::time::Duration;

/// A device address (CUDA's `CUdeviceptr`; on the host shim, a host address).
pub type DevPtr = u64;

/// The address of a block of page-locked (pinned) host memory from [`Gpu::alloc_host`],
/// which the device copies to and from asynchronously ([`Gpu::dtoh_async`],
/// [`Gpu::htod_async`]).
pub type HostPtr = u64;

/// A stream of one [`Gpu`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u32);

/// An event of one [`Gpu`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(pub u32);

/// The storage type of activations and weights (`T` in the kernel sources). Statistics,
/// gradients, master weights and optimizer state are always `f32`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision.
    #[default]
    F32,
    /// bfloat16 (f32 accumulation in every kernel and GEMM).
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
    /// `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }
    /// The kernel sources' `T`.
    pub fn c_type(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::Bf16),
            _ => Err(format!("unknown dtype `{s}`: expected f32 or bf16")),
        }
    }
}

/// A failed device call: what was called and why it failed, in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuError(pub String);

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GpuError {}

impl From<GpuError> for String {
    fn from(e: GpuError) -> String {
        e.0
    }
}

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A device pointer (0 for a null pointer).
    Ptr(DevPtr),
    /// `int`.
    I32(i32),
    /// `unsigned`.
    U32(u32),
    /// `long`.
    I64(i64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

impl Arg {
    fn kind(&self) -> Param {
        match self {
            Arg::Ptr(_) => Param::Ptr,
            Arg::I32(_) => Param::I32,
            Arg::U32(_) => Param::U32,
            Arg::I64(_) => Param::I64,
            Arg::F32(_) => Param::F32,
            Arg::F64(_) => Param::F64,
        }
    }
    /// The argument's bytes in an 8-byte slot (little-endian, as the kernel reads them).
    pub fn slot(&self) -> u64 {
        match *self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::U32(v) => v as u64,
            Arg::I64(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
            Arg::F64(v) => v.to_bits(),
        }
    }
}

/// A kernel launch: grid and block sizes and the arguments in the kernel's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// Kernel name (a file of `kernels/`).
    pub kernel: &'static str,
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Arguments.
    pub args: Vec<Arg>,
}

impl Launch {
    /// The kernel's table entry, after checking that the arguments match its parameters in
    /// number and kind. Errors: an unknown kernel or a mismatched argument (a driver bug
    /// that would otherwise corrupt memory).
    pub fn check(&self) -> Result<&'static KernelInfo, GpuError> {
        self.resolve().map(|(_, k)| k)
    }

    /// [`Launch::check`] with the kernel's index in [`KERNELS`] (the table the CUDA device
    /// and the host shim resolve their function handles in, once, at load).
    pub fn resolve(&self) -> Result<(usize, &'static KernelInfo), GpuError> {
        let ix = crate::kernels::kernel_index(self.kernel)
            .ok_or_else(|| GpuError(format!("no kernel named `{}`", self.kernel)))?;
        let info = &KERNELS[ix];
        if info.params.len() != self.args.len() {
            return Err(GpuError(format!(
                "kernel `{}` takes {} arguments, the launch passes {}",
                self.kernel,
                info.params.len(),
                self.args.len()
            )));
        }
        for (i, (p, a)) in info.params.iter().zip(&self.args).enumerate() {
            if *p != a.kind() {
                return Err(GpuError(format!(
                    "kernel `{}` argument {i} is {p:?}, the launch passes {a:?}",
                    self.kernel
                )));
            }
        }
        if self.block.iter().product::<u32>() == 0 || self.grid.iter().product::<u32>() == 0 {
            return Err(GpuError(format!(
                "kernel `{}` launched with an empty grid or block",
                self.kernel
            )));
        }
        Ok((ix, info))
    }
}

/// A captured sequence of one stream's device work ([`Gpu::end_capture`]), replayed by
/// [`Gpu::replay`] (a CUDA graph on the GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphId(pub u32);

/// A (batched) matrix product in row-major terms:
/// `C_b = alpha op(A_b) op(B_b) + beta C_b` for `b < batch`, with `op(A)` `m x k`, `op(B)`
/// `k x n`, `C` `m x n`. `A` is stored `m x k` (row stride `lda`), or `k x m` when `ta`
/// (then `op(A) = Aᵀ`); likewise `B`. Strides between batch members are in elements.
/// `A` and `B` are of the run's [`DType`]; `C` too, or `f32` when `c_f32`. Accumulation is
/// in `f32`.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemm {
    /// Rows of `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `A`.
    pub a: DevPtr,
    /// Row stride of `A` as stored.
    pub lda: usize,
    /// Batch stride of `A`.
    pub sa: usize,
    /// `op(A) = Aᵀ`.
    pub ta: bool,
    /// `B`.
    pub b: DevPtr,
    /// Row stride of `B` as stored.
    pub ldb: usize,
    /// Batch stride of `B`.
    pub sb: usize,
    /// `op(B) = Bᵀ`.
    pub tb: bool,
    /// `C`.
    pub c: DevPtr,
    /// Row stride of `C`.
    pub ldc: usize,
    /// Batch stride of `C`.
    pub sc: usize,
    /// Batch size (1: a plain GEMM).
    pub batch: usize,
    /// `alpha`.
    pub alpha: f32,
    /// `beta` (0: `C` is not read).
    pub beta: f32,
    /// `C` is `f32` (weight gradients, logits) rather than the run's type.
    pub c_f32: bool,
}

/// What a [`Gpu`] can do: the CUDA driver API's memory, streams and events, kernel launches
/// and cuBLAS GEMMs. Errors are [`GpuError`]s naming the call and the cause.
pub trait Gpu: Send + Sync {
    /// The device, in words (name, memory, libraries).
    fn describe(&self) -> String;
    /// The storage type the kernels were compiled for.
    fn dtype(&self) -> DType;
    /// Device memory free now, bytes; `None` where the device cannot say (the memory check
    /// before a run is then skipped). Errors: the device's.
    fn memory_free(&self) -> Result<Option<usize>, GpuError> {
        Ok(None)
    }
    /// Allocates `bytes` of device memory (synchronous).
    fn alloc(&self, bytes: usize) -> Result<DevPtr, GpuError>;
    /// Releases memory from [`Gpu::alloc`] (synchronous: call it only when no stream uses
    /// it).
    fn free(&self, ptr: DevPtr) -> Result<(), GpuError>;
    /// A new stream.
    fn new_stream(&self) -> Result<StreamId, GpuError>;
    /// A new event for ordering streams (`CU_EVENT_DISABLE_TIMING`: recording and waiting
    /// on it is cheaper; [`Gpu::elapsed_ms`] refuses it).
    fn new_event(&self) -> Result<EventId, GpuError>;
    /// A new event that can also time a stretch of a stream ([`Gpu::elapsed_ms`]), for
    /// profiling and benchmarks.
    fn new_timing_event(&self) -> Result<EventId, GpuError> {
        self.new_event()
    }
    /// Zero-fills `bytes` at `ptr`, on stream `s`.
    fn memset(&self, s: StreamId, ptr: DevPtr, bytes: usize) -> Result<(), GpuError>;
    /// Copies host bytes to the device, on `s` (the host buffer may be dropped on return).
    fn htod(&self, s: StreamId, dst: DevPtr, src: &[u8]) -> Result<(), GpuError>;
    /// Copies device bytes to the host after everything issued on `s` (waits for `s`).
    fn dtoh(&self, s: StreamId, src: DevPtr, dst: &mut [u8]) -> Result<(), GpuError>;
    /// Allocates `bytes` of page-locked (pinned) host memory (`cuMemHostAlloc`,
    /// synchronous), the target of the asynchronous copies below. Errors: the device's, or
    /// no host memory.
    fn alloc_host(&self, bytes: usize) -> Result<HostPtr, GpuError>;
    /// Releases memory from [`Gpu::alloc_host`] (synchronous: call it only when no stream
    /// copies to or from it).
    fn free_host(&self, ptr: HostPtr) -> Result<(), GpuError>;
    /// Copies `bytes` of device memory at `src` into pinned host memory at `dst`, on `s`,
    /// without waiting (`cuMemcpyDtoHAsync`; the host reads `dst` only after an event or
    /// a synchronization of `s`).
    fn dtoh_async(
        &self,
        s: StreamId,
        dst: HostPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), GpuError>;
    /// Copies `bytes` of pinned host memory at `src` to the device at `dst`, on `s`, without
    /// waiting (`cuMemcpyHtoDAsync`; `src` must stay unchanged until the copy has run).
    fn htod_async(
        &self,
        s: StreamId,
        dst: DevPtr,
        src: HostPtr,
        bytes: usize,
    ) -> Result<(), GpuError>;
    /// Copies device bytes, on `s`.
    fn dtod(&self, s: StreamId, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), GpuError>;
    /// Launches a kernel on `s`.
    fn launch(&self, s: StreamId, l: &Launch) -> Result<(), GpuError>;
    /// Runs a GEMM on `s`.
    fn gemm(&self, s: StreamId, g: &Gemm) -> Result<(), GpuError>;
    /// Records `e` at this point of `s`.
    fn record(&self, s: StreamId, e: EventId) -> Result<(), GpuError>;
    /// Makes `s` wait for the last record of `e`.
    fn wait(&self, s: StreamId, e: EventId) -> Result<(), GpuError>;
    /// Blocks until everything issued on `s` has run, at most `timeout`. Errors: a failed
    /// kernel, or the timeout (a peer that never sends).
    fn sync(&self, s: StreamId, timeout: Duration) -> Result<(), GpuError>;
    /// Milliseconds between two recorded events made by [`Gpu::new_timing_event`] (after
    /// both completed).
    fn elapsed_ms(&self, start: EventId, end: EventId) -> Result<f32, GpuError>;
    /// Starts capturing stream `s` (`cuStreamBeginCapture`, thread-local mode): what is
    /// issued on `s` until [`Gpu::end_capture`] is recorded as a graph, not run. Nothing
    /// that waits for the device ([`Gpu::dtoh`], [`Gpu::sync`]) may be issued on `s` while
    /// it captures. Errors: a device without graphs, a stream already capturing.
    fn begin_capture(&self, _s: StreamId) -> Result<(), GpuError> {
        Err(GpuError(format!(
            "{} cannot capture graphs",
            self.describe()
        )))
    }
    /// Ends the capture of `s` and makes its graph ready to replay (`cuStreamEndCapture`,
    /// `cuGraphInstantiate`). Errors: `s` was not capturing, or the capture was
    /// invalidated (a call the capture does not allow).
    fn end_capture(&self, _s: StreamId) -> Result<GraphId, GpuError> {
        Err(GpuError(format!(
            "{} cannot capture graphs",
            self.describe()
        )))
    }
    /// Runs graph `g` on `s` (`cuGraphLaunch`): the captured work with the captured
    /// arguments (the same pointers, so new inputs go into the captured buffers before a
    /// replay). Errors: an unknown graph.
    fn replay(&self, _s: StreamId, _g: GraphId) -> Result<(), GpuError> {
        Err(GpuError(format!(
            "{} cannot capture graphs",
            self.describe()
        )))
    }
    /// An annotation from the driver: the program instruction whose calls follow on `s`
    /// (the recording fake formats and keeps it; the others ignore it, so that nothing is
    /// formatted per instruction on the hot path).
    fn mark(&self, _s: StreamId, _what: &dyn fmt::Display) {}
}

/// NCCL's calls as the driver uses them: point-to-point sends and receives, grouped, on
/// one of the rank's communicators (one per program stream, so that the order of calls
/// on each communicator is the order of one stream), and a sum all-reduce.
pub trait Collectives: Send + Sync {
    /// This process's rank in every communicator.
    fn rank(&self) -> u32;
    /// `ncclGroupStart`.
    fn group_start(&self) -> Result<(), GpuError>;
    /// `ncclGroupEnd`.
    fn group_end(&self) -> Result<(), GpuError>;
    /// `ncclSend` of `bytes` at `ptr` to `peer` on communicator `comm`, stream `s`.
    fn send(
        &self,
        comm: usize,
        s: StreamId,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<(), GpuError>;
    /// `ncclRecv` of `bytes` into `ptr` from `peer`.
    fn recv(
        &self,
        comm: usize,
        s: StreamId,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<(), GpuError>;
    /// `ncclAllReduce` (sum, in place) of `count` floats over every rank of `comm`.
    fn all_reduce_f32(
        &self,
        comm: usize,
        s: StreamId,
        ptr: DevPtr,
        count: usize,
    ) -> Result<(), GpuError>;
    /// `ncclCommAbort` of every communicator, on an error path: what is in flight is
    /// dropped and nothing waits for the peers (`ncclCommDestroy` could wait forever for a
    /// peer that died). The communicators are unusable afterwards.
    fn abort(&self) {}
}

/// `bf16` bits of `x`, rounded to nearest even (the kernels' `st`).
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return 0x7fc0;
    }
    let u = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    (u >> 16) as u16
}

/// The `f32` value of `bf16` bits.
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `xs` as the bytes of `dtype` elements.
pub fn encode(dtype: DType, xs: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => xs.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::Bf16 => xs
            .iter()
            .flat_map(|x| f32_to_bf16(*x).to_le_bytes())
            .collect(),
    }
}

/// The `f32` values of bytes holding `dtype` elements.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0)), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        // 1 + 3 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to even (1 + 2^-6).
        assert_eq!(
            bf16_to_f32(f32_to_bf16(1.0 + 3.0 / 256.0)),
            1.0 + 1.0 / 64.0
        );
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(
            decode(DType::Bf16, &encode(DType::Bf16, &[-2.5, 3.0])),
            vec![-2.5, 3.0]
        );
    }

    #[test]
    fn launches_are_checked_against_the_kernel_table() {
        let l = Launch {
            kernel: "add",
            grid: [1, 1, 1],
            block: [32, 1, 1],
            args: vec![Arg::Ptr(8), Arg::Ptr(16), Arg::Ptr(24), Arg::I64(4)],
        };
        assert_eq!(l.check().unwrap().name, "add");
        let bad = Launch {
            args: vec![Arg::Ptr(8), Arg::Ptr(16), Arg::Ptr(24), Arg::I32(4)],
            ..l.clone()
        };
        assert_eq!(
            bad.check().unwrap_err().0,
            "kernel `add` argument 3 is I64, the launch passes I32(4)"
        );
        let short = Launch {
            args: vec![],
            ..l.clone()
        };
        assert!(short.check().unwrap_err().0.contains("takes 4 arguments"));
        let none = Launch {
            kernel: "nope",
            ..l
        };
        assert_eq!(none.check().unwrap_err().0, "no kernel named `nope`");
    }
}
