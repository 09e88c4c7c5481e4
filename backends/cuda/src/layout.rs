//! Where everything lives in device memory: the sizes the kernels run on ([`Dims`]), the
//! parameters of a stage copy ([`ParamLayout`], the CPU backend's flattening), and the
//! regions of a `stash` buffer ([`StashLayout`]), which holds everything one
//! `(stage, micro-batch)` keeps from its forward to its weight gradient, plus the
//! all-to-all outbox and inbox.
//!
//! All-to-all packets are fixed-size slots: a 16-byte header (the row count), the expert id
//! of each row (dispatch), then the rows. Their size is the bound the routing guarantees
//! (`rmax` rows), so that the host never needs a count from the device: a transport moves
//! whole slots, and the kernels read the counts.

use crate::api::DType;
use schedc_cpu::model::{Scope, StageParams};
use schedc_program::mesh::{Dim, Mesh};
use schedc_program::{LocalStage, ModelConfig};
use std::collections::HashMap;

/// Byte alignment of every region.
pub const ALIGN: usize = 256;

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// The sizes of one rank's kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Storage type.
    pub dtype: DType,
    /// Bytes per element of the storage type.
    pub ts: usize,
    /// Hidden size `d`.
    pub d: usize,
    /// Heads of this member: `H / tp` (Megatron-LM's split of MLA's up-projections and
    /// `W_O`; `H` without tensor parallelism).
    pub heads: usize,
    /// TP group size (1 without tensor parallelism).
    pub tp: usize,
    /// The shared expert's hidden width on this member, `f / tp`.
    pub fs: usize,
    /// Query compression rank `d_c'` (MLA).
    pub qr: usize,
    /// Key/value compression rank `d_c` (MLA).
    pub kvr: usize,
    /// Per-head content width of queries and keys `d_h`.
    pub dn: usize,
    /// RoPE width `d_h^R` (per head for queries; of each RoPE key).
    pub dr: usize,
    /// Per-head value width.
    pub dv: usize,
    /// RoPE keys per token: 1 (MLA's shared key), `H` under the `per_head_kpe` bug.
    pub kph: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Local tokens per micro-batch (`B seq_len / sp`; with Megatron sequence parallelism the
    /// TP member's shard, `seq_len / sp / tp`): one routing group.
    pub t: usize,
    /// Query rows of the attention: the SP chunk, `seq_len / sp` (`t` without Megatron
    /// sequence parallelism; `tp t` with it, the TP group's gathered shards).
    pub tc: usize,
    /// Megatron-LM's sequence parallelism inside the TP group (`--sequence-parallel`).
    pub seq_par: bool,
    /// Where this member's `t` rows start in the chunk (`tp_rank t` with Megatron sequence
    /// parallelism, else 0; 0 under the injected `shard_positions_from_zero` bug).
    pub shard0: usize,
    /// Keys per query (`seq_len`, the gathered sequence; `B seq_len` with `B` sequences per
    /// micro-batch, each query seeing its own sequence's only).
    pub tk: usize,
    /// Sequences per micro-batch `B` (`--micro-batch-size`): `t`, `tc` and `tk` hold `B`
    /// equal row blocks, one per sequence; attention and RoPE run per block.
    pub seqs: usize,
    /// Routed experts `E`.
    pub e: usize,
    /// Experts per token.
    pub k: usize,
    /// Expert hidden size.
    pub f: usize,
    /// EP group size.
    pub ep: usize,
    /// SP group size.
    pub sp: usize,
    /// Experts per EP member.
    pub per: usize,
    /// Expert capacity of one routing group (`i32::MAX` without a capacity factor).
    pub cap: i32,
    /// Rows one source can send one EP member (`min(t min(k, per), per min(t, cap))`).
    pub rmax: usize,
    /// Rows one local expert can receive in all (`ep min(t, cap)`).
    pub cmax: usize,
    /// Layers per stage.
    pub layers: usize,
    /// Each layer has a shared expert.
    pub shared: bool,
    /// Byte offset of the rows in an all-to-all slot.
    pub rows_off: usize,
    /// Bytes of one all-to-all slot.
    pub slot_bytes: usize,
    /// Slots of the outbox and of the inbox (`max(ep, sp)`).
    pub slots: usize,
}

impl Dims {
    /// The sizes for `cfg` on `mesh` in `dtype`. Errors: a sequence that the SP group does
    /// not divide, experts that the EP group does not divide, attention head dimensions over
    /// the attention kernels' tiles (`d_h + d_h^R` over [`crate::model::ATT_MAX_QK`], `d_v`
    /// over [`crate::model::ATT_MAX_V`]).
    pub fn new(cfg: &ModelConfig, mesh: &Mesh, dtype: DType) -> Result<Dims, String> {
        Dims::with_sequence_parallel(cfg, mesh, dtype, None)
    }

    /// [`Dims::new`] for TP member `tp_rank` with Megatron sequence parallelism (`Some`):
    /// the member's rows are its shard of the chunk (`t = seq_len / sp / tp`, from row
    /// `tp_rank t`), which routes alone; the attention's queries are the chunk's (`tc`).
    /// Errors: those of [`Dims::new`], and a chunk the TP group does not divide.
    pub fn with_sequence_parallel(
        cfg: &ModelConfig,
        mesh: &Mesh,
        dtype: DType,
        tp_rank: Option<usize>,
    ) -> Result<Dims, String> {
        cfg.validate()?;
        let ep = mesh.size(Dim::Ep) as usize;
        let sp = mesh.size(Dim::Sp) as usize;
        if !cfg.seq_len.is_multiple_of(sp) {
            return Err(format!(
                "the SP group of {sp} does not divide the sequence of {}",
                cfg.seq_len
            ));
        }
        if !cfg.experts.is_multiple_of(ep) {
            return Err(format!(
                "the EP group of {ep} does not divide the {} experts",
                cfg.experts
            ));
        }
        let tp = mesh.size(Dim::Tp) as usize;
        if !cfg.heads.is_multiple_of(tp) {
            return Err(format!(
                "the TP group of {tp} does not divide the {} heads",
                cfg.heads
            ));
        }
        if !cfg.expert_hidden.is_multiple_of(tp) {
            return Err(format!(
                "the TP group of {tp} does not divide the shared expert's hidden size {}",
                cfg.expert_hidden
            ));
        }
        let (qk, v) = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim);
        if qk > crate::model::ATT_MAX_QK || v > crate::model::ATT_MAX_V {
            return Err(format!(
                "attention head dimensions qk_nope_head_dim {} + qk_rope_head_dim {} = {qk}, v_head_dim {v}: the CUDA attention kernels take at most {} and {}",
                cfg.qk_nope_head_dim,
                cfg.qk_rope_head_dim,
                crate::model::ATT_MAX_QK,
                crate::model::ATT_MAX_V
            ));
        }
        let b = cfg.micro_batch_size;
        let seq_par = tp_rank.is_some() && tp > 1;
        if b > 1 && (sp > 1 || seq_par) {
            return Err(format!(
                "--micro-batch-size {b} with sequence parallelism (sp={sp}, --sequence-parallel: {seq_par}): not supported"
            ));
        }
        let tc = b * (cfg.seq_len / sp);
        if seq_par && !tc.is_multiple_of(tp) {
            return Err(format!(
                "tp={tp} does not divide the {tc} tokens of a sequence chunk (--sequence-parallel shards them over the TP group)"
            ));
        }
        let t = if seq_par { tc / tp } else { tc };
        let shard0 = match tp_rank {
            Some(j) if seq_par && !cfg.bugs.shard_positions_from_zero => j * t,
            _ => 0,
        };
        let per = cfg.experts / ep;
        let k = cfg.top_k;
        let capu = cfg.capacity(t);
        let cmin = t.min(capu);
        let rmax = (t * k.min(per)).min(per * cmin).max(1);
        let cmax = (ep * cmin).max(1);
        let d = cfg.hidden;
        let ts = dtype.size();
        let rows_off = align(16 + 4 * rmax, 16);
        let rows = (rmax * d).max(tc * cfg.kv_gather_width());
        Ok(Dims {
            dtype,
            ts,
            d,
            heads: cfg.heads / tp,
            tp,
            fs: cfg.expert_hidden / tp,
            qr: cfg.q_lora_rank,
            kvr: cfg.kv_lora_rank,
            dn: cfg.qk_nope_head_dim,
            dr: cfg.qk_rope_head_dim,
            dv: cfg.v_head_dim,
            kph: cfg.rope_keys_per_token(),
            vocab: cfg.vocab,
            t,
            tc,
            seq_par,
            shard0,
            tk: b * cfg.seq_len,
            seqs: b,
            e: cfg.experts,
            k,
            f: cfg.expert_hidden,
            ep,
            sp,
            per,
            cap: capu.min(i32::MAX as usize) as i32,
            rmax,
            cmax,
            layers: cfg.layers_per_stage,
            shared: cfg.shared_expert,
            rows_off,
            slot_bytes: align(rows_off + rows * ts, ALIGN),
            slots: ep.max(sp),
        })
    }

    /// Bytes of an activation or gradient message (`t x d` of the storage type).
    pub fn act_bytes(&self) -> usize {
        self.t * self.d * self.ts
    }

    /// Width of one token's RoPE key row, `kph d_h^R`.
    pub fn kw(&self) -> usize {
        self.kph * self.dr
    }

    /// Values per token the SP group gathers: `[c_KV; k^R]`, `d_c + kph d_h^R`.
    pub fn gather_width(&self) -> usize {
        self.kvr + self.kw()
    }
}

/// One tensor of a stage copy's parameters: offsets in elements in the flat parameter
/// vector (`dense` tensors, then `expert` tensors, each in the CPU backend's visit order)
/// and in the gradient vector (the same, with the per-layer load counts after the dense
/// tensors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tensor {
    /// Offset in the parameter vector.
    pub param: usize,
    /// Offset in the gradient vector.
    pub grad: usize,
    /// Elements.
    pub len: usize,
    /// Dense or expert.
    pub scope: Scope,
}

/// The per-layer tensors of a stage, by their name after `layer{g}.`, in the order of
/// [`LayerTensors::by`].
pub const LAYER_TENSORS: [&str; 16] = [
    "norm1",
    "wdq",
    "q_norm",
    "wuq",
    "wqr",
    "wdkv",
    "kv_norm",
    "wkr",
    "wuk",
    "wuv",
    "wo",
    "norm2",
    "router",
    "shared.w1",
    "shared.w3",
    "shared.w2",
];

/// One layer's tensors, resolved at load ([`ParamLayout::resolve`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerTensors {
    /// The layer's global index.
    pub global: usize,
    /// The tensors of [`LAYER_TENSORS`], in its order (`None`: not held, e.g. no shared
    /// expert).
    pub by: [Option<Tensor>; 16],
    /// The first local expert's `w1`, `w3`, `w2` (the others follow at a fixed stride).
    pub expert0: [Option<Tensor>; 3],
}

impl LayerTensors {
    /// The tensor `layer{g}.{name}` for a name of [`LAYER_TENSORS`]: a `match` on the
    /// short name (a length switch and a compare), no formatting, hashing or allocation.
    /// Errors: a name not in the list, or a tensor the stage does not hold.
    pub fn get(&self, name: &str) -> Result<Tensor, String> {
        let k = match name {
            "norm1" => 0,
            "wdq" => 1,
            "q_norm" => 2,
            "wuq" => 3,
            "wqr" => 4,
            "wdkv" => 5,
            "kv_norm" => 6,
            "wkr" => 7,
            "wuk" => 8,
            "wuv" => 9,
            "wo" => 10,
            "norm2" => 11,
            "router" => 12,
            "shared.w1" => 13,
            "shared.w3" => 14,
            "shared.w2" => 15,
            _ => usize::MAX,
        };
        self.by
            .get(k)
            .copied()
            .flatten()
            .ok_or_else(|| format!("the stage has no tensor layer{}.{name}", self.global))
    }
}

/// A stage's tensors resolved once ([`ParamLayout::resolve`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// `embed` (first stage).
    pub embed: Option<Tensor>,
    /// `final_norm` (last stage).
    pub final_norm: Option<Tensor>,
    /// `head` (last stage).
    pub head: Option<Tensor>,
    /// The stage's layers, local index order.
    pub layers: Vec<LayerTensors>,
}

impl Resolved {
    /// A stage-level tensor (`embed`, `final_norm`, `head`). Errors: another name, or one
    /// the stage does not hold.
    pub fn global(&self, name: &str) -> Result<Tensor, String> {
        match name {
            "embed" => self.embed,
            "final_norm" => self.final_norm,
            "head" => self.head,
            _ => None,
        }
        .ok_or_else(|| format!("the stage has no tensor {name}"))
    }
}

/// The parameters of one stage copy, as flat vectors: `[dense | expert]` for the
/// parameters (master copy, compute copy, Adam's moments), `[dense | loads | expert]` for
/// the gradients (`weight_grad`), which is the CPU backend's `Grads::flatten(Dense)`
/// followed by `Grads::flatten(Expert)`, so that an all-reduce of one scope is one
/// contiguous range.
#[derive(Clone, Debug)]
pub struct ParamLayout {
    /// Tensors by global name (`layer3.wq`, `layer3.expert5.w1`, `head`, ...), in order.
    pub tensors: Vec<(String, Tensor)>,
    index: HashMap<String, usize>,
    /// Dense elements.
    pub dense: usize,
    /// Load counts (`layers x E`).
    pub loads: usize,
    /// Expert elements.
    pub expert: usize,
}

impl ParamLayout {
    /// The layout of `p` (any values; only shapes and names are used).
    pub fn of(p: &StageParams<f32>, experts: usize) -> ParamLayout {
        let mut dense = Vec::new();
        let mut expert = Vec::new();
        p.visit(&mut |n, s, t| match s {
            Scope::Dense => dense.push((n.to_string(), t.len())),
            Scope::Expert => expert.push((n.to_string(), t.len())),
        });
        let nd: usize = dense.iter().map(|x| x.1).sum();
        let nloads = p.layers.len() * experts;
        let mut tensors = Vec::new();
        let mut at = 0;
        for (n, len) in dense {
            tensors.push((
                n,
                Tensor {
                    param: at,
                    grad: at,
                    len,
                    scope: Scope::Dense,
                },
            ));
            at += len;
        }
        for (n, len) in expert {
            tensors.push((
                n,
                Tensor {
                    param: at,
                    grad: at + nloads,
                    len,
                    scope: Scope::Expert,
                },
            ));
            at += len;
        }
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.clone(), i))
            .collect();
        ParamLayout {
            tensors,
            index,
            dense: nd,
            loads: nloads,
            expert: at - nd,
        }
    }

    /// Every tensor of the stage resolved once, by position rather than by name
    /// ([`Resolved`]), for the launch sequences (issue 24, item 3: no name formatted or
    /// looked up per instruction). `layers`: the global indices of the stage's layers in
    /// order; `expert_lo`: its first local expert. Tensors the stage does not hold are
    /// `None`.
    pub fn resolve(&self, layers: std::ops::Range<usize>, expert_lo: usize) -> Resolved {
        let get = |n: &str| self.index.get(n).map(|&i| self.tensors[i].1);
        Resolved {
            embed: get("embed"),
            final_norm: get("final_norm"),
            head: get("head"),
            layers: layers
                .map(|g| LayerTensors {
                    global: g,
                    by: std::array::from_fn(|k| get(&format!("layer{g}.{}", LAYER_TENSORS[k]))),
                    expert0: std::array::from_fn(|k| {
                        get(&format!(
                            "layer{g}.expert{expert_lo}.{}",
                            ["w1", "w3", "w2"][k]
                        ))
                    }),
                })
                .collect(),
        }
    }

    /// The tensor named `name`. Errors: no such tensor (a layout that does not match the
    /// stage).
    pub fn get(&self, name: &str) -> Result<Tensor, String> {
        self.index
            .get(name)
            .map(|&i| self.tensors[i].1)
            .ok_or_else(|| format!("the stage has no tensor {name}"))
    }

    /// Parameter elements (`dense + expert`).
    pub fn params(&self) -> usize {
        self.dense + self.expert
    }

    /// Gradient elements (`dense + loads + expert`).
    pub fn grads(&self) -> usize {
        self.dense + self.loads + self.expert
    }

    /// Offset of layer `l`'s load counts in the gradient vector.
    pub fn loads_of(&self, l: usize, experts: usize) -> usize {
        self.dense + l * experts
    }
}

/// A region of a stash: byte offset and size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Region {
    /// Byte offset from the stash's base.
    pub off: usize,
    /// Bytes.
    pub bytes: usize,
}

struct Alloc {
    at: usize,
}

impl Alloc {
    fn take(&mut self, bytes: usize) -> Region {
        let r = Region {
            off: self.at,
            bytes,
        };
        self.at += align(bytes.max(1), ALIGN);
        r
    }
}

/// One layer's regions (T: storage type; f: f32; i: i32). The attention is DeepSeek-V3's
/// multi-head latent attention (the CPU backend's `fwd_qkv` / `fwd_attn`): `H dn` is the
/// width of the content parts of queries and keys, `H dr` of the queries' RoPE parts, `kw`
/// of a token's RoPE key(s), `H dv` of the values.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct LayerRegions {
    // Forward, this rank's tokens.
    pub xin: Region,       // T t x d: the layer input
    pub xhat1: Region,     // T t x d
    pub inv1: Region,      // f t
    pub a: Region,         // T t x d
    pub cq_raw: Region,    // T t x qr: a W_DQ
    pub cq: Region,        // T tc x qr: RMSNorm(a W_DQ; q_norm)
    pub cq_xhat: Region,   // T t x qr
    pub cq_inv: Region,    // f t
    pub q_nope: Region,    // T tc x H dn
    pub q_pe: Region,      // T tc x H dr (rotated)
    pub ckv_raw: Region,   // T t x kvr: a W_DKV
    pub ckv: Region,       // T tc x kvr: RMSNorm(a W_DKV; kv_norm)
    pub ckv_xhat: Region,  // T t x kvr
    pub ckv_inv: Region,   // f t
    pub kpe: Region,       // T tc x kw (rotated)
    pub ckv_all: Region,   // T tk x kvr: the gathered latents
    pub kpe_all: Region,   // T tk x kw: the gathered RoPE keys
    pub k_nope: Region,    // T tk x H dn: c_KV W_UK
    pub v: Region,         // T tk x H dv: c_KV W_UV
    pub lse: Region,       // f H x tc: attention rows' log-sum-exp (no H x t x tk)
    pub o: Region,         // T tc x H dv
    pub h1: Region,        // T t x d
    pub xhat2: Region,     // T t x d
    pub inv2: Region,      // f t
    pub n2: Region,        // T t x d
    pub logits: Region,    // f t x E
    pub s: Region,         // f t x E
    pub softmax: Region,   // f t x E (softmax_gates bug)
    pub experts: Region,   // i t x k
    pub desired: Region,   // i t x k
    pub gates: Region,     // f t x k
    pub z: Region,         // f t
    pub cnt: Region,       // i E
    pub order: Region,     // i t x k
    pub slot_dest: Region, // i t x k
    pub slot_pos: Region,  // i t x k
    pub eo: Region,        // T t x k x d
    pub sh_h1: Region,     // T tc x f
    pub sh_h3: Region,     // T tc x f
    pub sh_act: Region,    // T tc x f
    pub sh_y: Region,      // T tc x d
    // Megatron sequence parallelism (empty without): the TP group's gathered MoE-norm
    // rows (the shared expert's input), `o W_O`'s partial sum before its reduce-scatter,
    // and this member's rows of the shared expert's output after its reduce-scatter.
    pub n2c: Region, // T tc x d
    pub h1c: Region, // T tc x d
    pub ysh: Region, // T t x d
    // Backward.
    pub dgates: Region,   // f t x k
    pub dn2: Region,      // T t x d
    pub sh_da: Region,    // T tc x f
    pub sh_dh1: Region,   // T tc x f
    pub sh_dh3: Region,   // T tc x f
    pub dlr: Region,      // T t x E: router logits' gradient
    pub dh1: Region,      // T t x d
    pub doh: Region,      // T tc x H dv
    pub delta: Region,    // f H x tc: dout . out per attention row
    pub dkp_part: Region, // f H x tk x dr: per-head RoPE key gradients
    pub dq_nope: Region,  // T tc x H dn
    pub dqr: Region,      // T tc x H dr (rotated back)
    pub dk_nope: Region,  // T tk x H dn
    pub dk_pe: Region,    // T tk x kw
    pub dvv: Region,      // T tk x H dv
    pub dckv_all: Region, // T tk x kvr
    pub dckv: Region,     // T tc x kvr: the local chunk's, summed over the SP group
    pub dkr: Region,      // T tc x kw (summed, rotated back)
    pub dckv_raw: Region, // T t x kvr
    pub dcq: Region,      // T tc x qr
    pub dcq_raw: Region,  // T t x qr
    pub da: Region,       // T t x d
    pub dx: Region,       // T t x d: the layer input's gradient
    pub tpg: Region,      // T tc x (qr + kvr + kw): TP, `[dc_Q; dc_KV; dk^R]` to all-reduce
    // Megatron sequence parallelism (empty without): this member's `[c_Q | c_KV | k^R]`
    // for the all-gather and its `[dc_Q | dc_KV | dk^R]` after the reduce-scatter (`tpg`
    // then holds the gathered rows and the partial sums as one such block per shard);
    // the gathered gradients of the layer output and of `h1`, and the shared expert's
    // partial input gradient before its reduce-scatter.
    pub tps: Region,  // T t x (qr + kvr + kw)
    pub dyc: Region,  // T tc x d
    pub dn2c: Region, // T tc x d
    pub dh1c: Region, // T tc x d
    // The expert side (rows received from the EP group).
    pub perm: Region,      // i ep x rmax
    pub ecount: Region,    // i per
    pub src_count: Region, // i ep
    pub xe: Region,        // T per x cmax x d
    pub h1e: Region,       // T per x cmax x f
    pub h3e: Region,       // T per x cmax x f
    pub ae: Region,        // T per x cmax x f
    pub ye: Region,        // T per x cmax x d
    pub dye: Region,       // T per x cmax x d
    pub dae: Region,       // T per x cmax x f
    pub dh1e: Region,      // T per x cmax x f
    pub dh3e: Region,      // T per x cmax x f
    pub dxe: Region,       // T per x cmax x d
}

/// The regions of one stage copy's stash.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct StashLayout {
    pub tokens: Region,  // u32 t
    pub targets: Region, // u32 t
    pub xout: Region,    // T t x d: the stage output
    pub gout: Region,    // T t x d: the stage output's gradient
    // Head (last stage).
    pub xf: Region,      // T t x d
    pub xhatf: Region,   // T t x d
    pub invf: Region,    // f t
    pub logits: Region,  // f t x V
    pub dlogits: Region, // T t x V
    pub dxf: Region,     // T t x d
    pub rowloss: Region, // f t
    pub outbox: Region,  // slots x slot_bytes
    pub inbox: Region,   // slots x slot_bytes
    pub layers: Vec<LayerRegions>,
    /// Total bytes.
    pub bytes: usize,
}

impl StashLayout {
    /// The stash of a stage copy with `dims` (head regions only for the last stage).
    pub fn new(dims: &Dims, stage: &LocalStage) -> StashLayout {
        let mut a = Alloc { at: 0 };
        let (t, d, tk, e, k, f, h) = (dims.t, dims.d, dims.tk, dims.e, dims.k, dims.f, dims.heads);
        // The attention's query rows (the SP chunk; with Megatron sequence parallelism the
        // TP group's gathered shards): `tc = t` without it.
        let tc = dims.tc;
        let (ts, fs, is) = (dims.ts, 4usize, 4usize);
        let act = t * d * ts;
        let v = if stage.last { dims.vocab } else { 0 };
        let tokens = a.take(t * 4);
        let targets = a.take(t * 4);
        let xout = a.take(act);
        let gout = a.take(act);
        let xf = a.take(if stage.last { act } else { 0 });
        let xhatf = a.take(if stage.last { act } else { 0 });
        let invf = a.take(if stage.last { t * fs } else { 0 });
        let logits = a.take(t * v * fs);
        let dlogits = a.take(t * v * ts);
        let dxf = a.take(if stage.last { act } else { 0 });
        let rowloss = a.take(t * fs);
        let outbox = a.take(dims.slots * dims.slot_bytes);
        let inbox = a.take(dims.slots * dims.slot_bytes);
        let fsh = if dims.shared { tc * f * ts } else { 0 };
        // Megatron sequence parallelism's gathered rows and shard outputs (none without).
        let chunk = if dims.seq_par { tc * d * ts } else { 0 };
        let lat = dims.qr + dims.kvr + dims.kw();
        let ex = dims.per * dims.cmax;
        let (qr, kvr, kw) = (dims.qr, dims.kvr, dims.kw());
        let (hdn, hdr, hdv) = (h * dims.dn, h * dims.dr, h * dims.dv);
        let layers = (0..dims.layers)
            .map(|_| LayerRegions {
                xin: a.take(act),
                xhat1: a.take(act),
                inv1: a.take(t * fs),
                a: a.take(act),
                cq_raw: a.take(t * qr * ts),
                cq: a.take(tc * qr * ts),
                cq_xhat: a.take(t * qr * ts),
                cq_inv: a.take(t * fs),
                q_nope: a.take(tc * hdn * ts),
                q_pe: a.take(tc * hdr * ts),
                ckv_raw: a.take(t * kvr * ts),
                ckv: a.take(tc * kvr * ts),
                ckv_xhat: a.take(t * kvr * ts),
                ckv_inv: a.take(t * fs),
                kpe: a.take(tc * kw * ts),
                ckv_all: a.take(tk * kvr * ts),
                kpe_all: a.take(tk * kw * ts),
                k_nope: a.take(tk * hdn * ts),
                v: a.take(tk * hdv * ts),
                lse: a.take(h * tc * fs),
                o: a.take(tc * hdv * ts),
                h1: a.take(act),
                xhat2: a.take(act),
                inv2: a.take(t * fs),
                n2: a.take(act),
                logits: a.take(t * e * fs),
                s: a.take(t * e * fs),
                softmax: a.take(t * e * fs),
                experts: a.take(t * k * is),
                desired: a.take(t * k * is),
                gates: a.take(t * k * fs),
                z: a.take(t * fs),
                cnt: a.take(e * is),
                order: a.take(t * k * is),
                slot_dest: a.take(t * k * is),
                slot_pos: a.take(t * k * is),
                eo: a.take(t * k * d * ts),
                sh_h1: a.take(fsh),
                sh_h3: a.take(fsh),
                sh_act: a.take(fsh),
                sh_y: a.take(if dims.shared || dims.seq_par {
                    tc * d * ts
                } else {
                    0
                }),
                n2c: a.take(chunk),
                h1c: a.take(chunk),
                ysh: a.take(if dims.seq_par { act } else { 0 }),
                dgates: a.take(t * k * fs),
                dn2: a.take(act),
                sh_da: a.take(fsh),
                sh_dh1: a.take(fsh),
                sh_dh3: a.take(fsh),
                dlr: a.take(t * e * ts),
                dh1: a.take(act),
                doh: a.take(tc * hdv * ts),
                delta: a.take(h * tc * fs),
                dkp_part: a.take(h * tk * dims.dr * fs),
                dq_nope: a.take(tc * hdn * ts),
                dqr: a.take(tc * hdr * ts),
                dk_nope: a.take(tk * hdn * ts),
                dk_pe: a.take(tk * kw * ts),
                dvv: a.take(tk * hdv * ts),
                dckv_all: a.take(tk * kvr * ts),
                dckv: a.take(tc * kvr * ts),
                dkr: a.take(tc * kw * ts),
                dckv_raw: a.take(t * kvr * ts),
                dcq: a.take(tc * qr * ts),
                dcq_raw: a.take(t * qr * ts),
                da: a.take(act),
                dx: a.take(act),
                tpg: a.take(if dims.tp > 1 { tc * lat * ts } else { 0 }),
                tps: a.take(if dims.seq_par { t * lat * ts } else { 0 }),
                dyc: a.take(chunk),
                dn2c: a.take(chunk),
                dh1c: a.take(chunk),
                perm: a.take(dims.ep * dims.rmax * is),
                ecount: a.take(dims.per * is),
                src_count: a.take(dims.ep * is),
                xe: a.take(ex * d * ts),
                h1e: a.take(ex * f * ts),
                h3e: a.take(ex * f * ts),
                ae: a.take(ex * f * ts),
                ye: a.take(ex * d * ts),
                dye: a.take(ex * d * ts),
                dae: a.take(ex * f * ts),
                dh1e: a.take(ex * f * ts),
                dh3e: a.take(ex * f * ts),
                dxe: a.take(ex * d * ts),
            })
            .collect();
        StashLayout {
            tokens,
            targets,
            xout,
            gout,
            xf,
            xhatf,
            invf,
            logits,
            dlogits,
            dxf,
            rowloss,
            outbox,
            inbox,
            layers,
            bytes: a.at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_bounds_follow_the_routing() {
        let cfg = ModelConfig::tiny(); // T = 8, E = 4, k = 2, capacity factor 1
        let mesh: Mesh = "pp=2,ep=2".parse().unwrap();
        let d = Dims::new(&cfg, &mesh, DType::F32).unwrap();
        // capacity of a group of 8 tokens: max(ceil(8*2/4), ceil(16/3)) = 6.
        assert_eq!(cfg.capacity(8), 6);
        assert_eq!((d.t, d.per, d.cap), (8, 2, 6));
        // A member holds 2 experts; each token sends it at most min(k, per) = 2 rows, and
        // each expert takes at most min(t, cap) = 6: rmax = min(16, 12).
        assert_eq!(d.rmax, 12);
        assert_eq!(d.cmax, 12);
        assert_eq!(d.rows_off, 64);
        assert!(d.slot_bytes >= d.rows_off + 12 * 16 * 4);
        assert_eq!(d.slot_bytes % ALIGN, 0);
        let bad: Mesh = "pp=2,ep=3".parse().unwrap();
        assert!(Dims::new(&cfg, &bad, DType::F32).is_err());
    }

    #[test]
    fn tp_splits_the_heads_and_the_shared_expert_or_names_the_dimension() {
        let cfg = ModelConfig::tiny();
        let d = Dims::new(&cfg, &"pp=2,tp=2".parse().unwrap(), DType::F32).unwrap();
        assert_eq!(
            (d.tp, d.heads, d.fs),
            (2, cfg.heads / 2, cfg.expert_hidden / 2)
        );
        // The routed experts stay whole (no expert TP).
        assert_eq!(d.f, cfg.expert_hidden);
        let three: Mesh = "pp=2,tp=3".parse().unwrap();
        let e = Dims::new(&cfg, &three, DType::F32).unwrap_err();
        assert_eq!(
            e,
            format!("the TP group of 3 does not divide the {} heads", cfg.heads)
        );
    }

    #[test]
    fn sequence_parallel_dims_are_the_members_shard_of_the_chunk() {
        // Issue 23: tiny model, sequence 8 at sp=2: chunks of 4 tokens, 2 per TP member.
        let cfg = ModelConfig::tiny();
        let mesh: Mesh = "pp=2,tp=2,sp=2".parse().unwrap();
        let plain = Dims::new(&cfg, &mesh, DType::F32).unwrap();
        assert_eq!(
            (plain.t, plain.tc, plain.shard0, plain.seq_par),
            (4, 4, 0, false)
        );
        let d = Dims::with_sequence_parallel(&cfg, &mesh, DType::F32, Some(1)).unwrap();
        assert_eq!((d.t, d.tc, d.shard0, d.seq_par), (2, 4, 2, true));
        // The shard routes alone: its capacity and the all-to-all bounds are a shard's.
        assert_eq!(d.cap, cfg.capacity(2) as i32);
        assert_eq!(d.act_bytes(), 2 * cfg.hidden * 4);
        // Without TP there is nothing to shard.
        let no_tp: Mesh = "pp=2,sp=2".parse().unwrap();
        let d = Dims::with_sequence_parallel(&cfg, &no_tp, DType::F32, Some(0)).unwrap();
        assert_eq!((d.t, d.tc, d.seq_par), (4, 4, false));
        // A chunk the TP group does not divide is refused, naming both.
        let odd = ModelConfig {
            heads: 4,
            seq_len: 12,
            ..ModelConfig::tiny()
        };
        let four: Mesh = "pp=2,tp=4,sp=2".parse().unwrap();
        assert_eq!(
            Dims::with_sequence_parallel(&odd, &four, DType::F32, Some(0)).unwrap_err(),
            "tp=4 does not divide the 6 tokens of a sequence chunk (--sequence-parallel shards them over the TP group)"
        );
    }

    #[test]
    fn attention_stash_has_no_heads_by_t_by_t_buffer() {
        // issue 24: 128 heads of DeepSeek-V3's MLA head dims (d_h 128, d_h^R 64, d_v 128)
        // at 4096 tokens. The untiled kernels kept f32 probabilities and their gradient,
        // H x t x t each (8,589,934,592 bytes apiece); the tiled ones keep the rows'
        // log-sum-exp and, as backward scratch, D (H x t floats each) and the per-head RoPE
        // key gradients (H x t x d_h^R floats).
        let cfg = ModelConfig {
            hidden: 1024,
            heads: 128,
            q_lora_rank: 256,
            kv_lora_rank: 128,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            seq_len: 4096,
            experts: 8,
            expert_hidden: 256,
            ..ModelConfig::tiny()
        };
        let d = Dims::new(&cfg, &Mesh::pipeline(1), DType::Bf16).unwrap();
        let stage = schedc_program::LocalStage {
            stage: 0,
            model_stage: 0,
            direction: 0,
            first: false,
            last: false,
            expert_lo: 0,
            expert_hi: 8,
            replica_peer: None,
        };
        let st = StashLayout::new(&d, &stage);
        let l = &st.layers[0];
        assert_eq!(l.lse.bytes, 2_097_152);
        assert_eq!(l.delta.bytes, 2_097_152);
        assert_eq!(l.dkp_part.bytes, 134_217_728);
        let untiled = 128 * 4096 * 4096 * 4;
        assert_eq!(untiled, 8_589_934_592usize);
        // The whole stash of the layer is smaller than one H x t x t buffer.
        assert!(st.bytes < untiled, "stash of {} bytes", st.bytes);
    }

    #[test]
    fn head_dims_over_the_attention_tiles_are_refused() {
        let cfg = ModelConfig {
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            ..ModelConfig::tiny()
        };
        assert!(Dims::new(&cfg, &Mesh::pipeline(1), DType::Bf16).is_ok());
        let wide = ModelConfig {
            qk_rope_head_dim: 66,
            ..cfg.clone()
        };
        assert_eq!(
            Dims::new(&wide, &Mesh::pipeline(1), DType::Bf16).unwrap_err(),
            "attention head dimensions qk_nope_head_dim 128 + qk_rope_head_dim 66 = 194, v_head_dim 128: the CUDA attention kernels take at most 192 and 128"
        );
        let wide_v = ModelConfig {
            v_head_dim: 136,
            ..cfg.clone()
        };
        assert_eq!(
            Dims::new(&wide_v, &Mesh::pipeline(1), DType::F32).unwrap_err(),
            "attention head dimensions qk_nope_head_dim 128 + qk_rope_head_dim 64 = 192, v_head_dim 136: the CUDA attention kernels take at most 192 and 128"
        );
    }

    #[test]
    fn params_follow_the_cpu_flattening() {
        let cfg = ModelConfig::tiny();
        let p = StageParams::<f32>::init(&cfg, 0, 2, 0, 4);
        let l = ParamLayout::of(&p, cfg.experts);
        assert_eq!(l.dense, p.flatten(Scope::Dense).len());
        assert_eq!(l.expert, p.flatten(Scope::Expert).len());
        assert_eq!(l.loads, cfg.experts);
        let w1 = l.get("layer0.expert1.w1").unwrap();
        let w1_0 = l.get("layer0.expert0.w1").unwrap();
        // Experts' tensors are w1, w3, w2 per expert, consecutive: one stride 3 d f.
        assert_eq!(w1.param - w1_0.param, 3 * 16 * 16);
        assert_eq!(w1.grad - w1.param, cfg.experts);
        assert!(l.get("head").is_err());
    }
}
