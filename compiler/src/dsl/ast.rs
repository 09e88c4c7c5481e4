//! The syntax tree of a `.sched` file. Every node carries its [`Sp`] (byte range), which
//! compares equal to any other span so that trees compare by structure alone (the `fmt`
//! round-trip property).

/// A byte range in the source; equality ignores it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sp {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl PartialEq for Sp {
    fn eq(&self, _: &Sp) -> bool {
        true
    }
}
impl Eq for Sp {}

impl Sp {
    /// The span from `a`'s start to `b`'s end.
    pub fn to(self, b: Sp) -> Sp {
        Sp {
            start: self.start,
            end: b.end,
        }
    }
}

/// A whole spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct File {
    /// Top-level items in order.
    pub items: Vec<Item>,
}

/// Binary operators, by precedence group (lowest first): `||`; `&&`; comparisons; `+ -`;
/// `* / %`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    /// `||`
    Or,
    /// `&&`
    And,
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/` (floor division: rounds toward negative infinity)
    Div,
    /// `%` (floor modulo: the result has the divisor's sign)
    Mod,
}

impl BinOp {
    /// The token.
    pub fn as_str(self) -> &'static str {
        match self {
            BinOp::Or => "||",
            BinOp::And => "&&",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Mod => "%",
        }
    }
    /// Precedence level, higher binds tighter.
    pub fn prec(self) -> u8 {
        match self {
            BinOp::Or => 1,
            BinOp::And => 2,
            BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => 3,
            BinOp::Add | BinOp::Sub => 4,
            BinOp::Mul | BinOp::Div | BinOp::Mod => 5,
        }
    }
}

/// An expression: integers and booleans (booleans are 0/1 integers where an integer is
/// expected is an error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    /// An integer literal.
    Int(i64, Sp),
    /// `true` / `false`.
    Bool(bool, Sp),
    /// A name: a parameter, `let`, loop variable, or built-in (`P`, `M`, `V`, `S`, the rank).
    Var(String, Sp),
    /// `-e`
    Neg(Box<Expr>, Sp),
    /// `!e`
    Not(Box<Expr>, Sp),
    /// `a op b`
    Bin(BinOp, Box<Expr>, Box<Expr>, Sp),
    /// A call: `min(a, b)`, `max(a, b)`, `done(F, c)`, `left(F, c)`.
    Call(String, Vec<Arg>, Sp),
    /// `if c { a } else { b }`: `a` where `c` holds, else `b` (only the chosen branch is
    /// evaluated).
    If(Box<Expr>, Box<Expr>, Box<Expr>, Sp),
}

/// An argument of a call: an expression or an op kind (`F`, `B`, `W`, `BW`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arg {
    /// An expression.
    Expr(Expr),
    /// An op kind.
    Kind(schedc_ir::Kind, Sp),
}

impl Expr {
    /// The span.
    pub fn sp(&self) -> Sp {
        match self {
            Expr::Int(_, s)
            | Expr::Bool(_, s)
            | Expr::Var(_, s)
            | Expr::Neg(_, s)
            | Expr::Not(_, s)
            | Expr::Bin(_, _, _, s)
            | Expr::Call(_, _, s)
            | Expr::If(_, _, _, s) => *s,
        }
    }
}

/// Which micro-batch an op names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// `F(c)`: local chunk `c`, the next micro-batch of that chunk's counter for the kind.
    /// `W()` (no chunk): the oldest pending weight gradient of any chunk.
    Next(Option<Expr>),
    /// `F(c, m)`: local chunk `c`, micro-batch `m` (counters untouched).
    Chunk(Expr, Expr),
    /// `F(stage s, m)`: a global stage id and micro-batch.
    Stage(Expr, Expr),
}

/// One compute op statement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpStmt {
    /// F, B, W or BW.
    pub kind: schedc_ir::Kind,
    /// `F?(c)`: emit only if the chunk has a micro-batch left for this kind.
    pub optional: bool,
    /// What it names.
    pub target: Target,
    /// `F(c)!`: a checkpointed forward ([`schedc_ir::Compute::checkpoint`]); forwards only.
    pub checkpoint: bool,
    /// Span.
    pub sp: Sp,
}

/// A memory op statement: `OFFLOAD(c, m)`, `RELOAD(c, m)`, `RECOMPUTE(c, m)` (local chunk
/// `c`) or `OFFLOAD(stage s, m)` (global stage): the IR's [`schedc_ir::MemOp`] on the saved
/// activations of that forward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemStmt {
    /// Offload, reload or recompute.
    pub kind: schedc_ir::MemKind,
    /// The forward named: [`Target::Chunk`] or [`Target::Stage`] (a micro-batch is required).
    pub target: Target,
    /// Span.
    pub sp: Sp,
}

/// A lending statement (BPipe's hand-off of a forward's stash, the IR's `LEND`/`RETURN`
/// messages): `LEND(c, m) to r` (the owner lends the stash of its chunk `c`'s forward `m` to
/// rank `r`), `LEND(stage s, m) from o` (rank `r` receives it from the owner `o`),
/// `RETURN(stage s, m) to o` (the holder sends it back), `RETURN(c, m) from r` (the owner
/// receives it back before the backward); `@ ch` after the peer puts the message on
/// channel `ch` (default 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LendStmt {
    /// `LEND` ([`schedc_ir::PayloadKind::Lend`]) or `RETURN` ([`schedc_ir::PayloadKind::Return`]).
    pub kind: schedc_ir::PayloadKind,
    /// The forward named: [`Target::Chunk`] or [`Target::Stage`] (a micro-batch is required).
    pub target: Target,
    /// True for `to` (a send), false for `from` (a receive).
    pub send: bool,
    /// The peer rank.
    pub peer: Expr,
    /// The channel (`@ ch`), if given.
    pub channel: Option<Expr>,
    /// Span.
    pub sp: Sp,
}

/// A send or receive statement: `SA(s, m -> peer)` etc. (payload stage, micro-batch, peer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommStmt {
    /// `SA`, `RA`, `SG` or `RG`.
    pub op: String,
    /// Producing stage.
    pub stage: Expr,
    /// Micro-batch.
    pub mb: Expr,
    /// Peer rank.
    pub peer: Expr,
    /// Span.
    pub sp: Sp,
}

/// A collective statement: `A2A(comm, "label")`; `{NAME}` in the label is replaced by the
/// value of `NAME` (as in a `require` message).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollStmt {
    /// The communicator's name (declared with a `communicator` item or in a `literal` block).
    pub comm: String,
    /// The label, before interpolation.
    pub label: String,
    /// Span.
    pub sp: Sp,
}

/// A set of ranks (`communicator`) or of stages (`moe`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SetSpec {
    /// `all`: every rank, or every stage.
    All,
    /// `[e0, e1, ...]`.
    List(Vec<Expr>),
    /// `x => cond`: the ids `x` in `0..P` (ranks) or `0..S` (stages) where `cond` holds.
    Where(String, Expr),
}

/// The relation of an expectation: the figure on the left, the bound on the right.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rel {
    /// `<=`
    Le,
    /// `==` (a timing figure within a relative 1e-9)
    Eq,
    /// `>=`
    Ge,
}

impl Rel {
    /// The token.
    pub fn as_str(self) -> &'static str {
        match self {
            Rel::Le => "<=",
            Rel::Eq => "==",
            Rel::Ge => ">=",
        }
    }

    /// Whether `got` relates to `bound` so, within `tol` (0 for integer figures).
    pub fn holds(self, got: f64, bound: f64, tol: f64) -> bool {
        match self {
            Rel::Le => got <= bound + tol,
            Rel::Eq => (got - bound).abs() <= tol,
            Rel::Ge => got >= bound - tol,
        }
    }
}

/// A statement of a rank program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stmt {
    /// `let x = e` (immutable; shadows).
    Let(String, Expr, Sp),
    /// `var x = e` (mutable).
    Var(String, Expr, Sp),
    /// `x = e` (assigns a `var`).
    Assign(String, Expr, Sp),
    /// `for i in a..b { }` (half-open; `..=` inclusive), optional `step k`.
    For {
        /// Loop variable.
        var: String,
        /// Start.
        from: Expr,
        /// End.
        to: Expr,
        /// `..=`.
        inclusive: bool,
        /// `step k` (k > 0).
        step: Option<Expr>,
        /// Body.
        body: Vec<Stmt>,
        /// Span of the header.
        sp: Sp,
    },
    /// `repeat n { }`.
    Repeat(Expr, Vec<Stmt>, Sp),
    /// `while cond { }` (bounded by the elaboration step budget).
    While(Expr, Vec<Stmt>, Sp),
    /// `if c { } else { }` (`else if` nests).
    If(Expr, Vec<Stmt>, Vec<Stmt>, Sp),
    /// A compute op.
    Op(OpStmt),
    /// `F(..) & B(..)`: an overlapped pair (forward first).
    Overlap(OpStmt, OpStmt, Sp),
    /// An explicit send or receive (a lone op).
    Comm(CommStmt),
    /// `{ SA(..) RG(..) }`-style group: `group { comm* }`.
    Group(Vec<CommStmt>, Sp),
    /// `idle`: an idle slot.
    Idle(Sp),
    /// `F(c).attn`, `BW(c, m).combine`, ...: one MoE part of an op. The first part in
    /// execution order (attn for F, combine for B/BW) takes the op's micro-batch as `F(c)`
    /// would; a later part joins the oldest op of that chunk and kind still missing it.
    Part(OpStmt, schedc_ir::Part, Sp),
    /// `A2A(comm, "label")`: a collective on a declared communicator.
    Collective(CollStmt),
    /// `OFFLOAD(c, m)`, `RELOAD(c, m)`, `RECOMPUTE(c, m)`: a memory op.
    Mem(MemStmt),
    /// `LEND(c, m) to r`, `RETURN(stage s, m) to o`, ...: a lending message.
    Lend(LendStmt),
    /// `NAME(a, b)`: the use of a `def NAME(x, y) { ... }`: its statements, run here with
    /// `x`, `y` bound to the values of `a`, `b` (evaluated once, at the use).
    Call(String, Vec<Expr>, Sp),
}

/// The placement item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlacementSpec {
    /// `placement loop`
    Loop,
    /// `placement v`
    V,
    /// `placement bidir`
    Bidir,
    /// `placement [e0, e1, ...]` (rank of each stage).
    List(Vec<Expr>),
    /// `placement s => e` (rank of stage `s`, for `s` in `0..stages`).
    Map(String, Expr),
}

/// What an `expect` line asserts: a figure and its relation (`<=`, `==` or `>=`) to the
/// bound. The per-rank figures (warmup, peak activations, idle) are checked on every rank,
/// the rank variable bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExpectKind {
    /// `expect warmup == e`: forwards before the rank's first backward.
    Warmup(Rel),
    /// `expect peak_activations <= e`: the rank's peak of live activations (chunk units).
    PeakActivations(Rel),
    /// `expect idle == e`: the rank's idle time under unit times (F=B=W=1, BW=2).
    Idle(Rel),
    /// `expect makespan <= e`: the step's makespan under the cost model, seconds.
    Makespan(Rel),
    /// `expect bubble(CONVENTION) <= e`: the bubble fraction under a named convention
    /// (`from_start`, `per_rank_span`, `steady_state`).
    Bubble(crate::sim::Convention, Rel),
    /// `expect exposed_a2a <= e`: the fraction of the MoE all-to-all time not hidden under
    /// compute (0 without all-to-alls).
    ExposedA2a(Rel),
    /// `expect exposed_comm <= e`: communication the compute streams wait for, seconds
    /// summed over ranks.
    ExposedComm(Rel),
}

impl ExpectKind {
    /// True for the expectations on the simulated timeline (makespan, bubble, exposed
    /// communication), which are evaluated under a cost model with real arithmetic.
    pub fn is_timing(&self) -> bool {
        matches!(
            self,
            ExpectKind::Makespan(_)
                | ExpectKind::Bubble(..)
                | ExpectKind::ExposedA2a(_)
                | ExpectKind::ExposedComm(_)
        )
    }

    /// The relation.
    pub fn rel(&self) -> Rel {
        match self {
            ExpectKind::Warmup(r)
            | ExpectKind::PeakActivations(r)
            | ExpectKind::Idle(r)
            | ExpectKind::Makespan(r)
            | ExpectKind::Bubble(_, r)
            | ExpectKind::ExposedA2a(r)
            | ExpectKind::ExposedComm(r) => *r,
        }
    }

    /// The figure as written: `makespan`, `bubble(from_start)`.
    pub fn figure(&self) -> String {
        match self {
            ExpectKind::Warmup(_) => "warmup".into(),
            ExpectKind::PeakActivations(_) => "peak_activations".into(),
            ExpectKind::Idle(_) => "idle".into(),
            ExpectKind::Makespan(_) => "makespan".into(),
            ExpectKind::Bubble(c, _) => format!("bubble({})", c.as_str()),
            ExpectKind::ExposedA2a(_) => "exposed_a2a".into(),
            ExpectKind::ExposedComm(_) => "exposed_comm".into(),
        }
    }

    /// The left-hand side and relation as written: `makespan <=`, `bubble(from_start) ==`.
    pub fn lhs(&self) -> String {
        format!("{} {}", self.figure(), self.rel().as_str())
    }
}

/// One line of a `list r { ... }` block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListRule {
    /// `let x = e`: a name for the lines after it (evaluated per rank).
    Let(String, Expr, Sp),
    /// `F(c, m) = e`: the priority of kind `kind` on local chunk `c`, micro-batch `m` (the
    /// smaller runs first); `c` and `m` are the names the expression uses.
    Priority {
        /// F, B, W or BW.
        kind: schedc_ir::Kind,
        /// Name bound to the local chunk.
        chunk: String,
        /// Name bound to the micro-batch.
        mb: String,
        /// The priority.
        expr: Expr,
        /// Span of the line.
        sp: Sp,
    },
    /// `memory <= e`: at most `e` live activations per rank (chunk units; `F` allocates, `W`
    /// or `BW` frees).
    Memory(Expr, Sp),
    /// `inflight <= e`: at most `e` forwards per rank whose backward (`B` or `BW`) has not
    /// run.
    Inflight(Expr, Sp),
    /// `defer W`: weight gradients run only where they delay nothing else (or free memory
    /// the cap needs).
    Defer(schedc_ir::Kind, Sp),
    /// `strict`: every rank runs its ops exactly in priority order (no backfilling).
    Strict(Sp),
    /// `memory offload`, `memory recompute` or `memory wait`: what a rank does when its next
    /// op would exceed the `memory <=` cap.
    OnMemory(super::list::MemPolicy, Sp),
}

impl ListRule {
    /// The span.
    pub fn sp(&self) -> Sp {
        match self {
            ListRule::Let(_, _, s)
            | ListRule::Memory(_, s)
            | ListRule::Inflight(_, s)
            | ListRule::Defer(_, s)
            | ListRule::Strict(s)
            | ListRule::OnMemory(_, s) => *s,
            ListRule::Priority { sp, .. } => *sp,
        }
    }
}

/// A top-level item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    /// `schedule "name"`
    Name(String, Sp),
    /// `param NAME = default` (an integer the user sets with `--param NAME=VALUE`).
    Param(String, Option<Expr>, Sp),
    /// `vpp e`: the spec accepts only this number of virtual stages per rank.
    Vpp(Expr, Sp),
    /// `vpp default e`: the number of virtual stages per rank when `--vpp` is not given.
    VppDefault(Expr, Sp),
    /// `stages e`: number of stage ids (default `P*V`; `2P` for `bidir`).
    Stages(Expr, Sp),
    /// `microbatches e`: micro-batches per stage (default `M`; `M/2` for `bidir`).
    Microbatches(Expr, Sp),
    /// `placement ...`
    Placement(PlacementSpec, Sp),
    /// `let x = e` at top level.
    Let(String, Expr, Sp),
    /// `fn name(a, b) = e`: a function of integers, visible to everything after it (rank
    /// programs and `expect` lines); it sees the items before it and its parameters.
    Fn(String, Vec<String>, Expr, Sp),
    /// `def name(a, b) { ... }`: a named group of statements, used as the statement
    /// `name(x, y)` in a rank program (or another `def` after it). Its body sees the items
    /// before it, its parameters and the rank's progress functions; the span is the header's.
    Def(String, Vec<String>, Vec<Stmt>, Sp),
    /// `require cond, "message"`.
    Require(Expr, String, Sp),
    /// `rank r { ... }`: the program of every rank, `r` bound to its id.
    Rank(String, Vec<Stmt>, Sp),
    /// `literal { rank 0: ... }`: hand-written IR text lines.
    Literal(String, Sp),
    /// `list r { ... }`: list scheduling. A priority per op kind (an expression of the rank
    /// `r`, the local chunk and the micro-batch) and optional rules; schedc builds the
    /// per-rank orders by a deterministic cross-rank greedy (`dsl::list`).
    List(String, Vec<ListRule>, Sp),
    /// `expect FIGURE REL e [if COND]`: the figure, the bound `e`, and the guard `COND` (the
    /// line applies only where it holds: per rank for the per-rank figures, under the cost
    /// model for the timing ones).
    Expect(ExpectKind, Expr, Option<Expr>, Sp),
    /// `communicator NAME [r0, r1, ...]` (or `all`, or `r => cond`): a named set of ranks
    /// for `A2A` collectives.
    Communicator(String, SetSpec, Sp),
    /// `moe [s0, s1, ...]` (or `all`, or `s => cond`): the MoE stages; the others are
    /// dense (no MoE parts; `--moe` keeps them whole).
    Moe(SetSpec, Sp),
    /// `recompute stages [s0, ...]` (or `all`, or `s => cond`): every forward of these stages
    /// runs checkpointed (`F(s,m)!`), and a `RECOMPUTE(s,m)` goes before its backward on the
    /// rank (a per-stage activation-checkpointing policy over the program as written).
    Recompute(SetSpec, Sp),
    /// `parts list [N]` or `parts adjacent`: the spec's MoE stages (its `moe` item, else
    /// every stage) are split into parts in that order, as `--moe=auto:list[N]` (or
    /// `:adjacent`) would, without the flag; `--moe` on the command line takes precedence.
    Parts(PartsOrder, Sp),
}

/// The part order a `parts` item asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartsOrder {
    /// `parts list` / `parts list N`: the cost-aware greedy of `--moe=...:list` (`:listN`),
    /// N ops in flight per rank (1 to 8; 2 without N).
    List(Option<Expr>),
    /// `parts adjacent`: consecutive independent plain ops interleaved at part level.
    Adjacent,
}
