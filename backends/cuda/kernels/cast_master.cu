// The compute copy of the weights from the float master copy: y = (T) x (round to nearest
// even for bf16). Launch: 1-D grid-stride over n.
KERNEL cast_master(T* y, const float* x, long n) {
    for (long i = gtid(); i < n; i += gsize()) st(&y[i], x[i]);
}
