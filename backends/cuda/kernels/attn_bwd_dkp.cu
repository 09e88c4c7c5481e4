// B, RoPE key gradients from attn_bwd_dkv's per-head parts (part: heads x tk x dr floats):
// with one RoPE key shared by every head (kp_heads = 1, MLA) dkp_j = sum over h (in order)
// of part_h,j; with one per head (kp_heads = heads) head h's part is its own key's gradient.
// dkp: tk x kp_heads*dr (row stride lddkp).
// Launch: 1-D grid-stride over tk*kp_heads*dr.
KERNEL attn_bwd_dkp(T* dkp, int lddkp, const float* part, int kp_heads, int tk, int heads,
                    int dr) {
    long w = (long)kp_heads * dr;
    for (long n = gtid(); n < (long)tk * w; n += gsize()) {
        int j = (int)(n / w), kh = (int)((n % w) / dr), e = (int)(n % dr);
        float acc = 0.0f;
        if (kp_heads == 1) {
            for (int h = 0; h < heads; h++) acc += part[((long)h * tk + j) * dr + e];
        } else {
            acc = part[((long)kh * tk + j) * dr + e];
        }
        st(&dkp[(long)j * lddkp + (long)kh * dr + e], acc);
    }
}
