#!/usr/bin/env python3
"""torchtitan's path for a schedc schedule, against schedc's own runtime (issue 25, item 4).

For each configuration below (a V-shaped schedule and a looped one), this

1. exports the schedule with ``schedc convert --to torch-csv -o X.csv --sidecar X.json
   --layers 6`` (the compute_only CSV torchtitan's ``pipeline_parallel_schedule_csv`` names)
   and compiles it with ``schedc compile --granularity stage``;
2. checks that the sidecar's ``stages_of_rank`` is what torchtitan derives from the
   ``pipeline_parallel_schedule`` the sidecar gives (``"v"`` style for ZBVZeroBubble and
   DualPipeV: rank r holds r and 2P-1-r; ``"loop"`` otherwise: r, r+P, ...);
3. on P gloo processes, builds the stages as torchtitan does: a copy of a small decoder with
   torchtitan's module names (``tok_embeddings``, ``layers.<i>``, ``norm``, ``lm_head``)
   pruned to each stage's ``module_fqns_per_model_part`` list, wrapped in ``PipelineStage``;
   loads the CSV into torch 2.15's ``_PipelineScheduleRuntime`` with ``_load_csv`` (what
   torchtitan's ``build_pipeline_schedule`` does) and trains 3 SGD steps in f64;
4. trains the same model, split by the same sidecar, with ``schedc_torch_runtime.load_program``
   for 3 steps on the same batches, and compares every micro-batch loss of every step
   (relative error <= 1e-12), and torch's losses with the whole model trained without a
   pipeline (<= 1e-10: the split holds every module once, in order).

Run with the torch 2.15 virtual environment's python (``run_e2e.sh`` does)::

    python backends/torch/test_torchtitan.py --schedc target/debug/schedc
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
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
sys.dont_write_bytecode = True

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (name, spec, P, V, M)
CONFIGS = [
    ("zbv", "specs/zbv.sched", 2, 2, 4),
    ("interleaved_1f1b", "specs/interleaved_1f1b.sched", 2, 2, 4),
]
LAYERS = 6
STEPS = 3
SEED = 2025
ROWS, SEQ, VOCAB, DIM = 2, 8, 32, 16
LR = 0.05
RTOL = 1e-12
REF_RTOL = 1e-10  # the unpipelined model sums its gradients in another order


class Layer(nn.Module):
    """A residual MLP block (enough to make every stage's gradients depend on its input)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Decoder(nn.Module):
    """torchtitan's module names; a pruned copy (a stage) skips what it no longer holds."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h


def model_part(full: Decoder, fqns: list[str]) -> Decoder:
    """A copy of ``full`` holding only the modules named in ``fqns`` (torchtitan's split)."""
    part = copy.deepcopy(full)
    keep = {f.split(".", 1)[1] for f in fqns if f.startswith("layers.")}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    for top in ("tok_embeddings", "norm", "lm_head"):
        if top not in fqns:
            setattr(part, top, None)
    return part


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batch(step: int, m: int):
    g = torch.Generator().manual_seed(SEED + 1 + step)
    seq = torch.randint(0, VOCAB, (m * ROWS, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def torchtitan_stage_ids(rank: int, pp: int, schedule: str, n_stages: int) -> list[int]:
    """torchtitan's rank-to-stages rule (pipeline_parallel.py,
    _get_pp_rank_to_stage_indices_mapping @b5bcd76), restated."""
    per = n_stages // pp
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        assert per == 2
        return [rank, n_stages - 1 - rank]
    return [rank + s * pp for s in range(per)]


def worker(rank: int, world: int, port: int, c: dict, results) -> None:
    try:
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float64)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

        import schedc_torch_runtime as rtm

        side = c["sidecar"]
        titan = side["torchtitan"]["parallelism"]
        fqns = titan["module_fqns_per_model_part"]
        n = len(fqns)
        m = titan["num_pp_microbatches"]
        torch.manual_seed(SEED)
        base = Decoder()

        # torchtitan's path: stages from the sidecar, the CSV on _PipelineScheduleRuntime.
        mine = side["stages_of_rank"][rank]
        mods, stages = [], []
        for s in mine:
            mod = model_part(base, fqns[s])
            x_in = (torch.zeros(ROWS, SEQ, dtype=torch.long) if s == 0
                    else torch.zeros(ROWS, SEQ, DIM, requires_grad=True))
            x_out = torch.zeros(ROWS, SEQ, VOCAB if s == n - 1 else DIM, requires_grad=True)
            mods.append(mod)
            stages.append(PipelineStage(mod, s, n, torch.device("cpu"), input_args=x_in,
                                        output_args=x_out))
        theirs = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=loss_fn)
        theirs._load_csv(titan["pipeline_parallel_schedule_csv"])
        opt = torch.optim.SGD([p for mod in mods for p in mod.parameters()], lr=LR)

        # schedc's runtime on the same split.
        def make_stage(s, *_):
            return model_part(base, fqns[s])

        ours = rtm.load_program(c["dir"], make_stage=make_stage, loss_fn=loss_fn,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), timeout=60.0)

        # The whole model without a pipeline, on the same batches: the split loses nothing.
        ref = copy.deepcopy(base)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

        got = {"theirs": [], "ours": [], "chunks": [], "ref": [], "stages": mine}
        for step in range(STEPS):
            x, y = batch(step, m)
            ref_opt.zero_grad()
            per_mb = [loss_fn(ref(xc), yc) for xc, yc in zip(x.chunk(m), y.chunk(m))]
            torch.stack(per_mb).mean().backward()
            ref_opt.step()
            got["ref"].append([float(v.detach()) for v in per_mb])
            opt.zero_grad()
            ls: list = []
            theirs.step(x, target=y, losses=ls)
            opt.step()
            got["theirs"].append([float(v.detach()) for v in ls])
            dist.barrier()
            got["ours"].append([float(v) for v in ours.step(x, y)])
            got["chunks"].append(list(ours.loss_chunks))
            dist.barrier()
        dist.destroy_process_group()
        results.put((rank, got, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, traceback.format_exc()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, cfg: dict, timeout: float):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, cfg, results)) for r in range(world)]
    for p in procs:
        p.start()
    got, errors = {}, {}
    deadline = time.time() + timeout
    while len(got) + len(errors) < world and time.time() < deadline:
        try:
            rank, res, err = results.get(timeout=0.5)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        if err is not None:
            errors[rank] = err
        else:
            got[rank] = res
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    return got, errors


def schedc(exe: str, args: list[str]) -> str:
    p = subprocess.run([exe, *args], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"schedc {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedc", required=True, help="the schedc binary")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    exe = os.path.abspath(args.schedc)
    passed, failed = 0, []

    def record(name: str, ok: bool, detail: str) -> None:
        nonlocal passed
        print(f"  {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if ok:
            passed += 1
        else:
            failed.append(name)

    with tempfile.TemporaryDirectory(prefix="schedc-torchtitan-") as tmp:
        for name, spec, pp, vpp, mb in CONFIGS:
            inst = ["--pp", str(pp), "--mb", str(mb), "--vpp", str(vpp)]
            csv = os.path.join(tmp, f"{name}.csv")
            side_path = os.path.join(tmp, f"{name}.json")
            d = os.path.join(tmp, name)
            t0 = time.time()
            try:
                schedc(exe, ["convert", spec, *inst, "--to", "torch-csv", "-o", csv,
                             "--sidecar", side_path, "--layers", str(LAYERS)])
                schedc(exe, ["compile", spec, *inst, "--granularity", "stage", "-o", d])
            except Exception as e:  # noqa: BLE001
                record(f"{name} export", False, str(e))
                continue
            with open(side_path) as f:
                side = json.load(f)
            titan = side["torchtitan"]["parallelism"]
            rule = [torchtitan_stage_ids(r, pp, titan["pipeline_parallel_schedule"], side["stages"])
                    for r in range(pp)]
            record(f"{name} placement", rule == side["stages_of_rank"],
                   f"torchtitan's {titan['pipeline_parallel_schedule']} places {rule}, "
                   f"the CSV {side['stages_of_rank']}")
            got, errors = spawn(pp, {"sidecar": side, "dir": d}, args.timeout)
            if errors or len(got) < pp:
                for e in errors.values():
                    print(e, file=sys.stderr)
                record(f"{name} losses", False,
                       "; ".join(e.strip().splitlines()[-1] for e in errors.values()) or "no result")
                continue
            worst, count, vs_ref = 0.0, 0, 0.0
            for r, g in got.items():
                for step in range(STEPS):
                    theirs, ours, chunks = g["theirs"][step], g["ours"][step], g["chunks"][step]
                    if not theirs:
                        continue
                    if len(theirs) != mb or len(ours) != len(chunks):
                        worst = float("inf")
                        continue
                    for k, v in zip(chunks, ours):
                        worst = max(worst, abs(v - theirs[k]) / abs(theirs[k]))
                        count += 1
                    for v, w in zip(theirs, g["ref"][step]):
                        vs_ref = max(vs_ref, abs(v - w) / abs(w))
            record(f"{name} losses", count == STEPS * mb and worst <= RTOL and vs_ref <= REF_RTOL,
                   f"{count} micro-batch losses over {STEPS} steps, torch's _PipelineScheduleRuntime "
                   f"(_load_csv) vs schedc_torch_runtime: max rel err {worst:.1e}; vs the "
                   f"unpipelined model: {vs_ref:.1e} ({time.time() - t0:.1f}s)")
    print(f"{passed} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
