//! Elaboration: a parsed spec and an instance (P, M, V, parameters) to the IR.

use super::ast::*;
use schedc_ir::text::{SourceMap, Span};
use schedc_ir::{
    Collective, Comm, Communicator, Compute, Instr, Kind, Part, Payload, PayloadKind, Pipeline,
    PlacementKind, Program,
};
use std::collections::VecDeque;

/// One instance of a family: the values of the built-in and user parameters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Instance {
    /// `--pp`: number of pipeline ranks P.
    pub pp: u32,
    /// `--mb`: micro-batches in one step M (DualPipe: both directions together).
    pub mb: u32,
    /// `--vpp`: virtual stages per rank V (default: the spec's `vpp`, else 1).
    pub vpp: Option<u32>,
    /// `--param NAME=VALUE`.
    pub params: Vec<(String, i64)>,
}

/// An elaboration error: where in the spec, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElabError {
    /// The offending construct.
    pub sp: Sp,
    /// What went wrong.
    pub message: String,
    /// A hint.
    pub help: Option<String>,
    /// The rank being elaborated, if any.
    pub rank: Option<u32>,
    /// True for a failed `require` (the instance is outside the family: exit 1, not 2).
    pub refused: bool,
    /// True for bad usage of the command line: an unknown `--param`, or a parameter without
    /// a default that was not given (exit 2, like any other bad usage).
    pub usage: bool,
    /// True for a spec that is malformed whatever the instance: a `def` used with the wrong
    /// number of arguments, recursive, using one defined below it, named as an op, defined
    /// twice or with a parameter twice, or a name that is both a `fn` and a `def`, or a
    /// `list` block's `memory offload|recompute` without a `memory <=` cap (exit 2, as for a
    /// syntax error or a use of no `def`, which the parser finds).
    pub malformed: bool,
    /// Where in the program it happened, innermost first: the loop iterations
    /// (`` in iteration `i = 3` of the `for` loop ``).
    pub context: Vec<String>,
    /// For an error inside the statements of a `def`: the uses it was expanded from,
    /// innermost first (the span of `NAME(args)` and NAME). The error's own span is in the
    /// `def`; these are the use sites, which the diagnostic shows beside it. (Boxed: the
    /// error travels in every `Result` of the elaborator.)
    pub expansions: Box<Vec<(Sp, String)>>,
}

/// A per-rank expectation, evaluated: `values[r]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expectation {
    /// What.
    pub kind: ExpectKind,
    /// The expected value (or bound) per rank; empty for a timing expectation.
    pub values: Vec<i64>,
    /// Per rank, whether the line's `if` guard holds there (all true without a guard); empty
    /// for a timing expectation, whose guard is in its [`Formula`].
    pub applies: Vec<bool>,
    /// The `expect` item.
    pub sp: Sp,
    /// For a timing expectation ([`ExpectKind::is_timing`]): the bound, evaluated later under
    /// the cost model ([`Formula::eval`]).
    pub formula: Option<Formula>,
}

/// The bound of a timing expectation: an expression evaluated with real arithmetic (`/` is
/// exact division) once the cost model is known. It sees the spec's top-level names (P, M,
/// V, S, parameters, `let`s, `fn`s) and the cost model's seconds `F`, `B`, `W`, `BW`, `FB`
/// (an overlapped pair), `DISPATCH`, `COMBINE` (one all-to-all of an MoE op; 0 when the
/// schedule has no MoE parts), `MSG` (one point-to-point message); a spec name shadows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Formula {
    expr: Expr,
    /// The line's `if` guard, evaluated with the same names.
    guard: Option<Expr>,
    /// The top-level bindings where the `expect` item is, as integers (booleans 0/1).
    vars: Vec<(String, i64)>,
    /// The user functions visible there: (name, parameters, body).
    fns: Vec<(String, Vec<String>, Expr)>,
}

impl Formula {
    /// Evaluates the bound with `costs` (name, seconds) bound first.
    ///
    /// Errors: an unknown name, a division by zero, a comparison or boolean, a function
    /// other than min, max, abs and the spec's own, a non-finite result; each with the
    /// offending expression's span.
    pub fn eval(&self, costs: &[(&str, f64)]) -> Result<f64, (Sp, String)> {
        let mut env: Vec<(String, f64)> = costs.iter().map(|(n, v)| (n.to_string(), *v)).collect();
        env.extend(self.vars.iter().map(|(n, v)| (n.clone(), *v as f64)));
        let v = self.real(&self.expr, &env, 0)?;
        if v.is_finite() {
            Ok(v)
        } else {
            Err((self.expr.sp(), "the bound is not a finite number".into()))
        }
    }

    /// Whether the line's `if` guard holds with `costs` bound first (true without a guard).
    ///
    /// Errors: as [`Formula::eval`], and a guard that is not a comparison or a boolean.
    pub fn applies(&self, costs: &[(&str, f64)]) -> Result<bool, (Sp, String)> {
        let Some(g) = &self.guard else {
            return Ok(true);
        };
        let mut env: Vec<(String, f64)> = costs.iter().map(|(n, v)| (n.to_string(), *v)).collect();
        env.extend(self.vars.iter().map(|(n, v)| (n.clone(), *v as f64)));
        self.truth(g, &env, 0)
    }

    fn real(&self, e: &Expr, env: &[(String, f64)], depth: u32) -> Result<f64, (Sp, String)> {
        Ok(match e {
            Expr::Int(v, _) => *v as f64,
            Expr::Bool(_, sp) | Expr::Not(_, sp) => {
                return Err((*sp, "a timing expectation's bound is a number, not a boolean".into()))
            }
            Expr::Var(n, sp) => env
                .iter()
                .rev()
                .find(|(k, _)| k == n)
                .map(|(_, v)| *v)
                .ok_or_else(|| (*sp, format!("unknown name `{n}` (a timing expectation sees P, M, V, S, parameters, `let`s and the cost model's F, B, W, BW, FB, DISPATCH, COMBINE, MSG)")))?,
            Expr::Neg(x, _) => -self.real(x, env, depth)?,
            Expr::If(c, a, b, _) => {
                if self.truth(c, env, depth)? {
                    self.real(a, env, depth)?
                } else {
                    self.real(b, env, depth)?
                }
            }
            Expr::Bin(op, a, b, sp) => {
                let (x, y) = (self.real(a, env, depth)?, self.real(b, env, depth)?);
                match op {
                    BinOp::Add => x + y,
                    BinOp::Sub => x - y,
                    BinOp::Mul => x * y,
                    BinOp::Div => {
                        if y == 0.0 {
                            return Err((b.sp(), "division by zero".into()));
                        }
                        x / y
                    }
                    _ => {
                        return Err((
                            *sp,
                            format!("`{}` has no meaning in a timing expectation's bound (+, -, *, / only)", op.as_str()),
                        ))
                    }
                }
            }
            Expr::Call(name, args, sp) => {
                let vals = args
                    .iter()
                    .map(|a| match a {
                        Arg::Expr(x) => self.real(x, env, depth),
                        Arg::Kind(_, s) => Err((*s, "expected a number, found an op kind".into())),
                    })
                    .collect::<Result<Vec<f64>, _>>()?;
                match name.as_str() {
                    "min" | "max" if !vals.is_empty() => {
                        let f = if name == "min" { f64::min } else { f64::max };
                        vals[1..].iter().fold(vals[0], |a, &b| f(a, b))
                    }
                    "abs" if vals.len() == 1 => vals[0].abs(),
                    _ => {
                        let Some((_, params, body)) =
                            self.fns.iter().rev().find(|(n, _, _)| n == name)
                        else {
                            return Err((*sp, format!("`{name}` is not available in a timing expectation (min, max, abs and the spec's own functions are)")));
                        };
                        if params.len() != vals.len() {
                            return Err((*sp, format!("`{name}` takes {} argument(s), given {}", params.len(), vals.len())));
                        }
                        if depth >= 64 {
                            return Err((*sp, format!("`{name}` calls itself too deeply (64 levels)")));
                        }
                        let mut inner = env.to_vec();
                        inner.extend(params.iter().cloned().zip(vals));
                        self.real(body, &inner, depth + 1)?
                    }
                }
            }
        })
    }

    /// The condition of an `if` in a timing bound: comparisons of numbers, `&&`, `||`, `!`,
    /// `true` and `false`.
    fn truth(&self, e: &Expr, env: &[(String, f64)], depth: u32) -> Result<bool, (Sp, String)> {
        Ok(match e {
            Expr::Bool(v, _) => *v,
            Expr::Not(x, _) => !self.truth(x, env, depth)?,
            Expr::Bin(BinOp::And, a, b, _) => {
                self.truth(a, env, depth)? && self.truth(b, env, depth)?
            }
            Expr::Bin(BinOp::Or, a, b, _) => {
                self.truth(a, env, depth)? || self.truth(b, env, depth)?
            }
            Expr::Bin(
                op @ (BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge),
                a,
                b,
                _,
            ) => {
                let (x, y) = (self.real(a, env, depth)?, self.real(b, env, depth)?);
                match op {
                    BinOp::Eq => x == y,
                    BinOp::Ne => x != y,
                    BinOp::Lt => x < y,
                    BinOp::Le => x <= y,
                    BinOp::Gt => x > y,
                    _ => x >= y,
                }
            }
            other => return Err((
                other.sp(),
                "an `if` condition in a timing expectation's bound is a comparison or a boolean"
                    .into(),
            )),
        })
    }
}

/// The result of elaborating one instance.
#[derive(Clone, Debug)]
pub struct Elaborated {
    /// The schedule.
    pub program: Program,
    /// For each instruction, the span of the spec statement that emitted it.
    pub spans: SourceMap,
    /// The expectations to check.
    pub expects: Vec<Expectation>,
    /// The spec's name, if it has one.
    pub name: Option<String>,
    /// Things the user should know about the instance (e.g. that V defaulted to 1).
    pub notes: Vec<String>,
    /// The part order of the spec's `parts` item: the `--moe` selection it stands for
    /// (`auto:listN` or `auto:adjacent`), applied where the command line gives no `--moe`.
    pub parts: Option<crate::moe::MoeStages>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Val {
    Int(i64),
    Bool(bool),
}

struct Binding {
    name: String,
    val: Val,
    mutable: bool,
}

/// A user function: parameters, body, and how many bindings were in scope where it was
/// defined (it sees those, and its parameters).
struct FnDef {
    name: String,
    params: Vec<String>,
    body: Expr,
    scope: usize,
}

/// A `def`: a named group of statements, its parameters, and what it sees (the bindings
/// and the `fn`s and `def`s defined above it).
struct DefDef {
    name: String,
    params: Vec<String>,
    body: Vec<Stmt>,
    scope: usize,
    fns: std::rc::Rc<Vec<FnDef>>,
    defs: std::rc::Rc<Vec<DefDef>>,
    sp: Sp,
}

struct Env {
    vars: Vec<Binding>,
    fns: std::rc::Rc<Vec<FnDef>>,
    defs: std::rc::Rc<Vec<DefDef>>,
    depth: u32,
}

impl Env {
    fn get(&self, n: &str) -> Option<Val> {
        self.vars.iter().rev().find(|b| b.name == n).map(|b| b.val)
    }
    fn push(&mut self, n: &str, v: Val, mutable: bool) {
        self.vars.push(Binding {
            name: n.to_string(),
            val: v,
            mutable,
        });
    }
}

fn err(sp: Sp, message: impl Into<String>) -> ElabError {
    ElabError {
        sp,
        message: message.into(),
        help: None,
        rank: None,
        refused: false,
        usage: false,
        malformed: false,
        context: Vec::new(),
        expansions: Box::default(),
    }
}

/// An op of a rank: (kind, stage, micro-batch).
type OpId = (Kind, u32, u32);
/// The uses of `def`s an op was emitted from, innermost first.
type Uses = Vec<(Sp, String)>;

/// Per-rank elaboration state.
struct RankState<'a> {
    rank: u32,
    /// Stage of each local chunk.
    chunks: Vec<u32>,
    mbs: u32,
    fwd: Vec<u32>,
    bwd: Vec<u32>,
    wdone: Vec<u32>,
    /// Pending weight gradients: (chunk, mb), oldest first.
    pending: VecDeque<(usize, u32)>,
    /// Per chunk, the micro-batches whose forward / backward (B or BW) has been emitted
    /// (explicit `F(c, m)` can leave gaps below a counter).
    ran: [Vec<std::collections::HashSet<u32>>; 2],
    /// Ops given in MoE parts whose four parts have not all been given yet, oldest first:
    /// (stage, kind, mb, bitmask of the parts seen).
    open: Vec<(u32, Kind, u32, u8)>,
    out: Vec<Instr>,
    spans: Vec<Span>,
    /// The uses of `def`s being expanded, outermost first (span, label).
    chain: Vec<(Sp, String)>,
    /// The compute ops emitted inside a `def`: (kind, stage, mb) and the uses, innermost
    /// first.
    expanded: Vec<(OpId, Uses)>,
    budget: &'a mut u64,
    /// True in a `list` block: its priorities are fixed expressions, so the progress
    /// functions (`done`, `left`, `pending`) of a rank program mean nothing there.
    list: bool,
}

/// Elaboration steps (loop iterations and ops) allowed per instance; see
/// [`set_step_budget`].
static STEP_BUDGET: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(20_000_000);

/// Sets the number of elaboration steps allowed per instance (default 20 million; every
/// emitted op and idle slot is a step, so this also bounds the program's size): a spec
/// whose loops run longer is an error, not a hang. Fuzzing lowers it.
pub fn set_step_budget(steps: u64) {
    STEP_BUDGET.store(steps, std::sync::atomic::Ordering::Relaxed);
}

fn eval(e: &Expr, env: &Env, st: Option<&RankState<'_>>) -> Result<Val, ElabError> {
    Ok(match e {
        Expr::Int(v, _) => Val::Int(*v),
        Expr::Bool(b, _) => Val::Bool(*b),
        Expr::Var(n, sp) => env.get(n).ok_or_else(|| {
            let mut e = err(*sp, format!("unknown name `{n}`"));
            e.help = Some(
                "names in scope: P, M, V, S, the rank variable inside `rank r { }`, parameters, and `let`/`var`/loop variables"
                    .into(),
            );
            e
        })?,
        Expr::Neg(x, sp) => Val::Int(
            int(eval(x, env, st)?, *sp)?
                .checked_neg()
                .ok_or_else(|| err(*sp, "integer overflow"))?,
        ),
        Expr::Not(x, sp) => Val::Bool(!boolean(eval(x, env, st)?, *sp)?),
        Expr::Bin(op, a, b, sp) => {
            let va = eval(a, env, st)?;
            // Short-circuit logic.
            if *op == BinOp::And {
                return Ok(Val::Bool(boolean(va, a.sp())? && boolean(eval(b, env, st)?, b.sp())?));
            }
            if *op == BinOp::Or {
                return Ok(Val::Bool(boolean(va, a.sp())? || boolean(eval(b, env, st)?, b.sp())?));
            }
            let vb = eval(b, env, st)?;
            match op {
                BinOp::Eq | BinOp::Ne => {
                    let eq = match (va, vb) {
                        (Val::Int(x), Val::Int(y)) => x == y,
                        (Val::Bool(x), Val::Bool(y)) => x == y,
                        _ => return Err(err(*sp, "cannot compare an integer with a boolean")),
                    };
                    Val::Bool(if *op == BinOp::Eq { eq } else { !eq })
                }
                _ => {
                    let (x, y) = (int(va, a.sp())?, int(vb, b.sp())?);
                    let ov = || err(*sp, "integer overflow");
                    match op {
                        BinOp::Lt => Val::Bool(x < y),
                        BinOp::Le => Val::Bool(x <= y),
                        BinOp::Gt => Val::Bool(x > y),
                        BinOp::Ge => Val::Bool(x >= y),
                        BinOp::Add => Val::Int(x.checked_add(y).ok_or_else(ov)?),
                        BinOp::Sub => Val::Int(x.checked_sub(y).ok_or_else(ov)?),
                        BinOp::Mul => Val::Int(x.checked_mul(y).ok_or_else(ov)?),
                        BinOp::Div | BinOp::Mod => {
                            if y == 0 {
                                return Err(err(b.sp(), "division by zero"));
                            }
                            if x == i64::MIN && y == -1 {
                                return Err(ov());
                            }
                            let q = x.div_euclid(y);
                            let r = x.rem_euclid(y);
                            // Floor semantics: the remainder takes the divisor's sign.
                            let (q, r) = if r != 0 && y < 0 { (q - 1, r + y) } else { (q, r) };
                            Val::Int(if *op == BinOp::Div { q } else { r })
                        }
                        _ => unreachable!(),
                    }
                }
            }
        }
        Expr::Call(name, args, sp) => call(name, args, *sp, env, st)?,
        Expr::If(c, a, b, _) => {
            if boolean(eval(c, env, st)?, c.sp())? {
                eval(a, env, st)?
            } else {
                eval(b, env, st)?
            }
        }
    })
}

fn int(v: Val, sp: Sp) -> Result<i64, ElabError> {
    match v {
        Val::Int(x) => Ok(x),
        Val::Bool(_) => Err(err(sp, "expected an integer, found a boolean")),
    }
}

fn boolean(v: Val, sp: Sp) -> Result<bool, ElabError> {
    match v {
        Val::Bool(x) => Ok(x),
        Val::Int(_) => {
            let mut e = err(sp, "expected a boolean, found an integer");
            e.help = Some("compare it, e.g. `x > 0`".into());
            Err(e)
        }
    }
}

fn call(
    name: &str,
    args: &[Arg],
    sp: Sp,
    env: &Env,
    st: Option<&RankState<'_>>,
) -> Result<Val, ElabError> {
    let ints = |args: &[Arg]| -> Result<Vec<i64>, ElabError> {
        args.iter()
            .map(|a| match a {
                Arg::Expr(e) => int(eval(e, env, st)?, e.sp()),
                Arg::Kind(_, s) => Err(err(*s, "expected an integer, found an op kind")),
            })
            .collect()
    };
    match name {
        "min" | "max" => {
            let v = ints(args)?;
            if v.is_empty() {
                return Err(err(sp, format!("`{name}` needs at least one argument")));
            }
            Ok(Val::Int(if name == "min" {
                *v.iter().min().expect("non-empty")
            } else {
                *v.iter().max().expect("non-empty")
            }))
        }
        "abs" => {
            let v = ints(args)?;
            if v.len() != 1 {
                return Err(err(sp, "`abs` takes one argument"));
            }
            Ok(Val::Int(
                v[0].checked_abs()
                    .ok_or_else(|| err(sp, "integer overflow"))?,
            ))
        }
        "done" | "left" | "pending" if st.is_some_and(|st| st.list) => Err(err(
            sp,
            format!(
                "`{name}` reads a rank program's progress and is not defined in a `list` block: a priority is a fixed expression of the chunk, micro-batch and rank (the list scheduler decides the progress)"
            ),
        )),
        "done" | "left" => {
            let st = st.ok_or_else(|| {
                err(
                    sp,
                    format!("`{name}` is only defined inside `rank r {{ }}`"),
                )
            })?;
            let (Some(Arg::Kind(k, _)), Some(Arg::Expr(c)), 2) =
                (args.first(), args.get(1), args.len())
            else {
                return Err(err(
                    sp,
                    format!("`{name}` takes an op kind and a chunk, e.g. `{name}(F, 0)`"),
                ));
            };
            let c = chunk(st, int(eval(c, env, Some(st))?, c.sp())?, c.sp())?;
            let d = match k {
                Kind::F => st.fwd[c],
                Kind::B | Kind::BW => st.bwd[c],
                Kind::W => st.wdone[c],
            } as i64;
            Ok(Val::Int(if name == "done" { d } else { st.mbs as i64 - d }))
        }
        "pending" => {
            let st = st.ok_or_else(|| err(sp, "`pending` is only defined inside `rank r { }`"))?;
            let v = ints(args)?;
            Ok(Val::Int(match v.as_slice() {
                [] => st.pending.len() as i64,
                [c] => {
                    let c = chunk(st, *c, sp)?;
                    st.pending.iter().filter(|p| p.0 == c).count() as i64
                }
                _ => return Err(err(sp, "`pending` takes at most one chunk")),
            }))
        }
        "chunks" => {
            let st = st.ok_or_else(|| err(sp, "`chunks` is only defined inside `rank r { }`"))?;
            if !args.is_empty() {
                return Err(err(sp, "`chunks()` takes no argument"));
            }
            Ok(Val::Int(st.chunks.len() as i64))
        }
        "stage" => {
            let st = st.ok_or_else(|| err(sp, "`stage` is only defined inside `rank r { }`"))?;
            let v = ints(args)?;
            if v.len() != 1 {
                return Err(err(sp, "`stage` takes one chunk"));
            }
            Ok(Val::Int(st.chunks[chunk(st, v[0], sp)?] as i64))
        }
        _ if env.fns.iter().any(|f| f.name == name) => {
            let f = env
                .fns
                .iter()
                .rev()
                .find(|f| f.name == name)
                .expect("present");
            if args.len() != f.params.len() {
                return Err(err(
                    sp,
                    format!(
                        "`{name}` takes {} argument(s), given {}",
                        f.params.len(),
                        args.len()
                    ),
                ));
            }
            if env.depth >= 64 {
                return Err(err(
                    sp,
                    format!("`{name}` calls itself too deeply (64 levels)"),
                ));
            }
            let vals = ints(args)?;
            let mut inner = Env {
                vars: env.vars[..f.scope.min(env.vars.len())]
                    .iter()
                    .map(|b| Binding {
                        name: b.name.clone(),
                        val: b.val,
                        mutable: false,
                    })
                    .collect(),
                fns: env.fns.clone(),
                defs: env.defs.clone(),
                depth: env.depth + 1,
            };
            for (p, v) in f.params.iter().zip(vals) {
                inner.push(p, Val::Int(v), false);
            }
            eval(&f.body, &inner, st)
        }
        _ => {
            let mut e = err(sp, format!("unknown function `{name}`"));
            e.help = Some(
                "functions: min, max, abs, done(K, c), left(K, c), pending(), pending(c), stage(c), chunks()"
                    .into(),
            );
            Err(e)
        }
    }
}

fn chunk(st: &RankState<'_>, c: i64, sp: Sp) -> Result<usize, ElabError> {
    if c < 0 || c as usize >= st.chunks.len() {
        return Err(err(
            sp,
            format!(
                "chunk {c} does not exist on rank {}: it holds {} chunk(s) (stages {:?})",
                st.rank,
                st.chunks.len(),
                st.chunks
            ),
        ));
    }
    Ok(c as usize)
}

fn u32_of(v: i64, sp: Sp, what: &str) -> Result<u32, ElabError> {
    u32::try_from(v).map_err(|_| err(sp, format!("{what} {v} is out of range")))
}

fn op_compute(o: &OpStmt, env: &Env, st: &mut RankState<'_>) -> Result<Option<Compute>, ElabError> {
    let kind = o.kind;
    let (stage, mb) = match &o.target {
        Target::Stage(s, m) => {
            let s = u32_of(int(eval(s, env, Some(st))?, s.sp())?, s.sp(), "stage")?;
            let m = u32_of(int(eval(m, env, Some(st))?, m.sp())?, m.sp(), "micro-batch")?;
            if let Some(c) = st.chunks.iter().position(|&x| x == s) {
                note_explicit(st, kind, c, m);
            }
            (s, m)
        }
        Target::Chunk(c, m) => {
            let ci = chunk(st, int(eval(c, env, Some(st))?, c.sp())?, c.sp())?;
            let m = u32_of(int(eval(m, env, Some(st))?, m.sp())?, m.sp(), "micro-batch")?;
            note_explicit(st, kind, ci, m);
            (st.chunks[ci], m)
        }
        Target::Next(None) => {
            if kind != Kind::W {
                return Err(err(
                    o.sp,
                    format!(
                        "{}() needs a chunk: {}(c) runs the next micro-batch of local chunk c",
                        kind.as_str(),
                        kind.as_str()
                    ),
                ));
            }
            match st.pending.pop_front() {
                Some((c, m)) => {
                    st.wdone[c] += 1;
                    (st.chunks[c], m)
                }
                None if o.optional => return Ok(None),
                None => {
                    return Err(err(o.sp, format!("W() on rank {}: no weight gradient is pending (every B so far already has its W)", st.rank)))
                }
            }
        }
        Target::Next(Some(c)) => {
            let ci = chunk(st, int(eval(c, env, Some(st))?, c.sp())?, c.sp())?;
            let s = st.chunks[ci];
            match kind {
                Kind::F | Kind::B | Kind::BW => {
                    let ctr = if kind == Kind::F { &mut st.fwd[ci] } else { &mut st.bwd[ci] };
                    if *ctr >= st.mbs {
                        if o.optional {
                            return Ok(None);
                        }
                        let what = if kind == Kind::F { "forward" } else { "backward" };
                        let ran = &st.ran[usize::from(kind != Kind::F)][ci];
                        let gaps: Vec<String> = (0..st.mbs)
                            .filter(|m| !ran.contains(m))
                            .take(6)
                            .map(|m| m.to_string())
                            .collect();
                        let mut e = if gaps.is_empty() {
                            let mut e = err(o.sp, format!(
                                "{}({ci}) on rank {}: chunk {ci} (stage {s}) has no micro-batch left; all {} already have their {what}",
                                kind.as_str(), st.rank, st.mbs,
                            ));
                            e.help = Some(format!("`{}?({ci})` runs it only while micro-batches remain", kind.as_str()));
                            e
                        } else {
                            let mut e = err(o.sp, format!(
                                "{}({ci}) on rank {}: chunk {ci} (stage {s})'s {what} counter is past its last micro-batch ({}), but micro-batch(es) {} still have no {what}",
                                kind.as_str(), st.rank, st.mbs - 1, gaps.join(", "),
                            ));
                            e.help = Some(format!(
                                "an explicit `{}({ci}, m)` moves the counter past m; name the missing micro-batches explicitly too",
                                kind.as_str()
                            ));
                            e
                        };
                        e.rank = Some(st.rank);
                        return Err(e);
                    }
                    let m = *ctr;
                    *ctr += 1;
                    if kind == Kind::B {
                        st.pending.push_back((ci, m));
                    }
                    if kind == Kind::BW {
                        st.wdone[ci] += 1;
                    }
                    (s, m)
                }
                Kind::W => match st.pending.iter().position(|p| p.0 == ci) {
                    Some(k) => {
                        let (_, m) = st.pending.remove(k).expect("present");
                        st.wdone[ci] += 1;
                        (s, m)
                    }
                    None if o.optional => return Ok(None),
                    None => {
                        return Err(err(o.sp, format!(
                            "W({ci}) on rank {}: chunk {ci} has no pending weight gradient (run B({ci}) first)",
                            st.rank
                        )))
                    }
                },
            }
        }
    };
    if let Some(c) = st.chunks.iter().position(|&x| x == stage) {
        if kind != Kind::W {
            st.ran[usize::from(kind != Kind::F)][c].insert(mb);
        }
    }
    Ok(Some(Compute {
        checkpoint: o.checkpoint,
        ..Compute::new(kind, stage, mb)
    }))
}

fn part_bit(p: Part) -> u8 {
    match p {
        Part::Whole => 0,
        Part::Attn => 1,
        Part::Dispatch => 2,
        Part::Mlp => 4,
        Part::Combine => 8,
    }
}

/// One MoE part of an op (`F(c).attn`): it joins the oldest open op of its stage and kind
/// that is missing this part, else it opens a new op, taking the micro-batch as the whole op
/// would (counters, the pending-W queue). The op closes once all four parts are given; a
/// part given out of order is left for the checker to report, at this statement.
fn part_compute(
    o: &OpStmt,
    part: Part,
    sp: Sp,
    env: &Env,
    st: &mut RankState<'_>,
) -> Result<Option<Compute>, ElabError> {
    if o.kind == Kind::W {
        let mut e = err(
            sp,
            "W has no MoE parts: only F, B and BW are split (attention, dispatch, MLP, combine)",
        );
        e.help = Some("write the weight gradient whole: `W(c)`".into());
        return Err(e);
    }
    let bit = part_bit(part);
    // The stage (and micro-batch, when named) the statement refers to.
    let (stage, named_mb) = match &o.target {
        Target::Next(None) => {
            return Err(err(o.sp, format!("{}() needs a chunk", o.kind.as_str())))
        }
        Target::Next(Some(c)) => {
            let ci = chunk(st, int(eval(c, env, Some(st))?, c.sp())?, c.sp())?;
            (st.chunks[ci], None)
        }
        Target::Chunk(c, m) => {
            let ci = chunk(st, int(eval(c, env, Some(st))?, c.sp())?, c.sp())?;
            let m = u32_of(int(eval(m, env, Some(st))?, m.sp())?, m.sp(), "micro-batch")?;
            (st.chunks[ci], Some(m))
        }
        Target::Stage(s, m) => {
            let s = u32_of(int(eval(s, env, Some(st))?, s.sp())?, s.sp(), "stage")?;
            let m = u32_of(int(eval(m, env, Some(st))?, m.sp())?, m.sp(), "micro-batch")?;
            (s, Some(m))
        }
    };
    let join = st.open.iter().position(|&(s, k, m, seen)| {
        s == stage && k == o.kind && seen & bit == 0 && named_mb.is_none_or(|nm| nm == m)
    });
    let mb = match join {
        Some(ix) => {
            let e = &mut st.open[ix];
            e.3 |= bit;
            let m = e.2;
            if e.3 == 15 {
                st.open.remove(ix);
            }
            m
        }
        None => {
            let Some(c) = op_compute(o, env, st)? else {
                return Ok(None);
            };
            st.open.push((c.stage, o.kind, c.mb, bit));
            c.mb
        }
    };
    if o.checkpoint {
        return Err(err(
            sp,
            "only a whole forward can be checkpointed: `F(c)!` has no MoE parts",
        ));
    }
    Ok(Some(Compute {
        kind: o.kind,
        stage,
        mb,
        part,
        checkpoint: false,
    }))
}

/// Keeps counters and pending Ws consistent when a spec names micro-batches explicitly.
fn note_explicit(st: &mut RankState<'_>, kind: Kind, c: usize, m: u32) {
    match kind {
        Kind::F => st.fwd[c] = st.fwd[c].max(m + 1),
        Kind::B => {
            st.bwd[c] = st.bwd[c].max(m + 1);
            st.pending.push_back((c, m));
        }
        Kind::BW => {
            st.bwd[c] = st.bwd[c].max(m + 1);
            st.wdone[c] += 1;
        }
        Kind::W => {
            if let Some(k) = st.pending.iter().position(|p| *p == (c, m)) {
                st.pending.remove(k);
            }
            st.wdone[c] += 1;
        }
    }
}

fn span(sp: Sp) -> Span {
    Span {
        start: sp.start as u32,
        len: (sp.end - sp.start) as u32,
    }
}

fn comm(c: &CommStmt, env: &Env, st: &RankState<'_>) -> Result<Comm, ElabError> {
    let s = u32_of(
        int(eval(&c.stage, env, Some(st))?, c.stage.sp())?,
        c.stage.sp(),
        "stage",
    )?;
    let m = u32_of(
        int(eval(&c.mb, env, Some(st))?, c.mb.sp())?,
        c.mb.sp(),
        "micro-batch",
    )?;
    let p = u32_of(
        int(eval(&c.peer, env, Some(st))?, c.peer.sp())?,
        c.peer.sp(),
        "peer rank",
    )?;
    let kind = if c.op.ends_with('A') {
        PayloadKind::Act
    } else {
        PayloadKind::Grad
    };
    let payload = Payload {
        kind,
        stage: s,
        mb: m,
    };
    Ok(if c.op.starts_with('S') {
        Comm::Send {
            payload,
            peer: p,
            channel: 0,
        }
    } else {
        Comm::Recv {
            payload,
            peer: p,
            channel: 0,
        }
    })
}

/// The use of a `def`, `NAME(args)`: its statements run with the parameters bound to the
/// arguments' values, in the scope of the definition; an error inside carries the use site.
fn expand(
    n: &str,
    args: &[Expr],
    sp: Sp,
    env: &mut Env,
    st: &mut RankState<'_>,
) -> Result<(), ElabError> {
    let defs = env.defs.clone();
    let Some(d) = defs.iter().rev().find(|d| d.name == n) else {
        let mut e = err(sp, format!("unknown statement `{n}(..)`: no `def {n}`"));
        e.malformed = true;
        let best = super::parse::closest(n, defs.iter().map(|d| d.name.as_str()));
        e.help = Some(match best {
            Some(name) => format!("did you mean `{name}`?"),
            None if defs.is_empty() => {
                "define it with `def NAME(params) { statements }` above its first use".into()
            }
            None => format!(
                "the defs in scope: {}",
                defs.iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
        return Err(e);
    };
    if args.len() != d.params.len() {
        let mut e = err(
            sp,
            format!(
                "`{n}` takes {} argument(s) ({}), given {}",
                d.params.len(),
                d.params.join(", "),
                args.len()
            ),
        );
        e.expansions.push((d.sp, format!("`def {n}` is here")));
        e.malformed = true;
        return Err(e);
    }
    let mut vals = Vec::with_capacity(args.len());
    for a in args {
        vals.push(eval(a, env, Some(st))?);
    }
    let mut inner = Env {
        vars: env.vars[..d.scope.min(env.vars.len())]
            .iter()
            .map(|b| Binding {
                name: b.name.clone(),
                val: b.val,
                mutable: false,
            })
            .collect(),
        fns: d.fns.clone(),
        defs: d.defs.clone(),
        depth: 0,
    };
    for (p, v) in d.params.iter().zip(vals) {
        inner.push(p, v, false);
    }
    st.chain.push((sp, format!("in this use of `{n}`")));
    let res = exec(&d.body, &mut inner, st);
    st.chain.pop();
    res.map_err(|mut e| {
        e.expansions.push((sp, format!("in this use of `{n}`")));
        e
    })
}

/// Inside a `def`'s expansion: records the uses for the compute ops of the instruction just
/// emitted (for the checks' diagnostics, [`SourceMap::expanded`]).
fn note_expanded(st: &mut RankState<'_>) {
    if st.chain.is_empty() {
        return;
    }
    let Some(i) = st.out.last() else { return };
    let uses: Vec<(Sp, String)> = st.chain.iter().rev().cloned().collect();
    let mut keys = Vec::new();
    i.for_each_compute(|c| keys.push((c.kind, c.stage, c.mb)));
    for k in keys {
        st.expanded.push((k, uses.clone()));
    }
}

fn exec(body: &[Stmt], env: &mut Env, st: &mut RankState<'_>) -> Result<(), ElabError> {
    let mark = env.vars.len();
    let r = exec_inner(body, env, st);
    env.vars.truncate(mark);
    r
}

/// The (global stage, micro-batch) a memory or lending op (`OFFLOAD`, `RELOAD`, `RECOMPUTE`,
/// `LEND`, `RETURN`; `name` for the message) names: `op(c, m)` with a local chunk or
/// `op(stage s, m)`. Errors: a bad chunk or micro-batch, or no micro-batch (`op(c)`), at the
/// expression's span.
fn stage_mb(
    target: &Target,
    name: &str,
    sp: Sp,
    env: &Env,
    st: &RankState<'_>,
) -> Result<(u32, u32), ElabError> {
    let mb_of = |mb: &Expr| {
        u32_of(
            int(eval(mb, env, Some(st))?, mb.sp())?,
            mb.sp(),
            "micro-batch",
        )
    };
    match target {
        Target::Chunk(c, mb) => {
            let ci = chunk(st, int(eval(c, env, Some(st))?, c.sp())?, c.sp())?;
            Ok((st.chunks[ci], mb_of(mb)?))
        }
        Target::Stage(s, mb) => {
            let s = u32_of(int(eval(s, env, Some(st))?, s.sp())?, s.sp(), "stage")?;
            Ok((s, mb_of(mb)?))
        }
        Target::Next(_) => Err(err(
            sp,
            format!("{name}(c, m) needs a chunk and a micro-batch"),
        )),
    }
}

fn tick(st: &mut RankState<'_>, sp: Sp) -> Result<(), ElabError> {
    *st.budget += 1;
    let limit = STEP_BUDGET.load(std::sync::atomic::Ordering::Relaxed);
    if *st.budget > limit {
        return Err(err(
            sp,
            format!("elaboration exceeds {limit} steps (a loop that does not end?)"),
        ));
    }
    Ok(())
}

fn exec_inner(body: &[Stmt], env: &mut Env, st: &mut RankState<'_>) -> Result<(), ElabError> {
    for s in body {
        match s {
            Stmt::Let(n, e, _) => {
                let v = eval(e, env, Some(st))?;
                env.push(n, v, false);
            }
            Stmt::Var(n, e, _) => {
                let v = eval(e, env, Some(st))?;
                env.push(n, v, true);
            }
            Stmt::Assign(n, e, sp) => {
                let v = eval(e, env, Some(st))?;
                match env.vars.iter_mut().rev().find(|b| &b.name == n) {
                    Some(b) if b.mutable => b.val = v,
                    Some(_) => {
                        let mut e = err(*sp, format!("`{n}` is not mutable"));
                        e.help = Some(format!("declare it with `var {n} = ...`"));
                        return Err(e);
                    }
                    None => return Err(err(*sp, format!("unknown name `{n}`"))),
                }
            }
            Stmt::For {
                var,
                from,
                to,
                inclusive,
                step,
                body,
                sp,
            } => {
                let a = int(eval(from, env, Some(st))?, from.sp())?;
                let b = int(eval(to, env, Some(st))?, to.sp())?;
                let k = match step {
                    Some(e) => int(eval(e, env, Some(st))?, e.sp())?,
                    None => 1,
                };
                if k == 0 {
                    return Err(err(*sp, "`step` must not be 0"));
                }
                // A negative step counts down: `for i in 5..=0 step -1` runs 5, 4, ..., 0.
                let in_range = |i: i64| match (k > 0, *inclusive) {
                    (true, true) => i <= b,
                    (true, false) => i < b,
                    (false, true) => i >= b,
                    (false, false) => i > b,
                };
                let mut i = a;
                while in_range(i) {
                    tick(st, *sp)?;
                    env.push(var, Val::Int(i), false);
                    let r = exec(body, env, st);
                    env.vars.pop();
                    r.map_err(|mut e| {
                        e.context
                            .push(format!("in iteration `{var} = {i}` of the `for` loop"));
                        e
                    })?;
                    i = match i.checked_add(k) {
                        Some(x) => x,
                        None => break,
                    };
                }
            }
            Stmt::Repeat(n, body, sp) => {
                let n = int(eval(n, env, Some(st))?, n.sp())?;
                for k in 0..n.max(0) {
                    tick(st, *sp)?;
                    exec(body, env, st).map_err(|mut e| {
                        e.context.push(format!(
                            "in iteration {} of {n} of the `repeat` loop",
                            k + 1
                        ));
                        e
                    })?;
                }
            }
            Stmt::While(c, body, sp) => {
                let mut k = 0u64;
                while boolean(eval(c, env, Some(st))?, c.sp())? {
                    tick(st, *sp)?;
                    k += 1;
                    exec(body, env, st).map_err(|mut e| {
                        e.context
                            .push(format!("in iteration {k} of the `while` loop"));
                        e
                    })?;
                }
            }
            Stmt::If(c, a, b, _) => {
                if boolean(eval(c, env, Some(st))?, c.sp())? {
                    exec(a, env, st)?;
                } else {
                    exec(b, env, st)?;
                }
            }
            Stmt::Op(o) => {
                tick(st, o.sp)?;
                if let Some(c) = op_compute(o, env, st)? {
                    st.out.push(Instr::Compute(c));
                    st.spans.push(span(o.sp));
                    note_expanded(st);
                }
            }
            Stmt::Overlap(a, b, sp) => {
                tick(st, *sp)?;
                if a.kind != Kind::F || !matches!(b.kind, Kind::B | Kind::BW) {
                    return Err(err(
                        *sp,
                        "an overlapped pair is a forward then a backward: `F(c) & BW(c2)`",
                    ));
                }
                let f = op_compute(a, env, st)?;
                let bw = op_compute(b, env, st)?;
                match (f, bw) {
                    (Some(f), Some(bw)) => st.out.push(Instr::Overlap { fwd: f, bwd: bw }),
                    (Some(c), None) | (None, Some(c)) => st.out.push(Instr::Compute(c)),
                    (None, None) => continue,
                }
                st.spans.push(span(*sp));
                note_expanded(st);
            }
            Stmt::Comm(c) => {
                tick(st, c.sp)?;
                let m = comm(c, env, st)?;
                st.out.push(Instr::Comm(m));
                st.spans.push(span(c.sp));
            }
            Stmt::Group(v, sp) => {
                tick(st, *sp)?;
                let g = v
                    .iter()
                    .map(|c| comm(c, env, st))
                    .collect::<Result<Vec<_>, _>>()?;
                st.out.push(Instr::Group(g));
                st.spans.push(span(*sp));
            }
            Stmt::Idle(sp) => {
                tick(st, *sp)?;
                st.out.push(Instr::Idle);
                st.spans.push(span(*sp));
            }
            Stmt::Mem(m) => {
                tick(st, m.sp)?;
                let (stage, mb) = stage_mb(&m.target, m.kind.name(), m.sp, env, st)?;
                st.out.push(Instr::Mem(schedc_ir::MemOp {
                    kind: m.kind,
                    stage,
                    mb,
                }));
                st.spans.push(span(m.sp));
            }
            Stmt::Lend(m) => {
                tick(st, m.sp)?;
                let name = if m.kind == PayloadKind::Lend {
                    "LEND"
                } else {
                    "RETURN"
                };
                let (stage, mb) = stage_mb(&m.target, name, m.sp, env, st)?;
                let peer = u32_of(
                    int(eval(&m.peer, env, Some(st))?, m.peer.sp())?,
                    m.peer.sp(),
                    "peer rank",
                )?;
                let channel = match &m.channel {
                    Some(c) => u32_of(int(eval(c, env, Some(st))?, c.sp())?, c.sp(), "channel")?,
                    None => 0,
                };
                let payload = Payload {
                    kind: m.kind,
                    stage,
                    mb,
                };
                st.out.push(Instr::Comm(if m.send {
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
                }));
                st.spans.push(span(m.sp));
            }
            Stmt::Part(o, part, sp) => {
                tick(st, *sp)?;
                if let Some(c) = part_compute(o, *part, *sp, env, st)? {
                    st.out.push(Instr::Compute(c));
                    st.spans.push(span(*sp));
                    note_expanded(st);
                }
            }
            Stmt::Call(n, args, sp) => {
                tick(st, *sp)?;
                expand(n, args, *sp, env, st)?;
            }
            Stmt::Collective(c) => {
                tick(st, c.sp)?;
                let label = interpolate(&c.label, env);
                if label.is_empty()
                    || label.contains(|ch: char| ch.is_whitespace() || ",(){}".contains(ch))
                {
                    let mut e = err(
                        c.sp,
                        format!("the collective label `{label}` must be one word without `,`, `(`, `)`, `{{`, `}}` or white space"),
                    );
                    e.help = Some("write it like `dispatch.{m}`".into());
                    return Err(e);
                }
                st.out
                    .push(Instr::Comm(Comm::Collective(Box::new(Collective {
                        comm: c.comm.clone(),
                        label,
                    }))));
                st.spans.push(span(c.sp));
            }
        }
    }
    Ok(())
}

/// Elaborates `file` for `inst`, list-scheduling (`list r { }`) under unit op times
/// (F = B = W = 1, BW = 2, free communication: the costs of `schedc check`).
///
/// Errors: every failed `require` (with `refused` set), or the first elaboration error
/// (unknown name, division by zero, a chunk with no micro-batch left, ...), each with its span.
pub fn elaborate(file: &File, inst: &Instance) -> Result<Elaborated, Vec<ElabError>> {
    elaborate_with(file, inst, &crate::sim::cost::CostModel::default())
}

/// [`elaborate`], with a `list r { }` block scheduled under the op times and message latency
/// of `cost` (seconds; only the compute times and `p2p` are read).
pub fn elaborate_with(
    file: &File,
    inst: &Instance,
    cost: &crate::sim::cost::CostModel,
) -> Result<Elaborated, Vec<ElabError>> {
    let mut env = Env {
        vars: Vec::new(),
        fns: std::rc::Rc::new(Vec::new()),
        defs: std::rc::Rc::new(Vec::new()),
        depth: 0,
    };
    let mut name = None;
    let any_sp = Sp::default();
    // Fixed V.
    let mut fixed_v: Option<(Expr, Sp)> = None;
    let mut default_v: Option<(Expr, Sp)> = None;
    let mut stages_e: Option<&Expr> = None;
    let mut mbs_e: Option<&Expr> = None;
    let mut placement: Option<(&PlacementSpec, Sp)> = None;
    for it in &file.items {
        match it {
            Item::Name(n, _) => name = Some(n.clone()),
            Item::Vpp(e, sp) => fixed_v = Some((e.clone(), *sp)),
            Item::VppDefault(e, sp) => default_v = Some((e.clone(), *sp)),
            Item::Stages(e, _) => stages_e = Some(e),
            Item::Microbatches(e, _) => mbs_e = Some(e),
            Item::Placement(p, sp) => placement = Some((p, *sp)),
            _ => {}
        }
    }
    if inst.pp == 0 {
        return Err(vec![err(any_sp, "--pp must be at least 1")]);
    }
    if inst.pp > schedc_ir::text::MAX_RANKS_OR_STAGES {
        return Err(vec![err(
            any_sp,
            format!(
                "--pp {} is too large (at most {})",
                inst.pp,
                schedc_ir::text::MAX_RANKS_OR_STAGES
            ),
        )]);
    }
    if inst.mb == 0 {
        return Err(vec![err(any_sp, "--mb must be at least 1")]);
    }
    if let Some(e) = shadowed_builtin(file) {
        return Err(vec![e]);
    }
    env.push("P", Val::Int(inst.pp as i64), false);
    env.push("M", Val::Int(inst.mb as i64), false);
    // Parameters.
    let declared: Vec<&str> = file
        .items
        .iter()
        .filter_map(|it| match it {
            Item::Param(n, _, _) => Some(n.as_str()),
            _ => None,
        })
        .collect();
    for (n, _) in &inst.params {
        if !declared.contains(&n.as_str()) {
            let mut e = err(any_sp, format!("unknown parameter `{n}`"));
            e.help = Some(if declared.is_empty() {
                "this spec declares no parameters".into()
            } else {
                format!("this spec's parameters: {}", declared.join(", "))
            });
            e.usage = true;
            return Err(vec![e]);
        }
    }
    let is_bidir = matches!(placement, Some((PlacementSpec::Bidir, _)));
    let s_default = |v: i64| {
        if is_bidir {
            2 * inst.pp as i64
        } else {
            inst.pp as i64 * v
        }
    };
    // V (and the default S): from --vpp (default 1) when the spec has no `vpp` item; else
    // where that item stands, since items are evaluated in file order (`vpp 2 * waves` after
    // `param waves = 2`).
    let check_v = |v: i64| -> Result<(), Vec<ElabError>> {
        if v < 1 || v > schedc_ir::text::MAX_RANKS_OR_STAGES as i64 {
            return Err(vec![err(
                fixed_v.as_ref().map_or(any_sp, |f| f.1),
                format!(
                    "the number of virtual stages per rank must be in 1..={}, got {v}",
                    schedc_ir::text::MAX_RANKS_OR_STAGES
                ),
            )]);
        }
        Ok(())
    };
    if let (Some(_), Some((_, sp))) = (&fixed_v, &default_v) {
        return Err(vec![err(
            *sp,
            "a spec fixes V with `vpp` or gives a default with `vpp default`, not both",
        )]);
    }
    let mut notes = Vec::new();
    // V set where a `vpp` (or, without --vpp, a `vpp default`) item stands.
    let v_at_item = fixed_v.is_some() || (default_v.is_some() && inst.vpp.is_none());
    let mut v = inst.vpp.unwrap_or(1) as i64;
    let mut s_val = s_default(v);
    let mut s_given = false;
    if !v_at_item {
        check_v(v)?;
        env.push("V", Val::Int(v), false);
        env.push("S", Val::Int(s_val), false);
        if inst.vpp.is_none() && !is_bidir {
            notes.push(
                "V = 1 virtual stage per rank: this spec states no default V (pass --vpp)".into(),
            );
        }
    }
    // Before the `vpp` item, V and S are not defined yet: say where they come from.
    let before_vpp = |mut e: ElabError, env: &Env| {
        if (e.message == "unknown name `V`" || e.message == "unknown name `S`")
            && env.get("V").is_none()
        {
            e.help = Some(
                "items are evaluated in file order and `V` (and the default `S`) is set by the `vpp` item further down: move `vpp` above this line"
                    .into(),
            );
        }
        vec![e]
    };
    // Items in order: vpp, params, lets, stages, requires.
    let mut errors = Vec::new();
    for it in &file.items {
        match it {
            Item::VppDefault(e, _) if v_at_item => {
                let dv = int(
                    eval(e, &env, None).map_err(|x| before_vpp(x, &env))?,
                    e.sp(),
                )
                .map_err(|e| vec![e])?;
                if dv < 1 || dv > schedc_ir::text::MAX_RANKS_OR_STAGES as i64 {
                    return Err(vec![err(
                        e.sp(),
                        format!(
                            "the default number of virtual stages per rank must be in 1..={}, got {dv}",
                            schedc_ir::text::MAX_RANKS_OR_STAGES
                        ),
                    )]);
                }
                v = dv;
                env.push("V", Val::Int(v), false);
                if !s_given {
                    s_val = s_default(v);
                    env.push("S", Val::Int(s_val), false);
                }
            }
            Item::Vpp(e, sp) => {
                let fv = int(
                    eval(e, &env, None).map_err(|x| before_vpp(x, &env))?,
                    e.sp(),
                )
                .map_err(|e| vec![e])?;
                if let Some(given) = inst.vpp {
                    if given as i64 != fv {
                        let mut e = err(*sp, format!("this schedule has {fv} virtual stage(s) per rank; --vpp {given} is not accepted"));
                        e.help = Some(format!("drop --vpp or pass --vpp {fv}"));
                        e.refused = true;
                        return Err(vec![e]);
                    }
                }
                check_v(fv)?;
                v = fv;
                env.push("V", Val::Int(v), false);
                if !s_given {
                    s_val = s_default(v);
                    env.push("S", Val::Int(s_val), false);
                }
            }
            Item::Param(n, d, sp) => {
                let val = match inst.params.iter().find(|(k, _)| k == n) {
                    Some((_, v)) => *v,
                    None => match d {
                        Some(e) => int(
                            eval(e, &env, None).map_err(|x| before_vpp(x, &env))?,
                            e.sp(),
                        )
                        .map_err(|e| vec![e])?,
                        None => {
                            let mut e = err(*sp, format!("parameter `{n}` has no default"));
                            e.help = Some(format!("pass --param {n}=VALUE"));
                            e.usage = true;
                            return Err(vec![e]);
                        }
                    },
                };
                env.push(n, Val::Int(val), false);
            }
            Item::Let(n, e, _) => {
                let x = eval(e, &env, None).map_err(|x| before_vpp(x, &env))?;
                env.push(n, x, false);
            }
            Item::Fn(n, params, body, sp) => {
                const BUILTINS: [&str; 9] = [
                    "min", "max", "abs", "done", "left", "pending", "stage", "chunks", "fn",
                ];
                if BUILTINS.contains(&n.as_str()) {
                    // Malformed whatever the instance: an input error (exit 2), as a `def`
                    // named like an op is.
                    let mut e = err(
                        *sp,
                        format!("`{n}` is a built-in function; pick another name"),
                    );
                    e.malformed = true;
                    return Err(vec![e]);
                }
                if env.defs.iter().any(|d| d.name == *n) {
                    return Err(vec![fn_and_def(file, n, *sp)]);
                }
                let mut fns: Vec<FnDef> = env
                    .fns
                    .iter()
                    .map(|f| FnDef {
                        name: f.name.clone(),
                        params: f.params.clone(),
                        body: f.body.clone(),
                        scope: f.scope,
                    })
                    .collect();
                fns.push(FnDef {
                    name: n.clone(),
                    params: params.clone(),
                    body: body.clone(),
                    scope: env.vars.len(),
                });
                env.fns = std::rc::Rc::new(fns);
            }
            Item::Def(n, params, body, sp) => {
                def_item(file, n, params, body, *sp, &mut env).map_err(|e| vec![e])?;
            }
            Item::Stages(e, _) => {
                s_val = int(
                    eval(e, &env, None).map_err(|x| before_vpp(x, &env))?,
                    e.sp(),
                )
                .map_err(|e| vec![e])?;
                s_given = true;
                env.push("S", Val::Int(s_val), false);
            }
            Item::Require(c, msg, sp) => match eval(c, &env, None).and_then(|v| boolean(v, c.sp()))
            {
                Ok(true) => {}
                Ok(false) => {
                    let mut e = err(*sp, interpolate(msg, &env));
                    e.refused = true;
                    errors.push(e);
                }
                Err(e) => errors.extend(before_vpp(e, &env)),
            },
            _ => {}
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let _ = stages_e;
    let pp = inst.pp;
    let max_s = schedc_ir::text::MAX_RANKS_OR_STAGES as i64;
    if s_val < 1 || s_val > max_s {
        return Err(vec![err(
            any_sp,
            format!("the number of stages must be in 1..={max_s}, got {s_val}"),
        )]);
    }
    let s_n = s_val as u32;
    let mps = match mbs_e {
        Some(e) => int(eval(e, &env, None).map_err(|e| vec![e])?, e.sp()).map_err(|e| vec![e])?,
        None if is_bidir => {
            if !inst.mb.is_multiple_of(2) {
                let mut e = err(placement.map_or(any_sp, |p| p.1), format!("a bidirectional schedule splits the micro-batches between two directions; --mb {} is odd", inst.mb));
                e.refused = true;
                return Err(vec![e]);
            }
            inst.mb as i64 / 2
        }
        None => inst.mb as i64,
    };
    if mps < 1 || mps > u32::MAX as i64 {
        return Err(vec![err(
            any_sp,
            format!(
                "the number of micro-batches per stage must be in 1..={}, got {mps}",
                u32::MAX
            ),
        )]);
    }
    let pipeline = match placement {
        None | Some((PlacementSpec::Loop, _)) => {
            Pipeline::new(pp, s_n, mps as u32, PlacementKind::Loop)
        }
        Some((PlacementSpec::V, _)) => Pipeline::new(pp, s_n, mps as u32, PlacementKind::V),
        Some((PlacementSpec::Bidir, _)) => Pipeline::new(pp, s_n, mps as u32, PlacementKind::Bidir),
        Some((PlacementSpec::List(v), _)) => {
            let mut map = Vec::new();
            for e in v {
                map.push(
                    u32_of(
                        int(eval(e, &env, None).map_err(|e| vec![e])?, e.sp())
                            .map_err(|e| vec![e])?,
                        e.sp(),
                        "rank",
                    )
                    .map_err(|e| vec![e])?,
                );
            }
            if map.len() as u32 != s_n {
                return Err(vec![err(
                    placement.expect("some").1,
                    format!(
                        "the placement lists {} ranks but there are {s_n} stages",
                        map.len()
                    ),
                )]);
            }
            Pipeline::explicit(pp, mps as u32, map)
        }
        Some((PlacementSpec::Map(var, e), _)) => {
            let mut map = Vec::with_capacity(s_n as usize);
            for s in 0..s_n {
                env.push(var, Val::Int(s as i64), false);
                let r = eval(e, &env, None)
                    .and_then(|v| int(v, e.sp()))
                    .and_then(|v| u32_of(v, e.sp(), "rank"));
                env.vars.pop();
                map.push(r.map_err(|e| vec![e])?);
            }
            Pipeline::explicit(pp, mps as u32, map)
        }
    }
    .map_err(|e| vec![err(placement.map_or(any_sp, |p| p.1), e.to_string())])?;

    // Communicators, MoE stages and their part order.
    let mut pipeline = pipeline;
    let mut parts = None;
    for it in &file.items {
        match it {
            Item::Communicator(name, set, sp) => {
                if pipeline.communicators.iter().any(|c| &c.name == name) {
                    return Err(vec![err(
                        *sp,
                        format!("communicator `{name}` is declared twice"),
                    )]);
                }
                let ranks = id_set(set, pp, "rank", &mut env).map_err(|e| vec![e])?;
                pipeline.communicators.push(Communicator {
                    name: name.clone(),
                    ranks,
                });
            }
            Item::Parts(order, sp) => {
                if parts.is_some() {
                    return Err(vec![err(*sp, "`parts` is given twice")]);
                }
                let auto = Box::new(crate::moe::MoeStages::Auto);
                parts = Some(match order {
                    PartsOrder::Adjacent => crate::moe::MoeStages::Adjacent(auto),
                    PartsOrder::List(None) => {
                        crate::moe::MoeStages::Listed(auto, crate::moe_list::DEFAULT_WINDOW as u8)
                    }
                    PartsOrder::List(Some(e)) => {
                        let n = int(eval(e, &env, None).map_err(|x| vec![x])?, e.sp())
                            .map_err(|x| vec![x])?;
                        if !(1..=8).contains(&n) {
                            return Err(vec![err(
                                e.sp(),
                                format!("`parts list {n}`: the ops in flight must be 1 to 8"),
                            )]);
                        }
                        crate::moe::MoeStages::Listed(auto, n as u8)
                    }
                });
            }
            Item::Moe(set, sp) => {
                if pipeline.moe_stages.is_some() {
                    return Err(vec![err(*sp, "`moe` is given twice")]);
                }
                let mut v = id_set(set, s_n, "stage", &mut env).map_err(|e| vec![e])?;
                v.sort_unstable();
                v.dedup();
                pipeline.moe_stages = Some(v);
            }
            _ => {}
        }
    }

    // Rank programs.
    let mut expanded = std::collections::HashMap::new();
    let mut ranks: Vec<Vec<Instr>> = vec![Vec::new(); pp as usize];
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); pp as usize];
    let mut budget = 0u64;
    let rank_items: Vec<&Item> = file
        .items
        .iter()
        .filter(|i| matches!(i, Item::Rank(..)))
        .collect();
    let literal_items: Vec<&Item> = file
        .items
        .iter()
        .filter(|i| matches!(i, Item::Literal(..)))
        .collect();
    if rank_items.len() > 1 {
        if let Item::Rank(_, _, sp) = rank_items[1] {
            return Err(vec![err(
                *sp,
                "a spec has one `rank r { }` program (branch on the rank inside it)",
            )]);
        }
    }
    if let (Some(Item::Rank(_, _, sp)), Some(_)) = (rank_items.first(), literal_items.first()) {
        return Err(vec![err(
            *sp,
            "a spec has either a `rank r { }` program or `literal { }` blocks, not both",
        )]);
    }
    let list_items: Vec<&Item> = file
        .items
        .iter()
        .filter(|i| matches!(i, Item::List(..)))
        .collect();
    if let Some(Item::List(_, _, sp)) = list_items.get(1) {
        return Err(vec![err(*sp, "a spec has one `list r { }` block")]);
    }
    if let (Some(Item::List(_, _, sp)), true) = (
        list_items.first(),
        !rank_items.is_empty() || !literal_items.is_empty(),
    ) {
        return Err(vec![err(
            *sp,
            "a spec has one of `rank r { }`, `list r { }` or `literal { }`, not two",
        )]);
    }
    if let Some(Item::List(var, rules, sp)) = list_items.first() {
        let (r, s) = elab_list(var, rules, *sp, &pipeline, &mut env, cost, &mut budget)?;
        ranks = r;
        spans = s;
    }
    if let Some(Item::Rank(var, body, _)) = rank_items.first() {
        let mut by_rank = pipeline.stages_by_rank();
        for r in 0..pp {
            let chunks = std::mem::take(&mut by_rank[r as usize]);
            let nc = chunks.len();
            let ran = vec![std::collections::HashSet::new(); nc];
            let mut st = RankState {
                rank: r,
                chunks,
                mbs: mps as u32,
                fwd: vec![0; nc],
                bwd: vec![0; nc],
                wdone: vec![0; nc],
                pending: VecDeque::new(),
                ran: [ran.clone(), ran],
                open: Vec::new(),
                out: Vec::new(),
                spans: Vec::new(),
                chain: Vec::new(),
                expanded: Vec::new(),
                budget: &mut budget,
                list: false,
            };
            env.push(var, Val::Int(r as i64), false);
            let res = exec(body, &mut env, &mut st);
            env.vars.pop();
            if let Err(mut e) = res {
                e.rank = Some(r);
                return Err(vec![e]);
            }
            for (key, uses) in st.expanded {
                expanded
                    .entry((r, key.0, key.1, key.2))
                    .or_insert_with(|| uses.into_iter().map(|(sp, l)| (span(sp), l)).collect());
            }
            ranks[r as usize] = st.out;
            spans[r as usize] = st.spans;
        }
    }
    for it in &literal_items {
        let Item::Literal(body, sp) = it else {
            continue;
        };
        // The header carries the shape only: a literal block may declare its own
        // communicators and MoE stages (`group`/`communicator`, `moe` lines).
        let header = schedc_ir::text::print(&Program {
            pipeline: Pipeline {
                communicators: Vec::new(),
                moe_stages: None,
                ..pipeline.clone()
            },
            ranks: Vec::new(),
        });
        // The block's lines are IR text indented as a whole (as a spec indents a block):
        // drop their common indentation, so that `rank N:` starts its line as IR text
        // wants (an indented line there continues the previous rank's list).
        let (body, back) = dedent(body);
        let text = format!("{header}{body}");
        let parsed = schedc_ir::text::parse(&text).map_err(|e| {
            // Map the error back into the spec: the body starts after `literal {`.
            let body_start = sp.start + "literal {".len();
            let off = back(e.offset.saturating_sub(header.len())) + body_start;
            // A shape line (`pp`, `stages`, `microbatches`, `placement`, ...) in the block
            // clashes with the header the spec generates: say so, not "first on line 1" of
            // a header the user never wrote (newcomer round 4, finding 10); malformed (2).
            let shape = e.message.contains("is given twice (first on line");
            let (message, help) = if shape {
                let word = e.message.split('`').nth(1).unwrap_or("this line").to_string();
                (
                    format!("`{word}` is not written in a literal block: the spec's shape (pp, stages, micro-batches, placement) comes from the spec and the command line"),
                    Some("write only `rank N:` lines, `group`/`communicator` and `moe` lines in the block".to_string()),
                )
            } else {
                (e.message, e.help)
            };
            vec![ElabError {
                sp: Sp {
                    start: off,
                    end: off + e.len.max(1),
                },
                message,
                help,
                rank: None,
                refused: false,
                usage: false,
                malformed: shape,
                context: Vec::new(),
                expansions: Box::default(),
            }]
        })?;
        let body_start = sp.start + "literal {".len();
        for c in parsed.program.pipeline.communicators {
            if pipeline.communicators.iter().any(|x| x.name == c.name) {
                return Err(vec![err(
                    *sp,
                    format!("communicator `{}` is declared twice", c.name),
                )]);
            }
            pipeline.communicators.push(c);
        }
        if let Some(v) = parsed.program.pipeline.moe_stages {
            if pipeline.moe_stages.is_some() {
                return Err(vec![err(*sp, "`moe` is given twice")]);
            }
            pipeline.moe_stages = Some(v);
        }
        for (r, instrs) in parsed.program.ranks.into_iter().enumerate() {
            if instrs.is_empty() {
                continue;
            }
            ranks[r].extend(instrs);
            spans[r].extend(parsed.spans.ranks[r].iter().map(|s| Span {
                start: (back(s.start as usize - header.len()) + body_start) as u32,
                len: s.len,
            }));
        }
    }

    // `recompute stages ...`: checkpoint every forward of those stages, recompute before
    // the backward.
    for it in &file.items {
        if let Item::Recompute(set, sp) = it {
            let stages = id_set(set, s_n, "stage", &mut env).map_err(|e| vec![e])?;
            let mut chosen = vec![false; s_n as usize];
            for s in stages {
                chosen[s as usize] = true;
            }
            for (instrs, sps) in ranks.iter_mut().zip(spans.iter_mut()) {
                recompute_stages(instrs, sps, &chosen, span(*sp));
            }
        }
    }

    // Expectations.
    let mut expects = Vec::new();
    for it in &file.items {
        if let Item::Expect(kind, e, guard, sp) = it {
            if kind.is_timing() {
                expects.push(Expectation {
                    kind: kind.clone(),
                    values: Vec::new(),
                    applies: Vec::new(),
                    sp: *sp,
                    formula: Some(Formula {
                        expr: e.clone(),
                        guard: guard.clone(),
                        vars: env
                            .vars
                            .iter()
                            .map(|b| {
                                let v = match b.val {
                                    Val::Int(x) => x,
                                    Val::Bool(x) => i64::from(x),
                                };
                                (b.name.clone(), v)
                            })
                            .collect(),
                        fns: env
                            .fns
                            .iter()
                            .map(|f| (f.name.clone(), f.params.clone(), f.body.clone()))
                            .collect(),
                    }),
                });
                continue;
            }
            let mut values = Vec::with_capacity(pp as usize);
            let mut applies = Vec::with_capacity(pp as usize);
            for r in 0..pp {
                let var = rank_items
                    .first()
                    .or(list_items.first())
                    .and_then(|i| match i {
                        Item::Rank(v, _, _) | Item::List(v, _, _) => Some(v.as_str()),
                        _ => None,
                    })
                    .unwrap_or("r");
                env.push(var, Val::Int(r as i64), false);
                // The guard first: where it fails, the bound need not be defined.
                let holds = match guard {
                    Some(g) => eval(g, &env, None).and_then(|v| boolean(v, g.sp())),
                    None => Ok(true),
                };
                let v = match &holds {
                    Ok(true) => eval(e, &env, None).and_then(|v| int(v, e.sp())),
                    Ok(false) => Ok(0),
                    Err(x) => Err(x.clone()),
                };
                env.vars.pop();
                let at_rank = |mut e: ElabError| {
                    e.rank = Some(r);
                    vec![e]
                };
                applies.push(holds.map_err(at_rank)?);
                values.push(v.map_err(at_rank)?);
            }
            expects.push(Expectation {
                kind: kind.clone(),
                values,
                applies,
                sp: *sp,
                formula: None,
            });
        }
    }

    Ok(Elaborated {
        program: Program { pipeline, ranks },
        spans: SourceMap {
            ranks: spans,
            expanded,
        },
        expects,
        name,
        notes,
        parts,
    })
}

/// What a built-in name of the instance means, for the error that refuses a spec defining it.
fn builtin_meaning(n: &str) -> Option<&'static str> {
    Some(match n {
        "P" => "the number of ranks, `--pp`",
        "M" => "the number of micro-batches, `--mb`",
        "V" => "the number of virtual stages per rank, `--vpp` or the `vpp` item",
        "S" => "the number of stages, the `stages` item",
        _ => return None,
    })
}

/// The first name a spec defines (`param`, `let`, `var`, `fn` and its parameters, a loop or
/// rank variable, a `list` block's names) that is one of the instance's built-in names
/// (P, M, V, S): it would silently shadow the instance's value.
fn shadowed_builtin(file: &File) -> Option<ElabError> {
    fn refuse(n: &str, sp: Sp) -> Option<ElabError> {
        let what = builtin_meaning(n)?;
        let mut e = err(
            sp,
            format!("`{n}` is built in ({what}); choose another name"),
        );
        e.help = Some(format!(
            "a spec reads `{n}` from the instance; a parameter of its own needs a name of its own"
        ));
        Some(e)
    }
    fn stmts(body: &[Stmt]) -> Option<ElabError> {
        for st in body {
            let found = match st {
                Stmt::Let(n, _, sp) | Stmt::Var(n, _, sp) => refuse(n, *sp),
                Stmt::For { var, body, sp, .. } => refuse(var, *sp).or_else(|| stmts(body)),
                Stmt::Repeat(_, b, _) | Stmt::While(_, b, _) => stmts(b),
                Stmt::If(_, a, b, _) => stmts(a).or_else(|| stmts(b)),
                _ => None,
            };
            if found.is_some() {
                return found;
            }
        }
        None
    }
    for it in &file.items {
        let found = match it {
            Item::Param(n, _, sp) | Item::Let(n, _, sp) => refuse(n, *sp),
            Item::Fn(n, params, _, sp) => {
                refuse(n, *sp).or_else(|| params.iter().find_map(|p| refuse(p, *sp)))
            }
            Item::Rank(n, body, sp) => refuse(n, *sp).or_else(|| stmts(body)),
            Item::Def(n, params, body, sp) => refuse(n, *sp)
                .or_else(|| params.iter().find_map(|p| refuse(p, *sp)))
                .or_else(|| stmts(body)),
            Item::List(n, rules, sp) => refuse(n, *sp).or_else(|| {
                rules.iter().find_map(|r| match r {
                    ListRule::Let(n, _, sp) => refuse(n, *sp),
                    ListRule::Priority { chunk, mb, sp, .. } => {
                        refuse(chunk, *sp).or_else(|| refuse(mb, *sp))
                    }
                    _ => None,
                })
            }),
            _ => None,
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

/// The calls (`NAME(args)`) in a block, nested blocks included: (name, span).
fn calls_in(body: &[Stmt], out: &mut Vec<(String, Sp)>) {
    for s in body {
        match s {
            Stmt::Call(n, _, sp) => out.push((n.clone(), *sp)),
            Stmt::For { body, .. } | Stmt::Repeat(_, body, _) | Stmt::While(_, body, _) => {
                calls_in(body, out)
            }
            Stmt::If(_, a, b, _) => {
                calls_in(a, out);
                calls_in(b, out);
            }
            _ => {}
        }
    }
}

/// Registers `def n(params) { body }`: refuses a name taken by an op, a send or a receive,
/// a second `def` of the same name, and recursion (a `def` that uses itself, or one defined
/// below it, which is how a cycle of defs would start).
fn def_item(
    file: &File,
    n: &str,
    params: &[String],
    body: &[Stmt],
    sp: Sp,
    env: &mut Env,
) -> Result<(), ElabError> {
    def_item_checked(file, n, params, body, sp, env).map_err(|mut e| {
        e.malformed = true;
        e
    })
}

/// [`def_item`]'s work; its errors are marked malformed there.
fn def_item_checked(
    file: &File,
    n: &str,
    params: &[String],
    body: &[Stmt],
    sp: Sp,
    env: &mut Env,
) -> Result<(), ElabError> {
    const TAKEN: [&str; 14] = [
        "F",
        "B",
        "W",
        "BW",
        "SA",
        "RA",
        "SG",
        "RG",
        "A2A",
        "OFFLOAD",
        "RELOAD",
        "RECOMPUTE",
        "LEND",
        "RETURN",
    ];
    if TAKEN.contains(&n) {
        return Err(err(
            sp,
            format!("`{n}` is an op of the language; a `def` needs another name"),
        ));
    }
    if env.fns.iter().any(|f| f.name == n) {
        return Err(fn_and_def(file, n, sp));
    }
    if let Some(prev) = env.defs.iter().find(|d| d.name == n) {
        let mut e = err(sp, format!("`def {n}` is defined twice"));
        e.expansions
            .push((prev.sp, "the first definition is here".to_string()));
        return Err(e);
    }
    for (i, p) in params.iter().enumerate() {
        if params[..i].contains(p) {
            return Err(err(
                sp,
                format!("`def {n}` names the parameter `{p}` twice"),
            ));
        }
    }
    let mut calls = Vec::new();
    calls_in(body, &mut calls);
    for (c, csp) in calls {
        if c == n {
            let mut e = err(
                csp,
                format!("`def {n}` uses itself: a def cannot be recursive"),
            );
            e.help = Some(
                "a def expands to its statements at each use, so a recursive one never ends; write the repetition as a loop (`repeat`, `for`, `while`)".into(),
            );
            e.expansions.push((sp, format!("`def {n}` is here")));
            return Err(e);
        }
        if env.defs.iter().any(|d| d.name == c) {
            continue;
        }
        let later = file.items.iter().find_map(|it| match it {
            Item::Def(m, _, _, dsp) if *m == c => Some(*dsp),
            _ => None,
        });
        if let Some(dsp) = later {
            let mut e = err(
                csp,
                format!("`def {n}` uses `{c}`, which is defined below it"),
            );
            e.help = Some(
                "a def sees only the defs above it (so defs cannot call each other in a cycle): move this one below it".into(),
            );
            e.expansions.push((dsp, format!("`def {c}` is here")));
            return Err(e);
        }
    }
    let mut defs: Vec<DefDef> = env.defs.iter().map(DefDef::clone_def).collect();
    defs.push(DefDef {
        name: n.to_string(),
        params: params.to_vec(),
        body: body.to_vec(),
        scope: env.vars.len(),
        fns: env.fns.clone(),
        defs: env.defs.clone(),
        sp,
    });
    env.defs = std::rc::Rc::new(defs);
    Ok(())
}

/// The error for a name that is both a `fn` and a `def`, at `sp` (the second of the two):
/// it names both locations.
fn fn_and_def(file: &File, n: &str, sp: Sp) -> ElabError {
    let fn_sp = file.items.iter().find_map(|it| match it {
        Item::Fn(m, _, _, s) if m == n => Some(*s),
        _ => None,
    });
    let def_sp = file.items.iter().find_map(|it| match it {
        Item::Def(m, _, _, s) if m == n => Some(*s),
        _ => None,
    });
    let mut e = err(sp, format!("`{n}` is both a `fn` and a `def`"));
    e.help = Some(
        "a `fn` computes a value in expressions and a `def` expands to statements; one name for both reads as either: rename one".into(),
    );
    for (s, what) in [(fn_sp, "fn"), (def_sp, "def")] {
        if let Some(s) = s.filter(|s| s.start != sp.start) {
            e.expansions.push((s, format!("`{what} {n}` is here")));
        }
    }
    e.malformed = true;
    e
}

impl DefDef {
    fn clone_def(&self) -> DefDef {
        DefDef {
            name: self.name.clone(),
            params: self.params.clone(),
            body: self.body.clone(),
            scope: self.scope,
            fns: self.fns.clone(),
            defs: self.defs.clone(),
            sp: self.sp,
        }
    }
}

/// `body` without the indentation (spaces and tabs) that all its non-blank lines share, and
/// a map from an offset in the result back to the offset in `body`.
fn dedent(body: &str) -> (String, impl Fn(usize) -> usize) {
    let indent_of = |l: &str| l.len() - l.trim_start_matches([' ', '\t']).len();
    let k = body
        .split('\n')
        .filter(|l| !l.trim().is_empty())
        .map(indent_of)
        .min()
        .unwrap_or(0);
    let mut out = String::with_capacity(body.len());
    // (start of a line in `out`, bytes removed before it and at its start)
    let mut marks: Vec<(usize, usize)> = Vec::new();
    let mut removed = 0;
    for (n, line) in body.split('\n').enumerate() {
        if n > 0 {
            out.push('\n');
        }
        let cut = if line.trim().is_empty() {
            0
        } else {
            k.min(indent_of(line))
        };
        removed += cut;
        marks.push((out.len(), removed));
        out.push_str(&line[cut..]);
    }
    let back = move |off: usize| {
        let i = marks.partition_point(|&(start, _)| start <= off);
        off + if i == 0 { 0 } else { marks[i - 1].1 }
    };
    (out, back)
}

/// A `list r { }` block: each op's priority, the rules, then the list scheduler
/// ([`super::list::schedule`]) for the per-rank orders.
#[allow(clippy::type_complexity)]
fn elab_list(
    var: &str,
    rules: &[ListRule],
    list_sp: Sp,
    pl: &Pipeline,
    env: &mut Env,
    cost: &crate::sim::cost::CostModel,
    budget: &mut u64,
) -> Result<(Vec<Vec<Instr>>, Vec<Vec<Span>>), Vec<ElabError>> {
    use super::list;
    let one = |e: ElabError| vec![e];
    // The rules, checked once.
    let mut prio: [Option<usize>; 4] = [None; 4];
    let slot = |k: Kind| match k {
        Kind::F => 0,
        Kind::B => 1,
        Kind::W => 2,
        Kind::BW => 3,
    };
    let (mut mem_rule, mut infl_rule, mut defer, mut strict) = (None, None, None, None);
    let mut on_memory = None;
    for (k, rule) in rules.iter().enumerate() {
        // Wrong whatever the instance: an input error (exit 2), as a syntax error is.
        let dup = |what: &str| {
            let mut e = err(
                rule.sp(),
                format!("a second `{what}` line in the `list` block"),
            );
            e.malformed = true;
            vec![e]
        };
        match rule {
            ListRule::Priority { kind, .. } => {
                if prio[slot(*kind)].replace(k).is_some() {
                    return Err(dup(&format!("{}(c, m) =", kind.as_str())));
                }
            }
            ListRule::Memory(..) => {
                if mem_rule.replace(k).is_some() {
                    return Err(dup("memory <="));
                }
            }
            ListRule::Inflight(..) => {
                if infl_rule.replace(k).is_some() {
                    return Err(dup("inflight <="));
                }
            }
            ListRule::Defer(kind, sp) => {
                if *kind != Kind::W {
                    let mut e = err(
                        *sp,
                        format!("only `W` can be deferred, not `{}`", kind.as_str()),
                    );
                    e.help = Some("`defer W` lets weight gradients fill the bubbles".into());
                    return Err(vec![e]);
                }
                if defer.replace(k).is_some() {
                    return Err(dup("defer W"));
                }
            }
            ListRule::Strict(_) => {
                if strict.replace(k).is_some() {
                    return Err(dup("strict"));
                }
            }
            ListRule::OnMemory(..) => {
                if on_memory.replace(k).is_some() {
                    return Err(dup("memory offload|recompute|wait"));
                }
            }
            ListRule::Let(..) => {}
        }
    }
    let policy = match on_memory.map(|k| &rules[k]) {
        Some(ListRule::OnMemory(p, _)) => *p,
        _ => list::MemPolicy::Wait,
    };
    if let (Some(k), None, true) = (on_memory, mem_rule, policy != list::MemPolicy::Wait) {
        let mut e = err(
            rules[k].sp(),
            format!(
                "`memory {}` needs a cap: the `list` block has no `memory <= e` line",
                policy.as_str()
            ),
        );
        e.help = Some("add `memory <= e`: at most e live activations per rank".into());
        // Wrong whatever the instance: an input error (exit 2), as a syntax error is.
        e.malformed = true;
        return Err(vec![e]);
    }
    let need = |msg: &str, help: &str| {
        let mut e = err(list_sp, msg.to_string());
        e.help = Some(help.to_string());
        vec![e]
    };
    if prio[0].is_none() {
        return Err(need(
            "the `list` block gives no priority for the forwards",
            "add `F(c, m) = ...`: the priority of the forward of local chunk c, micro-batch m (the smaller runs first)",
        ));
    }
    let fused = prio[3].is_some();
    if fused && (prio[1].is_some() || prio[2].is_some()) {
        let k = prio[1].or(prio[2]).expect("some");
        return Err(vec![err(
            rules[k].sp(),
            "a `list` block runs either fused backwards (`BW`) or split ones (`B` and `W`), not both",
        )]);
    }
    if !fused && prio[1].is_none() {
        return Err(need(
            "the `list` block gives no priority for the backwards",
            "add `BW(c, m) = ...` (fused backward) or `B(c, m) = ...` (input gradient; `W(c, m) = ...` orders the weight gradients, by default like their B)",
        ));
    }
    if let (Some(k), true) = (defer, fused) {
        return Err(vec![err(
            rules[k].sp(),
            "`defer W` needs split backwards: this block runs fused `BW`",
        )]);
    }
    let kinds: Vec<Kind> = if fused {
        vec![Kind::F, Kind::BW]
    } else {
        vec![Kind::F, Kind::B, Kind::W]
    };
    // The line whose expression gives each kind's priority (W falls back to B's).
    let line_of = |k: Kind| {
        prio[slot(k)]
            .or(if k == Kind::W { prio[1] } else { None })
            .expect("checked")
    };
    let mbs = pl.microbatches;
    let mut ops: Vec<list::Op> = Vec::new();
    let mut op_line: Vec<usize> = Vec::new();
    let mut memory = mem_rule.map(|_| Vec::with_capacity(pl.pp as usize));
    let mut inflight = infl_rule.map(|_| Vec::with_capacity(pl.pp as usize));
    for r in 0..pl.pp {
        let mark = env.vars.len();
        env.push(var, Val::Int(r as i64), false);
        let chunks = pl.stages_of(r);
        let nc = chunks.len();
        let st = RankState {
            rank: r,
            chunks: chunks.clone(),
            mbs,
            fwd: vec![0; nc],
            bwd: vec![0; nc],
            wdone: vec![0; nc],
            pending: VecDeque::new(),
            ran: [Vec::new(), Vec::new()],
            open: Vec::new(),
            out: Vec::new(),
            spans: Vec::new(),
            chain: Vec::new(),
            expanded: Vec::new(),
            budget,
            list: true,
        };
        // Each priority line sees the `let`s above it.
        let mut scopes: Vec<Option<Env>> = Vec::new();
        scopes.resize_with(rules.len(), || None);
        let res = (|| -> Result<(), ElabError> {
            for (k, rule) in rules.iter().enumerate() {
                match rule {
                    ListRule::Let(n, e, _) => {
                        let v = eval(e, env, Some(&st))?;
                        env.push(n, v, false);
                    }
                    ListRule::Priority { .. } => {
                        scopes[k] = Some(Env {
                            vars: env
                                .vars
                                .iter()
                                .map(|b| Binding {
                                    name: b.name.clone(),
                                    val: b.val,
                                    mutable: false,
                                })
                                .collect(),
                            fns: env.fns.clone(),
                            defs: env.defs.clone(),
                            depth: 0,
                        });
                    }
                    ListRule::Memory(e, _) | ListRule::Inflight(e, _) => {
                        let v = int(eval(e, env, Some(&st))?, e.sp())?;
                        if v < 1 {
                            return Err(err(
                                e.sp(),
                                format!("the cap must be at least 1, got {v} on rank {r}"),
                            ));
                        }
                        if matches!(rule, ListRule::Memory(..)) {
                            memory.as_mut().expect("declared").push(v);
                        } else {
                            inflight.as_mut().expect("declared").push(v);
                        }
                    }
                    ListRule::Defer(..) | ListRule::Strict(_) | ListRule::OnMemory(..) => {}
                }
            }
            Ok(())
        })();
        env.vars.truncate(mark);
        res.map_err(|mut e| {
            e.rank = Some(r);
            vec![e]
        })?;
        let mut st = st;
        for (c, &stage) in chunks.iter().enumerate() {
            for m in 0..mbs {
                for &k in &kinds {
                    let line = line_of(k);
                    let ListRule::Priority {
                        chunk, mb, expr, ..
                    } = &rules[line]
                    else {
                        unreachable!("a priority line")
                    };
                    tick(&mut st, rules[line].sp()).map_err(one)?;
                    let scope = scopes[line].as_mut().expect("recorded");
                    scope.push(chunk, Val::Int(c as i64), false);
                    scope.push(mb, Val::Int(m as i64), false);
                    let v = eval(expr, scope, Some(&st)).and_then(|v| int(v, expr.sp()));
                    scope.vars.truncate(scope.vars.len() - 2);
                    let p = v.map_err(|mut e| {
                        e.rank = Some(r);
                        e.message = format!(
                            "{} (priority of {}(c = {c}, m = {m}))",
                            e.message,
                            k.as_str()
                        );
                        vec![e]
                    })?;
                    ops.push(list::Op {
                        kind: k,
                        stage,
                        mb: m,
                        prio: p,
                    });
                    op_line.push(line);
                }
            }
        }
    }
    let lr = list::Rules {
        memory,
        inflight,
        defer_w: defer.is_some(),
        strict: strict.is_some(),
        policy,
    };
    let orders = list::schedule(pl, &ops, &lr, cost).map_err(|stuck| {
        // Point at the rule that holds a rank back, if one does.
        let blocked_by = |f: fn(&list::Blocker) -> bool| stuck.ranks.iter().any(|x| f(&x.2));
        let at = if blocked_by(|b| matches!(b, list::Blocker::Memory(_))) {
            mem_rule.map_or(list_sp, |k| rules[k].sp())
        } else if blocked_by(|b| matches!(b, list::Blocker::Inflight(_))) {
            infl_rule.map_or(list_sp, |k| rules[k].sp())
        } else {
            list_sp
        };
        let name = |i: usize| {
            let o = &ops[i];
            format!("{}({},{})", o.kind.as_str(), o.stage, o.mb)
        };
        let mut e = err(
            at,
            format!(
                "list scheduling is stuck at time {} after {} of {} ops: no rank can start its next op",
                // Twelve significant digits: the sum of op times without its rounding noise.
                format!("{:.12}", stuck.time)
                    .trim_end_matches('0')
                    .trim_end_matches('.'),
                stuck.done,
                ops.len()
            ),
        );
        let why: Vec<String> = stuck
            .ranks
            .iter()
            .map(|(r, i, b)| match b {
                list::Blocker::Memory(l) => format!(
                    "rank {r}: {} waits for memory ({l} live activations, cap {})",
                    name(*i),
                    lr.memory.as_ref().map_or(0, |m| m[*r as usize])
                ),
                list::Blocker::Inflight(l) => {
                    let cap = lr.inflight.as_ref().map_or(0, |m| m[*r as usize]);
                    format!(
                        "rank {r}: {} waits for the in-flight cap ({l} in flight, cap {cap}){}",
                        name(*i),
                        if *l < cap {
                            "; a micro-batch enters out of order only while a slot stays free for the next in order (give the older micro-batches' forwards smaller priorities)"
                        } else {
                            ""
                        }
                    )
                }
                list::Blocker::Input(p) => {
                    // Say why the input's own rank does not run it.
                    let q = pl.rank_of(ops[*p].stage);
                    let why = match stuck.ranks.iter().find(|x| x.0 == q) {
                        Some((_, h, list::Blocker::Memory(_))) => format!(
                            " (rank {q}, whose next op {} waits for memory)",
                            name(*h)
                        ),
                        Some((_, h, list::Blocker::Inflight(_))) => format!(
                            " (rank {q}, whose next op {} waits for the in-flight cap)",
                            name(*h)
                        ),
                        Some((_, h, _)) if *h != *p => {
                            format!(" (rank {q}, queued behind its next op {})", name(*h))
                        }
                        _ => format!(" (rank {q})"),
                    };
                    format!("rank {r}: {} waits for {}{why}", name(*i), name(*p))
                }
            })
            .collect();
        e.help = Some(format!(
            "{}; raise the cap, or give the ops that free memory (backwards of earlier micro-batches) smaller priorities than the forwards that need it",
            why.join("; ")
        ));
        vec![e]
    })?;
    // A memory op points at the `memory` policy line that made it.
    let policy_sp = on_memory.map_or(list_sp, |k| rules[k].sp());
    let mut ranks: Vec<Vec<Instr>> = Vec::with_capacity(orders.ranks.len());
    let mut spans: Vec<Vec<Span>> = Vec::with_capacity(orders.ranks.len());
    for ord in &orders.ranks {
        let mut instrs = Vec::with_capacity(ord.len());
        let mut sps = Vec::with_capacity(ord.len());
        for step in ord {
            let (instr, sp) = match *step {
                list::Step::Op(i) => {
                    let mut c = Compute::new(ops[i].kind, ops[i].stage, ops[i].mb);
                    c.checkpoint = orders.checkpointed[i];
                    (Instr::Compute(c), rules[op_line[i]].sp())
                }
                list::Step::Offload(i) | list::Step::Reload(i) | list::Step::Recompute(i) => {
                    let kind = match step {
                        list::Step::Offload(_) => schedc_ir::MemKind::Offload,
                        list::Step::Reload(_) => schedc_ir::MemKind::Reload,
                        _ => schedc_ir::MemKind::Recompute,
                    };
                    let m = schedc_ir::MemOp {
                        kind,
                        stage: ops[i].stage,
                        mb: ops[i].mb,
                    };
                    (Instr::Mem(m), policy_sp)
                }
            };
            instrs.push(instr);
            sps.push(span(sp));
        }
        ranks.push(instrs);
        spans.push(sps);
    }
    Ok((ranks, spans))
}

/// Marks every whole forward of a `chosen` stage in one rank's program checkpointed
/// (`F(s,m)!`) and puts `RECOMPUTE(s,m)` (pointing at `sp`, the `recompute stages` item)
/// right before the first instruction that runs its backward (`B` or `BW`, alone or in an
/// overlapped pair). A forward the program already checkpoints, or whose activations it
/// moves (`OFFLOAD`, `RELOAD`, `RECOMPUTE`, `LEND`, `RETURN`), is left as written, as is one
/// without a backward on the rank.
fn recompute_stages(instrs: &mut Vec<Instr>, spans: &mut Vec<Span>, chosen: &[bool], sp: Span) {
    use std::collections::HashSet;
    let whole_f = |c: &Compute| {
        c.kind == Kind::F && c.part == schedc_ir::Part::Whole && chosen[c.stage as usize]
    };
    let lent = |c: &schedc_ir::Comm, skip: &mut HashSet<(u32, u32)>| {
        if let schedc_ir::Comm::Send { payload, .. } | schedc_ir::Comm::Recv { payload, .. } = c {
            if payload.kind.is_stash() {
                skip.insert((payload.stage, payload.mb));
            }
        }
    };
    // (stage, mb) the program already manages.
    let mut skip: HashSet<(u32, u32)> = HashSet::new();
    let mut fwds: HashSet<(u32, u32)> = HashSet::new();
    for ins in instrs.iter() {
        match ins {
            Instr::Mem(m) => {
                skip.insert((m.stage, m.mb));
            }
            Instr::Comm(c) => lent(c, &mut skip),
            Instr::Group(v) => v.iter().for_each(|c| lent(c, &mut skip)),
            _ => {}
        }
        ins.for_each_compute(|c| {
            if whole_f(c) {
                if c.checkpoint {
                    skip.insert((c.stage, c.mb));
                } else {
                    fwds.insert((c.stage, c.mb));
                }
            }
        });
    }
    fwds.retain(|k| !skip.contains(k));
    if fwds.is_empty() {
        return;
    }
    let mut out = Vec::with_capacity(instrs.len() + fwds.len());
    let mut out_sp = Vec::with_capacity(instrs.len() + fwds.len());
    for (mut ins, isp) in instrs.drain(..).zip(spans.drain(..)) {
        let mut rec = None;
        let mut visit = |c: &mut Compute| {
            let key = (c.stage, c.mb);
            if whole_f(c) && fwds.contains(&key) {
                c.checkpoint = true;
            } else if matches!(c.kind, Kind::B | Kind::BW) && fwds.remove(&key) {
                rec = Some(key);
            }
        };
        match &mut ins {
            Instr::Compute(c) => visit(c),
            Instr::Overlap { fwd, bwd } => {
                visit(fwd);
                visit(bwd);
            }
            _ => {}
        }
        if let Some((stage, mb)) = rec {
            out.push(Instr::Mem(schedc_ir::MemOp {
                kind: schedc_ir::MemKind::Recompute,
                stage,
                mb,
            }));
            out_sp.push(sp);
        }
        out.push(ins);
        out_sp.push(isp);
    }
    *instrs = out;
    *spans = out_sp;
}

/// The ids `0..n` a set names (`all`, a list, `x => cond`), in the order given.
fn id_set(set: &SetSpec, n: u32, what: &str, env: &mut Env) -> Result<Vec<u32>, ElabError> {
    Ok(match set {
        SetSpec::All => (0..n).collect(),
        SetSpec::List(v) => {
            let mut out = Vec::with_capacity(v.len());
            for e in v {
                let x = int(eval(e, env, None)?, e.sp())?;
                if x < 0 || x >= n as i64 {
                    let limit = if what == "rank" { "P" } else { "S" };
                    return Err(err(
                        e.sp(),
                        format!("{what} {x} is out of range 0..{n} ({limit} = {n})"),
                    ));
                }
                out.push(x as u32);
            }
            out
        }
        SetSpec::Where(var, cond) => {
            let mut out = Vec::new();
            for x in 0..n {
                env.push(var, Val::Int(x as i64), false);
                let b = eval(cond, env, None).and_then(|v| boolean(v, cond.sp()));
                env.vars.pop();
                if b? {
                    out.push(x);
                }
            }
            out
        }
    })
}

/// Replaces `{NAME}` in a `require` message with the value of `NAME` (P, M, V, S, a
/// parameter or a `let`); unknown names stay as written.
fn interpolate(msg: &str, env: &Env) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(a) = rest.find('{') {
        out.push_str(&rest[..a]);
        let after = &rest[a + 1..];
        match after.find('}') {
            Some(b)
                if !after[..b].is_empty()
                    && after[..b]
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                match env.get(&after[..b]) {
                    Some(Val::Int(v)) => out.push_str(&v.to_string()),
                    Some(Val::Bool(v)) => out.push_str(&v.to_string()),
                    None => out.push_str(&rest[a..a + b + 2]),
                }
                rest = &after[b + 1..];
            }
            _ => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}
