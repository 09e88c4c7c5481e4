//! The sidecar of a torch schedule CSV for torchtitan (`schedc convert --to torch-csv
//! --sidecar FILE`): where each stage runs, how many micro-batches a step has, and which
//! model modules each stage holds, in the shape of torchtitan's `[parallelism]` settings.
//!
//! torchtitan (pytorch/torchtitan @b5bcd76, `torchtitan/config/configs.py` and
//! `torchtitan/distributed/pipeline_parallel.py`) runs a schedule CSV given as
//! `pipeline_parallel_schedule_csv` on torch's `_PipelineScheduleRuntime` (`_load_csv`, the
//! compute_only form). It builds the stages from `module_fqns_per_model_part` (a list, per
//! stage in model order, of module names: `tok_embeddings`, `layers.0`, ..., `norm`,
//! `lm_head`) and places them by the style of `pipeline_parallel_schedule`: `"v"` (rank r
//! holds stages r and 2P-1-r) for `ZBVZeroBubble` and `DualPipeV`, else `"loop"` (rank r holds
//! r, r+P, ...). `num_pp_microbatches` is the number of micro-batches.

use super::{model_chunks, ExportError};
use schedc_ir::{PlacementKind, Program};
use serde_json::{json, Value};

/// The modules torchtitan's decoder models name: before the first layer, and after the last.
pub const EMBEDDING_FQNS: &[&str] = &["tok_embeddings"];
/// See [`EMBEDDING_FQNS`].
pub const HEAD_FQNS: &[&str] = &["norm", "lm_head"];

/// The module names of every stage, in model order, for a model of `layers` transformer
/// layers (`layers.<i>`), split as [`model_chunks`] splits it (`layout`, else schedc's
/// split).
///
/// Errors: [`model_chunks`]'s, and a layout with multi-token-prediction modules (`m`), which
/// torchtitan's decoder has no name for.
pub fn module_fqns(
    layers: u32,
    stages: u32,
    layout: Option<&str>,
) -> Result<Vec<Vec<String>>, ExportError> {
    let (chunks, _) = model_chunks(layers, stages, layout)?;
    if chunks.iter().any(|c| c.mtp > 0) {
        return Err(ExportError::Usage(
            "--layout: torchtitan's decoder has no multi-token-prediction modules (`m`)".into(),
        ));
    }
    Ok(chunks
        .iter()
        .map(|c| {
            let mut v: Vec<String> = Vec::new();
            if c.embedding {
                v.extend(EMBEDDING_FQNS.iter().map(|s| s.to_string()));
            }
            v.extend(c.layers.iter().map(|l| format!("layers.{l}")));
            if c.head {
                v.extend(HEAD_FQNS.iter().map(|s| s.to_string()));
            }
            v
        })
        .collect())
}

/// The `pipeline_parallel_schedule` whose stage placement torchtitan derives is the
/// program's, or why none is.
fn torchtitan_schedule(p: &Program) -> Result<&'static str, String> {
    let pl = &p.pipeline;
    let (pp, s) = (pl.pp, pl.stages);
    let loop_ = (0..s).all(|st| pl.stage_to_rank[st as usize] == st % pp);
    if loop_ {
        return Ok(if s == pp { "1F1B" } else { "Interleaved1F1B" });
    }
    let v = s == 2 * pp
        && (0..s)
            .all(|st| pl.stage_to_rank[st as usize] == if st < pp { st } else { 2 * pp - 1 - st });
    if v {
        return Ok("ZBVZeroBubble");
    }
    Err(format!(
        "torchtitan places stages only as a loop (rank r holds r, r+P, ...) or as a V of two stages per rank (ZBVZeroBubble, DualPipeV); this schedule places stages {:?} on ranks {:?}",
        (0..s).collect::<Vec<_>>(),
        pl.stage_to_rank
    ))
}

/// The sidecar JSON of `p`'s CSV (`csv`: the CSV's path as torchtitan will be given it).
///
/// Fields: `schedule_csv`, `pipeline_parallel_degree` (P), `stages`, `stages_per_rank`,
/// `microbatches` (M), `placement` (`loop`, `v`, `explicit`), `stage_to_rank`,
/// `stages_of_rank` (each rank's stages, ascending), `layers` (or null),
/// `module_fqns_per_model_part` (null without `layers`), and `torchtitan`: the
/// `[parallelism]` settings to give torchtitan, or null with `torchtitan_note` saying why
/// torchtitan cannot place the stages as the CSV does (the CSV and the maps still serve
/// torch's runtime directly).
///
/// Errors: a bidirectional placement ([`ExportError::Unsupported`], torch's CSV refuses it
/// too) and [`module_fqns`]'s.
pub fn sidecar(
    p: &Program,
    csv: &str,
    layers: Option<u32>,
    layout: Option<&str>,
) -> Result<String, ExportError> {
    let pl = &p.pipeline;
    if pl.placement == PlacementKind::Bidir {
        return Err(ExportError::Unsupported(
            "a bidirectional placement (two copies of each stage) has no torch schedule CSV".into(),
        ));
    }
    if layers.is_none() && layout.is_some() {
        return Err(ExportError::Usage(
            "--layout needs the model's layer count: give --layers N or --model".into(),
        ));
    }
    let fqns = layers
        .map(|n| module_fqns(n, pl.stages, layout))
        .transpose()?;
    let by_rank = pl.stages_by_rank();
    let placement = match pl.placement {
        PlacementKind::Loop => "loop",
        PlacementKind::V => "v",
        _ => "explicit",
    };
    let per_rank: Vec<usize> = by_rank.iter().map(Vec::len).collect();
    let stages_per_rank: Value = if per_rank.windows(2).all(|w| w[0] == w[1]) {
        json!(per_rank.first().copied().unwrap_or(0))
    } else {
        json!(per_rank)
    };
    let (titan, note) = match (torchtitan_schedule(p), &fqns) {
        (Ok(name), Some(f)) => (
            json!({ "parallelism": {
                "pipeline_parallel_degree": pl.pp,
                "pipeline_parallel_schedule": name,
                "pipeline_parallel_schedule_csv": csv,
                "num_pp_microbatches": pl.microbatches,
                "module_fqns_per_model_part": f,
            } }),
            Value::Null,
        ),
        (Ok(_), None) => (
            Value::Null,
            json!("give --layers N or --model to get module_fqns_per_model_part and torchtitan's settings"),
        ),
        (Err(e), _) => (Value::Null, json!(e)),
    };
    let mut fields: Vec<(&str, Value)> = vec![
        ("schedule_csv", json!(csv)),
        ("pipeline_parallel_degree", json!(pl.pp)),
        ("stages", json!(pl.stages)),
        ("stages_per_rank", stages_per_rank),
        ("microbatches", json!(pl.microbatches)),
        ("placement", json!(placement)),
        ("stage_to_rank", json!(pl.stage_to_rank)),
        ("stages_of_rank", json!(by_rank)),
        ("layers", json!(layers)),
        ("module_fqns_per_model_part", json!(fqns)),
        ("torchtitan", titan),
    ];
    if !note.is_null() {
        fields.push(("torchtitan_note", note));
    }
    let mut s = String::new();
    write_object(&mut s, &fields, 0);
    s.push('\n');
    Ok(s)
}

/// Writes `fields` as a JSON object in their order, one key per line; arrays of scalars and
/// arrays of such arrays stay on one line per inner array.
fn write_object(out: &mut String, fields: &[(&str, Value)], indent: usize) {
    let pad = "  ".repeat(indent + 1);
    out.push_str("{\n");
    for (i, (k, v)) in fields.iter().enumerate() {
        out.push_str(&format!("{pad}{}: ", Value::from(*k)));
        write_value(out, v, indent + 1);
        out.push_str(if i + 1 < fields.len() { ",\n" } else { "\n" });
    }
    out.push_str(&"  ".repeat(indent));
    out.push('}');
}

fn write_value(out: &mut String, v: &Value, indent: usize) {
    match v {
        Value::Object(m) => {
            let f: Vec<(&str, Value)> = m.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            write_object(out, &f, indent);
        }
        Value::Array(a) if a.iter().any(Value::is_array) => {
            let pad = "  ".repeat(indent + 1);
            out.push_str("[\n");
            for (i, x) in a.iter().enumerate() {
                out.push_str(&pad);
                out.push_str(&x.to_string());
                out.push_str(if i + 1 < a.len() { ",\n" } else { "\n" });
            }
            out.push_str(&"  ".repeat(indent));
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_fqns_put_the_embedding_first_and_the_head_last() {
        let f = module_fqns(6, 4, None).unwrap();
        assert_eq!(
            f,
            vec![
                vec!["tok_embeddings", "layers.0"],
                vec!["layers.1", "layers.2"],
                vec!["layers.3", "layers.4"],
                vec!["layers.5", "norm", "lm_head"],
            ]
        );
        let e = module_fqns(3, 4, None).unwrap_err();
        assert!(e.to_string().contains("3 layer(s) over 4"), "{e}");
    }
}
