// F, embedding: x[i, :] = table[tok[i], :]. x: t x d (T), table: V x d (T), tok: t.
// A token outside the vocabulary sets *err = 1 (the host validates the data first).
// Launch: 1-D grid-stride over t*d.
KERNEL embed_fwd(T* x, const T* table, const unsigned* tok, int t, int d, int vocab, int* err) {
    for (long n = gtid(); n < (long)t * d; n += gsize()) {
        long i = n / d, u = n % d;
        unsigned v = tok[i];
        if (v >= (unsigned)vocab) {
            *err = 1;
            continue;
        }
        x[n] = table[(long)v * d + u];
    }
}
