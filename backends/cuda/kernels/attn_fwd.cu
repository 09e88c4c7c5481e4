// F, causal attention in tiles (FlashAttention-2's forward, Dao 2023 Algorithm 1), for
// multi-head attention or MLA's (content and RoPE parts): for head h, local query i (global
// position q_offset + i) sees keys j <= q_offset + i (j < tk);
//   score_j = scale (qn_i,h . kn_j,h + qp_i,h . kp_j,h'),  p = softmax(score),  out = p V,
// and lse_h,i = log sum_j exp(score_j) (heads x tq floats, -inf for a row that sees no key),
// which is all the backward keeps: no tq x tk buffer.
// Query content qn: tq x (heads*dn) (row stride ldqn); query RoPE part qp: heads*dr per row
// (ldqp); key content kn: tk x heads*dn (ldkn); RoPE keys kp: kp_heads*dr per row (ldkp):
// one shared by every head (kp_heads = 1, MLA: read from the same rows by every head, never
// replicated) or one per head; values v: heads*dv per row (ldv); out: heads*dv per row (ldo).
// dr = 0 means no RoPE part (plain multi-head attention on already rotated q and k).
// dn + dr <= ATT_DQK, dv <= ATT_DV.
// A block keeps ATT_BQ query rows in shared memory and loops over the key tiles up to the
// causal limit with an online softmax: per row the running maximum m and sum l; each tile's
// p = exp(s - m_new), the row's output accumulator (registers, ATT_TPR threads per row)
// scaled by exp(m_old - m_new) before p V is added; at the end out = acc / l.
// In bf16 on sm_80+ (and on the host shim, emulated) the two tile products run on tensor cores
// (att_mma: scores Q K^T as two 16 x 8 tiles over k-steps of 16, by warps 0 and 1; P V as
// 16 x 8 tiles of the output, warp w holding tiles w, w+4, w+8, w+12 in registers, with P split
// into two bf16 parts P_hi + P_lo, two products, so that P keeps 16 bits of mantissa rather
// than FlashAttention-2's 8: the gradients' bf16 error stays that of the scalar path); in f32
// they are scalar f32 sums.
// Launch: grid (ceil(tq / ATT_BQ), heads), block ATT_THREADS.
KERNEL attn_fwd(T* out, int ldo, float* lse, const T* qn, int ldqn, const T* qp, int ldqp,
                const T* kn, int ldkn, const T* kp, int ldkp, int kp_heads, const T* v, int ldv,
                int tq, int tk, int heads, int dn, int dr, int dv, int q_offset, float scale) {
    __shared__ float qs[ATT_BQ * ATT_DQK];
    __shared__ float ks[ATT_BK * ATT_DQK];
    __shared__ float vs[ATT_BK * ATT_DV];
    __shared__ float ps[ATT_BQ * ATT_BK];
    __shared__ float mrow[ATT_BQ], lrow[ATT_BQ], crow[ATT_BQ];
    int i0 = blockIdx.x * ATT_BQ, h = blockIdx.y;
    if (i0 >= tq || h >= heads) return;
    int kh = kp_heads == 1 ? 0 : h, w = dn + dr;
    int r = threadIdx.x / ATT_TPR, lane = threadIdx.x % ATT_TPR;
    // Tensor-core fragments: warp, g = lane / 4, q = lane % 4 of the warp's lane.
    const bool mma = ATT_MMA && att_is_bf16(out);
    int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
    float oc[4][4];
    for (int j = 0; j < 4; j++)
        for (int x = 0; x < 4; x++) oc[j][x] = 0.0f;
    att_load_qk(qs, qn, ldqn, (long)h * dn, qp, ldqp, (long)h * dr, i0, tq, ATT_BQ, dn, dr);
    if (threadIdx.x < ATT_BQ) {
        mrow[threadIdx.x] = neg_inf();
        lrow[threadIdx.x] = 0.0f;
    }
    float acc[ATT_DV / ATT_TPR];
    ATT_UNROLL
    for (int k = 0; k < ATT_DV / ATT_TPR; k++) acc[k] = 0.0f;
    // Keys past the last row's causal limit are seen by no row of this tile.
    long kend = (long)q_offset + (tq < i0 + ATT_BQ ? tq : i0 + ATT_BQ);
    if (kend > tk) kend = tk;
    __syncthreads();
    for (int j0 = 0; j0 < kend; j0 += ATT_BK) {
        att_load_qk(ks, kn, ldkn, (long)h * dn, kp, ldkp, (long)kh * dr, j0, tk, ATT_BK, dn, dr);
        att_load_v(vs, v, ldv, (long)h * dv, j0, tk, ATT_BK, dv);
        __syncthreads();
        if (mma) {
            // Warps 0 and 1: score columns 0-7 and 8-15 (warps 2 and 3 repeat them).
            int nt = warp & 1;
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            att_mma_exact(c, qs, ATT_DQK, ks, ATT_DQK, true, nt * 8, att_pad16(w));
            if (warp < 2)
                for (int x = 0; x < 4; x++) {
                    int rr = att_c_row(x), cc = nt * 8 + att_c_col(x);
                    ps[rr * ATT_BK + cc] =
                        att_visible(i0 + rr, tq, j0 + cc, tk, q_offset) ? c[x] * scale : neg_inf();
                }
        } else {
            for (int idx = threadIdx.x; idx < ATT_BQ * ATT_BK; idx += blockDim.x) {
                int rr = idx / ATT_BK, c = idx % ATT_BK;
                ps[idx] = att_visible(i0 + rr, tq, j0 + c, tk, q_offset)
                              ? att_dot(qs + rr * ATT_DQK, ks + c * ATT_DQK, w) * scale
                              : neg_inf();
            }
        }
        __syncthreads();
        if (threadIdx.x < ATT_BQ) {
            int rr = threadIdx.x;
            float* pr = ps + rr * ATT_BK;
            float m = mrow[rr], mx = m, sum = 0.0f, alpha = 1.0f;
            for (int c = 0; c < ATT_BK; c++) mx = fmaxf(mx, pr[c]);
            if (mx == neg_inf()) {
                for (int c = 0; c < ATT_BK; c++) pr[c] = 0.0f;
            } else {
                alpha = expf(m - mx);  // 0 while m is still -inf
                for (int c = 0; c < ATT_BK; c++) {
                    float p = expf(pr[c] - mx);  // 0 for masked keys
                    pr[c] = p;
                    sum += p;
                }
            }
            lrow[rr] = lrow[rr] * alpha + sum;
            mrow[rr] = mx;
            crow[rr] = alpha;
        }
        __syncthreads();
        if (mma) {
            float ag = crow[g], ag8 = crow[g + 8];
            for (int j = 0; j < 4; j++) {
                oc[j][0] *= ag;
                oc[j][1] *= ag;
                oc[j][2] *= ag8;
                oc[j][3] *= ag8;
                att_mma_split(oc[j], ps, ATT_BK, false, vs, ATT_DV, false, (warp + 4 * j) * 8);
            }
        } else {
            float a = crow[r];
            const float* pr = ps + r * ATT_BK;
            ATT_UNROLL
            for (int k = 0; k < ATT_DV / ATT_TPR; k++) {
                int e = lane + k * ATT_TPR;
                if (e >= dv) continue;
                float s = 0.0f;
                for (int c = 0; c < ATT_BK; c++) s += pr[c] * vs[c * ATT_DV + e];
                acc[k] = acc[k] * a + s;
            }
        }
        __syncthreads();
    }
    if (mma) {
        for (int j = 0; j < 4; j++)
            for (int x = 0; x < 4; x++) {
                int rr = att_c_row(x), e = (warp + 4 * j) * 8 + att_c_col(x);
                float lr = lrow[rr];
                if (i0 + rr < tq && e < dv)
                    st(&out[(long)(i0 + rr) * ldo + (long)h * dv + e],
                       lr > 0.0f ? oc[j][x] * (1.0f / lr) : 0.0f);
            }
    }
    int i = i0 + r;
    float l = lrow[r];
    if (i < tq) {
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* o = out + (long)i * ldo + (long)h * dv;
        ATT_UNROLL
        for (int k = 0; k < ATT_DV / ATT_TPR; k++) {
            int e = lane + k * ATT_TPR;
            if (e >= dv || mma) continue;
            st(&o[e], acc[k] * inv);
        }
        if (lane == 0) lse[(long)h * tq + i] = l > 0.0f ? mrow[r] + logf(l) : neg_inf();
    }
}
