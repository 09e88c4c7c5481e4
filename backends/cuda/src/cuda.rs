//! The GPU through cudarc 0.19 with dynamic loading: the driver API for memory, streams,
//! events and launches, NVRTC for the kernels, cuBLAS for the GEMMs, NCCL for the
//! transports. Nothing is linked at build time, so the crate builds and tests on machines
//! without CUDA; [`probe`] says why a machine cannot run it.
//!
//! cudarc panics where a library or one of its symbols is missing, and its NCCL group
//! guard unwraps on drop. Here every library is checked with `is_culib_present()` before
//! its first use, every call runs under [`guard`] (a panic becomes an error naming the
//! call), and NCCL groups use `ncclGroupStart` / `ncclGroupEnd` directly, never the guard.

use crate::api::*;
use crate::kernels::KERNELS;
use crate::nvrtc::{self, guard};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as drv, sys};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use std::cell::Cell;
use std::ffi::{c_void, CString};
use std::sync::{OnceLock, RwLock};
use std::time::{Duration, Instant};

/// The file names cudarc tries for library `lib`, without repeats.
pub fn candidates(lib: &str) -> String {
    let mut v: Vec<String> = Vec::new();
    for c in cudarc::get_lib_name_candidates(lib) {
        if !v.contains(&c) {
            v.push(c);
        }
    }
    v.join(", ")
}

fn present(lib: &str, f: unsafe fn() -> bool) -> Result<(), String> {
    // SAFETY: `is_culib_present` only tries to load the library.
    let ok = guard(&format!("loading {lib}"), || Ok(unsafe { f() }))?;
    if ok {
        Ok(())
    } else {
        Err(format!(
            "the {lib} library cannot be loaded (cudarc looks for {} on the library path)",
            crate::cuda::candidates(lib)
        ))
    }
}

/// Why this machine cannot run the CUDA backend, if it cannot: no driver (no
/// `libcuda.so.1`), no device, no NVRTC or cuBLAS; with `nccl`, no NCCL (which ships as
/// `libnccl.so.2`, a name cudarc does not try: link it as `libnccl.so` in a directory on
/// `LD_LIBRARY_PATH`).
pub fn probe(nccl: bool) -> Result<String, String> {
    present("cuda", cudarc::driver::sys::is_culib_present).map_err(|e| {
        format!("no CUDA driver: {e}; the CUDA backend needs an NVIDIA GPU and its driver")
    })?;
    let n = guard("cuInit", || {
        drv::init().map_err(|e| format!("{e:?}"))?;
        drv::device::get_count().map_err(|e| format!("{e:?}"))
    })
    .map_err(|e| format!("no CUDA device: {e}"))?;
    if n == 0 {
        return Err("no CUDA device: the driver reports none".into());
    }
    present("nvrtc", cudarc::nvrtc::sys::is_culib_present)?;
    present("cublas", cudarc::cublas::sys::is_culib_present)?;
    if nccl {
        present("nccl", cudarc::nccl::sys::is_culib_present)?;
    }
    Ok(format!("{n} CUDA device(s)"))
}

/// The number of CUDA devices. Errors: no driver ([`probe`]'s message).
pub fn device_count() -> Result<usize, String> {
    present("cuda", cudarc::driver::sys::is_culib_present)
        .map_err(|e| format!("no CUDA driver: {e}"))?;
    guard("cuDeviceGetCount", || {
        drv::init().map_err(|e| format!("{e:?}"))?;
        drv::device::get_count()
            .map(|n| n as usize)
            .map_err(|e| format!("{e:?}"))
    })
}

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// One stream and its cuBLAS handle, made at the stream's first GEMM and bound to it: a
/// stream belongs to one rank's thread, so its handle is never used by two threads at once
/// and needs no lock (issue 24, item 3: no global lock around the GEMMs).
struct StreamSlot {
    stream: sys::CUstream,
    blas: OnceLock<Result<usize, String>>,
}

/// One GPU (see the module docs).
pub struct CudaGpu {
    ctx: sys::CUcontext,
    dtype: DType,
    name: String,
    memory: usize,
    arch: String,
    /// Written only while the rank drivers set up (a new stream); read by every call.
    streams: RwLock<Vec<StreamSlot>>,
    events: RwLock<Vec<sys::CUevent>>,
    /// Instantiated graphs (`CUgraphExec`), by [`GraphId`].
    graphs: RwLock<Vec<usize>>,
    /// Function handles in the order of [`KERNELS`], resolved once at load: a launch
    /// indexes this table ([`Launch::resolve`]) rather than looking a name up.
    funcs: Vec<sys::CUfunction>,
}

// SAFETY: the raw handles are used under the context bound to each calling thread; the
// driver API and NVRTC are thread-safe as used here; a cuBLAS handle belongs to one stream
// and so to the one thread that issues on it.
unsafe impl Send for CudaGpu {}
// SAFETY: see `Send`.
unsafe impl Sync for CudaGpu {}

fn derr(call: &str) -> impl Fn(drv::DriverError) -> GpuError + '_ {
    move |e| GpuError(format!("{call}: {e:?}"))
}

impl CudaGpu {
    /// Opens device `ordinal`, compiles every kernel for `dtype` with NVRTC for `arch`
    /// (default: the device's own, `sm_XY`) and loads them. Errors: [`probe`]'s, a device
    /// that does not exist, a kernel that does not compile or load.
    pub fn new(ordinal: usize, dtype: DType, arch: Option<&str>) -> Result<CudaGpu, String> {
        probe(false)?;
        guard("opening the GPU", || {
            let dev =
                drv::device::get(ordinal as i32).map_err(|e| format!("device {ordinal}: {e:?}"))?;
            // SAFETY: a retained primary context, made current on this thread.
            let ctx = unsafe { drv::primary_ctx::retain(dev) }
                .map_err(|e| format!("primary context: {e:?}"))?;
            unsafe { drv::ctx::set_current(ctx) }.map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
            CURRENT.with(|c| c.set(ctx as usize));
            let name = drv::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
            // SAFETY: plain queries of a valid device.
            let memory = unsafe { drv::device::total_mem(dev) }.unwrap_or(0);
            let cc = |a| unsafe { drv::device::get_attribute(dev, a) }.unwrap_or(0);
            let own = format!(
                "sm_{}{}",
                cc(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                cc(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            );
            let arch = arch.map(str::to_string).unwrap_or(own);
            let ptx = nvrtc::compile(&nvrtc::source(KERNELS, dtype), "schedc-kernels", &arch)?;
            let image = CString::new(ptx).map_err(|e| e.to_string())?;
            // SAFETY: a NUL-terminated PTX image.
            let module = unsafe { drv::module::load_data(image.as_ptr() as *const c_void) }
                .map_err(|e| format!("loading the kernels' PTX for {arch}: {e:?}"))?;
            let mut funcs = Vec::with_capacity(KERNELS.len());
            for k in KERNELS {
                let cname = CString::new(k.name).map_err(|e| e.to_string())?;
                // SAFETY: a loaded module and a NUL-terminated name.
                let f = unsafe { drv::module::get_function(module, cname) }
                    .map_err(|e| format!("kernel {}: {e:?}", k.name))?;
                funcs.push(f);
            }
            Ok(CudaGpu {
                ctx,
                dtype,
                name,
                memory,
                arch,
                streams: RwLock::new(Vec::new()),
                events: RwLock::new(Vec::new()),
                graphs: RwLock::new(Vec::new()),
                funcs,
            })
        })
    }

    /// Binds the context to the calling thread (once per thread).
    fn bind(&self) -> Result<(), GpuError> {
        if CURRENT.with(|c| c.get()) != self.ctx as usize {
            // SAFETY: the retained primary context of this device.
            unsafe { drv::ctx::set_current(self.ctx) }.map_err(derr("cuCtxSetCurrent"))?;
            CURRENT.with(|c| c.set(self.ctx as usize));
        }
        Ok(())
    }

    fn stream(&self, s: StreamId) -> Result<sys::CUstream, GpuError> {
        self.streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(s.0 as usize)
            .map(|x| x.stream)
            .ok_or_else(|| GpuError(format!("no stream {}", s.0)))
    }

    /// The cuBLAS handle of stream `s`, made (and bound to `s`) at its first use.
    fn blas(&self, s: StreamId) -> Result<blas_sys::cublasHandle_t, GpuError> {
        let streams = self.streams.read().unwrap_or_else(|p| p.into_inner());
        let slot = streams
            .get(s.0 as usize)
            .ok_or_else(|| GpuError(format!("no stream {}", s.0)))?;
        let h = slot.blas.get_or_init(|| {
            let h = blas::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
            // SAFETY: a new handle and a live stream.
            unsafe { blas::set_stream(h, slot.stream as blas_sys::cudaStream_t) }
                .map_err(|e| format!("cublasSetStream: {e:?}"))?;
            Ok(h as usize)
        });
        h.clone()
            .map(|h| h as blas_sys::cublasHandle_t)
            .map_err(GpuError)
    }

    fn event(&self, e: EventId) -> Result<sys::CUevent, GpuError> {
        self.events
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(e.0 as usize)
            .copied()
            .ok_or_else(|| GpuError(format!("no event {}", e.0)))
    }

    /// Runs a call under the context and [`guard`].
    fn call<T>(&self, what: &str, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
        guard(what, || {
            self.bind().map_err(String::from)?;
            f().map_err(String::from)
        })
        .map_err(GpuError)
    }

    /// The architecture the kernels were compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn make_event(&self, flags: sys::CUevent_flags) -> Result<EventId, GpuError> {
        self.call("cuEventCreate", || {
            let e = drv::event::create(flags).map_err(derr("cuEventCreate"))?;
            let mut v = self.events.write().unwrap_or_else(|p| p.into_inner());
            v.push(e);
            Ok(EventId(v.len() as u32 - 1))
        })
    }
}

fn data_type(f32_: bool) -> blas_sys::cudaDataType {
    if f32_ {
        blas_sys::cudaDataType::CUDA_R_32F
    } else {
        blas_sys::cudaDataType::CUDA_R_16BF
    }
}

impl Gpu for CudaGpu {
    fn describe(&self) -> String {
        format!(
            "{} ({:.1} GiB, kernels for {}, {})",
            self.name,
            self.memory as f64 / (1u64 << 30) as f64,
            self.arch,
            self.dtype.name()
        )
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn memory_free(&self) -> Result<Option<usize>, GpuError> {
        self.call("cuMemGetInfo", || {
            drv::mem_get_info()
                .map(|(free, _total)| Some(free))
                .map_err(derr("cuMemGetInfo"))
        })
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr, GpuError> {
        // SAFETY: a plain allocation.
        self.call("cuMemAlloc", || {
            unsafe { drv::malloc_sync(bytes.max(1)) }.map_err(derr("cuMemAlloc"))
        })
    }
    fn free(&self, ptr: DevPtr) -> Result<(), GpuError> {
        // SAFETY: the caller frees only what `alloc` returned, once, when no stream uses it.
        self.call("cuMemFree", || {
            unsafe { drv::free_sync(ptr) }.map_err(derr("cuMemFree"))
        })
    }
    fn new_stream(&self) -> Result<StreamId, GpuError> {
        self.call("cuStreamCreate", || {
            let s = drv::stream::create(drv::stream::StreamKind::NonBlocking)
                .map_err(derr("cuStreamCreate"))?;
            let mut v = self.streams.write().unwrap_or_else(|p| p.into_inner());
            v.push(StreamSlot {
                stream: s,
                blas: OnceLock::new(),
            });
            Ok(StreamId(v.len() as u32 - 1))
        })
    }
    fn new_event(&self) -> Result<EventId, GpuError> {
        self.make_event(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }
    fn new_timing_event(&self) -> Result<EventId, GpuError> {
        self.make_event(sys::CUevent_flags::CU_EVENT_DEFAULT)
    }
    fn memset(&self, s: StreamId, ptr: DevPtr, bytes: usize) -> Result<(), GpuError> {
        self.call("cuMemsetD8Async", || {
            let st = self.stream(s)?;
            // SAFETY: device memory of at least `bytes`, by the caller's layout.
            unsafe { drv::memset_d8_async(ptr, 0, bytes, st) }.map_err(derr("cuMemsetD8Async"))
        })
    }
    fn htod(&self, s: StreamId, dst: DevPtr, src: &[u8]) -> Result<(), GpuError> {
        self.call("cuMemcpyHtoDAsync", || {
            let st = self.stream(s)?;
            // SAFETY: pageable host memory is staged before the call returns.
            unsafe { drv::memcpy_htod_async(dst, src, st) }.map_err(derr("cuMemcpyHtoDAsync"))
        })
    }
    fn dtoh(&self, s: StreamId, src: DevPtr, dst: &mut [u8]) -> Result<(), GpuError> {
        self.call("cuMemcpyDtoHAsync", || {
            let st = self.stream(s)?;
            // SAFETY: `dst` lives until the stream is synchronized below.
            unsafe { drv::memcpy_dtoh_async(dst, src, st) }.map_err(derr("cuMemcpyDtoHAsync"))?;
            unsafe { drv::stream::synchronize(st) }.map_err(derr("cuStreamSynchronize"))
        })
    }
    fn alloc_host(&self, bytes: usize) -> Result<HostPtr, GpuError> {
        // SAFETY: a plain page-locked allocation in this context (flags 0).
        self.call("cuMemHostAlloc", || {
            unsafe { drv::malloc_host(bytes.max(1), 0) }
                .map(|p| p as HostPtr)
                .map_err(derr("cuMemHostAlloc"))
        })
    }
    fn free_host(&self, ptr: HostPtr) -> Result<(), GpuError> {
        // SAFETY: the caller frees only what `alloc_host` returned, once, when no stream
        // copies to or from it.
        self.call("cuMemFreeHost", || {
            unsafe { drv::free_host(ptr as *mut c_void) }.map_err(derr("cuMemFreeHost"))
        })
    }
    fn dtoh_async(
        &self,
        s: StreamId,
        dst: HostPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), GpuError> {
        self.call("cuMemcpyDtoHAsync", || {
            let st = self.stream(s)?;
            // SAFETY: `dst` is pinned memory of at least `bytes` (the caller's block) that
            // outlives the copy; `src` device memory of at least `bytes`.
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, st) }
                .result()
                .map_err(derr("cuMemcpyDtoHAsync"))
        })
    }
    fn htod_async(
        &self,
        s: StreamId,
        dst: DevPtr,
        src: HostPtr,
        bytes: usize,
    ) -> Result<(), GpuError> {
        self.call("cuMemcpyHtoDAsync", || {
            let st = self.stream(s)?;
            // SAFETY: as in `dtoh_async`, the other way.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, st) }
                .result()
                .map_err(derr("cuMemcpyHtoDAsync"))
        })
    }
    fn dtod(&self, s: StreamId, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), GpuError> {
        self.call("cuMemcpyDtoDAsync", || {
            let st = self.stream(s)?;
            // SAFETY: both ranges are device memory of at least `bytes`.
            unsafe { drv::memcpy_dtod_async(dst, src, bytes, st) }
                .map_err(derr("cuMemcpyDtoDAsync"))
        })
    }
    fn launch(&self, s: StreamId, l: &Launch) -> Result<(), GpuError> {
        let (ix, _) = l.resolve()?;
        self.call(l.kernel, || {
            let st = self.stream(s)?;
            let f = *self
                .funcs
                .get(ix)
                .ok_or_else(|| GpuError(format!("kernel {} is not loaded", l.kernel)))?;
            let mut slots = [0u64; 48];
            let n = l.args.len();
            if n > slots.len() {
                return Err(GpuError(format!("kernel {}: {n} arguments", l.kernel)));
            }
            for (x, a) in slots.iter_mut().zip(&l.args) {
                *x = a.slot();
            }
            let mut params = [std::ptr::null_mut::<c_void>(); 48];
            for (p, x) in params.iter_mut().zip(slots.iter_mut()) {
                *p = x as *mut u64 as *mut c_void;
            }
            let params = &mut params[..n];
            // SAFETY: the arguments match the kernel's parameters (checked above); the
            // pointers are device memory laid out by the driver.
            unsafe {
                drv::launch_kernel(
                    f,
                    (l.grid[0], l.grid[1], l.grid[2]),
                    (l.block[0], l.block[1], l.block[2]),
                    0,
                    st,
                    params,
                )
            }
            .map_err(|e| GpuError(format!("launching {}: {e:?}", l.kernel)))
        })
    }
    fn gemm(&self, s: StreamId, g: &Gemm) -> Result<(), GpuError> {
        self.call("cublasGemmStridedBatchedEx", || {
            let h = self.blas(s)?;
            // Row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ.
            let op = |t: bool| {
                if t {
                    blas_sys::cublasOperation_t::CUBLAS_OP_T
                } else {
                    blas_sys::cublasOperation_t::CUBLAS_OP_N
                }
            };
            let ab = data_type(self.dtype == DType::F32);
            let (alpha, beta) = (g.alpha, g.beta);
            // SAFETY: the operands are device memory of the sizes the driver laid out;
            // alpha and beta are host f32 (compute type 32F).
            unsafe {
                blas::gemm_strided_batched_ex(
                    h,
                    op(g.tb),
                    op(g.ta),
                    g.n as i32,
                    g.m as i32,
                    g.k as i32,
                    &alpha as *const f32 as *const c_void,
                    g.b as *const c_void,
                    ab,
                    g.ldb as i32,
                    g.sb as i64,
                    g.a as *const c_void,
                    ab,
                    g.lda as i32,
                    g.sa as i64,
                    &beta as *const f32 as *const c_void,
                    g.c as *mut c_void,
                    data_type(g.c_f32 || self.dtype == DType::F32),
                    g.ldc as i32,
                    g.sc as i64,
                    g.batch as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| {
                GpuError(format!(
                    "cublasGemmStridedBatchedEx {}x{}x{} batch {}: {e:?}",
                    g.m, g.n, g.k, g.batch
                ))
            })
        })
    }
    fn record(&self, s: StreamId, e: EventId) -> Result<(), GpuError> {
        self.call("cuEventRecord", || {
            // SAFETY: live event and stream.
            unsafe { drv::event::record(self.event(e)?, self.stream(s)?) }
                .map_err(derr("cuEventRecord"))
        })
    }
    fn wait(&self, s: StreamId, e: EventId) -> Result<(), GpuError> {
        self.call("cuStreamWaitEvent", || {
            // SAFETY: live event and stream.
            unsafe {
                drv::stream::wait_event(
                    self.stream(s)?,
                    self.event(e)?,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(derr("cuStreamWaitEvent"))
        })
    }
    fn sync(&self, s: StreamId, timeout: Duration) -> Result<(), GpuError> {
        self.call("synchronizing a stream", || {
            let st = self.stream(s)?;
            let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(derr("cuEventCreate"))?;
            // SAFETY: live event and stream; the event is destroyed below.
            unsafe { drv::event::record(e, st) }.map_err(derr("cuEventRecord"))?;
            let start = Instant::now();
            let r = loop {
                // SAFETY: a live event.
                match unsafe { drv::event::query(e) } {
                    Ok(()) => break Ok(()),
                    Err(err) if err.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => {
                        if start.elapsed() >= timeout {
                            break Err(GpuError(format!(
                                "a stream did not finish within {:.0} s (a peer that never sends, or a hung kernel)",
                                timeout.as_secs_f64()
                            )));
                        }
                        std::thread::sleep(Duration::from_micros(50));
                    }
                    Err(err) => break Err(GpuError(format!("a kernel or copy failed: {err:?}"))),
                }
            };
            // SAFETY: created above.
            let _ = unsafe { drv::event::destroy(e) };
            r
        })
    }
    fn begin_capture(&self, s: StreamId) -> Result<(), GpuError> {
        self.call("cuStreamBeginCapture", || {
            let st = self.stream(s)?;
            // SAFETY: a live stream; thread-local mode lets the other rank threads make
            // their (uncaptured) calls meanwhile.
            unsafe {
                drv::stream::begin_capture(
                    st,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            }
            .map_err(derr("cuStreamBeginCapture"))
        })
    }
    fn end_capture(&self, s: StreamId) -> Result<GraphId, GpuError> {
        self.call("cuStreamEndCapture", || {
            let st = self.stream(s)?;
            // SAFETY: a stream that captures; the graph is instantiated, then destroyed
            // (the executable graph keeps what it needs).
            let graph =
                unsafe { drv::stream::end_capture(st) }.map_err(derr("cuStreamEndCapture"))?;
            let exec = unsafe { drv::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
                .map_err(derr("cuGraphInstantiate"));
            let _ = unsafe { drv::graph::destroy(graph) };
            let mut v = self.graphs.write().unwrap_or_else(|p| p.into_inner());
            v.push(exec? as usize);
            Ok(GraphId(v.len() as u32 - 1))
        })
    }
    fn replay(&self, s: StreamId, g: GraphId) -> Result<(), GpuError> {
        self.call("cuGraphLaunch", || {
            let st = self.stream(s)?;
            let exec = *self
                .graphs
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .get(g.0 as usize)
                .ok_or_else(|| GpuError(format!("no graph {}", g.0)))?;
            // SAFETY: an instantiated graph and a live stream.
            unsafe { drv::graph::launch(exec as sys::CUgraphExec, st) }
                .map_err(derr("cuGraphLaunch"))
        })
    }
    fn elapsed_ms(&self, start: EventId, end: EventId) -> Result<f32, GpuError> {
        self.call("cuEventElapsedTime", || {
            // SAFETY: live events recorded with timing.
            unsafe { drv::event::elapsed(self.event(start)?, self.event(end)?) }
                .map_err(derr("cuEventElapsedTime"))
        })
    }
}

/// NCCL communicators of one process (one per stream kind of the program set, plus one
/// for the losses), created from unique ids shared by the rendezvous.
pub struct CudaNccl<'a> {
    gpu: &'a CudaGpu,
    rank: u32,
    comms: Vec<nccl_sys::ncclComm_t>,
    aborted: std::sync::atomic::AtomicBool,
}

// SAFETY: communicators are used from the rank's one thread at a time.
unsafe impl Send for CudaNccl<'_> {}
// SAFETY: see `Send`.
unsafe impl Sync for CudaNccl<'_> {}

/// A new NCCL unique id (rank 0 makes them and the rendezvous shares them).
pub fn nccl_unique_id() -> Result<[u8; 128], String> {
    present("nccl", cudarc::nccl::sys::is_culib_present)?;
    guard("ncclGetUniqueId", || {
        let id = nccl::get_uniqueid().map_err(|e| format!("{e:?}"))?;
        let mut out = [0u8; 128];
        for (o, c) in out.iter_mut().zip(id.internal.iter()) {
            *o = *c as u8;
        }
        Ok(out)
    })
}

impl<'a> CudaNccl<'a> {
    /// Joins one communicator per id as `rank` of `world` (blocks until every rank has
    /// joined). Errors: NCCL missing, or its error.
    pub fn new(gpu: &'a CudaGpu, rank: u32, world: u32, ids: &[[u8; 128]]) -> Result<Self, String> {
        present("nccl", cudarc::nccl::sys::is_culib_present)?;
        let mut comms: Vec<nccl_sys::ncclComm_t> = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let c = guard("ncclCommInitRank", || {
                gpu.bind().map_err(String::from)?;
                let mut uid = nccl_sys::ncclUniqueId { internal: [0; 128] };
                for (u, b) in uid.internal.iter_mut().zip(id.iter()) {
                    *u = *b as _;
                }
                let mut comm = std::ptr::null_mut();
                // SAFETY: an out-pointer and a unique id shared by every rank.
                unsafe { nccl::comm_init_rank(&mut comm, world as i32, uid, rank as i32) }
                    .map_err(|e| format!("communicator {i}: {e:?}"))?;
                Ok(comm)
            });
            match c {
                Ok(c) => comms.push(c),
                Err(e) => {
                    // The ones made so far are aborted, not destroyed: a peer that did
                    // not join would make ncclCommDestroy wait.
                    abort_all(&comms);
                    return Err(e);
                }
            }
        }
        Ok(CudaNccl {
            gpu,
            rank,
            comms,
            aborted: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn comm(&self, i: usize) -> Result<nccl_sys::ncclComm_t, GpuError> {
        self.comms
            .get(i)
            .copied()
            .ok_or_else(|| GpuError(format!("no communicator {i}")))
    }

    fn run(&self, what: &str, f: impl FnOnce() -> Result<(), GpuError>) -> Result<(), GpuError> {
        self.gpu.call(what, f)
    }
}

fn abort_all(comms: &[nccl_sys::ncclComm_t]) {
    for &c in comms {
        // SAFETY: a communicator made by `ncclCommInitRank`, aborted once; errors ignored.
        let _ = guard("ncclCommAbort", || {
            Ok(unsafe { nccl::comm_abort(c) }.is_ok())
        });
    }
}

impl Drop for CudaNccl<'_> {
    fn drop(&mut self) {
        if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        for c in self.comms.drain(..) {
            // SAFETY: communicators created by `new`, destroyed once; errors ignored.
            let _ = guard("ncclCommDestroy", || {
                Ok(unsafe { nccl::comm_destroy(c) }.is_ok())
            });
        }
    }
}

fn nerr(call: &str) -> impl Fn(nccl::NcclError) -> GpuError + '_ {
    move |e| GpuError(format!("{call}: {e:?}"))
}

impl Collectives for CudaNccl<'_> {
    fn rank(&self) -> u32 {
        self.rank
    }
    fn abort(&self) {
        if !self.aborted.swap(true, std::sync::atomic::Ordering::SeqCst) {
            abort_all(&self.comms);
        }
    }
    fn group_start(&self) -> Result<(), GpuError> {
        self.run("ncclGroupStart", || {
            nccl::group_start()
                .map(|_| ())
                .map_err(nerr("ncclGroupStart"))
        })
    }
    fn group_end(&self) -> Result<(), GpuError> {
        self.run("ncclGroupEnd", || {
            nccl::group_end().map(|_| ()).map_err(nerr("ncclGroupEnd"))
        })
    }
    fn send(
        &self,
        comm: usize,
        s: StreamId,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<(), GpuError> {
        self.run("ncclSend", || {
            let (c, st) = (self.comm(comm)?, self.gpu.stream(s)?);
            // SAFETY: device memory of `bytes`; a live communicator and stream.
            unsafe {
                nccl::send(
                    ptr as *const c_void,
                    bytes,
                    nccl_sys::ncclDataType_t::ncclUint8,
                    peer as i32,
                    c,
                    st as _,
                )
            }
            .map(|_| ())
            .map_err(nerr("ncclSend"))
        })
    }
    fn recv(
        &self,
        comm: usize,
        s: StreamId,
        ptr: DevPtr,
        bytes: usize,
        peer: u32,
    ) -> Result<(), GpuError> {
        self.run("ncclRecv", || {
            let (c, st) = (self.comm(comm)?, self.gpu.stream(s)?);
            // SAFETY: as in `send`.
            unsafe {
                nccl::recv(
                    ptr as *mut c_void,
                    bytes,
                    nccl_sys::ncclDataType_t::ncclUint8,
                    peer as i32,
                    c,
                    st as _,
                )
            }
            .map(|_| ())
            .map_err(nerr("ncclRecv"))
        })
    }
    fn all_reduce_f32(
        &self,
        comm: usize,
        s: StreamId,
        ptr: DevPtr,
        count: usize,
    ) -> Result<(), GpuError> {
        self.run("ncclAllReduce", || {
            let (c, st) = (self.comm(comm)?, self.gpu.stream(s)?);
            // SAFETY: `count` floats of device memory, in place.
            unsafe {
                nccl::all_reduce(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    count,
                    nccl_sys::ncclDataType_t::ncclFloat32,
                    nccl_sys::ncclRedOp_t::ncclSum,
                    c,
                    st as _,
                )
            }
            .map(|_| ())
            .map_err(nerr("ncclAllReduce"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a GPU every entry point is an error with its cause, never a
    /// panic; with a GPU, the probe names the devices.
    #[test]
    fn without_a_driver_opening_the_gpu_is_an_error_not_a_panic() {
        match probe(false) {
            Err(e) => {
                println!("skipped: no CUDA device ({e})");
                assert!(
                    e.starts_with("no CUDA driver")
                        || e.starts_with("no CUDA device")
                        || e.contains("cannot be loaded"),
                    "{e}"
                );
                let e2 = CudaGpu::new(0, DType::F32, None)
                    .err()
                    .expect("no GPU, no device");
                assert_eq!(e2, e);
            }
            Ok(what) => println!("a GPU is present: {what}"),
        }
    }
}
