// B, query gradients in tiles (FlashAttention-2's backward, Dao 2023 Algorithm 2, the dQ
// half; no atomics): a block keeps ATT_BQ query rows of head h (content and RoPE parts, their
// output gradients dout, lse and delta from attn_fwd and attn_bwd_delta) and loops over the
// key tiles up to the causal limit, recomputing
//   P_ij = exp(scale (q_i . k_j) - lse_i) (0 where j > q_offset + i),
//   dP_ij = dout_i . v_j,  dS_ij = P_ij (dP_ij - D_i) scale,  dq_i += sum_j dS_ij k_j,
// k_j being the content key and the (shared or per-head) RoPE key of key j. Writes the
// content part to dqn (row stride lddqn, heads*dn) and the RoPE part to dqp (lddqp,
// heads*dr; nothing when dr = 0). Other parameters as attn_fwd's.
// In bf16 on sm_80+ (and on the host shim, emulated) the tile products run on tensor cores
// (att_mma_s_dp for q k and dout v; dS K with dS split into two bf16 parts, warp w holding
// the 16 x 8 tiles w, w+4, ..., w+20 of dq in registers); in f32 they are scalar f32 sums.
// Launch: grid (ceil(tq / ATT_BQ), heads), block ATT_THREADS.
KERNEL attn_bwd_dq(T* dqn, int lddqn, T* dqp, int lddqp, const float* lse, const float* delta,
                   const T* dout, int ldd, const T* qn, int ldqn, const T* qp, int ldqp,
                   const T* kn, int ldkn, const T* kp, int ldkp, int kp_heads, const T* v,
                   int ldv, int tq, int tk, int heads, int dn, int dr, int dv, int q_offset,
                   float scale) {
    __shared__ float qs[ATT_BQ * ATT_DQK];
    __shared__ float dos[ATT_BQ * ATT_DV];
    __shared__ float ks[ATT_BK * ATT_DQK];
    __shared__ float vs[ATT_BK * ATT_DV];
    __shared__ float dss[ATT_BQ * ATT_BK];
    __shared__ float sst[ATT_BQ * ATT_BK], dpt[ATT_BQ * ATT_BK];
    __shared__ float lrow[ATT_BQ], drow[ATT_BQ];
    int i0 = blockIdx.x * ATT_BQ, h = blockIdx.y;
    if (i0 >= tq || h >= heads) return;
    int kh = kp_heads == 1 ? 0 : h, w = dn + dr;
    int r = threadIdx.x / ATT_TPR, lane = threadIdx.x % ATT_TPR;
    att_load_qk(qs, qn, ldqn, (long)h * dn, qp, ldqp, (long)h * dr, i0, tq, ATT_BQ, dn, dr);
    att_load_v(dos, dout, ldd, (long)h * dv, i0, tq, ATT_BQ, dv);
    if (threadIdx.x < ATT_BQ) {
        int i = i0 + threadIdx.x;
        lrow[threadIdx.x] = i < tq ? lse[(long)h * tq + i] : 0.0f;
        drow[threadIdx.x] = i < tq ? delta[(long)h * tq + i] : 0.0f;
    }
    const bool mma = ATT_MMA && att_is_bf16(dqn);
    int warp = threadIdx.x / 32;
    float qc[6][4];
    for (int j = 0; j < 6; j++)
        for (int x = 0; x < 4; x++) qc[j][x] = 0.0f;
    float acc[ATT_DQK / ATT_TPR];
    ATT_UNROLL
    for (int k = 0; k < ATT_DQK / ATT_TPR; k++) acc[k] = 0.0f;
    long kend = (long)q_offset + (tq < i0 + ATT_BQ ? tq : i0 + ATT_BQ);
    if (kend > tk) kend = tk;
    __syncthreads();
    for (int j0 = 0; j0 < kend; j0 += ATT_BK) {
        att_load_qk(ks, kn, ldkn, (long)h * dn, kp, ldkp, (long)kh * dr, j0, tk, ATT_BK, dn, dr);
        att_load_v(vs, v, ldv, (long)h * dv, j0, tk, ATT_BK, dv);
        __syncthreads();
        if (mma) {
            att_mma_s_dp(sst, dpt, qs, ks, dos, vs, w, dv);
            __syncthreads();
        }
        for (int idx = threadIdx.x; idx < ATT_BQ * ATT_BK; idx += blockDim.x) {
            int rr = idx / ATT_BK, c = idx % ATT_BK;
            float ds = 0.0f;
            if (att_visible(i0 + rr, tq, j0 + c, tk, q_offset)) {
                float s = (mma ? sst[idx] : att_dot(qs + rr * ATT_DQK, ks + c * ATT_DQK, w)) * scale;
                float p = expf(s - lrow[rr]);
                float dp = mma ? dpt[idx] : att_dot(dos + rr * ATT_DV, vs + c * ATT_DV, dv);
                ds = p * (dp - drow[rr]) * scale;
            }
            dss[idx] = ds;
        }
        __syncthreads();
        if (mma) {
            for (int j = 0; j < 6; j++)
                att_mma_split(qc[j], dss, ATT_BK, false, ks, ATT_DQK, false, (warp + 4 * j) * 8);
            __syncthreads();
            continue;
        }
        const float* dr_ = dss + r * ATT_BK;
        ATT_UNROLL
        for (int k = 0; k < ATT_DQK / ATT_TPR; k++) {
            int e = lane + k * ATT_TPR;
            if (e >= w) continue;
            float s = 0.0f;
            for (int c = 0; c < ATT_BK; c++) s += dr_[c] * ks[c * ATT_DQK + e];
            acc[k] += s;
        }
        __syncthreads();
    }
    if (mma) {
        for (int j = 0; j < 6; j++)
            for (int x = 0; x < 4; x++) {
                int i = i0 + att_c_row(x), e = (warp + 4 * j) * 8 + att_c_col(x);
                if (i >= tq || e >= w) continue;
                if (e < dn)
                    st(&dqn[(long)i * lddqn + (long)h * dn + e], qc[j][x]);
                else
                    st(&dqp[(long)i * lddqp + (long)h * dr + (e - dn)], qc[j][x]);
            }
        return;
    }
    int i = i0 + r;
    if (i >= tq) return;
    ATT_UNROLL
    for (int k = 0; k < ATT_DQK / ATT_TPR; k++) {
        int e = lane + k * ATT_TPR;
        if (e >= w) continue;
        if (e < dn)
            st(&dqn[(long)i * lddqn + (long)h * dn + e], acc[k]);
        else
            st(&dqp[(long)i * lddqp + (long)h * dr + (e - dn)], acc[k]);
    }
}
