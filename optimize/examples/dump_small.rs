//! The small grid's instances as JSON lines, for the independent CP-SAT check
//! (`optimize/cpsat/prove.py`): P in {2, 3, 4}, M in 1..=6, the cost sets of
//! [`schedc_optimize::refdata::COST_SETS`] (`unit`, `profA`, `profB`), caps {P, 2P}, the loop
//! or the V placement ([`schedc_optimize::refdata::small_instance`]).
//!
//! `cargo run --release -p schedc-optimize --example dump_small -- loop|v`
use schedc_optimize::refdata::{small_instance, COST_SETS};
use std::io::Write;

fn main() {
    let placement = match std::env::args().nth(1).as_deref() {
        Some("v") => "v",
        Some("loop") => "loop",
        _ => {
            eprintln!("usage: dump_small loop|v");
            std::process::exit(2);
        }
    };
    let mut out = std::io::stdout().lock();
    for p in 2..=4u32 {
        for m in 1..=6u32 {
            for (cn, _) in COST_SETS {
                for cap in [p as u64, 2 * p as u64] {
                    let (inst, _) = small_instance(placement, p, m, cn, cap).unwrap();
                    let mut line = inst.model_json();
                    line["placement"] = placement.into();
                    line["P"] = p.into();
                    line["M"] = m.into();
                    line["cost"] = cn.into();
                    // A closed pipe (`| head`) ends the dump quietly.
                    if writeln!(out, "{line}").is_err() {
                        return;
                    }
                }
            }
        }
    }
}
