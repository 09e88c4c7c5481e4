// Optimizer step, SGD: p -= lr g. Launch: 1-D grid-stride over n.
KERNEL sgd(float* p, const float* g, long n, float lr) {
    for (long i = gtid(); i < n; i += gsize()) p[i] = p[i] - lr * g[i];
}
