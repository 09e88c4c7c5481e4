//! DeepSeek DualPipe / DualPipeV reference traces (`shared/reference/dualpipe/*.json`).
//!
//! A trace is a JSON object recorded from deepseek-ai/DualPipe's `dualpipe.py` or
//! `dualpipev.py`:
//!
//! ```json
//! { "schedule": "dualpipe", "num_ranks": 4, "num_chunks": 8,
//!   "ops":     { "0": ["F0.0", "F0.1", "F0.3&B1.1", "I0.2", "W0.2", ...], "1": [...] },
//!   "program": { "0": ["F0.0", "COMM{sendAct0.0@r1}", ...], ... } }
//! ```
//!
//! `ops[r]` is rank r's compute ops in order; `program[r]` the same with each
//! `batch_isend_irecv` group in place as `COMM{...}`. (A JSON array of per-rank lists is
//! accepted too.) An op names a *local module* (0 or 1) and a micro-batch: `F<m>.<k>`
//! forward, `B<m>.<k>` full backward ([`Kind::BW`]), `I<m>.<k>` input-only backward (our
//! [`Kind::B`]), `W<m>.<k>` weight backward, `F<m>.<k>&B<m'>.<k'>` an overlapped chunk
//! ([`Instr::Overlap`]; `I` is accepted in the backward slot).
//!
//! ## Stages
//!
//! On rank r, module 0 is stage id `r` and module 1 is stage id `2P-1-r`, in both schedules:
//!
//! * DualPipe: [`PlacementKind::Bidir`], `Pipeline::new(P, 2P, N/2, Bidir)`. Module 1 of
//!   rank r is stage `P-1-r` of direction 1, whose id is `P + (P-1-r)`. Micro-batch ids run
//!   `0..N/2` in each direction (N must be even).
//! * DualPipeV: [`PlacementKind::V`], `Pipeline::new(P, 2P, N, V)`: module 0 is stage r,
//!   module 1 stage `2P-1-r`; all N micro-batches go through every stage.
//!
//! ## Communication
//!
//! A `COMM{...}` becomes one [`Instr::Group`] (even with a single entry). Module indices in
//! an entry are those of the rank doing the send or receive:
//! `sendAct<m>.<k>@r<p>` is `Send { Act(stage(m), k), p }`; `sendGrad<m>.<k>@r<p>` is
//! `Send { Grad(stage(m), k), p }`; `recvAct<m>.<k>@r<p>` receives the activation module m
//! consumes, `Recv { Act(prev_stage(stage(m)), k), p }`; `recvGrad<m>.<k>@r<p>` the gradient it
//! consumes, `Recv { Grad(next_stage(stage(m)), k), p }`. The unit tests check this reading
//! against every reference trace: the k-th send from rank a to rank b always carries the same
//! payload as the k-th receive on b from a.

use schedc_ir::text::{line_col, ParseError};
use schedc_ir::{
    Comm, Compute, Instr, Kind, Payload, PayloadKind, Pipeline, PlacementKind, Program, Stage,
};
use serde_json::Value;

/// Imports a trace's `"program"`: compute ops and `COMM{...}` groups, per rank.
///
/// Errors: a [`ParseError`] for malformed JSON (at serde_json's line and column), a missing or
/// invalid field (`schedule` other than `dualpipe`/`dualpipev`, `num_ranks` or `num_chunks`
/// not a positive integer, an odd `num_chunks` for DualPipe, a rank list missing or not a list
/// of strings), or a bad op (unknown syntax, a module index other than 0 or 1, a micro-batch
/// out of range, a peer `>= num_ranks`, a receive the stage cannot have, such as `recvAct` into
/// a first stage), located at the op's string in the source when it can be found, else at
/// line 1, column 1. Never panics.
pub fn parse_trace(src: &str) -> Result<Program, ParseError> {
    parse(src, "program")
}

/// Imports a trace's `"ops"`: compute ops only (a compute-only program, as the lowering pass
/// takes). Errors: as [`parse_trace`]; a `COMM{...}` in `ops` is an error too.
pub fn parse_trace_compute_only(src: &str) -> Result<Program, ParseError> {
    parse(src, "ops")
}

fn err_at(src: &str, offset: usize, len: usize, message: impl Into<String>) -> ParseError {
    let offset = offset.min(src.len());
    let (line, col) = line_col(src, offset);
    ParseError {
        offset,
        len,
        line,
        col,
        message: message.into(),
        help: None,
    }
}

/// The error for a JSON value at `path`, located in the source if the path can be found.
fn err_path(src: &str, path: &[Seg<'_>], message: impl Into<String>) -> ParseError {
    match locate(src, path) {
        Some((start, len)) => err_at(src, start, len, message),
        None => err_at(src, 0, 0, message),
    }
}

fn json_error(src: &str, e: &serde_json::Error) -> ParseError {
    // serde_json: 1-based line, 1-based column (0 when at a line start / unknown).
    let line = e.line().max(1);
    let mut line_start = 0;
    for _ in 1..line {
        match src[line_start..].find('\n') {
            Some(i) => line_start += i + 1,
            None => {
                line_start = src.len();
                break;
            }
        }
    }
    let line_end = src[line_start..]
        .find('\n')
        .map_or(src.len(), |i| line_start + i);
    let mut offset = (line_start + e.column().saturating_sub(1)).min(line_end);
    while !src.is_char_boundary(offset) {
        offset -= 1;
    }
    let full = e.to_string();
    let msg = match full.rfind(" at line ") {
        Some(i) => &full[..i],
        None => &full,
    };
    let len = usize::from(offset < src.len());
    err_at(src, offset, len, format!("invalid JSON: {msg}"))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Sched {
    DualPipe,
    DualPipeV,
}

/// What the op parser needs to know.
struct Ctx {
    sched: Sched,
    pipeline: Pipeline,
}

impl Ctx {
    /// The stage id of local module `m` on rank `r` (`m` already checked to be 0 or 1).
    fn stage(&self, r: u32, m: u32) -> Stage {
        let p = self.pipeline.pp;
        if m == 0 {
            r
        } else {
            2 * p - 1 - r
        }
    }
}

fn parse(src: &str, key: &'static str) -> Result<Program, ParseError> {
    let v: Value = serde_json::from_str(src).map_err(|e| json_error(src, &e))?;
    let Some(obj) = v.as_object() else {
        return Err(err_at(
            src,
            0,
            0,
            "expected a JSON object (a DualPipe trace)",
        ));
    };
    let sched = match obj.get("schedule") {
        Some(Value::String(s)) if s == "dualpipe" => Sched::DualPipe,
        Some(Value::String(s)) if s == "dualpipev" => Sched::DualPipeV,
        Some(_) => {
            return Err(err_path(
                src,
                &[Seg::Key("schedule")],
                "expected `schedule` to be \"dualpipe\" or \"dualpipev\"",
            ))
        }
        None => {
            return Err(err_at(
                src,
                0,
                0,
                "missing `schedule` (\"dualpipe\" or \"dualpipev\")",
            ))
        }
    };
    let uint = |name: &'static str| -> Result<u32, ParseError> {
        match obj.get(name) {
            Some(x) => x
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    err_path(
                        src,
                        &[Seg::Key(name)],
                        format!("expected `{name}` to be a positive integer"),
                    )
                }),
            None => Err(err_at(src, 0, 0, format!("missing `{name}`"))),
        }
    };
    let pp = uint("num_ranks")?;
    let chunks = uint("num_chunks")?;

    // The per-rank lists, checked before anything is sized by `pp`.
    let lists: Vec<(&Vec<Value>, Seg<'static>)> = match obj.get(key) {
        None => return Err(err_at(src, 0, 0, format!("missing `{key}`"))),
        Some(Value::Array(a)) => {
            if a.len() != pp as usize {
                return Err(err_path(
                    src,
                    &[Seg::Key(key)],
                    format!("`{key}` has {} rank lists, but num_ranks is {pp}", a.len()),
                ));
            }
            let mut out = Vec::with_capacity(a.len());
            for (r, x) in a.iter().enumerate() {
                let Value::Array(l) = x else {
                    return Err(err_path(
                        src,
                        &[Seg::Key(key), Seg::Index(r)],
                        format!("expected rank {r}'s `{key}` to be a list of op strings"),
                    ));
                };
                out.push((l, Seg::Index(r)));
            }
            out
        }
        Some(Value::Object(m)) => {
            if m.len() != pp as usize {
                return Err(err_path(
                    src,
                    &[Seg::Key(key)],
                    format!("`{key}` has {} ranks, but num_ranks is {pp}", m.len()),
                ));
            }
            let mut out = Vec::with_capacity(m.len());
            for r in 0..pp {
                let name = r.to_string();
                let Some(x) = m.get(&name) else {
                    return Err(err_path(
                        src,
                        &[Seg::Key(key)],
                        format!("rank {r} is missing from `{key}` (num_ranks is {pp})"),
                    ));
                };
                let Value::Array(l) = x else {
                    return Err(err_path(
                        src,
                        &[Seg::Key(key), Seg::RankKey(r)],
                        format!("expected rank {r}'s `{key}` to be a list of op strings"),
                    ));
                };
                out.push((l, Seg::RankKey(r)));
            }
            out
        }
        Some(_) => {
            return Err(err_path(
                src,
                &[Seg::Key(key)],
                format!("expected `{key}` to map each rank to its list of ops"),
            ))
        }
    };

    let (placement, mbs) = match sched {
        Sched::DualPipe => {
            if chunks % 2 != 0 {
                return Err(err_path(
                    src,
                    &[Seg::Key("num_chunks")],
                    format!("DualPipe needs an even num_chunks (half go each way), got {chunks}"),
                ));
            }
            (PlacementKind::Bidir, chunks / 2)
        }
        Sched::DualPipeV => (PlacementKind::V, chunks),
    };
    let stages = pp
        .checked_mul(2)
        .ok_or_else(|| err_path(src, &[Seg::Key("num_ranks")], "num_ranks is too large"))?;
    let pipeline = Pipeline::new(pp, stages, mbs, placement)
        .map_err(|e| err_at(src, 0, 0, format!("invalid pipeline: {e}")))?;
    let ctx = Ctx { sched, pipeline };

    let mut ranks = Vec::with_capacity(lists.len());
    for (r, (list, rseg)) in lists.iter().enumerate() {
        let r = r as u32;
        let mut instrs = Vec::with_capacity(list.len());
        for (i, x) in list.iter().enumerate() {
            let path = [Seg::Key(key), *rseg, Seg::Index(i)];
            let Value::String(op) = x else {
                return Err(err_path(
                    src,
                    &path,
                    format!("expected an op string in rank {r}'s `{key}`"),
                ));
            };
            let instr = parse_op(&ctx, r, op, key == "program").map_err(|e| {
                let mut pe = match locate(src, &path) {
                    // Point inside the quotes.
                    Some((start, len)) if len >= 2 => err_at(src, start + 1, len - 2, e.message),
                    Some((start, len)) => err_at(src, start, len, e.message),
                    None => err_at(src, 0, 0, e.message),
                };
                pe.help = e.help;
                pe
            })?;
            instrs.push(instr);
        }
        ranks.push(instrs);
    }
    Ok(Program {
        pipeline: ctx.pipeline,
        ranks,
    })
}

// ---------------------------------------------------------------------------------------------
// Ops
// ---------------------------------------------------------------------------------------------

struct OpErr {
    message: String,
    help: Option<String>,
}

fn op_err(message: impl Into<String>, help: Option<&str>) -> OpErr {
    OpErr {
        message: message.into(),
        help: help.map(str::to_string),
    }
}

fn clip(s: &str) -> String {
    let mut it = s.chars();
    let head: String = it.by_ref().take(40).collect();
    if it.next().is_some() {
        format!("{head}...")
    } else {
        head
    }
}

const OP_HELP: &str = "ops are `F<module>.<mb>`, `B<module>.<mb>`, `I<module>.<mb>`, \
                       `W<module>.<mb>`, `F<m>.<k>&B<m'>.<k'>` and `COMM{...}`";
const COMM_HELP: &str = "COMM entries are `sendAct<module>.<mb>@r<peer>`, `sendGrad...`, \
                         `recvAct...` and `recvGrad...`, separated by commas";

/// Parses a decimal u32 at the start of `s`; returns it and the rest.
fn num<'a>(s: &'a str, what: &str, whole: &str) -> Result<(u32, &'a str), OpErr> {
    let end = s.bytes().take_while(u8::is_ascii_digit).count();
    if end == 0 {
        return Err(op_err(
            format!("expected {what} in `{}`", clip(whole)),
            Some(OP_HELP),
        ));
    }
    let n = s[..end].parse::<u32>().map_err(|_| {
        op_err(
            format!(
                "{what} `{}` in `{}` is too large",
                clip(&s[..end]),
                clip(whole)
            ),
            None,
        )
    })?;
    Ok((n, &s[end..]))
}

/// `<module>.<mb>` at the start of `s`: the stage id and micro-batch, and the rest.
fn module_mb<'a>(
    ctx: &Ctx,
    r: u32,
    s: &'a str,
    whole: &str,
) -> Result<(Stage, u32, &'a str), OpErr> {
    let (m, rest) = num(s, "a module index", whole)?;
    if m > 1 {
        return Err(op_err(
            format!(
                "module index {m} in `{}` is out of range: each rank holds modules 0 and 1",
                clip(whole)
            ),
            None,
        ));
    }
    let Some(rest) = rest.strip_prefix('.') else {
        return Err(op_err(
            format!("expected `.` after the module index in `{}`", clip(whole)),
            Some(OP_HELP),
        ));
    };
    let (k, rest) = num(rest, "a micro-batch number", whole)?;
    let per = ctx.pipeline.microbatches;
    if k >= per {
        let what = match ctx.sched {
            Sched::DualPipe => format!("DualPipe runs {per} micro-batches in each direction"),
            Sched::DualPipeV => format!("DualPipeV runs {per} micro-batches"),
        };
        return Err(op_err(
            format!(
                "micro-batch {k} in `{}` is out of range: {what}",
                clip(whole)
            ),
            None,
        ));
    }
    Ok((ctx.stage(r, m), k, rest))
}

/// One compute op `<K><m>.<k>` with nothing after it.
fn compute(ctx: &Ctx, r: u32, s: &str, whole: &str) -> Result<Compute, OpErr> {
    let kind = match s.as_bytes().first() {
        Some(b'F') => Kind::F,
        Some(b'B') => Kind::BW,
        Some(b'I') => Kind::B,
        Some(b'W') => Kind::W,
        _ => {
            return Err(op_err(
                format!("expected an op such as `F0.3`, found `{}`", clip(whole)),
                Some(OP_HELP),
            ))
        }
    };
    let (stage, mb, rest) = module_mb(ctx, r, &s[1..], whole)?;
    if !rest.is_empty() {
        return Err(op_err(
            format!(
                "unexpected `{}` after the op in `{}`",
                clip(rest),
                clip(whole)
            ),
            Some(OP_HELP),
        ));
    }
    Ok(Compute::new(kind, stage, mb))
}

fn parse_op(ctx: &Ctx, r: u32, op: &str, comms_allowed: bool) -> Result<Instr, OpErr> {
    if let Some(rest) = op.strip_prefix("COMM") {
        if !comms_allowed {
            return Err(op_err(
                format!(
                    "`{}` in `ops`: the ops lists hold compute ops only",
                    clip(op)
                ),
                Some("communication is in `program`; use parse_trace"),
            ));
        }
        let Some(inner) = rest.strip_prefix('{').and_then(|x| x.strip_suffix('}')) else {
            return Err(op_err(
                format!("expected `COMM{{...}}`, found `{}`", clip(op)),
                Some(COMM_HELP),
            ));
        };
        if inner.is_empty() {
            return Err(op_err("empty `COMM{}` group", Some(COMM_HELP)));
        }
        let group = inner
            .split(',')
            .map(|e| comm_entry(ctx, r, e, op))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(Instr::Group(group));
    }
    if let Some((f, b)) = op.split_once('&') {
        let fwd = compute(ctx, r, f, op)?;
        let bwd = compute(ctx, r, b, op)?;
        if fwd.kind != Kind::F || !bwd.kind.is_backward_input() {
            return Err(op_err(
                format!(
                    "expected a forward and a backward in the overlapped chunk `{}`",
                    clip(op)
                ),
                Some("an overlapped chunk is `F<m>.<k>&B<m'>.<k'>`, the forward first"),
            ));
        }
        return Ok(Instr::Overlap { fwd, bwd });
    }
    compute(ctx, r, op, op).map(Instr::Compute)
}

fn comm_entry(ctx: &Ctx, r: u32, e: &str, whole: &str) -> Result<Comm, OpErr> {
    let (send, kind, rest) = if let Some(x) = e.strip_prefix("sendAct") {
        (true, PayloadKind::Act, x)
    } else if let Some(x) = e.strip_prefix("sendGrad") {
        (true, PayloadKind::Grad, x)
    } else if let Some(x) = e.strip_prefix("recvAct") {
        (false, PayloadKind::Act, x)
    } else if let Some(x) = e.strip_prefix("recvGrad") {
        (false, PayloadKind::Grad, x)
    } else {
        return Err(op_err(
            format!("unknown COMM entry `{}` in `{}`", clip(e), clip(whole)),
            Some(COMM_HELP),
        ));
    };
    let (stage, mb, rest) = module_mb(ctx, r, rest, whole)?;
    let Some(rest) = rest.strip_prefix("@r") else {
        return Err(op_err(
            format!("expected `@r<peer>` in `{}` of `{}`", clip(e), clip(whole)),
            Some(COMM_HELP),
        ));
    };
    let (peer, rest) = num(rest, "a peer rank", whole)?;
    if !rest.is_empty() {
        return Err(op_err(
            format!(
                "unexpected `{}` after `{}` in `{}`",
                clip(rest),
                clip(e),
                clip(whole)
            ),
            Some(COMM_HELP),
        ));
    }
    let pl = &ctx.pipeline;
    if peer >= pl.pp {
        return Err(op_err(
            format!(
                "peer rank {peer} in `{}` is out of range: the trace has {} ranks",
                clip(e),
                pl.pp
            ),
            None,
        ));
    }
    let producer = match (send, kind) {
        (true, _) => Some(stage),
        (false, PayloadKind::Act) => pl.prev_stage(stage),
        (false, PayloadKind::Grad) => pl.next_stage(stage),
        (false, PayloadKind::Lend | PayloadKind::Return) => Some(stage),
    };
    let Some(producer) = producer else {
        let (what, end) = if kind == PayloadKind::Act {
            ("an activation", "first")
        } else {
            ("a gradient", "last")
        };
        return Err(op_err(
            format!(
                "`{}` receives {what} into stage {stage}, which is the {end} stage of its \
                 direction",
                clip(e)
            ),
            None,
        ));
    };
    let payload = Payload {
        kind,
        stage: producer,
        mb,
    };
    Ok(if send {
        Comm::Send {
            payload,
            peer,
            channel: 0,
        }
    } else {
        Comm::Recv {
            payload,
            peer,
            channel: 0,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Locating a JSON value in the source (for error positions)
// ---------------------------------------------------------------------------------------------

/// One step of a path into the JSON document.
#[derive(Clone, Copy, Debug)]
enum Seg<'a> {
    /// An object member by its (unescaped-as-written) key.
    Key(&'a str),
    /// An object member whose key is the decimal rank.
    RankKey(u32),
    /// An array element.
    Index(usize),
}

/// A minimal scanner over JSON text that serde_json has already accepted.
struct Scan<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Scan<'a> {
    fn ws(&mut self) {
        while self.pos < self.b.len() && matches!(self.b[self.pos], b' ' | b'\t' | b'\n' | b'\r') {
            self.pos += 1;
        }
    }
    fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        if self.b.get(self.pos) == Some(&c) {
            self.pos += 1;
            Some(())
        } else {
            None
        }
    }
    /// A string token; returns the raw bytes between the quotes.
    fn string(&mut self) -> Option<&'a [u8]> {
        self.ws();
        if self.b.get(self.pos) != Some(&b'"') {
            return None;
        }
        let start = self.pos + 1;
        let mut i = start;
        while i < self.b.len() {
            match self.b[i] {
                b'\\' => i += 2,
                b'"' => {
                    self.pos = i + 1;
                    return self.b.get(start..i);
                }
                _ => i += 1,
            }
        }
        None
    }
    fn skip_value(&mut self, depth: usize) -> Option<()> {
        if depth > 256 {
            return None;
        }
        self.ws();
        match *self.b.get(self.pos)? {
            b'"' => self.string().map(|_| ()),
            open @ (b'{' | b'[') => {
                let close = if open == b'{' { b'}' } else { b']' };
                self.pos += 1;
                if self.eat(close).is_some() {
                    return Some(());
                }
                loop {
                    if open == b'{' {
                        self.string()?;
                        self.eat(b':')?;
                    }
                    self.skip_value(depth + 1)?;
                    if self.eat(b',').is_none() {
                        return self.eat(close);
                    }
                }
            }
            _ => {
                while self.pos < self.b.len()
                    && !matches!(
                        self.b[self.pos],
                        b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'
                    )
                {
                    self.pos += 1;
                }
                Some(())
            }
        }
    }
}

/// The byte range of the value at `path` (a string's range includes its quotes).
fn locate(src: &str, path: &[Seg<'_>]) -> Option<(usize, usize)> {
    let mut s = Scan {
        b: src.as_bytes(),
        pos: 0,
    };
    for seg in path {
        match *seg {
            Seg::Key(_) | Seg::RankKey(_) => {
                let rank_key;
                let want: &[u8] = match seg {
                    Seg::Key(k) => k.as_bytes(),
                    Seg::RankKey(r) => {
                        rank_key = r.to_string();
                        rank_key.as_bytes()
                    }
                    Seg::Index(_) => return None,
                };
                s.eat(b'{')?;
                loop {
                    let k = s.string()?;
                    s.eat(b':')?;
                    if k == want {
                        break;
                    }
                    s.skip_value(0)?;
                    s.eat(b',')?;
                }
            }
            Seg::Index(i) => {
                s.eat(b'[')?;
                for _ in 0..i {
                    s.skip_value(0)?;
                    s.eat(b',')?;
                }
            }
        }
    }
    s.ws();
    let start = s.pos;
    s.skip_value(0)?;
    Some((start, s.pos - start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, VecDeque};

    fn traces() -> Vec<(String, String)> {
        let dir = crate::test_support::shared().join("reference/dualpipe");
        let Ok(rd) = std::fs::read_dir(&dir) else {
            crate::test_support::skip_missing(&dir);
            return Vec::new();
        };
        let mut v: Vec<(String, String)> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy().into_owned();
                n.starts_with("dualpipe") && n.ends_with(".json")
            })
            .map(|p| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read_to_string(&p).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn every_trace_imports_with_complete_ops() {
        let ts = traces();
        assert!(ts.len() >= 20, "found {} traces", ts.len());
        for (name, src) in &ts {
            let full = parse_trace(src).unwrap_or_else(|e| panic!("{name}: {e}"));
            let ops = parse_trace_compute_only(src).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(full.pipeline, ops.pipeline, "{name}");
            assert!(ops.is_compute_only(), "{name}");
            let pl = &full.pipeline;
            let want = if name.starts_with("dualpipev") {
                PlacementKind::V
            } else {
                PlacementKind::Bidir
            };
            assert_eq!(pl.placement, want, "{name}");
            assert_eq!(pl.stages, 2 * pl.pp, "{name}");
            // Same compute ops, in the same order, in both lists.
            for r in 0..pl.pp as usize {
                let a: Vec<&Instr> = full.ranks[r].iter().filter(|i| i.is_compute()).collect();
                let b: Vec<&Instr> = ops.ranks[r].iter().collect();
                assert_eq!(a, b, "{name} rank {r}");
                // Every compute op of rank r is of a stage on rank r.
                for i in &ops.ranks[r] {
                    i.for_each_compute(|c| assert_eq!(pl.rank_of(c.stage), r as u32, "{name}"));
                }
            }
            // Each (stage, mb): one F, and one BW or one B and one W.
            let mut count: HashMap<(Kind, u32, u32), u32> = HashMap::new();
            for i in ops.ranks.iter().flatten() {
                i.for_each_compute(|c| *count.entry((c.kind, c.stage, c.mb)).or_default() += 1);
            }
            let n = |k, s, m| count.get(&(k, s, m)).copied().unwrap_or(0);
            for s in 0..pl.stages {
                for m in 0..pl.microbatches {
                    assert_eq!(n(Kind::F, s, m), 1, "{name} F({s},{m})");
                    let bw = n(Kind::BW, s, m);
                    let (b, w) = (n(Kind::B, s, m), n(Kind::W, s, m));
                    assert!(
                        (bw, b, w) == (1, 0, 0) || (bw, b, w) == (0, 1, 1),
                        "{name} ({s},{m}): BW {bw}, B {b}, W {w}"
                    );
                }
            }
            assert_eq!(
                ops.compute_ops(),
                count.values().map(|&v| v as usize).sum::<usize>()
            );
            // The program's COMM groups are all groups.
            assert!(full
                .ranks
                .iter()
                .flatten()
                .all(|i| !matches!(i, Instr::Comm(_))));
        }
    }

    #[test]
    fn fifo_labels_agree_on_every_trace() {
        for (name, src) in traces() {
            let p = parse_trace(&src).unwrap();
            let pp = p.pipeline.pp as usize;
            // channel (from, to) -> payloads sent, in order.
            let mut chan: HashMap<(usize, usize), VecDeque<Payload>> = HashMap::new();
            let mut sends = 0;
            for (a, prog) in p.ranks.iter().enumerate() {
                for m in prog.iter().flat_map(Instr::comms) {
                    if let Comm::Send { payload, peer, .. } = m {
                        assert_ne!(*peer as usize, a, "{name}: send to self");
                        chan.entry((a, *peer as usize))
                            .or_default()
                            .push_back(*payload);
                        sends += 1;
                    }
                }
            }
            let mut recvs = 0;
            for (b, prog) in p.ranks.iter().enumerate() {
                for m in prog.iter().flat_map(Instr::comms) {
                    if let Comm::Recv { payload, peer, .. } = m {
                        let got = chan
                            .get_mut(&(*peer as usize, b))
                            .and_then(VecDeque::pop_front);
                        assert_eq!(
                            got,
                            Some(*payload),
                            "{name}: receive #{recvs} on rank {b} from rank {peer}"
                        );
                        recvs += 1;
                    }
                }
            }
            assert_eq!(sends, recvs, "{name}");
            assert!(chan.values().all(VecDeque::is_empty), "{name}");
            if pp > 1 {
                assert!(sends > 0, "{name}");
            }
            // Every message goes between the producer's rank and the consumer's rank.
            for (a, prog) in p.ranks.iter().enumerate() {
                for m in prog.iter().flat_map(Instr::comms) {
                    if let Comm::Send { payload, peer, .. } = m {
                        let pl = &p.pipeline;
                        assert_eq!(pl.rank_of(payload.stage) as usize, a, "{name}");
                        let consumer = match payload.kind {
                            PayloadKind::Act => pl.next_stage(payload.stage),
                            _ => pl.prev_stage(payload.stage),
                        }
                        .unwrap();
                        assert_eq!(pl.rank_of(consumer), *peer, "{name}");
                    }
                }
            }
        }
    }

    fn trace(sched: &str, p: u32, n: u32, r0: &str, r1: &str) -> String {
        format!(
            "{{\n  \"schedule\": \"{sched}\",\n  \"num_ranks\": {p},\n  \"num_chunks\": {n},\n  \
             \"ops\": {{\"0\": [], \"1\": []}},\n  \"program\": {{\n    \"0\": [{r0}],\n    \
             \"1\": [{r1}]\n  }}\n}}\n"
        )
    }

    #[test]
    fn small_dualpipe_mapping() {
        let src = trace(
            "dualpipe",
            2,
            4,
            "\"F0.0\", \"COMM{sendAct0.0@r1,recvAct1.1@r1}\", \"F1.1&I0.0\", \"W0.0\"",
            "\"COMM{recvAct0.0@r0}\", \"B1.1\"",
        );
        let p = parse_trace(&src).unwrap();
        assert_eq!(p.pipeline.placement, PlacementKind::Bidir);
        assert_eq!(p.pipeline.microbatches, 2);
        let act = |s, mb| Payload {
            kind: PayloadKind::Act,
            stage: s,
            mb,
        };
        // Rank 0: module 0 = stage 0, module 1 = stage 3 (direction 1's stage 1).
        assert_eq!(
            p.ranks[0][1],
            Instr::Group(vec![
                Comm::Send {
                    payload: act(0, 0),
                    peer: 1,
                    channel: 0,
                },
                Comm::Recv {
                    payload: act(2, 1),
                    peer: 1,
                    channel: 0,
                },
            ])
        );
        assert_eq!(
            p.ranks[0][2],
            Instr::Overlap {
                fwd: Compute::new(Kind::F, 3, 1),
                bwd: Compute::new(Kind::B, 0, 0)
            }
        );
        assert_eq!(p.ranks[0][3], Instr::Compute(Compute::new(Kind::W, 0, 0)));
        assert_eq!(
            p.ranks[1][0],
            Instr::Group(vec![Comm::Recv {
                payload: act(0, 0),
                peer: 0,
                channel: 0,
            }])
        );
        // Rank 1: module 1 = stage 2 (direction 1's stage 0).
        assert_eq!(p.ranks[1][1], Instr::Compute(Compute::new(Kind::BW, 2, 1)));
    }

    #[test]
    fn small_dualpipev_mapping() {
        let src = trace(
            "dualpipev",
            2,
            3,
            "\"COMM{recvAct1.2@r1,recvGrad0.1@r1,sendGrad1.0@r1}\"",
            "\"F0.2\"",
        );
        let p = parse_trace(&src).unwrap();
        assert_eq!(p.pipeline.placement, PlacementKind::V);
        assert_eq!(p.pipeline.microbatches, 3);
        let pay = |kind, stage, mb| Payload { kind, stage, mb };
        assert_eq!(
            p.ranks[0][0],
            Instr::Group(vec![
                Comm::Recv {
                    payload: pay(PayloadKind::Act, 2, 2),
                    peer: 1,
                    channel: 0,
                },
                Comm::Recv {
                    payload: pay(PayloadKind::Grad, 1, 1),
                    peer: 1,
                    channel: 0,
                },
                Comm::Send {
                    payload: pay(PayloadKind::Grad, 3, 0),
                    peer: 1,
                    channel: 0,
                },
            ])
        );
    }

    fn err(src: &str) -> ParseError {
        match parse_trace(src) {
            Ok(_) => panic!("parsed: {src}"),
            Err(e) => e,
        }
    }

    #[test]
    fn errors_with_locations() {
        // Malformed JSON: serde's position.
        let e = err("{\n  \"schedule\": \"dualpipe\",\n  \"num_ranks\": 2,,\n}");
        assert_eq!((e.line, e.col), (3, 18));
        assert!(e.message.starts_with("invalid JSON"), "{}", e.message);
        assert!(!e.message.contains("at line"), "{}", e.message);

        // Unknown op: located at its string (line 7 is rank 1's list), inside the quotes.
        let src = trace("dualpipe", 2, 4, "\"F0.0\"", "\"F0.0\", \"X1.0\"");
        let e = err(&src);
        assert_eq!((e.line, e.col, e.len), (8, 20, 4), "{e}");
        assert_eq!(&src[e.offset..e.offset + e.len], "X1.0");
        assert!(e.help.is_some());

        // Module index out of range.
        let src = trace("dualpipe", 2, 4, "\"F2.0\"", "");
        let e = err(&src);
        assert_eq!((e.line, e.col), (7, 12), "{e}");
        assert!(e.message.contains("module index 2"), "{}", e.message);

        // recvAct into a first stage (module 0 of rank 0 is stage 0).
        let src = trace("dualpipev", 2, 4, "\"COMM{recvAct0.0@r1}\"", "");
        let e = err(&src);
        assert_eq!((e.line, e.col), (7, 12), "{e}");
        assert!(e.message.contains("first stage"), "{}", e.message);
        // recvGrad into the last stage (module 1 of rank 0 in DualPipeV is stage 2P-1).
        let src = trace("dualpipev", 2, 4, "\"COMM{recvGrad1.0@r1}\"", "");
        assert!(err(&src).message.contains("last stage"));

        // Micro-batch out of range (DualPipe: N/2 per direction), peer out of range.
        let src = trace("dualpipe", 2, 4, "\"F0.2\"", "");
        assert!(err(&src)
            .message
            .contains("2 micro-batches in each direction"));
        let src = trace("dualpipe", 2, 4, "\"COMM{sendAct0.0@r2}\"", "");
        assert!(err(&src).message.contains("peer rank 2"));

        // Odd N for DualPipe; num_ranks not matching the lists; bad schedule.
        let e = err(&trace("dualpipe", 2, 5, "", ""));
        assert_eq!((e.line, e.col), (4, 17), "{e}");
        assert!(e.message.contains("even"), "{}", e.message);
        assert!(err(&trace("dualpipe", 3, 6, "", ""))
            .message
            .contains("num_ranks is 3"));
        let e = err(&trace("zb", 2, 4, "", ""));
        assert_eq!((e.line, e.col), (2, 15), "{e}");

        // COMM in ops.
        let src = trace("dualpipe", 2, 4, "", "").replace(
            "\"ops\": {\"0\": [], \"1\": []}",
            "\"ops\": {\"0\": [\"COMM{sendAct0.0@r1}\"], \"1\": []}",
        );
        let e = parse_trace_compute_only(&src).unwrap_err();
        assert_eq!((e.line, e.col), (5, 18), "{e}");

        // Malformed ops of all sorts: errors, never panics.
        for op in [
            "",
            "F",
            "F0",
            "F0.",
            "F.0",
            "F0.0x",
            "F0.0&",
            "&B0.0",
            "B0.0&F0.0",
            "F0.0&W0.0",
            "F0.0&B0.0&B0.1",
            "COMM",
            "COMM{",
            "COMM{}",
            "COMM{sendAct0.0}",
            "COMM{sendAct0.0@r}",
            "COMM{sendAct0.0@1}",
            "COMM{sendAct0.0@r1,}",
            "COMM{sendAct0.0@r1x}",
            "COMM{foo0.0@r1}",
            "F99999999999.0",
            "F0.99999999999",
            "\u{e9}",
            "f0.0",
        ] {
            let src = trace("dualpipe", 2, 4, &format!("\"{op}\""), "");
            let e = err(&src);
            assert_eq!(e.line, 7, "{op}: {e}");
        }
        // Non-object, missing fields, wrong types.
        for src in [
            "", "[]", "1", "{}", "{\"schedule\": \"dualpipe\"}",
            "{\"schedule\": \"dualpipe\", \"num_ranks\": 1, \"num_chunks\": 2}",
            "{\"schedule\": \"dualpipe\", \"num_ranks\": 0, \"num_chunks\": 2, \"program\": []}",
            "{\"schedule\": \"dualpipe\", \"num_ranks\": 1, \"num_chunks\": 2, \"program\": [1]}",
            "{\"schedule\": \"dualpipe\", \"num_ranks\": 1, \"num_chunks\": 2, \"program\": [[1]]}",
            "{\"schedule\": \"dualpipe\", \"num_ranks\": 4294967295, \"num_chunks\": 2, \"program\": []}",
            "{\"schedule\": \"dualpipe\", \"num_ranks\": 1, \"num_chunks\": 2, \"program\": {\"1\": []}}",
            "{\"schedule\": 3, \"num_ranks\": 1, \"num_chunks\": 2, \"program\": [[]]}",
        ] {
            let _ = err(src);
        }
        // A list of lists works as well as an object keyed by rank.
        let p = parse_trace(
            "{\"schedule\": \"dualpipev\", \"num_ranks\": 1, \"num_chunks\": 1, \
             \"program\": [[\"F0.0\", \"F1.0\", \"B1.0\", \"B0.0\"]]}",
        )
        .unwrap();
        assert_eq!(p.len(), 4);
    }

    #[test]
    fn fuzz_mutated_traces_never_panic() {
        let Some((_, src)) = traces()
            .into_iter()
            .find(|(n, _)| n == "dualpipe_P2_N4.json")
        else {
            return;
        };
        let bytes = b"0123456789.&@r{},[]:\"FBIWCOMsendrecvActGrad \\\n";
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for _ in 0..3_000 {
            let mut b = src.clone().into_bytes();
            for _ in 0..1 + next(4) {
                let i = next(b.len());
                match next(3) {
                    0 => b[i] = bytes[next(bytes.len())],
                    1 => {
                        b.remove(i);
                    }
                    _ => b.insert(i, bytes[next(bytes.len())]),
                }
            }
            let s = String::from_utf8(b).unwrap();
            for r in [parse_trace(&s), parse_trace_compute_only(&s)] {
                if let Err(e) = r {
                    assert!(e.offset + e.len <= s.len(), "{e}");
                    assert_eq!((e.line, e.col), line_col(&s, e.offset));
                }
            }
        }
    }
}
