// F, causal attention (multi-head, or MLA's with content and RoPE parts): for head h, query
// i (global position q_offset + i) sees keys j <= q_offset + i (j < tk);
//   score_j = scale (qn_i,h . kn_j,h + qp_i,h . kp_j,h'),  p = softmax(score),  out = p V.
// Query content qn: tq x (heads*dn) (row stride ldqn); query RoPE part qp: heads*dr per row
// (ldqp); key content kn: tk x heads*dn (ldkn); RoPE keys kp: kp_heads*dr per row (ldkp):
// one shared by every head (kp_heads = 1, MLA) or one per head; values v: heads*dv per row
// (ldv); out: heads*dv per row (ldo). dr = 0 means no RoPE part (plain multi-head attention
// on already rotated q and k). probs: heads x tq x tk (float, masked entries 0).
// Launch: grid (tq, heads), block a power of two.
KERNEL attn_fwd(T* out, int ldo, float* probs, const T* qn, int ldqn, const T* qp, int ldqp,
                const T* kn, int ldkn, const T* kp, int ldkp, int kp_heads, const T* v, int ldv,
                int tq, int tk, int heads, int dn, int dr, int dv, int q_offset, float scale) {
    __shared__ float sh[SCHEDC_MAX_BLOCK];
    int i = blockIdx.x, h = blockIdx.y;
    if (i >= tq || h >= heads) return;
    int visible = q_offset + i + 1;
    if (visible > tk) visible = tk;
    if (visible < 0) visible = 0;
    float* row = probs + ((long)h * tq + i) * tk;
    const T* q1 = qn + (long)i * ldqn + (long)h * dn;
    const T* q2 = qp + (long)i * ldqp + (long)h * dr;
    int kh = kp_heads == 1 ? 0 : h;
    float mx = neg_inf();
    for (int j = threadIdx.x; j < tk; j += blockDim.x) {
        if (j >= visible) {
            row[j] = 0.0f;
            continue;
        }
        const T* k1 = kn + (long)j * ldkn + (long)h * dn;
        float s = 0.0f;
        for (int e = 0; e < dn; e++) s += ld(q1[e]) * ld(k1[e]);
        if (dr > 0) {
            const T* k2 = kp + (long)j * ldkp + (long)kh * dr;
            for (int e = 0; e < dr; e++) s += ld(q2[e]) * ld(k2[e]);
        }
        s = s * scale;
        row[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < visible; j += blockDim.x) {
        float p = expf(row[j] - mx);
        row[j] = p;
        sum += p;
    }
    sum = block_sum(sum, sh);
    for (int j = threadIdx.x; j < visible; j += blockDim.x) row[j] = row[j] / sum;
    __syncthreads();
    T* o = out + (long)i * ldo + (long)h * dv;
    for (int e = threadIdx.x; e < dv; e += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < visible; j++) acc += row[j] * ld(v[(long)j * ldv + (long)h * dv + e]);
        st(&o[e], acc);
    }
}
