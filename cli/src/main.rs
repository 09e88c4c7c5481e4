//! The `schedc` command line: one module per command over the compiler library (`schedc`),
//! the program crate (`schedc-program`) and the backends (`schedc-cpu`).

/// `eprintln!` that ignores a failed write: standard error closed or full must not turn an
/// error message into a panic (std's `eprintln!` panics when it cannot write). Under
/// `--format json` the text is also kept for the error object ([`common::json_errors`]).
macro_rules! eprintln {
    ($($t:tt)*) => {{
        $crate::common::json_errors::to_stderr(&format!("{}\n", format_args!($($t)*)));
    }};
}

/// `eprint!` that ignores a failed write (see `eprintln!`).
macro_rules! eprint {
    ($($t:tt)*) => {{
        $crate::common::json_errors::to_stderr(&format!($($t)*));
    }};
}

mod check;
mod cluster;
mod common;
mod compare;
mod compile;
mod convert;
mod family;
mod fmt;
mod optimize;
mod plan;
mod run;
mod show;
mod sim;
mod test;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "schedc",
    version,
    about = "A schedule compiler for pipeline-parallel training: verify schedules (check, show, test), convert them (convert, fmt), simulate and compare them under a cost model (sim, compare, plan), lower them to per-rank programs and train on them (compile, run)",
    after_help = "Exit status: 0 accepted, 1 rejected by a pass (or a failed expectation), 2 unreadable input, bad usage, an output that cannot be written or an environment that cannot run it (no GPU or NVRTC, a small ulimit -v).\nSCHEDC_MEMORY_LIMIT (default 8G) bounds the memory an instance may need by schedc's estimate."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Verify a schedule: well-formedness, dependencies, lowering, deadlock freedom, warmup,
    /// activation peaks, unit-time idle. Exit 0 accepted, 1 rejected, 2 unreadable input.
    Check(check::Args),
    /// Print the rank-by-step grid (unit-time spacing: F=B=W=1, BW=2).
    Show(show::Args),
    /// Convert between formats.
    Convert(convert::Args),
    /// Simulate a schedule under a cost model: makespan, bubble under each convention
    /// (from_start, per_rank_span, steady_state), busy, idle, exposed communication and
    /// all-to-all, peak memory per rank; timelines.
    Sim(sim::Args),
    /// Compare schedules at one size under one cost model: makespan, bubble under each
    /// convention, exposed all-to-all, peak activations, parameter copies; rejected specs and
    /// failed expectations reported as such. Exit 1 if any input fails.
    Compare(compare::Args),
    /// Recommend a mesh (tp, pp, ep, dp), a schedule and its micro-batches for a model on a
    /// cluster: every candidate simulated under the model-level cost model (as `sim
    /// --model`), ranked by tokens/s among those that fit, with the reasoning, the top
    /// candidates and what was skipped or pruned.
    Plan(plan::Args),
    /// Train a small MoE transformer under the schedule on a backend (`--backend cpu`: one
    /// thread per global rank), optionally comparing with sequential training (`--verify`).
    Run(run::Args),
    /// Lower the schedule to per-rank stream programs (compute, p2p and EP streams, events,
    /// buffers, gradient reduction, optimizer step), verify them and write one file per rank
    /// and a manifest; `--granularity stage` for a runtime of your own model
    /// (backends/torch/schedc_torch_runtime.py).
    Compile(compile::Args),
    /// Search for a schedule with a shorter simulated makespan under an activation cap,
    /// keeping the placement; report it next to the input, the specs that fit and the Zero
    /// Bubble greedy, and write it as IR text, a spec or torch CSV.
    Optimize(optimize::Args),
    /// Print a `.sched` spec in canonical layout (to standard output unless --write).
    Fmt(fmt::Args),
    /// Run `.case` files and compare their verdicts and figures with their `expect` lines.
    Test(test::Args),
}

/// The stack of the worker thread that runs the command, bytes. Deeply nested inputs
/// recurse in the parsers and passes: this gives them room (the parsers also bound their
/// nesting, so this is a margin, not the limit).
const WORKER_STACK: usize = 256 << 20;

fn main() -> ExitCode {
    // SIGINT, SIGTERM and SIGHUP remove the temporary outputs before the process ends
    // (installed before any other thread starts, so that every thread blocks them).
    common::signals::install();
    // `--help`, `--version` and usage errors need no worker (nor its large stack, which a
    // tight `ulimit -v` may refuse).
    let cli = match parse() {
        Ok(c) => c,
        Err(code) => return code,
    };
    match std::thread::Builder::new()
        .stack_size(WORKER_STACK)
        .spawn(move || real_main(cli))
        .map(|h| h.join())
    {
        Ok(Ok(code)) => code,
        Ok(Err(_)) => ExitCode::from(101),
        Err(e) => {
            eprintln!("error: {}", worker_error(&e));
            common::json_errors::finish(ExitCode::from(2))
        }
    }
}

/// Why the worker thread could not start: under an address-space limit (`ulimit -v`) too
/// small for its stack, which limit to raise, and to what.
fn worker_error(e: &std::io::Error) -> String {
    let stack_mib = WORKER_STACK >> 20;
    match schedc::limits::address_space_room() {
        Some((room, limit)) => {
            // What is mapped now, the stack, and 256 MiB for the command's allocator arena
            // and its smallest instance (the memory estimates start at 64 MiB).
            let need_kib = (limit - room + WORKER_STACK as u64 + (256 << 20)) / 1024;
            format!(
                "cannot start the worker thread: its {stack_mib} MiB stack does not fit under the virtual-memory limit (`ulimit -v {}`, {} left); raise it to at least `ulimit -v {need_kib}` (KiB), more for large instances, or remove it ({e})",
                limit / 1024,
                schedc::limits::human_bytes(room)
            )
        }
        None => format!("cannot start the worker thread (a {stack_mib} MiB stack): {e}"),
    }
}

/// Parses the command line; `--help`, `--version` and usage errors end here with their
/// exit status. Turns on the JSON error object of a `--format json` command.
fn parse() -> Result<Cli, ExitCode> {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            // A usage error of a `--format json` command is one JSON object too.
            let args: Vec<String> = std::env::args().collect();
            let json = args
                .windows(2)
                .any(|w| w[0] == "--format" && w[1] == "json")
                || args.iter().any(|a| a == "--format=json");
            if code == 2 && json {
                let text = e.render().to_string();
                let _ = e.print();
                return Err(common::emit_then(
                    &common::json_errors::object(&text, 2),
                    ExitCode::from(2),
                ));
            }
            // `--help > /dev/full` is a failed write, not success; a closed pipe is not.
            return Err(match e.print() {
                Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => {
                    eprintln!("error: cannot write to standard output: {err}");
                    ExitCode::from(2)
                }
                _ => ExitCode::from(code),
            });
        }
    };
    // Every error of a `--format json` command is one JSON object on standard output.
    let json = match &cli.cmd {
        Cmd::Check(a) => a.format,
        Cmd::Sim(a) => a.format,
        Cmd::Compare(a) => a.format,
        Cmd::Plan(a) => a.format,
        Cmd::Run(a) => a.format,
        Cmd::Optimize(a) => a.format,
        _ => common::OutFormat::Human,
    } == common::OutFormat::Json;
    if json {
        common::json_errors::activate();
    }
    Ok(cli)
}

fn real_main(cli: Cli) -> ExitCode {
    // The memory limit: a bad SCHEDC_MEMORY_LIMIT is bad usage; the elaboration budget of a
    // spec follows the limit.
    if let Err(e) = schedc::limits::memory_limit() {
        eprintln!("error: {e}");
        return common::json_errors::finish(ExitCode::from(2));
    }
    schedc::dsl::elab::set_step_budget(schedc::limits::elaboration_budget());
    let code = match cli.cmd {
        Cmd::Check(a) => check::run(a),
        Cmd::Show(a) => show::run(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::Sim(a) => sim::run(a),
        Cmd::Compare(a) => compare::run(a),
        Cmd::Plan(a) => plan::run(a),
        Cmd::Run(a) => run::run(a),
        Cmd::Compile(a) => compile::run(a),
        Cmd::Optimize(a) => optimize::run(a),
        Cmd::Fmt(a) => fmt::run(a),
        Cmd::Test(a) => test::run(a),
    };
    common::json_errors::finish(code)
}
