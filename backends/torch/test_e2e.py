#!/usr/bin/env python3
"""End-to-end test: schedc schedules run on torch.distributed.pipelining (torch 2.15, CPU, gloo).

For every configuration below, this

1. exports the spec with ``schedc convert --to torch-csv`` in both of torch's forms
   (``compute_comms``: schedc's verified send/receive order; ``compute_only``: torch lowers);
2. spawns P processes joined by a gloo process group on 127.0.0.1, splits a small
   decoder-only transformer (one block per stage; the embedding on stage 0, the head on the
   last stage; deterministic init from a seed) into the stages each rank holds, loads the CSV
   with ``schedc_torch.load_schedule`` and runs 3 training steps (SGD);
3. compares the loss of every step and every parameter gradient of every step with a
   non-pipelined run of the same model on the whole batch (f32; |a - b| <= 1e-5 + 1e-5 |b|);
4. compares torch's ``analyze_pipeline_activation_liveness`` peak per rank with
   ``schedc check --format json`` (``ranks[r].peak_activations``);
5. checks the round trip: the schedule torch lowered from the compute_only CSV, dumped with
   ``_dump_csv(..., "compute_comms")``, passes ``schedc check`` with the same peaks.

Run it with the torch 2.15 virtual environment's python (see run_e2e.sh)::

    python backends/torch/test_e2e.py --schedc target/debug/schedc

It prints one line per check and a summary ``N passed, M failed``; exit status 1 on any
failure.
"""

from __future__ import annotations

import argparse
import copy
import csv as csv_module
import json
import math
import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import schedc_torch  # noqa: E402

# (name, spec, P, V, M): P in {2, 4}, M small (at most 2P, or the spec's minimum).
CONFIGS = [
    ("1f1b", "specs/1f1b.sched", 4, 1, 8),
    ("interleaved_1f1b", "specs/interleaved_1f1b.sched", 4, 2, 8),
    ("interleaved_zb", "specs/interleaved_zb.sched", 2, 2, 4),
    ("zbv", "specs/zbv.sched", 4, 2, 8),
    ("dualpipev", "specs/dualpipev.sched", 2, 2, 4),
    ("custom", "backends/torch/specs/custom.sched", 2, 2, 4),
]
FORMATS = ("compute_comms", "compute_only")
STEPS = 3
RTOL = ATOL = 1e-5
SEED = 20260
MB_SIZE, SEQ, VOCAB, DIM, HEADS = 2, 8, 32, 16, 2
LR = 0.1


# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)

        def heads(y):
            return y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Embedding, ``layers`` decoder blocks, final norm and head; deterministic from ``seed``."""

    def __init__(self, layers: int, seed: int):
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.pos = nn.Parameter(0.02 * torch.randn(SEQ, DIM))
            self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(layers))
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class Stage(nn.Module):
    """Stage ``s`` of ``n`` of a TinyGPT with one block per stage (sharing its modules)."""

    def __init__(self, full: TinyGPT, s: int, n: int):
        super().__init__()
        self.first, self.last = s == 0, s == n - 1
        if self.first:
            self.embed, self.pos = full.embed, full.pos
        self.block = full.blocks[s]
        if self.last:
            self.norm, self.head = full.norm, full.head
        self.names = {}  # stage parameter name -> the full model's name
        for name, _ in self.named_parameters():
            self.names[name] = f"blocks.{s}." + name[6:] if name.startswith("block.") else name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x) + self.pos[: x.shape[1]]
        x = self.block(x)
        if self.last:
            x = self.head(self.norm(x))
        return x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batch(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch of ``m`` micro-batches: (tokens, next tokens)."""
    g = torch.Generator().manual_seed(SEED + 1 + step)
    seq = torch.randint(0, VOCAB, (m * MB_SIZE, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    """(max |a - b|, max |a - b| / |b| over |b| > 1e-3, all within ATOL + RTOL |b|)."""
    d = (a - b).abs()
    big = b.abs() > 1e-3
    rel = (d[big] / b.abs()[big]).max().item() if big.any() else 0.0
    return d.max().item(), rel, bool((d <= ATOL + RTOL * b.abs()).all())


# ------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------


def run_format(rank: int, pp: int, n_stages: int, m: int, csv: str, fmt: str, dump: str | None):
    """Trains STEPS steps with the CSV and with the reference; returns this rank's figures."""
    from torch.distributed.pipelining import PipelineStage

    reference = TinyGPT(n_stages, SEED)
    piped = copy.deepcopy(reference)
    local = schedc_torch.stages_of_rank(csv, rank)
    mods, stages = [], []
    for s in local:
        mod = Stage(piped, s, n_stages)
        x_in = (
            torch.zeros(MB_SIZE, SEQ, dtype=torch.long)
            if s == 0
            # A float input that requires grad: the stage sends its input gradient back.
            else torch.zeros(MB_SIZE, SEQ, DIM, requires_grad=True)
        )
        # Outputs require grad too: torch derives the gradient buffers it receives from them.
        x_out = torch.zeros(
            MB_SIZE, SEQ, VOCAB if s == n_stages - 1 else DIM, requires_grad=True
        )
        mods.append(mod)
        stages.append(
            PipelineStage(
                mod, s, n_stages, torch.device("cpu"), input_args=x_in, output_args=x_out
            )
        )
    schedule = schedc_torch.load_schedule(csv, stages, m, loss_fn, format=fmt)
    peaks = schedc_torch.activation_peaks(schedule, pp)
    if dump and rank == 0:
        schedule._dump_csv(dump, "compute_comms")

    params = [p for mod in mods for p in mod.parameters()]
    # Parameters shared by two stages of one rank would be stepped twice; there are none.
    assert len({id(p) for p in params}) == len(params)
    opt = torch.optim.SGD(params, lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_params = dict(reference.named_parameters())
    out = {"loss_abs": 0.0, "grad_abs": 0.0, "grad_rel": 0.0, "ok": True, "params": 0}
    out["peaks"] = peaks
    out["has_last"] = (n_stages - 1) in local
    out["losses"] = []
    for step in range(STEPS):
        x, y = batch(step, m)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()

        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(x, target=y, losses=losses)
        if out["has_last"]:
            if len(losses) != m:
                raise AssertionError(f"expected {m} micro-batch losses, got {len(losses)}")
            loss = torch.stack(losses).mean()
            a, _, ok = max_diff(loss.detach(), ref_loss.detach())
            out["loss_abs"] = max(out["loss_abs"], a)
            out["ok"] &= ok
            out["losses"].append((loss.item(), ref_loss.item()))
        for mod in mods:
            for name, p in mod.named_parameters():
                ref = ref_params[mod.names[name]]
                if p.grad is None:
                    raise AssertionError(f"stage parameter {mod.names[name]} has no gradient")
                a, r, ok = max_diff(p.grad, ref.grad)
                out["grad_abs"] = max(out["grad_abs"], a)
                out["grad_rel"] = max(out["grad_rel"], r)
                out["ok"] &= ok
                out["params"] += 1 if step == 0 else 0
        opt.step()
        ref_opt.step()
    return out


def worker(rank: int, pp: int, port: int, cfg: dict, results) -> None:
    """One pipeline rank: every run of one configuration; results go on the queue."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=pp,
            timeout=timedelta(seconds=cfg["timeout"]),
        )
        for label, fmt, csv in cfg["runs"]:
            dump = cfg["dump"] if label == "compute_only" else None
            res = run_format(rank, pp, cfg["stages"], cfg["mb"], csv, fmt, dump)
            results.put((rank, label, res, None))
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, None, None, traceback.format_exc()))


# ------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedc(args: list[str], exe: str) -> str:
    p = subprocess.run([exe, *args], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"schedc {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p.stdout


def check_json(path: str, extra: list[str], exe: str) -> dict:
    return json.loads(schedc(["check", path, *extra, "--format", "json"], exe))


class Tally:
    def __init__(self):
        self.passed, self.failed = 0, []

    def record(self, name: str, ok: bool, detail: str) -> None:
        print(f"  {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)


def first_error(tb: str) -> str:
    """The root cause of a formatted traceback: its first `SomeError: message` line."""
    lines = tb.strip().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", line):
            rest = " ".join(x.strip() for x in lines[i + 1 : i + 4] if x.strip())
            return (line + (" " + rest if line.endswith(":") else "")).strip()[:300]
    return lines[-1][:300] if lines else "?"


def strip_reduce_grad(src: str, dst: str) -> None:
    """Copies a compute_comms CSV without its REDUCE_GRAD and WAIT_REDUCE_GRAD actions."""
    with open(src, newline="") as f:
        rows = list(csv_module.reader(f))
    with open(dst, "w", newline="") as f:
        w = csv_module.writer(f)
        for row in rows:
            w.writerow([c for c in row if "REDUCE_GRAD" not in c])


def run_config(name, spec, pp, vpp, mb, exe, tmp, tally, timeout, control) -> None:
    t0 = time.time()
    inst = ["--pp", str(pp), "--mb", str(mb)] + (["--vpp", str(vpp)] if vpp > 1 else [])
    print(f"== {name}: {spec} P={pp} V={vpp} M={mb}", flush=True)
    try:
        want = check_json(spec, inst, exe)
        if want["verdict"] != "accepted":
            raise RuntimeError(f"schedc check rejects {spec} {' '.join(inst)}")
        want_peaks = [r["peak_activations"] for r in want["ranks"]]
        csv = {}
        for fmt in FORMATS:
            csv[fmt] = os.path.join(tmp, f"{name}.{fmt}.csv")
            schedc(
                ["convert", spec, *inst, "--to", "torch-csv", "--torch-format",
                 fmt.replace("_", "-"), "-o", csv[fmt], "--force"],
                exe,
            )
    except Exception as e:  # noqa: BLE001
        tally.record(f"{name} export", False, str(e))
        return
    runs = [(fmt, fmt, csv[fmt]) for fmt in FORMATS]
    if control:
        # Negative control: without REDUCE_GRAD torch neither scales nor reduces the
        # gradients, so they come out M times too large and the comparison must notice.
        bad = os.path.join(tmp, f"{name}.no-reduce-grad.csv")
        strip_reduce_grad(csv["compute_comms"], bad)
        runs.append(("control", "compute_comms", bad))
    cfg = {
        "stages": want["stages"],
        "mb": mb,
        "runs": runs,
        "dump": os.path.join(tmp, f"{name}.torch-lowered.csv"),
        "timeout": timeout,
    }
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, pp, port, cfg, results)) for r in range(pp)]
    for p in procs:
        p.start()
    got, errors = {}, []
    deadline = time.time() + timeout + 60
    while len(got) + len(errors) < pp * len(runs) and time.time() < deadline:
        try:
            rank, fmt, res, err = results.get(timeout=1.0)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        if err:
            errors.append(f"rank {rank}: {first_error(err)}")
            print(err, file=sys.stderr)
        else:
            got[(rank, fmt)] = res
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for run, _, _ in runs:
        label = f"{name} [{run}]"
        res = [got.get((r, run)) for r in range(pp)]
        if any(x is None for x in res):
            missing = [r for r in range(pp) if res[r] is None]
            why = "; ".join(errors) or f"no result from ranks {missing} (hang or timeout)"
            tally.record(f"{label} training", False, why)
            tally.record(f"{label} liveness", False, "not run")
            continue
        ok = all(x["ok"] for x in res)
        loss_abs = max(x["loss_abs"] for x in res)
        grad_abs = max(x["grad_abs"] for x in res)
        grad_rel = max(x["grad_rel"] for x in res)
        n_params = sum(x["params"] for x in res)
        steps = next(x["losses"] for x in res if x["has_last"])
        if run == "control":
            tally.record(
                f"{label} negative control",
                not ok and grad_abs > 1e-3,
                f"without REDUCE_GRAD the gradients differ: max |dgrad| {grad_abs:.2e} "
                f"(the comparison {'notices' if not ok else 'MISSES'} it)",
            )
            continue
        tally.record(
            f"{label} training",
            ok,
            f"{STEPS} steps, loss {steps[-1][0]:.6f} (reference {steps[-1][1]:.6f}), "
            f"max |dloss| {loss_abs:.2e}, {n_params} gradients: max |dgrad| {grad_abs:.2e}, "
            f"max rel {grad_rel:.2e}",
        )
        peaks = res[0]["peaks"]
        tally.record(
            f"{label} liveness",
            peaks == want_peaks,
            f"torch analyze_pipeline_activation_liveness {peaks}, schedc check {want_peaks}",
        )
    # Round trip: torch's own lowering of the compute_only CSV, dumped, checks with schedc.
    dump = cfg["dump"]
    if os.path.exists(dump):
        try:
            back = check_json(dump, [], exe)
            back_peaks = [r["peak_activations"] for r in back["ranks"]]
            tally.record(
                f"{name} round trip",
                back["verdict"] == "accepted" and back_peaks == want_peaks,
                f"torch-lowered CSV: schedc check {back['verdict']}, peaks {back_peaks}",
            )
        except Exception as e:  # noqa: BLE001
            tally.record(f"{name} round trip", False, str(e))
    else:
        tally.record(f"{name} round trip", False, "torch did not dump its lowered CSV")
    print(f"   ({time.time() - t0:.1f}s)", flush=True)


def check_helpers(tmp: str, tally: Tally) -> None:
    """schedc_torch's own errors, without processes: each bad input names what is wrong."""
    from types import SimpleNamespace

    def csv_file(text: str) -> str:
        path = os.path.join(tmp, f"helper{len(os.listdir(tmp))}.csv")
        with open(path, "w") as f:
            f.write(text)
        return path

    good = csv_file("0F0,0F1,3F0,3I0,3W0,0B0\n1F0,2F0,2B0,1B0\n")
    cases = [
        ("placement", lambda: schedc_torch.stage_to_rank(good) == [0, 1, 1, 0]),
        ("stages of rank 1", lambda: schedc_torch.stages_of_rank(good, 1) == [1, 2]),
    ]

    def raises(fn, *words):
        try:
            fn()
        except schedc_torch.SchedcTorchError as e:
            return all(w in str(e) for w in words) or str(e)
        return "no error"

    stage = SimpleNamespace(group_size=2, group_rank=0, num_stages=4, stage_index=0)
    cases += [
        ("bad cell", lambda: raises(lambda: schedc_torch.read_schedule(csv_file("0F0,0X1\n")),
                                    "rank 0, cell 2", "`0X1`")),
        ("stage on two rows", lambda: raises(
            lambda: schedc_torch.stage_to_rank(csv_file("0F0\n0B0\n")), "stage 0", "rank 1")),
        ("gap in stages", lambda: raises(
            lambda: schedc_torch.stage_to_rank(csv_file("0F0\n2F0\n")), "stage 1 never")),
        ("unknown format", lambda: raises(
            lambda: schedc_torch.load_schedule(good, [stage], 2, format="lowered"), "format")),
        ("wrong local stages", lambda: raises(
            lambda: schedc_torch.load_schedule(good, [stage], 2), "stages [0, 3] on rank 0",
            "built stages [0]")),
        ("comms in compute_only", lambda: raises(
            lambda: schedc_torch.load_schedule(
                csv_file("0F0,0SEND_F0\n1RECV_F0,1F0\n"),
                [SimpleNamespace(group_size=2, group_rank=0, num_stages=2, stage_index=0)],
                1, format="compute_only"),
            "0SEND_F0", "compute_comms")),
    ]
    for name, fn in cases:
        got = fn()
        tally.record(f"schedc_torch {name}", got is True, "ok" if got is True else str(got))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedc", default=os.path.join(ROOT, "target", "debug", "schedc"))
    ap.add_argument("--only", action="append", help="run only this configuration (repeatable)")
    ap.add_argument("--keep", help="write the CSVs to this directory and keep them")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per configuration")
    args = ap.parse_args()
    unknown = set(args.only or []) - {c[0] for c in CONFIGS}
    if unknown:
        print(f"error: unknown configuration {sorted(unknown)}; the configurations are "
              f"{[c[0] for c in CONFIGS]}")
        return 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"torch {torch.__version__}, schedc {args.schedc}", flush=True)
    if not os.path.exists(args.schedc):
        print(f"error: {args.schedc} not found; build it with `cargo build -p schedc-cli`")
        return 2
    tally = Tally()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="schedc-torch-") as tmp:
        out = args.keep or tmp
        os.makedirs(out, exist_ok=True)
        helpers = os.path.join(tmp, "helpers")
        os.makedirs(helpers)
        check_helpers(helpers, tally)
        for name, spec, pp, vpp, mb in CONFIGS:
            if args.only and name not in args.only:
                continue
            control = name == CONFIGS[0][0]
            run_config(name, spec, pp, vpp, mb, args.schedc, out, tally, args.timeout, control)
    print(
        f"{tally.passed} passed, {len(tally.failed)} failed ({time.time() - t0:.0f}s)"
        + (": " + ", ".join(tally.failed) if tally.failed else "")
    )
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
