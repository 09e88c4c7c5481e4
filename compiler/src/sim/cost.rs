//! The cost model: what each op takes (seconds), how big messages are (bytes), how much memory
//! a rank holds (bytes). Read from TOML; presets ship in `compiler/presets/`; `k=v` overrides.
//!
//! ```toml
//! [compute]            # seconds per op on every stage
//! F = 1.0              # forward
//! B = 1.0              # input-gradient backward (torch `I`)
//! W = 1.0              # weight-gradient backward
//! # BW = 2.0           # fused backward; default B + W
//! # FB = 3.0           # an overlapped F&B pair; default F + (the backward's time)
//! # measured = false   # true: times of this program's own stages (a profile), no 1/V charge
//! [compute.stage.0]    # per-stage overrides (embedding), [compute.stage.N] ...
//! F = 1.2
//! [p2p]
//! latency = 0.0        # seconds per message
//! bandwidth = 0.0      # bytes per second; 0 = free
//! # bytes = 0         # message size; default from [model]
//! [model]              # message size = hidden * seq * micro_batch * dtype_bytes
//! hidden = 7168
//! seq = 4096
//! micro_batch = 1
//! dtype_bytes = 2
//! [moe]                # the section's presence is what `--moe` requires
//! dispatch = 0.0       # seconds per dispatch all-to-all (an MoE op's `.dispatch` part)
//! combine = 0.0        # seconds per combine all-to-all
//! # bandwidth = 0.0    # EP bytes per second: a dispatch or combine left at 0 takes
//! # latency = 0.0      #   latency + seq * micro_batch * hidden * dtype_bytes * top_k / bandwidth
//! # top_k = 1          #   (tokens x hidden x bytes, from [model]; each token goes to top_k experts)
//! # attn_share = 0.5   # share of an F, B or BW that is attention (the MLP part gets the rest)
//! overlap = true       # on a separate communication stream that overlaps compute
//! a2a = 0.0            # seconds per explicit A2A collective
//! [memory]
//! activation_bytes = 0.0      # per (stage, micro-batch)
//! released_at_b = 0.5         # fraction freed by B; the rest at W (Zero Bubble's accounting)
//! param_bytes = 0.0           # per stage (a rank holding two stages holds two copies)
//! grad_bytes = 0.0            # per stage
//! optimizer_bytes = 0.0       # per stage
//! offload = 0.0               # seconds per OFFLOAD(s,m) on the host-copy stream
//! reload = 0.0                # seconds per RELOAD(s,m) (default: equal to offload)
//! pcie_bandwidth = 0.0        # host-copy bytes per second: a copy whose seconds are 0
//!                             #   takes activation_bytes / pcie_bandwidth
//! host_bytes = 0.0            # host memory per rank for offloaded activations; 0: unlimited
//! ```
//!
//! Defaults: unit compute (F = B = W = 1), free communication, no memory figures.

use schedc_ir::{Compute, Kind, Part};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Per-op times, seconds. `None` falls back to the model-wide value.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpCosts {
    /// Forward.
    #[serde(rename = "F")]
    pub f: Option<f64>,
    /// Input-gradient backward.
    #[serde(rename = "B")]
    pub b: Option<f64>,
    /// Weight-gradient backward.
    #[serde(rename = "W")]
    pub w: Option<f64>,
    /// Fused backward (default B + W).
    #[serde(rename = "BW")]
    pub bw: Option<f64>,
    /// Overlapped F&B pair (default F + the backward's time).
    #[serde(rename = "FB")]
    pub fb: Option<f64>,
}

/// Compute costs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeCosts {
    /// Model-wide times.
    #[serde(flatten)]
    pub all: OpCosts,
    /// Per-stage overrides, keyed by stage id.
    #[serde(default)]
    pub stage: BTreeMap<String, OpCosts>,
    /// The times are of this program's own stages as run (a measured profile, such as the
    /// torch runtime's `write_profile`): no `P / stages per direction` charge
    /// ([`CostModel::for_pipeline`]). Default false: times for a stage of 1/P of the model.
    #[serde(default)]
    pub measured: bool,
}

/// Point-to-point communication.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct P2p {
    /// Seconds per message.
    #[serde(default)]
    pub latency: f64,
    /// Bytes per second; 0 means free.
    #[serde(default)]
    pub bandwidth: f64,
    /// Message size in bytes (default: from `[model]`).
    pub bytes: Option<f64>,
}

/// Model shape, for message sizes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Hidden size.
    pub hidden: f64,
    /// Sequence length.
    pub seq: f64,
    /// Micro-batch size (sequences).
    pub micro_batch: f64,
    /// Bytes per element.
    pub dtype_bytes: f64,
}

/// MoE all-to-all costs.
///
/// A backward's dispatch and combine parts mirror the forward's (the gradient of combine is a
/// dispatch-shaped all-to-all of the same volume, run where the forward's combine ran), so a
/// `B` or `BW` part costs what the forward part of the same name costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Moe {
    /// True when the model has a `[moe]` section (or `dispatch=`/`combine=` overrides): what
    /// `--moe` requires, so that all-to-alls are never silently free.
    #[serde(skip, default = "yes")]
    pub present: bool,
    /// Seconds per dispatch; 0 derives it from `bandwidth`.
    #[serde(default)]
    pub dispatch: f64,
    /// Seconds per combine; 0 derives it from `bandwidth`.
    #[serde(default)]
    pub combine: f64,
    /// Expert-parallel bandwidth, bytes per second (0: no derived time).
    #[serde(default)]
    pub bandwidth: f64,
    /// Seconds per derived all-to-all on top of its transfer time.
    #[serde(default)]
    pub latency: f64,
    /// Experts each token is sent to (bytes multiply by it).
    #[serde(default = "one")]
    pub top_k: f64,
    /// Share of an F, B or BW op's compute time in its attention part; the MLP part takes the
    /// rest.
    #[serde(default = "half")]
    pub attn_share: f64,
    /// Whether dispatch/combine run on their own stream, overlapping compute.
    #[serde(default = "yes")]
    pub overlap: bool,
    /// Seconds per explicit `A2A` collective.
    #[serde(default)]
    pub a2a: f64,
    /// Per-stage overrides (`[moe.stage.N]`), keyed by stage id: a stage of dense layers has
    /// no all-to-all, a stage's attention share follows its layers (set by `--model`).
    #[serde(default)]
    pub stage: BTreeMap<String, StageMoe>,
}

/// Per-stage MoE overrides; `None` falls back to the model-wide value.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageMoe {
    /// Seconds per dispatch of an op of this stage.
    pub dispatch: Option<f64>,
    /// Seconds per combine.
    pub combine: Option<f64>,
    /// Share of an op's compute in its attention part, in [0, 1].
    pub attn_share: Option<f64>,
}

/// Per-stage memory overrides (`[memory.stage.N]`); `None` falls back to the model-wide
/// value.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageMemory {
    /// Activation bytes of one micro-batch of this stage.
    pub activation_bytes: Option<f64>,
    /// Fraction of them freed by B.
    pub released_at_b: Option<f64>,
    /// Parameter bytes of the stage.
    pub param_bytes: Option<f64>,
    /// Gradient bytes of the stage.
    pub grad_bytes: Option<f64>,
    /// Optimizer-state bytes of the stage.
    pub optimizer_bytes: Option<f64>,
}

fn yes() -> bool {
    true
}

fn one() -> f64 {
    1.0
}

impl Default for Moe {
    fn default() -> Self {
        Moe {
            present: false,
            dispatch: 0.0,
            combine: 0.0,
            bandwidth: 0.0,
            latency: 0.0,
            top_k: 1.0,
            attn_share: 0.5,
            overlap: true,
            a2a: 0.0,
            stage: BTreeMap::new(),
        }
    }
}

/// Memory accounting (bytes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    /// Activation bytes of one (stage, micro-batch).
    #[serde(default)]
    pub activation_bytes: f64,
    /// Fraction of it freed by B (the rest by W); BW frees all. Zero Bubble (arXiv
    /// 2401.10241, §2) keeps W's inputs alive until W.
    #[serde(default = "half")]
    pub released_at_b: f64,
    /// Parameter bytes per stage.
    #[serde(default)]
    pub param_bytes: f64,
    /// Gradient bytes per stage.
    #[serde(default)]
    pub grad_bytes: f64,
    /// Optimizer-state bytes per stage.
    #[serde(default)]
    pub optimizer_bytes: f64,
    /// Seconds of one `OFFLOAD(s,m)` (device to host, on the rank's host-copy stream); 0:
    /// from `pcie_bandwidth`, or free.
    #[serde(default)]
    pub offload: f64,
    /// Seconds of one `RELOAD(s,m)` (host to device); `None`: as `offload`.
    #[serde(default)]
    pub reload: Option<f64>,
    /// Host-copy bandwidth, bytes per second; used for a copy whose seconds are 0:
    /// `activation_bytes / pcie_bandwidth`. 0: copies are free.
    #[serde(default)]
    pub pcie_bandwidth: f64,
    /// Host memory budget per rank for offloaded activations, bytes: an `OFFLOAD` that would
    /// hold more on the rank's host is an error of `schedc check --cost` and `schedc sim`
    /// (reported by [`crate::sim::SimResult::host_overflows`]). 0 (the default): unlimited.
    #[serde(default)]
    pub host_bytes: f64,
    /// Per-stage overrides (`[memory.stage.N]`), keyed by stage id (set by `--model`: the
    /// embedding's and the head's stages differ from the rest).
    #[serde(default)]
    pub stage: BTreeMap<String, StageMemory>,
}

impl Memory {
    fn at(&self, stage: u32) -> Option<&StageMemory> {
        if self.stage.is_empty() {
            None
        } else {
            self.stage.get(&stage.to_string())
        }
    }

    /// Activation bytes of one micro-batch of `stage`.
    pub fn activation_bytes_at(&self, stage: u32) -> f64 {
        self.at(stage)
            .and_then(|s| s.activation_bytes)
            .unwrap_or(self.activation_bytes)
    }

    /// The fraction of `stage`'s activations B frees.
    pub fn released_at_b_at(&self, stage: u32) -> f64 {
        self.at(stage)
            .and_then(|s| s.released_at_b)
            .unwrap_or(self.released_at_b)
            .clamp(0.0, 1.0)
    }

    /// Seconds of one host copy (`OFFLOAD` or `RELOAD`; `RECOMPUTE` is a forward, priced by
    /// the compute costs) of `stage`'s activations: `offload` / `reload` when set, else
    /// `activation_bytes / pcie_bandwidth`, else 0.
    pub fn copy_time(&self, kind: schedc_ir::MemKind, stage: u32) -> f64 {
        let secs = match kind {
            schedc_ir::MemKind::Reload => self.reload.unwrap_or(self.offload),
            _ => self.offload,
        };
        if secs > 0.0 {
            secs
        } else if self.pcie_bandwidth > 0.0 {
            self.activation_bytes_at(stage) / self.pcie_bandwidth
        } else {
            0.0
        }
    }

    /// Weights, gradients and optimizer state of `stage`, bytes.
    pub fn static_bytes_at(&self, stage: u32) -> f64 {
        let s = self.at(stage);
        s.and_then(|s| s.param_bytes).unwrap_or(self.param_bytes)
            + s.and_then(|s| s.grad_bytes).unwrap_or(self.grad_bytes)
            + s.and_then(|s| s.optimizer_bytes)
                .unwrap_or(self.optimizer_bytes)
    }
}

fn half() -> f64 {
    0.5
}

impl Default for Memory {
    fn default() -> Self {
        Memory {
            activation_bytes: 0.0,
            released_at_b: 0.5,
            param_bytes: 0.0,
            grad_bytes: 0.0,
            optimizer_bytes: 0.0,
            offload: 0.0,
            reload: None,
            pcie_bandwidth: 0.0,
            host_bytes: 0.0,
            stage: BTreeMap::new(),
        }
    }
}

/// The whole cost model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    /// Compute times.
    #[serde(default)]
    pub compute: ComputeCosts,
    /// Point-to-point communication.
    #[serde(default)]
    pub p2p: P2p,
    /// Model shape.
    pub model: Option<ModelShape>,
    /// MoE all-to-alls.
    #[serde(default)]
    pub moe: Moe,
    /// Memory.
    #[serde(default)]
    pub memory: Memory,
    /// Multiplies every compute time (not set from TOML). `schedc compare` sets it to
    /// `P / stages per direction` so that schedules splitting the model into more, smaller
    /// stages (interleaved, ZB-V, DualPipeV) are charged for the layers they hold: the
    /// configured times are for a stage of 1/P of the model.
    #[serde(skip)]
    pub op_scale: Option<f64>,
}

/// Presets shipped with schedc: `(name, TOML)`.
pub const PRESETS: &[(&str, &str)] = &[
    ("unit", include_str!("../../presets/unit.toml")),
    (
        "dualpipe-readme",
        include_str!("../../presets/dualpipe-readme.toml"),
    ),
    ("dsv3-h800", include_str!("../../presets/dsv3-h800.toml")),
];

impl CostModel {
    /// Parses TOML. Errors: the TOML error with its line and column, or a value
    /// [`CostModel::validate`] refuses.
    pub fn from_toml(s: &str) -> Result<Self, String> {
        let m: CostModel = toml::from_str(s).map_err(|e| e.to_string())?;
        m.validate()?;
        Ok(m)
    }

    /// Checks every value: times, sizes and bandwidth finite and non-negative,
    /// `released_at_b` in [0, 1], per-stage keys stage numbers.
    pub fn validate(&self) -> Result<(), String> {
        let ok = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "`{name}` must be a finite non-negative number, got {v}"
                ))
            }
        };
        let ops = |pre: &str, c: &OpCosts| -> Result<(), String> {
            for (n, v) in [
                ("F", c.f),
                ("B", c.b),
                ("W", c.w),
                ("BW", c.bw),
                ("FB", c.fb),
            ] {
                if let Some(v) = v {
                    ok(&format!("{pre}{n}"), v)?;
                }
            }
            Ok(())
        };
        ops("compute.", &self.compute.all)?;
        for (k, c) in &self.compute.stage {
            if k.parse::<u32>().is_err() {
                return Err(format!(
                    "[compute.stage.{k}]: the key must be a stage number"
                ));
            }
            ops(&format!("compute.stage.{k}."), c)?;
        }
        ok("p2p.latency", self.p2p.latency)?;
        ok("p2p.bandwidth", self.p2p.bandwidth)?;
        if let Some(b) = self.p2p.bytes {
            ok("p2p.bytes", b)?;
        }
        if let Some(m) = &self.model {
            for (n, v) in [
                ("hidden", m.hidden),
                ("seq", m.seq),
                ("micro_batch", m.micro_batch),
                ("dtype_bytes", m.dtype_bytes),
            ] {
                ok(&format!("model.{n}"), v)?;
            }
        }
        for (n, v) in [
            ("moe.dispatch", self.moe.dispatch),
            ("moe.combine", self.moe.combine),
            ("moe.a2a", self.moe.a2a),
            ("moe.bandwidth", self.moe.bandwidth),
            ("moe.latency", self.moe.latency),
            ("moe.top_k", self.moe.top_k),
        ] {
            ok(n, v)?;
        }
        if !(0.0..=1.0).contains(&self.moe.attn_share) {
            return Err(format!(
                "`moe.attn_share` must be in [0, 1], got {}",
                self.moe.attn_share
            ));
        }
        let mem = &self.memory;
        for (n, v) in [
            ("memory.activation_bytes", mem.activation_bytes),
            ("memory.param_bytes", mem.param_bytes),
            ("memory.grad_bytes", mem.grad_bytes),
            ("memory.optimizer_bytes", mem.optimizer_bytes),
            ("memory.offload", mem.offload),
            ("memory.reload", mem.reload.unwrap_or(0.0)),
            ("memory.pcie_bandwidth", mem.pcie_bandwidth),
            ("memory.host_bytes", mem.host_bytes),
        ] {
            ok(n, v)?;
        }
        if !(0.0..=1.0).contains(&mem.released_at_b) {
            return Err(format!(
                "`memory.released_at_b` must be in [0, 1], got {}",
                mem.released_at_b
            ));
        }
        // Sums of times must stay finite too.
        let total = self.op_time(Kind::F, 0)
            + self.op_time(Kind::BW, 0)
            + self.message_time()
            + self.a2a_time(Part::Dispatch)
            + self.a2a_time(Part::Combine)
            + self.memory.copy_time(schedc_ir::MemKind::Offload, 0)
            + self.memory.copy_time(schedc_ir::MemKind::Reload, 0);
        if !total.is_finite() {
            return Err("the cost model's times are too large: their sums overflow".into());
        }
        Ok(())
    }

    /// A preset by name, a TOML file path, or inline `k=v,...` overrides on the unit model
    /// (`F=1,B=1,W=1,FB=3`, `latency=1e-5`, `bandwidth=5e10`, `bytes=1e6`, `dispatch=..`,
    /// `combine=..`, `activation_bytes=..`, `param_bytes=..`).
    ///
    /// Errors: an unknown key, a value that is not a number, an unreadable or invalid file.
    pub fn resolve(spec: &str) -> Result<Self, String> {
        if let Some((_, t)) = PRESETS.iter().find(|(n, _)| *n == spec) {
            return Self::from_toml(t).map_err(|e| format!("preset `{spec}`: {e}"));
        }
        if spec.contains('=') && !std::path::Path::new(spec).exists() {
            let mut m = CostModel::default();
            m.apply_overrides(spec)?;
            return Ok(m);
        }
        let text = std::fs::read_to_string(spec).map_err(|e| {
            format!(
                "cannot read cost model `{spec}`: {e} (presets: {})",
                PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
            )
        })?;
        Self::from_toml(&text).map_err(|e| format!("{spec}: {e}"))
    }

    /// Applies `k=v,...` overrides.
    pub fn apply_overrides(&mut self, kv: &str) -> Result<(), String> {
        for part in kv.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("cost override `{part}`: expected KEY=VALUE"))?;
            let k = k.trim();
            let v: f64 = v
                .trim()
                .parse()
                .map_err(|_| format!("cost override `{part}`: `{}` is not a number", v.trim()))?;
            if !v.is_finite() || v < 0.0 {
                return Err(format!(
                    "cost override `{part}`: must be a finite non-negative number"
                ));
            }
            match k {
                "F" => self.compute.all.f = Some(v),
                "B" => self.compute.all.b = Some(v),
                "W" => self.compute.all.w = Some(v),
                "BW" => self.compute.all.bw = Some(v),
                "FB" => self.compute.all.fb = Some(v),
                "latency" => self.p2p.latency = v,
                "bandwidth" => self.p2p.bandwidth = v,
                "bytes" => self.p2p.bytes = Some(v),
                "dispatch" => {
                    self.moe.dispatch = v;
                    self.moe.present = true;
                }
                "combine" => {
                    self.moe.combine = v;
                    self.moe.present = true;
                }
                "ep_bandwidth" => {
                    self.moe.bandwidth = v;
                    self.moe.present = true;
                }
                "ep_latency" => {
                    self.moe.latency = v;
                    self.moe.present = true;
                }
                "top_k" => self.moe.top_k = v,
                "attn_share" => self.moe.attn_share = v,
                "a2a" => self.moe.a2a = v,
                "activation_bytes" => self.memory.activation_bytes = v,
                "released_at_b" => self.memory.released_at_b = v,
                "param_bytes" => self.memory.param_bytes = v,
                "grad_bytes" => self.memory.grad_bytes = v,
                "optimizer_bytes" => self.memory.optimizer_bytes = v,
                "offload" => self.memory.offload = v,
                "reload" => self.memory.reload = Some(v),
                "pcie_bandwidth" => self.memory.pcie_bandwidth = v,
                "host_bytes" => self.memory.host_bytes = v,
                _ => {
                    return Err(format!(
                        "unknown cost key `{k}`: expected F, B, W, BW, FB, latency, bandwidth, bytes, dispatch, combine, ep_bandwidth, ep_latency, top_k, attn_share, a2a, activation_bytes, released_at_b, param_bytes, grad_bytes, optimizer_bytes, offload, reload, pcie_bandwidth, host_bytes"
                    ))
                }
            }
        }
        self.validate()
    }

    /// [`CostModel::apply_overrides`] that also replaces the per-stage values of the keys it
    /// sets (op times, all-to-all times, memory), so that an override given on top of a
    /// derived model (`--model ... --set F=0.01`) holds on every stage.
    pub fn apply_overrides_everywhere(&mut self, kv: &str) -> Result<(), String> {
        self.apply_overrides(kv)?;
        for part in kv.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let k = part.split_once('=').map_or(part, |(k, _)| k).trim();
            for c in self.compute.stage.values_mut() {
                match k {
                    "F" => c.f = None,
                    "B" => c.b = None,
                    "W" => c.w = None,
                    "BW" => c.bw = None,
                    "FB" => c.fb = None,
                    _ => {}
                }
            }
            for m in self.moe.stage.values_mut() {
                match k {
                    "dispatch" => m.dispatch = None,
                    "combine" => m.combine = None,
                    "attn_share" => m.attn_share = None,
                    _ => {}
                }
            }
            for m in self.memory.stage.values_mut() {
                match k {
                    "activation_bytes" => m.activation_bytes = None,
                    "released_at_b" => m.released_at_b = None,
                    "param_bytes" => m.param_bytes = None,
                    "grad_bytes" => m.grad_bytes = None,
                    "optimizer_bytes" => m.optimizer_bytes = None,
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn stage_costs(&self, stage: u32) -> Option<&OpCosts> {
        self.compute.stage.get(&stage.to_string())
    }

    fn pick(&self, stage: u32, f: impl Fn(&OpCosts) -> Option<f64>) -> Option<f64> {
        self.stage_costs(stage)
            .and_then(&f)
            .or_else(|| f(&self.compute.all))
    }

    /// Seconds of a whole op of `kind` on `stage`.
    pub fn op_time(&self, kind: Kind, stage: u32) -> f64 {
        let f = self.pick(stage, |c| c.f).unwrap_or(1.0);
        let b = self.pick(stage, |c| c.b).unwrap_or(1.0);
        let w = self.pick(stage, |c| c.w).unwrap_or(1.0);
        match kind {
            Kind::F => f,
            Kind::B => b,
            Kind::W => w,
            Kind::BW => self.pick(stage, |c| c.bw).unwrap_or(b + w),
        }
    }

    /// Seconds of one compute op (an MoE part: `attn_share` of its op for attention, the rest
    /// for the MLP; [`CostModel::a2a_time`] for dispatch and combine).
    pub fn compute_time(&self, c: &Compute) -> f64 {
        self.op_scale.unwrap_or(1.0) * self.compute_time_unscaled(c)
    }

    fn compute_time_unscaled(&self, c: &Compute) -> f64 {
        match c.part {
            Part::Whole => self.op_time(c.kind, c.stage),
            Part::Attn => self.op_time(c.kind, c.stage) * self.attn_share_at(c.stage),
            Part::Mlp => self.op_time(c.kind, c.stage) * (1.0 - self.attn_share_at(c.stage)),
            Part::Dispatch | Part::Combine => self.a2a_time_at(c.part, c.stage),
        }
    }

    /// The attention share of `stage`'s ops: its `[moe.stage.N]` override, else
    /// `attn_share`.
    pub fn attn_share_at(&self, stage: u32) -> f64 {
        self.moe_stage(stage)
            .and_then(|s| s.attn_share)
            .unwrap_or(self.moe.attn_share)
    }

    fn moe_stage(&self, stage: u32) -> Option<&StageMoe> {
        if self.moe.stage.is_empty() {
            None
        } else {
            self.moe.stage.get(&stage.to_string())
        }
    }

    /// [`CostModel::a2a_time`] of an op of `stage`: its `[moe.stage.N]` override when given.
    pub fn a2a_time_at(&self, part: Part, stage: u32) -> f64 {
        let over = self.moe_stage(stage).and_then(|s| match part {
            Part::Dispatch => s.dispatch,
            Part::Combine => s.combine,
            _ => None,
        });
        match over {
            Some(t) => t,
            None => self.a2a_time(part),
        }
    }

    /// Seconds of one dispatch or combine all-to-all (of a forward, or the mirror of a
    /// backward): the `[moe]` time, or, when it is 0 and an EP `bandwidth` is given,
    /// `latency + seq * micro_batch * hidden * dtype_bytes * top_k / bandwidth` with the
    /// sizes of `[model]`. 0 for other parts. The time is per stage-chunk, like the op
    /// times: [`CostModel::compute_time`] scales it by `op_scale` with them (a stage holding
    /// half the layers issues half the all-to-alls).
    pub fn a2a_time(&self, part: Part) -> f64 {
        let given = match part {
            Part::Dispatch => self.moe.dispatch,
            Part::Combine => self.moe.combine,
            _ => return 0.0,
        };
        if given > 0.0 || self.moe.bandwidth <= 0.0 {
            return given;
        }
        let bytes = match &self.model {
            Some(m) => m.seq * m.micro_batch * m.hidden * m.dtype_bytes * self.moe.top_k,
            None => 0.0,
        };
        self.moe.latency + bytes / self.moe.bandwidth
    }

    /// Seconds of an overlapped pair that is not split into MoE parts: the `FB` override when
    /// given, else the sum of its two ops (no overlap gain; split the pair with `--moe` to let
    /// the simulator find the overlap).
    pub fn pair_time(&self, fwd: &Compute, bwd: &Compute) -> f64 {
        match self.pick(bwd.stage, |c| c.fb) {
            Some(t) => self.op_scale.unwrap_or(1.0) * t,
            None => self.compute_time(fwd) + self.compute_time(bwd),
        }
    }

    /// Bytes of one activation or gradient message.
    pub fn message_bytes(&self) -> f64 {
        if let Some(b) = self.p2p.bytes {
            return b;
        }
        match &self.model {
            Some(m) => m.hidden * m.seq * m.micro_batch * m.dtype_bytes,
            None => 0.0,
        }
    }

    /// The model for a schedule of `pl`, as `sim`, `check` and `compare` time it: the op
    /// times are for a stage holding 1/P of the model, so a schedule that splits it into more
    /// stages per direction than ranks (V > 1: interleaved, ZB-V, DualPipeV) has each op
    /// charged `P / stages per direction` of them ([`CostModel::op_scale`]), and every
    /// schedule does the same work. The `[memory]` sizes of a stage (activation, parameter,
    /// gradient and optimizer bytes) and the seconds of a host copy are charged the same
    /// share, so such a schedule also holds the same model: a ZB-V rank's two stages hold
    /// one `param_bytes` between them. Per-stage overrides (`[memory.stage.N]`, which
    /// `--model` sets for the schedule's own stages) are kept as given. An `op_scale`
    /// already set is kept, and then nothing is scaled.
    pub fn for_pipeline(&self, pl: &schedc_ir::Pipeline) -> CostModel {
        let mut c = self.clone();
        if c.op_scale.is_none() {
            let f = if c.compute.measured {
                1.0
            } else {
                pl.pp as f64 / pl.stages_per_direction().max(1) as f64
            };
            c.op_scale = Some(f);
            if f != 1.0 {
                let m = &mut c.memory;
                m.activation_bytes *= f;
                m.param_bytes *= f;
                m.grad_bytes *= f;
                m.optimizer_bytes *= f;
                m.offload *= f;
                m.reload = m.reload.map(|r| r * f);
            }
        }
        c
    }

    /// Seconds of one `LEND`/`RETURN` message of `stage`'s stash (BPipe's hand-off), priced
    /// as a point-to-point message: `p2p.latency + bytes / p2p.bandwidth`, where the bytes
    /// are the stash's, `[memory] activation_bytes` of the stage, or, when that is 0, those
    /// of an activation message ([`CostModel::message_bytes`]).
    pub fn stash_message_time(&self, stage: u32) -> f64 {
        let act = self.memory.activation_bytes_at(stage);
        let bytes = if act > 0.0 { act } else { self.message_bytes() };
        let xfer = if self.p2p.bandwidth > 0.0 {
            bytes / self.p2p.bandwidth
        } else {
            0.0
        };
        self.p2p.latency + xfer
    }

    /// Seconds of one P2P message.
    pub fn message_time(&self) -> f64 {
        let bytes = self.message_bytes();
        let xfer = if self.p2p.bandwidth > 0.0 {
            bytes / self.p2p.bandwidth
        } else {
            0.0
        };
        self.p2p.latency + xfer
    }
}
