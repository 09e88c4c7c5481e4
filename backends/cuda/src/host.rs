//! The host shim device: every kernel source compiled as C++ (`shim/`, built by `build.rs`
//! with the system C++ compiler) and run on the CPU, GEMMs as a reference loop, memory on
//! the heap. Launches execute when issued, so streams and events need no work: the driver
//! issues in an order that respects every event, and on this device issuing is running.
//!
//! Pinned host memory ([`Gpu::alloc_host`]) is heap memory too, kept apart from the
//! device's and filled with `0xff` bytes (NaN) when allocated; the asynchronous copies run
//! when issued, like everything else.
//!
//! It exists so that the kernels, and the whole host driver with them, are checked against
//! the CPU backend on machines without a GPU (CI). It is slow (one kernel at a time, one
//! thread at a time) and meant for the tiny test models.

use crate::api::*;
use std::alloc::{alloc, alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

extern "C" {
    fn schedc_shim_launch_index(
        dtype: c_int,
        index: c_int,
        grid: *const c_uint,
        block: *const c_uint,
        args: *mut *mut c_void,
        err: *mut c_char,
        err_len: c_ulong,
    ) -> c_int;
    fn schedc_shim_kernels() -> c_int;
    fn schedc_shim_kernel_name(i: c_int) -> *const c_char;
}

/// The names of the kernels compiled into the shim (the build's table).
pub fn shim_kernel_names() -> Vec<String> {
    // SAFETY: the table is static and its names are NUL-terminated literals.
    unsafe {
        (0..schedc_shim_kernels())
            .map(|i| {
                std::ffi::CStr::from_ptr(schedc_shim_kernel_name(i))
                    .to_string_lossy()
                    .to_string()
            })
            .collect()
    }
}

const ALIGN: usize = 256;

/// The most arguments a kernel takes (the attention kernels take 29).
const MAX_ARGS: usize = 48;

/// One call captured on the shim ([`Gpu::begin_capture`]).
#[derive(Clone, Debug)]
enum Captured {
    Launch(Launch),
    Gemm(Gemm),
    Memset(DevPtr, usize),
    Htod(DevPtr, Vec<u8>),
    Dtod(DevPtr, DevPtr, usize),
    DtohAsync(HostPtr, DevPtr, usize),
    HtodAsync(DevPtr, HostPtr, usize),
}

/// The host shim device (see the module docs).
///
/// Graphs: a capture records the calls issued on the capturing stream instead of running
/// them, and a replay runs the recording in order with the recorded arguments, as a CUDA
/// graph does (host bytes of an `htod` are copied at capture, as a graph's memcpy node
/// from pageable memory would not be: the driver never captures one).
pub struct HostGpu {
    capture: Mutex<Option<(StreamId, Vec<Captured>)>>,
    graphs: Mutex<Vec<Vec<Captured>>>,
    dtype: DType,
    allocs: Mutex<HashMap<DevPtr, Layout>>,
    /// The emulated pinned host pool ([`Gpu::alloc_host`]), apart from device memory so
    /// that a copy checks each side against its own kind.
    host_allocs: Mutex<HashMap<HostPtr, Layout>>,
    next: AtomicU32,
    memory: Option<usize>,
    allocations: std::sync::atomic::AtomicUsize,
}

impl HostGpu {
    /// A device whose kernels run for `dtype`.
    pub fn new(dtype: DType) -> Self {
        HostGpu {
            capture: Mutex::new(None),
            graphs: Mutex::new(Vec::new()),
            dtype,
            allocs: Mutex::new(HashMap::new()),
            host_allocs: Mutex::new(HashMap::new()),
            next: AtomicU32::new(0),
            memory: None,
            allocations: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// The same device reporting `bytes` free ([`Gpu::memory_free`]), so that the memory
    /// check before a run can be tested on the host (the shim allocates host memory and
    /// does not enforce it).
    pub fn with_memory(mut self, bytes: usize) -> Self {
        self.memory = Some(bytes);
        self
    }

    /// Allocations made so far ([`Gpu::alloc`] calls that succeeded).
    pub fn allocations(&self) -> usize {
        self.allocations.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records `c` if `s` is capturing (then the call does not run): `Ok(true)`.
    fn captured(&self, s: StreamId, c: impl FnOnce() -> Captured) -> Result<bool, GpuError> {
        let mut cap = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        match cap.as_mut() {
            Some((cs, v)) if *cs == s => {
                v.push(c());
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Refuses a call that waits for the device on a capturing stream (CUDA invalidates
    /// the capture).
    fn no_wait_while_capturing(&self, s: StreamId, what: &str) -> Result<(), GpuError> {
        let cap = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        match cap.as_ref() {
            Some((cs, _)) if *cs == s => Err(GpuError(format!(
                "{what} on stream {} while it captures a graph (a capture cannot wait for the device)",
                s.0
            ))),
            _ => Ok(()),
        }
    }

    fn check(&self, ptr: DevPtr, bytes: usize, what: &str) -> Result<(), GpuError> {
        Self::check_in(&self.allocs, ptr, bytes, what)
    }

    /// Pinned host bytes held now ([`Gpu::alloc_host`] blocks not freed).
    pub fn host_bytes(&self) -> usize {
        self.host_allocs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|l| l.size())
            .sum()
    }

    fn check_in(
        allocs: &Mutex<HashMap<u64, Layout>>,
        ptr: u64,
        bytes: usize,
        what: &str,
    ) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        let a = allocs.lock().unwrap_or_else(|p| p.into_inner());
        let ok = a
            .iter()
            .any(|(&base, l)| ptr >= base && ptr + bytes as u64 <= base + l.size() as u64);
        if ok {
            Ok(())
        } else {
            Err(GpuError(format!(
                "{what}: {bytes} bytes at {ptr:#x} are outside every allocation"
            )))
        }
    }

    fn read(&self, ptr: DevPtr, f32_elems: bool, i: usize) -> f32 {
        // SAFETY: callers checked the ranges against the allocations.
        unsafe {
            if f32_elems || self.dtype == DType::F32 {
                *(ptr as *const f32).add(i)
            } else {
                bf16_to_f32(*(ptr as *const u16).add(i))
            }
        }
    }

    fn write(&self, ptr: DevPtr, f32_elems: bool, i: usize, v: f32) {
        // SAFETY: as in `read`.
        unsafe {
            if f32_elems || self.dtype == DType::F32 {
                *(ptr as *mut f32).add(i) = v;
            } else {
                *(ptr as *mut u16).add(i) = f32_to_bf16(v);
            }
        }
    }
}

impl Drop for HostGpu {
    fn drop(&mut self) {
        let a = self.allocs.get_mut().unwrap_or_else(|p| p.into_inner());
        for (p, l) in a.drain() {
            // SAFETY: allocated by `alloc` with this layout.
            unsafe { dealloc(p as *mut u8, l) };
        }
        let h = self
            .host_allocs
            .get_mut()
            .unwrap_or_else(|p| p.into_inner());
        for (p, l) in h.drain() {
            // SAFETY: allocated by `alloc_host` with this layout.
            unsafe { dealloc(p as *mut u8, l) };
        }
    }
}

/// The extent in elements of a stored `rows x cols` operand with row stride `ld`.
fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

impl Gpu for HostGpu {
    fn describe(&self) -> String {
        format!(
            "host shim ({}, kernels run as C++ on the CPU)",
            self.dtype.name()
        )
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn memory_free(&self) -> Result<Option<usize>, GpuError> {
        Ok(self.memory)
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr, GpuError> {
        self.allocations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let l = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| GpuError(format!("alloc of {bytes} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(l) };
        if p.is_null() {
            return Err(GpuError(format!(
                "alloc of {bytes} bytes: out of host memory"
            )));
        }
        self.allocs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p as DevPtr, l);
        Ok(p as DevPtr)
    }
    fn free(&self, ptr: DevPtr) -> Result<(), GpuError> {
        let l = self
            .allocs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ptr)
            .ok_or_else(|| GpuError(format!("free of {ptr:#x}, which is not allocated")))?;
        // SAFETY: allocated by `alloc` with this layout, removed from the map once.
        unsafe { dealloc(ptr as *mut u8, l) };
        Ok(())
    }
    fn new_stream(&self) -> Result<StreamId, GpuError> {
        Ok(StreamId(self.next.fetch_add(1, Ordering::Relaxed)))
    }
    fn new_event(&self) -> Result<EventId, GpuError> {
        Ok(EventId(self.next.fetch_add(1, Ordering::Relaxed)))
    }
    fn memset(&self, s: StreamId, ptr: DevPtr, bytes: usize) -> Result<(), GpuError> {
        self.check(ptr, bytes, "memset")?;
        if self.captured(s, || Captured::Memset(ptr, bytes))? {
            return Ok(());
        }
        // SAFETY: checked against the allocations.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(())
    }
    fn htod(&self, s: StreamId, dst: DevPtr, src: &[u8]) -> Result<(), GpuError> {
        self.check(dst, src.len(), "htod")?;
        if self.captured(s, || Captured::Htod(dst, src.to_vec()))? {
            return Ok(());
        }
        // SAFETY: checked; host and shim memory never overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    fn dtoh(&self, s: StreamId, src: DevPtr, dst: &mut [u8]) -> Result<(), GpuError> {
        self.no_wait_while_capturing(s, "dtoh")?;
        self.check(src, dst.len(), "dtoh")?;
        // SAFETY: checked.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn alloc_host(&self, bytes: usize) -> Result<HostPtr, GpuError> {
        let l = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| GpuError(format!("alloc_host of {bytes} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc(l) };
        if p.is_null() {
            return Err(GpuError(format!(
                "alloc_host of {bytes} bytes: out of host memory"
            )));
        }
        // Fresh pinned memory holds garbage on a GPU machine: here every byte is 0xff, a NaN
        // in f32 and in bf16, so that a reload of a block no offload wrote shows in the
        // results rather than reading zeros.
        // SAFETY: `l.size()` bytes were just allocated.
        unsafe { std::ptr::write_bytes(p, 0xff, l.size()) };
        self.host_allocs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p as HostPtr, l);
        Ok(p as HostPtr)
    }
    fn free_host(&self, ptr: HostPtr) -> Result<(), GpuError> {
        let l = self
            .host_allocs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ptr)
            .ok_or_else(|| {
                GpuError(format!(
                    "free_host of {ptr:#x}, which is not pinned host memory"
                ))
            })?;
        // SAFETY: allocated by `alloc_host` with this layout, removed from the map once.
        unsafe { dealloc(ptr as *mut u8, l) };
        Ok(())
    }
    fn dtoh_async(
        &self,
        s: StreamId,
        dst: HostPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), GpuError> {
        self.check(src, bytes, "dtoh_async source")?;
        Self::check_in(
            &self.host_allocs,
            dst,
            bytes,
            "dtoh_async destination (pinned host)",
        )?;
        if self.captured(s, || Captured::DtohAsync(dst, src, bytes))? {
            return Ok(());
        }
        // SAFETY: both ranges checked, in different allocations.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn htod_async(
        &self,
        s: StreamId,
        dst: DevPtr,
        src: HostPtr,
        bytes: usize,
    ) -> Result<(), GpuError> {
        self.check(dst, bytes, "htod_async destination")?;
        Self::check_in(
            &self.host_allocs,
            src,
            bytes,
            "htod_async source (pinned host)",
        )?;
        if self.captured(s, || Captured::HtodAsync(dst, src, bytes))? {
            return Ok(());
        }
        // SAFETY: both ranges checked, in different allocations.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn dtod(&self, s: StreamId, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), GpuError> {
        self.check(dst, bytes, "dtod destination")?;
        self.check(src, bytes, "dtod source")?;
        if self.captured(s, || Captured::Dtod(dst, src, bytes))? {
            return Ok(());
        }
        // SAFETY: checked; `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn launch(&self, s: StreamId, l: &Launch) -> Result<(), GpuError> {
        // The kernel by its index in the table: no name compared, nothing allocated.
        let (ix, _) = l.resolve()?;
        if self.captured(s, || Captured::Launch(l.clone()))? {
            return Ok(());
        }
        let mut slots = [0u64; MAX_ARGS];
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        if l.args.len() > MAX_ARGS {
            return Err(GpuError(format!(
                "kernel `{}`: {} arguments, the shim takes at most {MAX_ARGS}",
                l.kernel,
                l.args.len()
            )));
        }
        for (k, a) in l.args.iter().enumerate() {
            slots[k] = a.slot();
        }
        for (p, s) in ptrs.iter_mut().zip(slots.iter_mut()) {
            *p = s as *mut u64 as *mut c_void;
        }
        let mut err = [0 as c_char; 512];
        // SAFETY: the arguments match the kernel's parameters (checked above); pointer
        // arguments are the caller's responsibility, as on a GPU.
        let rc = unsafe {
            schedc_shim_launch_index(
                (self.dtype == DType::Bf16) as c_int,
                ix as c_int,
                l.grid.as_ptr(),
                l.block.as_ptr(),
                ptrs.as_mut_ptr(),
                err.as_mut_ptr(),
                err.len() as c_ulong,
            )
        };
        if rc != 0 {
            // SAFETY: the shim NUL-terminates the message.
            let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
            return Err(GpuError(format!(
                "kernel `{}`: {}",
                l.kernel,
                msg.to_string_lossy()
            )));
        }
        Ok(())
    }
    fn gemm(&self, s: StreamId, g: &Gemm) -> Result<(), GpuError> {
        if self.captured(s, || Captured::Gemm(g.clone()))? {
            return Ok(());
        }
        let (ar, ac) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
        let (br, bc) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
        let t = self.dtype.size();
        let cs = if g.c_f32 { 4 } else { t };
        for b in 0..g.batch {
            self.check(
                g.a + (b * g.sa * t) as u64,
                extent(ar, ac, g.lda) * t,
                "gemm A",
            )?;
            self.check(
                g.b + (b * g.sb * t) as u64,
                extent(br, bc, g.ldb) * t,
                "gemm B",
            )?;
            self.check(
                g.c + (b * g.sc * cs) as u64,
                extent(g.m, g.n, g.ldc) * cs,
                "gemm C",
            )?;
        }
        for b in 0..g.batch {
            let (a, bm, c) = (
                g.a + (b * g.sa * t) as u64,
                g.b + (b * g.sb * t) as u64,
                g.c + (b * g.sc * cs) as u64,
            );
            for i in 0..g.m {
                for j in 0..g.n {
                    // Accumulation starts from beta C, as the CPU backend adds weight
                    // gradients into their accumulator.
                    let mut acc = if g.beta == 0.0 {
                        0.0
                    } else {
                        g.beta * self.read(c, g.c_f32, i * g.ldc + j)
                    };
                    for p in 0..g.k {
                        let x = if g.ta {
                            self.read(a, false, p * g.lda + i)
                        } else {
                            self.read(a, false, i * g.lda + p)
                        };
                        let y = if g.tb {
                            self.read(bm, false, j * g.ldb + p)
                        } else {
                            self.read(bm, false, p * g.ldb + j)
                        };
                        acc += g.alpha * x * y;
                    }
                    self.write(c, g.c_f32, i * g.ldc + j, acc);
                }
            }
        }
        Ok(())
    }
    fn record(&self, _s: StreamId, _e: EventId) -> Result<(), GpuError> {
        Ok(())
    }
    fn wait(&self, _s: StreamId, _e: EventId) -> Result<(), GpuError> {
        Ok(())
    }
    fn sync(&self, s: StreamId, _timeout: Duration) -> Result<(), GpuError> {
        self.no_wait_while_capturing(s, "a stream synchronization")
    }
    fn begin_capture(&self, s: StreamId) -> Result<(), GpuError> {
        let mut cap = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((cs, _)) = cap.as_ref() {
            return Err(GpuError(format!(
                "stream {} already captures a graph (the shim captures one stream at a time)",
                cs.0
            )));
        }
        *cap = Some((s, Vec::new()));
        Ok(())
    }
    fn end_capture(&self, s: StreamId) -> Result<GraphId, GpuError> {
        let mut cap = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        match cap.take() {
            Some((cs, v)) if cs == s => {
                let mut g = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
                g.push(v);
                Ok(GraphId(g.len() as u32 - 1))
            }
            other => {
                *cap = other;
                Err(GpuError(format!("stream {} is not capturing a graph", s.0)))
            }
        }
    }
    fn replay(&self, s: StreamId, g: GraphId) -> Result<(), GpuError> {
        let calls = self
            .graphs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(g.0 as usize)
            .cloned()
            .ok_or_else(|| GpuError(format!("no graph {}", g.0)))?;
        for c in &calls {
            match c {
                Captured::Launch(l) => self.launch(s, l)?,
                Captured::Gemm(x) => self.gemm(s, x)?,
                Captured::Memset(p, b) => self.memset(s, *p, *b)?,
                Captured::Htod(p, b) => self.htod(s, *p, b)?,
                Captured::Dtod(d, x, b) => self.dtod(s, *d, *x, *b)?,
                Captured::DtohAsync(d, x, b) => self.dtoh_async(s, *d, *x, *b)?,
                Captured::HtodAsync(d, x, b) => self.htod_async(s, *d, *x, *b)?,
            }
        }
        Ok(())
    }
    fn elapsed_ms(&self, _start: EventId, _end: EventId) -> Result<f32, GpuError> {
        Err(GpuError("the host shim does not time streams".into()))
    }
}
