// B, attention: D_h,i = dout_i,h . out_i,h (= sum_j P_h,i,j dP_h,i,j, FlashAttention-2's
// rowsum(dO o O)), the softmax Jacobian's row term, for attn_bwd_dq and attn_bwd_dkv.
// delta: heads x tq (float); dout, out: tq x heads*dv (row strides ldd, ldo).
// Launch: 1-D grid-stride over tq*heads.
KERNEL attn_bwd_delta(float* delta, const T* dout, int ldd, const T* out, int ldo, int tq,
                      int heads, int dv) {
    for (long n = gtid(); n < (long)tq * heads; n += gsize()) {
        int i = (int)(n / heads), h = (int)(n % heads);
        const T* a = dout + (long)i * ldd + (long)h * dv;
        const T* b = out + (long)i * ldo + (long)h * dv;
        float s = 0.0f;
        for (int e = 0; e < dv; e++) s += ld(a[e]) * ld(b[e]);
        delta[(long)h * tq + i] = s;
    }
}
