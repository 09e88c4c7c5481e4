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
//   * No warp shuffles, no atomics: every sum has a fixed order. (The attention kernels' bf16
//     tile products use tensor cores, mma.sync, whose order of accumulation is the
//     hardware's: fixed, so runs stay deterministic, but not the shim's.)
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
// Shared memory per block: at most 45,184 bytes (attn_bwd_dkv in bf16), under the 48 KiB of static
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

// w rounded up to a multiple of 16 (the k-step of the tensor-core product).
DEV int att_pad16(int w) { return (w + 15) / 16 * 16; }

// Stages `n` rows (row0.. of `rows`) of a query or key tile into dst (row stride ATT_DQK,
// float): the content part xn[i*ldn + on + e] (e < dn), then the RoPE part
// xp[i*ldp + op + e] (e < dr; xp is not read when dr = 0). Rows past `rows`, and columns
// from dn + dr up to the next multiple of 16, are zeros.
template <typename U>
DEV void att_load_qk(float* dst, const U* xn, int ldn, long on, const U* xp, int ldp, long op,
                     int row0, int rows, int n, int dn, int dr) {
    int w = dn + dr, wp = att_pad16(w);
    for (int idx = threadIdx.x; idx < n * wp; idx += blockDim.x) {
        int r = idx / wp, e = idx % wp, i = row0 + r;
        float x = 0.0f;
        if (i < rows && e < w)
            x = e < dn ? ld(xn[(long)i * ldn + on + e]) : ld(xp[(long)i * ldp + op + (e - dn)]);
        dst[r * ATT_DQK + e] = x;
    }
}

// Stages `n` rows of width w (row0.. of `rows`; x[i*ldx + o + e]) into dst (row stride
// ATT_DV, float); rows past `rows`, and columns from w up to the next multiple of 16, are
// zeros.
template <typename U>
DEV void att_load_v(float* dst, const U* x, int ldx, long o, int row0, int rows, int n, int w) {
    int wp = att_pad16(w);
    for (int idx = threadIdx.x; idx < n * wp; idx += blockDim.x) {
        int r = idx / wp, e = idx % wp, i = row0 + r;
        dst[r * ATT_DV + e] = i < rows && e < w ? ld(x[(long)i * ldx + o + e]) : 0.0f;
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

// Tensor cores (attn_fwd in bf16): the tile products as PTX mma.sync.m16n8k16 (bf16 inputs,
// f32 accumulation) on sm_80 and later; on the host shim an emulation of the same warp-level
// instruction (below), so that the fragments' indexing is checked on the CPU; elsewhere (an
// older --arch, or f32) the scalar path.
#if defined(SCHEDC_SHIM) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define ATT_MMA 1
#else
#define ATT_MMA 0
#endif
DEV bool att_is_bf16(const float*) { return false; }
DEV bool att_is_bf16(const bf16*) { return true; }

// Two floats as bf16 (rounded to nearest even) in one register, `lo` in the low half.
DEV unsigned att_pack(float lo, float hi) {
    bf16 a, b;
    st(&a, lo);
    st(&b, hi);
    return (unsigned)a.bits | ((unsigned)b.bits << 16);
}

// One warp's c (16 x 8, f32) += A (16 x 16, bf16) B (16 x 8, bf16): the fragments of
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32. Lane l holds, with g = l / 4 and
// q = l % 4 (two bf16 per register, the lower index in the low half):
//   a[0] = A[g][2q, 2q+1], a[1] = A[g+8][2q, 2q+1], a[2] = A[g][2q+8, 2q+9],
//   a[3] = A[g+8][2q+8, 2q+9];  b[0] = B[2q, 2q+1][g], b[1] = B[2q+8, 2q+9][g];
//   c[0], c[1] = C[g][2q], C[g][2q+1];  c[2], c[3] = C[g+8][2q], C[g+8][2q+1].
// Every thread of the block calls it equally often (the shim's emulation exchanges the
// fragments through shared memory between two barriers).
DEV void att_mma(float* c, const unsigned* a, const unsigned* b) {
#ifdef SCHEDC_SHIM
    static unsigned fa[ATT_THREADS][4], fb[ATT_THREADS][2];
    if (blockDim.x != ATT_THREADS) {
        schedc_shim_fail("att_mma: the block is not ATT_THREADS threads");
        return;
    }
    unsigned t = threadIdx.x, w0 = t / 32 * 32, l = t % 32, g = l / 4, q = l % 4;
    for (int x = 0; x < 4; x++) fa[t][x] = a[x];
    fb[t][0] = b[0];
    fb[t][1] = b[1];
    __syncthreads();
    for (int x = 0; x < 4; x++) {
        unsigned row = g + 8 * (x / 2), col = 2 * q + x % 2;
        float d = 0.0f;
        for (unsigned k = 0; k < 16; k++) {
            unsigned ab = fa[w0 + (row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)];
            unsigned bb = fb[w0 + col * 4 + (k % 8) / 2][k >= 8];
            bf16 av, bv;
            av.bits = (unsigned short)(ab >> (16 * (k % 2)));
            bv.bits = (unsigned short)(bb >> (16 * (k % 2)));
            d += ld(av) * ld(bv);
        }
        c[x] += d;
    }
    __syncthreads();
#elif ATT_MMA
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, "
        "%7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The position of accumulator element x (0..3) of a 16 x 8 tile in this lane: row, column.
DEV int att_c_row(int x) { return threadIdx.x % 32 / 4 + 8 * (x / 2); }
DEV int att_c_col(int x) { return 2 * (threadIdx.x % 4) + x % 2; }

// This lane's A fragment of the 16 x 16 block at columns k0.. of a float matrix in shared
// memory, A[r][k] = m[r*lm + k] (or m[k*lm + r] when trans), as bf16 (hi) and, when lo is
// not null, the remainders m - hi as bf16 (lo): hi + lo keeps 16 bits of mantissa.
DEV void att_frag_a(unsigned* hi, unsigned* lo, const float* m, int lm, bool trans, int k0) {
    int g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
    for (int reg = 0; reg < 4; reg++) {
        float h[2], l[2];
        for (int x = 0; x < 2; x++) {
            int r = g + 8 * (reg & 1), k = k0 + 2 * q + x + 8 * (reg >> 1);
            float v = trans ? m[k * lm + r] : m[r * lm + k];
            bf16 b;
            st(&b, v);
            h[x] = ld(b);
            l[x] = v - h[x];
        }
        hi[reg] = att_pack(h[0], h[1]);
        if (lo) lo[reg] = att_pack(l[0], l[1]);
    }
}

// This lane's B fragment of the 16 x 8 block B[k][n] (k from k0, n from n0) of a float matrix
// in shared memory: B[k][n] = m[n*lm + k] when bt (B^T stored, as keys for Q K^T), else
// m[k*lm + n]; rounded to bf16 (exact for values loaded from bf16 storage).
DEV void att_frag_b(unsigned* b, const float* m, int lm, bool bt, int k0, int n0) {
    int n = n0 + threadIdx.x % 32 / 4, q = threadIdx.x % 4;
    for (int reg = 0; reg < 2; reg++) {
        int k = k0 + 2 * q + 8 * reg;
        float x0 = bt ? m[n * lm + k] : m[k * lm + n];
        float x1 = bt ? m[n * lm + k + 1] : m[(k + 1) * lm + n];
        b[reg] = att_pack(x0, x1);
    }
}

// c (this warp's 16 x 8 tile at columns n0) += A B over k = 0..kdim (a multiple of 16), both
// operands values of bf16 storage (exact in bf16): A[r][k] = a[r*lda + k], B as att_frag_b.
DEV void att_mma_exact(float* c, const float* a, int lda, const float* b, int ldb, bool bt, int n0,
                       int kdim) {
    for (int k0 = 0; k0 < kdim; k0 += 16) {
        unsigned fa[4], fb[2];
        att_frag_a(fa, 0, a, lda, false, k0);
        att_frag_b(fb, b, ldb, bt, k0, n0);
        att_mma(c, fa, fb);
    }
}

// c (this warp's 16 x 8 tile at columns n0) += A B for one k-step of 16, A an f32 tile
// (probabilities or their gradient; transposed when trans) split into two bf16 products.
DEV void att_mma_split(float* c, const float* a, int lda, bool trans, const float* b, int ldb,
                       bool bt, int n0) {
    unsigned hi[4], lo[4], fb[2];
    att_frag_a(hi, lo, a, lda, trans, 0);
    att_frag_b(fb, b, ldb, bt, 0, n0);
    att_mma(c, hi, fb);
    att_mma(c, lo, fb);
}

// The unscaled scores s = q . k and dp = dout . v of a query tile (qs, dos) against a key
// tile (ks, vs), 16 x 16 each (row: query, column: key), on tensor cores: warps 0 and 1
// write columns 0-7 and 8-15; warps 2 and 3 compute the same and drop it (every thread
// takes part in att_mma equally often).
DEV void att_mma_s_dp(float* s, float* dp, const float* qs, const float* ks, const float* dos,
                      const float* vs, int w, int dv) {
    int warp = threadIdx.x / 32, nt = warp & 1;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    att_mma_exact(c, qs, ATT_DQK, ks, ATT_DQK, true, nt * 8, att_pad16(w));
    att_mma_exact(d, dos, ATT_DV, vs, ATT_DV, true, nt * 8, att_pad16(dv));
    if (warp < 2)
        for (int x = 0; x < 4; x++) {
            int at = att_c_row(x) * ATT_BK + nt * 8 + att_c_col(x);
            s[at] = c[x];
            dp[at] = d[x];
        }
}
