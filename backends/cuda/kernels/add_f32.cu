// y = a + b elementwise (float: gradients); y may alias a or b. Launch: 1-D grid-stride.
KERNEL add_f32(float* y, const float* a, const float* b, long n) {
    for (long i = gtid(); i < n; i += gsize()) y[i] = a[i] + b[i];
}
