#!/usr/bin/env python3
"""GPU smoke test of schedc_torch_runtime (for a session with a CUDA device; skipped without).

Prepare the programs where schedc is built (they are small JSON files; an untracked directory
of the worktree travels with it to the device machine)::

    bash backends/torch/gpu_smoke.sh --prepare backends/torch/gpu_programs

then, on the machine with the GPU (torch with CUDA installed)::

    python3 backends/torch/gpu_smoke.py --programs backends/torch/gpu_programs

Checks, each printed as PASS / FAIL / SKIP with its figures, summary JSON last:

1. **NCCL, world size 1**: one process, NCCL, ``cuda:0``: ZB-V and DualPipeV with P = 1 (both
   stages of the V on the one rank: local hand-offs, split B/W, F&B pairs with a callback),
   and DualPipeV with MoE parts; 3 steps in f64 and f32 against non-pipelined training on the
   same GPU (f64 <= 1e-10, f32 <= 1e-5 relative), with ``profile=True`` (CUDA events) and a
   written profile.
2. **two processes on one GPU**: DualPipeV with P = 2 on NCCL, both ranks on ``cuda:0``.
   NCCL refuses two ranks of one communicator on one device in the versions we know
   ("Duplicate GPU detected"); the check reports what this NCCL does: trains and compares, or
   fails with NCCL's message (then SKIP, with the reason).

``--device cpu --backend gloo`` runs the same script on CPU (to test the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True

try:
    import torch  # noqa: E402
except ImportError:  # a machine without torch: nothing to smoke-test
    print('{"checks": [{"name": "torch", "status": "SKIP", "detail": "torch is not installed"}]}')
    sys.exit(0)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import moe_model as mm  # noqa: E402
import schedc_torch_runtime as rtm  # noqa: E402

SEED, STEPS, ROWS = 7, 3, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel_err(a, b) -> float:
    den = b.abs().max().item()
    return (a - b).abs().max().item() / den if den > 0 else (a - b).abs().max().item()


def train_and_compare(prog_dir: str, rank: int, device: torch.device, profile: str | None) -> dict:
    prog = rtm.read_program(prog_dir, rank)
    n = prog.manifest["model_stages"]
    k = prog.total_microbatches
    out = {}
    for dtype in (torch.float64, torch.float32):
        torch.set_default_dtype(dtype)
        cfg = mm.Config()
        base = mm.build(cfg, n, SEED, dtype)
        ref = [s.to(device) for s in mm.build(cfg, n, SEED, dtype)]

        def make(s, base=base):
            import copy
            return copy.deepcopy(base[s]).to(device)

        calls = []

        def cb(f, b):
            calls.append(1)
            f.forward()
            b.backward()

        rt = rtm.ProgramRuntime(prog, make_stage=make, loss_fn=mm.loss_fn,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                moe_parts=rtm.MoEParts.methods(), overlapped_forward_backward=cb,
                                timeout=60.0, profile=profile is not None, device=device)
        ref_opt = torch.optim.SGD([p for s in ref for p in s.parameters()], lr=0.1)
        le = ge = 0.0
        t_steps = []
        for step in range(STEPS):
            x, y = mm.batch(cfg, k * ROWS, SEED + step)
            x, y = x.to(device), y.to(device)
            ref_opt.zero_grad()
            want = []
            for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
                h = xm
                for s in ref:
                    h = s(h)
                loss = mm.loss_fn(h, ym)
                (loss / k).backward()
                want.append(loss.detach())
            t0 = time.perf_counter()
            got = rt.step(x, y)
            t_steps.append(time.perf_counter() - t0)
            for g, l in zip(rt.loss_chunks, got):
                le = max(le, rel_err(l, want[g]))
            for st in rt.stages.values():
                for (_, p), (_, q) in zip(st.module.named_parameters(),
                                          ref[st.info.model_stage].named_parameters()):
                    if q.grad is not None:
                        ge = max(ge, rel_err(p.grad, q.grad))
            ref_opt.step()
        out[str(dtype)[6:]] = {"loss_err": le, "grad_err": ge, "pairs": len(calls),
                               "step_ms": [round(t * 1e3, 2) for t in t_steps]}
        if profile and dtype == torch.float32:
            rt.write_profile(profile, skip_steps=1)
    return out


def worker(rank: int, world: int, port: int, c: dict, q) -> None:
    try:
        if c["device"] == "cuda":
            torch.cuda.set_device(c["gpu"][rank])
            device = torch.device("cuda", c["gpu"][rank])
        else:
            device = torch.device("cpu")
        dist.init_process_group(c["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        res = {}
        for name, d in c["dirs"]:
            # Every rank profiles; write_profile gathers and rank 0 writes.
            prof = os.path.join(c["out"], f"{name}.profile.toml") if c["out"] else None
            res[name] = train_and_compare(d, rank, device, prof)
        dist.destroy_process_group()
        q.put((rank, res, None))
    except BaseException:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))


def run(world: int, c: dict, timeout: float):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=worker, args=(r, world, port, c, q)) for r in range(world)]
    for p in ps:
        p.start()
    got, errs = {}, {}
    deadline = time.time() + timeout
    while len(got) + len(errs) < world and time.time() < deadline:
        try:
            r, res, err = q.get(timeout=1.0)
        except Exception:  # noqa: BLE001
            if all(not p.is_alive() for p in ps):
                break
            continue
        (errs if err else got)[r] = err or res
    for p in ps:
        p.join(5)
        if p.is_alive():
            p.kill()
    return got, errs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default=os.path.join(HERE, "gpu_programs"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="write profiles here")
    args = ap.parse_args()
    summary = {"torch": torch.__version__, "checks": []}
    if args.out:
        os.makedirs(args.out, exist_ok=True)

    def record(name, status, detail):
        print(f"  {status} {name}: {detail}", flush=True)
        summary["checks"].append({"name": name, "status": status, "detail": detail})

    if args.device == "cuda" and not torch.cuda.is_available():
        record("gpu", "SKIP", "no CUDA device (torch.cuda.is_available() is False)")
        print(json.dumps(summary))
        return 0
    if args.device == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(0)
        summary["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    p1 = [(n, os.path.join(args.programs, n)) for n in ("zbv-p1", "dualpipev-p1", "dualpipev-p1-moe")]
    missing = [d for _, d in p1 if not os.path.isdir(d)]
    if missing:
        record("programs", "FAIL", f"missing {missing}: run gpu_smoke.sh --prepare {args.programs} first")
        print(json.dumps(summary))
        return 1
    c = {"device": args.device, "backend": args.backend, "gpu": [0], "dirs": p1, "out": args.out}
    got, errs = run(1, c, 600)
    if errs or 0 not in got:
        record("world size 1", "FAIL", "; ".join(e.strip().splitlines()[-1] for e in errs.values()) or "timeout")
        for e in errs.values():
            print(e, file=sys.stderr)
    else:
        for name, res in got[0].items():
            ok = res["float64"]["loss_err"] <= 1e-10 and res["float64"]["grad_err"] <= 1e-10 \
                and res["float32"]["loss_err"] <= 1e-5 and res["float32"]["grad_err"] <= 1e-5
            record(f"world size 1 {args.backend} {name}", "PASS" if ok else "FAIL",
                   f"f64 loss {res['float64']['loss_err']:.1e} grad {res['float64']['grad_err']:.1e}; "
                   f"f32 loss {res['float32']['loss_err']:.1e} grad {res['float32']['grad_err']:.1e}; "
                   f"{res['float32']['pairs']} F&B callbacks; f32 steps {res['float32']['step_ms']} ms")
    d2 = os.path.join(args.programs, "dualpipev-p2")
    c2 = dict(c, gpu=[0, 0], dirs=[("dualpipev-p2", d2)])
    got, errs = run(2, c2, 300)
    if errs or len(got) < 2:
        text = " | ".join(e.strip().splitlines()[-1] for e in errs.values()) or "no result (hang until the timeout)"
        dup = "duplicate gpu" in text.lower() or "ncclinvalidusage" in text.lower()
        record("two processes on one GPU", "SKIP" if dup else "FAIL",
               ("NCCL refuses two ranks of one communicator on one device: " if dup else "") + text[:400])
    else:
        res = [got[r]["dualpipev-p2"] for r in (0, 1)]
        le = max(r["float64"]["loss_err"] for r in res)
        ge = max(r["float64"]["grad_err"] for r in res)
        record("two processes on one GPU", "PASS" if le <= 1e-10 and ge <= 1e-10 else "FAIL",
               f"DualPipeV P=2 through {args.backend} on one device: f64 loss {le:.1e} grad {ge:.1e}")
    print(json.dumps(summary))
    return 1 if any(ch["status"] == "FAIL" for ch in summary["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
