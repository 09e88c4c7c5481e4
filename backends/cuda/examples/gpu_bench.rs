//! GPU micro-benchmarks of the CUDA backend, through its own device API (`CudaGpu`): the
//! expert GEMMs at DeepSeek-like shapes against a plain cuBLAS bf16 GEMM measured in the
//! same run, an overlapped F&B chunk against F then B with the all-to-alls simulated by
//! device copies of their size, the launch overhead, and the tiled attention (its
//! tensor-core kernels against the host shim's on the same inputs, then its speed at a
//! DeepSeek-V3-style shape). Prints one JSON object.
//!
//! `gpu_bench [--device N] [--what gemm,overlap,launch,attention,graph]` (`graph`: CUDA
//! graphs, replay against eager and launch overhead; `--host-graph` runs it on the shim); run by
//! `backends/cuda/gpu-check.sh`. The attention section runs last and reports its error in
//! the JSON instead of failing the rest.
//! Without a GPU it prints why and exits 1.

use schedc_cuda::api::*;
use schedc_cuda::cuda::CudaGpu;
use schedc_cuda::host::HostGpu;
use schedc_cuda::model::{attention_bwd, attention_fwd, AttnDims};
use serde_json::json;
use std::time::Instant;

fn fill(g: &dyn Gpu, s: StreamId, p: DevPtr, n: usize, seed: u32) -> Result<(), GpuError> {
    g.launch(
        s,
        &Launch {
            kernel: "fill_hash",
            grid: [n.div_ceil(256).clamp(1, 65535) as u32, 1, 1],
            block: [256, 1, 1],
            args: vec![
                Arg::Ptr(p),
                Arg::I64(n as i64),
                Arg::U32(seed),
                Arg::F32(0.05),
            ],
        },
    )
}

/// Milliseconds per run of `f` on stream `s` (3 warm-ups, `reps` timed, events).
fn time(
    g: &dyn Gpu,
    s: StreamId,
    reps: usize,
    mut f: impl FnMut() -> Result<(), GpuError>,
) -> Result<f64, GpuError> {
    for _ in 0..3 {
        f()?;
    }
    let (a, b) = (g.new_timing_event()?, g.new_timing_event()?);
    g.record(s, a)?;
    for _ in 0..reps {
        f()?;
    }
    g.record(s, b)?;
    g.sync(s, std::time::Duration::from_secs(300))?;
    Ok(g.elapsed_ms(a, b)? as f64 / reps as f64)
}

#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: DevPtr,
    sa: usize,
    b: DevPtr,
    sb: usize,
    tb: bool,
    c: DevPtr,
    sc: usize,
    batch: usize,
) -> Gemm {
    Gemm {
        m,
        n,
        k,
        a,
        lda: k,
        sa,
        ta: false,
        b,
        ldb: if tb { k } else { n },
        sb,
        tb,
        c,
        ldc: n,
        sc,
        batch,
        alpha: 1.0,
        beta: 0.0,
        c_f32: false,
    }
}

/// The peak: an 8192³ bf16 GEMM.
fn peak(g: &CudaGpu, s: StreamId) -> Result<serde_json::Value, GpuError> {
    let n = 8192;
    let (a, b, c) = (
        g.alloc(n * n * 2)?,
        g.alloc(n * n * 2)?,
        g.alloc(n * n * 2)?,
    );
    fill(g, s, a, n * n, 1)?;
    fill(g, s, b, n * n, 2)?;
    let ms = time(g, s, 10, || {
        g.gemm(s, &gemm(n, n, n, a, 0, b, 0, false, c, 0, 1))
    })?;
    for p in [a, b, c] {
        g.free(p)?;
    }
    let tf = 2.0 * (n as f64).powi(3) / (ms * 1e-3) / 1e12;
    Ok(json!({"shape": "8192x8192x8192 bf16, f32 accumulation", "ms": ms, "tflops": tf}))
}

/// The expert GEMMs of the forward (`h1 = X W1`, `h3 = X W3`, `y = act W2`, batched over
/// the local experts, weights interleaved w1, w3, w2 per expert as the driver lays them
/// out) and of the weight gradient (`dW1 += Xᵀ dH1`, f32 accumulators), hidden 7168,
/// expert hidden 2048, 4096 tokens per rank, top-8 of 256 experts, balanced.
fn experts(
    g: &CudaGpu,
    s: StreamId,
    local: usize,
    rows: usize,
) -> Result<serde_json::Value, GpuError> {
    let (d, f) = (7168usize, 2048usize);
    let stride = 3 * d * f;
    let w = g.alloc(local * stride * 2)?;
    let x = g.alloc(local * rows * d * 2)?;
    let (h1, h3) = (
        g.alloc(local * rows * f * 2)?,
        g.alloc(local * rows * f * 2)?,
    );
    let y = g.alloc(local * rows * d * 2)?;
    let dw = g.alloc(d * f * local * 4)?;
    fill(g, s, w, local * stride, 3)?;
    fill(g, s, x, local * rows * d, 4)?;
    fill(g, s, h1, local * rows * f, 5)?;
    let fwd = time(g, s, 5, || {
        g.gemm(
            s,
            &gemm(
                rows,
                f,
                d,
                x,
                rows * d,
                w,
                stride,
                false,
                h1,
                rows * f,
                local,
            ),
        )?;
        g.gemm(
            s,
            &gemm(
                rows,
                f,
                d,
                x,
                rows * d,
                w + (d * f * 2) as u64,
                stride,
                false,
                h3,
                rows * f,
                local,
            ),
        )?;
        g.gemm(
            s,
            &gemm(
                rows,
                d,
                f,
                h1,
                rows * f,
                w + (2 * d * f * 2) as u64,
                stride,
                false,
                y,
                rows * d,
                local,
            ),
        )
    })?;
    let wgrad = time(g, s, 5, || {
        g.gemm(
            s,
            &Gemm {
                m: d,
                n: f,
                k: rows,
                a: x,
                lda: d,
                sa: rows * d,
                ta: true,
                b: h1,
                ldb: f,
                sb: rows * f,
                tb: false,
                c: dw,
                ldc: f,
                sc: d * f,
                batch: local,
                alpha: 1.0,
                beta: 1.0,
                c_f32: true,
            },
        )
    })?;
    for p in [w, x, h1, h3, y, dw] {
        g.free(p)?;
    }
    let flops_fwd = 2.0 * (local * rows) as f64 * 3.0 * (d * f) as f64;
    let flops_w = 2.0 * (local * rows) as f64 * (d * f) as f64;
    Ok(json!({
        "local_experts": local, "rows_per_expert": rows, "hidden": d, "expert_hidden": f,
        "forward_ms": fwd, "forward_tflops": flops_fwd / (fwd * 1e-3) / 1e12,
        "wgrad_w1_ms": wgrad, "wgrad_w1_tflops": flops_w / (wgrad * 1e-3) / 1e12,
    }))
}

/// An F&B chunk of one layer: F = attention (4 GEMMs t x d x d), dispatch, experts
/// (3 batched GEMMs), combine; B = combine, experts (6), dispatch, attention (8); the
/// all-to-alls are device copies of t k d bf16 values. Serial: everything on one stream.
/// Overlapped: compute and copies on two streams, ordered by events as DualPipe orders
/// them. Compute only: no copies. Exposed all-to-all = overlapped - compute only.
fn overlap(g: &CudaGpu) -> Result<serde_json::Value, GpuError> {
    let (t, d, f, k, local) = (4096usize, 7168usize, 2048usize, 8usize, 32usize);
    let rows = t * k / local;
    let (cs, ms) = (g.new_stream()?, g.new_stream()?);
    let aw = g.alloc(4 * d * d * 2)?;
    let ax = g.alloc(t * d * 2)?;
    let ay = g.alloc(t * d * 2)?;
    let stride = 3 * d * f;
    let w = g.alloc(local * stride * 2)?;
    let x = g.alloc(local * rows * d * 2)?;
    let h = g.alloc(local * rows * f * 2)?;
    let a2a = t * k * d * 2;
    let (src, dst) = (g.alloc(a2a)?, g.alloc(a2a)?);
    for (p, n, seed) in [
        (aw, 4 * d * d, 7),
        (ax, t * d, 8),
        (w, local * stride, 9),
        (x, local * rows * d, 10),
    ] {
        fill(g, cs, p, n, seed)?;
    }
    g.sync(cs, std::time::Duration::from_secs(300))?;
    let attn = |s: StreamId, n: usize| -> Result<(), GpuError> {
        for i in 0..n {
            g.gemm(
                s,
                &gemm(
                    t,
                    d,
                    d,
                    ax,
                    0,
                    aw + ((i % 4) * d * d * 2) as u64,
                    0,
                    false,
                    ay,
                    0,
                    1,
                ),
            )?;
        }
        Ok(())
    };
    let mlp = |s: StreamId, n: usize| -> Result<(), GpuError> {
        for i in 0..n {
            if i % 3 == 2 {
                g.gemm(
                    s,
                    &gemm(
                        rows,
                        d,
                        f,
                        h,
                        rows * f,
                        w + (2 * d * f * 2) as u64,
                        stride,
                        false,
                        x,
                        rows * d,
                        local,
                    ),
                )?;
            } else {
                g.gemm(
                    s,
                    &gemm(
                        rows,
                        f,
                        d,
                        x,
                        rows * d,
                        w,
                        stride,
                        false,
                        h,
                        rows * f,
                        local,
                    ),
                )?;
            }
        }
        Ok(())
    };
    let copy = |s: StreamId| g.dtod(s, dst, src, a2a);
    let serial = time(g, cs, 5, || {
        attn(cs, 4)?;
        copy(cs)?;
        mlp(cs, 3)?;
        copy(cs)?;
        copy(cs)?;
        mlp(cs, 6)?;
        copy(cs)?;
        attn(cs, 8)
    })?;
    let compute = time(g, cs, 5, || {
        attn(cs, 4)?;
        mlp(cs, 3)?;
        mlp(cs, 6)?;
        attn(cs, 8)
    })?;
    let ev: Vec<EventId> = (0..8).map(|_| g.new_event()).collect::<Result<_, _>>()?;
    let overlapped = time(g, cs, 5, || {
        attn(cs, 4)?; // attention F
        g.record(cs, ev[0])?;
        g.wait(ms, ev[0])?;
        copy(ms)?; // dispatch F
        g.record(ms, ev[1])?;
        copy(ms)?; // combine B (its input is the next stage's gradient)
        g.record(ms, ev[2])?;
        g.wait(cs, ev[2])?;
        mlp(cs, 6)?; // experts B
        g.record(cs, ev[3])?;
        g.wait(ms, ev[3])?;
        copy(ms)?; // dispatch B
        g.record(ms, ev[4])?;
        g.wait(cs, ev[1])?;
        mlp(cs, 3)?; // experts F
        g.record(cs, ev[5])?;
        g.wait(ms, ev[5])?;
        copy(ms)?; // combine F
        g.record(ms, ev[6])?;
        g.wait(cs, ev[4])?;
        attn(cs, 8)?; // attention B
        g.wait(cs, ev[6])
    })?;
    for p in [aw, ax, ay, w, x, h, src, dst] {
        g.free(p)?;
    }
    Ok(json!({
        "tokens": t, "hidden": d, "top_k": k, "local_experts": local,
        "all_to_all_bytes": a2a, "all_to_alls_per_chunk": 4,
        "serial_f_then_b_ms": serial, "overlapped_ms": overlapped, "compute_only_ms": compute,
        "exposed_all_to_all_serial_ms": serial - compute,
        "exposed_all_to_all_overlapped_ms": overlapped - compute,
        "note": "all-to-alls simulated by device-to-device copies on one GPU (no network)",
    }))
}

/// One attention call's buffers on a device: inputs (`qn, qp, kn, kp, v, dout`), outputs
/// (`out, lse, dqn, dqp, dkn, dkp, dv`) and scratch (`delta, dkp_part`).
struct AttnBufs {
    inputs: [DevPtr; 6],
    outputs: [DevPtr; 7],
    scratch: [DevPtr; 2],
}

/// Sizes in elements of [`AttnBufs`]' inputs, outputs (the same order) and scratch.
fn attn_sizes(a: &AttnDims, t: usize) -> ([usize; 6], [usize; 7], [usize; 2]) {
    let (h, dn, dr, dv, kw) = (a.heads, a.dn, a.dr, a.dv, a.kph * a.dr);
    (
        [
            t * h * dn,
            t * h * dr,
            t * h * dn,
            t * kw,
            t * h * dv,
            t * h * dv,
        ],
        [
            t * h * dv,
            h * t,
            t * h * dn,
            t * h * dr,
            t * h * dn,
            t * kw,
            t * h * dv,
        ],
        [h * t, h * t * dr],
    )
}

fn attn_alloc(g: &dyn Gpu, a: &AttnDims, t: usize) -> Result<AttnBufs, GpuError> {
    let (i, o, sc) = attn_sizes(a, t);
    let ts = g.dtype().size();
    let al = |n: usize, size: usize| g.alloc((n * size).max(1));
    Ok(AttnBufs {
        inputs: [
            al(i[0], ts)?,
            al(i[1], ts)?,
            al(i[2], ts)?,
            al(i[3], ts)?,
            al(i[4], ts)?,
            al(i[5], ts)?,
        ],
        outputs: [
            al(o[0], ts)?,
            al(o[1], 4)?,
            al(o[2], ts)?,
            al(o[3], ts)?,
            al(o[4], ts)?,
            al(o[5], ts)?,
            al(o[6], ts)?,
        ],
        scratch: [al(sc[0], 4)?, al(sc[1], 4)?],
    })
}

/// The causal attention forward, then its backward, on `b`.
fn attn_run(
    g: &dyn Gpu,
    s: StreamId,
    a: &AttnDims,
    b: &AttnBufs,
    t: usize,
    bwd: bool,
) -> Result<(), GpuError> {
    let [qn, qp, kn, kp, v, dout] = b.inputs;
    let [out, lse, dqn, dqp, dkn, dkp, dv] = b.outputs;
    attention_fwd(g, s, a, (out, lse), (qn, qp), (kn, kp, v), (t, t, 0))?;
    if bwd {
        attention_bwd(
            g,
            s,
            a,
            (dqn, dqp, dkn, dkp, dv),
            (b.scratch[0], b.scratch[1]),
            (dout, out, lse),
            (qn, qp),
            (kn, kp, v),
            (t, t, 0),
        )?;
    }
    Ok(())
}

fn attn_free(g: &dyn Gpu, b: &AttnBufs) -> Result<(), GpuError> {
    for p in b.inputs.iter().chain(&b.outputs).chain(&b.scratch) {
        g.free(*p)?;
    }
    Ok(())
}

/// The tiled attention: (1) check: the device's bf16 kernels (tensor cores on sm_80+) against
/// the host shim's (the same kernels, `mma` emulated) on the same inputs, MLA with
/// DeepSeek-V3's head dims, 3 heads, 100 tokens, relative error per output (both round to
/// bf16 and sum in different orders: expect about 1e-2 at most; a wrong fragment layout
/// gives errors near 1); (2) speed: forward and forward+backward at `heads` heads and `t`
/// tokens (causal; 16 and 4096 on a GPU), with FLOPs counted as FlashAttention-2 does for a causal mask (forward
/// `H t^2 (d_qk + d_v)`, backward `H t^2 (3 d_qk + 2 d_v)` multiply-adds times 2, halved).
fn attention(
    g: &dyn Gpu,
    s: StreamId,
    (heads, t): (usize, usize),
    host_only: bool,
) -> Result<serde_json::Value, GpuError> {
    let dims = |heads| AttnDims {
        heads,
        dn: 128,
        dr: 64,
        dv: 128,
        kph: 1,
        scale: (1.0 / 192f64.sqrt()) as f32,
    };
    // (1) check against the shim.
    let (a, tc) = (dims(3), 100);
    let host = HostGpu::new(DType::Bf16);
    let (isz, osz, _) = attn_sizes(&a, tc);
    let mut rng = schedc_cpu::tensor::Rng::new(11);
    let inputs: Vec<Vec<u8>> = isz
        .iter()
        .map(|&n| {
            let xs: Vec<f32> = (0..n).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect();
            encode(DType::Bf16, &xs)
        })
        .collect();
    let hs = StreamId(0);
    let (bd, bh) = (attn_alloc(g, &a, tc)?, attn_alloc(&host, &a, tc)?);
    for (k, x) in inputs.iter().enumerate() {
        g.htod(s, bd.inputs[k], x)?;
        host.htod(hs, bh.inputs[k], x)?;
    }
    attn_run(g, s, &a, &bd, tc, true)?;
    attn_run(&host, hs, &a, &bh, tc, true)?;
    let names = ["out", "lse", "dq_nope", "dq_pe", "dk_nope", "dk_pe", "dv"];
    let mut check = serde_json::Map::new();
    for (k, name) in names.iter().enumerate() {
        let dt = if k == 1 { DType::F32 } else { DType::Bf16 };
        let mut bytes = vec![0u8; osz[k] * dt.size()];
        g.dtoh(s, bd.outputs[k], &mut bytes)?;
        let dev = decode(dt, &bytes);
        host.dtoh(hs, bh.outputs[k], &mut bytes)?;
        let shim = decode(dt, &bytes);
        let e = schedc_cpu::tensor::rel_err(&dev, &shim, 1e-30);
        check.insert(format!("{name}_rel_err_vs_shim"), json!(e));
    }
    attn_free(g, &bd)?;
    attn_free(&host, &bh)?;
    // (2) speed.
    let a = dims(heads);
    let b = attn_alloc(g, &a, t)?;
    let (isz, _, _) = attn_sizes(&a, t);
    for (k, n) in isz.iter().enumerate() {
        fill(g, s, b.inputs[k], *n, 100 + k as u32)?;
    }
    // The host shim has no timing events: it runs each once, untimed (NaN).
    let timed = !host_only;
    let (fwd, both) = if timed {
        (
            time(g, s, 5, || attn_run(g, s, &a, &b, t, false))?,
            time(g, s, 5, || attn_run(g, s, &a, &b, t, true))?,
        )
    } else {
        attn_run(g, s, &a, &b, t, true)?;
        (f64::NAN, f64::NAN)
    };
    attn_free(g, &b)?;
    let (h, tt, qk, v) = (heads as f64, t as f64, 192.0, 128.0);
    let f_flops = 2.0 * h * tt * tt * (qk + v) / 2.0;
    let b_flops = 2.0 * h * tt * tt * (3.0 * qk + 2.0 * v) / 2.0;
    Ok(json!({
        "check": {"heads": 3, "tokens": 100, "d_qk": 192, "d_v": 128, "errors": check},
        "heads": heads, "tokens": t, "d_qk": 192, "d_v": 128, "causal": true,
        "forward_ms": fwd, "forward_backward_ms": both,
        "forward_tflops": f_flops / fwd / 1e9,
        "forward_backward_tflops": (f_flops + b_flops) / both / 1e9,
    }))
}

/// Launch overhead: 20000 one-element `add` launches on one stream.
fn launch(g: &CudaGpu, s: StreamId) -> Result<serde_json::Value, GpuError> {
    let p = g.alloc(4096)?;
    let l = Launch {
        kernel: "add_f32",
        grid: [1, 1, 1],
        block: [32, 1, 1],
        args: vec![Arg::Ptr(p), Arg::Ptr(p), Arg::Ptr(p + 1024), Arg::I64(1)],
    };
    let n = 20000;
    let (a, b) = (g.new_timing_event()?, g.new_timing_event()?);
    for _ in 0..100 {
        g.launch(s, &l)?;
    }
    g.sync(s, std::time::Duration::from_secs(60))?;
    let t0 = Instant::now();
    g.record(s, a)?;
    for _ in 0..n {
        g.launch(s, &l)?;
    }
    g.record(s, b)?;
    let host = t0.elapsed().as_secs_f64();
    g.sync(s, std::time::Duration::from_secs(60))?;
    let dev = g.elapsed_ms(a, b)? as f64;
    g.free(p)?;
    Ok(json!({
        "launches": n, "host_us_per_launch": host * 1e6 / n as f64, "device_us_per_launch": dev * 1e3 / n as f64,
    }))
}

/// CUDA graphs (issue 24, item 3): (1) one attention forward and backward (MLA head
/// dims, 3 heads, 100 tokens, as the attention check) captured once and replayed against
/// the same calls run eagerly on the same inputs (the outputs must be equal bit for bit);
/// (2) launch overhead through a graph: 1000 one-element `add_f32` launches captured,
/// replayed 20 times, host and device time per launch (against `launch`'s eager figures).
/// With `dump`, case (1)'s inputs and eager outputs are written there as JSON (gpu-check's
/// comparison with torch's `scaled_dot_product_attention`, `sdpa_check.py`).
fn graph(
    g: &dyn Gpu,
    s: StreamId,
    timed: bool,
    dump: Option<&str>,
) -> Result<serde_json::Value, GpuError> {
    let a = AttnDims {
        heads: 3,
        dn: 128,
        dr: 64,
        dv: 128,
        kph: 1,
        scale: (1.0 / 192f64.sqrt()) as f32,
    };
    let t = 100;
    let b = attn_alloc(g, &a, t)?;
    let (isz, osz, _) = attn_sizes(&a, t);
    for (k, &n) in isz.iter().enumerate() {
        fill(g, s, b.inputs[k], n, 7 + k as u32)?;
    }
    let read = |g: &dyn Gpu| -> Result<Vec<Vec<u8>>, GpuError> {
        let mut v = Vec::new();
        for (k, &n) in osz.iter().enumerate() {
            let size = if k == 1 { 4 } else { g.dtype().size() };
            let mut x = vec![0u8; n * size];
            g.dtoh(s, b.outputs[k], &mut x)?;
            v.push(x);
        }
        Ok(v)
    };
    attn_run(g, s, &a, &b, t, true)?;
    let eager = read(g)?;
    for (k, &n) in osz.iter().enumerate() {
        let size = if k == 1 { 4 } else { g.dtype().size() };
        g.memset(s, b.outputs[k], n * size)?;
    }
    g.begin_capture(s)?;
    let captured = attn_run(g, s, &a, &b, t, true);
    let graph = g.end_capture(s);
    captured?;
    let graph = graph?;
    g.replay(s, graph)?;
    let replayed = read(g)?;
    let differing: Vec<usize> = (0..osz.len())
        .filter(|&k| eager[k] != replayed[k])
        .collect();
    if let Some(path) = dump {
        // The case for gpu-check's comparison with torch's scaled_dot_product_attention:
        // inputs and outputs as f32 values of what the buffers hold.
        let names_in = ["q_nope", "q_pe", "k_nope", "k_pe", "v", "dout"];
        let names_out = ["out", "lse", "dq_nope", "dq_pe", "dk_nope", "dk_pe", "dv"];
        let mut inputs = serde_json::Map::new();
        for (k, &n) in isz.iter().enumerate() {
            let mut x = vec![0u8; n * g.dtype().size()];
            g.dtoh(s, b.inputs[k], &mut x)?;
            inputs.insert(names_in[k].into(), json!(decode(g.dtype(), &x)));
        }
        let mut outputs = serde_json::Map::new();
        for (k, x) in eager.iter().enumerate() {
            let dt = if k == 1 { DType::F32 } else { g.dtype() };
            outputs.insert(names_out[k].into(), json!(decode(dt, x)));
        }
        let case = json!({
            "heads": a.heads, "tokens": t, "dn": a.dn, "dr": a.dr, "dv": a.dv, "kph": a.kph,
            "scale": a.scale, "dtype": g.dtype().name(), "inputs": inputs, "outputs": outputs,
        });
        std::fs::write(path, case.to_string())
            .map_err(|e| GpuError(format!("writing {path}: {e}")))?;
    }
    attn_free(g, &b)?;
    // (2) launch overhead.
    let p = g.alloc(4096)?;
    g.memset(s, p, 4096)?;
    let l = Launch {
        kernel: "add_f32",
        grid: [1, 1, 1],
        block: [32, 1, 1],
        args: vec![Arg::Ptr(p), Arg::Ptr(p), Arg::Ptr(p + 1024), Arg::I64(1)],
    };
    let per = 1000;
    g.begin_capture(s)?;
    let mut captured = Ok(());
    for _ in 0..per {
        captured = captured.and_then(|_| g.launch(s, &l));
    }
    let lg = g.end_capture(s);
    captured?;
    let lg = lg?;
    g.replay(s, lg)?;
    g.sync(s, std::time::Duration::from_secs(60))?;
    let reps = 20;
    let ev = if timed {
        Some((g.new_timing_event()?, g.new_timing_event()?))
    } else {
        None
    };
    let t0 = Instant::now();
    if let Some((e0, _)) = ev {
        g.record(s, e0)?;
    }
    for _ in 0..reps {
        g.replay(s, lg)?;
    }
    if let Some((_, e1)) = ev {
        g.record(s, e1)?;
    }
    let host = t0.elapsed().as_secs_f64();
    g.sync(s, std::time::Duration::from_secs(60))?;
    let n = (per * reps) as f64;
    let dev = match ev {
        Some((e0, e1)) => json!(g.elapsed_ms(e0, e1)? as f64 * 1e3 / n),
        None => json!(null),
    };
    g.free(p)?;
    Ok(json!({
        "attention_replay_equals_eager": differing.is_empty(),
        "attention_outputs_differing": differing,
        "launches_per_graph": per, "replays": reps,
        "host_us_per_launch": host * 1e6 / n, "device_us_per_launch": dev,
    }))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let device: usize = opt("--device").and_then(|v| v.parse().ok()).unwrap_or(0);
    if args.iter().any(|a| a == "--host-attention") {
        // The attention section on the host shim against itself (2 heads, 64 tokens): checks
        // the benchmark's own code without a GPU (errors 0; times are the shim's).
        let h = HostGpu::new(DType::Bf16);
        match attention(&h, StreamId(0), (2, 64), true) {
            Ok(v) => println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default()),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    if args.iter().any(|a| a == "--host-graph") {
        // The graph section on the host shim (capture records, replay runs the record).
        let h = HostGpu::new(DType::Bf16);
        match graph(&h, StreamId(0), false, opt("--dump-attention").as_deref()) {
            Ok(v) => println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default()),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    let what = opt("--what").unwrap_or_else(|| "gemm,overlap,launch,attention".into());
    let g = match CudaGpu::new(device, DType::Bf16, None) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let run = || -> Result<serde_json::Value, GpuError> {
        let s = g.new_stream()?;
        let mut out = json!({"device": g.describe()});
        if what.contains("gemm") {
            let pk = peak(&g, s)?;
            let peak_tf = pk["tflops"].as_f64().unwrap_or(1.0);
            let mut shapes = Vec::new();
            for (local, rows) in [(256, 128), (32, 1024)] {
                let mut e = experts(&g, s, local, rows)?;
                let tf = e["forward_tflops"].as_f64().unwrap_or(0.0);
                e["forward_fraction_of_peak"] = json!(tf / peak_tf);
                shapes.push(e);
            }
            out["gemm_peak"] = pk;
            out["expert_gemms"] = json!(shapes);
        }
        if what.contains("overlap") {
            out["overlap"] = overlap(&g)?;
        }
        if what.contains("launch") {
            out["launch"] = launch(&g, s)?;
        }
        if what.contains("graph") {
            out["graph"] = graph(&g, s, true, opt("--dump-attention").as_deref())
                .unwrap_or_else(|e| json!({"error": e.to_string()}));
        }
        if what.contains("attention") {
            out["attention"] = attention(&g, s, (16, 4096), false)
                .unwrap_or_else(|e| json!({"error": e.to_string()}));
        }
        Ok(out)
    };
    match run() {
        Ok(v) => println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
