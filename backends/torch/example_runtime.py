#!/usr/bin/env python3
"""Train a small MoE transformer under any schedc schedule with schedc_torch_runtime (CPU, gloo).

    schedc compile specs/dualpipev.sched --pp 2 --mb 4 --granularity stage -o /tmp/dpv
    python backends/torch/example_runtime.py /tmp/dpv --steps 20

The programs decide the pipeline: one process per global rank, the stages each holds, the
order of every compute op and message. The model (``moe_model.py``) is the user's: one
decoder block with a mixture of experts per stage, the embedding on stage 0, the LM head on
the last stage; it trains on the bytes of a text (``--data``, default the Shakespeare text in
``../shared/data`` when present, else a short built-in text). When the programs split stages
into MoE parts, the block's ``attn``/``dispatch``/``mlp``/``combine`` methods run them;
``--overlap`` passes a sequential ``overlapped_forward_backward`` (DualPipe's contract) for
the F&B pairs. ``--profile FILE`` writes the measured cost model for ``schedc sim --cost``.

Rank 0 prints each step's mean loss over every micro-batch (of both directions for DualPipe,
of every data-parallel replica) and its own step time.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import moe_model as mm  # noqa: E402
from schedc_torch_runtime import MoEParts, ProgramFormatError, load_program, read_program  # noqa: E402

SHAKESPEARE = os.path.join(HERE, "..", "..", "..", "shared", "data", "tinyshakespeare.txt")
BUILTIN = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
    "First Citizen: You are all resolved rather to die than to famish? All: Resolved. "
)


def text_batches(buf: torch.Tensor, rows: int, seq: int, step: int, shard: int, shards: int):
    """``rows`` windows of ``seq + 1`` tokens for this step and data shard: (tokens, next tokens)."""
    g = torch.Generator().manual_seed(1000 * step)
    n = buf.numel() - seq - 1
    starts = torch.randint(0, n, (rows * shards,), generator=g)[shard * rows:(shard + 1) * rows]
    win = torch.stack([buf[s: s + seq + 1] for s in starts.tolist()])
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def worker(rank: int, world: int, port: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    cfg = mm.Config(vocab=256, dim=args.dim, heads=4, seq=args.seq, experts=args.experts,
                    top_k=min(2, max(1, args.experts)), expert_dim=2 * args.dim)
    prog = read_program(args.programs, rank)
    n_model = prog.manifest["model_stages"]
    calls = []

    def overlapped(f, b):  # the DualPipe contract: run F's forward and B's backward
        calls.append(1)
        f.forward()
        b.backward()

    rt = load_program(
        args.programs, rank,
        make_stage=mm.maker(cfg, n_model, seed=1, dtype=torch.float32),
        loss_fn=mm.loss_fn,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
        moe_parts=MoEParts.methods(),
        overlapped_forward_backward=overlapped if args.overlap else None,
        timeout=args.timeout,
        profile=args.profile is not None,
    )
    shards = 1
    for d, n in prog.manifest["mesh"]["dims"]:
        if d in ("dp", "ep"):
            shards *= n
    data = torch.frombuffer(bytearray(args.text), dtype=torch.uint8).long()
    rows = prog.total_microbatches * args.rows
    for step in range(args.steps):
        x, y = text_batches(data, rows, cfg.seq, step, prog.data_shard, shards)
        t0 = time.perf_counter()
        losses = rt.step(x, y)
        ms = (time.perf_counter() - t0) * 1e3
        # The step's mean loss over every micro-batch of every pipeline (sum, count).
        tot = torch.tensor([float(sum(l.item() for l in losses)), float(len(losses))], dtype=torch.float64)
        dist.all_reduce(tot)
        if rank == 0:
            print(f"step {step}: loss {tot[0].item() / tot[1].item():.4f} "
                  f"({int(tot[1].item())} micro-batches, {ms:.0f} ms)", flush=True)
    if args.profile:
        if rt.write_profile(args.profile) is not None:
            print(f"wrote {args.profile}", flush=True)
    n = torch.tensor([len(calls)])
    dist.all_reduce(n)
    if args.overlap and rank == 0:
        print(f"overlapped_forward_backward ran {n.item()} F&B pairs in {args.steps} steps", flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("programs", help="a `schedc compile --granularity stage` directory")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=4, help="experts per block (0: dense)")
    ap.add_argument("--data", help="a text file (bytes are tokens)")
    ap.add_argument("--overlap", action="store_true", help="pass an overlapped_forward_backward")
    ap.add_argument("--profile", help="write the measured cost model (TOML) here")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    try:
        world = read_program(args.programs, 0).world
    except ProgramFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = args.data or (SHAKESPEARE if os.path.exists(SHAKESPEARE) else None)
    args.text = open(path, "rb").read() if path else BUILTIN.encode()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(worker, args=(world, port, args), nprocs=world, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
