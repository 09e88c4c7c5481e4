// B, RMSNorm input gradient: dx = inv (dy g - xhat mean(dy g xhat)) (+ resid if non-null).
// dx, dy, xhat, resid: rows x d (T), g: d (T), inv: rows (float). dx may alias resid.
// Launch: one block per row, block a power of two.
KERNEL rmsnorm_bwd(T* dx, const T* dy, const T* g, const T* xhat, const float* inv,
                   const T* resid, int rows, int d) {
    __shared__ float sh[SCHEDC_MAX_BLOCK];
    long r = blockIdx.x;
    if (r >= rows) return;
    float dot = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        dot += ld(dy[r * d + i]) * ld(g[i]) * ld(xhat[r * d + i]);
    dot = block_sum(dot, sh);
    float mean = dot / (float)d;
    float iv = inv[r];
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        long n = r * d + i;
        float v = iv * (ld(dy[n]) * ld(g[i]) - ld(xhat[n]) * mean);
        if (resid) v = v + ld(resid[n]);
        st(&dx[n], v);
    }
}
