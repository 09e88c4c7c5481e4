//! From tokens to a lowered program: micro-batch labels in order, sends and receives in the
//! order the evaluator's times give, each stage boundary on its own channel when messages
//! take time.
//!
//! The messages come from `schedc::passes::lower::lower_timed` keyed by every op's end
//! time, so each communication stream lists its messages in the order their data is ready
//! and no message waits behind a later one. When a message takes time (latency or
//! bandwidth), two boundaries sharing a rank's stream would queue behind each other; each
//! boundary (payload kind, producing stage) therefore gets a channel of its own, chosen so
//! that no two boundaries touching one rank share one (a greedy edge colouring: a handful of
//! channels for loop and V placements). With free messages everything stays on channel 0.

use crate::eval::{Evaluator, Fail};
use crate::instance::Instance;
use crate::sched::Sched;
use schedc::passes::lower::lower_timed;
use schedc_ir::{Comm, Instr, PayloadKind, Program};
use std::collections::HashMap;

/// Lowers `sc`. Errors: the tokens are not a schedule (see [`Fail`]), or the lowering pass
/// finds no interleaving (it cannot when the evaluator ran them).
pub fn lower(inst: &Instance, sc: &Sched) -> Result<Program, String> {
    let mut ev = Evaluator::new(inst);
    let (_, starts) = ev.eval_starts(sc).map_err(|f| describe(inst, sc, f))?;
    let prog = sc.to_program(inst);
    let keys: Vec<Vec<f64>> = sc
        .ranks
        .iter()
        .zip(&starts)
        .map(|(toks, st)| toks.iter().zip(st).map(|(t, s)| s + t.time(inst)).collect())
        .collect();
    let mut low = lower_timed(&prog, Some(&keys))
        .map_err(|e| format!("the lowering pass found no interleaving: {e:?}"))?;
    if !inst.free_comm() {
        let chan = channels(inst);
        for instrs in &mut low.ranks {
            for ins in instrs.iter_mut() {
                if let Instr::Comm(Comm::Send {
                    payload, channel, ..
                })
                | Instr::Comm(Comm::Recv {
                    payload, channel, ..
                }) = ins
                {
                    if let Some(&c) = chan.get(&(payload.kind, payload.stage)) {
                        *channel = c;
                    }
                }
            }
        }
    }
    Ok(low)
}

/// The channel of every stage boundary that crosses ranks: `(payload kind, producing
/// stage) -> channel`, no two boundaries with a common rank on one channel.
pub fn channels(inst: &Instance) -> HashMap<(PayloadKind, u32), u32> {
    let mut used: Vec<Vec<u32>> = vec![Vec::new(); inst.p];
    let mut out = HashMap::new();
    for s in 0..inst.s {
        let links = [
            (PayloadKind::Act, inst.next[s]),
            (PayloadKind::Grad, inst.prev[s]),
        ];
        for (kind, peer) in links {
            let Some(q) = peer else { continue };
            let (a, b) = (inst.rank_of[s] as usize, inst.rank_of[q as usize] as usize);
            if a == b {
                continue;
            }
            let c = (0u32..)
                .find(|c| !used[a].contains(c) && !used[b].contains(c))
                .expect("a free channel");
            used[a].push(c);
            used[b].push(c);
            out.insert((kind, s as u32), c);
        }
    }
    out
}

/// A message for a failed evaluation, naming the rank and op.
pub fn describe(inst: &Instance, sc: &Sched, f: Fail) -> String {
    let op = |r: u32, pos: u32| -> String {
        let p = sc.to_program(inst);
        p.ranks
            .get(r as usize)
            .and_then(|v| v.get(pos as usize))
            .map(schedc_ir::text::instr_to_string)
            .unwrap_or_default()
    };
    match f {
        Fail::Deadlock => "the ranks wait on each other in a cycle".into(),
        Fail::Incomplete => "some op is missing or repeated".into(),
        Fail::Order { rank, pos } => format!(
            "rank {rank}, op {pos} ({}): out of order on its rank, on the wrong rank, or one too many",
            op(rank, pos)
        ),
        Fail::OverCap { rank, pos } => format!(
            "rank {rank}, op {pos} ({}): more than {} live activations",
            op(rank, pos),
            inst.cap
        ),
    }
}
