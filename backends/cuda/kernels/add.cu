// y = a + b elementwise (T); y may alias a or b. Launch: 1-D grid-stride over n.
KERNEL add(T* y, const T* a, const T* b, long n) {
    for (long i = gtid(); i < n; i += gsize()) st(&y[i], ld(a[i]) + ld(b[i]));
}
