//! Reading any supported input: IR text (and `.case` files), IR JSON, PyTorch CSV (both
//! forms), DeepSeek DualPipe traces. The format is chosen by extension, then by content.

use crate::import::{dualpipe, torch};
use schedc_ir::text::{self, Expect, ParseError, SourceMap, Span};
use schedc_ir::{Pipeline, PlacementKind, Program};

/// An input format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// IR text or `.case`.
    IrText,
    /// IR JSON.
    IrJson,
    /// PyTorch pipelining CSV (`compute_only` or `compute_comms`).
    TorchCsv,
    /// DeepSeek DualPipe / DualPipeV trace JSON.
    DualPipe,
    /// A `.sched` spec (elaborated for the instance given by `--pp`, `--mb`, `--vpp`,
    /// `--param`).
    Spec,
}

/// A placement given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlacementArg {
    /// A standard kind.
    Kind(PlacementKind),
    /// An explicit stage-to-rank map.
    Map(Vec<u32>),
}

impl std::str::FromStr for PlacementArg {
    type Err = String;
    /// `loop`, `v`, `bidir`, or a comma-separated list of ranks (`0,1,1,0`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "loop" => Ok(PlacementArg::Kind(PlacementKind::Loop)),
            "v" | "V" => Ok(PlacementArg::Kind(PlacementKind::V)),
            "bidir" => Ok(PlacementArg::Kind(PlacementKind::Bidir)),
            _ => s
                .split(',')
                .map(|x| x.trim().parse::<u32>())
                .collect::<Result<Vec<_>, _>>()
                .map(PlacementArg::Map)
                .map_err(|_| {
                    format!("invalid placement `{s}`: expected loop, v, bidir or a list of ranks such as 0,1,1,0")
                }),
        }
    }
}

/// Command-line overrides of what the input says or implies.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// `--mb M`.
    pub microbatches: Option<u32>,
    /// `--placement`.
    pub placement: Option<PlacementArg>,
    /// `--pp` (specs only).
    pub pp: Option<u32>,
    /// `--vpp` (specs only).
    pub vpp: Option<u32>,
    /// `--param NAME=VALUE` (specs only).
    pub params: Vec<(String, i64)>,
    /// The cost model a spec's `list` block is scheduled under (`schedc sim --cost`); unit
    /// op times when `None`.
    pub list_cost: Option<crate::sim::cost::CostModel>,
    /// `--moe[=STAGES]`: split the MoE stages' ops into parts ([`crate::moe`]).
    pub moe: Option<crate::moe::MoeStages>,
}

/// A loaded input.
pub struct Loaded {
    /// The program.
    pub program: Program,
    /// Where its instructions are in `text` (none for JSON inputs).
    pub spans: Option<SourceMap>,
    /// The file name, as given.
    pub name: String,
    /// The file's text.
    pub text: String,
    /// The format read.
    pub format: Format,
    /// For torch CSV: which form.
    pub torch_format: Option<torch::TorchFormat>,
    /// `.case` expectations.
    pub expects: Vec<(Expect, Span)>,
    /// `.case` activation budget.
    pub budget: Option<u64>,
    /// A spec's per-rank expectations (evaluated for this instance).
    pub spec_expects: Vec<crate::dsl::elab::Expectation>,
    /// A spec's notes about the instance (e.g. that V defaulted to 1).
    pub notes: Vec<String>,
    /// Where `--moe=...:list` or `:adjacent` reordered a spec's parts: the program with plain
    /// `--moe`'s order (the spec's own order, split), which the spec's `expect` lines
    /// describe and are checked on ([`crate::check::check_expectations_on`]). `None` when
    /// they describe [`Loaded::program`] itself.
    pub expect_program: Option<Program>,
    /// The MoE part selection applied: `--moe`'s, else a spec's `parts` item's
    /// ([`crate::dsl::Elaborated::parts`]); `None` when the ops were not split.
    pub moe: Option<crate::moe::MoeStages>,
    /// Where a spec's `parts` item split the parts (no `--moe` given): `NAME:LINE:COL:
    /// \`parts list\`` ([`parts_item`]); `None` otherwise.
    pub parts_item: Option<String>,
}

/// The `parts` item of the spec `text` read as `name`, as `NAME:LINE:COL: \`parts list\``
/// (the item as written); `None` when the text does not parse or has none.
pub fn parts_item(name: &str, text: &str) -> Option<String> {
    let file = crate::dsl::parse_file(text).ok()?;
    file.items.iter().find_map(|i| match i {
        crate::dsl::ast::Item::Parts(_, sp) => {
            let (l, c) = text::line_col(text, sp.start);
            let item = text.get(sp.start..sp.end).unwrap_or("parts").trim();
            Some(format!("{name}:{l}:{c}: `{item}`"))
        }
        _ => None,
    })
}

/// A spec's `parts` item splits the MoE stages into parts as `--moe=auto:list` does, so it
/// needs what the flag needs from a cost model that times the program: all-to-all times
/// ([`crate::moe::require_moe_costs`]). `Ok` when `loaded` was not split by such an item.
///
/// Errors: the item's location and why, when `cost` gives the all-to-alls no time.
pub fn require_part_costs(
    loaded: &Loaded,
    cost: &crate::sim::cost::CostModel,
    cost_name: &str,
) -> Result<(), String> {
    match &loaded.parts_item {
        Some(item) => require_parts_item_costs(item, cost, cost_name),
        None => Ok(()),
    }
}

/// [`require_part_costs`] for the item `item` ([`parts_item`]'s text).
///
/// Errors: as [`require_part_costs`].
pub fn require_parts_item_costs(
    item: &str,
    cost: &crate::sim::cost::CostModel,
    cost_name: &str,
) -> Result<(), String> {
    crate::moe::require_moe_costs_for(
        cost,
        cost_name,
        &format!("{item} (the spec's MoE stages split into parts, as by --moe=auto:list)"),
    )
}

/// A load failure: unreadable file, or a syntax error with its location.
#[derive(Debug)]
pub enum LoadError {
    /// The file could not be read.
    Io(String),
    /// A syntax error.
    Parse(ParseError),
    /// An override that does not fit the input.
    Usage(String),
    /// A spec that does not parse (exit 2), an instance its `require`s refuse or that cannot
    /// be elaborated (exit 1); the diagnostics point into `text`.
    Spec {
        /// The diagnostics.
        diags: Vec<crate::diag::Diagnostic>,
        /// The spec's text.
        text: String,
        /// True if a `require` refused the instance.
        refused: bool,
    },
}

impl LoadError {
    /// The exit status of a command that could not load its input: 1 for a spec that parses
    /// but whose instance is refused by a `require` or cannot be elaborated (the spec is
    /// readable; the instance is rejected), 2 for unreadable input (I/O, syntax) or bad usage
    /// (an unknown or missing `--param`: [`crate::diag::Code::Usage`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            LoadError::Spec { diags, .. }
                if !diags.iter().any(|d| {
                    matches!(d.code, crate::diag::Code::Syntax | crate::diag::Code::Usage)
                }) =>
            {
                1
            }
            _ => 2,
        }
    }

    /// The verdict a JSON report gives it: `refused` (a `require`), `rejected` (an
    /// elaboration error), `unreadable` (everything else).
    pub fn verdict(&self) -> &'static str {
        match self {
            LoadError::Spec { refused: true, .. } => "refused",
            e if e.exit_code() == 1 => "rejected",
            _ => "unreadable",
        }
    }
}

/// True if `text` reads as a `.sched` spec: one of its lines (outside comments) starts with a
/// keyword only the schedule language has (`schedule`, `param`, `vpp`, `let`, `fn`,
/// `require`), or is a rank block `rank r {` with a name rather than a number.
pub fn looks_like_spec(text: &str) -> bool {
    text.lines().any(|l| {
        let l = l.trim_start();
        let word: String = l
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let rest = l[word.len()..].trim_start();
        match word.as_str() {
            "schedule" | "param" | "vpp" | "let" | "fn" | "require" => {
                !rest.is_empty() && !rest.starts_with(':')
            }
            "rank" => rest
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_'),
            _ => false,
        }
    })
}

/// Detects the format from the name and the text: the extension decides (`.sched`, `.csv`,
/// `.json`, `.ir`, `.case`); otherwise the content.
pub fn detect(name: &str, text: &str) -> Format {
    let lower = name.to_ascii_lowercase();
    if lower.ends_with(".sched") {
        return Format::Spec;
    }
    if lower.ends_with(".csv") {
        return Format::TorchCsv;
    }
    let known_ir = lower.ends_with(".ir") || lower.ends_with(".case");
    let t = text.trim_start();
    if !known_ir && !lower.ends_with(".json") && !t.starts_with('{') && looks_like_spec(text) {
        return Format::Spec;
    }
    if lower.ends_with(".json") || t.starts_with('{') {
        if t.contains("\"num_chunks\"") && t.contains("\"num_ranks\"") {
            return Format::DualPipe;
        }
        return Format::IrJson;
    }
    // Without an extension: IR text lines start with a keyword, torch CSV rows with a stage
    // number or a compound `(`, or a comma (an idle first cell).
    let first = t.lines().next().unwrap_or("");
    if first
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_digit() || c == '(' || c == ',')
    {
        return Format::TorchCsv;
    }
    Format::IrText
}

/// Loads a file from disk (`-` is standard input). The path need not be UTF-8; messages show
/// it lossily.
pub fn load_path(path: impl AsRef<std::path::Path>, ov: &Overrides) -> Result<Loaded, LoadError> {
    let path = path.as_ref();
    let text = read_text(path)?;
    load_str(&path.to_string_lossy(), text, ov)
}

/// Reads an input's text: a file, or standard input for `-`; at most
/// [`crate::limits::max_input_bytes`]; UTF-8, without a byte-order mark.
///
/// Errors: [`LoadError::Io`] for a missing, unreadable, too large or non-UTF-8 input, or a
/// directory.
pub fn read_text(path_ref: &std::path::Path) -> Result<String, LoadError> {
    let name = path_ref.to_string_lossy().into_owned();
    let path = name.as_str();
    let max = crate::limits::max_input_bytes();
    let (shown, bytes) = if path_ref.as_os_str() == "-" {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(std::io::stdin(), max + 1), &mut b)
            .map_err(|e| LoadError::Io(format!("cannot read standard input: {e}")))?;
        ("standard input".to_string(), b)
    } else {
        if path_ref.is_dir() {
            return Err(LoadError::Io(format!(
                "`{path}` is a directory, not a schedule"
            )));
        }
        let f = std::fs::File::open(path_ref)
            .map_err(|e| LoadError::Io(format!("cannot read `{path}`: {e}")))?;
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(f, max + 1), &mut b)
            .map_err(|e| LoadError::Io(format!("cannot read `{path}`: {e}")))?;
        (format!("`{path}`"), b)
    };
    if bytes.len() as u64 > max {
        return Err(LoadError::Io(format!(
            "{shown} is larger than {} bytes, the most schedc reads under its memory limit ({}; set {} to allow more)",
            max,
            crate::limits::human_bytes(crate::limits::memory_limit().unwrap_or(crate::limits::DEFAULT_MEMORY_LIMIT)),
            crate::limits::LIMIT_VAR
        )));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        LoadError::Io(format!(
            "{shown} is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })?;
    // A UTF-8 byte-order mark is not part of the text.
    let text = match text.strip_prefix('\u{feff}') {
        Some(t) => t.to_string(),
        None => text,
    };
    Ok(text)
}

fn json_error(text: &str, e: serde_json::Error) -> ParseError {
    let (line, col) = (e.line().max(1), e.column().max(1));
    let mut offset = 0usize;
    for (i, l) in text.split_inclusive('\n').enumerate() {
        if i + 1 == line {
            offset += (col - 1).min(l.len());
            break;
        }
        offset += l.len();
    }
    ParseError {
        offset,
        len: 1,
        line,
        col,
        message: format!("invalid IR JSON: {}", strip_serde_location(&e.to_string())),
        help: None,
    }
}

/// Loads from text already in memory.
pub fn load_str(name: &str, text: String, ov: &Overrides) -> Result<Loaded, LoadError> {
    let format = detect(name, &text);
    let mut expects = Vec::new();
    let mut budget = None;
    let mut torch_format = None;
    let mut spec_expects = Vec::new();
    let mut notes = Vec::new();
    let mut spec_parts = None;
    if format != Format::Spec && (ov.pp.is_some() || ov.vpp.is_some() || !ov.params.is_empty()) {
        return Err(LoadError::Usage(format!(
            "--pp, --vpp and --param apply to .sched specs only, and `{name}` reads as {} (a spec is recognised by its .sched extension or by its content: a `schedule`, `param`, `let` or `require` line, or a `rank r {{` block)",
            match format {
                Format::IrText => "IR text",
                Format::IrJson => "IR JSON",
                Format::TorchCsv => "a PyTorch CSV",
                Format::DualPipe => "a DualPipe trace",
                Format::Spec => "a spec",
            }
        )));
    }
    let (mut program, spans) = match format {
        Format::Spec => {
            let e = match &ov.list_cost {
                Some(c) => load_spec_with(&text, ov, c)?,
                None => load_spec(&text, ov)?,
            };
            spec_expects = e.expects;
            notes = e.notes;
            spec_parts = e.parts;
            (e.program, Some(e.spans))
        }
        Format::IrText => {
            let p = text::parse(&text).map_err(LoadError::Parse)?;
            expects = p.expects;
            budget = p.budget_activations;
            (p.program, Some(p.spans))
        }
        Format::IrJson => {
            let p: Program =
                serde_json::from_str(&text).map_err(|e| LoadError::Parse(json_error(&text, e)))?;
            validate_pipeline(&p.pipeline).map_err(LoadError::Usage)?;
            (p, None)
        }
        Format::DualPipe => (
            dualpipe::parse_trace(&text).map_err(LoadError::Parse)?,
            None,
        ),
        Format::TorchCsv => {
            let opts = torch::TorchOptions {
                microbatches: ov.microbatches,
                stage_to_rank: match &ov.placement {
                    Some(PlacementArg::Map(m)) => Some(m.clone()),
                    _ => None,
                },
            };
            let t = torch::parse_csv(&text, &opts).map_err(LoadError::Parse)?;
            torch_format = Some(t.format);
            (t.program, Some(t.spans))
        }
    };
    if format != Format::Spec {
        apply_overrides(&mut program, ov).map_err(LoadError::Usage)?;
    }
    // A spec's `parts` item stands for `--moe=auto:list` (or `:adjacent`) where the command
    // line gives no `--moe`.
    let parts_item = match (&ov.moe, &spec_parts) {
        (None, Some(_)) => parts_item(name, &text),
        _ => None,
    };
    let moe = ov.moe.clone().or(spec_parts);
    if let Some(sel) = &moe {
        // `:list` and `:adjacent` reorder the parts of a compute-only program; an input with
        // its messages (or waits) written keeps plain `--moe`'s order: say so.
        let mode = match sel.interleave() {
            crate::moe::Interleave::None => None,
            crate::moe::Interleave::Adjacent => Some("adjacent".to_string()),
            crate::moe::Interleave::List(k) if k as usize == crate::moe_list::DEFAULT_WINDOW => {
                Some("list".to_string())
            }
            crate::moe::Interleave::List(k) => Some(format!("list{k}")),
        };
        let written = program
            .ranks
            .iter()
            .flatten()
            .find(|i| !i.is_compute() && !matches!(i, schedc_ir::Instr::Idle));
        if let (Some(mode), Some(i)) = (mode, written) {
            notes.push(format!(
                "`--moe=...:{mode}` orders the parts of a compute-only program, and this one has `{}` written in it (a DualPipe trace, torch's compute_comms, IR with messages or waits): its MoE parts keep the default order of plain `--moe`",
                text::instr_to_string(i)
            ));
        }
    }
    let expect_program = match &moe {
        Some(sel) if !spec_expects.is_empty() => {
            expectations_program(&program, sel).map_err(LoadError::Usage)?
        }
        _ => None,
    };
    let (program, spans) = match &moe {
        Some(sel) => apply_moe_under(&program, spans.as_ref(), sel, ov.list_cost.as_ref())
            .map_err(LoadError::Usage)?,
        None => (program, spans),
    };
    Ok(Loaded {
        program,
        spans,
        name: name.to_string(),
        text,
        format,
        torch_format,
        expects,
        budget,
        spec_expects,
        notes,
        expect_program,
        moe,
        parts_item,
    })
}

/// The note `sim` and `check` print where a spec's `expect` lines are checked on the order
/// before a part reordering ([`expectations_program`]).
pub const REORDER_NOTE: &str = "the spec's `expect` lines describe its own order: they are checked on it with plain `--moe` (before the `:list`/`:adjacent` reordering of the parts)";

/// The program a spec's `expect` lines describe under `sel` when `sel` reorders the parts
/// (`:list`, `:adjacent`): `p` (the spec's elaborated program) split with plain `--moe`'s
/// order. `None` when `sel` keeps that order (the expectations describe the split program).
///
/// Errors: a selection that does not fit the pipeline, as [`apply_moe`].
pub fn expectations_program(
    p: &Program,
    sel: &crate::moe::MoeStages,
) -> Result<Option<Program>, String> {
    if sel.interleave() == crate::moe::Interleave::None {
        return Ok(None);
    }
    let stages = sel.resolve(&p.pipeline)?;
    Ok(Some(
        crate::moe::split_timed(p, None, &stages, crate::moe::Interleave::None, None).0,
    ))
}

/// Applies `--moe`: splits the ops of the selected MoE stages into parts
/// ([`crate::moe::split_with`], interleaved as the selection says), mapping `spans` along.
///
/// Errors: a selection that does not fit the pipeline (a stage out of range, `declared`
/// without a declaration).
pub fn apply_moe(
    p: &Program,
    spans: Option<&SourceMap>,
    sel: &crate::moe::MoeStages,
) -> Result<(Program, Option<SourceMap>), String> {
    apply_moe_under(p, spans, sel, None)
}

/// [`apply_moe`], a `:list` selection scheduled under `cost` (unit times without one).
///
/// Errors: as [`apply_moe`].
pub fn apply_moe_under(
    p: &Program,
    spans: Option<&SourceMap>,
    sel: &crate::moe::MoeStages,
    cost: Option<&crate::sim::cost::CostModel>,
) -> Result<(Program, Option<SourceMap>), String> {
    let stages = sel.resolve(&p.pipeline)?;
    Ok(crate::moe::split_timed(
        p,
        spans,
        &stages,
        sel.interleave(),
        cost,
    ))
}

/// Parses and elaborates a spec for the instance in `ov` (a `list` block is scheduled under
/// unit op times; see [`load_spec_with`]; `--moe` is not applied here: see [`apply_moe`]).
pub fn load_spec(text: &str, ov: &Overrides) -> Result<crate::dsl::Elaborated, LoadError> {
    load_spec_with(text, ov, &crate::sim::cost::CostModel::default())
}

/// [`load_spec`], with a `list` block scheduled under the op times and message latency of
/// `cost`.
pub fn load_spec_with(
    text: &str,
    ov: &Overrides,
    cost: &crate::sim::cost::CostModel,
) -> Result<crate::dsl::Elaborated, LoadError> {
    use crate::diag::{Code, Diagnostic};
    let file = crate::dsl::parse_file(text).map_err(|e| LoadError::Spec {
        diags: vec![{
            let mut d = Diagnostic::error(Code::Syntax, e.message.clone());
            d.span = Some(Span {
                start: e.offset as u32,
                len: e.len as u32,
            });
            d.help = e.help.clone();
            d
        }],
        text: text.to_string(),
        refused: false,
    })?;
    let (Some(pp), Some(mb)) = (ov.pp, ov.microbatches) else {
        return Err(LoadError::Usage(
            "a .sched spec describes a family of schedules: give the instance with --pp P --mb M (and --vpp V where the spec allows it)".into(),
        ));
    };
    if ov.placement.is_some() {
        return Err(LoadError::Usage(
            "--placement does not apply to a spec: its `placement` item decides".into(),
        ));
    }
    let inst = crate::dsl::Instance {
        pp,
        mb,
        vpp: ov.vpp,
        params: ov.params.clone(),
    };
    crate::dsl::elab::elaborate_with(&file, &inst, cost).map_err(|errs| {
        let refused = errs.iter().all(|e| e.refused);
        LoadError::Spec {
            diags: errs.iter().map(elab_diag).collect(),
            text: text.to_string(),
            refused,
        }
    })
}

/// The diagnostic of an elaboration error.
pub fn elab_diag(e: &crate::dsl::ElabError) -> crate::diag::Diagnostic {
    use crate::diag::{Code, Diagnostic};
    let code = if e.refused {
        Code::Refused
    } else if e.usage {
        Code::Usage
    } else if e.malformed {
        Code::Syntax
    } else {
        Code::Elaboration
    };
    let mut d = Diagnostic::error(code, e.message.clone());
    if e.sp.end > e.sp.start || e.sp.start > 0 {
        d.span = Some(Span {
            start: e.sp.start as u32,
            len: (e.sp.end - e.sp.start) as u32,
        });
    }
    d.rank = e.rank;
    d.help = e.help.clone();
    d.notes = e.context.clone();
    // An error inside a `def`: each use it was expanded from (or the definition, for an
    // error at a use) as a second location.
    for (sp, label) in e.expansions.iter() {
        d.related.push((
            crate::diag::Loc {
                rank: e.rank.unwrap_or(0),
                position: 0,
                op: String::new(),
                span: Some(Span {
                    start: sp.start as u32,
                    len: (sp.end - sp.start) as u32,
                }),
                location: None,
                via: Vec::new(),
            },
            label.clone(),
        ));
    }
    d
}

fn validate_pipeline(p: &Pipeline) -> Result<(), String> {
    if p.pp == 0 || p.stages == 0 || p.microbatches == 0 {
        return Err("pp, stages and microbatches must be at least 1".into());
    }
    if p.stage_to_rank.len() != p.stages as usize {
        return Err(format!(
            "stage_to_rank has {} entries but there are {} stages",
            p.stage_to_rank.len(),
            p.stages
        ));
    }
    if let Some(r) = p.stage_to_rank.iter().find(|&&r| r >= p.pp) {
        return Err(format!("stage_to_rank names rank {r}, but pp is {}", p.pp));
    }
    if p.placement == PlacementKind::Bidir && !p.stages.is_multiple_of(2) {
        return Err("a bidirectional placement needs an even number of stages".into());
    }
    Ok(())
}

/// Applies `--mb` and `--placement` to a loaded program.
pub fn apply_overrides(p: &mut Program, ov: &Overrides) -> Result<(), String> {
    let pl = &p.pipeline;
    if ov.microbatches.is_none() && ov.placement.is_none() {
        return Ok(());
    }
    // `--mb` is the micro-batches of one step, as for a spec: for a bidirectional (DualPipe)
    // pipeline that is both directions together, M per direction being half of it.
    let bidir = matches!(
        (&ov.placement, pl.placement),
        (Some(PlacementArg::Kind(PlacementKind::Bidir)), _) | (None, PlacementKind::Bidir)
    );
    let mb = match ov.microbatches {
        Some(0) => return Err("--mb must be at least 1".into()),
        Some(m) if bidir => {
            if m % 2 != 0 {
                return Err(format!(
                    "--mb {m}: a bidirectional (DualPipe) schedule runs half its micro-batches each way, so --mb must be even"
                ));
            }
            m / 2
        }
        Some(m) => m,
        None => pl.microbatches,
    };
    let comms = pl.communicators.clone();
    let new = match &ov.placement {
        None => {
            let mut n = pl.clone();
            n.microbatches = mb;
            n
        }
        Some(PlacementArg::Kind(k)) => {
            Pipeline::new(pl.pp, pl.stages, mb, *k).map_err(|e| format!("--placement: {e}"))?
        }
        Some(PlacementArg::Map(m)) => {
            if m.len() as u32 != pl.stages {
                return Err(format!(
                    "--placement lists {} ranks but the schedule has {} stages",
                    m.len(),
                    pl.stages
                ));
            }
            Pipeline::explicit(pl.pp, mb, m.clone()).map_err(|e| format!("--placement: {e}"))?
        }
    };
    p.pipeline = Pipeline {
        communicators: comms,
        ..new
    };
    Ok(())
}

/// serde_json appends " at line L column C"; the location is reported separately.
fn strip_serde_location(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(k) if msg[k..].contains(" column ") => msg[..k].to_string(),
        _ => msg.to_string(),
    }
}
