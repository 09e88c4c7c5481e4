//! The `.sched` parser: nom 8 combinators over `nom_locate` spans, errors with the furthest
//! position reached and what was expected there.

use super::ast::*;
use nom::branch::alt;
use nom::bytes::complete::{tag, take_while, take_while1};
use nom::character::complete::{char, digit1, multispace1, not_line_ending};
use nom::combinator::{cut, map, opt, recognize, value};
use nom::error::{ErrorKind, ParseError as NomParseError};
use nom::multi::many0;
use nom::sequence::{pair, preceded};
use nom::{IResult, Parser};
use nom_locate::LocatedSpan;
use schedc_ir::Kind;

type In<'a> = LocatedSpan<&'a str>;

/// How deeply expressions and blocks may nest, and how many terms one expression may have:
/// the parser and the elaborator recurse on the tree, so a generated file with 100,000
/// nested parentheses must be an error, not a stack overflow.
const MAX_DEPTH: u32 = 128;
const MAX_TERMS: u32 = 10_000;

thread_local! {
    static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Counts one level of nesting while alive.
struct Nest;

impl Nest {
    fn enter(i: In<'_>) -> Result<Nest, nom::Err<PErr>> {
        let d = DEPTH.with(|d| {
            d.set(d.get() + 1);
            d.get()
        });
        if d > MAX_DEPTH {
            DEPTH.with(|c| c.set(c.get() - 1));
            return Err(nom::Err::Failure(PErr {
                offset: i.location_offset(),
                expected: format!("at most {MAX_DEPTH} levels of nesting"),
                help: Some("split the expression or the block with `let` or `fn`".into()),
                generic: false,
            }));
        }
        Ok(Nest)
    }
}

impl Drop for Nest {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}
type R<'a, T> = IResult<In<'a>, T, PErr>;

/// A parse error: where, what was expected, what was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PErr {
    /// Byte offset.
    pub offset: usize,
    /// What the parser expected there ("an expression", "`}`", ...).
    pub expected: String,
    /// A hint.
    pub help: Option<String>,
    /// True once committed (`cut`): alternatives are not tried.
    generic: bool,
}

impl<'a> NomParseError<In<'a>> for PErr {
    fn from_error_kind(input: In<'a>, kind: ErrorKind) -> Self {
        PErr {
            offset: input.location_offset(),
            expected: format!("{kind:?}"),
            help: None,
            generic: true,
        }
    }
    fn append(_: In<'a>, _: ErrorKind, other: Self) -> Self {
        other
    }
    fn or(self, other: Self) -> Self {
        // Keep the error that got furthest; prefer a specific message at equal offsets.
        if other.offset > self.offset || (other.offset == self.offset && self.generic) {
            other
        } else {
            self
        }
    }
}

fn fail<'a, T>(i: In<'a>, expected: &str) -> R<'a, T> {
    Err(nom::Err::Error(PErr {
        offset: i.location_offset(),
        expected: expected.to_string(),
        help: None,
        generic: false,
    }))
}

/// Wraps a parser so that its failure reports `what` at the position it started.
fn expect<'a, T>(
    what: &'static str,
    mut p: impl Parser<In<'a>, Output = T, Error = PErr>,
) -> impl Parser<In<'a>, Output = T, Error = PErr> {
    move |i: In<'a>| match p.parse(i) {
        Ok(x) => Ok(x),
        Err(nom::Err::Error(e)) if e.generic || e.offset <= i.location_offset() => fail(i, what),
        Err(e) => Err(e),
    }
}

/// White space and `#` comments.
fn ws(i: In<'_>) -> R<'_, ()> {
    value(
        (),
        many0(alt((
            value((), multispace1),
            value((), pair(char('#'), not_line_ending)),
            value((), char(';')),
        ))),
    )
    .parse(i)
}

/// A token followed by white space.
fn tok<'a>(t: &'static str) -> impl Parser<In<'a>, Output = In<'a>, Error = PErr> {
    move |i: In<'a>| {
        let (i2, x) = tag(t).parse(i)?;
        let (i3, _) = ws(i2)?;
        Ok((i3, x))
    }
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}
fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

fn raw_ident(i: In<'_>) -> R<'_, In<'_>> {
    recognize(pair(take_while1(is_ident_start), take_while(is_ident))).parse(i)
}

/// A keyword: the word, not a prefix of a longer identifier.
fn kw<'a>(k: &'static str) -> impl Parser<In<'a>, Output = Sp, Error = PErr> {
    move |i: In<'a>| {
        let (i2, w) = raw_ident(i)?;
        if *w.fragment() != k {
            return fail(i, k);
        }
        let sp = sp_of(i, i2);
        let (i3, _) = ws(i2)?;
        Ok((i3, sp))
    }
}

const KEYWORDS: &[&str] = &[
    "let",
    "var",
    "for",
    "in",
    "repeat",
    "if",
    "else",
    "step",
    "rank",
    "literal",
    "expect",
    "param",
    "vpp",
    "stages",
    "microbatches",
    "placement",
    "require",
    "schedule",
    "idle",
    "group",
    "true",
    "false",
    "stage",
    "list",
];

fn ident(i: In<'_>) -> R<'_, (String, Sp)> {
    let (i2, w) = raw_ident(i)?;
    if KEYWORDS.contains(w.fragment()) {
        return fail(i, "a name");
    }
    let sp = sp_of(i, i2);
    let (i3, _) = ws(i2)?;
    Ok((i3, (w.fragment().to_string(), sp)))
}

/// The span from `a` to `b`, without the white space, `;` and comments that `b` skipped.
fn sp_of(a: In<'_>, b: In<'_>) -> Sp {
    let len = b.location_offset() - a.location_offset();
    let mut text = &a.fragment()[..len.min(a.fragment().len())];
    loop {
        let t = text.trim_end_matches(|c: char| c.is_whitespace() || c == ';');
        // A trailing comment: the last line's `#` (outside a string) starts it.
        let line_start = t.rfind('\n').map_or(0, |k| k + 1);
        let last = &t[line_start..];
        let cut = match last.find('#') {
            Some(k) if last[..k].matches('"').count() % 2 == 0 => line_start + k,
            _ => t.len(),
        };
        if cut == text.len() {
            break;
        }
        text = &t[..cut];
    }
    Sp {
        start: a.location_offset(),
        end: a.location_offset() + text.len(),
    }
}

fn int(i: In<'_>) -> R<'_, (i64, Sp)> {
    let (i2, d) = digit1(i)?;
    let v: i64 = match d.fragment().parse() {
        Ok(v) => v,
        Err(_) => {
            return Err(nom::Err::Failure(PErr {
                offset: i.location_offset(),
                expected: "an integer that fits in 64 bits".into(),
                help: None,
                generic: false,
            }))
        }
    };
    let sp = sp_of(i, i2);
    let (i3, _) = ws(i2)?;
    Ok((i3, (v, sp)))
}

fn string(i: In<'_>) -> R<'_, String> {
    let (i2, _) = char('"').parse(i)?;
    let (i3, s) = cut(take_while(|c| c != '"' && c != '\n')).parse(i2)?;
    let (i4, _) = cut(expect("`\"` closing the string", char('"'))).parse(i3)?;
    let (i5, _) = ws(i4)?;
    Ok((i5, s.fragment().to_string()))
}

fn op_kind(i: In<'_>) -> R<'_, (Kind, Sp)> {
    let (i2, w) = raw_ident(i)?;
    let k = match *w.fragment() {
        "F" => Kind::F,
        "B" => Kind::B,
        "W" => Kind::W,
        "BW" => Kind::BW,
        _ => return fail(i, "an op (F, B, W or BW)"),
    };
    let sp = sp_of(i, i2);
    let (i3, _) = ws(i2)?;
    Ok((i3, (k, sp)))
}

// ---------------------------------------------------------------- expressions

fn primary(i: In<'_>) -> R<'_, Expr> {
    let _nest = Nest::enter(i)?;
    let start = i;
    match int(i) {
        Ok((i2, (v, sp))) => return Ok((i2, Expr::Int(v, sp))),
        // A literal out of range: say so, not "expected an expression".
        Err(nom::Err::Failure(e)) => return Err(nom::Err::Failure(e)),
        Err(_) => {}
    }
    if let Ok((i2, _)) = tok("(").parse(i) {
        let (i3, e) = cut(expr).parse(i2)?;
        let (i4, _) = cut(expect("`)`", tok(")"))).parse(i3)?;
        return Ok((i4, e));
    }
    if let Ok((i2, _)) = tok("-").parse(i) {
        let (i3, e) = cut(expect("an expression after `-`", unary)).parse(i2)?;
        return Ok((i3, Expr::Neg(Box::new(e), sp_of(start, i3))));
    }
    if let Ok((i2, _)) = tok("!").parse(i) {
        let (i3, e) = cut(expect("an expression after `!`", unary)).parse(i2)?;
        return Ok((i3, Expr::Not(Box::new(e), sp_of(start, i3))));
    }
    if let Ok((i2, sp)) = kw("true").parse(i) {
        return Ok((i2, Expr::Bool(true, sp)));
    }
    if let Ok((i2, sp)) = kw("false").parse(i) {
        return Ok((i2, Expr::Bool(false, sp)));
    }
    if let Ok((i2, _)) = kw("if").parse(i) {
        return cut(|i| if_expr(i, start)).parse(i2);
    }
    // `stage` is a keyword (`F(stage s, m)`), but `stage(c)` is the built-in function.
    let (i2, (name, nsp)) = match kw("stage").parse(i) {
        Ok((i2, sp)) if i2.fragment().starts_with('(') => (i2, ("stage".to_string(), sp)),
        _ => expect("an expression", ident).parse(i)?,
    };
    if let Ok((i3, _)) = tok("(").parse(i2) {
        let mut args = Vec::new();
        let mut cur = i3;
        if let Ok((i4, _)) = tok(")").parse(cur) {
            return Ok((i4, Expr::Call(name, args, sp_of(start, i4))));
        }
        loop {
            let (i4, a) = cut(call_arg).parse(cur)?;
            args.push(a);
            if let Ok((i5, _)) = tok(",").parse(i4) {
                cur = i5;
                continue;
            }
            let (i5, _) = cut(expect("`,` or `)`", tok(")"))).parse(i4)?;
            return Ok((i5, Expr::Call(name, args, sp_of(start, i5))));
        }
    }
    Ok((i2, Expr::Var(name, nsp)))
}

/// The rest of `if c { a } else { b }` (or `else if ...`) after `if`.
fn if_expr<'a>(i: In<'a>, start: In<'a>) -> R<'a, Expr> {
    let (i, c) = expect("a condition after `if`", expr).parse(i)?;
    let (i, _) = expect("`{` and the value where the condition holds", tok("{")).parse(i)?;
    let (i, a) = expect("an expression", expr).parse(i)?;
    let (i, _) = expect("`}`", tok("}")).parse(i)?;
    let (i, _) = match kw("else").parse(i) {
        Ok(x) => x,
        Err(_) => {
            return Err(nom::Err::Failure(PErr {
                offset: i.location_offset(),
                expected: "`else` (an `if` expression needs both values)".into(),
                help: Some("write `if c { a } else { b }`".into()),
                generic: false,
            }))
        }
    };
    let (i, b) = if let Ok((i2, _)) = kw("if").parse(i) {
        if_expr(i2, i)?
    } else {
        let (i, _) = expect("`{` or `if` after `else`", tok("{")).parse(i)?;
        let (i, b) = expect("an expression", expr).parse(i)?;
        let (i, _) = expect("`}`", tok("}")).parse(i)?;
        (i, b)
    };
    Ok((
        i,
        Expr::If(Box::new(c), Box::new(a), Box::new(b), sp_of(start, i)),
    ))
}

fn call_arg(i: In<'_>) -> R<'_, Arg> {
    if let Ok((i2, (k, sp))) = op_kind(i) {
        // `F` alone (not `F(`): a kind argument.
        if !i2.fragment().starts_with('(') {
            return Ok((i2, Arg::Kind(k, sp)));
        }
    }
    map(expect("an expression or an op kind", expr), Arg::Expr).parse(i)
}

fn unary(i: In<'_>) -> R<'_, Expr> {
    primary(i)
}

fn binop(i: In<'_>) -> R<'_, BinOp> {
    alt((
        value(BinOp::Or, tok("||")),
        value(BinOp::And, tok("&&")),
        value(BinOp::Eq, tok("==")),
        value(BinOp::Ne, tok("!=")),
        value(BinOp::Le, tok("<=")),
        value(BinOp::Ge, tok(">=")),
        value(BinOp::Lt, tok("<")),
        value(BinOp::Gt, tok(">")),
        value(BinOp::Add, tok("+")),
        value(BinOp::Sub, tok("-")),
        value(BinOp::Mul, tok("*")),
        value(BinOp::Div, tok("/")),
        value(BinOp::Mod, tok("%")),
    ))
    .parse(i)
}

/// Precedence climbing.
fn expr_prec(i: In<'_>, min: u8) -> R<'_, Expr> {
    let (mut i, mut lhs) = unary(i)?;
    let mut terms = 1u32;
    loop {
        terms += 1;
        if terms > MAX_TERMS {
            return Err(nom::Err::Failure(PErr {
                offset: i.location_offset(),
                expected: format!("at most {MAX_TERMS} terms in one expression"),
                help: Some("split it with `let` or `fn`".into()),
                generic: false,
            }));
        }
        // Do not read `->`/`<-` (comm arrows) or `..` as operators.
        let f = i.fragment();
        if f.starts_with("->") || f.starts_with("<-") {
            break;
        }
        let Ok((i2, op)) = binop(i) else { break };
        if op.prec() < min {
            break;
        }
        let (i3, rhs) = cut(expect("an expression", |x| expr_prec(x, op.prec() + 1))).parse(i2)?;
        let sp = lhs.sp().to(rhs.sp());
        lhs = Expr::Bin(op, Box::new(lhs), Box::new(rhs), sp);
        i = i3;
    }
    Ok((i, lhs))
}

/// An expression.
pub fn expr(i: In<'_>) -> R<'_, Expr> {
    expr_prec(i, 1)
}

// ---------------------------------------------------------------- statements

fn block(i: In<'_>) -> R<'_, Vec<Stmt>> {
    let _nest = Nest::enter(i)?;
    let open = i.location_offset();
    let (i, _) = expect("`{`", tok("{")).parse(i)?;
    let mut out = Vec::new();
    let mut cur = i;
    loop {
        if let Ok((i2, _)) = tok("}").parse(cur) {
            return Ok((i2, out));
        }
        if cur.fragment().is_empty() {
            return Err(nom::Err::Failure(PErr {
                offset: open,
                expected: "`}` closing the block".into(),
                help: Some("add `}` where this block should end".into()),
                generic: false,
            }));
        }
        let (i2, s) = cut(stmt).parse(cur)?;
        out.push(s);
        cur = i2;
    }
}

fn op_stmt(i: In<'_>) -> R<'_, OpStmt> {
    let start = i;
    let (i, (kind, _)) = op_kind(i)?;
    let (i, q) = opt(tok("?")).parse(i)?;
    let (i, _) = expect("`(` after the op", tok("(")).parse(i)?;
    // Committed from here.
    let (i, target) = cut(|i| -> R<'_, Target> {
        if let Ok((i2, _)) = tok(")").parse(i) {
            return Ok((i2, Target::Next(None)));
        }
        // `stage s` names a global stage; `stage(c)` right after `(` is the built-in call.
        let is_call = i
            .fragment()
            .strip_prefix("stage")
            .is_some_and(|r| r.starts_with('('));
        if let (false, Ok((i2, _))) = (is_call, kw("stage").parse(i)) {
            let (i3, s) = expect("a stage expression", expr).parse(i2)?;
            let (i4, _) = expect("`,` and a micro-batch", tok(",")).parse(i3)?;
            let (i5, m) = expect("a micro-batch expression", expr).parse(i4)?;
            let (i6, _) = expect("`)`", tok(")")).parse(i5)?;
            return Ok((i6, Target::Stage(s, m)));
        }
        let (i2, c) = expect("a chunk expression, `stage`, or `)`", expr).parse(i)?;
        if let Ok((i3, _)) = tok(",").parse(i2) {
            let (i4, m) = expect("a micro-batch expression", expr).parse(i3)?;
            let (i5, _) = expect("`)`", tok(")")).parse(i4)?;
            return Ok((i5, Target::Chunk(c, m)));
        }
        let (i3, _) = expect("`,` or `)`", tok(")")).parse(i2)?;
        Ok((i3, Target::Next(Some(c))))
    })
    .parse(i)?;
    // `F(c)!`: a checkpointed forward (saves only its input).
    let (i, bang) = if kind == schedc_ir::Kind::F {
        opt(tok("!")).parse(i)?
    } else {
        (i, None)
    };
    Ok((
        i,
        OpStmt {
            kind,
            optional: q.is_some(),
            target,
            checkpoint: bang.is_some(),
            sp: sp_of(start, i),
        },
    ))
}

fn mem_target(i: In<'_>) -> R<'_, Target> {
    let is_call = i
        .fragment()
        .strip_prefix("stage")
        .is_some_and(|r| r.starts_with('('));
    let (i, global) = match (is_call, kw("stage").parse(i)) {
        (false, Ok((i2, _))) => (i2, true),
        _ => (i, false),
    };
    let what = if global {
        "a stage expression"
    } else {
        "a chunk expression or `stage`"
    };
    let (i, c) = expect(what, expr).parse(i)?;
    let (i, _) = expect("`,` and a micro-batch", tok(",")).parse(i)?;
    let (i, m) = expect("a micro-batch expression", expr).parse(i)?;
    let (i, _) = expect("`)`", tok(")")).parse(i)?;
    Ok((
        i,
        if global {
            Target::Stage(c, m)
        } else {
            Target::Chunk(c, m)
        },
    ))
}

fn mem_stmt(i: In<'_>) -> R<'_, MemStmt> {
    let start = i;
    let (i2, w) = raw_ident(i)?;
    let kind = match *w.fragment() {
        "OFFLOAD" => schedc_ir::MemKind::Offload,
        "RELOAD" => schedc_ir::MemKind::Reload,
        "RECOMPUTE" => schedc_ir::MemKind::Recompute,
        _ => return fail(i, "a memory op (OFFLOAD, RELOAD, RECOMPUTE)"),
    };
    let (i, _) = ws(i2)?;
    let (i, _) = expect("`(`", tok("(")).parse(i)?;
    let (i, target) = cut(mem_target).parse(i)?;
    Ok((
        i,
        MemStmt {
            kind,
            target,
            sp: sp_of(start, i),
        },
    ))
}

/// `LEND(c, m) to r`, `LEND(stage s, m) from o`, `RETURN(stage s, m) to o`,
/// `RETURN(c, m) from r`, each with an optional `@ channel`.
fn lend_stmt(i: In<'_>) -> R<'_, LendStmt> {
    let start = i;
    let (i2, w) = raw_ident(i)?;
    let kind = match *w.fragment() {
        "LEND" => schedc_ir::PayloadKind::Lend,
        "RETURN" => schedc_ir::PayloadKind::Return,
        _ => return fail(i, "LEND or RETURN"),
    };
    let (i, _) = ws(i2)?;
    let (i, _) = expect("`(`", tok("(")).parse(i)?;
    let (i, (target, send, peer, channel)) =
        cut(|i| -> R<'_, (Target, bool, Expr, Option<Expr>)> {
            let (i, target) = mem_target(i)?;
            let (i, send) = match kw("to").parse(i) {
                Ok((i2, _)) => (i2, true),
                Err(_) => {
                    let (i2, _) = expect(
                        "`to` and the rank the stash goes to, or `from` and the rank it comes from",
                        kw("from"),
                    )
                    .parse(i)?;
                    (i2, false)
                }
            };
            let (i, peer) = expect("the peer rank", expr).parse(i)?;
            let (i, channel) = match tok("@").parse(i) {
                Ok((i2, _)) => {
                    let (i3, c) = expect("a channel expression after `@`", expr).parse(i2)?;
                    (i3, Some(c))
                }
                Err(_) => (i, None),
            };
            Ok((i, (target, send, peer, channel)))
        })
        .parse(i)?;
    Ok((
        i,
        LendStmt {
            kind,
            target,
            send,
            peer,
            channel,
            sp: sp_of(start, i),
        },
    ))
}

fn comm_stmt(i: In<'_>) -> R<'_, CommStmt> {
    let start = i;
    let (i2, w) = raw_ident(i)?;
    let op = *w.fragment();
    if !matches!(op, "SA" | "RA" | "SG" | "RG") {
        return fail(i, "a send or receive (SA, RA, SG, RG)");
    }
    let (i, _) = ws(i2)?;
    let (i, _) = expect("`(`", tok("(")).parse(i)?;
    let arrow = if op.starts_with('S') { "->" } else { "<-" };
    let (i, (stage, mb, peer)) = cut(|i| -> R<'_, (Expr, Expr, Expr)> {
        let (i, s) = expect("the payload's stage", expr).parse(i)?;
        let (i, _) = expect("`,`", tok(",")).parse(i)?;
        let (i, m) = expect("the payload's micro-batch", expr).parse(i)?;
        let (i, _) = expect(
            if arrow == "->" {
                "`->` and the peer"
            } else {
                "`<-` and the peer"
            },
            tok(arrow),
        )
        .parse(i)?;
        let (i, p) = expect("the peer rank", expr).parse(i)?;
        let (i, _) = expect("`)`", tok(")")).parse(i)?;
        Ok((i, (s, m, p)))
    })
    .parse(i)?;
    Ok((
        i,
        CommStmt {
            op: op.to_string(),
            stage,
            mb,
            peer,
            sp: sp_of(start, i),
        },
    ))
}

/// `A2A(comm, "label")`.
fn coll_stmt(i: In<'_>) -> R<'_, CollStmt> {
    let start = i;
    let (i2, w) = raw_ident(i)?;
    if *w.fragment() != "A2A" {
        return fail(i, "A2A");
    }
    let (i, _) = ws(i2)?;
    let (i, _) = expect("`(`", tok("(")).parse(i)?;
    let (i, (comm, label)) = cut(|i| -> R<'_, (String, String)> {
        let (i, (c, _)) = expect("a communicator name", ident).parse(i)?;
        let (i, _) = expect("`,` and a label in quotes", tok(",")).parse(i)?;
        let (i, l) = expect("a label in quotes", string).parse(i)?;
        let (i, _) = expect("`)`", tok(")")).parse(i)?;
        Ok((i, (c, l)))
    })
    .parse(i)?;
    Ok((
        i,
        CollStmt {
            comm,
            label,
            sp: sp_of(start, i),
        },
    ))
}

/// `.attn`, `.dispatch`, `.mlp` or `.combine` right after an op.
fn part_suffix(i: In<'_>) -> R<'_, schedc_ir::Part> {
    let (i2, _) = char('.').parse(i)?;
    let (i3, w) = cut(expect("a part: attn, dispatch, mlp or combine", raw_ident)).parse(i2)?;
    let p = match *w.fragment() {
        "attn" => schedc_ir::Part::Attn,
        "dispatch" => schedc_ir::Part::Dispatch,
        "mlp" => schedc_ir::Part::Mlp,
        "combine" => schedc_ir::Part::Combine,
        _ => {
            return Err(nom::Err::Failure(PErr {
                offset: i2.location_offset(),
                expected: "a part: attn, dispatch, mlp or combine".into(),
                help: None,
                generic: false,
            }))
        }
    };
    let (i4, _) = ws(i3)?;
    Ok((i4, p))
}

/// `all`, `[e, ...]` or `x => cond` (a `communicator`'s ranks, `moe`'s stages).
fn set_spec<'a>(i: In<'a>, what: &'static str) -> R<'a, SetSpec> {
    if let Ok((i2, _)) = kw("all").parse(i) {
        return Ok((i2, SetSpec::All));
    }
    if let Ok((i2, _)) = tok("[").parse(i) {
        let mut v = Vec::new();
        let mut cur = i2;
        loop {
            if let Ok((i3, _)) = tok("]").parse(cur) {
                return Ok((i3, SetSpec::List(v)));
            }
            let (i3, e) = expect(what, expr).parse(cur)?;
            v.push(e);
            cur = match tok(",").parse(i3) {
                Ok((i4, _)) => i4,
                Err(_) => {
                    let (i4, _) = expect("`,` or `]`", tok("]")).parse(i3)?;
                    return Ok((i4, SetSpec::List(v)));
                }
            };
        }
    }
    let (i2, (n, _)) = expect("all, a list `[a, b, ...]` or `x => condition`", ident).parse(i)?;
    let (i3, _) = expect("`=>`", tok("=>")).parse(i2)?;
    let (i4, e) = expect("a condition", expr).parse(i3)?;
    Ok((i4, SetSpec::Where(n, e)))
}

fn stmt(i: In<'_>) -> R<'_, Stmt> {
    let start = i;
    if let Ok((i2, _)) = kw("let").parse(i) {
        let (i3, (n, _)) = cut(expect("a name after `let`", ident)).parse(i2)?;
        let (i4, _) = cut(expect("`=`", tok("="))).parse(i3)?;
        let (i5, e) = cut(expect("an expression", expr)).parse(i4)?;
        return Ok((i5, Stmt::Let(n, e, sp_of(start, i5))));
    }
    if let Ok((i2, _)) = kw("var").parse(i) {
        let (i3, (n, _)) = cut(expect("a name after `var`", ident)).parse(i2)?;
        let (i4, _) = cut(expect("`=`", tok("="))).parse(i3)?;
        let (i5, e) = cut(expect("an expression", expr)).parse(i4)?;
        return Ok((i5, Stmt::Var(n, e, sp_of(start, i5))));
    }
    if let Ok((i2, _)) = kw("for").parse(i) {
        let (i3, (var, _)) = cut(expect("a loop variable", ident)).parse(i2)?;
        let (i4, _) = cut(expect("`in`", kw("in"))).parse(i3)?;
        let (i5, from) = cut(expect("the start of the range", expr)).parse(i4)?;
        let (i6, incl) = cut(expect(
            "`..` or `..=`",
            alt((value(true, tok("..=")), value(false, tok("..")))),
        ))
        .parse(i5)?;
        let (i7, to) = cut(expect("the end of the range", expr)).parse(i6)?;
        let (i8, step) = opt(preceded(kw("step"), cut(expect("a step", expr)))).parse(i7)?;
        let sp = sp_of(start, i8);
        let (i9, body) = cut(block).parse(i8)?;
        return Ok((
            i9,
            Stmt::For {
                var,
                from,
                to,
                inclusive: incl,
                step,
                body,
                sp,
            },
        ));
    }
    if let Ok((i2, _)) = kw("while").parse(i) {
        let (i3, c) = cut(expect("a condition after `while`", expr)).parse(i2)?;
        let sp = sp_of(start, i3);
        let (i4, body) = cut(block).parse(i3)?;
        return Ok((i4, Stmt::While(c, body, sp)));
    }
    if let Ok((i2, _)) = kw("repeat").parse(i) {
        let (i3, n) = cut(expect("a count after `repeat`", expr)).parse(i2)?;
        let sp = sp_of(start, i3);
        let (i4, body) = cut(block).parse(i3)?;
        return Ok((i4, Stmt::Repeat(n, body, sp)));
    }
    if let Ok((i2, _)) = kw("if").parse(i) {
        return cut(|i| if_rest(i, start)).parse(i2);
    }
    if let Ok((i2, sp)) = kw("idle").parse(i) {
        return Ok((i2, Stmt::Idle(sp)));
    }
    if let Ok((i2, _)) = kw("group").parse(i) {
        let (i3, _) = cut(expect("`{`", tok("{"))).parse(i2)?;
        let mut v = Vec::new();
        let mut cur = i3;
        loop {
            if let Ok((i4, _)) = tok("}").parse(cur) {
                if v.is_empty() {
                    return Err(nom::Err::Failure(PErr {
                        offset: cur.location_offset(),
                        expected: "a send or receive in the group".into(),
                        help: None,
                        generic: false,
                    }));
                }
                return Ok((i4, Stmt::Group(v, sp_of(start, i4))));
            }
            let (i4, c) = cut(expect(
                "a send or receive (SA, RA, SG, RG) or `}`",
                comm_stmt,
            ))
            .parse(cur)?;
            v.push(c);
            cur = i4;
        }
    }
    if let Ok((i2, c)) = comm_stmt(i) {
        return Ok((i2, Stmt::Comm(c)));
    }
    match mem_stmt(i) {
        Ok((i2, m)) => return Ok((i2, Stmt::Mem(m))),
        Err(nom::Err::Failure(e)) => return Err(nom::Err::Failure(e)),
        Err(_) => {}
    }
    match lend_stmt(i) {
        Ok((i2, m)) => return Ok((i2, Stmt::Lend(m))),
        Err(nom::Err::Failure(e)) => return Err(nom::Err::Failure(e)),
        Err(_) => {}
    }
    match coll_stmt(i) {
        Ok((i2, c)) => return Ok((i2, Stmt::Collective(c))),
        Err(nom::Err::Failure(e)) => return Err(nom::Err::Failure(e)),
        Err(_) => {}
    }
    if let Ok((i2, a)) = op_stmt(i) {
        if i2.fragment().starts_with('.') {
            let (i3, part) = part_suffix(i2)?;
            return Ok((i3, Stmt::Part(a, part, sp_of(start, i3))));
        }
        if let Ok((i3, _)) = tok("&").parse(i2) {
            let (i4, b) = cut(expect("a backward op after `&`", op_stmt)).parse(i3)?;
            return Ok((i4, Stmt::Overlap(a, b, sp_of(start, i4))));
        }
        return Ok((i2, Stmt::Op(a)));
    }
    // Propagate committed errors from inside an op.
    if let Err(nom::Err::Failure(e)) = op_stmt(i) {
        return Err(nom::Err::Failure(e));
    }
    if let Ok((i2, (n, _))) = ident(i) {
        // `NAME(args)`: the use of a `def`.
        if let Ok((mut cur, _)) = tok("(").parse(i2) {
            let mut args = Vec::new();
            if let Ok((i3, _)) = tok(")").parse(cur) {
                cur = i3;
            } else {
                loop {
                    let (i3, a) = cut(expect("an argument", expr)).parse(cur)?;
                    args.push(a);
                    if let Ok((i4, _)) = tok(",").parse(i3) {
                        cur = i4;
                        continue;
                    }
                    let (i4, _) = cut(expect("`,` or `)`", tok(")"))).parse(i3)?;
                    cur = i4;
                    break;
                }
            }
            return Ok((cur, Stmt::Call(n, args, sp_of(start, cur))));
        }
        if let Ok((i3, _)) = tok("=").parse(i2) {
            if !i3.fragment().starts_with('=') {
                let (i4, e) = cut(expect("an expression", expr)).parse(i3)?;
                return Ok((i4, Stmt::Assign(n, e, sp_of(start, i4))));
            }
        }
    }
    fail(i, STMT_EXPECTED)
}

fn if_rest<'a>(i: In<'a>, start: In<'a>) -> R<'a, Stmt> {
    let (i, c) = expect("a condition after `if`", expr).parse(i)?;
    let sp = sp_of(start, i);
    let (i, then) = block(i)?;
    if let Ok((i2, _)) = kw("else").parse(i) {
        if let Ok((i3, _)) = kw("if").parse(i2) {
            let (i4, nested) = if_rest(i3, i2)?;
            return Ok((i4, Stmt::If(c, then, vec![nested], sp)));
        }
        let (i3, els) = block(i2)?;
        return Ok((i3, Stmt::If(c, then, els, sp)));
    }
    Ok((i, Stmt::If(c, then, Vec::new(), sp)))
}

// ---------------------------------------------------------------- list scheduling

fn list_rule(i: In<'_>) -> R<'_, ListRule> {
    let start = i;
    if let Ok((i2, _)) = kw("let").parse(i) {
        let (i3, (n, _)) = cut(expect("a name after `let`", ident)).parse(i2)?;
        let (i4, _) = cut(expect("`=`", tok("="))).parse(i3)?;
        let (i5, e) = cut(expect("an expression", expr)).parse(i4)?;
        return Ok((i5, ListRule::Let(n, e, sp_of(start, i5))));
    }
    if let Ok((i2, _)) = kw("memory").parse(i) {
        use super::list::MemPolicy;
        for (w, p) in [
            ("offload", MemPolicy::Offload),
            ("recompute", MemPolicy::Recompute),
            ("wait", MemPolicy::Wait),
        ] {
            if let Ok((i3, _)) = kw(w).parse(i2) {
                return Ok((i3, ListRule::OnMemory(p, sp_of(start, i3))));
            }
        }
        let (i3, _) = cut(expect(
            "`<=` (a cap) or `offload`, `recompute`, `wait` (what a rank does at the cap)",
            tok("<="),
        ))
        .parse(i2)?;
        let (i4, e) = cut(expect("the most live activations per rank", expr)).parse(i3)?;
        return Ok((i4, ListRule::Memory(e, sp_of(start, i4))));
    }
    if let Ok((i2, _)) = kw("inflight").parse(i) {
        let (i3, _) = cut(expect("`<=`", tok("<="))).parse(i2)?;
        let (i4, e) = cut(expect("the most forwards in flight per rank", expr)).parse(i3)?;
        return Ok((i4, ListRule::Inflight(e, sp_of(start, i4))));
    }
    if let Ok((i2, sp)) = kw("strict").parse(i) {
        return Ok((i2, ListRule::Strict(sp)));
    }
    if let Ok((i2, _)) = kw("defer").parse(i) {
        let (i3, (k, _)) = cut(expect("`W` after `defer`", op_kind)).parse(i2)?;
        return Ok((i3, ListRule::Defer(k, sp_of(start, i3))));
    }
    if let Ok((i2, (kind, _))) = op_kind(i) {
        let (i3, _) = cut(expect(
            "`(` and the names of the chunk and micro-batch",
            tok("("),
        ))
        .parse(i2)?;
        let (i4, (c, _)) = cut(expect("a name for the local chunk", ident)).parse(i3)?;
        let (i5, _) = cut(expect("`,`", tok(","))).parse(i4)?;
        let (i6, (m, _)) = cut(expect("a name for the micro-batch", ident)).parse(i5)?;
        let (i7, _) = cut(expect("`)`", tok(")"))).parse(i6)?;
        let (i8, _) = cut(expect("`=` and the priority", tok("="))).parse(i7)?;
        let (i9, e) = cut(expect("the priority (an expression)", expr)).parse(i8)?;
        return Ok((
            i9,
            ListRule::Priority {
                kind,
                chunk: c,
                mb: m,
                expr: e,
                sp: sp_of(start, i9),
            },
        ));
    }
    fail(
        i,
        "a list rule (`F(c, m) = priority`, `let`, `memory <= e`, `memory offload|recompute|wait`, `inflight <= e`, `defer W`, `strict`)",
    )
}

fn list_body(i: In<'_>) -> R<'_, Vec<ListRule>> {
    let open = i.location_offset();
    let (i, _) = expect("`{`", tok("{")).parse(i)?;
    let mut out = Vec::new();
    let mut cur = i;
    loop {
        if let Ok((i2, _)) = tok("}").parse(cur) {
            return Ok((i2, out));
        }
        if cur.fragment().is_empty() {
            return Err(nom::Err::Failure(PErr {
                offset: open,
                expected: "`}` closing the block".into(),
                help: Some("add `}` where this block should end".into()),
                generic: false,
            }));
        }
        let (i2, r) = cut(list_rule).parse(cur)?;
        out.push(r);
        cur = i2;
    }
}

// ---------------------------------------------------------------- items

fn literal_body(i: In<'_>) -> R<'_, String> {
    // `{` ... matching `}`; the text between is IR text (which has its own braces).
    let (i, _) = expect("`{`", char('{')).parse(i)?;
    let s = i.fragment();
    let mut depth = 1usize;
    let mut end = None;
    for (k, ch) in s.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    end = Some(k);
                    break;
                }
            }
            _ => {}
        }
    }
    let Some(end) = end else {
        return Err(nom::Err::Failure(PErr {
            offset: i.location_offset() + s.len(),
            expected: "`}` closing the literal block".into(),
            help: None,
            generic: false,
        }));
    };
    let body = s[..end].to_string();
    let (rest, _) = nom::bytes::complete::take::<usize, In<'_>, PErr>(end + 1).parse(i)?;
    let (rest, _) = ws(rest)?;
    Ok((rest, body))
}

fn item(i: In<'_>) -> R<'_, Item> {
    let start = i;
    if let Ok((i2, _)) = kw("schedule").parse(i) {
        let (i3, s) = cut(expect("a quoted name", string)).parse(i2)?;
        return Ok((i3, Item::Name(s, sp_of(start, i3))));
    }
    if let Ok((i2, _)) = kw("param").parse(i) {
        let (i3, (n, _)) = cut(expect("a parameter name", ident)).parse(i2)?;
        let (i4, d) = opt(preceded(tok("="), cut(expect("a default value", expr)))).parse(i3)?;
        return Ok((i4, Item::Param(n, d, sp_of(start, i4))));
    }
    if let Ok((i2, _)) = kw("vpp").parse(i) {
        if let Ok((i3, _)) = kw("default").parse(i2) {
            let (i4, e) = cut(expect(
                "the default number of virtual stages per rank",
                expr,
            ))
            .parse(i3)?;
            return Ok((i4, Item::VppDefault(e, sp_of(start, i4))));
        }
        let (i3, e) = cut(expect("the number of virtual stages per rank", expr)).parse(i2)?;
        return Ok((i3, Item::Vpp(e, sp_of(start, i3))));
    }
    if let Ok((i2, _)) = kw("stages").parse(i) {
        let (i3, e) = cut(expect("the number of stages", expr)).parse(i2)?;
        return Ok((i3, Item::Stages(e, sp_of(start, i3))));
    }
    if let Ok((i2, _)) = kw("microbatches").parse(i) {
        let (i3, e) = cut(expect("the number of micro-batches per stage", expr)).parse(i2)?;
        return Ok((i3, Item::Microbatches(e, sp_of(start, i3))));
    }
    if let Ok((i2, _)) = kw("placement").parse(i) {
        let (i3, p) = cut(|i| -> R<'_, PlacementSpec> {
            if let Ok((i2, _)) = kw("loop").parse(i) {
                return Ok((i2, PlacementSpec::Loop));
            }
            if let Ok((i2, _)) = kw("v").parse(i) {
                return Ok((i2, PlacementSpec::V));
            }
            if let Ok((i2, _)) = kw("bidir").parse(i) {
                return Ok((i2, PlacementSpec::Bidir));
            }
            if let Ok((i2, _)) = tok("[").parse(i) {
                let mut v = Vec::new();
                let mut cur = i2;
                loop {
                    if let Ok((i3, _)) = tok("]").parse(cur) {
                        return Ok((i3, PlacementSpec::List(v)));
                    }
                    let (i3, e) = expect("a rank expression or `]`", expr).parse(cur)?;
                    v.push(e);
                    cur = match tok(",").parse(i3) {
                        Ok((i4, _)) => i4,
                        Err(_) => {
                            let (i4, _) = expect("`,` or `]`", tok("]")).parse(i3)?;
                            return Ok((i4, PlacementSpec::List(v)));
                        }
                    };
                }
            }
            let (i2, (n, _)) = expect(
                "loop, v, bidir, a list `[r0, r1, ...]` or `s => rank`",
                ident,
            )
            .parse(i)?;
            let (i3, _) = expect("`=>`", tok("=>")).parse(i2)?;
            let (i4, e) = expect("the rank of the stage", expr).parse(i3)?;
            Ok((i4, PlacementSpec::Map(n, e)))
        })
        .parse(i2)?;
        return Ok((i3, Item::Placement(p, sp_of(start, i3))));
    }
    if let Ok((i2, _)) = kw("let").parse(i) {
        let (i3, (n, _)) = cut(expect("a name after `let`", ident)).parse(i2)?;
        let (i4, _) = cut(expect("`=`", tok("="))).parse(i3)?;
        let (i5, e) = cut(expect("an expression", expr)).parse(i4)?;
        return Ok((i5, Item::Let(n, e, sp_of(start, i5))));
    }
    if let Ok((i2, _)) = kw("fn").parse(i) {
        let (i3, (n, _)) = cut(expect("a function name after `fn`", ident)).parse(i2)?;
        let (mut cur, _) = cut(expect("`(` and the parameters", tok("("))).parse(i3)?;
        let mut params = Vec::new();
        if let Ok((i4, _)) = tok(")").parse(cur) {
            cur = i4;
        } else {
            loop {
                let (i4, (pn, _)) = cut(expect("a parameter name", ident)).parse(cur)?;
                params.push(pn);
                if let Ok((i5, _)) = tok(",").parse(i4) {
                    cur = i5;
                    continue;
                }
                let (i5, _) = cut(expect("`,` or `)`", tok(")"))).parse(i4)?;
                cur = i5;
                break;
            }
        }
        let (i6, _) = cut(expect("`=` and the function's expression", tok("="))).parse(cur)?;
        let (i7, e) = cut(expect("an expression", expr)).parse(i6)?;
        return Ok((i7, Item::Fn(n, params, e, sp_of(start, i7))));
    }
    if let Ok((i2, _)) = kw("def").parse(i) {
        let (i3, (n, _)) = cut(expect("a name after `def`", ident)).parse(i2)?;
        let (mut cur, _) = cut(expect("`(` and the parameters", tok("("))).parse(i3)?;
        let mut params = Vec::new();
        if let Ok((i4, _)) = tok(")").parse(cur) {
            cur = i4;
        } else {
            loop {
                let (i4, (pn, _)) = cut(expect("a parameter name", ident)).parse(cur)?;
                params.push(pn);
                if let Ok((i5, _)) = tok(",").parse(i4) {
                    cur = i5;
                    continue;
                }
                let (i5, _) = cut(expect("`,` or `)`", tok(")"))).parse(i4)?;
                cur = i5;
                break;
            }
        }
        let sp = sp_of(start, cur);
        let (i4, body) = cut(block).parse(cur)?;
        return Ok((i4, Item::Def(n, params, body, sp)));
    }
    if let Ok((i2, _)) = kw("require").parse(i) {
        let (i3, c) = cut(expect("a condition", expr)).parse(i2)?;
        let (i4, _) = cut(expect("`,` and a message in quotes", tok(","))).parse(i3)?;
        let (i5, m) = cut(expect("a message in quotes", string)).parse(i4)?;
        return Ok((i5, Item::Require(c, m, sp_of(start, i5))));
    }
    if let Ok((i2, _)) = kw("rank").parse(i) {
        let (i3, (n, _)) =
            cut(expect("the rank variable's name, e.g. `rank r {`", ident)).parse(i2)?;
        let sp = sp_of(start, i3);
        let (i4, body) = cut(block).parse(i3)?;
        return Ok((i4, Item::Rank(n, body, sp)));
    }
    if let Ok((i2, _)) = kw("list").parse(i) {
        let (i3, (n, _)) =
            cut(expect("the rank variable's name, e.g. `list r {`", ident)).parse(i2)?;
        let sp = sp_of(start, i3);
        let (i4, rules) = cut(list_body).parse(i3)?;
        return Ok((i4, Item::List(n, rules, sp)));
    }
    if let Ok((i2, _)) = kw("literal").parse(i) {
        let (i3, body) = cut(literal_body).parse(i2)?;
        return Ok((i3, Item::Literal(body, sp_of(start, i3))));
    }
    if let Ok((i2, _)) = kw("communicator").parse(i) {
        let (i3, (n, _)) = cut(expect("a communicator name", ident)).parse(i2)?;
        let (i4, set) = cut(|i| set_spec(i, "a rank expression or `]`")).parse(i3)?;
        return Ok((i4, Item::Communicator(n, set, sp_of(start, i4))));
    }
    if let Ok((i2, _)) = kw("parts").parse(i) {
        if let Ok((i3, _)) = kw("adjacent").parse(i2) {
            return Ok((i3, Item::Parts(PartsOrder::Adjacent, sp_of(start, i3))));
        }
        let (i3, _) = cut(expect("`list` or `adjacent` after `parts`", kw("list"))).parse(i2)?;
        // `parts list N`: N on the same line (a next line starts the next item).
        let same_line =
            !start.fragment()[..i3.location_offset() - start.location_offset()].contains('\n');
        if same_line {
            if let Ok((i4, n)) = expr(i3) {
                return Ok((i4, Item::Parts(PartsOrder::List(Some(n)), sp_of(start, i4))));
            }
        }
        return Ok((i3, Item::Parts(PartsOrder::List(None), sp_of(start, i3))));
    }
    if let Ok((i2, _)) = kw("recompute").parse(i) {
        let (i3, _) = cut(expect("`stages` after `recompute`", kw("stages"))).parse(i2)?;
        let (i4, set) = cut(|i| set_spec(i, "a stage expression or `]`")).parse(i3)?;
        return Ok((i4, Item::Recompute(set, sp_of(start, i4))));
    }
    if let Ok((i2, _)) = kw("moe").parse(i) {
        let (i3, set) = cut(|i| set_spec(i, "a stage expression or `]`")).parse(i2)?;
        return Ok((i3, Item::Moe(set, sp_of(start, i3))));
    }
    if let Ok((i2, _)) = kw("expect").parse(i) {
        let rel = |i| -> R<'_, Rel> {
            cut(expect(
                "`<=`, `==` or `>=`",
                alt((
                    value(Rel::Le, tok("<=")),
                    value(Rel::Eq, tok("==")),
                    value(Rel::Ge, tok(">=")),
                )),
            ))
            .parse(i)
        };
        let (i3, kind) = cut(|i| -> R<'_, ExpectKind> {
            if let Ok((i2, _)) = kw("warmup").parse(i) {
                let (i3, r) = rel(i2)?;
                return Ok((i3, ExpectKind::Warmup(r)));
            }
            if let Ok((i2, _)) = kw("peak_activations").parse(i) {
                let (i3, r) = rel(i2)?;
                return Ok((i3, ExpectKind::PeakActivations(r)));
            }
            if let Ok((i2, _)) = kw("idle").parse(i) {
                let (i3, r) = rel(i2)?;
                return Ok((i3, ExpectKind::Idle(r)));
            }
            if let Ok((i2, _)) = kw("makespan").parse(i) {
                let (i3, r) = rel(i2)?;
                return Ok((i3, ExpectKind::Makespan(r)));
            }
            if let Ok((i2, _)) = kw("exposed_a2a").parse(i) {
                let (i3, r) = rel(i2)?;
                return Ok((i3, ExpectKind::ExposedA2a(r)));
            }
            if let Ok((i2, _)) = kw("exposed_comm").parse(i) {
                let (i3, r) = rel(i2)?;
                return Ok((i3, ExpectKind::ExposedComm(r)));
            }
            if let Ok((i2, _)) = kw("bubble").parse(i) {
                let (i3, _) = cut(expect("`(` and a convention", tok("("))).parse(i2)?;
                let (i4, w) = cut(expect(
                    "a convention: from_start, per_rank_span or steady_state",
                    raw_ident,
                ))
                .parse(i3)?;
                let Some(conv) = crate::sim::Convention::from_name(w.fragment()) else {
                    return Err(nom::Err::Failure(PErr {
                        offset: i3.location_offset(),
                        expected: "a convention: from_start, per_rank_span or steady_state"
                            .into(),
                        help: None,
                        generic: false,
                    }));
                };
                let (i5, _) = ws(i4)?;
                let (i6, _) = cut(expect("`)`", tok(")"))).parse(i5)?;
                let (i7, r) = rel(i6)?;
                return Ok((i7, ExpectKind::Bubble(conv, r)));
            }
            fail(
                i,
                "warmup, peak_activations, idle, makespan, bubble(CONVENTION), exposed_a2a or exposed_comm",
            )
        })
        .parse(i2)?;
        let (i4, e) = cut(expect("an expression", expr)).parse(i3)?;
        // `if COND`: the line applies only where the condition holds.
        if let Ok((i5, _)) = kw("if").parse(i4) {
            let (i6, c) = cut(expect("a condition after `if`", expr)).parse(i5)?;
            return Ok((i6, Item::Expect(kind, e, Some(c), sp_of(start, i6))));
        }
        return Ok((i4, Item::Expect(kind, e, None, sp_of(start, i4))));
    }
    fail(
        i,
        "an item (schedule, param, vpp, stages, microbatches, placement, let, fn, def, require, rank, list, literal, communicator, moe, parts, recompute, expect)",
    )
}

/// A syntax error, located.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntaxError {
    /// Byte offset.
    pub offset: usize,
    /// Length of the offending token (at least 1 unless at the end).
    pub len: usize,
    /// "expected X, found Y".
    pub message: String,
    /// A hint.
    pub help: Option<String>,
}

fn found_at(src: &str, off: usize) -> (String, usize) {
    let rest = &src[off.min(src.len())..];
    if rest.is_empty() {
        return ("end of file".into(), 0);
    }
    let first = rest.chars().next().unwrap_or(' ');
    if first == '\n' {
        return ("end of line".into(), 1);
    }
    let len = if is_ident(first) {
        rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len())
    } else {
        first.len_utf8()
    };
    (format!("`{}`", &rest[..len]), len)
}

fn help_for(expected: &str, found: &str) -> Option<String> {
    if found == "`I`" {
        return Some(
            "torch's `I` (input-only backward) is `B` here; torch's `B` (full backward) is `BW`"
                .into(),
        );
    }
    if expected.starts_with("an item") && found == "`for`" {
        return Some("statements go inside `rank r { ... }`".into());
    }
    if found == "`=`" {
        return Some("comparisons use `==`".into());
    }
    None
}

/// Parses a whole `.sched` file.
///
/// Errors: the first syntax error, at the furthest position the parser reached, with what
/// it expected and what it found.
pub fn parse_file(src: &str) -> Result<File, SyntaxError> {
    DEPTH.with(|d| d.set(0));
    let input = In::new(src);
    let (mut cur, _) = ws(input).map_err(|_| SyntaxError {
        offset: 0,
        len: 0,
        message: "unreadable input".into(),
        help: None,
    })?;
    let mut items = Vec::new();
    while !cur.fragment().is_empty() {
        match item(cur) {
            Ok((rest, it)) => {
                items.push(it);
                cur = rest;
            }
            Err(nom::Err::Error(e)) | Err(nom::Err::Failure(e)) => {
                let (found, len) = found_at(src, e.offset);
                let expected = if e.generic {
                    "a valid token".to_string()
                } else {
                    e.expected
                };
                let message = if expected.starts_with("`}` closing the block") {
                    "unclosed block: the file ends before its `}`".to_string()
                } else if expected.starts_with("at most ") {
                    format!("too complex: {expected}")
                } else {
                    format!("expected {expected}, found {found}")
                };
                return Err(SyntaxError {
                    offset: e.offset,
                    len,
                    help: e.help.or_else(|| help_for(&expected, &found)),
                    message,
                });
            }
            Err(nom::Err::Incomplete(_)) => {
                return Err(SyntaxError {
                    offset: src.len(),
                    len: 0,
                    message: "unexpected end of file".into(),
                    help: None,
                })
            }
        }
    }
    let file = File { items };
    unknown_calls(&file)?;
    Ok(file)
}

const STMT_EXPECTED: &str = "a statement (let, var, for, while, repeat, if, an op such as F(0) or F(0).attn, a send or receive, A2A, group, idle, the use of a def)";

/// Edit distance between two names (for "did you mean").
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The closest of `names` to `n`, if close enough to be a typo.
pub(crate) fn closest<'a>(n: &str, names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    names
        .map(|m| (edit_distance(m, n), m))
        .filter(|&(k, m)| k <= 2.max(m.len() / 3))
        .min()
        .map(|(_, m)| m)
}

/// A statement `NAME(..)` whose NAME no `def` of the file has is a syntax error (as any
/// other unknown statement), with the closest `def` suggested.
fn unknown_calls(file: &File) -> Result<(), SyntaxError> {
    let defs: Vec<&str> = file
        .items
        .iter()
        .filter_map(|it| match it {
            Item::Def(n, ..) => Some(n.as_str()),
            _ => None,
        })
        .collect();
    fn walk(body: &[Stmt], defs: &[&str]) -> Result<(), SyntaxError> {
        for s in body {
            match s {
                Stmt::Call(n, _, sp) if !defs.contains(&n.as_str()) => {
                    let found = format!("`{n}`");
                    let help = help_for(STMT_EXPECTED, &found).or_else(|| {
                        Some(match closest(n, defs.iter().copied()) {
                            Some(m) => format!("no `def {n}` in this file; did you mean `{m}`?"),
                            None => format!(
                                "no `def {n}` in this file: define it with `def {n}(params) {{ statements }}`"
                            ),
                        })
                    });
                    return Err(SyntaxError {
                        offset: sp.start,
                        len: n.len(),
                        message: format!("expected {STMT_EXPECTED}, found {found}"),
                        help,
                    });
                }
                Stmt::For { body, .. } | Stmt::Repeat(_, body, _) | Stmt::While(_, body, _) => {
                    walk(body, defs)?
                }
                Stmt::If(_, a, b, _) => {
                    walk(a, defs)?;
                    walk(b, defs)?;
                }
                _ => {}
            }
        }
        Ok(())
    }
    for it in &file.items {
        if let Item::Rank(_, body, _) | Item::Def(_, _, body, _) = it {
            walk(body, &defs)?;
        }
    }
    Ok(())
}
