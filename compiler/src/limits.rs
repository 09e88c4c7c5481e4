//! Memory limits: every command estimates, before the work that grows with the instance,
//! how much memory an instance needs, and refuses one whose estimate exceeds the limit
//! (exit status 2, with the estimate, the limit and how to change it), instead of running
//! out of memory part way or being killed.
//!
//! The limit is [`DEFAULT_MEMORY_LIMIT`] (8 GiB) unless the environment variable
//! `SCHEDC_MEMORY_LIMIT` says otherwise (`SCHEDC_MEMORY_LIMIT=32G`, `=512M`, `=1000000000`;
//! binary units).
//!
//! The estimates are linear in the size of the instance, with coefficients measured as peak
//! resident memory (`/usr/bin/time -f %M`) of the release binary on the standard library's
//! schedules and then doubled as a margin; the book's CLI chapter lists them with the
//! commands that measured them. They are estimates of the work after loading; loading itself
//! is bounded by the input (a file is read whole, a spec's elaboration by its step budget,
//! which [`elaboration_budget`] derives from the limit).

use schedc_ir::{Instr, Program};

/// The memory limit when `SCHEDC_MEMORY_LIMIT` is not set, bytes (8 GiB).
pub const DEFAULT_MEMORY_LIMIT: u64 = 8 << 30;

/// The environment variable that sets the limit.
pub const LIMIT_VAR: &str = "SCHEDC_MEMORY_LIMIT";

/// Bytes per elaboration step of a spec (an emitted op or an idle slot, with its source
/// span), measured: 525 MB peak for the 20 M steps of `1f1b --pp 64 --mb 150000`, doubled.
pub const ELAB_BYTES_PER_STEP: u64 = 52;

/// Bytes per op for `check` and `show` (the seven passes, the lowering of compute-only
/// input, the report), measured: 209 MB for the 524 288 ops of `check specs/1f1b.sched
/// --pp 64 --mb 4096`, about 400 B per op, doubled.
pub const CHECK_BYTES_PER_OP: u64 = 800;

/// Bytes per op for `sim` (`check` plus the event list), measured: 316 MB for the same
/// instance, about 600 B per op, doubled.
pub const SIM_BYTES_PER_OP: u64 = 1200;

/// Bytes per op for `convert` without checking (the IR and the output text), measured: 84 MB
/// for the same instance to IR JSON, about 160 B per op, doubled.
pub const CONVERT_BYTES_PER_OP: u64 = 320;

/// Fixed part of every estimate (the binary, buffers), bytes.
pub const BASE_BYTES: u64 = 64 << 20;

/// The size of a loaded instance.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Size {
    /// Pipeline ranks.
    pub ranks: u64,
    /// Stages.
    pub stages: u64,
    /// Micro-batches, both directions together.
    pub microbatches: u64,
    /// Compute ops (an overlapped pair counts 2, an MoE part 1).
    pub compute_ops: u64,
    /// Communication ops as written (0 for compute-only input).
    pub comm_ops: u64,
}

impl Size {
    /// The size of `p`.
    pub fn of(p: &Program) -> Size {
        let mut compute = 0u64;
        let mut comm = 0u64;
        for i in p.ranks.iter().flatten() {
            match i {
                Instr::Compute(_) => compute += 1,
                Instr::Overlap { .. } => compute += 2,
                Instr::Group(g) => comm += g.len() as u64,
                _ => comm += 1,
            }
        }
        Size {
            ranks: p.pipeline.pp as u64,
            stages: p.pipeline.stages as u64,
            microbatches: p.pipeline.total_microbatches() as u64,
            compute_ops: compute,
            comm_ops: comm,
        }
    }

    /// Ops the passes work on: those written, plus the sends and receives that lowering
    /// inserts for compute-only input (at most two per compute op).
    pub fn checked_ops(&self) -> u64 {
        if self.comm_ops == 0 {
            self.compute_ops.saturating_mul(3)
        } else {
            self.compute_ops.saturating_add(self.comm_ops)
        }
        .saturating_add(self.stages.saturating_mul(self.microbatches))
        .saturating_add(self.ranks)
    }
}

/// What a command does with an instance, for [`estimate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// `check`, `show`, `convert --lowered` or `--torch-format compute-comms`.
    Check,
    /// `sim`, and each spec of `compare` and `plan`.
    Sim,
    /// `convert` as written.
    Convert,
}

/// The estimated peak memory of `work` on an instance of `size`, bytes (saturating).
pub fn estimate(work: Work, size: &Size) -> u64 {
    let per_op = match work {
        Work::Check => CHECK_BYTES_PER_OP,
        Work::Sim => SIM_BYTES_PER_OP,
        Work::Convert => CONVERT_BYTES_PER_OP,
    };
    BASE_BYTES.saturating_add(size.checked_ops().saturating_mul(per_op))
}

/// A lower bound on the size of a spec's instance before it is elaborated: every (stage,
/// micro-batch) pair has a forward and a backward, and there are at least P x V stages of M
/// micro-batches each (DualPipe: 2P stages of M/2).
pub fn spec_size_lower_bound(pp: u32, mb: u32, vpp: Option<u32>) -> Size {
    let stages = pp as u64 * vpp.unwrap_or(1).max(1) as u64;
    Size {
        ranks: pp as u64,
        stages,
        microbatches: mb as u64,
        compute_ops: stages.saturating_mul(mb as u64).saturating_mul(2),
        comm_ops: 0,
    }
}

/// Parses a size: a number of bytes, optionally with a binary suffix K, M, G or T (`KB`,
/// `KiB`... accepted too). Errors: anything else, or zero.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || {
        format!(
            "invalid size `{s}`: expected a number of bytes, optionally with K, M, G or T (e.g. 8G, or 3.5e9)"
        )
    };
    // A plain number, exponent notation included (`3.5e9`).
    if let Ok(v) = t.parse::<f64>() {
        if v.is_finite() && v >= 1.0 {
            return Ok(if v >= u64::MAX as f64 {
                u64::MAX
            } else {
                v as u64
            });
        }
        if v.is_finite() && v >= 0.0 {
            return Err(format!("invalid size `{s}`: must be at least 1 byte"));
        }
        return Err(bad());
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        "T" | "TB" | "TIB" => 1 << 40,
        _ => return Err(bad()),
    };
    let v = n * mult as f64;
    if !(v.is_finite() && v >= 1.0) {
        return Err(bad());
    }
    Ok(if v >= u64::MAX as f64 {
        u64::MAX
    } else {
        v as u64
    })
}

/// The limit in force: `SCHEDC_MEMORY_LIMIT` or [`DEFAULT_MEMORY_LIMIT`]. Errors: a value
/// [`parse_size`] refuses.
pub fn memory_limit() -> Result<u64, String> {
    match std::env::var(LIMIT_VAR) {
        Ok(v) => parse_size(&v).map_err(|e| format!("{LIMIT_VAR}: {e}")),
        Err(std::env::VarError::NotPresent) => Ok(DEFAULT_MEMORY_LIMIT),
        Err(_) => Err(format!("{LIMIT_VAR} is not valid Unicode")),
    }
}

/// The process's address-space limit (`ulimit -v`, RLIMIT_AS; the soft limit), bytes, and
/// the room left under it (the limit less the virtual memory mapped now): `None` without a
/// limit, or where `/proc/self` cannot tell (off Linux).
///
/// The estimates count resident memory, and virtual memory is larger (thread stacks and
/// allocator arenas are reserved whole), so a command may still fail to allocate under a
/// tight limit; this refuses what is over it for certain. A command that is out of memory
/// all the same aborts with "memory allocation of N bytes failed" (exit status 134).
pub fn address_space_room() -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    let soft = line
        .trim_start_matches("Max address space")
        .split_whitespace()
        .next()?;
    let limit: u64 = soft.parse().ok()?; // `unlimited` does not parse: no limit
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let vm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((limit.saturating_sub(vm_kib.saturating_mul(1024)), limit))
}

/// Bytes as a short human figure (`1.5 GiB`).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else if v >= 1e4 {
        format!("{:.3e} {}", v, UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Ok if `estimate` bytes fit in the limit; otherwise the message refusing `what` (which
/// names the instance), with the estimate, the limit and how to raise it.
pub fn within_limit(what: &str, estimate: u64) -> Result<(), String> {
    let limit = memory_limit()?;
    if estimate <= limit {
        // Under `ulimit -v`, refuse what cannot be mapped rather than abort on a failed
        // allocation part way.
        if let Some((room, as_limit)) = address_space_room() {
            if estimate > room {
                return Err(format!(
                    "{what} needs about {} of memory by schedc's estimate, more than the {} left under the virtual-memory limit of {} (`ulimit -v {}`): raise `ulimit -v` or remove it",
                    human_bytes(estimate),
                    human_bytes(room),
                    human_bytes(as_limit),
                    as_limit / 1024
                ));
            }
        }
        return Ok(());
    }
    Err(format!(
        "{what} needs about {} of memory by schedc's estimate, more than the limit of {} (set {LIMIT_VAR}, e.g. {LIMIT_VAR}=64G, to allow more; the book's CLI chapter explains the estimate)",
        human_bytes(estimate),
        human_bytes(limit)
    ))
}

/// Bytes of input one read may take: a sixteenth of the limit (the program parsed from a
/// text takes a few times the text).
pub fn max_input_bytes() -> u64 {
    memory_limit().unwrap_or(DEFAULT_MEMORY_LIMIT) / 16
}

/// The elaboration step budget under the limit: at most 20 million steps, fewer when the
/// limit is smaller than what 20 million steps take.
pub fn elaboration_budget() -> u64 {
    let limit = memory_limit().unwrap_or(DEFAULT_MEMORY_LIMIT);
    (limit.saturating_sub(BASE_BYTES) / ELAB_BYTES_PER_STEP).clamp(1000, 20_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("8G").unwrap(), 8 << 30);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("0").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("8X").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_size("3.5e9").unwrap(), 3_500_000_000);
        assert!(
            parse_size("nan").is_err() && parse_size("inf").is_err() && parse_size("-3").is_err()
        );
    }

    #[test]
    fn estimates_grow_with_the_instance_and_saturate() {
        let small = spec_size_lower_bound(4, 8, None);
        let big = spec_size_lower_bound(100_000, 1_000_000, Some(4));
        assert!(estimate(Work::Check, &small) < estimate(Work::Check, &big));
        assert!(estimate(Work::Sim, &small) > estimate(Work::Check, &small));
        let huge = spec_size_lower_bound(u32::MAX, u32::MAX, Some(u32::MAX));
        assert_eq!(estimate(Work::Sim, &huge), u64::MAX);
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }
}
