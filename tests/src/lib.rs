//! Test support: a generator of random valid schedules and the mutations that the verifier
//! must catch. Deterministic from a seed (SplitMix64), so property tests shrink and
//! regressions replay.

use schedc_ir::{Comm, Compute, Instr, Kind, Pipeline, PlacementKind, Program};

/// SplitMix64: a tiny deterministic RNG.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// True with probability `num/den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next_u64() % den < num
    }
}

/// A random pipeline: P in 1..=4, a random placement (loop, V, bidirectional or an explicit
/// random map), M in 1..=5.
pub fn random_pipeline(rng: &mut Rng) -> Pipeline {
    let pp = 1 + rng.below(4) as u32;
    let mb = 1 + rng.below(5) as u32;
    match rng.below(4) {
        0 => Pipeline::new(pp, pp * (1 + rng.below(3) as u32), mb, PlacementKind::Loop).unwrap(),
        1 => Pipeline::new(pp, pp * (1 + rng.below(3) as u32), mb, PlacementKind::V).unwrap(),
        2 => Pipeline::new(pp, 2 * pp, mb, PlacementKind::Bidir).unwrap(),
        _ => {
            let s = 1 + rng.below(6);
            let map = (0..s).map(|_| rng.below(pp as usize) as u32).collect();
            Pipeline::explicit(pp, mb, map).unwrap()
        }
    }
}

/// A random valid compute-only schedule on `pl`: each (stage, mb) gets F and either BW or
/// B then W (chosen at random); the per-rank orders are the projections of one random
/// topological order of the dependency graph, so every order constraint holds and an
/// execution exists.
pub fn random_schedule(rng: &mut Rng, pl: Pipeline) -> Program {
    let (s_n, m_n) = (pl.stages, pl.microbatches);
    let split: Vec<bool> = (0..s_n * m_n).map(|_| rng.chance(1, 2)).collect();
    // Op ids: (kind, s, m). State per (s, m): 0 nothing, 1 F done, 2 backward-input done, 3 W done.
    let n = (s_n * m_n) as usize;
    let mut state = vec![0u8; n];
    let mut ranks: Vec<Vec<Instr>> = vec![Vec::new(); pl.pp as usize];
    let total_ops: usize = (0..n).map(|k| if split[k] { 3 } else { 2 }).sum();
    let mut emitted = 0;
    let mut ready: Vec<(Kind, u32, u32)> = Vec::new();
    while emitted < total_ops {
        ready.clear();
        for s in 0..s_n {
            for m in 0..m_n {
                let k = (s * m_n + m) as usize;
                match state[k] {
                    0 => {
                        let ok = pl
                            .prev_stage(s)
                            .is_none_or(|ps| state[(ps * m_n + m) as usize] >= 1);
                        if ok {
                            ready.push((Kind::F, s, m));
                        }
                    }
                    1 => {
                        let ok = pl
                            .next_stage(s)
                            .is_none_or(|ns| state[(ns * m_n + m) as usize] >= 2);
                        if ok {
                            ready.push((if split[k] { Kind::B } else { Kind::BW }, s, m));
                        }
                    }
                    2 if split[k] => ready.push((Kind::W, s, m)),
                    _ => {}
                }
            }
        }
        let (kind, s, m) = ready[rng.below(ready.len())];
        let k = (s * m_n + m) as usize;
        state[k] = match kind {
            Kind::F => 1,
            Kind::B | Kind::BW => 2,
            Kind::W => 3,
        };
        if kind == Kind::BW {
            state[k] = 2;
        }
        ranks[pl.rank_of(s) as usize].push(Instr::Compute(Compute::new(kind, s, m)));
        emitted += 1;
    }
    Program {
        pipeline: pl,
        ranks,
    }
}

/// The fault kinds of the mutation test, with the diagnostic code each must produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Remove one compute op: `missing-op`.
    DropOp,
    /// Insert a second copy of a compute op right after it: `duplicate-op`.
    DuplicateOp,
    /// Move a backward (B or BW) to just before its forward: `order`.
    BackwardBeforeForward,
    /// Move a W to just before its B: `order`.
    WBeforeB,
    /// Remove one receive from a lowered program: `unmatched`.
    DropRecv,
    /// Swap two receives from the same peer: `label-mismatch`.
    SwapRecvs,
    /// Swap the payloads of two sends to the same peer: `label-mismatch`.
    SwapSendPayloads,
}

impl Mutation {
    /// Every kind.
    pub const ALL: [Mutation; 7] = [
        Mutation::DropOp,
        Mutation::DuplicateOp,
        Mutation::BackwardBeforeForward,
        Mutation::WBeforeB,
        Mutation::DropRecv,
        Mutation::SwapRecvs,
        Mutation::SwapSendPayloads,
    ];
    /// The code that must be reported.
    pub fn expected_code(self) -> &'static str {
        match self {
            Mutation::DropOp => "missing-op",
            Mutation::DuplicateOp => "duplicate-op",
            Mutation::BackwardBeforeForward | Mutation::WBeforeB => "order",
            Mutation::DropRecv => "unmatched",
            Mutation::SwapRecvs | Mutation::SwapSendPayloads => "label-mismatch",
        }
    }
    /// True if the mutation applies to the lowered program (with communication).
    pub fn needs_comms(self) -> bool {
        matches!(
            self,
            Mutation::DropRecv | Mutation::SwapRecvs | Mutation::SwapSendPayloads
        )
    }
}

fn positions(p: &Program, f: impl Fn(&Instr) -> bool) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for (r, instrs) in p.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            if f(ins) {
                v.push((r, i));
            }
        }
    }
    v
}

/// Applies `mu` at a random applicable site. Returns `None` if the program has no site for
/// it (e.g. no W to move, no two receives from one peer).
pub fn mutate(p: &Program, mu: Mutation, rng: &mut Rng) -> Option<Program> {
    let mut q = p.clone();
    match mu {
        Mutation::DropOp | Mutation::DuplicateOp => {
            let sites = positions(p, Instr::is_compute);
            let (r, i) = *sites.get(rng.below(sites.len().max(1)))?;
            if mu == Mutation::DropOp {
                q.ranks[r].remove(i);
            } else {
                let ins = q.ranks[r][i].clone();
                q.ranks[r].insert(i + 1, ins);
            }
        }
        Mutation::BackwardBeforeForward | Mutation::WBeforeB => {
            let want: &[Kind] = if mu == Mutation::WBeforeB {
                &[Kind::W]
            } else {
                &[Kind::B, Kind::BW]
            };
            let sites = positions(
                p,
                |ins| matches!(ins, Instr::Compute(c) if want.contains(&c.kind)),
            );
            let (r, i) = *sites.get(rng.below(sites.len().max(1)))?;
            let Instr::Compute(c) = q.ranks[r][i] else {
                unreachable!()
            };
            let dep_kind = if mu == Mutation::WBeforeB {
                Kind::B
            } else {
                Kind::F
            };
            let j = q.ranks[r].iter().position(|x| {
                matches!(x, Instr::Compute(d) if d.kind == dep_kind && d.stage == c.stage && d.mb == c.mb)
            })?;
            let ins = q.ranks[r].remove(i);
            q.ranks[r].insert(j, ins);
        }
        Mutation::DropRecv => {
            let sites = positions(p, |ins| matches!(ins, Instr::Comm(Comm::Recv { .. })));
            let (r, i) = *sites.get(rng.below(sites.len().max(1)))?;
            q.ranks[r].remove(i);
        }
        Mutation::SwapRecvs | Mutation::SwapSendPayloads => {
            let recv = mu == Mutation::SwapRecvs;
            let sites = positions(p, |ins| {
                matches!(ins, Instr::Comm(Comm::Recv { .. })) && recv
                    || matches!(ins, Instr::Comm(Comm::Send { .. })) && !recv
            });
            if sites.len() < 2 {
                return None;
            }
            // Pick a first site, then another on the same rank with the same peer.
            let start = rng.below(sites.len());
            for k in 0..sites.len() {
                let (r, i) = sites[(start + k) % sites.len()];
                let peer = q.ranks[r][i].comms()[0].peer();
                let others: Vec<usize> = sites
                    .iter()
                    .filter(|&&(r2, i2)| {
                        r2 == r && i2 != i && q.ranks[r2][i2].comms()[0].peer() == peer
                    })
                    .map(|&(_, i2)| i2)
                    .collect();
                if others.is_empty() {
                    continue;
                }
                let j = others[rng.below(others.len())];
                if recv {
                    q.ranks[r].swap(i, j);
                } else {
                    let (
                        Instr::Comm(Comm::Send { payload: a, .. }),
                        Instr::Comm(Comm::Send { payload: b, .. }),
                    ) = (q.ranks[r][i].clone(), q.ranks[r][j].clone())
                    else {
                        unreachable!()
                    };
                    if let Instr::Comm(Comm::Send { payload, .. }) = &mut q.ranks[r][i] {
                        *payload = b;
                    }
                    if let Instr::Comm(Comm::Send { payload, .. }) = &mut q.ranks[r][j] {
                        *payload = a;
                    }
                }
                return Some(q);
            }
            return None;
        }
    }
    Some(q)
}

/// The `shared/` folder beside the repository (reference data and cases), if present.
///
/// CI always has it and sets `SCHEDC_REQUIRE_SHARED=1`, which turns its absence into a test
/// failure; a developer's clone without it skips the conformance tests with a note.
pub fn shared_dir() -> Option<std::path::PathBuf> {
    let d = match std::env::var_os("SCHEDC_SHARED_DIR") {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"),
    };
    if d.is_dir() {
        return Some(d);
    }
    if std::env::var_os("SCHEDC_REQUIRE_SHARED").is_some_and(|v| v != "0") {
        panic!(
            "{} is missing and SCHEDC_REQUIRE_SHARED is set",
            d.display()
        );
    }
    // Written past libtest's capture (which takes only the print macros), so that the skip
    // shows in `cargo test`'s output next to the test that passed without its data.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "skipped: {} not found: the conformance tests against the shared reference data did not run (see README.md)",
        d.display()
    );
    None
}

/// Conformance of `specs/*.sched` with reference schedules.
pub mod conform {
    use schedc::input::{load_spec, LoadError, Overrides};
    use schedc_ir::{Compute, Instr, Kind, Program};
    use std::path::PathBuf;

    /// The repository root.
    pub fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    /// Elaborates `specs/<spec>.sched` for (P, M, V). `Ok(None)` if a `require` refuses it.
    pub fn elaborate(
        spec: &str,
        pp: u32,
        mb: u32,
        vpp: Option<u32>,
    ) -> Result<Option<Program>, String> {
        let path = root().join("specs").join(format!("{spec}.sched"));
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let ov = Overrides {
            pp: Some(pp),
            microbatches: Some(mb),
            vpp,
            ..Default::default()
        };
        match load_spec(&text, &ov) {
            Ok(e) => Ok(Some(e.program)),
            Err(LoadError::Spec { refused: true, .. }) => Ok(None),
            Err(LoadError::Spec { diags, .. }) => Err(diags
                .iter()
                .map(|d| format!("{}: {}", d.code.as_str(), d.message))
                .collect::<Vec<_>>()
                .join("; ")),
            Err(LoadError::Usage(u)) | Err(LoadError::Io(u)) => Err(u),
            Err(LoadError::Parse(p)) => Err(p.message),
        }
    }

    fn torch_tok(c: &Compute) -> String {
        let k = match c.kind {
            Kind::F => "F",
            Kind::B => "I",
            Kind::W => "W",
            Kind::BW => "B",
        };
        format!("{}{k}{}", c.stage, c.mb)
    }

    /// A rank's compute ops in torch's action syntax (idle slots and other ops dropped).
    pub fn torch_order(p: &Program, r: usize) -> Vec<String> {
        p.ranks[r]
            .iter()
            .filter_map(|i| match i {
                Instr::Compute(c) => Some(torch_tok(c)),
                Instr::Overlap { fwd, bwd } => Some(format!(
                    "({};{})OVERLAP_F_B",
                    torch_tok(fwd),
                    torch_tok(bwd)
                )),
                _ => None,
            })
            .collect()
    }

    /// Compares `spec` with every config of torch `class` in shared/reference/torch: the
    /// compute order of every rank (idle cells ignored) for accepted configs, refusal for
    /// refused ones. Returns one line per difference (empty: conformant), and the number of
    /// configs compared.
    ///
    /// `torch_1f1b`: the two documented departures from torch's Schedule1F1B. Its
    /// compute order numbers the last rank's forwards 1..=M (see
    /// tests/tests/conformance.rs), which the comparison undoes; and it refuses M < P only to
    /// dodge a hang in its own send/receive pairing (pytorch/torchtitan#775), so for those
    /// configs the spec must *accept* and its lowering must pass `schedc check`.
    pub fn torch(spec: &str, class: &str, torch_1f1b: bool) -> (Vec<String>, usize) {
        let last_rank_fwd_shift = torch_1f1b;
        let Some(shared) = crate::shared_dir() else {
            return (Vec::new(), 0);
        };
        let dir = shared.join("reference/torch");
        let recs: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let mut diffs = Vec::new();
        let mut n = 0;
        for rec in recs.iter().filter(|r| r["schedule"] == class) {
            n += 1;
            let name = rec["name"].as_str().unwrap();
            let pp = rec["pp"].as_u64().unwrap() as u32;
            let mb = rec["microbatches"].as_u64().unwrap() as u32;
            let v = rec["stages_per_rank"].as_u64().unwrap() as u32;
            let got = match elaborate(spec, pp, mb, Some(v)) {
                Ok(g) => g,
                Err(e) => {
                    diffs.push(format!("{name}: elaboration error: {e}"));
                    continue;
                }
            };
            let accepted = rec["accepted"].as_bool().unwrap();
            match (accepted, got) {
                (false, None) => {}
                (false, Some(p)) if torch_1f1b && mb < pp => {
                    let out = schedc::check::check(&p, None, &Default::default());
                    if out.report.verdict != schedc::check::Verdict::Accepted {
                        diffs.push(format!("{name}: M < P must be accepted and pass check"));
                    }
                }
                (false, Some(_)) => diffs.push(format!(
                    "{name}: torch refuses ({}) but the spec accepts",
                    rec["reason"]
                )),
                (true, None) => diffs.push(format!("{name}: torch accepts but the spec refuses")),
                (true, Some(p)) => {
                    let csv =
                        std::fs::read_to_string(dir.join(format!("{name}.compute.csv"))).unwrap();
                    for (r, line) in csv.lines().enumerate() {
                        let want: Vec<String> = line
                            .split(',')
                            .map(str::trim)
                            .filter(|c| {
                                !c.is_empty() && !c.contains("REDUCE_GRAD") && !c.contains("SHARD")
                            })
                            .map(|c| {
                                if last_rank_fwd_shift && r + 1 == pp as usize {
                                    if let Some((s, m)) = c.split_once('F') {
                                        return format!("{s}F{}", m.parse::<u32>().unwrap() - 1);
                                    }
                                }
                                c.to_string()
                            })
                            .collect();
                        let have = if r < p.ranks.len() {
                            torch_order(&p, r)
                        } else {
                            Vec::new()
                        };
                        if have != want {
                            let k = have
                                .iter()
                                .zip(&want)
                                .position(|(a, b)| a != b)
                                .unwrap_or(have.len().min(want.len()));
                            diffs.push(format!(
                                "{name} rank {r}: differs at op {k}: spec {:?} torch {:?} (lengths {} vs {})",
                                &have[k.min(have.len())..(k + 4).min(have.len())],
                                &want[k.min(want.len())..(k + 4).min(want.len())],
                                have.len(),
                                want.len()
                            ));
                        }
                    }
                }
            }
        }
        (diffs, n)
    }

    /// Compares `spec` with DeepSeek's reference traces of `schedule` ("dualpipe" or
    /// "dualpipev"): the compute order of every rank, op for op, and the refusals of
    /// constraints.json. Returns the differences and the number of traces compared.
    pub fn dualpipe(spec: &str, schedule: &str) -> (Vec<String>, usize) {
        let Some(shared) = crate::shared_dir() else {
            return (Vec::new(), 0);
        };
        let dir = shared.join("reference/dualpipe");
        let mut diffs = Vec::new();
        let mut n = 0;
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        for f in files {
            let fname = f.file_name().unwrap().to_str().unwrap().to_string();
            if !fname.starts_with(&format!("{schedule}_P")) {
                continue;
            }
            n += 1;
            let src = std::fs::read_to_string(&f).unwrap();
            let want = schedc::import::dualpipe::parse_trace_compute_only(&src).unwrap();
            let v: serde_json::Value = serde_json::from_str(&src).unwrap();
            let (pp, nchunks) = (
                v["num_ranks"].as_u64().unwrap() as u32,
                v["num_chunks"].as_u64().unwrap() as u32,
            );
            match elaborate(spec, pp, nchunks, None) {
                Err(e) => diffs.push(format!("{fname}: elaboration error: {e}")),
                Ok(None) => diffs.push(format!(
                    "{fname}: the reference runs it but the spec refuses"
                )),
                Ok(Some(p)) => {
                    if p.pipeline != want.pipeline {
                        diffs.push(format!(
                            "{fname}: pipeline differs: spec {:?} reference {:?}",
                            p.pipeline, want.pipeline
                        ));
                    }
                    for r in 0..pp as usize {
                        let have: Vec<&Instr> =
                            p.ranks[r].iter().filter(|i| i.is_compute()).collect();
                        let wants: Vec<&Instr> =
                            want.ranks[r].iter().filter(|i| i.is_compute()).collect();
                        if have != wants {
                            let k = have
                                .iter()
                                .zip(&wants)
                                .position(|(a, b)| a != b)
                                .unwrap_or(have.len().min(wants.len()));
                            let t = |v: &[&Instr]| {
                                v.iter()
                                    .map(|i| schedc_ir::text::instr_to_string(i))
                                    .collect::<Vec<_>>()
                            };
                            diffs.push(format!(
                                "{fname} rank {r}: differs at op {k}: spec {:?} reference {:?} (lengths {} vs {})",
                                t(&have[k.min(have.len())..(k + 4).min(have.len())]),
                                t(&wants[k.min(wants.len())..(k + 4).min(wants.len())]),
                                have.len(),
                                wants.len()
                            ));
                        }
                    }
                }
            }
        }
        let cons: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("constraints.json")).unwrap())
                .unwrap();
        for c in cons.iter().filter(|c| c["schedule"] == schedule) {
            n += 1;
            let (pp, nch) = (
                c["P"].as_u64().unwrap() as u32,
                c["N"].as_u64().unwrap() as u32,
            );
            let refused = c["probe"].as_str().unwrap().starts_with("rejected");
            match (refused, elaborate(spec, pp, nch, None)) {
                (true, Ok(None)) | (false, Ok(Some(_))) => {}
                (true, r) => diffs.push(format!(
                    "P={pp} N={nch}: the reference refuses but the spec gives {:?}",
                    r.map(|p| p.is_some())
                )),
                (false, r) => diffs.push(format!(
                    "P={pp} N={nch}: the reference accepts but the spec gives {:?}",
                    r.map(|p| p.is_some())
                )),
            }
        }
        (diffs, n)
    }
}

/// Conformance with the Zero Bubble / Controllable Memory / Chimera authors' generators
/// (`shared/reference/zb`, see its README): per-rank orders, the makespan from time 0 under
/// the README's timing model, and peak activations.
pub mod zb {
    use schedc::sim::cost::CostModel;
    use schedc_ir::{Compute, Instr, Kind, Pipeline, PlacementKind, Program};

    /// One reference configuration.
    pub struct RefConfig {
        /// `vhalf_P8_M24_unit`, ...
        pub id: String,
        /// Ranks.
        pub pp: u32,
        /// Micro-batches (both directions together for Chimera).
        pub mb: u32,
        /// `unit`, `profA`, `profB`.
        pub cost_name: String,
        /// F, B, W, comm.
        pub cost: [f64; 4],
        /// The authors' orders as a schedc program.
        pub program: Program,
        /// The README's `derived.makespan_from_t0`.
        pub makespan: f64,
        /// The README's `derived.per_rank_peak_mem_units`.
        pub peaks: Vec<u64>,
    }

    /// The reference configs of `generator` (empty without `../shared`), sorted by (P, M,
    /// cost set).
    pub fn configs(generator: &str) -> Vec<RefConfig> {
        let Some(shared) = crate::shared_dir() else {
            return Vec::new();
        };
        let dir = shared.join("reference/zb");
        let mut out = Vec::new();
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if !name.starts_with(&format!("{generator}_P")) || !name.ends_with(".json") {
                continue;
            }
            let d: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            out.push(parse(&d));
        }
        out.sort_by(|a, b| (a.pp, a.mb, &a.cost_name).cmp(&(b.pp, b.mb, &b.cost_name)));
        out
    }

    fn parse(d: &serde_json::Value) -> RefConfig {
        let pp = d["P"].as_u64().unwrap() as u32;
        let mb = d["M"].as_u64().unwrap() as u32;
        let c = &d["cost"];
        let cost = ["F", "B", "W", "comm"].map(|k| c[k].as_f64().unwrap());
        let placement = d["placement"].as_str().unwrap();
        let (pipeline, mb_of): (Pipeline, Box<dyn Fn(u32, u32) -> u32>) = match placement {
            "V" => (
                Pipeline::new(pp, 2 * pp, mb, PlacementKind::V).unwrap(),
                Box::new(|_, m| m),
            ),
            "interleaved" => (
                Pipeline::new(pp, 2 * pp, mb, PlacementKind::Loop).unwrap(),
                Box::new(|_, m| m),
            ),
            "single" => (
                Pipeline::new(pp, pp, mb, PlacementKind::Loop).unwrap(),
                Box::new(|_, m| m),
            ),
            "bidir" => {
                // Micro-batches are numbered over both directions; each pipeline instance
                // holds a run of them in one direction. Per direction, schedc numbers them
                // 0.. in instance order.
                let inst = &d["generator_reported"]["pipeline_instances"];
                let mut map = std::collections::HashMap::new();
                let mut next = [0u32; 2];
                let mut keys: Vec<u64> = inst
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(|k| k.parse().unwrap())
                    .collect();
                keys.sort();
                for k in keys {
                    let v = &inst[k.to_string()];
                    let dir = usize::from(v["direction_label"] == "up");
                    for m in v["microbatches"].as_array().unwrap() {
                        map.insert((dir as u32, m.as_u64().unwrap() as u32), next[dir]);
                        next[dir] += 1;
                    }
                }
                (
                    Pipeline::new(pp, 2 * pp, mb / 2, PlacementKind::Bidir).unwrap(),
                    Box::new(move |dir, m| map[&(dir, m)]),
                )
            }
            other => panic!("unknown placement {other}"),
        };
        let stage_of = |r: u32, chunk: u32| -> u32 {
            match placement {
                "V" => {
                    if chunk == 0 {
                        r
                    } else {
                        2 * pp - 1 - r
                    }
                }
                "interleaved" => chunk * pp + r,
                "single" => r,
                _ => {
                    if chunk == 0 {
                        r
                    } else {
                        pp + (pp - 1 - r)
                    }
                }
            }
        };
        let ranks = d["orders"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(r, ops)| {
                ops.as_array()
                    .unwrap()
                    .iter()
                    .map(|o| {
                        let kind = match o["type"].as_str().unwrap() {
                            "F" => Kind::F,
                            "B" => Kind::B,
                            "W" => Kind::W,
                            "BW" => Kind::BW,
                            t => panic!("op type {t}"),
                        };
                        let chunk = o["chunk"].as_u64().unwrap() as u32;
                        let m = o["microbatch"].as_u64().unwrap() as u32;
                        Instr::Compute(Compute::new(
                            kind,
                            stage_of(r as u32, chunk),
                            mb_of(chunk, m),
                        ))
                    })
                    .collect()
            })
            .collect();
        let x = &d["derived"];
        RefConfig {
            id: d["config_id"].as_str().unwrap().to_string(),
            pp,
            mb,
            cost_name: d["cost_name"].as_str().unwrap().to_string(),
            cost,
            program: Program { pipeline, ranks },
            makespan: x["makespan_from_t0"].as_f64().unwrap(),
            peaks: x["per_rank_peak_mem_units"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect(),
        }
    }

    /// The cost model of a reference cost set: op times F, B, W (BW = B + W) and `comm` as
    /// the latency of every message between ranks.
    pub fn cost_model(c: [f64; 4]) -> CostModel {
        let toml = format!(
            "[compute]\nF = {}\nB = {}\nW = {}\n[p2p]\nlatency = {}\n",
            c[0], c[1], c[2], c[3]
        );
        CostModel::from_toml(&toml).unwrap()
    }

    /// The README's timing model (`derived`): each rank runs its compute ops back to back in
    /// order, each as soon as the rank is free and its input is done (the previous stage's
    /// F; the next stage's B, or the stage's own F on a last stage; its own B for W), plus
    /// `comm` when the input comes from another rank. Returns the makespan from time 0, or
    /// `None` if the orders cannot run.
    pub fn makespan(p: &Program, c: [f64; 4]) -> Option<f64> {
        finish_times(p, c).map(|f| f.iter().cloned().fold(0.0, f64::max))
    }

    /// Per rank, when its last op ends under [`makespan`]'s model.
    pub fn finish_times(p: &Program, c: [f64; 4]) -> Option<Vec<f64>> {
        start_times(p, c).map(|(f, _)| f)
    }

    /// Per rank, when its last op ends, and the start of every op by (kind, stage, mb).
    #[allow(clippy::type_complexity)]
    pub fn start_times(
        p: &Program,
        c: [f64; 4],
    ) -> Option<(Vec<f64>, std::collections::HashMap<(Kind, u32, u32), f64>)> {
        let mut starts = std::collections::HashMap::new();
        let pl = &p.pipeline;
        let (sn, mn) = (pl.stages as usize, pl.microbatches as usize);
        let mut end_f = vec![f64::NAN; sn * mn];
        let mut end_b = vec![f64::NAN; sn * mn];
        let mut free = vec![0f64; p.ranks.len()];
        let mut pos = vec![0usize; p.ranks.len()];
        let dur = |k: Kind| match k {
            Kind::F => c[0],
            Kind::B => c[1],
            Kind::W => c[2],
            Kind::BW => c[1] + c[2],
        };
        loop {
            let mut progress = false;
            for r in 0..p.ranks.len() {
                while let Some(Instr::Compute(o)) = p.ranks[r].get(pos[r]) {
                    let k = o.stage as usize * mn + o.mb as usize;
                    let (input, from) = match o.kind {
                        Kind::F => match pl.prev_stage(o.stage) {
                            Some(s) => (end_f[s as usize * mn + o.mb as usize], s),
                            None => (0.0, o.stage),
                        },
                        Kind::B | Kind::BW => match pl.next_stage(o.stage) {
                            Some(s) => (end_b[s as usize * mn + o.mb as usize], s),
                            None => (end_f[k], o.stage),
                        },
                        Kind::W => (end_b[k], o.stage),
                    };
                    if input.is_nan() {
                        break;
                    }
                    let arrive = if pl.rank_of(from) as usize != r {
                        input + c[3]
                    } else {
                        input
                    };
                    starts.insert((o.kind, o.stage, o.mb), arrive.max(free[r]));
                    let e = arrive.max(free[r]) + dur(o.kind);
                    free[r] = e;
                    match o.kind {
                        Kind::F => end_f[k] = e,
                        Kind::B | Kind::BW => end_b[k] = e,
                        Kind::W => {}
                    }
                    pos[r] += 1;
                    progress = true;
                }
            }
            if !progress {
                break;
            }
        }
        if (0..p.ranks.len()).any(|r| pos[r] < p.ranks[r].len()) {
            return None;
        }
        Some((free, starts))
    }

    /// Peak live activations per rank (F allocates, W or BW frees: `schedc check`'s count,
    /// and the README's `peak_mem_units`).
    pub fn peaks(p: &Program) -> Vec<u64> {
        schedc::passes::liveness::analyze(p, None)
            .0
            .iter()
            .map(|l| l.peak)
            .collect()
    }
}

pub mod zbv;
