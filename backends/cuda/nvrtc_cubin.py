"""Assembles every CUDA kernel to SASS with NVRTC (no GPU needed), for nvrtc_check.sh.

    python3 backends/cuda/nvrtc_cubin.py LIBDIR [ARCH]

LIBDIR holds libnvrtc.so.13 (and libnvrtc-builtins, on LD_LIBRARY_PATH). For each kernel
source and element type (float, bf16) it compiles prelude + `typedef T` + source, as the
host driver does, for the real architecture ARCH (default sm_90), so that NVRTC runs ptxas:
inline PTX (the attention kernels' mma.sync) is assembled, not only emitted. Prints the
registers, spills and shared memory of the attention kernels; exits 1 on any failure or on
a kernel that spills to local memory.
"""

import ctypes
import os
import sys


def main():
    libdir = sys.argv[1]
    arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90"
    lib = ctypes.CDLL(os.path.join(libdir, "libnvrtc.so.13"))
    kdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
    prelude = open(os.path.join(kdir, "prelude.cuh")).read()
    names = sorted(f[:-3] for f in os.listdir(kdir) if f.endswith(".cu"))
    bad = []
    for name in names:
        body = open(os.path.join(kdir, name + ".cu")).read()
        for ty in ["float", "bf16"]:
            src = prelude + "\ntypedef %s T;\n" % ty + body
            prog = ctypes.c_void_p()
            if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None):
                bad.append("%s %s: nvrtcCreateProgram failed" % (name, ty))
                continue
            opts = [("--gpu-architecture=%s" % arch).encode(), b"-std=c++17", b"-Xptxas", b"-v"]
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(max(n.value, 1))
            lib.nvrtcGetProgramLog(prog, log)
            log = log.value.decode(errors="replace")
            size = ctypes.c_size_t()
            got = lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0 and size.value > 0
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
            if rc != 0 or not got:
                bad.append("%s %s: no cubin (nvrtc %d)\n%s" % (name, ty, rc, log))
                continue
            spill = [l for l in log.splitlines() if "spill" in l and " 0 bytes spill stores" not in l]
            if spill:
                bad.append("%s %s: spills: %s" % (name, ty, spill))
            if name.startswith("attn"):
                info = [l.split(":", 1)[-1].strip() for l in log.splitlines() if "Used" in l]
                print("nvrtc_cubin: %s %s %s: %s" % (arch, name, ty, "; ".join(info)))
    if bad:
        for b in bad:
            print("nvrtc_cubin: FAILED: " + b, file=sys.stderr)
        sys.exit(1)
    print("nvrtc_cubin: assembled %d kernels (%d sources, float and bf16) for %s" % (2 * len(names), len(names), arch))


if __name__ == "__main__":
    main()
