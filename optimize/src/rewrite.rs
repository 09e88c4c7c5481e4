//! Equality saturation over a window of one rank's ops (egg), extracted with the evaluator
//! in the loop.
//!
//! A window of k consecutive tokens of a rank is the term `(seq t1 (seq t2 ... (seq tk
//! nil)))`. The rules, each sound for the rank's own order (the evaluator rejects what
//! breaks an order on another rank, a deadlock or the cap):
//!
//! * `swap`: `(seq ?a (seq ?b ?r)) => (seq ?b (seq ?a ?r))` when `?b` does not depend on
//!   `?a` on this rank (a forward on the stage after it, a backward on the stage before it,
//!   the loss backward on its forward, a `W` on its `B`) and they are not the same op. With
//!   it the e-graph holds every order of the window that keeps those dependencies: moving a
//!   `W` into a gap, a forward across a backward.
//! * `split`: `(seq BW_s ?r) => (seq B_s (seq W_s ?r))`.
//! * `fuse`: `(seq B_s (seq W_s ?r)) => (seq BW_s ?r)` (only when `BW < B + W`).
//! * `pair` and `pair-bf`: an adjacent forward and backward (either order) become one
//!   overlapped chunk `(pair F_a B_b)`; `unpair` undoes it (only when pairs are faster).
//!
//! Makespan and peak memory are not sums over the term, so egg's additive extractors cannot
//! pick the best order. Extraction is a beam search over the e-graph instead: a partial
//! extraction is a prefix of the window's ops and the e-class of the rest, scored by the
//! evaluator on the whole schedule with the rest completed by the smallest term of its
//! class; the best `beam` prefixes are kept at each length.

use crate::eval::Evaluator;
use crate::instance::Instance;
use crate::local::{score, Score};
use crate::sched::{Sched, Tok};
use egg::{
    rewrite, Applier, AstSize, EGraph, Extractor, Id, Pattern, PatternAst, RecExpr, Rewrite,
    Runner, Subst, Symbol, Var,
};
use std::fmt;
use std::str::FromStr;

/// One op as an e-graph leaf: `F3`, `B3`, `W3`, `BW3` (stage 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpLeaf(pub Tok);

impl fmt::Display for OpLeaf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Tok::F(s) => write!(f, "F{s}"),
            Tok::B(s) => write!(f, "B{s}"),
            Tok::W(s) => write!(f, "W{s}"),
            Tok::BW(s) => write!(f, "BW{s}"),
            Tok::Pair { .. } => write!(f, "?"),
        }
    }
}

impl FromStr for OpLeaf {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |t: &str| t.parse::<u32>().map_err(|e| e.to_string());
        if let Some(t) = s.strip_prefix("BW") {
            return Ok(OpLeaf(Tok::BW(num(t)?)));
        }
        if let Some(t) = s.strip_prefix('F') {
            return Ok(OpLeaf(Tok::F(num(t)?)));
        }
        if let Some(t) = s.strip_prefix('B') {
            return Ok(OpLeaf(Tok::B(num(t)?)));
        }
        if let Some(t) = s.strip_prefix('W') {
            return Ok(OpLeaf(Tok::W(num(t)?)));
        }
        Err(format!("not an op: {s}"))
    }
}

mod lang {
    #![allow(missing_docs)]
    use super::OpLeaf;
    use egg::{define_language, Id};
    define_language! {
        /// The term language of a window: `(seq op rest)`, `(pair F B)`, `nil`, op leaves.
        pub enum Win {
            "seq" = Seq([Id; 2]),
            "pair" = Pair([Id; 2]),
            "nil" = Nil,
            Op(OpLeaf),
        }
    }
}
pub use lang::Win;

/// The e-graph of a window (no analysis).
pub type WinGraph = EGraph<Win, ()>;

/// The single op leaf of an e-class, if it has one.
fn leaf(eg: &WinGraph, id: Id) -> Option<Tok> {
    eg[id].nodes.iter().find_map(|n| match n {
        Win::Op(o) => Some(o.0),
        _ => None,
    })
}

/// The ops an e-class stands for: a leaf, or the two halves of a pair.
fn ops_of(eg: &WinGraph, id: Id) -> Vec<Tok> {
    let mut v = Vec::new();
    for n in &eg[id].nodes {
        match n {
            Win::Op(o) => v.push(o.0),
            Win::Pair([a, b]) => {
                v.extend(leaf(eg, *a));
                v.extend(leaf(eg, *b));
            }
            _ => {}
        }
    }
    v
}

/// True if, on one rank, op `b` may need op `a` to have run before it.
pub fn depends(inst: &Instance, a: Tok, b: Tok) -> bool {
    let is_bwd = |t: Tok| matches!(t, Tok::B(_) | Tok::BW(_));
    match (a, b) {
        _ if a == b => true,
        (Tok::F(x), Tok::F(y)) => inst.next[x as usize] == Some(y),
        (Tok::F(x), t) if is_bwd(t) => t.stage() == x && inst.next[x as usize].is_none(),
        (t, u) if is_bwd(t) && is_bwd(u) => inst.prev[t.stage() as usize] == Some(u.stage()),
        (Tok::B(x), Tok::W(y)) => x == y,
        _ => false,
    }
}

fn var(s: &str) -> Var {
    s.parse().expect("a pattern variable")
}

/// Splits `?x` = `BW_s` in `(seq ?x ?r)` into `(seq B_s (seq W_s ?r))`.
struct SplitApplier;

impl Applier<Win, ()> for SplitApplier {
    fn apply_one(
        &self,
        eg: &mut WinGraph,
        eclass: Id,
        subst: &Subst,
        _ast: Option<&PatternAst<Win>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let Some(Tok::BW(s)) = leaf(eg, subst[var("?x")]) else {
            return vec![];
        };
        let r = subst[var("?r")];
        let w = eg.add(Win::Op(OpLeaf(Tok::W(s))));
        let b = eg.add(Win::Op(OpLeaf(Tok::B(s))));
        let tail = eg.add(Win::Seq([w, r]));
        let new = eg.add(Win::Seq([b, tail]));
        if eg.union(eclass, new) {
            vec![eclass]
        } else {
            vec![]
        }
    }
}

/// Fuses `(seq B_s (seq W_s ?r))` into `(seq BW_s ?r)`.
struct FuseApplier;

impl Applier<Win, ()> for FuseApplier {
    fn apply_one(
        &self,
        eg: &mut WinGraph,
        eclass: Id,
        subst: &Subst,
        _ast: Option<&PatternAst<Win>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let (Some(Tok::B(s)), Some(Tok::W(t))) =
            (leaf(eg, subst[var("?b")]), leaf(eg, subst[var("?w")]))
        else {
            return vec![];
        };
        if s != t {
            return vec![];
        }
        let r = subst[var("?r")];
        let bw = eg.add(Win::Op(OpLeaf(Tok::BW(s))));
        let new = eg.add(Win::Seq([bw, r]));
        if eg.union(eclass, new) {
            vec![eclass]
        } else {
            vec![]
        }
    }
}

/// The rules that apply under `inst`'s cost model.
pub fn rules(inst: &Instance) -> Vec<Rewrite<Win, ()>> {
    let i1 = inst.clone();
    let indep = move |eg: &mut WinGraph, _: Id, s: &Subst| {
        let a = ops_of(eg, s[var("?a")]);
        let b = ops_of(eg, s[var("?b")]);
        !a.is_empty() && !b.is_empty() && a.iter().all(|&x| b.iter().all(|&y| !depends(&i1, x, y)))
    };
    let mut v: Vec<Rewrite<Win, ()>> = vec![
        rewrite!("swap"; "(seq ?a (seq ?b ?r))" => "(seq ?b (seq ?a ?r))" if indep),
        Rewrite::new(
            "split",
            "(seq ?x ?r)".parse::<Pattern<Win>>().unwrap(),
            SplitApplier,
        )
        .unwrap(),
    ];
    if !inst.split_dominates() {
        v.push(
            Rewrite::new(
                "fuse",
                "(seq ?b (seq ?w ?r))".parse::<Pattern<Win>>().unwrap(),
                FuseApplier,
            )
            .unwrap(),
        );
    }
    if inst.pairs_help() {
        let fwd = |eg: &mut WinGraph, s: &Subst, name: &str| {
            matches!(leaf(eg, s[var(name)]), Some(Tok::F(_)))
        };
        let bwd = |eg: &mut WinGraph, s: &Subst, name: &str| {
            matches!(leaf(eg, s[var(name)]), Some(Tok::B(_) | Tok::BW(_)))
        };
        v.push(
            rewrite!("pair"; "(seq ?f (seq ?b ?r))" => "(seq (pair ?f ?b) ?r)"
            if move |eg: &mut WinGraph, _: Id, s: &Subst| fwd(eg, s, "?f") && bwd(eg, s, "?b")),
        );
        v.push(
            rewrite!("pair-bf"; "(seq ?b (seq ?f ?r))" => "(seq (pair ?f ?b) ?r)"
            if move |eg: &mut WinGraph, _: Id, s: &Subst| fwd(eg, s, "?f") && bwd(eg, s, "?b")),
        );
        v.push(rewrite!("unpair"; "(seq (pair ?f ?b) ?r)" => "(seq ?f (seq ?b ?r))"));
    }
    v
}

/// The term of a window.
pub fn window_expr(toks: &[Tok]) -> RecExpr<Win> {
    let mut e = RecExpr::default();
    let mut rest = e.add(Win::Nil);
    for &t in toks.iter().rev() {
        let op = match t {
            Tok::Pair { f, b, fused } => {
                let fi = e.add(Win::Op(OpLeaf(Tok::F(f))));
                let bi = e.add(Win::Op(OpLeaf(if fused { Tok::BW(b) } else { Tok::B(b) })));
                e.add(Win::Pair([fi, bi]))
            }
            _ => e.add(Win::Op(OpLeaf(t))),
        };
        rest = e.add(Win::Seq([op, rest]));
    }
    e
}

/// The tokens of a window term.
pub fn expr_tokens(e: &RecExpr<Win>) -> Vec<Tok> {
    let nodes = e.as_ref();
    let mut out = Vec::new();
    let mut cur = Id::from(nodes.len() - 1);
    while let Win::Seq([op, rest]) = &nodes[usize::from(cur)] {
        out.push(node_tok(nodes, *op));
        cur = *rest;
    }
    out
}

fn node_tok(nodes: &[Win], id: Id) -> Tok {
    match &nodes[usize::from(id)] {
        Win::Op(o) => o.0,
        Win::Pair([a, b]) => {
            let (Win::Op(fa), Win::Op(bb)) = (&nodes[usize::from(*a)], &nodes[usize::from(*b)])
            else {
                unreachable!("a pair of two ops")
            };
            let fused = matches!(bb.0, Tok::BW(_));
            Tok::Pair {
                f: fa.0.stage(),
                b: bb.0.stage(),
                fused,
            }
        }
        _ => unreachable!("an op"),
    }
}

/// Saturates the window's e-graph under `rules` (node and iteration limits, no time limit,
/// so results do not depend on the machine).
pub fn saturate(toks: &[Tok], rules: &[Rewrite<Win, ()>], node_limit: usize) -> (WinGraph, Id) {
    let expr = window_expr(toks);
    let runner = Runner::default()
        .with_node_limit(node_limit)
        .with_iter_limit(64)
        .with_time_limit(std::time::Duration::from_secs(3600))
        .with_expr(&expr)
        .run(rules);
    let root = runner.egraph.find(runner.roots[0]);
    (runner.egraph, root)
}

/// Beam extraction: the best window order in the e-graph for the whole schedule `sc`
/// (rank `r`, window `start..start + len`), scored by the evaluator. Returns the window's new
/// tokens and their score.
#[allow(clippy::too_many_arguments)]
pub fn extract(
    ev: &mut Evaluator<'_>,
    sc: &Sched,
    r: usize,
    start: usize,
    len: usize,
    eg: &WinGraph,
    root: Id,
    beam: usize,
) -> Option<(Vec<Tok>, Score)> {
    let ext = Extractor::new(eg, AstSize);
    let complete = |id: Id| -> Vec<Tok> { expr_tokens(&ext.find_best(id).1) };
    let mut trial = sc.clone();
    let mut eval_with = |win: &[Tok]| -> Score {
        trial.ranks[r].splice(start..start + len, win.iter().copied());
        let s = score(ev, &trial);
        trial.ranks[r].clone_from(&sc.ranks[r]);
        s
    };
    let mut states: Vec<(Vec<Tok>, Id)> = vec![(Vec::new(), root)];
    let mut best: Option<(Vec<Tok>, Score)> = None;
    let mut guard = 0;
    while !states.is_empty() && guard < 64 {
        guard += 1;
        let mut next: Vec<(Score, Vec<Tok>, Id)> = Vec::new();
        for (prefix, id) in &states {
            for n in &eg[*id].nodes {
                match n {
                    Win::Nil => {
                        let s = eval_with(prefix);
                        if best.as_ref().is_none_or(|b| s.lt(&b.1)) {
                            best = Some((prefix.clone(), s));
                        }
                    }
                    Win::Seq([op, rest]) => {
                        for on in &eg[*op].nodes {
                            let tok = match on {
                                Win::Op(o) => o.0,
                                Win::Pair([a, b]) => {
                                    let (Some(f), Some(bt)) = (leaf(eg, *a), leaf(eg, *b)) else {
                                        continue;
                                    };
                                    Tok::Pair {
                                        f: f.stage(),
                                        b: bt.stage(),
                                        fused: matches!(bt, Tok::BW(_)),
                                    }
                                }
                                _ => continue,
                            };
                            let mut p = prefix.clone();
                            p.push(tok);
                            let rest = eg.find(*rest);
                            let mut full = p.clone();
                            full.extend(complete(rest));
                            let s = eval_with(&full);
                            if s.makespan.is_finite() {
                                next.push((s, p, rest));
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        next.sort_by(|a, b| {
            a.0.makespan
                .total_cmp(&b.0.makespan)
                .then(a.0.mean_end.total_cmp(&b.0.mean_end))
                .then(a.1.cmp(&b.1))
        });
        next.dedup_by(|a, b| a.1 == b.1 && a.2 == b.2);
        next.truncate(beam);
        states = next.into_iter().map(|(_, p, id)| (p, id)).collect();
    }
    best
}

/// Window rewrites over the ranks: windows of `k` tokens starting every `k / 2`, visited in
/// a seeded random order until `max_evals` evaluations are spent; each window is saturated
/// and extracted, and an extraction that improves the score is kept. Returns the
/// evaluations run.
#[allow(clippy::too_many_arguments)]
pub fn improve_windows(
    inst: &Instance,
    sc: &mut Sched,
    k: usize,
    beam: usize,
    max_evals: u64,
    seed: u64,
    deadline: Option<std::time::Instant>,
    on_best: &mut dyn FnMut(f64),
) -> u64 {
    let rules = rules(inst);
    let mut ev = Evaluator::new(inst);
    let mut cur = score(&mut ev, sc);
    let step = (k / 2).max(1);
    let mut windows: Vec<(usize, usize)> = Vec::new();
    for r in 0..sc.ranks.len() {
        let mut start = 0;
        while start + 2 <= sc.ranks[r].len() {
            windows.push((r, start));
            start += step;
        }
    }
    let mut rng = crate::list::Rng::new(seed);
    for i in (1..windows.len()).rev() {
        windows.swap(i, rng.below(i + 1));
    }
    for (r, start) in windows {
        if ev.count >= max_evals || deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            break;
        }
        // Splits and fusions change lengths: clamp to the rank as it is now.
        if start + 2 > sc.ranks[r].len() {
            continue;
        }
        let len = k.min(sc.ranks[r].len() - start);
        let win: Vec<Tok> = sc.ranks[r][start..start + len].to_vec();
        let (eg, root) = saturate(&win, &rules, 20_000);
        if let Some((new, s)) = extract(&mut ev, sc, r, start, len, &eg, root, beam) {
            if s.lt(&cur) {
                if s.makespan < cur.makespan - crate::local::EPS {
                    on_best(s.makespan);
                }
                sc.ranks[r].splice(start..start + len, new.iter().copied());
                cur = s;
            }
        }
    }
    ev.count
}
