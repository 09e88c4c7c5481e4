// Optimizer step, Adam (Kingma & Ba, arXiv 1412.6980, Algorithm 1) with bias corrections
// c1 = 1 - beta1^t, c2 = 1 - beta2^t computed by the host:
//   m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2,  p -= lr (m / c1) / (sqrt(v / c2) + eps).
// p, m, v, g: n floats. Launch: 1-D grid-stride over n.
KERNEL adam(float* p, float* m, float* v, const float* g, long n, float lr, float b1, float b2,
            float eps, float c1, float c2) {
    for (long i = gtid(); i < n; i += gsize()) {
        float d = g[i];
        float mi = b1 * m[i] + (1.0f - b1) * d;
        float vi = b2 * v[i] + (1.0f - b2) * d * d;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] - lr * (mi / c1) / (sqrtf(vi / c2) + eps);
    }
}
