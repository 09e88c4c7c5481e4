// B, combine: each slot's gate gradient dgates[i] = dy[token] . eo[i] (0 when dropped).
// Launch: 1-D grid-stride over nslots.
KERNEL combine_bwd_dgate(float* dgates, const T* dy, const T* eo, const int* slot_dest, int nslots,
                         int k, int d) {
    for (long i = gtid(); i < nslots; i += gsize()) {
        float acc = 0.0f;
        if (slot_dest[i] >= 0) {
            const T* g = dy + (i / k) * d;
            for (int u = 0; u < d; u++) acc += ld(g[u]) * ld(eo[i * d + u]);
        }
        dgates[i] = acc;
    }
}
