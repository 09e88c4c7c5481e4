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

/// Threads of the one block of `route` and `dispatch_plan` (parallel over tokens and
/// experts; any size gives the same result).
pub const ROUTE_THREADS: u32 = 256;

/// Threads per block of `embed_w` (a block per token, a thread per column).
pub const EMBED_THREADS: u32 = 256;

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
    /// Its tensors resolved once at load, by position (the launch sequences look nothing
    /// up by name).
    pub tensors: Resolved,
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
    /// `StageParams::init`, TP member `tp_rank`'s slices of the split ones; balancing state
    /// as `RouterState::new`). `s`: the stream of the uploads.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &dyn Gpu,
        s: StreamId,
        cfg: &ModelConfig,
        dims: &Dims,
        info: &LocalStage,
        model_stages: usize,
        opt: &Optimizer,
        tp_rank: usize,
    ) -> Result<StageDev, GpuError> {
        let mut params = StageParams::<f32>::init(
            cfg,
            info.model_stage as usize,
            model_stages,
            info.expert_lo as usize,
            info.expert_hi as usize,
        );
        // Tensor parallelism: this member's slice of every split tensor (the CPU backend's
        // `tp_split`), so that the kernels run on `H / tp` heads and `f / tp` shared units.
        params.shard_tp(cfg, tp_rank, dims.tp);
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
        let g0 = info.model_stage as usize * dims.layers;
        let tensors = layout.resolve(g0..g0 + dims.layers, info.expert_lo as usize);
        Ok(StageDev {
            info: info.clone(),
            layout,
            tensors,
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
    /// `Some(scratch)`: the forward kernel runs as a recompute (the IR's `RECOMPUTE(s,m)`,
    /// `Pass::Recompute`), whose only effect is the stash: the router's load counts go to
    /// `scratch` (`layers x experts` f32 of the stage, never read) instead of the
    /// `weight_grad` buffer, and the loss is not summed into `loss`, so that neither counts
    /// twice.
    pub recompute: Option<DevPtr>,
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
    /// Global position of the rank's chunk's first token (`sp_rank * tc`; with Megatron
    /// sequence parallelism this member's shard starts [`Dims::shard0`] rows later).
    pub pos0: usize,
    /// The rank's error word (kernels set it on bad input).
    pub err: DevPtr,
}

/// Query rows (and key rows) of one attention tile (`ATT_BQ`, `ATT_BK` in
/// `kernels/prelude.cuh`).
pub const ATT_TILE: usize = 16;
/// Threads per block of the attention kernels (`ATT_THREADS`).
pub const ATT_THREADS: u32 = 128;
/// The largest `d_h + d_h^R` (content plus RoPE part of a query or key head) the attention
/// kernels take (`ATT_DQK`).
pub const ATT_MAX_QK: usize = 192;
/// The largest value head `d_v` the attention kernels take (`ATT_DV`).
pub const ATT_MAX_V: usize = 128;

/// The shape of an attention call: `heads` heads whose queries and keys have a content
/// part of `dn` and a RoPE part of `dr` values (`dr = 0`: none), values of `dv`; `kph`
/// RoPE keys per token (1: shared by every head, MLA; `heads`: one per head); the softmax
/// `scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDims {
    /// Heads (this rank's).
    pub heads: usize,
    /// Content dimension per head.
    pub dn: usize,
    /// RoPE dimension per head (0: no RoPE part).
    pub dr: usize,
    /// Value dimension per head.
    pub dv: usize,
    /// RoPE keys per token: 1 or `heads`.
    pub kph: usize,
    /// Softmax scale.
    pub scale: f32,
}

impl AttnDims {
    /// Checks the head dimensions against the kernels' tiles. Errors: `dn + dr` over
    /// [`ATT_MAX_QK`] or `dv` over [`ATT_MAX_V`] (or zero).
    pub fn check(&self) -> Result<(), GpuError> {
        if self.dn + self.dr == 0
            || self.dn + self.dr > ATT_MAX_QK
            || self.dv == 0
            || self.dv > ATT_MAX_V
        {
            return Err(GpuError(format!(
                "attention head dimensions d_h {} + d_h^R {}, d_v {}: the CUDA attention kernels take d_h + d_h^R from 1 to {ATT_MAX_QK} and d_v from 1 to {ATT_MAX_V}",
                self.dn, self.dr, self.dv
            )));
        }
        Ok(())
    }
}

fn launch(
    gpu: &dyn Gpu,
    s: StreamId,
    kernel: &'static str,
    grid: [u32; 3],
    block: u32,
    args: Vec<Arg>,
) -> Result<(), GpuError> {
    gpu.launch(
        s,
        &Launch {
            kernel,
            grid,
            block: [block, 1, 1],
            args,
        },
    )
}

fn tiles(n: usize) -> u32 {
    n.div_ceil(ATT_TILE).max(1) as u32
}

fn grid_stride(n: usize) -> [u32; 3] {
    [n.div_ceil(BLOCK as usize).clamp(1, 4096) as u32, 1, 1]
}

/// Causal attention in tiles, FlashAttention-2's forward (`attn_fwd`): `out` (`tq x heads
/// dv`, storage type) and `lse` (`heads x tq` floats, each row's log-sum-exp of its scaled
/// scores: all that the backward keeps) from the queries' content and RoPE parts (`tq`
/// rows of `heads dn` and `heads dr`), the keys' content parts (`tk x heads dn`), RoPE keys
/// (`tk x kph dr`) and values (`tk x heads dv`); query `i` sees the keys
/// `j <= q_offset + i`. `(tq, tk, q_offset)`. Errors: the shape ([`AttnDims::check`]) or
/// the launch.
pub fn attention_fwd(
    gpu: &dyn Gpu,
    s: StreamId,
    a: &AttnDims,
    (out, lse): (DevPtr, DevPtr),
    (q_nope, q_pe): (DevPtr, DevPtr),
    (k_nope, k_pe, v): (DevPtr, DevPtr, DevPtr),
    (tq, tk, q_offset): (usize, usize, usize),
) -> Result<(), GpuError> {
    a.check()?;
    let (h, dn, dr, dv) = (a.heads, a.dn, a.dr, a.dv);
    launch(
        gpu,
        s,
        "attn_fwd",
        [tiles(tq), h as u32, 1],
        ATT_THREADS,
        vec![
            p(out),
            i(h * dv),
            p(lse),
            p(q_nope),
            i(h * dn),
            p(q_pe),
            i(h * dr),
            p(k_nope),
            i(h * dn),
            p(k_pe),
            i(a.kph * dr),
            i(a.kph),
            p(v),
            i(h * dv),
            i(tq),
            i(tk),
            i(h),
            i(dn),
            i(dr),
            i(dv),
            i(q_offset),
            Arg::F32(a.scale),
        ],
    )
}

/// The backward of [`attention_fwd`] in tiles (FlashAttention-2's backward, the
/// probabilities recomputed from `lse`, no `tq x tk` buffer): `attn_bwd_delta` (`delta_i =
/// dout_i . out_i`), `attn_bwd_dq` (a block per query tile), `attn_bwd_dkv` (a block per
/// key tile and head; the RoPE key's gradient per head into `dkp_part`) and `attn_bwd_dkp`
/// (summed over the heads sharing a RoPE key). `grads`: `(dq_nope, dq_pe, dk_nope, dk_pe,
/// dv)`, shaped as the inputs; `scratch`: `(delta, dkp_part)` of `heads x tq` and
/// `heads x tk x dr` floats; `fwd`: `(dout, out, lse)`. Errors: as [`attention_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    gpu: &dyn Gpu,
    s: StreamId,
    a: &AttnDims,
    (dq_nope, dq_pe, dk_nope, dk_pe, dv_): (DevPtr, DevPtr, DevPtr, DevPtr, DevPtr),
    (delta, dkp_part): (DevPtr, DevPtr),
    (dout, out, lse): (DevPtr, DevPtr, DevPtr),
    (q_nope, q_pe): (DevPtr, DevPtr),
    (k_nope, k_pe, v): (DevPtr, DevPtr, DevPtr),
    (tq, tk, q_offset): (usize, usize, usize),
) -> Result<(), GpuError> {
    a.check()?;
    let (h, dn, dr, dv, kph) = (a.heads, a.dn, a.dr, a.dv, a.kph);
    let kw = kph * dr;
    launch(
        gpu,
        s,
        "attn_bwd_delta",
        grid_stride(tq * h),
        BLOCK,
        vec![
            p(delta),
            p(dout),
            i(h * dv),
            p(out),
            i(h * dv),
            i(tq),
            i(h),
            i(dv),
        ],
    )?;
    let tail = |mut head: Vec<Arg>| {
        head.extend([
            p(dout),
            i(h * dv),
            p(q_nope),
            i(h * dn),
            p(q_pe),
            i(h * dr),
            p(k_nope),
            i(h * dn),
            p(k_pe),
            i(kw),
            i(kph),
            p(v),
            i(h * dv),
            i(tq),
            i(tk),
            i(h),
            i(dn),
            i(dr),
            i(dv),
            i(q_offset),
            Arg::F32(a.scale),
        ]);
        head
    };
    launch(
        gpu,
        s,
        "attn_bwd_dq",
        [tiles(tq), h as u32, 1],
        ATT_THREADS,
        tail(vec![
            p(dq_nope),
            i(h * dn),
            p(dq_pe),
            i(h * dr),
            p(lse),
            p(delta),
        ]),
    )?;
    launch(
        gpu,
        s,
        "attn_bwd_dkv",
        [tiles(tk), h as u32, 1],
        ATT_THREADS,
        tail(vec![
            p(dk_nope),
            i(h * dn),
            p(dkp_part),
            p(dv_),
            i(h * dv),
            p(lse),
            p(delta),
        ]),
    )?;
    if kw > 0 {
        launch(
            gpu,
            s,
            "attn_bwd_dkp",
            grid_stride(tk * kw),
            BLOCK,
            vec![p(dk_pe), i(kw), p(dkp_part), i(kph), i(tk), i(h), i(dr)],
        )?;
    }
    Ok(())
}

/// Byte offsets of sequence `j` of `seqs` in the buffers of an attention call of `tq`
/// query and `tk` key rows: `(q, k)` is the row blocks' offsets for storage elements of
/// `ts` bytes, as a function of a row width; `f(q)`, `f(k)`: of `heads x rows` float blocks.
struct SeqOffsets {
    tq: usize,
    tk: usize,
    j: usize,
    ts: usize,
}

impl SeqOffsets {
    /// Query-row block of width `w` elements.
    fn q(&self, w: usize) -> u64 {
        (self.j * self.tq * w * self.ts) as u64
    }
    /// Key-row block of width `w` elements.
    fn k(&self, w: usize) -> u64 {
        (self.j * self.tk * w * self.ts) as u64
    }
    /// A float block of `w` floats per query row (`lse`, `delta`: `heads` per row).
    fn fq(&self, w: usize) -> u64 {
        (self.j * self.tq * w * 4) as u64
    }
    /// A float block of `w` floats per key row (`dkp_part`: `heads dr` per row).
    fn fk(&self, w: usize) -> u64 {
        (self.j * self.tk * w * 4) as u64
    }
}

/// [`attention_fwd`] over a micro-batch of `seqs` sequences (`--micro-batch-size`),
/// block-diagonal: the `tq` query rows and the `tk` key rows are `seqs` equal blocks, one
/// per sequence, and sequence `j`'s queries attend causally (at `q_offset`) to its own
/// keys only; one launch per sequence on slices of the buffers. `lse` is the sequences'
/// `heads x tq/seqs` blocks one after the other. `ts`: bytes of the storage type. Errors:
/// rows that `seqs` does not divide, or as [`attention_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd_seqs(
    gpu: &dyn Gpu,
    s: StreamId,
    a: &AttnDims,
    (ts, seqs): (usize, usize),
    (out, lse): (DevPtr, DevPtr),
    (q_nope, q_pe): (DevPtr, DevPtr),
    (k_nope, k_pe, v): (DevPtr, DevPtr, DevPtr),
    (tq, tk, q_offset): (usize, usize, usize),
) -> Result<(), GpuError> {
    let seqs = split_rows(tq, tk, seqs)?;
    let (h, dn, dr, dv, kw) = (a.heads, a.dn, a.dr, a.dv, a.kph * a.dr);
    let (tq, tk) = (tq / seqs, tk / seqs);
    for j in 0..seqs {
        let o = SeqOffsets { tq, tk, j, ts };
        attention_fwd(
            gpu,
            s,
            a,
            (out + o.q(h * dv), lse + o.fq(h)),
            (q_nope + o.q(h * dn), q_pe + o.q(h * dr)),
            (k_nope + o.k(h * dn), k_pe + o.k(kw), v + o.k(h * dv)),
            (tq, tk, q_offset),
        )?;
    }
    Ok(())
}

/// The backward of [`attention_fwd_seqs`]: [`attention_bwd`] per sequence on slices of
/// the buffers (`delta` and `dkp_part` as the sequences' `heads x tq/seqs` and
/// `heads x tk/seqs x dr` float blocks one after the other). Errors: as
/// [`attention_fwd_seqs`].
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_seqs(
    gpu: &dyn Gpu,
    s: StreamId,
    a: &AttnDims,
    (ts, seqs): (usize, usize),
    (dq_nope, dq_pe, dk_nope, dk_pe, dv_): (DevPtr, DevPtr, DevPtr, DevPtr, DevPtr),
    (delta, dkp_part): (DevPtr, DevPtr),
    (dout, out, lse): (DevPtr, DevPtr, DevPtr),
    (q_nope, q_pe): (DevPtr, DevPtr),
    (k_nope, k_pe, v): (DevPtr, DevPtr, DevPtr),
    (tq, tk, q_offset): (usize, usize, usize),
) -> Result<(), GpuError> {
    let seqs = split_rows(tq, tk, seqs)?;
    let (h, dn, dr, dv, kw) = (a.heads, a.dn, a.dr, a.dv, a.kph * a.dr);
    let (tq, tk) = (tq / seqs, tk / seqs);
    for j in 0..seqs {
        let o = SeqOffsets { tq, tk, j, ts };
        attention_bwd(
            gpu,
            s,
            a,
            (
                dq_nope + o.q(h * dn),
                dq_pe + o.q(h * dr),
                dk_nope + o.k(h * dn),
                dk_pe + o.k(kw),
                dv_ + o.k(h * dv),
            ),
            (delta + o.fq(h), dkp_part + o.fk(h * dr)),
            (dout + o.q(h * dv), out + o.q(h * dv), lse + o.fq(h)),
            (q_nope + o.q(h * dn), q_pe + o.q(h * dr)),
            (k_nope + o.k(h * dn), k_pe + o.k(kw), v + o.k(h * dv)),
            (tq, tk, q_offset),
        )?;
    }
    Ok(())
}

/// `seqs` (at least 1) if it divides both `tq` and `tk`. Errors: it does not.
fn split_rows(tq: usize, tk: usize, seqs: usize) -> Result<usize, GpuError> {
    let seqs = seqs.max(1);
    if !tq.is_multiple_of(seqs) || !tk.is_multiple_of(seqs) {
        return Err(GpuError(format!(
            "attention over {seqs} sequences: {tq} query and {tk} key rows do not split into {seqs} equal blocks"
        )));
    }
    Ok(seqs)
}

impl Model<'_> {
    /// Sequences the attention and RoPE treat separately: [`Dims::seqs`], or 1 under the
    /// injected `cross_sequence_attention` bug (the micro-batch's rows as one sequence).
    fn attn_seqs(&self) -> usize {
        if self.cfg.bugs.cross_sequence_attention {
            1
        } else {
            self.dims.seqs.max(1)
        }
    }

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

    /// RMSNorm forward over `rows` rows of `width` (`d`, or a latent's rank).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        s: StreamId,
        (y, xhat, inv): (DevPtr, DevPtr, DevPtr),
        x: DevPtr,
        g: DevPtr,
        rows: usize,
        width: usize,
    ) -> Result<(), GpuError> {
        self.go(
            s,
            "rmsnorm_fwd",
            [rows as u32, 1, 1],
            row_block(width),
            vec![
                p(y),
                p(xhat),
                p(inv),
                p(x),
                i(width),
                p(g),
                i(rows),
                i(width),
                Arg::F32(self.cfg.norm_eps as f32),
            ],
        )
    }

    /// RMSNorm input gradient (`+ resid` when `resid` is not 0).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_bwd(
        &self,
        s: StreamId,
        dx: DevPtr,
        dy: DevPtr,
        (g, xhat, inv): (DevPtr, DevPtr, DevPtr),
        resid: DevPtr,
        rows: usize,
        width: usize,
    ) -> Result<(), GpuError> {
        self.go(
            s,
            "rmsnorm_bwd",
            [rows as u32, 1, 1],
            row_block(width),
            vec![
                p(dx),
                p(dy),
                p(g),
                p(xhat),
                p(inv),
                p(resid),
                i(rows),
                i(width),
            ],
        )
    }

    fn rmsnorm_w(
        &self,
        s: StreamId,
        dg: DevPtr,
        dy: DevPtr,
        xhat: DevPtr,
        rows: usize,
        width: usize,
    ) -> Result<(), GpuError> {
        self.ew(
            s,
            "rmsnorm_w",
            width,
            vec![p(dg), p(dy), p(xhat), i(rows), i(width)],
        )
    }

    /// RoPE (or its inverse) on `rows` rows of stride `ld`, in `heads` groups of `dr`, at the
    /// rank's global positions.
    fn rope(
        &self,
        s: StreamId,
        x: DevPtr,
        rows: usize,
        ld: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<(), GpuError> {
        self.rope_at(s, x, (rows, ld, heads), self.pos0, inverse)
    }

    /// [`Self::rope`] with the first row at global position `pos`.
    fn rope_at(
        &self,
        s: StreamId,
        x: DevPtr,
        (rows, ld, heads): (usize, usize, usize),
        pos: usize,
        inverse: bool,
    ) -> Result<(), GpuError> {
        let dr = self.dims.dr;
        // The micro-batch's sequences are equal row blocks, each from position `pos`.
        let b = self.dims.seqs.max(1);
        let rows = rows / b;
        for j in 0..b {
            self.ew(
                s,
                "rope",
                rows * heads * dr / 2,
                vec![
                    p(x + (j * rows * ld * self.dims.ts) as u64),
                    i(ld),
                    i(rows),
                    i(heads),
                    i(dr),
                    i(pos),
                    Arg::F64(self.cfg.rope_base),
                    i(inverse as usize),
                ],
            )?;
        }
        Ok(())
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

    /// The softmax scale `1 / sqrt(d_h + d_h^R)` (DeepSeek-V3 eq. 10).
    fn scale(&self) -> f32 {
        (1.0 / ((self.dims.dn + self.dims.dr) as f64).sqrt()) as f32
    }

    /// The attention kernels' shape for this model: [`AttnDims`] of the local heads.
    pub fn attn_dims(&self) -> AttnDims {
        let dm = self.dims;
        AttnDims {
            heads: dm.heads,
            dn: dm.dn,
            dr: dm.dr,
            dv: dm.dv,
            kph: dm.kph,
            scale: self.scale(),
        }
    }

    /// MLA's attention core (the CPU backend's `attention`), in tiles: `out` (`tq x H dv`)
    /// and the rows' log-sum-exp `lse` (`H x tq` floats) from the local queries' content
    /// and RoPE parts (`q_nope`, `q_pe`, `tq` rows) over the gathered keys' content parts
    /// (`k_nope`), RoPE keys (`k_pe`, shared by the heads) and values (`v`, `tk` rows),
    /// causal at `q_offset`. See [`attention_fwd`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        s: StreamId,
        (out, lse): (DevPtr, DevPtr),
        q: (DevPtr, DevPtr),
        keys: (DevPtr, DevPtr, DevPtr),
        tq: usize,
        tk: usize,
        q_offset: usize,
    ) -> Result<(), GpuError> {
        attention_fwd_seqs(
            self.gpu,
            s,
            &self.attn_dims(),
            (self.dims.ts, self.attn_seqs()),
            (out, lse),
            q,
            keys,
            (tq, tk, q_offset),
        )
    }

    /// The attention core's backward (`attention_backward`), recomputing the probabilities
    /// from `lse`: the gradients of the queries' parts (`tq` rows), of the keys' content
    /// parts, the RoPE keys and the values (`tk` rows) from `dout` and the forward's `out`.
    /// Scratch: `delta` (`H x tq` floats) and `dkp_part` (`H x tk x dr` floats). See
    /// [`attention_bwd`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_bwd(
        &self,
        s: StreamId,
        grads: (DevPtr, DevPtr, DevPtr, DevPtr, DevPtr),
        scratch: (DevPtr, DevPtr),
        fwd: (DevPtr, DevPtr, DevPtr),
        q: (DevPtr, DevPtr),
        keys: (DevPtr, DevPtr, DevPtr),
        tq: usize,
        tk: usize,
        q_offset: usize,
    ) -> Result<(), GpuError> {
        attention_bwd_seqs(
            self.gpu,
            s,
            &self.attn_dims(),
            (self.dims.ts, self.attn_seqs()),
            grads,
            scratch,
            fwd,
            q,
            keys,
            (tq, tk, q_offset),
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
            (Pass::F, Part::AttnPost { layer }) => self.f_attn_post(s, st, layer as usize, io),
            (Pass::B, Part::QkvPost { layer }) => self.b_qkv_post(s, st, layer as usize, io),
            (Pass::F, Part::QkvPost { layer }) if self.dims.seq_par => {
                self.f_qkv_post(s, st, layer as usize, io)
            }
            (Pass::F, Part::Shared { layer }) if self.dims.seq_par => {
                self.f_shared(s, st, layer as usize, io)
            }
            (Pass::B, Part::Shared { layer }) if self.dims.seq_par => {
                self.b_shared(s, st, layer as usize, io)
            }
            (Pass::B, Part::AttnPost { layer }) if self.dims.seq_par => {
                self.b_attn_post(s, st, layer as usize, io)
            }
            (Pass::W, Part::Weights) => self.w_weights(s, st, io, true, true),
            (Pass::W, Part::WeightsAttn) => self.w_weights(s, st, io, true, false),
            (Pass::W, Part::WeightsMlp) => self.w_weights(s, st, io, false, true),
            (pass, part) => Err(GpuError(format!("no kernel {pass:?} {part:?}"))),
        }
    }

    /// A stage-level weight (`embed`, `final_norm`, `head`) in the compute copy.
    fn w(&self, st: &StageDev, name: &str) -> Result<DevPtr, GpuError> {
        let t = st.tensors.global(name).map_err(GpuError)?;
        Ok(st.weights + (t.param * self.dims.ts) as u64)
    }
    /// A stage-level weight's gradient.
    fn g(&self, st: &StageDev, io: &Io, name: &str) -> Result<DevPtr, GpuError> {
        let t = st.tensors.global(name).map_err(GpuError)?;
        Ok(io.grads + (t.grad * 4) as u64)
    }
    /// Local layer `l`'s tensor `name` (one of [`LAYER_TENSORS`]).
    fn ltensor(&self, st: &StageDev, l: usize, name: &str) -> Result<Tensor, GpuError> {
        st.tensors
            .layers
            .get(l)
            .ok_or_else(|| GpuError(format!("the stage has no local layer {l}")))?
            .get(name)
            .map_err(GpuError)
    }
    /// Local layer `l`'s weight `name` in the compute copy.
    fn lw(&self, st: &StageDev, l: usize, name: &str) -> Result<DevPtr, GpuError> {
        let t = self.ltensor(st, l, name)?;
        Ok(st.weights + (t.param * self.dims.ts) as u64)
    }
    /// Local layer `l`'s gradient of `name`.
    fn lg(&self, st: &StageDev, io: &Io, l: usize, name: &str) -> Result<DevPtr, GpuError> {
        let t = self.ltensor(st, l, name)?;
        Ok(io.grads + (t.grad * 4) as u64)
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

    /// F, norm and MLA's token-local projections (`fwd_qkv`): the queries' latent
    /// `c_Q = RMSNorm(a W_DQ)`, their content and rotated RoPE parts, the key/value latent
    /// `c_KV = RMSNorm(a W_DKV)` and the rotated RoPE key `k^R = RoPE(a W_KR)`; every SP
    /// member's slot gets `[c_KV; k^R]` (the all-gather).
    fn f_qkv(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, qr, kvr, kw) = (dm.t, dm.d, dm.qr, dm.kvr, dm.kw());
        let r = &st.stash.layers[l];
        let x = self.at(io, r.xin);
        if l == 0 {
            if let Some(input) = io.act_in {
                self.upload_tokens(s, st, io)?;
                self.gpu.dtod(s, x, input, dm.act_bytes())?;
            }
        }
        let w = |n: &str| self.lw(st, l, n);
        let at = |x: Region| self.at(io, x);
        let a = at(r.a);
        self.rmsnorm(s, (a, at(r.xhat1), at(r.inv1)), x, w("norm1")?, t, d)?;
        self.mm(
            s,
            (t, qr, d),
            a,
            false,
            w("wdq")?,
            false,
            at(r.cq_raw),
            false,
            false,
        )?;
        self.rmsnorm(
            s,
            (at(r.cq), at(r.cq_xhat), at(r.cq_inv)),
            at(r.cq_raw),
            w("q_norm")?,
            t,
            qr,
        )?;
        self.mm(
            s,
            (t, kvr, d),
            a,
            false,
            w("wdkv")?,
            false,
            at(r.ckv_raw),
            false,
            false,
        )?;
        self.rmsnorm(
            s,
            (at(r.ckv), at(r.ckv_xhat), at(r.ckv_inv)),
            at(r.ckv_raw),
            w("kv_norm")?,
            t,
            kvr,
        )?;
        self.mm(
            s,
            (t, kw, d),
            a,
            false,
            w("wkr")?,
            false,
            at(r.kpe),
            false,
            false,
        )?;
        // The RoPE key at the local tokens' global positions: a sequence-parallel TP
        // member's shard starts `shard0` rows into the chunk.
        self.rope_at(s, at(r.kpe), (t, kw, dm.kph), self.pos0 + dm.shard0, false)?;
        if dm.seq_par {
            // The shard's `[c_Q | c_KV | k^R]` for the TP group's all-gather
            // (`latent_gather`); `qkv_post` up-projects the chunk's.
            let g = at(r.tps);
            let mut off = 0u64;
            for (y, n) in [
                (at(r.cq), t * qr),
                (at(r.ckv), t * kvr),
                (at(r.kpe), t * kw),
            ] {
                self.gpu.dtod(s, g + off, y, n * dm.ts)?;
                off += (n * dm.ts) as u64;
            }
            return Ok(());
        }
        self.qkv_up(s, st, l, io)
    }

    /// F, with Megatron sequence parallelism (`fwd_qkv_post`): once `tpg` holds the TP
    /// group's gathered `[c_Q | c_KV | k^R]` shard blocks, the chunk's latents into `cq`,
    /// `ckv`, `kpe` (shard `j` at row `j t`) and the up-projections ([`Self::qkv_up`]).
    fn f_qkv_post(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, qr, kvr, kw) = (dm.t, dm.qr, dm.kvr, dm.kw());
        let r = &st.stash.layers[l];
        let at = |x: Region| self.at(io, x);
        let g = at(r.tpg);
        let mut off = 0u64;
        for j in 0..dm.tc / t {
            for (y, wd) in [(at(r.cq), qr), (at(r.ckv), kvr), (at(r.kpe), kw)] {
                let n = t * wd * dm.ts;
                self.gpu.dtod(s, y + (j * n) as u64, g + off, n)?;
                off += n as u64;
            }
        }
        self.qkv_up(s, st, l, io)
    }

    /// The queries' up-projections of the chunk's `c_Q` (`tc` rows, this member's heads;
    /// `q^R` rotated at the chunk's positions) and every SP member's slot of the all-gather
    /// `[c_KV; k^R]` (the CPU backend's `qkv_up`).
    fn qkv_up(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (tc, h, qr, kvr, kw) = (dm.tc, dm.heads, dm.qr, dm.kvr, dm.kw());
        let r = &st.stash.layers[l];
        let w = |n: &str| self.lw(st, l, n);
        let at = |x: Region| self.at(io, x);
        self.mm(
            s,
            (tc, h * dm.dn, qr),
            at(r.cq),
            false,
            w("wuq")?,
            false,
            at(r.q_nope),
            false,
            false,
        )?;
        self.mm(
            s,
            (tc, h * dm.dr, qr),
            at(r.cq),
            false,
            w("wqr")?,
            false,
            at(r.q_pe),
            false,
            false,
        )?;
        self.rope(s, at(r.q_pe), tc, h * dm.dr, h, false)?;
        let ob = at(st.stash.outbox);
        let (nc, np) = (tc * kvr * dm.ts, tc * kw * dm.ts);
        for j in 0..dm.sp {
            self.gpu.dtod(s, self.rows(ob, j), at(r.ckv), nc)?;
            self.gpu
                .dtod(s, self.rows(ob, j) + nc as u64, at(r.kpe), np)?;
        }
        Ok(())
    }

    /// F, the rest of the attention and the router (`fwd_attn`): the gathered latents
    /// up-projected to every head's content keys `c_KV W_UK` and values `c_KV W_UV`,
    /// attention over them, output projection, residual, norm, routing, and the dispatch
    /// packets.
    fn f_attn(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, h, kvr, kw, tk) = (dm.tc, dm.d, dm.heads, dm.kvr, dm.kw(), dm.tk);
        let r = &st.stash.layers[l];
        let w = |n: &str| self.lw(st, l, n);
        let at = |x: Region| self.at(io, x);
        let ib = at(st.stash.inbox);
        let (nc, np) = (t * kvr * dm.ts, t * kw * dm.ts);
        let (ckv_all, kpe_all) = (at(r.ckv_all), at(r.kpe_all));
        for j in 0..dm.sp {
            self.gpu
                .dtod(s, ckv_all + (j * nc) as u64, self.rows(ib, j), nc)?;
            self.gpu.dtod(
                s,
                kpe_all + (j * np) as u64,
                self.rows(ib, j) + nc as u64,
                np,
            )?;
        }
        let (k_nope, v) = (at(r.k_nope), at(r.v));
        self.mm(
            s,
            (tk, h * dm.dn, kvr),
            ckv_all,
            false,
            w("wuk")?,
            false,
            k_nope,
            false,
            false,
        )?;
        self.mm(
            s,
            (tk, h * dm.dv, kvr),
            ckv_all,
            false,
            w("wuv")?,
            false,
            v,
            false,
            false,
        )?;
        // `t`: the chunk's query rows. With Megatron sequence parallelism `o W_O` goes to
        // `h1c` for the reduce-scatter (`attn_out_scatter`), which leaves this member's
        // rows in `h1`.
        let o = at(r.o);
        let h1 = at(if dm.seq_par { r.h1c } else { r.h1 });
        self.attention(
            s,
            (o, at(r.lse)),
            (at(r.q_nope), at(r.q_pe)),
            (k_nope, kpe_all, v),
            t,
            tk,
            self.mask_offset(),
        )?;
        self.mm(
            s,
            (t, d, h * dm.dv),
            o,
            false,
            w("wo")?,
            false,
            h1,
            false,
            false,
        )?;
        if dm.tp > 1 {
            // This member's heads' share of `o W_O`: the `attn_out` all-reduce sums it in
            // place (or `attn_out_scatter` reduce-scatters it), then `attn_post` goes on.
            return Ok(());
        }
        self.f_attn_post(s, st, l, io)
    }

    /// F, the rest of the attention block once `h1` holds `o W_O` summed over the TP group
    /// (`fwd_attn_post`; with `tp = 1` [`Self::f_attn`] runs it itself): residual, norm,
    /// routing, the dispatch packets; with `tp > 1` also this member's slice of the shared
    /// expert into `sh_y` (its partial output, for the `mlp_out` all-reduce).
    fn f_attn_post(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, e, k) = (dm.t, dm.d, dm.e, dm.k);
        let r = &st.stash.layers[l];
        let w = |n: &str| self.lw(st, l, n);
        let at = |x: Region| self.at(io, x);
        let h1 = at(r.h1);
        self.add(s, h1, h1, at(r.xin), t * d)?;
        let n2 = at(r.n2);
        self.rmsnorm(s, (n2, at(r.xhat2), at(r.inv2)), h1, w("norm2")?, t, d)?;
        let (logits, sc) = (at(r.logits), at(r.s));
        self.mm(
            s,
            (t, e, d),
            n2,
            false,
            w("router")?,
            false,
            logits,
            false,
            true,
        )?;
        self.ew(s, "sigmoid", t * e, vec![p(sc), p(logits), n64(t * e)])?;
        // A recompute's loads go to its scratch (`Io::recompute`), not to `weight_grad`.
        let loads = match io.recompute {
            Some(scratch) => scratch + (l * e * 4) as u64,
            None => io.grads + (st.layout.loads_of(l, e) * 4) as u64,
        };
        let bugs = &self.cfg.bugs;
        self.go(
            s,
            "route",
            [1, 1, 1],
            ROUTE_THREADS,
            vec![
                p(at(r.experts)),
                p(at(r.desired)),
                p(at(r.gates)),
                p(at(r.z)),
                p(at(r.softmax)),
                p(loads),
                p(at(r.cnt)),
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
        let ob = at(st.stash.outbox);
        self.go(
            s,
            "dispatch_plan",
            [1, 1, 1],
            ROUTE_THREADS,
            vec![
                p(at(r.order)),
                p(at(r.slot_dest)),
                p(at(r.slot_pos)),
                p(ob),
                n64(dm.slot_bytes),
                p(at(r.experts)),
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
                p(at(r.slot_dest)),
                p(at(r.slot_pos)),
                i(t * k),
                i(k),
                i(d),
            ],
        )?;
        // With Megatron sequence parallelism the shared expert runs on the gathered rows
        // (`shared` kernel).
        if dm.tp > 1 && dm.shared && !dm.seq_par {
            self.shared_fwd(s, st, l, io)?;
        }
        Ok(())
    }

    /// F, with Megatron sequence parallelism (`fwd_shared`): this member's slice of the
    /// shared expert on the TP group's gathered MoE-norm rows (`n2c`, the chunk) into
    /// `sh_y`, its partial output for the reduce-scatter (zeros without a shared expert).
    fn f_shared(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let r = &st.stash.layers[l];
        if !self.dims.shared {
            return self.gpu.memset(s, self.at(io, r.sh_y), r.sh_y.bytes);
        }
        self.ffn(
            s,
            st,
            l,
            self.at(io, r.n2c),
            self.dims.tc,
            (
                self.at(io, r.sh_h1),
                self.at(io, r.sh_h3),
                self.at(io, r.sh_act),
            ),
            self.at(io, r.sh_y),
        )
    }

    /// This member's slice of layer `l`'s shared expert on `n2` into `sh_y`.
    fn shared_fwd(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let r = &st.stash.layers[l];
        self.ffn(
            s,
            st,
            l,
            self.at(io, r.n2),
            self.dims.t,
            (
                self.at(io, r.sh_h1),
                self.at(io, r.sh_h3),
                self.at(io, r.sh_act),
            ),
            self.at(io, r.sh_y),
        )
    }

    /// The stride between consecutive local experts' tensors, and the first expert's
    /// `w1`, `w3`, `w2` (offsets in elements of the parameter vector).
    fn experts_at(&self, st: &StageDev, l: usize) -> Result<(usize, [usize; 3]), GpuError> {
        let lt = st
            .tensors
            .layers
            .get(l)
            .ok_or_else(|| GpuError(format!("the stage has no local layer {l}")))?;
        let get = |k: usize| {
            lt.expert0[k].map(|t| t.param).ok_or_else(|| {
                GpuError(format!(
                    "the stage has no tensor layer{}.expert{}.{}",
                    lt.global,
                    st.info.expert_lo,
                    ["w1", "w3", "w2"][k]
                ))
            })
        };
        let (d, f) = (self.dims.d, self.dims.f);
        Ok((3 * d * f, [get(0)?, get(1)?, get(2)?]))
    }

    /// The received rows of the inbox (`inbox`, `slot_bytes` per source rank) gathered into
    /// per-expert blocks `dst` (`per x cmax x d`, zeroed first: `dst.1` bytes), by the
    /// permutation `perm` and per-source counts `cnt` of `expert_plan` (kernel
    /// `expert_gather`).
    fn gather_expert_rows(
        &self,
        s: StreamId,
        dst: (u64, usize),
        inbox: u64,
        perm: u64,
        cnt: u64,
    ) -> Result<(), GpuError> {
        let dm = self.dims;
        self.gpu.memset(s, dst.0, dst.1)?;
        self.ew(
            s,
            "expert_gather",
            dm.ep * dm.rmax * dm.d,
            vec![
                p(dst.0),
                p(inbox),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(perm),
                p(cnt),
                i(dm.ep),
                i(dm.rmax),
                i(dm.d),
            ],
        )
    }

    /// The inverse of [`Self::gather_expert_rows`]: the per-expert blocks `src` back into the
    /// outbox `outbox`, rows in the order they were received (kernel `expert_scatter`).
    fn scatter_expert_rows(
        &self,
        s: StreamId,
        src: u64,
        outbox: u64,
        perm: u64,
        cnt: u64,
    ) -> Result<(), GpuError> {
        let dm = self.dims;
        self.ew(
            s,
            "expert_scatter",
            dm.ep * dm.rmax * dm.d,
            vec![
                p(outbox),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(src),
                p(perm),
                p(cnt),
                i(dm.ep),
                i(dm.rmax),
                i(dm.d),
            ],
        )
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
        // Per-thread counts of every local expert fit the kernel's shared array
        // (EXPERT_PLAN_SHARED = 8192 ints); one thread when they never could.
        let threads = (8192 / dm.per.max(1)).clamp(1, ROUTE_THREADS as usize) as u32;
        self.go(
            s,
            "expert_plan",
            [1, 1, 1],
            threads,
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
        self.gather_expert_rows(s, (xe, r.xe.bytes), ib, perm, cnt)?;
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
        self.scatter_expert_rows(s, ye, ob, perm, cnt)
    }

    /// A SwiGLU FFN on `x` (`rows x d`) with local layer `l`'s shared expert
    /// `shared.w1/w3/w2` (`ffn_forward`): `h1`, `h3`, `act` kept, output into `y`.
    #[allow(clippy::too_many_arguments)]
    fn ffn(
        &self,
        s: StreamId,
        st: &StageDev,
        l: usize,
        x: DevPtr,
        rows: usize,
        (h1, h3, act): (DevPtr, DevPtr, DevPtr),
        y: DevPtr,
    ) -> Result<(), GpuError> {
        // The shared expert: this member's `f / tp` hidden units.
        let (d, f) = (self.dims.d, self.dims.fs);
        self.mm(
            s,
            (rows, f, d),
            x,
            false,
            self.lw(st, l, "shared.w1")?,
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
            self.lw(st, l, "shared.w3")?,
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
            self.lw(st, l, "shared.w2")?,
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
        if dm.seq_par {
            // This member's rows of the shared expert's output (`mlp_out_scatter`; zeros
            // without a shared expert).
            self.add(s, y, y, self.at(io, r.ysh), t * d)?;
        } else if dm.shared {
            // With `tp > 1`, `sh_y` already holds the shared expert's output summed over
            // the TP group (`attn_post`, then the `mlp_out` all-reduce).
            if dm.tp == 1 {
                self.shared_fwd(s, st, l, io)?;
            }
            let ys = self.at(io, r.sh_y);
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
            d,
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
        if io.recompute.is_some() {
            // The forward summed it already; `dlogits` above is what the stash needs.
            return Ok(());
        }
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
            (
                self.w(st, "final_norm")?,
                self.at(io, sl.xhatf),
                self.at(io, sl.invf),
            ),
            0,
            t,
            d,
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
        let (t, d, k) = (dm.t, dm.d, dm.k);
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
        if dm.seq_par {
            // The shared expert's backward runs on the TP group's gathered output gradient
            // (`shared` kernel); its reduce-scatter (`mlp_in_grad_scatter`) writes `dn2`.
            return Ok(());
        }
        let dn2 = self.at(io, r.dn2);
        if dm.shared {
            self.shared_bwd(s, st, l, io, t, dy, dn2)
        } else {
            self.gpu.memset(s, dn2, r.dn2.bytes)
        }
    }

    /// B, with Megatron sequence parallelism (`bwd_shared`): this member's slice of the
    /// shared expert's backward on the TP group's gathered output gradient (`dyc`, the
    /// chunk); its partial input gradient into `dn2c` for the reduce-scatter (zeros without
    /// a shared expert).
    fn b_shared(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let t = dm.tc;
        let r = &st.stash.layers[l];
        let at = |x: Region| self.at(io, x);
        let dn2c = at(r.dn2c);
        if !dm.shared {
            return self.gpu.memset(s, dn2c, r.dn2c.bytes);
        }
        self.shared_bwd(s, st, l, io, t, at(r.dyc), dn2c)
    }

    /// The shared expert's backward on `t` rows: from the output gradient `dy` (`t x d`) the
    /// input gradient into `dn2` (`t x d`, overwritten), through `W2`, SwiGLU and `W1`/`W3`
    /// (this TP member's slices: hidden `dims.fs`), with the stash's `sh_*` scratch.
    #[allow(clippy::too_many_arguments)]
    fn shared_bwd(
        &self,
        s: StreamId,
        st: &StageDev,
        l: usize,
        io: &Io,
        t: usize,
        dy: DevPtr,
        dn2: DevPtr,
    ) -> Result<(), GpuError> {
        let (d, f) = (self.dims.d, self.dims.fs);
        let r = &st.stash.layers[l];
        let at = |x: Region| self.at(io, x);
        let (da, dh1, dh3) = (at(r.sh_da), at(r.sh_dh1), at(r.sh_dh3));
        self.mm(
            s,
            (t, f, d),
            dy,
            false,
            self.lw(st, l, "shared.w2")?,
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
                p(at(r.sh_h1)),
                p(at(r.sh_h3)),
                n64(n),
            ],
        )?;
        self.mm(
            s,
            (t, d, f),
            dh1,
            false,
            self.lw(st, l, "shared.w1")?,
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
            self.lw(st, l, "shared.w3")?,
            true,
            dn2,
            true,
            false,
        )
    }

    /// B, the local experts (`bwd_experts`): input gradients of the received rows.
    fn b_experts(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (d, f, cm) = (dm.d, dm.f, dm.cmax);
        let r = &st.stash.layers[l];
        let (ib, ob) = (self.at(io, st.stash.inbox), self.at(io, st.stash.outbox));
        let (perm, cnt) = (self.at(io, r.perm), self.at(io, r.src_count));
        let dye = self.at(io, r.dye);
        self.gather_expert_rows(s, (dye, r.dye.bytes), ib, perm, cnt)?;
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
        self.scatter_expert_rows(s, dxe, ob, perm, cnt)
    }

    /// B, dispatch, router, norm, output projection, attention (`bwd_attn`): the gradients
    /// of the gathered latents (`dk^C W_UKᵀ + dv W_UVᵀ`) and RoPE keys of every SP member's
    /// chunk into its slot; the queries' RoPE gradient rotated back.
    fn b_attn(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let r = &st.stash.layers[l];
        if self.dims.seq_par {
            // `attn_post` ran first; `dh1c` holds the TP group's gathered `h1` gradient
            // (`bwd_attn_gathered`).
            return self.b_attn_core(s, st, l, io, self.at(io, r.dh1c));
        }
        self.b_attn_post(s, st, l, io)?;
        self.b_attn_core(s, st, l, io, self.at(io, r.dh1))
    }

    /// B, dispatch, router and MoE norm on this member's rows (`bwd_attn_post`): the
    /// gradient of `h1` into `dh1` (with Megatron sequence parallelism, for the TP group's
    /// all-gather `attn_out_grad_gather`).
    fn b_attn_post(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, k, e) = (dm.t, dm.d, dm.k, dm.e);
        let r = &st.stash.layers[l];
        let w = |n: &str| self.lw(st, l, n);
        let at = |x: Region| self.at(io, x);
        let ib = at(st.stash.inbox);
        let dn2 = at(r.dn2);
        self.ew(
            s,
            "dispatch_bwd",
            t * d,
            vec![
                p(dn2),
                p(ib),
                n64(dm.slot_bytes),
                n64(dm.rows_off),
                p(at(r.experts)),
                p(at(r.slot_dest)),
                p(at(r.slot_pos)),
                i(t),
                i(k),
                i(d),
            ],
        )?;
        let dlr = at(r.dlr);
        self.ew(
            s,
            "gate_bwd",
            t,
            vec![
                p(dlr),
                p(at(r.dgates)),
                p(at(r.gates)),
                p(at(r.z)),
                p(at(r.s)),
                p(at(r.softmax)),
                p(at(r.experts)),
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
            w("router")?,
            true,
            dn2,
            true,
            false,
        )?;
        let dh1 = at(r.dh1);
        self.rmsnorm_bwd(
            s,
            dh1,
            dn2,
            (w("norm2")?, at(r.xhat2), at(r.inv2)),
            self.dy(st, l, io),
            t,
            d,
        )
    }

    /// B, the attention core from the gradient `dh1` of `h1` on the chunk's `tc` rows
    /// (`bwd_attn_core`): output projection, attention, the gradients of the gathered
    /// latents (`dk^C W_UKᵀ + dv W_UVᵀ`) and RoPE keys of every SP member's chunk into its
    /// slot; the queries' RoPE gradient rotated back.
    fn b_attn_core(
        &self,
        s: StreamId,
        st: &StageDev,
        l: usize,
        io: &Io,
        dh1: DevPtr,
    ) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, h, kvr, kw, tk) = (dm.tc, dm.d, dm.heads, dm.kvr, dm.kw(), dm.tk);
        let r = &st.stash.layers[l];
        let w = |n: &str| self.lw(st, l, n);
        let at = |x: Region| self.at(io, x);
        let doh = at(r.doh);
        self.mm(
            s,
            (t, h * dm.dv, d),
            dh1,
            false,
            w("wo")?,
            true,
            doh,
            false,
            false,
        )?;
        let (dk_nope, dk_pe, dvv) = (at(r.dk_nope), at(r.dk_pe), at(r.dvv));
        self.attention_bwd(
            s,
            (at(r.dq_nope), at(r.dqr), dk_nope, dk_pe, dvv),
            (at(r.delta), at(r.dkp_part)),
            (doh, at(r.o), at(r.lse)),
            (at(r.q_nope), at(r.q_pe)),
            (at(r.k_nope), at(r.kpe_all), at(r.v)),
            t,
            tk,
            self.mask_offset(),
        )?;
        let dckv_all = at(r.dckv_all);
        self.mm(
            s,
            (tk, kvr, h * dm.dn),
            dk_nope,
            false,
            w("wuk")?,
            true,
            dckv_all,
            false,
            false,
        )?;
        self.mm(
            s,
            (tk, kvr, h * dm.dv),
            dvv,
            false,
            w("wuv")?,
            true,
            dckv_all,
            true,
            false,
        )?;
        self.rope(s, at(r.dqr), t, h * dm.dr, h, true)?;
        let ob = at(st.stash.outbox);
        let (nc, np) = (t * kvr * dm.ts, t * kw * dm.ts);
        for j in 0..dm.sp {
            self.gpu
                .dtod(s, self.rows(ob, j), dckv_all + (j * nc) as u64, nc)?;
            self.gpu
                .dtod(s, self.rows(ob, j) + nc as u64, dk_pe + (j * np) as u64, np)?;
        }
        Ok(())
    }

    /// B, MLA's projections and norm (`bwd_qkv`): sums the local chunk's latent and
    /// RoPE-key gradients over the SP group, rotates the RoPE gradient back, runs the
    /// gradients through the latents' norms and the down-projections, and the layer input's
    /// gradient.
    fn b_qkv(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        // `t`: the chunk's rows (with Megatron sequence parallelism, the TP group's).
        let (t, h, qr, kvr, kw) = (dm.tc, dm.heads, dm.qr, dm.kvr, dm.kw());
        let r = &st.stash.layers[l];
        let w = |n: &str| self.lw(st, l, n);
        let at = |x: Region| self.at(io, x);
        let ib = at(st.stash.inbox);
        let (dckv, dkr) = (at(r.dckv), at(r.dkr));
        for (y, off, n) in [
            (dckv, dm.rows_off, t * kvr),
            (dkr, dm.rows_off + t * kvr * dm.ts, t * kw),
        ] {
            self.ew(
                s,
                "sum_slots",
                n,
                vec![p(y), p(ib), n64(dm.slot_bytes), n64(off), i(dm.sp), n64(n)],
            )?;
        }
        self.rope(s, dkr, t, kw, dm.kph, true)?;
        let dcq = at(r.dcq);
        self.mm(
            s,
            (t, qr, h * dm.dn),
            at(r.dq_nope),
            false,
            w("wuq")?,
            true,
            dcq,
            false,
            false,
        )?;
        self.mm(
            s,
            (t, qr, h * dm.dr),
            at(r.dqr),
            false,
            w("wqr")?,
            true,
            dcq,
            true,
            false,
        )?;
        if dm.tp > 1 {
            // This member's heads' share of `[dc_Q; dc_KV; dk^R]`, packed for the
            // `attn_in_grad` all-reduce, or with Megatron sequence parallelism one block
            // per shard (`[dc_Q | dc_KV | dk^R]` of its `dm.t` rows) for the reduce-scatter
            // `latent_grad_scatter`; `qkv_post` goes on from the sum.
            let g = at(r.tpg);
            let rows = dm.t;
            let mut off = 0u64;
            for j in 0..t / rows {
                for (x, wd) in [(dcq, qr), (dckv, kvr), (dkr, kw)] {
                    let n = rows * wd * dm.ts;
                    self.gpu.dtod(s, g + off, x + (j * n) as u64, n)?;
                    off += n as u64;
                }
            }
            return Ok(());
        }
        self.b_qkv_post(s, st, l, io)
    }

    /// B, the rest of the attention backward once `[dc_Q; dc_KV; dk^R]` is summed over the
    /// TP group (`bwd_qkv_post`; with `tp = 1` [`Self::b_qkv`] runs it itself): the latents'
    /// norms, the down-projections, the attention norm and the residual; the layer input's
    /// gradient into `dx`.
    fn b_qkv_post(&self, s: StreamId, st: &StageDev, l: usize, io: &Io) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, qr, kvr, kw) = (dm.t, dm.d, dm.qr, dm.kvr, dm.kw());
        let r = &st.stash.layers[l];
        let w = |n: &str| self.lw(st, l, n);
        let at = |x: Region| self.at(io, x);
        let (dckv, dkr, dcq, dcq_raw) = (at(r.dckv), at(r.dkr), at(r.dcq), at(r.dcq_raw));
        if dm.tp > 1 {
            // The sum (with Megatron sequence parallelism, this member's shard of it).
            let g = at(if dm.seq_par { r.tps } else { r.tpg });
            let mut off = 0u64;
            for (x, n) in [(dcq, t * qr), (dckv, t * kvr), (dkr, t * kw)] {
                self.gpu.dtod(s, x, g + off, n * dm.ts)?;
                off += (n * dm.ts) as u64;
            }
        }
        let dckv_raw = at(r.dckv_raw);
        self.rmsnorm_bwd(
            s,
            dckv_raw,
            dckv,
            (w("kv_norm")?, at(r.ckv_xhat), at(r.ckv_inv)),
            0,
            t,
            kvr,
        )?;
        self.rmsnorm_bwd(
            s,
            dcq_raw,
            dcq,
            (w("q_norm")?, at(r.cq_xhat), at(r.cq_inv)),
            0,
            t,
            qr,
        )?;
        let da = at(r.da);
        self.mm(
            s,
            (t, d, qr),
            dcq_raw,
            false,
            w("wdq")?,
            true,
            da,
            false,
            false,
        )?;
        self.mm(
            s,
            (t, d, kvr),
            dckv_raw,
            false,
            w("wdkv")?,
            true,
            da,
            true,
            false,
        )?;
        self.mm(s, (t, d, kw), dkr, false, w("wkr")?, true, da, true, false)?;
        let dx = at(r.dx);
        self.rmsnorm_bwd(
            s,
            dx,
            da,
            (w("norm1")?, at(r.xhat1), at(r.inv1)),
            at(r.dh1),
            t,
            d,
        )?;
        if l == 0 {
            if let Some(g) = io.grad_out {
                self.gpu.dtod(s, g, dx, dm.act_bytes())?;
            }
        }
        Ok(())
    }

    /// W: every weight gradient of the stage added to `weight_grad` (`weights`).
    /// The weight gradients of the stage: those of the attention side (`attn`: embedding,
    /// norms, attention, router, final norm and head) and of the MLPs (`mlp`: shared expert
    /// and experts); both for a whole `W`, one for a split `W`'s part.
    fn w_weights(
        &self,
        s: StreamId,
        st: &StageDev,
        io: &Io,
        attn: bool,
        mlp: bool,
    ) -> Result<(), GpuError> {
        let dm = self.dims;
        let (t, d, e, f, v) = (dm.t, dm.d, dm.e, dm.f, dm.vocab);
        let sl = &st.stash;
        if st.info.first && attn {
            self.go(
                s,
                "embed_w",
                [t.clamp(1, 4096) as u32, 1, 1],
                EMBED_THREADS,
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
        let (h, qr, kvr, kw, tk, tc) = (dm.heads, dm.qr, dm.kvr, dm.kw(), dm.tk, dm.tc);
        for (li, r) in sl.layers.iter().enumerate() {
            let g = |w: &str| self.lg(st, io, li, w);
            let at = |x: Region| self.at(io, x);
            if attn {
                self.rmsnorm_w(s, g("norm1")?, at(r.da), at(r.xhat1), t, d)?;
                self.mm(
                    s,
                    (d, qr, t),
                    at(r.a),
                    true,
                    at(r.dcq_raw),
                    false,
                    g("wdq")?,
                    true,
                    true,
                )?;
                self.rmsnorm_w(s, g("q_norm")?, at(r.dcq), at(r.cq_xhat), t, qr)?;
                self.mm(
                    s,
                    (qr, h * dm.dn, tc),
                    at(r.cq),
                    true,
                    at(r.dq_nope),
                    false,
                    g("wuq")?,
                    true,
                    true,
                )?;
                self.mm(
                    s,
                    (qr, h * dm.dr, tc),
                    at(r.cq),
                    true,
                    at(r.dqr),
                    false,
                    g("wqr")?,
                    true,
                    true,
                )?;
                self.mm(
                    s,
                    (d, kvr, t),
                    at(r.a),
                    true,
                    at(r.dckv_raw),
                    false,
                    g("wdkv")?,
                    true,
                    true,
                )?;
                self.rmsnorm_w(s, g("kv_norm")?, at(r.dckv), at(r.ckv_xhat), t, kvr)?;
                self.mm(
                    s,
                    (d, kw, t),
                    at(r.a),
                    true,
                    at(r.dkr),
                    false,
                    g("wkr")?,
                    true,
                    true,
                )?;
                // Over the gathered sequence: each SP member adds its queries' share; the
                // data-parallel all-reduce, which spans the SP group, sums the shares.
                self.mm(
                    s,
                    (kvr, h * dm.dn, tk),
                    at(r.ckv_all),
                    true,
                    at(r.dk_nope),
                    false,
                    g("wuk")?,
                    true,
                    true,
                )?;
                self.mm(
                    s,
                    (kvr, h * dm.dv, tk),
                    at(r.ckv_all),
                    true,
                    at(r.dvv),
                    false,
                    g("wuv")?,
                    true,
                    true,
                )?;
                // The chunk's rows: with Megatron sequence parallelism the gathered `h1`
                // gradient (the CPU backend's `dh1_full`).
                self.mm(
                    s,
                    (h * dm.dv, d, tc),
                    at(r.o),
                    true,
                    at(if dm.seq_par { r.dh1c } else { r.dh1 }),
                    false,
                    g("wo")?,
                    true,
                    true,
                )?;
                self.rmsnorm_w(s, g("norm2")?, at(r.dn2), at(r.xhat2), t, d)?;
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
            }
            if mlp {
                if dm.shared {
                    // With Megatron sequence parallelism on the TP group's gathered rows.
                    let (dy, f) = (self.dy(st, li, io), dm.fs);
                    let (x, dy, t) = if dm.seq_par {
                        (at(r.n2c), at(r.dyc), tc)
                    } else {
                        (at(r.n2), dy, t)
                    };
                    self.mm(
                        s,
                        (d, f, t),
                        x,
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
                        x,
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
        }
        if st.info.last && attn {
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
                d,
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
