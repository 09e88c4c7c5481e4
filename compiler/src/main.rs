//! The `schedc` command line.

use clap::{Parser, Subcommand, ValueEnum};
use schedc::check::{self, Verdict};
use schedc::diag;
use schedc::import::torch::{self, TorchFormat};
use schedc::input::{load_path, LoadError, Loaded, Overrides, PlacementArg};
use schedc::passes::deadlock::Semantics;
use schedc::passes::makespan;
use schedc_ir::text::{self, ParseError};
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

#[derive(clap::Args)]
struct InputArgs {
    /// Input: IR text (.ir, .case), IR JSON, PyTorch CSV (compute_only or compute_comms),
    /// or a DualPipe trace (.json); `-` reads standard input.
    input: String,
    /// Number of micro-batches (default: from the input, else max id + 1).
    #[arg(long = "mb", value_name = "M")]
    mb: Option<u32>,
    /// Placement of stages on ranks: loop, v, bidir, or a list such as 0,1,1,0
    /// (default: from the input, else inferred from which rank runs each stage).
    #[arg(long, value_name = "PLACEMENT")]
    placement: Option<PlacementArg>,
}

impl InputArgs {
    fn overrides(&self) -> Overrides {
        Overrides {
            microbatches: self.mb,
            placement: self.placement.clone(),
        }
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
        #[arg(long)]
        eager_sends: bool,
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
        /// Overwrite an existing output file.
        #[arg(long)]
        force: bool,
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
    }
}

fn read_source(name: &str) -> Option<String> {
    std::fs::read_to_string(name).ok()
}

fn render_parse_error(p: &ParseError, name: &str) -> String {
    let d = diag::syntax(p);
    let head = format!("error: {name}:{}:{}: {}\n", p.line, p.col, p.message);
    match read_source(name) {
        Some(s) if p.offset <= s.len() => {
            let body = diag::render_color(&d, Some((name, &s)), std::io::stderr().is_terminal());
            format!("{head}{body}")
        }
        _ => head,
    }
}

fn load(args: &InputArgs) -> Result<Loaded, ExitCode> {
    load_path(&args.input, &args.overrides()).map_err(|e| {
        print_load_error(&e, &args.input);
        ExitCode::from(2)
    })
}

fn main() -> ExitCode {
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
        } => {
            let loaded = match load(&input) {
                Ok(l) => l,
                Err(c) => return c,
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
            emit(&grid(&loaded.program));
            ExitCode::SUCCESS
        }
        Cmd::Convert {
            input,
            to,
            torch_format,
            output,
            force,
        } => {
            let loaded = match load(&input) {
                Ok(l) => l,
                Err(c) => return c,
            };
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
                    let prog = if f == TorchFormat::ComputeComms && loaded.program.is_compute_only()
                    {
                        // Lower first so the communication order is the verified one.
                        let out = check::check(
                            &loaded.program,
                            loaded.spans.as_ref(),
                            &Default::default(),
                        );
                        if out.report.verdict != Verdict::Accepted {
                            eprintln!("error: the schedule does not pass `schedc check`; refusing to export it");
                            return ExitCode::from(1);
                        }
                        out.checked.expect("accepted schedules are lowered")
                    } else {
                        loaded.program.clone()
                    };
                    match torch::write_csv(&prog, f) {
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
        Cmd::Test { files } => {
            use std::fmt::Write as _;
            let mut o = String::new();
            let (mut pass, mut fail) = (0, 0);
            for f in &files {
                let r = schedc::casefile::run_case(f);
                if r.passed {
                    pass += 1;
                    let _ = writeln!(o, "PASS {f}");
                } else {
                    fail += 1;
                    let _ = writeln!(o, "FAIL {f}");
                    for d in &r.differences {
                        let _ = writeln!(o, "    {d}");
                    }
                }
            }
            let _ = writeln!(o, "{pass} passed, {fail} failed");
            emit(&o);
            if fail == 0 {
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
        "{}: {verdict} — pp {}, {} stages ({:?} placement), {} micro-batches{}, {} compute ops{}",
        loaded.name,
        rep.pp,
        rep.stages,
        rep.placement,
        rep.microbatches,
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
            "unit-time makespan {m} (F=B=W=1, BW=2), bubble {:.1}%",
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

/// The rank-by-step grid with unit-time spacing.
fn grid(p: &schedc_ir::Program) -> String {
    use schedc_ir::Instr;
    let ut = makespan::analyze(p);
    let mut rows: Vec<Vec<(usize, String, usize)>> = Vec::new(); // (start, text, width)
                                                                 // Recompute start times with the same rule as the unit-time pass: program order per rank.
    let starts = ut.as_ref().map(|_| unit_starts(p));
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut row = Vec::new();
        let mut t = 0usize;
        for (i, ins) in instrs.iter().enumerate() {
            if !ins.is_compute() {
                continue;
            }
            let w = {
                let mut d = 0.0;
                ins.for_each_compute(|c| d += makespan::unit_cost(c));
                d.ceil().max(1.0) as usize
            };
            let start = match &starts {
                Some(s) => s[r][i],
                None => t,
            };
            row.push((start, text::instr_to_string(ins), w));
            t = start + w;
        }
        let _ = Instr::Idle;
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
    out.push_str(&format!("{:>7} ", "step"));
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
            t += w;
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Unit-time start of each instruction (by position), per rank.
fn unit_starts(p: &schedc_ir::Program) -> Vec<Vec<usize>> {
    // A small re-run of the unit-time rule that records starts (integers: whole ops only;
    // parts are rounded up).
    let pl = &p.pipeline;
    let (s_n, m_n) = (pl.stages, pl.microbatches);
    let n = (s_n * m_n) as usize;
    let mut end_f = vec![usize::MAX; n];
    let mut end_b = vec![usize::MAX; n];
    let np = p.ranks.len();
    let mut starts: Vec<Vec<usize>> = p.ranks.iter().map(|r| vec![0; r.len()]).collect();
    let mut ptr = vec![0usize; np];
    let mut clock = vec![0usize; np];
    let mut progress = true;
    while progress {
        progress = false;
        for r in 0..np {
            while ptr[r] < p.ranks[r].len() {
                let ins = &p.ranks[r][ptr[r]];
                let mut ready = clock[r];
                let mut blocked = false;
                ins.for_each_compute(|c| {
                    if c.stage >= s_n || c.mb >= m_n {
                        return;
                    }
                    let dep = match c.kind {
                        schedc_ir::Kind::F => pl
                            .prev_stage(c.stage)
                            .map(|ps| end_f[(ps * m_n + c.mb) as usize]),
                        schedc_ir::Kind::B | schedc_ir::Kind::BW => pl
                            .next_stage(c.stage)
                            .map(|ns| end_b[(ns * m_n + c.mb) as usize]),
                        schedc_ir::Kind::W => None,
                    };
                    if let Some(d) = dep {
                        if d == usize::MAX {
                            blocked = true;
                        } else {
                            ready = ready.max(d);
                        }
                    }
                });
                if blocked {
                    break;
                }
                let mut t = ready;
                ins.for_each_compute(|c| {
                    t += makespan::unit_cost(c).ceil() as usize;
                    if c.stage < s_n && c.mb < m_n {
                        let k = (c.stage * m_n + c.mb) as usize;
                        match c.kind {
                            schedc_ir::Kind::F => end_f[k] = t,
                            schedc_ir::Kind::B | schedc_ir::Kind::BW => end_b[k] = t,
                            _ => {}
                        }
                    }
                });
                starts[r][ptr[r]] = ready;
                clock[r] = t;
                ptr[r] += 1;
                progress = true;
            }
        }
    }
    starts
}

/// Writes to standard output; a closed pipe (`schedc ... | head`) is not an error.
fn emit(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(s.as_bytes());
    let _ = out.flush();
}
