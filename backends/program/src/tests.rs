use crate::format::*;
use crate::lower::LowerOptions;
use crate::mesh::Mesh;
use crate::model::ModelConfig;
use crate::verify::verify;
use schedc::input::{load_spec, Overrides};
use schedc_ir::Program;

pub(crate) fn spec(name: &str, pp: u32, mb: u32, vpp: Option<u32>) -> Program {
    let path = format!("{}/../../specs/{name}.sched", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        vpp,
        ..Default::default()
    };
    match load_spec(&text, &ov) {
        Ok(e) => e.program,
        Err(_) => panic!("spec {name} refuses P={pp} M={mb}"),
    }
}

#[test]
fn lowers_and_verifies_every_spec() {
    let cfg = ModelConfig::tiny();
    for (name, pp, mb, vpp) in [
        ("gpipe", 4, 4, None),
        ("1f1b", 4, 6, None),
        ("interleaved_1f1b", 2, 4, Some(2)),
        ("zbv", 2, 4, None),
        ("dualpipev", 2, 4, None),
        ("dualpipe", 4, 8, None),
        ("zb_h1", 2, 3, None),
        ("zb_h2", 2, 3, None),
        ("looped_bfs", 2, 2, Some(2)),
        ("interleaved_zb", 2, 4, Some(2)),
    ] {
        let src = spec(name, pp, mb, vpp);
        for mesh in [
            format!("pp={pp}"),
            format!("pp={pp},dp=2,ep=2"),
            format!("sp=2,pp={pp},ep=2"),
        ] {
            let mesh: Mesh = mesh.parse().unwrap();
            let set = ProgramSet::lower(&src, &mesh, &cfg, LowerOptions::default()).unwrap();
            let rep = verify(&set, &src).unwrap_or_else(|e| panic!("{name}: {e}"));
            // The stash peak of every rank is schedc's activation peak.
            let (live, _) = schedc::passes::liveness::analyze(&src, None);
            for (g, rp) in set.ranks.iter().enumerate() {
                assert_eq!(
                    rep.peak_stash[g] as u64, live[rp.coords.pp as usize].peak,
                    "{name} rank {g}"
                );
            }
            assert!(rep.messages > 0 && rep.collectives > 0);
        }
    }
}

#[test]
fn program_shape_1f1b() {
    let src = spec("1f1b", 2, 2, None);
    let set = ProgramSet::lower(
        &src,
        &Mesh::pipeline(2),
        &ModelConfig::tiny(),
        LowerOptions::default(),
    )
    .unwrap();
    let r0 = &set.ranks[0];
    let comm: Vec<String> = r0.streams[1].ops.iter().map(|o| o.to_string()).collect();
    // Rank 0 sends act(0,0), act(0,1) and receives grad(1,0), grad(1,1): 1F1B's order.
    let sends: Vec<&String> = comm
        .iter()
        .filter(|s| s.starts_with("send") || s.starts_with("recv"))
        .collect();
    assert_eq!(
        sends,
        vec![
            "send act(0,0) to rank 1",
            "send act(0,1) to rank 1",
            "recv grad(1,0) from rank 1",
            "recv grad(1,1) from rank 1"
        ]
    );
    // Compute: F(0,0) embeds, attends, dispatches ... and records the send event.
    let compute: Vec<String> = r0.streams[0].ops.iter().map(|o| o.to_string()).collect();
    assert_eq!(compute[0], "alloc weight_grad(0) (zeroed)");
    assert_eq!(compute[1], "alloc stash(0,0)");
    assert_eq!(compute[2], "alloc act(0,0)");
    assert_eq!(compute[3], "F(0,0).embed");
    assert_eq!(compute[4], "F(0,0).qkv[0]");
    assert!(compute[5].starts_with("all_to_all GatherKv(0,0)[0] over [0]"));
    assert_eq!(compute[6], "F(0,0).attn[0]");
    assert!(compute[7].starts_with("all_to_all Dispatch(0,0)[0]"));
    assert!(compute.iter().any(|c| c == "W(0,1).weights"));
    assert_eq!(compute.last().unwrap(), "free weight_grad(0)");
    // JSON round trip.
    let json = serde_json::to_string(&set).unwrap();
    let back: ProgramSet = serde_json::from_str(&json).unwrap();
    assert_eq!(back, set);
    assert!(json.contains("\"op\":\"kernel\""), "{}", &json[..400]);
}

#[test]
fn write_and_read_dir() {
    let src = spec("gpipe", 2, 2, None);
    let mesh: Mesh = "pp=2,ep=2".parse().unwrap();
    let set =
        ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default()).unwrap();
    let dir = std::env::temp_dir().join(format!("schedc-cpu-prog-{}", std::process::id()));
    let files = set.write_dir(&dir).unwrap();
    assert_eq!(files.len(), 5);
    let back = ProgramSet::read_dir(&dir).unwrap();
    assert_eq!(back, set);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dualpipe_replica_sum_pairs_mirror_ranks() {
    let src = spec("dualpipe", 4, 8, None);
    let set = ProgramSet::lower(
        &src,
        &Mesh::pipeline(4),
        &ModelConfig::tiny(),
        LowerOptions::default(),
    )
    .unwrap();
    for rp in &set.ranks {
        let sums: Vec<(u32, u32)> = rp.streams[1]
            .ops
            .iter()
            .filter_map(|o| match o {
                Op::ReplicaSum {
                    model_stage, peer, ..
                } => Some((*model_stage, *peer)),
                _ => None,
            })
            .collect();
        let r = rp.rank;
        let mut want = vec![(r, 3 - r), (3 - r, 3 - r)];
        want.sort();
        assert_eq!(sums, want, "rank {r}");
    }
    let bug = ProgramSet::lower(
        &src,
        &Mesh::pipeline(4),
        &ModelConfig::tiny(),
        LowerOptions {
            bug_skip_replica_sum: true,
        },
    )
    .unwrap();
    assert!(!bug
        .ranks
        .iter()
        .flat_map(|r| &r.streams[1].ops)
        .any(|o| matches!(o, Op::ReplicaSum { .. })));
}

fn first_index(rp: &RankProgram, s: usize, f: impl Fn(&Op) -> bool) -> usize {
    rp.streams[s].ops.iter().position(f).unwrap()
}

#[test]
fn verifier_catches_broken_programs() {
    let src = spec("1f1b", 2, 2, None);
    let set = ProgramSet::lower(
        &src,
        &Mesh::pipeline(2),
        &ModelConfig::tiny(),
        LowerOptions::default(),
    )
    .unwrap();
    verify(&set, &src).unwrap();

    // A wait without its record.
    let mut bad = set.clone();
    let i = first_index(&bad.ranks[0], 0, |o| matches!(o, Op::Record { .. }));
    bad.ranks[0].streams[0].ops.remove(i);
    let e = verify(&bad, &src).unwrap_err().to_string();
    assert!(e.contains("no stream records this event"), "{e}");

    // A send that no longer waits for its producer: a race on act(0,0).
    let mut bad = set.clone();
    let i = first_index(&bad.ranks[0], 1, |o| matches!(o, Op::Wait { .. }));
    bad.ranks[0].streams[1].ops.remove(i);
    let e = verify(&bad, &src).unwrap_err().to_string();
    assert!(
        e.contains("rank 0: act(0,0) is freed at comm op #1")
            && e.contains("before its allocation"),
        "{e}"
    );

    // A stash freed twice.
    let mut bad = set.clone();
    let i = first_index(&bad.ranks[1], 0, |o| {
        matches!(
            o,
            Op::Free {
                buf: Buf::Stash { .. }
            }
        )
    });
    let op = bad.ranks[1].streams[0].ops[i].clone();
    bad.ranks[1].streams[0].ops.push(op);
    let e = verify(&bad, &src).unwrap_err().to_string();
    assert!(e.contains("freed 2 times"), "{e}");

    // A buffer read after its release.
    let mut bad = set.clone();
    let ops = &mut bad.ranks[1].streams[0].ops;
    let f = ops
        .iter()
        .position(|o| {
            matches!(
                o,
                Op::Free {
                    buf: Buf::Stash { stage: 1, mb: 0 }
                }
            )
        })
        .unwrap();
    let k = ops[..f]
        .iter()
        .rposition(|o| matches!(o, Op::Kernel(_)))
        .unwrap();
    ops.swap(f, k);
    let e = verify(&bad, &src).unwrap_err().to_string();
    assert!(e.contains("after (or unordered with) its release"), "{e}");

    // A receive whose message never comes: the programs deadlock.
    let mut bad = set.clone();
    let i = first_index(&bad.ranks[0], 1, |o| matches!(o, Op::Send { .. }));
    bad.ranks[0].streams[1].ops[i] = Op::Record { event: 999 };
    bad.ranks[0].events = 1000;
    let e = verify(&bad, &src).unwrap_err().to_string();
    assert!(
        e.contains("deadlock") && e.contains("recv act(0,0) from rank 0"),
        "{e}"
    );

    // The source must verify too.
    let mut wrong = src.clone();
    wrong.ranks[0].swap(0, 2);
    let e = verify(&set, &wrong).unwrap_err().to_string();
    assert!(e.contains("does not verify"), "{e}");
}

#[test]
fn refuses_what_it_cannot_run() {
    let src = spec("1f1b", 2, 2, None);
    let mesh: Mesh = "pp=2,ep=3".parse().unwrap();
    let e =
        ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default()).unwrap_err();
    assert!(
        e.to_string()
            .contains("ep=3 does not divide the model's 4 experts"),
        "{e}"
    );
    let mesh: Mesh = "pp=4".parse().unwrap();
    let e =
        ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default()).unwrap_err();
    assert!(
        e.to_string().contains("pp=4, but the schedule has 2"),
        "{e}"
    );
}
