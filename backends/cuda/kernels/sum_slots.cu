// y[i] = sum over slots j (in order) of slot j's element i, reading n elements at byte
// offset `off` of each slot: the owner's sum of the key/value gradient chunks the SP group
// sent it (reduce-scatter). Launch: 1-D grid-stride over n.
KERNEL sum_slots(T* y, const char* base, long slot_bytes, long off, int nslots, long n) {
    for (long i = gtid(); i < n; i += gsize()) {
        float acc = 0.0f;
        for (int j = 0; j < nslots; j++) acc += ld(slot_rows_c<T>(base, slot_bytes, off, j)[i]);
        st(&y[i], acc);
    }
}
