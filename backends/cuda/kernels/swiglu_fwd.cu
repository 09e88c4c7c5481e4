// F, SwiGLU gate (Shazeer, arXiv 2002.05202): act = silu(h1) h3, silu(x) = x sigmoid(x).
// Launch: 1-D grid-stride over n.
KERNEL swiglu_fwd(T* act, const T* h1, const T* h3, long n) {
    for (long i = gtid(); i < n; i += gsize()) st(&act[i], siluf_(ld(h1[i])) * ld(h3[i]));
}
