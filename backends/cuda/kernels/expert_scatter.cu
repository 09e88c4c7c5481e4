// The local experts' output rows back to their sources, in the order received: outbox slot
// j, row r = ye[perm[j*rmax + r]]; each slot's count = src_count[j]. Forward (outputs) and
// backward (input gradients). Launch: 1-D grid-stride over ep*rmax*d.
KERNEL expert_scatter(char* outbox, long slot_bytes, long rows_off, const T* ye, const int* perm,
                      const int* src_count, int ep, int rmax, int d) {
    for (long n = gtid(); n < (long)ep * rmax * d; n += gsize()) {
        int j = (int)(n / ((long)rmax * d));
        int r = (int)((n / d) % rmax), u = (int)(n % d);
        if (r == 0 && u == 0) *slot_count(outbox, slot_bytes, j) = src_count[j];
        if (r >= src_count[j]) continue;
        int p = perm[j * rmax + r];
        if (p < 0) continue;
        slot_rows<T>(outbox, slot_bytes, rows_off, j)[(long)r * d + u] = ye[(long)p * d + u];
    }
}
