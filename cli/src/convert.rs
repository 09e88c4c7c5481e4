//! `schedc convert`: between IR text, IR JSON and PyTorch CSV (with torchtitan's settings
//! beside it), and to Megatron-LM's flags.

use crate::common::*;
use schedc::check::{self, Verdict};
use schedc::export::{megatron, torchtitan, ExportError};
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
    /// For --to torch-csv with -o FILE: also write torchtitan's settings to this JSON file:
    /// the stage-to-rank map, stages per rank, micro-batches, and (with --layers or --model)
    /// each stage's module names as torchtitan's `module_fqns_per_model_part` wants them.
    #[arg(long, value_name = "FILE")]
    pub sidecar: Option<std::path::PathBuf>,
    /// Transformer layers of the model, for --to megatron (--num-layers and
    /// --pipeline-model-parallel-layout) and for --sidecar's module names.
    #[arg(long, value_name = "N")]
    pub layers: Option<u32>,
    /// Take the layer count from a model instead of --layers: a Hugging Face config.json or a
    /// preset (as `schedc sim --model`).
    #[arg(long, value_name = "CONFIG.JSON|PRESET")]
    pub model: Option<String>,
    /// Which layers each stage holds, a Megatron-LM layout string such as "Et*3|(t*4|)*2t*3L"
    /// (with --layers or --model; default: an even split, the extra layers on the middle
    /// stages first).
    #[arg(long, value_name = "LAYOUT")]
    pub layout: Option<String>,
    /// For --to megatron: sequences per micro-batch (--micro-batch-size; default 1).
    #[arg(long, value_name = "SEQS")]
    pub micro_batch_size: Option<u64>,
    /// For --to megatron: data-parallel replicas, for --global-batch-size (default 1).
    #[arg(long, value_name = "N")]
    pub dp: Option<u32>,
}

/// The layer count of `--layers` or `--model`. Errors: both given, a model that does not
/// resolve, zero layers (exit status 2, after printing why).
fn layer_count(layers: Option<u32>, model: Option<&str>) -> Result<Option<u32>, ExitCode> {
    let fail = |m: String| {
        eprintln!("error: {m}");
        ExitCode::from(2)
    };
    match (layers, model) {
        (Some(_), Some(_)) => Err(fail(
            "--layers and --model both give the layer count: give one".into(),
        )),
        (Some(0), None) => Err(fail("--layers must be at least 1".into())),
        (Some(n), None) => Ok(Some(n)),
        (None, Some(m)) => schedc::costmodel::arch::resolve(m)
            .map(|a| Some(a.layers()))
            .map_err(|e| fail(format!("--model: {e}"))),
        (None, None) => Ok(None),
    }
}

/// Prints an export error; its exit status (1 unsupported, 2 bad usage).
fn export_failed(e: ExportError, what: &str) -> ExitCode {
    match e {
        ExportError::Unsupported(s) => {
            eprintln!("error: cannot export to {what}: {s}");
            ExitCode::from(1)
        }
        ExportError::Usage(s) => {
            eprintln!("error: {s}");
            ExitCode::from(2)
        }
    }
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
        sidecar,
        layers,
        model: model_name,
        layout,
        micro_batch_size,
        dp,
    } = args;
    if torch_format.is_some() && to != ConvertTo::TorchCsv {
        eprintln!("error: --torch-format applies to --to torch-csv only");
        return ExitCode::from(2);
    }
    if sidecar.is_some() && to != ConvertTo::TorchCsv {
        eprintln!("error: --sidecar applies to --to torch-csv only");
        return ExitCode::from(2);
    }
    if micro_batch_size.is_some() || dp.is_some() {
        if to != ConvertTo::Megatron {
            eprintln!("error: --micro-batch-size and --dp apply to --to megatron only");
            return ExitCode::from(2);
        }
        if micro_batch_size == Some(0) || dp == Some(0) {
            eprintln!("error: --micro-batch-size and --dp must be at least 1");
            return ExitCode::from(2);
        }
    }
    let wants_layers = to == ConvertTo::Megatron || sidecar.is_some();
    if !wants_layers && (layers.is_some() || model_name.is_some() || layout.is_some()) {
        eprintln!(
            "error: --layers, --model and --layout apply to --to megatron and to --sidecar only"
        );
        return ExitCode::from(2);
    }
    let n_layers = match layer_count(layers, model_name.as_deref()) {
        Ok(n) => n,
        Err(c) => return c,
    };
    if let Some(sc) = &sidecar {
        match &output {
            Some(o) if !is_stdout(o) => {
                if sc == o {
                    eprintln!("error: --sidecar and -o name the same file");
                    return ExitCode::from(2);
                }
                if let Err(c) = check_output(sc, force) {
                    return c;
                }
            }
            _ => {
                eprintln!("error: --sidecar names the CSV file it describes: give -o FILE too");
                return ExitCode::from(2);
            }
        }
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
    let cost_name = order_cost.name();
    let mut loaded = match load_for_under(
        &input,
        Some(work),
        model.as_ref().map(|m| (m, cost_name.as_str())),
    ) {
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
        ConvertTo::Megatron => {
            let opts = megatron::Options {
                layers: n_layers,
                layout: layout.clone(),
                micro_batch_size,
                dp,
            };
            match megatron::export(&loaded.program, &input.name(), &opts) {
                Ok(s) => s,
                Err(e) => return export_failed(e, "Megatron-LM"),
            }
        }
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
            let csv = match prog.and_then(|p| torch::write_csv(&p, f)) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("error: cannot export to torch CSV: {e}");
                    return ExitCode::from(1);
                }
            };
            if let (Some(sc), Some(o)) = (&sidecar, &output) {
                let json = match torchtitan::sidecar(
                    &loaded.program,
                    &o.to_string_lossy(),
                    n_layers,
                    layout.as_deref(),
                ) {
                    Ok(j) => j,
                    Err(e) => return export_failed(e, "torchtitan's settings"),
                };
                // The CSV first: a sidecar never describes a CSV that was not written.
                if let Err(c) = write_output(o, csv.as_bytes(), force) {
                    return c;
                }
                return match write_output(sc, json.as_bytes(), force) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(c) => c,
                };
            }
            csv
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
