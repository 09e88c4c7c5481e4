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
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void, CString};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

extern "C" {
    fn schedc_shim_launch(
        dtype: c_int,
        name: *const c_char,
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

/// The host shim device (see the module docs).
pub struct HostGpu {
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
    fn memset(&self, _s: StreamId, ptr: DevPtr, bytes: usize) -> Result<(), GpuError> {
        self.check(ptr, bytes, "memset")?;
        // SAFETY: checked against the allocations.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(())
    }
    fn htod(&self, _s: StreamId, dst: DevPtr, src: &[u8]) -> Result<(), GpuError> {
        self.check(dst, src.len(), "htod")?;
        // SAFETY: checked; host and shim memory never overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    fn dtoh(&self, _s: StreamId, src: DevPtr, dst: &mut [u8]) -> Result<(), GpuError> {
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
        _s: StreamId,
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
        // SAFETY: both ranges checked, in different allocations.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn htod_async(
        &self,
        _s: StreamId,
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
        // SAFETY: both ranges checked, in different allocations.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn dtod(&self, _s: StreamId, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), GpuError> {
        self.check(dst, bytes, "dtod destination")?;
        self.check(src, bytes, "dtod source")?;
        // SAFETY: checked; `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn launch(&self, _s: StreamId, l: &Launch) -> Result<(), GpuError> {
        l.check()?;
        let mut slots: Vec<u64> = l.args.iter().map(Arg::slot).collect();
        let mut ptrs: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let name = CString::new(l.kernel).map_err(|e| GpuError(e.to_string()))?;
        let mut err = vec![0 as c_char; 512];
        // SAFETY: the arguments match the kernel's parameters (checked above); pointer
        // arguments are the caller's responsibility, as on a GPU.
        let rc = unsafe {
            schedc_shim_launch(
                (self.dtype == DType::Bf16) as c_int,
                name.as_ptr(),
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
    fn gemm(&self, _s: StreamId, g: &Gemm) -> Result<(), GpuError> {
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
    fn sync(&self, _s: StreamId, _timeout: Duration) -> Result<(), GpuError> {
        Ok(())
    }
    fn elapsed_ms(&self, _start: EventId, _end: EventId) -> Result<f32, GpuError> {
        Err(GpuError("the host shim does not time streams".into()))
    }
}
