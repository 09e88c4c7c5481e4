// B, key and value gradients in tiles (FlashAttention-2's backward, Dao 2023 Algorithm 2,
// the dK/dV half; no atomics): a block keeps ATT_BK keys of head h (content key, RoPE key,
// value) and loops over the query tiles from the first that sees one of them (causal),
// recomputing P and dS as attn_bwd_dq does from q, k, lse and delta:
//   dv_j += sum_i P_ij dout_i,  dkn_j += sum_i dS_ij qn_i,  dkr_h,j += sum_i dS_ij qp_i.
// Writes the content key gradient to dkn (row stride lddkn, heads*dn), the value gradient to
// dvv (lddv, heads*dv), and head h's RoPE key gradient to dkp_part[(h*tk + j)*dr + e] (float;
// attn_bwd_dkp sums it over the heads that share a RoPE key). Other parameters as attn_fwd's.
// In bf16 on sm_80+ (and on the host shim, emulated) the tile products run on tensor cores
// (att_mma_s_dp; P^T dout and dS^T q with P and dS split into two bf16 parts, warp w holding
// the 16 x 8 tiles w, w+4, ... of dk and dv in registers); in f32 they are scalar f32 sums.
// Launch: grid (ceil(tk / ATT_BK), heads), block ATT_THREADS.
KERNEL attn_bwd_dkv(T* dkn, int lddkn, float* dkp_part, T* dvv, int lddv, const float* lse,
                    const float* delta, const T* dout, int ldd, const T* qn, int ldqn,
                    const T* qp, int ldqp, const T* kn, int ldkn, const T* kp, int ldkp,
                    int kp_heads, const T* v, int ldv, int tq, int tk, int heads, int dn, int dr,
                    int dv, int q_offset, float scale) {
    __shared__ float ks[ATT_BK * ATT_DQK];
    __shared__ float vs[ATT_BK * ATT_DV];
    __shared__ float qs[ATT_BQ * ATT_DQK];
    __shared__ float dos[ATT_BQ * ATT_DV];
    __shared__ float ps[ATT_BQ * ATT_BK];
    __shared__ float dss[ATT_BQ * ATT_BK];
    __shared__ float sst[ATT_BQ * ATT_BK], dpt[ATT_BQ * ATT_BK];
    __shared__ float lrow[ATT_BQ], drow[ATT_BQ];
    int j0 = blockIdx.x * ATT_BK, h = blockIdx.y;
    if (j0 >= tk || h >= heads) return;
    int kh = kp_heads == 1 ? 0 : h, w = dn + dr;
    int c = threadIdx.x / ATT_TPR, lane = threadIdx.x % ATT_TPR;
    att_load_qk(ks, kn, ldkn, (long)h * dn, kp, ldkp, (long)kh * dr, j0, tk, ATT_BK, dn, dr);
    att_load_v(vs, v, ldv, (long)h * dv, j0, tk, ATT_BK, dv);
    const bool mma = ATT_MMA && att_is_bf16(dkn);
    int warp = threadIdx.x / 32;
    float kc6[6][4], vc4[4][4];
    for (int x = 0; x < 4; x++) {
        for (int j = 0; j < 6; j++) kc6[j][x] = 0.0f;
        for (int j = 0; j < 4; j++) vc4[j][x] = 0.0f;
    }
    float dk[ATT_DQK / ATT_TPR], dva[ATT_DV / ATT_TPR];
    ATT_UNROLL
    for (int k = 0; k < ATT_DQK / ATT_TPR; k++) dk[k] = 0.0f;
    ATT_UNROLL
    for (int k = 0; k < ATT_DV / ATT_TPR; k++) dva[k] = 0.0f;
    // The first query that sees key j0 is i = j0 - q_offset.
    long first = (long)j0 - q_offset;
    if (first < 0) first = 0;
    for (long i0l = first / ATT_BQ * ATT_BQ; i0l < tq; i0l += ATT_BQ) {
        int i0 = (int)i0l;
        att_load_qk(qs, qn, ldqn, (long)h * dn, qp, ldqp, (long)h * dr, i0, tq, ATT_BQ, dn, dr);
        att_load_v(dos, dout, ldd, (long)h * dv, i0, tq, ATT_BQ, dv);
        if (threadIdx.x < ATT_BQ) {
            int i = i0 + threadIdx.x;
            lrow[threadIdx.x] = i < tq ? lse[(long)h * tq + i] : 0.0f;
            drow[threadIdx.x] = i < tq ? delta[(long)h * tq + i] : 0.0f;
        }
        __syncthreads();
        if (mma) {
            att_mma_s_dp(sst, dpt, qs, ks, dos, vs, w, dv);
            __syncthreads();
        }
        for (int idx = threadIdx.x; idx < ATT_BQ * ATT_BK; idx += blockDim.x) {
            int rr = idx / ATT_BK, cc = idx % ATT_BK;
            float p = 0.0f, ds = 0.0f;
            if (att_visible(i0 + rr, tq, j0 + cc, tk, q_offset)) {
                float s =
                    (mma ? sst[idx] : att_dot(qs + rr * ATT_DQK, ks + cc * ATT_DQK, w)) * scale;
                p = expf(s - lrow[rr]);
                float dp = mma ? dpt[idx] : att_dot(dos + rr * ATT_DV, vs + cc * ATT_DV, dv);
                ds = p * (dp - drow[rr]) * scale;
            }
            ps[idx] = p;
            dss[idx] = ds;
        }
        __syncthreads();
        if (mma) {
            // Rows of these products are keys: A = P^T, dS^T (transposed tiles).
            for (int j = 0; j < 4; j++)
                att_mma_split(vc4[j], ps, ATT_BK, true, dos, ATT_DV, false, (warp + 4 * j) * 8);
            for (int j = 0; j < 6; j++)
                att_mma_split(kc6[j], dss, ATT_BK, true, qs, ATT_DQK, false, (warp + 4 * j) * 8);
            __syncthreads();
            continue;
        }
        ATT_UNROLL
        for (int k = 0; k < ATT_DQK / ATT_TPR; k++) {
            int e = lane + k * ATT_TPR;
            if (e >= w) continue;
            float s = 0.0f;
            for (int rr = 0; rr < ATT_BQ; rr++) s += dss[rr * ATT_BK + c] * qs[rr * ATT_DQK + e];
            dk[k] += s;
        }
        ATT_UNROLL
        for (int k = 0; k < ATT_DV / ATT_TPR; k++) {
            int e = lane + k * ATT_TPR;
            if (e >= dv) continue;
            float s = 0.0f;
            for (int rr = 0; rr < ATT_BQ; rr++) s += ps[rr * ATT_BK + c] * dos[rr * ATT_DV + e];
            dva[k] += s;
        }
        __syncthreads();
    }
    if (mma) {
        for (int x = 0; x < 4; x++) {
            int j = j0 + att_c_row(x);
            if (j >= tk) continue;
            for (int jj = 0; jj < 6; jj++) {
                int e = (warp + 4 * jj) * 8 + att_c_col(x);
                if (e < dn)
                    st(&dkn[(long)j * lddkn + (long)h * dn + e], kc6[jj][x]);
                else if (e < w)
                    dkp_part[((long)h * tk + j) * dr + (e - dn)] = kc6[jj][x];
            }
            for (int jj = 0; jj < 4; jj++) {
                int e = (warp + 4 * jj) * 8 + att_c_col(x);
                if (e < dv) st(&dvv[(long)j * lddv + (long)h * dv + e], vc4[jj][x]);
            }
        }
        return;
    }
    int j = j0 + c;
    if (j >= tk) return;
    ATT_UNROLL
    for (int k = 0; k < ATT_DQK / ATT_TPR; k++) {
        int e = lane + k * ATT_TPR;
        if (e >= w) continue;
        if (e < dn)
            st(&dkn[(long)j * lddkn + (long)h * dn + e], dk[k]);
        else
            dkp_part[((long)h * tk + j) * dr + (e - dn)] = dk[k];
    }
    ATT_UNROLL
    for (int k = 0; k < ATT_DV / ATT_TPR; k++) {
        int e = lane + k * ATT_TPR;
        if (e >= dv) continue;
        st(&dvv[(long)j * lddv + (long)h * dv + e], dva[k]);
    }
}
