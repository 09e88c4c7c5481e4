// F, expert side of dispatch: for the rows received from each EP member j (count and
// expert ids in the inbox slot headers, in member order), the position of each row in the
// local experts' blocks: perm[j*rmax + r] = (expert - lo) * cmax + (rows of that expert so
// far). Rows of one expert are thereby in (source, row) order, as the CPU backend sums
// them. src_count: ep, ecount: per (rows per local expert, at most cmax). A count over
// rmax, a row for an expert not held here or over cmax sets *err (2, 3, 4; when several
// occur, the largest code).
// Launch: one block of any size (ROUTE_THREADS in the driver; 1 works). The ep * rmax row
// slots are cut into blockDim.x contiguous runs in (source, row) order; each thread counts
// its run's rows per local expert, one thread per expert turns the counts into each run's
// first position (an exclusive scan over the runs), and each thread places its run's
// rows: no atomics, the plan of the one-thread loop. When per x blockDim.x counts do not
// fit EXPERT_PLAN_SHARED ints, thread 0 runs that loop.
#define EXPERT_PLAN_SHARED 8192
KERNEL expert_plan(int* perm, int* ecount, int* src_count, const char* inbox, long slot_bytes,
                   int ep, int rmax, int lo, int per, int cmax, int* err) {
    __shared__ int first[EXPERT_PLAN_SHARED];
    __shared__ int flags[5];
    const int tid = threadIdx.x, nth = blockDim.x;
    for (int c = tid; c < 5; c += nth) flags[c] = 0;
    __syncthreads();
    for (int j = tid; j < ep; j += nth) {
        int c = *slot_count_c(inbox, slot_bytes, j);
        if (c < 0 || c > rmax) {
            flags[2] = 1;
            c = 0;
        }
        src_count[j] = c;
    }
    __syncthreads();
    if ((long)per * nth > EXPERT_PLAN_SHARED) {
        if (tid == 0) {
            for (int e = 0; e < per; e++) ecount[e] = 0;
            for (int j = 0; j < ep; j++) {
                const int* meta = slot_meta_c(inbox, slot_bytes, j);
                for (int r = 0; r < src_count[j]; r++) {
                    int x = meta[r] - lo;
                    if (x < 0 || x >= per) {
                        flags[3] = 1;
                        perm[j * rmax + r] = -1;
                    } else if (ecount[x] >= cmax) {
                        flags[4] = 1;
                        perm[j * rmax + r] = -1;
                    } else {
                        perm[j * rmax + r] = x * cmax + ecount[x];
                        ecount[x] += 1;
                    }
                }
            }
        }
    } else {
        // Thread tid's run of row slots: [q0, q1) of the ep * rmax slots.
        const long n = (long)ep * rmax;
        const long q0 = n * tid / nth, q1 = n * (tid + 1) / nth;
        for (int e = 0; e < per; e++) first[e * nth + tid] = 0;
        for (long q = q0; q < q1; q++) {
            int j = (int)(q / rmax), r = (int)(q % rmax);
            if (r >= src_count[j]) continue;
            int x = slot_meta_c(inbox, slot_bytes, j)[r] - lo;
            if (x < 0 || x >= per) {
                flags[3] = 1;
                perm[q] = -1;
                continue;
            }
            first[x * nth + tid] += 1;
        }
        __syncthreads();
        for (int e = tid; e < per; e += nth) {
            int run = 0;
            for (int t = 0; t < nth; t++) {
                int c = first[e * nth + t];
                first[e * nth + t] = run;
                run += c;
            }
            if (run > cmax) flags[4] = 1;
            ecount[e] = run < cmax ? run : cmax;
        }
        __syncthreads();
        for (long q = q0; q < q1; q++) {
            int j = (int)(q / rmax), r = (int)(q % rmax);
            if (r >= src_count[j]) continue;
            int x = slot_meta_c(inbox, slot_bytes, j)[r] - lo;
            if (x < 0 || x >= per) continue;
            int pos = first[x * nth + tid]++;
            perm[q] = pos < cmax ? x * cmax + pos : -1;
        }
    }
    __syncthreads();
    if (tid == 0) {
        for (int c = 4; c >= 2; c--) {
            if (flags[c]) {
                *err = c;
                break;
            }
        }
    }
}
