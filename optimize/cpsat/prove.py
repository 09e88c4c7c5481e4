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

An instance CP-SAT proves has no schedule within its cap is written with `cpsat` and
`cpsat_bound` null and `infeasible` true.

Every line is read and checked before any is solved; an empty input, a line that is not a
JSON object with the fields above, or a time that is not positive, finite and a multiple of
0.001 is an error naming the line (exit 2, nothing written).

Usage: python3 prove.py [--time-limit S] [--workers N] < instances.jsonl
"""


class InputError(Exception):
    """An instance line that cannot be solved (its message names the field)."""


def die(msg):
    """Reports `msg` on stderr and exits 2 (unreadable input or bad usage)."""
    print(f"prove.py: {msg}", file=sys.stderr)
    sys.exit(2)

import argparse
import json
import math
import sys

# Imported in main(), after the input is read and checked: bad input is reported without
# OR-Tools installed, and a missing OR-Tools gets its own message.
cp_model = None


def scale_of(inst):
    vals = inst["d_f"] + inst["d_b"] + inst["d_w"] + [inst["lat"]]
    for sc in (1, 10, 20, 100, 1000):
        if all(abs(v * sc - round(v * sc)) < 1e-9 for v in vals):
            return sc
    raise InputError("op and message times must be multiples of 0.001 seconds")


def solve(inst, time_limit, workers):
    sc = scale_of(inst)
    S, M = len(inst["rank_of"]), inst["M"]
    P = max(inst["rank_of"]) + 1
    rank_of, nxt, prv = inst["rank_of"], inst["next"], inst["prev"]
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
    if status == cp_model.INFEASIBLE:
        return None, None, False, solver.WallTime(), None
    if status == cp_model.MODEL_INVALID:
        raise InputError(f"CP-SAT rejects the model: {m.Validate()}")
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


def check(inst):
    """Raises InputError unless `inst` is an instance dump_small writes: field types, list
    lengths, stage links within range, positive finite op times, a non-negative message
    time, a positive cap, BW >= B + W."""
    if not isinstance(inst, dict):
        raise InputError("not a JSON object")
    for k in ("placement", "P", "M", "cost", "cap", "rank_of", "next", "prev",
              "d_f", "d_b", "d_w", "d_bw", "lat"):
        if k not in inst:
            raise InputError(f"missing field `{k}`")

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    def is_num(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    for k in ("P", "M", "cap"):
        if not is_int(inst[k]) or inst[k] < 1:
            raise InputError(f"`{k}` must be a positive integer, got {inst[k]!r}")
    rank_of = inst["rank_of"]
    if not isinstance(rank_of, list) or not rank_of:
        raise InputError("`rank_of` must be a non-empty list of ranks")
    S = len(rank_of)
    if not all(is_int(r) and 0 <= r < inst["P"] for r in rank_of):
        raise InputError(f"`rank_of` must hold ranks in 0..{inst['P'] - 1}")
    for k in ("next", "prev"):
        v = inst[k]
        if not isinstance(v, list) or len(v) != S:
            raise InputError(f"`{k}` must be a list of {S} stages or nulls")
        if not all(x is None or (is_int(x) and 0 <= x < S) for x in v):
            raise InputError(f"`{k}` must hold stages in 0..{S - 1} or null")
    for k in ("d_f", "d_b", "d_w", "d_bw"):
        v = inst[k]
        if not isinstance(v, list) or len(v) != S:
            raise InputError(f"`{k}` must be a list of {S} times")
        for s, x in enumerate(v):
            if not is_num(x) or not math.isfinite(x) or x <= 0:
                raise InputError(f"`{k}` of stage {s} must be a positive, finite time, got {x!r}")
    lat = inst["lat"]
    if not is_num(lat) or not math.isfinite(lat) or lat < 0:
        raise InputError(f"`lat` must be a non-negative, finite time, got {lat!r}")
    for s in range(S):
        if inst["d_bw"][s] < inst["d_b"][s] + inst["d_w"][s] - 1e-12:
            raise InputError(
                f"stage {s}: BW faster than B + W: fused backwards are not modelled"
            )
    scale_of(inst)


def read_instances(lines):
    """The instances of `lines` (blank lines skipped) with their line numbers, each
    checked; exits 2 naming the first bad line."""
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            try:
                inst = json.loads(line.strip())
            except json.JSONDecodeError as e:
                raise InputError(f"not JSON: {e.msg} at column {e.colno}") from None
            check(inst)
        except InputError as e:
            die(f"standard input, line {no}: {e}")
        out.append((no, inst))
    if not out:
        die("no instances on standard input (expected JSON lines from `--example dump_small`)")
    return out


def main():
    global cp_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per instance")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    if not (math.isfinite(a.time_limit) and a.time_limit > 0):
        ap.error(f"--time-limit must be a positive number of seconds, got {a.time_limit}")
    if a.workers < 1:
        ap.error(f"--workers must be at least 1, got {a.workers}")
    insts = read_instances(sys.stdin)
    try:
        from ortools.sat.python import cp_model as cp
    except ImportError:
        die("OR-Tools is not installed in this Python (see optimize/cpsat/README.md: "
            "pip install ortools in a venv)")
    cp_model = cp
    n = proved = infeasible = 0
    for no, inst in insts:
        try:
            best, bound, ok, wall, order = solve(inst, a.time_limit, a.workers)
        except InputError as e:
            die(f"standard input, line {no}: {e}")
        n += 1
        proved += ok
        out = {k: inst[k] for k in ("placement", "P", "M", "cost", "cap")}
        # Labels a dump may carry (dump_reference: the configuration and the authors'
        # makespan) pass through.
        out.update({k: inst[k] for k in ("id", "authors") if k in inst})
        out.update(
            cpsat=best, cpsat_bound=bound, proved=ok, seconds=round(wall, 3), order=order
        )
        if best is None and bound is None:
            out["infeasible"] = True
            infeasible += 1
        print(json.dumps(out), flush=True)
    print(
        f"{n} instances, {proved} proved optimal by CP-SAT"
        + (f", {infeasible} proved to have no schedule within the cap" if infeasible else ""),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
