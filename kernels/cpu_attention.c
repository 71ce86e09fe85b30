/* Batch-invariant paged attention for the CPU (kernels/cpu_attention.py builds and calls it).
 *
 * Every query token attends over its own list of visible KV slots, read where they lie in the pool.
 * A token's result is a fixed sequence of float operations over its query and its keys in list order:
 * it does not depend on how many other tokens share the call, on their lengths, on padding or on
 * threads. That is what makes a verify forward (several tokens of a request at once) give, row for
 * row, the bits a decode step gives for the same token, so speculative decoding repeats plain decoding
 * exactly even where bf16 or int8 rounding downstream would amplify a last-bit difference.
 *
 * Arithmetic is fp32 whatever the storage (fp32 or bf16): scores by 16-lane dot products reduced in a
 * fixed tree, a two-pass softmax, values accumulated key after key and divided by the sum at the end.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_HEAD_DIM 512

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch converts (NaN stays NaN). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Row `i` of `n` floats: a pointer into fp32 storage, or converted from bf16 into `buf`. */
static inline const float *row_of(const void *base, int bf16, int64_t i, int n, float *buf) {
    if (!bf16) return (const float *)base + i * n;
    const uint16_t *src = (const uint16_t *)base + i * n;
    for (int d = 0; d < n; d++) buf[d] = bf16_to_float(src[d]);
    return buf;
}

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in
 * two parts, p of degree 6 (within 2 ulp of expf). Plain arithmetic, so loops over it vectorize. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float shift = 12582912.0f;      /* 1.5 * 2^23: adding and taking it away rounds to an integer */
    const float n = (x * 1.44269504088896341f + shift) - shift;
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* sum(a * b) over d (d a multiple of LANES), lanes reduced pairwise in a fixed order. */
static inline float dot(const float *a, const float *b, int d) {
    float acc[LANES] = {0};
    for (int i = 0; i < d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* q, out [T, H, D]; k_pool, v_pool [slots, Hkv, D]; token t sees the slots kv_index[t, :kv_len[t]].
 * One work item is a token and a KV head with its H / Hkv query heads; scratch holds a thread's
 * scores. Returns 0, or -1 when the head dimension is unsupported or memory runs out. */
int spec_attend(const void *q, const void *k_pool, const void *v_pool, void *out, int bf16,
                int64_t T, int H, int Hkv, int D, const int64_t *kv_index, const int64_t *kv_len,
                int64_t max_kv, float scale, int threads) {
    if (D % LANES || D > MAX_HEAD_DIM || H % Hkv) return -1;
    const int G = H / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)G * (size_t)(max_kv > 0 ? max_kv : 1) * sizeof(float));
        float *qf = malloc((size_t)G * D * sizeof(float));
        float *acc = malloc((size_t)G * D * sizeof(float));
        float *sums = malloc((size_t)G * sizeof(float));
        float row[MAX_HEAD_DIM];
        if (!scores || !qf || !acc || !sums) failed = 1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * Hkv; item++) {
            if (failed) continue;
            const int64_t t = item / Hkv;
            const int h = (int)(item % Hkv);
            const int64_t n = kv_len[t];
            const int64_t *slots = kv_index + t * max_kv;
            for (int g = 0; g < G; g++) {
                const float *qg = row_of(q, bf16, t * H + (int64_t)h * G + g, D, row);
                memcpy(qf + g * D, qg, (size_t)D * sizeof(float));
            }
            for (int64_t j = 0; j < n; j++) {
                const float *k = row_of(k_pool, bf16, slots[j] * Hkv + h, D, row);
                for (int g = 0; g < G; g++) scores[g * n + j] = dot(qf + g * D, k, D) * scale;
            }
            memset(acc, 0, (size_t)G * D * sizeof(float));
            for (int g = 0; g < G; g++) {
                float *s = scores + g * n, top = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
                for (int64_t j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - top);
                for (int64_t j = 0; j < n; j++) sum += s[j];
                sums[g] = sum;
            }
            for (int64_t j = 0; j < n; j++) {
                const float *v = row_of(v_pool, bf16, slots[j] * Hkv + h, D, row);
                for (int g = 0; g < G; g++) {
                    const float p = scores[g * n + j];
                    float *a = acc + g * D;
                    for (int d = 0; d < D; d++) a[d] += p * v[d];
                }
            }
            for (int g = 0; g < G; g++)
                for (int d = 0; d < D; d++) acc[g * D + d] /= sums[g];
            for (int g = 0; g < G; g++) {
                const int64_t o = (t * H + (int64_t)h * G + g) * D;
                if (bf16) {
                    for (int d = 0; d < D; d++) ((uint16_t *)out)[o + d] = float_to_bf16(acc[g * D + d]);
                } else {
                    memcpy((float *)out + o, acc + g * D, (size_t)D * sizeof(float));
                }
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(sums);
    }
    return failed ? -1 : 0;
}
