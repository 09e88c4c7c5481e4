// F, dispatch plan of one routing group: the valid slots (token i, pick j: slot i*k + j)
// in dispatch order (by expert, then slot) into `order` (-1 after the last); each slot's
// destination EP member (expert / per, -1 when dropped) and its row in that member's
// packet; every packet's row count and expert ids into the outbox slots' headers.
// Launch: one block of any size (ROUTE_THREADS in the driver; 1 works): the rows of each
// expert counted and placed by one thread per expert (in slot order), the experts' first
// rows by a prefix sum over E; no atomics, the same plan as in one thread. E over
// DISPATCH_MAX_E runs in thread 0.
#define DISPATCH_MAX_E 1024
KERNEL dispatch_plan(int* order, int* slot_dest, int* slot_pos, char* outbox, long slot_bytes,
                     const int* experts, int nslots, int E, int per, int ep) {
    __shared__ int base[DISPATCH_MAX_E + 1];
    const int tid = threadIdx.x, nth = blockDim.x;
    if (E > DISPATCH_MAX_E) {
        if (tid != 0) return;
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
        return;
    }
    for (int x = tid; x < E; x += nth) {
        int n = 0;
        for (int i = 0; i < nslots; i++) n += experts[i] == x;
        base[x + 1] = n;
    }
    for (int i = tid; i < nslots; i += nth)
        if (experts[i] < 0 || experts[i] >= E) slot_dest[i] = -1;
    __syncthreads();
    if (tid == 0) {
        base[0] = 0;
        for (int x = 0; x < E; x++) base[x + 1] += base[x];
    }
    __syncthreads();
    const int m = base[E];
    for (int r = m + tid; r < nslots; r += nth) order[r] = -1;
    for (int q = tid; q < ep; q += nth) {
        int lo = q * per < E ? q * per : E, hi = (q + 1) * per < E ? (q + 1) * per : E;
        *slot_count(outbox, slot_bytes, q) = base[hi] - base[lo];
    }
    for (int x = tid; x < E; x += nth) {
        int q = x / per, c = base[x], first = base[q * per];
        for (int i = 0; i < nslots; i++) {
            if (experts[i] != x) continue;
            order[c] = i;
            slot_dest[i] = q;
            slot_pos[i] = c - first;
            slot_meta(outbox, slot_bytes, q)[c - first] = x;
            c++;
        }
    }
}
