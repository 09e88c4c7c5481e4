// W, RMSNorm gain gradient: dg[i] += sum over rows r (in order) of dy[r, i] xhat[r, i].
// dg: d (float), dy, xhat: rows x d (T). Launch: 1-D grid-stride over d.
KERNEL rmsnorm_w(float* dg, const T* dy, const T* xhat, int rows, int d) {
    for (long i = gtid(); i < d; i += gsize()) {
        float acc = dg[i];
        for (int r = 0; r < rows; r++) acc = acc + ld(dy[(long)r * d + i]) * ld(xhat[(long)r * d + i]);
        dg[i] = acc;
    }
}
