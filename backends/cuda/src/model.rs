//! The MoE transformer on a [`Gpu`]: for every kernel of the per-rank program (`F`, `B`,
//! `W` of a stage's parts), the launches and GEMMs that compute what the CPU backend's
//! `StageKernels` computes (`backends/cpu/src/model.rs` documents the architecture and
//! the formulas; the comments here name the CPU function each sequence mirrors).
//!
//! A stage copy's state on the device is a [`StageDev`]: the parameters (an `f32` master
//! copy and, in bf16, a compute copy), Adam's moments and the routers' balancing state.
//! A `(stage, micro-batch)` keeps everything between its forward and its weight gradient
//! in its `stash` buffer ([`StashLayout`]).

use crate::api::*;
use crate::layout::*;
use schedc_cpu::exec::Optimizer;
use schedc_cpu::model::{RouterState, StageParams};
use schedc_program::{LocalStage, ModelConfig, Part, Pass};

/// Threads per block of elementwise kernels.
pub const BLOCK: u32 = 256;

fn p(x: DevPtr) -> Arg {
    Arg::Ptr(x)
}
fn i(x: usize) -> Arg {
    Arg::I32(x as i32)
}
fn n64(x: usize) -> Arg {
    Arg::I64(x as i64)
}

/// A power-of-two block for a row of `n` elements (32..=256).
pub fn row_block(n: usize) -> u32 {
    (n.next_power_of_two() as u32).clamp(32, 256)
}

/// The parameters and state of one stage copy on the device.
#[derive(Clone, Debug)]
pub struct StageDev {
    /// The stage as the program describes it.
    pub info: LocalStage,
    /// Where its tensors are.
    pub layout: ParamLayout,
    /// Its stash's regions.
    pub stash: StashLayout,
    /// `f32` master parameters, `[dense | expert]`.
    pub master: DevPtr,
    /// The compute copy read by the kernels (the master itself in f32).
    pub weights: DevPtr,
    /// Adam's first moments (0 for SGD).
    pub adam_m: DevPtr,
    /// Adam's second moments (0 for SGD).
    pub adam_v: DevPtr,
    /// Per layer, `E` selection biases.
    pub bias: DevPtr,
    /// Per layer, `E` load EMAs.
    pub ema: DevPtr,
    /// Per layer, the bias routing uses.
    pub routing_bias: DevPtr,
    /// Optimizer steps taken.
    pub opt_t: u32,
}

impl StageDev {
    /// Allocates and initializes stage copy `info` (weights by name, as the CPU backend's
    /// `StageParams::init`; balancing state as `RouterState::new`). `s`: the stream of the
    /// uploads.
    pub fn new(
        gpu: &dyn Gpu,
        s: StreamId,
        cfg: &ModelConfig,
        dims: &Dims,
        info: &LocalStage,
        model_stages: usize,
        opt: &Optimizer,
    ) -> Result<StageDev, GpuError> {
        let params = StageParams::<f32>::init(
            cfg,
            info.model_stage as usize,
            model_stages,
            info.expert_lo as usize,
            info.expert_hi as usize,
        );
        let layout = ParamLayout::of(&params, cfg.experts);
        let mut flat = params.flatten(schedc_cpu::model::Scope::Dense);
        flat.extend(params.flatten(schedc_cpu::model::Scope::Expert));
        let n = flat.len();
        let master = gpu.alloc(n * 4)?;
        gpu.htod(s, master, &encode(DType::F32, &flat))?;
        let weights = if dims.dtype == DType::F32 {
            master
        } else {
            let w = gpu.alloc(n * dims.ts)?;
            gpu.htod(s, w, &encode(dims.dtype, &flat))?;
            w
        };
        let (adam_m, adam_v) = match opt {
            Optimizer::Adam { .. } => {
                let m = gpu.alloc(n * 4)?;
                let v = gpu.alloc(n * 4)?;
                gpu.memset(s, m, n * 4)?;
                gpu.memset(s, v, n * 4)?;
                (m, v)
            }
            Optimizer::Sgd { .. } => (0, 0),
        };
        let le = dims.layers * cfg.experts;
        let r = RouterState::<f32>::new(cfg);
        let rep = |v: &Vec<f32>| -> Vec<f32> { (0..dims.layers).flat_map(|_| v.clone()).collect() };
        let mut state = Vec::new();
        for v in [&r.bias, &r.ema, &r.routing_bias] {
            let ptr = gpu.alloc(le * 4)?;
            gpu.htod(s, ptr, &encode(DType::F32, &rep(v)))?;
            state.push(ptr);
        }
        Ok(StageDev {
            info: info.clone(),
            layout,
            stash: StashLayout::new(dims, info),
            master,
            weights,
            adam_m,
            adam_v,
            bias: state[0],
            ema: state[1],
            routing_bias: state[2],
            opt_t: 0,
        })
    }

    /// Releases the device memory.
    pub fn release(&self, gpu: &dyn Gpu) -> Result<(), GpuError> {
        let mut ptrs = vec![self.master, self.bias, self.ema, self.routing_bias];
        if self.weights != self.master {
            ptrs.push(self.weights);
        }
        if self.adam_m != 0 {
            ptrs.extend([self.adam_m, self.adam_v]);
        }
        for q in ptrs {
            gpu.free(q)?;
        }
        Ok(())
    }

    /// Bytes of parameters and optimizer state held.
    pub fn bytes(&self, dims: &Dims) -> usize {
        let n = self.layout.params();
        let mut b = n * 4 + 3 * dims.layers * dims.e * 4;
        if self.weights != self.master {
            b += n * dims.ts;
        }
        if self.adam_m != 0 {
            b += 2 * n * 4;
        }
        b
    }
}

/// The buffers one kernel of the program touches besides its stash.
#[derive(Clone, Debug, Default)]
pub struct Io {
    /// The stash of `(stage, mb)`.
    pub stash: DevPtr,
    /// The stage's `weight_grad` (f32, `[dense | loads | expert]`).
    pub grads: DevPtr,
    /// `act(prev, mb)` read by the first layer's forward (non-first stages).
    pub act_in: Option<DevPtr>,
    /// `act(stage, mb)` written by the last layer's forward (non-last stages).
    pub act_out: Option<DevPtr>,
    /// `grad(next, mb)` read by the last layer's backward (non-last stages).
    pub grad_in: Option<DevPtr>,
    /// `grad(stage, mb)` written by the first layer's backward (non-first stages).
    pub grad_out: Option<DevPtr>,
    /// Where the micro-batch's loss goes (last stage's forward head).
    pub loss: DevPtr,
    /// Tokens and targets of the micro-batch (uploaded by its first forward kernel).
    pub tokens: Option<(Vec<u32>, Vec<u32>)>,
    /// The loss scale `1/N`.
    pub scale: f64,
}

/// What the kernels of one rank need: the device, the sizes, the model, the compute
/// stream, the rank's error word and its position in the SP group.
pub struct Model<'a> {
    /// The device.
    pub gpu: &'a dyn Gpu,
    /// Sizes.
    pub dims: &'a Dims,
    /// The model.
    pub cfg: &'a ModelConfig,
    /// Global position of the rank's first token (`sp_rank * t`).
    pub pos0: usize,
    /// The rank's error word (kernels set it on bad input).
    pub err: DevPtr,
}

impl Model<'_> {
    fn go(
        &self,
        s: StreamId,
        kernel: &'static str,
        grid: [u32; 3],
        block: u32,
        args: Vec<Arg>,
    ) -> Result<(), GpuError> {
        self.gpu.launch(
            s,
            &Launch {
                kernel,
                grid,
                block: [block, 1, 1],
                args,
            },
        )
    }

    /// A grid-stride kernel over `n` elements.
    fn ew(
        &self,
        s: StreamId,
        kernel: &'static str,
        n: usize,
        args: Vec<Arg>,
    ) -> Result<(), GpuError> {
        let blocks = n.div_ceil(BLOCK as usize).clamp(1, 4096) as u32;
        self.go(s, kernel, [blocks, 1, 1], BLOCK, args)
    }

    /// A one-thread kernel.
    fn one(&self, s: StreamId, kernel: &'static str, args: Vec<Arg>) -> Result<(), GpuError> {
        self.go(s, kernel, [1, 1, 1], 1, args)
    }

    /// `C = op(A) op(B)` (+ `C` when `acc`), row-major, one matrix.
    #[allow(clippy::too_many_arguments)]
    fn mm(
        &self,
        s: StreamId,
        (m, n, k): (usize, usize, usize),
        a: DevPtr,
        ta: bool,
        b: DevPtr,
        tb: bool,
        c: DevPtr,
        acc: bool,
        c_f32: bool,
    ) -> Result<(), GpuError> {
        self.gpu.gemm(
            s,
            &Gemm {
                m,
                n,
                k,
                a,
                lda: if ta { m } else { k },
                sa: 0,
                ta,
                b,
                ldb: if tb { k } else { n },
                sb: 0,
                tb,
                c,
                ldc: n,
                sc: 0,
                batch: 1,
                alpha: 1.0,
                beta: if acc { 1.0 } else { 0.0 },
                c_f32,
            },
        )
    }

    /// The batched form of [`Model::mm`] over the local experts: batch strides `sa`, `sb`,
    /// `sc` in elements.
    #[allow(clippy::too_many_arguments)]
    fn bmm(
        &self,
        s: StreamId,
        (m, n, k): (usize, usize, usize),
        (a, sa, ta): (DevPtr, usize, bool),
        (b, sb, tb): (DevPtr, usize, bool),
        (c, sc): (DevPtr, usize),
        acc: bool,
        c_f32: bool,
    ) -> Result<(), GpuError> {
        self.gpu.gemm(
            s,
            &Gemm {
                m,
                n,
                k,
                a,
                lda: if ta { m } else { k },
                sa,
                ta,
                b,
                ldb: if tb { k } else { n },
                sb,
                tb,
                c,
                ldc: n,
                sc,
                batch: self.dims.per,
                alpha: 1.0,
                beta: if acc { 1.0 } else { 0.0 },
                c_f32,
            },
        )
    }

    fn add(&self, s: StreamId, y: DevPtr, a: DevPtr, b: DevPtr, n: usize) -> Result<(), GpuError> {
        self.ew(s, "add", n, vec![p(y), p(a), p(b), n64(n)])
    }

    fn rmsnorm(
        &self,
        s: StreamId,
        (y, xhat, inv): (DevPtr, DevPtr, DevPtr),
        x: DevPtr,
        g: DevPtr,
        rows: usize,
    ) -> Result<(), GpuError> {
        let d = self.dims.d;
        self.go(
            s,
            "rmsnorm_fwd",
            [rows as u32, 1, 1],
            row_block(d),
            vec![
                p(y),
                p(xhat),
                p(inv),
                p(x),
                i(d),
                p(g),
                i(rows),
                i(d),
                Arg::F32(self.cfg.norm_eps as f32),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_bwd(
        &self,
        s: StreamId,
        dx: DevPtr,
        dy: DevPtr,
        g: DevPtr,
        xhat: DevPtr,
        inv: DevPtr,
        resid: DevPtr,
        rows: usize,
    ) -> Result<(), GpuError> {
        let d = self.dims.d;
        self.go(
            s,
            "rmsnorm_bwd",
            [rows as u32, 1, 1],
            row_block(d),
            vec![p(dx), p(dy), p(g), p(xhat), p(inv), p(resid), i(rows), i(d)],
        )
    }

    fn rmsnorm_w(
        &self,
        s: StreamId,
        dg: DevPtr,
        dy: DevPtr,
        xhat: DevPtr,
        rows: usize,
    ) -> Result<(), GpuError> {
        let d = self.dims.d;
        self.ew(
            s,
            "rmsnorm_w",
            d,
            vec![p(dg), p(dy), p(xhat), i(rows), i(d)],
        )
    }

    fn rope(&self, s: StreamId, x: DevPtr, rows: usize, inverse: bool) -> Result<(), GpuError> {
        let dm = self.dims;
        self.ew(
            s,
            "rope",
            rows * dm.heads * dm.hd / 2,
            vec![
                p(x),
                i(dm.d),
                i(rows),
                i(dm.heads),
                i(dm.hd),
                i(self.pos0),
                Arg::F64(self.cfg.rope_base),
                i(inverse as usize),
            ],
        )
    }

    /// The causal mask's offset: the global position of the rank's first query (0 under
    /// the injected `local_causal_mask` bug).
    pub fn mask_offset(&self) -> usize {
        if self.cfg.bugs.local_causal_mask {
            0
        } else {
            self.pos0
        }
    }

    fn scale(&self) -> f32 {
        (1.0 / (self.dims.hd as f64).sqrt()) as f32
    }

    /// The attention core: `out`, `probs` from rotated `q` (t rows) over gathered `kg`,
    /// `vg` (tk rows); mirrors the CPU backend's `attention`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        s: StreamId,
        out: DevPtr,
        probs: DevPtr,
        q: DevPtr,
        kg: DevPtr,
        vg: DevPtr,
        tq: usize,
        tk: usize,
        q_offset: usize,
    ) -> Result<(), GpuError> {
        let dm = self.dims;
        let (d, h, hd) = (dm.d, dm.heads, dm.hd);
        self.go(
            s,
            "attn_fwd",
            [tq as u32, h as u32, 1],
            row_block(tk),
            vec![
                p(out),
                i(d),
                p(probs),
                p(q),
                i(d),
                p(0),
                i(0),
                p(kg),
                i(d),
                p(0),
                i(0),
                i(1),
                p(vg),
                i(d),
                i(tq),
                i(tk),
                i(h),
                i(hd),
                i(0),
                i(hd),
                i(q_offset),
                Arg::F32(self.scale()),
            ],
        )
    }

    /// The attention core's backward: `dq` (t rows), `dkg`, `dvg` (tk rows) from `dout`;
    /// mirrors `attention_backward`. `ds`: scratch `H x tq x tk` floats.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_bwd(
        &self,
        s: StreamId,
        (dq, dkg, dvg, ds): (DevPtr, DevPtr, DevPtr, DevPtr),
        dout: DevPtr,
        q: DevPtr,
        kg: DevPtr,
        vg: DevPtr,
        probs: DevPtr,
        tq: usize,
        tk: usize,
    ) -> Result<(), GpuError> {
        let dm = self.dims;
        let (d, h, hd) = (dm.d, dm.heads, dm.hd);
        self.go(
            s,
            "attn_bwd_ds",
            [tq as u32, h as u32, 1],
            row_block(tk),
            vec![
                p(ds),
                p(probs),
                p(dout),
                i(d),
                p(vg),
                i(d),
                i(tq),
                i(tk),
                i(h),
                i(hd),
                Arg::F32(self.scale()),
            ],
        )?;
        self.ew(
            s,
            "attn_bwd_dq",
            tq * h * hd,
            vec![
                p(dq),
                i(d),
                p(0),
                i(0),
                p(ds),
                p(kg),
                i(d),
                p(0),
                i(0),
                i(1),
                i(tq),
                i(tk),
                i(h),
                i(hd),
                i(0),
            ],
        )?;
        self.ew(
            s,
            "attn_bwd_dkv",
            tk * 2 * d,
            vec![
                p(dkg),
                i(d),
                p(0),
                i(0),
                p(dvg),
                i(d),
                p(ds),
                p(probs),
                p(q),
                i(d),
                p(0),
                i(0),
                p(dout),
                i(d),
                i(1),
                i(tq),
                i(tk),
                i(h),
                i(hd),
                i(0),
                i(hd),
            ],
        )
    }

    fn slot(&self, base: DevPtr, j: usize) -> DevPtr {
        base + (j * self.dims.slot_bytes) as u64
    }
    fn rows(&self, base: DevPtr, j: usize) -> DevPtr {
        self.slot(base, j) + self.dims.rows_off as u64
    }

    /// Runs the kernel `(pass, part)` of stage copy `st` on stream `s`: the launches that
    /// compute what the CPU backend's kernel of the same name computes.
    pub fn kernel(
        &self,
        s: StreamId,
        st: &StageDev,
        pass: Pass,
        part: Part,
        io: &Io,
    ) -> Result<(), GpuError> {
        match (pass, part) {
            (Pass::F, Part::Embed) => self.f_embed(s, st, io),
            (Pass::F, Part::Qkv { layer }) => self.f_qkv(s, st, layer as usize, io),
            (Pass::F, Part::Attn { layer }) => self.f_attn(s, st, layer as usize, io),
            (Pass::F, Part::Experts { layer }) => self.f_experts(s, st, layer as usize, io),
            (Pass::F, Part::Combine { layer }) => self.f_combine(s, st, layer as usize, io),
            (Pass::F, Part::Head) => self.f_head(s, st, io),
            (Pass::B, Part::Head) => self.b_head(s, st, io),
            (Pass::B, Part::Combine { layer }) => self.b_combine(s, st, layer as usize, io),
            (Pass::B, Part::Experts { layer }) => self.b_experts(s, st, layer as usize, io),
            (Pass::B, Part::Attn { layer }) => self.b_attn(s, st, layer as usize, io),
            (Pass::B, Part::Qkv { layer }) => self.b_qkv(s, st, layer as usize, io),
            (Pass::W, Part::Weights) => self.w_weights(s, st, io),
            (pass, part) => Err(GpuError(format!("no kernel {pass:?} {part:?}"))),
        }
    }

    fn w(&self, st: &StageDev, name: &str) -> Result<DevPtr, GpuError> {
        let t = st.layout.get(name).map_err(GpuError)?;
        Ok(st.weights + (t.param * self.dims.ts) as u64)
    }
    fn g(&self, st: &StageDev, io: &Io, name: &str) -> Result<DevPtr, GpuError> {
        let t = st.layout.get(name).map_err(GpuError)?;
        Ok(io.grads + (t.grad * 4) as u64)
    }
    fn lname(&self, st: &StageDev, l: usize, what: &str) -> String {
        format!(
            "layer{}.{what}",
            st.info.model_stage as usize * self.dims.layers + l
        )
    }
    fn at(&self, io: &Io, r: Region) -> DevPtr {
        io.stash + r.off as u64
    }

    fn upload_tokens(&self, s: StreamId, st: &StageDev, io: &Io) -> Result<(), GpuError> {
        if let Some((tok, tgt)) = &io.tokens {
            let bytes =
                |v: &Vec<u32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
            if !tok.is_empty() {
                self.gpu
                    .htod(s, self.at(io, st.stash.tokens), &bytes(tok))?;
            }
            if !tgt.is_empty() {
                self.gpu
                    .htod(s, self.at(io, st.stash.targets), &bytes(tgt))?;
            }
        }
        Ok(())
    }

    /// F, embedding (`fwd_embed`).
    fn f_embed(&self, s: StreamId, st: &StageDev, io: &Io) -> Result<(), GpuError> {
        self.upload_tokens(s, st, io)?;
        let dm = self.dims;
        let x = self.at(io, st.stash.layers[0].xin);
        self.ew(
            s,
            "embed_fwd",
            dm.t * dm.d,
            vec![
                p(x),
                p(self.w(st, "embed")?),
                p(self.at(io, st.stash.tokens)),
                i(dm.t),
                i(dm.d),
                i(dm.vocab),
                p(self.err),
            ],
        )
    }

    /// F, norm, Q/K/V, RoPE, and the keys and values into every SP member's slot
    /// (`fwd_qkv`).
    fn f_qkv(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d) = (dm.t, dm.d);
        let r = &st.stash.layers[l];
        let x = self.at(io, r.xin);
        if l == 0 {
            if let Some(input) = io.act_in {
                self.upload_tokens(s, st, io)?;
                self.gpu.dtod(s, x, input, dm.act_bytes())?;
            }
        }
        let (a, q, k, v) = (
            self.at(io, r.a),
            self.at(io, r.q),
            self.at(io, r.kloc),
            self.at(io, r.vloc),
        );
        self.rmsnorm(
            s,
            (a, self.at(io, r.xhat1), self.at(io, r.inv1)),
            x,
            self.w(st, &self.lname(st, l, "norm1"))?,
            t,
        )?;
        self.mm(
            s,
            (t, d, d),
            a,
            false,
            self.w(st, &self.lname(st, l, "wq"))?,
            false,
            q,
            false,
            false,
        )?;
        self.mm(
            s,
            (t, d, d),
            a,
            false,
            self.w(st, &self.lname(st, l, "wk"))?,
            false,
            k,
            false,
            false,
        )?;
        self.mm(
            s,
            (t, d, d),
            a,
            false,
            self.w(st, &self.lname(st, l, "wv"))?,
            false,
            v,
            false,
            false,
        )?;
        self.rope(s, q, t, false)?;
        self.rope(s, k, t, false)?;
        let ob = self.at(io, st.stash.outbox);
        let n = dm.act_bytes();
        for j in 0..dm.sp {
            self.gpu.dtod(s, self.rows(ob, j), k, n)?;
            self.gpu.dtod(s, self.rows(ob, j) + n as u64, v, n)?;
        }
        Ok(())
    }

    /// F, attention over the gathered keys and values, output projection, residual, norm,
    /// router, and the dispatch packets (`fwd_attn`).
    fn f_attn(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, e, k) = (dm.t, dm.d, dm.e, dm.k);
        let r = &st.stash.layers[l];
        let ib = self.at(io, st.stash.inbox);
        let n = dm.act_bytes();
        let (kg, vg) = (self.at(io, r.kg), self.at(io, r.vg));
        for j in 0..dm.sp {
            self.gpu.dtod(s, kg + (j * n) as u64, self.rows(ib, j), n)?;
            self.gpu
                .dtod(s, vg + (j * n) as u64, self.rows(ib, j) + n as u64, n)?;
        }
        let (o, h1) = (self.at(io, r.o), self.at(io, r.h1));
        self.attention(
            s,
            o,
            self.at(io, r.probs),
            self.at(io, r.q),
            kg,
            vg,
            t,
            dm.tk,
            self.mask_offset(),
        )?;
        self.mm(
            s,
            (t, d, d),
            o,
            false,
            self.w(st, &self.lname(st, l, "wo"))?,
            false,
            h1,
            false,
            false,
        )?;
        self.add(s, h1, h1, self.at(io, r.xin), t * d)?;
        let n2 = self.at(io, r.n2);
        self.rmsnorm(
            s,
            (n2, self.at(io, r.xhat2), self.at(io, r.inv2)),
            h1,
            self.w(st, &self.lname(st, l, "norm2"))?,
            t,
        )?;
        let (logits, sc) = (self.at(io, r.logits), self.at(io, r.s));
        self.mm(
            s,
            (t, e, d),
            n2,
            false,
            self.w(st, &self.lname(st, l, "router"))?,
            false,
            logits,
            false,
            true,
        )?;
        self.ew(s, "sigmoid", t * e, vec![p(sc), p(logits), n64(t * e)])?;
        let loads = io.grads + (st.layout.loads_of(l, e) * 4) as u64;
        let bugs = &self.cfg.bugs;
        self.one(
            s,
            "route",
            vec![
                p(self.at(io, r.experts)),
                p(self.at(io, r.desired)),
                p(self.at(io, r.gates)),
                p(self.at(io, r.z)),
                p(self.at(io, r.softmax)),
                p(loads),
                p(self.at(io, r.cnt)),
                p(logits),
                p(sc),
                p(st.routing_bias + (l * e * 4) as u64),
                i(t),
                i(e),
                i(k),
                Arg::I32(dm.cap),
                i(bugs.softmax_gates as usize),
                i(bugs.drop_overflow as usize),
            ],
        )?;
        let ob = self.at(io, st.stash.outbox);
        self.one(
            s,
            "dispatch_plan",
            vec![
                p(self.at(io, r.order)),
                p(self.at(io, r.slot_dest)),
                p(self.at(io, r.slot_pos)),
                p(ob),
                n64(dm.slot_bytes),
                p(self.at(io, r.experts)),
                i(t * k),
                i(e),
                i(dm.per),
                i(dm.ep),
            ],
        )?;
        self.ew(
            s,
            "dispatch_pack",
            t * k * d,
            vec![
                p(ob),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(n2),
                p(self.at(io, r.slot_dest)),
                p(self.at(io, r.slot_pos)),
                i(t * k),
                i(k),
                i(d),
            ],
        )
    }

    /// The stride between consecutive local experts' tensors, and the first expert's
    /// `w1`, `w3`, `w2` (offsets in elements of the parameter vector).
    fn experts_at(&self, st: &StageDev, l: usize) -> Result<(usize, [usize; 3]), GpuError> {
        let x0 = st.info.expert_lo as usize;
        let name = |w: &str| format!("{}.{w}", self.lname(st, l, &format!("expert{x0}")));
        let get = |w: &str| st.layout.get(&name(w)).map(|t| t.param).map_err(GpuError);
        let (d, f) = (self.dims.d, self.dims.f);
        Ok((3 * d * f, [get("w1")?, get("w3")?, get("w2")?]))
    }

    /// F, the local experts on the received rows (`fwd_experts`): rows into per-expert
    /// blocks, `h1 = X W1`, `h3 = X W3`, `act = silu(h1) h3`, `y = act W2` as batched GEMMs
    /// over the local experts, outputs back in the order received.
    fn f_experts(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (d, f, cm) = (dm.d, dm.f, dm.cmax);
        let r = &st.stash.layers[l];
        let (ib, ob) = (self.at(io, st.stash.inbox), self.at(io, st.stash.outbox));
        let (perm, cnt) = (self.at(io, r.perm), self.at(io, r.src_count));
        self.one(
            s,
            "expert_plan",
            vec![
                p(perm),
                p(self.at(io, r.ecount)),
                p(cnt),
                p(ib),
                n64(dm.slot_bytes),
                i(dm.ep),
                i(dm.rmax),
                i(st.info.expert_lo as usize),
                i(dm.per),
                i(cm),
                p(self.err),
            ],
        )?;
        let xe = self.at(io, r.xe);
        self.gpu.memset(s, xe, r.xe.bytes)?;
        self.ew(
            s,
            "expert_gather",
            dm.ep * dm.rmax * d,
            vec![
                p(xe),
                p(ib),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(perm),
                p(cnt),
                i(dm.ep),
                i(dm.rmax),
                i(d),
            ],
        )?;
        let (stride, [w1, w3, w2]) = self.experts_at(st, l)?;
        let wp = |o: usize| st.weights + (o * dm.ts) as u64;
        let (h1e, h3e, ae, ye) = (
            self.at(io, r.h1e),
            self.at(io, r.h3e),
            self.at(io, r.ae),
            self.at(io, r.ye),
        );
        self.bmm(
            s,
            (cm, f, d),
            (xe, cm * d, false),
            (wp(w1), stride, false),
            (h1e, cm * f),
            false,
            false,
        )?;
        self.bmm(
            s,
            (cm, f, d),
            (xe, cm * d, false),
            (wp(w3), stride, false),
            (h3e, cm * f),
            false,
            false,
        )?;
        let n = dm.per * cm * f;
        self.ew(s, "swiglu_fwd", n, vec![p(ae), p(h1e), p(h3e), n64(n)])?;
        self.bmm(
            s,
            (cm, d, f),
            (ae, cm * f, false),
            (wp(w2), stride, false),
            (ye, cm * d),
            false,
            false,
        )?;
        self.ew(
            s,
            "expert_scatter",
            dm.ep * dm.rmax * d,
            vec![
                p(ob),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(ye),
                p(perm),
                p(cnt),
                i(dm.ep),
                i(dm.rmax),
                i(d),
            ],
        )
    }

    /// A SwiGLU FFN on `x` (`rows x d`) with the dense tensors `prefix.w1/w3/w2`
    /// (`ffn_forward`): `h1`, `h3`, `act` kept, output into `y`.
    #[allow(clippy::too_many_arguments)]
    fn ffn(
        &self,
        s: StreamId,
        st: &StageDev,
        prefix: &str,
        x: DevPtr,
        rows: usize,
        (h1, h3, act): (DevPtr, DevPtr, DevPtr),
        y: DevPtr,
    ) -> Result<(), GpuError> {
        let (d, f) = (self.dims.d, self.dims.f);
        self.mm(
            s,
            (rows, f, d),
            x,
            false,
            self.w(st, &format!("{prefix}.w1"))?,
            false,
            h1,
            false,
            false,
        )?;
        self.mm(
            s,
            (rows, f, d),
            x,
            false,
            self.w(st, &format!("{prefix}.w3"))?,
            false,
            h3,
            false,
            false,
        )?;
        let n = rows * f;
        self.ew(s, "swiglu_fwd", n, vec![p(act), p(h1), p(h3), n64(n)])?;
        self.mm(
            s,
            (rows, d, f),
            act,
            false,
            self.w(st, &format!("{prefix}.w2"))?,
            false,
            y,
            false,
            false,
        )
    }

    /// F, combine (`fwd_combine`): the gated sum of the expert outputs, the shared expert,
    /// the residual; the stage output also into `act(stage, mb)`.
    fn f_combine(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, k) = (dm.t, dm.d, dm.k);
        let r = &st.stash.layers[l];
        let y = if l + 1 < dm.layers {
            self.at(io, st.stash.layers[l + 1].xin)
        } else {
            self.at(io, st.stash.xout)
        };
        let ib = self.at(io, st.stash.inbox);
        self.ew(
            s,
            "combine_fwd",
            t * d,
            vec![
                p(y),
                p(self.at(io, r.eo)),
                p(self.at(io, r.h1)),
                p(ib),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(self.at(io, r.slot_dest)),
                p(self.at(io, r.slot_pos)),
                p(self.at(io, r.gates)),
                i(t),
                i(k),
                i(d),
            ],
        )?;
        if dm.shared {
            let ys = self.at(io, r.sh_y);
            self.ffn(
                s,
                st,
                &self.lname(st, l, "shared"),
                self.at(io, r.n2),
                t,
                (
                    self.at(io, r.sh_h1),
                    self.at(io, r.sh_h3),
                    self.at(io, r.sh_act),
                ),
                ys,
            )?;
            self.add(s, y, y, ys, t * d)?;
        }
        if l + 1 == dm.layers {
            if let Some(out) = io.act_out {
                self.gpu.dtod(s, out, y, dm.act_bytes())?;
            }
        }
        Ok(())
    }

    /// F, final norm, LM head, cross-entropy (`fwd_head`); the micro-batch's loss into
    /// `io.loss`.
    fn f_head(&self, s: StreamId, st: &StageDev, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, v) = (dm.t, dm.d, dm.vocab);
        let sl = &st.stash;
        let xf = self.at(io, sl.xf);
        self.rmsnorm(
            s,
            (xf, self.at(io, sl.xhatf), self.at(io, sl.invf)),
            self.at(io, sl.xout),
            self.w(st, "final_norm")?,
            t,
        )?;
        let logits = self.at(io, sl.logits);
        self.mm(
            s,
            (t, v, d),
            xf,
            false,
            self.w(st, "head")?,
            false,
            logits,
            false,
            true,
        )?;
        let rowloss = self.at(io, sl.rowloss);
        self.go(
            s,
            "cross_entropy",
            [t as u32, 1, 1],
            row_block(v),
            vec![
                p(self.at(io, sl.dlogits)),
                p(rowloss),
                p(logits),
                p(self.at(io, sl.targets)),
                i(t),
                i(v),
                Arg::F32(io.scale as f32),
                p(self.err),
            ],
        )?;
        self.one(s, "loss_sum", vec![p(io.loss), p(rowloss), i(t)])
    }

    /// B, LM head and final norm (`bwd_head`).
    fn b_head(&self, s: StreamId, st: &StageDev, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, v) = (dm.t, dm.d, dm.vocab);
        let sl = &st.stash;
        let dxf = self.at(io, sl.dxf);
        self.mm(
            s,
            (t, d, v),
            self.at(io, sl.dlogits),
            false,
            self.w(st, "head")?,
            true,
            dxf,
            false,
            false,
        )?;
        self.rmsnorm_bwd(
            s,
            self.at(io, sl.gout),
            dxf,
            self.w(st, "final_norm")?,
            self.at(io, sl.xhatf),
            self.at(io, sl.invf),
            0,
            t,
        )
    }

    /// The gradient w.r.t. layer `l`'s output.
    fn dy(&self, st: &StageDev, l: usize, io: &Io) -> DevPtr {
        if l + 1 < self.dims.layers {
            self.at(io, st.stash.layers[l + 1].dx)
        } else {
            self.at(io, st.stash.gout)
        }
    }

    /// B, combine (`bwd_combine`): output gradients to the experts, the gates' gradients,
    /// the shared expert's backward.
    fn b_combine(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, k, f) = (dm.t, dm.d, dm.k, dm.f);
        let r = &st.stash.layers[l];
        if l + 1 == dm.layers {
            if let Some(g) = io.grad_in {
                self.gpu
                    .dtod(s, self.at(io, st.stash.gout), g, dm.act_bytes())?;
            }
        }
        let dy = self.dy(st, l, io);
        let ob = self.at(io, st.stash.outbox);
        let (dest, pos) = (self.at(io, r.slot_dest), self.at(io, r.slot_pos));
        self.ew(
            s,
            "combine_bwd_pack",
            t * k * d,
            vec![
                p(ob),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(dy),
                p(self.at(io, r.gates)),
                p(dest),
                p(pos),
                i(t * k),
                i(k),
                i(d),
            ],
        )?;
        self.ew(
            s,
            "combine_bwd_dgate",
            t * k,
            vec![
                p(self.at(io, r.dgates)),
                p(dy),
                p(self.at(io, r.eo)),
                p(dest),
                i(t * k),
                i(k),
                i(d),
            ],
        )?;
        let dn2 = self.at(io, r.dn2);
        if dm.shared {
            let pre = self.lname(st, l, "shared");
            let (da, dh1, dh3) = (
                self.at(io, r.sh_da),
                self.at(io, r.sh_dh1),
                self.at(io, r.sh_dh3),
            );
            self.mm(
                s,
                (t, f, d),
                dy,
                false,
                self.w(st, &format!("{pre}.w2"))?,
                true,
                da,
                false,
                false,
            )?;
            let n = t * f;
            self.ew(
                s,
                "swiglu_bwd",
                n,
                vec![
                    p(dh1),
                    p(dh3),
                    p(da),
                    p(self.at(io, r.sh_h1)),
                    p(self.at(io, r.sh_h3)),
                    n64(n),
                ],
            )?;
            self.mm(
                s,
                (t, d, f),
                dh1,
                false,
                self.w(st, &format!("{pre}.w1"))?,
                true,
                dn2,
                false,
                false,
            )?;
            self.mm(
                s,
                (t, d, f),
                dh3,
                false,
                self.w(st, &format!("{pre}.w3"))?,
                true,
                dn2,
                true,
                false,
            )?;
        } else {
            self.gpu.memset(s, dn2, r.dn2.bytes)?;
        }
        Ok(())
    }

    /// B, the local experts (`bwd_experts`): input gradients of the received rows.
    fn b_experts(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (d, f, cm) = (dm.d, dm.f, dm.cmax);
        let r = &st.stash.layers[l];
        let (ib, ob) = (self.at(io, st.stash.inbox), self.at(io, st.stash.outbox));
        let (perm, cnt) = (self.at(io, r.perm), self.at(io, r.src_count));
        let dye = self.at(io, r.dye);
        self.gpu.memset(s, dye, r.dye.bytes)?;
        self.ew(
            s,
            "expert_gather",
            dm.ep * dm.rmax * d,
            vec![
                p(dye),
                p(ib),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(perm),
                p(cnt),
                i(dm.ep),
                i(dm.rmax),
                i(d),
            ],
        )?;
        let (stride, [w1, w3, w2]) = self.experts_at(st, l)?;
        let wp = |o: usize| st.weights + (o * dm.ts) as u64;
        let (dae, dh1e, dh3e, dxe) = (
            self.at(io, r.dae),
            self.at(io, r.dh1e),
            self.at(io, r.dh3e),
            self.at(io, r.dxe),
        );
        self.bmm(
            s,
            (cm, f, d),
            (dye, cm * d, false),
            (wp(w2), stride, true),
            (dae, cm * f),
            false,
            false,
        )?;
        let n = dm.per * cm * f;
        self.ew(
            s,
            "swiglu_bwd",
            n,
            vec![
                p(dh1e),
                p(dh3e),
                p(dae),
                p(self.at(io, r.h1e)),
                p(self.at(io, r.h3e)),
                n64(n),
            ],
        )?;
        self.bmm(
            s,
            (cm, d, f),
            (dh1e, cm * f, false),
            (wp(w1), stride, true),
            (dxe, cm * d),
            false,
            false,
        )?;
        self.bmm(
            s,
            (cm, d, f),
            (dh3e, cm * f, false),
            (wp(w3), stride, true),
            (dxe, cm * d),
            true,
            false,
        )?;
        self.ew(
            s,
            "expert_scatter",
            dm.ep * dm.rmax * d,
            vec![
                p(ob),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(dxe),
                p(perm),
                p(cnt),
                i(dm.ep),
                i(dm.rmax),
                i(d),
            ],
        )
    }

    /// B, dispatch, router, norm, output projection, attention (`bwd_attn`): the key and
    /// value gradients of every SP member's chunk into its slot.
    fn b_attn(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, k, e) = (dm.t, dm.d, dm.k, dm.e);
        let r = &st.stash.layers[l];
        let ib = self.at(io, st.stash.inbox);
        let dn2 = self.at(io, r.dn2);
        self.ew(
            s,
            "dispatch_bwd",
            t * d,
            vec![
                p(dn2),
                p(ib),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(self.at(io, r.experts)),
                p(self.at(io, r.slot_dest)),
                p(self.at(io, r.slot_pos)),
                i(t),
                i(k),
                i(d),
            ],
        )?;
        let dlr = self.at(io, r.dlr);
        self.ew(
            s,
            "gate_bwd",
            t,
            vec![
                p(dlr),
                p(self.at(io, r.dgates)),
                p(self.at(io, r.gates)),
                p(self.at(io, r.z)),
                p(self.at(io, r.s)),
                p(self.at(io, r.softmax)),
                p(self.at(io, r.experts)),
                i(t),
                i(k),
                i(e),
                i(self.cfg.bugs.softmax_gates as usize),
            ],
        )?;
        self.mm(
            s,
            (t, d, e),
            dlr,
            false,
            self.w(st, &self.lname(st, l, "router"))?,
            true,
            dn2,
            true,
            false,
        )?;
        let dh1 = self.at(io, r.dh1);
        self.rmsnorm_bwd(
            s,
            dh1,
            dn2,
            self.w(st, &self.lname(st, l, "norm2"))?,
            self.at(io, r.xhat2),
            self.at(io, r.inv2),
            self.dy(st, l, io),
            t,
        )?;
        let doh = self.at(io, r.doh);
        self.mm(
            s,
            (t, d, d),
            dh1,
            false,
            self.w(st, &self.lname(st, l, "wo"))?,
            true,
            doh,
            false,
            false,
        )?;
        let (dkg, dvg) = (self.at(io, r.dkg), self.at(io, r.dvg));
        self.attention_bwd(
            s,
            (self.at(io, r.dq), dkg, dvg, self.at(io, r.ds)),
            doh,
            self.at(io, r.q),
            self.at(io, r.kg),
            self.at(io, r.vg),
            self.at(io, r.probs),
            t,
            dm.tk,
        )?;
        let ob = self.at(io, st.stash.outbox);
        let n = dm.act_bytes();
        for j in 0..dm.sp {
            self.gpu
                .dtod(s, self.rows(ob, j), dkg + (j * n) as u64, n)?;
            self.gpu
                .dtod(s, self.rows(ob, j) + n as u64, dvg + (j * n) as u64, n)?;
        }
        Ok(())
    }

    /// B, Q/K/V and norm (`bwd_qkv`): sums the local chunk's key and value gradients over
    /// the SP group, rotates back, and the layer input's gradient.
    fn b_qkv(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d) = (dm.t, dm.d);
        let r = &st.stash.layers[l];
        let ib = self.at(io, st.stash.inbox);
        let (dq, dk, dv, da) = (
            self.at(io, r.dq),
            self.at(io, r.dk),
            self.at(io, r.dv),
            self.at(io, r.da),
        );
        let n = t * d;
        for (y, off) in [(dk, dm.rows_off), (dv, dm.rows_off + dm.act_bytes())] {
            self.ew(
                s,
                "sum_slots",
                n,
                vec![p(y), p(ib), n64(dm.slot_bytes), n64(off), i(dm.sp), n64(n)],
            )?;
        }
        self.rope(s, dq, t, true)?;
        self.rope(s, dk, t, true)?;
        self.mm(
            s,
            (t, d, d),
            dq,
            false,
            self.w(st, &self.lname(st, l, "wq"))?,
            true,
            da,
            false,
            false,
        )?;
        self.mm(
            s,
            (t, d, d),
            dk,
            false,
            self.w(st, &self.lname(st, l, "wk"))?,
            true,
            da,
            true,
            false,
        )?;
        self.mm(
            s,
            (t, d, d),
            dv,
            false,
            self.w(st, &self.lname(st, l, "wv"))?,
            true,
            da,
            true,
            false,
        )?;
        let dx = self.at(io, r.dx);
        self.rmsnorm_bwd(
            s,
            dx,
            da,
            self.w(st, &self.lname(st, l, "norm1"))?,
            self.at(io, r.xhat1),
            self.at(io, r.inv1),
            self.at(io, r.dh1),
            t,
        )?;
        if l == 0 {
            if let Some(g) = io.grad_out {
                self.gpu.dtod(s, g, dx, dm.act_bytes())?;
            }
        }
        Ok(())
    }

    /// W: every weight gradient of the stage added to `weight_grad` (`weights`).
    fn w_weights(&self, s: StreamId, st: &StageDev, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, e, f, v) = (dm.t, dm.d, dm.e, dm.f, dm.vocab);
        let sl = &st.stash;
        if st.info.first {
            self.ew(
                s,
                "embed_w",
                v * d,
                vec![
                    p(self.g(st, io, "embed")?),
                    p(self.at(io, sl.layers[0].dx)),
                    p(self.at(io, sl.tokens)),
                    i(t),
                    i(d),
                    i(v),
                ],
            )?;
        }
        for (li, r) in sl.layers.iter().enumerate() {
            let g = |w: &str| self.g(st, io, &self.lname(st, li, w));
            let at = |x: Region| self.at(io, x);
            self.rmsnorm_w(s, g("norm1")?, at(r.da), at(r.xhat1), t)?;
            self.mm(
                s,
                (d, d, t),
                at(r.a),
                true,
                at(r.dq),
                false,
                g("wq")?,
                true,
                true,
            )?;
            self.mm(
                s,
                (d, d, t),
                at(r.a),
                true,
                at(r.dk),
                false,
                g("wk")?,
                true,
                true,
            )?;
            self.mm(
                s,
                (d, d, t),
                at(r.a),
                true,
                at(r.dv),
                false,
                g("wv")?,
                true,
                true,
            )?;
            self.mm(
                s,
                (d, d, t),
                at(r.o),
                true,
                at(r.dh1),
                false,
                g("wo")?,
                true,
                true,
            )?;
            self.rmsnorm_w(s, g("norm2")?, at(r.dn2), at(r.xhat2), t)?;
            self.mm(
                s,
                (d, e, t),
                at(r.n2),
                true,
                at(r.dlr),
                false,
                g("router")?,
                true,
                true,
            )?;
            if dm.shared {
                let dy = self.dy(st, li, io);
                self.mm(
                    s,
                    (d, f, t),
                    at(r.n2),
                    true,
                    at(r.sh_dh1),
                    false,
                    g("shared.w1")?,
                    true,
                    true,
                )?;
                self.mm(
                    s,
                    (d, f, t),
                    at(r.n2),
                    true,
                    at(r.sh_dh3),
                    false,
                    g("shared.w3")?,
                    true,
                    true,
                )?;
                self.mm(
                    s,
                    (f, d, t),
                    at(r.sh_act),
                    true,
                    dy,
                    false,
                    g("shared.w2")?,
                    true,
                    true,
                )?;
            }
            let (stride, [w1, w3, w2]) = self.experts_at(st, li)?;
            let nl = st.layout.loads;
            let gp = |o: usize| io.grads + ((o + nl) * 4) as u64;
            let cm = dm.cmax;
            self.bmm(
                s,
                (d, f, cm),
                (at(r.xe), cm * d, true),
                (at(r.dh1e), cm * f, false),
                (gp(w1), stride),
                true,
                true,
            )?;
            self.bmm(
                s,
                (d, f, cm),
                (at(r.xe), cm * d, true),
                (at(r.dh3e), cm * f, false),
                (gp(w3), stride),
                true,
                true,
            )?;
            self.bmm(
                s,
                (f, d, cm),
                (at(r.ae), cm * f, true),
                (at(r.dye), cm * d, false),
                (gp(w2), stride),
                true,
                true,
            )?;
        }
        if st.info.last {
            self.mm(
                s,
                (d, v, t),
                self.at(io, sl.xf),
                true,
                self.at(io, sl.dlogits),
                false,
                self.g(st, io, "head")?,
                true,
                true,
            )?;
            self.rmsnorm_w(
                s,
                self.g(st, io, "final_norm")?,
                self.at(io, sl.dxf),
                self.at(io, sl.xhatf),
                t,
            )?;
        }
        Ok(())
    }

    /// The optimizer step of stage copy `st` with its summed gradients (`optimizer_step`
    /// and `RouterState::update` of the CPU backend), then the compute copy in bf16.
    pub fn optimizer_step(
        &self,
        s: StreamId,
        st: &mut StageDev,
        grads: DevPtr,
        opt: &Optimizer,
    ) -> Result<(), GpuError> {
        let lay = &st.layout;
        st.opt_t += 1;
        // [dense | expert] parameters against [dense | loads | expert] gradients.
        let parts = [
            (0usize, 0usize, lay.dense),
            (lay.dense, lay.dense + lay.loads, lay.expert),
        ];
        for (po, go, n) in parts {
            if n == 0 {
                continue;
            }
            let (pp, gp) = (st.master + (po * 4) as u64, grads + (go * 4) as u64);
            match *opt {
                Optimizer::Sgd { lr } => {
                    self.ew(s, "sgd", n, vec![p(pp), p(gp), n64(n), Arg::F32(lr as f32)])?
                }
                Optimizer::Adam {
                    lr,
                    beta1,
                    beta2,
                    eps,
                } => {
                    let c1 = (1.0 - beta1.powi(st.opt_t as i32)) as f32;
                    let c2 = (1.0 - beta2.powi(st.opt_t as i32)) as f32;
                    self.ew(
                        s,
                        "adam",
                        n,
                        vec![
                            p(pp),
                            p(st.adam_m + (po * 4) as u64),
                            p(st.adam_v + (po * 4) as u64),
                            p(gp),
                            n64(n),
                            Arg::F32(lr as f32),
                            Arg::F32(beta1 as f32),
                            Arg::F32(beta2 as f32),
                            Arg::F32(eps as f32),
                            Arg::F32(c1),
                            Arg::F32(c2),
                        ],
                    )?
                }
            }
        }
        let dm = self.dims;
        self.ew(
            s,
            "router_update",
            dm.layers,
            vec![
                p(st.bias),
                p(st.ema),
                p(st.routing_bias),
                p(grads + (lay.dense * 4) as u64),
                i(dm.e),
                i(dm.layers),
                Arg::F64(self.cfg.ema_decay),
                Arg::F64(self.cfg.bias_rate),
                i(self.cfg.bugs.bias_update_after_routing as usize),
            ],
        )?;
        if st.weights != st.master {
            let n = lay.params();
            self.ew(
                s,
                "cast_master",
                n,
                vec![p(st.weights), p(st.master), n64(n)],
            )?;
        }
        Ok(())
    }
}
