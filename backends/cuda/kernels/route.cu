// Routing of one group of t tokens (DeepSeek-V3 §2.1.2): experts ranked by s + bias (ties to
// the lower id); desired = each token's top k (the load the router asked for: loads[x] += 1
// per desired pick); then k rounds, token order within a round: round j gives token i its
// best-ranked expert not chosen yet with fewer than `cap` assignments (an overflowing token
// is re-routed, never dropped). gates = s / z over the selected experts, z = their sum.
// Under the injected bugs: drop_overflow keeps round j's pick to the j-th desired expert and
// drops it when full (expert -1, gate 0); softmax_gates takes gates from a softmax over all
// the logits (written to `softmax`, t x E).
// experts, desired: t x k (int); gates: t x k, z: t, loads: E (float); logits, s: t x E;
// bias: E (float); cnt: E ints of scratch.
// Launch: one block of any size (ROUTE_THREADS in the driver; 1 works). Parallel over the
// tokens (the top k, the proposals of a round, the gates) and over the experts (loads,
// counts), no atomics. A round is exact in parallel: every token proposes its best expert
// with room at the round's start; when no expert receives more proposals than its room,
// the sequential round gives every token its proposal (room only shrinks, and no proposed
// expert fills before its last proposer), so they are kept; otherwise thread 0 runs that
// round sequentially, in token order.
KERNEL route(int* experts, int* desired, float* gates, float* z, float* softmax, float* loads,
             int* cnt, const float* logits, const float* s, const float* bias, int t, int E,
             int k, int cap, int softmax_gates, int drop_overflow) {
    __shared__ int overflow;
    const int tid = threadIdx.x, nth = blockDim.x;
    for (int i = tid; i < t; i += nth) {
        const float* si = s + (long)i * E;
        int* di = desired + (long)i * k;
        for (int j = 0; j < k; j++) {
            int best = -1;
            float bv = 0.0f;
            for (int x = 0; x < E; x++) {
                bool taken = false;
                for (int q = 0; q < j; q++) taken = taken || di[q] == x;
                if (taken) continue;
                float v = si[x] + bias[x];
                if (best < 0 || v > bv) {
                    best = x;
                    bv = v;
                }
            }
            di[j] = best;
        }
        for (int j = 0; j < k; j++) experts[(long)i * k + j] = -1;
    }
    __syncthreads();
    for (int x = tid; x < E; x += nth) {
        int n = 0;
        for (long q = 0; q < (long)t * k; q++) n += desired[q] == x;
        loads[x] = loads[x] + (float)n;
        cnt[x] = 0;
    }
    __syncthreads();
    for (int j = 0; j < k; j++) {
        // Proposals against the counts at the round's start.
        for (int i = tid; i < t; i += nth) {
            const float* si = s + (long)i * E;
            int* ei = experts + (long)i * k;
            int pick = -1;
            if (drop_overflow) {
                int want = desired[(long)i * k + j];
                if (cnt[want] < cap) pick = want;
            } else {
                float bv = 0.0f;
                for (int x = 0; x < E; x++) {
                    bool taken = false;
                    for (int q = 0; q < j; q++) taken = taken || ei[q] == x;
                    if (taken || cnt[x] >= cap) continue;
                    float v = si[x] + bias[x];
                    if (pick < 0 || v > bv) {
                        pick = x;
                        bv = v;
                    }
                }
            }
            ei[j] = pick;
        }
        if (tid == 0) overflow = 0;
        __syncthreads();
        for (int x = tid; x < E; x += nth) {
            int n = 0;
            for (int i = 0; i < t; i++) n += experts[(long)i * k + j] == x;
            if (cnt[x] + n > cap) overflow = 1;
        }
        __syncthreads();
        if (!overflow) {
            for (int x = tid; x < E; x += nth) {
                int n = 0;
                for (int i = 0; i < t; i++) n += experts[(long)i * k + j] == x;
                cnt[x] += n;
            }
        } else if (tid == 0) {
            // The round in token order, as the CPU routes it.
            for (int i = 0; i < t; i++) experts[(long)i * k + j] = -1;
            for (int i = 0; i < t; i++) {
                const float* si = s + (long)i * E;
                int* ei = experts + (long)i * k;
                int pick = -1;
                if (drop_overflow) {
                    int want = desired[(long)i * k + j];
                    if (cnt[want] < cap) pick = want;
                } else {
                    float bv = 0.0f;
                    for (int x = 0; x < E; x++) {
                        bool taken = false;
                        for (int q = 0; q < j; q++) taken = taken || ei[q] == x;
                        if (taken || cnt[x] >= cap) continue;
                        float v = si[x] + bias[x];
                        if (pick < 0 || v > bv) {
                            pick = x;
                            bv = v;
                        }
                    }
                }
                if (pick >= 0) {
                    ei[j] = pick;
                    cnt[pick] += 1;
                }
            }
        }
        __syncthreads();
    }
    for (int i = tid; i < t; i += nth) {
        const float* si = s + (long)i * E;
        const int* ei = experts + (long)i * k;
        if (softmax_gates) {
            const float* li = logits + (long)i * E;
            float* pi = softmax + (long)i * E;
            float mx = neg_inf();
            for (int x = 0; x < E; x++) mx = fmaxf(mx, li[x]);
            float sum = 0.0f;
            for (int x = 0; x < E; x++) {
                pi[x] = expf(li[x] - mx);
                sum += pi[x];
            }
            for (int x = 0; x < E; x++) pi[x] = pi[x] / sum;
        }
        float zi = 0.0f;
        for (int j = 0; j < k; j++)
            if (ei[j] >= 0) zi += si[ei[j]];
        z[i] = zi;
        for (int j = 0; j < k; j++) {
            int x = ei[j];
            gates[(long)i * k + j] = x < 0 ? 0.0f : (softmax_gates ? softmax[(long)i * E + x] : si[x] / zi);
        }
    }
}
