// F, dispatch plan of one routing group: the valid slots (token i, pick j: slot i*k + j)
// in dispatch order (by expert, then slot) into `order` (-1 after the last); each slot's
// destination EP member (expert / per, -1 when dropped) and its row in that member's
// packet; every packet's row count and expert ids into the outbox slots' headers.
// Launch: one thread.
KERNEL dispatch_plan(int* order, int* slot_dest, int* slot_pos, char* outbox, long slot_bytes,
                     const int* experts, int nslots, int E, int per, int ep) {
    if (gtid() != 0) return;
    int m = 0;
    for (int x = 0; x < E; x++)
        for (int i = 0; i < nslots; i++)
            if (experts[i] == x) order[m++] = i;
    for (int r = m; r < nslots; r++) order[r] = -1;
    for (int q = 0; q < ep; q++) *slot_count(outbox, slot_bytes, q) = 0;
    for (int i = 0; i < nslots; i++) slot_dest[i] = -1;
    for (int r = 0; r < m; r++) {
        int i = order[r], x = experts[i], q = x / per;
        int* c = slot_count(outbox, slot_bytes, q);
        slot_dest[i] = q;
        slot_pos[i] = *c;
        slot_meta(outbox, slot_bytes, q)[*c] = x;
        *c += 1;
    }
}
