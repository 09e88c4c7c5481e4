// Aux-loss-free balancing (DeepSeek-V3 §2.1.2), once per optimizer step, per layer l:
// total = sum of the step's loads; if total > 0, for each expert
//   ema = beta ema + (1 - beta) load / total,   bias += gamma sign(1/E - ema)
// in double, as the CPU backend; routing_bias = the new bias (under the
// bias_update_after_routing bug: the bias from before this update).
// bias, ema, routing_bias, loads: layers x E floats. Launch: 1-D grid-stride over layers.
KERNEL router_update(float* bias, float* ema, float* routing_bias, const float* loads, int E,
                     int layers, double beta, double gamma, int bug_after) {
    for (long l = gtid(); l < layers; l += gsize()) {
        float* b = bias + l * E;
        float* m = ema + l * E;
        float* rb = routing_bias + l * E;
        const float* ld_ = loads + l * E;
        double total = 0.0;
        for (int i = 0; i < E; i++) total += (double)ld_[i];
        for (int i = 0; i < E; i++) {
            float before = b[i];
            if (total > 0.0) {
                double frac = (double)ld_[i] / total;
                double e = beta * (double)m[i] + (1.0 - beta) * frac;
                m[i] = (float)e;
                double diff = 1.0 / (double)E - e;
                double sign = diff > 0.0 ? 1.0 : (diff < 0.0 ? -1.0 : 0.0);
                b[i] = (float)((double)b[i] + gamma * sign);
            }
            rb[i] = bug_after ? before : b[i];
        }
    }
}
