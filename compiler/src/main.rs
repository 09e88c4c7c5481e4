//! The `schedc` command line.

use clap::{Parser, Subcommand, ValueEnum};
use schedc::check::{self, Verdict};
use schedc::diag;
use schedc::import::torch::{self, TorchFormat};
use schedc::input::{load_path, LoadError, Loaded, Overrides, PlacementArg};
use schedc::passes::deadlock::Semantics;
use schedc::passes::makespan;
use schedc_ir::text::{self, ParseError};
use schedc_ir::Instr;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "schedc",
    version,
    about = "A schedule compiler for pipeline-parallel training: check, show and convert schedules"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum OutFormat {
    Human,
    Json,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum ConvertTo {
    IrText,
    IrJson,
    TorchCsv,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum TorchForm {
    ComputeOnly,
    ComputeComms,
}

/// A value or a range of values: `8`, `2..=16`, `2..=16:2` (step), `1..9`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RangeArg(Vec<u32>);

impl std::str::FromStr for RangeArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!("invalid value `{s}`: expected a number or a range such as 2..=16 or 2..=16:2")
        };
        let (body, step) = match s.split_once(':') {
            Some((b, st)) => (b, st.trim().parse::<u32>().map_err(|_| bad())?),
            None => (s, 1),
        };
        if step == 0 {
            return Err(format!("invalid value `{s}`: the step must be at least 1"));
        }
        if let Some((a, b)) = body.split_once("..") {
            let (incl, b) = match b.strip_prefix('=') {
                Some(b) => (true, b),
                None => (false, b),
            };
            let a: u32 = a.trim().parse().map_err(|_| bad())?;
            let b: u32 = b.trim().parse().map_err(|_| bad())?;
            let end = if incl {
                b
            } else {
                b.checked_sub(1).ok_or_else(bad)?
            };
            if end < a {
                return Err(format!("invalid range `{s}`: it is empty"));
            }
            return Ok(RangeArg((a..=end).step_by(step as usize).collect()));
        }
        Ok(RangeArg(vec![body.trim().parse().map_err(|_| bad())?]))
    }
}

fn parse_param(s: &str) -> Result<(String, i64), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("invalid --param `{s}`: expected NAME=VALUE"))?;
    let v: i64 = v
        .trim()
        .parse()
        .map_err(|_| format!("invalid --param `{s}`: the value must be an integer"))?;
    Ok((k.trim().to_string(), v))
}

#[derive(clap::Args)]
struct InputArgs {
    /// Input: a `.sched` spec, IR text (.ir, .case), IR JSON, PyTorch CSV (compute_only or
    /// compute_comms), or a DualPipe trace (.json); `-` reads standard input.
    input: String,
    /// Number of micro-batches M (for a spec: the instance's M, a range to sweep with
    /// `check`; otherwise an override of what the input implies).
    #[arg(long = "mb", value_name = "M")]
    mb: Option<RangeArg>,
    /// Pipeline ranks P of a spec's instance (a range such as 2..=16:2 sweeps with `check`).
    #[arg(long, value_name = "P")]
    pp: Option<RangeArg>,
    /// Virtual stages per rank V of a spec's instance (a range sweeps with `check`).
    #[arg(long, value_name = "V")]
    vpp: Option<RangeArg>,
    /// A spec parameter, NAME=VALUE (repeatable).
    #[arg(long = "param", value_name = "NAME=VALUE", value_parser = parse_param)]
    params: Vec<(String, i64)>,
    /// Placement of stages on ranks: loop, v, bidir, or a list such as 0,1,1,0
    /// (default: from the input, else inferred from which rank runs each stage).
    #[arg(long, value_name = "PLACEMENT")]
    placement: Option<PlacementArg>,
    /// Split every F, B and BW of the MoE stages into attention, dispatch, MLP and combine
    /// parts (DeepSeek-V3's order in an overlapped pair). STAGES: auto (the input's `moe`
    /// declaration, else all), all, dense-ends (embedding and head stages stay whole),
    /// declared, or ids and ranges such as 1-6,9.
    #[arg(long, value_name = "STAGES", num_args = 0..=1, default_missing_value = "auto", require_equals = true)]
    moe: Option<schedc::moe::MoeStages>,
}

impl InputArgs {
    fn is_sweep(&self) -> bool {
        [&self.pp, &self.mb, &self.vpp]
            .iter()
            .any(|r| r.as_ref().is_some_and(|r| r.0.len() > 1))
    }
    fn single(r: &Option<RangeArg>, flag: &str) -> Result<Option<u32>, String> {
        match r {
            None => Ok(None),
            Some(RangeArg(v)) if v.len() == 1 => Ok(Some(v[0])),
            Some(_) => Err(format!(
                "{flag} takes one value here; ranges sweep with `schedc check`"
            )),
        }
    }
    fn overrides(&self) -> Result<Overrides, String> {
        Ok(Overrides {
            microbatches: Self::single(&self.mb, "--mb")?,
            placement: self.placement.clone(),
            pp: Self::single(&self.pp, "--pp")?,
            vpp: Self::single(&self.vpp, "--vpp")?,
            params: self.params.clone(),
            moe: self.moe.clone(),
        })
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Verify a schedule: well-formedness, dependencies, lowering, deadlock freedom, warmup,
    /// activation peaks, unit-time idle. Exit 0 accepted, 1 rejected, 2 unreadable input.
    Check {
        #[command(flatten)]
        input: InputArgs,
        /// Output format.
        #[arg(long, value_enum, default_value = "human")]
        format: OutFormat,
        /// Reject a rank whose peak live activations exceed N.
        #[arg(long, value_name = "N")]
        max_activations: Option<u64>,
        /// K buffer slots per rank pair: a send completes once the receive K messages
        /// earlier is posted (relaxes rendezvous).
        #[arg(long, value_name = "K")]
        buffer_slots: Option<u32>,
        /// Sends complete as soon as they are posted (unbounded buffering).
        #[arg(long, conflicts_with = "buffer_slots")]
        eager_sends: bool,
        /// Cost model for a spec's timing expectations (`expect makespan`, `bubble(..)`,
        /// `exposed_a2a`, `exposed_comm`), as for `sim` (default: unit).
        #[arg(long, value_name = "FILE|PRESET|K=V,...")]
        cost: Option<String>,
        /// A group's ops complete one by one, each once its partner is posted, instead of the
        /// group completing as a unit together with every group matched to it.
        #[arg(long)]
        per_op_groups: bool,
    },
    /// Print the rank-by-step grid (unit-time spacing: F=B=W=1, BW=2).
    Show {
        #[command(flatten)]
        input: InputArgs,
    },
    /// Convert between formats.
    Convert {
        #[command(flatten)]
        input: InputArgs,
        /// Output format.
        #[arg(long, value_enum)]
        to: ConvertTo,
        /// For --to torch-csv: torch's compute_only or compute_comms form.
        #[arg(long, value_enum, default_value = "compute-only")]
        torch_format: TorchForm,
        /// Output file (default: standard output). An existing file is not overwritten
        /// unless --force is given.
        #[arg(short, long, value_name = "FILE")]
        output: Option<String>,
        /// Convert the program as `schedc check` lowers it (sends and receives inserted in
        /// the verified order) rather than as written.
        #[arg(long)]
        lowered: bool,
        /// Overwrite an existing output file.
        #[arg(long)]
        force: bool,
    },
    /// Simulate a schedule under a cost model: makespan, bubble (both conventions), busy,
    /// idle, exposed communication and peak memory per rank; timelines.
    Sim {
        #[command(flatten)]
        input: InputArgs,
        /// Cost model: a preset (unit, dualpipe-readme, dsv3-h800), a TOML file, or inline
        /// overrides such as F=1,B=1,W=1,FB=3.
        #[arg(long, value_name = "FILE|PRESET|K=V,...", default_value = "unit")]
        cost: String,
        /// Further inline overrides applied on top of --cost (e.g. --set latency=1e-5).
        #[arg(long = "set", value_name = "K=V,...")]
        set: Option<String>,
        /// Output format.
        #[arg(long, value_enum, default_value = "human")]
        format: OutFormat,
        /// Write a Chrome trace (open in Perfetto or chrome://tracing).
        #[arg(long, value_name = "FILE")]
        trace: Option<String>,
        /// Write an SVG Gantt chart.
        #[arg(long, value_name = "FILE")]
        svg: Option<String>,
        /// Overwrite existing --trace/--svg files.
        #[arg(long)]
        force: bool,
    },
    /// Compare schedules at one size under one cost model: makespan, bubble under each
    /// convention, exposed all-to-all, peak activations, parameter copies; rejected specs and
    /// failed expectations reported as such. Exit 1 if any input fails.
    Compare {
        /// Spec files, directories of specs, or other schedule files (IR, torch CSV, DualPipe
        /// traces, at their own size); default `specs`.
        inputs: Vec<String>,
        /// Pipeline ranks.
        #[arg(long)]
        pp: u32,
        /// Micro-batches per step.
        #[arg(long)]
        mb: u32,
        /// Virtual stages per rank for specs whose V is free (interleaved schedules).
        #[arg(long, default_value_t = 2)]
        vpp: u32,
        /// A spec parameter, NAME=VALUE, given to the specs that declare it (repeatable).
        #[arg(long = "param", value_name = "NAME=VALUE", value_parser = parse_param)]
        params: Vec<(String, i64)>,
        /// Split the MoE stages into parts, as for `check` (needs a cost model with [moe]).
        #[arg(long, value_name = "STAGES", num_args = 0..=1, default_missing_value = "auto", require_equals = true)]
        moe: Option<schedc::moe::MoeStages>,
        /// Cost model (as for `sim`).
        #[arg(long, default_value = "unit")]
        cost: String,
        /// Further inline overrides applied on top of --cost.
        #[arg(long = "set", value_name = "K=V,...")]
        set: Option<String>,
        /// A directory of specs (the same as naming it as an input).
        #[arg(long, value_name = "DIR")]
        specs: Option<String>,
        /// Output format.
        #[arg(long, value_enum, default_value = "human")]
        format: OutFormat,
    },
    /// Recommend a pipeline degree and schedule for a cluster and a model, with the
    /// reasoning, memory per GPU and GPU-hours saved against 1F1B.
    Plan {
        /// GPUs in all.
        #[arg(long)]
        gpus: u32,
        /// GPUs per node.
        #[arg(long, default_value_t = 8)]
        gpus_per_node: u32,
        /// Model: a preset (dsv3, dense70b) or a TOML file with the fields of `ModelSpec`.
        #[arg(long)]
        model: String,
        /// Inter-node links: ib800, ib400, ib200, roce100.
        #[arg(long, default_value = "ib400")]
        interconnect: String,
        /// Memory per GPU, GB.
        #[arg(long, default_value_t = 80.0)]
        gpu_memory: f64,
        /// Peak dense bf16 TFLOP/s per GPU.
        #[arg(long, default_value_t = 989.0)]
        peak_tflops: f64,
        /// Model FLOPs utilization assumed for compute.
        #[arg(long, default_value_t = 0.4)]
        mfu: f64,
        /// Tokens per optimizer step.
        #[arg(long, default_value_t = 16.0e6)]
        global_batch_tokens: f64,
        /// Expert-parallel degree (MoE; default: GPUs per node).
        #[arg(long)]
        ep: Option<u32>,
        /// Where the specs are.
        #[arg(long, default_value = "specs")]
        specs: String,
        /// Output format.
        #[arg(long, value_enum, default_value = "human")]
        format: OutFormat,
    },
    /// Train a small MoE transformer under the schedule on a backend (`--backend cpu`: one
    /// thread per global rank), optionally comparing with sequential training (`--verify`).
    /// Runs the `schedc-cpu` binary installed next to `schedc`; see `schedc run --help-backend`.
    #[command(disable_help_flag = true)]
    Run {
        /// Arguments for the backend: INPUT --pp P --mb M [--vpp V] [--mesh pp=..,dp=..,ep=..,tp=..,sp=..]
        /// --backend cpu [--dtype f32|f64] [--steps N] [--data FILE] [--verify] [--format human|json].
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Lower the schedule to per-rank stream programs (compute, p2p and EP streams, events,
    /// buffers, gradient reduction, optimizer step), verify them and write one file per rank
    /// and a manifest: INPUT --pp P --mb M [--vpp V] [--mesh ...] -o DIR. Runs `schedc-cpu`.
    #[command(disable_help_flag = true)]
    Compile {
        /// Arguments for the backend.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Print a `.sched` spec in canonical layout (to standard output unless --write).
    Fmt {
        /// The spec.
        file: String,
        /// Rewrite the file in place (only if it parses; the original is replaced atomically).
        #[arg(long, conflicts_with = "check")]
        write: bool,
        /// Exit 1 if the file is not in canonical layout (for CI); print nothing.
        #[arg(long)]
        check: bool,
    },
    /// Run `.case` files and compare their verdicts and figures with their `expect` lines.
    Test {
        /// The case files.
        #[arg(required = true)]
        files: Vec<String>,
    },
}

fn print_load_error(e: &LoadError, name: &str) {
    match e {
        LoadError::Io(s) | LoadError::Usage(s) => eprintln!("error: {s}"),
        LoadError::Parse(p) => eprint!("{}", render_parse_error(p, name)),
        LoadError::Spec {
            diags,
            text,
            refused,
        } => {
            let color = std::io::stderr().is_terminal();
            if *refused {
                eprintln!("error: {name}: this instance is outside the schedule's family");
            }
            for d in diags {
                eprint!("{}", diag::render_color(d, Some((name, text)), color));
            }
        }
    }
}

fn read_source(name: &str) -> Option<String> {
    std::fs::read_to_string(name).ok()
}

fn render_parse_error(p: &ParseError, name: &str) -> String {
    let d = diag::syntax(p);
    match read_source(name) {
        Some(s) if p.offset <= s.len() => {
            // miette's header carries the message and file:line:col.
            let body = diag::render_color(&d, Some((name, &s)), std::io::stderr().is_terminal());
            format!(
                "error: syntax error in {name} at {}:{}\n{body}",
                p.line, p.col
            )
        }
        _ => format!("error: {name}:{}:{}: {}\n", p.line, p.col, p.message),
    }
}

fn load(args: &InputArgs) -> Result<Loaded, ExitCode> {
    let ov = args.overrides().map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(2)
    })?;
    load_path(&args.input, &ov).map_err(|e| {
        print_load_error(&e, &args.input);
        match e {
            LoadError::Spec { refused: true, .. } => ExitCode::from(1),
            _ => ExitCode::from(2),
        }
    })
}

fn main() -> ExitCode {
    // Deeply nested inputs recurse in the parsers and passes: give them room (the parsers
    // also bound their nesting, so this is a margin, not the limit).
    match std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(real_main)
        .map(|h| h.join())
    {
        Ok(Ok(code)) => code,
        Ok(Err(_)) => ExitCode::from(101),
        Err(e) => {
            eprintln!("error: cannot start: {e}");
            ExitCode::from(2)
        }
    }
}

fn real_main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match cli.cmd {
        Cmd::Check {
            input,
            format,
            max_activations,
            buffer_slots,
            eager_sends,
            per_op_groups,
            cost,
        } => {
            let model = match resolve_cost(cost.as_deref().unwrap_or("unit"), None) {
                Ok(m) => m,
                Err(c) => return c,
            };
            if let (Some(_), Some(name)) = (&input.moe, &cost) {
                if let Err(e) = schedc::moe::require_moe_costs(&model, name) {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            }
            if input.is_sweep() {
                return sweep(
                    &input,
                    eager_sends,
                    per_op_groups,
                    buffer_slots,
                    max_activations,
                    format,
                    &model,
                );
            }
            let loaded = match load(&input) {
                Ok(l) => l,
                Err(c) => {
                    // With --format json, standard output still carries one object.
                    if format == OutFormat::Json {
                        let verdict = if c == ExitCode::from(1) {
                            "refused"
                        } else {
                            "unreadable"
                        };
                        emit(&format!(
                            "{}\n",
                            serde_json::json!({"verdict": verdict, "input": input.input, "diagnostics": [], "note": "see standard error"})
                        ));
                    }
                    return c;
                }
            };
            let opts = check::Options {
                semantics: Semantics {
                    eager: eager_sends,
                    per_op_groups,
                    buffer_slots,
                },
                max_activations: max_activations.or(loaded.budget),
            };
            let mut out = check::check(&loaded.program, loaded.spans.as_ref(), &opts);
            check::check_expectations(&mut out.report, &loaded.spec_expects);
            check::evaluate_timing_expectations(
                &mut out.report,
                out.checked.as_ref(),
                &loaded.spec_expects,
                &model,
            );
            if loaded.spans.is_some() {
                for d in &mut out.report.diagnostics {
                    d.locate(&loaded.name, &loaded.text);
                }
            }
            let rep = &out.report;
            match format {
                OutFormat::Json => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(rep).expect("report serializes")
                    );
                }
                OutFormat::Human => emit(&print_human(&loaded, rep)),
            }
            if rep.verdict == Verdict::Accepted {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Cmd::Show { input } => {
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
        Cmd::Convert {
            input,
            to,
            torch_format,
            output,
            lowered,
            force,
        } => {
            let mut loaded = match load(&input) {
                Ok(l) => l,
                Err(c) => return c,
            };
            if lowered {
                let out = check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
                match out.checked {
                    Some(l) if out.report.verdict == Verdict::Accepted => loaded.program = l,
                    _ => {
                        eprintln!("error: the schedule does not pass `schedc check`; run it for the diagnostics");
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
                        let out = check::check(
                            &loaded.program,
                            loaded.spans.as_ref(),
                            &Default::default(),
                        );
                        match out.checked {
                            // Add what torch's runtime needs to run it (REDUCE_GRAD, send
                            // waits, ...).
                            Some(l) if out.report.verdict == Verdict::Accepted => {
                                torch::for_runtime(&l, f)
                            }
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
                None => {
                    emit(&text);
                }
                Some(path) if path == "-" => emit(&text),
                Some(path) => {
                    if !force && std::path::Path::new(&path).exists() {
                        eprintln!("error: `{path}` exists; not overwriting it (pass --force to replace it)");
                        return ExitCode::from(2);
                    }
                    if let Err(e) = std::fs::write(&path, text) {
                        eprintln!("error: cannot write `{path}`: {e}");
                        return ExitCode::from(2);
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Cmd::Sim {
            input,
            cost,
            set,
            format,
            trace,
            svg,
            force,
        } => {
            let model = match resolve_cost(&cost, set.as_deref()) {
                Ok(m) => m,
                Err(c) => return c,
            };
            if input.moe.is_some() {
                if let Err(e) = schedc::moe::require_moe_costs(&model, &cost) {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            }
            if trace.is_some() && trace == svg {
                eprintln!("error: --trace and --svg name the same file");
                return ExitCode::from(2);
            }
            for f in [&trace, &svg].into_iter().flatten() {
                if !force && std::path::Path::new(f).exists() {
                    eprintln!(
                        "error: `{f}` exists; not overwriting it (pass --force to replace it)"
                    );
                    return ExitCode::from(2);
                }
            }
            let loaded = match load(&input) {
                Ok(l) => l,
                Err(c) => return c,
            };
            let mut checked =
                check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
            // The spec's expectations are the check's; its timing ones hold under this model.
            let structural = checked.report.verdict != Verdict::Accepted;
            check::check_expectations(&mut checked.report, &loaded.spec_expects);
            if structural {
                eprintln!(
                    "error: the schedule does not pass `schedc check`; run it for the diagnostics"
                );
                return ExitCode::from(1);
            }
            let prog = checked.checked.expect("accepted schedules are lowered");
            let res = match schedc::sim::simulate(&prog, &model) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            };
            if let Some(f) = &trace {
                if let Err(e) = std::fs::write(f, schedc::sim::render::chrome_trace(&res, &prog)) {
                    eprintln!("error: cannot write `{f}`: {e}");
                    return ExitCode::from(2);
                }
            }
            if let Some(f) = &svg {
                let title = format!(
                    "{} — P={}, {} micro-batches",
                    loaded.name,
                    prog.pipeline.pp,
                    prog.pipeline.total_microbatches()
                );
                if let Err(e) = std::fs::write(f, schedc::sim::render::svg(&res, &prog, &title)) {
                    eprintln!("error: cannot write `{f}`: {e}");
                    return ExitCode::from(2);
                }
            }
            match format {
                OutFormat::Json => {
                    let mut j = serde_json::to_string_pretty(&res).expect("json");
                    j.push('\n');
                    emit(&j);
                }
                OutFormat::Human => emit(&schedc::sim::render::text_report(&res, 100)),
            }
            check::check_timing_expectations(
                &mut checked.report,
                &loaded.spec_expects,
                Some(&res),
                &model,
            );
            let failed: Vec<_> = checked
                .report
                .diagnostics
                .iter_mut()
                .filter(|d| d.is_error())
                .collect();
            let n_failed = failed.len();
            for d in failed {
                d.locate(&loaded.name, &loaded.text);
                eprint!(
                    "{}",
                    diag::render_color(
                        d,
                        Some((loaded.name.as_str(), loaded.text.as_str())),
                        std::io::stderr().is_terminal()
                    )
                );
            }
            if n_failed > 0 {
                eprintln!("error: {n_failed} expectation(s) of the spec do not hold under this cost model");
                return ExitCode::from(1);
            }
            let exposed: f64 = res.ranks.iter().map(|r| r.exposed_comm).sum();
            if exposed > 0.0 && model.message_time() == 0.0 && model.moe.a2a == 0.0 {
                eprintln!(
                    "note: {exposed:.4} s of communication is exposed although messages are free: this program's message order makes ranks wait on one in-order stream per channel (schedc's lowering of the compute-only form orders messages as their data becomes ready)"
                );
            }
            ExitCode::SUCCESS
        }
        Cmd::Compare {
            mut inputs,
            pp,
            mb,
            vpp,
            params,
            moe,
            cost,
            set,
            specs,
            format,
        } => {
            if pp == 0 || mb == 0 || vpp == 0 {
                eprintln!("error: --pp, --mb and --vpp must be at least 1");
                return ExitCode::from(2);
            }
            let model = match resolve_cost(&cost, set.as_deref()) {
                Ok(m) => m,
                Err(c) => return c,
            };
            inputs.extend(specs);
            if inputs.is_empty() {
                inputs.push("specs".into());
            }
            let files = match schedc::compare::expand(&inputs) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            let opts = schedc::compare::Options {
                pp,
                mb,
                vpp,
                params,
                moe,
                cost: model,
                cost_name: cost,
            };
            let report = match schedc::compare::compare(&files, &opts) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(if opts.moe.is_some() && e.starts_with("--moe") {
                        1
                    } else {
                        2
                    });
                }
            };
            match format {
                OutFormat::Json => emit(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&report).expect("json")
                )),
                OutFormat::Human => emit(&schedc::compare::render(&report)),
            }
            if report.has_failures() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Cmd::Plan {
            gpus,
            gpus_per_node,
            model,
            interconnect,
            gpu_memory,
            peak_tflops,
            mfu,
            global_batch_tokens,
            ep,
            specs,
            format,
        } => {
            let spec = match schedc::plan::preset(&model) {
                Some(m) => m,
                None => match std::fs::read_to_string(&model) {
                    Ok(t) => match toml::from_str::<schedc::plan::ModelSpec>(&t) {
                        Ok(m) => m,
                        Err(e) => {
                            eprintln!("error: {model}: {e}");
                            return ExitCode::from(2);
                        }
                    },
                    Err(_) => {
                        eprintln!("error: unknown model `{model}`: presets are dsv3 and dense70b, or give a TOML file");
                        return ExitCode::from(2);
                    }
                },
            };
            if let Err(e) = spec.validate() {
                eprintln!("error: model `{model}`: {e}");
                return ExitCode::from(2);
            }
            let Some((bw, lat)) = schedc::plan::interconnect(&interconnect) else {
                eprintln!(
                    "error: unknown interconnect `{interconnect}`: ib800, ib400, ib200, roce100"
                );
                return ExitCode::from(2);
            };
            if gpus == 0 || gpus_per_node == 0 || gpus % gpus_per_node != 0 {
                eprintln!("error: --gpus must be a positive multiple of --gpus-per-node");
                return ExitCode::from(2);
            }
            if ep == Some(0) {
                eprintln!("error: --ep must be at least 1");
                return ExitCode::from(2);
            }
            if !(mfu > 0.0 && mfu <= 1.0) {
                eprintln!("error: --mfu must be in (0, 1]");
                return ExitCode::from(2);
            }
            let cluster = schedc::plan::Cluster {
                gpus,
                gpus_per_node,
                gpu_memory: gpu_memory * 1e9,
                peak_flops: peak_tflops * 1e12,
                mfu,
                inter_bw: bw,
                latency: lat,
                global_batch_tokens,
                ep,
            };
            let p = match schedc::plan::plan(&spec, &cluster, &specs) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            match format {
                OutFormat::Json => emit(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&p).expect("json")
                )),
                OutFormat::Human => emit(&schedc::plan::report(&spec, &cluster, &p)),
            }
            ExitCode::SUCCESS
        }
        Cmd::Run { args } => backend("run", &args),
        Cmd::Compile { args } => backend("compile", &args),
        Cmd::Fmt { file, write, check } => {
            if file == "-" && write {
                eprintln!("error: --write needs a file, not standard input");
                return ExitCode::from(2);
            }
            let read = if file == "-" {
                let mut t = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut t).map(|_| t)
            } else {
                std::fs::read_to_string(&file)
            };
            let text = match read {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: cannot read `{file}`: {e}");
                    return ExitCode::from(2);
                }
            };
            let parsed = match schedc::dsl::parse_file(&text) {
                Ok(f) => f,
                Err(e) => {
                    let pe = ParseError {
                        offset: e.offset,
                        len: e.len,
                        line: text::line_col(&text, e.offset).0,
                        col: text::line_col(&text, e.offset).1,
                        message: e.message,
                        help: e.help,
                    };
                    eprint!("{}", render_parse_error(&pe, &file));
                    return ExitCode::from(2);
                }
            };
            let out = schedc::dsl::fmt::format_file(&parsed, &text);
            if check {
                return if out == text {
                    ExitCode::SUCCESS
                } else {
                    eprintln!("{file} is not formatted (run `schedc fmt --write {file}`)");
                    ExitCode::from(1)
                };
            }
            if write {
                if out != text {
                    // Write the file a symbolic link points to, keep its permissions, and
                    // replace it atomically.
                    let target =
                        std::fs::canonicalize(&file).unwrap_or_else(|_| file.clone().into());
                    let tmp = target.with_extension("schedc-fmt.tmp");
                    let res = std::fs::write(&tmp, &out)
                        .and_then(|_| std::fs::metadata(&target))
                        .and_then(|m| std::fs::set_permissions(&tmp, m.permissions()))
                        .and_then(|_| std::fs::rename(&tmp, &target));
                    if let Err(e) = res {
                        let _ = std::fs::remove_file(&tmp);
                        eprintln!("error: cannot write `{}`: {e}", target.display());
                        return ExitCode::from(2);
                    }
                }
            } else {
                emit(&out);
            }
            ExitCode::SUCCESS
        }
        Cmd::Test { files } => {
            use std::fmt::Write as _;
            let mut o = String::new();
            let (mut pass, mut fail, mut unreadable) = (0, 0, false);
            for f in &files {
                let r = schedc::casefile::run_case(f);
                if r.passed {
                    pass += 1;
                    let _ = writeln!(o, "PASS {f}");
                } else {
                    fail += 1;
                    unreadable |= r.differences.iter().any(|d| d.starts_with("cannot load"));
                    let _ = writeln!(o, "FAIL {f}");
                    for d in &r.differences {
                        let _ = writeln!(o, "    {d}");
                    }
                }
            }
            let _ = writeln!(o, "{pass} passed, {fail} failed");
            emit(&o);
            if unreadable {
                ExitCode::from(2)
            } else if fail == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
    }
}

fn print_human(loaded: &Loaded, rep: &check::Report) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let color = std::io::stdout().is_terminal();
    let verdict = match rep.verdict {
        Verdict::Accepted => "accepted",
        Verdict::Rejected => "rejected",
    };
    let p = &loaded.program;
    let _ =
        writeln!(o,
        "{}: {verdict} — pp {}, {} stage{} ({} placement), {} micro-batch{}{}, {} compute ops{}",
        loaded.name,
        rep.pp,
        rep.stages,
        if rep.stages == 1 { "" } else { "s" },
        placement_name(rep.placement),
        rep.microbatches,
        if rep.microbatches == 1 { "" } else { "es" },
        if p.pipeline.directions() == 2 {
            format!(" ({} per direction)", p.pipeline.microbatches)
        } else {
            String::new()
        },
        p.compute_ops(),
        if rep.lowered {
            format!(
                ", {} comm ops inserted",
                rep.ranks.iter().map(|r| r.comm_ops).sum::<u64>()
            )
        } else {
            format!(", {} comm ops", p.comm_ops())
        }
    );
    if let Some(m) = rep.makespan {
        let _ = writeln!(
            o,
            "unit-time makespan {m} (F=B=W=1, BW=2), bubble {:.1}% (from_start)",
            100.0 * rep.bubble.unwrap_or(0.0)
        );
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "{:>5} {:>8} {:>7} {:>7} {:>9} {:>10} {:>9} {:>8}",
        "rank", "compute", "comm", "warmup", "steady", "cooldown", "peak_act", "idle"
    );
    for r in &rep.ranks {
        let _ = writeln!(
            o,
            "{:>5} {:>8} {:>7} {:>7} {:>9} {:>10} {:>9} {:>8}",
            r.rank,
            r.ops,
            r.comm_ops,
            r.warmup,
            r.steady,
            r.cooldown,
            r.peak_activations,
            r.idle.map_or("-".to_string(), |x| format!("{x}"))
        );
    }
    let errors = rep.diagnostics.iter().filter(|d| d.is_error()).count();
    let shown = 20;
    if !rep.diagnostics.is_empty() {
        o.push('\n');
    }
    let src = loaded
        .spans
        .as_ref()
        .map(|_| (loaded.name.as_str(), loaded.text.as_str()));
    for d in rep.diagnostics.iter().take(shown) {
        let _ = write!(o, "{}", diag::render_color(d, src, color));
    }
    if rep.diagnostics.len() > shown {
        let _ = writeln!(
            o,
            "... and {} more (use --format json for all)",
            rep.diagnostics.len() - shown
        );
    }
    if errors > 0 {
        let _ = writeln!(o, "{errors} error(s)");
    }
    o
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

/// Writes to standard output; a closed pipe (`schedc ... | head`) is not an error.
fn emit(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(s.as_bytes());
    let _ = out.flush();
}

/// One instance's outcome: (P, M, V, passed / refused by `require` / failed with a message).
type SweepResult = (u32, u32, Option<u32>, Result<bool, String>);

/// `schedc check SPEC` over ranges of `--pp`, `--mb`, `--vpp`: every instance in parallel,
/// failures smallest first.
fn sweep(
    input: &InputArgs,
    eager: bool,
    per_op: bool,
    slots: Option<u32>,
    max_act: Option<u64>,
    format: OutFormat,
    model: &schedc::sim::cost::CostModel,
) -> ExitCode {
    use indicatif::{ProgressBar, ProgressStyle};
    use rayon::prelude::*;
    if !input.input.ends_with(".sched") {
        eprintln!(
            "error: ranges of --pp/--mb/--vpp sweep a .sched spec; `{}` is a single schedule",
            input.input
        );
        return ExitCode::from(2);
    }
    let text = match std::fs::read_to_string(&input.input) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read `{}`: {e}", input.input);
            return ExitCode::from(2);
        }
    };
    let Some(pps) = input.pp.as_ref() else {
        eprintln!("error: a sweep needs --pp");
        return ExitCode::from(2);
    };
    let Some(mbs) = input.mb.as_ref() else {
        eprintln!("error: a sweep needs --mb");
        return ExitCode::from(2);
    };
    let vpps: Vec<Option<u32>> = match &input.vpp {
        None => vec![None],
        Some(r) => r.0.iter().map(|v| Some(*v)).collect(),
    };
    let mut insts = Vec::new();
    for &p in &pps.0 {
        for &m in &mbs.0 {
            for &v in &vpps {
                insts.push((p, m, v));
            }
        }
    }
    let bar = ProgressBar::new(insts.len() as u64);
    if std::io::stderr().is_terminal() {
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:40} {pos}/{len} instances, {elapsed} elapsed, eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let opts = check::Options {
        semantics: Semantics {
            eager,
            per_op_groups: per_op,
            buffer_slots: slots,
        },
        max_activations: max_act,
    };
    // (pp, mb, vpp, outcome): None = passed, Some(Ok(())) = refused by `require`, Some(Err(msg)) = failed.
    let results: Vec<SweepResult> = insts
        .par_iter()
        .map(|&(p, m, v)| {
            let ov = Overrides {
                microbatches: Some(m),
                pp: Some(p),
                vpp: v,
                params: input.params.clone(),
                placement: None,
                moe: None,
            };
            let r = match schedc::input::load_spec(&text, &ov) {
                Err(LoadError::Spec { refused: true, .. }) => Ok(false),
                Err(LoadError::Spec { diags, .. }) => {
                    Err(diags.first().map(|d| d.message.clone()).unwrap_or_default())
                }
                Err(LoadError::Usage(u)) | Err(LoadError::Io(u)) => Err(u),
                Err(LoadError::Parse(e)) => Err(e.message),
                Ok(e) => match &input.moe {
                    Some(sel) => schedc::input::apply_moe(&e.program, Some(&e.spans), sel)
                        .map(|(p, s)| (p, s.unwrap_or_default())),
                    None => Ok((e.program, e.spans)),
                }
                .and_then(|(prog, spans)| {
                    let mut out = check::check(&prog, Some(&spans), &opts);
                    check::check_expectations(&mut out.report, &e.expects);
                    check::evaluate_timing_expectations(
                        &mut out.report,
                        out.checked.as_ref(),
                        &e.expects,
                        model,
                    );
                    match out.report.diagnostics.iter().find(|d| d.is_error()) {
                        None => Ok(true),
                        Some(d) => Err(format!("[{}] {}", d.code.as_str(), d.message)),
                    }
                }),
            };
            bar.inc(1);
            (p, m, v, r)
        })
        .collect();
    bar.finish_and_clear();
    let mut failed: Vec<_> = results.iter().filter(|r| r.3.is_err()).collect();
    failed.sort_by_key(|r| (r.0, r.1, r.2));
    let passed = results.iter().filter(|r| matches!(r.3, Ok(true))).count();
    let refused = results.iter().filter(|r| matches!(r.3, Ok(false))).count();
    let inst_str = |p: u32, m: u32, v: Option<u32>| match v {
        Some(v) => format!("--pp {p} --mb {m} --vpp {v}"),
        None => format!("--pp {p} --mb {m}"),
    };
    match format {
        OutFormat::Json => {
            let v = serde_json::json!({
                "instances": results.len(),
                "passed": passed,
                "refused": refused,
                "failed": failed.iter().map(|(p, m, v, r)| serde_json::json!({
                    "pp": p, "mb": m, "vpp": v, "error": r.as_ref().err()
                })).collect::<Vec<_>>(),
            });
            emit(&format!(
                "{}\n",
                serde_json::to_string_pretty(&v).expect("json")
            ));
        }
        OutFormat::Human => {
            use std::fmt::Write as _;
            let mut o = String::new();
            for (p, m, v, r) in failed.iter().take(20) {
                let _ = writeln!(
                    o,
                    "FAIL {}: {}",
                    inst_str(*p, *m, *v),
                    r.as_ref().err().map_or("", String::as_str)
                );
            }
            if failed.len() > 20 {
                let _ = writeln!(o, "... and {} more failing instances", failed.len() - 20);
            }
            let _ = writeln!(
                o,
                "{}: {} instances: {passed} passed, {} failed, {refused} outside the family (refused by `require`)",
                input.input,
                results.len(),
                failed.len()
            );
            emit(&o);
        }
    }
    if failed.is_empty() && passed > 0 {
        ExitCode::SUCCESS
    } else {
        if passed == 0 && failed.is_empty() {
            eprintln!("error: every instance is outside the family: nothing was checked");
        }
        ExitCode::from(1)
    }
}

/// A cost model by name (preset, file, `K=V,...`) with `--set` overrides; exit 2 on error.
fn resolve_cost(name: &str, set: Option<&str>) -> Result<schedc::sim::cost::CostModel, ExitCode> {
    let mut model = schedc::sim::cost::CostModel::resolve(name).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(2)
    })?;
    if let Some(kv) = set {
        model.apply_overrides(kv).map_err(|e| {
            eprintln!("error: {e}");
            ExitCode::from(2)
        })?;
    }
    Ok(model)
}

fn placement_name(k: schedc_ir::PlacementKind) -> &'static str {
    match k {
        schedc_ir::PlacementKind::Loop => "loop",
        schedc_ir::PlacementKind::V => "v",
        schedc_ir::PlacementKind::Bidir => "bidir",
        schedc_ir::PlacementKind::Explicit => "explicit",
    }
}

/// Runs a backend command (`run`, `compile`) with the `schedc-cpu` binary that sits next to
/// this one (the backend crate depends on this crate's library, so it is its own binary).
fn backend(cmd: &str, args: &[String]) -> ExitCode {
    let args: Vec<String> = args
        .iter()
        .map(|a| {
            if a == "--help-backend" {
                "--help".to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let exe = std::env::current_exe().ok().and_then(|p| {
        p.parent()
            .map(|d| d.join(format!("schedc-cpu{}", std::env::consts::EXE_SUFFIX)))
    });
    let Some(exe) = exe.filter(|p| p.exists()) else {
        eprintln!(
            "error: `schedc {cmd}` needs the CPU backend binary `schedc-cpu` next to `schedc`; build both with `cargo build --release --workspace`"
        );
        return ExitCode::from(2);
    };
    match std::process::Command::new(&exe)
        .arg(cmd)
        .args(&args)
        .status()
    {
        Ok(st) => ExitCode::from(st.code().unwrap_or(1).clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("error: cannot run {}: {e}", exe.display());
            ExitCode::from(2)
        }
    }
}
