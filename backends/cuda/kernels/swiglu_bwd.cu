// B, SwiGLU gate: dh3 = da silu(h1), dh1 = da h3 silu'(h1),
// silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))). Launch: 1-D grid-stride over n.
KERNEL swiglu_bwd(T* dh1, T* dh3, const T* da, const T* h1, const T* h3, long n) {
    for (long i = gtid(); i < n; i += gsize()) {
        float a = ld(da[i]), x = ld(h1[i]);
        st(&dh3[i], a * siluf_(x));
        st(&dh1[i], a * ld(h3[i]) * silu_gradf_(x));
    }
}
