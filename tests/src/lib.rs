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
    let d = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared");
    if d.is_dir() {
        return Some(d);
    }
    if std::env::var_os("SCHEDC_REQUIRE_SHARED").is_some_and(|v| v != "0") {
        panic!(
            "{} is missing and SCHEDC_REQUIRE_SHARED is set",
            d.display()
        );
    }
    eprintln!(
        "note: {} not found; skipping the tests that need it",
        d.display()
    );
    None
}
