// The received rows (inbox slot j, row r < src_count[j]) into the local experts' blocks at
// perm[j*rmax + r] (rows of d). xe: per x cmax x d (T), zeroed by the caller so that the
// padding rows contribute nothing. Forward (inputs) and backward (output gradients).
// Launch: 1-D grid-stride over ep*rmax*d.
KERNEL expert_gather(T* xe, const char* inbox, long slot_bytes, long rows_off, const int* perm,
                     const int* src_count, int ep, int rmax, int d) {
    for (long n = gtid(); n < (long)ep * rmax * d; n += gsize()) {
        int j = (int)(n / ((long)rmax * d));
        int r = (int)((n / d) % rmax), u = (int)(n % d);
        if (r >= src_count[j]) continue;
        int p = perm[j * rmax + r];
        if (p < 0) continue;
        xe[(long)p * d + u] = slot_rows_c<T>(inbox, slot_bytes, rows_off, j)[(long)r * d + u];
    }
}
