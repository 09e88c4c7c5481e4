// Router affinities s = 1 / (1 + exp(-logits)) (float). Launch: 1-D grid-stride over n.
KERNEL sigmoid(float* s, const float* logits, long n) {
    for (long i = gtid(); i < n; i += gsize()) s[i] = sigmoidf_(logits[i]);
}
