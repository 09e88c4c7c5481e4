// B, key and value gradients: for key j,
//   dkn_j,h = sum_i ds_h,i,j qn_i,h,   dv_j,h = sum_i P_h,i,j dout_i,h   (i in order),
//   dkp_j = sum over the heads sharing the RoPE key (h in order) of sum_i ds_h,i,j qp_i,h.
// Columns of key j: [0, heads*dn) content, then heads*dv values, then kp_heads*dr RoPE.
// Launch: 1-D grid-stride over tk*(heads*dn + heads*dv + kp_heads*dr).
KERNEL attn_bwd_dkv(T* dkn, int lddkn, T* dkp, int lddkp, T* dvv, int lddv, const float* ds,
                    const float* probs, const T* qn, int ldqn, const T* qp, int ldqp,
                    const T* dout, int ldo, int kp_heads, int tq, int tk, int heads, int dn,
                    int dr, int dv) {
    long cn = (long)heads * dn, cv = (long)heads * dv, cr = (long)kp_heads * dr;
    long w = cn + cv + cr;
    for (long n = gtid(); n < (long)tk * w; n += gsize()) {
        int j = (int)(n / w);
        long c = n % w;
        float acc = 0.0f;
        if (c < cn) {
            int h = (int)(c / dn), e = (int)(c % dn);
            for (int i = 0; i < tq; i++)
                acc += ds[((long)h * tq + i) * tk + j] * ld(qn[(long)i * ldqn + (long)h * dn + e]);
            st(&dkn[(long)j * lddkn + c], acc);
        } else if (c < cn + cv) {
            long c2 = c - cn;
            int h = (int)(c2 / dv), e = (int)(c2 % dv);
            for (int i = 0; i < tq; i++)
                acc += probs[((long)h * tq + i) * tk + j] * ld(dout[(long)i * ldo + (long)h * dv + e]);
            st(&dvv[(long)j * lddv + c2], acc);
        } else {
            long c3 = c - cn - cv;
            int kh = (int)(c3 / dr), e = (int)(c3 % dr);
            int h0 = kp_heads == 1 ? 0 : kh, h1 = kp_heads == 1 ? heads : kh + 1;
            for (int h = h0; h < h1; h++)
                for (int i = 0; i < tq; i++)
                    acc += ds[((long)h * tq + i) * tk + j] * ld(qp[(long)i * ldqp + (long)h * dr + e]);
            st(&dkp[(long)j * lddkp + c3], acc);
        }
    }
}
