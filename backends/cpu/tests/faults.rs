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
