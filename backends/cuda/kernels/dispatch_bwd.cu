// B, dispatch: the input gradients returned by the experts (inbox, at each slot's member
// and row) added to dn2 (t x d, T), per token in dispatch order (its picks by expert id).
// Launch: 1-D grid-stride over t*d.
KERNEL dispatch_bwd(T* dn2, const char* inbox, long slot_bytes, long rows_off, const int* experts,
                    const int* slot_dest, const int* slot_pos, int t, int k, int d) {
    for (long n = gtid(); n < (long)t * d; n += gsize()) {
        long tok = n / d, u = n % d;
        float acc = ld(dn2[n]);
        int last = -1;
        for (int m = 0; m < k; m++) {
            long best = -1;
            for (int j = 0; j < k; j++) {
                long i = tok * k + j;
                int x = experts[i];
                if (slot_dest[i] < 0 || x <= last) continue;
                if (best < 0 || x < experts[best]) best = i;
            }
            if (best < 0) break;
            last = experts[best];
            acc = acc + ld(slot_rows_c<T>(inbox, slot_bytes, rows_off, slot_dest[best])[(long)slot_pos[best] * d + u]);
        }
        st(&dn2[n], acc);
    }
}
