//! The small grid's instances as JSON lines, for the independent CP-SAT check
//! (`optimize/cpsat/prove.py`): P in {2, 3, 4}, M in 1..=6, the costs `unit`,
//! `profA` (F=1 B=1.1 W=0.9, 0.05 s messages) and `profB` (F=1 B=2 W=1), caps {P, 2P},
//! the loop or the V placement.
//!
//! `cargo run --release -p schedc-optimize --example dump_small -- loop|v`
use schedc::sim::cost::CostModel;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::Instance;

/// The grid's cost sets: (name, `CostModel::resolve` string).
const COSTS: [(&str, &str); 3] = [
    ("unit", "F=1,B=1,W=1"),
    ("profA", "F=1,B=1.1,W=0.9,latency=0.05"),
    ("profB", "F=1,B=2,W=1"),
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let v_place = args.iter().any(|x| x == "v");
    for p in 2..=4u32 {
        for m in 1..=6u32 {
            for (cn, cs) in COSTS {
                for cap in [p as u64, 2 * p as u64] {
                    let pl = if v_place {
                        Pipeline::new(p, 2 * p, m, PlacementKind::V).unwrap()
                    } else {
                        Pipeline::new(p, p, m, PlacementKind::Loop).unwrap()
                    };
                    let c = CostModel::resolve(cs).unwrap();
                    let inst = Instance::new(&pl, &c, Some(cap)).unwrap();
                    let line = serde_json::json!({
                        "placement": if v_place { "v" } else { "loop" },
                        "P": p, "M": m, "cost": cn, "cap": cap,
                        "rank_of": inst.rank_of,
                        "next": inst.next,
                        "prev": inst.prev,
                        "d_f": inst.d_f, "d_b": inst.d_b, "d_w": inst.d_w, "d_bw": inst.d_bw,
                        "lat": inst.lat,
                    });
                    println!("{line}");
                }
            }
        }
    }
}
