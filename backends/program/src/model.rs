//! The model a program set belongs to: its sizes and hyper-parameters ([`ModelConfig`]),
//! which every backend builds the same network from, and the two scopes of its gradients
//! ([`Scope`]). The network itself (kernels, forward, B, W) is each backend's; the CPU
//! backend's `model` module documents the architecture and the formulas.

use serde::{Deserialize, Serialize};

/// Deliberately wrong behaviours, each one a silent failure that a test must catch. All
/// `false` in real runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bugs {
    /// The causal mask compares a query's *local* index (in its sequence-parallel chunk)
    /// with global key positions, instead of its global position.
    pub local_causal_mask: bool,
    /// Gates are a softmax over all experts' logits, taken at the selected experts, instead
    /// of the sigmoid scores normalized over the selected experts.
    pub softmax_gates: bool,
    /// The load EMA starts at 0 instead of the uniform `1/E`.
    pub ema_init_zero: bool,
    /// The bias update is applied after the next routing instead of before it.
    pub bias_update_after_routing: bool,
    /// Assignments over capacity are dropped instead of re-routed.
    pub drop_overflow: bool,
    /// The decoupled RoPE key `k_pe` is computed per head (a `d x (H d_h^R)` projection,
    /// `H` RoPE keys per token) instead of once per token and shared by every head
    /// (DeepSeek-V3 eq. 3-4). It trains, and every schedule still equals sequential
    /// training, but the model learns `H` redundant position keys and the SP group gathers
    /// `H` times the RoPE key.
    #[serde(default)]
    pub per_head_kpe: bool,
    /// With Megatron sequence parallelism inside the TP group, a member rotates its
    /// shard's RoPE keys at the chunk's first positions instead of the shard's own (the
    /// shard's offset `tp_rank * T/(sp tp)` missed): every member but the first attends
    /// with keys at the wrong positions.
    #[serde(default)]
    pub shard_positions_from_zero: bool,
    /// With several sequences per micro-batch, attention is causal over the micro-batch's
    /// `B T` rows as one stream instead of within each sequence: a query sees every token of
    /// the sequences before its own (no block-diagonal mask).
    #[serde(default)]
    pub cross_sequence_attention: bool,
}

fn one() -> usize {
    1
}

fn is_one(x: &usize) -> bool {
    *x == 1
}

impl Bugs {
    /// True if no bug is switched on.
    pub fn none(&self) -> bool {
        *self == Bugs::default()
    }
}

/// Group-limited routing (DeepSeek-V3's node-limited routing, arXiv 2412.19437 §2.1.2
/// and §3.2.2): the `E` routed experts form `groups` equal contiguous groups (expert `x` is
/// in group `x / (E / groups)`; with the groups placed one per node, each token's experts
/// sit on at most `max` nodes), and each token first picks the `max` groups whose best
/// `max(1, k / max)` selection scores (`s + bias`) sum highest (ties to the lower group),
/// then its top-k among their experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLimit {
    /// Expert groups `G` (the nodes the EP group spans, for node-limited routing).
    pub groups: usize,
    /// Groups a token's experts may come from, `M` (`1..=G`).
    pub max: usize,
}

/// The model's sizes and hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size (256 for the byte tokenizer).
    pub vocab: usize,
    /// Hidden size `d`.
    pub hidden: usize,
    /// Attention heads `H`.
    pub heads: usize,
    /// Query compression rank `d_c'`: `c_Q = RMSNorm(h W_DQ)` has this width (DeepSeek-V3:
    /// 1536).
    pub q_lora_rank: usize,
    /// Key/value compression rank `d_c`: the latent `c_KV = RMSNorm(h W_DKV)` that the SP
    /// group gathers has this width (DeepSeek-V3: 512).
    pub kv_lora_rank: usize,
    /// Per-head width `d_h` of the content parts of queries and keys (DeepSeek-V3: 128).
    pub qk_nope_head_dim: usize,
    /// Width `d_h^R` of the decoupled RoPE key and of each head's RoPE query part; even
    /// (DeepSeek-V3: 64).
    pub qk_rope_head_dim: usize,
    /// Per-head value width (DeepSeek-V3: 128).
    pub v_head_dim: usize,
    /// Tokens per sequence `T`.
    pub seq_len: usize,
    /// Sequences per micro-batch `B` (`--micro-batch-size`): a micro-batch is `B T` token
    /// rows, sequence `b` at rows `b T..(b + 1) T`; attention is causal within each
    /// sequence and RoPE positions restart at 0 for each.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub micro_batch_size: usize,
    /// Transformer layers in each model stage.
    pub layers_per_stage: usize,
    /// Routed experts per layer `E`.
    pub experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// Expert hidden size `f`.
    pub expert_hidden: usize,
    /// Whether each layer has a shared expert (applied to every token).
    pub shared_expert: bool,
    /// Expert capacity factor; `None`: unlimited.
    pub capacity_factor: Option<f64>,
    /// RoPE base (10000 in the paper).
    pub rope_base: f64,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// Bias update speed `gamma` of aux-loss-free balancing.
    pub bias_rate: f64,
    /// Load EMA decay `beta`.
    pub ema_decay: f64,
    /// Seed of the weight initialization.
    pub seed: u64,
    /// Group-limited (node-limited) routing; `None`: every token may pick any expert.
    /// Under a capacity factor an assignment that finds every expert of its groups full is
    /// re-routed to the best expert with room outside them (never dropped), so capacity can
    /// break the limit; without one it always holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_limit: Option<GroupLimit>,
    /// Injected bugs (tests only).
    #[serde(default, skip_serializing_if = "Bugs::none")]
    pub bugs: Bugs,
}

impl ModelConfig {
    /// The tiny model of the tests: `d = 16`, 2 heads (MLA: `d_c' = 12`, `d_c = 8`,
    /// `d_h = 8`, `d_h^R = 4`, `d_v = 8`), 4 experts (top-2, hidden 16), a shared expert,
    /// capacity factor 1.0, `T = 8`, one layer per stage, vocabulary 128 (ASCII bytes).
    pub fn tiny() -> Self {
        ModelConfig {
            vocab: 128,
            hidden: 16,
            heads: 2,
            q_lora_rank: 12,
            kv_lora_rank: 8,
            qk_nope_head_dim: 8,
            qk_rope_head_dim: 4,
            v_head_dim: 8,
            seq_len: 8,
            micro_batch_size: 1,
            layers_per_stage: 1,
            experts: 4,
            top_k: 2,
            expert_hidden: 16,
            shared_expert: true,
            capacity_factor: Some(1.0),
            rope_base: 10000.0,
            norm_eps: 1e-6,
            bias_rate: 1e-3,
            ema_decay: 0.9,
            seed: 1234,
            group_limit: None,
            bugs: Bugs::default(),
        }
    }

    /// The model of `schedc run` by default: `d = 32`, 4 heads (MLA: `d_c' = 24`,
    /// `d_c = 16`, `d_h = 8`, `d_h^R = 8`, `d_v = 8`: the SP group gathers 24 values per
    /// token instead of the 64 of keys and values), 4 experts (top-2, hidden 32), a shared
    /// expert, capacity 1.25, `T = 32`, one layer per stage, vocabulary 256 (bytes).
    /// `d_h^R = d_h` rather than V3's `d_h / 2`: with 4 RoPE dimensions (two frequencies)
    /// the byte model learned visibly slower (mean loss of the last 20 of the README's 200
    /// steps 2.385 against 2.309 with 8).
    pub fn small() -> Self {
        ModelConfig {
            vocab: 256,
            hidden: 32,
            heads: 4,
            q_lora_rank: 24,
            kv_lora_rank: 16,
            qk_rope_head_dim: 8,
            seq_len: 32,
            expert_hidden: 32,
            capacity_factor: Some(1.25),
            ..ModelConfig::tiny()
        }
    }

    /// Token rows of one micro-batch, `B T` ([`Self::micro_batch_size`] sequences of
    /// [`Self::seq_len`]).
    pub fn micro_batch_tokens(&self) -> usize {
        self.micro_batch_size.saturating_mul(self.seq_len)
    }

    /// RoPE keys per token: 1 (MLA's shared `k_pe`), `H` under [`Bugs::per_head_kpe`].
    pub fn rope_keys_per_token(&self) -> usize {
        if self.bugs.per_head_kpe {
            self.heads
        } else {
            1
        }
    }

    /// Values per token that the SP group gathers in each layer: the latent `c_KV` and the
    /// RoPE key, `d_c + d_h^R` (DeepSeek-V2, arXiv 2405.04434, Table 1: MLA's KV cache per
    /// token and layer); `d_c + H d_h^R` under [`Bugs::per_head_kpe`].
    pub fn kv_gather_width(&self) -> usize {
        self.kv_lora_rank + self.rope_keys_per_token() * self.qk_rope_head_dim
    }

    /// Checks the sizes. Errors: a zero size, an odd RoPE dimension, `k` outside `1..=E`, a
    /// non-positive capacity factor.
    pub fn validate(&self) -> Result<(), String> {
        for (n, v) in [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("seq_len", self.seq_len),
            ("micro_batch_size", self.micro_batch_size),
            ("layers_per_stage", self.layers_per_stage),
            ("experts", self.experts),
            ("top_k", self.top_k),
            ("expert_hidden", self.expert_hidden),
        ] {
            if v == 0 {
                return Err(format!("model: {n} must be at least 1"));
            }
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(format!(
                "model: RoPE needs an even qk_rope_head_dim, got {}",
                self.qk_rope_head_dim
            ));
        }
        if self.top_k > self.experts {
            return Err(format!(
                "model: top_k = {} exceeds the {} experts",
                self.top_k, self.experts
            ));
        }
        if let Some(cf) = self.capacity_factor {
            if cf.is_nan() || cf <= 0.0 {
                return Err(format!("model: capacity factor must be positive, got {cf}"));
            }
        }
        if let Some(GroupLimit { groups, max }) = self.group_limit {
            if groups == 0 || !self.experts.is_multiple_of(groups) {
                return Err(format!(
                    "model: the {} experts do not split into {groups} equal routing groups",
                    self.experts
                ));
            }
            if max == 0 || max > groups {
                return Err(format!(
                    "model: a token's experts must come from 1 to {groups} groups, got {max}"
                ));
            }
            if max * (self.experts / groups) < self.top_k {
                return Err(format!(
                    "model: {max} group(s) of {} experts hold fewer than top_k = {} experts",
                    self.experts / groups,
                    self.top_k
                ));
            }
        }
        Ok(())
    }

    /// The expert groups token `scores` (`s + bias`, one per expert) may route to under
    /// [`ModelConfig::group_limit`], as a mask over the experts (all true without one).
    pub fn allowed_experts<T: Copy + PartialOrd + std::ops::Add<Output = T>>(
        &self,
        scores: &[T],
    ) -> Vec<bool> {
        let e = self.experts;
        let Some(GroupLimit { groups, max }) = self.group_limit else {
            return vec![true; e];
        };
        let per = e / groups;
        let best = (self.top_k / max).clamp(1, per);
        let desc = |a: &T, b: &T| b.partial_cmp(a).unwrap_or(std::cmp::Ordering::Equal);
        // Per group, the sum of its `best` highest scores.
        let sums: Vec<T> = (0..groups)
            .map(|g| {
                let mut v = scores[g * per..(g + 1) * per].to_vec();
                v.sort_by(desc);
                let mut acc = v[0];
                for x in &v[1..best] {
                    acc = acc + *x;
                }
                acc
            })
            .collect();
        let mut order: Vec<usize> = (0..groups).collect();
        order.sort_by(|&a, &b| desc(&sums[a], &sums[b]).then(a.cmp(&b)));
        let mut mask = vec![false; e];
        for &g in &order[..max] {
            mask[g * per..(g + 1) * per].fill(true);
        }
        mask
    }

    /// The capacity of one expert for a routing group of `t` tokens (see the module docs);
    /// `usize::MAX` without a capacity factor.
    pub fn capacity(&self, t: usize) -> usize {
        let Some(cf) = self.capacity_factor else {
            return usize::MAX;
        };
        let (e, k) = (self.experts, self.top_k);
        let a = (cf * (t * k) as f64 / e as f64).ceil() as usize;
        let b = (t * k).div_ceil(e - k + 1);
        if self.bugs.drop_overflow {
            a
        } else {
            a.max(b)
        }
    }
}

/// Which replicas hold a parameter: all data-parallel ranks (dense) or only those with the
/// same experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Non-expert parameters (and the router's load counts).
    Dense,
    /// Routed experts' parameters.
    Expert,
}

/// The DeepSeek-V3-style model `schedc run --model` trains, from a model architecture (a
/// Hugging Face `config.json` or a preset, read by [`schedc::costmodel::arch::resolve`]).
#[derive(Clone, Debug, PartialEq)]
pub struct FromArch {
    /// The executors' model.
    pub model: ModelConfig,
    /// What the executors run differently from the config (dense layers run as MoE layers,
    /// layers rounded up to a multiple of the stages, several shared experts as one), one
    /// sentence each, for the user.
    pub notes: Vec<String>,
}

impl ModelConfig {
    /// The executors' model for `arch` at `seq_len` tokens per sequence, with its layers
    /// spread over `model_stages` stages (each gets `ceil(layers / model_stages)`; the
    /// executors give every stage the same number). Everything `arch` does not say (the
    /// capacity factor, RoPE base, norm epsilon, balancing rates, seed) is
    /// [`ModelConfig::small`]'s.
    ///
    /// Errors: an architecture the executors do not build: not MLA (Llama, Qwen, Mixtral),
    /// MLA without query compression (`q_lora_rank` absent, DeepSeek-V2-Lite), no routed
    /// experts; a zero `seq_len` or `model_stages`; an odd `qk_rope_head_dim`.
    pub fn from_arch(
        arch: &schedc::costmodel::arch::Arch,
        seq_len: usize,
        model_stages: usize,
    ) -> Result<FromArch, String> {
        use schedc::costmodel::arch::Attention;
        let name = &arch.name;
        let Attention::Mla {
            heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        } = arch.attention
        else {
            return Err(format!(
                "`{name}` (model_type `{}`) has grouped-query attention: the executors train DeepSeek-V3-style models (multi-head latent attention and routed experts); give a deepseek_v2/deepseek_v3 config.json or the preset dsv3",
                arch.family
            ));
        };
        let Some(q_lora_rank) = q_lora_rank else {
            return Err(format!(
                "`{name}` has no `q_lora_rank` (a full query projection, as DeepSeek-V2-Lite): the executors' MLA compresses the queries; give the config a `q_lora_rank`"
            ));
        };
        let Some(moe) = &arch.moe else {
            return Err(format!(
                "`{name}` has no routed experts (`n_routed_experts`): the executors train MoE models"
            ));
        };
        if seq_len == 0 {
            return Err("--seq must be at least 1".into());
        }
        if model_stages == 0 {
            return Err("the schedule has no stage".into());
        }
        let layers = arch.layers() as usize;
        let per = layers.div_ceil(model_stages);
        let mut notes = Vec::new();
        if per * model_stages != layers {
            notes.push(format!(
                "`{name}` has {layers} layers; the executors give each of the {model_stages} stages {per} ({} in all)",
                per * model_stages
            ));
        }
        let dense = arch.moe_layers.iter().filter(|m| !**m).count();
        if dense > 0 {
            notes.push(format!(
                "its {dense} dense layer(s) (`first_k_dense_replace`, `moe_layer_freq`) run as MoE layers: every executor layer is MLA + routed experts"
            ));
        }
        if moe.shared_ffn > moe.expert_ffn {
            notes.push(format!(
                "its shared experts ({} units in all) run as one shared expert of {} units",
                moe.shared_ffn, moe.expert_ffn
            ));
        }
        let u = |x: u64| x as usize;
        let model = ModelConfig {
            vocab: u(arch.vocab),
            hidden: u(arch.hidden),
            heads: u(heads),
            q_lora_rank: u(q_lora_rank),
            kv_lora_rank: u(kv_lora_rank),
            qk_nope_head_dim: u(qk_nope_head_dim),
            qk_rope_head_dim: u(qk_rope_head_dim),
            v_head_dim: u(v_head_dim),
            seq_len,
            layers_per_stage: per,
            experts: u(moe.experts),
            top_k: u(moe.top_k),
            expert_hidden: u(moe.expert_ffn),
            shared_expert: moe.shared_ffn > 0,
            ..ModelConfig::small()
        };
        model.validate().map_err(|e| format!("`{name}`: {e}"))?;
        Ok(FromArch { model, notes })
    }

    /// Parameters of one stage copy, elements: the stage's layers with `local_experts`
    /// routed experts each, the embedding if `first`, the final norm and the head if
    /// `last`, on one member of a TP group of `tp` (which holds `1/tp` of the heads' up- and
    /// output projections and of the shared expert). Equals the length of the executors'
    /// flattened parameters.
    pub fn stage_params(&self, first: bool, last: bool, local_experts: usize, tp: usize) -> u64 {
        let tp = tp.max(1) as u64;
        let u = |x: usize| x as u64;
        let (d, v, e, f) = (
            u(self.hidden),
            u(self.vocab),
            u(self.experts),
            u(self.expert_hidden),
        );
        let (qr, kvr, h) = (u(self.q_lora_rank), u(self.kv_lora_rank), u(self.heads));
        let (dn, dr, dv) = (
            u(self.qk_nope_head_dim),
            u(self.qk_rope_head_dim),
            u(self.v_head_dim),
        );
        let kpe = u(self.rope_keys_per_token()) * dr;
        let split = qr * h * dn + qr * h * dr + kvr * h * dn + kvr * h * dv + h * dv * d;
        let shared = if self.shared_expert { 3 * d * f } else { 0 };
        let layer = 2 * d
            + d * qr
            + qr
            + d * kvr
            + kvr
            + d * kpe
            + d * e
            + (split + shared) / tp
            + u(local_experts) * 3 * d * f;
        let mut n = u(self.layers_per_stage) * layer;
        if first {
            n += v * d;
        }
        if last {
            n += d + d * v;
        }
        n
    }

    /// Elements one layer keeps per token of a micro-batch from its forward to its
    /// backward on the CPU backend, an upper estimate: the layer's inputs and norms, the
    /// compressed and up-projected queries, keys and values (keys and values over `tk`
    /// gathered positions), the attention probabilities (`H/tp x tk` per query: the CPU
    /// backend materializes them), the router's scores, and each of the `k` selected
    /// experts' input, three hidden rows and output, and the shared expert's.
    pub fn stash_elems_per_token(&self, tk: usize, tp: usize) -> u64 {
        let u = |x: usize| x as u64;
        let (d, f, e, k) = (
            u(self.hidden),
            u(self.expert_hidden),
            u(self.experts),
            u(self.top_k),
        );
        let h = u(self.heads / tp.max(1)).max(1);
        let (dn, dr, dv) = (
            u(self.qk_nope_head_dim),
            u(self.qk_rope_head_dim),
            u(self.v_head_dim),
        );
        let qk = h * (dn + dr);
        6 * d
            + 2 * u(self.q_lora_rank)
            + 2 * u(self.kv_lora_rank)
            + dr
            + 2 * qk
            + 2 * h * dv
            + h * u(tk)
            + 2 * e
            + k * (2 * d + 3 * f)
            + 3 * f
    }
}
