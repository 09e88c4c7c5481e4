#!/usr/bin/env python3
"""An independent exact solver for schedc-optimize's small instances: OR-Tools CP-SAT.

schedc's own exact search is branch and bound (optimize/src/exact.rs). This script solves
the same problem with a different, well-kept solver, to check it (and the optimizer) from
outside: every instance it proves optimal gives a makespan that `schedc optimize` must equal,
and that no bound of ours may exceed.

Input: JSON lines from `cargo run --release -p schedc-optimize --example dump_small -- v|loop
` (one instance a line: stage -> rank map, stage links, per-stage op times in seconds, the
message time, the activation cap).

The model is the one schedc's evaluator (optimize/src/eval.rs) computes:
- one interval per op F(s,k), B(s,k), W(s,k) (every backward split: the instances have
  BW >= B + W, where splitting never hurts); the ops of one rank never overlap;
- F(s,k) starts after F(prev(s),k), B(s,k) after B(next(s),k) (after F(s,k) on a last
  stage), W(s,k) after B(s,k); a dependency across ranks travels over that stage
  boundary's own in-order channel: message k arrives at max(end, arrival of message k-1)
  + message time;
- the k-th op of a kind on a stage is micro-batch k (relabelling loses no schedule:
  optimize/src/sched.rs);
- memory: a forward adds one live activation at its start, a W releases it at its end;
  at most `cap` live per rank at any time (CP-SAT's reservoir constraint; a W ending when
  a forward starts counts first, as in program order);
- objective: the latest end (from-start makespan).
Times are scaled to integers (x20 for these cost sets; checked exact).

Output: one JSON line per instance (`cpsat`: best makespan found, `cpsat_bound`: CP-SAT's
proved lower bound, `proved`: the two are equal, `order`: each rank's ops in start order as
tokens such as "F3", "B2", "W2" for stage 3 or 2), and a summary on stderr.

Usage: python3 prove.py [--time-limit S] [--workers N] < instances.jsonl
"""
import argparse
import json
import sys

from ortools.sat.python import cp_model


def scale_of(inst):
    vals = inst["d_f"] + inst["d_b"] + inst["d_w"] + [inst["lat"]]
    for sc in (1, 10, 20, 100, 1000):
        if all(abs(v * sc - round(v * sc)) < 1e-9 for v in vals):
            return sc
    raise SystemExit(f"times of P={inst['P']} M={inst['M']} are not multiples of 0.001")


def solve(inst, time_limit, workers):
    sc = scale_of(inst)
    S, M = len(inst["rank_of"]), inst["M"]
    P = max(inst["rank_of"]) + 1
    rank_of, nxt, prv = inst["rank_of"], inst["next"], inst["prev"]
    for s in range(S):
        if inst["d_bw"][s] < inst["d_b"][s] + inst["d_w"][s] - 1e-12:
            raise SystemExit("BW faster than B + W: fused backwards are not modelled")
    df = [round(x * sc) for x in inst["d_f"]]
    db = [round(x * sc) for x in inst["d_b"]]
    dw = [round(x * sc) for x in inst["d_w"]]
    lat = round(inst["lat"] * sc)
    # Horizon: micro-batches one at a time, every message on the critical path.
    per_mb = sum(df) + sum(db) + sum(dw) + lat * 2 * S
    horizon = per_mb * M

    m = cp_model.CpModel()
    iv = {}
    st = {}
    en = {}
    on_rank = [[] for _ in range(P)]
    for s in range(S):
        for k in range(M):
            for kind, d in (("F", df[s]), ("B", db[s]), ("W", dw[s])):
                a = m.NewIntVar(0, horizon, f"s{kind}{s}_{k}")
                e = m.NewIntVar(0, horizon, f"e{kind}{s}_{k}")
                i = m.NewIntervalVar(a, d, e, f"{kind}{s}_{k}")
                st[kind, s, k], en[kind, s, k], iv[kind, s, k] = a, e, i
                on_rank[rank_of[s]].append(i)
    for r in range(P):
        m.AddNoOverlap(on_rank[r])

    def link(kind, src, dst):
        """Op `kind` of stage dst, micro-batch k, needs op `kind` of stage src, same k."""
        cross = rank_of[src] != rank_of[dst]
        prev_arr = None
        for k in range(M):
            if cross and lat > 0:
                arr = m.NewIntVar(0, horizon, f"arr{kind}{src}_{k}")
                m.Add(arr >= en[kind, src, k] + lat)
                if prev_arr is not None:
                    m.Add(arr >= prev_arr + lat)
                m.Add(st[kind, dst, k] >= arr)
                prev_arr = arr
            else:
                m.Add(st[kind, dst, k] >= en[kind, src, k])

    for s in range(S):
        if prv[s] is not None:
            link("F", prv[s], s)
        if nxt[s] is not None:
            link("B", nxt[s], s)
        else:
            for k in range(M):
                m.Add(st["B", s, k] >= en["F", s, k])
        for k in range(M):
            m.Add(st["W", s, k] >= en["B", s, k])
            if k + 1 < M:
                for kind in ("F", "B", "W"):
                    m.Add(st[kind, s, k + 1] >= en[kind, s, k])
    cap = inst["cap"]
    for r in range(P):
        times, deltas = [], []
        for s in range(S):
            if rank_of[s] != r:
                continue
            for k in range(M):
                times += [st["F", s, k], en["W", s, k]]
                deltas += [1, -1]
        m.AddReservoirConstraint(times, deltas, 0, cap)
    mk = m.NewIntVar(0, horizon, "makespan")
    for s in range(S):
        for k in range(M):
            m.Add(mk >= en["W", s, k])
    m.Minimize(mk)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 1
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, solver.BestObjectiveBound() / sc, False, solver.WallTime(), None
    # Each rank's ops in start order, as tokens ("F3": a forward of stage 3; the k-th of a
    # kind on a stage is micro-batch k).
    order = []
    for r in range(P):
        ops = [
            (solver.Value(st[kind, s, k]), kind, s)
            for s in range(S)
            if rank_of[s] == r
            for k in range(M)
            for kind in ("F", "B", "W")
        ]
        order.append([f"{kind}{s}" for _, kind, s in sorted(ops)])
    return (
        solver.ObjectiveValue() / sc,
        solver.BestObjectiveBound() / sc,
        status == cp_model.OPTIMAL,
        solver.WallTime(),
        order,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per instance")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    n = proved = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        inst = json.loads(line)
        best, bound, ok, wall, order = solve(inst, a.time_limit, a.workers)
        n += 1
        proved += ok
        out = {k: inst[k] for k in ("placement", "P", "M", "cost", "cap")}
        out.update(
            cpsat=best, cpsat_bound=bound, proved=ok, seconds=round(wall, 3), order=order
        )
        print(json.dumps(out), flush=True)
    print(f"{n} instances, {proved} proved optimal by CP-SAT", file=sys.stderr)


if __name__ == "__main__":
    main()
