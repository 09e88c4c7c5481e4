// W, embedding: g[v, u] += dx[i, u] for every token i with tok[i] == v, in token order.
// g: V x d (float), dx: t x d (T). Launch: blocks over the tokens (grid-stride), any block
// size (EMBED_THREADS in the driver). The block of token i does nothing unless i is the
// first token with its id v; then it walks the later tokens in chunks of blockDim (thread
// 0 lists a chunk's tokens with id v, in order) and its threads add their rows into
// g[v, :], one column per thread: O(t d) additions and O(t^2) id compares, instead of the
// O(V d t) of a pass over the vocabulary; each sum in token order, as the CPU's (no
// atomics). A token outside the vocabulary is skipped (embed_fwd reports it).
#define EMBED_CHUNK 1024
KERNEL embed_w(float* g, const T* dx, const unsigned* tok, int t, int d, int vocab) {
    __shared__ int first;
    __shared__ int nlist;
    __shared__ int list[EMBED_CHUNK];
    const int tid = threadIdx.x;
    const int nth = blockDim.x < EMBED_CHUNK ? blockDim.x : EMBED_CHUNK;
    for (long i = blockIdx.x; i < t; i += gridDim.x) {
        const unsigned v = tok[i];
        if (v >= (unsigned)vocab) continue;
        if (tid == 0) first = 1;
        __syncthreads();
        for (long q = tid; q < i; q += blockDim.x)
            if (tok[q] == v) first = 0;
        __syncthreads();
        if (first) {
            for (long c0 = i; c0 < t; c0 += nth) {
                if (tid == 0) {
                    int n = 0;
                    for (long q = c0; q < c0 + nth && q < t; q++)
                        if (tok[q] == v) list[n++] = (int)q;
                    nlist = n;
                }
                __syncthreads();
                for (long u = tid; u < d; u += blockDim.x) {
                    float acc = g[(long)v * d + u];
                    for (int r = 0; r < nlist; r++) acc = acc + ld(dx[(long)list[r] * d + u]);
                    g[(long)v * d + u] = acc;
                }
                __syncthreads();
            }
        }
        __syncthreads();
    }
}
