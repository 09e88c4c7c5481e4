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
    #[command(flatten)]
    pub order: OrderCostArgs,
}

/// Runs `schedc show`.
pub fn run(args: Args) -> ExitCode {
    let Args { input, order } = args;
    // The program `sim --cost` timed: `:list` parts and a spec's `list` block ordered under
    // the same model (the grid itself is drawn in unit steps).
    let model = match order.model(&input) {
        Ok(m) => m,
        Err(c) => return c,
    };
    let cost_name = order.name();
    let loaded = match load_for_under(
        &input,
        Some(Work::Check),
        model.as_ref().map(|m| (m, cost_name.as_str())),
    ) {
        Ok(l) => l,
        Err(f) => return f.code(),
    };
    let out = check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
    if out.report.verdict == Verdict::Rejected {
        let first = out.report.diagnostics.iter().find(|d| d.is_error());
        eprintln!(
            "note: `schedc check` rejects this schedule ({}); the grid shows the compute order only",
            first.map(diag_summary).unwrap_or_default()
        );
    }
    let mut o = Out::new();
    match write_grid(&loaded.program, &mut o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(c) => c,
    }
}

/// `code: message`, without repeating the code when the message starts with it.
fn diag_summary(d: &schedc::diag::Diagnostic) -> String {
    let code = d.code.as_str();
    if d.message.starts_with(&format!("{code}:")) {
        d.message.clone()
    } else {
        format!("{code}: {}", d.message)
    }
}

/// Writes the rank-by-step grid with unit-time spacing (pass 7's schedule: F = B = W = 1,
/// BW = 2, an MoE part a quarter step); ops in program order where the order admits no
/// execution. Rows are written one at a time, so the output can be far larger than memory.
fn write_grid(p: &schedc_ir::Program, o: &mut dyn Sink) -> Result<(), ExitCode> {
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
    // Per rank: (start column, instruction position, width); the text is rendered when the
    // row is written.
    let mut rows: Vec<Vec<(usize, usize, usize)>> = Vec::with_capacity(p.ranks.len());
    let mut cellw = 4usize;
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
            cellw = cellw.max(text::instr_to_string(ins).len().div_ceil(w));
            row.push((start, i, w));
            t = start + w;
        }
        rows.push(row);
    }
    let steps = rows
        .iter()
        .filter_map(|r| r.last().map(|(s, _, w)| s + w))
        .max()
        .unwrap_or(0);
    let mut head = String::new();
    if timing.is_none() {
        head.push_str("(the order admits no execution: ops shown in program order)\n");
    }
    head.push_str(&format!("{:>7} ", if res < 1.0 { "t*4" } else { "step" }));
    for s in 0..steps {
        head.push_str(&format!("{:<cellw$} ", s));
    }
    let trimmed = head.trim_end().len();
    head.truncate(trimmed);
    head.push('\n');
    o.put(&head)?;
    for (r, row) in rows.iter().enumerate() {
        if o.closed() {
            break;
        }
        let mut line = format!("{:>7} ", format!("rank {r}"));
        let mut t = 0;
        for &(start, i, w) in row {
            while t < start {
                line.push_str(&format!("{:<cellw$} ", "."));
                t += 1;
            }
            let width = w * (cellw + 1) - 1;
            let txt = text::instr_to_string(&p.ranks[r][i]);
            line.push_str(&format!("{:<width$} ", txt));
            t = start.max(t) + w;
        }
        let n = line.trim_end().len();
        line.truncate(n);
        line.push('\n');
        o.put(&line)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the size of each piece written.
    struct Pieces(Vec<usize>);
    impl Sink for Pieces {
        fn put(&mut self, s: &str) -> Result<(), ExitCode> {
            self.0.push(s.len());
            Ok(())
        }
        fn closed(&self) -> bool {
            false
        }
    }

    /// Issue 11, item 6: the grid is written row by row, never whole: no piece is larger
    /// than one row, and there is one piece per rank plus the header.
    #[test]
    fn the_grid_is_streamed_row_by_row() {
        let text = schedc::specs::get("1f1b").unwrap();
        let ov = schedc::input::Overrides {
            pp: Some(64),
            microbatches: Some(16),
            ..Default::default()
        };
        let e = schedc::input::load_spec(text, &ov).ok().unwrap();
        let mut sink = Pieces(Vec::new());
        write_grid(&e.program, &mut sink).unwrap_or_else(|_| panic!("write"));
        assert_eq!(sink.0.len(), 1 + 64);
        let total: usize = sink.0.iter().sum();
        let largest = *sink.0.iter().max().unwrap();
        assert!(largest * 32 < total, "largest piece {largest} of {total}");
    }
}
