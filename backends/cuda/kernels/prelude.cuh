// schedc CUDA kernels: what every kernel source shares. Compiled two ways:
//   * by NVRTC (__CUDACC_RTC__ defined), once per element type, with `typedef ... T;`
//     (float or bf16) prepended by the host driver;
//   * as host C++ under shim/shim.h (SCHEDC_SHIM defined), where blocks and threads become
//     loops (fibers for kernels that call __syncthreads), for the numerics tests in CI.
//
// Conventions:
//   * `T` is the storage type of activations and weights (float or bf16). Statistics
//     (norm inverses, attention probabilities, router scores, gates), weight gradients,
//     master weights, optimizer state and losses are always float.
//   * Every kernel is `KERNEL name(...)`; helpers live only in this prelude, so that all
//     kernel sources concatenate into one translation unit.
//   * Block reductions use `__shared__` arrays of SCHEDC_MAX_BLOCK floats and a fixed tree,
//     so results do not depend on timing; block sizes are powers of two <= SCHEDC_MAX_BLOCK.
//   * No warp shuffles, no atomics: every sum has a fixed order.
#pragma once

#define SCHEDC_MAX_BLOCK 256

#ifdef __CUDACC_RTC__
#define KERNEL extern "C" __global__ void
#define DEV __device__ __forceinline__
#define SHARED __shared__
DEV float schedc_bits_to_float(unsigned u) { return __uint_as_float(u); }
DEV unsigned schedc_float_to_bits(float f) { return __float_as_uint(f); }
#else
#ifndef SCHEDC_SHIM
#error "prelude.cuh is compiled by NVRTC or under shim/shim.h"
#endif
#endif

// bfloat16: the upper 16 bits of an IEEE float (same bits as __nv_bfloat16 and cuBLAS's
// CUDA_R_16BF); conversion from float rounds to nearest even.
struct bf16 {
    unsigned short bits;
};

DEV float ld(float x) { return x; }
DEV float ld(bf16 x) { return schedc_bits_to_float(((unsigned)x.bits) << 16); }
DEV void st(float* p, float v) { *p = v; }
DEV void st(bf16* p, float v) {
    unsigned u = schedc_float_to_bits(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        p->bits = 0x7fc0;  // NaN stays NaN
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    p->bits = (unsigned short)(u >> 16);
}

DEV float neg_inf() { return schedc_bits_to_float(0xff800000u); }

DEV float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
DEV float siluf_(float x) { return x * sigmoidf_(x); }
DEV float silu_gradf_(float x) {
    float s = sigmoidf_(x);
    return s * (1.0f + x * (1.0f - s));
}

// Sum of `v` over the block (every thread gets the result). `sh` is a __shared__ array of
// SCHEDC_MAX_BLOCK floats; blockDim.x is a power of two.
DEV float block_sum(float v, float* sh) {
    unsigned t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// Maximum of `v` over the block (every thread gets the result).
DEV float block_max(float v, float* sh) {
    unsigned t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] = fmaxf(sh[t], sh[t + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// The linear index of this thread in a 1-D grid, and the grid's size (grid-stride loops).
DEV long gtid() { return (long)blockIdx.x * blockDim.x + threadIdx.x; }
DEV long gsize() { return (long)gridDim.x * blockDim.x; }

// All-to-all slots: a slot is `slot_bytes` bytes; it starts with a header of 16 bytes (the
// row count as an int, then padding), then `meta_cap` ints (the expert id of each row,
// dispatch only), then the rows at byte `rows_off`.
DEV int* slot_count(char* base, long slot_bytes, int j) { return (int*)(base + j * slot_bytes); }
DEV const int* slot_count_c(const char* base, long slot_bytes, int j) {
    return (const int*)(base + j * slot_bytes);
}
DEV int* slot_meta(char* base, long slot_bytes, int j) { return (int*)(base + j * slot_bytes + 16); }
DEV const int* slot_meta_c(const char* base, long slot_bytes, int j) {
    return (const int*)(base + j * slot_bytes + 16);
}

// The rows of slot j, as elements of type U.
template <typename U>
DEV U* slot_rows(char* base, long slot_bytes, long rows_off, int j) {
    return (U*)(base + j * slot_bytes + rows_off);
}
template <typename U>
DEV const U* slot_rows_c(const char* base, long slot_bytes, long rows_off, int j) {
    return (const U*)(base + j * slot_bytes + rows_off);
}

// Attention in tiles (FlashAttention-2: attn_fwd, attn_bwd_dq, attn_bwd_dkv). A block of
// ATT_THREADS threads works on ATT_BQ query rows and, in turn, tiles of ATT_BK keys, staged
// in shared memory as float; ATT_TPR threads share one row of a tile (ATT_BQ == ATT_BK, so
// the same holds for key rows in attn_bwd_dkv). Head dimensions: content + RoPE part at most
// ATT_DQK, values at most ATT_DV (DeepSeek-V3: 128 + 64 and 128); the host checks them.
// Shared memory per block: at most 43,136 bytes (attn_bwd_dkv), under the 48 KiB of static
// shared memory every sm_50+ device has.
#define ATT_BQ 16
#define ATT_BK 16
#define ATT_THREADS 128
#define ATT_TPR (ATT_THREADS / ATT_BQ)
#define ATT_DQK 192
#define ATT_DV 128
// Fully unrolled register loops (the accumulators stay in registers, not local memory).
#ifdef __CUDACC_RTC__
#define ATT_UNROLL _Pragma("unroll")
#else
#define ATT_UNROLL
#endif

// Stages `n` rows (row0.. of `rows`) of a query or key tile into dst (row stride ATT_DQK,
// float): the content part xn[i*ldn + on + e] (e < dn), then the RoPE part
// xp[i*ldp + op + e] (e < dr; xp is not read when dr = 0). Rows past `rows` are zeros.
template <typename U>
DEV void att_load_qk(float* dst, const U* xn, int ldn, long on, const U* xp, int ldp, long op,
                     int row0, int rows, int n, int dn, int dr) {
    int w = dn + dr;
    for (int idx = threadIdx.x; idx < n * w; idx += blockDim.x) {
        int r = idx / w, e = idx % w, i = row0 + r;
        float x = 0.0f;
        if (i < rows)
            x = e < dn ? ld(xn[(long)i * ldn + on + e]) : ld(xp[(long)i * ldp + op + (e - dn)]);
        dst[r * ATT_DQK + e] = x;
    }
}

// Stages `n` rows of width w (row0.. of `rows`; x[i*ldx + o + e]) into dst (row stride
// ATT_DV, float); rows past `rows` are zeros.
template <typename U>
DEV void att_load_v(float* dst, const U* x, int ldx, long o, int row0, int rows, int n, int w) {
    for (int idx = threadIdx.x; idx < n * w; idx += blockDim.x) {
        int r = idx / w, e = idx % w, i = row0 + r;
        dst[r * ATT_DV + e] = i < rows ? ld(x[(long)i * ldx + o + e]) : 0.0f;
    }
}

// a . b over w elements, in order.
DEV float att_dot(const float* a, const float* b, int w) {
    float s = 0.0f;
    for (int e = 0; e < w; e++) s += a[e] * b[e];
    return s;
}

// Whether local query i (global position q_offset + i) sees key j: j <= q_offset + i (causal).
DEV bool att_visible(int i, int tq, int j, int tk, int q_offset) {
    return i < tq && j < tk && (long)j <= (long)q_offset + i;
}
