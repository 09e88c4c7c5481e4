//! The IR text format (`ir-text`): a header, then one line per rank.
//!
//! ```text
//! # comment
//! pp 2
//! stages 2
//! microbatches 2
//! placement loop                 # or: v | bidir | <rank of stage 0> <rank of stage 1> ...
//! group ep 0 1                   # optional communicators for collectives (or `communicator`)
//! moe 0 1                        # optional: the MoE stages (the others are dense)
//! rank 0: F(0,0) SA(0,0->1) F(0,1) {SA(0,1->1) RG(1,0<-1)} BW(0,0) RG(1,1<-1) BW(0,1)
//! rank 1: RA(0,0<-0) F(1,0) BW(1,0) {SG(1,0->0) RA(0,1<-0)} F(1,1) BW(1,1) SG(1,1->0)
//! ```
//!
//! A line that starts with white space continues the previous rank's list. The printer writes
//! exactly this form, one line per rank, so `print(parse(s))` reproduces a file written by the
//! printer byte for byte and `parse(print(p)) == p` for every program.
//!
//! Ops: `F(s,m)`, `B(s,m)`, `W(s,m)`, `BW(s,m)`, optionally with an MoE part suffix
//! (`F(s,m).attn`, `.dispatch`, `.mlp`, `.combine`); an overlapped pair `F(s,m)&BW(t,k)`;
//! `SA(s,m->r)`, `RA(s,m<-r)`, `SG(s,m->r)`, `RG(s,m<-r)`; a group `{op op ...}`;
//! `A2A(comm,label)`; `REDUCE_GRAD(s)`, `WAIT_REDUCE_GRAD(s)`, `UNSHARD(s)`, `RESHARD(s)`;
//! `WAIT_SA(s,m)`, `WAIT_SG(s,m)` (wait for an earlier send), `WAIT_RA(s,m)`, `WAIT_RG(s,m)`
//! (the compute stream waits for an earlier receive); `OFFLOAD(s,m)`, `RELOAD(s,m)`,
//! `RECOMPUTE(s,m)` (memory ops on forward `F(s,m)`'s saved activations, see
//! [`MemKind`](crate::MemKind)); `LEND(s,m->r)` / `LEND(s,m<-o)` (the owner of stage `s`
//! lends the stash of `F(s,m)` to rank `r`, which receives it from owner `o`) and
//! `RETURN(s,m->o)` / `RETURN(s,m<-h)` (the holder sends it back, the owner receives it from
//! holder `h`), see [`PayloadKind::Lend`](crate::PayloadKind::Lend); `WAIT_SL`, `WAIT_RL`,
//! `WAIT_ST`, `WAIT_RT` wait for them like `WAIT_SA`; `_` an idle slot.
//!
//! The same parser reads the `.case` test format of `shared/cases`, whose extra header lines
//! (`expect ...`, `budget activations N`) are returned in [`Parsed`].

use crate::*;
use std::fmt::Write as _;

/// A byte range in the source text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Byte offset of the first byte.
    pub start: u32,
    /// Length in bytes.
    pub len: u32,
}

/// Spans of every instruction: `ranks[r][i]` is the text of rank r's i-th instruction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceMap {
    /// One span per instruction, per rank.
    pub ranks: Vec<Vec<Span>>,
    /// For the compute ops a spec emitted inside a `def`'s statements, keyed by (rank, kind,
    /// stage, micro-batch): the uses it was expanded from, innermost first (span, label).
    /// Keyed by the op, not its position, so that it survives `--moe` splits and lowering.
    pub expanded: std::collections::HashMap<OpKey, Vec<(Span, String)>>,
}

/// An op of a rank by identity: (rank, kind, stage, micro-batch).
pub type OpKey = (u32, Kind, u32, u32);

impl SourceMap {
    /// The span of rank `r`'s instruction at `pos`, if known.
    pub fn get(&self, r: usize, pos: usize) -> Option<Span> {
        self.ranks.get(r).and_then(|v| v.get(pos)).copied()
    }
}

/// An `expect` line of a `.case` file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// `expect accept`.
    Accept,
    /// `expect reject <code>`.
    Reject(String),
    /// `expect peak_activations n0 n1 ...` (per rank).
    PeakActivations(Vec<u64>),
    /// `expect warmup n0 n1 ...` (per rank).
    Warmup(Vec<u64>),
    /// `expect idle n0 n1 ...` (per rank, unit time).
    Idle(Vec<u64>),
}

/// The result of parsing: the program, spans, and `.case` extras.
#[derive(Clone, Debug)]
pub struct Parsed {
    /// The program.
    pub program: Program,
    /// Span of every instruction.
    pub spans: SourceMap,
    /// `expect` lines with their spans, in file order.
    pub expects: Vec<(Expect, Span)>,
    /// `budget activations N`, if given.
    pub budget_activations: Option<u64>,
    /// Whether the `stages` header was given (else inferred from the ops).
    pub stages_given: bool,
    /// Whether the `microbatches` header was given (else inferred from the ops).
    pub microbatches_given: bool,
}

/// A syntax error with its location.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{line}:{col}: {message}")]
pub struct ParseError {
    /// Byte offset.
    pub offset: usize,
    /// Length of the offending text (at least 1 unless at end of input).
    pub len: usize,
    /// 1-based line.
    pub line: usize,
    /// 1-based column (in characters).
    pub col: usize,
    /// What was expected and what was found.
    pub message: String,
    /// A hint, if any.
    pub help: Option<String>,
}

/// 1-based (line, column) of a byte offset.
pub fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(src.len());
    let before = &src.as_bytes()[..offset];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |p| p + 1);
    let col = src[line_start..offset].chars().count() + 1;
    (line, col)
}

/// The largest number of ranks (`pp`) or stages the parser accepts. The program holds a list
/// per rank and the pipeline an entry per stage, so without a bound a few bytes of input
/// (`pp 4000000000`) would allocate gigabytes.
pub const MAX_RANKS_OR_STAGES: u32 = 1 << 20;

struct Cur<'a> {
    src: &'a str,
    b: &'a [u8],
    pos: usize,
}

type PResult<T> = Result<T, ParseError>;

impl<'a> Cur<'a> {
    fn err(&self, at: usize, len: usize, message: impl Into<String>) -> ParseError {
        let (line, col) = line_col(self.src, at);
        ParseError {
            offset: at,
            len,
            line,
            col,
            message: message.into(),
            help: None,
        }
    }
    fn err_here(&self, expected: &str) -> ParseError {
        let found = self.found();
        let len = self
            .token_len()
            .max(1)
            .min(self.b.len().saturating_sub(self.pos));
        self.err(self.pos, len, format!("expected {expected}, found {found}"))
    }
    fn token_len(&self) -> usize {
        let mut e = self.pos;
        while e < self.b.len() && !self.b[e].is_ascii_whitespace() {
            e += 1;
        }
        (e - self.pos).max(1)
    }
    fn found(&self) -> String {
        if self.pos >= self.b.len() {
            return "end of input".into();
        }
        match self.b[self.pos] {
            b'\n' => "end of line".into(),
            _ => {
                let e = self.pos + self.token_len();
                let t: String = self.src[self.pos..e.min(self.b.len())]
                    .chars()
                    .take(24)
                    .collect();
                format!("`{t}`")
            }
        }
    }
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.pos).copied()
    }
    #[inline]
    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expect_byte(&mut self, c: u8, what: &str) -> PResult<()> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.err_here(what))
        }
    }
    fn skip_inline_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r')) {
            self.pos += 1;
        }
    }
    fn uint(&mut self, what: &str) -> PResult<u32> {
        let start = self.pos;
        let mut v: u64 = 0;
        while let Some(c @ b'0'..=b'9') = self.peek() {
            v = v * 10 + (c - b'0') as u64;
            if v > u32::MAX as u64 {
                return Err(self.err(start, self.pos - start + 1, format!("{what} is too large")));
            }
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.err_here(what));
        }
        Ok(v as u32)
    }
    fn ident(&mut self) -> &'a str {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_ascii_alphanumeric() || c == b'_' {
                self.pos += 1;
            } else {
                break;
            }
        }
        &self.src[start..self.pos]
    }
    /// A free-form word: anything up to `,`, `)`, `}` or white space.
    fn word(&mut self, what: &str) -> PResult<&'a str> {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c == b',' || c == b')' || c == b'}' || c == b'(' || c.is_ascii_whitespace() {
                break;
            }
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.err_here(what));
        }
        Ok(&self.src[start..self.pos])
    }
    fn at_line_end(&self) -> bool {
        matches!(self.peek(), None | Some(b'\n') | Some(b'#'))
    }
    fn skip_to_line_end(&mut self) {
        while let Some(c) = self.peek() {
            if c == b'\n' {
                break;
            }
            self.pos += 1;
        }
    }
    fn end_header_line(&mut self) -> PResult<()> {
        self.skip_inline_ws();
        if self.peek() == Some(b'#') {
            self.skip_to_line_end();
        }
        if self.at_line_end() {
            Ok(())
        } else {
            Err(self.err_here("end of line"))
        }
    }
    /// Numbers separated by white space or commas (`0 1 1 0`, `0,1,1,0`).
    fn uint_list(&mut self, what: &str) -> PResult<Vec<u32>> {
        let mut v = Vec::new();
        loop {
            self.skip_inline_ws();
            if !v.is_empty() && self.eat(b',') {
                self.skip_inline_ws();
            }
            if self.at_line_end() {
                break;
            }
            v.push(self.uint(what)?);
        }
        Ok(v)
    }
}

fn part_from(s: &str) -> Option<Part> {
    Some(match s {
        "attn" => Part::Attn,
        "dispatch" => Part::Dispatch,
        "mlp" => Part::Mlp,
        "combine" => Part::Combine,
        _ => return None,
    })
}

const OP_NAMES: &str = "F, B, W, BW, SA, RA, SG, RG, A2A, REDUCE_GRAD, WAIT_REDUCE_GRAD, UNSHARD, RESHARD, WAIT_SA, WAIT_SG, WAIT_RA, WAIT_RG, OFFLOAD, RELOAD, RECOMPUTE, LEND, RETURN, `{`, or `_`";

enum Item {
    Compute(Compute),
    Comm(Comm),
    Other(Instr),
}

fn parse_one(c: &mut Cur<'_>) -> PResult<Item> {
    let start = c.pos;
    let name = c.ident();
    if name.is_empty() {
        return Err(c.err_here(&format!("an op ({OP_NAMES})")));
    }
    let name_end = c.pos;
    let bad_name = |c: &Cur<'_>| {
        let mut e = c.err(
            start,
            name_end - start,
            format!("unknown op `{name}`; expected one of {OP_NAMES}"),
        );
        if name == "I" {
            e.help = Some("torch's `I` (input-only backward) is `B` here; torch's `B` (full backward) is `BW`".into());
        }
        e
    };
    let known = matches!(
        name,
        "F" | "B"
            | "W"
            | "BW"
            | "SA"
            | "RA"
            | "SG"
            | "RG"
            | "A2A"
            | "REDUCE_GRAD"
            | "WAIT_REDUCE_GRAD"
            | "UNSHARD"
            | "RESHARD"
            | "WAIT_SA"
            | "WAIT_SG"
            | "WAIT_RA"
            | "WAIT_RG"
            | "OFFLOAD"
            | "RELOAD"
            | "RECOMPUTE"
            | "LEND"
            | "RETURN"
            | "WAIT_SL"
            | "WAIT_RL"
            | "WAIT_ST"
            | "WAIT_RT"
    );
    if !known {
        return Err(bad_name(c));
    }
    c.expect_byte(b'(', "`(`")?;
    c.skip_inline_ws();
    let item = match name {
        "F" | "B" | "W" | "BW" => {
            let kind = match name {
                "F" => Kind::F,
                "B" => Kind::B,
                "W" => Kind::W,
                _ => Kind::BW,
            };
            let stage = c.uint("a stage number")?;
            c.skip_inline_ws();
            c.expect_byte(b',', "`,`")?;
            c.skip_inline_ws();
            let mb = c.uint("a micro-batch number")?;
            c.skip_inline_ws();
            c.expect_byte(b')', "`)`")?;
            let mut part = Part::Whole;
            if c.peek() == Some(b'.') {
                c.pos += 1;
                let ps = c.pos;
                let p = c.ident();
                part = part_from(p).ok_or_else(|| {
                    c.err(
                        ps,
                        p.len().max(1),
                        format!("unknown MoE part `{p}`; expected attn, dispatch, mlp or combine"),
                    )
                })?;
            }
            let mut checkpoint = false;
            if c.peek() == Some(b'!') {
                if kind != Kind::F || part != Part::Whole {
                    return Err(c.err(
                        c.pos,
                        1,
                        "only a whole forward can be checkpointed (`F(s,m)!`)".to_string(),
                    ));
                }
                c.pos += 1;
                checkpoint = true;
            }
            Item::Compute(Compute {
                kind,
                stage,
                mb,
                part,
                checkpoint,
            })
        }
        "SA" | "SG" | "RA" | "RG" | "LEND" | "RETURN" => {
            let stash = name.len() > 2;
            let kind = match name {
                "LEND" => PayloadKind::Lend,
                "RETURN" => PayloadKind::Return,
                _ if name.ends_with('A') => PayloadKind::Act,
                _ => PayloadKind::Grad,
            };
            let stage = c.uint("a stage number")?;
            c.skip_inline_ws();
            c.expect_byte(b',', "`,`")?;
            c.skip_inline_ws();
            let mb = c.uint("a micro-batch number")?;
            c.skip_inline_ws();
            // SA/SG send, RA/RG receive; LEND and RETURN send with `->` and receive with `<-`.
            let send = if stash {
                if c.src[c.pos..].starts_with("->") {
                    true
                } else if c.src[c.pos..].starts_with("<-") {
                    false
                } else {
                    return Err(c.err_here(&format!(
                        "`->` and the rank the stash goes to (`{name}(s,m->r)` sends it) or `<-` and the rank it comes from (`{name}(s,m<-r)` receives it)"
                    )));
                }
            } else {
                name.starts_with('S')
            };
            let arrow = if send { "->" } else { "<-" };
            if c.src[c.pos..].starts_with(arrow) {
                c.pos += 2;
            } else {
                return Err(c.err_here(&format!("`{arrow}` and the peer rank")));
            }
            c.skip_inline_ws();
            let peer = c.uint("a peer rank")?;
            c.skip_inline_ws();
            let mut channel = 0;
            if c.eat(b'@') {
                channel = c.uint("a channel number after `@`")?;
                c.skip_inline_ws();
            }
            c.expect_byte(b')', "`)` (or `@channel`)")?;
            let payload = Payload { kind, stage, mb };
            Item::Comm(if send {
                Comm::Send {
                    payload,
                    peer,
                    channel,
                }
            } else {
                Comm::Recv {
                    payload,
                    peer,
                    channel,
                }
            })
        }
        "A2A" => {
            let comm = c.word("a communicator name")?.to_string();
            c.skip_inline_ws();
            c.expect_byte(b',', "`,`")?;
            c.skip_inline_ws();
            let label = c.word("a collective label")?.to_string();
            c.skip_inline_ws();
            c.expect_byte(b')', "`)`")?;
            Item::Comm(Comm::Collective(Box::new(Collective { comm, label })))
        }
        "OFFLOAD" | "RELOAD" | "RECOMPUTE" => {
            let kind = match name {
                "OFFLOAD" => MemKind::Offload,
                "RELOAD" => MemKind::Reload,
                _ => MemKind::Recompute,
            };
            let stage = c.uint("a stage number")?;
            c.skip_inline_ws();
            c.expect_byte(b',', "`,`")?;
            c.skip_inline_ws();
            let mb = c.uint("a micro-batch number")?;
            c.skip_inline_ws();
            c.expect_byte(b')', "`)`")?;
            Item::Other(Instr::Mem(MemOp { kind, stage, mb }))
        }
        "WAIT_SA" | "WAIT_SG" | "WAIT_RA" | "WAIT_RG" | "WAIT_SL" | "WAIT_RL" | "WAIT_ST"
        | "WAIT_RT" => {
            let kind = match name.as_bytes()[6] {
                b'A' => PayloadKind::Act,
                b'G' => PayloadKind::Grad,
                b'L' => PayloadKind::Lend,
                _ => PayloadKind::Return,
            };
            let stage = c.uint("a stage number")?;
            c.skip_inline_ws();
            c.expect_byte(b',', "`,`")?;
            c.skip_inline_ws();
            let mb = c.uint("a micro-batch number")?;
            c.skip_inline_ws();
            c.expect_byte(b')', "`)`")?;
            let payload = Payload { kind, stage, mb };
            Item::Other(if name.starts_with("WAIT_S") {
                Instr::WaitSend(payload)
            } else {
                Instr::WaitRecv(payload)
            })
        }
        _ => {
            let s = c.uint("a stage number")?;
            c.skip_inline_ws();
            c.expect_byte(b')', "`)`")?;
            Item::Other(match name {
                "REDUCE_GRAD" => Instr::ReduceGrad(s),
                "WAIT_REDUCE_GRAD" => Instr::WaitReduceGrad(s),
                "UNSHARD" => Instr::Unshard(s),
                _ => Instr::Reshard(s),
            })
        }
    };
    Ok(item)
}

fn parse_instr(c: &mut Cur<'_>) -> PResult<Instr> {
    if c.eat(b'_') {
        return Ok(Instr::Idle);
    }
    if c.peek() == Some(b'{') {
        let open = c.pos;
        c.pos += 1;
        let mut v = Vec::new();
        loop {
            while matches!(c.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
                c.pos += 1;
            }
            match c.peek() {
                Some(b'}') => {
                    c.pos += 1;
                    break;
                }
                None => {
                    return Err(c.err(open, 1, "unclosed group: expected `}`".to_string()));
                }
                _ => {}
            }
            let s = c.pos;
            match parse_one(c)? {
                Item::Comm(m) => v.push(m),
                _ => {
                    return Err(c.err(
                        s,
                        c.pos - s,
                        "only sends, receives and collectives may appear in a group `{...}`",
                    ))
                }
            }
        }
        if v.is_empty() {
            return Err(c.err(open, c.pos - open, "empty group `{}`"));
        }
        return Ok(Instr::Group(v));
    }
    let s = c.pos;
    match parse_one(c)? {
        Item::Compute(a) => {
            if c.peek() == Some(b'&') {
                c.pos += 1;
                let s2 = c.pos;
                let b = match parse_one(c)? {
                    Item::Compute(b) => b,
                    _ => {
                        return Err(c.err(
                            s2,
                            c.pos - s2,
                            "an overlapped pair `X&Y` joins two compute ops",
                        ))
                    }
                };
                let (fwd, bwd) = match (a.kind, b.kind) {
                    (Kind::F, Kind::B | Kind::BW) => (a, b),
                    (Kind::B | Kind::BW, Kind::F) => (b, a),
                    _ => {
                        return Err(c.err(
                            s,
                            c.pos - s,
                            "an overlapped pair is one forward and one backward (B or BW), e.g. F(0,3)&BW(1,1)",
                        ))
                    }
                };
                if a.kind != Kind::F {
                    return Err(c.err(
                        s,
                        c.pos - s,
                        "write the forward first in an overlapped pair, e.g. F(0,3)&BW(1,1)",
                    ));
                }
                return Ok(Instr::Overlap { fwd, bwd });
            }
            Ok(Instr::Compute(a))
        }
        Item::Comm(m) => Ok(Instr::Comm(m)),
        Item::Other(i) => Ok(i),
    }
}

/// Parses the IR text format (or a `.case` file).
///
/// Errors: the first syntax error, with its line and column. Semantic problems (ranges,
/// placement, missing ops) are left to the verifier, which reports all of them with spans.
pub fn parse(src: &str) -> Result<Parsed, ParseError> {
    let mut c = Cur {
        src,
        b: src.as_bytes(),
        pos: 0,
    };
    let mut pp: Option<(u32, usize)> = None;
    let mut stages: Option<u32> = None;
    let mut mbs: Option<u32> = None;
    let mut placement: Option<(PlacementKind, Vec<u32>, usize, usize)> = None;
    let mut communicators = Vec::new();
    let mut moe: Option<(Vec<u32>, usize)> = None;
    let mut expects = Vec::new();
    let mut budget = None;
    let mut ranks: Vec<(u32, usize, Vec<Instr>, Vec<Span>)> = Vec::new();
    let mut in_rank = false;

    while c.pos < c.b.len() {
        let line_start = c.pos;
        let indented = matches!(c.peek(), Some(b' ' | b'\t'));
        c.skip_inline_ws();
        if c.at_line_end() {
            c.skip_to_line_end();
            c.eat(b'\n');
            // Comment or blank lines do not end a rank's list.
            continue;
        }
        if indented && in_rank {
            let (_, _, instrs, spans) = ranks.last_mut().expect("in_rank");
            parse_rank_body(&mut c, instrs, spans)?;
            c.eat(b'\n');
            continue;
        }
        let _ = line_start;
        in_rank = false;
        let kw_start = c.pos;
        let kw = c.ident();
        match kw {
            "pp" => {
                c.skip_inline_ws();
                let v = c.uint("the number of pipeline ranks")?;
                if v == 0 {
                    return Err(c.err(kw_start, c.pos - kw_start, "pp must be at least 1"));
                }
                if v > MAX_RANKS_OR_STAGES {
                    return Err(c.err(
                        kw_start,
                        c.pos - kw_start,
                        format!("pp is too large (at most {MAX_RANKS_OR_STAGES})"),
                    ));
                }
                if let Some((_, at)) = pp {
                    let (l, _) = line_col(src, at);
                    return Err(c.err(
                        kw_start,
                        c.pos - kw_start,
                        format!("`pp` is given twice (first on line {l})"),
                    ));
                }
                pp = Some((v, kw_start));
                c.end_header_line()?;
            }
            "stages" => {
                c.skip_inline_ws();
                let v = c.uint("the number of stages")?;
                if v == 0 {
                    return Err(c.err(kw_start, c.pos - kw_start, "stages must be at least 1"));
                }
                if v > MAX_RANKS_OR_STAGES {
                    return Err(c.err(
                        kw_start,
                        c.pos - kw_start,
                        format!("stages is too large (at most {MAX_RANKS_OR_STAGES})"),
                    ));
                }
                stages = Some(v);
                c.end_header_line()?;
            }
            "microbatches" => {
                c.skip_inline_ws();
                let v = c.uint("the number of micro-batches")?;
                if v == 0 {
                    return Err(c.err(
                        kw_start,
                        c.pos - kw_start,
                        "microbatches must be at least 1",
                    ));
                }
                mbs = Some(v);
                c.end_header_line()?;
            }
            "placement" => {
                c.skip_inline_ws();
                let vs = c.pos;
                let kind = match c.peek() {
                    Some(b'0'..=b'9') => {
                        let map = c.uint_list("a rank number")?;
                        placement = Some((PlacementKind::Explicit, map, kw_start, c.pos));
                        c.end_header_line()?;
                        continue;
                    }
                    _ => c.ident(),
                };
                let k = match kind {
                    "loop" => PlacementKind::Loop,
                    "v" | "V" => PlacementKind::V,
                    "bidir" => PlacementKind::Bidir,
                    _ => {
                        let mut e = c.err(
                            vs,
                            kind.len().max(1),
                            format!("unknown placement `{kind}`; expected loop, v, bidir or a list of ranks"),
                        );
                        e.help = Some("an explicit placement lists the rank of stage 0, 1, ...: `placement 0 1 1 0`".into());
                        return Err(e);
                    }
                };
                placement = Some((k, Vec::new(), kw_start, c.pos));
                c.end_header_line()?;
            }
            "group" | "communicator" => {
                c.skip_inline_ws();
                let name = c.word("a communicator name")?.to_string();
                let members = c.uint_list("a rank number")?;
                communicators.push(Communicator {
                    name,
                    ranks: members,
                });
                c.end_header_line()?;
            }
            "moe" => {
                if moe.is_some() {
                    return Err(c.err(kw_start, c.pos - kw_start, "`moe` is given twice"));
                }
                let mut v = c.uint_list("a stage number")?;
                v.sort_unstable();
                v.dedup();
                moe = Some((v, kw_start));
                c.end_header_line()?;
            }
            "budget" => {
                c.skip_inline_ws();
                let what = c.ident();
                if what != "activations" {
                    return Err(c.err(
                        kw_start,
                        c.pos - kw_start,
                        format!("unknown budget `{what}`; expected `budget activations N`"),
                    ));
                }
                c.skip_inline_ws();
                budget = Some(c.uint("an activation budget")? as u64);
                c.end_header_line()?;
            }
            "expect" => {
                c.skip_inline_ws();
                let what = c.ident();
                let e = match what {
                    "accept" => Expect::Accept,
                    "reject" => {
                        c.skip_inline_ws();
                        let code = c.word("an error code")?.to_string();
                        Expect::Reject(code)
                    }
                    "peak_activations" | "warmup" | "idle" => {
                        let v: Vec<u64> = c
                            .uint_list("a number per rank")?
                            .into_iter()
                            .map(u64::from)
                            .collect();
                        match what {
                            "peak_activations" => Expect::PeakActivations(v),
                            "warmup" => Expect::Warmup(v),
                            _ => Expect::Idle(v),
                        }
                    }
                    _ => {
                        return Err(c.err(
                            kw_start,
                            c.pos - kw_start,
                            format!("unknown expectation `{what}`; expected accept, reject <code>, peak_activations, warmup or idle"),
                        ))
                    }
                };
                expects.push((
                    e,
                    Span {
                        start: kw_start as u32,
                        len: (c.pos - kw_start) as u32,
                    },
                ));
                c.end_header_line()?;
            }
            "rank" => {
                c.skip_inline_ws();
                let r = c.uint("a rank number")?;
                c.skip_inline_ws();
                c.expect_byte(b':', "`:` after the rank number")?;
                if let Some((_, at, _, _)) = ranks.iter().find(|x| x.0 == r) {
                    let (l, _) = line_col(src, *at);
                    return Err(c.err(
                        kw_start,
                        c.pos - kw_start,
                        format!("rank {r} is listed twice (first on line {l})"),
                    ));
                }
                ranks.push((r, kw_start, Vec::new(), Vec::new()));
                in_rank = true;
                let (_, _, instrs, spans) = ranks.last_mut().expect("just pushed");
                parse_rank_body(&mut c, instrs, spans)?;
            }
            _ => {
                // Measure the token from its start: the identifier may stop inside it, and
                // `token_len` counts from the cursor (slicing `kw_start..` by a length taken
                // from the cursor could end inside a multi-byte character).
                c.pos = kw_start;
                let mut e = c.err(
                    kw_start,
                    c.token_len(),
                    format!(
                        "expected a header line (pp, stages, microbatches, placement, group, moe, budget, expect) or `rank N:`, found `{}`",
                        &src[kw_start..kw_start + c.token_len().min(src.len() - kw_start)].chars().take(24).collect::<String>()
                    ),
                );
                if indented {
                    e.help = Some(
                        "an indented line continues a rank's list only after a `rank N:` line"
                            .into(),
                    );
                }
                return Err(e);
            }
        }
        c.skip_to_line_end();
        c.eat(b'\n');
    }

    let (pp, _) = pp.ok_or_else(|| {
        let mut e = c.err(0, 0, "missing header line `pp <number of ranks>`");
        e.line = 1;
        e.col = 1;
        e
    })?;
    for (r, at, _, _) in &ranks {
        if *r >= pp {
            let (line, col) = line_col(src, *at);
            return Err(ParseError {
                offset: *at,
                len: 4,
                line,
                col,
                message: format!("rank {r} is out of range: pp is {pp}"),
                help: None,
            });
        }
    }
    // Infer S and M from the ops when not given.
    let (mut max_s, mut max_m) = (0u32, 0u32);
    for (_, _, instrs, _) in &ranks {
        for i in instrs {
            i.for_each_compute(|c| {
                max_s = max_s.max(c.stage.saturating_add(1));
                max_m = max_m.max(c.mb.saturating_add(1));
            });
        }
    }
    let stages_given =
        stages.is_some() || matches!(&placement, Some((PlacementKind::Explicit, ..)));
    let microbatches_given = mbs.is_some();
    let mbs = mbs.unwrap_or(max_m.max(1));
    let (kind, map, p_at, p_end) = placement.unwrap_or((PlacementKind::Loop, Vec::new(), 0, 0));
    let stages = match (stages, kind) {
        (Some(s), _) => s,
        (None, PlacementKind::Explicit) => map.len() as u32,
        (None, PlacementKind::Bidir) => 2 * pp,
        (None, _) => {
            if max_s > MAX_RANKS_OR_STAGES {
                // Point at the first op whose stage id makes S too large.
                let at = ranks
                    .iter()
                    .flat_map(|(_, _, instrs, spans)| instrs.iter().zip(spans))
                    .find(|(i, _)| {
                        let mut big = false;
                        i.for_each_compute(|c| big |= c.stage >= MAX_RANKS_OR_STAGES);
                        big
                    })
                    .map_or(Span::default(), |(_, sp)| *sp);
                let mut e = c.err(
                    at.start as usize,
                    at.len as usize,
                    format!(
                        "stage id too large: the number of stages would be {max_s} (at most {MAX_RANKS_OR_STAGES})"
                    ),
                );
                e.help = Some("give `stages <S>` to make large ids range errors".into());
                return Err(e);
            }
            max_s.max(1)
        }
    };
    let pipeline = if kind == PlacementKind::Explicit {
        if map.len() as u32 != stages {
            let (line, col) = line_col(src, p_at);
            return Err(ParseError {
                offset: p_at,
                len: p_end - p_at,
                line,
                col,
                message: format!(
                    "the placement lists {} ranks but there are {stages} stages",
                    map.len()
                ),
                help: Some("list the rank of every stage, stage 0 first".into()),
            });
        }
        Pipeline::explicit(pp, mbs, map)
    } else {
        Pipeline::new(pp, stages, mbs, kind)
    }
    .map_err(|e| {
        let (line, col) = line_col(src, p_at);
        ParseError {
            offset: p_at,
            len: (p_end - p_at).max(1),
            line,
            col,
            message: e.to_string(),
            help: None,
        }
    })?;
    let mut pipeline = pipeline;
    pipeline.communicators = communicators;
    if let Some((v, at)) = moe {
        if let Some(&s) = v.iter().find(|&&s| s >= pipeline.stages) {
            let (line, col) = line_col(src, at);
            return Err(ParseError {
                offset: at,
                len: 3,
                line,
                col,
                message: format!(
                    "`moe` names stage {s}, but there are {} stages",
                    pipeline.stages
                ),
                help: None,
            });
        }
        pipeline.moe_stages = Some(v);
    }
    let mut prog_ranks = vec![Vec::new(); pp as usize];
    let mut span_ranks = vec![Vec::new(); pp as usize];
    for (r, _, instrs, spans) in ranks {
        prog_ranks[r as usize] = instrs;
        span_ranks[r as usize] = spans;
    }
    Ok(Parsed {
        program: Program {
            pipeline,
            ranks: prog_ranks,
        },
        spans: SourceMap {
            ranks: span_ranks,
            ..Default::default()
        },
        expects,
        budget_activations: budget,
        stages_given,
        microbatches_given,
    })
}

fn parse_rank_body(c: &mut Cur<'_>, instrs: &mut Vec<Instr>, spans: &mut Vec<Span>) -> PResult<()> {
    loop {
        c.skip_inline_ws();
        if c.peek() == Some(b'#') {
            c.skip_to_line_end();
        }
        if matches!(c.peek(), None | Some(b'\n')) {
            return Ok(());
        }
        let s = c.pos;
        let i = parse_instr(c)?;
        // An op must be followed by white space or the end of the line.
        if !matches!(c.peek(), None | Some(b' ' | b'\t' | b'\r' | b'\n' | b'#')) {
            return Err(c.err_here("white space between ops"));
        }
        instrs.push(i);
        spans.push(Span {
            start: s as u32,
            len: (c.pos - s) as u32,
        });
    }
}

/// Writes one compute op (`F(0,1)`, `B(2,3).mlp`).
pub fn write_compute(out: &mut String, c: &Compute) {
    let _ = write!(out, "{}({},{})", c.kind.as_str(), c.stage, c.mb);
    if c.part != Part::Whole {
        out.push('.');
        out.push_str(c.part.as_str());
    }
    if c.checkpoint {
        out.push('!');
    }
}

/// Writes one communication op (`SA(0,1->1)`, `SA(0,1->1@2)` on channel 2, `A2A(ep,d0)`).
pub fn write_comm(out: &mut String, m: &Comm) {
    match m {
        Comm::Send {
            payload,
            peer,
            channel,
        } => {
            let k = match payload.kind {
                PayloadKind::Act => "SA",
                PayloadKind::Grad => "SG",
                PayloadKind::Lend => "LEND",
                PayloadKind::Return => "RETURN",
            };
            let _ = write!(out, "{k}({},{}->{peer}", payload.stage, payload.mb);
            write_channel(out, *channel);
        }
        Comm::Recv {
            payload,
            peer,
            channel,
        } => {
            let k = match payload.kind {
                PayloadKind::Act => "RA",
                PayloadKind::Grad => "RG",
                PayloadKind::Lend => "LEND",
                PayloadKind::Return => "RETURN",
            };
            let _ = write!(out, "{k}({},{}<-{peer}", payload.stage, payload.mb);
            write_channel(out, *channel);
        }
        Comm::Collective(col) => {
            let _ = write!(out, "A2A({},{})", col.comm, col.label);
        }
    }
}

fn write_channel(out: &mut String, channel: u32) {
    if channel != 0 {
        let _ = write!(out, "@{channel}");
    }
    out.push(')');
}

/// Writes one instruction in text form.
pub fn write_instr(out: &mut String, i: &Instr) {
    match i {
        Instr::Compute(c) => write_compute(out, c),
        Instr::Overlap { fwd, bwd } => {
            write_compute(out, fwd);
            out.push('&');
            write_compute(out, bwd);
        }
        Instr::Comm(m) => write_comm(out, m),
        Instr::Group(g) => {
            out.push('{');
            for (k, m) in g.iter().enumerate() {
                if k > 0 {
                    out.push(' ');
                }
                write_comm(out, m);
            }
            out.push('}');
        }
        Instr::ReduceGrad(s) => {
            let _ = write!(out, "REDUCE_GRAD({s})");
        }
        Instr::WaitReduceGrad(s) => {
            let _ = write!(out, "WAIT_REDUCE_GRAD({s})");
        }
        Instr::Unshard(s) => {
            let _ = write!(out, "UNSHARD({s})");
        }
        Instr::Reshard(s) => {
            let _ = write!(out, "RESHARD({s})");
        }
        Instr::WaitSend(p) => {
            let _ = write!(out, "WAIT_S{}({},{})", p.kind.letter(), p.stage, p.mb);
        }
        Instr::WaitRecv(p) => {
            let _ = write!(out, "WAIT_R{}({},{})", p.kind.letter(), p.stage, p.mb);
        }
        Instr::Mem(op) => {
            let _ = write!(out, "{}({},{})", op.kind.name(), op.stage, op.mb);
        }
        Instr::Idle => out.push('_'),
    }
}

/// The text of one instruction.
pub fn instr_to_string(i: &Instr) -> String {
    let mut s = String::new();
    write_instr(&mut s, i);
    s
}

/// Prints a program in the IR text format (header, then one line per rank).
pub fn print(p: &Program) -> String {
    let pl = &p.pipeline;
    let mut out = String::with_capacity(p.len() * 12 + 128);
    let _ = writeln!(out, "pp {}", pl.pp);
    let _ = writeln!(out, "stages {}", pl.stages);
    let _ = writeln!(out, "microbatches {}", pl.microbatches);
    match pl.placement {
        PlacementKind::Loop => out.push_str("placement loop\n"),
        PlacementKind::V => out.push_str("placement v\n"),
        PlacementKind::Bidir => out.push_str("placement bidir\n"),
        PlacementKind::Explicit => {
            out.push_str("placement");
            for r in &pl.stage_to_rank {
                let _ = write!(out, " {r}");
            }
            out.push('\n');
        }
    }
    for g in &pl.communicators {
        let _ = write!(out, "group {}", g.name);
        for r in &g.ranks {
            let _ = write!(out, " {r}");
        }
        out.push('\n');
    }
    if let Some(v) = &pl.moe_stages {
        out.push_str("moe");
        for s in v {
            let _ = write!(out, " {s}");
        }
        out.push('\n');
    }
    for (r, instrs) in p.ranks.iter().enumerate() {
        let _ = write!(out, "rank {r}:");
        for i in instrs {
            out.push(' ');
            write_instr(&mut out, i);
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = "pp 2\nstages 2\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) SA(0,0->1) F(0,1) {SA(0,1->1) RG(1,0<-1)} BW(0,0) RG(1,1<-1) BW(0,1)\nrank 1: RA(0,0<-0) F(1,0) BW(1,0) {SG(1,0->0) RA(0,1<-0)} F(1,1) BW(1,1) SG(1,1->0)\n";

    #[test]
    fn round_trip_is_exact() {
        let p = parse(SRC).unwrap();
        assert_eq!(print(&p.program), SRC);
        assert_eq!(p.program.ranks[0].len(), 7);
        assert_eq!(p.spans.get(0, 1), Some(Span { start: 59, len: 10 }));
        assert_eq!(&SRC[59..69], "SA(0,0->1)");
    }

    #[test]
    fn continuation_lines_and_comments() {
        let src = "# c\npp 1\nrank 0: F(0,0)\n  # note\n    BW(0,0) # tail\n";
        let p = parse(src).unwrap();
        assert_eq!(p.program.ranks[0].len(), 2);
        assert_eq!(p.program.pipeline.stages, 1);
        assert_eq!(p.program.pipeline.microbatches, 1);
    }

    #[test]
    fn overlap_parts_and_misc() {
        let src = "pp 1\nstages 2\nmicrobatches 2\nplacement 0 0\ngroup ep 0\nrank 0: F(0,0).attn F(0,0).dispatch F(0,0).mlp F(0,0).combine F(1,0) F(0,1)&BW(1,0) _ A2A(ep,x.1) REDUCE_GRAD(1) WAIT_SA(0,1) UNSHARD(0) RESHARD(0) WAIT_REDUCE_GRAD(1) WAIT_SG(1,0) WAIT_RA(0,1) WAIT_RG(1,0) W(0,0).mlp W(0,0).attn\n";
        let p = parse(src).unwrap();
        assert_eq!(print(&p.program), src);
    }

    #[test]
    fn errors_have_locations() {
        let e = parse("pp 2\nrank 0: F(0,0) X(1,2)\n").unwrap_err();
        assert_eq!((e.line, e.col), (2, 16));
        assert!(e.message.contains("unknown op `X`"), "{}", e.message);
        let e = parse("pp 2\nrank 0: SA(0,0-1)\n").unwrap_err();
        assert_eq!((e.line, e.col), (2, 15));
        let e = parse("pp 2\nrank 2: F(0,0)\n").unwrap_err();
        assert!(e.message.contains("out of range"));
        let e = parse("rank 0: F(0,0)\n").unwrap_err();
        assert!(e.message.contains("missing header"));
        let e = parse("pp 1\nrank 0: I(0,0)\n").unwrap_err();
        assert!(e.help.unwrap().contains("torch"));
    }

    #[test]
    fn memory_ops_round_trip_exactly() {
        let src = "pp 1\nstages 1\nmicrobatches 2\nplacement loop\nrank 0: F(0,0) OFFLOAD(0,0) F(0,1) OFFLOAD(0,1) RELOAD(0,0) BW(0,0) RECOMPUTE(0,1) BW(0,1)\n";
        let p = parse(src).unwrap();
        assert_eq!(print(&p.program), src);
        assert_eq!(
            p.program.ranks[0][1],
            Instr::Mem(MemOp {
                kind: MemKind::Offload,
                stage: 0,
                mb: 0
            })
        );
        assert_eq!(
            p.program.ranks[0][6],
            Instr::Mem(MemOp {
                kind: MemKind::Recompute,
                stage: 0,
                mb: 1
            })
        );
        let e = parse("pp 1\nrank 0: OFFLOAD(0)\n").unwrap_err();
        assert_eq!((e.line, e.col), (2, 18));
    }

    #[test]
    fn lend_and_return_round_trip_exactly() {
        let src = "pp 2\nstages 2\nmicrobatches 1\nplacement loop\nrank 0: F(0,0) SA(0,0->1) LEND(0,0->1@1) RG(1,0<-1) RETURN(0,0<-1@1) WAIT_RT(0,0) BW(0,0)\nrank 1: RA(0,0<-0) LEND(0,0<-0@1) F(1,0) BW(1,0) {SG(1,0->0) RETURN(0,0->0)} WAIT_SL(0,0) WAIT_RL(0,0) WAIT_ST(0,0)\n";
        let p = parse(src).unwrap();
        assert_eq!(print(&p.program), src);
        let lend = Payload {
            kind: PayloadKind::Lend,
            stage: 0,
            mb: 0,
        };
        assert_eq!(
            p.program.ranks[0][2],
            Instr::Comm(Comm::Send {
                payload: lend,
                peer: 1,
                channel: 1
            })
        );
        assert_eq!(
            p.program.ranks[1][1],
            Instr::Comm(Comm::Recv {
                payload: lend,
                peer: 0,
                channel: 1
            })
        );
        assert_eq!(p.program.ranks[0][4].comms()[0].peer(), Some(1));
        assert!(p.program.has_lending());
        let e = parse("pp 2\nrank 0: LEND(0,0 1)\n").unwrap_err();
        assert_eq!((e.line, e.col), (2, 18));
        assert!(
            e.message.contains("`->` and the rank the stash goes to"),
            "{}",
            e.message
        );
    }

    /// Found by `cargo fuzz run ir_text`: an unknown header word whose identifier part stops
    /// before a multi-byte character used to slice the source inside that character (panic
    /// "byte index 3 is not a char boundary").
    #[test]
    fn unknown_header_word_with_multibyte_char_is_an_error() {
        let e = parse("p\u{4c2de}").unwrap_err();
        assert_eq!((e.offset, e.len, e.line, e.col), (0, 5, 1, 1));
        assert!(e.message.contains("found `p\u{4c2de}`"), "{}", e.message);
        let e = parse("pp 1\na\u{20ac}b x\n").unwrap_err();
        assert_eq!((e.offset, e.len, e.line, e.col), (5, 5, 2, 1));
        assert!(e.message.contains("found `a\u{20ac}b`"), "{}", e.message);
    }

    /// Found by `cargo fuzz run ir_text` (out-of-memory): `pp 311111111` made the parser
    /// allocate a list per rank (7.4 GB) from a 40-byte input; a huge `stages` (given or
    /// inferred from an op) did the same for the stage-to-rank map, and inferring S or M from
    /// an op with id `u32::MAX` overflowed.
    #[test]
    fn huge_pp_or_stages_is_an_error_not_an_allocation() {
        let e = parse("#.\npp 311111111#11111111111111111\u{11}11111#").unwrap_err();
        assert_eq!((e.line, e.col), (2, 1));
        assert!(e.message.contains("too large"), "{}", e.message);
        let e = parse("pp 3000000000\nplacement bidir\n").unwrap_err();
        assert!(e.message.contains("too large"), "{}", e.message);
        let e = parse("pp 1\nstages 4294967295\n").unwrap_err();
        assert_eq!((e.line, e.col), (2, 1));
        assert!(e.message.contains("too large"), "{}", e.message);
        let e = parse("pp 1\nrank 0: F(0,0) F(4294967295,0)\n").unwrap_err();
        assert_eq!((e.offset, e.len, e.line, e.col), (20, 15, 2, 16));
        assert!(e.message.contains("too large"), "{}", e.message);
        // A given S makes large stage ids a range error for the verifier, not a parse error;
        // a large micro-batch id only sets M (no allocation here).
        let p = parse("pp 1\nstages 1\nrank 0: F(4294967295,4294967295)\n").unwrap();
        assert_eq!(p.program.pipeline.stages, 1);
        assert_eq!(p.program.pipeline.microbatches, u32::MAX);
        let p = parse("pp 1048576\nstages 1048576\n").unwrap();
        assert_eq!(p.program.ranks.len(), 1 << 20);
    }
}
