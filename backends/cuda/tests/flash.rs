//! The tiled attention kernels (FlashAttention-2: `attn_fwd`, `attn_bwd_delta`,
//! `attn_bwd_dq`, `attn_bwd_dkv`, `attn_bwd_dkp`), compiled as C++ under the host shim,
//! against a plain f64 attention at small sizes: sequence lengths that are not multiples
//! of the 16-row tile, causal masks at sequence-parallel offsets, MLA (content and a RoPE
//! part whose key is shared by the heads), a RoPE key per head, and plain multi-head
//! attention without a RoPE part. f32 within 1e-5 of the f64 reference (relative to the
//! largest magnitude), bf16 storage within 1e-2.
//!
//! Each case prints `flash KERNEL DTYPE SHAPE: max rel err E`;
//! `cargo test -p schedc-cuda --test flash -- --nocapture` lists them.

use schedc_cpu::tensor::{rel_err, Rng};
use schedc_cuda::api::*;
use schedc_cuda::host::HostGpu;
use schedc_cuda::model::{
    attention_bwd, attention_bwd_seqs, attention_fwd, attention_fwd_seqs, AttnDims, ATT_MAX_QK,
    ATT_MAX_V,
};

const S: StreamId = StreamId(0);

/// Against the f64 attention whose `D_i = dout_i . out_i` uses the output as stored (f32 or
/// bf16), as FlashAttention-2's backward does.
fn tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::Bf16 => 1e-2,
    }
}

/// Against the f64 attention with the exact `D_i = sum_j P_ij dP_ij`: in bf16 the output's
/// rounding (2^-9) reaches the gradients through `dP_ij - D_i` (measured up to 1.4e-2 on
/// these sizes); the bf16 bound of the project's kernel numerics (`numerics.rs`).
fn tol_exact(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::Bf16 => 2e-2,
    }
}

/// The inputs of one attention call (values as the storage type holds them).
struct Case {
    a: AttnDims,
    tq: usize,
    tk: usize,
    off: usize,
    qn: Vec<f32>,
    qp: Vec<f32>,
    kn: Vec<f32>,
    kp: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
}

/// What the reference and the kernels compute.
struct Out {
    out: Vec<f64>,
    lse: Vec<f64>,
    dqn: Vec<f64>,
    dqp: Vec<f64>,
    dkn: Vec<f64>,
    dkp: Vec<f64>,
    dv: Vec<f64>,
}

/// Plain causal attention in f64: scores, softmax, P V, and its backward through the full
/// `tq x tk` probabilities, with the softmax Jacobian's row term `D_i` exact (`stored`
/// None) or, as FlashAttention-2 computes it, from the output as type `stored` holds it.
fn reference(c: &Case, stored: Option<DType>) -> Out {
    let a = &c.a;
    let (h, dn, dr, dv, kph) = (a.heads, a.dn, a.dr, a.dv, a.kph);
    let (tq, tk) = (c.tq, c.tk);
    let sc = a.scale as f64;
    let f = |x: &[f32], i: usize| x[i] as f64;
    let mut o = Out {
        out: vec![0.0; tq * h * dv],
        lse: vec![0.0; h * tq],
        dqn: vec![0.0; tq * h * dn],
        dqp: vec![0.0; tq * h * dr],
        dkn: vec![0.0; tk * h * dn],
        dkp: vec![0.0; tk * kph * dr],
        dv: vec![0.0; tk * h * dv],
    };
    for hh in 0..h {
        let kh = if kph == 1 { 0 } else { hh };
        for i in 0..tq {
            let vis = (c.off + i + 1).min(tk);
            let s: Vec<f64> = (0..vis)
                .map(|j| {
                    let mut d = 0.0;
                    for e in 0..dn {
                        d +=
                            f(&c.qn, i * h * dn + hh * dn + e) * f(&c.kn, j * h * dn + hh * dn + e);
                    }
                    for e in 0..dr {
                        d += f(&c.qp, i * h * dr + hh * dr + e)
                            * f(&c.kp, j * kph * dr + kh * dr + e);
                    }
                    d * sc
                })
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum();
            o.lse[hh * tq + i] = mx + sum.ln();
            let p: Vec<f64> = s.iter().map(|x| (x - mx).exp() / sum).collect();
            let dp: Vec<f64> = (0..vis)
                .map(|j| {
                    (0..dv)
                        .map(|e| {
                            f(&c.dout, i * h * dv + hh * dv + e) * f(&c.v, j * h * dv + hh * dv + e)
                        })
                        .sum()
                })
                .collect();
            // D_i: the exact sum_j P_ij dP_ij, or FlashAttention-2's rowsum(dO o O) with O as
            // the storage type holds it.
            let pdp: f64 = match stored {
                None => p.iter().zip(&dp).map(|(x, y)| x * y).sum(),
                Some(dt) => (0..dv)
                    .map(|e| {
                        let oe: f64 = (0..vis)
                            .map(|j| p[j] * f(&c.v, j * h * dv + hh * dv + e))
                            .sum();
                        let oe = decode(dt, &encode(dt, &[oe as f32]))[0] as f64;
                        oe * f(&c.dout, i * h * dv + hh * dv + e)
                    })
                    .sum(),
            };
            for j in 0..vis {
                let ds = p[j] * (dp[j] - pdp) * sc;
                for e in 0..dv {
                    o.out[i * h * dv + hh * dv + e] += p[j] * f(&c.v, j * h * dv + hh * dv + e);
                    o.dv[j * h * dv + hh * dv + e] += p[j] * f(&c.dout, i * h * dv + hh * dv + e);
                }
                for e in 0..dn {
                    o.dqn[i * h * dn + hh * dn + e] += ds * f(&c.kn, j * h * dn + hh * dn + e);
                    o.dkn[j * h * dn + hh * dn + e] += ds * f(&c.qn, i * h * dn + hh * dn + e);
                }
                for e in 0..dr {
                    o.dqp[i * h * dr + hh * dr + e] += ds * f(&c.kp, j * kph * dr + kh * dr + e);
                    o.dkp[j * kph * dr + kh * dr + e] += ds * f(&c.qp, i * h * dr + hh * dr + e);
                }
            }
        }
    }
    o
}

struct Dev {
    gpu: HostGpu,
    dt: DType,
}

impl Dev {
    fn put(&self, xs: &[f32], dt: DType) -> DevPtr {
        let p = self.gpu.alloc((xs.len() * dt.size()).max(1)).unwrap();
        self.gpu.htod(S, p, &encode(dt, xs)).unwrap();
        p
    }
    fn t(&self, xs: &[f32]) -> DevPtr {
        self.put(xs, self.dt)
    }
    /// A storage-type buffer of n NaNs: every element the kernels should write shows if
    /// they do not.
    fn nan_t(&self, n: usize) -> DevPtr {
        self.t(&vec![f32::NAN; n])
    }
    fn nan_f(&self, n: usize) -> DevPtr {
        self.put(&vec![f32::NAN; n], DType::F32)
    }
    fn get(&self, p: DevPtr, n: usize, dt: DType) -> Vec<f64> {
        let mut b = vec![0u8; n * dt.size()];
        self.gpu.dtoh(S, p, &mut b).unwrap();
        decode(dt, &b).into_iter().map(|x| x as f64).collect()
    }
}

fn case(dt: DType, a: AttnDims, tq: usize, tk: usize, off: usize, seed: u64) -> Case {
    let mut rng = Rng::new(seed);
    let mut gen = |n: usize| -> Vec<f32> {
        let xs: Vec<f32> = (0..n).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect();
        decode(dt, &encode(dt, &xs))
    };
    let (h, dn, dr, dv) = (a.heads, a.dn, a.dr, a.dv);
    Case {
        a,
        tq,
        tk,
        off,
        qn: gen(tq * h * dn),
        qp: gen(tq * h * dr),
        kn: gen(tk * h * dn),
        kp: gen(tk * a.kph * dr),
        v: gen(tk * h * dv),
        dout: gen(tq * h * dv),
    }
}

/// Runs the kernels on `c` and returns what they wrote.
fn kernels(dev: &Dev, c: &Case) -> Out {
    let a = &c.a;
    let (h, dn, dr, dv, kph) = (a.heads, a.dn, a.dr, a.dv, a.kph);
    let (tq, tk, dt) = (c.tq, c.tk, dev.dt);
    let q = (dev.t(&c.qn), dev.t(&c.qp));
    let k = (dev.t(&c.kn), dev.t(&c.kp), dev.t(&c.v));
    let (out, lse) = (dev.nan_t(tq * h * dv), dev.nan_f(h * tq));
    attention_fwd(&dev.gpu, S, a, (out, lse), q, k, (tq, tk, c.off)).unwrap();
    let g = (
        dev.nan_t(tq * h * dn),
        dev.nan_t(tq * h * dr),
        dev.nan_t(tk * h * dn),
        dev.nan_t(tk * kph * dr),
        dev.nan_t(tk * h * dv),
    );
    let scratch = (dev.nan_f(h * tq), dev.nan_f(h * tk * dr));
    let dout = dev.t(&c.dout);
    attention_bwd(
        &dev.gpu,
        S,
        a,
        g,
        scratch,
        (dout, out, lse),
        q,
        k,
        (tq, tk, c.off),
    )
    .unwrap();
    Out {
        out: dev.get(out, tq * h * dv, dt),
        lse: dev.get(lse, h * tq, DType::F32),
        dqn: dev.get(g.0, tq * h * dn, dt),
        dqp: dev.get(g.1, tq * h * dr, dt),
        dkn: dev.get(g.2, tk * h * dn, dt),
        dkp: dev.get(g.3, tk * kph * dr, dt),
        dv: dev.get(g.4, tk * h * dv, dt),
    }
}

fn dims(heads: usize, dn: usize, dr: usize, dv: usize, kph: usize) -> AttnDims {
    AttnDims {
        heads,
        dn,
        dr,
        dv,
        kph,
        scale: (1.0 / ((dn + dr) as f64).sqrt()) as f32,
    }
}

/// Checks every output of `c` against the f64 reference whose `D` comes from the output as
/// the storage type holds it (within [`tol`]), and against the one with the exact `D`
/// (within [`tol_exact`]); returns the worst relative errors of both.
fn check(dt: DType, name: &str, c: &Case) -> (f64, f64) {
    let dev = Dev {
        gpu: HostGpu::new(dt),
        dt,
    };
    let got = kernels(&dev, c);
    let shape = format!(
        "H={} dn={} dr={} dv={} kph={} tq={} tk={} off={}",
        c.a.heads, c.a.dn, c.a.dr, c.a.dv, c.a.kph, c.tq, c.tk, c.off
    );
    let mut worst = (0.0f64, 0.0f64);
    for (exact, want) in [(false, reference(c, Some(dt))), (true, reference(c, None))] {
        let limit = if exact { tol_exact(dt) } else { tol(dt) };
        let refname = if exact { "exact D" } else { "stored-O D" };
        for (what, g, w) in [
            ("attn_fwd (out)", &got.out, &want.out),
            ("attn_fwd (lse)", &got.lse, &want.lse),
            ("attn_bwd_dq (content)", &got.dqn, &want.dqn),
            ("attn_bwd_dq (RoPE)", &got.dqp, &want.dqp),
            ("attn_bwd_dkv (keys)", &got.dkn, &want.dkn),
            ("attn_bwd_dkp (RoPE keys)", &got.dkp, &want.dkp),
            ("attn_bwd_dkv (values)", &got.dv, &want.dv),
        ] {
            if w.is_empty() {
                continue;
            }
            let e = rel_err(g, w, 1e-30);
            println!(
                "flash {what} {} {name} {shape} ({refname}): max rel err {e:.2e}",
                dt.name()
            );
            assert!(
                e <= limit,
                "{what} ({}, {name}, {shape}, {refname}): relative error {e:.3e} over {limit:.0e}",
                dt.name()
            );
            if exact {
                worst.1 = worst.1.max(e);
            } else {
                worst.0 = worst.0.max(e);
            }
        }
    }
    worst
}

const DTYPES: [DType; 2] = [DType::F32, DType::Bf16];

/// `(tq, tk, q_offset)`: one query row; 5, 17 and 33 rows (not multiples of the tile), full
/// causal; SP chunks (the last of 2 at 20 rows each, the middle of 3 at 13 each).
const SIZES: [(usize, usize, usize); 6] = [
    (1, 1, 0),
    (5, 5, 0),
    (17, 17, 0),
    (33, 33, 0),
    (20, 40, 20),
    (13, 39, 13),
];

#[test]
fn flash_attention_mla_with_a_shared_rope_key_matches_f64() {
    for dt in DTYPES {
        for (n, &(tq, tk, off)) in SIZES.iter().enumerate() {
            let c = case(dt, dims(3, 8, 4, 6, 1), tq, tk, off, 10 + n as u64);
            check(dt, "MLA", &c);
        }
    }
}

#[test]
fn flash_attention_with_a_rope_key_per_head_matches_f64() {
    for dt in DTYPES {
        for (n, &(tq, tk, off)) in SIZES.iter().enumerate() {
            let c = case(dt, dims(2, 8, 4, 8, 2), tq, tk, off, 20 + n as u64);
            check(dt, "RoPE key per head", &c);
        }
    }
}

#[test]
fn flash_attention_without_a_rope_part_matches_f64() {
    for dt in DTYPES {
        for (n, &(tq, tk, off)) in SIZES.iter().enumerate() {
            let c = case(dt, dims(2, 12, 0, 10, 1), tq, tk, off, 30 + n as u64);
            check(dt, "multi-head, no RoPE", &c);
        }
    }
}

#[test]
fn flash_attention_at_deepseek_v3_head_dims_matches_f64() {
    // d_h 128, d_h^R 64, d_v 128: the largest the tiles take (ATT_DQK 192, ATT_DV 128).
    assert_eq!((ATT_MAX_QK, ATT_MAX_V), (192, 128));
    for dt in DTYPES {
        for (n, &(tq, tk, off)) in [(33usize, 33usize, 0usize), (18, 36, 18)]
            .iter()
            .enumerate()
        {
            let c = case(dt, dims(2, 128, 64, 128, 1), tq, tk, off, 40 + n as u64);
            check(dt, "DeepSeek-V3 head dims", &c);
        }
    }
}

#[test]
fn flash_attention_refuses_head_dims_over_its_tiles() {
    let gpu = HostGpu::new(DType::F32);
    for (a, what) in [
        (dims(2, 160, 64, 128, 1), "d_h 160 + d_h^R 64, d_v 128"),
        (dims(2, 128, 64, 192, 1), "d_h 128 + d_h^R 64, d_v 192"),
    ] {
        let e = attention_fwd(&gpu, S, &a, (0, 0), (0, 0), (0, 0, 0), (4, 4, 0)).unwrap_err();
        assert_eq!(
            e.0,
            format!("attention head dimensions {what}: the CUDA attention kernels take d_h + d_h^R from 1 to 192 and d_v from 1 to 128")
        );
    }
}

/// Issue 24: a micro-batch of `B = 2` sequences (`--micro-batch-size 2`) in one buffer of
/// `2 T` rows, through `attention_fwd_seqs` / `attention_bwd_seqs` (one launch per
/// sequence on slices): every output equals the f64 attention of each sequence alone,
/// side by side (`lse`, `delta`, `dkp_part` as per-sequence blocks), for T = 5, 17 and 33
/// (not multiples of the tile). The kernels run plainly over the `2 T` rows (the second
/// sequence's queries see the first sequence's keys: no block-diagonal mask) differ: that
/// is the bug the split guards against.
#[test]
fn flash_attention_over_two_sequences_is_block_diagonal() {
    let a = dims(3, 8, 4, 6, 1);
    for dt in DTYPES {
        for (n, t) in [5usize, 17, 33].into_iter().enumerate() {
            let seqs: Vec<Case> = (0..2)
                .map(|j| case(dt, a, t, t, 0, 100 + 2 * n as u64 + j))
                .collect();
            let cat = |f: &dyn Fn(&Case) -> &Vec<f32>| -> Vec<f32> {
                seqs.iter().flat_map(|c| f(c).iter().copied()).collect()
            };
            let both = Case {
                a,
                tq: 2 * t,
                tk: 2 * t,
                off: 0,
                qn: cat(&|c| &c.qn),
                qp: cat(&|c| &c.qp),
                kn: cat(&|c| &c.kn),
                kp: cat(&|c| &c.kp),
                v: cat(&|c| &c.v),
                dout: cat(&|c| &c.dout),
            };
            let refs: Vec<Out> = seqs.iter().map(|c| reference(c, Some(dt))).collect();
            let want = |f: &dyn Fn(&Out) -> &Vec<f64>| -> Vec<f64> {
                refs.iter().flat_map(|o| f(o).iter().copied()).collect()
            };
            let dev = Dev {
                gpu: HostGpu::new(dt),
                dt,
            };
            let got = kernels_seqs(&dev, &both, 2);
            let mut worst = 0.0f64;
            for (what, g, w) in [
                ("out", &got.out, want(&|o| &o.out)),
                ("lse", &got.lse, want(&|o| &o.lse)),
                ("dq content", &got.dqn, want(&|o| &o.dqn)),
                ("dq RoPE", &got.dqp, want(&|o| &o.dqp)),
                ("dk content", &got.dkn, want(&|o| &o.dkn)),
                ("dk RoPE", &got.dkp, want(&|o| &o.dkp)),
                ("dv", &got.dv, want(&|o| &o.dv)),
            ] {
                let e = rel_err(g, &w, 1e-30);
                worst = worst.max(e);
                assert!(
                    e <= tol(dt),
                    "{what} ({}, B=2 T={t}): relative error {e:.3e}",
                    dt.name()
                );
            }
            // The bug: one causal sequence of 2T rows.
            let wrong = kernels_seqs(&dev, &both, 1);
            let bug = rel_err(&wrong.out, &want(&|o| &o.out), 1e-30);
            println!(
                "flash B=2 {} T={t}: max rel err {worst:.2e}; without the block-diagonal mask: out off by {bug:.2e}",
                dt.name()
            );
            assert!(bug > 1e-2, "the cross-sequence mask went unseen: {bug:e}");
        }
    }
}

/// `kernels` through the per-sequence entry points, `seqs` sequences.
fn kernels_seqs(dev: &Dev, c: &Case, seqs: usize) -> Out {
    let a = &c.a;
    let (h, dn, dr, dv, kph) = (a.heads, a.dn, a.dr, a.dv, a.kph);
    let (tq, tk, dt) = (c.tq, c.tk, dev.dt);
    let split = (dt.size(), seqs);
    let q = (dev.t(&c.qn), dev.t(&c.qp));
    let k = (dev.t(&c.kn), dev.t(&c.kp), dev.t(&c.v));
    let (out, lse) = (dev.nan_t(tq * h * dv), dev.nan_f(h * tq));
    attention_fwd_seqs(&dev.gpu, S, a, split, (out, lse), q, k, (tq, tk, c.off)).unwrap();
    let g = (
        dev.nan_t(tq * h * dn),
        dev.nan_t(tq * h * dr),
        dev.nan_t(tk * h * dn),
        dev.nan_t(tk * kph * dr),
        dev.nan_t(tk * h * dv),
    );
    let scratch = (dev.nan_f(h * tq), dev.nan_f(h * tk * dr));
    let dout = dev.t(&c.dout);
    attention_bwd_seqs(
        &dev.gpu,
        S,
        a,
        split,
        g,
        scratch,
        (dout, out, lse),
        q,
        k,
        (tq, tk, c.off),
    )
    .unwrap();
    Out {
        out: dev.get(out, tq * h * dv, dt),
        lse: dev.get(lse, h * tq, DType::F32),
        dqn: dev.get(g.0, tq * h * dn, dt),
        dqp: dev.get(g.1, tq * h * dr, dt),
        dkn: dev.get(g.2, tk * h * dn, dt),
        dkp: dev.get(g.3, tk * kph * dr, dt),
        dv: dev.get(g.4, tk * h * dv, dt),
    }
}

/// The per-sequence entry points refuse rows that the sequences do not split evenly.
#[test]
fn flash_attention_over_sequences_refuses_uneven_rows() {
    let dev = Dev {
        gpu: HostGpu::new(DType::F32),
        dt: DType::F32,
    };
    let c = case(DType::F32, dims(3, 8, 4, 6, 1), 5, 5, 0, 7);
    let q = (dev.t(&c.qn), dev.t(&c.qp));
    let k = (dev.t(&c.kn), dev.t(&c.kp), dev.t(&c.v));
    let (out, lse) = (dev.nan_t(5 * 3 * 6), dev.nan_f(3 * 5));
    let e = attention_fwd_seqs(&dev.gpu, S, &c.a, (4, 2), (out, lse), q, k, (5, 5, 0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not split into 2 equal blocks"), "{e}");
}
