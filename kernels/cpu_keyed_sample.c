/* Keyed sampling on the CPU (kernels/cpu_keyed_sample.py builds and calls it): per row, the Gumbel-max
 * draw from a distribution p with noise fixed by a 64-bit key,
 *     token = argmax_j p[j] / E[j],   E[j] = -log(u[j]),   u[j] = uniform(splitmix64 of key + j * golden),
 * (p/E, the exponential race, orders tokens as log p + Gumbel noise does), an exact sample of p. The same
 * p and key give the same token, so a draft sampled from q with the target's key agrees with the
 * target's draw whenever q is close to p.
 *
 * Most tokens cannot win: with s the best score so far, token j beats it only if E[j] < p[j] / s, which
 * needs u[j] > exp(-p[j] / s) >= 1 - p[j] / s. That test is one multiply-compare per token in a
 * vectorized pass over the hashes; the few tokens that pass compute their logarithm. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
#define GOLDEN 0x9E3779B97F4A7C15ull

typedef uint64_t v8u __attribute__((vector_size(64)));
typedef int64_t v8l __attribute__((vector_size(64)));
typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));

static inline uint64_t mix(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline v8u mix8(v8u x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* u in (0, 1]: 53 bits, never 0 (whose logarithm has no value). */
static inline double uniform(uint64_t key, int64_t j) {
    return (double)((mix(key + (uint64_t)j * GOLDEN) >> 11) + 1) * 0x1p-53;
}

static int64_t sample_row(const float *p, int64_t n, uint64_t key) {
    /* Start from the most probable token: its score bounds the others from below. */
    int64_t best = 0;
    for (int64_t j = 1; j < n; j++)
        if (p[j] > p[best]) best = j;
    double s = (double)p[best] / -log(uniform(key, best));
    const v8u lane = {0, 1, 2, 3, 4, 5, 6, 7};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        v8f pf;
        memcpy(&pf, p + j, sizeof pf);
        const v8d pd = __builtin_convertvector(pf, v8d);
        const v8u h = mix8(key + (lane + (uint64_t)j) * GOLDEN);
        const v8d u = __builtin_convertvector((h >> 11) + 1, v8d) * 0x1p-53;
        const v8l maybe = (u * s > s - pd) & (pd > 0);
        int64_t any = 0;
        for (int l = 0; l < LANES; l++) any |= maybe[l];
        if (!any) continue;
        for (int l = 0; l < LANES; l++) {
            if (!maybe[l]) continue;
            const double score = pd[l] / -log(u[l]);
            if (score > s) s = score, best = j + l;
        }
    }
    for (; j < n; j++) {
        if (!(p[j] > 0)) continue;
        const double u = uniform(key, j);
        if (u * s <= s - p[j]) continue;
        const double score = p[j] / -log(u);
        if (score > s) s = score, best = j;
    }
    return best;
}

/* out[r] = the keyed draw from p[r, :n] (rows `stride` floats apart, non-negative, any scale) with key
 * keys[r]. */
void spec_keyed_sample_f32(const float *p, int64_t rows, int64_t n, int64_t stride, const uint64_t *keys,
                           int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * n >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) out[r] = sample_row(p + r * stride, n, keys[r]);
}
