// F, RMSNorm over rows of d: inv = 1/sqrt(mean(x^2) + eps), xhat = x inv, y = xhat g.
// y, xhat: rows x d (T), inv: rows (float), x: rows x d (T) with row stride ldx, g: d (T).
// Launch: one block per row (grid.x = rows), block a power of two.
KERNEL rmsnorm_fwd(T* y, T* xhat, float* inv, const T* x, int ldx, const T* g, int rows, int d,
                   float eps) {
    __shared__ float sh[SCHEDC_MAX_BLOCK];
    long r = blockIdx.x;
    if (r >= rows) return;
    const T* xr = x + r * ldx;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = ld(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    float iv = 1.0f / sqrtf(ss / (float)d + eps);
    if (threadIdx.x == 0) inv[r] = iv;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float xh = ld(xr[i]) * iv;
        st(&xhat[r * d + i], xh);
        st(&y[r * d + i], xh * ld(g[i]));
    }
}
