#!/usr/bin/env python3
"""Train a small MLP with a schedc schedule on torch.distributed.pipelining (CPU, gloo).

    schedc convert specs/zbv.sched --pp 2 --mb 4 --to torch-csv -o zbv.csv
    python backends/torch/example.py zbv.csv --mb 4

Either of torch's forms works: ``--format auto`` (the default) loads the file in the form it
is in (``compute_only``, schedc's default export: torch inserts the communication;
``compute_comms``, from ``--torch-format compute-comms``: schedc's verified order).

The CSV decides everything about the pipeline: its rows are the ranks (one process each),
and the stages on a row are the stages that rank builds. Each stage here is one
``Linear + tanh`` layer of an MLP; the last stage's output goes through a mean-squared-error
loss. Every rank prints nothing but errors; the rank holding the last stage prints the loss
of each step.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from schedc_torch import (  # noqa: E402
    SchedcTorchError,
    detect_format,
    load_schedule,
    microbatches_of,
    read_schedule,
    stage_to_rank,
    stages_of_rank,
)

WIDTH, MB_SIZE = 16, 4


def make_stage(s: int) -> nn.Module:
    """Stage ``s`` of the model: deterministic from ``s``, the same on every run."""
    torch.manual_seed(1000 + s)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def run(rank: int, pp: int, port: int, csv: str, mb: int, steps: int, fmt: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=pp,
        timeout=timedelta(seconds=60),
    )
    num_stages = len(stage_to_rank(csv))
    example = torch.zeros(MB_SIZE, WIDTH, requires_grad=True)  # shapes of one micro-batch
    mods = {s: make_stage(s) for s in stages_of_rank(csv, rank)}
    stages = [
        PipelineStage(m, s, num_stages, torch.device("cpu"), input_args=example,
                      output_args=example)
        for s, m in mods.items()
    ]
    schedule = load_schedule(csv, stages, mb, loss_fn=nn.functional.mse_loss, format=fmt)
    params = [p for m in mods.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(mb * MB_SIZE, WIDTH, generator=g)
    y = torch.randn(mb * MB_SIZE, WIDTH, generator=g).tanh()
    for step in range(steps):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(x, target=y, losses=losses)  # every rank passes the whole batch
        opt.step()
        if losses:  # the rank that holds the last stage
            print(f"step {step}: loss {torch.stack(losses).mean().item():.6f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description="Train an MLP with a schedc schedule CSV.")
    ap.add_argument("csv", help="from schedc convert ... --to torch-csv")
    ap.add_argument("--mb", type=int, required=True, help="micro-batches M the CSV was made for")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--format",
        choices=("auto", "compute_only", "compute_comms"),
        default="auto",
        help="torch's CSV form; auto: the form the file is in",
    )
    args = ap.parse_args()
    fmt = None if args.format == "auto" else args.format
    try:
        pp = len(read_schedule(args.csv))  # one row per rank
        m = microbatches_of(args.csv)
        if m != args.mb:
            raise SchedcTorchError(
                f"{args.csv} runs M = {m} micro-batches, but --mb {args.mb} was given"
            )
        if fmt == "compute_comms" and detect_format(args.csv) == "compute_only":
            raise SchedcTorchError(
                f"{args.csv} is in the compute_only form: use --format auto or compute_only, "
                "or export with --torch-format compute-comms"
            )
    except (OSError, SchedcTorchError) as e:
        sys.exit(f"error: {e}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(run, args=(pp, port, args.csv, args.mb, args.steps, fmt), nprocs=pp, join=True)


if __name__ == "__main__":
    main()
