//! `optimize --to spec`: a found schedule with a periodic steady state written as a family in
//! M (issue 26, item 4).
//!
//! Each rank's instruction list is searched for a period: a run of `L` instructions that
//! repeats `K >= 2` times, each repetition the same ops with every micro-batch shifted by the
//! same `d` (one shift for all ranks). The rank's program is then its prefix as found
//! (absolute micro-batches), a loop over the periods whose count grows by one every `d`
//! micro-batches, and its suffix with micro-batches counted from the end (`M - c`). The
//! family is written only if its instance at the optimized M is the found program exactly
//! and `schedc check` (with the search's activation cap) accepts it over a range of M;
//! otherwise the caller writes the one instance and says why.

use schedc_ir::{Comm, Compute, Instr, PayloadKind, Program};
use std::fmt::Write as _;

/// Ops per rank beyond which the period search is not tried (it is quadratic in the
/// length of a rank's list, bounded by [`MAX_PERIOD`]).
const MAX_OPS_PER_RANK: usize = 20_000;
/// Instructions in all beyond which the period search is not tried (the family is checked
/// at up to 17 values of M).
const MAX_OPS: usize = 400_000;
/// The longest period (instructions) searched.
const MAX_PERIOD: usize = 512;

/// A family written for a periodic schedule.
pub struct Family {
    /// The spec's text (without the header comment).
    pub text: String,
    /// The micro-batch shift per period (the family's M steps by it, times the directions).
    pub step: u32,
    /// The M checked, as ranges (`first..=last`, in steps of `step`), ascending: all from
    /// `lo` to `hi` when they are few; at a large M the smallest instances up to four
    /// periods above the smallest (`require M >= ` it), M at doubling distances from it, and the optimized M up to four
    /// periods above it (the M between hold by the period, as those above `hi` do).
    pub checked: Vec<(u32, u32)>,
    /// The period of each rank (instructions).
    pub periods: Vec<usize>,
}

impl Family {
    /// The report's line.
    pub fn note(&self) -> String {
        format!(
            "periodic: wrote a family in M (P fixed), M = {} step {} checked by `schedc check`{} (periods of {} instructions per rank, {} micro-batch(es) per period)",
            ranges_text(&self.checked),
            self.step,
            if self.checked.len() > 1 {
                ", the M between them by the period"
            } else {
                ""
            },
            summarize(&self.periods),
            self.step
        )
    }
}

/// `4..=8, 12, 2000..=2004`: each range as `first..=last`, or `first` alone.
fn ranges_text(r: &[(u32, u32)]) -> String {
    r.iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}..={b}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn summarize(v: &[usize]) -> String {
    let (lo, hi) = (v.iter().min(), v.iter().max());
    match (lo, hi) {
        (Some(a), Some(b)) if a == b => a.to_string(),
        (Some(a), Some(b)) => format!("{a} to {b}"),
        _ => "0".into(),
    }
}

/// The micro-batches an instruction names, in a fixed order.
fn mbs(i: &Instr) -> Vec<u32> {
    let comm = |c: &Comm| match c {
        Comm::Send { payload, .. } | Comm::Recv { payload, .. } => Some(payload.mb),
        Comm::Collective(_) => None,
    };
    match i {
        Instr::Compute(c) => vec![c.mb],
        Instr::Overlap { fwd, bwd } => vec![fwd.mb, bwd.mb],
        Instr::Comm(c) => comm(c).into_iter().collect(),
        Instr::Group(v) => v.iter().filter_map(comm).collect(),
        _ => Vec::new(),
    }
}

fn compute_stmt(c: &Compute, mb: &str) -> String {
    let mut s = format!("{}(stage {}, {mb})", c.kind.as_str(), c.stage);
    if c.part != schedc_ir::Part::Whole {
        let _ = write!(s, ".{}", c.part.as_str());
    }
    s
}

fn comm_stmt(c: &Comm, mb: &str) -> Option<String> {
    match c {
        Comm::Send {
            payload,
            peer,
            channel: 0,
        } => Some(format!(
            "{}({}, {mb} -> {peer})",
            if payload.kind == PayloadKind::Act {
                "SA"
            } else {
                "SG"
            },
            payload.stage
        )),
        Comm::Recv {
            payload,
            peer,
            channel: 0,
        } => Some(format!(
            "{}({}, {mb} <- {peer})",
            if payload.kind == PayloadKind::Act {
                "RA"
            } else {
                "RG"
            },
            payload.stage
        )),
        _ => None,
    }
}

/// The statement of `i` with its micro-batches written as `m` (in [`mbs`]'s order); `None`
/// for what a rank program cannot write (a channel, a collective, a wait).
fn stmt(i: &Instr, m: &[String]) -> Option<String> {
    Some(match i {
        Instr::Compute(c) => compute_stmt(c, &m[0]),
        Instr::Overlap { fwd, bwd } => {
            format!(
                "{} & {}",
                compute_stmt(fwd, &m[0]),
                compute_stmt(bwd, &m[1])
            )
        }
        Instr::Comm(c) => comm_stmt(c, &m[0])?,
        Instr::Group(v) => {
            let mut parts = Vec::with_capacity(v.len());
            for (c, mb) in v.iter().zip(m) {
                parts.push(comm_stmt(c, mb)?);
            }
            format!("group {{ {} }}", parts.join(" "))
        }
        Instr::Idle => "idle".into(),
        _ => return None,
    })
}

/// A rank's period: `count` repetitions of `len` instructions from `start`, each shifted by
/// `shift` micro-batches from the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Period {
    start: usize,
    len: usize,
    count: usize,
    shift: u32,
}

/// The period covering the most instructions (then the shortest, then the earliest) with a
/// shift of `want` micro-batches if given. `ops[i]` are the compute ops of instruction `i`
/// (ids of their kind, stage and part): a period must run each op the rank has exactly
/// `shift` times (a steady state, every op growing with M), else M could not grow.
fn find_period(
    tpl: &[u32],
    mb: &[Vec<u32>],
    ops: &[Vec<u32>],
    want: Option<u32>,
) -> Option<Period> {
    let n = tpl.len();
    let mut all: Vec<u32> = ops.iter().flatten().copied().collect();
    all.sort_unstable();
    all.dedup();
    let complete = |start: usize, len: usize, shift: u32| {
        let mut count: std::collections::HashMap<u32, u32> = Default::default();
        for o in ops[start..start + len].iter().flatten() {
            *count.entry(*o).or_default() += 1;
        }
        all.iter().all(|o| count.get(o) == Some(&shift))
    };
    let mut best: Option<Period> = None;
    for len in 1..=(n / 2).min(MAX_PERIOD) {
        // Runs of j where instruction j + len is instruction j shifted by one shift.
        let mut run_start = 0;
        let mut run_shift: Option<u32> = None;
        let mut j = 0;
        let close = |start: usize, end: usize, shift: Option<u32>, best: &mut Option<Period>| {
            let Some(shift) = shift else { return };
            let count = (end - start + len) / len;
            if count < 2 {
                return;
            }
            let p = Period {
                start,
                len,
                count,
                shift,
            };
            let better = match best {
                None => true,
                Some(b) => p.len * p.count > b.len * b.count,
            };
            if better && complete(start, len, shift) {
                *best = Some(p);
            }
        };
        while j + len < n {
            let k = j + len;
            let shift = if tpl[j] != tpl[k] || mb[j].len() != mb[k].len() {
                Err(())
            } else if mb[j].is_empty() {
                Ok(None)
            } else {
                let d = mb[k][0].wrapping_sub(mb[j][0]);
                let same = mb[j]
                    .iter()
                    .zip(&mb[k])
                    .all(|(a, b)| b.wrapping_sub(*a) == d);
                if same && d > 0 && d < u32::MAX / 2 && want.is_none_or(|w| w == d) {
                    Ok(Some(d))
                } else {
                    Err(())
                }
            };
            match shift {
                Ok(s) if s.is_none() || run_shift.is_none() || s == run_shift => {
                    if run_shift.is_none() {
                        run_shift = s;
                    }
                }
                Ok(s) => {
                    // Another shift: a new run from here.
                    close(run_start, j, run_shift, &mut best);
                    run_start = j;
                    run_shift = s;
                }
                Err(()) => {
                    close(run_start, j, run_shift, &mut best);
                    run_start = j + 1;
                    run_shift = None;
                }
            }
            j += 1;
        }
        close(run_start, j, run_shift, &mut best);
    }
    best
}

/// A family in M for `p` (the found, lowered program), or why there is none. `valid` says
/// whether a spec text's instance at (P, total M) is accepted, and gives its program.
pub fn family(
    p: &Program,
    valid: &dyn Fn(&str, u32) -> Result<Program, String>,
) -> Result<Family, String> {
    let pl = &p.pipeline;
    let dirs = pl.total_microbatches() / pl.microbatches.max(1);
    if p.ranks.iter().any(|r| r.len() > MAX_OPS_PER_RANK)
        || p.ranks.iter().map(Vec::len).sum::<usize>() > MAX_OPS
    {
        return Err(format!(
            "more than {MAX_OPS_PER_RANK} instructions on a rank or {MAX_OPS} in all, too many to search for a period"
        ));
    }
    // Templates: each instruction with its micro-batches blanked, interned.
    let mut ids: std::collections::HashMap<String, u32> = Default::default();
    let mut tpls = Vec::new();
    let mut mbs_all = Vec::new();
    let mut ops_all = Vec::new();
    let mut op_ids: std::collections::HashMap<(schedc_ir::Kind, u32, schedc_ir::Part), u32> =
        Default::default();
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut t = Vec::with_capacity(instrs.len());
        let mut m = Vec::with_capacity(instrs.len());
        let mut o = Vec::with_capacity(instrs.len());
        for i in instrs {
            let mut here = Vec::new();
            i.for_each_compute(|c| {
                let n = op_ids.len() as u32;
                here.push(*op_ids.entry((c.kind, c.stage, c.part)).or_insert(n));
            });
            o.push(here);
            let v = mbs(i);
            let blank = vec!["#".to_string(); v.len()];
            let Some(s) = stmt(i, &blank) else {
                return Err(format!(
                    "rank {r} has `{}`, which a rank program does not write",
                    schedc_ir::text::instr_to_string(i)
                ));
            };
            let n = ids.len() as u32;
            t.push(*ids.entry(s).or_insert(n));
            m.push(v);
        }
        tpls.push(t);
        mbs_all.push(m);
        ops_all.push(o);
    }
    // One shift for all ranks: the first rank's, the others searched with it.
    let first = find_period(&tpls[0], &mbs_all[0], &ops_all[0], None)
        .ok_or("rank 0 repeats no block of ops with shifted micro-batches")?;
    let d = first.shift;
    let mut periods = vec![first];
    for r in 1..p.ranks.len() {
        periods.push(find_period(&tpls[r], &mbs_all[r], &ops_all[r], Some(d)).ok_or_else(|| {
            format!("rank {r} repeats no block of ops shifted by {d} micro-batch(es) as rank 0 does")
        })?);
    }
    let n0 = pl.microbatches;
    let text = spec_text(p, &periods, d, dirs);
    // The instance at the optimized M is the found program, exactly.
    let at = |lo: u32| text.replace("@LO@", &(lo * dirs).to_string());
    let got = valid(&at(n0), n0 * dirs)?;
    if got.ranks != p.ranks {
        return Err("the family's instance at the optimized M differs from the found order".into());
    }
    // Check it up to four periods above the optimized M, and find the smallest M from
    // which it holds, down to the fewest periods any rank can have (none).
    let min_count = periods.iter().map(|q| q.count as u32).min().unwrap_or(0);
    let lo_min = n0 - (n0 - n0.saturating_sub(d.saturating_mul(min_count)).max(1)) / d * d;
    let hi = n0 + 4 * d;
    for n in (n0 + d..=hi).step_by(d as usize) {
        valid(&at(n0), n * dirs).map_err(|e| {
            format!(
                "periodic, but the family fails `schedc check` at M = {}: {e}",
                n * dirs
            )
        })?;
    }
    let (lo, mut checked) = lowest_m(lo_min, n0, d, &|m| valid(&at(lo_min), m * dirs).is_ok());
    checked.push((n0, hi));
    // Ranges that meet (`..=7`, `8..=`) are one.
    let mut merged: Vec<(u32, u32)> = Vec::new();
    for (a, b) in checked {
        match merged.last_mut() {
            Some(last) if a <= last.1 + d => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    let checked: Vec<(u32, u32)> = merged.iter().map(|&(a, b)| (a * dirs, b * dirs)).collect();
    Ok(Family {
        text: at(lo).replace("@CHECKED@", &ranges_text(&checked)),
        step: d * dirs,
        checked,
        periods: periods.iter().map(|q| q.len).collect(),
    })
}

/// Periods above the smallest valid M that [`lowest_m`] checks one by one before it
/// trusts the period for the M above them (as for those above the optimized M).
const RUN: u32 = 4;

/// The smallest M (of `lo_min`, `lo_min + d`, ..., `n0`, which `ok` accepts) from which
/// every M up to `n0` holds, and the ranges of M checked below `n0` to say so. The M are
/// scanned upward from `lo_min` (small instances check fast) until `RUN + 1` in a row
/// pass; when that run ends below `n0`, M at doubling distances from its start (`lo + 8d`,
/// `lo + 16d`, ...) are checked too, and a failure there starts the scan again above it.
/// With few periods below `n0` every M between is checked. `ok(n0)` is known to hold.
fn lowest_m(lo_min: u32, n0: u32, d: u32, ok: &dyn Fn(u32) -> bool) -> (u32, Vec<(u32, u32)>) {
    let mut from = lo_min;
    'scan: loop {
        // Upward from `from`: the first run of RUN + 1 valid M (or every M up to n0).
        let mut start = None;
        let mut m = from;
        while m < n0 {
            if ok(m) {
                let s = *start.get_or_insert(m);
                if m >= s + RUN * d {
                    break;
                }
            } else {
                start = None;
            }
            m += d;
        }
        let Some(lo) = start else {
            return (n0, Vec::new());
        };
        if m >= n0 {
            // Every M from lo to n0 checked.
            return (lo, vec![(lo, n0 - d)]);
        }
        let mut checked = vec![(lo, m)];
        let mut gap = 8 * d;
        while lo.saturating_add(gap) < n0 {
            let g = lo + gap;
            if !ok(g) {
                from = g + d;
                continue 'scan;
            }
            checked.push((g, g));
            gap = gap.saturating_mul(2);
        }
        return (lo, checked);
    }
}

/// The family's text; `@LO@` stands for its smallest M, `@CHECKED@` for the range of M
/// checked.
fn spec_text(p: &Program, periods: &[Period], d: u32, dirs: u32) -> String {
    let pl = &p.pipeline;
    let n0 = pl.microbatches as i64;
    let mut s = crate::optimize::spec_header(p);
    if let Some(moe) = &pl.moe_stages {
        let _ = writeln!(
            s,
            "moe [{}]",
            moe.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(
        s,
        "require P == {}, \"this schedule was found for P = {}\"",
        pl.pp, pl.pp
    );
    let m_of = if dirs > 1 {
        format!("M / {dirs}")
    } else {
        "M".into()
    };
    let step = d * dirs;
    // Only the clauses that constrain anything: `M % 1 == 0` is never written.
    let mut cond = "M >= @LO@".to_string();
    if dirs > 1 {
        let _ = write!(cond, " && M % {dirs} == 0");
    }
    if d > 1 {
        let _ = write!(cond, " && ({m_of} - {n0}) % {d} == 0");
    }
    let _ = writeln!(
        s,
        "require {cond}, \"this family was found for M = {} and checked by schedc check for M = @CHECKED@ in steps of {step}; got M = {{M}}\"",
        n0 * dirs as i64
    );
    let _ = writeln!(s, "let n_mb = {m_of}");
    s.push_str("\nrank r {\n");
    for (r, (instrs, q)) in p.ranks.iter().zip(periods).enumerate() {
        let _ = writeln!(
            s,
            "    {}if r == {r} {{",
            if r == 0 { "" } else { "} else " }
        );
        let line = |s: &mut String, i: &Instr, m: Vec<String>, pad: &str| {
            let _ = writeln!(s, "{pad}{}", stmt(i, &m).expect("checked"));
        };
        for i in &instrs[..q.start] {
            line(
                &mut s,
                i,
                mbs(i).iter().map(u32::to_string).collect(),
                "        ",
            );
        }
        // Periods: count(M) = count0 + (M - M0) / d.
        let c = q.count as i64;
        let count = if d == 1 {
            offset("n_mb", c - n0)
        } else {
            offset(&format!("(n_mb - {n0}) / {d}"), c)
        };
        let _ = writeln!(s, "        for k in 0..{count} {{");
        for i in &instrs[q.start..q.start + q.len] {
            let m = mbs(i)
                .iter()
                .map(|&b| {
                    let k = if d == 1 {
                        "k".to_string()
                    } else {
                        format!("{d} * k")
                    };
                    offset(&k, b as i64)
                })
                .collect();
            line(&mut s, i, m, "            ");
        }
        s.push_str("        }\n");
        for i in &instrs[q.start + q.len * q.count..] {
            let m = mbs(i)
                .iter()
                .map(|&b| offset("n_mb", b as i64 - n0))
                .collect();
            line(&mut s, i, m, "        ");
        }
    }
    s.push_str("    }\n}\n");
    s
}

/// `base + k` written simply: `base`, `base + 3`, `base - 2`.
fn offset(base: &str, k: i64) -> String {
    match k {
        0 => base.to_string(),
        k if k > 0 => format!("{base} + {k}"),
        k => format!("{base} - {}", -k),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_steady_state_of_a_shifted_block() {
        // 1F1B's shape: F0 F1 B0 F2 B1 F3 B2 F4 B3 B4 (template and op id: F 0, B 1).
        let tpl = [0, 0, 1, 0, 1, 0, 1, 0, 1, 1];
        let mb: Vec<Vec<u32>> = [0, 1, 0, 2, 1, 3, 2, 4, 3, 4]
            .iter()
            .map(|&m| vec![m])
            .collect();
        let ops: Vec<Vec<u32>> = tpl.iter().map(|&o| vec![o]).collect();
        assert_eq!(
            find_period(&tpl, &mb, &ops, None),
            Some(Period {
                start: 1,
                len: 2,
                count: 4,
                shift: 1
            })
        );
        // With a shift of 2: two micro-batches per period.
        assert_eq!(
            find_period(&tpl, &mb, &ops, Some(2)),
            Some(Period {
                start: 1,
                len: 4,
                count: 2,
                shift: 2
            })
        );
        assert_eq!(find_period(&tpl, &mb, &ops, Some(3)), None);
        // An op that never repeats (id 2, first) leaves no period that runs every op.
        let tpl2: Vec<u32> = std::iter::once(2).chain(tpl).collect();
        let mb2: Vec<Vec<u32>> = std::iter::once(vec![0]).chain(mb).collect();
        let ops2: Vec<Vec<u32>> = tpl2.iter().map(|&o| vec![o]).collect();
        assert_eq!(find_period(&tpl2, &mb2, &ops2, None), None);
        assert_eq!(offset("n_mb", -3), "n_mb - 3");
    }
}

#[cfg(test)]
mod lowest_m_tests {
    use super::lowest_m;

    /// Issue 26 (e): the smallest M is found from the fewest periods upward, and a failure
    /// at a doubling distance starts the scan again above it.
    #[test]
    fn lowest_m_scans_up_and_restarts_above_a_failure() {
        let ok = |m: u32| m >= 10 && m != 26;
        let (lo, checked) = lowest_m(1, 200, 1, &ok);
        assert_eq!(lo, 27);
        assert_eq!(
            checked,
            vec![(27, 31), (35, 35), (43, 43), (59, 59), (91, 91), (155, 155)]
        );
        // Few periods below the optimized M: every M between is checked.
        assert_eq!(lowest_m(4, 8, 1, &|m| m >= 5), (5, vec![(5, 7)]));
        // None below it holds.
        assert_eq!(lowest_m(4, 8, 1, &|_| false), (8, vec![]));
        // Steps of d.
        assert_eq!(lowest_m(8, 16, 4, &|_| true), (8, vec![(8, 12)]));
    }
}
