// B, query gradients: dq_i,h = sum_j (in order) ds_h,i,j k_j,h for the content part (width
// dn, into dqn with row stride lddqn) and the RoPE part (width dr, from the shared or
// per-head RoPE key, into dqp with row stride lddqp; skipped when dr = 0).
// Launch: 1-D grid-stride over tq*heads*(dn+dr).
KERNEL attn_bwd_dq(T* dqn, int lddqn, T* dqp, int lddqp, const float* ds, const T* kn, int ldkn,
                   const T* kp, int ldkp, int kp_heads, int tq, int tk, int heads, int dn,
                   int dr) {
    int w = dn + dr;
    for (long n = gtid(); n < (long)tq * heads * w; n += gsize()) {
        int i = (int)(n / ((long)heads * w));
        int h = (int)((n / w) % heads), e = (int)(n % w);
        const float* d = ds + ((long)h * tq + i) * tk;
        float acc = 0.0f;
        if (e < dn) {
            for (int j = 0; j < tk; j++) acc += d[j] * ld(kn[(long)j * ldkn + (long)h * dn + e]);
            st(&dqn[(long)i * lddqn + (long)h * dn + e], acc);
        } else {
            int kh = kp_heads == 1 ? 0 : h, f = e - dn;
            for (int j = 0; j < tk; j++) acc += d[j] * ld(kp[(long)j * ldkp + (long)kh * dr + f]);
            st(&dqp[(long)i * lddqp + (long)h * dr + f], acc);
        }
    }
}
