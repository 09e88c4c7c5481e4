//! Model architectures: a Hugging Face `config.json` (the Llama, Qwen2/Qwen3, Qwen3-MoE,
//! Mixtral and DeepSeek-V2/V3 families) or a preset name, reduced to what the cost model
//! needs: per layer, the attention's and the feed-forward's weight shapes.
//!
//! Sizes are element counts; parameters are counted exactly from the shapes (biases and
//! norm weights included where the family has them), so the preset totals can be checked
//! against the published ones (`dsv3`: 671 B without the multi-token-prediction module,
//! DeepSeek-V3 technical report, arXiv 2412.19437, §4.2).

use serde_json::Value;

/// The attention of every layer.
#[derive(Clone, Debug, PartialEq)]
pub enum Attention {
    /// Multi-head or grouped-query attention (Llama, Qwen): `heads` query heads and
    /// `kv_heads` key/value heads of `head_dim` each.
    Gqa {
        /// Query heads.
        heads: u64,
        /// Key/value heads (GQA groups; `heads` for MHA).
        kv_heads: u64,
        /// Dimension of one head.
        head_dim: u64,
        /// Whether the q, k, v projections have biases (Qwen2).
        qkv_bias: bool,
    },
    /// Multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434 §2.1): queries through
    /// an optional low-rank `q_lora_rank`, keys and values through a shared latent of
    /// `kv_lora_rank` plus a decoupled RoPE key of `qk_rope_head_dim` shared by the heads.
    Mla {
        /// Attention heads.
        heads: u64,
        /// Query compression rank (`None`: a full query projection, DeepSeek-V2-Lite).
        q_lora_rank: Option<u64>,
        /// Key-value compression rank.
        kv_lora_rank: u64,
        /// Per-head query/key dimension without position.
        qk_nope_head_dim: u64,
        /// Per-head query/key RoPE dimension (the key part is shared by the heads).
        qk_rope_head_dim: u64,
        /// Per-head value dimension.
        v_head_dim: u64,
    },
}

impl Attention {
    /// Query heads.
    pub fn heads(&self) -> u64 {
        match self {
            Attention::Gqa { heads, .. } | Attention::Mla { heads, .. } => *heads,
        }
    }

    /// Key/value heads that tensor parallelism splits (MLA: every head has its own keys and
    /// values after the up-projection).
    pub fn kv_heads(&self) -> u64 {
        match self {
            Attention::Gqa { kv_heads, .. } => *kv_heads,
            Attention::Mla { heads, .. } => *heads,
        }
    }

    /// `(query/key dimension, value dimension)` per head, as the attention core sees them.
    pub fn core_dims(&self) -> (u64, u64) {
        match self {
            Attention::Gqa { head_dim, .. } => (*head_dim, *head_dim),
            Attention::Mla {
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                ..
            } => (qk_nope_head_dim + qk_rope_head_dim, *v_head_dim),
        }
    }

    /// The weight matrices `(rows, cols)` of one layer's attention (each a GEMM of the
    /// forward: tokens x rows -> tokens x cols), in order.
    pub fn matrices(&self, hidden: u64) -> Vec<(u64, u64)> {
        match *self {
            Attention::Gqa {
                heads,
                kv_heads,
                head_dim,
                ..
            } => vec![
                (hidden, heads * head_dim),
                (hidden, 2 * kv_heads * head_dim),
                (heads * head_dim, hidden),
            ],
            Attention::Mla {
                heads,
                q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
            } => {
                let q = heads * (qk_nope_head_dim + qk_rope_head_dim);
                let mut m = match q_lora_rank {
                    Some(r) => vec![(hidden, r), (r, q)],
                    None => vec![(hidden, q)],
                };
                m.push((hidden, kv_lora_rank + qk_rope_head_dim));
                m.push((kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim)));
                m.push((heads * v_head_dim, hidden));
                m
            }
        }
    }

    /// Parameters of one layer's attention besides its matrices: biases and the
    /// compression norms (MLA), elements.
    pub fn extra_params(&self) -> u64 {
        match *self {
            Attention::Gqa {
                heads,
                kv_heads,
                head_dim,
                qkv_bias,
            } => {
                if qkv_bias {
                    (heads + 2 * kv_heads) * head_dim
                } else {
                    0
                }
            }
            Attention::Mla {
                q_lora_rank,
                kv_lora_rank,
                ..
            } => q_lora_rank.unwrap_or(0) + kv_lora_rank,
        }
    }
}

/// The routed experts of an MoE model.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeArch {
    /// Routed experts per MoE layer.
    pub experts: u64,
    /// Experts each token is routed to.
    pub top_k: u64,
    /// Intermediate size of one routed expert (SwiGLU: three matrices).
    pub expert_ffn: u64,
    /// Intermediate size of the shared experts together (0: none).
    pub shared_ffn: u64,
    /// Node-limited routing: a token goes to experts on at most this many nodes
    /// (DeepSeek-V3's `topk_group`, 4; `None`: unlimited).
    pub max_nodes: Option<u64>,
}

/// A model architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct Arch {
    /// Display name.
    pub name: String,
    /// The `model_type` of its config (`llama`, `qwen3_moe`, `deepseek_v3`, ...).
    pub family: String,
    /// Hidden size.
    pub hidden: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Input embedding and output head share one matrix.
    pub tied_embeddings: bool,
    /// Attention (the same in every layer).
    pub attention: Attention,
    /// Intermediate size of a dense layer's SwiGLU MLP (three matrices).
    pub ffn: u64,
    /// The routed experts, for an MoE model.
    pub moe: Option<MoeArch>,
    /// For each transformer layer, whether its feed-forward is MoE (`false`: dense).
    pub moe_layers: Vec<bool>,
    /// Multi-token-prediction modules (`num_nextn_predict_layers`, DeepSeek-V3 §2.2): what a
    /// layout's `m` may place.
    pub mtp_layers: u32,
}

impl Arch {
    /// Transformer layers.
    pub fn layers(&self) -> u32 {
        self.moe_layers.len() as u32
    }

    /// Parameters of transformer layer `i`, elements: attention, its feed-forward (every
    /// routed expert for an MoE layer) and two RMSNorm weights.
    pub fn layer_params(&self, i: usize) -> u64 {
        let h = self.hidden;
        let attn: u64 = self
            .attention
            .matrices(h)
            .iter()
            .map(|(a, b)| a * b)
            .sum::<u64>()
            + self.attention.extra_params();
        attn + self.ffn_params(i) + 2 * h
    }

    /// Feed-forward parameters of layer `i`: `(routed experts, the rest)`.
    pub fn ffn_split(&self, i: usize) -> (u64, u64) {
        let h = self.hidden;
        match (&self.moe, self.moe_layers.get(i).copied().unwrap_or(false)) {
            (Some(m), true) => (
                m.experts * 3 * h * m.expert_ffn,
                3 * h * m.shared_ffn + h * m.experts,
            ),
            _ => (0, 3 * h * self.ffn),
        }
    }

    fn ffn_params(&self, i: usize) -> u64 {
        let (e, r) = self.ffn_split(i);
        e + r
    }

    /// Parameters of the input embedding (`vocab x hidden`).
    pub fn embedding_params(&self) -> u64 {
        self.vocab * self.hidden
    }

    /// Parameters of the output head with its final norm (the head matrix is 0 when tied to
    /// the embedding; it still costs its GEMM).
    pub fn head_params(&self) -> u64 {
        self.hidden
            + if self.tied_embeddings {
                0
            } else {
                self.vocab * self.hidden
            }
    }

    /// Every parameter, elements.
    pub fn total_params(&self) -> u64 {
        (0..self.moe_layers.len())
            .map(|i| self.layer_params(i))
            .sum::<u64>()
            + self.embedding_params()
            + self.head_params()
    }

    /// Parameters one token uses (top-k of the routed experts), elements.
    pub fn active_params(&self) -> u64 {
        let mut t = self.total_params();
        if let Some(m) = &self.moe {
            let moe_layers = self.moe_layers.iter().filter(|&&x| x).count() as u64;
            t -= moe_layers * (m.experts - m.top_k) * 3 * self.hidden * m.expert_ffn;
        }
        t
    }

    /// Routed-expert parameters, elements.
    pub fn expert_params(&self) -> u64 {
        (0..self.moe_layers.len())
            .map(|i| self.ffn_split(i).0)
            .sum()
    }
}

/// The preset names, for help texts and errors.
pub const PRESETS: &[&str] = &[
    "dsv3",
    "qwen3-235b-a22b",
    "qwen3-30b-a3b",
    "llama3-8b",
    "llama3-70b",
    "dense70b",
    "zb-6.2b",
];

/// A preset by name (`dsv3`, `qwen3-235b-a22b`, `qwen3-30b-a3b`, `llama3-8b`, `llama3-70b`,
/// `dense70b` (= `llama3-70b`), `zb-6.2b`), each the published `config.json` of the model
/// (the fields the cost model reads), or `None`.
pub fn preset(name: &str) -> Option<Arch> {
    let json = match name {
        // deepseek-ai/DeepSeek-V3, config.json.
        "dsv3" | "deepseek-v3" => {
            r#"{"model_type":"deepseek_v3","hidden_size":7168,"num_hidden_layers":61,
            "intermediate_size":18432,"moe_intermediate_size":2048,"n_routed_experts":256,
            "n_shared_experts":1,"num_experts_per_tok":8,"first_k_dense_replace":3,
            "moe_layer_freq":1,"q_lora_rank":1536,"kv_lora_rank":512,"qk_nope_head_dim":128,
            "qk_rope_head_dim":64,"v_head_dim":128,"num_attention_heads":128,
            "vocab_size":129280,"tie_word_embeddings":false,"n_group":8,"topk_group":4,
            "num_nextn_predict_layers":1}"#
        }
        // Qwen/Qwen3-235B-A22B, config.json.
        "qwen3-235b-a22b" => {
            r#"{"model_type":"qwen3_moe","hidden_size":4096,"num_hidden_layers":94,
            "num_attention_heads":64,"num_key_value_heads":4,"head_dim":128,
            "intermediate_size":12288,"moe_intermediate_size":1536,"num_experts":128,
            "num_experts_per_tok":8,"decoder_sparse_step":1,"mlp_only_layers":[],
            "vocab_size":151936,"tie_word_embeddings":false}"#
        }
        // Qwen/Qwen3-30B-A3B, config.json.
        "qwen3-30b-a3b" => {
            r#"{"model_type":"qwen3_moe","hidden_size":2048,"num_hidden_layers":48,
            "num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,
            "intermediate_size":6144,"moe_intermediate_size":768,"num_experts":128,
            "num_experts_per_tok":8,"decoder_sparse_step":1,"mlp_only_layers":[],
            "vocab_size":151936,"tie_word_embeddings":false}"#
        }
        // meta-llama/Meta-Llama-3-8B, config.json.
        "llama3-8b" => {
            r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":14336,
            "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
            "vocab_size":128256,"tie_word_embeddings":false}"#
        }
        // meta-llama/Meta-Llama-3-70B, config.json.
        "llama3-70b" | "dense70b" | "llama70b" => {
            r#"{"model_type":"llama","hidden_size":8192,"intermediate_size":28672,
            "num_hidden_layers":80,"num_attention_heads":64,"num_key_value_heads":8,
            "vocab_size":128256,"tie_word_embeddings":false}"#
        }
        // The Zero Bubble paper's 6.2B model (arXiv 2401.10241, Table 3: 30 layers, 32
        // heads, hidden 4096), a GPT with a 4h MLP, written as a Llama-style config: the
        // MLP's 2 matrices of 4h become SwiGLU's 3 of 8h/3 (the same parameters and FLOPs).
        "zb-6.2b" => {
            r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":10923,
            "num_hidden_layers":30,"num_attention_heads":32,"num_key_value_heads":32,
            "vocab_size":50304,"tie_word_embeddings":false}"#
        }
        _ => return None,
    };
    let v: Value = serde_json::from_str(json).expect("preset JSON");
    let mut a = from_config(&v, name).expect("preset config");
    a.name = name.to_string();
    Some(a)
}

/// Reads a Hugging Face `config.json` already parsed as JSON; `source` names it in errors.
///
/// Families (`model_type`): `llama`, `mistral`, `qwen2`, `qwen3` (dense, GQA, SwiGLU),
/// `qwen3_moe` (`num_experts`, `mlp_only_layers`, `decoder_sparse_step`), `mixtral`
/// (`num_local_experts`), `deepseek_v2` / `deepseek_v3` (MLA, `first_k_dense_replace`,
/// `moe_layer_freq`, shared experts, `topk_group` as node-limited routing).
///
/// Errors: an unknown `model_type` (the supported ones listed), a missing or mistyped field
/// (named, with the family that needs it), a value that is 0 where it cannot be, or
/// inconsistent sizes (`num_key_value_heads` not dividing the heads, top-k above the
/// experts, an `mlp_only_layers` index past the layers).
pub fn from_config(v: &Value, source: &str) -> Result<Arch, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("{source}: a config.json is a JSON object"))?;
    let family = obj
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{source}: missing field `model_type` (a string such as \"llama\" or \"deepseek_v3\")"))?
        .to_string();
    let known = [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "mixtral",
        "deepseek_v2",
        "deepseek_v3",
    ];
    if !known.contains(&family.as_str()) {
        return Err(format!(
            "{source}: unknown architecture `model_type: {family}`: schedc reads {}",
            known.join(", ")
        ));
    }
    let int = |k: &str| -> Result<u64, String> {
        match obj.get(k) {
            None | Some(Value::Null) => Err(format!(
                "{source}: missing field `{k}` (model_type `{family}` needs it)"
            )),
            Some(x) => x.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                format!("{source}: field `{k}` must be a positive integer, got {x}")
            }),
        }
    };
    let opt_int = |k: &str| -> Result<Option<u64>, String> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x.as_u64().map(Some).ok_or_else(|| {
                format!("{source}: field `{k}` must be a non-negative integer, got {x}")
            }),
        }
    };
    let boolean = |k: &str, d: bool| -> Result<bool, String> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(Value::Bool(b)) => Ok(*b),
            Some(x) => Err(format!(
                "{source}: field `{k}` must be true or false, got {x}"
            )),
        }
    };
    let hidden = int("hidden_size")?;
    let layers = int("num_hidden_layers")?;
    let vocab = int("vocab_size")?;
    let heads = int("num_attention_heads")?;
    let tied = boolean("tie_word_embeddings", false)?;
    let deepseek = family.starts_with("deepseek");
    let attention = if deepseek {
        Attention::Mla {
            heads,
            q_lora_rank: opt_int("q_lora_rank")?.filter(|&r| r > 0),
            kv_lora_rank: int("kv_lora_rank")?,
            qk_nope_head_dim: int("qk_nope_head_dim")?,
            qk_rope_head_dim: int("qk_rope_head_dim")?,
            v_head_dim: int("v_head_dim")?,
        }
    } else {
        let kv_heads = opt_int("num_key_value_heads")?.unwrap_or(heads);
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "{source}: `num_key_value_heads` ({kv_heads}) must divide `num_attention_heads` ({heads})"
            ));
        }
        let head_dim = match opt_int("head_dim")? {
            Some(d) if d > 0 => d,
            _ => {
                if !hidden.is_multiple_of(heads) {
                    return Err(format!(
                        "{source}: no `head_dim`, and `hidden_size` ({hidden}) is not a multiple of `num_attention_heads` ({heads})"
                    ));
                }
                hidden / heads
            }
        };
        Attention::Gqa {
            heads,
            kv_heads,
            head_dim,
            qkv_bias: family == "qwen2" || boolean("attention_bias", false)?,
        }
    };
    let n = layers as usize;
    let (ffn, moe, moe_layers) = match family.as_str() {
        "qwen3_moe" => {
            let experts = int("num_experts")?;
            let top_k = int("num_experts_per_tok")?;
            let step = opt_int("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(format!(
                    "{source}: field `decoder_sparse_step` must be at least 1, got 0"
                ));
            }
            let mut dense = vec![false; n];
            if let Some(l) = obj.get("mlp_only_layers") {
                let arr = l.as_array().ok_or_else(|| {
                    format!("{source}: field `mlp_only_layers` must be a list of layer indices")
                })?;
                for x in arr {
                    let i = x.as_u64().ok_or_else(|| {
                        format!("{source}: `mlp_only_layers` holds {x}, not a layer index")
                    })?;
                    if i >= layers {
                        return Err(format!(
                            "{source}: `mlp_only_layers` names layer {i}, but the model has {layers} (0..={})",
                            layers - 1
                        ));
                    }
                    dense[i as usize] = true;
                }
            }
            let ml = (0..n)
                .map(|i| !dense[i] && (i as u64 + 1).is_multiple_of(step))
                .collect();
            let ffn = opt_int("intermediate_size")?.unwrap_or(0);
            (
                ffn,
                Some(MoeArch {
                    experts,
                    top_k,
                    expert_ffn: int("moe_intermediate_size")?,
                    shared_ffn: 0,
                    max_nodes: None,
                }),
                ml,
            )
        }
        "mixtral" => (
            int("intermediate_size")?,
            Some(MoeArch {
                experts: int("num_local_experts")?,
                top_k: int("num_experts_per_tok")?,
                expert_ffn: int("intermediate_size")?,
                shared_ffn: 0,
                max_nodes: None,
            }),
            vec![true; n],
        ),
        "deepseek_v2" | "deepseek_v3" => {
            let experts = opt_int("n_routed_experts")?.unwrap_or(0);
            let first_dense = opt_int("first_k_dense_replace")?.unwrap_or(0);
            if first_dense > layers {
                return Err(format!(
                    "{source}: field `first_k_dense_replace` ({first_dense}) exceeds the {layers} layers"
                ));
            }
            let freq = opt_int("moe_layer_freq")?.unwrap_or(1);
            if freq == 0 {
                return Err(format!(
                    "{source}: field `moe_layer_freq` must be at least 1, got 0"
                ));
            }
            let ffn = int("intermediate_size")?;
            if experts == 0 {
                (ffn, None, vec![false; n])
            } else {
                let expert_ffn = int("moe_intermediate_size")?;
                let shared = opt_int("n_shared_experts")?.unwrap_or(0);
                let ml = (0..n as u64)
                    .map(|i| i >= first_dense && i.is_multiple_of(freq))
                    .collect();
                let groups = opt_int("n_group")?.unwrap_or(1).max(1);
                let topk_group = opt_int("topk_group")?;
                if !experts.is_multiple_of(groups) {
                    return Err(format!(
                        "{source}: field `n_group` ({groups}) does not divide the {experts} routed experts"
                    ));
                }
                if let Some(g) = topk_group {
                    if g == 0 || g > groups {
                        return Err(format!(
                            "{source}: field `topk_group` ({g}) must be in 1..={groups} (`n_group`)"
                        ));
                    }
                }
                (
                    ffn,
                    Some(MoeArch {
                        experts,
                        top_k: int("num_experts_per_tok")?,
                        expert_ffn,
                        shared_ffn: shared * expert_ffn,
                        max_nodes: topk_group.filter(|_| groups > 1),
                    }),
                    ml,
                )
            }
        }
        _ => (int("intermediate_size")?, None, vec![false; n]),
    };
    if let Some(m) = &moe {
        if m.top_k > m.experts {
            return Err(format!(
                "{source}: `num_experts_per_tok` ({}) exceeds the {} routed experts",
                m.top_k, m.experts
            ));
        }
    }
    if moe.is_none() && ffn == 0 {
        return Err(format!(
            "{source}: missing field `intermediate_size` (model_type `{family}` needs it)"
        ));
    }
    let name = obj
        .get("_name_or_path")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| source.to_string());
    let mtp_layers = opt_int("num_nextn_predict_layers")?.unwrap_or(0) as u32;
    Ok(Arch {
        name,
        family,
        hidden,
        vocab,
        tied_embeddings: tied,
        attention,
        ffn,
        moe,
        moe_layers,
        mtp_layers,
    })
}

/// A preset name or a `config.json` path. Errors: an unreadable file, JSON that does not
/// parse (with its line and column), or what [`from_config`] refuses; a name that is
/// neither a preset nor a file lists the presets.
pub fn resolve(spec: &str) -> Result<Arch, String> {
    if let Some(a) = preset(spec) {
        return Ok(a);
    }
    let path = std::path::Path::new(spec);
    if !path.exists() {
        return Err(format!(
            "unknown model `{spec}`: give a Hugging Face config.json or a preset ({})",
            PRESETS.join(", ")
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{spec}`: {e}"))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| format!("{spec}:{}:{}: not JSON: {e}", e.line(), e.column()))?;
    from_config(&v, spec)
}
