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
 * fixed tree, a two-pass softmax (its sum in 16 lanes, reduced the same way), values accumulated key
 * after key and divided by the sum at the end.
 * A request's tokens (a verified tree) share its prefix: those keys are read once for all of them,
 * which changes the order of nothing a single token computes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define LANES 16
#define MAX_HEAD_DIM 512
#define BLOCK 16           /* value rows summed per pass */

/* Row `i` of `n` floats: a pointer into fp32 storage, or converted from bf16 into `buf`. */
static inline const float *row_of(const void *base, int bf16, int64_t i, int n, float *buf) {
    if (!bf16) return (const float *)base + i * n;
    const uint16_t *src = (const uint16_t *)base + i * n;
    for (int d = 0; d < n; d++) buf[d] = bf16_to_float(src[d]);
    return buf;
}

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 lane sums to one: lane l + lane l + 8, then l + 4, l + 2, l + 1. */
static inline float reduce16(v16f acc) {
    const v8f h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4f h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* sum(a * b) over d (a multiple of LANES), in 16 lanes reduced by reduce16. GCC's vector types keep it
 * in registers (an array was spilled to the stack). */
static inline float dot(const float *a, const float *b, int d) {
    v16f acc = {0};
    for (int i = 0; i < d; i += LANES) acc += load16(a + i) * load16(b + i);
    return reduce16(acc);
}

/* dot(a, b[r]) for four rows b at once, each by exactly dot's operations: four independent chains
 * keep the FMA units busy where one waits on its own latency. */
static inline void dot4(const float *a, const float *const b[4], int d, float out[4]) {
    v16f acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
    for (int i = 0; i < d; i += LANES) {
        const v16f x = load16(a + i);
        acc0 += x * load16(b[0] + i);
        acc1 += x * load16(b[1] + i);
        acc2 += x * load16(b[2] + i);
        acc3 += x * load16(b[3] + i);
    }
    out[0] = reduce16(acc0);
    out[1] = reduce16(acc1);
    out[2] = reduce16(acc2);
    out[3] = reduce16(acc3);
}

typedef struct {
    const void *q, *k_pool, *v_pool;
    void *out;
    int bf16, H, Hkv, D, G;
    const int64_t *kv_index, *kv_len;
    int64_t max_kv;
    float scale;
} Problem;

/* max(s[:n]), 16 lanes at a time (a maximum is the same in any order). */
static inline float max_of(const float *s, int64_t n) {
    float lane[LANES];
    for (int l = 0; l < LANES; l++) lane[l] = -INFINITY;
    for (int64_t j = 0; j < n; j += LANES)
        for (int l = 0; l < LANES && j + l < n; l++) lane[l] = s[j + l] > lane[l] ? s[j + l] : lane[l];
    float top = lane[0];
    for (int l = 1; l < LANES; l++) top = lane[l] > top ? lane[l] : top;
    return top;
}

/* sum(s[:n]): lane l sums s[l], s[l + 16], ... in order, then reduce16; fixed for a given n. */
static inline float sum_of(const float *s, int64_t n) {
    v16f acc = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) acc += load16(s + j);
    float tail[LANES] = {0};
    memcpy(tail, s + j, (size_t)(n - j) * sizeof(float));
    return reduce16(acc + load16(tail));
}

/* Scores of query rows [r0, r1) (row r: token r / G, head h * G + r % G) against keys [j0, j1) of
 * `slots`, four keys at a time: the same operations per score whatever the range. */
static void score_keys(const Problem *P, int h, const float *qf, int r0, int r1, const int64_t *slots,
                       int64_t j0, int64_t j1, float *scores, float rows[BLOCK][MAX_HEAD_DIM]) {
    const int D = P->D;
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        const float *k[4], *const *kc = k;
        float four[4];
        for (int i = 0; i < 4; i++) k[i] = row_of(P->k_pool, P->bf16, slots[j + i] * P->Hkv + h, D, rows[i]);
        for (int r = r0; r < r1; r++) {
            dot4(qf + (int64_t)r * D, kc, D, four);
            for (int i = 0; i < 4; i++) scores[r * P->max_kv + j + i] = four[i] * P->scale;
        }
    }
    for (; j < j1; j++) {
        const float *k = row_of(P->k_pool, P->bf16, slots[j] * P->Hkv + h, D, rows[0]);
        for (int r = r0; r < r1; r++) scores[r * P->max_kv + j] = dot(qf + (int64_t)r * D, k, D) * P->scale;
    }
}

/* acc[r] += p[r][j] * v[j] for rows [r0, r1), keys [j0, j1) in order: BLOCK keys at a time, each
 * 16 lanes of a row's sums kept in a register across the block. */
static void sum_values(const Problem *P, int h, const float *scores, int r0, int r1, const int64_t *slots,
                       int64_t j0, int64_t j1, float *acc, float rows[BLOCK][MAX_HEAD_DIM]) {
    const int D = P->D;
    for (int64_t j = j0; j < j1; j += BLOCK) {
        const int m = j1 - j < BLOCK ? (int)(j1 - j) : BLOCK;
        const float *v[BLOCK];
        for (int i = 0; i < m; i++) v[i] = row_of(P->v_pool, P->bf16, slots[j + i] * P->Hkv + h, D, rows[i]);
        for (int r = r0; r < r1; r++) {
            const float *p = scores + r * P->max_kv + j;
            float *a = acc + (int64_t)r * D;
            for (int d = 0; d < D; d += LANES) {
                v16f sum = load16(a + d);
                for (int i = 0; i < m; i++) sum += p[i] * load16(v[i] + d);
                memcpy(a + d, &sum, sizeof sum);
            }
        }
    }
}

/* Tokens [t0, t1), which all see their first `shared` keys (the same slots), with KV head h: those keys
 * are read once for all of them. Scratch: scores [rows, max_kv], qf and acc [rows, D], sums [rows]. */
static void attend_item(const Problem *P, int64_t t0, int64_t t1, int64_t shared, int h, float *scores,
                        float *qf, float *acc, float *sums, float rows[BLOCK][MAX_HEAD_DIM]) {
    const int D = P->D, G = P->G, R = (int)(t1 - t0) * G;
    for (int r = 0; r < R; r++) {
        const int64_t t = t0 + r / G;
        const float *x = row_of(P->q, P->bf16, t * P->H + (int64_t)h * G + r % G, D, rows[0]);
        memcpy(qf + (int64_t)r * D, x, (size_t)D * sizeof(float));
    }
    score_keys(P, h, qf, 0, R, P->kv_index + t0 * P->max_kv, 0, shared, scores, rows);
    for (int64_t t = t0; t < t1; t++)
        score_keys(P, h, qf, (int)(t - t0) * G, (int)(t - t0 + 1) * G, P->kv_index + t * P->max_kv, shared,
                   P->kv_len[t], scores, rows);
    memset(acc, 0, (size_t)R * D * sizeof(float));
    for (int r = 0; r < R; r++) {
        const int64_t n = P->kv_len[t0 + r / G];
        float *s = scores + (int64_t)r * P->max_kv;
        const float top = max_of(s, n);
        for (int64_t j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - top);
        sums[r] = sum_of(s, n);
    }
    sum_values(P, h, scores, 0, R, P->kv_index + t0 * P->max_kv, 0, shared, acc, rows);
    for (int64_t t = t0; t < t1; t++)
        sum_values(P, h, scores, (int)(t - t0) * G, (int)(t - t0 + 1) * G, P->kv_index + t * P->max_kv, shared,
                   P->kv_len[t], acc, rows);
    for (int r = 0; r < R; r++) {
        const int64_t o = ((t0 + r / G) * P->H + (int64_t)h * G + r % G) * D;
        const float *a = acc + (int64_t)r * D, sum = sums[r];
        if (P->bf16) {
            for (int d = 0; d < D; d++) ((uint16_t *)P->out)[o + d] = float_to_bf16(a[d] / sum);
        } else {
            for (int d = 0; d < D; d++) ((float *)P->out)[o + d] = a[d] / sum;
        }
    }
}

/* q, out [T, H, D]; k_pool, v_pool [slots, Hkv, D]; token t sees the slots kv_index[t, :kv_len[t]].
 * Tokens come in groups (a request's tokens): group i is tokens [starts[i], starts[i + 1]), which all
 * see the same first shared[i] slots. A work item is some tokens of a group with one KV head and its
 * H / Hkv query heads; groups are split so that every thread has several items.
 * Returns 0, or -1 when the shapes are unsupported or memory runs out. */
int spec_attend(const void *q, const void *k_pool, const void *v_pool, void *out, int bf16,
                int64_t T, int H, int Hkv, int D, const int64_t *kv_index, const int64_t *kv_len,
                int64_t max_kv, const int64_t *starts, const int64_t *shared, int64_t groups, float scale,
                int threads) {
    if (D % LANES || D > MAX_HEAD_DIM || H % Hkv || T == 0) return T == 0 ? 0 : -1;
    const Problem P = {q, k_pool, v_pool, out, bf16, H, Hkv, D, H / Hkv, kv_index, kv_len, max_kv, scale};
    int64_t per = (T * Hkv + 4 * threads - 1) / (4 * (int64_t)threads);
    per = per < 1 ? 1 : per > 8 ? 8 : per;
    int64_t items = 0;
    for (int64_t i = 0; i < groups; i++) items += (starts[i + 1] - starts[i] + per - 1) / per;
    int64_t *first = malloc((size_t)items * sizeof(int64_t)), *group = malloc((size_t)items * sizeof(int64_t));
    if (!first || !group) {
        free(first);
        free(group);
        return -1;
    }
    for (int64_t i = 0, k = 0; i < groups; i++)
        for (int64_t t = starts[i]; t < starts[i + 1]; t += per, k++) first[k] = t, group[k] = i;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int64_t R = per * P.G;
        float *scores = malloc((size_t)R * (size_t)(max_kv > 0 ? max_kv : 1) * sizeof(float));
        float *qf = malloc((size_t)R * D * sizeof(float));
        float *acc = malloc((size_t)R * D * sizeof(float));
        float *sums = malloc((size_t)R * sizeof(float));
        float rows[BLOCK][MAX_HEAD_DIM];
        if (!scores || !qf || !acc || !sums) failed = 1;
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < items * Hkv; item++) {
            if (failed) continue;
            const int64_t k = item / Hkv, end = starts[group[k] + 1];
            const int64_t t1 = first[k] + per < end ? first[k] + per : end;
            attend_item(&P, first[k], t1, shared[group[k]], (int)(item % Hkv), scores, qf, acc, sums, rows);
        }
        free(scores);
        free(qf);
        free(acc);
        free(sums);
    }
    free(first);
    free(group);
    return failed ? -1 : 0;
}
