//! `cargo run -p schedc-tests --example family_dump SPEC P M F B W COMM`: both orders with
//! start times (schedc's family and the authors' generator), for looking at one point of the
//! family sweep.

use schedc::input::{load_spec_with, Overrides};
use schedc_ir::Instr;
use schedc_tests::{zb, zbv};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let spec = &a[0];
    let (p, m): (u32, u32) = (a[1].parse().unwrap(), a[2].parse().unwrap());
    let c: [f64; 4] = [3, 4, 5, 6].map(|i| a[i].parse().unwrap());
    let mode = if spec == "v_half" {
        zbv::Mode::Half
    } else {
        zbv::Mode::Min
    };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let text = std::fs::read_to_string(root.join(format!("{spec}.sched"))).unwrap();
    let ov = Overrides {
        pp: Some(p),
        microbatches: Some(m),
        ..Default::default()
    };
    let ours = load_spec_with(&text, &ov, &zb::cost_model(c))
        .unwrap()
        .program;
    let theirs = zbv::program(mode, p, m);
    for (name, prog) in [("ours", &ours), ("authors", &theirs)] {
        let (_, st) = zb::start_times(prog, c).unwrap();
        println!("{name}: makespan {:?}", zb::makespan(prog, c));
        for (r, ops) in prog.ranks.iter().enumerate() {
            let s: Vec<String> = ops
                .iter()
                .map(|i| match i {
                    Instr::Compute(o) => format!(
                        "{}@{:.2}",
                        schedc_ir::text::instr_to_string(i),
                        st[&(o.kind, o.stage, o.mb)]
                    ),
                    _ => String::new(),
                })
                .collect();
            println!("  r{r}: {}", s.join(" "));
        }
    }
}
