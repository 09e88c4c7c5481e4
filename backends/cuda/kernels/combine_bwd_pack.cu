// B, combine: the output gradient of every valid slot, gate dy[token], into its expert
// member's packet at the slot's row (the same places as the forward's dispatch).
// Launch: 1-D grid-stride over nslots*d.
KERNEL combine_bwd_pack(char* outbox, long slot_bytes, long rows_off, const T* dy,
                        const float* gates, const int* slot_dest, const int* slot_pos, int nslots,
                        int k, int d) {
    for (long n = gtid(); n < (long)nslots * d; n += gsize()) {
        int i = (int)(n / d), u = (int)(n % d);
        int q = slot_dest[i];
        if (q < 0) continue;
        T* rows = slot_rows<T>(outbox, slot_bytes, rows_off, q);
        st(&rows[(long)slot_pos[i] * d + u], gates[i] * ld(dy[(long)(i / k) * d + u]));
    }
}
