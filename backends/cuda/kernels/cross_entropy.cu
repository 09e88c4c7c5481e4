// F (last stage), cross-entropy of each row of logits (t x V, float) against its target:
// rowloss[i] = (logsumexp(z_i) - z_i,y) scale, and the logits' gradient (kept for B and W)
// dlogits = (softmax(z_i) - onehot(y)) scale (T). A target outside the vocabulary sets
// *err = 5. Launch: one block per row, block a power of two.
KERNEL cross_entropy(T* dlogits, float* rowloss, const float* logits, const unsigned* targets,
                     int t, int V, float scale, int* err) {
    __shared__ float sh[SCHEDC_MAX_BLOCK];
    long i = blockIdx.x;
    if (i >= t) return;
    unsigned y = targets[i];
    if (y >= (unsigned)V) {
        if (threadIdx.x == 0) *err = 5;
        y = 0;
    }
    const float* z = logits + i * V;
    float mx = neg_inf();
    for (int c = threadIdx.x; c < V; c += blockDim.x) mx = fmaxf(mx, z[c]);
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) sum += expf(z[c] - mx);
    sum = block_sum(sum, sh);
    if (threadIdx.x == 0) rowloss[i] = (mx + logf(sum) - z[y]) * scale;
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        float p = expf(z[c] - mx) / sum;
        if (c == (int)y) p = p - 1.0f;
        st(&dlogits[i * V + c], p * scale);
    }
}
