// F, combine: each slot's expert output from the inbox (member slot_dest, row slot_pos;
// 0 for a dropped slot) into eo (t*k x d, kept for the backward), and
// y = h1 + sum over picks j (in order) of gate_j eo_j. y, h1: t x d (T).
// Launch: 1-D grid-stride over t*d.
KERNEL combine_fwd(T* y, T* eo, const T* h1, const char* inbox, long slot_bytes, long rows_off,
                   const int* slot_dest, const int* slot_pos, const float* gates, int t, int k,
                   int d) {
    for (long n = gtid(); n < (long)t * d; n += gsize()) {
        long tok = n / d, u = n % d;
        float acc = ld(h1[n]);
        for (int j = 0; j < k; j++) {
            long i = tok * k + j;
            int q = slot_dest[i];
            float v = 0.0f;
            if (q >= 0) v = ld(slot_rows_c<T>(inbox, slot_bytes, rows_off, q)[(long)slot_pos[i] * d + u]);
            st(&eo[i * d + u], v);
            acc = acc + gates[i] * v;
        }
        st(&y[n], acc);
    }
}
