//! Host overhead of the CUDA backend's driver per instruction (issue 24, item 3).
//!
//! The README's training run (DualPipe, P=4, M=8, `ModelConfig::small`, single-GPU mode,
//! four rank threads) is driven against a device that does nothing (`Null`: every call
//! returns at once, memory is never touched), so that criterion's time per element is the
//! host time the driver spends per program instruction: interpretation, buffers, the
//! model's launch sequences and the device API calls, without the device.
//!
//! The baseline in the same run (`interp_only`) is the device-neutral interpreter over the
//! same programs with a device that does nothing per instruction (one rank after the other,
//! nothing blocks): the floor any backend pays. `driver / interp_only` is the ratio to
//! compare between commits (it cancels the machine's speed); the real GPU adds the driver
//! API's own cost per call (about 3 µs per `cuLaunchKernel` on an H200).
//!
//! Run with `cargo bench -p schedc-cuda --bench host`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use schedc::input::{load_spec, Overrides};
use schedc_cuda::api::*;
use schedc_cuda::driver::{execute, ExecOptions};
use schedc_program::data::Data;
use schedc_program::interp::{self, Abort, Device, InterpOptions, Ready};
use schedc_program::mesh::Mesh;
use schedc_program::{Buf, LowerOptions, ModelConfig, Op, ProgramSet};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// A device that does nothing (module docs).
struct Null {
    next: AtomicU64,
}

impl Gpu for Null {
    fn describe(&self) -> String {
        "null".into()
    }
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr, GpuError> {
        Ok(self
            .next
            .fetch_add(bytes.next_multiple_of(256) as u64 + 256, Ordering::Relaxed))
    }
    fn free(&self, _ptr: DevPtr) -> Result<(), GpuError> {
        Ok(())
    }
    fn new_stream(&self) -> Result<StreamId, GpuError> {
        Ok(StreamId(self.next.fetch_add(1, Ordering::Relaxed) as u32))
    }
    fn new_event(&self) -> Result<EventId, GpuError> {
        Ok(EventId(self.next.fetch_add(1, Ordering::Relaxed) as u32))
    }
    fn memset(&self, _s: StreamId, _p: DevPtr, _b: usize) -> Result<(), GpuError> {
        Ok(())
    }
    fn htod(&self, _s: StreamId, _d: DevPtr, _src: &[u8]) -> Result<(), GpuError> {
        Ok(())
    }
    fn dtoh(&self, _s: StreamId, _src: DevPtr, dst: &mut [u8]) -> Result<(), GpuError> {
        dst.fill(0);
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
        _s: StreamId,
        _d: HostPtr,
        _src: DevPtr,
        _b: usize,
    ) -> Result<(), GpuError> {
        Ok(())
    }
    fn htod_async(
        &self,
        _s: StreamId,
        _d: DevPtr,
        _src: HostPtr,
        _b: usize,
    ) -> Result<(), GpuError> {
        Ok(())
    }
    fn dtod(&self, _s: StreamId, _d: DevPtr, _src: DevPtr, _b: usize) -> Result<(), GpuError> {
        Ok(())
    }
    fn launch(&self, _s: StreamId, l: &Launch) -> Result<(), GpuError> {
        // What every real device does first: resolve the kernel and check the arguments.
        black_box(l.check()?);
        Ok(())
    }
    fn gemm(&self, _s: StreamId, g: &Gemm) -> Result<(), GpuError> {
        black_box(g);
        Ok(())
    }
    fn record(&self, _s: StreamId, _e: EventId) -> Result<(), GpuError> {
        Ok(())
    }
    fn wait(&self, _s: StreamId, _e: EventId) -> Result<(), GpuError> {
        Ok(())
    }
    fn sync(&self, _s: StreamId, _t: Duration) -> Result<(), GpuError> {
        Ok(())
    }
    fn elapsed_ms(&self, _a: EventId, _b: EventId) -> Result<f32, GpuError> {
        Ok(0.0)
    }
}

/// A device of the interpreter that does nothing per instruction.
struct Idle;

impl Device for Idle {
    fn alloc(&mut self, buf: Buf, _zero: bool) -> Result<(), String> {
        black_box(buf);
        Ok(())
    }
    fn free(&mut self, buf: Buf) -> Result<(), String> {
        black_box(buf);
        Ok(())
    }
    fn exec(&mut self, _s: usize, op: &Op, _issued: &mut bool) -> Result<Ready, String> {
        black_box(op);
        Ok(Ready::Done)
    }
    fn wait(&mut self, _at_most: Duration) {}
}

fn programs() -> ProgramSet {
    let path = format!("{}/../../specs/dualpipe.sched", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).expect("the spec exists");
    let ov = Overrides {
        pp: Some(4),
        microbatches: Some(8),
        ..Default::default()
    };
    let src = load_spec(&text, &ov).expect("dualpipe P=4 M=8").program;
    ProgramSet::lower(
        &src,
        &Mesh::pipeline(4),
        &ModelConfig::small(),
        LowerOptions::default(),
    )
    .expect("lowers")
}

fn host(c: &mut Criterion) {
    let set = programs();
    let data = Data::builtin();
    let steps = 4;
    let opts = ExecOptions {
        steps,
        ..ExecOptions::default()
    };
    let n = (set.len() * steps) as u64;
    let mut g = c.benchmark_group("host");
    g.sample_size(20).measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(n));
    g.bench_function("driver/dualpipe_P4_M8", |b| {
        b.iter(|| {
            let null = Null {
                next: AtomicU64::new(1 << 20),
            };
            let r = execute(&null, &set, &data, &opts).expect("runs");
            assert_eq!(r.instructions, n);
            black_box(r)
        })
    });
    g.bench_function("interp_only/dualpipe_P4_M8", |b| {
        b.iter(|| {
            let mut total = 0;
            for prog in &set.ranks {
                total += interp::run_rank(
                    prog,
                    &mut Idle,
                    InterpOptions {
                        steps,
                        timeout: Duration::from_secs(10),
                    },
                    &Abort::default(),
                    &Mutex::default(),
                )
                .expect("runs");
            }
            assert_eq!(total, n);
            black_box(total)
        })
    });
    g.finish();
}

criterion_group!(benches, host);
criterion_main!(benches);
