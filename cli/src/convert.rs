//! `schedc convert`: between IR text, IR JSON and PyTorch CSV.

use crate::common::*;
use schedc::check::{self, Verdict};
use schedc::import::torch::{self, TorchFormat};
use schedc_ir::text;
use schedc_ir::Instr;
use std::process::ExitCode;

/// `schedc convert`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub order_cost: OrderCostArgs,
    /// Output format.
    #[arg(long, value_enum)]
    pub to: ConvertTo,
    /// For --to torch-csv: torch's compute_only (the default) or compute_comms form.
    #[arg(long, value_enum)]
    pub torch_format: Option<TorchForm>,
    /// Output file (default, or `-`: standard output). It is written whole or not at all
    /// (a temporary file renamed into place); an existing file is not overwritten unless
    /// --force is given.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<std::path::PathBuf>,
    /// Convert the program as `schedc check` lowers it (sends and receives inserted in
    /// the verified order) rather than as written.
    #[arg(long)]
    pub lowered: bool,
    /// Overwrite an existing output file.
    #[arg(long)]
    pub force: bool,
}

/// Runs `schedc convert`.
pub fn run(args: Args) -> ExitCode {
    let Args {
        input,
        order_cost,
        to,
        torch_format,
        output,
        lowered,
        force,
    } = args;
    if torch_format.is_some() && to != ConvertTo::TorchCsv {
        eprintln!("error: --torch-format applies to --to torch-csv only");
        return ExitCode::from(2);
    }
    let torch_format = torch_format.unwrap_or(TorchForm::ComputeOnly);
    if let Some(path) = &output {
        if let Err(c) = check_output(path, force) {
            return c;
        }
    }
    let checks = lowered || (to == ConvertTo::TorchCsv && torch_format == TorchForm::ComputeComms);
    let work = if checks { Work::Check } else { Work::Convert };
    let model = match order_cost.model(&input) {
        Ok(m) => m,
        Err(c) => return c,
    };
    let mut loaded = match load_for_under(&input, Some(work), model.as_ref()) {
        Ok(l) => l,
        Err(f) => return f.code(),
    };
    if lowered {
        let out = check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
        match out.checked {
            Some(l) if out.report.verdict == Verdict::Accepted => loaded.program = l,
            _ => {
                eprintln!(
                    "error: the schedule does not pass `schedc check`; run it for the diagnostics"
                );
                return ExitCode::from(1);
            }
        }
    }
    let text = match to {
        ConvertTo::IrText => text::print(&loaded.program),
        ConvertTo::IrJson => {
            let mut s = loaded.program.to_json();
            s.push('\n');
            s
        }
        ConvertTo::TorchCsv => {
            let f = match torch_format {
                TorchForm::ComputeOnly => TorchFormat::ComputeOnly,
                TorchForm::ComputeComms => TorchFormat::ComputeComms,
            };
            let prog = if f == TorchFormat::ComputeComms {
                // Torch runs a compute_comms CSV as written and checks none of its
                // communication: export only what `schedc check` accepts, lowered,
                // so the send/receive order is the verified one.
                let out = check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
                match out.checked {
                    // Add what torch's runtime needs to run it (REDUCE_GRAD, send
                    // waits, ...).
                    Some(l) if out.report.verdict == Verdict::Accepted => torch::for_runtime(&l, f),
                    _ => {
                        eprintln!("error: the schedule does not pass `schedc check`; refusing to export it (run `schedc check` for the diagnostics)");
                        return ExitCode::from(1);
                    }
                }
            } else {
                if loaded.program.ranks.iter().flatten().any(|i| {
                    matches!(
                        i,
                        Instr::ReduceGrad(_)
                            | Instr::WaitReduceGrad(_)
                            | Instr::Unshard(_)
                            | Instr::Reshard(_)
                    )
                }) {
                    eprintln!("warning: the program has REDUCE_GRAD, WAIT_REDUCE_GRAD, UNSHARD or RESHARD actions, which are written as they are; torch's compute_only loader refuses them (it inserts its own): drop them, or export with --torch-format compute-comms");
                }
                Ok(loaded.program.clone())
            };
            match prog.and_then(|p| torch::write_csv(&p, f)) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("error: cannot export to torch CSV: {e}");
                    return ExitCode::from(1);
                }
            }
        }
    };
    match output {
        None => emit_then(&text, ExitCode::SUCCESS),
        Some(path) => match write_output(&path, text.as_bytes(), force) {
            Ok(()) => ExitCode::SUCCESS,
            Err(c) => c,
        },
    }
}
