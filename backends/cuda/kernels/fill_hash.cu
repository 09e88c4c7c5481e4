// Fills x with deterministic pseudo-random values in [-scale, scale): a hash of the index
// and the seed (benchmarks: GEMMs on random data run slower than on zeros).
// Launch: 1-D grid-stride over n.
KERNEL fill_hash(T* x, long n, unsigned seed, float scale) {
    for (long i = gtid(); i < n; i += gsize()) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 16;
        h *= 0x7feb352du;
        h ^= h >> 15;
        h *= 0x846ca68bu;
        h ^= h >> 16;
        st(&x[i], scale * ((float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f));
    }
}
