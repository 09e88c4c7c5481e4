//! The memory a run needs per rank, checked before anything is allocated: each backend
//! estimates its ranks' needs ([`RankNeed`]) from the lowered programs and the model's sizes
//! alone, and [`check_fit`] compares them with what the host or the device has, with an
//! error that names the rank, its need and the limit.

use crate::ProgramSet;
use schedc::limits::human_bytes;

/// What one global rank needs, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankNeed {
    /// Global rank.
    pub rank: u32,
    /// Parameters, their gradients and the optimizer state of the rank's stage copies.
    pub params: u64,
    /// Activations and buffers (stashes, messages, scratch) at the rank's peak.
    pub activations: u64,
}

impl RankNeed {
    /// Everything, bytes (saturating).
    pub fn total(&self) -> u64 {
        self.params.saturating_add(self.activations)
    }
}

fn describe(n: &RankNeed) -> String {
    format!(
        "rank {} needs {} ({} of parameters, gradients and optimizer state, {} of activations and buffers)",
        n.rank,
        human_bytes(n.total()),
        human_bytes(n.params),
        human_bytes(n.activations)
    )
}

/// Ok if the ranks fit. `together`: all of `needs` share `limit` (every rank in one
/// process, or on one device); otherwise each rank has `limit` of its own. `limit_name`
/// says what the limit is (e.g. "the 139.7 GiB free on GPU 0", "--memory-limit").
///
/// Errors: the message, naming the rank that needs the most, its need (split into
/// parameters and activations), the sum when shared, and the limit.
pub fn check_fit(
    needs: &[RankNeed],
    limit: u64,
    limit_name: &str,
    together: bool,
) -> Result<(), String> {
    let Some(worst) = needs.iter().max_by_key(|n| (n.total(), u32::MAX - n.rank)) else {
        return Ok(());
    };
    if together && needs.len() > 1 {
        let sum = needs.iter().fold(0u64, |a, n| a.saturating_add(n.total()));
        if sum > limit {
            return Err(format!(
                "the model does not fit: the {} rank(s) run here need {} together, more than {limit_name} ({}); the largest, {}",
                needs.len(),
                human_bytes(sum),
                human_bytes(limit),
                describe(worst)
            ));
        }
    } else if worst.total() > limit {
        return Err(format!(
            "the model does not fit: {}, more than {limit_name} ({})",
            describe(worst),
            human_bytes(limit)
        ));
    }
    Ok(())
}

/// The CPU backend's needs: per global rank, its stage copies' parameters with their
/// gradient accumulators and Adam's two moments (`4 x elem` bytes per parameter, plus the
/// same again with `verify`, for the recorded gradients and the sequential reference), and
/// its peak of live stashes (`peak_activations`: [`crate::verify::VerifyReport::peak_activations`],
/// `schedc check`'s count, so a stash lent to another rank counts on its holder) of
/// [`crate::ModelConfig::stash_elems_per_token`] per token (`B T / sp` per micro-batch) and
/// layer, plus, on a rank that holds a last stage, the LM head's saved state per stash
/// (`vocab + 3 hidden + 1` per token: the scaled logits' gradient, the final norm's output,
/// normalized input and inverse, and the head's input gradient; an upper bound where the
/// rank's peak also holds stashes of other stages). An estimate: the CPU backend's buffers
/// are not planned ahead, and its temporaries (a backward's intermediate gradients, messages
/// in flight) are not counted.
pub fn cpu_needs(
    set: &ProgramSet,
    peak_activations: &[u32],
    elem: u64,
    verify: bool,
) -> Vec<RankNeed> {
    let Some(m) = &set.manifest.model else {
        return Vec::new();
    };
    let mesh = &set.manifest.mesh;
    let tp = mesh.size(crate::mesh::Dim::Tp) as usize;
    let sp = mesh.size(crate::mesh::Dim::Sp) as usize;
    // The micro-batch's B sequences, each its chunk of T / sp rows.
    let t = ((m.seq_len / sp.max(1)).max(1) as u64).saturating_mul(m.micro_batch_size as u64);
    let per_stash = (m.layers_per_stage as u64)
        .saturating_mul(t)
        .saturating_mul(m.stash_elems_per_token(m.seq_len, tp))
        .saturating_mul(elem);
    // The head's stash per micro-batch: dlogits (t x vocab), xf, xhat, dxf (t x d), inv (t).
    let head_stash = t
        .saturating_mul((m.vocab as u64).saturating_add(3 * m.hidden as u64 + 1))
        .saturating_mul(elem);
    let state = if verify { 8 } else { 4 };
    set.ranks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let params = r.stages.iter().fold(0u64, |a, s| {
                a.saturating_add(m.stage_params(
                    s.first,
                    s.last,
                    (s.expert_hi - s.expert_lo) as usize,
                    tp,
                ))
            });
            let peak = peak_activations.get(i).copied().unwrap_or(0) as u64;
            let per = if r.stages.iter().any(|s| s.last) {
                per_stash.saturating_add(head_stash)
            } else {
                per_stash
            };
            RankNeed {
                rank: r.rank,
                params: params.saturating_mul(state * elem),
                activations: peak.saturating_mul(per),
            }
        })
        .collect()
}

/// The host's available memory, bytes: `MemAvailable` of `/proc/meminfo` (Linux), or
/// `None` where it cannot be read.
pub fn available_ram() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_fit_names_the_rank_its_need_and_the_limit() {
        let needs = [
            RankNeed {
                rank: 0,
                params: 3 << 30,
                activations: 1 << 30,
            },
            RankNeed {
                rank: 1,
                params: 5 << 30,
                activations: 1 << 30,
            },
        ];
        let limit = 11 << 29; // 5.5 GiB
        assert_eq!(
            check_fit(&needs, limit, "--memory-limit", false).unwrap_err(),
            "the model does not fit: rank 1 needs 6.0 GiB (5.0 GiB of parameters, gradients and optimizer state, 1.0 GiB of activations and buffers), more than --memory-limit (5.5 GiB)"
        );
        // Each fits in 6 GiB of its own, not in 6 GiB shared.
        assert_eq!(check_fit(&needs, 6 << 30, "x", false), Ok(()));
        assert_eq!(
            check_fit(&needs, 6 << 30, "the 6.0 GiB free on GPU 0", true).unwrap_err(),
            "the model does not fit: the 2 rank(s) run here need 10.0 GiB together, more than the 6.0 GiB free on GPU 0 (6.0 GiB); the largest, rank 1 needs 6.0 GiB (5.0 GiB of parameters, gradients and optimizer state, 1.0 GiB of activations and buffers)"
        );
        assert_eq!(check_fit(&needs, 10 << 30, "x", true), Ok(()));
    }
}
