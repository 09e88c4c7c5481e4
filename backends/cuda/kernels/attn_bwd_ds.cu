// B, attention scores' gradient: dP_ij = dout_i,h . v_j,h; ds_ij = P_ij (dP_ij - sum_j' P_ij'
// dP_ij') scale (the softmax Jacobian; masked entries have P = 0 and get 0).
// ds, probs: heads x tq x tk (float); dout: tq x heads*dv (ldo); v: tk x heads*dv (ldv).
// Launch: grid (tq, heads), block a power of two.
KERNEL attn_bwd_ds(float* ds, const float* probs, const T* dout, int ldo, const T* v, int ldv,
                   int tq, int tk, int heads, int dv, float scale) {
    __shared__ float sh[SCHEDC_MAX_BLOCK];
    int i = blockIdx.x, h = blockIdx.y;
    if (i >= tq || h >= heads) return;
    const float* p = probs + ((long)h * tq + i) * tk;
    float* d = ds + ((long)h * tq + i) * tk;
    const T* doi = dout + (long)i * ldo + (long)h * dv;
    float part = 0.0f;
    for (int j = threadIdx.x; j < tk; j += blockDim.x) {
        const T* vj = v + (long)j * ldv + (long)h * dv;
        float s = 0.0f;
        for (int e = 0; e < dv; e++) s += ld(doi[e]) * ld(vj[e]);
        d[j] = s;
        part += p[j] * s;
    }
    float sum = block_sum(part, sh);
    for (int j = threadIdx.x; j < tk; j += blockDim.x) d[j] = p[j] * (d[j] - sum) * scale;
}
