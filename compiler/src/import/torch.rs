//! PyTorch `torch.distributed.pipelining` (2.15) schedule CSV: import and export.
//!
//! Torch writes a schedule as a CSV file with one row per pipeline rank (row `i` is rank `i`,
//! no header) and one action per cell (`3F12`: forward of stage 3 on micro-batch 12). Two
//! flavours exist ([`TorchFormat`]):
//!
//! * `compute_only` (`schedule.pipeline_order`): compute actions, `OVERLAP_F_B` compounds and
//!   empty cells for idle slots (plus `REDUCE_GRAD`/`WAIT_REDUCE_GRAD` in the single-stage
//!   schedules);
//! * `compute_comms` (`pipeline_order_with_comms`): the lowered program, with `SEND_F`,
//!   `RECV_F`, `SEND_B`, `RECV_B`, `WAIT_SEND_F/B`, `UNSHARD`, `RESHARD`, `REDUCE_GRAD`,
//!   `WAIT_REDUCE_GRAD`, and no empty cells.
//!
//! ## Letters
//!
//! Torch's `B` is the *fused* backward and `I` the input-only half; in the IR (and the
//! zero-bubble papers) `B` is the input-only half and `BW` the fused one. The conversion
//! happens here and nowhere else: torch `F` = [`Kind::F`], torch `I` = [`Kind::B`], torch `W`
//! = [`Kind::W`], torch `B` = [`Kind::BW`].
//!
//! ## Communication
//!
//! Torch attaches a send or receive to *its own* stage and leaves the peer implicit:
//! `3SEND_F5` sends stage 3's activation to the rank of stage 4, and `4RECV_F5` receives it on
//! the rank of stage 4. The IR names the payload by its *producer* and the peer explicitly, so
//! `4RECV_F5` becomes `Recv { Act(3, 5), peer: rank(3) }`, and `3RECV_B5` becomes
//! `Recv { Grad(4, 5), peer: rank(4) }`. Peers are computed from the stage-to-rank map, which is
//! inferred from the rows (or given in [`TorchOptions`]).
//!
//! ## Strictness
//!
//! Torch parses a cell with a *prefix* regex match and ignores anything after a valid action
//! (`0FOO` reads as `0F`, `3F12abc` as `3F12`). This importer does not: every cell must be
//! exactly one action, and anything else is a [`ParseError`] pointing at the cell. Like
//! torch, it strips spaces and tabs around a cell, and reads an empty (or all-blank) cell as an
//! idle slot.

use schedc_ir::text::{instr_to_string, line_col, ParseError, SourceMap, Span};
use schedc_ir::{
    Comm, Compute, Instr, Kind, Part, Payload, PayloadKind, Pipeline, PlacementKind, Program, Rank,
};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The two CSV flavours torch reads and writes (`_load_csv(path, format=...)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TorchFormat {
    /// `format="compute_only"`: compute actions, `OVERLAP_F_B` and empty cells (idle slots);
    /// torch lowers it (inserting sends, receives, FSDP and gradient-reduction actions) when it
    /// loads it.
    ComputeOnly,
    /// `format="compute_comms"`: the fully lowered program, run as written; no empty cells.
    ComputeComms,
}

impl TorchFormat {
    /// Torch's spelling of the format: `compute_only` or `compute_comms`.
    pub fn as_str(self) -> &'static str {
        match self {
            TorchFormat::ComputeOnly => "compute_only",
            TorchFormat::ComputeComms => "compute_comms",
        }
    }
}

/// The result of [`parse_csv`].
#[derive(Clone, Debug)]
pub struct TorchImport {
    /// The program: one rank per CSV row, one instruction per cell (an empty cell is
    /// [`Instr::Idle`]; a row with no cells is a rank with no instructions).
    pub program: Program,
    /// The span of every instruction: byte offset and length of its cell (without surrounding
    /// blanks); a zero-length span at the cell's position for an empty cell.
    pub spans: SourceMap,
    /// [`TorchFormat::ComputeComms`] if any `SEND_*`, `RECV_*` or `WAIT_SEND_*` action
    /// appears, else [`TorchFormat::ComputeOnly`].
    pub format: TorchFormat,
}

/// Options for [`parse_csv`]; the default infers everything from the file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TorchOptions {
    /// The number of micro-batches M. `None`: the largest micro-batch id in the file, plus 1.
    /// When given, a micro-batch id `>= M` is an error.
    pub microbatches: Option<u32>,
    /// The rank of each stage (`stage_to_rank[s]`), fixing the number of stages S to its
    /// length. `None`: inferred from the row on which each stage's actions appear. When given,
    /// an action of stage `s` on a row other than `stage_to_rank[s]` is an error.
    pub stage_to_rank: Option<Vec<u32>>,
}

// ---------------------------------------------------------------------------------------------
// Cell syntax
// ---------------------------------------------------------------------------------------------

/// Torch's `_ComputationType`s, as they appear in a cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ty {
    F,
    I,
    W,
    B,
    Unshard,
    Reshard,
    ReduceGrad,
    WaitReduceGrad,
    SendF,
    RecvF,
    SendB,
    RecvB,
    WaitSendF,
    WaitSendB,
}

/// Every action type, by its token.
const TYPES: [(&str, Ty); 14] = [
    ("F", Ty::F),
    ("I", Ty::I),
    ("W", Ty::W),
    ("B", Ty::B),
    ("UNSHARD", Ty::Unshard),
    ("RESHARD", Ty::Reshard),
    ("REDUCE_GRAD", Ty::ReduceGrad),
    ("WAIT_REDUCE_GRAD", Ty::WaitReduceGrad),
    ("SEND_F", Ty::SendF),
    ("RECV_F", Ty::RecvF),
    ("SEND_B", Ty::SendB),
    ("RECV_B", Ty::RecvB),
    ("WAIT_SEND_F", Ty::WaitSendF),
    ("WAIT_SEND_B", Ty::WaitSendB),
];

const TYPE_LIST: &str = "F, I, W, B, SEND_F, RECV_F, SEND_B, RECV_B, WAIT_SEND_F, WAIT_SEND_B \
     (each followed by a micro-batch number) and UNSHARD, RESHARD, REDUCE_GRAD, \
     WAIT_REDUCE_GRAD (without one)";

const OVERLAP: &str = "OVERLAP_F_B";

impl Ty {
    fn token(self) -> &'static str {
        TYPES
            .iter()
            .find(|(_, t)| *t == self)
            .map_or("?", |(s, _)| s)
    }
    fn from_token(s: &str) -> Option<Ty> {
        TYPES.iter().find(|(n, _)| *n == s).map(|(_, t)| *t)
    }
    /// True for the types written with a micro-batch number.
    fn has_mb(self) -> bool {
        !matches!(
            self,
            Ty::Unshard | Ty::Reshard | Ty::ReduceGrad | Ty::WaitReduceGrad
        )
    }
    fn is_comm(self) -> bool {
        matches!(
            self,
            Ty::SendF | Ty::RecvF | Ty::SendB | Ty::RecvB | Ty::WaitSendF | Ty::WaitSendB
        )
    }
    fn compute_kind(self) -> Option<Kind> {
        match self {
            Ty::F => Some(Kind::F),
            Ty::I => Some(Kind::B),
            Ty::W => Some(Kind::W),
            Ty::B => Some(Kind::BW),
            _ => None,
        }
    }
}

/// Torch's letter for one of our compute kinds.
fn torch_letter(k: Kind) -> &'static str {
    match k {
        Kind::F => "F",
        Kind::B => "I",
        Kind::W => "W",
        Kind::BW => "B",
    }
}

/// One parsed action (not a compound).
#[derive(Clone, Copy, Debug)]
struct Act {
    stage: u32,
    ty: Ty,
    /// Present exactly when `ty.has_mb()`.
    mb: u32,
}

impl Act {
    fn compute(&self) -> Option<Compute> {
        self.ty
            .compute_kind()
            .map(|k| Compute::new(k, self.stage, self.mb))
    }
}

/// One parsed cell.
#[derive(Clone, Copy, Debug)]
enum Cell {
    Idle,
    One(Act),
    /// `(fwd;bwd)OVERLAP_F_B`.
    Overlap(Act, Act),
}

impl Cell {
    fn for_each_act(&self, mut f: impl FnMut(&Act)) {
        match self {
            Cell::Idle => {}
            Cell::One(a) => f(a),
            Cell::Overlap(a, b) => {
                f(a);
                f(b);
            }
        }
    }
}

/// A cell-level error: message and optional help; located at the whole cell by the caller.
struct CellErr {
    message: String,
    help: Option<String>,
}

fn cell_err(message: impl Into<String>, help: Option<String>) -> CellErr {
    CellErr {
        message: message.into(),
        help,
    }
}

/// At most 32 characters of `s`, for messages (a fuzzed cell may be huge).
fn clip(s: &str) -> String {
    let mut it = s.chars();
    let head: String = it.by_ref().take(32).collect();
    if it.next().is_some() {
        format!("{head}...")
    } else {
        head
    }
}

fn expected_action(found: &str, help: Option<String>) -> CellErr {
    cell_err(
        format!("expected an action such as `3F12`, found `{}`", clip(found)),
        help,
    )
}

/// Parses a decimal `u32`; `what` names it in the overflow error.
fn parse_u32(digits: &str, cell: &str, what: &str) -> Result<u32, CellErr> {
    digits.parse::<u32>().map_err(|_| {
        cell_err(
            format!(
                "{what} `{}` in `{}` is too large (at most {})",
                clip(digits),
                clip(cell),
                u32::MAX
            ),
            None,
        )
    })
}

fn digits_end(b: &[u8], from: usize) -> usize {
    let mut i = from;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    i
}

/// Parses one simple action `<stage><TYPE>[<mb>]`, exactly (no trailing text).
fn parse_action(text: &str) -> Result<Act, CellErr> {
    let b = text.as_bytes();
    let stage_end = digits_end(b, 0);
    if stage_end == 0 {
        let help = if text.starts_with(|c: char| c.is_ascii_uppercase()) {
            "an action starts with its stage number, as in `0F3` (stage 0, forward, micro-batch 3)"
                .to_string()
        } else {
            format!("an action is <stage><TYPE><micro-batch>; the types are {TYPE_LIST}")
        };
        return Err(expected_action(text, Some(help)));
    }
    let stage = parse_u32(&text[..stage_end], text, "stage number")?;
    let mut ty_end = stage_end;
    while ty_end < b.len() && (b[ty_end].is_ascii_uppercase() || b[ty_end] == b'_') {
        ty_end += 1;
    }
    let name = &text[stage_end..ty_end];
    let Some(ty) = Ty::from_token(name) else {
        let help = if name.is_empty() {
            let lower = text[stage_end..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_lowercase());
            if lower {
                format!("action types are upper case; they are {TYPE_LIST}")
            } else {
                format!("an action is <stage><TYPE><micro-batch>; the types are {TYPE_LIST}")
            }
        } else if name == OVERLAP {
            "`OVERLAP_F_B` is a compound: `(<forward>;<backward>)OVERLAP_F_B`".to_string()
        } else {
            // The longest type that prefixes the name: what torch's prefix match would read.
            let prefix = TYPES
                .iter()
                .filter(|(t, _)| name.starts_with(t))
                .max_by_key(|(t, _)| t.len());
            match prefix {
                Some((t, _)) => format!(
                    "`{}` is not an action type; torch would read `{}{t}` and silently ignore \
                     the rest, schedc does not. The types are {TYPE_LIST}",
                    clip(name),
                    &text[..stage_end]
                ),
                None => format!(
                    "`{}` is not an action type; the types are {TYPE_LIST}",
                    clip(name)
                ),
            }
        };
        return Err(expected_action(text, Some(help)));
    };
    let mb_end = digits_end(b, ty_end);
    let mb_text = &text[ty_end..mb_end];
    let mb = if ty.has_mb() {
        if mb_text.is_empty() {
            return Err(expected_action(
                text,
                Some(format!(
                    "`{}` needs a micro-batch number, as in `{}{}0`",
                    ty.token(),
                    &text[..stage_end],
                    ty.token()
                )),
            ));
        }
        parse_u32(mb_text, text, "micro-batch number")?
    } else {
        if !mb_text.is_empty() {
            return Err(expected_action(
                text,
                Some(format!(
                    "`{}` takes no micro-batch number: write `{}{}`",
                    ty.token(),
                    &text[..stage_end],
                    ty.token()
                )),
            ));
        }
        0
    };
    if mb_end < text.len() {
        return Err(expected_action(
            text,
            Some(format!(
                "unexpected `{}` after `{}`; torch ignores text after an action, schedc rejects it",
                clip(&text[mb_end..]),
                &text[..mb_end]
            )),
        ));
    }
    Ok(Act { stage, ty, mb })
}

/// Parses one non-empty, trimmed cell.
fn parse_cell(text: &str) -> Result<Cell, CellErr> {
    if text == "\"\"" {
        // Python's csv writer quotes a row's only field when it is empty.
        return Ok(Cell::Idle);
    }
    if !text.starts_with('(') {
        return parse_action(text).map(Cell::One);
    }
    let shape = "a compound action is `(<forward>;<backward>)OVERLAP_F_B`, as in \
                 `(0F7;7B3)OVERLAP_F_B`";
    let Some(close) = text.find(')') else {
        return Err(cell_err(
            format!("expected `)` closing the compound action `{}`", clip(text)),
            Some(shape.into()),
        ));
    };
    let inner = &text[1..close];
    let suffix = &text[close + 1..];
    if inner.contains('(') || suffix.contains(')') {
        return Err(cell_err(
            format!(
                "nested parentheses in `{}`: compound actions cannot be nested",
                clip(text)
            ),
            Some(shape.into()),
        ));
    }
    if suffix != OVERLAP {
        return Err(cell_err(
            format!("expected `OVERLAP_F_B` after `)`, found `{}`", clip(suffix)),
            Some(shape.into()),
        ));
    }
    let mut acts = Vec::with_capacity(2);
    for piece in inner.split(';') {
        let a = parse_action(piece.trim_matches([' ', '\t'])).map_err(|e| CellErr {
            message: format!("in compound action: {}", e.message),
            help: e.help,
        })?;
        acts.push(a);
        if acts.len() > 2 {
            break;
        }
    }
    let one_fwd_one_bwd = "OVERLAP_F_B holds one forward and one backward (`B` or `I`), \
                           the forward first";
    if acts.len() != 2 {
        return Err(cell_err(
            format!(
                "`{}` has {} action{}; OVERLAP_F_B needs exactly two",
                clip(text),
                if acts.len() > 2 { "more than 2" } else { "1" },
                if acts.len() > 1 { "s" } else { "" }
            ),
            Some(one_fwd_one_bwd.into()),
        ));
    }
    let (f, b) = (acts[0], acts[1]);
    if f.ty != Ty::F || !matches!(b.ty, Ty::B | Ty::I) {
        let help = if b.ty == Ty::F && matches!(f.ty, Ty::B | Ty::I) {
            format!(
                "write the forward first: `({};{})OVERLAP_F_B`",
                &inner[inner.find(';').map_or(0, |p| p + 1)..].trim_matches([' ', '\t']),
                inner[..inner.find(';').unwrap_or(0)].trim_matches([' ', '\t'])
            )
        } else {
            one_fwd_one_bwd.into()
        };
        return Err(cell_err(
            format!("expected one forward and one backward in `{}`", clip(text)),
            Some(help),
        ));
    }
    Ok(Cell::Overlap(f, b))
}

// ---------------------------------------------------------------------------------------------
// Import
// ---------------------------------------------------------------------------------------------

fn perr(src: &str, start: usize, len: usize, message: impl Into<String>) -> ParseError {
    let (line, col) = line_col(src, start);
    ParseError {
        offset: start,
        len,
        line,
        col,
        message: message.into(),
        help: None,
    }
}

fn perr_span(src: &str, sp: Span, message: impl Into<String>) -> ParseError {
    perr(src, sp.start as usize, sp.len as usize, message)
}

fn with_help(mut e: ParseError, help: impl Into<String>) -> ParseError {
    e.help = Some(help.into());
    e
}

fn span(start: usize, len: usize) -> Span {
    // The input length is checked to fit in u32 up front.
    Span {
        start: start as u32,
        len: len as u32,
    }
}

/// Splits the source into rows of parsed cells.
fn parse_rows(src: &str) -> Result<Vec<Vec<(Cell, Span)>>, ParseError> {
    let mut rows = Vec::new();
    let mut pos = 0;
    loop {
        let end = src[pos..].find('\n').map_or(src.len(), |i| pos + i);
        let mut line_end = end;
        if src[pos..line_end].ends_with('\r') {
            line_end -= 1;
        }
        let mut row = Vec::new();
        if line_end > pos {
            let mut cell_start = pos;
            loop {
                let cell_end = src[cell_start..line_end]
                    .find(',')
                    .map_or(line_end, |i| cell_start + i);
                let raw = &src[cell_start..cell_end];
                let lead = raw.len() - raw.trim_start_matches([' ', '\t']).len();
                let text = raw.trim_matches([' ', '\t']);
                let start = cell_start + lead;
                if text.is_empty() {
                    row.push((Cell::Idle, span(cell_start, 0)));
                } else {
                    let sp = span(start, text.len());
                    let cell = parse_cell(text).map_err(|e| ParseError {
                        help: e.help,
                        ..perr_span(src, sp, e.message)
                    })?;
                    row.push((cell, sp));
                }
                if cell_end == line_end {
                    break;
                }
                cell_start = cell_end + 1;
            }
        }
        rows.push(row);
        if end >= src.len() || end + 1 == src.len() {
            break;
        }
        pos = end + 1;
    }
    Ok(rows)
}

/// Parses a torch schedule CSV (either format, detected) into the IR.
///
/// Row `i` is rank `i`, so P is the number of rows (a final newline does not start a row);
/// lines may end in `\n` or `\r\n`. S is the largest stage id plus one (or the length of
/// `opts.stage_to_rank`), M the largest micro-batch id plus one (or `opts.microbatches`). The
/// placement is [`PlacementKind::Loop`] if stage `s` is on rank `s % P`, [`PlacementKind::V`]
/// if it follows torch's zigzag, else [`PlacementKind::Explicit`].
///
/// Errors (each a [`ParseError`] with the byte offset, length and 1-based line and column of
/// the offending cell): empty input; a malformed cell (unknown action type, text after an
/// action, a missing or too large number, a compound that is not exactly
/// `(<F>;<B or I>)OVERLAP_F_B`); (a stage on two ranks is not an import error: the first rank
/// to run it holds it, and `schedc check` reports the others as `placement` errors), or
/// on a rank other than the one `opts.stage_to_rank` gives; a stage id below the largest that
/// never appears; a send or receive with no
/// neighbouring stage (`SEND_F` or `RECV_B` on the last stage, `RECV_F` or `SEND_B` on stage
/// 0); no micro-batch at all. Never panics.
pub fn parse_csv(src: &str, opts: &TorchOptions) -> Result<TorchImport, ParseError> {
    if src.len() > u32::MAX as usize {
        return Err(perr(src, 0, 0, "input too large (over 4 GiB)"));
    }
    if src.is_empty() {
        return Err(with_help(
            perr(
                src,
                0,
                0,
                "empty input: expected one row of actions per rank",
            ),
            "a torch schedule CSV has one row per pipeline rank, e.g. `0F0,0F1,0B0,0B1`",
        ));
    }
    let rows = parse_rows(src)?;
    let pp = match u32::try_from(rows.len()) {
        Ok(p) if p > 0 => p,
        _ => return Err(perr(src, 0, 0, "expected between 1 and 2^32-1 rows")),
    };

    let mut format = TorchFormat::ComputeOnly;
    let mut max_mb: Option<(u32, Span)> = None;
    for row in &rows {
        for (cell, sp) in row {
            cell.for_each_act(|a| {
                if a.ty.is_comm() {
                    format = TorchFormat::ComputeComms;
                }
                if a.ty.has_mb() && max_mb.is_none_or(|(m, _)| a.mb > m) {
                    max_mb = Some((a.mb, *sp));
                }
            });
        }
    }

    // Stage-to-rank map.
    let map: Vec<Rank> = match &opts.stage_to_rank {
        Some(given) => check_given_map(src, &rows, given, pp)?,
        None => infer_map(src, &rows)?,
    };
    let stages = map.len() as u32;

    // Micro-batches.
    let microbatches = match opts.microbatches {
        Some(0) => {
            return Err(perr(
                src,
                0,
                0,
                "the number of micro-batches must be at least 1",
            ))
        }
        // Ids >= M are kept: the verifier reports them with their location (`range`).
        Some(m) => m,
        None => match max_mb {
            None => {
                return Err(with_help(
                    perr(
                        src,
                        0,
                        0,
                        "no action with a micro-batch: the CSV has no compute op",
                    ),
                    "a schedule needs at least one forward such as `0F0`",
                ))
            }
            Some((m, sp)) => m
                .checked_add(1)
                .ok_or_else(|| perr_span(src, sp, format!("micro-batch id {m} is too large")))?,
        },
    };

    let pipeline = build_pipeline(pp, stages, microbatches, map)
        .map_err(|e| perr(src, 0, 0, format!("invalid pipeline: {e}")))?;

    // Conversion.
    let mut ranks = Vec::with_capacity(rows.len());
    let mut spans = Vec::with_capacity(rows.len());
    for row in &rows {
        let mut instrs = Vec::with_capacity(row.len());
        let mut sps = Vec::with_capacity(row.len());
        for (cell, sp) in row {
            instrs.push(convert(src, &pipeline, cell, *sp)?);
            sps.push(*sp);
        }
        ranks.push(instrs);
        spans.push(sps);
    }
    Ok(TorchImport {
        program: Program { pipeline, ranks },
        spans: SourceMap {
            ranks: spans,
            ..Default::default()
        },
        format,
    })
}

fn check_given_map(
    src: &str,
    rows: &[Vec<(Cell, Span)>],
    given: &[u32],
    pp: u32,
) -> Result<Vec<Rank>, ParseError> {
    if given.is_empty() {
        return Err(perr(src, 0, 0, "the given stage-to-rank map is empty"));
    }
    if u32::try_from(given.len()).is_err() {
        return Err(perr(src, 0, 0, "the given stage-to-rank map is too long"));
    }
    if let Some((s, r)) = given.iter().enumerate().find(|(_, &r)| r >= pp) {
        return Err(perr(
            src,
            0,
            0,
            format!("the given stage-to-rank map puts stage {s} on rank {r}, but the CSV has {pp} row(s)"),
        ));
    }
    for (r, row) in rows.iter().enumerate() {
        for (cell, sp) in row {
            let mut bad: Option<String> = None;
            cell.for_each_act(|a| {
                if bad.is_some() {
                    return;
                }
                match given.get(a.stage as usize) {
                    None => {
                        bad = Some(format!(
                            "stage {} is out of range: the given stage-to-rank map has {} stages",
                            a.stage,
                            given.len()
                        ))
                    }
                    Some(&want) if want as usize != r => {
                        bad = Some(format!(
                            "stage {} is on rank {want} by the given stage-to-rank map, but \
                             appears on rank {r}",
                            a.stage
                        ))
                    }
                    _ => {}
                }
            });
            if let Some(m) = bad {
                return Err(perr_span(src, *sp, m));
            }
        }
    }
    Ok(given.to_vec())
}

fn infer_map(src: &str, rows: &[Vec<(Cell, Span)>]) -> Result<Vec<Rank>, ParseError> {
    // stage -> (rank, first span)
    let mut seen: BTreeMap<u32, (u32, Span)> = BTreeMap::new();
    for (r, row) in rows.iter().enumerate() {
        let r = r as u32;
        for (cell, sp) in row {
            // The first rank to run a stage holds it; actions of that stage on other rows
            // stay where they are, and the verifier reports them (`placement`, with their
            // location) instead of the import failing.
            cell.for_each_act(|a| {
                seen.entry(a.stage).or_insert((r, *sp));
            });
        }
    }
    if seen.is_empty() {
        return Err(with_help(
            perr(src, 0, 0, "no actions: every row is empty"),
            "a schedule needs at least one forward such as `0F0`",
        ));
    }
    for (i, (&s, &(_, sp))) in seen.iter().enumerate() {
        if s as usize != i {
            return Err(with_help(
                perr_span(
                    src,
                    sp,
                    format!("stage {i} never appears, but stage {s} does"),
                ),
                format!(
                    "stages are numbered from 0 without gaps; every stage below {s} needs \
                     actions on its rank"
                ),
            ));
        }
    }
    Ok(seen.values().map(|&(r, _)| r).collect())
}

/// A pipeline with the most specific placement kind that reproduces `map`.
fn build_pipeline(
    pp: u32,
    stages: u32,
    microbatches: u32,
    map: Vec<Rank>,
) -> Result<Pipeline, schedc_ir::PipelineError> {
    for kind in [PlacementKind::Loop, PlacementKind::V] {
        if let Ok(p) = Pipeline::new(pp, stages, microbatches, kind) {
            if p.stage_to_rank == map {
                return Ok(p);
            }
        }
    }
    Pipeline::explicit(pp, microbatches, map)
}

fn convert(src: &str, pl: &Pipeline, cell: &Cell, sp: Span) -> Result<Instr, ParseError> {
    let a = match cell {
        Cell::Idle => return Ok(Instr::Idle),
        Cell::Overlap(f, b) => {
            // Both are compute actions by construction.
            return match (f.compute(), b.compute()) {
                (Some(fwd), Some(bwd)) => Ok(Instr::Overlap { fwd, bwd }),
                _ => Err(perr_span(src, sp, "expected one forward and one backward")),
            };
        }
        Cell::One(a) => a,
    };
    let s = a.stage;
    let m = a.mb;
    let last = pl.stages - 1;
    let at_end = |what: &str| perr_span(src, sp, format!("`{s}{}{m}` {what}", a.ty.token()));
    let payload = |kind, stage| Payload { kind, stage, mb: m };
    Ok(match a.ty {
        Ty::Unshard => Instr::Unshard(s),
        Ty::Reshard => Instr::Reshard(s),
        Ty::ReduceGrad => Instr::ReduceGrad(s),
        Ty::WaitReduceGrad => Instr::WaitReduceGrad(s),
        Ty::WaitSendF => Instr::WaitSend(payload(PayloadKind::Act, s)),
        Ty::WaitSendB => Instr::WaitSend(payload(PayloadKind::Grad, s)),
        Ty::SendF => {
            if s >= last {
                return Err(at_end(&format!(
                    "sends stage {s}'s activation forward, but stage {s} is the last stage"
                )));
            }
            Instr::Comm(Comm::Send {
                payload: payload(PayloadKind::Act, s),
                peer: pl.rank_of(s + 1),
                channel: 0,
            })
        }
        Ty::RecvF => {
            if s == 0 {
                return Err(at_end(
                    "receives an activation into stage 0, but stage 0 is the first stage",
                ));
            }
            Instr::Comm(Comm::Recv {
                payload: payload(PayloadKind::Act, s - 1),
                peer: pl.rank_of(s - 1),
                channel: 0,
            })
        }
        Ty::SendB => {
            if s == 0 {
                return Err(at_end(
                    "sends stage 0's input gradient backward, but stage 0 is the first stage",
                ));
            }
            Instr::Comm(Comm::Send {
                payload: payload(PayloadKind::Grad, s),
                peer: pl.rank_of(s - 1),
                channel: 0,
            })
        }
        Ty::RecvB => {
            if s >= last {
                return Err(at_end(&format!(
                    "receives a gradient into stage {s}, but stage {s} is the last stage"
                )));
            }
            Instr::Comm(Comm::Recv {
                payload: payload(PayloadKind::Grad, s + 1),
                peer: pl.rank_of(s + 1),
                channel: 0,
            })
        }
        Ty::F => Instr::Compute(Compute::new(Kind::F, s, m)),
        Ty::I => Instr::Compute(Compute::new(Kind::B, s, m)),
        Ty::W => Instr::Compute(Compute::new(Kind::W, s, m)),
        Ty::B => Instr::Compute(Compute::new(Kind::BW, s, m)),
    })
}

// ---------------------------------------------------------------------------------------------
// Export
// ---------------------------------------------------------------------------------------------

/// Writes a program as a torch schedule CSV: one row per rank, cells joined by `,`, each row
/// ended by `\n`.
///
/// * [`TorchFormat::ComputeOnly`] writes compute ops, overlaps (`(0F7;7B3)OVERLAP_F_B`), idle
///   slots as empty cells, and `REDUCE_GRAD`, `WAIT_REDUCE_GRAD`, `UNSHARD`, `RESHARD`. A rank
///   whose only instruction is an idle slot is written `""`, as Python's csv writer does.
/// * [`TorchFormat::ComputeComms`] writes every instruction except idle slots (torch allows no
///   empty cell there), flattening each [`Instr::Group`] into its members in order and
///   converting sends and receives to torch's attachment (`Recv Act(s,m)` is
///   `{s+1}RECV_F{m}`, `Recv Grad(s,m)` is `{s-1}RECV_B{m}`, `Send Act(s,m)` is `{s}SEND_F{m}`,
///   `Send Grad(s,m)` is `{s}SEND_B{m}`).
///
/// Round trips: `write_csv(parse_csv(s))` reproduces a torch-written CSV byte for byte (line
/// ends aside: this writes `\n`). `parse_csv(write_csv(p))` gives `p` back except for what
/// the CSV does not carry: idle slots and group boundaries under `ComputeComms`, a number of
/// micro-batches above the largest id used, and an `Explicit` placement that equals a
/// standard one.
///
/// Errors (a sentence naming the rank and instruction): what torch cannot run or express —
/// a [`PlacementKind::Bidir`] pipeline (DualPipe's two copies of each stage), an MoE part
/// (only whole-stage ops), a collective, an overlap that is not one forward and one backward,
/// a send or receive whose peer is not the rank of the neighbouring stage (torch derives peers
/// from the placement), or that sits on a rank not holding the stage torch attaches it to; a
/// send, receive or send-wait in `ComputeOnly` (use `ComputeComms`); a rank count different
/// from `pp`.
pub fn write_csv(p: &Program, format: TorchFormat) -> Result<String, String> {
    let pl = &p.pipeline;
    if pl.placement == PlacementKind::Bidir {
        return Err(
            "torch cannot run a bidirectional (DualPipe) placement: every rank would hold two \
             copies of a stage, and torch places each stage on exactly one rank; use the V \
             placement (DualPipeV) for torch"
                .into(),
        );
    }
    if p.ranks.len() != pl.pp as usize {
        return Err(format!(
            "the program has {} rank programs but pp is {}; torch needs one row per rank",
            p.ranks.len(),
            pl.pp
        ));
    }
    let mut out = String::with_capacity(p.len() * 8 + p.ranks.len());
    for (r, instrs) in p.ranks.iter().enumerate() {
        if format == TorchFormat::ComputeOnly && instrs.len() == 1 && instrs[0] == Instr::Idle {
            out.push_str("\"\"\n");
            continue;
        }
        let mut first = true;
        for (i, instr) in instrs.iter().enumerate() {
            let ctx = || format!("rank {r}, instruction {i} (`{}`)", instr_to_string(instr));
            let mut cell = |out: &mut String| {
                if !first {
                    out.push(',');
                }
                first = false;
            };
            match instr {
                Instr::Idle => {
                    if format == TorchFormat::ComputeOnly {
                        cell(&mut out);
                    }
                }
                Instr::Compute(c) => {
                    check_whole(c, &ctx)?;
                    cell(&mut out);
                    write_compute(&mut out, c);
                }
                Instr::Overlap { fwd, bwd } => {
                    check_whole(fwd, &ctx)?;
                    check_whole(bwd, &ctx)?;
                    if fwd.kind != Kind::F || !bwd.kind.is_backward_input() {
                        return Err(format!(
                            "{}: torch's OVERLAP_F_B holds one forward and one backward (B or \
                             BW)",
                            ctx()
                        ));
                    }
                    cell(&mut out);
                    out.push('(');
                    write_compute(&mut out, fwd);
                    out.push(';');
                    write_compute(&mut out, bwd);
                    out.push(')');
                    out.push_str(OVERLAP);
                }
                Instr::ReduceGrad(s) => {
                    cell(&mut out);
                    let _ = write!(out, "{s}REDUCE_GRAD");
                }
                Instr::WaitReduceGrad(s) => {
                    cell(&mut out);
                    let _ = write!(out, "{s}WAIT_REDUCE_GRAD");
                }
                Instr::Unshard(s) => {
                    cell(&mut out);
                    let _ = write!(out, "{s}UNSHARD");
                }
                Instr::Reshard(s) => {
                    cell(&mut out);
                    let _ = write!(out, "{s}RESHARD");
                }
                Instr::WaitSend(pay) => {
                    if format == TorchFormat::ComputeOnly {
                        return Err(comms_in_compute_only(&ctx()));
                    }
                    cell(&mut out);
                    let k = if pay.kind == PayloadKind::Act {
                        'F'
                    } else {
                        'B'
                    };
                    let _ = write!(out, "{}WAIT_SEND_{k}{}", pay.stage, pay.mb);
                }
                Instr::Mem(_) => {
                    return Err(format!(
                        "{}: torch's schedule CSV has no action for moving or recomputing \
                         saved activations (OFFLOAD, RELOAD, RECOMPUTE); the torch format \
                         cannot express a schedule that manages memory",
                        ctx()
                    ));
                }
                Instr::WaitRecv(_) => {
                    return Err(format!(
                        "{}: torch has no action that holds its compute stream back until a \
                         receive completes (its RECV_F/RECV_B are waited by the op that reads \
                         them); export the program without `--moe=...:list`",
                        ctx()
                    ));
                }
                Instr::Comm(_) | Instr::Group(_) => {
                    if format == TorchFormat::ComputeOnly {
                        return Err(comms_in_compute_only(&ctx()));
                    }
                    for m in instr.comms() {
                        cell(&mut out);
                        write_comm(&mut out, pl, r as Rank, m, &ctx)?;
                    }
                }
            }
        }
        out.push('\n');
    }
    Ok(out)
}

fn comms_in_compute_only(ctx: &str) -> String {
    format!(
        "{ctx}: the compute_only format has no sends, receives or send waits; export with \
         compute_comms"
    )
}

fn check_whole(c: &Compute, ctx: &dyn Fn() -> String) -> Result<(), String> {
    if c.part == Part::Whole {
        Ok(())
    } else {
        Err(format!(
            "{}: torch runs whole stages and has no MoE parts (`.{}`); fold the parts into \
             whole-stage ops before exporting",
            ctx(),
            c.part.as_str()
        ))
    }
}

fn write_compute(out: &mut String, c: &Compute) {
    let _ = write!(out, "{}{}{}", c.stage, torch_letter(c.kind), c.mb);
}

/// Writes one send or receive in torch's stage attachment, checking that torch's implicit
/// peer (from the placement) is the program's peer.
fn write_comm(
    out: &mut String,
    pl: &Pipeline,
    rank: Rank,
    m: &Comm,
    ctx: &dyn Fn() -> String,
) -> Result<(), String> {
    if m.channel() != 0 {
        return Err(format!(
            "{}: the message is on channel {}, but torch has one in-order channel per pair of \
             ranks (its P2P process group); export a program whose sends and receives are all \
             on channel 0",
            ctx(),
            m.channel()
        ));
    }
    let (send, payload, peer) = match m {
        Comm::Send { payload, peer, .. } => (true, payload, *peer),
        Comm::Recv { payload, peer, .. } => (false, payload, *peer),
        Comm::Collective(_) => {
            return Err(format!(
                "{}: torch has no collectives (MoE all-to-all); fold the MoE parts into \
                 whole-stage ops before exporting",
                ctx()
            ))
        }
    };
    if payload.kind.is_stash() {
        return Err(format!(
            "{}: torch's schedule format has no action that lends a stage's saved \
             activations to another rank (BPipe's LEND/RETURN); export a schedule without them",
            ctx()
        ));
    }
    let s = payload.stage;
    let act = payload.kind == PayloadKind::Act;
    // The payload goes from its producer `s` to its consumer (the next stage for an
    // activation, the previous one for a gradient); torch attaches a send to the producer and
    // a receive to the consumer.
    let consumer = if act {
        s.checked_add(1).filter(|&t| t < pl.stages)
    } else {
        s.checked_sub(1)
    };
    let Some(consumer) = consumer.filter(|_| s < pl.stages) else {
        return Err(format!(
            "{}: stage {s} has no {} stage to exchange this with in a pipeline of {} stages",
            ctx(),
            if act { "next" } else { "previous" },
            pl.stages
        ));
    };
    let (attached, theirs) = if send { (s, consumer) } else { (consumer, s) };
    if pl.rank_of(attached) != rank {
        return Err(format!(
            "{}: torch attaches this to stage {attached}, which is on rank {}, not rank {rank}",
            ctx(),
            pl.rank_of(attached)
        ));
    }
    if pl.rank_of(theirs) != peer {
        return Err(format!(
            "{}: the peer is rank {peer}, but torch exchanges it with the rank of stage {theirs}, \
             rank {}",
            ctx(),
            pl.rank_of(theirs)
        ));
    }
    let dir = if act { 'F' } else { 'B' };
    let verb = if send { "SEND" } else { "RECV" };
    let _ = write!(out, "{attached}{verb}_{dir}{}", payload.mb);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Runtime completion
// ---------------------------------------------------------------------------------------------

/// Prepares a program for torch 2.15's `_PipelineScheduleRuntime._load_csv(path, format)`:
/// what [`write_csv`] should be given to get a CSV that the runtime loads **and runs**.
///
/// * [`TorchFormat::ComputeOnly`]: drops `REDUCE_GRAD`, `WAIT_REDUCE_GRAD`, `UNSHARD` and
///   `RESHARD` (torch's `compute_only` loader refuses every non-compute action and inserts
///   these itself); everything else is kept as written. (`schedc convert` does not call this:
///   it writes a compute-only program as it is, so that torch's own files convert back byte
///   for byte, and warns when one of these actions is present.)
/// * [`TorchFormat::ComputeComms`]: keeps every compute op, send and receive in place (the
///   order `schedc check` verified) and adds what the runtime runs a `compute_comms` schedule
///   with but does not insert itself, on each rank:
///   - `UNSHARD` of every stage the rank holds, first (in the order the rank first uses
///     them), and `RESHARD` right after the stage's last op: FSDP's parameter all-gather and
///     release, no-ops for a stage that is not FSDP-wrapped (only on a rank with neither);
///   - `REDUCE_GRAD` then `WAIT_REDUCE_GRAD` right after each stage's last weight gradient
///     (its last `W` or fused backward, past the sends that directly follow it): the only
///     place the runtime scales gradients by 1/M (`scale_grads`) and reduces them across
///     data-parallel replicas; a `REDUCE_GRAD` already present without its wait gets the wait
///     right after it (torch allows one pending reduction per rank);
///   - `WAIT_SEND_F`/`WAIT_SEND_B` for every send without one, as torch's own lowering places
///     them: an activation send of (s, m) waits right after the rank's input backward of
///     (s, m) (`B` or fused backward) and the sends that directly follow it (torch puts the
///     wait before those sends); that backward cannot run before the peer has received the
///     activation, so the wait never blocks. Any other send waits at the end of the rank.
///     Torch refuses a `compute_comms` schedule with a send that has no wait.
///
///   Idle slots are dropped (`compute_comms` has no empty cells).
///
/// The result still passes `schedc check` when the input does, with the same warmup and
/// activation peaks (none of the added actions moves a compute op, a send or a receive).
/// Never fails today (the `Result` leaves room for refusals); [`write_csv`] still refuses what
/// torch cannot express.
pub fn for_runtime(p: &Program, format: TorchFormat) -> Result<Program, String> {
    let ranks = match format {
        TorchFormat::ComputeOnly => p
            .ranks
            .iter()
            .map(|instrs| {
                instrs
                    .iter()
                    .filter(|i| {
                        !matches!(
                            i,
                            Instr::ReduceGrad(_)
                                | Instr::WaitReduceGrad(_)
                                | Instr::Unshard(_)
                                | Instr::Reshard(_)
                        )
                    })
                    .cloned()
                    .collect()
            })
            .collect(),
        TorchFormat::ComputeComms => p.ranks.iter().map(|r| complete_rank(r)).collect(),
    };
    Ok(Program {
        pipeline: p.pipeline.clone(),
        ranks,
    })
}

/// What [`complete_rank`] adds after an instruction, in this order at one anchor.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Added {
    WaitSend,
    ReduceGrad,
    WaitReduceGrad,
    Reshard,
}

/// One rank of [`for_runtime`] for `compute_comms`.
fn complete_rank(instrs: &[Instr]) -> Vec<Instr> {
    let n = instrs.len();
    let is_send = |i: &Instr| {
        !i.comms().is_empty() && i.comms().iter().all(|c| matches!(c, Comm::Send { .. }))
    };
    // An op's bookkeeping goes after the sends (and idle slots) that directly follow it, so
    // that they are issued first.
    let anchor = |i: usize| {
        let mut j = i;
        while j + 1 < n && (is_send(&instrs[j + 1]) || instrs[j + 1] == Instr::Idle) {
            j += 1;
        }
        j
    };

    // Stages in the order of first use; last op and last weight gradient of each.
    let mut stages: Vec<u32> = Vec::new();
    let mut last_op: BTreeMap<u32, usize> = BTreeMap::new();
    let mut last_wgrad: BTreeMap<u32, usize> = BTreeMap::new();
    let mut has_fsdp = false;
    let mut reduced: BTreeMap<u32, usize> = BTreeMap::new();
    let mut reduce_waited: Vec<u32> = Vec::new();
    let mut waited: Vec<Payload> = Vec::new();
    for (i, ins) in instrs.iter().enumerate() {
        ins.for_each_compute(|c| {
            if !stages.contains(&c.stage) {
                stages.push(c.stage);
            }
            last_op.insert(c.stage, i);
            if matches!(c.kind, Kind::W | Kind::BW) {
                last_wgrad.insert(c.stage, i);
            }
        });
        match ins {
            Instr::Unshard(_) | Instr::Reshard(_) => has_fsdp = true,
            Instr::ReduceGrad(s) => {
                reduced.entry(*s).or_insert(i);
            }
            Instr::WaitReduceGrad(s) => reduce_waited.push(*s),
            Instr::WaitSend(pay) => waited.push(*pay),
            _ => {}
        }
    }

    let mut adds: Vec<(usize, Added, Instr)> = Vec::new();
    for (i, ins) in instrs.iter().enumerate() {
        for m in ins.comms() {
            let Comm::Send { payload, .. } = m else {
                continue;
            };
            if waited.contains(payload) {
                continue;
            }
            waited.push(*payload);
            let wait = Instr::WaitSend(*payload);
            let after_bwd = (payload.kind == PayloadKind::Act)
                .then(|| {
                    (i + 1..n).find(|&k| {
                        let mut hit = false;
                        instrs[k].for_each_compute(|c| {
                            hit |= c.kind.is_backward_input()
                                && c.stage == payload.stage
                                && c.mb == payload.mb;
                        });
                        hit
                    })
                })
                .flatten();
            // `n` stands for the end of the rank.
            adds.push((after_bwd.map_or(n, anchor), Added::WaitSend, wait));
        }
    }
    for (&s, &i) in &last_wgrad {
        if !reduced.contains_key(&s) {
            let at = anchor(i);
            adds.push((at, Added::ReduceGrad, Instr::ReduceGrad(s)));
            adds.push((at, Added::WaitReduceGrad, Instr::WaitReduceGrad(s)));
        }
    }
    for (&s, &i) in &reduced {
        if !reduce_waited.contains(&s) {
            adds.push((i, Added::WaitReduceGrad, Instr::WaitReduceGrad(s)));
        }
    }
    if !has_fsdp {
        for (&s, &i) in &last_op {
            // After the stage's reduction when that follows its last op.
            let at = if !reduced.contains_key(&s) && last_wgrad.get(&s) == Some(&i) {
                anchor(i)
            } else {
                i
            };
            adds.push((at, Added::Reshard, Instr::Reshard(s)));
        }
    }
    // Stable: same anchor and kind keep the order they were found in.
    adds.sort_by_key(|(at, kind, _)| (*at, *kind));

    let mut out = Vec::with_capacity(n + adds.len() + stages.len());
    if !has_fsdp {
        out.extend(stages.iter().map(|&s| Instr::Unshard(s)));
    }
    let mut next = adds.into_iter().peekable();
    for (i, ins) in instrs.iter().enumerate() {
        if *ins != Instr::Idle {
            out.push(ins.clone());
        }
        while let Some((_, _, add)) = next.next_if(|(at, _, _)| *at == i) {
            out.push(add);
        }
    }
    out.extend(next.map(|(_, _, add)| add));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn ref_dir() -> PathBuf {
        crate::test_support::shared().join("reference/torch")
    }

    fn files(suffix: &str) -> Vec<PathBuf> {
        let dir = ref_dir();
        let Ok(rd) = std::fs::read_dir(&dir) else {
            crate::test_support::skip_missing(&dir);
            return Vec::new();
        };
        let mut v: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with(suffix))
            .collect();
        v.sort();
        v
    }

    fn parse(src: &str) -> Result<TorchImport, ParseError> {
        parse_csv(src, &TorchOptions::default())
    }

    /// Non-empty cells of a CSV text, counted independently of the parser.
    fn cells(src: &str) -> (usize, usize) {
        let mut nonempty = 0;
        let mut all = 0;
        for line in src.lines() {
            if line.is_empty() {
                continue;
            }
            for c in line.split(',') {
                all += 1;
                if !c.is_empty() {
                    nonempty += 1;
                }
            }
        }
        (nonempty, all)
    }

    #[test]
    fn compute_csvs_round_trip_byte_for_byte() {
        let fs = files(".compute.csv");
        assert!(
            fs.len() > 100,
            "expected the reference CSVs, found {}",
            fs.len()
        );
        for f in fs {
            let src = std::fs::read_to_string(&f).unwrap();
            let imp = parse(&src).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            assert_eq!(imp.format, TorchFormat::ComputeOnly, "{}", f.display());
            let (_, all) = cells(&src);
            assert_eq!(imp.program.len(), all, "{}", f.display());
            assert_eq!(imp.program.pipeline.pp as usize, src.lines().count());
            for (r, row) in imp.spans.ranks.iter().enumerate() {
                assert_eq!(row.len(), imp.program.ranks[r].len());
            }
            let out = write_csv(&imp.program, TorchFormat::ComputeOnly).unwrap();
            assert_eq!(out, src, "{}", f.display());
        }
    }

    #[test]
    fn comms_csvs_parse_and_round_trip() {
        let fs = files(".comms.csv");
        assert!(
            fs.len() > 50,
            "expected the reference CSVs, found {}",
            fs.len()
        );
        for f in fs {
            let src = std::fs::read_to_string(&f).unwrap();
            let imp = parse(&src).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            assert_eq!(imp.format, TorchFormat::ComputeComms, "{}", f.display());
            let p = &imp.program;
            let (nonempty, all) = cells(&src);
            assert_eq!(
                nonempty,
                all,
                "{}: comms CSVs have no empty cell",
                f.display()
            );
            assert_eq!(p.len(), nonempty, "{}", f.display());
            assert!(p.ranks.iter().flatten().all(|i| *i != Instr::Idle));
            let count = |pat: &str| src.matches(pat).count();
            let overlaps = count(OVERLAP);
            let comms = count("SEND_F") + count("RECV_F") + count("SEND_B") + count("RECV_B")
                - count("WAIT_SEND_F")
                - count("WAIT_SEND_B");
            assert_eq!(p.comm_ops(), comms, "{}", f.display());
            let computes = src
                .split([',', '\n'])
                .filter(|c| {
                    let t = c.trim_start_matches(|ch: char| ch.is_ascii_digit());
                    t.len() < c.len()
                        && matches!(t.chars().next(), Some('F' | 'I' | 'W' | 'B'))
                        && t[1..].chars().all(|ch| ch.is_ascii_digit())
                })
                .count();
            assert_eq!(p.compute_ops(), computes + 2 * overlaps, "{}", f.display());
            let out = write_csv(p, TorchFormat::ComputeComms).unwrap();
            assert_eq!(out, src, "{}", f.display());
            // A program with sends cannot be written compute-only.
            let e = write_csv(p, TorchFormat::ComputeOnly).unwrap_err();
            assert!(e.contains("compute_comms"), "{e}");
            fifo_agrees(p, &f.display().to_string());
        }
    }

    /// The k-th send from rank a to rank b carries the payload of the k-th receive on b from
    /// a, and every send is received.
    fn fifo_agrees(p: &Program, name: &str) {
        use std::collections::{HashMap, VecDeque};
        let mut chan: HashMap<(u32, u32), VecDeque<Payload>> = HashMap::new();
        for (a, prog) in p.ranks.iter().enumerate() {
            for m in prog.iter().flat_map(Instr::comms) {
                if let Comm::Send { payload, peer, .. } = m {
                    chan.entry((a as u32, *peer))
                        .or_default()
                        .push_back(*payload);
                }
            }
        }
        for (b, prog) in p.ranks.iter().enumerate() {
            for m in prog.iter().flat_map(Instr::comms) {
                if let Comm::Recv { payload, peer, .. } = m {
                    let got = chan
                        .get_mut(&(*peer, b as u32))
                        .and_then(VecDeque::pop_front);
                    assert_eq!(got, Some(*payload), "{name}: rank {b} from {peer}");
                }
            }
        }
        assert!(chan.values().all(VecDeque::is_empty), "{name}");
    }

    /// Torch 2.15's `Schedule1F1B.pipeline_order` numbers the last rank's forwards 1..=M
    /// instead of 0..M (`1F1,1B0,1F2,1B1,...` for P=2): imported faithfully, the inferred M is
    /// one too many, and an explicit M rejects the file at the first out-of-range forward.
    #[test]
    fn torch_1f1b_last_rank_forward_ids_are_shifted() {
        let f = ref_dir().join("Schedule1F1B_P2_M2_V1.compute.csv");
        let Ok(src) = std::fs::read_to_string(&f) else {
            crate::test_support::skip_missing(&f);
            return;
        };
        let p = parse(&src).unwrap().program;
        assert_eq!(p.pipeline.microbatches, 3);
        assert_eq!(p.ranks[1][0], Instr::Compute(Compute::new(Kind::F, 1, 1)));
        let o = TorchOptions {
            microbatches: Some(2),
            stage_to_rank: None,
        };
        // The importer keeps the out-of-range id; the verifier reports it (see the
        // conformance tests).
        let q = parse_csv(&src, &o).unwrap().program;
        assert_eq!(q.pipeline.microbatches, 2);
        assert_eq!(q.ranks[1][2], Instr::Compute(Compute::new(Kind::F, 1, 2)));
    }

    #[test]
    fn large_schedule() {
        let dir = ref_dir().join("large");
        for ext in ["compute", "comms"] {
            let f = dir.join(format!("ScheduleInterleaved1F1B_P64_M1024_V2.{ext}.csv"));
            let Ok(src) = std::fs::read_to_string(&f) else {
                crate::test_support::skip_missing(&f);
                continue;
            };
            let imp = parse(&src).unwrap();
            let pl = &imp.program.pipeline;
            assert_eq!((pl.pp, pl.stages, pl.microbatches), (64, 128, 1024));
            assert_eq!(pl.placement, PlacementKind::Loop);
            let fmt = if ext == "compute" {
                TorchFormat::ComputeOnly
            } else {
                TorchFormat::ComputeComms
            };
            assert_eq!(imp.format, fmt);
            assert_eq!(write_csv(&imp.program, fmt).unwrap(), src);
        }
    }

    #[test]
    fn placement_matches_expected_json() {
        let path = ref_dir().join("expected.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            crate::test_support::skip_missing(&path);
            return;
        };
        let recs: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        let mut checked = 0;
        for rec in recs {
            let name = rec["name"].as_str().unwrap();
            if rec["accepted"] != serde_json::Value::Bool(true) {
                continue;
            }
            let pp = rec["pp"].as_u64().unwrap() as u32;
            let v = rec["stages_per_rank"].as_u64().unwrap() as u32;
            for ext in ["compute", "comms"] {
                let f = ref_dir().join(format!("{name}.{ext}.csv"));
                let Ok(src) = std::fs::read_to_string(&f) else {
                    continue;
                };
                let imp = parse(&src).unwrap();
                let pl = &imp.program.pipeline;
                assert_eq!((pl.pp, pl.stages), (pp, pp * v), "{name}");
                if let Some(map) = rec.get("stage_to_rank") {
                    let map: Vec<u32> = serde_json::from_value(map.clone()).unwrap();
                    assert_eq!(pl.stage_to_rank, map, "{name}");
                    checked += 1;
                }
                let schedule = rec["schedule"].as_str().unwrap();
                let want =
                    if v > 1 && matches!(schedule, "ScheduleZBVZeroBubble" | "ScheduleDualPipeV") {
                        PlacementKind::V
                    } else {
                        PlacementKind::Loop
                    };
                assert_eq!(pl.placement, want, "{name}");
                // Re-parsing with the map given gives the same program.
                let opts = TorchOptions {
                    microbatches: Some(pl.microbatches),
                    stage_to_rank: Some(pl.stage_to_rank.clone()),
                };
                assert_eq!(parse_csv(&src, &opts).unwrap().program, imp.program);
            }
        }
        assert!(checked > 100, "only {checked} maps checked");
    }

    #[test]
    fn letters_and_comms() {
        let src = "0F0,0SEND_F0,0RECV_B0,0I0,0W0,(0F1;0B0)OVERLAP_F_B,0WAIT_SEND_F0\r\n\
                   1RECV_F0,1F0,1B0,1SEND_B0,1WAIT_SEND_B0,1UNSHARD,1RESHARD,1REDUCE_GRAD\r\n";
        let imp = parse(src).unwrap();
        assert_eq!(imp.format, TorchFormat::ComputeComms);
        let r0 = &imp.program.ranks[0];
        let act = |s, m| Payload {
            kind: PayloadKind::Act,
            stage: s,
            mb: m,
        };
        let grad = |s, m| Payload {
            kind: PayloadKind::Grad,
            stage: s,
            mb: m,
        };
        assert_eq!(r0[0], Instr::Compute(Compute::new(Kind::F, 0, 0)));
        assert_eq!(
            r0[1],
            Instr::Comm(Comm::Send {
                payload: act(0, 0),
                peer: 1,
                channel: 0,
            })
        );
        assert_eq!(
            r0[2],
            Instr::Comm(Comm::Recv {
                payload: grad(1, 0),
                peer: 1,
                channel: 0,
            })
        );
        assert_eq!(r0[3], Instr::Compute(Compute::new(Kind::B, 0, 0)));
        assert_eq!(r0[4], Instr::Compute(Compute::new(Kind::W, 0, 0)));
        assert_eq!(
            r0[5],
            Instr::Overlap {
                fwd: Compute::new(Kind::F, 0, 1),
                bwd: Compute::new(Kind::BW, 0, 0)
            }
        );
        assert_eq!(r0[6], Instr::WaitSend(act(0, 0)));
        let r1 = &imp.program.ranks[1];
        assert_eq!(
            r1[0],
            Instr::Comm(Comm::Recv {
                payload: act(0, 0),
                peer: 0,
                channel: 0,
            })
        );
        assert_eq!(r1[2], Instr::Compute(Compute::new(Kind::BW, 1, 0)));
        assert_eq!(
            r1[3],
            Instr::Comm(Comm::Send {
                payload: grad(1, 0),
                peer: 0,
                channel: 0,
            })
        );
        assert_eq!(r1[4], Instr::WaitSend(grad(1, 0)));
        assert_eq!(r1[5], Instr::Unshard(1));
        assert_eq!(r1[6], Instr::Reshard(1));
        assert_eq!(r1[7], Instr::ReduceGrad(1));
        assert_eq!(imp.program.pipeline.microbatches, 2);
        // Spans point at the cells.
        let sp = imp.spans.get(0, 5).unwrap();
        assert_eq!(
            &src[sp.start as usize..(sp.start + sp.len) as usize],
            "(0F1;0B0)OVERLAP_F_B"
        );
        let out = write_csv(&imp.program, TorchFormat::ComputeComms).unwrap();
        assert_eq!(out, src.replace("\r\n", "\n"));
    }

    #[test]
    fn groups_flatten_on_export() {
        let mut p = parse("0F0,0SEND_F0\n1RECV_F0,1F0\n").unwrap().program;
        let m = p.ranks[0].remove(1);
        let Instr::Comm(c) = m else { panic!() };
        p.ranks[0].push(Instr::Group(vec![c.clone(), c]));
        p.ranks[0].push(Instr::Idle);
        assert_eq!(
            write_csv(&p, TorchFormat::ComputeComms).unwrap(),
            "0F0,0SEND_F0,0SEND_F0\n1RECV_F0,1F0\n"
        );
    }

    #[test]
    fn idle_cells() {
        for src in [",1F0,,\n0F0\n", "\"\"\n0F0\n", "\n0F0\n", "0F0,\n1F0"] {
            let imp = parse(src).unwrap();
            let out = write_csv(&imp.program, TorchFormat::ComputeOnly).unwrap();
            let want = if src.ends_with('\n') {
                src.to_string()
            } else {
                format!("{src}\n")
            };
            assert_eq!(out, want);
            assert_eq!(parse(&out).unwrap().program, imp.program);
        }
        let imp = parse(",0F0, ,\n").unwrap();
        assert_eq!(imp.program.ranks[0][0], Instr::Idle);
        assert_eq!(imp.spans.get(0, 0), Some(Span { start: 0, len: 0 }));
        assert_eq!(imp.spans.get(0, 2), Some(Span { start: 5, len: 0 }));
        assert_eq!(imp.spans.get(0, 3), Some(Span { start: 7, len: 0 }));
        // An empty line is a rank with no instructions; a single quoted empty cell is an idle.
        assert!(parse("\n0F0\n").unwrap().program.ranks[0].is_empty());
        assert_eq!(
            parse("\"\"\n0F0\n").unwrap().program.ranks[0],
            vec![Instr::Idle]
        );
    }

    #[test]
    fn placement_kinds() {
        let p = parse("0F0,2F0\n1F0,3F0\n").unwrap().program.pipeline;
        assert_eq!(p.placement, PlacementKind::Loop);
        let p = parse("0F0,3F0\n1F0,2F0\n").unwrap().program.pipeline;
        assert_eq!(p.placement, PlacementKind::V);
        let p = parse("0F0,1F0\n2F0,3F0\n").unwrap().program.pipeline;
        assert_eq!(p.placement, PlacementKind::Explicit);
        assert_eq!(p.stage_to_rank, vec![0, 0, 1, 1]);
        // S == P: loop and V agree; loop wins.
        let p = parse("0F0\n1F0\n").unwrap().program.pipeline;
        assert_eq!(p.placement, PlacementKind::Loop);
        // A stage adjacent on the same rank still gets a peer from the map.
        let imp = parse("0F0,1F0,1SEND_F0\n2RECV_F0,2F0\n").unwrap();
        assert_eq!(
            imp.program.ranks[0][2],
            Instr::Comm(Comm::Send {
                payload: Payload {
                    kind: PayloadKind::Act,
                    stage: 1,
                    mb: 0
                },
                peer: 1,
                channel: 0,
            })
        );
    }

    #[test]
    fn options() {
        let o = TorchOptions {
            microbatches: Some(4),
            stage_to_rank: Some(vec![1, 0]),
        };
        let p = parse_csv("1F0\n0F0\n", &o).unwrap().program.pipeline;
        assert_eq!(p.microbatches, 4);
        assert_eq!(p.placement, PlacementKind::Explicit);
        assert_eq!(p.stage_to_rank, vec![1, 0]);
        let e = parse_csv("0F0\n1F0\n", &o).unwrap_err();
        assert_eq!((e.line, e.col), (1, 1));
        assert!(e.message.contains("stage 0 is on rank 1"), "{}", e.message);
        // Out-of-range ids are left to the verifier, which reports them with their span.
        assert!(parse_csv("1F0\n0F4\n", &o).is_ok());
        let o = TorchOptions {
            microbatches: None,
            stage_to_rank: Some(vec![0, 2]),
        };
        assert!(parse_csv("0F0\n1F0\n", &o).is_err());
    }

    fn err(src: &str) -> ParseError {
        match parse(src) {
            Ok(_) => panic!("`{src}` parsed"),
            Err(e) => e,
        }
    }

    #[test]
    fn errors_with_locations() {
        let e = err("0F0,0F1\n1F0,3X1\n");
        assert_eq!((e.line, e.col, e.offset, e.len), (2, 5, 12, 3));
        assert_eq!(e.message, "expected an action such as `3F12`, found `3X1`");

        let e = err("0FOO\n");
        assert_eq!((e.line, e.col, e.len), (1, 1, 4));
        let h = e.help.unwrap();
        assert!(h.contains("torch would read `0F`"), "{h}");

        let e = err("0F0,0F12abc\n");
        assert_eq!((e.line, e.col, e.len), (1, 5, 7));
        assert!(e.help.unwrap().contains("unexpected `abc` after `0F12`"));

        let e = err("0F0\r\n1F\r\n");
        assert_eq!((e.line, e.col), (2, 1));
        assert!(e.help.unwrap().contains("needs a micro-batch number"));

        let e = err("0F0,((0F1;1B0)OVERLAP_F_B;1B1)OVERLAP_F_B\n");
        assert_eq!((e.line, e.col), (1, 5));
        assert!(e.message.contains("nested"), "{}", e.message);

        let e = err("0F0,0F4294967296\n");
        assert_eq!((e.line, e.col, e.len), (1, 5, 12));
        assert!(e.message.contains("too large"), "{}", e.message);
        let e = err("99999999999F0\n");
        assert!(e.message.contains("too large"), "{}", e.message);

        // A stage on two rows imports; the verifier reports the second row's op.
        let p = parse("0F0,1F0\n2F0,1B0\n").unwrap().program;
        assert_eq!(p.pipeline.stage_to_rank, vec![0, 0, 1]);

        let e = err("0F0\n2F0\n");
        assert_eq!((e.line, e.col), (2, 1));
        assert_eq!(e.message, "stage 1 never appears, but stage 2 does");

        let e = err("0F0,0SEND_F0\n");
        assert_eq!((e.line, e.col), (1, 5));
        assert!(e.message.contains("last stage"), "{}", e.message);
        let e = err("0RECV_F0,0F0\n1F0\n");
        assert!(e.message.contains("first stage"), "{}", e.message);

        let e = err("0F0,(1B0;0F1)OVERLAP_F_B\n1B0\n");
        assert_eq!((e.line, e.col), (1, 5));
        assert!(e.help.unwrap().contains("(0F1;1B0)OVERLAP_F_B"));
        assert!(err("(0F0;0W0)OVERLAP_F_B\n")
            .message
            .contains("one forward"));
        assert!(err("(0F0;0B0;0F1)OVERLAP_F_B\n")
            .message
            .contains("exactly two"));
        assert!(err("(0F0;0B0)OVERLAP\n").message.contains("OVERLAP_F_B"));
        assert!(err("(0F0;0B0\n").message.contains("`)`"));
        assert!(err("0OVERLAP_F_B\n").help.unwrap().contains("compound"));
        assert!(err("0f0\n").help.unwrap().contains("upper case"));
        assert!(err("0UNSHARD3\n").help.unwrap().contains("no micro-batch"));
        assert!(err("F0\n").help.unwrap().contains("stage number"));
        assert!(err("0F0;0F1\n").help.is_some());

        let e = err("");
        assert_eq!((e.line, e.col), (1, 1));
        assert!(err("\n").message.contains("no actions"));
        assert!(err("0UNSHARD\n").message.contains("no compute op"));
        assert!(err("0F4294967295\n").message.contains("too large"));
    }

    #[test]
    fn export_refusals() {
        let mut p = parse("0F0,0B0\n").unwrap().program;
        p.ranks[0][0] = Instr::Compute(Compute {
            part: Part::Mlp,
            ..Compute::new(Kind::F, 0, 0)
        });
        assert!(write_csv(&p, TorchFormat::ComputeOnly)
            .unwrap_err()
            .contains("fold"));
        let mut p = parse("0F0,0B0\n").unwrap().program;
        p.ranks[0].push(Instr::Comm(Comm::Collective(Box::new(
            schedc_ir::Collective {
                comm: "ep".into(),
                label: "d0".into(),
            },
        ))));
        assert!(write_csv(&p, TorchFormat::ComputeComms)
            .unwrap_err()
            .contains("collective"));
        let mut p = parse("0F0\n1F0\n").unwrap().program;
        p.pipeline = Pipeline::new(1, 2, 1, PlacementKind::Bidir).unwrap();
        p.ranks.pop();
        assert!(write_csv(&p, TorchFormat::ComputeOnly)
            .unwrap_err()
            .contains("DualPipe"));
        // A peer torch would not derive.
        let mut p = parse("0F0,0SEND_F0\n1RECV_F0,1F0\n2F0\n").unwrap().program;
        p.ranks[0][1] = Instr::Comm(Comm::Send {
            payload: Payload {
                kind: PayloadKind::Act,
                stage: 0,
                mb: 0,
            },
            peer: 2,
            channel: 0,
        });
        assert!(write_csv(&p, TorchFormat::ComputeComms)
            .unwrap_err()
            .contains("peer is rank 2"));
    }

    #[test]
    fn never_panics_on_junk() {
        let junk = [
            ",",
            ",,\n,",
            "\r\n",
            "\r",
            "0",
            "0F",
            "(",
            ")",
            "();",
            "()OVERLAP_F_B",
            "(;)OVERLAP_F_B",
            "(0F0;)OVERLAP_F_B",
            "0F0,\u{e9}",
            "\u{e9}\n0F0",
            "0RECV_B0",
            "0F0\n\n\n",
            "0SEND_B0",
            "4294967295F0",
            "0F0,4294967295RECV_F0",
            "0F0 , 0F1",
            "0F0\r",
            "\"\"",
            "\"\",\"\"",
        ];
        for j in junk {
            if let Ok(imp) = parse(j) {
                for f in [TorchFormat::ComputeOnly, TorchFormat::ComputeComms] {
                    if let Ok(out) = write_csv(&imp.program, f) {
                        assert_eq!(parse(&out).unwrap().program, imp.program, "{j:?}");
                    }
                }
            }
        }
    }

    /// A tiny deterministic generator (xorshift), for the fuzz-style tests.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn fuzz_random_cells_never_panic() {
        let pieces = [
            "0",
            "1",
            "2",
            "3",
            "12",
            "4294967295",
            "4294967296",
            "F",
            "I",
            "W",
            "B",
            "SEND_F",
            "RECV_F",
            "SEND_B",
            "RECV_B",
            "WAIT_SEND_F",
            "WAIT_SEND_B",
            "UNSHARD",
            "RESHARD",
            "REDUCE_GRAD",
            "WAIT_REDUCE_GRAD",
            "OVERLAP_F_B",
            "(",
            ")",
            ";",
            ",",
            ",",
            "\n",
            "\r\n",
            " ",
            "\"",
            "x",
            "\u{e9}",
            "\r",
        ];
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..20_000 {
            let n = rng.below(12);
            let src: String = (0..n).map(|_| pieces[rng.below(pieces.len())]).collect();
            if let Ok(imp) = parse(&src) {
                assert_eq!(imp.spans.ranks.len(), imp.program.ranks.len());
                for f in [TorchFormat::ComputeOnly, TorchFormat::ComputeComms] {
                    if let Ok(out) = write_csv(&imp.program, f) {
                        let back = parse(&out);
                        if f == TorchFormat::ComputeOnly {
                            let back = back.unwrap().program;
                            assert_eq!(back.ranks, imp.program.ranks, "{src:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn fuzz_mutated_reference_never_panics() {
        let f = ref_dir().join("ScheduleDualPipeV_P2_M4_V2.comms.csv");
        let Ok(src) = std::fs::read_to_string(&f) else {
            crate::test_support::skip_missing(&f);
            return;
        };
        let bytes = b"0123456789FIWBSEND_RECVOAPLH();,\n\r \"x";
        let mut rng = Rng(12345);
        for _ in 0..3_000 {
            let mut b = src.clone().into_bytes();
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(b.len());
                match rng.below(3) {
                    0 => b[i] = bytes[rng.below(bytes.len())],
                    1 => {
                        b.remove(i);
                    }
                    _ => b.insert(i, bytes[rng.below(bytes.len())]),
                }
            }
            let s = String::from_utf8(b).unwrap();
            if let Ok(imp) = parse(&s) {
                let _ = write_csv(&imp.program, TorchFormat::ComputeComms);
            } else if let Err(e) = parse(&s) {
                assert!(e.offset + e.len <= s.len());
                assert_eq!((e.line, e.col), line_col(&s, e.offset));
            }
        }
    }

    // ---- Export for torch 2.15's `_PipelineScheduleRuntime` ----

    /// The spec instances the PyTorch end-to-end test (backends/torch/test_e2e.py) runs, and
    /// more sizes: (spec path from the repository root, P, V, M).
    const RUNTIME_INSTANCES: &[(&str, u32, u32, u32)] = &[
        ("specs/1f1b.sched", 4, 1, 8),
        ("specs/1f1b.sched", 3, 1, 2),
        ("specs/interleaved_1f1b.sched", 4, 2, 8),
        ("specs/interleaved_1f1b.sched", 2, 3, 6),
        ("specs/interleaved_zb.sched", 2, 2, 4),
        ("specs/interleaved_zb.sched", 4, 2, 8),
        ("specs/zbv.sched", 4, 2, 8),
        ("specs/zbv.sched", 3, 2, 2),
        ("specs/dualpipev.sched", 2, 2, 4),
        ("specs/dualpipev.sched", 4, 2, 10),
        ("backends/torch/specs/custom.sched", 2, 2, 4),
        ("backends/torch/specs/custom.sched", 4, 2, 8),
    ];

    fn load_instance(spec: &str, pp: u32, vpp: u32, mb: u32) -> crate::input::Loaded {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(spec);
        let ov = crate::input::Overrides {
            pp: Some(pp),
            vpp: Some(vpp),
            microbatches: Some(mb),
            ..Default::default()
        };
        match crate::input::load_path(&path, &ov) {
            Ok(l) => l,
            Err(_) => panic!("{spec} P={pp} V={vpp} M={mb} does not load"),
        }
    }

    fn figures(r: &crate::check::Report) -> Vec<(u64, u64)> {
        r.ranks
            .iter()
            .map(|k| (k.warmup, k.peak_activations))
            .collect()
    }

    /// What torch 2.15's `_PipelineScheduleRuntime` needs of a `compute_comms` program beyond
    /// its loader's checks, rank by rank: every send has exactly one later wait (torch's
    /// `_validate_send_waits`, and the runtime retires sends only there); an activation send
    /// waits after the rank's own input backward of it, if the rank runs one (so the wait
    /// never blocks); at most one pending reduction, each `REDUCE_GRAD` waited (torch's
    /// load-time check), after the stage's M-th weight gradient (where the runtime's
    /// "last backward" count ends) and exactly once per stage; `UNSHARD` before a stage's
    /// first op, `RESHARD` after its last; no idle slot.
    fn assert_runnable_by_torch(p: &Program, name: &str) {
        let m = p.pipeline.microbatches;
        for (r, instrs) in p.ranks.iter().enumerate() {
            let at = |i: usize| format!("{name}: rank {r}, instruction {i}");
            let mut pending: Vec<Payload> = Vec::new();
            let mut sent: Vec<Payload> = Vec::new();
            let mut wgrads: BTreeMap<u32, u32> = BTreeMap::new();
            let mut reduced: Vec<u32> = Vec::new();
            let mut open_reduce: Option<u32> = None;
            let mut unsharded: Vec<u32> = Vec::new();
            let mut resharded: Vec<u32> = Vec::new();
            let mut bwd_done: Vec<(u32, u32)> = Vec::new();
            for (i, ins) in instrs.iter().enumerate() {
                assert_ne!(*ins, Instr::Idle, "{}", at(i));
                ins.for_each_compute(|c| {
                    assert!(unsharded.contains(&c.stage), "{}: before UNSHARD", at(i));
                    assert!(!resharded.contains(&c.stage), "{}: after RESHARD", at(i));
                    assert!(!reduced.contains(&c.stage), "{}: after REDUCE_GRAD", at(i));
                    if matches!(c.kind, Kind::W | Kind::BW) {
                        *wgrads.entry(c.stage).or_default() += 1;
                    }
                    if c.kind.is_backward_input() {
                        bwd_done.push((c.stage, c.mb));
                    }
                });
                for c in ins.comms() {
                    if let Comm::Send { payload, .. } = c {
                        assert!(!sent.contains(payload), "{}: sent twice", at(i));
                        sent.push(*payload);
                        pending.push(*payload);
                    }
                }
                match ins {
                    Instr::WaitSend(pay) => {
                        let k = pending.iter().position(|q| q == pay);
                        assert!(k.is_some(), "{}: a wait with no pending send", at(i));
                        pending.remove(k.unwrap_or(0));
                        let local_bwd = instrs.iter().any(|x| {
                            let mut hit = false;
                            x.for_each_compute(|c| {
                                hit |= c.kind.is_backward_input()
                                    && (c.stage, c.mb) == (pay.stage, pay.mb)
                            });
                            hit
                        });
                        if pay.kind == PayloadKind::Act && local_bwd {
                            assert!(
                                bwd_done.contains(&(pay.stage, pay.mb)),
                                "{}: waits for an activation send before the backward that \
                                 proves it was received",
                                at(i)
                            );
                        }
                    }
                    Instr::ReduceGrad(s) => {
                        assert_eq!(open_reduce, None, "{}: two pending reductions", at(i));
                        assert_eq!(wgrads.get(s), Some(&m), "{}: before the M-th dW", at(i));
                        assert!(!reduced.contains(s), "{}: reduced twice", at(i));
                        reduced.push(*s);
                        open_reduce = Some(*s);
                    }
                    Instr::WaitReduceGrad(s) => {
                        assert_eq!(open_reduce, Some(*s), "{}", at(i));
                        open_reduce = None;
                    }
                    Instr::Unshard(s) => unsharded.push(*s),
                    Instr::Reshard(s) => {
                        assert!(unsharded.contains(s), "{}", at(i));
                        resharded.push(*s);
                    }
                    _ => {}
                }
            }
            assert!(
                pending.is_empty(),
                "{name}: rank {r}: sends never waited: {pending:?}"
            );
            assert_eq!(
                open_reduce, None,
                "{name}: rank {r}: a reduction never waited"
            );
            let mut held: Vec<u32> = wgrads.keys().copied().collect();
            held.sort_unstable();
            reduced.sort_unstable();
            resharded.sort_unstable();
            assert_eq!(reduced, held, "{name}: rank {r}: one REDUCE_GRAD per stage");
            assert_eq!(resharded, held, "{name}: rank {r}: one RESHARD per stage");
        }
    }

    /// `schedc convert --to torch-csv --torch-format compute-comms` (check, lower,
    /// `for_runtime`, `write_csv`) imports back to a program that `schedc check` accepts with
    /// the same warmup and peak activations on every rank, the same sends and receives in the
    /// same order on every rank, and everything torch's runtime needs; likewise compute-only.
    #[test]
    fn runtime_export_round_trips_through_check() {
        for &(spec, pp, vpp, mb) in RUNTIME_INSTANCES {
            let name = format!("{spec} P={pp} V={vpp} M={mb}");
            let loaded = load_instance(spec, pp, vpp, mb);
            let out =
                crate::check::check(&loaded.program, loaded.spans.as_ref(), &Default::default());
            assert_eq!(
                out.report.verdict,
                crate::check::Verdict::Accepted,
                "{name}"
            );
            let want = figures(&out.report);
            let lowered = out.checked.unwrap();

            let prog = for_runtime(&lowered, TorchFormat::ComputeComms).unwrap();
            let csv = write_csv(&prog, TorchFormat::ComputeComms).unwrap();
            assert!(
                csv.lines().all(|l| l.split(',').all(|c| !c.is_empty())),
                "{name}: an empty cell"
            );
            for needed in ["REDUCE_GRAD", "WAIT_REDUCE_GRAD", "UNSHARD", "RESHARD"] {
                assert!(csv.contains(needed), "{name}: no {needed}");
            }
            let back = parse(&csv).unwrap();
            assert_eq!(back.format, TorchFormat::ComputeComms, "{name}");
            assert_eq!(back.program.pipeline, lowered.pipeline, "{name}");
            let again = crate::check::check(&back.program, Some(&back.spans), &Default::default());
            assert_eq!(
                again.report.verdict,
                crate::check::Verdict::Accepted,
                "{name}"
            );
            assert_eq!(figures(&again.report), want, "{name}");
            for r in 0..pp as usize {
                let comms = |p: &Program| -> Vec<Comm> {
                    p.ranks[r].iter().flat_map(|i| i.comms().to_vec()).collect()
                };
                assert_eq!(comms(&back.program), comms(&lowered), "{name}: rank {r}");
                let computes = |p: &Program| -> Vec<Compute> {
                    let mut v = Vec::new();
                    p.ranks[r]
                        .iter()
                        .for_each(|i| i.for_each_compute(|c| v.push(*c)));
                    v
                };
                assert_eq!(
                    computes(&back.program),
                    computes(&lowered),
                    "{name}: rank {r}"
                );
            }
            assert_runnable_by_torch(&back.program, &name);
            // Completing twice adds nothing.
            assert_eq!(
                for_runtime(&back.program, TorchFormat::ComputeComms)
                    .unwrap()
                    .ranks,
                back.program.ranks,
                "{name}"
            );

            let co = write_csv(
                &for_runtime(&loaded.program, TorchFormat::ComputeOnly).unwrap(),
                TorchFormat::ComputeOnly,
            )
            .unwrap();
            let back = parse(&co).unwrap();
            assert_eq!(back.format, TorchFormat::ComputeOnly, "{name}");
            let again = crate::check::check(&back.program, Some(&back.spans), &Default::default());
            assert_eq!(
                again.report.verdict,
                crate::check::Verdict::Accepted,
                "{name}"
            );
            assert_eq!(figures(&again.report), want, "{name}");
        }
    }

    /// 1F1B with P = 2, M = 2, exactly: torch's own lowering places the same actions (its
    /// `_add_wait_send` puts an activation send's wait right after the backward instead of
    /// after the backward's own sends; here there are none in between).
    #[test]
    fn runtime_export_golden_1f1b() {
        let loaded = load_instance("specs/1f1b.sched", 2, 1, 2);
        let out = crate::check::check(&loaded.program, None, &Default::default());
        let prog = for_runtime(&out.checked.unwrap(), TorchFormat::ComputeComms).unwrap();
        assert_eq!(
            write_csv(&prog, TorchFormat::ComputeComms).unwrap(),
            "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0WAIT_SEND_F0,0RECV_B1,0B1,\
             0WAIT_SEND_F1,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0RESHARD\n\
             1UNSHARD,1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1REDUCE_GRAD,\
             1WAIT_REDUCE_GRAD,1RESHARD,1WAIT_SEND_B0,1WAIT_SEND_B1\n"
        );
    }

    /// Torch's own lowered programs (the reference `*.comms.csv`), stripped of the actions
    /// `for_runtime` adds, get them all back: the same number of each on every rank, and a
    /// program torch's runtime can run.
    #[test]
    fn runtime_completion_restores_torch_bookkeeping() {
        let mut n = 0;
        for f in files(".comms.csv") {
            let src = std::fs::read_to_string(&f).unwrap();
            let full = parse(&src).unwrap().program;
            let added = |i: &Instr| {
                matches!(
                    i,
                    Instr::ReduceGrad(_)
                        | Instr::WaitReduceGrad(_)
                        | Instr::Unshard(_)
                        | Instr::Reshard(_)
                        | Instr::WaitSend(_)
                )
            };
            let mut bare = full.clone();
            for r in &mut bare.ranks {
                r.retain(|i| !added(i));
            }
            let done = for_runtime(&bare, TorchFormat::ComputeComms).unwrap();
            let name = f.display().to_string();
            for (a, b) in full.ranks.iter().zip(&done.ranks) {
                let mut want: Vec<&Instr> = a.iter().filter(|i| added(i)).collect();
                let mut got: Vec<&Instr> = b.iter().filter(|i| added(i)).collect();
                want.sort_by_key(|i| instr_to_string(i));
                got.sort_by_key(|i| instr_to_string(i));
                assert_eq!(got, want, "{name}");
            }
            assert_runnable_by_torch(&done, &name);
            // Torch's own lowering is runnable by the same standard.
            assert_runnable_by_torch(&full, &name);
            n += 1;
        }
        assert!(n == 0 || n > 50, "{n}");
    }

    #[test]
    fn runtime_compute_only_drops_bookkeeping() {
        let p = parse("0F0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0UNSHARD,0RESHARD\n")
            .unwrap()
            .program;
        let q = for_runtime(&p, TorchFormat::ComputeOnly).unwrap();
        assert_eq!(
            write_csv(&q, TorchFormat::ComputeOnly).unwrap(),
            "0F0,0B0\n"
        );
        // An existing REDUCE_GRAD without its wait gets one right after it.
        let p = parse("0F0,0B0,0REDUCE_GRAD,0F1,0B1\n").unwrap().program;
        let q = for_runtime(&p, TorchFormat::ComputeComms).unwrap();
        assert_eq!(
            write_csv(&q, TorchFormat::ComputeComms).unwrap(),
            "0UNSHARD,0F0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0F1,0B1,0RESHARD\n"
        );
    }

    #[test]
    fn channels_are_refused() {
        let mut p = parse("0F0,0SEND_F0\n1RECV_F0,1F0\n").unwrap().program;
        if let Instr::Comm(Comm::Send { channel, .. }) = &mut p.ranks[0][1] {
            *channel = 1;
        }
        let e = write_csv(&p, TorchFormat::ComputeComms).unwrap_err();
        assert!(e.contains("channel 1"), "{e}");
        assert!(e.starts_with("rank 0, instruction 1"), "{e}");
    }
}
