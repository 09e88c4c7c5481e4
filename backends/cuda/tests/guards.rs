//! The CPU backend's six silent-failure guards (`schedc_cpu::model::properties` and
//! `Bugs`) hold on the CUDA kernels too: each property, checked on the kernels (host shim),
//! passes with the correct model and fails with its bug injected; and end to end, a run of
//! the whole host driver with the bug injected no longer equals the CPU backend's correct
//! run, while the correct run does (`equivalence.rs`). Bugs:
//! * `local_causal_mask`: an SP chunk's queries masked at local instead of global positions;
//! * `softmax_gates`: gates from a softmax over all experts, not normalized sigmoid scores;
//! * `ema_init_zero`: the load EMA starting at 0 instead of 1/E;
//! * `bias_update_after_routing`: the balancing bias moved after the next routing;
//! * `drop_overflow`: assignments over capacity dropped instead of re-routed;
//! * `per_head_kpe`: MLA's RoPE key computed per head instead of once per token.

use schedc::input::{load_spec, Overrides};
use schedc_cpu::exec::{execute as cpu_execute, ExecOptions as CpuOptions, Optimizer};
use schedc_cpu::model::{self as cpu, Bugs, ModelConfig};
use schedc_cpu::tensor::{rel_err, sigmoid, Rng};
use schedc_cuda::api::*;
use schedc_cuda::driver::{execute, ExecOptions};
use schedc_cuda::host::HostGpu;
use schedc_cuda::layout::Dims;
use schedc_cuda::model::Io;
use schedc_cuda::model::{Model, StageDev};
use schedc_program::data::Data;
use schedc_program::mesh::Mesh;
use schedc_program::{LocalStage, LowerOptions, Part, Pass, ProgramSet};

const S: StreamId = StreamId(0);

struct Dev(HostGpu);

impl Dev {
    fn f(&self, xs: &[f32]) -> DevPtr {
        let p = self.0.alloc(xs.len() * 4).unwrap();
        self.0.htod(S, p, &encode(DType::F32, xs)).unwrap();
        p
    }
    fn i(&self, n: usize) -> DevPtr {
        let p = self.0.alloc(n * 4).unwrap();
        self.0.memset(S, p, n * 4).unwrap();
        p
    }
    fn get_f(&self, p: DevPtr, n: usize) -> Vec<f32> {
        let mut b = vec![0u8; n * 4];
        self.0.dtoh(S, p, &mut b).unwrap();
        decode(DType::F32, &b)
    }
    fn get_i(&self, p: DevPtr, n: usize) -> Vec<i32> {
        let mut b = vec![0u8; n * 4];
        self.0.dtoh(S, p, &mut b).unwrap();
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
    fn go(&self, kernel: &'static str, args: Vec<Arg>) {
        self.0
            .launch(
                S,
                &Launch {
                    kernel,
                    grid: [1, 1, 1],
                    block: [1, 1, 1],
                    args,
                },
            )
            .unwrap();
    }
}

fn p(x: DevPtr) -> Arg {
    Arg::Ptr(x)
}
fn i(x: usize) -> Arg {
    Arg::I32(x as i32)
}

/// The route kernel on `t` tokens: (experts, gates).
fn route(dv: &Dev, cfg: &ModelConfig, logits: &[f32], bias: &[f32]) -> (Vec<i32>, Vec<f32>) {
    let (e, k) = (cfg.experts, cfg.top_k);
    let t = logits.len() / e;
    let s: Vec<f32> = logits.iter().map(|z| sigmoid(*z)).collect();
    let (ex, gates) = (dv.i(t * k), dv.f(&vec![0.0; t * k]));
    dv.go(
        "route",
        vec![
            p(ex),
            p(dv.i(t * k)),
            p(gates),
            p(dv.f(&vec![0.0; t])),
            p(dv.f(&vec![0.0; t * e])),
            p(dv.f(&vec![0.0; e])),
            p(dv.i(e)),
            p(dv.f(logits)),
            p(dv.f(&s)),
            p(dv.f(bias)),
            i(t),
            i(e),
            i(k),
            Arg::I32(cfg.capacity(t).min(i32::MAX as usize) as i32),
            i(cfg.bugs.softmax_gates as usize),
            i(cfg.bugs.drop_overflow as usize),
        ],
    );
    (dv.get_i(ex, t * k), dv.get_f(gates, t * k))
}

/// SP: each chunk's attention through the driver's mask offset equals full attention.
fn sp_attention_matches_full(bugs: Bugs, sp: usize) -> Result<(), String> {
    let dv = Dev(HostGpu::new(DType::F32));
    let mut cfg = ModelConfig::tiny();
    cfg.bugs = bugs;
    let dims = Dims::new(&cfg, &Mesh::pipeline(1), DType::F32)?;
    let sh = cpu::AttnShape::of(&cfg);
    let (t, h) = (cfg.seq_len, sh.heads);
    let mut rng = Rng::new(7);
    let mut gen = |n: usize| (0..n).map(|_| rng.uniform() as f32).collect::<Vec<f32>>();
    let (qn, qp) = (gen(t * h * sh.nope), gen(t * h * sh.rope));
    let (kn, kp, v) = (
        gen(t * h * sh.nope),
        gen(t * sh.kpe_width()),
        gen(t * h * sh.v),
    );
    let full_in = cpu::AttnIn {
        q_nope: &qn,
        q_pe: &qp,
        k_nope: &kn,
        k_pe: &kp,
        v: &v,
    };
    let (full, _) = cpu::attention(&full_in, &sh, 0, &Bugs::default());
    let keys = (dv.f(&kn), dv.f(&kp), dv.f(&v));
    let chunk = t / sp;
    let rows = |x: &[f32], w: usize, c: usize| x[c * chunk * w..(c + 1) * chunk * w].to_vec();
    for c in 0..sp {
        let m = Model {
            gpu: &dv.0,
            dims: &dims,
            cfg: &cfg,
            pos0: c * chunk,
            err: dv.i(1),
        };
        let (out, lse) = (
            dv.f(&vec![0.0; chunk * h * sh.v]),
            dv.f(&vec![0.0; h * chunk]),
        );
        let q = (
            dv.f(&rows(&qn, h * sh.nope, c)),
            dv.f(&rows(&qp, h * sh.rope, c)),
        );
        m.attention(S, (out, lse), q, keys, chunk, t, m.mask_offset())
            .map_err(String::from)?;
        let e = rel_err(
            &dv.get_f(out, chunk * h * sh.v),
            &rows(&full, h * sh.v, c),
            1e-30,
        );
        if e > 1e-5 {
            return Err(format!(
                "SP chunk {c} differs from full attention (relative error {e:.3e})"
            ));
        }
    }
    Ok(())
}

/// MLA's decoupled RoPE key (DeepSeek-V3 eq. 3-4) on the device: `W_KR` is `d x d_h^R`
/// (one RoPE key per token), the SP group gathers `d_c + d_h^R` values per token, and the
/// driver's F Q/K/V and attention of layer 0 equal the CPU's `reference_mla`, whose heads
/// share one RoPE key.
fn kpe_shared_across_heads(bugs: Bugs) -> Result<(), String> {
    let gpu = HostGpu::new(DType::F32);
    let dv = Dev(HostGpu::new(DType::F32));
    let mut cfg = ModelConfig::tiny();
    cfg.bugs = bugs;
    let dims = Dims::new(&cfg, &Mesh::pipeline(1), DType::F32)?;
    let (d, dr) = (cfg.hidden, cfg.qk_rope_head_dim);
    let info = LocalStage {
        stage: 1,
        model_stage: 1,
        direction: 0,
        first: false,
        last: false,
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
        3,
        &Optimizer::Sgd { lr: 0.1 },
        0,
    )
    .map_err(String::from)?;
    let wkr = st.layout.get("layer1.wkr")?;
    if wkr.len != d * dr {
        return Err(format!(
            "W_KR holds {} values, d x {}: {} RoPE keys per token where MLA has one shared by all heads",
            wkr.len,
            wkr.len / d,
            wkr.len / (d * dr)
        ));
    }
    if dims.gather_width() != cfg.kv_lora_rank + dr {
        return Err(format!(
            "the SP group gathers {} values per token",
            dims.gather_width()
        ));
    }
    let t = cfg.seq_len;
    let mut rng = Rng::new(17);
    let x: Vec<f32> = (0..t * d).map(|_| rng.uniform() as f32).collect();
    let stash = gpu.alloc(st.stash.bytes).map_err(String::from)?;
    let grads = gpu.alloc(st.layout.grads() * 4).map_err(String::from)?;
    let act = gpu.alloc(t * d * 4).map_err(String::from)?;
    gpu.htod(S, act, &encode(DType::F32, &x))
        .map_err(String::from)?;
    let err = gpu.alloc(4).map_err(String::from)?;
    gpu.memset(S, err, 4).map_err(String::from)?;
    let m = Model {
        gpu: &gpu,
        dims: &dims,
        cfg: &cfg,
        pos0: 0,
        err,
    };
    let io = Io {
        stash,
        grads,
        act_in: Some(act),
        tokens: Some((vec![], vec![])),
        scale: 1.0,
        ..Io::default()
    };
    m.kernel(S, &st, Pass::F, Part::Qkv { layer: 0 }, &io)
        .map_err(String::from)?;
    let sl = &st.stash;
    gpu.dtod(
        S,
        stash + sl.inbox.off as u64,
        stash + sl.outbox.off as u64,
        dims.slot_bytes,
    )
    .map_err(String::from)?;
    m.kernel(S, &st, Pass::F, Part::Attn { layer: 0 }, &io)
        .map_err(String::from)?;
    let read = |r: schedc_cuda::layout::Region| {
        let mut b = vec![0u8; t * d * 4];
        gpu.dtoh(S, stash + r.off as u64, &mut b).unwrap();
        decode(DType::F32, &b)
    };
    let (a, h1) = (read(sl.layers[0].a), read(sl.layers[0].h1));
    let model: Vec<f64> = h1.iter().zip(&x).map(|(h1, x)| (*h1 - *x) as f64).collect();
    let p64 = cpu::StageParams::<f64>::init(&cfg, 1, 3, 0, cfg.experts);
    let a64: Vec<f64> = a.iter().map(|v| *v as f64).collect();
    let want = cpu::properties::reference_mla(&cfg, &p64.layers[0], &a64)?;
    let e = rel_err(&model, &want, 1e-30);
    let _ = dv;
    if e > 1e-5 {
        return Err(format!(
            "the attention output differs from MLA with one shared RoPE key ({e:.3e})"
        ));
    }
    Ok(())
}

/// Gates: each token's gates are its selected experts' sigmoid scores over their sum.
fn gates_normalized_over_selected(bugs: Bugs) -> Result<(), String> {
    let dv = Dev(HostGpu::new(DType::F32));
    let mut cfg = ModelConfig::tiny();
    cfg.bugs = bugs;
    let (t, e) = (6usize, cfg.experts);
    let mut rng = Rng::new(11);
    let logits: Vec<f32> = (0..t * e).map(|_| (2.0 * rng.uniform()) as f32).collect();
    let (ex, gates) = route(&dv, &cfg, &logits, &vec![0.0; e]);
    for tok in 0..t {
        let sel: Vec<usize> = ex[tok * cfg.top_k..(tok + 1) * cfg.top_k]
            .iter()
            .map(|x| *x as usize)
            .collect();
        let z: f32 = sel.iter().map(|&x| sigmoid(logits[tok * e + x])).sum();
        for (j, &x) in sel.iter().enumerate() {
            let want = sigmoid(logits[tok * e + x]) / z;
            let got = gates[tok * cfg.top_k + j];
            if (got - want).abs() > 1e-6 {
                return Err(format!(
                    "token {tok}: gate of expert {x} is {got}, expected s/sum(selected s) = {want}"
                ));
            }
        }
    }
    Ok(())
}

/// Balancing: the device state starts at EMA 1/E; one update from loads [3, 3, 1, 1]
/// gives the CPU's EMA and bias, and the next routing uses the moved bias.
fn bias_ema_before_routing(bugs: Bugs) -> Result<(), String> {
    let dv = Dev(HostGpu::new(DType::F32));
    let mut cfg = ModelConfig::tiny();
    cfg.bugs = bugs;
    cfg.top_k = 1;
    cfg.capacity_factor = None;
    cfg.bias_rate = 0.1;
    cfg.ema_decay = 0.5;
    let dims = Dims::new(&cfg, &Mesh::pipeline(1), DType::F32)?;
    let info = LocalStage {
        stage: 0,
        model_stage: 0,
        direction: 0,
        first: true,
        last: true,
        expert_lo: 0,
        expert_hi: 4,
        replica_peer: None,
    };
    let st = StageDev::new(
        &dv.0,
        S,
        &cfg,
        &dims,
        &info,
        1,
        &Optimizer::Sgd { lr: 0.1 },
        0,
    )
    .map_err(String::from)?;
    let ema = dv.get_f(st.ema, 4);
    if ema.iter().any(|x| (x - 0.25).abs() > 1e-7) {
        return Err(format!("the load EMA starts at {ema:?}, not 1/E"));
    }
    let logits: Vec<f32> = (0..4).flat_map(|_| [0.10f32, 0.08, 0.06, 0.04]).collect();
    let (before, _) = route(&dv, &cfg, &logits, &dv.get_f(st.routing_bias, 4));
    if before.iter().any(|&x| x != 0) {
        return Err("setup: expert 0 should win every token at zero bias".into());
    }
    dv.go(
        "router_update",
        vec![
            p(st.bias),
            p(st.ema),
            p(st.routing_bias),
            p(dv.f(&[3.0, 3.0, 1.0, 1.0])),
            i(4),
            i(1),
            Arg::F64(cfg.ema_decay),
            Arg::F64(cfg.bias_rate),
            i(cfg.bugs.bias_update_after_routing as usize),
        ],
    );
    let (ema, bias) = (dv.get_f(st.ema, 4), dv.get_f(st.bias, 4));
    if ema != [0.3125, 0.3125, 0.1875, 0.1875] {
        return Err(format!("EMA is {ema:?}"));
    }
    if bias != [-0.1, -0.1, 0.1, 0.1] {
        return Err(format!("bias is {bias:?}"));
    }
    let (after, _) = route(&dv, &cfg, &logits, &dv.get_f(st.routing_bias, 4));
    if after.iter().any(|&x| x != 2) {
        return Err(format!("the routing after the update picks {after:?}, not expert 2: it did not use the updated bias"));
    }
    Ok(())
}

/// Capacity: with every token preferring the same experts, each still gets k distinct
/// experts within capacity and gates summing to 1.
fn overflow_rerouted(bugs: Bugs) -> Result<(), String> {
    let dv = Dev(HostGpu::new(DType::F32));
    let mut cfg = ModelConfig::tiny();
    cfg.bugs = bugs;
    cfg.capacity_factor = Some(0.5);
    let t = 8;
    let cap = cfg.capacity(t);
    let logits: Vec<f32> = (0..t)
        .flat_map(|i| [1.0, 0.9, 0.2 + 0.01 * i as f32, 0.1])
        .collect();
    let (ex, gates) = route(&dv, &cfg, &logits, &[0.0; 4]);
    let mut load = [0usize; 4];
    for tok in 0..t {
        let sel = &ex[tok * 2..tok * 2 + 2];
        if sel.contains(&-1) {
            return Err(format!("token {tok} lost an expert slot: {sel:?}"));
        }
        let gs: f32 = gates[tok * 2..tok * 2 + 2].iter().sum();
        if (gs - 1.0).abs() > 1e-6 {
            return Err(format!("token {tok}: gates sum to {gs}"));
        }
        for &x in sel {
            load[x as usize] += 1;
        }
    }
    if load.iter().any(|&l| l > cap) {
        return Err(format!("loads {load:?} exceed the capacity {cap}"));
    }
    Ok(())
}

fn injected(f: impl Fn(Bugs) -> Result<(), String>, bug: Bugs, name: &str) {
    f(Bugs::default()).unwrap_or_else(|e| panic!("{name}: the correct model fails: {e}"));
    let e = f(bug).expect_err(&format!("{name}: the injected bug went unnoticed"));
    println!("guard {name}: correct model passes; injected bug caught: {e}");
}

#[test]
fn silent_failure_sp_causal_mask_uses_global_positions() {
    injected(
        |b| sp_attention_matches_full(b, 2),
        Bugs {
            local_causal_mask: true,
            ..Bugs::default()
        },
        "local_causal_mask",
    );
}

#[test]
fn silent_failure_kpe_computed_once_and_shared_across_heads() {
    injected(
        kpe_shared_across_heads,
        Bugs {
            per_head_kpe: true,
            ..Bugs::default()
        },
        "per_head_kpe",
    );
}

#[test]
fn silent_failure_gates_normalized_after_top_k() {
    injected(
        gates_normalized_over_selected,
        Bugs {
            softmax_gates: true,
            ..Bugs::default()
        },
        "softmax_gates",
    );
}

#[test]
fn silent_failure_bias_ema_init_and_order() {
    injected(
        bias_ema_before_routing,
        Bugs {
            ema_init_zero: true,
            ..Bugs::default()
        },
        "ema_init_zero",
    );
    injected(
        bias_ema_before_routing,
        Bugs {
            bias_update_after_routing: true,
            ..Bugs::default()
        },
        "bias_update_after_routing",
    );
}

#[test]
fn silent_failure_overflow_rerouted_not_dropped() {
    injected(
        overflow_rerouted,
        Bugs {
            drop_overflow: true,
            ..Bugs::default()
        },
        "drop_overflow",
    );
}

/// End to end: the driver with `bug` against the CPU backend's correct run; returns the
/// largest relative difference of losses, gradients and parameters.
fn end_to_end(bug: Bugs, mesh: &str, steps: usize) -> f64 {
    end_to_end_against(bug, Bugs::default(), mesh, steps)
}

/// [`end_to_end`] with the CPU run under `cpu_bug`.
fn end_to_end_against(bug: Bugs, cpu_bug: Bugs, mesh: &str, steps: usize) -> f64 {
    let text = std::fs::read_to_string(format!(
        "{}/../../specs/1f1b.sched",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let ov = Overrides {
        pp: Some(2),
        microbatches: Some(4),
        ..Default::default()
    };
    let src = load_spec(&text, &ov).unwrap().program;
    let mesh: Mesh = mesh.parse().unwrap();
    let mut cfg = ModelConfig::tiny();
    cfg.capacity_factor = Some(0.6);
    // A fast bias (gamma) so that the balancing moves routing within three steps.
    cfg.bias_rate = 0.3;
    cfg.bugs = cpu_bug;
    let good = ProgramSet::lower(&src, &mesh, &cfg, LowerOptions::default()).unwrap();
    cfg.bugs = bug;
    let bad = ProgramSet::lower(&src, &mesh, &cfg, LowerOptions::default()).unwrap();
    let data = Data::builtin();
    let opt = Optimizer::Sgd { lr: 0.5 };
    let want = cpu_execute::<f32>(
        &good,
        &data,
        &CpuOptions {
            steps,
            optimizer: opt,
            record: true,
            ..CpuOptions::default()
        },
    )
    .unwrap();
    let got = execute(
        &HostGpu::new(DType::F32),
        &bad,
        &data,
        &ExecOptions {
            steps,
            optimizer: opt,
            record: true,
            ..ExecOptions::default()
        },
    )
    .unwrap();
    let mut worst = 0.0f64;
    for (a, b) in got.losses.iter().zip(&want.losses) {
        worst = worst.max((a - b).abs() / b.abs());
    }
    let by_name: std::collections::HashMap<(u32, u32, &str), &Vec<f64>> = want
        .params
        .iter()
        .flat_map(|(r, s, named)| named.iter().map(move |(n, t)| ((*r, *s, n.as_str()), t)))
        .collect();
    for (r, s, named) in &got.params {
        for (n, x) in named {
            let y = by_name[&(*r, *s, n.as_str())];
            // A tensor of another shape (per_head_kpe's W_KR) differs entirely.
            worst = worst.max(if x.len() == y.len() {
                rel_err(x, y, 1e-8)
            } else {
                f64::INFINITY
            });
        }
    }
    worst
}

#[test]
fn every_injected_bug_changes_the_training_end_to_end() {
    for (name, bug, mesh, steps) in [
        (
            "local_causal_mask",
            Bugs {
                local_causal_mask: true,
                ..Bugs::default()
            },
            "pp=2,sp=2",
            1,
        ),
        (
            "softmax_gates",
            Bugs {
                softmax_gates: true,
                ..Bugs::default()
            },
            "pp=2",
            1,
        ),
        (
            "ema_init_zero",
            Bugs {
                ema_init_zero: true,
                ..Bugs::default()
            },
            "pp=2",
            3,
        ),
        (
            "bias_update_after_routing",
            Bugs {
                bias_update_after_routing: true,
                ..Bugs::default()
            },
            "pp=2",
            3,
        ),
        (
            "drop_overflow",
            Bugs {
                drop_overflow: true,
                ..Bugs::default()
            },
            "pp=2",
            1,
        ),
        (
            "per_head_kpe",
            Bugs {
                per_head_kpe: true,
                ..Bugs::default()
            },
            "pp=2,sp=2",
            1,
        ),
    ] {
        let d = end_to_end(bug, mesh, steps);
        println!("guard {name} end to end ({mesh}, {steps} steps): differs from the correct CPU run by {d:.2e}");
        assert!(
            d > 1e-3,
            "{name}: the injected bug changed nothing ({d:.2e})"
        );
    }
    let d = end_to_end(Bugs::default(), "pp=2,sp=2", 3);
    assert!(d < 1e-4, "the correct run differs by {d:.2e}");
    // per_head_kpe trains: the driver with it equals the CPU backend with it (its H RoPE
    // keys gathered over SP), which the shapes alone would not show.
    let kpe = Bugs {
        per_head_kpe: true,
        ..Bugs::default()
    };
    let d = end_to_end_against(kpe, kpe, "pp=2,sp=2", 2);
    println!("guard per_head_kpe: the driver with it equals the CPU with it to {d:.2e}");
    assert!(
        d < 1e-4,
        "per_head_kpe: the driver differs from the CPU by {d:.2e}"
    );
}
