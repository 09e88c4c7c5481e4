//! Diagnostics: every pass reports its typed errors as [`Diagnostic`]s, collected (never
//! stopping at the first) and rendered rustc-style with miette or as JSON.

use schedc_ir::text::Span;
use serde::Serialize;

/// How bad a diagnostic is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The schedule is rejected.
    Error,
    /// Worth a look; the schedule is still accepted.
    Warning,
}

/// The kind of a diagnostic. The JSON spelling (kebab-case) is the code used in `.case` files'
/// `expect reject <code>` lines (see `shared/cases/README.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Code {
    /// A wait-for cycle: no rank can make progress.
    Deadlock,
    /// A rank waits forever on something that will never come (e.g. an unmatched receive),
    /// without a cycle.
    Stall,
    /// A FIFO-matched send/receive pair whose payload labels differ.
    LabelMismatch,
    /// A send or receive with no partner, or a cross-rank dependency with no message.
    Unmatched,
    /// An F, B/W or BW (or an MoE part) missing.
    MissingOp,
    /// An op given twice.
    DuplicateOp,
    /// An op before one it depends on, on the same rank.
    Order,
    /// An op on a rank that does not hold its stage, or a message to the wrong rank.
    Placement,
    /// A stage, micro-batch or rank out of range.
    Range,
    /// Over the activation budget.
    Memory,
    /// Members of a communicator issue collectives in different orders.
    CollectiveOrder,
    /// An `expect` line of a spec or case that does not hold.
    Expectation,
    /// Input that does not parse, or a spec malformed whatever the instance (a `def` misused,
    /// a name both `fn` and `def`: `ElabError::malformed`); exit status 2, not a verdict.
    Syntax,
    /// A spec's `require` refuses the instance (exit status 1).
    Refused,
    /// A spec that cannot be elaborated (unknown name, division by zero, a chunk with no
    /// micro-batch left, ...; exit status 1: the spec was read, the instance is rejected).
    Elaboration,
    /// A spec's instance asked for with a `--param` the spec does not declare, or without
    /// one it requires (bad usage: exit status 2).
    Usage,
}

impl Code {
    /// The kebab-case spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Deadlock => "deadlock",
            Code::Stall => "stall",
            Code::LabelMismatch => "label-mismatch",
            Code::Unmatched => "unmatched",
            Code::MissingOp => "missing-op",
            Code::DuplicateOp => "duplicate-op",
            Code::Order => "order",
            Code::Placement => "placement",
            Code::Range => "range",
            Code::Memory => "memory",
            Code::CollectiveOrder => "collective-order",
            Code::Expectation => "expectation",
            Code::Syntax => "syntax",
            Code::Refused => "refused",
            Code::Elaboration => "elaboration",
            Code::Usage => "usage",
        }
    }

    /// Every code, for listings.
    pub const ALL: [Code; 16] = [
        Code::Deadlock,
        Code::Stall,
        Code::LabelMismatch,
        Code::Unmatched,
        Code::MissingOp,
        Code::DuplicateOp,
        Code::Order,
        Code::Placement,
        Code::Range,
        Code::Memory,
        Code::CollectiveOrder,
        Code::Expectation,
        Code::Syntax,
        Code::Refused,
        Code::Elaboration,
        Code::Usage,
    ];
}

fn ser_related<S: serde::Serializer>(v: &[(Loc, String)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(Some(v.len()))?;
    for (loc, label) in v {
        seq.serialize_element(&serde_json::json!({
            "rank": loc.rank,
            "position": loc.position,
            "op": loc.op,
            "label": label,
            "location": loc.location,
        }))?;
    }
    seq.end()
}

/// A location in a schedule: rank and position in that rank's instruction list (0-based), the
/// op's text, and its span in the source file when there is one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Loc {
    /// The rank.
    pub rank: u32,
    /// Index into the rank's instruction list.
    pub position: usize,
    /// The instruction's text (IR text syntax).
    pub op: String,
    /// Byte span in the input file, if the input was a file with known spans.
    #[serde(skip)]
    pub span: Option<Span>,
    /// `file:line:col` of the span, filled in by [`Diagnostic::locate`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// For an op a spec emitted inside a `def`: the uses it was expanded from (span, label),
    /// which [`Diagnostic::at`] adds as related locations.
    #[serde(skip)]
    pub via: Vec<(Span, String)>,
}

/// One finding of a pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// The kind.
    pub code: Code,
    /// One sentence, no trailing period.
    pub message: String,
    /// Primary location's rank, if any.
    pub rank: Option<u32>,
    /// Primary location's position, if any.
    pub position: Option<usize>,
    /// Primary location's op text, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// Primary span in the source file.
    #[serde(skip)]
    pub span: Option<Span>,
    /// `file:line:col` of the primary span, filled in by [`Diagnostic::locate`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// Secondary locations (the other end of a message, the first of a duplicate, each step
    /// of a wait-for cycle), each with a label. JSON: objects with `rank`, `position`, `op`,
    /// `label` and, for a file, `location`.
    #[serde(skip_serializing_if = "Vec::is_empty", serialize_with = "ser_related")]
    pub related: Vec<(Loc, String)>,
    /// Further lines of explanation.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// A suggestion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub help: Option<String>,
}

impl Diagnostic {
    /// An error with no location yet.
    pub fn error(code: Code, message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Error,
            code,
            message: message.into(),
            rank: None,
            position: None,
            op: None,
            span: None,
            location: None,
            related: Vec::new(),
            notes: Vec::new(),
            help: None,
        }
    }
    /// Sets the primary location.
    pub fn at(mut self, loc: Loc) -> Self {
        self.rank = Some(loc.rank);
        self.position = Some(loc.position);
        self.op = Some(loc.op);
        self.span = loc.span;
        for (sp, label) in loc.via {
            self.related.push((
                Loc {
                    rank: loc.rank,
                    position: 0,
                    op: String::new(),
                    span: Some(sp),
                    location: None,
                    via: Vec::new(),
                },
                label,
            ));
        }
        self
    }
    /// Sets only the rank.
    pub fn on_rank(mut self, rank: u32) -> Self {
        self.rank = Some(rank);
        self
    }
    /// Adds a related location.
    pub fn with_related(mut self, loc: Loc, label: impl Into<String>) -> Self {
        self.related.push((loc, label.into()));
        self
    }
    /// Adds a note.
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }
    /// Sets the help line.
    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
    /// Fills [`Diagnostic::location`] (`file:line:col`) from the span, given the source.
    pub fn locate(&mut self, file: &str, src: &str) {
        let at = |sp: Span| {
            let (l, c) = schedc_ir::text::line_col(src, sp.start as usize);
            format!("{file}:{l}:{c}")
        };
        self.location = self.span.map(at);
        for (loc, _) in &mut self.related {
            loc.location = loc.span.map(at);
        }
    }
    /// True for errors.
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// Lines longer than this (bytes) are not shown whole: the excerpt is a window around the
/// span instead ([`crop_excerpt`]).
const MAX_EXCERPT_LINE: usize = 200;

/// Bytes of context on each side of the span in a cropped excerpt.
const CROP_CONTEXT: usize = 24;

/// Show and underline at most this many characters of the span itself.
const MAX_UNDERLINE: usize = 32;

/// A window of the line holding `sp` in `text`: its line number, about [`CROP_CONTEXT`]
/// bytes on each side of the span (on character boundaries, `…` where cut), and a caret
/// underline of at most [`MAX_UNDERLINE`] columns:
///
/// ```text
///    3 │ …1F2,1I2,1W2,1F3,1I3,0SEND_F0,1RECV_B1,1W3,…
///      │                      ^^^^^^^^
/// ```
pub fn crop_excerpt(text: &str, sp: Span) -> String {
    let off = (sp.start as usize).min(text.len());
    let b = text.as_bytes();
    let line_start = b[..off]
        .iter()
        .rposition(|&c| c == b'\n')
        .map_or(0, |k| k + 1);
    let line_end = b[off..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(b.len(), |k| off + k);
    let line_no = b[..line_start].iter().filter(|&&c| c == b'\n').count() + 1;
    let floor = |mut i: usize| {
        while i > line_start && !text.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let ceil = |mut i: usize| {
        while i < line_end && !text.is_char_boundary(i) {
            i += 1;
        }
        i
    };
    let off = floor(off);
    let span_stop = ceil((off + sp.len as usize).min(line_end));
    let span_end = text[off..span_stop]
        .char_indices()
        .nth(MAX_UNDERLINE)
        .map_or(span_stop, |(k, _)| off + k);
    let from = floor(off.saturating_sub(CROP_CONTEXT).max(line_start));
    let to = ceil((span_end + CROP_CONTEXT).min(line_end));
    let window = text[from..to].replace('\t', " ");
    let lead = if from > line_start { "…" } else { "" };
    let tail = if to < line_end { "…" } else { "" };
    let pad = lead.chars().count() + text[from..off].chars().count();
    let width = text[off..span_end].chars().count().clamp(1, MAX_UNDERLINE);
    let num = line_no.to_string();
    format!(
        "{num} │ {lead}{window}{tail}\n{} │ {}{}",
        " ".repeat(num.len()),
        " ".repeat(pad),
        "^".repeat(width)
    )
}

/// The length of the line containing byte `off`.
fn line_len_at(text: &str, off: usize) -> usize {
    let off = off.min(text.len());
    let b = text.as_bytes();
    let start = b[..off]
        .iter()
        .rposition(|&c| c == b'\n')
        .map_or(0, |k| k + 1);
    let end = b[off..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(b.len(), |k| off + k);
    end - start
}

/// A miette view of a diagnostic over its source file, for rustc-style rendering.
#[derive(Debug)]
pub struct Rendered<'a> {
    diag: &'a Diagnostic,
    src: Option<miette::NamedSource<String>>,
    code: String,
    /// A cropped excerpt of a long line (see [`crop_excerpt`]).
    crop: Option<String>,
    /// `file:line:col` of the primary span when the excerpt is cropped (a very long line)
    /// and the diagnostic carries no location of its own.
    fallback_location: Option<String>,
}

impl<'a> Rendered<'a> {
    /// Wraps `diag`; `src` is `(file name, file text)` when spans refer to a file.
    pub fn new(diag: &'a Diagnostic, src: Option<(&str, &str)>) -> Self {
        // An excerpt of a very long line (torch's CSV rows run to 150 KB) is unreadable, and
        // the renderer cannot draw columns past 65535: such diagnostics print without one.
        let spans = diag
            .span
            .into_iter()
            .chain(diag.related.iter().filter_map(|(l, _)| l.span));
        let long = src.is_some_and(|(_, text)| {
            spans
                .clone()
                .any(|sp| line_len_at(text, sp.start as usize) > MAX_EXCERPT_LINE)
        });
        // A long line gets a cropped window around the primary span instead.
        let crop = match (long, src, diag.span) {
            (true, Some((_, text)), Some(sp)) if (sp.start as usize) <= text.len() => {
                Some(crop_excerpt(text, sp))
            }
            _ => None,
        };
        let fallback_location = match (long, src, diag.span) {
            (true, Some((name, text)), Some(sp)) if diag.location.is_none() => {
                let (l, c) = schedc_ir::text::line_col(text, sp.start as usize);
                Some(format!("{name}:{l}:{c}"))
            }
            _ => None,
        };
        let src = if long { None } else { src };
        Rendered {
            diag,
            src: src.map(|(n, t)| miette::NamedSource::new(n, t.to_string())),
            code: format!("schedc::{}", diag.code.as_str()),
            crop,
            fallback_location,
        }
    }
}

impl std::fmt::Display for Rendered<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = self.diag;
        write!(f, "{}", d.message)?;
        if d.span.is_none() || self.src.is_none() {
            if let Some(loc) = d.location.as_ref().or(self.fallback_location.as_ref()) {
                write!(f, " at {loc}")?;
            }
            if let (Some(r), Some(p)) = (d.rank, d.position) {
                write!(f, " (rank {r}, position {p}")?;
                if let Some(op) = &d.op {
                    write!(f, ", {op}")?;
                }
                write!(f, ")")?;
            } else if let Some(r) = d.rank {
                // Not again where the message starts with its rank.
                if !d.message.starts_with(&format!("rank {r} ")) {
                    write!(f, " (rank {r})")?;
                }
            }
        }
        if let Some(c) = &self.crop {
            write!(f, "\n{c}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Rendered<'_> {}

impl miette::Diagnostic for Rendered<'_> {
    fn code<'b>(&'b self) -> Option<Box<dyn std::fmt::Display + 'b>> {
        Some(Box::new(&self.code))
    }
    fn severity(&self) -> Option<miette::Severity> {
        Some(match self.diag.severity {
            Severity::Error => miette::Severity::Error,
            Severity::Warning => miette::Severity::Warning,
        })
    }
    fn help<'b>(&'b self) -> Option<Box<dyn std::fmt::Display + 'b>> {
        let mut lines: Vec<String> = Vec::new();
        for (loc, label) in &self.diag.related {
            if loc.span.is_none() || self.src.is_none() {
                lines.push(format!(
                    "{label}: rank {} position {} `{}`",
                    loc.rank, loc.position, loc.op
                ));
            }
        }
        lines.extend(self.diag.notes.iter().map(|n| format!("• {n}")));
        if let Some(h) = &self.diag.help {
            lines.push(h.clone());
        }
        if lines.is_empty() {
            None
        } else {
            Some(Box::new(lines.join("\n")))
        }
    }
    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        self.src.as_ref().map(|s| s as &dyn miette::SourceCode)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = miette::LabeledSpan> + '_>> {
        self.src.as_ref()?;
        let mut v = Vec::new();
        if let Some(sp) = self.diag.span {
            let label = match (self.diag.rank, self.diag.position) {
                (Some(r), Some(p)) => format!("rank {r}, position {p}"),
                _ => "here".to_string(),
            };
            v.push(miette::LabeledSpan::new_primary_with_span(
                Some(label),
                (sp.start as usize, sp.len as usize),
            ));
        }
        for (loc, label) in &self.diag.related {
            if let Some(sp) = loc.span {
                // A location in a spec that is no instruction (an empty `op`: the use of a
                // `def`, a definition) has no position to show.
                let text = if loc.op.is_empty() {
                    label.clone()
                } else {
                    format!("{label} (rank {}, position {})", loc.rank, loc.position)
                };
                v.push(miette::LabeledSpan::new_with_span(
                    Some(text),
                    (sp.start as usize, sp.len as usize),
                ));
            }
        }
        if v.is_empty() {
            None
        } else {
            Some(Box::new(v.into_iter()))
        }
    }
}

/// Renders a diagnostic as plain text (no colour), rustc-style, with source excerpts when
/// `src` is given. Deterministic: used for snapshots.
pub fn render(diag: &Diagnostic, src: Option<(&str, &str)>, width: usize) -> String {
    let r = Rendered::new(diag, src);
    let handler =
        miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
            .with_width(width)
            .with_links(false);
    let mut out = String::new();
    let _ = handler.render_report(&mut out, &r);
    out
}

/// Renders with colours if `color` (for terminals).
pub fn render_color(diag: &Diagnostic, src: Option<(&str, &str)>, color: bool) -> String {
    if !color {
        return render(diag, src, 100);
    }
    let r = Rendered::new(diag, src);
    let handler = miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode())
        .with_width(100)
        .with_links(false);
    let mut out = String::new();
    let _ = handler.render_report(&mut out, &r);
    out
}

/// A diagnostic for a syntax error of an importer, spanning the offending text.
pub fn syntax(e: &schedc_ir::text::ParseError) -> Diagnostic {
    let mut d = Diagnostic::error(Code::Syntax, e.message.clone());
    d.span = Some(Span {
        start: e.offset as u32,
        len: e.len as u32,
    });
    if let Some(h) = &e.help {
        d = d.with_help(h.clone());
    }
    d
}

#[cfg(test)]
mod crop_tests {
    use super::*;

    #[test]
    fn a_long_line_is_cropped_around_the_span() {
        // A 3000-byte row with multi-byte characters, the span in the middle.
        let row: String = (0..300).map(|i| format!("é{i:04}abc,")).collect();
        let text = format!("head\n{row}\ntail\n");
        let at = text.find("é0150").unwrap();
        let out = crop_excerpt(
            &text,
            Span {
                start: at as u32,
                len: 6,
            },
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert!(
            lines[0].starts_with("2 │ …") && lines[0].ends_with('…'),
            "{out}"
        );
        assert!(lines.iter().all(|l| l.chars().count() < 100), "{out}");
        // The carets sit under the span.
        let col = lines[1].find('^').unwrap();
        let under: String = lines[0][..]
            .chars()
            .skip(lines[1][..col].chars().count())
            .take(5)
            .collect();
        assert_eq!(under, "é0150", "{out}");
        assert_eq!(lines[1].matches('^').count(), 5);
        // A long span is underlined up to the cap.
        let out = crop_excerpt(
            &text,
            Span {
                start: 5,
                len: 2000,
            },
        );
        assert_eq!(
            out.lines().nth(1).unwrap().matches('^').count(),
            MAX_UNDERLINE
        );
    }

    #[test]
    fn diagnostics_on_long_lines_show_the_window_and_the_location() {
        let row = "x,".repeat(1000);
        let text = format!("{row}BAD,{row}\n");
        let mut d = Diagnostic::error(Code::Syntax, "unknown cell");
        d.span = Some(Span {
            start: 2000,
            len: 3,
        });
        d.locate("f.csv", &text);
        let out = render(&d, Some(("f.csv", &text)), 100);
        assert!(out.contains("f.csv:1:2001"), "{out}");
        assert!(
            out.contains("1 │ …x,x,") && out.contains("x,x,BAD,x,x"),
            "{out}"
        );
        assert!(out.lines().all(|l| l.chars().count() <= 100), "{out}");
    }
}
