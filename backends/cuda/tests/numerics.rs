//! Kernel numerics on the CPU: every kernel source, compiled as C++ under the host shim,
//! against the CPU backend's operation (`backends/cpu/src/model.rs`, `tensor.rs`) in f32,
//! and in bf16 (storage) against the same f32 reference at bf16's tolerance.
//!
//! Each test prints `numerics KERNEL DTYPE: max rel err E (tolerance TOL)`; the book's
//! table is `cargo test -p schedc-cuda --test numerics -- --nocapture --test-threads 1`.

use schedc_cpu::model::{self as cpu, Bugs, ModelConfig};
use schedc_cpu::tensor::{self, rel_err, Rng};
use schedc_cuda::api::*;
use schedc_cuda::host::HostGpu;
use schedc_cuda::layout::Dims;
use schedc_cuda::model::{row_block, Model, EMBED_THREADS, ROUTE_THREADS};
use schedc_program::mesh::Mesh;

const S: StreamId = StreamId(0);

/// f32 kernels against the f32 CPU operation: a few roundings apart at most.
const TOL_F32: f64 = 2e-6;
/// bf16 storage (8 bits of mantissa) against the f32 CPU operation.
const TOL_BF16: f64 = 2e-2;

fn tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => TOL_F32,
        DType::Bf16 => TOL_BF16,
    }
}

struct Dev {
    gpu: HostGpu,
    dt: DType,
}

impl Dev {
    fn new(dt: DType) -> Self {
        Dev {
            gpu: HostGpu::new(dt),
            dt,
        }
    }
    /// Storage-type tensor.
    fn t(&self, xs: &[f32]) -> DevPtr {
        let p = self.gpu.alloc(xs.len() * self.dt.size()).unwrap();
        self.gpu.htod(S, p, &encode(self.dt, xs)).unwrap();
        p
    }
    fn f(&self, xs: &[f32]) -> DevPtr {
        let p = self.gpu.alloc(xs.len() * 4).unwrap();
        self.gpu.htod(S, p, &encode(DType::F32, xs)).unwrap();
        p
    }
    fn i(&self, xs: &[i32]) -> DevPtr {
        let p = self.gpu.alloc(xs.len() * 4).unwrap();
        let b: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.gpu.htod(S, p, &b).unwrap();
        p
    }
    fn zt(&self, n: usize) -> DevPtr {
        self.t(&vec![0.0; n])
    }
    fn zf(&self, n: usize) -> DevPtr {
        self.f(&vec![0.0; n])
    }
    fn get_t(&self, p: DevPtr, n: usize) -> Vec<f32> {
        let mut b = vec![0u8; n * self.dt.size()];
        self.gpu.dtoh(S, p, &mut b).unwrap();
        decode(self.dt, &b)
    }
    fn get_f(&self, p: DevPtr, n: usize) -> Vec<f32> {
        let mut b = vec![0u8; n * 4];
        self.gpu.dtoh(S, p, &mut b).unwrap();
        decode(DType::F32, &b)
    }
    fn get_i(&self, p: DevPtr, n: usize) -> Vec<i32> {
        let mut b = vec![0u8; n * 4];
        self.gpu.dtoh(S, p, &mut b).unwrap();
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
    fn go(&self, kernel: &'static str, grid: [u32; 3], block: u32, args: Vec<Arg>) {
        self.gpu
            .launch(
                S,
                &Launch {
                    kernel,
                    grid,
                    block: [block, 1, 1],
                    args,
                },
            )
            .unwrap();
    }
    /// Values as the storage type holds them (the reference's inputs in bf16 runs).
    fn round(&self, xs: &[f32]) -> Vec<f32> {
        decode(self.dt, &encode(self.dt, xs))
    }
}

fn rand(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (scale * rng.uniform()) as f32).collect()
}

fn check(kernel: &str, dt: DType, got: &[f32], want: &[f32]) {
    let e = rel_err(got, want, 1e-6);
    println!(
        "numerics {kernel} {}: max rel err {e:.2e} (tolerance {:.0e})",
        dt.name(),
        tol(dt)
    );
    assert!(
        e <= tol(dt),
        "{kernel} ({}): relative error {e:.3e} over {:.0e}\n got  {:?}\n want {:?}",
        dt.name(),
        tol(dt),
        &got[..got.len().min(8)],
        &want[..want.len().min(8)]
    );
}

fn p(x: DevPtr) -> Arg {
    Arg::Ptr(x)
}
fn i(x: usize) -> Arg {
    Arg::I32(x as i32)
}

const DTYPES: [DType; 2] = [DType::F32, DType::Bf16];

#[test]
fn rmsnorm_forward_backward_and_gain_gradient() {
    for dt in DTYPES {
        let dv = Dev::new(dt);
        let (rows, d, eps) = (5usize, 24usize, 1e-6);
        let mut rng = Rng::new(1);
        let x = dv.round(&rand(&mut rng, rows * d, 1.0));
        let g = dv.round(&rand(&mut rng, d, 1.0));
        let dy = dv.round(&rand(&mut rng, rows * d, 1.0));
        let (wy, wxhat, winv) = cpu::rmsnorm(&x, &g, d, eps);
        let (y, xhat, inv) = (dv.zt(rows * d), dv.zt(rows * d), dv.zf(rows));
        let (px, pg) = (dv.t(&x), dv.t(&g));
        dv.go(
            "rmsnorm_fwd",
            [rows as u32, 1, 1],
            row_block(d),
            vec![
                p(y),
                p(xhat),
                p(inv),
                p(px),
                i(d),
                p(pg),
                i(rows),
                i(d),
                Arg::F32(eps as f32),
            ],
        );
        check("rmsnorm_fwd", dt, &dv.get_t(y, rows * d), &wy);
        check("rmsnorm_fwd (inv)", dt, &dv.get_f(inv, rows), &winv);
        // The backward from the device's own forward values, with a residual.
        let xh = dv.get_t(xhat, rows * d);
        let iv = dv.get_f(inv, rows);
        let resid = dv.round(&rand(&mut rng, rows * d, 1.0));
        let mut want = cpu::rmsnorm_backward(&dy, &g, &xh, &iv, d);
        tensor::add_into(&mut want, &resid);
        let (dx, pdy, pres) = (dv.zt(rows * d), dv.t(&dy), dv.t(&resid));
        dv.go(
            "rmsnorm_bwd",
            [rows as u32, 1, 1],
            row_block(d),
            vec![
                p(dx),
                p(pdy),
                p(pg),
                p(xhat),
                p(inv),
                p(pres),
                i(rows),
                i(d),
            ],
        );
        check("rmsnorm_bwd", dt, &dv.get_t(dx, rows * d), &want);
        let g0 = rand(&mut rng, d, 1.0);
        let mut wdg = g0.clone();
        cpu::rmsnorm_weight_grad(&mut wdg, &dy, &xh, d);
        let dg = dv.f(&g0);
        dv.go(
            "rmsnorm_w",
            [1, 1, 1],
            32,
            vec![p(dg), p(pdy), p(xhat), i(rows), i(d)],
        );
        check("rmsnorm_w", dt, &dv.get_f(dg, d), &wdg);
        let _ = wxhat;
    }
}

#[test]
fn rope_and_its_inverse() {
    for dt in DTYPES {
        let dv = Dev::new(dt);
        let (rows, heads, hd, pos0) = (6usize, 3usize, 8usize, 5usize);
        let d = heads * hd;
        let mut rng = Rng::new(2);
        let x = dv.round(&rand(&mut rng, rows * d, 1.0));
        for inverse in [false, true] {
            let mut want = x.clone();
            cpu::rope(&mut want, heads, hd, pos0, 10000.0, inverse);
            let px = dv.t(&x);
            dv.go(
                "rope",
                [1, 1, 1],
                64,
                vec![
                    p(px),
                    i(d),
                    i(rows),
                    i(heads),
                    i(hd),
                    i(pos0),
                    Arg::F64(10000.0),
                    i(inverse as usize),
                ],
            );
            check(
                if inverse { "rope (inverse)" } else { "rope" },
                dt,
                &dv.get_t(px, rows * d),
                &want,
            );
        }
    }
}

fn dims(cfg: &ModelConfig, dt: DType) -> Dims {
    Dims::new(cfg, &Mesh::pipeline(1), dt).unwrap()
}

#[test]
fn attention_forward_and_backward_with_the_sp_mask_offset() {
    // MLA's attention core (content and RoPE parts, values of their own width), with one
    // RoPE key shared by the heads and, as under the per_head_kpe bug's shapes, one per head.
    for dt in DTYPES {
        for per_head in [false, true] {
            let dv = Dev::new(dt);
            let mut cfg = ModelConfig::tiny(); // 2 heads, d_h 8, d_h^R 4, d_v 8
            cfg.bugs.per_head_kpe = per_head;
            let dm = dims(&cfg, dt);
            let sh = cpu::AttnShape::of(&cfg);
            let h = sh.heads;
            let m = Model {
                gpu: &dv.gpu,
                dims: &dm,
                cfg: &cfg,
                pos0: 0,
                err: dv.i(&[0]),
            };
            let mut rng = Rng::new(3);
            // A query chunk of 4 rows at global positions 4.. over 8 keys (SP chunk 1 of 2).
            let (tq, tk, off) = (4usize, 8usize, 4usize);
            let mut gen = |n: usize| dv.round(&rand(&mut rng, n, 1.0));
            let qn = gen(tq * h * sh.nope);
            let qp = gen(tq * h * sh.rope);
            let kn = gen(tk * h * sh.nope);
            let kp = gen(tk * sh.kpe_width());
            let v = gen(tk * h * sh.v);
            let x = cpu::AttnIn {
                q_nope: &qn,
                q_pe: &qp,
                k_nope: &kn,
                k_pe: &kp,
                v: &v,
            };
            let (wout, wprobs) = cpu::attention(&x, &sh, off, &Bugs::default());
            let (out, lse) = (dv.zt(tq * h * sh.v), dv.zf(h * tq));
            let (pqn, pqp, pkn, pkp, pv) = (dv.t(&qn), dv.t(&qp), dv.t(&kn), dv.t(&kp), dv.t(&v));
            m.attention(S, (out, lse), (pqn, pqp), (pkn, pkp, pv), tq, tk, off)
                .unwrap();
            let tag = if per_head {
                " (a RoPE key per head)"
            } else {
                ""
            };
            check(
                &format!("attn_fwd{tag}"),
                dt,
                &dv.get_t(out, tq * h * sh.v),
                &wout,
            );
            let dout = dv.round(&rand(&mut rng, tq * h * sh.v, 1.0));
            let g = cpu::attention_backward(&dout, &x, &wprobs, &sh);
            let bufs = (
                dv.zt(qn.len()),
                dv.zt(qp.len()),
                dv.zt(kn.len()),
                dv.zt(kp.len()),
                dv.zt(v.len()),
            );
            m.attention_bwd(
                S,
                bufs,
                (dv.zf(h * tq), dv.zf(h * tk * sh.rope)),
                (dv.t(&dout), out, lse),
                (pqn, pqp),
                (pkn, pkp, pv),
                tq,
                tk,
                off,
            )
            .unwrap();
            check(
                &format!("attn_bwd_dq (content){tag}"),
                dt,
                &dv.get_t(bufs.0, qn.len()),
                &g.dq_nope,
            );
            check(
                &format!("attn_bwd_dq (RoPE){tag}"),
                dt,
                &dv.get_t(bufs.1, qp.len()),
                &g.dq_pe,
            );
            check(
                &format!("attn_bwd_dkv (keys){tag}"),
                dt,
                &dv.get_t(bufs.2, kn.len()),
                &g.dk_nope,
            );
            check(
                &format!("attn_bwd_dkv (RoPE keys){tag}"),
                dt,
                &dv.get_t(bufs.3, kp.len()),
                &g.dk_pe,
            );
            check(
                &format!("attn_bwd_dkv (values){tag}"),
                dt,
                &dv.get_t(bufs.4, v.len()),
                &g.dv,
            );
        }
    }
}

#[test]
fn sigmoid_and_swiglu() {
    for dt in DTYPES {
        let dv = Dev::new(dt);
        let mut rng = Rng::new(4);
        let n = 50;
        let z = rand(&mut rng, n, 3.0);
        let s = dv.zf(n);
        dv.go(
            "sigmoid",
            [1, 1, 1],
            32,
            vec![p(s), p(dv.f(&z)), Arg::I64(n as i64)],
        );
        let want: Vec<f32> = z.iter().map(|x| tensor::sigmoid(*x)).collect();
        // The router's scores are f32 in both dtypes.
        check("sigmoid", DType::F32, &dv.get_f(s, n), &want);
        let h1 = dv.round(&rand(&mut rng, n, 2.0));
        let h3 = dv.round(&rand(&mut rng, n, 2.0));
        let da = dv.round(&rand(&mut rng, n, 1.0));
        let act = dv.zt(n);
        let (p1, p3) = (dv.t(&h1), dv.t(&h3));
        dv.go(
            "swiglu_fwd",
            [1, 1, 1],
            32,
            vec![p(act), p(p1), p(p3), Arg::I64(n as i64)],
        );
        let want: Vec<f32> = h1
            .iter()
            .zip(&h3)
            .map(|(a, b)| tensor::silu(*a) * *b)
            .collect();
        check("swiglu_fwd", dt, &dv.get_t(act, n), &want);
        let (dh1, dh3) = (dv.zt(n), dv.zt(n));
        dv.go(
            "swiglu_bwd",
            [1, 1, 1],
            32,
            vec![
                p(dh1),
                p(dh3),
                p(dv.t(&da)),
                p(p1),
                p(p3),
                Arg::I64(n as i64),
            ],
        );
        let w3: Vec<f32> = (0..n).map(|j| da[j] * tensor::silu(h1[j])).collect();
        let w1: Vec<f32> = (0..n)
            .map(|j| da[j] * h3[j] * tensor::silu_grad(h1[j]))
            .collect();
        check("swiglu_bwd (dh1)", dt, &dv.get_t(dh1, n), &w1);
        check("swiglu_bwd (dh3)", dt, &dv.get_t(dh3, n), &w3);
    }
}

#[test]
fn gemms_match_the_cpu_matmuls() {
    for dt in DTYPES {
        let dv = Dev::new(dt);
        let mut rng = Rng::new(5);
        let (m, k, n) = (5usize, 7usize, 3usize);
        let a = dv.round(&rand(&mut rng, m * k, 1.0));
        let b = dv.round(&rand(&mut rng, k * n, 1.0));
        let (pa, pb) = (dv.t(&a), dv.t(&b));
        let c = dv.zf(m * n);
        let g = |m, n, k, a, lda, ta, b, ldb, tb, c, beta| Gemm {
            m,
            n,
            k,
            a,
            lda,
            sa: 0,
            ta,
            b,
            ldb,
            sb: 0,
            tb,
            c,
            ldc: n,
            sc: 0,
            batch: 1,
            alpha: 1.0,
            beta,
            c_f32: true,
        };
        dv.gpu
            .gemm(S, &g(m, n, k, pa, k, false, pb, n, false, c, 0.0))
            .unwrap();
        check(
            "gemm NN",
            DType::F32,
            &dv.get_f(c, m * n),
            &tensor::matmul(&a, &b, m, k, n),
        );
        // C = A Bᵀ with B stored n x k.
        let bt = dv.round(&rand(&mut rng, n * k, 1.0));
        dv.gpu
            .gemm(S, &g(m, n, k, pa, k, false, dv.t(&bt), k, true, c, 0.0))
            .unwrap();
        check(
            "gemm NT",
            DType::F32,
            &dv.get_f(c, m * n),
            &tensor::matmul_bt(&a, &bt, m, k, n),
        );
        // G += Aᵀ B with A stored m x k, B m x n: G is k x n.
        let bb = dv.round(&rand(&mut rng, m * n, 1.0));
        let g0 = rand(&mut rng, k * n, 1.0);
        let pg = dv.f(&g0);
        dv.gpu
            .gemm(S, &g(k, n, m, pa, k, true, dv.t(&bb), n, false, pg, 1.0))
            .unwrap();
        let mut want = g0.clone();
        tensor::add_matmul_at(&mut want, &a, &bb, m, k, n);
        check(
            "gemm TN (accumulate)",
            DType::F32,
            &dv.get_f(pg, k * n),
            &want,
        );
    }
}

fn routing_cfg() -> ModelConfig {
    let mut cfg = ModelConfig::tiny();
    cfg.experts = 6;
    cfg.top_k = 2;
    cfg.capacity_factor = Some(0.7);
    cfg
}

/// What the route kernel returns: experts, gates, z, loads, softmax.
type Routed = (Vec<i32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// Runs the route kernel on `t` tokens.
fn gpu_route(dv: &Dev, cfg: &ModelConfig, logits: &[f32], s: &[f32], bias: &[f32]) -> Routed {
    gpu_route_with(dv, cfg, logits, s, bias, 1)
}

/// [`gpu_route`] with a block of `block` threads.
fn gpu_route_with(
    dv: &Dev,
    cfg: &ModelConfig,
    logits: &[f32],
    s: &[f32],
    bias: &[f32],
    block: u32,
) -> Routed {
    let (e, k) = (cfg.experts, cfg.top_k);
    let t = s.len() / e;
    let (ex, des, gates, z, sm, loads, cnt) = (
        dv.i(&vec![0; t * k]),
        dv.i(&vec![0; t * k]),
        dv.zf(t * k),
        dv.zf(t),
        dv.zf(t * e),
        dv.zf(e),
        dv.i(&vec![0; e]),
    );
    dv.go(
        "route",
        [1, 1, 1],
        block,
        vec![
            p(ex),
            p(des),
            p(gates),
            p(z),
            p(sm),
            p(loads),
            p(cnt),
            p(dv.f(logits)),
            p(dv.f(s)),
            p(dv.f(bias)),
            i(t),
            i(e),
            i(k),
            Arg::I32(cfg.capacity(t).min(i32::MAX as usize) as i32),
            i(cfg.bugs.softmax_gates as usize),
            i(cfg.bugs.drop_overflow as usize),
        ],
    );
    (
        dv.get_i(ex, t * k),
        dv.get_f(gates, t * k),
        dv.get_f(z, t),
        dv.get_f(loads, e),
        dv.get_f(sm, t * e),
    )
}

#[test]
fn routing_with_capacity_and_rerouting_equals_the_cpu() {
    let dv = Dev::new(DType::F32);
    for bugs in [
        Bugs::default(),
        Bugs {
            drop_overflow: true,
            ..Bugs::default()
        },
        Bugs {
            softmax_gates: true,
            ..Bugs::default()
        },
    ] {
        let mut cfg = routing_cfg();
        cfg.bugs = bugs;
        let (t, e) = (12usize, cfg.experts);
        let mut rng = Rng::new(6);
        // Skewed logits: most tokens prefer experts 0 and 1, so capacity re-routes.
        let logits: Vec<f32> = (0..t * e)
            .map(|n| (rng.uniform() + if n % e < 2 { 1.5 } else { 0.0 }) as f32)
            .collect();
        let s: Vec<f32> = logits.iter().map(|z| tensor::sigmoid(*z)).collect();
        let bias: Vec<f32> = (0..e).map(|x| 0.01 * x as f32).collect();
        let r = cpu::route(&cfg, &logits, &s, &bias);
        let (ex, gates, z, loads, _) = gpu_route(&dv, &cfg, &logits, &s, &bias);
        let want_ex: Vec<i32> = r
            .experts
            .iter()
            .map(|&x| if x == usize::MAX { -1 } else { x as i32 })
            .collect();
        assert_eq!(ex, want_ex, "experts under {bugs:?}");
        if !bugs.drop_overflow && !bugs.softmax_gates {
            // The setup does re-route: some token's pick is not its desired expert.
            assert!(r.experts != r.desired, "setup: nothing was re-routed");
        }
        let mut want_loads = vec![0f32; e];
        for &x in &r.desired {
            want_loads[x] += 1.0;
        }
        assert_eq!(loads, want_loads);
        check("route (gates)", DType::F32, &gates, &r.gates);
        check("route (z)", DType::F32, &z, &r.z);
        // The backward of the gates.
        let dg = rand(&mut rng, t * cfg.top_k, 1.0);
        let want = cpu::gate_backward(&cfg, &r, &s, &dg);
        let dl = dv.zt(t * e);
        let (_, _, _, _, sm) = gpu_route(&dv, &cfg, &logits, &s, &bias);
        dv.go(
            "gate_bwd",
            [1, 1, 1],
            32,
            vec![
                p(dl),
                p(dv.f(&dg)),
                p(dv.f(&gates)),
                p(dv.f(&z)),
                p(dv.f(&s)),
                p(dv.f(&sm)),
                p(dv.i(&ex)),
                i(t),
                i(cfg.top_k),
                i(e),
                i(bugs.softmax_gates as usize),
            ],
        );
        check("gate_bwd", DType::F32, &dv.get_t(dl, t * e), &want);
    }
}

#[test]
fn router_update_equals_the_cpu_in_both_orders() {
    let dv = Dev::new(DType::F32);
    for bug in [false, true] {
        let mut cfg = ModelConfig::tiny();
        cfg.bias_rate = 0.1;
        cfg.ema_decay = 0.5;
        cfg.bugs.bias_update_after_routing = bug;
        let e = cfg.experts;
        let mut st = cpu::RouterState::<f32>::new(&cfg);
        let (b, m, rb) = (dv.f(&st.bias), dv.f(&st.ema), dv.f(&st.routing_bias));
        for loads in [
            [3.0f32, 3.0, 1.0, 1.0],
            [0.0, 0.0, 0.0, 0.0],
            [1.0, 5.0, 1.0, 1.0],
        ] {
            st.update(&cfg, &loads);
            dv.go(
                "router_update",
                [1, 1, 1],
                1,
                vec![
                    p(b),
                    p(m),
                    p(rb),
                    p(dv.f(&loads)),
                    i(e),
                    i(1),
                    Arg::F64(0.5),
                    Arg::F64(0.1),
                    i(bug as usize),
                ],
            );
            assert_eq!(dv.get_f(b, e), st.bias);
            assert_eq!(dv.get_f(m, e), st.ema);
            assert_eq!(dv.get_f(rb, e), st.routing_bias);
        }
    }
    println!("numerics router_update f32: bit-identical to RouterState::update");
}

#[test]
fn adam_and_sgd_equal_the_cpu_optimizer() {
    let dv = Dev::new(DType::F32);
    let mut rng = Rng::new(7);
    let n = 40;
    let p0 = rand(&mut rng, n, 1.0);
    let g = rand(&mut rng, n, 1.0);
    let (lr, b1, b2, eps) = (3e-3f64, 0.9f64, 0.999f64, 1e-8f64);
    let (pp, pm, pv, pg) = (dv.f(&p0), dv.zf(n), dv.zf(n), dv.f(&g));
    let mut want = p0.clone();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    for t in 1..=3 {
        let c1 = (1.0 - b1.powi(t)) as f32;
        let c2 = (1.0 - b2.powi(t)) as f32;
        let (b1f, b2f, lrf, epsf) = (b1 as f32, b2 as f32, lr as f32, eps as f32);
        for j in 0..n {
            m[j] = b1f * m[j] + (1.0 - b1f) * g[j];
            v[j] = b2f * v[j] + (1.0 - b2f) * g[j] * g[j];
            want[j] -= lrf * (m[j] / c1) / ((v[j] / c2).sqrt() + epsf);
        }
        dv.go(
            "adam",
            [1, 1, 1],
            32,
            vec![
                p(pp),
                p(pm),
                p(pv),
                p(pg),
                Arg::I64(n as i64),
                Arg::F32(lrf),
                Arg::F32(b1f),
                Arg::F32(b2f),
                Arg::F32(epsf),
                Arg::F32(c1),
                Arg::F32(c2),
            ],
        );
    }
    check("adam", DType::F32, &dv.get_f(pp, n), &want);
    let ps = dv.f(&p0);
    dv.go(
        "sgd",
        [1, 1, 1],
        32,
        vec![p(ps), p(pg), Arg::I64(n as i64), Arg::F32(0.1)],
    );
    let want: Vec<f32> = p0.iter().zip(&g).map(|(x, d)| x - 0.1 * d).collect();
    check("sgd", DType::F32, &dv.get_f(ps, n), &want);
}

#[test]
fn cross_entropy_and_loss_sum() {
    for dt in DTYPES {
        let dv = Dev::new(dt);
        let (t, v, scale) = (3usize, 37usize, 0.125f32);
        let mut rng = Rng::new(8);
        let logits = rand(&mut rng, t * v, 3.0);
        let targets: Vec<u32> = vec![0, 36, 11];
        let (dl, rowloss, loss, err) = (dv.zt(t * v), dv.zf(t), dv.zf(1), dv.i(&[0]));
        let tg = dv.i(&targets.iter().map(|&x| x as i32).collect::<Vec<_>>());
        dv.go(
            "cross_entropy",
            [t as u32, 1, 1],
            row_block(v),
            vec![
                p(dl),
                p(rowloss),
                p(dv.f(&logits)),
                p(tg),
                i(t),
                i(v),
                Arg::F32(scale),
                p(err),
            ],
        );
        dv.go("loss_sum", [1, 1, 1], 1, vec![p(loss), p(rowloss), i(t)]);
        let mut wl = 0f32;
        let mut wd = logits.clone();
        for (r, row) in wd.chunks_mut(v).enumerate() {
            let y = targets[r] as usize;
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = mx + row.iter().map(|z| (z - mx).exp()).sum::<f32>().ln();
            wl += (lse - row[y]) * scale;
            tensor::softmax_row(row);
            row[y] -= 1.0;
            row.iter_mut().for_each(|z| *z *= scale);
        }
        check(
            "cross_entropy + loss_sum (loss)",
            DType::F32,
            &dv.get_f(loss, 1),
            &[wl],
        );
        check("cross_entropy (dlogits)", dt, &dv.get_t(dl, t * v), &wd);
        assert_eq!(dv.get_i(err, 1), vec![0]);
    }
}

#[test]
fn fill_hash_is_the_documented_hash() {
    // The benchmarks' random data: scale * (hash(i, seed) >> 8 / 2^24 * 2 - 1).
    let hash = |i: u32, seed: u32| {
        let mut h = i.wrapping_mul(2654435761) ^ seed;
        h ^= h >> 16;
        h = h.wrapping_mul(0x7feb352d);
        h ^= h >> 15;
        h = h.wrapping_mul(0x846ca68b);
        h ^= h >> 16;
        0.5 * ((h >> 8) as f32 * (2.0 / 16777216.0) - 1.0)
    };
    for dt in DTYPES {
        let dv = Dev::new(dt);
        let n = 1000;
        let x = dv.zt(n);
        dv.go(
            "fill_hash",
            [2, 1, 1],
            64,
            vec![p(x), Arg::I64(n as i64), Arg::U32(42), Arg::F32(0.5)],
        );
        let want: Vec<f32> = dv.round(&(0..n as u32).map(|i| hash(i, 42)).collect::<Vec<_>>());
        let got = dv.get_t(x, n);
        assert_eq!(got, want, "{}", dt.name());
        assert!(got.iter().all(|v| (-0.5..=0.5).contains(v)));
    }
}

/// Issue 24, item 2: `route` and `dispatch_plan` run in one block of `ROUTE_THREADS`
/// threads (parallel over tokens and experts) and `embed_w` over the tokens, not the
/// vocabulary. At the size (sequence 256, 8 experts top 2, hidden 256): routing
/// equals the CPU's exactly (experts, loads) and within 1e-5 (gates, z), with and without
/// capacity re-routing (a round whose proposals overflow runs in token order) and under
/// the injected bugs; the dispatch plan equals the order by (expert, slot); the embedding
/// gradient equals the token-order sum (f32 within 1e-5, bf16 within 1e-2).
#[test]
fn parallel_routing_dispatch_plan_and_embedding_gradient_at_hidden_256_8_experts_seq_256() {
    let dv = Dev::new(DType::F32);
    let (t, e, k) = (256usize, 8usize, 2usize);
    let mut rerouted = 0;
    for (cf, skew, bugs) in [
        (None, 0.0, Bugs::default()),
        (Some(1.0), 1.5, Bugs::default()),
        (Some(0.7), 1.5, Bugs::default()),
        (
            Some(0.7),
            1.5,
            Bugs {
                drop_overflow: true,
                ..Bugs::default()
            },
        ),
        (
            Some(1.2),
            0.3,
            Bugs {
                softmax_gates: true,
                ..Bugs::default()
            },
        ),
    ] {
        let mut cfg = ModelConfig::tiny();
        cfg.hidden = 256;
        cfg.experts = e;
        cfg.top_k = k;
        cfg.capacity_factor = cf;
        cfg.bugs = bugs;
        let mut rng = Rng::new(24);
        let logits: Vec<f32> = (0..t * e)
            .map(|n| (rng.uniform() + if n % e < 2 { skew } else { 0.0 }) as f32)
            .collect();
        let s: Vec<f32> = logits.iter().map(|z| tensor::sigmoid(*z)).collect();
        let bias: Vec<f32> = (0..e).map(|x| 0.01 * x as f32).collect();
        let r = cpu::route(&cfg, &logits, &s, &bias);
        let want_ex: Vec<i32> = r
            .experts
            .iter()
            .map(|&x| if x == usize::MAX { -1 } else { x as i32 })
            .collect();
        if r.experts != r.desired {
            rerouted += 1;
        }
        let mut want_loads = vec![0f32; e];
        for &x in &r.desired {
            want_loads[x] += 1.0;
        }
        for block in [1, 7, ROUTE_THREADS] {
            let (ex, gates, z, loads, _) = gpu_route_with(&dv, &cfg, &logits, &s, &bias, block);
            assert_eq!(ex, want_ex, "experts, {cf:?} {bugs:?}, block {block}");
            assert_eq!(loads, want_loads, "loads, {cf:?}, block {block}");
            check("route (gates)", DType::F32, &gates, &r.gates);
            check("route (z)", DType::F32, &z, &r.z);
        }
        // The dispatch plan of these picks, over ep = 2 members of 4 experts.
        let (per, ep, ns) = (4usize, 2usize, t * k);
        let sb = 16 + 4 * ns;
        let mut want_order: Vec<i32> = Vec::new();
        for x in 0..e as i32 {
            for (i, &y) in want_ex.iter().enumerate() {
                if y == x {
                    want_order.push(i as i32);
                }
            }
        }
        let m = want_order.len();
        want_order.resize(ns, -1);
        let mut want_pos = vec![0i32; ns];
        let mut want_dest = vec![-1i32; ns];
        let mut want_meta = vec![Vec::new(); ep];
        for &i in &want_order[..m] {
            let x = want_ex[i as usize] as usize;
            let q = x / per;
            want_dest[i as usize] = q as i32;
            want_pos[i as usize] = want_meta[q].len() as i32;
            want_meta[q].push(x as i32);
        }
        for block in [1, 5, ROUTE_THREADS] {
            let (order, dest, pos) = (dv.i(&vec![7; ns]), dv.i(&vec![7; ns]), dv.i(&vec![0; ns]));
            let ob = dv.i(&vec![0; ep * sb / 4]);
            dv.go(
                "dispatch_plan",
                [1, 1, 1],
                block,
                vec![
                    p(order),
                    p(dest),
                    p(pos),
                    p(ob),
                    Arg::I64(sb as i64),
                    p(dv.i(&want_ex)),
                    i(ns),
                    i(e),
                    i(per),
                    i(ep),
                ],
            );
            assert_eq!(dv.get_i(order, ns), want_order, "order, block {block}");
            assert_eq!(dv.get_i(dest, ns), want_dest, "destinations, block {block}");
            let got_pos = dv.get_i(pos, ns);
            for i in 0..ns {
                if want_dest[i] >= 0 {
                    assert_eq!(got_pos[i], want_pos[i], "slot {i}'s row, block {block}");
                }
            }
            let box_ = dv.get_i(ob, ep * sb / 4);
            for (q, meta) in want_meta.iter().enumerate() {
                let at = q * sb / 4;
                let c = box_[at] as usize;
                assert_eq!(c, meta.len(), "packet {q}'s count");
                assert_eq!(&box_[at + 4..at + 4 + c], &meta[..], "packet {q}'s experts");
            }
        }
    }
    assert!(
        rerouted >= 2,
        "setup: capacity re-routed in {rerouted} cases"
    );
    // The embedding gradient: a vocabulary of 97 (ids repeat), hidden 256.
    for dt in [DType::F32, DType::Bf16] {
        let dv = Dev::new(dt);
        let (vocab, d) = (97usize, 256usize);
        let mut rng = Rng::new(5);
        let tok: Vec<i32> = (0..t)
            .map(|_| (((rng.uniform() + 1.0) * 0.5 * vocab as f64) as i32).min(vocab as i32 - 1))
            .collect();
        let dx = dv.round(&rand(&mut rng, t * d, 1.0));
        let g0 = rand(&mut rng, vocab * d, 0.1);
        let mut want: Vec<f64> = g0.iter().map(|&x| x as f64).collect();
        for (i, &v) in tok.iter().enumerate() {
            for u in 0..d {
                want[v as usize * d + u] += dx[i * d + u] as f64;
            }
        }
        let g = dv.f(&g0);
        dv.go(
            "embed_w",
            [t as u32, 1, 1],
            EMBED_THREADS,
            vec![p(g), p(dv.t(&dx)), p(dv.i(&tok)), i(t), i(d), i(vocab)],
        );
        let got = dv.get_f(g, vocab * d);
        check(
            "embed_w",
            dt,
            &got,
            &want.iter().map(|&x| x as f32).collect::<Vec<_>>(),
        );
    }
}

/// The one-thread plan of `expert_plan` (its loop before issue 24 made it parallel), as
/// the kernel documents it: `(perm, ecount, src_count, err)`.
fn expert_plan_reference(
    inbox: &[i32],
    slot_ints: usize,
    (ep, rmax, lo, per, cmax): (usize, usize, i32, usize, usize),
) -> (Vec<i32>, Vec<i32>, Vec<i32>, i32) {
    let mut perm = vec![7; ep * rmax];
    let (mut ecount, mut src) = (vec![0i32; per], vec![0i32; ep]);
    let mut err = 0;
    for j in 0..ep {
        let mut c = inbox[j * slot_ints];
        if c < 0 || c as usize > rmax {
            err = err.max(2);
            c = 0;
        }
        src[j] = c;
        for r in 0..c as usize {
            let x = inbox[j * slot_ints + 4 + r] - lo;
            perm[j * rmax + r] = if x < 0 || x as usize >= per {
                err = err.max(3);
                -1
            } else if ecount[x as usize] as usize >= cmax {
                err = err.max(4);
                -1
            } else {
                ecount[x as usize] += 1;
                x * cmax as i32 + ecount[x as usize] - 1
            };
        }
    }
    (perm, ecount, src, err)
}

/// Issue 24, item 2: `expert_plan` in one block of any size (runs of row slots counted per
/// expert, an exclusive scan per expert over the runs, no atomics) gives the one-thread
/// plan exactly: rows of one expert in (source, row) order, with and without capacity
/// overflow, rows for experts not held and a count over its bound; with more local experts
/// than its shared counts hold for the block, thread 0 plans alone.
#[test]
fn parallel_expert_plan_equals_the_one_thread_plan() {
    let dv = Dev::new(DType::F32);
    let mut rng = Rng::new(31);
    let mut cases = 0;
    for (ep, rmax, per, cmax, bad) in [
        (4usize, 300usize, 8usize, 1000usize, false),
        (4, 300, 8, 50, false),
        (2, 513, 4, 200, true),
        (8, 64, 128, 40, true),
    ] {
        let lo = per as i32;
        let slot_ints = 4 + rmax;
        let mut inbox = vec![0i32; ep * slot_ints];
        for j in 0..ep {
            let c = ((rng.uniform() + 1.0) * 0.5 * rmax as f64) as i32;
            inbox[j * slot_ints] = if bad && j == 1 { rmax as i32 + 1 } else { c };
            for r in 0..rmax {
                let u = (rng.uniform() + 1.0) * 0.5;
                let x = lo + (u * per as f64) as i32 % per as i32;
                inbox[j * slot_ints + 4 + r] = if bad && r % 97 == 5 {
                    lo + per as i32
                } else {
                    x
                };
            }
        }
        let geo = (ep, rmax, lo, per, cmax);
        let (want_perm, want_ecount, want_src, want_err) =
            expert_plan_reference(&inbox, slot_ints, geo);
        println!(
            "expert_plan ep {ep} rmax {rmax} per {per} cmax {cmax}: {} rows, at most {} per expert, error word {want_err}",
            want_src.iter().sum::<i32>(),
            want_ecount.iter().max().unwrap_or(&0)
        );
        for block in [1u32, 7, 64, ROUTE_THREADS] {
            let (perm, ecount, src, err) = (
                dv.i(&vec![7; ep * rmax]),
                dv.i(&vec![9; per]),
                dv.i(&vec![9; ep]),
                dv.i(&[0]),
            );
            dv.go(
                "expert_plan",
                [1, 1, 1],
                block,
                vec![
                    p(perm),
                    p(ecount),
                    p(src),
                    p(dv.i(&inbox)),
                    Arg::I64((slot_ints * 4) as i64),
                    i(ep),
                    i(rmax),
                    Arg::I32(lo),
                    i(per),
                    i(cmax),
                    p(err),
                ],
            );
            let what = format!("ep {ep} rmax {rmax} per {per} cmax {cmax}, block {block}");
            assert_eq!(dv.get_i(src, ep), want_src, "source counts, {what}");
            assert_eq!(dv.get_i(ecount, per), want_ecount, "expert counts, {what}");
            let got = dv.get_i(perm, ep * rmax);
            for (j, &c) in want_src.iter().enumerate() {
                let (c, at) = (c as usize, j * rmax);
                assert_eq!(got[at..at + c], want_perm[at..at + c], "source {j}, {what}");
            }
            assert_eq!(dv.get_i(err, 1), vec![want_err], "error word, {what}");
            cases += 1;
        }
        if per == 128 {
            assert!(
                per * ROUTE_THREADS as usize > 8192,
                "setup: thread 0 plans alone"
            );
        }
        if cmax == 50 {
            assert_eq!(want_err, 4, "setup: capacity overflows");
        }
        if bad {
            assert!(want_err >= 3, "setup: rows for experts not held");
        }
    }
    println!("numerics expert_plan: {cases} launches equal the one-thread plan");
}
