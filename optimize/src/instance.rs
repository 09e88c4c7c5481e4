//! The problem: a pipeline (ranks, stages, micro-batches, placement), the time of every op
//! under a cost model, and the activation cap.

use schedc::sim::cost::CostModel;
use schedc_ir::{Compute, Kind, Pipeline, PlacementKind};

/// Why a problem cannot be searched (the CLI exits 2 on each).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ProblemError {
    /// The cap is below what any schedule on this placement needs.
    #[error("--max-activations {cap} is below the minimum any schedule on this placement needs: {min} (stage, micro-batch) activations on rank {rank}, which holds {min} stages of one direction that one micro-batch passes through before its first backward")]
    CapBelowMinimum {
        /// The cap asked for.
        cap: u64,
        /// The minimum.
        min: u64,
        /// A rank that needs it.
        rank: u32,
    },
    /// The cost model gives no compute times.
    #[error("the cost model gives no op times: set [compute] F, B and W (seconds per op; inline: F=1,B=1,W=1,...) or use a preset such as `unit` (`schedc sim` falls back to unit op times; `optimize` asks for them, so that a model of messages or memory alone is not optimized in unit times by mistake)")]
    NoTimes,
    /// An op takes no time or a negative or non-finite time.
    #[error("the cost model gives {what} = {value} on stage {stage}: every op must take a positive, finite time")]
    BadTime {
        /// Which op.
        what: &'static str,
        /// Its stage.
        stage: u32,
        /// The value.
        value: f64,
    },
    /// The input cannot be searched (MoE parts, collectives, an unsupported placement).
    #[error("{0}")]
    Unsupported(String),
}

/// One problem instance: the pipeline, per-stage op times (seconds), the message time and the
/// activation cap.
///
/// Times come from [`CostModel::compute_time`] (so `op_scale` applies) and
/// [`CostModel::message_time`] (latency + bytes / bandwidth, added to every cross-rank
/// dependency).
#[derive(Clone, Debug)]
pub struct Instance {
    /// The pipeline (kept as given: the search keeps the placement).
    pub pipeline: Pipeline,
    /// P.
    pub p: usize,
    /// S (stage ids).
    pub s: usize,
    /// M (micro-batches per stage).
    pub m: usize,
    /// Rank of each stage.
    pub rank_of: Vec<u32>,
    /// Consumer stage of each stage's activation (`None` on the last stage of a direction).
    pub next: Vec<Option<u32>>,
    /// Producer stage of each stage's input (`None` on the first stage of a direction).
    pub prev: Vec<Option<u32>>,
    /// Stages held by each rank, increasing.
    pub stages_of: Vec<Vec<u32>>,
    /// Forward time per stage, seconds.
    pub d_f: Vec<f64>,
    /// Input-gradient backward (B) time per stage, seconds.
    pub d_b: Vec<f64>,
    /// Weight-gradient (W) time per stage, seconds.
    pub d_w: Vec<f64>,
    /// Fused backward (BW) time per stage, seconds.
    pub d_bw: Vec<f64>,
    /// Overlapped F&B time per backward stage when the cost model sets `FB`, seconds.
    pub d_fb: Vec<Option<f64>>,
    /// Seconds of one cross-rank message.
    pub lat: f64,
    /// Most live (stage, micro-batch) activations per rank (pass 6's count); `u64::MAX` for
    /// no cap.
    pub cap: u64,
}

impl Instance {
    /// Builds the instance. `cap` is in (stage, micro-batch) activations, the unit of
    /// `schedc check --max-activations`.
    ///
    /// Errors: [`ProblemError::CapBelowMinimum`], [`ProblemError::NoTimes`],
    /// [`ProblemError::BadTime`].
    pub fn new(pl: &Pipeline, cost: &CostModel, cap: Option<u64>) -> Result<Self, ProblemError> {
        if !has_times(cost) {
            return Err(ProblemError::NoTimes);
        }
        let (p, s, m) = (pl.pp as usize, pl.stages as usize, pl.microbatches as usize);
        let t = |k: Kind, st: u32| cost.compute_time(&Compute::new(k, st, 0));
        let mut d_f = Vec::with_capacity(s);
        let mut d_b = Vec::with_capacity(s);
        let mut d_w = Vec::with_capacity(s);
        let mut d_bw = Vec::with_capacity(s);
        let mut d_fb = Vec::with_capacity(s);
        for st in 0..s as u32 {
            for (what, k) in [
                ("F", Kind::F),
                ("B", Kind::B),
                ("W", Kind::W),
                ("BW", Kind::BW),
            ] {
                let v = t(k, st);
                if !(v.is_finite() && v > 0.0) {
                    return Err(ProblemError::BadTime {
                        what,
                        stage: st,
                        value: v,
                    });
                }
            }
            d_f.push(t(Kind::F, st));
            d_b.push(t(Kind::B, st));
            d_w.push(t(Kind::W, st));
            d_bw.push(t(Kind::BW, st));
            let f = Compute::new(Kind::F, st, 0);
            let b = Compute::new(Kind::B, st, 0);
            let pair = cost.pair_time(&f, &b);
            let plain = cost.compute_time(&f) + cost.compute_time(&b);
            d_fb.push(if (pair - plain).abs() > 1e-12 {
                Some(pair)
            } else {
                None
            });
        }
        let inst = Instance {
            pipeline: pl.clone(),
            p,
            s,
            m,
            rank_of: pl.stage_to_rank.clone(),
            next: (0..s as u32).map(|x| pl.next_stage(x)).collect(),
            prev: (0..s as u32).map(|x| pl.prev_stage(x)).collect(),
            stages_of: (0..p as u32).map(|r| pl.stages_of(r)).collect(),
            d_f,
            d_b,
            d_w,
            d_bw,
            d_fb,
            lat: cost.message_time(),
            cap: cap.unwrap_or(u64::MAX),
        };
        if let Some(c) = cap {
            let (min, rank) = inst.min_cap();
            if c < min {
                return Err(ProblemError::CapBelowMinimum { cap: c, min, rank });
            }
        }
        Ok(inst)
    }

    /// The smallest cap any schedule meets, and a rank that needs it: the most stages of one
    /// direction a rank holds. One micro-batch's forward passes through all of them before
    /// its first backward, so all are live at once; running micro-batches one at a time
    /// meets it.
    pub fn min_cap(&self) -> (u64, u32) {
        let per = self.pipeline.stages_per_direction();
        let mut best = (1u64, 0u32);
        for (r, st) in self.stages_of.iter().enumerate() {
            let dirs = self.pipeline.directions();
            for d in 0..dirs {
                let n = st.iter().filter(|&&x| x / per == d).count() as u64;
                if n > best.0 {
                    best = (n, r as u32);
                }
            }
        }
        best
    }

    /// Time of an overlapped pair: the cost model's `FB` for the backward's stage, else the
    /// sum of the two ops.
    #[inline]
    pub fn pair_time(&self, f: u32, b: u32, fused: bool) -> f64 {
        match self.d_fb[b as usize] {
            Some(t) => t,
            None => self.d_f[f as usize] + self.bwd_time(b, fused),
        }
    }

    /// Time of a backward-input op: `BW` when fused, else `B`.
    #[inline]
    pub fn bwd_time(&self, s: u32, fused: bool) -> f64 {
        if fused {
            self.d_bw[s as usize]
        } else {
            self.d_b[s as usize]
        }
    }

    /// True if splitting a fused backward into B then W never hurts: `BW >= B + W` on every
    /// stage (the split produces the input gradient sooner and frees the same memory at the
    /// same time).
    pub fn split_dominates(&self) -> bool {
        (0..self.s).all(|x| self.d_bw[x] >= self.d_b[x] + self.d_w[x] - 1e-12)
    }

    /// True if some overlapped pair is faster than its two ops back to back.
    pub fn pairs_help(&self) -> bool {
        (0..self.s).any(|b| {
            self.d_fb[b].is_some_and(|t| {
                (0..self.s).any(|f| t < self.d_f[f] + self.d_b[b].min(self.d_bw[b]) - 1e-12)
            })
        })
    }

    /// True if the message time is zero (every message can share channel 0).
    pub fn free_comm(&self) -> bool {
        self.lat == 0.0
    }

    /// Total compute per rank if every backward is split (seconds).
    pub fn work(&self, r: usize) -> f64 {
        self.stages_of[r]
            .iter()
            .map(|&x| {
                let x = x as usize;
                self.m as f64 * (self.d_f[x] + (self.d_b[x] + self.d_w[x]).min(self.d_bw[x]))
            })
            .sum()
    }

    /// The instance as the CP-SAT model of `optimize/cpsat/prove.py` reads it: `rank_of`,
    /// `next`, `prev` (stage links, `null` at a direction's end), per-stage op times `d_f`,
    /// `d_b`, `d_w`, `d_bw` (seconds), the message time `lat` (seconds) and the `cap`
    /// (activations per rank; omitted for no cap). Callers add their labels (`placement`,
    /// `P`, `M`, `cost`, ...).
    pub fn model_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "rank_of": self.rank_of,
            "next": self.next,
            "prev": self.prev,
            "d_f": self.d_f, "d_b": self.d_b, "d_w": self.d_w, "d_bw": self.d_bw,
            "lat": self.lat,
        });
        if self.cap != u64::MAX {
            v["cap"] = self.cap.into();
        }
        v
    }

    /// True for a `Bidir` (DualPipe) pipeline.
    pub fn bidir(&self) -> bool {
        self.pipeline.placement == PlacementKind::Bidir
    }
}

/// True if the cost model sets at least one compute time (model-wide or per stage).
pub fn has_times(cost: &CostModel) -> bool {
    let set = |c: &schedc::sim::cost::OpCosts| {
        c.f.is_some() || c.b.is_some() || c.w.is_some() || c.bw.is_some()
    };
    set(&cost.compute.all) || cost.compute.stage.values().any(set)
}
