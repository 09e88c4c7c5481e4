// F, dispatch: the row of every valid slot (the token's n2 row) into its destination's
// packet at its position. n2: t x d (T), slots i = token*k + pick.
// Launch: 1-D grid-stride over nslots*d.
KERNEL dispatch_pack(char* outbox, long slot_bytes, long rows_off, const T* n2,
                     const int* slot_dest, const int* slot_pos, int nslots, int k, int d) {
    for (long n = gtid(); n < (long)nslots * d; n += gsize()) {
        int i = (int)(n / d), u = (int)(n % d);
        int q = slot_dest[i];
        if (q < 0) continue;
        T* rows = slot_rows<T>(outbox, slot_bytes, rows_off, q);
        rows[(long)slot_pos[i] * d + u] = n2[(long)(i / k) * d + u];
    }
}
