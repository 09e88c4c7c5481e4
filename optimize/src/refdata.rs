//! Reading the Zero Bubble reference data (`shared/reference/zb/`, see its README): one
//! configuration file gives the instance (P, M, placement, costs, memory limit), the
//! authors' per-rank orders and their figures.

use crate::instance::{Instance, ProblemError};
use crate::sched::{Sched, Tok};
use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct RawOp {
    #[serde(rename = "type")]
    kind: String,
    chunk: u32,
}

#[derive(Deserialize)]
struct RawCost {
    #[serde(rename = "F")]
    f: f64,
    #[serde(rename = "B")]
    b: f64,
    #[serde(rename = "W")]
    w: f64,
    comm: f64,
}

#[derive(Deserialize)]
struct RawDerived {
    makespan_from_t0: f64,
    max_rank_span: f64,
    peak_mem_units: f64,
}

#[derive(Deserialize)]
struct RawConfig {
    config_id: String,
    generator: String,
    #[serde(rename = "P")]
    p: u32,
    #[serde(rename = "M")]
    m: u32,
    cost_name: String,
    cost: RawCost,
    num_chunks: u32,
    placement: String,
    memory_limit: Option<f64>,
    orders: Vec<Vec<RawOp>>,
    derived: RawDerived,
    #[serde(default)]
    generator_reported: serde_json::Value,
}

/// One reference configuration.
pub struct RefConfig {
    /// E.g. `zb1p_P8_M16_unit`.
    pub id: String,
    /// The generator (`zb1p`, `vauto2p`, ...).
    pub generator: String,
    /// `unit`, `profA` or `profB`.
    pub cost_name: String,
    /// The cost model: F, B, W per chunk, `comm` as the message latency.
    pub cost: CostModel,
    /// The pipeline: loop with one stage per rank (`single`) or V with two.
    pub pipeline: Pipeline,
    /// The memory limit passed to the generator, (stage, micro-batch) activations.
    pub memory_limit: Option<u64>,
    /// The authors' orders as tokens.
    pub sched: Sched,
    /// Their makespan from time 0 (`derived.makespan_from_t0`).
    pub makespan_from_t0: f64,
    /// Their longest rank span (`derived.max_rank_span`).
    pub max_rank_span: f64,
    /// Their peak (`derived.peak_mem_units`).
    pub peak: f64,
    /// The generator's own `best_time` when it reports one (`zb*`).
    pub best_time: Option<f64>,
}

impl RefConfig {
    /// The instance with the configuration's memory limit as the cap.
    ///
    /// Errors: see [`Instance::new`].
    pub fn instance(&self) -> Result<Instance, ProblemError> {
        Instance::new(&self.pipeline, &self.cost, self.memory_limit)
    }
}

/// The reference directory: `$SCHEDC_SHARED/reference/zb` or `../shared/reference/zb` from
/// the workspace root, if it exists.
pub fn zb_dir() -> Option<PathBuf> {
    let base = std::env::var_os("SCHEDC_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    let d = base.join("reference/zb");
    d.is_dir().then_some(d)
}

/// Reads one configuration file.
///
/// Errors: unreadable file, malformed JSON, an unknown placement or op type.
pub fn read(path: &Path) -> Result<RefConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let raw: RawConfig =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let p = raw.p;
    let pipeline = match (raw.placement.as_str(), raw.num_chunks) {
        ("single", 1) => Pipeline::new(p, p, raw.m, PlacementKind::Loop),
        ("V", 2) => Pipeline::new(p, 2 * p, raw.m, PlacementKind::V),
        (pl, c) => return Err(format!("{}: placement {pl} with {c} chunks", raw.config_id)),
    }
    .map_err(|e| e.to_string())?;
    let stage = |r: u32, c: u32| -> u32 {
        if raw.num_chunks == 1 || c == 0 {
            r
        } else {
            2 * p - 1 - r
        }
    };
    let mut ranks = Vec::with_capacity(p as usize);
    for (r, ops) in raw.orders.iter().enumerate() {
        let mut v = Vec::with_capacity(ops.len());
        for op in ops {
            let s = stage(r as u32, op.chunk);
            v.push(match op.kind.as_str() {
                "F" => Tok::F(s),
                "B" => Tok::B(s),
                "W" => Tok::W(s),
                "BW" => Tok::BW(s),
                k => return Err(format!("{}: op type {k}", raw.config_id)),
            });
        }
        ranks.push(v);
    }
    let cost = CostModel::resolve(&format!(
        "F={},B={},W={},latency={}",
        raw.cost.f, raw.cost.b, raw.cost.w, raw.cost.comm
    ))?;
    Ok(RefConfig {
        id: raw.config_id,
        generator: raw.generator,
        cost_name: raw.cost_name,
        cost,
        pipeline,
        memory_limit: raw.memory_limit.map(|x| x.round() as u64),
        sched: Sched { ranks },
        makespan_from_t0: raw.derived.makespan_from_t0,
        max_rank_span: raw.derived.max_rank_span,
        peak: raw.derived.peak_mem_units,
        best_time: raw
            .generator_reported
            .get("best_time")
            .and_then(|v| v.as_f64()),
    })
}

/// Every configuration of the given generators in `dir`, sorted by file name.
///
/// Errors: as [`read`].
pub fn read_all(dir: &Path, generators: &[&str]) -> Result<Vec<RefConfig>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.ends_with(".json")
                && generators
                    .iter()
                    .any(|g| name.starts_with(&format!("{g}_P")))
        })
        .collect();
    files.sort();
    files.iter().map(|f| read(f)).collect()
}

/// The reference data's three cost sets, as [`CostModel::resolve`] strings (seconds per stage
/// op; `profA` also 0.05 s per cross-rank message): `unit` (F = B = W = 1), `profA` (F = 1,
/// B = 1.1, W = 0.9) and `profB` (F = 1, B = 2, W = 1). The small grid, the grid and the
/// CP-SAT check use them by name.
pub const COST_SETS: [(&str, &str); 3] = [
    ("unit", "F=1,B=1,W=1"),
    ("profA", "F=1,B=1.1,W=0.9,latency=0.05"),
    ("profB", "F=1,B=2,W=1"),
];

/// One instance of the small grid (`--example small_grid`, `dump_small`, the CP-SAT check):
/// `placement` `"loop"` (one stage per rank) or `"v"` (two), P ranks, M micro-batches, a cost
/// set of [`COST_SETS`] by name, `cap` activations per rank (stage units).
///
/// Errors: an unknown placement or cost-set name, or what [`Instance::new`] returns.
pub fn small_instance(
    placement: &str,
    p: u32,
    m: u32,
    cost: &str,
    cap: u64,
) -> Result<(Instance, CostModel), String> {
    let pl = match placement {
        "v" => Pipeline::new(p, 2 * p, m, PlacementKind::V),
        "loop" => Pipeline::new(p, p, m, PlacementKind::Loop),
        other => return Err(format!("unknown placement `{other}` (loop or v)")),
    }
    .map_err(|e| e.to_string())?;
    let spec = COST_SETS
        .iter()
        .find(|(n, _)| *n == cost)
        .map(|(_, s)| *s)
        .ok_or_else(|| format!("unknown cost set `{cost}` (unit, profA or profB)"))?;
    let cost = CostModel::resolve(spec)?;
    let inst = Instance::new(&pl, &cost, Some(cap)).map_err(|e| e.to_string())?;
    Ok((inst, cost))
}
