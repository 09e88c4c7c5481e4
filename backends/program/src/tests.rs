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
        ("interleaved_1f1b_a2a", 2, 4, Some(2)),
        ("zbv", 2, 4, None),
        ("dualpipev", 2, 4, None),
        ("dualpipe", 4, 8, None),
        ("zb_h1", 2, 3, None),
        ("zb_h2", 2, 3, None),
        ("looped_bfs", 2, 2, Some(2)),
        ("interleaved_zb", 2, 4, Some(2)),
        ("1f1b_offload", 4, 8, None),
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
            ..Default::default()
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

fn stage_opts() -> LowerOptions {
    LowerOptions {
        granularity: Granularity::Stage,
        ..Default::default()
    }
}

fn ir(text: &str) -> Program {
    schedc_ir::text::parse(text).unwrap().program
}

/// Every compute op of the IR, in the rank's order, as the stage granularity prints it.
fn ir_ops(src: &Program, r: usize) -> Vec<String> {
    let out = schedc::check::check(src, None, &Default::default());
    let lowered = out.checked.unwrap();
    let mut v = Vec::new();
    for ins in &lowered.ranks[r] {
        match ins {
            schedc_ir::Instr::Overlap { fwd, bwd }
                if fwd.part == schedc_ir::Part::Whole
                    && bwd.part == schedc_ir::Part::Whole
                    && (fwd.stage, fwd.mb) != (bwd.stage, bwd.mb) =>
            {
                v.push(format!(
                    "{}({},{}) & {}({},{})",
                    fwd.kind.as_str(),
                    fwd.stage,
                    fwd.mb,
                    bwd.kind.as_str(),
                    bwd.stage,
                    bwd.mb
                ))
            }
            _ => ins.for_each_compute(|c| {
                let part = if c.part == schedc_ir::Part::Whole {
                    String::new()
                } else {
                    format!(".{}", c.part.as_str())
                };
                v.push(format!("{}({},{}){part}", c.kind.as_str(), c.stage, c.mb))
            }),
        }
    }
    v
}

#[test]
fn stage_granularity_lowers_and_verifies_every_spec() {
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
        ("1f1b_offload", 4, 8, None),
    ] {
        let src = spec(name, pp, mb, vpp);
        for mesh in [format!("pp={pp}"), format!("pp={pp},dp=2")] {
            let mesh: Mesh = mesh.parse().unwrap();
            let set = ProgramSet::lower(&src, &mesh, &cfg, stage_opts()).unwrap();
            assert_eq!(set.manifest.granularity, Granularity::Stage);
            assert!(set.manifest.model.is_none());
            let rep = verify(&set, &src).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (live, _) = schedc::passes::liveness::analyze(&src, None);
            for (g, rp) in set.ranks.iter().enumerate() {
                let pr = rp.coords.pp as usize;
                assert_eq!(rep.peak_stash[g] as u64, live[pr].peak, "{name} rank {g}");
                // One kernel (or pair) per IR op, in the IR's order.
                let got: Vec<String> = rp.streams[0]
                    .ops
                    .iter()
                    .filter(|o| matches!(o, Op::Kernel(_) | Op::Overlap { .. }))
                    .map(|o| o.to_string())
                    .collect();
                assert_eq!(got, ir_ops(&src, pr), "{name} rank {g}");
            }
            // DualPipe pairs mirror ranks; data parallelism adds an all-reduce group.
            if mesh.size(crate::mesh::Dim::Dp) == 2 {
                assert!(set.manifest.groups.iter().any(|g| g.len() == 2));
            }
            assert_eq!(set.manifest.channels, vec![0]);
        }
    }
}

#[test]
fn stage_granularity_program_of_1f1b() {
    let src = spec("1f1b", 2, 2, None);
    let set =
        ProgramSet::lower(&src, &Mesh::pipeline(2), &ModelConfig::tiny(), stage_opts()).unwrap();
    let texts = |r: usize, s: usize| -> Vec<String> {
        set.ranks[r].streams[s]
            .ops
            .iter()
            .map(|o| o.to_string())
            .collect()
    };
    assert_eq!(
        texts(0, 0),
        [
            "alloc weight_grad(0) (zeroed)",
            "alloc stash(0,0)",
            "alloc act(0,0)",
            "F(0,0)",
            "record e0",
            "alloc stash(0,1)",
            "alloc act(0,1)",
            "F(0,1)",
            "record e1",
            "wait e2",
            "BW(0,0)",
            "free grad(1,0)",
            "free stash(0,0)",
            "wait e3",
            "BW(0,1)",
            "free grad(1,1)",
            "free stash(0,1)",
            "record e4",
            "wait e5",
            "optimizer_step stage 0",
            "free weight_grad(0)",
        ]
    );
    assert_eq!(
        texts(1, 0)[..8],
        [
            "alloc weight_grad(1) (zeroed)",
            "wait e0",
            "alloc stash(1,0)",
            "F(1,0)",
            "free act(0,0)",
            "alloc grad(1,0)",
            "BW(1,0)",
            "record e2",
        ]
    );
    // The kernels say what they touch: BW(1,0) reads its stash and the gradient
    // accumulator, writes the input gradient it sends.
    let bw = set.ranks[1].streams[0]
        .ops
        .iter()
        .find_map(|o| match o {
            Op::Kernel(k) if k.pass == Pass::BW => Some(k.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        (bw.reads, bw.writes),
        (
            vec![Buf::Stash { stage: 1, mb: 0 }, Buf::WeightGrad { stage: 1 }],
            vec![
                Buf::Grad { stage: 1, mb: 0 },
                Buf::Stash { stage: 1, mb: 0 },
                Buf::WeightGrad { stage: 1 }
            ]
        )
    );
    // JSON: `"part": "stage"`, no `moe` for a whole op; round trip.
    let json = serde_json::to_string(&set).unwrap();
    assert!(json.contains(r#""pass":"BW","stage":1,"mb":0,"part":"stage","reads""#));
    let back: ProgramSet = serde_json::from_str(&json).unwrap();
    assert_eq!(back, set);
}

#[test]
fn stage_granularity_pairs_parts_channels_and_collectives() {
    // DualPipeV's F&B pairs become overlap ops.
    let src = spec("dualpipev", 2, 4, None);
    let set =
        ProgramSet::lower(&src, &Mesh::pipeline(2), &ModelConfig::tiny(), stage_opts()).unwrap();
    let pairs: Vec<String> = set.ranks[0].streams[0]
        .ops
        .iter()
        .filter(|o| matches!(o, Op::Overlap { .. }))
        .map(|o| o.to_string())
        .collect();
    assert_eq!(pairs[0], "F(0,3) & BW(3,1)");

    // MoE parts: one kernel each; the forward's first part waits for and frees the input,
    // its last writes the output; the backward's parts run in reverse.
    let src = ir("pp 2\nstages 2\nmicrobatches 1\nplacement loop\n\
         rank 0: F(0,0).attn F(0,0).dispatch F(0,0).mlp F(0,0).combine BW(0,0).combine BW(0,0).mlp BW(0,0).dispatch BW(0,0).attn\n\
         rank 1: F(1,0).attn F(1,0).dispatch F(1,0).mlp F(1,0).combine B(1,0).combine B(1,0).mlp B(1,0).dispatch B(1,0).attn W(1,0)\n");
    let set =
        ProgramSet::lower(&src, &Mesh::pipeline(2), &ModelConfig::tiny(), stage_opts()).unwrap();
    verify(&set, &src).unwrap();
    let r1: Vec<String> = set.ranks[1].streams[0]
        .ops
        .iter()
        .map(|o| o.to_string())
        .collect();
    assert_eq!(
        r1,
        [
            "alloc weight_grad(1) (zeroed)",
            "wait e0",
            "alloc stash(1,0)",
            "F(1,0).attn",
            "free act(0,0)",
            "F(1,0).dispatch",
            "F(1,0).mlp",
            "F(1,0).combine",
            "B(1,0).combine",
            "B(1,0).mlp",
            "B(1,0).dispatch",
            "alloc grad(1,0)",
            "B(1,0).attn",
            "record e1",
            "W(1,0)",
            "free stash(1,0)",
            "record e2",
            "wait e3",
            "optimizer_step stage 1",
            "free weight_grad(1)",
        ]
    );
    // The model granularity runs the same parts as schedc's kernels, their all-to-alls on
    // the `ep` stream.
    let model = ProgramSet::lower(
        &src,
        &Mesh::pipeline(2),
        &ModelConfig::tiny(),
        LowerOptions::default(),
    )
    .unwrap();
    verify(&model, &src).unwrap();
    assert!(model
        .ranks
        .iter()
        .all(|rp| rp.streams.last().unwrap().kind == StreamKind::Ep));

    // Channels: one comm stream each, listed in the manifest.
    let src = ir("pp 2\nstages 2\nmicrobatches 2\nplacement loop\n\
         rank 0: F(0,0) SA(0,0->1) F(0,1) SA(0,1->1) RG(1,0<-1@1) BW(0,0) RG(1,1<-1@1) BW(0,1)\n\
         rank 1: RA(0,0<-0) F(1,0) BW(1,0) SG(1,0->0@1) RA(0,1<-0) F(1,1) BW(1,1) SG(1,1->0@1)\n");
    let set =
        ProgramSet::lower(&src, &Mesh::pipeline(2), &ModelConfig::tiny(), stage_opts()).unwrap();
    verify(&set, &src).unwrap();
    assert_eq!(set.manifest.channels, vec![0, 1]);
    assert_eq!(
        set.ranks[0].streams[2].kind,
        StreamKind::Comm { channel: 1 }
    );

    // The schedule's collectives: on the comm stream, in order, their group in the manifest.
    let src = ir(
        "pp 2\nstages 2\nmicrobatches 1\nplacement loop\ngroup ep 1 0\n\
         rank 0: F(0,0) SA(0,0->1) A2A(ep,dispatch.0) A2A(ep,combine.0) RG(1,0<-1) BW(0,0)\n\
         rank 1: RA(0,0<-0) F(1,0) A2A(ep,dispatch.0) A2A(ep,combine.0) BW(1,0) SG(1,0->0)\n",
    );
    let set =
        ProgramSet::lower(&src, &Mesh::pipeline(2), &ModelConfig::tiny(), stage_opts()).unwrap();
    let rep = verify(&set, &src).unwrap();
    assert_eq!(set.manifest.groups, vec![vec![0, 1]]);
    let colls: Vec<String> = set.ranks[0].streams[1]
        .ops
        .iter()
        .filter(|o| matches!(o, Op::Collective { .. }))
        .map(|o| o.to_string())
        .collect();
    assert_eq!(
        colls,
        [
            "collective ep:dispatch.0 over [1, 0]",
            "collective ep:combine.0 over [1, 0]"
        ]
    );
    assert_eq!(rep.collectives, 2);
    // Swapping one rank's two collectives is caught by the program verifier.
    let mut bad = set.clone();
    let ops = &mut bad.ranks[1].streams[1].ops;
    let i = ops
        .iter()
        .position(|o| matches!(o, Op::Collective { .. }))
        .unwrap();
    ops.swap(i, i + 1);
    let e = verify(&bad, &src).unwrap_err().to_string();
    assert!(e.contains("deadlock") && e.contains("collective ep"), "{e}");
}

#[test]
fn stage_granularity_accepts_tp_and_sp_sending_to_the_same_coordinates() {
    // issue 23 (3): the user's stages do TP and SP over the runtime's groups; each (tp, sp)
    // rank of a stage sends its own activations to the rank of the same coordinates in the
    // next stage, and the program has no TP collective of its own.
    let src = spec("1f1b", 2, 2, None);
    for m in ["pp=2,tp=2", "pp=2,sp=2", "pp=2,tp=2,sp=2,dp=2"] {
        let mesh: Mesh = m.parse().unwrap();
        let set = ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), stage_opts())
            .unwrap_or_else(|e| panic!("{m}: {e}"));
        assert_eq!(set.ranks.len() as u32, mesh.world(), "{m}");
        for (g, r) in set.ranks.iter().enumerate() {
            for s in &r.streams {
                for op in &s.ops {
                    let peer = match op {
                        Op::Send { peer, .. } | Op::Recv { peer, .. } => *peer,
                        Op::Collective { .. } => panic!("{m}: rank {g} has a collective"),
                        _ => continue,
                    };
                    let (a, b) = (&r.coords, &set.ranks[peer as usize].coords);
                    assert_eq!(
                        (a.tp, a.sp, a.dp, a.ep),
                        (b.tp, b.sp, b.dp, b.ep),
                        "{m}: rank {g} -> {peer}"
                    );
                    assert_ne!(a.pp, b.pp, "{m}: rank {g} -> {peer}");
                }
            }
        }
    }
}

#[test]
fn read_dir_refuses_another_format_version() {
    let src = spec("gpipe", 2, 2, None);
    let set =
        ProgramSet::lower(&src, &Mesh::pipeline(2), &ModelConfig::tiny(), stage_opts()).unwrap();
    let dir = std::env::temp_dir().join(format!("schedc-prog-v1-{}", std::process::id()));
    set.write_dir(&dir).unwrap();
    let back = ProgramSet::read_dir(&dir).unwrap();
    assert_eq!(back, set);
    let m = dir.join("manifest.json");
    let text = std::fs::read_to_string(&m)
        .unwrap()
        .replace("\"format_version\": 2", "\"format_version\": 1");
    std::fs::write(&m, text).unwrap();
    let e = ProgramSet::read_dir(&dir).unwrap_err();
    assert!(e.contains("format version 1, this backend reads 2"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `spec` split into MoE parts at every stage (`--moe=all`).
fn moe(p: &Program) -> Program {
    let stages: Vec<u32> = (0..p.pipeline.stages).collect();
    schedc::moe::split(p, None, &stages).0
}

#[test]
fn moe_parts_lower_and_verify_every_spec() {
    let cfg = ModelConfig::tiny();
    for (name, pp, mb, vpp) in [
        ("gpipe", 2, 4, None),
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
        let src = moe(&spec(name, pp, mb, vpp));
        for mesh in [
            format!("pp={pp},ep=2"),
            format!("sp=2,pp={pp},ep=2"),
            format!("pp={pp},dp=2,ep=4"),
        ] {
            let mesh: Mesh = mesh.parse().unwrap();
            let set = ProgramSet::lower(&src, &mesh, &cfg, LowerOptions::default())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let rep = verify(&set, &src).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (live, _) = schedc::passes::liveness::analyze(&src, None);
            for (g, rp) in set.ranks.iter().enumerate() {
                assert_eq!(
                    rep.peak_stash[g] as u64, live[rp.coords.pp as usize].peak,
                    "{name} rank {g}"
                );
                // The EP stream is last and holds every EP all-to-all; the compute stream
                // keeps only the sequence-parallel ones.
                let ep = rp.streams.last().unwrap();
                assert_eq!(ep.kind, StreamKind::Ep, "{name}");
                for (s, st) in rp.streams.iter().enumerate() {
                    for op in &st.ops {
                        if let Op::AllToAll { phase, .. } = op {
                            let sp = matches!(phase, A2a::GatherKv | A2a::ScatterKvGrad);
                            assert_eq!(sp, s == 0, "{name}: {op} on {}", st.kind);
                        }
                    }
                }
            }
        }
    }
}

/// One rank, two stages: the overlapped pairs `F(0,1)&BW(1,0)` and `F(1,1)&BW(0,0)` in
/// DeepSeek's order, split by `--moe`.
const PAIRS: &str = "pp 1\nstages 2\nmicrobatches 2\nplacement 0 0\nrank 0: F(0,0) F(1,0) F(0,1)&BW(1,0) F(1,1)&BW(0,0) BW(1,1) BW(0,1)\n";

fn texts(ops: &[Op], f: impl Fn(&Op) -> bool) -> Vec<String> {
    ops.iter().filter(|o| f(o)).map(|o| o.to_string()).collect()
}

#[test]
fn an_overlapped_pair_interleaves_its_kernels_and_puts_its_all_to_alls_on_the_ep_stream() {
    let src = moe(&schedc_ir::text::parse(PAIRS).unwrap().program);
    let mesh: Mesh = "pp=1,ep=2".parse().unwrap();
    let set =
        ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default()).unwrap();
    verify(&set, &src).unwrap();
    let r0 = &set.ranks[0];
    let kernels = texts(&r0.streams[0].ops, |o| matches!(o, Op::Kernel(_)));
    // The first pair: B's combine, F's attention (with the embedding), B's MLP, F's MLP, B's attention, then
    // F's combine kernel (after its combine all-to-all, which ran under B's attention),
    // then BW's weight gradient.
    let i = kernels
        .iter()
        .position(|k| k == "B(1,0).combine[0]")
        .unwrap();
    assert_eq!(
        kernels[i..i + 10].to_vec(),
        [
            "B(1,0).combine[0]",
            "F(0,1).embed",
            "F(0,1).qkv[0]",
            "F(0,1).attn[0]",
            "B(1,0).experts[0]",
            "F(0,1).experts[0]",
            "B(1,0).attn[0]",
            "B(1,0).qkv[0]",
            "F(0,1).combine[0]",
            "W(1,0).weights",
        ]
    );
    let ep = &r0.streams.last().unwrap().ops;
    let a2a = texts(ep, |o| matches!(o, Op::AllToAll { .. }));
    // Plain F(0,0), F(1,0), then the pair's four in its order.
    assert_eq!(
        a2a[4..8].to_vec(),
        [
            "all_to_all CombineGrad(1,0)[0] over [0, 1]",
            "all_to_all Dispatch(0,1)[0] over [0, 1]",
            "all_to_all DispatchGrad(1,0)[0] over [0, 1]",
            "all_to_all Combine(0,1)[0] over [0, 1]",
        ]
    );
    // Each EP all-to-all waits for an event of the compute stream and records one that
    // the compute stream waits for.
    for w in ep.chunks(3) {
        assert!(matches!(
            w,
            [Op::Wait { .. }, Op::AllToAll { .. }, Op::Record { .. }]
        ));
    }
}

#[test]
fn two_layers_run_the_pair_order_once_per_layer() {
    let src = moe(&schedc_ir::text::parse(PAIRS).unwrap().program);
    let cfg = ModelConfig {
        layers_per_stage: 2,
        ..ModelConfig::tiny()
    };
    let set = ProgramSet::lower(&src, &Mesh::pipeline(1), &cfg, LowerOptions::default()).unwrap();
    verify(&set, &src).unwrap();
    let ep = &set.ranks[0].streams.last().unwrap().ops;
    let a2a = texts(ep, |o| matches!(o, Op::AllToAll { .. }));
    // The forward's layer 0 pairs with the backward's layer 1, then layer 1 with layer 0.
    assert_eq!(
        a2a[8..16].to_vec(),
        [
            "all_to_all CombineGrad(1,0)[1] over [0]",
            "all_to_all Dispatch(0,1)[0] over [0]",
            "all_to_all DispatchGrad(1,0)[1] over [0]",
            "all_to_all Combine(0,1)[0] over [0]",
            "all_to_all CombineGrad(1,0)[0] over [0]",
            "all_to_all Dispatch(0,1)[1] over [0]",
            "all_to_all DispatchGrad(1,0)[0] over [0]",
            "all_to_all Combine(0,1)[1] over [0]",
        ]
    );
}

#[test]
fn interleaved_parts_of_dependent_ops_need_one_layer_per_stage() {
    // F(0,1)'s parts span F(0,0)'s end and F(1,0)'s start, and F(1,0) needs F(0,0)'s output.
    let text = "pp 1\nstages 2\nmicrobatches 2\nplacement 0 0\nmoe 0 1\nrank 0: \
        F(0,0).attn F(0,1).attn F(0,0).dispatch F(0,0).mlp F(0,0).combine \
        F(1,0).attn F(0,1).dispatch F(1,0).dispatch F(1,0).mlp F(0,1).mlp F(1,0).combine F(0,1).combine \
        F(1,1) BW(1,1) BW(1,0) BW(0,0) BW(0,1)\n";
    let src = schedc_ir::text::parse(text).unwrap().program;
    let one = ProgramSet::lower(
        &src,
        &Mesh::pipeline(1),
        &ModelConfig::tiny(),
        LowerOptions::default(),
    )
    .unwrap();
    verify(&one, &src).unwrap();
    let cfg = ModelConfig {
        layers_per_stage: 2,
        ..ModelConfig::tiny()
    };
    let e = ProgramSet::lower(&src, &Mesh::pipeline(1), &cfg, LowerOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the MoE parts of F(0,0) and F(1,0) interleave"),
        "{e}"
    );
}

/// Issue 23: with `tp > 1` each layer's four tensor-parallel all-reduces (attention output
/// and shared-expert output in the forward, their input gradients in the backward) are ops
/// of the last stream, `tp`, over the TP group, bracketed by events; the programs verify
/// (whole ops and MoE parts); `tp = 1` has no `tp` stream.
#[test]
fn tensor_parallel_collectives_are_ops_of_their_own_stream() {
    let cfg = ModelConfig::tiny();
    for (name, src) in [
        ("1f1b", spec("1f1b", 2, 4, None)),
        ("dualpipev --moe", moe(&spec("dualpipev", 2, 4, None))),
    ] {
        let mesh: Mesh = "pp=2,tp=2,ep=2".parse().unwrap();
        let set = ProgramSet::lower(&src, &mesh, &cfg, LowerOptions::default()).unwrap();
        verify(&set, &src).unwrap_or_else(|e| panic!("{name}: {e}"));
        for rp in &set.ranks {
            let tp = rp.streams.last().unwrap();
            assert_eq!(tp.kind, StreamKind::Tp, "{name}");
            let group = mesh.tp_group(rp.rank).unwrap();
            let mut n = [0usize; 4];
            for op in &tp.ops {
                if let Op::TpCollective {
                    phase, group: g, ..
                } = op
                {
                    assert_eq!(g, &group);
                    n[*phase as usize] += 1;
                }
            }
            // One layer per stage; every (stage, micro-batch) runs F and B once.
            let ops = rp.stages.len() * 4;
            assert_eq!(n, [ops; 4], "{name} rank {}", rp.rank);
            for st in &rp.streams[..rp.streams.len() - 1] {
                assert!(
                    !st.ops.iter().any(|o| matches!(o, Op::TpCollective { .. })),
                    "{name}: a TP collective on {}",
                    st.kind
                );
            }
        }
        let flat = ProgramSet::lower(
            &src,
            &"pp=2,ep=2".parse().unwrap(),
            &cfg,
            LowerOptions::default(),
        )
        .unwrap();
        assert!(flat
            .ranks
            .iter()
            .all(|rp| rp.streams.iter().all(|s| s.kind != StreamKind::Tp)));
    }
}

/// Issue 23: with `sequence_parallel` each layer's TP collectives are all-gathers and
/// reduce-scatters (four each way), the step ends with the TP sum of the shards' gradients on
/// the comm stream, and the programs verify (whole ops and MoE parts); it needs `tp > 1`.
#[test]
fn sequence_parallel_lowers_gathers_and_scatters() {
    let cfg = ModelConfig::tiny();
    let src = spec("1f1b", 2, 4, None);
    let mesh: Mesh = "pp=2,tp=2".parse().unwrap();
    let opts = LowerOptions {
        sequence_parallel: true,
        ..LowerOptions::default()
    };
    let set = ProgramSet::lower(&src, &mesh, &cfg, opts).unwrap();
    assert!(set.manifest.sequence_parallel);
    verify(&set, &src).unwrap();
    for rp in &set.ranks {
        let tp = rp.streams.last().unwrap();
        assert_eq!(tp.kind, StreamKind::Tp);
        let mut kinds = [0usize; 3];
        for op in &tp.ops {
            if let Op::TpCollective { phase, .. } = op {
                kinds[phase.kind() as usize] += 1;
            }
        }
        // 4 micro-batches, one layer: 4 gathers and 4 scatters per F and B each.
        assert_eq!(kinds, [0, 4 * 4, 4 * 4], "rank {}", rp.rank);
        let comm = &rp.streams[1];
        assert_eq!(
            comm.ops
                .iter()
                .filter(|o| matches!(o, Op::TpGradAllReduce { .. }))
                .count(),
            rp.stages.len()
        );
    }
    let e = ProgramSet::lower(&src, &"pp=2".parse().unwrap(), &cfg, opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs tp > 1"), "{e}");
    // MoE parts too: their TP collectives on the tp stream between the parts' kernels.
    let parts = moe(&spec("dualpipev", 2, 4, None));
    let set = ProgramSet::lower(&parts, &"pp=2,tp=2,ep=2".parse().unwrap(), &cfg, opts).unwrap();
    verify(&set, &parts).unwrap();
}

/// Issue 27: memory ops at both granularities: the offloads and reloads on the copy stream
/// (each started by the compute stream's event where the IR issues it), the stash living
/// twice (freed by the offload, allocated again by the reload), the backward waiting for its
/// reload, and the stash peak counted where the copies are issued (the IR's peak).
#[test]
fn offload_reload_lower_to_the_copy_stream_and_verify() {
    let src = schedc_ir::text::parse(
        "pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) OFFLOAD(0,0) F(0,1) RELOAD(0,0) BW(0,0) BW(0,1)\n",
    )
    .unwrap()
    .program;
    for opts in [LowerOptions::default(), stage_opts()] {
        let set = ProgramSet::lower(&src, &Mesh::pipeline(1), &ModelConfig::tiny(), opts).unwrap();
        let rep = verify(&set, &src).unwrap();
        assert_eq!(rep.peak_stash, vec![2]);
        let copy = set.ranks[0].streams.last().unwrap();
        assert_eq!(copy.kind, StreamKind::Copy);
        let text: Vec<String> = copy.ops.iter().map(|o| o.to_string()).collect();
        assert_eq!(
            text,
            [
                "wait e0",
                "alloc host(0,0)",
                "offload stash(0,0) to host",
                "free stash(0,0)",
                "record e1",
                "wait e2",
                "alloc stash(0,0)",
                "reload stash(0,0) from host",
                "free host(0,0)",
                "record e3",
            ]
        );
        // The backward of (0,0) waits for the reload.
        let compute = &set.ranks[0].streams[0].ops;
        let w = compute
            .iter()
            .position(|o| *o == Op::Wait { event: 3 })
            .unwrap();
        assert!(
            matches!(&compute[w + 1..].iter().find(|o| matches!(o, Op::Kernel(_))), Some(Op::Kernel(k)) if k.mb == 0 && k.pass != Pass::F)
        );
    }
}

/// Issue 27: a reload moved before its offload on the copy stream breaks the stash's
/// lifetimes, and the verifier says so.
#[test]
fn a_reload_before_its_offload_is_refused_by_the_verifier() {
    let src = schedc_ir::text::parse(
        "pp 1\nstages 1\nmicrobatches 1\nplacement loop\nrank 0: F(0,0) OFFLOAD(0,0) RELOAD(0,0) BW(0,0)\n",
    )
    .unwrap()
    .program;
    let mut set =
        ProgramSet::lower(&src, &Mesh::pipeline(1), &ModelConfig::tiny(), stage_opts()).unwrap();
    let copy = set.ranks[0].streams.last_mut().unwrap();
    // Swap the two blocks (5 ops each).
    copy.ops.rotate_left(5);
    let e = verify(&set, &src).unwrap_err().to_string();
    assert_eq!(
        e,
        "rank 0: stash(0,0) is allocated again at copy op #1 `alloc stash(0,0)` before (or unordered with) its release at compute op #7 `free stash(0,0)`"
    );
}

/// The CPU backend's memory estimate counts the LM head's saved state on the rank that
/// holds the last stage: per stash, `seq x (vocab + 3 hidden + 1)` elements on top of the
/// layers' (the scaled logits' gradient alone is `seq x vocab`; at DeepSeek-V3's vocabulary
/// of 129,280 and 4096 tokens, 4.2 GB per stash in f64). 1F1B at P = 2, M = 1: both ranks
/// hold one stash at their peak, so their activations differ by the head's alone.
#[test]
fn cpu_memory_estimate_counts_the_heads_stash_on_the_last_stage() {
    let cfg = ModelConfig::tiny();
    let src = spec("1f1b", 2, 1, None);
    let set = ProgramSet::lower(&src, &Mesh::pipeline(2), &cfg, LowerOptions::default()).unwrap();
    let rep = verify(&set, &src).unwrap();
    assert_eq!(rep.peak_activations, vec![1, 1]);
    let needs = crate::memory::cpu_needs(&set, &rep.peak_activations, 8, false);
    let head = (cfg.seq_len * (cfg.vocab + 3 * cfg.hidden + 1) * 8) as u64;
    assert_eq!(needs[1].activations - needs[0].activations, head);
    assert_eq!(
        needs[0].activations,
        (cfg.layers_per_stage * cfg.seq_len) as u64 * cfg.stash_elems_per_token(cfg.seq_len, 1) * 8
    );
    assert!(
        head > 8 * (cfg.seq_len * cfg.vocab) as u64,
        "the logits' gradient is counted"
    );
}
