//! Graph capture and replay (issue 24, item 3) on the host shim: a captured sequence
//! replays exactly as it ran eagerly, reads its inputs at replay (not at capture), and a
//! call that waits for the device is refused while a stream captures, as CUDA refuses it.
//! The sequence is one attention forward and backward (`attn_fwd`, `attn_bwd_delta`,
//! `attn_bwd_dq`, `attn_bwd_dkv`, `attn_bwd_dkp`) with a GEMM and a zero-fill.

use schedc_cpu::tensor::Rng;
use schedc_cuda::api::*;
use schedc_cuda::host::HostGpu;
use schedc_cuda::model::{attention_bwd, attention_fwd, AttnDims};

const S: StreamId = StreamId(0);

struct Bufs {
    inputs: Vec<(DevPtr, usize)>,
    outputs: Vec<(DevPtr, usize)>,
}

/// Allocates the operands of one attention forward and backward of `a` (`t` tokens) and
/// issues it on `S` (captured or run, as the device decides), then a GEMM of the output
/// into `proj` after a zero-fill.
fn issue(gpu: &HostGpu, a: &AttnDims, t: usize, b: &Bufs) {
    let (h, dv) = (a.heads, a.dv);
    let [qn, qp, kn, kp, v, dout, w] = std::array::from_fn(|k| b.inputs[k].0);
    let [out, lse, dqn, dqp, dkn, dkp, dvv, delta, part, proj] =
        std::array::from_fn(|k| b.outputs[k].0);
    attention_fwd(gpu, S, a, (out, lse), (qn, qp), (kn, kp, v), (t, t, 0)).unwrap();
    attention_bwd(
        gpu,
        S,
        a,
        (dqn, dqp, dkn, dkp, dvv),
        (delta, part),
        (dout, out, lse),
        (qn, qp),
        (kn, kp, v),
        (t, t, 0),
    )
    .unwrap();
    gpu.memset(S, proj, b.outputs[9].1).unwrap();
    gpu.gemm(
        S,
        &Gemm {
            m: t,
            n: 8,
            k: h * dv,
            a: out,
            lda: h * dv,
            sa: 0,
            ta: false,
            b: w,
            ldb: 8,
            sb: 0,
            tb: false,
            c: proj,
            ldc: 8,
            sc: 0,
            batch: 1,
            alpha: 1.0,
            beta: 1.0,
            c_f32: true,
        },
    )
    .unwrap();
}

fn alloc(gpu: &HostGpu, a: &AttnDims, t: usize) -> Bufs {
    let (h, dn, dr, dv, kph) = (a.heads, a.dn, a.dr, a.dv, a.kph);
    let ts = gpu.dtype().size();
    let mk = |elems: usize, size: usize| (gpu.alloc(elems * size).unwrap(), elems);
    Bufs {
        inputs: vec![
            mk(t * h * dn, ts),
            mk(t * h * dr, ts),
            mk(t * h * dn, ts),
            mk(t * kph * dr, ts),
            mk(t * h * dv, ts),
            mk(t * h * dv, ts),
            mk(h * dv * 8, ts),
        ],
        outputs: vec![
            mk(t * h * dv, ts),
            mk(h * t, 4),
            mk(t * h * dn, ts),
            mk(t * h * dr, ts),
            mk(t * h * dn, ts),
            mk(t * kph * dr, ts),
            mk(t * h * dv, ts),
            mk(h * t, 4),
            mk(h * t * dr, 4),
            mk(t * 8, 4),
        ],
    }
}

fn fill(gpu: &HostGpu, b: &Bufs, seed: u64) {
    let mut rng = Rng::new(seed);
    for &(p, n) in &b.inputs {
        let xs: Vec<f32> = (0..n).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect();
        gpu.htod(S, p, &encode(gpu.dtype(), &xs)).unwrap();
    }
}

fn read(gpu: &HostGpu, b: &Bufs) -> Vec<Vec<u8>> {
    let ts = gpu.dtype().size();
    b.outputs
        .iter()
        .enumerate()
        .map(|(k, &(p, n))| {
            let size = if matches!(k, 1 | 7 | 8 | 9) { 4 } else { ts };
            let mut v = vec![0u8; n * size];
            gpu.dtoh(S, p, &mut v).unwrap();
            v
        })
        .collect()
}

#[test]
fn a_replayed_graph_equals_the_eager_run_bit_for_bit_and_reads_its_inputs_at_replay() {
    for dt in [DType::F32, DType::Bf16] {
        let a = AttnDims {
            heads: 2,
            dn: 8,
            dr: 4,
            dv: 8,
            kph: 1,
            scale: 0.25,
        };
        let t = 20;
        let eager = HostGpu::new(dt);
        let eb = alloc(&eager, &a, t);
        let graph = HostGpu::new(dt);
        let gb = alloc(&graph, &a, t);
        graph.begin_capture(S).unwrap();
        issue(&graph, &a, t, &gb);
        let g = graph.end_capture(S).unwrap();
        // Captured, nothing ran: the outputs are still the fresh allocation's.
        assert!(read(&graph, &gb)[9].iter().all(|&x| x == 0));
        for seed in [1, 2] {
            fill(&eager, &eb, seed);
            issue(&eager, &a, t, &eb);
            fill(&graph, &gb, seed);
            graph.replay(S, g).unwrap();
            let (want, got) = (read(&eager, &eb), read(&graph, &gb));
            for (k, (w, x)) in want.iter().zip(&got).enumerate() {
                assert_eq!(w, x, "{dt:?} seed {seed}: output {k} differs");
            }
            // The GEMM accumulates (beta 1) after the zero-fill: not all zeros.
            assert!(got[9].iter().any(|&x| x != 0));
        }
    }
}

#[test]
fn a_capture_refuses_calls_that_wait_for_the_device() {
    let gpu = HostGpu::new(DType::F32);
    let p = gpu.alloc(16).unwrap();
    gpu.begin_capture(S).unwrap();
    let mut b = [0u8; 4];
    assert_eq!(
        gpu.dtoh(S, p, &mut b).unwrap_err().0,
        "dtoh on stream 0 while it captures a graph (a capture cannot wait for the device)"
    );
    assert_eq!(
        gpu.begin_capture(S).unwrap_err().0,
        "stream 0 already captures a graph (the shim captures one stream at a time)"
    );
    // Another stream is not captured: it runs and may wait.
    gpu.dtoh(StreamId(1), p, &mut b).unwrap();
    gpu.end_capture(S).unwrap();
    assert_eq!(
        gpu.end_capture(S).unwrap_err().0,
        "stream 0 is not capturing a graph"
    );
    assert_eq!(gpu.replay(S, GraphId(7)).unwrap_err().0, "no graph 7");
}
