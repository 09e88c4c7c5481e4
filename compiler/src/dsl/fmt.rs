//! `schedc fmt`: the canonical layout of a `.sched` file. Comments are kept: each goes before
//! the item or statement that follows it in the source, except a comment at the end of a
//! line, which stays at the end of that line's statement (or, on a block's first line, of
//! the block's header: `for i in 0..k { # head`). Formatting is idempotent and `parse(fmt(f)) == parse(f)`.

use super::ast::*;
use std::fmt::Write as _;

/// The `#` comments of `src` with their byte offsets (outside strings and literal blocks).
fn comments(src: &str, skip: &[(usize, usize)]) -> Vec<(usize, String)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if let Some(&(_, e)) = skip.iter().find(|(s, e)| i >= *s && i < *e) {
            i = e;
            continue;
        }
        match b[i] {
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                    i += 1;
                }
                i += 1;
            }
            b'#' => {
                let s = i;
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                out.push((s, src[s..i].trim_end().to_string()));
            }
            _ => i += 1,
        }
    }
    out
}

struct Fmt<'s> {
    out: String,
    comments: Vec<(usize, String)>,
    next: usize,
    src: &'s str,
}

/// True if the source has a blank line somewhere in `a..b` (kept as one blank line).
fn blank_between(src: &str, a: usize, b: usize) -> bool {
    if a >= b || b > src.len() || !src.is_char_boundary(a) || !src.is_char_boundary(b) {
        return false;
    }
    let mut newline = false;
    for c in src[a..b].chars() {
        if c == '\n' {
            if newline {
                return true;
            }
            newline = true;
        } else if !c.is_whitespace() {
            newline = false;
        }
    }
    false
}

impl Fmt<'_> {
    /// A comment on the same source line, after byte `end` (the end of what was just printed),
    /// stays at the end of that line (`F(0) # fwd`), not on a line of its own.
    fn trailing(&mut self, end: usize) {
        let Some((off, c)) = self.comments.get(self.next) else {
            return;
        };
        let (off, c) = (*off, c.clone());
        if off < end
            || off > self.src.len()
            || !self.src.is_char_boundary(end.min(off))
            || self.src[end.min(off)..off].contains('\n')
        {
            return;
        }
        if self.out.ends_with('\n') {
            self.out.pop();
            let _ = writeln!(self.out, " {c}");
            self.next += 1;
        }
    }

    /// A comment on the first source line of a block's header (`for i in 0..k { # head`,
    /// `rank r # program`), which starts at `start`, before the block's first statement (at
    /// `first`), stays at the end of the header line just printed (it moved into the block
    /// before).
    fn header_comment(&mut self, start: usize, first: Option<usize>) {
        let Some((off, c)) = self.comments.get(self.next) else {
            return;
        };
        let (off, c) = (*off, c.clone());
        if off < start
            || first.is_some_and(|f| f < off)
            || !same_line(self.src, start, off)
            || !self.out.ends_with('\n')
        {
            return;
        }
        self.out.pop();
        let _ = writeln!(self.out, " {c}");
        self.next += 1;
    }

    fn flush_comments(&mut self, before: usize, indent: usize) {
        while self.next < self.comments.len() && self.comments[self.next].0 < before {
            let c = self.comments[self.next].1.clone();
            let _ = writeln!(self.out, "{:indent$}{c}", "");
            self.next += 1;
        }
    }
}

/// Prints an expression with the fewest parentheses that keep its structure.
pub fn expr_str(e: &Expr) -> String {
    let mut s = String::new();
    write_expr(&mut s, e, 0);
    s
}

fn write_expr(s: &mut String, e: &Expr, parent: u8) {
    match e {
        Expr::Int(v, _) => {
            let _ = write!(s, "{v}");
        }
        Expr::Bool(b, _) => {
            let _ = write!(s, "{b}");
        }
        Expr::Var(n, _) => s.push_str(n),
        Expr::Neg(x, _) => {
            s.push('-');
            write_expr(s, x, 6);
        }
        Expr::Not(x, _) => {
            s.push('!');
            write_expr(s, x, 6);
        }
        Expr::Bin(op, a, b, _) => {
            let p = op.prec();
            let paren = p < parent;
            if paren {
                s.push('(');
            }
            // Keep `(a / b) % c`-style groupings visible: mixed `* / %` read ambiguously.
            match &**a {
                Expr::Bin(aop, ..) if aop.prec() == p && p == 5 && aop != op => {
                    s.push('(');
                    write_expr(s, a, 0);
                    s.push(')');
                }
                _ => write_expr(s, a, p),
            }
            let _ = write!(s, " {} ", op.as_str());
            write_expr(s, b, p + 1);
            if paren {
                s.push(')');
            }
        }
        Expr::If(c, a, b, _) => {
            let _ = write!(s, "if {} {{ {} }} else ", expr_str(c), expr_str(a));
            match &**b {
                Expr::If(..) => write_expr(s, b, 0),
                _ => {
                    let _ = write!(s, "{{ {} }}", expr_str(b));
                }
            }
        }
        Expr::Call(n, args, _) => {
            s.push_str(n);
            s.push('(');
            for (k, a) in args.iter().enumerate() {
                if k > 0 {
                    s.push_str(", ");
                }
                match a {
                    Arg::Expr(x) => write_expr(s, x, 0),
                    Arg::Kind(k, _) => s.push_str(k.as_str()),
                }
            }
            s.push(')');
        }
    }
}

fn op_str(o: &OpStmt) -> String {
    let mut s = o.kind.as_str().to_string();
    if o.optional {
        s.push('?');
    }
    s.push('(');
    match &o.target {
        Target::Next(None) => {}
        Target::Next(Some(c)) => s.push_str(&expr_str(c)),
        Target::Chunk(c, m) => {
            let _ = write!(s, "{}, {}", expr_str(c), expr_str(m));
        }
        Target::Stage(st, m) => {
            let _ = write!(s, "stage {}, {}", expr_str(st), expr_str(m));
        }
    }
    s.push(')');
    if o.checkpoint {
        s.push('!');
    }
    s
}

fn lend_str(m: &LendStmt) -> String {
    let mut s = String::from(if m.kind == schedc_ir::PayloadKind::Lend {
        "LEND("
    } else {
        "RETURN("
    });
    match &m.target {
        Target::Stage(st, mb) => {
            let _ = write!(s, "stage {}, {}", expr_str(st), expr_str(mb));
        }
        Target::Chunk(c, mb) => {
            let _ = write!(s, "{}, {}", expr_str(c), expr_str(mb));
        }
        Target::Next(_) => {}
    }
    let _ = write!(
        s,
        ") {} {}",
        if m.send { "to" } else { "from" },
        expr_str(&m.peer)
    );
    if let Some(c) = &m.channel {
        let _ = write!(s, " @ {}", expr_str(c));
    }
    s
}

fn mem_str(m: &MemStmt) -> String {
    let mut s = format!("{}(", m.kind.name());
    match &m.target {
        Target::Stage(st, mb) => {
            let _ = write!(s, "stage {}, {}", expr_str(st), expr_str(mb));
        }
        Target::Chunk(c, mb) => {
            let _ = write!(s, "{}, {}", expr_str(c), expr_str(mb));
        }
        Target::Next(c) => {
            if let Some(c) = c {
                s.push_str(&expr_str(c));
            }
        }
    }
    s.push(')');
    s
}

fn comm_str(c: &CommStmt) -> String {
    let arrow = if c.op.starts_with('S') { "->" } else { "<-" };
    format!(
        "{}({}, {} {arrow} {})",
        c.op,
        expr_str(&c.stage),
        expr_str(&c.mb),
        expr_str(&c.peer)
    )
}

fn coll_str(c: &CollStmt) -> String {
    format!("A2A({}, \"{}\")", c.comm, c.label)
}

fn set_str(v: &SetSpec) -> String {
    match v {
        SetSpec::All => "all".into(),
        SetSpec::List(v) => format!(
            "[{}]",
            v.iter().map(expr_str).collect::<Vec<_>>().join(", ")
        ),
        SetSpec::Where(n, e) => format!("{n} => {}", expr_str(e)),
    }
}

fn stmt_start(s: &Stmt) -> usize {
    match s {
        Stmt::Part(_, _, sp) => sp.start,
        Stmt::Collective(c) => c.sp.start,
        Stmt::Let(_, _, sp) | Stmt::Var(_, _, sp) | Stmt::Assign(_, _, sp) => sp.start,
        Stmt::For { sp, .. } => sp.start,
        Stmt::Repeat(_, _, sp) | Stmt::While(_, _, sp) | Stmt::If(_, _, _, sp) => sp.start,
        Stmt::Op(o) => o.sp.start,
        Stmt::Overlap(_, _, sp) | Stmt::Group(_, sp) | Stmt::Idle(sp) => sp.start,
        Stmt::Comm(c) => c.sp.start,
        Stmt::Mem(m) => m.sp.start,
        Stmt::Lend(m) => m.sp.start,
        Stmt::Call(_, _, sp) => sp.start,
    }
}

/// The offset of the `}` that closes a block whose last statement ends before `pos`
/// (skipping white space and comments); `pos` if none is found.
fn close_brace_after(src: &str, pos: usize) -> usize {
    let b = src.as_bytes();
    let mut i = pos.min(b.len());
    while i < b.len() {
        match b[i] {
            b'}' => return i,
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            c if c.is_ascii_whitespace() || c == b';' => i += 1,
            _ => return pos,
        }
    }
    pos
}

/// The offset just past a statement including its closing `}` (and, for `if`, the whole
/// `else` chain): braces are matched in the source from the statement's start, skipping
/// comments and strings. Simple statements end where their span ends.
fn full_end(src: &str, s: &Stmt) -> usize {
    if is_simple(s) || matches!(s, Stmt::Let(..) | Stmt::Var(..) | Stmt::Assign(..)) {
        return stmt_end(s);
    }
    let b = src.as_bytes();
    let mut i = stmt_start(s).min(b.len());
    loop {
        // The next `{` and its matching `}`.
        let mut depth = 0usize;
        let mut closed = None;
        while i < b.len() {
            match b[i] {
                b'#' => {
                    while i < b.len() && b[i] != b'\n' {
                        i += 1;
                    }
                    continue;
                }
                b'"' => {
                    i += 1;
                    while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                        i += 1;
                    }
                }
                b'{' => depth += 1,
                b'}' if depth > 0 => {
                    depth -= 1;
                    if depth == 0 {
                        closed = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        let Some(end) = closed else {
            return stmt_end(s);
        };
        // An `else` continues the statement.
        let mut j = end;
        while j < b.len() && (b[j].is_ascii_whitespace() || b[j] == b';') {
            j += 1;
        }
        let rest = &src[j.min(src.len())..];
        let is_else = matches!(s, Stmt::If(..))
            && rest.starts_with("else")
            && !rest[4..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        if !is_else {
            return end;
        }
        i = j + 4;
    }
}

fn is_simple(s: &Stmt) -> bool {
    matches!(
        s,
        Stmt::Op(_)
            | Stmt::Overlap(..)
            | Stmt::Idle(_)
            | Stmt::Comm(_)
            | Stmt::Group(..)
            | Stmt::Part(..)
            | Stmt::Collective(_)
            | Stmt::Mem(_)
            | Stmt::Lend(_)
            | Stmt::Call(..)
    )
}

/// The one-line text of a simple statement.
fn simple_str(s: &Stmt) -> String {
    match s {
        Stmt::Op(o) => op_str(o),
        Stmt::Part(o, p, _) => format!("{}.{}", op_str(o), p.as_str()),
        Stmt::Collective(c) => coll_str(c),
        Stmt::Overlap(a, b, _) => format!("{} & {}", op_str(a), op_str(b)),
        Stmt::Idle(_) => "idle".into(),
        Stmt::Call(n, args, _) => format!(
            "{n}({})",
            args.iter().map(expr_str).collect::<Vec<_>>().join(", ")
        ),
        Stmt::Comm(c) => comm_str(c),
        Stmt::Mem(m) => mem_str(m),
        Stmt::Lend(m) => lend_str(m),
        Stmt::Group(v, _) => format!(
            "group {{ {} }}",
            v.iter().map(comm_str).collect::<Vec<_>>().join(" ")
        ),
        _ => unreachable!("not simple"),
    }
}

/// True if `src[a..b]` has no line break (both in range).
fn same_line(src: &str, a: usize, b: usize) -> bool {
    let (a, b) = (a.min(b), a.max(b));
    b <= src.len()
        && src.is_char_boundary(a)
        && src.is_char_boundary(b)
        && !src[a..b].contains('\n')
}

/// A block the source wrote on one line, holding only ops: printed on one line too.
fn one_line_block(f: &Fmt<'_>, header_start: usize, body: &[Stmt]) -> bool {
    if body.is_empty() || !body.iter().all(is_simple) {
        return false;
    }
    let last = stmt_end(body.last().expect("non-empty"));
    let close = close_brace_after(f.src, last);
    let no_comment = !f.comments[f.next..]
        .iter()
        .any(|(o, _)| *o >= header_start && *o <= close);
    no_comment && same_line(f.src, header_start, close)
}

fn write_block(f: &mut Fmt<'_>, body: &[Stmt], indent: usize, end: usize) {
    // Comments up to this block's `}` stay inside it, also after a last statement that is
    // itself a block.
    let end = match body.last() {
        Some(last) => close_brace_after(f.src, full_end(f.src, last)).max(end),
        None => close_brace_after(f.src, end.saturating_sub(1)).max(end),
    };
    let mut k = 0;
    while k < body.len() {
        let s = &body[k];
        if k > 0
            && blank_between(
                f.src,
                stmt_end(&body[k - 1]),
                first_comment_or(f, stmt_start(s)),
            )
        {
            f.out.push('\n');
        }
        // Ops that the source wrote on one line stay on one line.
        if is_simple(s) {
            let mut j = k + 1;
            while j < body.len()
                && is_simple(&body[j])
                && same_line(f.src, stmt_end(&body[j - 1]), stmt_start(&body[j]))
                && first_comment_or(f, stmt_start(&body[j])) == stmt_start(&body[j])
            {
                j += 1;
            }
            if j > k + 1 {
                f.flush_comments(stmt_start(s), indent);
                let line: Vec<String> = body[k..j].iter().map(simple_str).collect();
                let _ = writeln!(f.out, "{}{}", " ".repeat(indent), line.join(" "));
                f.trailing(stmt_end(&body[j - 1]));
                k = j;
                continue;
            }
        }
        write_stmt(f, s, indent);
        k += 1;
    }
    f.flush_comments(end, indent);
}

/// The offset just past a statement (for comments at the end of a block).
fn stmt_end(s: &Stmt) -> usize {
    match s {
        Stmt::For { body, sp, .. } | Stmt::Repeat(_, body, sp) | Stmt::While(_, body, sp) => {
            body.last().map_or(sp.end, stmt_end)
        }
        Stmt::If(_, a, b, sp) => b.last().or(a.last()).map_or(sp.end, stmt_end),
        Stmt::Let(_, _, sp) | Stmt::Var(_, _, sp) | Stmt::Assign(_, _, sp) => sp.end,
        Stmt::Op(o) => o.sp.end,
        Stmt::Overlap(_, _, sp) | Stmt::Group(_, sp) | Stmt::Idle(sp) => sp.end,
        Stmt::Comm(c) => c.sp.end,
        Stmt::Mem(m) => m.sp.end,
        Stmt::Lend(m) => m.sp.end,
        Stmt::Part(_, _, sp) => sp.end,
        Stmt::Collective(c) => c.sp.end,
        Stmt::Call(_, _, sp) => sp.end,
    }
}

fn write_stmt(f: &mut Fmt<'_>, s: &Stmt, indent: usize) {
    write_stmt_inner(f, s, indent);
    // A comment after the statement on its last source line (for a block, after its `}`).
    let end = full_end(f.src, s);
    f.trailing(end);
}

fn write_stmt_inner(f: &mut Fmt<'_>, s: &Stmt, indent: usize) {
    f.flush_comments(stmt_start(s), indent);
    let pad = " ".repeat(indent);
    match s {
        Stmt::Let(n, e, _) => {
            let _ = writeln!(f.out, "{pad}let {n} = {}", expr_str(e));
        }
        Stmt::Var(n, e, _) => {
            let _ = writeln!(f.out, "{pad}var {n} = {}", expr_str(e));
        }
        Stmt::Assign(n, e, _) => {
            let _ = writeln!(f.out, "{pad}{n} = {}", expr_str(e));
        }
        Stmt::For {
            var,
            from,
            to,
            inclusive,
            step,
            body,
            sp,
        } if one_line_block(f, sp.start, body) => {
            let line: Vec<String> = body.iter().map(simple_str).collect();
            let step = step
                .as_ref()
                .map(|st| format!(" step {}", expr_str(st)))
                .unwrap_or_default();
            let _ = writeln!(
                f.out,
                "{pad}for {var} in {}{}{}{step} {{ {} }}",
                expr_str(from),
                if *inclusive { "..=" } else { ".." },
                expr_str(to),
                line.join(" ")
            );
        }
        Stmt::For {
            var,
            from,
            to,
            inclusive,
            step,
            body,
            ..
        } => {
            let _ = write!(
                f.out,
                "{pad}for {var} in {}{}{}",
                expr_str(from),
                if *inclusive { "..=" } else { ".." },
                expr_str(to)
            );
            if let Some(st) = step {
                let _ = write!(f.out, " step {}", expr_str(st));
            }
            f.out.push_str(" {\n");
            f.header_comment(stmt_start(s), body.first().map(stmt_start));
            write_block(f, body, indent + 4, stmt_end(s) + 1);
            let _ = writeln!(f.out, "{pad}}}");
        }
        Stmt::Repeat(n, body, sp) if one_line_block(f, sp.start, body) => {
            let line: Vec<String> = body.iter().map(simple_str).collect();
            let _ = writeln!(
                f.out,
                "{pad}repeat {} {{ {} }}",
                expr_str(n),
                line.join(" ")
            );
        }
        Stmt::While(c, body, sp) if one_line_block(f, sp.start, body) => {
            let line: Vec<String> = body.iter().map(simple_str).collect();
            let _ = writeln!(f.out, "{pad}while {} {{ {} }}", expr_str(c), line.join(" "));
        }
        Stmt::If(c, a, b, sp) if b.is_empty() && one_line_block(f, sp.start, a) => {
            let line: Vec<String> = a.iter().map(simple_str).collect();
            let _ = writeln!(f.out, "{pad}if {} {{ {} }}", expr_str(c), line.join(" "));
        }
        Stmt::If(c, a, b, sp)
            if !b.is_empty()
                && one_line_block(f, sp.start, a)
                && b.iter().all(is_simple)
                && same_line(
                    f.src,
                    sp.start,
                    close_brace_after(f.src, stmt_end(b.last().expect("non-empty"))),
                ) =>
        {
            let la: Vec<String> = a.iter().map(simple_str).collect();
            let lb: Vec<String> = b.iter().map(simple_str).collect();
            let _ = writeln!(
                f.out,
                "{pad}if {} {{ {} }} else {{ {} }}",
                expr_str(c),
                la.join(" "),
                lb.join(" ")
            );
        }
        Stmt::Repeat(n, body, _) => {
            let _ = writeln!(f.out, "{pad}repeat {} {{", expr_str(n));
            f.header_comment(stmt_start(s), body.first().map(stmt_start));
            write_block(f, body, indent + 4, stmt_end(s) + 1);
            let _ = writeln!(f.out, "{pad}}}");
        }
        Stmt::While(c, body, _) => {
            let _ = writeln!(f.out, "{pad}while {} {{", expr_str(c));
            f.header_comment(stmt_start(s), body.first().map(stmt_start));
            write_block(f, body, indent + 4, stmt_end(s) + 1);
            let _ = writeln!(f.out, "{pad}}}");
        }
        Stmt::If(c, a, b, _) => {
            let _ = writeln!(f.out, "{pad}if {} {{", expr_str(c));
            f.header_comment(stmt_start(s), a.first().map(stmt_start));
            let a_end = a.last().map_or(0, stmt_end) + 1;
            write_block(f, a, indent + 4, a_end);
            // `else if` chains print flat.
            let mut els = b;
            loop {
                if els.is_empty() {
                    let _ = writeln!(f.out, "{pad}}}");
                    break;
                }
                if let [Stmt::If(c2, a2, b2, _)] = els.as_slice() {
                    let _ = writeln!(f.out, "{pad}}} else if {} {{", expr_str(c2));
                    let end = a2.last().map_or(0, stmt_end) + 1;
                    write_block(f, a2, indent + 4, end);
                    els = b2;
                    continue;
                }
                let _ = writeln!(f.out, "{pad}}} else {{");
                let end = els.last().map_or(0, stmt_end) + 1;
                write_block(f, els, indent + 4, end);
                let _ = writeln!(f.out, "{pad}}}");
                break;
            }
        }
        Stmt::Op(o) => {
            let _ = writeln!(f.out, "{pad}{}", op_str(o));
        }
        Stmt::Overlap(a, b, _) => {
            let _ = writeln!(f.out, "{pad}{} & {}", op_str(a), op_str(b));
        }
        Stmt::Comm(c) => {
            let _ = writeln!(f.out, "{pad}{}", comm_str(c));
        }
        Stmt::Group(v, _) => {
            let inner: Vec<String> = v.iter().map(comm_str).collect();
            let _ = writeln!(f.out, "{pad}group {{ {} }}", inner.join(" "));
        }
        Stmt::Idle(_) => {
            let _ = writeln!(f.out, "{pad}idle");
        }
        Stmt::Part(..) | Stmt::Collective(_) | Stmt::Call(..) | Stmt::Mem(_) | Stmt::Lend(_) => {
            let _ = writeln!(f.out, "{pad}{}", simple_str(s));
        }
    }
}

fn item_sp(it: &Item) -> Sp {
    match it {
        Item::Name(_, s)
        | Item::Param(_, _, s)
        | Item::Vpp(_, s)
        | Item::VppDefault(_, s)
        | Item::Stages(_, s)
        | Item::Microbatches(_, s)
        | Item::Placement(_, s)
        | Item::Let(_, _, s)
        | Item::Fn(_, _, _, s)
        | Item::Require(_, _, s)
        | Item::Rank(_, _, s)
        | Item::Def(_, _, _, s)
        | Item::Literal(_, s)
        | Item::List(_, _, s)
        | Item::Expect(_, _, _, s)
        | Item::Communicator(_, _, s)
        | Item::Moe(_, s)
        | Item::Recompute(_, s)
        | Item::Parts(_, s) => *s,
    }
}

/// Formats a parsed file; `src` is its text (for the comments).
pub fn format_file(file: &File, src: &str) -> String {
    let skip: Vec<(usize, usize)> = file
        .items
        .iter()
        .filter_map(|it| match it {
            Item::Literal(_, sp) => Some((sp.start, sp.end)),
            _ => None,
        })
        .collect();
    let mut f = Fmt {
        out: String::new(),
        comments: comments(src, &skip),
        next: 0,
        src,
    };
    let mut prev_block = false;
    for (k, it) in file.items.iter().enumerate() {
        let is_block = matches!(
            it,
            Item::Rank(..) | Item::Def(..) | Item::Literal(..) | Item::List(..)
        );
        let starts_expects = matches!(it, Item::Expect(..))
            && !matches!(file.items.get(k.wrapping_sub(1)), Some(Item::Expect(..)));
        let start = first_comment_or(&f, item_sp(it).start);
        let blank_in_src = k > 0 && blank_between(src, item_sp(&file.items[k - 1]).end, start);
        if k > 0
            && (is_block || prev_block || starts_expects || blank_in_src)
            && !f.out.ends_with("\n\n")
        {
            f.out.push('\n');
        }
        f.flush_comments(item_sp(it).start, 0);
        match it {
            Item::Name(n, _) => {
                let _ = writeln!(f.out, "schedule \"{n}\"");
            }
            Item::Param(n, d, _) => match d {
                Some(e) => {
                    let _ = writeln!(f.out, "param {n} = {}", expr_str(e));
                }
                None => {
                    let _ = writeln!(f.out, "param {n}");
                }
            },
            Item::Vpp(e, _) => {
                let _ = writeln!(f.out, "vpp {}", expr_str(e));
            }
            Item::VppDefault(e, _) => {
                let _ = writeln!(f.out, "vpp default {}", expr_str(e));
            }
            Item::Stages(e, _) => {
                let _ = writeln!(f.out, "stages {}", expr_str(e));
            }
            Item::Microbatches(e, _) => {
                let _ = writeln!(f.out, "microbatches {}", expr_str(e));
            }
            Item::Placement(p, _) => {
                let t = match p {
                    PlacementSpec::Loop => "loop".to_string(),
                    PlacementSpec::V => "v".to_string(),
                    PlacementSpec::Bidir => "bidir".to_string(),
                    PlacementSpec::List(v) => format!(
                        "[{}]",
                        v.iter().map(expr_str).collect::<Vec<_>>().join(", ")
                    ),
                    PlacementSpec::Map(n, e) => format!("{n} => {}", expr_str(e)),
                };
                let _ = writeln!(f.out, "placement {t}");
            }
            Item::Let(n, e, _) => {
                let _ = writeln!(f.out, "let {n} = {}", expr_str(e));
            }
            Item::Fn(n, params, e, _) => {
                let _ = writeln!(f.out, "fn {n}({}) = {}", params.join(", "), expr_str(e));
            }
            Item::Require(c, m, _) => {
                let _ = writeln!(f.out, "require {}, \"{m}\"", expr_str(c));
            }
            Item::Rank(n, body, sp) => {
                let _ = writeln!(f.out, "rank {n} {{");
                f.header_comment(sp.start, body.first().map(stmt_start));
                let end = body.last().map_or(sp.end, stmt_end) + 1;
                write_block(&mut f, body, 4, end);
                f.out.push_str("}\n");
            }
            Item::Def(n, params, body, sp) => {
                let _ = writeln!(f.out, "def {n}({}) {{", params.join(", "));
                f.header_comment(sp.start, body.first().map(stmt_start));
                let end = body.last().map_or(sp.end, stmt_end) + 1;
                write_block(&mut f, body, 4, end);
                f.out.push_str("}\n");
            }
            Item::List(n, rules, sp) => {
                let _ = writeln!(f.out, "list {n} {{");
                f.header_comment(sp.start, rules.first().map(|r| r.sp().start));
                let end = rules.last().map_or(sp.end, |r| r.sp().end) + 1;
                write_list(&mut f, rules, end);
                f.out.push_str("}\n");
            }
            Item::Literal(body, _) => {
                f.out.push_str("literal {");
                f.out.push_str(body);
                f.out.push_str("}\n");
            }
            Item::Expect(k, e, guard, _) => {
                let _ = write!(f.out, "expect {} {}", k.lhs(), expr_str(e));
                if let Some(g) = guard {
                    let _ = write!(f.out, " if {}", expr_str(g));
                }
                f.out.push('\n');
            }
            Item::Communicator(n, set, _) => {
                let _ = writeln!(f.out, "communicator {n} {}", set_str(set));
            }
            Item::Recompute(set, _) => {
                let _ = writeln!(f.out, "recompute stages {}", set_str(set));
            }
            Item::Moe(set, _) => {
                let _ = writeln!(f.out, "moe {}", set_str(set));
            }
            Item::Parts(order, _) => match order {
                PartsOrder::List(None) => f.out.push_str("parts list\n"),
                PartsOrder::List(Some(e)) => {
                    let _ = writeln!(f.out, "parts list {}", expr_str(e));
                }
                PartsOrder::Adjacent => f.out.push_str("parts adjacent\n"),
            },
        }
        prev_block = is_block;
        let end = match it {
            Item::Rank(_, body, sp) | Item::Def(_, _, body, sp) => {
                close_brace_after(src, body.last().map_or(sp.end, |s| full_end(src, s))) + 1
            }
            Item::List(_, rules, sp) => {
                close_brace_after(src, rules.last().map_or(sp.end, |r| r.sp().end)) + 1
            }
            _ => item_sp(it).end,
        };
        f.trailing(end);
    }
    f.flush_comments(usize::MAX, 0);
    f.out
}

/// The lines of a `list r { }` block, four-space indented, comments and blank lines kept.
fn write_list(f: &mut Fmt<'_>, rules: &[ListRule], end: usize) {
    let end = close_brace_after(f.src, end.saturating_sub(1)).max(end);
    for (k, r) in rules.iter().enumerate() {
        if k > 0
            && blank_between(
                f.src,
                rules[k - 1].sp().end,
                first_comment_or(f, r.sp().start),
            )
        {
            f.out.push('\n');
        }
        f.flush_comments(r.sp().start, 4);
        let line = match r {
            ListRule::Let(n, e, _) => format!("let {n} = {}", expr_str(e)),
            ListRule::Priority {
                kind,
                chunk,
                mb,
                expr,
                ..
            } => format!("{}({chunk}, {mb}) = {}", kind.as_str(), expr_str(expr)),
            ListRule::Memory(e, _) => format!("memory <= {}", expr_str(e)),
            ListRule::Inflight(e, _) => format!("inflight <= {}", expr_str(e)),
            ListRule::Defer(k, _) => format!("defer {}", k.as_str()),
            ListRule::Strict(_) => "strict".to_string(),
            ListRule::OnMemory(p, _) => format!("memory {}", p.as_str()),
        };
        let _ = writeln!(f.out, "    {line}");
        f.trailing(r.sp().end);
    }
    f.flush_comments(end, 4);
}

/// The offset of the first pending comment if it comes before `pos`, else `pos` (a blank line
/// is looked for before the comments that lead an item or statement).
fn first_comment_or(f: &Fmt<'_>, pos: usize) -> usize {
    match f.comments.get(f.next) {
        Some((off, _)) if *off < pos => *off,
        _ => pos,
    }
}
