//! Faults stop every rank with an error naming the rank, the instruction and what it waited
//! for, within a bounded time: never a hang.

use schedc::input::{load_spec, Overrides};
use schedc_cpu::exec::{execute, Data, ExecError, ExecOptions, Faults};
use schedc_cpu::model::ModelConfig;
use schedc_program::mesh::Mesh;
use schedc_program::{LowerOptions, ProgramSet};
use std::time::{Duration, Instant};

fn set(name: &str, pp: u32, mb: u32, mesh: &str) -> ProgramSet {
    let path = format!("{}/../../specs/{name}.sched", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        ..Default::default()
    };
    let src = load_spec(&text, &ov).ok().unwrap().program;
    let mesh: Mesh = mesh.parse().unwrap();
    ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default()).unwrap()
}

#[test]
fn a_panicking_rank_stops_every_rank() {
    let s = set("1f1b", 4, 4, "pp=4,ep=2");
    // Global rank 5 = pipeline rank 2, EP rank 1; its compute op #10 of step 1.
    let op = s.ranks[5].streams[0].ops[10].to_string();
    let opts = ExecOptions {
        steps: 2,
        timeout: Duration::from_secs(30),
        faults: Faults {
            panic_at: Some((5, 1, 10)),
            ..Faults::default()
        },
        ..ExecOptions::default()
    };
    let t = Instant::now();
    let e = execute::<f64>(&s, &Data::builtin(), &opts).unwrap_err();
    // Far below the 30 s timeout: the others stop on the abort flag, not by timing out.
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!(
            "rank 5 at step 1, compute op #10 `{op}` panicked: injected fault"
        )),
        "{msg}"
    );
    let ExecError::Panic { at, .. } = &e.cause else {
        panic!("{e:?}")
    };
    assert_eq!((at.rank, at.step, at.index), (5, 1, 10));
    // Every other rank either finished its work or stopped naming rank 5.
    for st in &e.stopped {
        match st {
            ExecError::Aborted { cause, at } => {
                assert_eq!(*cause, 5);
                assert!(!at.op.is_empty());
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert!(e.stopped.len() >= 6, "{}", e.stopped.len());
    assert!(msg.contains("stopped within"), "{msg}");
}

#[test]
fn a_lost_message_times_out_with_the_waiting_rank_and_instruction() {
    // 1F1B, P=2, M=2: rank 1 sends grad(1,0) then grad(1,1) to rank 0. Lose the second:
    // rank 0 alone waits for it.
    let s = set("1f1b", 2, 2, "pp=2");
    let opts = ExecOptions {
        steps: 1,
        timeout: Duration::from_millis(500),
        faults: Faults {
            drop_message: Some((1, 0, 1)),
            ..Faults::default()
        },
        ..ExecOptions::default()
    };
    let t = Instant::now();
    let e = execute::<f64>(&s, &Data::builtin(), &opts).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let ExecError::Timeout {
        at,
        waiting_for,
        blocked,
        ..
    } = &e.cause
    else {
        panic!("{e:?}")
    };
    assert_eq!(at.rank, 0);
    assert_eq!(at.stream, "comm");
    assert_eq!(at.op, "recv grad(1,1) from rank 1");
    assert_eq!(
        waiting_for,
        "the gradient of stage 1, micro-batch 1 from rank 1"
    );
    assert!(
        blocked.iter().any(|b| b.starts_with("compute op #")),
        "{blocked:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("rank 0 at step 0, comm op #") && msg.contains("waited 0.5 s for the gradient of stage 1, micro-batch 1 from rank 1, which never came"),
        "{msg}"
    );
}

#[test]
fn a_lost_message_mid_pipeline_stops_every_rank_in_bounded_time() {
    // Lose rank 1's first activation to rank 2 on a 4-rank, 2-replica mesh: ranks 2 and 3
    // of that pipeline wait, the EP peers of rank 2 wait in an all-to-all, everyone stops.
    let s = set("1f1b", 4, 4, "pp=4,ep=2");
    // Global ranks: pipeline rank p, EP rank e is 2p + e; rank 2 (p=1) sends to 4 (p=2).
    let opts = ExecOptions {
        steps: 1,
        timeout: Duration::from_millis(500),
        faults: Faults {
            drop_message: Some((2, 4, 0)),
            ..Faults::default()
        },
        ..ExecOptions::default()
    };
    let t = Instant::now();
    let e = execute::<f64>(&s, &Data::builtin(), &opts).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let ExecError::Timeout {
        at, waiting_for, ..
    } = &e.cause
    else {
        panic!("{e:?}")
    };
    assert!(!at.op.is_empty() && !waiting_for.is_empty(), "{e}");
    // Every rank that did not finish reports where it stopped.
    for st in &e.stopped {
        assert!(!st.to_string().is_empty());
    }
    assert!(e.to_string().contains("which never came"), "{e}");
}

/// Issue 11, item 4: `--verify` fails when a gradient differs beyond the dtype's tolerance,
/// names the worst tensor with its step and rank, and a NaN anywhere is a failure, never a
/// zero difference.
#[test]
fn verify_fails_above_the_tolerance_and_on_nan() {
    use schedc_cpu::exec::{compare, ExecResult, Reference};
    use schedc_cpu::{RunConfig, Tolerance};
    let path = format!("{}/../../specs/1f1b.sched", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let ov = Overrides {
        pp: Some(2),
        microbatches: Some(2),
        ..Default::default()
    };
    let src = load_spec(&text, &ov).ok().unwrap().program;
    // A bug that only SP shows (the causal mask by local positions): the comparison catches
    // it, and the report says so.
    let mut cfg = RunConfig {
        mesh: Some("pp=2,sp=2".parse().unwrap()),
        verify: true,
        model: ModelConfig::tiny(),
        ..RunConfig::default()
    };
    cfg.model.bugs.local_causal_mask = true;
    let rep = schedc_cpu::run(&src, &cfg).unwrap();
    let v = rep.verify.as_ref().unwrap();
    assert!(!v.verify_passed, "{}", rep.to_human());
    let worst = &v.worst;
    assert!(worst.grad.contains(" at step 0 on rank "), "{}", worst.grad);
    assert!(
        rep.to_human().contains("verify FAILED"),
        "{}",
        rep.to_human()
    );
    cfg.model.bugs.local_causal_mask = false;
    let rep = schedc_cpu::run(&src, &cfg).unwrap();
    assert!(
        rep.verify.as_ref().unwrap().verify_passed,
        "{}",
        rep.to_human()
    );
    // NaN: a gradient of the run, a loss, a parameter.
    let named = |v: f64| vec![("w".to_string(), vec![1.0, v])];
    let run = |g: f64, loss: f64, p: f64| ExecResult {
        losses: vec![loss],
        grads: vec![vec![(1, 0, named(g))]],
        params: vec![(1, 0, named(p))],
        ..ExecResult::default()
    };
    let reference = Reference {
        losses: vec![2.0],
        grads: vec![named(2.0)],
        params: named(2.0),
        seconds: 0.0,
    };
    let tol = Tolerance::of(schedc_cpu::DType::F64);
    let ok = compare(&run(2.0, 2.0, 2.0), &reference).unwrap();
    assert_eq!(tol.judge(&ok), Ok(()));
    for (g, l, p, what) in [
        (f64::NAN, 2.0, 2.0, "gradient"),
        (2.0, f64::NAN, 2.0, "loss"),
        (2.0, 2.0, f64::NAN, "parameter"),
    ] {
        let c = compare(&run(g, l, p), &reference).unwrap();
        let e = tol.judge(&c).unwrap_err();
        assert!(e.contains(what) && e.contains("NaN"), "{e}");
    }
    let c = compare(&run(f64::NAN, 2.0, 2.0), &reference).unwrap();
    assert!(c.max_rel_grad_err.is_nan() && c.first_step_rel_grad_err.is_nan());
    assert_eq!(c.worst_grad, "w at step 0 on rank 1");
    // Just above the f64 tolerance fails; f32's is looser, and NaN fails it too.
    let c = compare(&run(2.0 + 2.0 * 2e-9, 2.0, 2.0), &reference).unwrap();
    assert!(tol
        .judge(&c)
        .unwrap_err()
        .starts_with("relative gradient difference"));
    let t32 = Tolerance::of(schedc_cpu::DType::F32);
    assert_eq!(t32.judge(&c), Ok(()));
    let c = compare(&run(f64::NAN, 2.0, 2.0), &reference).unwrap();
    assert!(t32.judge(&c).is_err());
    let c = compare(&run(2.0, 2.1, 2.0), &reference).unwrap();
    assert!(t32.judge(&c).unwrap_err().contains("loss"));
}
