// W, embedding: g[v, u] += dx[i, u] for every token i with tok[i] == v, in token order.
// g: V x d (float), dx: t x d (T). Launch: 1-D grid-stride over V*d.
KERNEL embed_w(float* g, const T* dx, const unsigned* tok, int t, int d, int vocab) {
    for (long n = gtid(); n < (long)vocab * d; n += gsize()) {
        long v = n / d, u = n % d;
        float acc = g[n];
        for (int i = 0; i < t; i++)
            if (tok[i] == (unsigned)v) acc = acc + ld(dx[(long)i * d + u]);
        g[n] = acc;
    }
}
