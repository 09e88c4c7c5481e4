//! Issue 27, item 5: the IR's memory ops on the CUDA backend, part by part on the host shim:
//! a recompute's forward writes the stash only (not the router loads, not the loss); the
//! shim's pinned host memory and its asynchronous copies; the copy-stream calls of an
//! offloading program and the pinned pool it leaves behind.

use schedc::input::{load_spec, Overrides};
use schedc_cpu::exec::Optimizer;
use schedc_cpu::model::ModelConfig;
use schedc_cuda::api::*;
use schedc_cuda::driver::{execute, execute_on, ExecOptions};
use schedc_cuda::host::HostGpu;
use schedc_cuda::layout::Dims;
use schedc_cuda::model::{Io, Model, StageDev};
use schedc_cuda::record::{Call, Recorder};
use schedc_program::data::Data;
use schedc_program::mesh::Mesh;
use schedc_program::{LocalStage, LowerOptions, Op, Part, Pass, ProgramSet, StreamKind};

const S: StreamId = StreamId(0);

fn lower(name: &str, pp: u32, mb: u32) -> ProgramSet {
    let path = format!("{}/../../specs/{name}.sched", env!("CARGO_MANIFEST_DIR"));
    let ov = Overrides {
        pp: Some(pp),
        microbatches: Some(mb),
        ..Default::default()
    };
    let src = load_spec(&std::fs::read_to_string(path).unwrap(), &ov)
        .unwrap()
        .program;
    let mesh: Mesh = format!("pp={pp}").parse().unwrap();
    ProgramSet::lower(&src, &mesh, &ModelConfig::tiny(), LowerOptions::default()).unwrap()
}

fn f32s(gpu: &HostGpu, p: DevPtr, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    gpu.dtoh(S, p, &mut b).unwrap();
    decode(DType::F32, &b)
}

fn bytes(gpu: &HostGpu, p: DevPtr, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    gpu.dtoh(S, p, &mut b).unwrap();
    b
}

/// One stage holding the whole tiny model (groups of one): the forward's kernels once as
/// `F` and once as a recompute (`Io::recompute`) into a second stash. The recompute's
/// stash is byte-identical to the forward's, its router loads land in the scratch (the
/// same counts the forward added to `weight_grad`), and neither `weight_grad` nor the loss
/// slot changes.
#[test]
fn a_recompute_writes_the_stash_only_not_the_loads_or_the_loss() {
    let cfg = ModelConfig::tiny();
    let gpu = HostGpu::new(DType::F32);
    let dims = Dims::new(&cfg, &Mesh::pipeline(1), DType::F32).unwrap();
    let info = LocalStage {
        stage: 0,
        model_stage: 0,
        direction: 0,
        first: true,
        last: true,
        expert_lo: 0,
        expert_hi: cfg.experts as u32,
        replica_peer: None,
    };
    let st = StageDev::new(
        &gpu,
        S,
        &cfg,
        &dims,
        &info,
        1,
        &Optimizer::Sgd { lr: 0.1 },
        0,
    )
    .unwrap();
    let err = gpu.alloc(4).unwrap();
    gpu.memset(S, err, 4).unwrap();
    let m = Model {
        gpu: &gpu,
        dims: &dims,
        cfg: &cfg,
        pos0: 0,
        err,
    };
    let ng = st.layout.grads();
    let grads = gpu.alloc(ng * 4).unwrap();
    gpu.memset(S, grads, ng * 4).unwrap();
    let loss = gpu.alloc(4).unwrap();
    let (layers, e) = (dims.layers, dims.e);
    let scratch = gpu.alloc(layers * e * 4).unwrap();
    gpu.memset(S, scratch, layers * e * 4).unwrap();
    let t = cfg.seq_len;
    let tokens: Vec<u32> = (0..t).map(|i| (i * 7 % cfg.vocab) as u32).collect();
    let targets: Vec<u32> = (0..t).map(|i| (i * 5 % cfg.vocab) as u32).collect();
    let forward = |stash: DevPtr, recompute: Option<DevPtr>| {
        let io = Io {
            stash,
            grads,
            loss,
            tokens: Some((tokens.clone(), targets.clone())),
            scale: 1.0 / t as f64,
            recompute,
            ..Io::default()
        };
        let sl = &st.stash;
        let a2a = || {
            gpu.dtod(
                S,
                stash + sl.inbox.off as u64,
                stash + sl.outbox.off as u64,
                dims.slot_bytes,
            )
            .unwrap()
        };
        let run = |part| m.kernel(S, &st, Pass::F, part, &io).unwrap();
        run(Part::Embed);
        for l in 0..layers as u32 {
            run(Part::Qkv { layer: l });
            a2a();
            run(Part::Attn { layer: l });
            a2a();
            run(Part::Experts { layer: l });
            a2a();
            run(Part::Combine { layer: l });
        }
        run(Part::Head);
    };
    let sb = st.stash.bytes;
    let (s1, s2) = (gpu.alloc(sb).unwrap(), gpu.alloc(sb).unwrap());
    forward(s1, None);
    let loads = f32s(
        &gpu,
        grads + (st.layout.loads_of(0, e) * 4) as u64,
        layers * e,
    );
    let l1 = f32s(&gpu, loss, 1)[0];
    // Every token's top-k choices, counted once per layer.
    assert_eq!(
        loads.iter().sum::<f32>() as usize,
        layers * t * cfg.top_k,
        "{loads:?}"
    );
    assert!(l1 > 1.0, "{l1}");
    // A sentinel in the loss slot: a recompute must leave it alone.
    gpu.htod(S, loss, &7.0f32.to_le_bytes()).unwrap();
    let grads_before = bytes(&gpu, grads, ng * 4);
    forward(s2, Some(scratch));
    assert_eq!(f32s(&gpu, loss, 1)[0], 7.0, "the recompute wrote the loss");
    assert!(
        bytes(&gpu, grads, ng * 4) == grads_before,
        "the recompute changed weight_grad (the router loads)"
    );
    assert_eq!(f32s(&gpu, scratch, layers * e), loads);
    assert!(
        bytes(&gpu, s1, sb) == bytes(&gpu, s2, sb),
        "the recomputed stash differs from the forward's"
    );
    println!(
        "recompute: stash of {sb} bytes identical, loads {} in the scratch, weight_grad and loss {l1} untouched",
        loads.iter().sum::<f32>()
    );
}

/// The shim's pinned host memory: NaN-filled when fresh, a round trip device -> host ->
/// device restores the bytes, and a copy past the end of a block (either side) is an
/// error naming the side.
#[test]
fn pinned_host_copies_round_trip_and_check_their_ranges() {
    let gpu = HostGpu::new(DType::F32);
    let d = gpu.alloc(64).unwrap();
    let h = gpu.alloc_host(64).unwrap();
    assert_eq!(gpu.host_bytes(), 64);
    let back = gpu.alloc(64).unwrap();
    gpu.htod_async(S, back, h, 64).unwrap();
    assert!(f32s(&gpu, back, 16).iter().all(|x| x.is_nan()));
    let xs: Vec<f32> = (0..16).map(|i| i as f32 * 0.5).collect();
    gpu.htod(S, d, &encode(DType::F32, &xs)).unwrap();
    gpu.dtoh_async(S, h, d, 64).unwrap();
    gpu.htod_async(S, back, h, 64).unwrap();
    assert_eq!(f32s(&gpu, back, 16), xs);
    let e = gpu.dtoh_async(S, h, d, 512).unwrap_err();
    assert!(e.0.starts_with("dtoh_async source: 512 bytes"), "{e}");
    let e = gpu.htod_async(S, d, d, 64).unwrap_err();
    assert!(
        e.0.starts_with("htod_async source (pinned host): 64 bytes"),
        "{e}"
    );
    gpu.free_host(h).unwrap();
    assert_eq!(gpu.host_bytes(), 0);
    assert!(gpu.free_host(h).is_err());
}

/// On every rank of 1f1b_offload (P = 4, M = 8), each `offload` is one asynchronous
/// device-to-host copy of the stash's bytes and each `reload` one host-to-device copy,
/// both on the copy stream; a rank that offloads keeps a pinned pool of as many stashes as
/// it has on the host at once and fewer stash blocks on the device than 1F1B.
#[test]
fn offloads_are_async_copies_on_the_copy_stream_and_free_device_memory() {
    let set = lower("1f1b_offload", 4, 8);
    let opts = ExecOptions {
        steps: 1,
        ..ExecOptions::default()
    };
    let recs: Vec<Recorder> = set
        .ranks
        .iter()
        .map(|p| Recorder::new(p.rank, DType::F32))
        .collect();
    let gpus: Vec<&dyn Gpu> = recs.iter().map(|r| r as &dyn Gpu).collect();
    execute_on(&gpus, &set, &Data::builtin(), &opts).unwrap();
    let model = set.manifest.model.as_ref().unwrap();
    let dims = Dims::new(model, &set.manifest.mesh, DType::F32).unwrap();
    let mut copies = 0;
    for (prog, rec) in set.ranks.iter().zip(&recs) {
        let stash = schedc_cuda::layout::StashLayout::new(&dims, &prog.stages[0]).bytes;
        let Some(copy) = prog.streams.iter().position(|s| s.kind == StreamKind::Copy) else {
            continue;
        };
        let count = |f: fn(&Op) -> bool| prog.streams[copy].ops.iter().filter(|o| f(o)).count();
        let offloads = count(|o| matches!(o, Op::Offload { .. }));
        let reloads = count(|o| matches!(o, Op::Reload { .. }));
        let log = rec.log();
        let on_copy = |c: Call| {
            log.iter()
                .filter(|(s, x)| *s == Some(StreamId(copy as u32)) && *x == c)
                .count()
        };
        assert_eq!(
            on_copy(Call::DtohAsync(stash)),
            offloads,
            "rank {}",
            prog.rank
        );
        assert_eq!(
            on_copy(Call::HtodAsync(stash)),
            reloads,
            "rank {}",
            prog.rank
        );
        assert!(offloads > 0 && offloads == reloads);
        // No copy of the host pool on another stream.
        let elsewhere = log
            .iter()
            .filter(|(s, x)| {
                *s != Some(StreamId(copy as u32))
                    && matches!(x, Call::DtohAsync(_) | Call::HtodAsync(_))
            })
            .count();
        assert_eq!(elsewhere, 0);
        copies += offloads;
    }
    // Ranks 0 and 1 (4 and 3 forwards in flight) offload every micro-batch.
    assert_eq!(copies, 16);

    let data = Data::builtin();
    let off = execute(&HostGpu::new(DType::F32), &set, &data, &opts).unwrap();
    let plain = execute(
        &HostGpu::new(DType::F32),
        &lower("1f1b", 4, 8),
        &data,
        &opts,
    )
    .unwrap();
    for (o, p) in off.memory.iter().zip(&plain.memory) {
        println!(
            "rank {}: pool peak in use {} bytes with offload ({} pinned host bytes, peak {}), {} bytes in 1f1b",
            o.rank, o.pool_peak_in_use, o.pinned_host, o.pinned_host_peak, p.pool_peak_in_use
        );
    }
    let (o0, p0) = (&off.memory[0], &plain.memory[0]);
    assert!(o0.pool_peak_in_use < p0.pool_peak_in_use, "{o0:?} {p0:?}");
    assert!(o0.pinned_host > 0 && o0.pinned_host_peak <= o0.pinned_host);
    // The last rank neither offloads nor pins anything.
    assert_eq!(off.memory[3].pinned_host, 0);
    assert_eq!(off.losses, plain.losses);
}
