// RoPE (Su et al., arXiv 2104.09864, eq. 34) in place, or its inverse (the transpose, for
// gradients): in each of `heads` groups of width hd of row r (row stride ld), pair
// (2e, 2e+1) rotates by theta = (pos0 + r) base^(-2e/hd); the angle is computed in double.
// Launch: 1-D grid-stride over rows*heads*hd/2.
KERNEL rope(T* x, int ld_, int rows, int heads, int hd, int pos0, double base, int inverse) {
    int half = hd / 2;
    for (long n = gtid(); n < (long)rows * heads * half; n += gsize()) {
        long r = n / ((long)heads * half);
        int h = (int)((n / half) % heads), e = (int)(n % half);
        double theta = (double)(pos0 + r) * pow(base, -2.0 * (double)e / (double)hd);
        float c = (float)cos(theta), s = (float)sin(theta);
        if (inverse) s = -s;
        T* p = x + r * ld_ + (long)h * hd + 2 * e;
        float a = ld(p[0]), b = ld(p[1]);
        st(&p[0], a * c - b * s);
        st(&p[1], a * s + b * c);
    }
}
