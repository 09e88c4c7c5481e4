//! Schedules found by the search train exactly like sequential training on the CPU
//! backend (schedc-cpu's executor and reference, as in backends/cpu/tests/equivalence.rs):
//! loss, every gradient and the parameters after two SGD steps within 1e-10 relative, for
//! loop and V placements, caps from tight to loose, messages with latency (so the lowered
//! program uses one channel per stage boundary) and overlapped pairs.

use schedc::sim::cost::CostModel;
use schedc_cpu::exec::{compare, execute, reference, Batching, Data, ExecOptions, Optimizer};
use schedc_cpu::model::ModelConfig;
use schedc_ir::{Pipeline, PlacementKind};
use schedc_optimize::search::{optimize, Options};
use schedc_optimize::{verify, Instance, Tok};
use schedc_program::mesh::{Dim, Mesh};
use schedc_program::{LowerOptions, ProgramSet};

const TOL: f64 = 1e-10;

#[test]
fn optimized_schedules_equal_sequential_training() {
    let cases: &[(u32, u32, u32, &str, u64)] = &[
        (2, 4, 1, "F=1,B=1,W=1", 2),
        (4, 8, 1, "F=1,B=1.1,W=0.9,latency=0.05", 4),
        (4, 6, 1, "F=1,B=2,W=1", 8),
        (2, 4, 2, "F=1,B=1,W=1", 2),
        (4, 8, 2, "F=1,B=1.1,W=0.9,latency=0.05", 8),
        (2, 4, 2, "F=1,B=1,W=1,FB=1.5", 4),
    ];
    let cfg = ModelConfig::tiny();
    let mut pairs_seen = false;
    for &(p, m, v, cost, cap) in cases {
        let pl = if v == 1 {
            Pipeline::new(p, p, m, PlacementKind::Loop).unwrap()
        } else {
            Pipeline::new(p, v * p, m, PlacementKind::V).unwrap()
        };
        let c = CostModel::resolve(cost).unwrap();
        let inst = Instance::new(&pl, &c, Some(cap)).unwrap();
        let out = optimize(
            &inst,
            &[],
            &Options {
                effort: 0.1,
                ..Options::default()
            },
            &|_| {},
        );
        pairs_seen |= out
            .best
            .ranks
            .iter()
            .flatten()
            .any(|t| matches!(t, Tok::Pair { .. }));
        let ver = verify(&inst, &c, &out.best).unwrap();
        let mesh: Mesh = format!("pp={p}").parse().unwrap();
        let set = ProgramSet::lower(&ver.program, &mesh, &cfg, LowerOptions::default())
            .unwrap_or_else(|e| panic!("P={p} M={m} V={v} {cost}: {e}"));
        let data = Data::builtin();
        let opt = Optimizer::Sgd { lr: 0.2 };
        let opts = ExecOptions {
            steps: 2,
            optimizer: opt,
            record: true,
            ..ExecOptions::default()
        };
        let run = execute::<f64>(&set, &data, &opts).unwrap();
        let b = Batching {
            shards: mesh.data_shards() as usize,
            microbatches: (set.manifest.microbatches * set.manifest.directions) as usize,
            sp: mesh.size(Dim::Sp) as usize,
        };
        let r =
            reference::<f64>(&cfg, set.manifest.model_stages as usize, b, &data, 2, &opt).unwrap();
        let cmp = compare(&run, &r).unwrap();
        println!(
            "P={p} M={m} V={v} {cost} cap {cap}: makespan {} grad {:.2e} loss {:.2e} params {:.2e}",
            ver.sim.makespan, cmp.max_rel_grad_err, cmp.max_abs_loss_err, cmp.max_rel_param_err
        );
        assert!(cmp.tensors_compared > 0);
        assert!(
            cmp.max_rel_grad_err < TOL && cmp.max_abs_loss_err < TOL && cmp.max_rel_param_err < TOL,
            "P={p} M={m} V={v} {cost}: {cmp:?}"
        );
    }
    assert!(
        pairs_seen,
        "the FB = 1.5 case pairs some forward with a backward"
    );
}
