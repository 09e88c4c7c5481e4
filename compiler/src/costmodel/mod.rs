//! One model-level cost model for `sim`, `compare`, `plan` and `optimize`: op times and
//! memory per pipeline stage derived from a model ([`arch`]: a Hugging Face `config.json` or
//! a preset), a GPU ([`hardware`]) and a layout ([`layout`]: mesh, batch, recompute, dtype,
//! layers per stage), then simulated by [`crate::sim`] like any TOML cost model.
//!
//! ## What each op costs (per micro-batch, per GPU)
//!
//! `T = seq * micro_batch_size / cp` tokens reach a GPU's attention; with `tp > 1` Megatron's
//! sequence parallelism leaves `T / tp` in the norms, the residual stream and the
//! all-to-alls.
//!
//! * **GEMMs** (every weight matrix, the output head): `2 * rows * k * n / tp` FLOPs at the
//!   peak of `--dtype` times an efficiency that grows with the rows (tokens) of the GEMM,
//!   `e_gemm * rows / (rows + rows_half)`; an expert's rows are its share of the routed
//!   tokens, `T / tp * top_k * ep / experts` (balanced routing).
//! * **Attention core** (causal, FlashAttention: no `t x t` scores stored): forward
//!   `2 * T * (seq / 2) * heads / tp * (d_qk + d_v)` FLOPs, backward 2.5 times that (the
//!   five GEMMs of FlashAttention-2's backward against the forward's two), at the bf16 peak
//!   times `e_attn`.
//! * **Memory-bound ops** (norms, residual adds, rotary, SwiGLU, the loss): their bytes at
//!   `e_hbm` of the HBM bandwidth.
//! * **B and W** (Zero Bubble, arXiv 2401.10241 §2): B holds every GEMM's input-gradient
//!   GEMM, the attention core's backward and the memory-bound backward; W every GEMM's
//!   weight-gradient GEMM. `--recompute full` adds the forward to B; `selective` adds the
//!   recomputed up-projections, norms and activations.
//! * **TP collectives**: a dense layer's forward all-gathers and reduce-scatters twice (the
//!   attention's and the MLP's; the all-reduce without sequence parallelism moves the same
//!   bytes), an MoE layer's once (its experts see sequence-parallel tokens); `2 * (tp - 1) /
//!   tp * T * hidden * 2` bytes per pair, over NVLink within a node, added to F and to B
//!   (not overlapped).
//! * **EP all-to-all** (one dispatch and one combine per MoE layer and op, on the rank's
//!   expert-parallel stream): each of the `T / tp` tokens goes to `top_k` experts. Within a
//!   node every copy crosses NVLink; an EP group spanning `N` nodes sends a token over the
//!   network once per destination node (DeepEP's two-level kernels: at most `max_nodes`
//!   nodes with node-limited routing, else the expected number of distinct nodes among
//!   `top_k` random experts) and fans it out over NVLink; `--a2a flat` (one level, as `run
//!   --a2a flat` executes it) sends every copy bound for another node over the network,
//!   `top_k (N - 1) / N` copies per token. Dispatch moves fp8 (`hidden +
//!   hidden / 128 * 4` bytes per copy: 1-byte values and a 4-byte scale per 128) under
//!   `--dtype fp8`, else bf16; combine bf16. Achieved bandwidth: DeepEP's published normal
//!   kernels on H800 (DeepEP README, legacy table: intranode EP8 153 / 158 GB/s dispatch /
//!   combine over NVLink; internode EP16 43 / 43, EP32 58 / 57, EP64 51 / 50 GB/s over
//!   RDMA), scaled by the GPU's link bandwidth against H800's (160 GB/s achievable NVLink, 50
//!   GB/s network).
//! * **PP messages**: `T / tp * hidden * 2` bytes per stage boundary, over the network when
//!   a pipeline stage's `tp * cp * dp` GPUs fill a node or more, else over NVLink.
//! * **DP gradient reduction**: after the last micro-batch, each rank reduces its gradients
//!   (fp32) over its data-parallel group (`dp * cp` for dense weights, `dp * cp * tp / ep`
//!   for experts): a reduce-scatter with `--distributed-optimizer` (then an all-gather of the
//!   bf16 parameters), else an all-reduce, ring cost `(n - 1) / n` of the bytes per pass. It
//!   overlaps the last micro-batch's backward on the rank (Megatron-LM's
//!   `--overlap-grad-reduce`); what is left is exposed. The all-gather overlaps the next
//!   step's first forward (`--overlap-param-gather`).
//! * **Optimizer**: Adam reads the fp32 gradient, master weight and two moments, writes them
//!   and the bf16 weight: 30 bytes per parameter the rank updates, at `e_hbm` of the HBM
//!   bandwidth.
//!
//! ## Memory per rank (bytes)
//!
//! Megatron-LM's accounting (`docs/.../distrib_optimizer.md`): 2 bytes of bf16 weight and 4 of
//! fp32 gradient per parameter, plus 12 of optimizer state (fp32 master weight, two Adam
//! moments), divided by the data-parallel group with `--distributed-optimizer` (18 or `6 +
//! 12 / d` bytes per parameter). A rank holding two chunks (DualPipe, V placements) holds
//! both chunks' parameters. Activations per micro-batch and chunk come from the tensors the
//! backward needs (module [`activation_bytes`](self) docs), times the live (stage, micro-batch)
//! count the simulator tracks on that rank, with B freeing all but the GEMM inputs W needs.
//! A fixed overhead per GPU (CUDA context, NCCL and cuBLAS buffers, allocator slack) is added.
//!
//! Every efficiency is a field of [`Efficiency`] with its default and the data it was fitted
//! on (the book's "Against real clusters" chapter).

pub mod arch;
pub mod clusters;
pub mod hardware;
pub mod layout;

use crate::sim::cost::{CostModel, Memory, Moe, OpCosts, StageMemory, StageMoe};
use crate::sim::SimResult;
use arch::{Arch, Attention};
use hardware::Hardware;
use layout::{A2a, Chunk, Dtype, Mesh, Recompute};
use schedc_ir::Pipeline;
use serde::Serialize;

/// The efficiencies and constants the cost model cannot derive, with their sources.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Efficiency {
    /// Largest fraction of the bf16 peak a bf16 (or fp16) GEMM reaches. Fitted (see the
    /// book).
    pub gemm: f64,
    /// Largest fraction of the fp8 peak an fp8 GEMM reaches (fine-grained scaling and
    /// quantization included). Fitted (see the book).
    pub gemm_fp8: f64,
    /// Rows at which a GEMM reaches half of `gemm`: the shape of the size curve, from
    /// schedc's own cuBLAS bf16 measurement on an H200 (issue of 2026-12-04: 128-row expert
    /// GEMMs at 65% of the large-GEMM rate, 1024 rows at 98%).
    pub gemm_rows_half: f64,
    /// Fraction of the bf16 peak the attention core reaches (FlashAttention-2 on Hopper:
    /// about 35-50% forward and backward; assumed 0.45, not fitted).
    pub attn: f64,
    /// Fraction of the HBM bandwidth memory-bound ops reach (assumed 0.8, not fitted).
    pub hbm: f64,
    /// Fraction of the datasheet link bandwidth a TP collective, a PP message or a DP
    /// reduction reaches (assumed 0.8, not fitted).
    pub link: f64,
    /// Seconds per message on top of its transfer (PP, each collective).
    pub latency: f64,
    /// Seconds per transformer layer added to each F, B and W: the host's share that the GPU
    /// does not hide (kernel launches, framework overhead; a constant of the software, so it
    /// weighs more on a faster GPU). Fitted (see the book).
    pub layer_overhead: f64,
    /// Bytes per GPU besides weights, gradients, optimizer state and activations (CUDA
    /// context, NCCL and cuBLAS workspaces, allocator slack). Fitted (see the book).
    pub overhead_bytes: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Efficiency {
            // Fitted by `cargo run --release -p schedc --example calibrate` (the book's
            // "Against real clusters"): `gemm` on sail-sg#21's 1F1B throughput, `gemm_fp8` on
            // DeepSeek-V3's 180K H800 GPU-hours per trillion tokens.
            gemm: 0.4403,
            gemm_fp8: 0.2914,
            gemm_rows_half: 64.0,
            attn: 0.45,
            hbm: 0.8,
            link: 0.8,
            latency: 1e-5,
            layer_overhead: 0.0,
            // Fitted on sail-sg#21's 1F1B memory (48 GB), held at 0: the activations counted
            // already exceed it by 0.3 GB.
            overhead_bytes: 0.0,
        }
    }
}

/// The layout and training options besides the mesh.
#[derive(Clone, Debug, PartialEq)]
pub struct Training {
    /// The mesh.
    pub mesh: Mesh,
    /// Tokens per sequence.
    pub seq: u64,
    /// Sequences per micro-batch.
    pub micro_batch_size: u64,
    /// Recomputation in the backward.
    pub recompute: Recompute,
    /// Optimizer state sharded over the data-parallel group (ZeRO-1).
    pub distributed_optimizer: bool,
    /// GEMM number format.
    pub dtype: Dtype,
    /// A Megatron-LM layout string (`--layout`), else [`layout::default_split`].
    pub layout: Option<String>,
    /// FlashAttention (`true`, the default) or eager attention (`--attention eager`,
    /// Megatron-LM's fused softmax before FlashAttention: the `heads x seq x seq` scores
    /// stored, 5 bytes per score with dropout, Korthikanti et al. 2022 eq. 2's `5as/h` term,
    /// and the full product computed).
    pub flash_attention: bool,
    /// The EP all-to-all across nodes: two-level (the default) or flat (`--a2a`).
    pub a2a: A2a,
}

/// What one model chunk costs, per micro-batch on one GPU of its stage.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChunkCost {
    /// Forward, seconds (compute, memory-bound ops and TP collectives).
    pub f: f64,
    /// Input-gradient backward, seconds.
    pub b: f64,
    /// Weight-gradient backward, seconds.
    pub w: f64,
    /// Share of F, B and BW in the attention part (the MoE parts' split), in [0, 1].
    pub attn_share: f64,
    /// One dispatch of the op (every MoE layer of the chunk), seconds.
    pub dispatch: f64,
    /// One combine, seconds.
    pub combine: f64,
    /// MoE layers in the chunk.
    pub moe_layers: u32,
    /// Activation bytes stored per micro-batch.
    pub activation_bytes: f64,
    /// Share of them B frees (the rest, W's GEMM inputs, W frees).
    pub released_at_b: f64,
    /// Parameters held by one GPU of the stage, elements.
    pub params: f64,
    /// Weight bytes (bf16).
    pub param_bytes: f64,
    /// Gradient bytes (fp32).
    pub grad_bytes: f64,
    /// Optimizer-state bytes.
    pub optimizer_bytes: f64,
    /// Exposed DP reduction at the end of the step, seconds.
    pub dp_exposed: f64,
    /// DP reduction time in all, seconds.
    pub dp_reduce: f64,
    /// Optimizer step, seconds.
    pub optimizer: f64,
    /// Model FLOPs of one micro-batch's forward on the whole chunk (all TP ranks), the
    /// Megatron-LM convention (module docs of [`Derived::model_flops_per_step`]).
    pub model_flops_fwd: f64,
}

/// The derived costs of every model chunk, and what the report needs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Derived {
    /// Per model chunk, in model order.
    pub chunks: Vec<ChunkCost>,
    /// Bytes of one PP message.
    pub p2p_bytes: f64,
    /// Seconds of one PP message.
    pub p2p_seconds: f64,
    /// The PP link's latency (seconds) and bandwidth (bytes per second) that
    /// [`Derived::p2p_seconds`] is made of, so that a message of another size (a lent stash,
    /// BPipe's `LEND`/`RETURN`) is priced on the same link.
    #[serde(skip)]
    pub p2p_link: (f64, f64),
    /// GPUs.
    pub gpus: u64,
    /// Tokens per step over all GPUs.
    pub tokens_per_step: f64,
    /// Model FLOPs per step over all GPUs: 3 times the forward's (no recomputation counted),
    /// with the causal attention core at half of the full `seq x seq` product. Megatron-LM
    /// (`num_floating_point_operations`, megatron/training/training.py) counts the same GEMMs
    /// and logits.
    pub model_flops_per_step: f64,
    /// The peak the MFU is measured against (the dtype's dense peak), FLOP/s per GPU.
    pub peak_flops: f64,
    /// Memory per GPU, bytes.
    pub gpu_memory: f64,
    /// Bytes per GPU besides the schedule's (overhead).
    pub overhead_bytes: f64,
    /// The chunks' contents, for the report.
    #[serde(skip)]
    pub layout: Vec<Chunk>,
}

/// Achieved all-to-all bandwidth on H800 by EP size, DeepEP's normal kernels (README legacy
/// table): `(ep, dispatch GB/s, combine GB/s)`; EP 8 is NVLink, the rest RDMA.
const DEEPEP_H800: [(u32, f64, f64); 4] = [
    (8, 153.0, 158.0),
    (16, 43.0, 43.0),
    (32, 58.0, 57.0),
    (64, 51.0, 50.0),
];

/// The achieved bandwidth of a dispatch (`combine = false`) or combine over the network for
/// an EP group of `ep` GPUs spanning nodes, on H800 (bytes/s): DeepEP's figure at that size,
/// log-linearly interpolated between sizes and held beyond them.
pub fn deepep_network_bandwidth(ep: u32, combine: bool) -> f64 {
    let pick = |r: &(u32, f64, f64)| if combine { r.2 } else { r.1 };
    let rows = &DEEPEP_H800[1..];
    let e = ep.max(16) as f64;
    if e <= rows[0].0 as f64 {
        return pick(&rows[0]) * 1e9;
    }
    for w in rows.windows(2) {
        let (a, b) = (w[0].0 as f64, w[1].0 as f64);
        if e <= b {
            let t = (e.ln() - a.ln()) / (b.ln() - a.ln());
            return (pick(&w[0]) + t * (pick(&w[1]) - pick(&w[0]))) * 1e9;
        }
    }
    pick(&rows[rows.len() - 1]) * 1e9
}

/// DeepEP's intranode (NVLink) achieved bandwidth on H800, bytes/s.
pub fn deepep_nvlink_bandwidth(combine: bool) -> f64 {
    if combine {
        DEEPEP_H800[0].2 * 1e9
    } else {
        DEEPEP_H800[0].1 * 1e9
    }
}

/// H800's links as DeepEP's figures were measured on (bytes/s): NVLink's achievable 160
/// GB/s ("~160 GB/s NVLink maximum bandwidth", DeepEP README) against the datasheet's 200
/// per direction, and the 400 Gb/s NIC's 50.
const H800_NVLINK: f64 = 200e9;
const H800_NETWORK: f64 = 50e9;

/// One EP all-to-all to price with [`all_to_all_seconds`]: which layer's exchange, over
/// which mesh, in which precision and algorithm.
#[derive(Debug, Clone, Copy)]
pub struct AllToAll<'a> {
    /// The parallel layout (the EP group's size and its stride over the nodes).
    pub mesh: &'a Mesh,
    /// Tokens leaving one GPU in this exchange (before top-k replication).
    pub tokens: f64,
    /// Training precision: fp8 dispatches 1 byte per value plus a 4-byte scale per 128.
    pub dtype: Dtype,
    /// `true` for combine (always bf16), `false` for dispatch.
    pub combine: bool,
    /// Two-level (DeepSeek's node-limited) or flat.
    pub a2a: A2a,
}

/// Seconds of one EP all-to-all (dispatch or combine) of one MoE layer, and its bytes
/// leaving the GPU `(network, NVLink)`: `(seconds, bytes, bytes)`. See the module docs.
pub fn all_to_all_seconds(
    arch: &Arch,
    hw: &Hardware,
    q: &AllToAll<'_>,
    eff: &Efficiency,
) -> (f64, f64, f64) {
    let AllToAll {
        mesh,
        tokens,
        dtype,
        combine,
        a2a,
    } = *q;
    let Some(moe) = &arch.moe else {
        return (0.0, 0.0, 0.0);
    };
    let ep = mesh.ep as u64;
    if ep <= 1 {
        return (0.0, 0.0, 0.0);
    }
    let h = arch.hidden as f64;
    let bytes = if !combine && dtype == Dtype::Fp8 {
        h + h / 128.0 * 4.0
    } else {
        2.0 * h
    };
    let k = moe.top_k as f64;
    let gpn = hw.gpus_per_node as u64;
    // EP ranks on one node: the EP group's stride is tp * cp (Megatron's order tp-cp-ep-dp-pp).
    let stride = (mesh.tp as u64 * mesh.cp as u64).max(1);
    let g = (gpn / stride).clamp(1, ep);
    let nodes = ep.div_ceil(g);
    let e = ep as f64;
    let (net_copies, nvl_copies) = if nodes <= 1 {
        (0.0, k * (e - 1.0) / e)
    } else {
        let n = nodes as f64;
        match a2a {
            A2a::Hierarchical => {
                let distinct = match moe.max_nodes {
                    Some(m) => (m as f64).min(k).min(n),
                    None => n * (1.0 - (1.0 - 1.0 / n).powf(k)),
                };
                (distinct * (n - 1.0) / n, k * (e - 1.0) / e)
            }
            // Every copy to an expert off the node crosses the network; node-limited
            // routing keeps a token's experts on at most `max_nodes` nodes, which does not
            // change the expected share off the sender's node.
            A2a::Flat => (k * (n - 1.0) / n, k * (g as f64 - 1.0) / e),
        }
    };
    let net_bw = if nodes <= 1 {
        f64::INFINITY
    } else {
        deepep_network_bandwidth(mesh.ep, combine) * hw.network_bandwidth / H800_NETWORK
    };
    let nvl_bw = deepep_nvlink_bandwidth(combine) * hw.nvlink_bandwidth / H800_NVLINK;
    let net = tokens * net_copies * bytes;
    let nvl = tokens * nvl_copies * bytes;
    // Across nodes, DeepEP's figure is the whole all-to-all's time over its network bytes
    // (the NVLink forwarding overlaps it: "bottleneck bandwidth (RDMA)"); within a node,
    // NVLink's.
    let t = if nodes > 1 {
        net / net_bw
    } else {
        nvl / nvl_bw
    } + eff.latency;
    (t, net, nvl)
}

/// Derives every chunk's costs for `chunks` model chunks (stages of one direction).
///
/// Errors: the mesh does not fit the model (`tp` not dividing the heads or the key-value
/// heads, `ep` not dividing the experts or `tp * cp * dp`, `cp` not dividing the sequence),
/// or the layout does not (see [`layout::parse_layout`], [`layout::default_split`]), each
/// naming the dimension or field.
pub fn derive(
    arch: &Arch,
    hw: &Hardware,
    tr: &Training,
    chunks: u32,
    microbatches_total: u32,
    eff: &Efficiency,
) -> Result<Derived, String> {
    let m = tr.mesh;
    let heads = arch.attention.heads();
    if !heads.is_multiple_of(m.tp as u64) {
        return Err(format!(
            "--mesh tp={} does not divide the model's {heads} attention heads",
            m.tp
        ));
    }
    let kvh = arch.attention.kv_heads();
    if !(kvh.is_multiple_of(m.tp as u64) || (m.tp as u64).is_multiple_of(kvh)) {
        return Err(format!(
            "--mesh tp={} does not divide the model's {kvh} key-value heads (nor a multiple of them)",
            m.tp
        ));
    }
    match &arch.moe {
        Some(moe) => {
            if !moe.experts.is_multiple_of(m.ep as u64) {
                return Err(format!(
                    "--mesh ep={} does not divide the model's {} routed experts",
                    m.ep, moe.experts
                ));
            }
            let fold = m.tp * m.cp * m.dp;
            if !fold.is_multiple_of(m.ep) {
                return Err(format!(
                    "--mesh ep={} must divide tp * cp * dp = {fold} (the expert-parallel group is folded into the data-, context- and tensor-parallel GPUs of a stage)",
                    m.ep
                ));
            }
        }
        None if m.ep > 1 => {
            return Err(format!(
                "--mesh ep={}: the model is dense (no routed experts)",
                m.ep
            ))
        }
        None => {}
    }
    if !tr.seq.is_multiple_of(m.cp as u64) {
        return Err(format!(
            "--mesh cp={} does not divide the sequence length {}",
            m.cp, tr.seq
        ));
    }
    if m.tp > hw.gpus_per_node {
        return Err(format!(
            "--mesh tp={} spans more than a node of {} GPUs",
            m.tp, hw.gpus_per_node
        ));
    }
    let layout = match &tr.layout {
        Some(s) => layout::parse_layout(s, arch.layers(), chunks)?,
        None => layout::default_split(arch.layers(), chunks)?,
    };
    let mtp: u32 = layout.iter().map(|c| c.mtp).sum();
    if mtp > arch.mtp_layers {
        return Err(format!(
            "--layout places {mtp} multi-token-prediction module(s) (`m`), but the model has {} (`num_nextn_predict_layers`)",
            arch.mtp_layers
        ));
    }
    let tp = m.tp as f64;
    let h = arch.hidden as f64;
    let seq = tr.seq as f64;
    let t = seq * tr.micro_batch_size as f64 / m.cp as f64; // attention tokens per GPU
    let tl = t / tp; // sequence-parallel tokens per GPU
    let peak = match tr.dtype {
        Dtype::Bf16 => hw.bf16_flops,
        Dtype::Fp8 => hw.fp8_flops,
    };
    let gemm = |flops: f64, rows: f64| -> f64 {
        if flops <= 0.0 {
            return 0.0;
        }
        let top = match tr.dtype {
            Dtype::Bf16 => hw.gemm_efficiency.unwrap_or(eff.gemm),
            Dtype::Fp8 => hw.gemm_fp8_efficiency.unwrap_or(eff.gemm_fp8),
        };
        let e = top * rows / (rows + eff.gemm_rows_half);
        flops / (peak * e)
    };
    let attn_core = |flops: f64| flops / (hw.bf16_flops * eff.attn);
    let hbm = |bytes: f64| bytes / (hw.hbm_bandwidth * eff.hbm);
    let gpn = hw.gpus_per_node as u64;
    let link_bw = |group: u64, stride: u64| -> f64 {
        if group * stride <= gpn {
            hw.nvlink_bandwidth * eff.link
        } else {
            hw.network_bandwidth * eff.link
        }
    };
    // One TP all-gather + reduce-scatter pair (or one all-reduce), seconds.
    let tp_pair = if m.tp > 1 {
        2.0 * (tp - 1.0) / tp * t * h * 2.0 / link_bw(m.tp as u64, 1) + 2.0 * eff.latency
    } else {
        0.0
    };
    let (dqk, dv) = arch.attention.core_dims();
    let hq = heads as f64 / tp;
    let core_fwd = 2.0 * t * (seq / 2.0) * hq * (dqk + dv) as f64;
    let core_model_fwd = 2.0 * t * (seq / 2.0) * heads as f64 * (dqk + dv) as f64;
    let attn_mats = arch.attention.matrices(arch.hidden);
    let attn_params: f64 = attn_mats.iter().map(|&(a, b)| (a * b) as f64).sum::<f64>()
        + arch.attention.extra_params() as f64;
    let attn_gemm_fwd = 2.0 * t * attn_mats.iter().map(|&(a, b)| (a * b) as f64).sum::<f64>() / tp;
    // Attention activations per token (bf16 elements), stored for the backward: the norm's
    // input and output, the projections' outputs (queries, keys, values; MLA's compressed
    // latents too), the core's output and its log-sum-exp (fp32 per head).
    let (attn_act, attn_recomputable) = match arch.attention {
        Attention::Gqa {
            heads,
            kv_heads,
            head_dim,
            ..
        } => {
            let qkv = ((heads + 2 * kv_heads) * head_dim) as f64;
            let o = (heads * head_dim) as f64;
            (2.0 * h + qkv + o + 2.0 * heads as f64, h + qkv)
        }
        Attention::Mla {
            heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        } => {
            let q = (heads * (qk_nope_head_dim + qk_rope_head_dim)) as f64;
            let k = (heads * (qk_nope_head_dim + qk_rope_head_dim)) as f64;
            let v = (heads * v_head_dim) as f64;
            let lat = 2.0 * (q_lora_rank.unwrap_or(0) + kv_lora_rank + qk_rope_head_dim) as f64;
            (
                2.0 * h + lat + q + k + v + v + 2.0 * heads as f64,
                h + q + k + v,
            )
        }
    };
    // Bytes per element of a stored GEMM input.
    let gin = if tr.dtype == Dtype::Fp8 { 1.0 } else { 2.0 };
    let pp_stride = m.per_stage();
    let p2p_bytes = tl * h * 2.0;
    let p2p_bw = if pp_stride >= gpn {
        hw.network_bandwidth * eff.link
    } else {
        hw.nvlink_bandwidth * eff.link
    };
    let p2p_seconds = p2p_bytes / p2p_bw + eff.latency;
    let dp_dense = (m.dp * m.cp) as f64;
    let dp_expert = (m.dp * m.cp * m.tp) as f64 / m.ep as f64;
    let mut out = Vec::with_capacity(layout.len());
    let mut total_model_fwd = 0.0;
    for c in &layout {
        let mut cc = ChunkCost::default();
        let (mut f_attn, mut f_mlp, mut b_attn, mut b_mlp, mut w) = (0.0, 0.0, 0.0, 0.0, 0.0);
        let (mut act, mut act_w) = (0.0f64, 0.0f64);
        let (mut dense_params, mut expert_params) = (0.0f64, 0.0f64);
        let mut model_fwd = 0.0;
        let layer_list: Vec<(usize, bool)> = c
            .layers
            .iter()
            .map(|&i| (i, arch.moe_layers[i]))
            .chain((0..c.mtp).map(|_| {
                (
                    arch.moe_layers.len() - 1,
                    *arch.moe_layers.last().unwrap_or(&false),
                )
            }))
            .collect();
        for &(i, is_moe) in &layer_list {
            f_attn += eff.layer_overhead;
            b_attn += eff.layer_overhead;
            w += eff.layer_overhead;
            // Attention.
            let ag = gemm(attn_gemm_fwd, t);
            let elem_attn = hbm(2.0 * 8.0 * tl * h);
            // Eager attention: the full product as two batched GEMMs, and the softmax and
            // dropout over the stored scores (read and written in 16 bits, a 1-byte mask).
            let (core_f, core_b) = if tr.flash_attention {
                (attn_core(core_fwd), attn_core(2.5 * core_fwd))
            } else {
                let scores = hq * seq * t;
                (
                    gemm(2.0 * core_fwd, seq) + hbm(9.0 * scores),
                    gemm(4.0 * core_fwd, seq) + hbm(14.0 * scores),
                )
            };
            let fa = ag + core_f + elem_attn + tp_pair;
            f_attn += fa;
            let mut ba = ag + core_b + 2.0 * elem_attn + tp_pair;
            match tr.recompute {
                Recompute::Full => ba += fa,
                Recompute::Selective => ba += gemm(attn_gemm_fwd * 0.5, t) + elem_attn,
                Recompute::None => {}
            }
            b_attn += ba;
            w += ag;
            model_fwd += 2.0 * t * attn_params + core_model_fwd;
            // Attention activations (bf16), per GPU.
            let scores = if tr.flash_attention {
                0.0
            } else {
                5.0 * hq * seq * t
            };
            let a_store = match tr.recompute {
                Recompute::None => attn_act * tl * 2.0 + scores,
                Recompute::Selective => (attn_act - attn_recomputable) * tl * 2.0,
                Recompute::Full => 0.0,
            };
            act += a_store;
            act_w += (2.0 * h) * tl * 2.0; // the projections' inputs stay for W
            dense_params += (attn_params + 2.0 * h) / tp;
            // Feed-forward.
            let (e_par, rest_par) = arch.ffn_split(i);
            if is_moe {
                let moe = arch.moe.as_ref().expect("an MoE layer has experts");
                let k = moe.top_k as f64;
                let ef = moe.expert_ffn as f64;
                let rows = (tl * k * m.ep as f64 / moe.experts as f64).max(1.0);
                let expert_fwd = 2.0 * tl * k * 3.0 * h * ef;
                let shared_fwd = 2.0 * t * 3.0 * h * moe.shared_ffn as f64 / tp;
                let router = 2.0 * tl * h * moe.experts as f64;
                let g = gemm(expert_fwd, rows) + gemm(shared_fwd, t) + gemm(router, tl);
                let elem =
                    hbm(2.0
                        * (6.0 * tl * h
                            + 3.0 * tl * k * ef
                            + 3.0 * t * moe.shared_ffn as f64 / tp));
                let fm = g + elem;
                f_mlp += fm;
                let mut bm = g + 2.0 * elem;
                match tr.recompute {
                    Recompute::Full => bm += fm,
                    Recompute::Selective => bm += elem,
                    Recompute::None => {}
                }
                b_mlp += bm;
                w += g;
                model_fwd += expert_fwd * tp + shared_fwd * tp + router * tp;
                // Activations, bytes: the norm's input and output, the router's fp32
                // logits; per routed copy its input and its gate and up outputs (the
                // SwiGLU's inputs), both GEMM inputs that --dtype fp8 caches in fp8
                // (DeepSeek-V3 §3.3.3), and the SwiGLU output; the shared experts' the
                // same. Selective recomputation rebuilds the norm's output and the SwiGLU
                // outputs (DeepSeek-V3 caches the SwiGLU's inputs and recomputes its
                // output).
                let sf = moe.shared_ffn as f64 / tp;
                let full = tl * (4.0 * h + 4.0 * moe.experts as f64)
                    + tl * k * (gin * h + 2.0 * gin * ef + 2.0 * ef)
                    + t * (2.0 * gin + 2.0) * sf;
                let recomputable = tl * 2.0 * h + tl * k * 2.0 * ef + t * 2.0 * sf;
                act += match tr.recompute {
                    Recompute::None => full,
                    Recompute::Selective => full - recomputable,
                    Recompute::Full => 0.0,
                };
                act_w += tl * gin * h + tl * k * (gin * h + 2.0 * ef) + t * 2.0 * sf;
                let local_experts = moe.experts as f64 / m.ep as f64;
                expert_params += e_par as f64 * local_experts / moe.experts as f64;
                dense_params += rest_par as f64 / tp;
                cc.moe_layers += 1;
            } else {
                let ff = arch.ffn as f64 / tp;
                let mlp_fwd = 2.0 * t * 3.0 * h * ff;
                let g = gemm(mlp_fwd, t);
                let elem = hbm(2.0 * (6.0 * tl * h + 3.0 * t * ff));
                let fm = g + elem + tp_pair;
                f_mlp += fm;
                let mut bm = g + 2.0 * elem + tp_pair;
                match tr.recompute {
                    Recompute::Full => bm += fm,
                    Recompute::Selective => bm += elem,
                    Recompute::None => {}
                }
                b_mlp += bm;
                w += g;
                model_fwd += mlp_fwd * tp;
                // Bytes: the norm's input (bf16) and output (fc1's input), gate and up
                // (bf16), the SwiGLU output (fc2's input); GEMM inputs in fp8 under
                // --dtype fp8. Selective recomputation rebuilds the norm and SwiGLU outputs.
                let full = 2.0 * tl * h + gin * tl * h + 4.0 * t * ff + gin * t * ff;
                let recomputable = gin * tl * h + gin * t * ff;
                act += match tr.recompute {
                    Recompute::None => full,
                    Recompute::Selective => full - recomputable,
                    Recompute::Full => 0.0,
                };
                act_w += gin * (tl * h + t * ff);
                dense_params += rest_par as f64 / tp;
            }
            if tr.recompute == Recompute::Full {
                act += 2.0 * tl * h; // the layer's input
            }
        }
        // The embedding: a lookup (memory-bound) and its gradient's scatter-add in W.
        if c.embedding {
            f_attn += hbm(2.0 * tl * h * 2.0);
            w += hbm(3.0 * tl * h * 4.0);
            dense_params += arch.embedding_params() as f64 / tp;
        }
        // The head: the final norm, the logits GEMM, the loss on fp32 logits.
        let heads_here = u32::from(c.head) + c.mtp;
        for _ in 0..heads_here {
            let v = arch.vocab as f64 / tp;
            let logits = 2.0 * t * h * v;
            let g = gemm(logits, t);
            let elem = hbm(t * v * 4.0 * 3.0 + 4.0 * tl * h);
            f_mlp += g + elem;
            b_mlp += g + elem;
            w += g;
            model_fwd += logits * tp;
            act += 2.0 * tl * h * 2.0 + t * v * 4.0;
            act_w += 2.0 * t * h;
            if !(arch.tied_embeddings && c.embedding) {
                dense_params += v * h;
            }
            dense_params += h / tp;
        }
        cc.f = f_attn + f_mlp;
        cc.b = b_attn + b_mlp;
        cc.w = w;
        let comp = f_attn + f_mlp + b_attn + b_mlp;
        cc.attn_share = if comp > 0.0 {
            ((f_attn + b_attn) / comp).clamp(0.0, 1.0)
        } else {
            0.5
        };
        if cc.moe_layers > 0 {
            let q = |combine| AllToAll {
                mesh: &m,
                tokens: tl,
                dtype: tr.dtype,
                combine,
                a2a: tr.a2a,
            };
            let (d, _, _) = all_to_all_seconds(arch, hw, &q(false), eff);
            let (cb, _, _) = all_to_all_seconds(arch, hw, &q(true), eff);
            cc.dispatch = d * cc.moe_layers as f64;
            cc.combine = cb * cc.moe_layers as f64;
        }
        cc.activation_bytes = act;
        cc.released_at_b = if act > 0.0 {
            (1.0 - act_w.min(act) / act).clamp(0.0, 1.0)
        } else {
            1.0
        };
        cc.params = dense_params + expert_params;
        cc.param_bytes = 2.0 * cc.params;
        cc.grad_bytes = 4.0 * cc.params;
        let opt_div = |n: f64| if tr.distributed_optimizer { n } else { 1.0 };
        cc.optimizer_bytes =
            12.0 * (dense_params / opt_div(dp_dense) + expert_params / opt_div(dp_expert));
        // DP reduction, seconds: ring over the group, fp32 gradients.
        let ring = |params: f64, n: f64, stride: u64| -> f64 {
            if n <= 1.0 || params <= 0.0 {
                return 0.0;
            }
            let bw = link_bw(n as u64, stride);
            // A reduce-scatter (the distributed optimizer; its all-gather of the weights
            // overlaps the next step's first forward) or an all-reduce (two passes).
            let pass = (n - 1.0) / n * params * 4.0 / bw;
            if tr.distributed_optimizer {
                pass
            } else {
                2.0 * pass
            }
        };
        let dense_stride = (m.tp as u64) * (m.cp as u64);
        let reduce = ring(dense_params, dp_dense, dense_stride)
            + ring(expert_params, dp_expert, m.ep as u64);
        cc.dp_reduce = reduce;
        cc.dp_exposed = (reduce - (cc.b + cc.w)).max(0.0);
        let updated = dense_params / opt_div(dp_dense) + expert_params / opt_div(dp_expert);
        cc.optimizer = hbm(30.0 * updated);
        cc.model_flops_fwd = model_fwd;
        total_model_fwd += model_fwd;
        out.push(cc);
    }
    let gpus = m.gpus();
    let seqs = m.dp as f64 * microbatches_total as f64 * tr.micro_batch_size as f64;
    // A chunk's model FLOPs are per micro-batch of `t` tokens on one CP rank: scale by cp.
    let model_flops_per_step =
        3.0 * total_model_fwd * m.cp as f64 * m.dp as f64 * microbatches_total as f64;
    Ok(Derived {
        chunks: out,
        p2p_bytes,
        p2p_seconds,
        p2p_link: (eff.latency, p2p_bw),
        gpus,
        tokens_per_step: seqs * tr.seq as f64,
        model_flops_per_step,
        peak_flops: peak,
        gpu_memory: hw.hbm_bytes,
        overhead_bytes: eff.overhead_bytes,
        layout,
    })
}

impl Derived {
    /// The simulator's cost model for a program of `stages` stage ids with `per_direction`
    /// stages per direction (stage `s` holds model chunk `s % per_direction`): per-stage op
    /// times, MoE parts and memory, PP messages of [`Derived::p2p_seconds`].
    pub fn cost_model(&self, stages: u32, per_direction: u32) -> CostModel {
        let mut cm = CostModel {
            // The per-stage times already hold each stage's layers: no 1/V scaling.
            op_scale: Some(1.0),
            ..CostModel::default()
        };
        // latency + bytes / bandwidth is `p2p_seconds` for an activation message; a lent
        // stash's message is priced on the same link with its own bytes.
        let (latency, bandwidth) = self.p2p_link;
        if bandwidth > 0.0 {
            cm.p2p.latency = latency;
            cm.p2p.bandwidth = bandwidth;
        } else {
            cm.p2p.latency = self.p2p_seconds;
            cm.p2p.bandwidth = 0.0;
        }
        cm.p2p.bytes = Some(self.p2p_bytes);
        let any_moe = self.chunks.iter().any(|c| c.moe_layers > 0);
        cm.moe = Moe {
            present: any_moe,
            ..Moe::default()
        };
        cm.memory = Memory::default();
        for s in 0..stages {
            let c = &self.chunks[(s % per_direction.max(1)) as usize % self.chunks.len()];
            let key = s.to_string();
            cm.compute.stage.insert(
                key.clone(),
                OpCosts {
                    f: Some(c.f),
                    b: Some(c.b),
                    w: Some(c.w),
                    bw: None,
                    fb: None,
                },
            );
            cm.moe.stage.insert(
                key.clone(),
                StageMoe {
                    dispatch: Some(c.dispatch),
                    combine: Some(c.combine),
                    attn_share: Some(c.attn_share),
                },
            );
            cm.memory.stage.insert(
                key,
                StageMemory {
                    activation_bytes: Some(c.activation_bytes),
                    released_at_b: Some(c.released_at_b),
                    param_bytes: Some(c.param_bytes),
                    grad_bytes: Some(c.grad_bytes),
                    optimizer_bytes: Some(c.optimizer_bytes),
                },
            );
        }
        cm
    }
}

/// The step-level figures `sim` adds with `--model`.
#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    /// The step: the schedule's makespan plus, on the slowest rank to finish, the exposed
    /// data-parallel gradient reduction and the optimizer step, seconds.
    pub step_seconds: f64,
    /// Tokens per step over all GPUs.
    pub tokens_per_step: f64,
    /// Tokens per second over all GPUs.
    pub tokens_per_second: f64,
    /// Model FLOPs per step (3x the forward, causal attention, no recomputation: the
    /// Megatron-LM convention) / step / GPUs, TFLOP/s.
    pub tflops_per_gpu: f64,
    /// `tflops_per_gpu` over the dense peak of `--dtype`.
    pub mfu: f64,
    /// The largest rank's memory, bytes (weights, gradients, optimizer state, the peak of
    /// live activations, and the per-GPU overhead).
    pub peak_memory_bytes: f64,
    /// Each pipeline rank's memory, bytes.
    pub memory_bytes: Vec<f64>,
    /// The GPU's memory, bytes.
    pub gpu_memory_bytes: f64,
    /// Whether every rank fits.
    pub fits: bool,
    /// Exposed data-parallel reduction plus optimizer on the rank that ends the step,
    /// seconds.
    pub step_tail_seconds: f64,
    /// MoE all-to-all time not hidden under compute, summed over ranks, seconds (one GPU
    /// of each pipeline rank).
    pub exposed_a2a_seconds: f64,
    /// GPUs.
    pub gpus: u64,
}

impl Derived {
    /// The step-level figures of a simulation `res` of a program of shape `pl` under these
    /// costs.
    pub fn step_report(&self, pl: &Pipeline, res: &SimResult) -> StepReport {
        let d = self;
        let by_rank = pl.stages_by_rank();
        let per = pl.stages_per_direction().max(1);
        let tail = |r: usize| -> f64 {
            by_rank.get(r).map_or(0.0, |v| {
                v.iter()
                    .map(|&s| {
                        let c = &d.chunks[(s % per) as usize % d.chunks.len()];
                        c.dp_exposed + c.optimizer
                    })
                    .sum()
            })
        };
        let mut step = res.makespan;
        let mut tail_max = 0.0f64;
        for r in 0..res.ranks.len() {
            let end = res.makespan + tail(r);
            if end > step {
                step = end;
            }
            tail_max = tail_max.max(tail(r));
        }
        let memory_bytes: Vec<f64> = res
            .ranks
            .iter()
            .map(|r| r.peak_memory_bytes + d.overhead_bytes)
            .collect();
        let peak = memory_bytes.iter().copied().fold(0.0, f64::max);
        let tflops = if step > 0.0 {
            d.model_flops_per_step / step / d.gpus as f64 / 1e12
        } else {
            0.0
        };
        StepReport {
            step_seconds: step,
            tokens_per_step: d.tokens_per_step,
            tokens_per_second: if step > 0.0 {
                d.tokens_per_step / step
            } else {
                0.0
            },
            tflops_per_gpu: tflops,
            mfu: tflops * 1e12 / d.peak_flops,
            peak_memory_bytes: peak,
            memory_bytes,
            gpu_memory_bytes: d.gpu_memory,
            fits: peak <= d.gpu_memory,
            step_tail_seconds: tail_max,
            exposed_a2a_seconds: res.a2a.exposed,
            gpus: d.gpus,
        }
    }
}

/// One schedule evaluated under the model-level cost model.
#[derive(Clone, Debug)]
pub struct Evaluation {
    /// The step-level figures.
    pub step: StepReport,
    /// The simulation.
    pub sim: SimResult,
    /// The derived costs.
    pub derived: Derived,
}

/// The instance of a spec to evaluate.
#[derive(Clone, Debug)]
pub struct Instance<'a> {
    /// The spec's name in messages.
    pub name: &'a str,
    /// The spec's text.
    pub text: &'a str,
    /// Pipeline ranks P.
    pub pp: u32,
    /// Micro-batches M (per direction for a bidirectional spec).
    pub mb: u32,
    /// Virtual stages per rank, when the spec leaves V free.
    pub vpp: Option<u32>,
    /// MoE parts (`--moe=...`), e.g. `auto` or `all:list`.
    pub moe: Option<&'a str>,
}

/// Loads, checks and simulates `inst` with op times and memory derived from `arch`, `hw`
/// and `tr` (the mesh's `pp` must be the instance's P): what `schedc sim SPEC --model ...`
/// computes. A spec's `list` block and `:list` parts are ordered under the derived costs.
///
/// Errors: the spec does not load or pass `schedc check` (the first diagnostic), or
/// [`derive`] refuses the layout.
pub fn evaluate(
    inst: &Instance<'_>,
    arch: &Arch,
    hw: &Hardware,
    tr: &Training,
    eff: &Efficiency,
) -> Result<Evaluation, String> {
    use crate::input::{load_str, Overrides};
    let moe = match inst.moe {
        Some(m) => Some(m.parse::<crate::moe::MoeStages>()?),
        None => None,
    };
    let mut ov = Overrides {
        pp: Some(inst.pp),
        microbatches: Some(inst.mb),
        vpp: inst.vpp,
        ..Default::default()
    };
    let describe = |e: crate::input::LoadError| match e {
        crate::input::LoadError::Spec { diags, .. } => diags
            .first()
            .map(|d| d.message.clone())
            .unwrap_or_else(|| "the spec does not elaborate".into()),
        crate::input::LoadError::Parse(p) => {
            format!("syntax error at {}:{}: {}", p.line, p.col, p.message)
        }
        crate::input::LoadError::Io(m) | crate::input::LoadError::Usage(m) => m,
    };
    let shape = load_str(inst.name, inst.text.to_string(), &ov).map_err(describe)?;
    let pl = &shape.program.pipeline;
    let derived = derive(
        arch,
        hw,
        tr,
        pl.stages_per_direction(),
        pl.total_microbatches(),
        eff,
    )?;
    let cost = derived.cost_model(pl.stages, pl.stages_per_direction());
    ov.moe = moe;
    ov.list_cost = Some(cost.clone());
    let loaded = load_str(inst.name, inst.text.to_string(), &ov).map_err(describe)?;
    let out = crate::check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
    let prog = match (&out.checked, out.report.verdict) {
        (Some(p), crate::check::Verdict::Accepted) => p,
        _ => {
            return Err(out
                .report
                .diagnostics
                .iter()
                .find(|d| d.is_error())
                .map(|d| d.message.clone())
                .unwrap_or_else(|| "the schedule does not pass `schedc check`".into()))
        }
    };
    let sim = crate::sim::simulate(prog, &cost)?;
    let step = derived.step_report(&prog.pipeline, &sim);
    Ok(Evaluation { step, sim, derived })
}
