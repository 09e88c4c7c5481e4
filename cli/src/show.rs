//! `schedc show`: the rank-by-step grid.

use crate::common::*;
use schedc::check::{self, Verdict};
use schedc::passes::makespan;
use schedc_ir::text;
use std::process::ExitCode;

/// `schedc show`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
}

/// Runs `schedc show`.
pub fn run(args: Args) -> ExitCode {
    let Args { input } = args;
    let loaded = match load(&input) {
        Ok(l) => l,
        Err(c) => return c,
    };
    let out = check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
    if out.report.verdict == Verdict::Rejected {
        let first = out.report.diagnostics.iter().find(|d| d.is_error());
        eprintln!(
            "note: `schedc check` rejects this schedule ({}); the grid shows the compute order only",
            first.map(|d| format!("{}: {}", d.code.as_str(), d.message)).unwrap_or_default()
        );
    }
    emit(&grid(&loaded.program));
    ExitCode::SUCCESS
}

/// The rank-by-step grid with unit-time spacing (pass 7's schedule: F = B = W = 1, BW = 2,
/// an MoE part a quarter step); ops in program order where the order admits no execution.
fn grid(p: &schedc_ir::Program) -> String {
    let has_parts = p
        .ranks
        .iter()
        .flatten()
        .any(|i| matches!(i, schedc_ir::Instr::Compute(c) if c.part != schedc_ir::Part::Whole));
    // Grid resolution: one column per unit, or per quarter when MoE parts are present.
    let res = if has_parts { 0.25 } else { 1.0 };
    let timing = makespan::schedule_with(p, &makespan::unit_cost, &|f, b| {
        makespan::unit_cost(f) + makespan::unit_cost(b)
    });
    let mut rows: Vec<Vec<(usize, String, usize)>> = Vec::new(); // (start col, text, width)
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut row = Vec::new();
        let mut t = 0usize;
        for (i, ins) in instrs.iter().enumerate() {
            if !ins.is_compute() {
                continue;
            }
            let mut d = 0.0;
            ins.for_each_compute(|c| d += makespan::unit_cost(c));
            let w = ((d / res).round() as usize).max(1);
            let start = match &timing {
                Some(tm) => (tm.starts[r][i] / res).round() as usize,
                None => t,
            };
            row.push((start, text::instr_to_string(ins), w));
            t = start + w;
        }
        rows.push(row);
    }
    let steps = rows
        .iter()
        .filter_map(|r| r.last().map(|(s, _, w)| s + w))
        .max()
        .unwrap_or(0);
    let cellw = rows
        .iter()
        .flatten()
        .map(|(_, t, w)| t.len().div_ceil(*w))
        .max()
        .unwrap_or(4)
        .max(4);
    let mut out = String::new();
    if timing.is_none() {
        out.push_str("(the order admits no execution: ops shown in program order)\n");
    }
    out.push_str(&format!("{:>7} ", if res < 1.0 { "t*4" } else { "step" }));
    for s in 0..steps {
        out.push_str(&format!("{:<cellw$} ", s));
    }
    let trimmed = out.trim_end().len();
    out.truncate(trimmed);
    out.push('\n');
    for (r, row) in rows.iter().enumerate() {
        let mut line = format!("{:>7} ", format!("rank {r}"));
        let mut t = 0;
        for (start, txt, w) in row {
            while t < *start {
                line.push_str(&format!("{:<cellw$} ", "."));
                t += 1;
            }
            let width = w * (cellw + 1) - 1;
            line.push_str(&format!("{:<width$} ", txt));
            t = (*start).max(t) + w;
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}
