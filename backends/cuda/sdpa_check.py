"""gpu-check.sh's `sdpa` step (issue 24): the CUDA backend's tiled attention against
torch.nn.functional.scaled_dot_product_attention on the same GPU.

1. Numerics: the case gpu_bench's `graph` section dumped (MLA head dims, 3 heads, 100
   tokens, bf16 storage: our kernels' inputs and outputs) is recomputed by SDPA in f32 from
   the same inputs (queries [q_nope | q_pe], keys [k_nope | k_pe broadcast to the heads],
   causal, our scale), forward and backward through autograd; the relative error of each
   output (max |ours - torch| / max |torch|), expected about 1e-2 (bf16 storage).
2. Speed: SDPA in bf16 at 16 heads x 4096 tokens, d_qk 192, d_v 128, causal, forward and
   forward+backward (CUDA events, median of 10 after 3 warm-ups), for the summary's ratio
   against gpu_bench's attention figures at the same shape.

Usage: python3 sdpa_check.py CASE.json (SDPA_CHECK_CPU=1: the numerics on the CPU only, to
check the script without a GPU). Prints one JSON object; without torch or CUDA it
prints {"skipped": why} and exits 0.
"""
import json
import sys


def main():
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # no torch on this machine
        print(json.dumps({"skipped": f"no torch ({type(e).__name__}: {e})"}))
        return
    import os
    cpu = os.environ.get("SDPA_CHECK_CPU") == "1"  # numerics only, on the CPU (tests)
    if not cpu and not torch.cuda.is_available():
        print(json.dumps({"skipped": "torch sees no CUDA device"}))
        return
    dev = torch.device("cpu" if cpu else "cuda")
    out = {"torch": torch.__version__, "device": "cpu" if cpu else torch.cuda.get_device_name(0)}
    try:
        with open(sys.argv[1]) as f:
            c = json.load(f)
        h, t, dn, dr, dv = c["heads"], c["tokens"], c["dn"], c["dr"], c["dv"]
        kph = c["kph"]
        i = {k: torch.tensor(v, dtype=torch.float32, device=dev) for k, v in c["inputs"].items()}
        qn = i["q_nope"].view(t, h, dn)
        qp = i["q_pe"].view(t, h, dr)
        kn = i["k_nope"].view(t, h, dn)
        kp = i["k_pe"].view(t, kph, dr)
        v = i["v"].view(t, h, dv)
        leaves = [x.clone().requires_grad_(True) for x in (qn, qp, kn, kp, v)]
        qn_, qp_, kn_, kp_, v_ = leaves
        q = torch.cat([qn_, qp_], -1).transpose(0, 1).unsqueeze(0)
        k = torch.cat([kn_, kp_.expand(t, h, dr)], -1).transpose(0, 1).unsqueeze(0)
        vv = v_.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=c["scale"])
        o = o.squeeze(0).transpose(0, 1).reshape(t, h * dv)
        o.backward(i["dout"].view(t, h * dv))
        want = {"out": o.detach(), "dq_nope": qn_.grad, "dq_pe": qp_.grad,
                "dk_nope": kn_.grad, "dk_pe": kp_.grad, "dv": v_.grad}
        errs = {}
        for k2, w in want.items():
            got = torch.tensor(c["outputs"][k2], dtype=torch.float32, device=dev).view(-1)
            w = w.reshape(-1)
            errs[k2] = float((got - w).abs().max() / w.abs().max().clamp_min(1e-30))
        out["numerics"] = {"heads": h, "tokens": t, "dtype": c.get("dtype"), "rel_err": errs,
                           "worst": max(errs.values())}
    except Exception as e:
        out["numerics"] = {"error": f"{type(e).__name__}: {e}"}
    if cpu:
        print(json.dumps(out))
        return
    try:
        h, t = 16, 4096
        g = torch.Generator(device=dev).manual_seed(0)
        mk = lambda d: (torch.rand(1, h, t, d, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
        q, k, v = mk(192).requires_grad_(), mk(192).requires_grad_(), mk(128).requires_grad_()
        do = mk(128)
        scale = 1.0 / 192 ** 0.5

        def timed(f):
            for _ in range(3):
                f()
            ms = []
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                torch.cuda.synchronize()
                ms.append(a.elapsed_time(b))
            return sorted(ms)[len(ms) // 2]

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

        def both():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            torch.autograd.grad(o, (q, k, v), do)

        out["speed"] = {"heads": h, "tokens": t, "d_qk": 192, "d_v": 128, "dtype": "bf16",
                        "forward_ms": timed(fwd), "forward_backward_ms": timed(both)}
    except Exception as e:
        out["speed"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
