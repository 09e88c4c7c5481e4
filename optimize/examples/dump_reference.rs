//! The Zero Bubble reference configurations (`zb1p`, `zb2p`, `vauto1p`, `vauto2p` of
//! `shared/reference/zb/`) as JSON lines for the CP-SAT model (`optimize/cpsat/prove.py`):
//! each configuration's instance at its memory limit and placement (as
//! [`schedc_optimize::refdata::RefConfig::instance`] builds it), with its id and the authors'
//! from-start makespan (`derived.makespan_from_t0`) as labels that pass through.
//!
//! `cargo run --release -p schedc-optimize --example dump_reference -- [FILTER]`
use schedc_ir::PlacementKind;
use schedc_optimize::refdata::{read_all, zb_dir};
use std::io::Write;

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    let Some(dir) = zb_dir() else {
        eprintln!("shared/reference/zb not found (see README.md: the shared folder)");
        std::process::exit(2);
    };
    let cfgs = read_all(&dir, &["zb1p", "zb2p", "vauto1p", "vauto2p"]).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let mut out = std::io::stdout().lock();
    for c in cfgs.iter().filter(|c| c.id.contains(&filter)) {
        let inst = c.instance().unwrap_or_else(|e| {
            eprintln!("{}: {e}", c.id);
            std::process::exit(2);
        });
        if c.memory_limit.is_none() {
            // The model needs a cap; every configuration of these generators has one.
            eprintln!("{}: no memory limit", c.id);
            std::process::exit(2);
        }
        let mut line = inst.model_json();
        line["id"] = c.id.clone().into();
        line["authors"] = c.makespan_from_t0.into();
        line["placement"] = if c.pipeline.placement == PlacementKind::V {
            "v"
        } else {
            "loop"
        }
        .into();
        line["P"] = inst.p.into();
        line["M"] = inst.m.into();
        line["cost"] = c.cost_name.clone().into();
        if writeln!(out, "{line}").is_err() {
            return;
        }
    }
}
