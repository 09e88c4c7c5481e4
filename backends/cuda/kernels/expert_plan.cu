// F, expert side of dispatch: for the rows received from each EP member j (count and
// expert ids in the inbox slot headers, in member order), the position of each row in the
// local experts' blocks: perm[j*rmax + r] = (expert - lo) * cmax + (rows of that expert so
// far). Rows of one expert are thereby in (source, row) order, as the CPU backend sums
// them. src_count: ep, ecount: per (rows per local expert). A count over rmax, a row for an
// expert not held here or over cmax sets *err (2, 3, 4). Launch: one thread.
KERNEL expert_plan(int* perm, int* ecount, int* src_count, const char* inbox, long slot_bytes,
                   int ep, int rmax, int lo, int per, int cmax, int* err) {
    if (gtid() != 0) return;
    for (int e = 0; e < per; e++) ecount[e] = 0;
    for (int j = 0; j < ep; j++) {
        int c = *slot_count_c(inbox, slot_bytes, j);
        if (c < 0 || c > rmax) {
            *err = 2;
            c = 0;
        }
        src_count[j] = c;
        const int* meta = slot_meta_c(inbox, slot_bytes, j);
        for (int r = 0; r < c; r++) {
            int x = meta[r] - lo;
            if (x < 0 || x >= per) {
                *err = 3;
                perm[j * rmax + r] = -1;
                continue;
            }
            if (ecount[x] >= cmax) {
                *err = 4;
                perm[j * rmax + r] = -1;
                continue;
            }
            perm[j * rmax + r] = x * cmax + ecount[x];
            ecount[x] += 1;
        }
    }
}
