// F (last stage): out[0] = sum of the t row losses, in row order. Launch: one thread.
KERNEL loss_sum(float* out, const float* rowloss, int t) {
    if (gtid() != 0) return;
    float acc = 0.0f;
    for (int i = 0; i < t; i++) acc += rowloss[i];
    out[0] = acc;
}
