#!/usr/bin/env python3
"""End-to-end tests of schedc_torch_runtime: schedc's per-rank programs on torch.distributed.

Run with the torch 2.15 virtual environment's python (``run_e2e.sh`` does)::

    python backends/torch/test_runtime.py --schedc target/debug/schedc [--only NAME ...]

What it checks (one line per check, then ``N passed, M failed``; exit status 1 on a failure):

1. **units** (one process): the split backward (:mod:`schedc_autograd`) equals one fused
   backward on the MoE stage, with a weight used twice and without input gradients; program
   files with a wrong version, schedc's model granularity, or a rank out of range are refused.
2. **every spec in specs/** (and MoE parts, channels, the schedule's collectives, DualPipe with
   data parallelism): ``schedc compile --granularity stage``, P gloo processes on 127.0.0.1,
   the MoE transformer of ``moe_model.py`` (one block per stage), 3 SGD steps in f64 and in
   f32; every micro-batch loss and every gradient of every step against non-pipelined
   training of the same model on the same batch (relative error max|a-b| / max|b| per
   tensor: f64 <= 1e-10, f32 <= 1e-5); the peak of live activation stashes equals the
   verifier's; every stash's tensors are gone when the program frees it.
3. **torch**: for 1F1B, interleaved 1F1B, ZB-V and DualPipeV, the same schedule on torch's
   ``_PipelineScheduleRuntime`` (``schedc convert --torch-format compute-comms``) and on this
   runtime, in the same processes, alternating steps: equal losses; the ratio of median step
   times (ours / torch's) is reported (goal <= 1.2).
4. **calibration**: ``profile=True``, ``write_profile``, ``schedc sim --cost`` of the
   profile: the simulated makespan against the measured mean step time (within 25%), for
   1F1B, ZB-V, DualPipeV and DualPipeV in MoE parts.
5. **faults**: a rank killed in the middle of a step, and a message that is never sent: every
   rank ends with a SchedcRuntimeError naming its rank, op and peer, within the timeout.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import moe_model as mm  # noqa: E402
import schedc_autograd as sag  # noqa: E402
import schedc_torch_runtime as rtm  # noqa: E402

STEPS = 3
SEED = 20261
MB_ROWS = 2  # sequences per micro-batch
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
LR = 0.1

# (name, input, schedc arguments, mesh, moe split, overlap callback)
CONFIGS = [
    ("gpipe", "specs/gpipe.sched", ["--pp", "2", "--mb", "4"], None, False, False),
    ("1f1b", "specs/1f1b.sched", ["--pp", "4", "--mb", "4"], None, False, False),
    ("interleaved_1f1b", "specs/interleaved_1f1b.sched", ["--pp", "2", "--vpp", "2", "--mb", "4"], None, False, False),
    ("interleaved_1f1b_a2a", "specs/interleaved_1f1b_a2a.sched", ["--pp", "2", "--vpp", "2", "--mb", "4"], None, False, True),
    ("interleaved_zb", "specs/interleaved_zb.sched", ["--pp", "2", "--vpp", "2", "--mb", "4"], None, False, False),
    ("looped_bfs", "specs/looped_bfs.sched", ["--pp", "2", "--vpp", "2", "--mb", "2"], None, False, False),
    ("zb_h1", "specs/zb_h1.sched", ["--pp", "2", "--mb", "3"], None, False, False),
    ("zb_h2", "specs/zb_h2.sched", ["--pp", "2", "--mb", "3"], None, False, False),
    ("zbv", "specs/zbv.sched", ["--pp", "2", "--mb", "4"], None, False, False),
    ("v_half", "specs/v_half.sched", ["--pp", "2", "--mb", "4"], None, False, False),
    ("v_min", "specs/v_min.sched", ["--pp", "4", "--mb", "4"], None, False, False),
    ("hanayo", "specs/hanayo.sched", ["--pp", "2", "--mb", "4"], None, False, False),
    ("chimera", "specs/chimera.sched", ["--pp", "2", "--mb", "4"], None, False, False),
    ("chimera_direct", "specs/chimera_direct.sched", ["--pp", "2", "--mb", "4"], None, False, False),
    ("dualpipev", "specs/dualpipev.sched", ["--pp", "2", "--mb", "4"], None, False, True),
    ("dualpipe", "specs/dualpipe.sched", ["--pp", "4", "--mb", "8"], None, False, True),
    ("dualpipe-dp2", "specs/dualpipe.sched", ["--pp", "2", "--mb", "4"], "pp=2,dp=2", False, False),
    ("dualpipev-moe-parts", "specs/dualpipev.sched", ["--pp", "2", "--mb", "4"], None, True, False),
    ("zb_h1-moe-parts", "specs/zb_h1.sched", ["--pp", "2", "--mb", "3"], None, True, False),
    ("dualpipe-moe-parts", "specs/dualpipe.sched", ["--pp", "2", "--mb", "4"], None, True, False),
    # The cost-aware part order: split weight gradients (W.mlp, W.attn) and WAIT_RA/RG waits.
    ("dualpipe-moe-list", "specs/dualpipe.sched", ["--pp", "4", "--mb", "8", "--moe=all:list"], None, False, False),
    ("dualpipev-moe-list", "specs/dualpipev.sched", ["--pp", "2", "--mb", "4", "--moe=all:list"], None, False, False),
    ("channels", "tests/cases/channels-separate-streams.case", [], None, False, False),
    ("collectives", "tests/cases/a2a-order-agrees.case", [], None, False, False),
]
# Every spec of specs/ must be in CONFIGS (checked).
# Negative controls: a runtime fault that must make the gradient comparison fail.
CONTROLS = [
    ("control-no-replica-sum", "specs/dualpipe.sched", ["--pp", "2", "--mb", "4"], None, False, False),
    ("control-kept-stash", "specs/zbv.sched", ["--pp", "2", "--mb", "4"], None, False, False),
]
CONTROL_FAULTS = {"control-no-replica-sum": {"skip_replica_sum": True},
                  "control-kept-stash": {"keep_stashes": True}}
CONTROL_WHY = {"control-no-replica-sum": "DualPipe without the replica gradient sum",
               "control-kept-stash": "a runtime that keeps a reference to every freed stash"}
TORCH_CONFIGS = [  # (name, spec, P, V, M): schedules torch's runtime also runs
    ("1f1b", "specs/1f1b.sched", 2, 1, 8),
    ("interleaved_1f1b", "specs/interleaved_1f1b.sched", 2, 2, 8),
    ("zbv", "specs/zbv.sched", 2, 2, 8),
    ("dualpipev", "specs/dualpipev.sched", 2, 2, 8),
]
CALIBRATION = [("1f1b", "specs/1f1b.sched", ["--pp", "2", "--mb", "8"], False),
               ("zbv", "specs/zbv.sched", ["--pp", "2", "--mb", "8"], False),
               ("dualpipev", "specs/dualpipev.sched", ["--pp", "2", "--mb", "8"], False),
               ("dualpipev-moe-parts", "specs/dualpipev.sched", ["--pp", "2", "--mb", "8"], True)]


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


class Tally:
    def __init__(self):
        self.passed, self.failed = 0, []

    def record(self, name: str, ok: bool, detail: str) -> None:
        print(f"  {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)


def schedc(exe: str, args: list[str]) -> str:
    p = subprocess.run([exe, *args], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"schedc {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compile_program(exe: str, inp: str, args: list[str], mesh: str | None,
                    moe: bool, out: str) -> list[int]:
    """``schedc compile --granularity stage`` into ``out``; returns the verifier's stash peaks."""
    if moe:  # schedc's own MoE lowering: every F, B, BW of every stage in four parts
        args = [*args, "--moe"]
    extra = ["--mesh", mesh] if mesh else []
    text = schedc(exe, ["compile", inp, *args, *extra, "--granularity", "stage", "-o", out])
    m = re.search(r"peak stash per rank \[([\d, ]*)\]", text)
    return [int(x) for x in m.group(1).split(",")] if m and m.group(1) else []


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    den = b.abs().max().item()
    num = (a - b).abs().max().item()
    return num / den if den > 0 else num


def spawn(world: int, target, cfg: dict, timeout: float, per_rank: int | None = None):
    """Runs ``target(rank, world, port, cfg, results)`` in ``world`` processes, each putting
    ``per_rank`` results ``(rank, result, error text)`` on the queue; returns
    ({rank: [results]}, or {rank: result} without ``per_rank``, {rank: error text}, seconds)."""
    single = per_rank is None
    per_rank = per_rank or 1
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, cfg, results)) for r in range(world)]
    t0 = time.time()
    for p in procs:
        p.start()
    got, errors = {}, {}
    n = 0
    deadline = time.time() + timeout
    while n < world * per_rank and time.time() < deadline:
        try:
            rank, res, err = results.get(timeout=0.5)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        n += 1
        if err is not None:
            errors.setdefault(rank, err)
        else:
            got.setdefault(rank, []).append(res)
    if single:
        got = {r: v[0] for r, v in got.items()}
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    return got, errors, time.time() - t0


def init(rank: int, world: int, port: int, timeout: float = 120) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))


def seq_callback(calls: list):
    """A sequential ``overlapped_forward_backward`` (DualPipe's example does the same)."""
    def cb(f: rtm.FChunk, b: rtm.BChunk):
        calls.append((f.stage, f.mb, b.stage, b.mb))
        f.forward()
        b.backward()
    return cb


# ------------------------------------------------------------------------------------------
# 1. Units
# ------------------------------------------------------------------------------------------


def check_units(tally: Tally, tmp: str, exe: str) -> None:
    torch.manual_seed(0)
    cfg = mm.Config()
    st = mm.build(cfg, 3, 5)[1]
    params = [p for p in st.parameters()]
    x = torch.randn(2, cfg.seq, cfg.dim, dtype=torch.float64)
    g = torch.randn(2, cfg.seq, cfg.dim, dtype=torch.float64)

    def fused():
        xl = x.clone().requires_grad_()
        return torch.autograd.grad(st(xl), [xl, *params], g, allow_unused=True)

    ref = fused()
    xl = x.clone().requires_grad_()
    ig, plan = sag.input_backward([st(xl)], [g], [xl], params)
    for p in params:
        p.grad = None
    sag.weight_backward(plan, params)
    err_x = rel_err(ig[0], ref[0])
    err_w = max(rel_err(p.grad, r) for p, r in zip(params, ref[1:]) if r is not None)
    tally.record("units split backward (MoE stage)", err_x == 0 and err_w <= 1e-14,
                 f"input grad rel err {err_x:.1e}, weight grads max rel err {err_w:.1e}")
    # A weight used twice, one use below the other on the input path.
    lin = torch.nn.Linear(8, 8).double()
    lp = list(lin.parameters())
    x8, g8 = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    xl = x8.clone().requires_grad_()
    ref = torch.autograd.grad(lin(torch.tanh(lin(xl))), [xl, *lp], g8)
    xl = x8.clone().requires_grad_()
    ig, plan = sag.input_backward([lin(torch.tanh(lin(xl)))], [g8], [xl], lp)
    for p in lp:
        p.grad = None
    sag.weight_backward(plan, lp)
    err = max(rel_err(p.grad, r) for p, r in zip(lp, ref[1:]))
    tally.record("units split backward (shared weight)", rel_err(ig[0], ref[0]) == 0 and err <= 1e-14,
                 f"weight grads max rel err {err:.1e} (without the clamp: counted twice)")
    # No input gradient (a first stage): W does the whole backward.
    first = mm.build(cfg, 3, 5)[0]
    fp = list(first.parameters())
    tok = torch.randint(0, cfg.vocab, (2, cfg.seq))
    ref = torch.autograd.grad(first(tok), fp, g, allow_unused=True)
    ig, plan = sag.input_backward([first(tok)], [g], [], fp)
    for p in fp:
        p.grad = None
    sag.weight_backward(plan, fp)
    err = max(rel_err(p.grad, r) for p, r in zip(fp, ref) if r is not None)
    tally.record("units split backward (first stage)", ig == () and err <= 1e-14,
                 f"weight grads max rel err {err:.1e}")

    # Program files the runtime refuses.
    d = os.path.join(tmp, "units-model")
    schedc(exe, ["compile", "specs/1f1b.sched", "--pp", "2", "--mb", "2", "-o", d])
    cases = [("model granularity", d, 0, "--granularity stage")]
    d2 = os.path.join(tmp, "units-stage")
    schedc(exe, ["compile", "specs/1f1b.sched", "--pp", "2", "--mb", "2", "--granularity", "stage", "-o", d2])
    cases.append(("rank out of range", d2, 2, "rank 2 is out of range"))
    d3 = os.path.join(tmp, "units-v1")
    os.makedirs(d3)
    for f in os.listdir(d2):
        with open(os.path.join(d2, f)) as src, open(os.path.join(d3, f), "w") as dst:
            dst.write(src.read())
    m = json.load(open(os.path.join(d3, "manifest.json")))
    m["format_version"] = 1
    json.dump(m, open(os.path.join(d3, "manifest.json"), "w"))
    cases.append(("old format version", d3, 0, "format version 1; this runtime reads version 2"))
    cases.append(("missing directory", os.path.join(tmp, "nope"), 0, "cannot read"))
    for name, path, rank, words in cases:
        try:
            rtm.read_program(path, rank)
            tally.record(f"units refuses {name}", False, "no error")
        except rtm.ProgramFormatError as e:
            tally.record(f"units refuses {name}", words in str(e), str(e))
    p = rtm.read_program(d2, 1)
    texts = [rtm.op_text(o) for o in p.streams[1][1]]
    tally.record("units op text", "send grad(1,0) to rank 0" in texts and "recv act(0,0) from rank 0" in texts,
                 f"rank 1 comm stream starts {texts[:3]}")
    d3 = os.path.join(tmp, "units-moe")
    schedc(exe, ["compile", "specs/dualpipev.sched", "--pp", "1", "--mb", "2", "--moe", "--granularity", "stage",
                 "-o", d3])
    texts = [rtm.op_text(o) for o in rtm.read_program(d3, 0).streams[0][1]]
    kernels = [t for t in texts if re.fullmatch(r"(F|B|W|BW)\(\d+,\d+\)(\.\w+)?", t)]
    tally.record("units MoE parts (schedc compile --moe)",
                 kernels[:4] == ["F(0,0).attn", "F(0,0).dispatch", "F(0,0).mlp", "F(0,0).combine"]
                 and not any(t.startswith("W(") and "." in t for t in kernels),
                 f"rank 0 compute stream kernels start {kernels[:4]}")


# ------------------------------------------------------------------------------------------
# 2. Equivalence with non-pipelined training
# ------------------------------------------------------------------------------------------


def shard_batch(cfg: mm.Config, step: int, shard: int, chunks: int):
    return mm.batch(cfg, chunks * MB_ROWS, SEED + 1000 * shard + step)


def equivalence_worker(rank: int, world: int, port: int, c: dict, results) -> None:
    """Every configuration of ``c["configs"]`` (all with this world size), one after the other
    in the same processes; one result per configuration."""
    try:
        init(rank, world, port)
    except BaseException:  # noqa: BLE001
        for cc in c["configs"]:
            results.put((rank, (cc["name"], None), traceback.format_exc()))
        return
    for cc in c["configs"]:
        try:
            results.put((rank, (cc["name"], run_equivalence(rank, cc)), None))
        except BaseException:  # noqa: BLE001
            results.put((rank, (cc["name"], None), traceback.format_exc()))
        try:
            dist.barrier()
        except BaseException:  # noqa: BLE001
            pass
    dist.destroy_process_group()


def run_equivalence(rank: int, c: dict) -> dict:
    prog = rtm.read_program(c["dir"], rank)
    n_model = prog.manifest["model_stages"]
    n_chunks = prog.total_microbatches
    shards = c["shards"]
    out = {"rank": rank, "peak": 0, "leaks": 0, "calls": 0, "dtypes": {}}
    for dtype in (torch.float64, torch.float32):
        torch.set_default_dtype(dtype)
        cfg = mm.Config()
        calls: list = []
        rt = rtm.ProgramRuntime(
            prog, make_stage=mm.maker(cfg, n_model, SEED, dtype), loss_fn=mm.loss_fn,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
            moe_parts=rtm.MoEParts.methods(),
            overlapped_forward_backward=seq_callback(calls) if c["callback"] else None,
            timeout=c["timeout"], _faults={"check_leaks": True, **c.get("faults", {})})
        ref = mm.build(cfg, n_model, SEED, dtype)
        ref_opt = torch.optim.SGD([p for s in ref for p in s.parameters()], lr=LR)
        loss_err = grad_err = 0.0
        n_grads = 0
        losses = []
        for step in range(STEPS):
            batches = [shard_batch(cfg, step, sh, n_chunks) for sh in range(shards)]
            # Reference: the mean loss over every shard's micro-batches, one step.
            ref_opt.zero_grad()
            ref_losses = {}
            for sh, (x, y) in enumerate(batches):
                for i, (xm, ym) in enumerate(zip(x.tensor_split(n_chunks), y.tensor_split(n_chunks))):
                    h = xm
                    for s in ref:
                        h = s(h)
                    loss = mm.loss_fn(h, ym)
                    (loss / (n_chunks * shards)).backward()
                    ref_losses[(sh, i)] = loss.detach()
            x, y = batches[prog.data_shard]
            got = rt.step(x, y)
            for g, l in zip(rt.loss_chunks, got):
                want = ref_losses[(prog.data_shard, g)]
                loss_err = max(loss_err, rel_err(l, want))
                losses.append((step, g, l.item(), want.item()))
            for sid, st in rt.stages.items():
                rs = ref[st.info.model_stage]
                for (name, p), (_, q) in zip(st.module.named_parameters(), rs.named_parameters()):
                    if q.grad is None:
                        continue
                    if p.grad is None:
                        raise AssertionError(f"stage {sid} parameter {name} has no gradient")
                    grad_err = max(grad_err, rel_err(p.grad, q.grad))
                    n_grads += 1
            ref_opt.step()
        out["dtypes"][str(dtype)] = {"loss_err": loss_err, "grad_err": grad_err,
                                     "grads": n_grads, "losses": losses}
        out["peak"] = rt.peak_stash
        out["leaks"] += rt.leaked_stashes
        out["calls"] += len(calls)
    return out


def check_equivalence(tally: Tally, exe: str, tmp: str, only, timeout: float) -> None:
    names = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(ROOT, "specs")) if f.endswith(".sched")}
    covered = {os.path.splitext(os.path.basename(c[1]))[0] for c in CONFIGS if c[1].startswith("specs/")}
    tally.record("every spec in specs/ is tested", names <= covered,
                 f"missing {sorted(names - covered)}" if names - covered else f"{len(names)} specs")
    by_world: dict[int, list[dict]] = {}
    for name, inp, args, mesh, moe, callback in CONFIGS + CONTROLS:
        if only and name not in only:
            continue
        out = os.path.join(tmp, name)
        try:
            peaks = compile_program(exe, inp, args, mesh, moe, out)
        except Exception as e:  # noqa: BLE001
            tally.record(f"{name} compile", False, str(e))
            continue
        man = json.load(open(os.path.join(out, "manifest.json")))
        shards = 1
        for d, n in man["mesh"]["dims"]:
            if d in ("dp", "ep"):
                shards *= n
        by_world.setdefault(man["world"], []).append(
            {"name": name, "dir": out, "callback": callback, "shards": shards, "timeout": 60.0,
             "peaks": peaks, "faults": CONTROL_FAULTS.get(name, {})})
    for world, cfgs in sorted(by_world.items()):
        print(f"   {len(cfgs)} configuration(s) on {world} processes: {', '.join(c['name'] for c in cfgs)}", flush=True)
        got, errors, secs = spawn(world, equivalence_worker, {"configs": cfgs},
                                  timeout * len(cfgs), per_rank=len(cfgs))
        res = {(r, name): o for r, lst in got.items() for name, o in lst}
        for r, e in sorted(errors.items()):
            print(e, file=sys.stderr)
        for c in cfgs:
            report_equivalence(tally, c, world, {r: res.get((r, c["name"])) for r in range(world)}, errors)
        print(f"   ({secs:.1f}s)", flush=True)


def report_equivalence(tally: Tally, c: dict, world: int, got: dict, errors: dict) -> None:
    name = c["name"]
    if any(v is None for v in got.values()):
        why = "; ".join(f"rank {r}: {e.strip().splitlines()[-1]}" for r, e in sorted(errors.items()))
        missing = sorted(r for r, v in got.items() if v is None)
        tally.record(f"{name} training", False, why or f"no result from ranks {missing}")
        return
    if name == "control-kept-stash":
        leaks = sum(r["leaks"] for r in got.values())
        tally.record(f"{name} (negative control)", leaks > 0,
                     f"{CONTROL_WHY[name]}: {leaks} stashes alive after their free "
                     f"(the memory check {'notices' if leaks else 'MISSES'} it)")
        return
    if name in CONTROL_FAULTS:
        ge = max(r["dtypes"]["torch.float64"]["grad_err"] for r in got.values())
        tally.record(f"{name} (negative control)", ge > 1e-3,
                     f"{CONTROL_WHY[name]}: gradients max rel err {ge:.1e} "
                     f"(the comparison {'notices' if ge > 1e-3 else 'MISSES'} it)")
        return
    for dt, tol in (("torch.float64", 1e-10), ("torch.float32", 1e-5)):
        le = max(r["dtypes"][dt]["loss_err"] for r in got.values())
        ge = max(r["dtypes"][dt]["grad_err"] for r in got.values())
        ng = sum(r["dtypes"][dt]["grads"] for r in got.values())
        nl = sum(len(r["dtypes"][dt]["losses"]) for r in got.values())
        last = [x for r in got.values() for x in r["dtypes"][dt]["losses"] if x[0] == STEPS - 1]
        tally.record(
            f"{name} {dt[6:]}", le <= tol and ge <= tol and nl > 0 and ng > 0,
            f"{STEPS} steps, {nl} micro-batch losses (last step {statistics.fmean(x[2] for x in last):.6f}), "
            f"max rel err loss {le:.1e}, {ng} gradients max rel err {ge:.1e} (tolerance {tol:.0e})")
    have = [got[r]["peak"] for r in range(world)]
    leaks = sum(r["leaks"] for r in got.values())
    tally.record(f"{name} memory", have == c["peaks"] and leaks == 0,
                 f"peak live stashes per rank {have}, verifier {c['peaks']}; {leaks} stashes alive after their free")
    if c["callback"]:
        calls = sum(r["calls"] for r in got.values())
        tally.record(f"{name} overlap callback", calls > 0, f"overlapped_forward_backward called {calls} times")


# ------------------------------------------------------------------------------------------
# 3. Against torch's runtime
# ------------------------------------------------------------------------------------------

TORCH_CFG = mm.Config(vocab=64, dim=64, heads=4, seq=32, experts=0)
TORCH_ROWS = 4
# Calibration: ops of a few milliseconds, so that compute, not the machine's scheduling
# noise, makes the step.
CAL_CFG = mm.Config(vocab=64, dim=128, heads=4, seq=64, experts=0)
CAL_MOE_CFG = mm.Config(vocab=64, dim=128, heads=4, seq=64, experts=4, expert_dim=256)


def torch_worker(rank: int, world: int, port: int, c: dict, results) -> None:
    try:
        init(rank, world, port)
        from torch.distributed.pipelining import PipelineStage

        import schedc_torch

        torch.set_default_dtype(torch.float32)
        cfg = TORCH_CFG
        prog = rtm.read_program(c["dir"], rank)
        n = prog.manifest["model_stages"]
        m = prog.total_microbatches
        ours = rtm.ProgramRuntime(prog, make_stage=mm.maker(cfg, n, SEED, torch.float32),
                                  loss_fn=mm.loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
                                  timeout=60.0)
        base = mm.build(cfg, n, SEED, torch.float32)
        local = schedc_torch.stages_of_rank(c["csv"], rank)
        mods = [copy.deepcopy(base[s]) for s in local]
        stages = []
        for s, mod in zip(local, mods):
            x_in = (torch.zeros(TORCH_ROWS, cfg.seq, dtype=torch.long) if s == 0
                    else torch.zeros(TORCH_ROWS, cfg.seq, cfg.dim, requires_grad=True))
            x_out = torch.zeros(TORCH_ROWS, cfg.seq, cfg.vocab if s == n - 1 else cfg.dim, requires_grad=True)
            stages.append(PipelineStage(mod, s, n, torch.device("cpu"), input_args=x_in, output_args=x_out))
        theirs = schedc_torch.load_schedule(c["csv"], stages, m, mm.loss_fn)
        opt = torch.optim.SGD([p for mod in mods for p in mod.parameters()], lr=LR)
        t_ours, t_theirs, loss_err = [], [], 0.0
        for step in range(c["steps"]):
            x, y = mm.batch(cfg, m * TORCH_ROWS, SEED + step)
            order = ("ours", "theirs") if step % 2 == 0 else ("theirs", "ours")
            res = {}
            for who in order:
                dist.barrier()
                t0 = time.perf_counter()
                if who == "ours":
                    res["ours"] = ours.step(x, y)
                else:
                    opt.zero_grad()
                    ls: list = []
                    theirs.step(x, target=y, losses=ls)
                    opt.step()
                    res["theirs"] = ls
                dist.barrier()
                (t_ours if who == "ours" else t_theirs).append(time.perf_counter() - t0)
            if res["theirs"]:
                ch = ours.loss_chunks
                for g, l in zip(ch, res["ours"]):
                    loss_err = max(loss_err, rel_err(l, res["theirs"][g].detach()))
        warm = c["warmup"]
        out = {"ours": statistics.median(t_ours[warm:]), "theirs": statistics.median(t_theirs[warm:]),
               "loss_err": loss_err, "has_loss": bool(ours.loss_chunks)}
        dist.destroy_process_group()
        results.put((rank, out, None))
    except BaseException:  # noqa: BLE001
        results.put((rank, None, traceback.format_exc()))


def check_torch(tally: Tally, exe: str, tmp: str, only, timeout: float, steps: int) -> None:
    for name, spec, pp, vpp, mb in TORCH_CONFIGS:
        key = f"torch-{name}"
        if only and key not in only:
            continue
        inst = ["--pp", str(pp), "--mb", str(mb)] + (["--vpp", str(vpp)] if vpp > 1 else [])
        d = os.path.join(tmp, key)
        csv = os.path.join(tmp, f"{key}.csv")
        try:
            schedc(exe, ["compile", spec, *inst, "--granularity", "stage", "-o", d])
            schedc(exe, ["convert", spec, *inst, "--to", "torch-csv", "--torch-format", "compute-comms",
                         "-o", csv, "--force"])
        except Exception as e:  # noqa: BLE001
            tally.record(f"{key} export", False, str(e))
            continue
        got, errors, secs = spawn(pp, torch_worker, {"dir": d, "csv": csv, "steps": steps, "warmup": 2}, timeout)
        if errors or len(got) < pp:
            for e in errors.values():
                print(e, file=sys.stderr)
            tally.record(f"{key}", False, "; ".join(e.strip().splitlines()[-1] for e in errors.values()) or "no result")
            continue
        le = max(r["loss_err"] for r in got.values())
        ours, theirs = got[0]["ours"], got[0]["theirs"]
        tally.record(f"{key} losses", le <= 1e-5 and any(r["has_loss"] for r in got.values()),
                     f"{steps} steps on both runtimes, max rel err of the micro-batch losses {le:.1e}")
        ratio = ours / theirs
        tally.record(f"{key} step time", ratio <= 1.2,
                     f"median step {ours * 1e3:.1f} ms (schedc_torch_runtime) vs {theirs * 1e3:.1f} ms "
                     f"(torch _PipelineScheduleRuntime): ratio {ratio:.2f} (goal <= 1.2)")
        print(f"   ({secs:.1f}s)", flush=True)


# ------------------------------------------------------------------------------------------
# 4. Calibration
# ------------------------------------------------------------------------------------------


def calib_worker(rank: int, world: int, port: int, c: dict, results) -> None:
    try:
        init(rank, world, port)
        torch.set_default_dtype(torch.float32)
        cfg = CAL_MOE_CFG if c["moe"] else CAL_CFG
        prog = rtm.read_program(c["dir"], rank)
        n = prog.manifest["model_stages"]
        rt = rtm.ProgramRuntime(prog, make_stage=mm.maker(cfg, n, SEED, torch.float32),
                                loss_fn=mm.loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
                                moe_parts=rtm.MoEParts.methods(), timeout=60.0, profile=True)
        times = []
        for step in range(c["steps"]):
            x, y = mm.batch(cfg, prog.total_microbatches * TORCH_ROWS, SEED + step)
            dist.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            rt.step(x, y)
            times.append(time.perf_counter() - t0)
        # The step's time is its last rank's.
        every: list = [None] * world
        dist.all_gather_object(every, times)
        per_step = [max(ts[i] for ts in every) for i in range(len(times))]
        rt.write_profile(c["toml"], skip_steps=2)
        dist.destroy_process_group()
        # The mean, like the profile's op times (noise on a shared machine moves both).
        results.put((rank, {"mean": statistics.fmean(per_step[2:])}, None))
    except BaseException:  # noqa: BLE001
        results.put((rank, None, traceback.format_exc()))


def check_calibration(tally: Tally, exe: str, tmp: str, only, timeout: float, steps: int) -> None:
    for name, spec, args, moe in CALIBRATION:
        key = f"calibration-{name}"
        if only and key not in only:
            continue
        d = os.path.join(tmp, key)
        toml = os.path.join(tmp, f"{key}.toml")
        compile_program(exe, spec, args, None, moe, d)
        if moe:  # simulate what was compiled: the schedule split into parts
            args = [*args, "--moe"]
        world = json.load(open(os.path.join(d, "manifest.json")))["world"]
        # A shared machine's load moves single steps by a factor of two: one rerun when the
        # first attempt is outside the bound, and both ratios reported.
        ratios, detail, failed = [], "", None
        for attempt in range(2):
            got, errors, _ = spawn(world, calib_worker, {"dir": d, "toml": toml, "steps": steps, "moe": moe},
                                   timeout)
            if errors or len(got) < world:
                for e in errors.values():
                    print(e, file=sys.stderr)
                failed = "; ".join(e.strip().splitlines()[-1] for e in errors.values()) or "no result"
                break
            try:
                sim = json.loads(schedc(exe, ["sim", spec, *args, "--cost", toml, "--format", "json"]))
            except Exception as e:  # noqa: BLE001
                failed = f"schedc sim --cost {toml}: {e}"
                break
            measured = got[0]["mean"]
            ratios.append(sim["makespan"] / measured)
            detail = (f"simulated makespan {sim['makespan'] * 1e3:.1f} ms from the profile, measured step "
                      f"{measured * 1e3:.1f} ms (mean of {steps - 2})")
            if abs(ratios[-1] - 1) <= 0.25:
                break
        if failed:
            tally.record(key, False, failed)
            continue
        tally.record(key, abs(ratios[-1] - 1) <= 0.25,
                     f"{detail}: ratio {ratios[-1]:.2f} (within 25%)"
                     + (f"; first attempt {ratios[0]:.2f}" if len(ratios) > 1 else ""))


# ------------------------------------------------------------------------------------------
# 5. Faults
# ------------------------------------------------------------------------------------------


def fault_worker(rank: int, world: int, port: int, c: dict, results) -> None:
    try:
        init(rank, world, port, timeout=c["timeout"])
        torch.set_default_dtype(torch.float64)
        cfg = mm.Config()
        prog = rtm.read_program(c["dir"], rank)
        n = prog.manifest["model_stages"]
        faults = {}
        if c["kind"] == "kill" and rank == c["rank"]:
            faults["kill"] = (1, 0, c["op"])
        if c["kind"] == "drop" and rank == c["rank"]:
            faults["drop"] = (1, tuple(c["buf"]))
        rt = rtm.ProgramRuntime(prog, make_stage=mm.maker(cfg, n, SEED), loss_fn=mm.loss_fn,
                                timeout=c["timeout"], _faults=faults)
        x, y = mm.batch(cfg, prog.total_microbatches * MB_ROWS, SEED)
        rt.step(x, y)
        t0 = time.time()
        try:
            rt.step(x, y)
            results.put((rank, {"error": None}, None))
        except rtm.SchedcRuntimeError as e:
            results.put((rank, {"error": str(e), "peer": e.peer, "op": e.op, "secs": time.time() - t0}, None))
        results.close()
        results.join_thread()  # flush the result before leaving
        os._exit(0)  # the process groups are aborted: leave without destroying them
    except BaseException:  # noqa: BLE001
        results.put((rank, None, traceback.format_exc()))


def check_faults(tally: Tally, exe: str, tmp: str, only, timeout: float) -> None:
    d = os.path.join(tmp, "faults")
    schedc(exe, ["compile", "specs/1f1b.sched", "--pp", "4", "--mb", "4", "--granularity", "stage", "-o", d])
    t_out = 10.0
    cases = [
        ("faults killed rank", {"kind": "kill", "rank": 1, "op": 12}),
        ("faults dropped message", {"kind": "drop", "rank": 2, "buf": ["act", 2, 1]}),
    ]
    for name, spec in cases:
        if only and "faults" not in only:
            continue
        c = dict(spec, dir=d, timeout=t_out)
        got, errors, secs = spawn(4, fault_worker, c, timeout)
        for e in errors.values():
            print(e, file=sys.stderr)
        survivors = [r for r in range(4) if not (spec["kind"] == "kill" and r == spec["rank"])]
        errs = {r: got[r]["error"] for r in survivors if r in got}
        ok = len(errs) == len(survivors) and all(errs.values())
        named = all(re.search(r"rank \d+, step 1, \w+(@\d+)? stream op #\d+ `[^`]+`", e or "") for e in errs.values())
        worst = max((got[r]["secs"] for r in errs if got[r].get("secs") is not None), default=float("nan"))
        tally.record(name, ok and named and worst <= 2 * t_out + 5,
                     f"{len(errs)}/{len(survivors)} surviving ranks ended with an error, the last after "
                     f"{worst:.1f} s (timeout {t_out:.0f} s)")
        for r in sorted(errs):
            print(f"      rank {r}: {errs[r]}")


# ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedc", default=os.path.join(ROOT, "target", "debug", "schedc"))
    ap.add_argument("--only", action="append", help="a configuration name, torch-NAME, calibration-NAME, faults, units")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    ap.add_argument("--torch-steps", type=int, default=12, help="steps per runtime in the torch comparison")
    ap.add_argument("--keep", help="write the programs here and keep them")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"torch {torch.__version__}, schedc {args.schedc}", flush=True)
    if not os.path.exists(args.schedc):
        print(f"error: {args.schedc} not found; build it with `cargo build -p schedc-cli`")
        return 2
    only = set(args.only or [])
    tally = Tally()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="schedc-runtime-") as tmpd:
        tmp = args.keep or tmpd
        os.makedirs(tmp, exist_ok=True)
        print("== units", flush=True)
        if not only or "units" in only:
            check_units(tally, tmp, args.schedc)
        print("== equivalence with non-pipelined training (gloo, CPU)", flush=True)
        check_equivalence(tally, args.schedc, tmp, only, args.timeout)
        print("== against torch's _PipelineScheduleRuntime (same processes, alternating steps)", flush=True)
        check_torch(tally, args.schedc, tmp, only, args.timeout, args.torch_steps)
        print("== calibration: profile -> schedc sim --cost", flush=True)
        check_calibration(tally, args.schedc, tmp, only, args.timeout, args.torch_steps)
        print("== faults", flush=True)
        check_faults(tally, args.schedc, tmp, only, args.timeout)
    print(f"{tally.passed} passed, {len(tally.failed)} failed ({time.time() - t0:.0f}s)"
          + (": " + ", ".join(tally.failed) if tally.failed else ""))
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
