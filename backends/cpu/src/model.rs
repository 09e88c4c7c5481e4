//! A small DeepSeek-V3-style MoE transformer with every forward, input-gradient (B) and
//! weight-gradient (W) written by hand, generic over `f32`/`f64` ([`Real`]).
//!
//! ## Architecture (per layer, pre-norm, `T` tokens of width `d`)
//!
//! ```text
//! a  = RMSNorm(x; g1)                       xhat = x / sqrt(mean(x^2) + eps)
//! q, k, v = a Wq, a Wk, a Wv                (d x d each; H heads of d/H)
//! q, k = RoPE(q, pos), RoPE(k, pos)         rotate pairs (2i, 2i+1) by pos * base^(-2i/hd)
//! o  = softmax(q k^T / sqrt(hd) + causal) v, per head; causal: key pos <= query pos (global)
//! h1 = x + o Wo
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
//! Sources: DeepSeek-V3 technical report (arXiv 2412.19437) §2.1.2 (sigmoid affinities,
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
//! sequence. Queries and keys are rotated at these global positions; every member's keys
//! and values are gathered ([`StageKernels::fwd_qkv`] → all-gather →
//! [`StageKernels::fwd_attn`]), and a query at global position `p` attends keys `0..=p`
//! (so the mask offset of chunk `j` is `j T/n`). The key and value gradients each member
//! computes for every chunk go back to the chunk's owner, which sums them in group order
//! ([`StageKernels::bwd_attn`] → reduce-scatter → [`StageKernels::bwd_qkv`]). Each chunk
//! is its own routing group (capacity counted per chunk); the sequential reference routes
//! whole sequences in the same `n` groups ([`route_groups`]).
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
    /// Query projection, `d × d`.
    pub wq: Vec<T>,
    /// Key projection, `d × d`.
    pub wk: Vec<T>,
    /// Value projection, `d × d`.
    pub wv: Vec<T>,
    /// Output projection, `d × d`.
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
        let layers = (0..cfg.layers_per_stage)
            .map(|l| {
                let g = model_stage * cfg.layers_per_stage + l;
                let p = format!("layer{g}");
                Layer {
                    index: g,
                    norm1: init_gain(cfg, &format!("{p}.norm1"), d),
                    wq: init_tensor(cfg, &format!("{p}.wq"), d * d, d),
                    wk: init_tensor(cfg, &format!("{p}.wk"), d * d, d),
                    wv: init_tensor(cfg, &format!("{p}.wv"), d * d, d),
                    wo: init_tensor(cfg, &format!("{p}.wo"), d * d, d),
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
                ("wq", &l.wq),
                ("wk", &l.wk),
                ("wv", &l.wv),
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
                ("wq", &mut l.wq),
                ("wk", &mut l.wk),
                ("wv", &mut l.wv),
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

/// Causal multi-head attention of `tq` query rows at global positions `q_offset..` over `tk`
/// key/value rows at positions `0..tk`, all rows `d = heads × hd` wide (a sequence-parallel
/// rank passes its chunk's queries, the gathered keys and values, and
/// `q_offset = sp_rank * chunk`). Query `i` sees key `j` iff `j <= q_offset + i`.
/// Returns `(out, probs)`: `out` is `tq × d`, `probs` is `heads × tq × tk`.
pub fn attention<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    d: usize,
    heads: usize,
    q_offset: usize,
    bugs: &Bugs,
) -> (Vec<T>, Vec<T>) {
    let hd = d / heads;
    let (tq, tk) = (q.len() / d, k.len() / d);
    let scale = T::of(1.0 / (hd as f64).sqrt());
    let mut probs = vec![T::zero(); heads * tq * tk];
    let mut out = vec![T::zero(); tq * d];
    for h in 0..heads {
        for i in 0..tq {
            let qpos = if bugs.local_causal_mask {
                i
            } else {
                q_offset + i
            };
            let visible = (qpos + 1).min(tk);
            let row = &mut probs[(h * tq + i) * tk..(h * tq + i + 1) * tk];
            let qi = &q[i * d + h * hd..i * d + (h + 1) * hd];
            for j in 0..visible {
                let kj = &k[j * d + h * hd..j * d + (h + 1) * hd];
                let mut s = T::zero();
                for e in 0..hd {
                    s += qi[e] * kj[e];
                }
                row[j] = s * scale;
            }
            softmax_row(&mut row[..visible]);
            let oi = &mut out[i * d + h * hd..i * d + (h + 1) * hd];
            for j in 0..visible {
                let vj = &v[j * d + h * hd..j * d + (h + 1) * hd];
                for e in 0..hd {
                    oi[e] += row[j] * vj[e];
                }
            }
        }
    }
    (out, probs)
}

/// Gradients of [`attention`] w.r.t. `q`, `k`, `v` given `dout` and the forward's `probs`:
/// `dP = dO Vᵀ`, `dV = Pᵀ dO`, `dS = P (dP - rowsum(P dP))`, `dQ = dS K / sqrt(hd)`,
/// `dK = dSᵀ Q / sqrt(hd)`. Masked entries have `P = 0` and contribute nothing.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Real>(
    dout: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    probs: &[T],
    d: usize,
    heads: usize,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let hd = d / heads;
    let (tq, tk) = (q.len() / d, k.len() / d);
    let scale = T::of(1.0 / (hd as f64).sqrt());
    let (mut dq, mut dk, mut dv) = (
        vec![T::zero(); q.len()],
        vec![T::zero(); k.len()],
        vec![T::zero(); v.len()],
    );
    let mut dp = vec![T::zero(); tk];
    for h in 0..heads {
        for i in 0..tq {
            let p = &probs[(h * tq + i) * tk..(h * tq + i + 1) * tk];
            let doi = &dout[i * d + h * hd..i * d + (h + 1) * hd];
            let mut sum = T::zero();
            for j in 0..tk {
                let vj = &v[j * d + h * hd..j * d + (h + 1) * hd];
                let mut s = T::zero();
                for e in 0..hd {
                    s += doi[e] * vj[e];
                }
                dp[j] = s;
                sum += p[j] * s;
                for e in 0..hd {
                    dv[j * d + h * hd + e] += p[j] * doi[e];
                }
            }
            for j in 0..tk {
                let ds = p[j] * (dp[j] - sum) * scale;
                if ds == T::zero() {
                    continue;
                }
                for e in 0..hd {
                    dq[i * d + h * hd + e] += ds * k[j * d + h * hd + e];
                    dk[j * d + h * hd + e] += ds * q[i * d + h * hd + e];
                }
            }
        }
    }
    (dq, dk, dv)
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
    // Preference order per token on s + bias (ties to the lower id).
    let prefs: Vec<Vec<usize>> = (0..t)
        .map(|i| {
            let mut ids: Vec<usize> = (0..e).collect();
            ids.sort_by(|&a, &b| {
                let (sa, sb) = (s[i * e + a] + bias[a], s[i * e + b] + bias[b]);
                sb.partial_cmp(&sa)
                    .unwrap_or(std::cmp::Ordering::Equal)
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
    a: Vec<T>,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    probs: Vec<T>,
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
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
    dh1: Vec<T>,
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
}

impl<T: Real> StageKernels<'_, T> {
    fn d(&self) -> usize {
        self.cfg.hidden
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

    /// F, norm and Q/K/V projections of layer `l` (local index), rotated at the local tokens'
    /// global positions; `st.outbox` gets this rank's `[K; V]` for every SP group member
    /// (the all-gather).
    pub fn fwd_qkv(&self, l: usize, st: &mut Stash<T>) {
        let cfg = self.cfg;
        let (d, h) = (cfg.hidden, cfg.heads);
        let p = &self.params.layers[l];
        let x = std::mem::take(&mut st.x);
        let t = x.len() / d;
        let (a, xhat1, inv1) = rmsnorm(&x, &p.norm1, d, cfg.norm_eps);
        let mut q = matmul(&a, &p.wq, t, d, d);
        let mut k = matmul(&a, &p.wk, t, d, d);
        let v = matmul(&a, &p.wv, t, d, d);
        rope(&mut q, h, d / h, self.pos0, cfg.rope_base, false);
        rope(&mut k, h, d / h, self.pos0, cfg.rope_base, false);
        let mut kv = k;
        kv.extend_from_slice(&v);
        st.outbox = (0..self.sp)
            .map(|_| Packet {
                data: kv.clone(),
                meta: Vec::new(),
            })
            .collect();
        st.layers[l] = LayerCache {
            x,
            xhat1,
            inv1,
            a,
            q,
            ..LayerCache::default()
        };
    }

    /// F, attention (local queries over the gathered keys and values in `st.inbox`, causal
    /// at global positions), output projection, residual, norm and routing of layer `l`:
    /// fills `st.outbox` with the dispatch packets and adds the layer's top-k counts to
    /// `loads`. Errors: a gathered packet of the wrong size.
    pub fn fwd_attn(
        &self,
        l: usize,
        st: &mut Stash<T>,
        router: &RouterState<T>,
        loads: &mut [T],
    ) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, h, e) = (cfg.hidden, cfg.heads, cfg.experts);
        let p = &self.params.layers[l];
        let inbox = std::mem::take(&mut st.inbox);
        let c = std::mem::take(&mut st.layers[l]);
        let LayerCache {
            x,
            xhat1,
            inv1,
            a,
            q,
            ..
        } = c;
        let t = x.len() / d;
        let (mut k, mut v) = (Vec::with_capacity(t * d * self.sp), Vec::new());
        for pk in &inbox {
            if pk.data.len() != 2 * t * d {
                return Err(format!(
                    "gathered keys and values: {} values, expected {}",
                    pk.data.len(),
                    2 * t * d
                ));
            }
            k.extend_from_slice(&pk.data[..t * d]);
            v.extend_from_slice(&pk.data[t * d..]);
        }
        let (o_heads, probs) = attention(&q, &k, &v, d, h, self.pos0, &cfg.bugs);
        let mut h1 = matmul(&o_heads, &p.wo, t, d, d);
        add_into(&mut h1, &x);
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
        st.layers[l] = LayerCache {
            x,
            xhat1,
            inv1,
            a,
            q,
            k,
            v,
            probs,
            o_heads,
            xhat2,
            inv2,
            n2,
            s,
            routing: Some(r),
            order,
            h1,
            ..LayerCache::default()
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
        let (d, f) = (self.d(), self.cfg.expert_hidden);
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
        if let Some(sw) = &p.shared {
            let (ys, sc) = ffn_forward(sw, c.n2.clone(), d, f);
            add_into(&mut y, &ys);
            c.shared = Some(sc);
        }
        c.expert_out = eo;
        st.x = y;
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
        let (d, f) = (self.d(), self.cfg.expert_hidden);
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
        if let (Some(sw), Some(sc)) = (&p.shared, &c.shared) {
            let (dx, gr) = ffn_backward(sw, sc, dy.clone(), d, f);
            d_n2 = dx;
            c.shared_grad = Some(gr);
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
    /// `st.inbox`, computes the gradients of the local queries and of every gathered key and
    /// value; `st.outbox` gets, for each SP group member, the key/value gradients of its
    /// chunk (the reduce-scatter; [`StageKernels::bwd_qkv`] sums them).
    pub fn bwd_attn(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, h, e) = (cfg.hidden, cfg.heads, cfg.experts);
        let p = &self.params.layers[l];
        let inbox = std::mem::take(&mut st.inbox);
        let c = &mut st.layers[l];
        let r = c.routing.as_ref().ok_or("backward before forward")?;
        let t = c.x.len() / d;
        let per = e / self.ep;
        let mut d_n2 = std::mem::take(&mut c.d_n2);
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
        let d_oh = matmul_bt(&dh1, &p.wo, t, d, d);
        let (dq, dk, dv) = attention_backward(&d_oh, &c.q, &c.k, &c.v, &c.probs, d, h);
        let chunks = dk.len() / (t * d);
        if chunks != self.sp {
            return Err(format!(
                "{chunks} key chunks for an SP group of {}",
                self.sp
            ));
        }
        st.outbox = (0..chunks)
            .map(|j| {
                let mut data = dk[j * t * d..(j + 1) * t * d].to_vec();
                data.extend_from_slice(&dv[j * t * d..(j + 1) * t * d]);
                Packet {
                    data,
                    meta: Vec::new(),
                }
            })
            .collect();
        c.d_n2 = d_n2;
        c.dlogits = dlogits;
        c.dh1 = dh1;
        c.dq = dq;
        Ok(())
    }

    /// B, Q/K/V projections and norm of layer `l`: sums the local chunk's key and value
    /// gradients received from every SP member (in group order), rotates the query and key
    /// gradients back, and sets `st.grad` to the gradient w.r.t. the layer input.
    pub fn bwd_qkv(&self, l: usize, st: &mut Stash<T>) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, h) = (cfg.hidden, cfg.heads);
        let p = &self.params.layers[l];
        let inbox = std::mem::take(&mut st.inbox);
        let c = &mut st.layers[l];
        let t = c.x.len() / d;
        let (mut dk, mut dv) = (vec![T::zero(); t * d], vec![T::zero(); t * d]);
        for pk in &inbox {
            if pk.data.len() != 2 * t * d {
                return Err(format!(
                    "key/value gradients: {} values, expected {}",
                    pk.data.len(),
                    2 * t * d
                ));
            }
            add_into(&mut dk, &pk.data[..t * d]);
            add_into(&mut dv, &pk.data[t * d..]);
        }
        let mut dq = std::mem::take(&mut c.dq);
        rope(&mut dq, h, d / h, self.pos0, cfg.rope_base, true);
        rope(&mut dk, h, d / h, self.pos0, cfg.rope_base, true);
        let mut da = matmul_bt(&dq, &p.wq, t, d, d);
        add_into(&mut da, &matmul_bt(&dk, &p.wk, t, d, d));
        add_into(&mut da, &matmul_bt(&dv, &p.wv, t, d, d));
        let mut dx = rmsnorm_backward(&da, &p.norm1, &c.xhat1, &c.inv1, d);
        add_into(&mut dx, &c.dh1);
        c.dq = dq;
        c.dk = dk;
        c.dv = dv;
        c.da = da;
        st.grad = dx;
        Ok(())
    }

    /// W: every weight gradient of the stage, added to `g`, from a stash whose backward has
    /// run. For the first stage `st.grad` (w.r.t. the embedding output) feeds the
    /// embedding's gradient.
    pub fn weights(&self, st: &Stash<T>, g: &mut StageParams<T>) -> Result<(), String> {
        let cfg = self.cfg;
        let (d, e, f, v) = (cfg.hidden, cfg.experts, cfg.expert_hidden, cfg.vocab);
        if let (Some(ge), true) = (&mut g.embed, self.params.embed.is_some()) {
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
            let t = c.x.len() / d;
            rmsnorm_weight_grad(&mut gl.norm1, &c.da, &c.xhat1, d);
            add_matmul_at(&mut gl.wq, &c.a, &c.dq, t, d, d);
            add_matmul_at(&mut gl.wk, &c.a, &c.dk, t, d, d);
            add_matmul_at(&mut gl.wv, &c.a, &c.dv, t, d, d);
            add_matmul_at(&mut gl.wo, &c.o_heads, &c.dh1, t, d, d);
            rmsnorm_weight_grad(&mut gl.norm2, &c.d_n2, &c.xhat2, d);
            add_matmul_at(&mut gl.router, &c.n2, &c.dlogits, t, d, e);
            if let (Some(gs), Some(sc), Some(sg)) = (&mut gl.shared, &c.shared, &c.shared_grad) {
                ffn_weight_grad(gs, sc, sg, d, f);
            }
            for (ids, caches, grads) in &st.experts[l].sources {
                for (i, &x) in ids.iter().enumerate() {
                    let gx = &mut gl.experts[x as usize - g.expert_lo];
                    ffn_weight_grad(gx, &caches[i], &grads[i], d, f);
                }
            }
        }
        if let (Some(gn), Some(gh)) = (&mut g.final_norm, &mut g.head) {
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
        let (t, d, h) = (8usize, 8usize, 2usize);
        let mut rng = Rng::new(7);
        let mut gen = |n: usize| (0..n).map(|_| rng.uniform()).collect::<Vec<f64>>();
        let (q, k, v) = (gen(t * d), gen(t * d), gen(t * d));
        let (full, _) = attention(&q, &k, &v, d, h, 0, &Bugs::default());
        let chunk = t / sp;
        for c in 0..sp {
            let qc = &q[c * chunk * d..(c + 1) * chunk * d];
            let (part, _) = attention(qc, &k, &v, d, h, c * chunk, bugs);
            let want = &full[c * chunk * d..(c + 1) * chunk * d];
            let err = crate::tensor::rel_err(&part, want, 1e-30);
            if err > 1e-12 {
                return Err(format!(
                    "SP chunk {c} differs from full attention (relative error {err:.3e})"
                ));
            }
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
        let (d, h) = (8, 2);
        let mut rng = Rng::new(3);
        // Full sequence (offset 0) and a chunk of 3 queries at offset 4 over 8 keys.
        for (tq, tk, off) in [(5usize, 5usize, 0usize), (3, 8, 4)] {
            let q = rand_vec(&mut rng, tq * d, 1.0);
            let k = rand_vec(&mut rng, tk * d, 1.0);
            let v = rand_vec(&mut rng, tk * d, 1.0);
            let r = rand_vec(&mut rng, tq * d, 1.0);
            let b = Bugs::default();
            let (_, p) = attention(&q, &k, &v, d, h, off, &b);
            let (dq, dk, dv) = attention_backward(&r, &q, &k, &v, &p, d, h);
            let nq = fd(
                &mut |x| dot(&attention(x, &k, &v, d, h, off, &b).0, &r),
                &q,
                &all(q.len()),
            );
            let nk = fd(
                &mut |x| dot(&attention(&q, x, &v, d, h, off, &b).0, &r),
                &k,
                &all(k.len()),
            );
            let nv = fd(
                &mut |x| dot(&attention(&q, &k, x, d, h, off, &b).0, &r),
                &v,
                &all(v.len()),
            );
            check("attention dq", &dq, &nq);
            check("attention dk", &dk, &nk);
            check("attention dv", &dv, &nv);
            // Causality: keys after the last visible position get no gradient.
            for j in (off + tq).min(tk)..tk {
                assert!(dk[j * d..(j + 1) * d].iter().all(|x| *x == 0.0));
            }
        }
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
        let mut checked = 0;
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
            checked += 1;
        }
        assert!(checked >= 10, "only {checked} tensors checked");
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
        assert_eq!(q.layers[0].wq, p.layers[0].wq);
    }
}
