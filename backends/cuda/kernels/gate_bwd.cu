// B, router: gradient of the logits from the gates' gradients. Normalized sigmoid gates
// g_j = s_j / z: ds_j = (dg_j - sum_i dg_i g_i) / z, dlogit = ds s (1 - s); under the
// softmax_gates bug, the softmax's Jacobian. dlogits: t x E (T, all written); dgates,
// gates: t x k; z: t; s, softmax: t x E (float). Launch: 1-D grid-stride over t.
KERNEL gate_bwd(T* dlogits, const float* dgates, const float* gates, const float* z,
                const float* s, const float* softmax, const int* experts, int t, int k, int E,
                int softmax_gates) {
    for (long i = gtid(); i < t; i += gsize()) {
        T* dl = dlogits + i * E;
        const int* ei = experts + i * k;
        if (softmax_gates) {
            const float* p = softmax + i * E;
            float dot = 0.0f;
            for (int x = 0; x < E; x++) {
                float dp = 0.0f;
                for (int j = 0; j < k; j++)
                    if (ei[j] == x) dp += dgates[i * k + j];
                dot += p[x] * dp;
            }
            for (int x = 0; x < E; x++) {
                float dp = 0.0f;
                for (int j = 0; j < k; j++)
                    if (ei[j] == x) dp += dgates[i * k + j];
                st(&dl[x], p[x] * (dp - dot));
            }
            continue;
        }
        for (int x = 0; x < E; x++) st(&dl[x], 0.0f);
        float dot = 0.0f;
        for (int j = 0; j < k; j++)
            if (ei[j] >= 0) dot += dgates[i * k + j] * gates[i * k + j];
        for (int j = 0; j < k; j++) {
            int x = ei[j];
            if (x < 0) continue;
            float ds = (dgates[i * k + j] - dot) / z[i];
            float sv = s[i * E + x];
            st(&dl[x], ld(dl[x]) + ds * sv * (1.0f - sv));
        }
    }
}
