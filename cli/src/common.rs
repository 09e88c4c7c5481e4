//! What the commands share: input arguments and loading, ranges, output formats, error
//! rendering, writing to standard output.

use clap::ValueEnum;
use schedc::diag;
use schedc::input::{load_path, LoadError, Loaded, Overrides, PlacementArg};
use schedc_ir::text::ParseError;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

/// `--format`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum OutFormat {
    Human,
    Json,
}

/// `convert --to`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum ConvertTo {
    IrText,
    IrJson,
    TorchCsv,
}

/// `convert --torch-format`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum TorchForm {
    ComputeOnly,
    ComputeComms,
}

/// A value or a range of values: `8`, `2..=16`, `2..=16:2` (step), `1..9`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeArg(pub Vec<u32>);

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

/// `--param NAME=VALUE`.
pub fn parse_param(s: &str) -> Result<(String, i64), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("invalid --param `{s}`: expected NAME=VALUE"))?;
    let v: i64 = v
        .trim()
        .parse()
        .map_err(|_| format!("invalid --param `{s}`: the value must be an integer"))?;
    Ok((k.trim().to_string(), v))
}

/// The input of every command that reads one schedule.
#[derive(clap::Args)]
pub struct InputArgs {
    /// Input: a `.sched` spec, IR text (.ir, .case), IR JSON, PyTorch CSV (compute_only or
    /// compute_comms), or a DualPipe trace (.json); `-` reads standard input.
    pub input: String,
    /// Number of micro-batches M (for a spec: the instance's M, a range to sweep with
    /// `check`; otherwise an override of what the input implies).
    #[arg(long = "mb", value_name = "M")]
    pub mb: Option<RangeArg>,
    /// Pipeline ranks P of a spec's instance (a range such as 2..=16:2 sweeps with `check`).
    #[arg(long, value_name = "P")]
    pub pp: Option<RangeArg>,
    /// Virtual stages per rank V of a spec's instance (a range sweeps with `check`).
    #[arg(long, value_name = "V")]
    pub vpp: Option<RangeArg>,
    /// A spec parameter, NAME=VALUE (repeatable).
    #[arg(long = "param", value_name = "NAME=VALUE", value_parser = parse_param)]
    pub params: Vec<(String, i64)>,
    /// Placement of stages on ranks: loop, v, bidir, or a list such as 0,1,1,0
    /// (default: from the input, else inferred from which rank runs each stage).
    #[arg(long, value_name = "PLACEMENT")]
    pub placement: Option<PlacementArg>,
    /// Split every F, B and BW of the MoE stages into attention, dispatch, MLP and combine
    /// parts (DeepSeek-V3's order in an overlapped pair). STAGES: auto (the input's `moe`
    /// declaration, else all), all, dense-ends (embedding and head stages stay whole),
    /// declared, or ids and ranges such as 1-6,9; append `:adjacent` (e.g. `--moe=all:adjacent`)
    /// to interleave consecutive independent plain ops at part level.
    #[arg(long, value_name = "STAGES", num_args = 0..=1, default_missing_value = "auto", require_equals = true)]
    pub moe: Option<schedc::moe::MoeStages>,
}

impl InputArgs {
    /// True if `--pp`, `--mb` or `--vpp` is a range of more than one value.
    pub fn is_sweep(&self) -> bool {
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
    /// The overrides of a single instance. Errors: a range where one value is needed.
    pub fn overrides(&self) -> Result<Overrides, String> {
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

/// Prints a load error to standard error (with the source excerpt where there is one).
pub fn print_load_error(e: &LoadError, name: &str) {
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

/// A syntax error rendered with its source excerpt and `file:line:col`.
pub fn render_parse_error(p: &ParseError, name: &str) -> String {
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

/// Loads the input. Errors: the exit code (1 for an instance outside a spec's family, 2
/// for unreadable input), after printing why.
pub fn load(args: &InputArgs) -> Result<Loaded, ExitCode> {
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

/// Writes to standard output; a closed pipe (`schedc ... | head`) is not an error.
pub fn emit(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(s.as_bytes());
    let _ = out.flush();
}

/// A cost model by name (preset, file, `K=V,...`) with `--set` overrides; exit 2 on error.
pub fn resolve_cost(
    name: &str,
    set: Option<&str>,
) -> Result<schedc::sim::cost::CostModel, ExitCode> {
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

/// `--moe` needs all-to-all times: exit 1 with why when the cost model has none.
pub fn require_moe_costs(model: &schedc::sim::cost::CostModel, name: &str) -> Result<(), ExitCode> {
    schedc::moe::require_moe_costs(model, name).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(1)
    })
}

/// The placement's name in reports.
pub fn placement_name(k: schedc_ir::PlacementKind) -> &'static str {
    match k {
        schedc_ir::PlacementKind::Loop => "loop",
        schedc_ir::PlacementKind::V => "v",
        schedc_ir::PlacementKind::Bidir => "bidir",
        schedc_ir::PlacementKind::Explicit => "explicit",
    }
}
