//! Part-level numerics: every kernel of a stage program (`F` embed, Q/K/V, attention,
//! experts, combine, head; `B` of each; `W`) run by the CUDA host driver's launch sequences
//! on the host shim, against the CPU backend's `StageKernels` method of the same name, part
//! by part, on one stage holding the whole model (EP and SP groups of one: the all-to-alls
//! hand each packet to the rank itself).

use schedc_cpu::exec::Optimizer;
use schedc_cpu::model::{Grads, ModelConfig, RouterState, StageKernels, StageParams};
use schedc_cpu::tensor::{rel_err, Rng};
use schedc_cuda::api::*;
use schedc_cuda::host::HostGpu;
use schedc_cuda::layout::{Dims, Region};
use schedc_cuda::model::{Io, Model, StageDev};
use schedc_program::mesh::Mesh;
use schedc_program::{LocalStage, Part, Pass};

const S: StreamId = StreamId(0);

fn tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 2e-5,
        DType::Bf16 => 6e-2,
    }
}

struct Run<'a> {
    gpu: &'a HostGpu,
    dims: &'a Dims,
    dt: DType,
    stash: DevPtr,
}

impl Run<'_> {
    fn t(&self, r: Region, n: usize) -> Vec<f32> {
        self.bytes_t(self.stash + r.off as u64, n)
    }
    fn bytes_t(&self, p: DevPtr, n: usize) -> Vec<f32> {
        let mut b = vec![0u8; n * self.dt.size()];
        self.gpu.dtoh(S, p, &mut b).unwrap();
        decode(self.dt, &b)
    }
    fn f(&self, p: DevPtr, n: usize) -> Vec<f32> {
        let mut b = vec![0u8; n * 4];
        self.gpu.dtoh(S, p, &mut b).unwrap();
        decode(DType::F32, &b)
    }
    fn i(&self, p: DevPtr, n: usize) -> Vec<i32> {
        let mut b = vec![0u8; n * 4];
        self.gpu.dtoh(S, p, &mut b).unwrap();
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
    /// Slot 0 of a box: (count, meta, rows as n floats).
    fn slot(&self, bx: Region, n: usize) -> (i32, Vec<i32>, Vec<f32>) {
        let base = self.stash + bx.off as u64;
        let c = self.i(base, 1)[0];
        let meta = self.i(base + 16, c.max(0) as usize);
        (c, meta, self.bytes_t(base + self.dims.rows_off as u64, n))
    }
    /// The all-to-all of a group of one: slot 0 of the outbox to slot 0 of the inbox.
    fn a2a(&self, out: Region, inb: Region) {
        self.gpu
            .dtod(
                S,
                self.stash + inb.off as u64,
                self.stash + out.off as u64,
                self.dims.slot_bytes,
            )
            .unwrap();
    }
}

fn check(what: &str, dt: DType, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let e = rel_err(got, want, 1e-6);
    println!(
        "parts {what} {}: max rel err {e:.2e} (tolerance {:.0e})",
        dt.name(),
        tol(dt)
    );
    assert!(
        e <= tol(dt),
        "{what} ({}): relative error {e:.3e}",
        dt.name()
    );
}

fn stage_roundtrip(cfg: &ModelConfig, dt: DType) {
    let gpu = HostGpu::new(dt);
    let dims = Dims::new(cfg, &Mesh::pipeline(1), dt).unwrap();
    let info = LocalStage {
        stage: 0,
        model_stage: 0,
        direction: 0,
        first: true,
        last: true,
        expert_lo: 0,
        expert_hi: cfg.experts as u32,
        replica_peer: None,
    };
    let opt = Optimizer::Sgd { lr: 0.1 };
    let st = StageDev::new(&gpu, S, cfg, &dims, &info, 1, &opt, 0).unwrap();
    let err = gpu.alloc(4).unwrap();
    gpu.memset(S, err, 4).unwrap();
    let m = Model {
        gpu: &gpu,
        dims: &dims,
        cfg,
        pos0: 0,
        err,
    };
    let stash = gpu.alloc(st.stash.bytes).unwrap();
    let grads = gpu.alloc(st.layout.grads() * 4).unwrap();
    gpu.memset(S, grads, st.layout.grads() * 4).unwrap();
    let loss = gpu.alloc(4).unwrap();
    let mut rng = Rng::new(9);
    let t = cfg.seq_len;
    let tokens: Vec<u32> = (0..t)
        .map(|_| (rng.next_u64() % cfg.vocab as u64) as u32)
        .collect();
    let targets: Vec<u32> = (0..t)
        .map(|_| (rng.next_u64() % cfg.vocab as u64) as u32)
        .collect();
    let scale = 1.0 / t as f64;
    let io = Io {
        stash,
        grads,
        loss,
        tokens: Some((tokens.clone(), targets.clone())),
        scale,
        ..Io::default()
    };
    let r = Run {
        gpu: &gpu,
        dims: &dims,
        dt,
        stash,
    };

    // The CPU reference, in f32, with the same weights.
    let params = StageParams::<f32>::init(cfg, 0, 1, 0, cfg.experts);
    let kern = StageKernels {
        cfg,
        params: &params,
        ep: 1,
        sp: 1,
        pos0: 0,
        route_groups: 1,
        tp: 1,
        tp_rank: 0,
        sequence_parallel: false,
    };
    let routers: Vec<RouterState<f32>> = (0..cfg.layers_per_stage)
        .map(|_| RouterState::new(cfg))
        .collect();
    let mut g = Grads::zeros(cfg, &params);
    let mut cs = kern.new_stash(tokens, targets, scale);
    let (d, sl) = (cfg.hidden, &st.stash);
    let run = |pass, part| m.kernel(S, &st, pass, part, &io).unwrap();

    run(Pass::F, Part::Embed);
    kern.fwd_embed(&mut cs).unwrap();
    check("F embed", dt, &r.t(sl.layers[0].xin, t * d), &cs.x);
    let layers = cfg.layers_per_stage;
    for (l, router) in routers.iter().enumerate() {
        let lu = l as u32;
        run(Pass::F, Part::Qkv { layer: lu });
        kern.fwd_qkv(l, &mut cs);
        check(
            "F qkv (gathered latents and RoPE keys)",
            dt,
            &r.slot(sl.outbox, t * cfg.kv_gather_width()).2,
            &cs.outbox[0].data,
        );
        r.a2a(sl.outbox, sl.inbox);
        cs.inbox = std::mem::take(&mut cs.outbox);
        run(Pass::F, Part::Attn { layer: lu });
        kern.fwd_attn(l, &mut cs, router, &mut g.loads[l]).unwrap();
        let rows = cs.outbox[0].meta.len();
        let (c, meta, data) = r.slot(sl.outbox, rows * d);
        assert_eq!(c as usize, rows, "dispatch row count");
        assert_eq!(
            meta,
            cs.outbox[0]
                .meta
                .iter()
                .map(|&x| x as i32)
                .collect::<Vec<_>>(),
            "dispatch order"
        );
        check("F attn (dispatched rows)", dt, &data, &cs.outbox[0].data);
        r.a2a(sl.outbox, sl.inbox);
        cs.inbox = std::mem::take(&mut cs.outbox);
        run(Pass::F, Part::Experts { layer: lu });
        kern.fwd_experts(l, &mut cs).unwrap();
        check(
            "F experts (outputs)",
            dt,
            &r.slot(sl.outbox, rows * d).2,
            &cs.outbox[0].data,
        );
        r.a2a(sl.outbox, sl.inbox);
        cs.inbox = std::mem::take(&mut cs.outbox);
        run(Pass::F, Part::Combine { layer: lu });
        kern.fwd_combine(l, &mut cs).unwrap();
        let y = if l + 1 < layers {
            sl.layers[l + 1].xin
        } else {
            sl.xout
        };
        check("F combine", dt, &r.t(y, t * d), &cs.x);
    }
    run(Pass::F, Part::Head);
    let want_loss = kern.fwd_head(&mut cs).unwrap();
    check("F head (loss)", dt, &r.f(loss, 1), &[want_loss as f32]);

    run(Pass::B, Part::Head);
    kern.bwd_head(&mut cs).unwrap();
    check("B head", dt, &r.t(sl.gout, t * d), &cs.grad);
    for l in (0..layers).rev() {
        let lu = l as u32;
        run(Pass::B, Part::Combine { layer: lu });
        kern.bwd_combine(l, &mut cs).unwrap();
        let rows = cs.outbox[0].data.len() / d;
        check(
            "B combine (output gradients)",
            dt,
            &r.slot(sl.outbox, rows * d).2,
            &cs.outbox[0].data,
        );
        r.a2a(sl.outbox, sl.inbox);
        cs.inbox = std::mem::take(&mut cs.outbox);
        run(Pass::B, Part::Experts { layer: lu });
        kern.bwd_experts(l, &mut cs).unwrap();
        check(
            "B experts (input gradients)",
            dt,
            &r.slot(sl.outbox, rows * d).2,
            &cs.outbox[0].data,
        );
        r.a2a(sl.outbox, sl.inbox);
        cs.inbox = std::mem::take(&mut cs.outbox);
        run(Pass::B, Part::Attn { layer: lu });
        kern.bwd_attn(l, &mut cs).unwrap();
        check(
            "B attn (latent and RoPE-key gradients)",
            dt,
            &r.slot(sl.outbox, t * cfg.kv_gather_width()).2,
            &cs.outbox[0].data,
        );
        r.a2a(sl.outbox, sl.inbox);
        cs.inbox = std::mem::take(&mut cs.outbox);
        run(Pass::B, Part::Qkv { layer: lu });
        kern.bwd_qkv(l, &mut cs).unwrap();
        check("B qkv", dt, &r.t(sl.layers[l].dx, t * d), &cs.grad);
    }
    run(Pass::W, Part::Weights);
    kern.weights(&cs, &mut g.params).unwrap();
    let got = r.f(grads, st.layout.grads());
    let mut worst = (0.0f64, String::new());
    g.params.visit(&mut |name, _, want| {
        let tsr = st.layout.get(name).unwrap();
        let e = rel_err(&got[tsr.grad..tsr.grad + tsr.len], want, 1e-6);
        if e >= worst.0 {
            worst = (e, name.to_string());
        }
    });
    println!(
        "parts W (worst tensor {}) {}: max rel err {:.2e} (tolerance {:.0e})",
        worst.1,
        dt.name(),
        worst.0,
        tol(dt)
    );
    assert!(worst.0 <= tol(dt), "W: {} off by {:.3e}", worst.1, worst.0);
    let loads: Vec<f32> = g.loads.concat();
    assert_eq!(
        &got[st.layout.dense..st.layout.dense + st.layout.loads],
        &loads[..],
        "load counts"
    );
    assert_eq!(r.i(err, 1), vec![0], "no kernel reported an error");
}

#[test]
fn a_stage_equals_the_cpu_part_by_part_f32() {
    let mut cfg = ModelConfig::tiny();
    cfg.capacity_factor = Some(0.6);
    stage_roundtrip(&cfg, DType::F32);
}

#[test]
fn two_layers_without_a_shared_expert_f32() {
    let mut cfg = ModelConfig::tiny();
    cfg.layers_per_stage = 2;
    cfg.shared_expert = false;
    cfg.capacity_factor = None;
    stage_roundtrip(&cfg, DType::F32);
}

#[test]
fn a_stage_in_bf16_is_within_bf16_tolerance() {
    let cfg = ModelConfig::tiny();
    stage_roundtrip(&cfg, DType::Bf16);
}
