//! A small DeepSeek-V3-style MoE transformer with every forward, input-gradient (B) and
//! weight-gradient (W) written by hand, generic over `f32`/`f64` ([`Real`]).
//!
//! ## Architecture (per layer, pre-norm, `T` tokens of width `d`)
//!
//! ```text
//! a  = RMSNorm(x; g1)                       xhat = x / sqrt(mean(x^2) + eps)
//!                                           multi-head latent attention (MLA):
//! c_Q  = RMSNorm(a W_DQ; q_norm)            T x d_c'          (queries' latent)
//! q^C  = c_Q W_UQ,  q^R = RoPE(c_Q W_QR)    T x H d_h, T x H d_h^R
//! c_KV = RMSNorm(a W_DKV; kv_norm)          T x d_c           (keys' and values' latent)
//! k^R  = RoPE(a W_KR)                       T x d_h^R: ONE RoPE key per token, all heads
//! k^C  = c_KV W_UK,  v^C = c_KV W_UV        T x H d_h, T x H d_v
//! head h: q = [q^C_h; q^R_h], k = [k^C_h; k^R]   (k^R shared by every head)
//! o  = softmax(q k^T / sqrt(d_h + d_h^R) + causal) v^C_h per head; causal: key pos <=
//!      query pos (global); RoPE rotates pairs (2i, 2i+1) by pos * base^(-2i/d_h^R)
//! h1 = x + o W_O                            W_O: H d_v x d
//! n2 = RMSNorm(h1; g2)
//! s  = sigmoid(n2 Wr)                       (T x E affinities)
//! top-k experts per token on s + bias       (bias: aux-loss-free balancing, not trained)
//! gates g_j = s_{e_j} / sum_j' s_{e_j'}     (normalized over the selected experts only)
//! y  = h1 + sum_j g_j FFN_{e_j}(n2) + FFN_shared(n2)      FFN(x) = (silu(x W1) * x W3) W2
//! ```
//!
//! The first model stage starts with a token embedding, the last ends with a final RMSNorm,
//! the LM head and cross-entropy (mean over every token of the global batch: each token's
//! loss is scaled by `1/N`, so gradients of shards and micro-batches simply add).
//!
//! Sources: DeepSeek-V3 technical report (arXiv 2412.19437) §2.1.1 (MLA, eq. 1-11) and
//! DeepSeek-V2 (arXiv 2405.04434) §2.1 (low-rank key-value joint compression, decoupled
//! RoPE); the RMSNorms on the latents `c_Q` and `c_KV` follow DeepSeek's reference
//! implementation (`inference/model.py`, `q_norm` and `kv_norm`, applied before the
//! up-projections; DeepSeek-V2 §3.1.2 mentions them). Queries are compressed too, as in
//! V3 (V2-Lite's uncompressed queries are not offered). DeepSeek-V3 §2.1.2 (sigmoid affinities,
//! selection on `s + b`, gates normalized over the selected experts, eq. 12-16) and §2.1.2
//! "Auxiliary-Loss-Free Load Balancing" (bias moved by `gamma` against the load at the end
//! of each step); RoPE: Su et al. (arXiv 2104.09864) eq. 34; RMSNorm: Zhang & Sennrich
//! (arXiv 1910.07467); SwiGLU: Shazeer (arXiv 2002.05202).
//!
//! ## Routing, capacity, balancing
//! * Selection: experts ranked by `s + bias` (ties to the lower id).
//! * Capacity (when [`ModelConfig::capacity_factor`] is set): each expert takes at most
//!   `C = max(ceil(cf T k / E), ceil(T k / (E - k + 1)))` assignments from one routing group
//!   (the tokens of one micro-batch on one rank). Assignments are made in `k` rounds, token
//!   order within a round: round `j` gives each token its best-ranked expert that it has not
//!   chosen yet and that has room. An overflowing token is thereby **re-routed** to its next
//!   best expert with spare room, never dropped; the second bound on `C` guarantees that one
//!   always exists (a stuck token would need all `E - j` experts it has not chosen to be
//!   full, `(E - j) C >= k T` assignments, more than the fewer than `(j + 1) T` made so far).
//! * Load: the top-k counts *before* capacity (what the router asked for), summed over every
//!   micro-batch and replica of the step (all-reduced with the gradients).
//! * Balancing: per layer, `ema` starts at the uniform load `1/E`; at each optimizer step,
//!   before the next step routes anything, `ema = beta ema + (1 - beta) load/sum(load)` and
//!   `bias_e += gamma sign(1/E - ema_e)`.
//!
//! ## Sequence parallelism
//! With SP size `n`, rank `j` of the SP group holds tokens `j T/n .. (j+1) T/n` of every
//! sequence. Queries and RoPE keys are rotated at these global positions. What the group
//! gathers is MLA's cache, not keys and values: every member's `[c_KV; k^R]`, `d_c +
//! d_h^R` values per token ([`StageKernels::fwd_qkv`] → all-gather →
//! [`StageKernels::fwd_attn`], which up-projects the whole sequence's latents to every
//! head's keys and values); a query at global position `p` attends keys `0..=p` (so the
//! mask offset of chunk `j` is `j T/n`). The latent and RoPE-key gradients each member
//! computes for every chunk go back to the chunk's owner, which sums them in group order
//! ([`StageKernels::bwd_attn`] → reduce-scatter → [`StageKernels::bwd_qkv`]). `W_UK` and
//! `W_UV` get each member's share (its queries' gradient over the gathered latents); the
//! data-parallel all-reduce, which spans the SP group, sums them. Each chunk is its own
//! routing group (capacity counted per chunk); the sequential reference routes whole
//! sequences in the same `n` groups ([`route_groups`]).
//!
//! ## Tensor parallelism
//! With TP size `n` (Megatron-LM, arXiv 1909.08053, §3), member `j` holds heads
//! `j H/n .. (j+1) H/n` of `W_UQ`, `W_QR`, `W_UK`, `W_UV` (columns) and `W_O` (rows), and
//! hidden units `j f/n ..` of the shared expert (`W1`, `W3` columns, `W2` rows)
//! ([`tp_split`]); everything else is replicated. [`StageKernels::fwd_attn`] stops at the
//! member's partial `o W_O` (`st.tp_out`); after the all-reduce (`st.tp_in`)
//! [`StageKernels::fwd_attn_post`] adds the residual, routes, and runs the member's slice of
//! the shared expert, whose partial output is all-reduced before [`StageKernels::fwd_combine`].
//! Backward: the shared expert's partial input gradient is all-reduced before
//! [`StageKernels::bwd_attn`]; [`StageKernels::bwd_qkv`] stops at the partial gradients of
//! the column-parallel inputs `[c_Q; c_KV; k^R]`, all-reduced before
//! [`StageKernels::bwd_qkv_post`] runs the replicated norms and down-projections, whose
//! weight gradients are thereby the same on every member (no TP reduction of them needed).
//! Routed experts are whole on each EP rank and run redundantly on every TP member.
//!
//! With Megatron's sequence parallelism ([`StageKernels::sequence_parallel`]) the local
//! tokens are the member's shard of the chunk: [`StageKernels::fwd_qkv`] leaves the shard's
//! latents for an all-gather, [`StageKernels::fwd_qkv_post`] up-projects the chunk's;
//! `o W_O` is reduce-scattered back to the shard, [`StageKernels::fwd_shared`] runs the
//! shared expert's slice on the gathered rows; the backward mirrors it
//! ([`StageKernels::bwd_shared`], [`StageKernels::bwd_attn_post`] then
//! [`StageKernels::bwd_attn_gathered`]; `[dc_Q; dc_KV; dk^R]` reduce-scattered). The RoPE
//! keys are rotated at the shard's global positions.
//!
//! ## Expert parallelism
//! With EP size `n`, rank `q` of the EP group holds experts `q E/n .. (q+1) E/n`. Dispatch
//! sends each assignment's `n2` row to its expert's rank (ordered by expert, then token,
//! then slot; [`Packet::meta`] carries the expert ids); the expert rank runs the rows and
//! returns the outputs in the same order (combine). The backward runs the mirror images:
//! output gradients go to the expert ranks, input gradients come back.

use crate::tensor::{
    add_into, add_matmul_at, matmul, matmul_bt, sigmoid, silu, silu_grad, softmax_row, Real, Rng,
};
pub use schedc_program::model::{Bugs, ModelConfig, Scope};
use serde::{Deserialize, Serialize};

/// A SwiGLU feed-forward: `W1`, `W3` are `d × f`, `W2` is `f × d`.
#[derive(Clone, Debug, PartialEq)]
pub struct Ffn<T> {
    /// Gate projection, `d × f`.
    pub w1: Vec<T>,
    /// Up projection, `d × f`.
    pub w3: Vec<T>,
    /// Down projection, `f × d`.
    pub w2: Vec<T>,
}

/// One transformer layer's parameters (only the rank's own experts).
#[derive(Clone, Debug, PartialEq)]
pub struct Layer<T> {
    /// Global layer index (names and initialization).
    pub index: usize,
    /// Attention RMSNorm gain, `d`.
    pub norm1: Vec<T>,
    /// Query down-projection `W_DQ`, `d × d_c'` (eq. 6).
    pub wdq: Vec<T>,
    /// RMSNorm gain of the query latent `c_Q`, `d_c'`.
    pub q_norm: Vec<T>,
    /// Query content up-projection `W_UQ`, `d_c' × H d_h` (eq. 7).
    pub wuq: Vec<T>,
    /// Query RoPE projection `W_QR`, `d_c' × H d_h^R` (eq. 8).
    pub wqr: Vec<T>,
    /// Key/value down-projection `W_DKV`, `d × d_c` (eq. 1).
    pub wdkv: Vec<T>,
    /// RMSNorm gain of the key/value latent `c_KV`, `d_c`.
    pub kv_norm: Vec<T>,
    /// Shared RoPE key projection `W_KR`, `d × d_h^R` (eq. 3; `d × H d_h^R` under
    /// [`Bugs::per_head_kpe`]).
    pub wkr: Vec<T>,
    /// Key content up-projection `W_UK`, `d_c × H d_h` (eq. 2).
    pub wuk: Vec<T>,
    /// Value up-projection `W_UV`, `d_c × H d_v` (eq. 5).
    pub wuv: Vec<T>,
    /// Output projection `W_O`, `H d_v × d` (eq. 11).
    pub wo: Vec<T>,
    /// MoE RMSNorm gain, `d`.
    pub norm2: Vec<T>,
    /// Router, `d × E`.
    pub router: Vec<T>,
    /// Routed experts `expert_lo..expert_lo + experts.len()` of the stage.
    pub experts: Vec<Ffn<T>>,
    /// The shared expert.
    pub shared: Option<Ffn<T>>,
}

/// The parameters (or gradients) of one model stage on one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct StageParams<T> {
    /// Model stage index (`0..stages per direction`).
    pub model_stage: usize,
    /// Global id of the first local expert.
    pub expert_lo: usize,
    /// Token embedding, `V × d` (first stage only).
    pub embed: Option<Vec<T>>,
    /// The stage's layers.
    pub layers: Vec<Layer<T>>,
    /// Final RMSNorm gain, `d` (last stage only).
    pub final_norm: Option<Vec<T>>,
    /// LM head, `d × V` (last stage only).
    pub head: Option<Vec<T>>,
}

fn init_tensor<T: Real>(cfg: &ModelConfig, name: &str, n: usize, fan_in: usize) -> Vec<T> {
    let mut rng = Rng::named(cfg.seed, name);
    let a = 1.0 / (fan_in as f64).sqrt();
    (0..n).map(|_| T::of(a * rng.uniform())).collect()
}

fn init_gain<T: Real>(cfg: &ModelConfig, name: &str, n: usize) -> Vec<T> {
    // Gains near 1 (not exactly 1, so that gradient checks exercise them).
    let mut rng = Rng::named(cfg.seed, name);
    (0..n).map(|_| T::of(1.0 + 0.1 * rng.uniform())).collect()
}

impl<T: Real> Ffn<T> {
    fn init(cfg: &ModelConfig, prefix: &str) -> Self {
        let (d, f) = (cfg.hidden, cfg.expert_hidden);
        Ffn {
            w1: init_tensor(cfg, &format!("{prefix}.w1"), d * f, d),
            w3: init_tensor(cfg, &format!("{prefix}.w3"), d * f, d),
            w2: init_tensor(cfg, &format!("{prefix}.w2"), f * d, f),
        }
    }
    fn tensors(&self) -> [(&'static str, &Vec<T>); 3] {
        [("w1", &self.w1), ("w3", &self.w3), ("w2", &self.w2)]
    }
    fn tensors_mut(&mut self) -> [(&'static str, &mut Vec<T>); 3] {
        [
            ("w1", &mut self.w1),
            ("w3", &mut self.w3),
            ("w2", &mut self.w2),
        ]
    }
}

impl<T: Real> StageParams<T> {
    /// Initializes model stage `model_stage` of `n_stages`, holding experts
    /// `expert_lo..expert_hi`. Values depend only on the seed and each tensor's global name,
    /// so every partitioning of the model starts from the same weights.
    pub fn init(
        cfg: &ModelConfig,
        model_stage: usize,
        n_stages: usize,
        expert_lo: usize,
        expert_hi: usize,
    ) -> Self {
        let (d, v, e) = (cfg.hidden, cfg.vocab, cfg.experts);
        let (qr, kvr, sh) = (cfg.q_lora_rank, cfg.kv_lora_rank, AttnShape::of(cfg));
        let layers = (0..cfg.layers_per_stage)
            .map(|l| {
                let g = model_stage * cfg.layers_per_stage + l;
                let p = format!("layer{g}");
                Layer {
                    index: g,
                    norm1: init_gain(cfg, &format!("{p}.norm1"), d),
                    wdq: init_tensor(cfg, &format!("{p}.wdq"), d * qr, d),
                    q_norm: init_gain(cfg, &format!("{p}.q_norm"), qr),
                    wuq: init_tensor(cfg, &format!("{p}.wuq"), qr * sh.heads * sh.nope, qr),
                    wqr: init_tensor(cfg, &format!("{p}.wqr"), qr * sh.heads * sh.rope, qr),
                    wdkv: init_tensor(cfg, &format!("{p}.wdkv"), d * kvr, d),
                    kv_norm: init_gain(cfg, &format!("{p}.kv_norm"), kvr),
                    wkr: init_tensor(cfg, &format!("{p}.wkr"), d * sh.kpe_width(), d),
                    wuk: init_tensor(cfg, &format!("{p}.wuk"), kvr * sh.heads * sh.nope, kvr),
                    wuv: init_tensor(cfg, &format!("{p}.wuv"), kvr * sh.heads * sh.v, kvr),
                    wo: init_tensor(
                        cfg,
                        &format!("{p}.wo"),
                        sh.heads * sh.v * d,
                        sh.heads * sh.v,
                    ),
                    norm2: init_gain(cfg, &format!("{p}.norm2"), d),
                    router: init_tensor(cfg, &format!("{p}.router"), d * e, d),
                    experts: (expert_lo..expert_hi)
                        .map(|x| Ffn::init(cfg, &format!("{p}.expert{x}")))
                        .collect(),
                    shared: cfg
                        .shared_expert
                        .then(|| Ffn::init(cfg, &format!("{p}.shared"))),
                }
            })
            .collect();
        let last = model_stage + 1 == n_stages;
        StageParams {
            model_stage,
            expert_lo,
            embed: (model_stage == 0).then(|| init_tensor(cfg, "embed", v * d, 1)),
            layers,
            final_norm: last.then(|| init_gain(cfg, "final_norm", d)),
            head: last.then(|| init_tensor(cfg, "head", d * v, d)),
        }
    }

    /// The same shapes, all zeros (a gradient accumulator).
    pub fn zeros_like(&self) -> Self {
        let mut z = self.clone();
        z.visit_mut(&mut |_, _, t| t.iter_mut().for_each(|x| *x = T::zero()));
        z
    }

    /// Calls `f(name, scope, tensor)` for every tensor, in a fixed order. Names are global
    /// (`embed`, `layer3.wq`, `layer3.expert2.w1`, `head`, ...).
    pub fn visit(&self, f: &mut dyn FnMut(&str, Scope, &[T])) {
        if let Some(e) = &self.embed {
            f("embed", Scope::Dense, e);
        }
        for l in &self.layers {
            let p = format!("layer{}", l.index);
            for (n, t) in [
                ("norm1", &l.norm1),
                ("wdq", &l.wdq),
                ("q_norm", &l.q_norm),
                ("wuq", &l.wuq),
                ("wqr", &l.wqr),
                ("wdkv", &l.wdkv),
                ("kv_norm", &l.kv_norm),
                ("wkr", &l.wkr),
                ("wuk", &l.wuk),
                ("wuv", &l.wuv),
                ("wo", &l.wo),
                ("norm2", &l.norm2),
                ("router", &l.router),
            ] {
                f(&format!("{p}.{n}"), Scope::Dense, t);
            }
            if let Some(s) = &l.shared {
                for (n, t) in s.tensors() {
                    f(&format!("{p}.shared.{n}"), Scope::Dense, t);
                }
            }
            for (i, x) in l.experts.iter().enumerate() {
                for (n, t) in x.tensors() {
                    f(
                        &format!("{p}.expert{}.{n}", self.expert_lo + i),
                        Scope::Expert,
                        t,
                    );
                }
            }
        }
        if let Some(t) = &self.final_norm {
            f("final_norm", Scope::Dense, t);
        }
        if let Some(t) = &self.head {
            f("head", Scope::Dense, t);
        }
    }

    /// [`StageParams::visit`] with mutable tensors.
    pub fn visit_mut(&mut self, f: &mut dyn FnMut(&str, Scope, &mut Vec<T>)) {
        let lo = self.expert_lo;
        if let Some(e) = &mut self.embed {
            f("embed", Scope::Dense, e);
        }
        for l in &mut self.layers {
            let p = format!("layer{}", l.index);
            for (n, t) in [
                ("norm1", &mut l.norm1),
                ("wdq", &mut l.wdq),
                ("q_norm", &mut l.q_norm),
                ("wuq", &mut l.wuq),
                ("wqr", &mut l.wqr),
                ("wdkv", &mut l.wdkv),
                ("kv_norm", &mut l.kv_norm),
                ("wkr", &mut l.wkr),
                ("wuk", &mut l.wuk),
                ("wuv", &mut l.wuv),
                ("wo", &mut l.wo),
                ("norm2", &mut l.norm2),
                ("router", &mut l.router),
            ] {
                f(&format!("{p}.{n}"), Scope::Dense, t);
            }
            if let Some(s) = &mut l.shared {
                for (n, t) in s.tensors_mut() {
                    f(&format!("{p}.shared.{n}"), Scope::Dense, t);
                }
            }
            for (i, x) in l.experts.iter_mut().enumerate() {
                for (n, t) in x.tensors_mut() {
                    f(&format!("{p}.expert{}.{n}", lo + i), Scope::Expert, t);
                }
            }
        }
        if let Some(t) = &mut self.final_norm {
            f("final_norm", Scope::Dense, t);
        }
        if let Some(t) = &mut self.head {
            f("head", Scope::Dense, t);
        }
    }

    /// Every tensor of `scope`, concatenated in visit order.
    pub fn flatten(&self, scope: Scope) -> Vec<T> {
        let mut out = Vec::new();
        self.visit(&mut |_, s, t| {
            if s == scope {
                out.extend_from_slice(t);
            }
        });
        out
    }

    /// Overwrites the tensors of `scope` from `data` (the layout of [`StageParams::flatten`]).
    /// Panics if the length differs (a message from a mismatched program).
    pub fn unflatten(&mut self, scope: Scope, data: &[T]) {
        let mut at = 0;
        self.visit_mut(&mut |_, s, t| {
            if s == scope {
                let n = t.len();
                t.copy_from_slice(&data[at..at + n]);
                at += n;
            }
        });
        assert_eq!(at, data.len(), "unflatten: length mismatch");
    }
}

/// Rows of several blocks side by side: row `i` of the result is row `i` of each block in
/// turn (blocks of `w` values per row, the same number of rows). The TP collectives carry
/// such rows, so that a shard of rows is one contiguous slice.
pub fn interleave<T: Copy>(blocks: &[(&[T], usize)]) -> Vec<T> {
    let rows = blocks.first().map_or(0, |(b, w)| b.len() / (*w).max(1));
    let mut out = Vec::with_capacity(blocks.iter().map(|(b, _)| b.len()).sum());
    for r in 0..rows {
        for (b, w) in blocks {
            out.extend_from_slice(&b[r * w..(r + 1) * w]);
        }
    }
    out
}

/// Inverse of [`interleave`] for blocks of `widths`. Errors: a length that is not whole
/// rows.
pub fn deinterleave<T: Copy>(v: &[T], widths: &[usize]) -> Result<Vec<Vec<T>>, String> {
    let row: usize = widths.iter().sum();
    if row == 0 || !v.len().is_multiple_of(row) {
        return Err(format!(
            "{} values are not whole rows of {row} ({widths:?})",
            v.len()
        ));
    }
    let rows = v.len() / row;
    let mut out: Vec<Vec<T>> = widths
        .iter()
        .map(|w| Vec::with_capacity(rows * w))
        .collect();
    for r in v.chunks(row) {
        let mut at = 0;
        for (o, w) in out.iter_mut().zip(widths) {
            o.extend_from_slice(&r[at..at + w]);
            at += w;
        }
    }
    Ok(out)
}

/// How tensor parallelism splits a tensor over the TP group (Megatron-LM, Shoeybi et al.,
/// arXiv 1909.08053, §3): member `j` of `n` holds columns `j C/n .. (j+1) C/n` of every row
/// (a column-parallel weight: `W_UQ`, `W_QR`, `W_UK`, `W_UV`, whose columns are grouped by
/// head, and the shared expert's `W1`, `W3`), or rows `j R/n .. (j+1) R/n` (a row-parallel
/// weight: `W_O`, whose rows are grouped by head, and the shared expert's `W2`). Every other
/// tensor is replicated on each member: embedding, norms, the down-projections `W_DQ`,
/// `W_DKV`, `W_KR`, the router, the routed experts (whole per EP rank: no expert TP), the
/// final norm and the LM head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpSplit {
    /// Column-parallel: the matrix has this many columns.
    Columns(usize),
    /// Row-parallel.
    Rows,
}

/// How tensor parallelism splits the tensor named `name` ([`StageParams::visit`]'s names),
/// or `None` for a replicated one.
pub fn tp_split(cfg: &ModelConfig, name: &str) -> Option<TpSplit> {
    let h = cfg.heads;
    let (_, leaf) = name.split_once('.')?;
    match leaf {
        "wuq" | "wuk" => Some(TpSplit::Columns(h * cfg.qk_nope_head_dim)),
        "wqr" => Some(TpSplit::Columns(h * cfg.qk_rope_head_dim)),
        "wuv" => Some(TpSplit::Columns(h * cfg.v_head_dim)),
        "wo" | "shared.w2" => Some(TpSplit::Rows),
        "shared.w1" | "shared.w3" => Some(TpSplit::Columns(cfg.expert_hidden)),
        _ => None,
    }
}

/// Member `j`'s slice (of `n`) of `full` under `split`.
pub fn tp_slice<T: Copy>(full: &[T], split: TpSplit, j: usize, n: usize) -> Vec<T> {
    match split {
        TpSplit::Rows => {
            let per = full.len() / n;
            full[j * per..(j + 1) * per].to_vec()
        }
        TpSplit::Columns(c) => {
            let w = c / n;
            full.chunks(c)
                .flat_map(|row| row[j * w..(j + 1) * w].iter().copied())
                .collect()
        }
    }
}

/// The name under which a TP member reports its slice of a split tensor:
/// `NAME[tp J/N columns C]` or `NAME[tp J/N rows]` ([`parse_tp_shard_name`] reads it back).
pub fn tp_shard_name(name: &str, split: TpSplit, j: usize, n: usize) -> String {
    match split {
        TpSplit::Columns(c) => format!("{name}[tp {j}/{n} columns {c}]"),
        TpSplit::Rows => format!("{name}[tp {j}/{n} rows]"),
    }
}

/// Reads a [`tp_shard_name`]: `(name, split, j, n)`; `None` for a plain name.
pub fn parse_tp_shard_name(s: &str) -> Option<(&str, TpSplit, usize, usize)> {
    let (name, rest) = s.split_once("[tp ")?;
    let rest = rest.strip_suffix(']')?;
    let (jn, kind) = rest.split_once(' ')?;
    let (j, n) = jn.split_once('/')?;
    let (j, n): (usize, usize) = (j.parse().ok()?, n.parse().ok()?);
    let split = if kind == "rows" {
        TpSplit::Rows
    } else {
        TpSplit::Columns(kind.strip_prefix("columns ")?.parse().ok()?)
    };
    (j < n).then_some((name, split, j, n))
}

impl<T: Real> StageParams<T> {
    /// Keeps TP member `j`'s slice (of `n`) of every split tensor ([`tp_split`]); the
    /// replicated tensors stay whole. `n = 1` keeps everything.
    pub fn shard_tp(&mut self, cfg: &ModelConfig, j: usize, n: usize) {
        if n <= 1 {
            return;
        }
        self.visit_mut(&mut |name, _, t| {
            if let Some(split) = tp_split(cfg, name) {
                *t = tp_slice(t, split, j, n);
            }
        });
    }
}

/// A stage's gradient accumulator: parameter gradients and, per layer, the expert loads
/// counted by its routings.
#[derive(Clone, Debug, PartialEq)]
pub struct Grads<T> {
    /// Gradients, shaped like the parameters.
    pub params: StageParams<T>,
    /// Per layer, `E` counts of top-k selections.
    pub loads: Vec<Vec<T>>,
}

impl<T: Real> Grads<T> {
    /// Zero gradients and loads for `p`.
    pub fn zeros(cfg: &ModelConfig, p: &StageParams<T>) -> Self {
        Grads {
            params: p.zeros_like(),
            loads: vec![vec![T::zero(); cfg.experts]; p.layers.len()],
        }
    }
    /// The tensors of `scope` (for dense, followed by the loads) as one vector.
    pub fn flatten(&self, scope: Scope) -> Vec<T> {
        let mut v = self.params.flatten(scope);
        if scope == Scope::Dense {
            for l in &self.loads {
                v.extend_from_slice(l);
            }
        }
        v
    }
    /// Inverse of [`Grads::flatten`].
    pub fn unflatten(&mut self, scope: Scope, data: &[T]) {
        let n_loads: usize = if scope == Scope::Dense {
            self.loads.iter().map(Vec::len).sum()
        } else {
            0
        };
        let split = data.len() - n_loads;
        self.params.unflatten(scope, &data[..split]);
        if scope == Scope::Dense {
            let mut at = split;
            for l in &mut self.loads {
                let n = l.len();
                l.copy_from_slice(&data[at..at + n]);
                at += n;
            }
        }
    }
}

/// The balancing state of one MoE layer: the selection bias and the load EMA.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterState<T> {
    /// Per-expert bias added to the scores for selection only.
    pub bias: Vec<T>,
    /// EMA of the load fractions (starts at `1/E`).
    pub ema: Vec<T>,
    /// The bias routing uses (equals `bias` unless [`Bugs::bias_update_after_routing`]).
    pub routing_bias: Vec<T>,
}

impl<T: Real> RouterState<T> {
    /// The initial state: zero bias, EMA at the uniform load `1/E` (0 under
    /// [`Bugs::ema_init_zero`]).
    pub fn new(cfg: &ModelConfig) -> Self {
        let e = cfg.experts;
        let init = if cfg.bugs.ema_init_zero {
            0.0
        } else {
            1.0 / e as f64
        };
        RouterState {
            bias: vec![T::zero(); e],
            ema: vec![T::of(init); e],
            routing_bias: vec![T::zero(); e],
        }
    }

    /// Folds a step's loads (counts, summed over every replica) into the EMA and moves the
    /// bias: `ema = beta ema + (1-beta) load/sum`, `bias += gamma sign(1/E - ema)`. Called at
    /// the optimizer step, before the next routing. A step without load leaves the state.
    pub fn update(&mut self, cfg: &ModelConfig, load: &[T]) {
        let total: f64 = load.iter().map(|x| x.f64()).sum();
        // Under the bug, routing keeps using the bias from before this update.
        let before = self.bias.clone();
        if total > 0.0 {
            let e = cfg.experts as f64;
            let beta = cfg.ema_decay;
            for (i, l) in load.iter().enumerate().take(cfg.experts) {
                let frac = l.f64() / total;
                let ema = beta * self.ema[i].f64() + (1.0 - beta) * frac;
                self.ema[i] = T::of(ema);
                let diff = 1.0 / e - ema;
                let sign = if diff > 0.0 {
                    1.0
                } else if diff < 0.0 {
                    -1.0
                } else {
                    0.0
                };
                self.bias[i] = T::of(self.bias[i].f64() + cfg.bias_rate * sign);
            }
        }
        self.routing_bias = if cfg.bugs.bias_update_after_routing {
            before
        } else {
            self.bias.clone()
        };
    }
}

// ---------------------------------------------------------------------------------------
// Building blocks.

/// RMSNorm forward over rows of `d`: returns `(y, xhat, inv)` with `inv` the per-row
/// `1/sqrt(mean(x^2) + eps)`.
pub fn rmsnorm<T: Real>(x: &[T], g: &[T], d: usize, eps: f64) -> (Vec<T>, Vec<T>, Vec<T>) {
    let rows = x.len() / d;
    let mut y = vec![T::zero(); x.len()];
    let mut xhat = vec![T::zero(); x.len()];
    let mut inv = vec![T::zero(); rows];
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let ms = row.iter().map(|v| *v * *v).sum::<T>() / T::of(d as f64);
        let iv = T::one() / (ms + T::of(eps)).sqrt();
        inv[r] = iv;
        for i in 0..d {
            xhat[r * d + i] = row[i] * iv;
            y[r * d + i] = xhat[r * d + i] * g[i];
        }
    }
    (y, xhat, inv)
}

/// RMSNorm input gradient: `dx = inv (u - xhat mean(u xhat))`, `u = dy g`.
pub fn rmsnorm_backward<T: Real>(dy: &[T], g: &[T], xhat: &[T], inv: &[T], d: usize) -> Vec<T> {
    let rows = dy.len() / d;
    let mut dx = vec![T::zero(); dy.len()];
    for r in 0..rows {
        let mut dot = T::zero();
        for i in 0..d {
            dot += dy[r * d + i] * g[i] * xhat[r * d + i];
        }
        let mean = dot / T::of(d as f64);
        for i in 0..d {
            dx[r * d + i] = inv[r] * (dy[r * d + i] * g[i] - xhat[r * d + i] * mean);
        }
    }
    dx
}

/// RMSNorm gain gradient: `dg += sum over rows of dy xhat`.
pub fn rmsnorm_weight_grad<T: Real>(dg: &mut [T], dy: &[T], xhat: &[T], d: usize) {
    for (r, row) in dy.chunks(d).enumerate() {
        for i in 0..d {
            dg[i] += row[i] * xhat[r * d + i];
        }
    }
}

/// Applies RoPE (or its inverse, the transpose) in place to rows of `heads × hd`, row `i` at
/// position `pos0 + i`.
pub fn rope<T: Real>(x: &mut [T], heads: usize, hd: usize, pos0: usize, base: f64, inverse: bool) {
    let d = heads * hd;
    for (i, row) in x.chunks_mut(d).enumerate() {
        let pos = (pos0 + i) as f64;
        for h in 0..heads {
            for e in 0..hd / 2 {
                let theta = pos * base.powf(-2.0 * e as f64 / hd as f64);
                let (c, s) = (T::of(theta.cos()), T::of(theta.sin()));
                let s = if inverse { -s } else { s };
                let (a, b) = (row[h * hd + 2 * e], row[h * hd + 2 * e + 1]);
                row[h * hd + 2 * e] = a * c - b * s;
                row[h * hd + 2 * e + 1] = a * s + b * c;
            }
        }
    }
}

/// The shapes of the attention core of multi-head latent attention (DeepSeek-V3, arXiv
/// 2412.19437, §2.1.1, eq. 4, 9, 10): `H` heads; per head a content part of width
/// `nope` (`d_h`) and a RoPE part of width `rope` (`d_h^R`) in queries and keys, and values
/// of width `v`. The RoPE key of a token is one row of `rope` shared by every head
/// (`kpe_heads = 1`); [`Bugs::per_head_kpe`] gives every head its own (`kpe_heads = H`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Heads `H`.
    pub heads: usize,
    /// Per-head content width of queries and keys `d_h`.
    pub nope: usize,
    /// RoPE width `d_h^R` (per head for queries; of the shared key).
    pub rope: usize,
    /// Per-head value width.
    pub v: usize,
    /// RoPE keys per token: 1 (MLA), or `H` under [`Bugs::per_head_kpe`].
    pub kpe_heads: usize,
}

impl AttnShape {
    /// The shapes of `cfg`'s attention.
    pub fn of(cfg: &ModelConfig) -> Self {
        AttnShape {
            heads: cfg.heads,
            nope: cfg.qk_nope_head_dim,
            rope: cfg.qk_rope_head_dim,
            v: cfg.v_head_dim,
            kpe_heads: cfg.rope_keys_per_token(),
        }
    }

    /// Width of one token's RoPE key row, `kpe_heads × rope`.
    pub fn kpe_width(&self) -> usize {
        self.kpe_heads * self.rope
    }
    /// The softmax scale `1 / sqrt(d_h + d_h^R)` (eq. 10).
    fn scale(&self) -> f64 {
        1.0 / ((self.nope + self.rope) as f64).sqrt()
    }
}

/// The inputs of the attention core, all row-major with one row per token:
/// `q_nope` is `tq × H d_h`, `q_pe` is `tq × H d_h^R` (already rotated), `k_nope` is
/// `tk × H d_h`, `k_pe` is `tk × kpe_heads d_h^R` (already rotated), `v` is `tk × H d_v`.
#[derive(Clone, Copy, Debug)]
pub struct AttnIn<'a, T> {
    /// Query content parts `q^C`.
    pub q_nope: &'a [T],
    /// Query RoPE parts `q^R`.
    pub q_pe: &'a [T],
    /// Key content parts `k^C`.
    pub k_nope: &'a [T],
    /// RoPE keys `k^R` (one per token, shared by the heads).
    pub k_pe: &'a [T],
    /// Values `v^C`.
    pub v: &'a [T],
}

/// Gradients of the attention core's inputs, shaped like [`AttnIn`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AttnGrads<T> {
    /// w.r.t. `q_nope`.
    pub dq_nope: Vec<T>,
    /// w.r.t. `q_pe`.
    pub dq_pe: Vec<T>,
    /// w.r.t. `k_nope`.
    pub dk_nope: Vec<T>,
    /// w.r.t. `k_pe`: the sum over the heads that share each RoPE key.
    pub dk_pe: Vec<T>,
    /// w.r.t. `v`.
    pub dv: Vec<T>,
}

/// Causal attention of `tq` query rows at global positions `q_offset..` over `tk` key/value
/// rows at positions `0..tk` (a sequence-parallel rank passes its chunk's queries, the keys
/// and values of the gathered sequence, and `q_offset = sp_rank * chunk`). Query `i` sees
/// key `j` iff `j <= q_offset + i`. Head `h` scores
/// `(q^C_{i,h} · k^C_{j,h} + q^R_{i,h} · k^R_j) / sqrt(d_h + d_h^R)` (DeepSeek-V3 eq. 4, 9,
/// 10: the key of head `h` is `[k^C_{j,h}; k^R_j]`) and returns `sum_j p_{ij} v_{j,h}`.
/// Returns `(out, probs)`: `out` is `tq × H d_v`, `probs` is `H × tq × tk`.
pub fn attention<T: Real>(
    x: &AttnIn<'_, T>,
    sh: &AttnShape,
    q_offset: usize,
    bugs: &Bugs,
) -> (Vec<T>, Vec<T>) {
    let (h, nope, rope, vd, kw) = (sh.heads, sh.nope, sh.rope, sh.v, sh.kpe_width());
    let tq = x.q_nope.len() / (h * nope);
    let tk = x.k_nope.len() / (h * nope);
    let scale = T::of(sh.scale());
    let mut probs = vec![T::zero(); h * tq * tk];
    let mut out = vec![T::zero(); tq * h * vd];
    for hh in 0..h {
        let kr = (hh % sh.kpe_heads) * rope;
        for i in 0..tq {
            let qpos = if bugs.local_causal_mask {
                i
            } else {
                q_offset + i
            };
            let visible = (qpos + 1).min(tk);
            let row = &mut probs[(hh * tq + i) * tk..(hh * tq + i + 1) * tk];
            let qc = &x.q_nope[(i * h + hh) * nope..(i * h + hh + 1) * nope];
            let qr = &x.q_pe[(i * h + hh) * rope..(i * h + hh + 1) * rope];
            for (j, r) in row[..visible].iter_mut().enumerate() {
                let kc = &x.k_nope[(j * h + hh) * nope..(j * h + hh + 1) * nope];
                let kp = &x.k_pe[j * kw + kr..j * kw + kr + rope];
                *r = (dot(qc, kc) + dot(qr, kp)) * scale;
            }
            softmax_row(&mut row[..visible]);
            let oi = &mut out[(i * h + hh) * vd..(i * h + hh + 1) * vd];
            for (j, &pj) in row[..visible].iter().enumerate() {
                axpy(oi, pj, &x.v[(j * h + hh) * vd..(j * h + hh + 1) * vd]);
            }
        }
    }
    (out, probs)
}

/// Sequence `s` of `b` of the attention inputs: the `s`-th of `b` equal row blocks of
/// every input (queries, keys and values alike).
fn seq_block<'a, T>(x: &AttnIn<'a, T>, s: usize, b: usize) -> AttnIn<'a, T> {
    let part = |v: &'a [T]| {
        let n = v.len() / b;
        &v[s * n..(s + 1) * n]
    };
    AttnIn {
        q_nope: part(x.q_nope),
        q_pe: part(x.q_pe),
        k_nope: part(x.k_nope),
        k_pe: part(x.k_pe),
        v: part(x.v),
    }
}

/// `sum_e a[e] b[e]`.
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).map(|(x, y)| *x * *y).sum()
}

/// `y += alpha x`.
fn axpy<T: Real>(y: &mut [T], alpha: T, x: &[T]) {
    for (a, b) in y.iter_mut().zip(x) {
        *a += alpha * *b;
    }
}

/// Gradients of [`attention`] given `dout` (`tq × H d_v`) and the forward's `probs`:
/// `dP = dO Vᵀ`, `dV = Pᵀ dO`, `dS = P (dP - rowsum(P dP)) / sqrt(d_h + d_h^R)`, then per
/// head `dq^C = dS k^C`, `dq^R = dS k^R`, `dk^C = dSᵀ q^C`, and the shared RoPE key
/// collects every head's `dSᵀ q^R`. Masked entries have `P = 0` and contribute nothing.
pub fn attention_backward<T: Real>(
    dout: &[T],
    x: &AttnIn<'_, T>,
    probs: &[T],
    sh: &AttnShape,
) -> AttnGrads<T> {
    let (h, nope, rope, vd, kw) = (sh.heads, sh.nope, sh.rope, sh.v, sh.kpe_width());
    let tq = x.q_nope.len() / (h * nope);
    let tk = x.k_nope.len() / (h * nope);
    let scale = T::of(sh.scale());
    let mut g = AttnGrads {
        dq_nope: vec![T::zero(); x.q_nope.len()],
        dq_pe: vec![T::zero(); x.q_pe.len()],
        dk_nope: vec![T::zero(); x.k_nope.len()],
        dk_pe: vec![T::zero(); x.k_pe.len()],
        dv: vec![T::zero(); x.v.len()],
    };
    let mut dp = vec![T::zero(); tk];
    for hh in 0..h {
        let kr = (hh % sh.kpe_heads) * rope;
        for i in 0..tq {
            let p = &probs[(hh * tq + i) * tk..(hh * tq + i + 1) * tk];
            let doi = &dout[(i * h + hh) * vd..(i * h + hh + 1) * vd];
            let mut sum = T::zero();
            for (j, &pj) in p.iter().enumerate() {
                if pj == T::zero() {
                    // Masked (or underflowed): contributes exactly nothing.
                    continue;
                }
                let at = (j * h + hh) * vd..(j * h + hh + 1) * vd;
                let s = dot(doi, &x.v[at.clone()]);
                dp[j] = s;
                sum += pj * s;
                axpy(&mut g.dv[at], pj, doi);
            }
            let (qc, qr) = ((i * h + hh) * nope, (i * h + hh) * rope);
            for j in 0..tk {
                let ds = p[j] * (dp[j] - sum) * scale;
                if ds == T::zero() {
                    continue;
                }
                let (kc, kp) = ((j * h + hh) * nope, j * kw + kr);
                for e in 0..nope {
                    g.dq_nope[qc + e] += ds * x.k_nope[kc + e];
                    g.dk_nope[kc + e] += ds * x.q_nope[qc + e];
                }
                for e in 0..rope {
                    g.dq_pe[qr + e] += ds * x.k_pe[kp + e];
                    g.dk_pe[kp + e] += ds * x.q_pe[qr + e];
                }
            }
        }
    }
    g
}

/// What an FFN's backward and weight gradient need from its forward (rows `m`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FfnCache<T> {
    /// Input rows, `m × d`.
    pub x: Vec<T>,
    /// `x W1`, `m × f`.
    pub h1: Vec<T>,
    /// `x W3`, `m × f`.
    pub h3: Vec<T>,
    /// `silu(h1) h3`, `m × f`.
    pub act: Vec<T>,
}

/// An FFN's gradients w.r.t. its intermediate values (kept by B for W).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FfnGrad<T> {
    /// w.r.t. `h1`.
    pub dh1: Vec<T>,
    /// w.r.t. `h3`.
    pub dh3: Vec<T>,
    /// w.r.t. the output.
    pub dy: Vec<T>,
}

/// SwiGLU forward on `x` (`m × d`): `y = (silu(x W1) * x W3) W2`.
pub fn ffn_forward<T: Real>(w: &Ffn<T>, x: Vec<T>, d: usize, f: usize) -> (Vec<T>, FfnCache<T>) {
    let m = x.len() / d;
    let h1 = matmul(&x, &w.w1, m, d, f);
    let h3 = matmul(&x, &w.w3, m, d, f);
    let act: Vec<T> = h1.iter().zip(&h3).map(|(a, b)| silu(*a) * *b).collect();
    let y = matmul(&act, &w.w2, m, f, d);
    (y, FfnCache { x, h1, h3, act })
}

/// SwiGLU input gradient: `dA = dY W2ᵀ`, `dH3 = dA silu(H1)`, `dH1 = dA H3 silu'(H1)`,
/// `dX = dH1 W1ᵀ + dH3 W3ᵀ`.
pub fn ffn_backward<T: Real>(
    w: &Ffn<T>,
    c: &FfnCache<T>,
    dy: Vec<T>,
    d: usize,
    f: usize,
) -> (Vec<T>, FfnGrad<T>) {
    let m = dy.len() / d;
    let da = matmul_bt(&dy, &w.w2, m, d, f);
    let mut dh1 = vec![T::zero(); m * f];
    let mut dh3 = vec![T::zero(); m * f];
    for i in 0..m * f {
        dh3[i] = da[i] * silu(c.h1[i]);
        dh1[i] = da[i] * c.h3[i] * silu_grad(c.h1[i]);
    }
    let mut dx = matmul_bt(&dh1, &w.w1, m, f, d);
    add_into(&mut dx, &matmul_bt(&dh3, &w.w3, m, f, d));
    (dx, FfnGrad { dh1, dh3, dy })
}

/// SwiGLU weight gradients: `dW1 += Xᵀ dH1`, `dW3 += Xᵀ dH3`, `dW2 += Aᵀ dY`.
pub fn ffn_weight_grad<T: Real>(
    g: &mut Ffn<T>,
    c: &FfnCache<T>,
    gr: &FfnGrad<T>,
    d: usize,
    f: usize,
) {
    let m = c.x.len() / d;
    add_matmul_at(&mut g.w1, &c.x, &gr.dh1, m, d, f);
    add_matmul_at(&mut g.w3, &c.x, &gr.dh3, m, d, f);
    add_matmul_at(&mut g.w2, &c.act, &gr.dy, m, f, d);
}

/// The routing of one group of `t` tokens: `k` slots per token.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing<T> {
    /// Experts per token.
    pub k: usize,
    /// Expert of slot `t*k + j`; `usize::MAX` for a dropped slot (only under
    /// [`Bugs::drop_overflow`]).
    pub experts: Vec<usize>,
    /// Gate of each slot (0 for a dropped slot).
    pub gates: Vec<T>,
    /// The top-k on `s + bias` before capacity (the load the router asked for).
    pub desired: Vec<usize>,
    /// Per token, the sum of the selected experts' scores (the gates' normalizer).
    pub z: Vec<T>,
    /// Under [`Bugs::softmax_gates`]: the softmax over all experts, `t × E`.
    pub softmax: Vec<T>,
}

/// Routes `t` tokens given their router logits and affinities `s = sigmoid(logits)` (both
/// `t × E`) and the balancing bias. See the module docs for selection, capacity and gates.
pub fn route<T: Real>(cfg: &ModelConfig, logits: &[T], s: &[T], bias: &[T]) -> Routing<T> {
    let (e, k) = (cfg.experts, cfg.top_k);
    let t = s.len() / e;
    let cap = cfg.capacity(t);
    // Preference order per token on s + bias (ties to the lower id); under a group limit
    // the experts of the token's groups first.
    let prefs: Vec<Vec<usize>> = (0..t)
        .map(|i| {
            let score: Vec<T> = (0..e).map(|x| s[i * e + x] + bias[x]).collect();
            let allowed = cfg.allowed_experts(&score);
            let mut ids: Vec<usize> = (0..e).collect();
            ids.sort_by(|&a, &b| {
                allowed[b]
                    .cmp(&allowed[a])
                    .then(
                        score[b]
                            .partial_cmp(&score[a])
                            .unwrap_or(std::cmp::Ordering::Equal),
                    )
                    .then(a.cmp(&b))
            });
            ids
        })
        .collect();
    let desired: Vec<usize> = prefs.iter().flat_map(|p| p[..k].to_vec()).collect();
    let mut experts = vec![usize::MAX; t * k];
    let mut load = vec![0usize; e];
    for j in 0..k {
        for i in 0..t {
            let chosen = &experts[i * k..i * k + j];
            let pick = if cfg.bugs.drop_overflow {
                let want = prefs[i][j];
                (load[want] < cap).then_some(want)
            } else {
                prefs[i]
                    .iter()
                    .copied()
                    .find(|x| !chosen.contains(x) && load[*x] < cap)
            };
            if let Some(x) = pick {
                experts[i * k + j] = x;
                load[x] += 1;
            }
        }
    }
    let mut gates = vec![T::zero(); t * k];
    let mut z = vec![T::zero(); t];
    let mut softmax = Vec::new();
    if cfg.bugs.softmax_gates {
        softmax = logits.to_vec();
        for row in softmax.chunks_mut(e) {
            softmax_row(row);
        }
    }
    for i in 0..t {
        let mut zi = T::zero();
        for j in 0..k {
            if experts[i * k + j] != usize::MAX {
                zi += s[i * e + experts[i * k + j]];
            }
        }
        z[i] = zi;
        for j in 0..k {
            let x = experts[i * k + j];
            if x == usize::MAX {
                continue;
            }
            gates[i * k + j] = if cfg.bugs.softmax_gates {
                softmax[i * e + x]
            } else {
                s[i * e + x] / zi
            };
        }
    }
    Routing {
        k,
        experts,
        gates,
        desired,
        z,
        softmax,
    }
}

/// [`route`] applied separately to `groups` equal contiguous groups of tokens (each with
/// its own capacity), concatenated: the routing of a sequence whose sequence-parallel
/// chunks route independently.
pub fn route_groups<T: Real>(
    cfg: &ModelConfig,
    logits: &[T],
    s: &[T],
    bias: &[T],
    groups: usize,
) -> Routing<T> {
    let e = cfg.experts;
    let n = logits.len() / e / groups.max(1);
    let mut out = Routing {
        k: cfg.top_k,
        experts: Vec::new(),
        gates: Vec::new(),
        desired: Vec::new(),
        z: Vec::new(),
        softmax: Vec::new(),
    };
    for g in 0..groups.max(1) {
        let r = route(
            cfg,
            &logits[g * n * e..(g + 1) * n * e],
            &s[g * n * e..(g + 1) * n * e],
            bias,
        );
        out.experts.extend(r.experts);
        out.gates.extend(r.gates);
        out.desired.extend(r.desired);
        out.z.extend(r.z);
        out.softmax.extend(r.softmax);
    }
    out
}

/// Gradient of the router logits from the gates' gradients. Normalized sigmoid gates
/// `g_j = s_j / Z`: `ds_j = (dg_j - sum_i dg_i g_i) / Z`, `dlogit = ds s (1 - s)`; under
/// [`Bugs::softmax_gates`], the softmax's own Jacobian.
pub fn gate_backward<T: Real>(cfg: &ModelConfig, r: &Routing<T>, s: &[T], dgates: &[T]) -> Vec<T> {
    let (e, k) = (cfg.experts, r.k);
    let t = r.z.len();
    let mut dl = vec![T::zero(); t * e];
    for i in 0..t {
        if cfg.bugs.softmax_gates {
            let p = &r.softmax[i * e..(i + 1) * e];
            let mut dp = vec![T::zero(); e];
            for j in 0..k {
                let x = r.experts[i * k + j];
                if x != usize::MAX {
                    dp[x] += dgates[i * k + j];
                }
            }
            let dot: T = (0..e).map(|x| p[x] * dp[x]).sum();
            for x in 0..e {
                dl[i * e + x] = p[x] * (dp[x] - dot);
            }
            continue;
        }
        let mut dot = T::zero();
        for j in 0..k {
            if r.experts[i * k + j] != usize::MAX {
                dot += dgates[i * k + j] * r.gates[i * k + j];
            }
        }
        for j in 0..k {
            let x = r.experts[i * k + j];
            if x == usize::MAX {
                continue;
            }
            let ds = (dgates[i * k + j] - dot) / r.z[i];
            let sv = s[i * e + x];
            dl[i * e + x] += ds * sv * (T::one() - sv);
        }
    }
    dl
}

/// One all-to-all message: rows of `d` values, and per row the global expert id (dispatch
/// only; empty for combine and the gradients).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Packet<T> {
    /// Rows, concatenated.
    pub data: Vec<T>,
    /// Expert id of each row (dispatch), else empty.
    pub meta: Vec<u32>,
}

/// Everything one layer's backward and weight gradient need from its forward, and what its
/// backward leaves for the weight gradient.
#[derive(Clone, Debug, Default)]
pub struct LayerCache<T> {
    x: Vec<T>,
    xhat1: Vec<T>,
    inv1: Vec<T>,
    /// `h = RMSNorm(x; norm1)`, the attention input, `t × d`.
    a: Vec<T>,
    /// The query latent `c_Q` after its norm, `t × d_c'`, with the norm's saved values.
    cq: Vec<T>,
    cq_xhat: Vec<T>,
    cq_inv: Vec<T>,
    /// `q^C`, `t × H d_h`; `q^R` (rotated), `t × H d_h^R`.
    q_nope: Vec<T>,
    q_pe: Vec<T>,
    /// The local key/value latent's norm values, `t × d_c`.
    ckv_xhat: Vec<T>,
    ckv_inv: Vec<T>,
    /// The gathered latents `c_KV` (`T × d_c`) and RoPE keys `k^R` (`T × d_h^R`) of the
    /// whole sequence, and the per-head keys and values up-projected from them.
    ckv_all: Vec<T>,
    kpe_all: Vec<T>,
    k_nope: Vec<T>,
    v: Vec<T>,
    probs: Vec<T>,
    /// The heads' outputs, `t × H d_v`.
    o_heads: Vec<T>,
    xhat2: Vec<T>,
    inv2: Vec<T>,
    n2: Vec<T>,
    s: Vec<T>,
    routing: Option<Routing<T>>,
    /// Slots in dispatch order (by expert, token, slot).
    order: Vec<usize>,
    /// Expert output of each slot, `t*k × d`.
    expert_out: Vec<T>,
    shared: Option<FfnCache<T>>,
    h1: Vec<T>,
    // Left by the backward for the weight gradient.
    dy: Vec<T>,
    dgates: Vec<T>,
    d_n2: Vec<T>,
    shared_grad: Option<FfnGrad<T>>,
    /// Gradients of `q^C` (`t × H d_h`), of `c_Q W_QR` before the rotation
    /// (`t × H d_h^R`), of `c_Q` after and before its norm (`t × d_c'`).
    dq_nope: Vec<T>,
    dqr: Vec<T>,
    dcq: Vec<T>,
    dcq_raw: Vec<T>,
    /// Gradients of the gathered keys' content parts and values (`T` rows).
    dk_nope: Vec<T>,
    dv: Vec<T>,
    /// Gradients of the local `c_KV` after and before its norm (`t × d_c`) and of
    /// `h W_KR` before the rotation (`t × d_h^R`).
    dckv: Vec<T>,
    dckv_raw: Vec<T>,
    dkr: Vec<T>,
    dh1: Vec<T>,
    /// The gradient of `h1` on the chunk's rows (with Megatron sequence parallelism, the
    /// TP group's gathered one; else `dh1`): what `W_O`'s gradient needs.
    dh1_full: Vec<T>,
    da: Vec<T>,
    dlogits: Vec<T>,
}

/// The rows one expert rank received from one source: expert ids, per-row FFN caches, and
/// after B their gradients.
type SourceRows<T> = (Vec<u32>, Vec<FfnCache<T>>, Vec<FfnGrad<T>>);

/// The expert side of one layer: the rows received from each source rank.
#[derive(Clone, Debug, Default)]
pub struct ExpertCache<T> {
    /// Per source, in EP group order.
    sources: Vec<SourceRows<T>>,
}

/// The LM head's saved values.
#[derive(Clone, Debug, Default)]
pub struct HeadCache<T> {
    xhat: Vec<T>,
    inv: Vec<T>,
    xf: Vec<T>,
    dlogits: Vec<T>,
    dxf: Vec<T>,
}

/// The state of one (stage, micro-batch) between its forward and its weight gradient: the
/// contents of a `stash` buffer of the per-rank program.
#[derive(Clone, Debug, Default)]
pub struct Stash<T> {
    /// Input tokens (first stage).
    pub tokens: Vec<u32>,
    /// Target tokens (last stage).
    pub targets: Vec<u32>,
    /// Loss scale `1/N` (last stage).
    pub scale: f64,
    /// The running activation during the forward: the stage's input, then each layer's
    /// output; the stage output at the end.
    pub x: Vec<T>,
    /// The running gradient during the backward: w.r.t. the stage output, then each layer's
    /// input; w.r.t. the stage input at the end.
    pub grad: Vec<T>,
    /// Messages to post in the next all-to-all (one per EP group member).
    pub outbox: Vec<Packet<T>>,
    /// Messages received by the last all-to-all (one per EP group member).
    pub inbox: Vec<Packet<T>>,
    /// This TP member's partial sums for the next tensor-parallel all-reduce.
    pub tp_out: Vec<T>,
    /// The sum over the TP group left by the last tensor-parallel all-reduce.
    pub tp_in: Vec<T>,
    /// Sum of the scaled token losses (last stage).
    pub loss: f64,
    layers: Vec<LayerCache<T>>,
    experts: Vec<ExpertCache<T>>,
    head: Option<HeadCache<T>>,
}

/// One stage's parameters with what its kernels need to know: the config, the EP group
/// size (experts are split evenly across it), the SP group size and where the local tokens
/// sit in the sequence.
pub struct StageKernels<'a, T> {
    /// The model.
    pub cfg: &'a ModelConfig,
    /// This copy's parameters.
    pub params: &'a StageParams<T>,
    /// Size of the EP group.
    pub ep: usize,
    /// Size of the SP group (the local tokens are one of `sp` equal chunks of the sequence).
    pub sp: usize,
    /// Global position of the first local token (`sp_rank * chunk`).
    pub pos0: usize,
    /// Routing groups the local tokens are split into (each with its own capacity): 1 on
    /// an SP rank (its chunk), `sp` for the whole sequence on one host.
    pub route_groups: usize,
    /// Size of the TP group: `params` holds this member's `H / tp` heads' slices of `W_UQ`,
    /// `W_QR`, `W_UK`, `W_UV`, `W_O` and its `f / tp` slice of the shared expert
    /// ([`tp_split`]); 1 without tensor parallelism.
    pub tp: usize,
    /// This member's index in the TP group.
    pub tp_rank: usize,
    /// Megatron-LM's sequence parallelism inside the TP group (Korthikanti et al., arXiv
    /// 2205.05198, §4.2.2): the local tokens are this member's shard (`1/tp`) of the chunk;
    /// norms, residuals, router and routed experts run on the shard, the TP collectives are
    /// all-gathers and reduce-scatters.
    pub sequence_parallel: bool,
}

/// Which weight gradients a `W` kernel adds ([`StageKernels::weights_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightSet {
    /// Every weight of the stage (a whole `W`, or a `BW`'s weight half).
    All,
    /// The expert and shared-expert MLPs of every layer (a split `W`'s `mlp` part).
    Mlp,
    /// Every other weight: embedding, norms, attention, router, final norm and head (a
    /// split `W`'s `attn` part).
    Attn,
}

impl<T: Real> StageKernels<'_, T> {
    fn d(&self) -> usize {
        self.cfg.hidden
    }

    /// The attention shapes of this member's heads (`H / tp` of them).
    fn sh(&self) -> AttnShape {
        let mut sh = AttnShape::of(self.cfg);
        sh.heads /= self.tp.max(1);
        sh
    }

    /// Where `t` local rows start in the chunk: `tp_rank t` for a sequence-parallel TP
    /// member's shard, else 0.
    fn shard_offset(&self, t: usize) -> usize {
        if self.sequence_parallel && !self.cfg.bugs.shard_positions_from_zero {
            self.tp_rank * t
        } else {
            0
        }
    }

    /// Sequences per micro-batch `B`: the local rows are `B` equal blocks, one per sequence.
    fn seqs(&self) -> usize {
        self.cfg.micro_batch_size.max(1)
    }

    /// [`rope`] on rows of `heads × hd` that hold the micro-batch's `B` sequences one after
    /// the other: each sequence's block of `x.len() / B` values starts again at `pos0`.
    fn rope_seqs(&self, x: &mut [T], heads: usize, hd: usize, pos0: usize, inverse: bool) {
        let n = (x.len() / self.seqs()).max(1);
        for block in x.chunks_mut(n) {
            rope(block, heads, hd, pos0, self.cfg.rope_base, inverse);
        }
    }

    /// The attention core over a micro-batch of `B` sequences: block-diagonal, each
    /// sequence's `tq / B` query rows attend causally ([`attention`], query offset
    /// `pos0`) to its own `tk / B` key rows only. Returns `(out, probs)`: `out` is
    /// `tq × H d_v`, `probs` the `B` sequences' `H × tq/B × tk/B` blocks one after the
    /// other. The keys must be sequence-major (true without SP, which B > 1 refuses).
    /// Under [`Bugs::cross_sequence_attention`] the `B T` rows attend as one sequence.
    fn attend(&self, x: &AttnIn<'_, T>, sh: &AttnShape) -> (Vec<T>, Vec<T>) {
        let b = self.seqs();
        if b == 1 || self.cfg.bugs.cross_sequence_attention {
            return attention(x, sh, self.pos0, &self.cfg.bugs);
        }
        let (mut out, mut probs) = (Vec::new(), Vec::new());
        for s in 0..b {
            let (o, p) = attention(&seq_block(x, s, b), sh, self.pos0, &self.cfg.bugs);
            out.extend(o);
            probs.extend(p);
        }
        (out, probs)
    }

    /// Gradients of [`Self::attend`] given `dout` (`tq × H d_v`) and its `probs`: each
    /// sequence's [`attention_backward`], concatenated in row order.
    fn attend_backward(
        &self,
        dout: &[T],
        x: &AttnIn<'_, T>,
        probs: &[T],
        sh: &AttnShape,
    ) -> AttnGrads<T> {
        let b = self.seqs();
        if b == 1 || self.cfg.bugs.cross_sequence_attention {
            return attention_backward(dout, x, probs, sh);
        }
        let (dn, pn) = (dout.len() / b, probs.len() / b);
        let mut g = AttnGrads::default();
        for s in 0..b {
            let gs = attention_backward(
                &dout[s * dn..(s + 1) * dn],
                &seq_block(x, s, b),
                &probs[s * pn..(s + 1) * pn],
                sh,
            );
            g.dq_nope.extend(gs.dq_nope);
            g.dq_pe.extend(gs.dq_pe);
            g.dk_nope.extend(gs.dk_nope);
            g.dk_pe.extend(gs.dk_pe);
            g.dv.extend(gs.dv);
        }
        g
    }

    /// The shared expert's hidden width on this member (`f / tp`).
    fn shared_f(&self) -> usize {
        self.cfg.expert_hidden / self.tp.max(1)
    }

    /// Prepares an empty stash for `tokens`/`targets` with loss scale `scale`.
    pub fn new_stash(&self, tokens: Vec<u32>, targets: Vec<u32>, scale: f64) -> Stash<T> {
        let n = self.params.layers.len();
        Stash {
            tokens,
            targets,
            scale,
            layers: vec![LayerCache::default(); n],
            experts: vec![ExpertCache::default(); n],
            ..Stash::default()
        }
    }

    /// F, embedding: `x = E[tokens]`. Errors: a token outside the vocabulary.
    pub fn fwd_embed(&self, st: &mut Stash<T>) -> Result<(), String> {
        let d = self.d();
        let e = self.params.embed.as_ref().ok_or("not a first stage")?;
        let mut x = Vec::with_capacity(st.tokens.len() * d);
        for &t in &st.tokens {
            let t = t as usize;
            if t >= self.cfg.vocab {
                return Err(format!(
                    "token {t} is outside the vocabulary of {}",
                    self.cfg.vocab
                ));
            }
            x.extend_from_slice(&e[t * d..(t + 1) * d]);
        }
        st.x = x;
        Ok(())
    }

    /// F, norm and the MLA projections of layer `l` that need only the local tokens
    /// (DeepSeek-V3 §2.1.1): the query latent `c_Q = RMSNorm(h W_DQ; q_norm)` (eq. 6),
    /// `q^C = c_Q W_UQ` (eq. 7), `q^R = RoPE(c_Q W_QR)` (eq. 8); the key/value latent
    /// `c_KV = RMSNorm(h W_DKV; kv_norm)` (eq. 1) and the RoPE key `k^R = RoPE(h W_KR)`,
    /// one per token for all heads (eq. 3), rotated at the local tokens' global positions.
    /// `st.outbox` gets this rank's `[c_KV; k^R]` (`t × (d_c + d_h^R)`) for every SP
    /// group member (the all-gather): what MLA caches, not the per-head keys and values.
    /// The norms on the latents follow DeepSeek's reference implementation
    /// (`inference/model.py`, `q_norm`, `kv_norm`; DeepSeek-V2 §3.1.2).
    pub fn fwd_qkv(&self, l: usize, st: &mut Stash<T>) {
        let cfg = self.cfg;
        let (d, qr, kvr, sh) = (cfg.hidden, cfg.q_lora_rank, cfg.kv_lora_rank, self.sh());
        let eps = cfg.norm_eps;
        let p = &self.params.layers[l];
        let x = std::mem::take(&mut st.x);
        let t = x.len() / d;
        let (a, xhat1, inv1) = rmsnorm(&x, &p.norm1, d, eps);
        let cq_raw = matmul(&a, &p.wdq, t, d, qr);
        let (cq, cq_xhat, cq_inv) = rmsnorm(&cq_raw, &p.q_norm, qr, eps);
        let ckv_raw = matmul(&a, &p.wdkv, t, d, kvr);
        let (ckv, ckv_xhat, ckv_inv) = rmsnorm(&ckv_raw, &p.kv_norm, kvr, eps);
        let mut kpe = matmul(&a, &p.wkr, t, d, sh.kpe_width());
        // The RoPE key at the local tokens' global positions (a sequence-parallel TP
        // member's shard starts `tp_rank t` into the chunk).
        self.rope_seqs(
            &mut kpe,
            sh.kpe_heads,
            sh.rope,
            self.pos0 + self.shard_offset(t),
            false,
        );
        st.layers[l] = LayerCache {
            x,
            xhat1,
            inv1,
            a,
            cq_xhat,
            cq_inv,
            ckv_xhat,
            ckv_inv,
            ..LayerCache::default()
        };
        if self.sequence_parallel {
            // The TP group all-gathers the shards' latents before the up-projections.
            st.tp_out = interleave(&[(&cq, qr), (&ckv, kvr), (&kpe, sh.kpe_width())]);
            return;
        }
        self.qkv_up(l, st, cq, ckv, kpe);
    }

    /// F, with Megatron sequence parallelism: once `st.tp_in` holds the TP group's
    /// gathered `[c_Q; c_KV; k^R]` rows (the whole chunk), the up-projections
    /// ([`Self::fwd_qkv`] does them itself otherwise). Errors: a gathered block of the
    /// wrong size.
    pub fn fwd_qkv_post(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let cfg = self.cfg;
        let (qr, kvr, kw) = (cfg.q_lora_rank, cfg.kv_lora_rank, self.sh().kpe_width());
        let all = std::mem::take(&mut st.tp_in);
        let mut parts = deinterleave(&all, &[qr, kvr, kw])?.into_iter();
        let (cq, ckv, kpe) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        self.qkv_up(l, st, cq, ckv, kpe);
        Ok(())
    }

    /// The query up-projections of the chunk's `c_Q` (this member's heads; `q^R` rotated
    /// at the chunk's positions) and the SP group's all-gather packets `[c_KV; k^R]`.
    fn qkv_up(&self, l: usize, st: &mut Stash<T>, cq: Vec<T>, ckv: Vec<T>, kpe: Vec<T>) {
        let cfg = self.cfg;
        let (qr, sh) = (cfg.q_lora_rank, self.sh());
        let h = sh.heads;
        let p = &self.params.layers[l];
        let t = cq.len() / qr;
        let q_nope = matmul(&cq, &p.wuq, t, qr, h * sh.nope);
        let mut q_pe = matmul(&cq, &p.wqr, t, qr, h * sh.rope);
        self.rope_seqs(&mut q_pe, h, sh.rope, self.pos0, false);
        let mut latent = ckv;
        latent.extend_from_slice(&kpe);
        st.outbox = (0..self.sp)
            .map(|_| Packet {
                data: latent.clone(),
                meta: Vec::new(),
            })
            .collect();
        let c = &mut st.layers[l];
        c.cq = cq;
        c.q_nope = q_nope;
        c.q_pe = q_pe;
    }

    /// F, the rest of layer `l`'s attention and its router: the gathered latents and
    /// RoPE keys of the whole sequence (`st.inbox`, one packet per SP member in group
    /// order) are up-projected to every head's content key `k^C = c_KV W_UK` (eq. 2) and
    /// value `v^C = c_KV W_UV` (eq. 5); the local queries attend them causally at global
    /// positions ([`attention`]); `h1 = x + o W_O` (eq. 11), norm, routing. Fills
    /// `st.outbox` with the dispatch packets and adds the layer's top-k counts to `loads`.
    /// Errors: a gathered packet of the wrong size.
    pub fn fwd_attn(
        &self,
        l: usize,
        st: &mut Stash<T>,
        router: &RouterState<T>,
        loads: &mut [T],
    ) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, kvr, sh) = (cfg.hidden, cfg.kv_lora_rank, self.sh());
        let h = sh.heads;
        let p = &self.params.layers[l];
        let inbox = std::mem::take(&mut st.inbox);
        let c = std::mem::take(&mut st.layers[l]);
        // The chunk's query rows (with Megatron sequence parallelism, the TP group's).
        let t = c.q_nope.len() / (h * sh.nope);
        let w = cfg.kv_gather_width();
        let mut ckv_all = Vec::with_capacity(t * kvr * self.sp);
        let mut kpe_all = Vec::with_capacity(t * sh.kpe_width() * self.sp);
        for pk in &inbox {
            if pk.data.len() != t * w {
                return Err(format!(
                    "gathered latents and RoPE keys: {} values, expected {} ({t} tokens x {w})",
                    pk.data.len(),
                    t * w
                ));
            }
            ckv_all.extend_from_slice(&pk.data[..t * kvr]);
            kpe_all.extend_from_slice(&pk.data[t * kvr..]);
        }
        let tk = ckv_all.len() / kvr;
        let k_nope = matmul(&ckv_all, &p.wuk, tk, kvr, h * sh.nope);
        let v = matmul(&ckv_all, &p.wuv, tk, kvr, h * sh.v);
        let input = AttnIn {
            q_nope: &c.q_nope,
            q_pe: &c.q_pe,
            k_nope: &k_nope,
            k_pe: &kpe_all,
            v: &v,
        };
        let (o_heads, probs) = self.attend(&input, &sh);
        // With TP: this member's heads' share of `o W_O` (row-parallel `W_O`).
        let h1_part = matmul(&o_heads, &p.wo, t, h * sh.v, d);
        st.layers[l] = LayerCache {
            ckv_all,
            kpe_all,
            k_nope,
            v,
            probs,
            o_heads,
            ..c
        };
        if self.tp > 1 {
            st.tp_out = h1_part;
            return Ok(());
        }
        st.tp_in = h1_part;
        self.fwd_attn_post(l, st, router, loads)
    }

    /// F, the rest of layer `l`'s attention block once `st.tp_in` holds `o W_O` summed over
    /// the TP group (with `tp = 1`, [`Self::fwd_attn`] calls it itself): `h1 = x + o W_O`,
    /// norm, routing; fills `st.outbox` with the dispatch packets and adds the layer's top-k
    /// counts to `loads`. With `tp > 1` also runs this member's slice of the shared expert
    /// (column-parallel `W1`, `W3`, row-parallel `W2`) into `st.tp_out` for the `mlp_out`
    /// all-reduce. Errors: a reduced output of the wrong size.
    pub fn fwd_attn_post(
        &self,
        l: usize,
        st: &mut Stash<T>,
        router: &RouterState<T>,
        loads: &mut [T],
    ) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, e) = (cfg.hidden, cfg.experts);
        let p = &self.params.layers[l];
        let mut h1 = std::mem::take(&mut st.tp_in);
        let c = std::mem::take(&mut st.layers[l]);
        let t = c.x.len() / d;
        if h1.len() != t * d {
            return Err(format!(
                "the attention's reduced output has {} values, expected {} ({t} tokens x {d})",
                h1.len(),
                t * d
            ));
        }
        add_into(&mut h1, &c.x);
        let (n2, xhat2, inv2) = rmsnorm(&h1, &p.norm2, d, cfg.norm_eps);
        let logits = matmul(&n2, &p.router, t, d, e);
        let s: Vec<T> = logits.iter().map(|z| sigmoid(*z)).collect();
        let r = route_groups(cfg, &logits, &s, &router.routing_bias, self.route_groups);
        for &x in &r.desired {
            loads[x] += T::one();
        }
        // Dispatch order: slots by (expert, token, slot).
        let mut order: Vec<usize> = (0..t * r.k)
            .filter(|&i| r.experts[i] != usize::MAX)
            .collect();
        order.sort_by_key(|&i| (r.experts[i], i));
        let per = e / self.ep;
        let mut out: Vec<Packet<T>> = (0..self.ep).map(|_| Packet::default()).collect();
        for &i in &order {
            let x = r.experts[i];
            let pk = &mut out[x / per];
            let tok = i / r.k;
            pk.data.extend_from_slice(&n2[tok * d..(tok + 1) * d]);
            pk.meta.push(x as u32);
        }
        st.outbox = out;
        let mut shared = None;
        if self.sequence_parallel {
            // The shared expert runs on the TP group's gathered rows (`shared` kernel).
            st.tp_out = n2.clone();
        } else if self.tp > 1 {
            st.tp_out = match &p.shared {
                Some(sw) => {
                    let (ys, sc) = ffn_forward(sw, n2.clone(), d, self.shared_f());
                    shared = Some(sc);
                    ys
                }
                None => Vec::new(),
            };
        }
        st.layers[l] = LayerCache {
            xhat2,
            inv2,
            n2,
            s,
            routing: Some(r),
            order,
            h1,
            shared,
            ..c
        };
        Ok(())
    }

    /// F, the local experts of layer `l` on the rows in `st.inbox`; the outputs go to
    /// `st.outbox`, in the order received. Errors: a row for an expert this rank lacks.
    pub fn fwd_experts(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let (d, f) = (self.d(), self.cfg.expert_hidden);
        let p = &self.params.layers[l];
        let lo = self.params.expert_lo;
        let inbox = std::mem::take(&mut st.inbox);
        let mut sources = Vec::with_capacity(inbox.len());
        let mut out = Vec::with_capacity(inbox.len());
        for pk in inbox {
            let mut caches = Vec::with_capacity(pk.meta.len());
            let mut data = Vec::with_capacity(pk.data.len());
            for (i, &x) in pk.meta.iter().enumerate() {
                let w = (x as usize)
                    .checked_sub(lo)
                    .and_then(|j| p.experts.get(j))
                    .ok_or_else(|| format!("received a row for expert {x}, not held here"))?;
                let (y, c) = ffn_forward(w, pk.data[i * d..(i + 1) * d].to_vec(), d, f);
                data.extend_from_slice(&y);
                caches.push(c);
            }
            out.push(Packet {
                data,
                meta: Vec::new(),
            });
            sources.push((pk.meta, caches, Vec::new()));
        }
        st.experts[l] = ExpertCache { sources };
        st.outbox = out;
        Ok(())
    }

    /// F, combine of layer `l`: `y = h1 + sum_j g_j out_j + shared(n2)` from the expert
    /// outputs in `st.inbox`; `st.x = y`. Errors: a packet of the wrong size.
    pub fn fwd_combine(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let (d, f) = (self.d(), self.shared_f());
        let p = &self.params.layers[l];
        let inbox = std::mem::take(&mut st.inbox);
        let c = &mut st.layers[l];
        let r = c.routing.as_ref().ok_or("combine before attention")?;
        let t = c.x.len() / d;
        let per = self.cfg.experts / self.ep;
        let mut eo = vec![T::zero(); t * r.k * d];
        let mut next = vec![0usize; self.ep];
        for &i in &c.order {
            let q = r.experts[i] / per;
            let at = next[q];
            let row = inbox
                .get(q)
                .and_then(|pk| pk.data.get(at * d..(at + 1) * d))
                .ok_or_else(|| format!("combine: expert rank {q} returned too few rows"))?;
            eo[i * d..(i + 1) * d].copy_from_slice(row);
            next[q] += 1;
        }
        let mut y = c.h1.clone();
        for tok in 0..t {
            for j in 0..r.k {
                let i = tok * r.k + j;
                let g = r.gates[i];
                for u in 0..d {
                    y[tok * d + u] += g * eo[i * d + u];
                }
            }
        }
        if self.tp > 1 {
            // The shared expert's output, summed over the TP group (`attn_post`, then the
            // `mlp_out` all-reduce).
            if p.shared.is_some() {
                let ys = std::mem::take(&mut st.tp_in);
                if ys.len() != y.len() {
                    return Err(format!(
                        "combine: the shared expert's reduced output has {} values, expected {}",
                        ys.len(),
                        y.len()
                    ));
                }
                add_into(&mut y, &ys);
            }
        } else if let Some(sw) = &p.shared {
            let (ys, sc) = ffn_forward(sw, c.n2.clone(), d, f);
            add_into(&mut y, &ys);
            c.shared = Some(sc);
        }
        c.expert_out = eo;
        st.x = y;
        Ok(())
    }

    /// F, with Megatron sequence parallelism: this member's slice of the shared expert on
    /// the TP group's gathered MoE-norm rows (`st.tp_in`, the whole chunk); its partial
    /// output goes to `st.tp_out` for the reduce-scatter (an all-zero output without a
    /// shared expert).
    pub fn fwd_shared(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let (d, f) = (self.d(), self.shared_f());
        let n2 = std::mem::take(&mut st.tp_in);
        let c = &mut st.layers[l];
        st.tp_out = match &self.params.layers[l].shared {
            Some(sw) => {
                let (ys, sc) = ffn_forward(sw, n2, d, f);
                c.shared = Some(sc);
                ys
            }
            None => vec![T::zero(); n2.len()],
        };
        Ok(())
    }

    /// B, with Megatron sequence parallelism: this member's slice of the shared expert's
    /// backward on the TP group's gathered output gradient (`st.tp_in`); the partial input
    /// gradient goes to `st.tp_out` for the reduce-scatter.
    pub fn bwd_shared(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let (d, f) = (self.d(), self.shared_f());
        let dy = std::mem::take(&mut st.tp_in);
        let c = &mut st.layers[l];
        st.tp_out = match (&self.params.layers[l].shared, &c.shared) {
            (Some(sw), Some(sc)) => {
                if dy.len() != sc.x.len() {
                    return Err(format!(
                        "the gathered output gradient has {} values, expected {}",
                        dy.len(),
                        sc.x.len()
                    ));
                }
                let (dx, gr) = ffn_backward(sw, sc, dy, d, f);
                c.shared_grad = Some(gr);
                dx
            }
            _ => vec![T::zero(); dy.len()],
        };
        Ok(())
    }

    /// F, final norm, LM head and cross-entropy on `st.x`; returns the scaled loss sum and
    /// keeps the logits' gradient. Errors: a target outside the vocabulary.
    pub fn fwd_head(&self, st: &mut Stash<T>) -> Result<f64, String> {
        let (d, v) = (self.d(), self.cfg.vocab);
        let g = self.params.final_norm.as_ref().ok_or("not a last stage")?;
        let w = self.params.head.as_ref().ok_or("not a last stage")?;
        let t = st.x.len() / d;
        if st.targets.len() != t {
            return Err(format!("{} targets for {t} tokens", st.targets.len()));
        }
        let (xf, xhat, inv) = rmsnorm(&st.x, g, d, self.cfg.norm_eps);
        let mut logits = matmul(&xf, w, t, d, v);
        let scale = T::of(st.scale);
        let mut loss = T::zero();
        for (i, row) in logits.chunks_mut(v).enumerate() {
            let y = st.targets[i] as usize;
            if y >= v {
                return Err(format!("target {y} is outside the vocabulary of {v}"));
            }
            let mx = row.iter().copied().fold(T::neg_infinity(), T::max);
            let lse = mx + row.iter().map(|z| (*z - mx).exp()).sum::<T>().ln();
            loss += (lse - row[y]) * scale;
            softmax_row(row);
            row[y] = row[y] - T::one();
            for z in row.iter_mut() {
                *z = *z * scale;
            }
        }
        st.head = Some(HeadCache {
            xhat,
            inv,
            xf,
            dlogits: logits,
            dxf: Vec::new(),
        });
        st.loss = loss.f64();
        Ok(st.loss)
    }

    /// B, LM head and final norm: `st.grad` = gradient w.r.t. the stage output.
    pub fn bwd_head(&self, st: &mut Stash<T>) -> Result<(), String> {
        let (d, v) = (self.d(), self.cfg.vocab);
        let g = self.params.final_norm.as_ref().ok_or("not a last stage")?;
        let w = self.params.head.as_ref().ok_or("not a last stage")?;
        let hc = st.head.as_mut().ok_or("head backward before its forward")?;
        let t = hc.xf.len() / d;
        let dxf = matmul_bt(&hc.dlogits, w, t, v, d);
        st.grad = rmsnorm_backward(&dxf, g, &hc.xhat, &hc.inv, d);
        hc.dxf = dxf;
        Ok(())
    }

    /// B, combine of layer `l` from `st.grad` (w.r.t. the layer output): output gradients
    /// `g_j dy` to the expert ranks (`st.outbox`, dispatch order), the gates' gradients and
    /// the shared expert's input gradient kept.
    pub fn bwd_combine(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let (d, f) = (self.d(), self.shared_f());
        let p = &self.params.layers[l];
        let dy = std::mem::take(&mut st.grad);
        let c = &mut st.layers[l];
        let r = c.routing.as_ref().ok_or("backward before forward")?;
        let per = self.cfg.experts / self.ep;
        let mut out: Vec<Packet<T>> = (0..self.ep).map(|_| Packet::default()).collect();
        let mut dgates = vec![T::zero(); r.gates.len()];
        for &i in &c.order {
            let tok = i / r.k;
            let g = r.gates[i];
            let pk = &mut out[r.experts[i] / per];
            let mut dot = T::zero();
            for u in 0..d {
                pk.data.push(g * dy[tok * d + u]);
                dot += dy[tok * d + u] * c.expert_out[i * d + u];
            }
            dgates[i] = dot;
        }
        let mut d_n2 = vec![T::zero(); dy.len()];
        if self.sequence_parallel {
            // The shared expert's backward runs on the TP group's gathered output gradient
            // (`shared` kernel).
            st.tp_out = dy.clone();
        } else if let (Some(sw), Some(sc)) = (&p.shared, &c.shared) {
            let (dx, gr) = ffn_backward(sw, sc, dy.clone(), d, f);
            if self.tp > 1 {
                // This member's slice's share: the `mlp_in_grad` all-reduce sums them.
                st.tp_out = dx;
            } else {
                d_n2 = dx;
            }
            c.shared_grad = Some(gr);
        } else if self.tp > 1 {
            st.tp_out = d_n2.clone();
        }
        c.dgates = dgates;
        c.d_n2 = d_n2;
        c.dy = dy;
        st.outbox = out;
        Ok(())
    }

    /// B, the local experts of layer `l`: input gradients of the rows whose output
    /// gradients are in `st.inbox` (same order as the forward's), to `st.outbox`.
    pub fn bwd_experts(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let (d, f) = (self.d(), self.cfg.expert_hidden);
        let p = &self.params.layers[l];
        let lo = self.params.expert_lo;
        let inbox = std::mem::take(&mut st.inbox);
        let ec = &mut st.experts[l];
        if inbox.len() != ec.sources.len() {
            return Err(format!(
                "expert backward: {} packets for {} sources",
                inbox.len(),
                ec.sources.len()
            ));
        }
        let mut out = Vec::with_capacity(inbox.len());
        for (pk, (ids, caches, grads)) in inbox.into_iter().zip(ec.sources.iter_mut()) {
            if pk.data.len() != ids.len() * d {
                return Err(format!(
                    "expert backward: {} values for {} rows",
                    pk.data.len(),
                    ids.len()
                ));
            }
            let mut data = Vec::with_capacity(pk.data.len());
            grads.clear();
            for (i, &x) in ids.iter().enumerate() {
                let w = &p.experts[x as usize - lo];
                let (dx, gr) =
                    ffn_backward(w, &caches[i], pk.data[i * d..(i + 1) * d].to_vec(), d, f);
                data.extend_from_slice(&dx);
                grads.push(gr);
            }
            out.push(Packet {
                data,
                meta: Vec::new(),
            });
        }
        st.outbox = out;
        Ok(())
    }

    /// B, routing, norm and attention of layer `l`: with the experts' input gradients in
    /// `st.inbox`, computes the gradients of the local queries and, through `W_UK` and
    /// `W_UV`, of every gathered latent `c_KV` and RoPE key `k^R`; `st.outbox` gets, for
    /// each SP group member, the `[dc_KV; dk^R]` of its chunk (`t × (d_c + d_h^R)`, the
    /// reduce-scatter; [`StageKernels::bwd_qkv`] sums them).
    pub fn bwd_attn(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        self.bwd_attn_post(l, st)?;
        let dh1 = st.layers[l].dh1.clone();
        self.bwd_attn_core(l, st, dh1)
    }

    /// B, with Megatron sequence parallelism: the attention core of layer `l` once
    /// `st.tp_in` holds the TP group's gathered `h1` gradient (the whole chunk).
    pub fn bwd_attn_gathered(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let dh1 = std::mem::take(&mut st.tp_in);
        self.bwd_attn_core(l, st, dh1)
    }

    /// B, routing and MoE norm of layer `l` (on the local tokens): with the experts' input
    /// gradients in `st.inbox` (and with TP the shared expert's reduced input gradient in
    /// `st.tp_in`), the gradient of `h1`; with Megatron sequence parallelism also to
    /// `st.tp_out` for the TP group's all-gather.
    pub fn bwd_attn_post(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, e) = (cfg.hidden, cfg.experts);
        let p = &self.params.layers[l];
        let inbox = std::mem::take(&mut st.inbox);
        let reduced = std::mem::take(&mut st.tp_in);
        let c = &mut st.layers[l];
        let r = c.routing.as_ref().ok_or("backward before forward")?;
        let t = c.x.len() / d;
        let per = e / self.ep;
        let mut d_n2 = std::mem::take(&mut c.d_n2);
        if self.tp > 1 {
            if reduced.len() != d_n2.len() {
                return Err(format!(
                    "the shared expert's reduced input gradient has {} values, expected {}",
                    reduced.len(),
                    d_n2.len()
                ));
            }
            d_n2 = reduced;
        }
        let mut next = vec![0usize; self.ep];
        for &i in &c.order {
            let q = r.experts[i] / per;
            let at = next[q];
            let row = inbox
                .get(q)
                .and_then(|pk| pk.data.get(at * d..(at + 1) * d))
                .ok_or_else(|| {
                    format!("dispatch backward: expert rank {q} returned too few rows")
                })?;
            let tok = i / r.k;
            for u in 0..d {
                d_n2[tok * d + u] += row[u];
            }
            next[q] += 1;
        }
        let dlogits = gate_backward(cfg, r, &c.s, &c.dgates);
        add_into(&mut d_n2, &matmul_bt(&dlogits, &p.router, t, e, d));
        let mut dh1 = rmsnorm_backward(&d_n2, &p.norm2, &c.xhat2, &c.inv2, d);
        add_into(&mut dh1, &c.dy);
        if self.sequence_parallel {
            st.tp_out = dh1.clone();
        }
        c.d_n2 = d_n2;
        c.dlogits = dlogits;
        c.dh1 = dh1;
        Ok(())
    }

    /// B, the attention core of layer `l` from the gradient `dh1` of `h1` on the chunk's
    /// rows: through `W_O` (this member's heads), the attention, and `W_UK`, `W_UV` to the
    /// SP group's reduce-scatter packets (`st.outbox`).
    fn bwd_attn_core(&self, l: usize, st: &mut Stash<T>, dh1: Vec<T>) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, kvr, sh) = (cfg.hidden, cfg.kv_lora_rank, self.sh());
        let h = sh.heads;
        let p = &self.params.layers[l];
        let c = &mut st.layers[l];
        let t = c.q_nope.len() / (h * sh.nope);
        if dh1.len() != t * d {
            return Err(format!(
                "the gathered h1 gradient has {} values, expected {}",
                dh1.len(),
                t * d
            ));
        }
        let d_oh = matmul_bt(&dh1, &p.wo, t, d, h * sh.v);
        let input = AttnIn {
            q_nope: &c.q_nope,
            q_pe: &c.q_pe,
            k_nope: &c.k_nope,
            k_pe: &c.kpe_all,
            v: &c.v,
        };
        let g = self.attend_backward(&d_oh, &input, &c.probs, &sh);
        let tk = c.ckv_all.len() / kvr;
        if tk != self.sp * t {
            return Err(format!(
                "{tk} gathered tokens for an SP group of {} with {t} tokens each",
                self.sp
            ));
        }
        let mut dckv_all = matmul_bt(&g.dk_nope, &p.wuk, tk, h * sh.nope, kvr);
        add_into(&mut dckv_all, &matmul_bt(&g.dv, &p.wuv, tk, h * sh.v, kvr));
        let kw = sh.kpe_width();
        st.outbox = (0..self.sp)
            .map(|j| {
                let mut data = dckv_all[j * t * kvr..(j + 1) * t * kvr].to_vec();
                data.extend_from_slice(&g.dk_pe[j * t * kw..(j + 1) * t * kw]);
                Packet {
                    data,
                    meta: Vec::new(),
                }
            })
            .collect();
        c.dh1_full = dh1;
        c.dq_nope = g.dq_nope;
        // Rotated back here; bwd_qkv needs only the pre-rotation gradient.
        let mut dqr = g.dq_pe;
        self.rope_seqs(&mut dqr, h, sh.rope, self.pos0, true);
        c.dqr = dqr;
        c.dk_nope = g.dk_nope;
        c.dv = g.dv;
        Ok(())
    }

    /// B, the MLA projections and norm of layer `l`: sums the local chunk's latent and
    /// RoPE-key gradients received from every SP member (in group order), rotates the
    /// RoPE gradients back, runs them through the latents' norms and the down-projections,
    /// and sets `st.grad` to the gradient w.r.t. the layer input. Errors: a packet of the
    /// wrong size.
    pub fn bwd_qkv(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let cfg = self.cfg;
        let (qr, kvr, sh) = (cfg.q_lora_rank, cfg.kv_lora_rank, self.sh());
        let (h, kw) = (sh.heads, sh.kpe_width());
        let p = &self.params.layers[l];
        let inbox = std::mem::take(&mut st.inbox);
        let c = &mut st.layers[l];
        // The chunk's rows (with Megatron sequence parallelism, the TP group's).
        let t = c.q_nope.len() / (h * sh.nope);
        let w = cfg.kv_gather_width();
        let (mut dckv, mut dkr) = (vec![T::zero(); t * kvr], vec![T::zero(); t * kw]);
        for pk in &inbox {
            if pk.data.len() != t * w {
                return Err(format!(
                    "latent and RoPE-key gradients: {} values, expected {} ({t} tokens x {w})",
                    pk.data.len(),
                    t * w
                ));
            }
            add_into(&mut dckv, &pk.data[..t * kvr]);
            add_into(&mut dkr, &pk.data[t * kvr..]);
        }
        self.rope_seqs(&mut dkr, sh.kpe_heads, sh.rope, self.pos0, true);
        let mut dcq = matmul_bt(&c.dq_nope, &p.wuq, t, h * sh.nope, qr);
        add_into(&mut dcq, &matmul_bt(&c.dqr, &p.wqr, t, h * sh.rope, qr));
        // With TP: this member's heads' share of the gradients of the column-parallel
        // up-projections' inputs (`[dc_Q; dc_KV; dk^R]` side by side, `t` rows).
        let part = interleave(&[(&dcq, qr), (&dckv, kvr), (&dkr, kw)]);
        if self.tp > 1 {
            st.tp_out = part;
            return Ok(());
        }
        st.tp_in = part;
        self.bwd_qkv_post(l, st)
    }

    /// B, the rest of layer `l`'s attention backward once `st.tp_in` holds `[dc_Q; dc_KV;
    /// dk^R]` summed over the TP group (with `tp = 1`, [`Self::bwd_qkv`] calls it itself):
    /// the latents' norms, the down-projections and the attention norm; sets `st.grad` to
    /// the gradient w.r.t. the layer input. Errors: a reduced gradient of the wrong size.
    pub fn bwd_qkv_post(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, qr, kvr, sh) = (cfg.hidden, cfg.q_lora_rank, cfg.kv_lora_rank, self.sh());
        let kw = sh.kpe_width();
        let p = &self.params.layers[l];
        let red = std::mem::take(&mut st.tp_in);
        let c = &mut st.layers[l];
        let t = c.x.len() / d;
        if red.len() != t * (qr + kvr + kw) {
            return Err(format!(
                "the reduced latent gradients have {} values, expected {} ({t} tokens x {})",
                red.len(),
                t * (qr + kvr + kw),
                qr + kvr + kw
            ));
        }
        let mut parts = deinterleave(&red, &[qr, kvr, kw])?.into_iter();
        let (dcq, dckv, dkr) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        let dckv_raw = rmsnorm_backward(&dckv, &p.kv_norm, &c.ckv_xhat, &c.ckv_inv, kvr);
        let dcq_raw = rmsnorm_backward(&dcq, &p.q_norm, &c.cq_xhat, &c.cq_inv, qr);
        let mut da = matmul_bt(&dcq_raw, &p.wdq, t, qr, d);
        add_into(&mut da, &matmul_bt(&dckv_raw, &p.wdkv, t, kvr, d));
        add_into(&mut da, &matmul_bt(&dkr, &p.wkr, t, kw, d));
        let mut dx = rmsnorm_backward(&da, &p.norm1, &c.xhat1, &c.inv1, d);
        add_into(&mut dx, &c.dh1);
        c.dcq = dcq;
        c.dcq_raw = dcq_raw;
        c.dckv = dckv;
        c.dckv_raw = dckv_raw;
        c.dkr = dkr;
        c.da = da;
        st.grad = dx;
        Ok(())
    }

    /// W: every weight gradient of the stage, added to `g`, from a stash whose backward has
    /// run. For the first stage `st.grad` (w.r.t. the embedding output) feeds the
    /// embedding's gradient.
    pub fn weights(&self, st: &Stash<T>, g: &mut StageParams<T>) -> Result<(), String> {
        self.weights_of(st, g, WeightSet::All)
    }

    /// One part of a split W: the weight gradients of `set` only ([`WeightSet`]), added to
    /// `g`. `Mlp` then `Attn` (in either order) add exactly what [`Self::weights`] adds:
    /// every gradient is accumulated by one of them, in the same order of terms.
    ///
    /// # Errors
    /// A stash whose backward has not run.
    pub fn weights_of(
        &self,
        st: &Stash<T>,
        g: &mut StageParams<T>,
        set: WeightSet,
    ) -> Result<(), String> {
        let (attn, mlp) = match set {
            WeightSet::All => (true, true),
            WeightSet::Attn => (true, false),
            WeightSet::Mlp => (false, true),
        };
        let cfg = self.cfg;
        let (d, e, f, v) = (cfg.hidden, cfg.experts, cfg.expert_hidden, cfg.vocab);
        let (qr, kvr, sh) = (cfg.q_lora_rank, cfg.kv_lora_rank, self.sh());
        if let (Some(ge), true, true) = (&mut g.embed, self.params.embed.is_some(), attn) {
            if st.grad.len() != st.tokens.len() * d {
                return Err("embedding gradient before the backward".into());
            }
            for (i, &tok) in st.tokens.iter().enumerate() {
                let tok = tok as usize;
                add_into(
                    &mut ge[tok * d..(tok + 1) * d],
                    &st.grad[i * d..(i + 1) * d],
                );
            }
        }
        for (l, gl) in g.layers.iter_mut().enumerate() {
            let c = &st.layers[l];
            if c.da.is_empty() {
                return Err(format!("weight gradient of layer {l} before its backward"));
            }
            if mlp {
                if let (Some(gs), Some(sc), Some(sg)) = (&mut gl.shared, &c.shared, &c.shared_grad)
                {
                    ffn_weight_grad(gs, sc, sg, d, self.shared_f());
                }
                for (ids, caches, grads) in &st.experts[l].sources {
                    for (i, &x) in ids.iter().enumerate() {
                        let gx = &mut gl.experts[x as usize - g.expert_lo];
                        ffn_weight_grad(gx, &caches[i], &grads[i], d, f);
                    }
                }
            }
            if !attn {
                continue;
            }
            let t = c.x.len() / d;
            let tk = c.ckv_all.len() / kvr;
            let h = sh.heads;
            rmsnorm_weight_grad(&mut gl.norm1, &c.da, &c.xhat1, d);
            add_matmul_at(&mut gl.wdq, &c.a, &c.dcq_raw, t, d, qr);
            rmsnorm_weight_grad(&mut gl.q_norm, &c.dcq, &c.cq_xhat, qr);
            // The up-projections and W_O see the chunk's rows (with Megatron sequence
            // parallelism, the TP group's; the norms and down-projections its shard).
            let tq = c.cq.len() / qr;
            add_matmul_at(&mut gl.wuq, &c.cq, &c.dq_nope, tq, qr, h * sh.nope);
            add_matmul_at(&mut gl.wqr, &c.cq, &c.dqr, tq, qr, h * sh.rope);
            add_matmul_at(&mut gl.wdkv, &c.a, &c.dckv_raw, t, d, kvr);
            rmsnorm_weight_grad(&mut gl.kv_norm, &c.dckv, &c.ckv_xhat, kvr);
            add_matmul_at(&mut gl.wkr, &c.a, &c.dkr, t, d, sh.kpe_width());
            // Over the gathered sequence: each SP member adds its own queries' share, the
            // data-parallel all-reduce (which spans the SP group) sums the shares.
            add_matmul_at(&mut gl.wuk, &c.ckv_all, &c.dk_nope, tk, kvr, h * sh.nope);
            add_matmul_at(&mut gl.wuv, &c.ckv_all, &c.dv, tk, kvr, h * sh.v);
            add_matmul_at(&mut gl.wo, &c.o_heads, &c.dh1_full, tq, h * sh.v, d);
            rmsnorm_weight_grad(&mut gl.norm2, &c.d_n2, &c.xhat2, d);
            add_matmul_at(&mut gl.router, &c.n2, &c.dlogits, t, d, e);
        }
        if let (Some(gn), Some(gh), true) = (&mut g.final_norm, &mut g.head, attn) {
            let hc = st
                .head
                .as_ref()
                .ok_or("head weight gradient before its forward")?;
            let t = hc.xf.len() / d;
            add_matmul_at(gh, &hc.xf, &hc.dlogits, t, d, v);
            rmsnorm_weight_grad(gn, &hc.dxf, &hc.xhat, d);
        }
        Ok(())
    }
}

/// Runs the whole stage forward on one host with no EP or SP group (every expert local,
/// the whole sequence; `k.sp` must be 1): the sequential reference's step for one
/// micro-batch through one stage.
/// `x` is the stage input (ignored for the first stage, which embeds `st.tokens`).
pub fn stage_forward_local<T: Real>(
    k: &StageKernels<'_, T>,
    st: &mut Stash<T>,
    x: Option<Vec<T>>,
    routers: &[RouterState<T>],
    loads: &mut [Vec<T>],
) -> Result<(), String> {
    if k.params.embed.is_some() {
        k.fwd_embed(st)?;
    } else {
        st.x = x.ok_or("a stage input is needed")?;
    }
    for l in 0..k.params.layers.len() {
        k.fwd_qkv(l, st);
        st.inbox = std::mem::take(&mut st.outbox);
        k.fwd_attn(l, st, &routers[l], &mut loads[l])?;
        st.inbox = std::mem::take(&mut st.outbox);
        k.fwd_experts(l, st)?;
        st.inbox = std::mem::take(&mut st.outbox);
        k.fwd_combine(l, st)?;
    }
    if k.params.head.is_some() {
        k.fwd_head(st)?;
    }
    Ok(())
}

/// The backward counterpart of [`stage_forward_local`]: `dy` is the gradient w.r.t. the
/// stage output (ignored for the last stage). Leaves `st.grad` = gradient w.r.t. the input.
pub fn stage_backward_local<T: Real>(
    k: &StageKernels<'_, T>,
    st: &mut Stash<T>,
    dy: Option<Vec<T>>,
) -> Result<(), String> {
    if k.params.head.is_some() {
        k.bwd_head(st)?;
    } else {
        st.grad = dy.ok_or("an output gradient is needed")?;
    }
    for l in (0..k.params.layers.len()).rev() {
        k.bwd_combine(l, st)?;
        st.inbox = std::mem::take(&mut st.outbox);
        k.bwd_experts(l, st)?;
        st.inbox = std::mem::take(&mut st.outbox);
        k.bwd_attn(l, st)?;
        st.inbox = std::mem::take(&mut st.outbox);
        k.bwd_qkv(l, st)?;
    }
    Ok(())
}

/// Checks of the properties whose violation would train silently wrong; each returns
/// `Err(what failed)`. The tests run them on a correct configuration (must pass) and with
/// the matching [`Bugs`] switched on (must fail).
pub mod properties {
    use super::*;

    /// Sequence parallelism: attention of each SP chunk's queries (global positions
    /// `c * T/sp ..`) over the gathered keys and values equals the corresponding rows of
    /// full-sequence attention.
    pub fn sp_attention_matches_full(bugs: &Bugs, sp: usize) -> Result<(), String> {
        let t = 8usize;
        let sh = AttnShape {
            heads: 2,
            nope: 4,
            rope: 4,
            v: 3,
            kpe_heads: 1,
        };
        let (h, kw) = (sh.heads, sh.kpe_width());
        let mut rng = Rng::new(7);
        let mut gen = |n: usize| (0..n).map(|_| rng.uniform()).collect::<Vec<f64>>();
        let (q_nope, q_pe) = (gen(t * h * sh.nope), gen(t * h * sh.rope));
        let (k_nope, k_pe, v) = (gen(t * h * sh.nope), gen(t * kw), gen(t * h * sh.v));
        let full_in = AttnIn {
            q_nope: &q_nope,
            q_pe: &q_pe,
            k_nope: &k_nope,
            k_pe: &k_pe,
            v: &v,
        };
        let (full, _) = attention(&full_in, &sh, 0, &Bugs::default());
        let chunk = t / sp;
        for c in 0..sp {
            let rows = |x: &[f64], w: usize| x[c * chunk * w..(c + 1) * chunk * w].to_vec();
            let (qn, qp) = (rows(&q_nope, h * sh.nope), rows(&q_pe, h * sh.rope));
            let part_in = AttnIn {
                q_nope: &qn,
                q_pe: &qp,
                ..full_in
            };
            let (part, _) = attention(&part_in, &sh, c * chunk, bugs);
            let want = rows(&full, h * sh.v);
            let err = crate::tensor::rel_err(&part, &want, 1e-30);
            if err > 1e-12 {
                return Err(format!(
                    "SP chunk {c} differs from full attention (relative error {err:.3e})"
                ));
            }
        }
        Ok(())
    }

    /// Multi-head latent attention written out directly from DeepSeek-V3 eq. 1-11 for one
    /// layer and one whole sequence at positions `0..t`, with the norms on the latents of
    /// DeepSeek's reference implementation: returns `u = W_O [o_1; ...; o_H]` (`t × d`) for
    /// the attention input `a` (`t × d`). Each head's key is assembled explicitly as
    /// `[k^C_{j,h}; k^R_j]` with the one RoPE key of token `j`. Errors: a weight whose size
    /// is not the architecture's, named with its expected shape.
    pub fn reference_mla(cfg: &ModelConfig, p: &Layer<f64>, a: &[f64]) -> Result<Vec<f64>, String> {
        let (d, hh, qr, kvr) = (cfg.hidden, cfg.heads, cfg.q_lora_rank, cfg.kv_lora_rank);
        let (dn, dr, dv) = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
        for (name, w, rows, cols) in [
            ("W_DQ", &p.wdq, d, qr),
            ("W_UQ", &p.wuq, qr, hh * dn),
            ("W_QR", &p.wqr, qr, hh * dr),
            ("W_DKV", &p.wdkv, d, kvr),
            ("W_KR", &p.wkr, d, dr),
            ("W_UK", &p.wuk, kvr, hh * dn),
            ("W_UV", &p.wuv, kvr, hh * dv),
            ("W_O", &p.wo, hh * dv, d),
        ] {
            if w.len() != rows * cols {
                return Err(format!(
                    "{name} holds {} values, not the {rows} x {cols} of the architecture",
                    w.len()
                ));
            }
        }
        let t = a.len() / d;
        let eps = cfg.norm_eps;
        let (cq, _, _) = rmsnorm(&matmul(a, &p.wdq, t, d, qr), &p.q_norm, qr, eps);
        let q_c = matmul(&cq, &p.wuq, t, qr, hh * dn);
        let mut q_r = matmul(&cq, &p.wqr, t, qr, hh * dr);
        rope(&mut q_r, hh, dr, 0, cfg.rope_base, false);
        let (ckv, _, _) = rmsnorm(&matmul(a, &p.wdkv, t, d, kvr), &p.kv_norm, kvr, eps);
        let k_c = matmul(&ckv, &p.wuk, t, kvr, hh * dn);
        let v_c = matmul(&ckv, &p.wuv, t, kvr, hh * dv);
        let mut k_r = matmul(a, &p.wkr, t, d, dr);
        rope(&mut k_r, 1, dr, 0, cfg.rope_base, false);
        let mut o = vec![0.0; t * hh * dv];
        for h in 0..hh {
            let q_of = |i: usize| -> Vec<f64> {
                let mut q = q_c[(i * hh + h) * dn..(i * hh + h + 1) * dn].to_vec();
                q.extend_from_slice(&q_r[(i * hh + h) * dr..(i * hh + h + 1) * dr]);
                q
            };
            let k_of = |j: usize| -> Vec<f64> {
                let mut k = k_c[(j * hh + h) * dn..(j * hh + h + 1) * dn].to_vec();
                k.extend_from_slice(&k_r[j * dr..(j + 1) * dr]);
                k
            };
            for i in 0..t {
                let q = q_of(i);
                let mut w: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = k_of(j);
                        q.iter().zip(&k).map(|(x, y)| x * y).sum::<f64>()
                            / ((dn + dr) as f64).sqrt()
                    })
                    .collect();
                softmax_row(&mut w);
                for (j, wj) in w.iter().enumerate() {
                    for e in 0..dv {
                        o[(i * hh + h) * dv + e] += wj * v_c[(j * hh + h) * dv + e];
                    }
                }
            }
        }
        Ok(matmul(&o, &p.wo, t, hh * dv, d))
    }

    /// MLA's decoupled RoPE key (DeepSeek-V3 eq. 3-4): one `k^R` per token, shared by every
    /// head. Checked three ways on layer 0 of `cfg`'s first stage: `W_KR` is `d × d_h^R`
    /// (one RoPE key per token, not one per head); the SP group gathers `d_c + d_h^R` values
    /// per token (MLA's cache, DeepSeek-V2 Table 1); and the layer's attention output
    /// equals [`reference_mla`], whose heads all use the same RoPE key.
    pub fn kpe_shared_across_heads(cfg: &ModelConfig) -> Result<(), String> {
        let mut cfg = cfg.clone();
        cfg.layers_per_stage = 1;
        let (d, rope_dim) = (cfg.hidden, cfg.qk_rope_head_dim);
        let params = StageParams::<f64>::init(&cfg, 1, 3, 0, cfg.experts);
        let p = &params.layers[0];
        if p.wkr.len() != d * rope_dim {
            return Err(format!(
                "W_KR holds {} values, d x {}: {} RoPE keys per token where MLA has one \
                 shared by all heads (d x d_h^R = {d} x {rope_dim})",
                p.wkr.len(),
                p.wkr.len() / d,
                p.wkr.len() / (d * rope_dim)
            ));
        }
        let k = StageKernels {
            cfg: &cfg,
            params: &params,
            ep: 1,
            sp: 1,
            pos0: 0,
            route_groups: 1,
            tp: 1,
            tp_rank: 0,
            sequence_parallel: false,
        };
        let t = cfg.seq_len;
        let mut rng = Rng::new(17);
        let x: Vec<f64> = (0..t * d).map(|_| rng.uniform()).collect();
        let mut st = k.new_stash(vec![0; t], vec![0; t], 1.0);
        st.x = x.clone();
        k.fwd_qkv(0, &mut st);
        let want = cfg.kv_lora_rank + rope_dim;
        let got = st.outbox[0].data.len() / t;
        if got != want {
            return Err(format!(
                "the SP group gathers {got} values per token and layer, MLA's cache is \
                 d_c + d_h^R = {want}"
            ));
        }
        st.inbox = std::mem::take(&mut st.outbox);
        let router = RouterState::new(&cfg);
        let mut loads = vec![0.0; cfg.experts];
        k.fwd_attn(0, &mut st, &router, &mut loads)?;
        let c = &st.layers[0];
        let model: Vec<f64> = c.h1.iter().zip(&x).map(|(h1, x)| h1 - x).collect();
        let want = reference_mla(&cfg, p, &c.a)?;
        let err = crate::tensor::rel_err(&model, &want, 1e-30);
        if err > 1e-12 {
            return Err(format!(
                "the attention output differs from MLA with one RoPE key shared by the \
                 heads (relative error {err:.3e})"
            ));
        }
        Ok(())
    }

    /// Gates: for every token, the gates of its `k` experts are their sigmoid scores
    /// divided by the sum over the selected experts (so they sum to 1).
    pub fn gates_normalized_over_selected(cfg: &ModelConfig) -> Result<(), String> {
        let (t, e) = (6usize, cfg.experts);
        let mut rng = Rng::new(11);
        let logits: Vec<f64> = (0..t * e).map(|_| 2.0 * rng.uniform()).collect();
        let s: Vec<f64> = logits.iter().map(|z| sigmoid(*z)).collect();
        let r = route(cfg, &logits, &s, &vec![0.0; e]);
        for i in 0..t {
            let sel = &r.experts[i * r.k..(i + 1) * r.k];
            let z: f64 = sel.iter().map(|&x| s[i * e + x]).sum();
            for (j, &x) in sel.iter().enumerate() {
                let want = s[i * e + x] / z;
                let got = r.gates[i * r.k + j];
                if (got - want).abs() > 1e-14 {
                    return Err(format!(
                        "token {i}: gate of expert {x} is {got}, expected s/sum(selected s) = {want}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Balancing: the load EMA starts at `1/E`; one update from loads `[3, 3, 1, 1]` gives
    /// `ema = beta/E + (1 - beta) load/8` and moves the bias by `gamma` against it; the next
    /// routing already uses the moved bias (experts 2 and 3 win tokens they lost before).
    pub fn bias_ema_before_routing(cfg: &ModelConfig) -> Result<(), String> {
        let mut cfg = cfg.clone();
        cfg.experts = 4;
        cfg.top_k = 1;
        cfg.capacity_factor = None;
        cfg.bias_rate = 0.1;
        cfg.ema_decay = 0.5;
        let mut st = RouterState::<f64>::new(&cfg);
        if st.ema.iter().any(|x| (x - 0.25).abs() > 1e-15) {
            return Err(format!("the load EMA starts at {:?}, not 1/E", st.ema));
        }
        // Every token slightly prefers expert 0, then 1, then 2, then 3.
        let logits: Vec<f64> = (0..4).flat_map(|_| [0.10, 0.08, 0.06, 0.04]).collect();
        let s: Vec<f64> = logits.iter().map(|z| sigmoid(*z)).collect();
        let before = route(&cfg, &logits, &s, &st.routing_bias);
        if before.experts.iter().any(|&x| x != 0) {
            return Err("setup: expert 0 should win every token at zero bias".into());
        }
        st.update(&cfg, &[3.0, 3.0, 1.0, 1.0]);
        let want_ema = [0.3125, 0.3125, 0.1875, 0.1875];
        let want_bias = [-0.1, -0.1, 0.1, 0.1];
        for i in 0..4 {
            if (st.ema[i] - want_ema[i]).abs() > 1e-15 {
                return Err(format!("EMA is {:?}, expected {want_ema:?}", st.ema));
            }
            if (st.bias[i] - want_bias[i]).abs() > 1e-15 {
                return Err(format!("bias is {:?}, expected {want_bias:?}", st.bias));
            }
        }
        let after = route(&cfg, &logits, &s, &st.routing_bias);
        if after.experts.iter().any(|&x| x != 2) {
            return Err(format!(
                "the routing after the update picks experts {:?}, not expert 2: it did not use the updated bias",
                after.experts
            ));
        }
        Ok(())
    }

    /// Capacity: when every token prefers the same experts, each token still gets `k`
    /// distinct experts, no expert exceeds its capacity, and the gates still sum to 1.
    pub fn overflow_rerouted(cfg: &ModelConfig) -> Result<(), String> {
        let mut cfg = cfg.clone();
        cfg.experts = 4;
        cfg.top_k = 2;
        cfg.capacity_factor = Some(0.5);
        let t = 8;
        let cap = cfg.capacity(t);
        let logits: Vec<f64> = (0..t)
            .flat_map(|i| [1.0, 0.9, 0.2 + 0.01 * i as f64, 0.1])
            .collect();
        let s: Vec<f64> = logits.iter().map(|z| sigmoid(*z)).collect();
        let r = route(&cfg, &logits, &s, &[0.0; 4]);
        let mut load = [0usize; 4];
        for i in 0..t {
            let sel = &r.experts[i * 2..i * 2 + 2];
            if sel.contains(&usize::MAX) {
                return Err(format!("token {i} lost an expert slot: {sel:?}"));
            }
            if sel[0] == sel[1] {
                return Err(format!("token {i} got expert {} twice", sel[0]));
            }
            let gs: f64 = r.gates[i * 2..i * 2 + 2].iter().sum();
            if (gs - 1.0).abs() > 1e-14 {
                return Err(format!("token {i}: gates sum to {gs}"));
            }
            for &x in sel {
                load[x] += 1;
            }
        }
        if load.iter().any(|&l| l > cap) {
            return Err(format!("loads {load:?} exceed the capacity {cap}"));
        }
        if load[0] != cap || load[1] != cap {
            return Err(format!(
                "setup: experts 0 and 1 should be full ({load:?}, capacity {cap})"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::properties::*;
    use super::*;
    use crate::tensor::rel_err;

    const H: f64 = 1e-5;
    const TOL: f64 = 1e-6;

    fn rand_vec(rng: &mut Rng, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| scale * rng.uniform()).collect()
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Central differences of `f` at `x`, at the indices `idx` (all if `None`).
    fn fd(f: &mut dyn FnMut(&[f64]) -> f64, x: &[f64], idx: &[usize]) -> Vec<f64> {
        let mut xx = x.to_vec();
        idx.iter()
            .map(|&i| {
                let x0 = xx[i];
                xx[i] = x0 + H;
                let up = f(&xx);
                xx[i] = x0 - H;
                let dn = f(&xx);
                xx[i] = x0;
                (up - dn) / (2.0 * H)
            })
            .collect()
    }

    fn all(n: usize) -> Vec<usize> {
        (0..n).collect()
    }

    fn check(name: &str, analytic: &[f64], numeric: &[f64]) {
        let e = rel_err(analytic, numeric, 1e-12);
        assert!(
            e < TOL,
            "{name}: relative error {e:.3e}\n analytic {analytic:?}\n numeric {numeric:?}"
        );
    }

    #[test]
    fn rmsnorm_gradients() {
        let d = 6;
        let mut rng = Rng::new(1);
        let x = rand_vec(&mut rng, 3 * d, 1.0);
        let g = rand_vec(&mut rng, d, 1.0);
        let r = rand_vec(&mut rng, 3 * d, 1.0);
        let (_, xhat, inv) = rmsnorm(&x, &g, d, 1e-6);
        let dx = rmsnorm_backward(&r, &g, &xhat, &inv, d);
        let num = fd(
            &mut |xx| dot(&rmsnorm(xx, &g, d, 1e-6).0, &r),
            &x,
            &all(x.len()),
        );
        check("rmsnorm dx", &dx, &num);
        let mut dg = vec![0.0; d];
        rmsnorm_weight_grad(&mut dg, &r, &xhat, d);
        let num = fd(&mut |gg| dot(&rmsnorm(&x, gg, d, 1e-6).0, &r), &g, &all(d));
        check("rmsnorm dg", &dg, &num);
    }

    #[test]
    fn rope_gradient_is_the_inverse_rotation() {
        let (h, hd) = (2, 4);
        let mut rng = Rng::new(2);
        let x = rand_vec(&mut rng, 3 * h * hd, 1.0);
        let r = rand_vec(&mut rng, 3 * h * hd, 1.0);
        let mut dx = r.clone();
        rope(&mut dx, h, hd, 5, 10000.0, true);
        let num = fd(
            &mut |xx| {
                let mut y = xx.to_vec();
                rope(&mut y, h, hd, 5, 10000.0, false);
                dot(&y, &r)
            },
            &x,
            &all(x.len()),
        );
        check("rope dx", &dx, &num);
        // Position 0 is the identity; a rotation keeps norms.
        let mut y = x.clone();
        rope(&mut y, h, hd, 0, 10000.0, false);
        assert_eq!(&y[..h * hd], &x[..h * hd]);
        let n0: f64 = x.iter().map(|v| v * v).sum();
        rope(&mut y, h, hd, 3, 10000.0, false);
        let n1: f64 = y.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-12);
    }

    #[test]
    fn attention_gradients() {
        let mut rng = Rng::new(3);
        // Shared RoPE key (MLA) and one per head (the injected bug, which must still be
        // differentiated right: it trains silently); full sequence (offset 0) and a chunk
        // of 3 queries at offset 4 over 8 keys.
        for kpe_heads in [1usize, 2] {
            let sh = AttnShape {
                heads: 2,
                nope: 3,
                rope: 4,
                v: 5,
                kpe_heads,
            };
            let h = sh.heads;
            for (tq, tk, off) in [(5usize, 5usize, 0usize), (3, 8, 4)] {
                let q_nope = rand_vec(&mut rng, tq * h * sh.nope, 1.0);
                let q_pe = rand_vec(&mut rng, tq * h * sh.rope, 1.0);
                let k_nope = rand_vec(&mut rng, tk * h * sh.nope, 1.0);
                let k_pe = rand_vec(&mut rng, tk * sh.kpe_width(), 1.0);
                let v = rand_vec(&mut rng, tk * h * sh.v, 1.0);
                let r = rand_vec(&mut rng, tq * h * sh.v, 1.0);
                let b = Bugs::default();
                let x = AttnIn {
                    q_nope: &q_nope,
                    q_pe: &q_pe,
                    k_nope: &k_nope,
                    k_pe: &k_pe,
                    v: &v,
                };
                let (_, p) = attention(&x, &sh, off, &b);
                let g = attention_backward(&r, &x, &p, &sh);
                // Perturb one input at a time.
                let inputs: [(&str, &[f64], &[f64]); 5] = [
                    ("dq_nope", &q_nope, &g.dq_nope),
                    ("dq_pe", &q_pe, &g.dq_pe),
                    ("dk_nope", &k_nope, &g.dk_nope),
                    ("dk_pe", &k_pe, &g.dk_pe),
                    ("dv", &v, &g.dv),
                ];
                for (which, (name, base, an)) in inputs.iter().enumerate() {
                    let num = fd(
                        &mut |xx| {
                            let mut y = x;
                            match which {
                                0 => y.q_nope = xx,
                                1 => y.q_pe = xx,
                                2 => y.k_nope = xx,
                                3 => y.k_pe = xx,
                                _ => y.v = xx,
                            }
                            dot(&attention(&y, &sh, off, &b).0, &r)
                        },
                        base,
                        &all(base.len()),
                    );
                    check(
                        &format!("attention {name} (kpe_heads {kpe_heads})"),
                        an,
                        &num,
                    );
                }
                // Causality: keys after the last visible position get no gradient.
                for j in (off + tq).min(tk)..tk {
                    let row = &g.dk_pe[j * sh.kpe_width()..(j + 1) * sh.kpe_width()];
                    assert!(row.iter().all(|x| *x == 0.0));
                    let row = &g.dk_nope[j * h * sh.nope..(j + 1) * h * sh.nope];
                    assert!(row.iter().all(|x| *x == 0.0));
                }
            }
        }
    }

    #[test]
    fn a_shared_rope_key_gets_the_sum_of_the_heads_gradients() {
        // With one RoPE key per token, its gradient is the sum of what each head would
        // give its own copy of it.
        let mut rng = Rng::new(31);
        let one = AttnShape {
            heads: 3,
            nope: 2,
            rope: 2,
            v: 2,
            kpe_heads: 1,
        };
        let per_head = AttnShape {
            kpe_heads: 3,
            ..one
        };
        let (t, h) = (4, 3);
        let q_nope = rand_vec(&mut rng, t * h * 2, 1.0);
        let q_pe = rand_vec(&mut rng, t * h * 2, 1.0);
        let k_nope = rand_vec(&mut rng, t * h * 2, 1.0);
        let k_pe = rand_vec(&mut rng, t * 2, 1.0);
        let k_pe3: Vec<f64> = k_pe.chunks(2).flat_map(|r| [r, r, r].concat()).collect();
        let v = rand_vec(&mut rng, t * h * 2, 1.0);
        let r = rand_vec(&mut rng, t * h * 2, 1.0);
        let x1 = AttnIn {
            q_nope: &q_nope,
            q_pe: &q_pe,
            k_nope: &k_nope,
            k_pe: &k_pe,
            v: &v,
        };
        let x3 = AttnIn { k_pe: &k_pe3, ..x1 };
        let b = Bugs::default();
        let (o1, p1) = attention(&x1, &one, 0, &b);
        let (o3, p3) = attention(&x3, &per_head, 0, &b);
        assert!(rel_err(&o1, &o3, 1e-30) < 1e-15);
        let g1 = attention_backward(&r, &x1, &p1, &one);
        let g3 = attention_backward(&r, &x3, &p3, &per_head);
        let summed: Vec<f64> = g3
            .dk_pe
            .chunks(6)
            .flat_map(|c| [c[0] + c[2] + c[4], c[1] + c[3] + c[5]])
            .collect();
        assert!(rel_err(&g1.dk_pe, &summed, 1e-30) < 1e-14);
        // And the heads' shares differ (a head-independent gradient would hide a bug).
        assert!((g3.dk_pe[0] - g3.dk_pe[2]).abs() > 1e-6);
    }

    #[test]
    fn ffn_gradients() {
        let (d, f, m) = (6, 5, 3);
        let mut rng = Rng::new(4);
        let w = Ffn {
            w1: rand_vec(&mut rng, d * f, 0.5),
            w3: rand_vec(&mut rng, d * f, 0.5),
            w2: rand_vec(&mut rng, f * d, 0.5),
        };
        let x = rand_vec(&mut rng, m * d, 1.0);
        let r = rand_vec(&mut rng, m * d, 1.0);
        let (_, c) = ffn_forward(&w, x.clone(), d, f);
        let (dx, gr) = ffn_backward(&w, &c, r.clone(), d, f);
        let num = fd(
            &mut |xx| dot(&ffn_forward(&w, xx.to_vec(), d, f).0, &r),
            &x,
            &all(x.len()),
        );
        check("ffn dx", &dx, &num);
        let mut g = Ffn {
            w1: vec![0.0; d * f],
            w3: vec![0.0; d * f],
            w2: vec![0.0; f * d],
        };
        ffn_weight_grad(&mut g, &c, &gr, d, f);
        for which in 0..3 {
            let base = [&w.w1, &w.w3, &w.w2][which].clone();
            let num = fd(
                &mut |ww| {
                    let mut w2 = w.clone();
                    *[&mut w2.w1, &mut w2.w3, &mut w2.w2][which] = ww.to_vec();
                    dot(&ffn_forward(&w2, x.clone(), d, f).0, &r)
                },
                &base,
                &all(base.len()),
            );
            check("ffn dW", [&g.w1, &g.w3, &g.w2][which], &num);
        }
    }

    #[test]
    fn gate_gradients() {
        for softmax_bug in [false, true] {
            let mut cfg = ModelConfig::tiny();
            cfg.experts = 5;
            cfg.top_k = 2;
            cfg.bugs.softmax_gates = softmax_bug;
            let (t, e) = (4, 5);
            let mut rng = Rng::new(5);
            let logits = rand_vec(&mut rng, t * e, 2.0);
            let r = rand_vec(&mut rng, t * 2, 1.0);
            let gates_of = |l: &[f64]| {
                let s: Vec<f64> = l.iter().map(|z| sigmoid(*z)).collect();
                route(&cfg, l, &s, &[0.0; 5])
            };
            let base = gates_of(&logits);
            let s: Vec<f64> = logits.iter().map(|z| sigmoid(*z)).collect();
            let dl = gate_backward(&cfg, &base, &s, &r);
            let num = fd(
                &mut |l| {
                    let rr = gates_of(l);
                    assert_eq!(
                        rr.experts, base.experts,
                        "selection moved under the perturbation"
                    );
                    dot(&rr.gates, &r)
                },
                &logits,
                &all(logits.len()),
            );
            check("gate dlogits", &dl, &num);
        }
    }

    /// Loss of one stage on one micro-batch: the cross-entropy for a last stage, else the
    /// output dotted with `r`.
    fn stage_loss(cfg: &ModelConfig, p: &StageParams<f64>, x: Option<&[f64]>, r: &[f64]) -> f64 {
        let k = StageKernels {
            cfg,
            params: p,
            ep: 1,
            sp: 1,
            pos0: 0,
            route_groups: 1,
            tp: 1,
            tp_rank: 0,
            sequence_parallel: false,
        };
        let mut st = k.new_stash(tokens(cfg), targets(cfg), 1.0 / cfg.seq_len as f64);
        let routers: Vec<RouterState<f64>> = (0..p.layers.len()).map(|_| router(cfg)).collect();
        let mut loads = vec![vec![0.0; cfg.experts]; p.layers.len()];
        stage_forward_local(&k, &mut st, x.map(|x| x.to_vec()), &routers, &mut loads).unwrap();
        if p.head.is_some() {
            st.loss
        } else {
            dot(&st.x, r)
        }
    }

    fn router(cfg: &ModelConfig) -> RouterState<f64> {
        let mut r = RouterState::new(cfg);
        // A non-trivial bias so that selection on s + bias is exercised.
        r.routing_bias = (0..cfg.experts).map(|e| 0.01 * e as f64).collect();
        r
    }

    fn tokens(cfg: &ModelConfig) -> Vec<u32> {
        (0..cfg.seq_len as u32)
            .map(|i| (i * 37 + 11) % 128)
            .collect()
    }

    fn targets(cfg: &ModelConfig) -> Vec<u32> {
        (0..cfg.seq_len as u32)
            .map(|i| (i * 53 + 7) % 128)
            .collect()
    }

    /// Finite-difference check of every tensor of a stage (sampled entries for the big
    /// ones) and of the stage's input gradient.
    fn check_stage(cfg: &ModelConfig, model_stage: usize, n_stages: usize) {
        let p = StageParams::<f64>::init(cfg, model_stage, n_stages, 0, cfg.experts);
        let d = cfg.hidden;
        let mut rng = Rng::new(9);
        let x = (model_stage > 0).then(|| rand_vec(&mut rng, cfg.seq_len * d, 1.0));
        let r = rand_vec(&mut rng, cfg.seq_len * d, 1.0);
        // Analytic.
        let k = StageKernels {
            cfg,
            params: &p,
            ep: 1,
            sp: 1,
            pos0: 0,
            route_groups: 1,
            tp: 1,
            tp_rank: 0,
            sequence_parallel: false,
        };
        let mut st = k.new_stash(tokens(cfg), targets(cfg), 1.0 / cfg.seq_len as f64);
        let routers: Vec<RouterState<f64>> = (0..p.layers.len()).map(|_| router(cfg)).collect();
        let mut loads = vec![vec![0.0; cfg.experts]; p.layers.len()];
        stage_forward_local(&k, &mut st, x.clone(), &routers, &mut loads).unwrap();
        let dy = (p.head.is_none()).then(|| r.clone());
        stage_backward_local(&k, &mut st, dy).unwrap();
        let mut g = p.zeros_like();
        k.weights(&st, &mut g).unwrap();
        // Input gradient.
        if let Some(x) = &x {
            let num = fd(
                &mut |xx| stage_loss(cfg, &p, Some(xx), &r),
                x,
                &all(x.len()),
            );
            check("stage dx", &st.grad, &num);
        }
        // Every tensor.
        let mut names = Vec::new();
        p.visit(&mut |n, _, _| names.push(n.to_string()));
        let mut grads = Vec::new();
        g.visit(&mut |_, _, t| grads.push(t.to_vec()));
        let mut checked = Vec::new();
        for (ti, name) in names.iter().enumerate() {
            let an = &grads[ti];
            // The largest entries and a few spread ones.
            let mut idx: Vec<usize> = (0..an.len()).collect();
            idx.sort_by(|a, b| an[*b].abs().partial_cmp(&an[*a].abs()).unwrap());
            let mut pick: Vec<usize> = idx.iter().take(4).copied().collect();
            pick.extend((0..an.len()).step_by((an.len() / 4).max(1)));
            pick.sort_unstable();
            pick.dedup();
            let mut base = Vec::new();
            p.visit(&mut |n, _, t| {
                if n == name {
                    base = t.to_vec();
                }
            });
            let num = fd(
                &mut |vals| {
                    let mut p2 = p.clone();
                    let mut at = 0;
                    p2.visit_mut(&mut |n, _, t| {
                        if n == name {
                            for (j, &i) in pick.iter().enumerate() {
                                t[i] = vals[j];
                            }
                            at += 1;
                        }
                    });
                    stage_loss(cfg, &p2, x.as_deref(), &r)
                },
                &pick.iter().map(|&i| base[i]).collect::<Vec<_>>(),
                &all(pick.len()),
            );
            let a: Vec<f64> = pick.iter().map(|&i| an[i]).collect();
            if a.iter().all(|v| *v == 0.0) {
                // An expert no token reached: the numeric gradient must vanish too.
                assert!(num.iter().all(|v| v.abs() < 1e-9), "{name}: {num:?}");
                continue;
            }
            check(name, &a, &num);
            checked.push(name.clone());
        }
        assert!(
            checked.len() >= 20,
            "only {} tensors checked",
            checked.len()
        );
        // Every attention weight of every layer (MLA: eq. 1-11 and the latents' norms).
        for l in &p.layers {
            for w in [
                "norm1", "wdq", "q_norm", "wuq", "wqr", "wdkv", "kv_norm", "wkr", "wuk", "wuv",
                "wo",
            ] {
                let n = format!("layer{}.{w}", l.index);
                assert!(checked.contains(&n), "{n} was not checked");
            }
        }
    }

    #[test]
    fn whole_stage_gradients_first_and_last() {
        // One stage that is both first and last: embedding, two MoE layers, head + CE.
        let mut cfg = ModelConfig::tiny();
        cfg.layers_per_stage = 2;
        check_stage(&cfg, 0, 1);
    }

    #[test]
    fn whole_stage_gradients_middle_with_capacity_pressure() {
        // A middle stage (input gradient checked), tight capacity so that re-routing
        // happens, no shared expert.
        let mut cfg = ModelConfig::tiny();
        cfg.capacity_factor = Some(0.25);
        cfg.shared_expert = false;
        check_stage(&cfg, 1, 3);
    }

    #[test]
    fn whole_stage_gradients_with_per_head_rope_keys() {
        // The injected k_pe bug differentiates right too: nothing but the guard above can
        // tell it from MLA while training.
        let mut cfg = ModelConfig::tiny();
        cfg.bugs.per_head_kpe = true;
        check_stage(&cfg, 1, 3);
    }

    #[test]
    fn node_limited_routing_keeps_each_token_on_its_best_groups() {
        // 8 experts in 2 groups (nodes), top-4, at most 1 group per token, no capacity:
        // every token's 4 experts are the 4 of one group, the group whose best 4 scores sum
        // highest; without the limit some token spans both groups.
        use schedc_program::model::GroupLimit;
        let mut cfg = ModelConfig::tiny();
        cfg.experts = 8;
        cfg.top_k = 4;
        cfg.capacity_factor = None;
        let t = 16;
        let mut rng = crate::tensor::Rng::new(7);
        let logits: Vec<f64> = (0..t * 8).map(|_| 2.0 * rng.uniform()).collect();
        let s: Vec<f64> = logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
        let bias = vec![0.0; 8];
        let free = route(&cfg, &logits, &s, &bias);
        let spans = |r: &Routing<f64>, i: usize| {
            let mut g: Vec<usize> = r.experts[i * 4..i * 4 + 4].iter().map(|x| x / 4).collect();
            g.sort();
            g.dedup();
            g
        };
        assert!((0..t).any(|i| spans(&free, i).len() == 2));
        cfg.group_limit = Some(GroupLimit { groups: 2, max: 1 });
        cfg.validate().unwrap();
        let lim = route(&cfg, &logits, &s, &bias);
        for i in 0..t {
            let row = &s[i * 8..i * 8 + 8];
            let best = |g: usize| row[g * 4..g * 4 + 4].iter().sum::<f64>();
            let want = if best(1) > best(0) { 1 } else { 0 };
            assert_eq!(spans(&lim, i), vec![want], "token {i}");
            assert_eq!(lim.desired[i * 4..i * 4 + 4], lim.experts[i * 4..i * 4 + 4]);
        }
        // Refusals: groups that do not divide E, a limit out of range, too few experts.
        for (g, m, want) in [
            (3, 1, "do not split into 3 equal routing groups"),
            (2, 3, "must come from 1 to 2 groups, got 3"),
            (4, 1, "1 group(s) of 2 experts hold fewer than top_k = 4"),
        ] {
            cfg.group_limit = Some(GroupLimit { groups: g, max: m });
            let e = cfg.validate().unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn capacity_bound() {
        let cfg = ModelConfig::tiny(); // E = 4, k = 2, cf = 1
                                       // ceil(16/4) = 4 vs ceil(16/3) = 6.
        assert_eq!(cfg.capacity(8), 6);
        let mut c2 = cfg.clone();
        c2.experts = 16;
        c2.capacity_factor = Some(2.0);
        // ceil(2*16/16) = 2 vs ceil(16/15) = 2.
        assert_eq!(c2.capacity(8), 2);
        c2.capacity_factor = None;
        assert_eq!(c2.capacity(8), usize::MAX);
    }

    #[test]
    fn reroute_never_drops_under_any_preference() {
        // Exhaustive-ish: random scores, tight capacity, many shapes.
        let mut rng = Rng::new(21);
        for (e, k) in [(4, 2), (4, 3), (6, 2), (8, 4), (3, 2)] {
            for t in [1usize, 3, 8, 13] {
                let mut cfg = ModelConfig::tiny();
                cfg.experts = e;
                cfg.top_k = k;
                cfg.capacity_factor = Some(0.1);
                let logits = rand_vec(&mut rng, t * e, 3.0);
                let s: Vec<f64> = logits.iter().map(|z| sigmoid(*z)).collect();
                let r = route(&cfg, &logits, &s, &vec![0.0; e]);
                let cap = cfg.capacity(t);
                let mut load = vec![0; e];
                for i in 0..t {
                    let mut sel = r.experts[i * k..(i + 1) * k].to_vec();
                    assert!(!sel.contains(&usize::MAX), "E={e} k={k} t={t}: dropped");
                    sel.sort_unstable();
                    sel.dedup();
                    assert_eq!(sel.len(), k);
                    for x in sel {
                        load[x] += 1;
                    }
                }
                assert!(
                    load.iter().all(|&l| l <= cap),
                    "E={e} k={k} t={t}: {load:?} > {cap}"
                );
            }
        }
    }

    #[test]
    fn silent_failure_sp_causal_mask_uses_global_positions() {
        sp_attention_matches_full(&Bugs::default(), 2).unwrap();
        sp_attention_matches_full(&Bugs::default(), 4).unwrap();
        let bug = Bugs {
            local_causal_mask: true,
            ..Bugs::default()
        };
        let e = sp_attention_matches_full(&bug, 2).unwrap_err();
        assert!(e.contains("SP chunk 1 differs"), "{e}");
    }

    #[test]
    fn silent_failure_kpe_computed_once_and_shared_across_heads() {
        // The first silent failure of the DualPipe talk: k_pe per head trains (and every
        // schedule equals sequential training) but learns H redundant position keys.
        for cfg in [ModelConfig::tiny(), ModelConfig::small()] {
            kpe_shared_across_heads(&cfg).unwrap();
            let mut bug = cfg.clone();
            bug.bugs.per_head_kpe = true;
            let e = kpe_shared_across_heads(&bug).unwrap_err();
            assert!(
                e.contains(&format!("{} RoPE keys per token", cfg.heads)),
                "{e}"
            );
        }
    }

    #[test]
    fn reference_mla_refuses_per_head_rope_keys() {
        // The reference of the guard above matches the kernels on the model's weights (the
        // success above) and refuses a per-head W_KR by name.
        let mut bug = ModelConfig::tiny();
        bug.bugs.per_head_kpe = true;
        let p = StageParams::<f64>::init(&bug, 0, 1, 0, bug.experts);
        let a = vec![0.5; bug.seq_len * bug.hidden];
        let e = reference_mla(&bug, &p.layers[0], &a).unwrap_err();
        assert!(
            e.starts_with("W_KR holds 128 values, not the 16 x 4"),
            "{e}"
        );
    }

    #[test]
    fn silent_failure_gates_normalized_after_top_k() {
        let cfg = ModelConfig::tiny();
        gates_normalized_over_selected(&cfg).unwrap();
        let mut bug = cfg.clone();
        bug.bugs.softmax_gates = true;
        let e = gates_normalized_over_selected(&bug).unwrap_err();
        assert!(e.contains("expected s/sum(selected s)"), "{e}");
    }

    #[test]
    fn silent_failure_bias_ema_init_and_order() {
        let cfg = ModelConfig::tiny();
        bias_ema_before_routing(&cfg).unwrap();
        let mut bug = cfg.clone();
        bug.bugs.ema_init_zero = true;
        let e = bias_ema_before_routing(&bug).unwrap_err();
        assert!(e.contains("starts at"), "{e}");
        let mut bug = cfg.clone();
        bug.bugs.bias_update_after_routing = true;
        let e = bias_ema_before_routing(&bug).unwrap_err();
        assert!(e.contains("did not use the updated bias"), "{e}");
    }

    #[test]
    fn silent_failure_overflow_rerouted_not_dropped() {
        let cfg = ModelConfig::tiny();
        overflow_rerouted(&cfg).unwrap();
        let mut bug = cfg.clone();
        bug.bugs.drop_overflow = true;
        let e = overflow_rerouted(&bug).unwrap_err();
        assert!(e.contains("lost an expert slot"), "{e}");
    }

    #[test]
    fn flatten_round_trip_and_names() {
        let cfg = ModelConfig::tiny();
        let p = StageParams::<f64>::init(&cfg, 1, 2, 2, 4);
        let mut names = Vec::new();
        p.visit(&mut |n, s, _| names.push((n.to_string(), s)));
        assert_eq!(names[0].0, "layer1.norm1");
        assert!(names.contains(&("layer1.expert3.w2".to_string(), Scope::Expert)));
        assert!(!names.iter().any(|(n, _)| n.contains("expert1")));
        assert_eq!(names.last().unwrap().0, "head");
        let mut g = Grads::zeros(&cfg, &p);
        g.params = p.clone();
        g.loads[0] = vec![1.0, 2.0, 3.0, 4.0];
        let dense = g.flatten(Scope::Dense);
        let expert = g.flatten(Scope::Expert);
        let mut h = Grads::zeros(&cfg, &p);
        h.unflatten(Scope::Dense, &dense);
        h.unflatten(Scope::Expert, &expert);
        assert_eq!(h, g);
        // Same name, same values, wherever the tensor lives.
        let q = StageParams::<f64>::init(&cfg, 1, 2, 0, 4);
        assert_eq!(q.layers[0].experts[3], p.layers[0].experts[1]);
        assert_eq!(q.layers[0].wkr, p.layers[0].wkr);
    }
}
