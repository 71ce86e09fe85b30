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
 * after key and divided by the sum at the end. Where the CPU has avx512_bf16, a bf16 pool's scores take
 * its queries and keys as stored, each lane adding a pair of dimensions at a time (vdpbf16ps: bf16
 * products are exact in fp32; that instruction flushes subnormals), faster than converting every key to
 * fp32 first. Its values are weighted as flash attention
 * weights them: the softmax's weights rounded to bf16, a lane adding two keys' terms at a time (keys 0
 * and 1 of the token's list, 2 and 3, ...), where fp32 weights take one FMA a key: half the FMAs, for a
 * mean error against float64 a little above the output's bf16 rounding alone (the kernel tests bound
 * it). An fp32 pool keeps
 * fp32 weights: it is the exact reference.
 * A request's tokens (a verified tree) share its prefix: those keys are read once for all of them,
 * which changes the order of nothing a single token computes.
 *
 * Attention variants (spec_attend_variants), each a function of the token's own list alone, so batch
 * invariance holds with them: a sliding window keeps the last `window` keys of a token's list (its own
 * among them; the list holds consecutive positions, so these are the `window` most recent), which is
 * where its keys then start, pairs of bf16 keys included; a soft-cap maps every score s to
 * cap * tanh(s / cap) before the softmax; a sink (one logit per query head) joins the softmax's maximum
 * and its sum, after the keys' terms, and weighs no value. A window gives every token its own start, so
 * a request's tokens then share no keys read once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define LANES 16
#define MAX_HEAD_DIM 512
#define KEY_BLOCK 80       /* keys (values) converted per pass: every tile width (4, 5, 8, 16) divides it */

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

/* A score is sum(q * k) over d in 16 lanes (lane l adds q[d] k[d] for d = l, l + 16, ... in order), the
 * lanes then reduced as reduce16 does. reduce16x16 takes that tree for 16 such sums at once (lane c of
 * the result is sum c), shuffling across the 16 vectors instead of within each: the same additions in
 * a third of the operations. */
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
static inline v16f reduce16x16(const v16f a[16]) {
    v16f h8[8], h4[4], h2[2];
    for (int p = 0; p < 8; p++)     /* lanes 0-7: sum 2p's l + (l + 8); lanes 8-15: sum 2p + 1's */
        h8[p] = SHUFFLE(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                SHUFFLE(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)     /* four lanes each of sums 4p .. 4p + 3: l + (l + 4) */
        h4[p] = SHUFFLE(h8[2 * p], h8[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                SHUFFLE(h8[2 * p], h8[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)     /* two lanes each of sums 8p .. 8p + 7: 0 + 2 and 1 + 3 */
        h2[p] = SHUFFLE(h4[2 * p], h4[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                SHUFFLE(h4[2 * p], h4[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(h2[0], h2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(h2[0], h2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef SHUFFLE

typedef struct {
    const void *q, *k_pool, *v_pool;
    void *out;
    int bf16, pairs, H, Hkv, D, G;      /* pairs: bf16 scores by vdpbf16ps (see the top) */
    const int64_t *kv_index, *kv_len;
    int64_t max_kv;
    float scale;
    int64_t window;                     /* keys a token sees at most, the last of its list; 0: all */
    float softcap;                      /* 0: none */
    const float *sinks;                 /* [H] or NULL */
} Problem;

/* Where token t's keys start in its list: past those that fall out of the window. */
static inline int64_t first_key(const Problem *P, int64_t t) {
    return P->window && P->kv_len[t] > P->window ? P->kv_len[t] - P->window : 0;
}

/* Token t's visible slots (the window's), and their count. */
static inline const int64_t *keys_of(const Problem *P, int64_t t) {
    return P->kv_index + t * P->max_kv + first_key(P, t);
}
static inline int64_t count_of(const Problem *P, int64_t t) { return P->kv_len[t] - first_key(P, t); }

/* Row stride of the bf16 weights (weights_bf16 writes whole 32s). */
static inline int64_t pb_stride(const Problem *P) { return (P->max_kv + 2 * LANES - 1) / (2 * LANES) * (2 * LANES); }

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

/* Keeps a loaded vector in a register: GCC otherwise folds the load into every FMA that uses it, and the
 * loads, not the FMAs, then bound the loop. */
#if defined(__x86_64__) && defined(__AVX512F__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) (void)0
#endif

/* acc[r * KT + j] += q[r][d + l] k[j][d + l] in lane l, for RT fp32 query rows (stride D) and KT keys. */
static inline __attribute__((always_inline)) void products(const float *qf, const float *const *k, int D, int d,
                                                           const int RT, const int KT, v16f *acc) {
    v16f q[4], kd[16];
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++) {
        q[r] = load16(qf + (int64_t)r * D + d);
        IN_REGISTER(q[r]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < KT; j++) {
        kd[j] = load16(k[j] + d);
        IN_REGISTER(kd[j]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 16
        for (int j = 0; j < KT; j++) acc[r * KT + j] += q[r] * kd[j];
}

#if defined(__AVX512BF16__)
#define PAIRS 1
/* As products, on bf16 rows as stored, 32 dimensions from d: lane l adds the products of dimensions
 * d + 2l and d + 2l + 1 (vdpbf16ps). */
static inline __attribute__((always_inline)) void pair_products(const uint16_t *qb, const uint16_t *const *k, int D,
                                                                int d, const int RT, const int KT, v16f *acc) {
    __m512bh q[4], kd[16];
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++) {
        q[r] = (__m512bh)_mm512_loadu_si512(qb + (int64_t)r * D + d);
        IN_REGISTER(q[r]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < KT; j++) {
        kd[j] = (__m512bh)_mm512_loadu_si512(k[j] + d);
        IN_REGISTER(kd[j]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 16
        for (int j = 0; j < KT; j++) acc[r * KT + j] = (v16f)_mm512_dpbf16_ps((__m512)acc[r * KT + j], q[r], kd[j]);
}
#else
#define PAIRS 0
#endif

/* Scores of RT query rows (stride D; bf16 when pairs, else fp32) against KT keys: RT x KT <= 16 sums in
 * registers, each chunk of a query or a key loaded once for the tile, then one batched reduction. */
static inline __attribute__((always_inline)) void score_tile(const void *q, const void *const *k, int D, const int RT,
                                                             const int KT, const int pairs, float scale,
                                                             float *out[4]) {
    v16f acc[16] = {0};
#if PAIRS
    if (pairs)
        for (int d = 0; d < D; d += 2 * LANES)
            pair_products(q, (const uint16_t *const *)k, D, d, RT, KT, acc);
    else
#endif
        for (int d = 0; d < D; d += LANES) products(q, (const float *const *)k, D, d, RT, KT, acc);
    const v16f s = reduce16x16(acc) * scale;
    for (int r = 0; r < RT; r++) memcpy(out[r], (const float *)&s + r * KT, sizeof(float) * KT);
}

/* Scores of query rows [r0, r1) (row r: token r / G, head h * G + r % G) against keys [j0, j1) of `slots`,
 * into scores[r * max_kv + j]: tiles of up to 4 rows by 4 to 16 keys (the tile's last keys repeated past
 * j1, their sums dropped). The same operations per score whatever the range or the tile. */
static void score_keys(const Problem *P, int h, const void *qrows, int r0, int r1, const int64_t *slots,
                       int64_t j0, int64_t j1, float *scores, float *keys) {
    const int D = P->D;
    const size_t item = P->pairs ? sizeof(uint16_t) : sizeof(float);
    for (int64_t b = j0; b < j1; b += KEY_BLOCK) {
        const int n = j1 - b < KEY_BLOCK ? (int)(j1 - b) : KEY_BLOCK;
        const void *k[KEY_BLOCK + 16];
        for (int i = 0; i < n; i++) {
            const int64_t row = slots[b + i] * P->Hkv + h;
            k[i] = P->pairs ? (const void *)((const uint16_t *)P->k_pool + row * D)
                            : row_of(P->k_pool, P->bf16, row, D, keys + i * D);
        }
        for (int i = n; i < n + 16; i++) k[i] = k[n - 1];
        for (int r = r0; r < r1;) {
            const int RT = r1 - r < 4 ? r1 - r : 4, KT = RT == 4 ? 4 : RT == 3 ? 5 : RT == 2 ? 8 : 16;
            for (int i = 0; i < n; i += KT) {
                float part[4][16], *out[4] = {part[0], part[1], part[2], part[3]};
                const int m = n - i < KT ? n - i : KT;
                const int full = m == KT;
                for (int x = 0; x < RT && full; x++) out[x] = scores + (int64_t)(r + x) * P->max_kv + b + i;
                const void *qr = (const char *)qrows + (size_t)r * D * item, *const *ki = k + i;
#define TILE(RT, KT) P->pairs ? score_tile(qr, ki, D, RT, KT, 1, P->scale, out) \
                              : score_tile(qr, ki, D, RT, KT, 0, P->scale, out)
                switch (RT) {
                case 4: TILE(4, 4); break;
                case 3: TILE(3, 5); break;
                case 2: TILE(2, 8); break;
                default: TILE(1, 16); break;
                }
#undef TILE
                for (int x = 0; x < RT && !full; x++)
                    memcpy(scores + (int64_t)(r + x) * P->max_kv + b + i, part[x], sizeof(float) * m);
            }
            r += RT;
        }
    }
}

/* acc[r][d..d + 64) += p[r][i] * v[i][d..d + 64) for RT rows, keys i in order: RT x 4 chunks of sums in
 * registers, each value chunk loaded once for the RT rows. */
static inline __attribute__((always_inline)) void value_tile(const float *p, int64_t p_stride, const float *const *v,
                                                             int m, int d, float *acc, int D, const int RT) {
    v16f s[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) s[r][c] = load16(acc + (int64_t)r * D + d + 16 * c);
    for (int i = 0; i < m; i++) {
        v16f x[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            x[c] = load16(v[i] + d + 16 * c);
            IN_REGISTER(x[c]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < RT; r++) {
            const float w = p[r * p_stride + i];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) s[r][c] += w * x[c];
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) memcpy(acc + (int64_t)r * D + d + 16 * c, &s[r][c], sizeof(v16f));
}

/* acc[r] += p[r][j] * v[j] for rows [r0, r1), keys [j0, j1) in order: each lane of acc adds its keys' terms
 * one after another, whatever the tiling (up to 4 rows by 64 lanes, then 16-lane chunks). */
static void sum_values(const Problem *P, int h, const float *scores, int r0, int r1, const int64_t *slots,
                       int64_t j0, int64_t j1, float *acc, float *values) {
    const int D = P->D;
    for (int64_t j = j0; j < j1; j += KEY_BLOCK) {
        const int m = j1 - j < KEY_BLOCK ? (int)(j1 - j) : KEY_BLOCK;
        const float *v[KEY_BLOCK];
        for (int i = 0; i < m; i++) v[i] = row_of(P->v_pool, P->bf16, slots[j + i] * P->Hkv + h, D, values + i * D);
        for (int r = r0; r < r1;) {
            const int RT = r1 - r < 4 ? r1 - r : 4;
            const float *p = scores + r * P->max_kv + j;
            float *a = acc + (int64_t)r * D;
            int d = 0;
            for (; d + 4 * LANES <= D; d += 4 * LANES) switch (RT) {
                case 4: value_tile(p, P->max_kv, v, m, d, a, D, 4); break;
                case 3: value_tile(p, P->max_kv, v, m, d, a, D, 3); break;
                case 2: value_tile(p, P->max_kv, v, m, d, a, D, 2); break;
                default: value_tile(p, P->max_kv, v, m, d, a, D, 1); break;
                }
            for (; d < D; d += LANES)
                for (int x = 0; x < RT; x++) {
                    v16f s0 = load16(a + (int64_t)x * D + d);
                    for (int i = 0; i < m; i++) s0 += p[x * P->max_kv + i] * load16(v[i] + d);
                    memcpy(a + (int64_t)x * D + d, &s0, sizeof s0);
                }
            r += RT;
        }
    }
}

#if PAIRS
/* The weights of the values in bf16, as flash attention multiplies them: p[:n] rounded to nearest even
 * into pb, zeros after n up to the next multiple of 32 (a lone last key's partner weighs 0). */
static void weights_bf16(const float *p, int64_t n, uint16_t *pb) {
    for (int64_t j = 0; j < n; j += 2 * LANES) {
        const __mmask16 lo = n - j >= LANES ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __mmask16 hi = n - j >= 2 * LANES ? 0xffff : n - j > LANES ? (__mmask16)((1u << (n - j - LANES)) - 1) : 0;
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + j + LANES), _mm512_maskz_loadu_ps(lo, p + j));
        _mm512_storeu_si512(pb + j, (__m512i)b);
    }
}

/* The values of keys j .. j + m - 1 (j even) in pairs for vdpbf16ps: word d of pair i holds dimension d of
 * key j + 2i in its low half and of key j + 2i + 1 in its high half (zero past the last key). */
static void value_pairs(const Problem *P, int h, const int64_t *slots, int64_t j, int m, uint32_t *out) {
    static const uint16_t zeros[MAX_HEAD_DIM];
    /* word i: dimension i (16 + i) of the first vector, then of the second */
    static const uint16_t ilo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const uint16_t ihi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const int D = P->D;
    const __m512i lo = _mm512_loadu_si512(ilo), hi = _mm512_loadu_si512(ihi);
    for (int i = 0; i < m; i += 2) {
        const uint16_t *a = (const uint16_t *)P->v_pool + (slots[j + i] * P->Hkv + h) * D;
        const uint16_t *b = i + 1 < m ? (const uint16_t *)P->v_pool + (slots[j + i + 1] * P->Hkv + h) * D : zeros;
        uint32_t *o = out + (int64_t)(i / 2) * D;
        for (int d = 0; d < D; d += 2 * LANES) {
            const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
            _mm512_storeu_si512(o + d, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(o + d + LANES, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

/* acc[r][d .. d + 16 CV) += pb[r][2i] v[2i] + pb[r][2i + 1] v[2i + 1] for RT rows, pairs i in order
 * (vdpbf16ps: one instruction a pair of keys where value_tile takes one a key). */
static inline __attribute__((always_inline)) void value_pair_tile(const uint16_t *pb, int64_t pb_stride,
                                                                  const uint32_t *v, int pairs, int d, float *acc,
                                                                  int D, const int RT, const int CV) {
    __m512 s[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 4
        for (int c = 0; c < CV; c++) s[r][c] = _mm512_loadu_ps(acc + (int64_t)r * D + d + 16 * c);
    for (int i = 0; i < pairs; i++) {
        __m512bh x[4];
#pragma GCC unroll 4
        for (int c = 0; c < CV; c++) {
            x[c] = (__m512bh)_mm512_loadu_si512(v + (int64_t)i * D + d + 16 * c);
            IN_REGISTER(x[c]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < RT; r++) {
            uint32_t w;
            memcpy(&w, pb + r * pb_stride + 2 * i, sizeof w);
            const __m512bh wb = (__m512bh)_mm512_set1_epi32((int)w);
#pragma GCC unroll 4
            for (int c = 0; c < CV; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], wb, x[c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 4
        for (int c = 0; c < CV; c++) _mm512_storeu_ps(acc + (int64_t)r * D + d + 16 * c, s[r][c]);
}

/* As sum_values, on a bf16 pool by pairs of keys: keys [j0, j1) with j0 even, so that a key's partner is
 * the same whichever range holds it (the pairs of a token's list are (0, 1), (2, 3), ...). */
static void sum_value_pairs(const Problem *P, int h, const uint16_t *pb, int64_t pb_stride, int r0, int r1,
                            const int64_t *slots, int64_t j0, int64_t j1, float *acc, uint32_t *pairs) {
    const int D = P->D;
    for (int64_t j = j0; j < j1; j += KEY_BLOCK) {
        const int m = j1 - j < KEY_BLOCK ? (int)(j1 - j) : KEY_BLOCK, n = (m + 1) / 2;
        value_pairs(P, h, slots, j, m, pairs);
        for (int r = r0; r < r1;) {
            const int RT = r1 - r < 4 ? r1 - r : 4;
            const uint16_t *p = pb + r * pb_stride + j;
            float *a = acc + (int64_t)r * D;
            for (int d = 0; d < D;) {
                const int CV = D - d >= 4 * LANES ? 4 : 2;
#define PAIR_TILE(RT) CV == 4 ? value_pair_tile(p, pb_stride, pairs, n, d, a, D, RT, 4) \
                              : value_pair_tile(p, pb_stride, pairs, n, d, a, D, RT, 2)
                switch (RT) {
                case 4: PAIR_TILE(4); break;
                case 3: PAIR_TILE(3); break;
                case 2: PAIR_TILE(2); break;
                default: PAIR_TILE(1); break;
                }
#undef PAIR_TILE
                d += CV * LANES;
            }
            r += RT;
        }
    }
}
#endif

/* acc[r] += the weighted values of keys [j0, j1) for rows [r0, r1): by pairs of keys from the bf16
 * weights pb where the pool is paired, else from the fp32 weights in scores. */
static void add_values(const Problem *P, int h, const float *scores, const uint16_t *pb, int r0, int r1,
                       const int64_t *slots, int64_t j0, int64_t j1, float *acc, float *rows) {
#if PAIRS
    if (P->pairs) {
        sum_value_pairs(P, h, pb, pb_stride(P), r0, r1, slots, j0, j1, acc, (uint32_t *)rows);
        return;
    }
#endif
    (void)pb;
    sum_values(P, h, scores, r0, r1, slots, j0, j1, acc, rows);
}

/* Tokens [t0, t1), which all see their first `shared` keys (the same slots), with KV head h: those keys
 * are read once for all of them. Scratch: scores [rows, max_kv], qrows (the queries: bf16 as stored when
 * pairs, else fp32) and acc [rows, D], sums [rows], rows [KEY_BLOCK, D] for converted keys and values. */
static void attend_item(const Problem *P, int64_t t0, int64_t t1, int64_t shared, int h, float *scores,
                        float *qrows, float *acc, float *sums, float *rows, uint16_t *pb) {
    const int D = P->D, G = P->G, R = (int)(t1 - t0) * G;
    for (int r = 0; r < R; r++) {
        const int64_t row = (t0 + r / G) * P->H + (int64_t)h * G + r % G;
        if (P->pairs) memcpy((uint16_t *)qrows + (int64_t)r * D, (const uint16_t *)P->q + row * D, (size_t)D * 2);
        else memcpy(qrows + (int64_t)r * D, row_of(P->q, P->bf16, row, D, rows), (size_t)D * sizeof(float));
    }
    score_keys(P, h, qrows, 0, R, P->kv_index + t0 * P->max_kv, 0, shared, scores, rows);
    for (int64_t t = t0; t < t1; t++)
        score_keys(P, h, qrows, (int)(t - t0) * G, (int)(t - t0 + 1) * G, keys_of(P, t), shared, count_of(P, t),
                   scores, rows);
    memset(acc, 0, (size_t)R * D * sizeof(float));
    for (int r = 0; r < R; r++) {
        const int64_t n = count_of(P, t0 + r / G);
        float *s = scores + (int64_t)r * P->max_kv;
        if (P->softcap > 0)
            for (int64_t j = 0; j < n; j++) s[j] = P->softcap * tanhf(s[j] / P->softcap);
        const float sink = P->sinks ? P->sinks[h * G + r % G] : -INFINITY, most = max_of(s, n);
        const float top = sink > most ? sink : most;
        for (int64_t j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - top);
        sums[r] = sum_of(s, n);
        if (P->sinks) sums[r] += exp_nonpositive(sink - top);
#if PAIRS
        if (P->pairs) weights_bf16(s, n, pb + (int64_t)r * pb_stride(P));
#endif
    }
    /* Pairs of keys must not straddle the split: it falls on an even position for them. */
    const int64_t split = P->pairs ? shared & ~(int64_t)1 : shared;
    add_values(P, h, scores, pb, 0, R, P->kv_index + t0 * P->max_kv, 0, split, acc, rows);
    for (int64_t t = t0; t < t1; t++)
        add_values(P, h, scores, pb, (int)(t - t0) * G, (int)(t - t0 + 1) * G, keys_of(P, t), split, count_of(P, t),
                   acc, rows);
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

/* q, out [T, H, D]; k_pool, v_pool [slots, Hkv, D]; token t sees the slots kv_index[t, :kv_len[t]] (the
 * last `window` of them where window > 0), its scores soft-capped where softcap > 0, with a sink per query
 * head where sinks is not NULL (the top of this file).
 * Tokens come in groups (a request's tokens): group i is tokens [starts[i], starts[i + 1]), which all
 * see the same first shared[i] slots. A work item is some tokens of a group with one KV head and its
 * H / Hkv query heads: up to 4 tokens of a group (whose rows then fill the score tiles, and whose shared keys
 * are converted once for all of them), fewer where that leaves a thread without an item.
 * Returns 0, or -1 when the shapes are unsupported or memory runs out. */
int spec_attend_variants(const void *q, const void *k_pool, const void *v_pool, void *out, int bf16,
                         int64_t T, int H, int Hkv, int D, const int64_t *kv_index, const int64_t *kv_len,
                         int64_t max_kv, const int64_t *starts, const int64_t *shared, int64_t groups, float scale,
                         int64_t window, float softcap, const float *sinks, int threads) {
    if (D % LANES || D > MAX_HEAD_DIM || H % Hkv || T == 0 || window < 0) return T == 0 ? 0 : -1;
    const Problem P = {q, k_pool, v_pool, out, bf16, PAIRS && bf16 && D % (2 * LANES) == 0, H, Hkv, D, H / Hkv,
                       kv_index, kv_len, max_kv, scale, window, softcap, sinks};
    int64_t per = (T * Hkv + threads - 1) / threads;
    per = per < 1 ? 1 : per > 4 ? 4 : per;
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
        float *qrows = malloc((size_t)R * D * sizeof(float));
        float *acc = malloc((size_t)R * D * sizeof(float));
        float *sums = malloc((size_t)R * sizeof(float));
        float *rows = malloc((size_t)KEY_BLOCK * D * sizeof(float));
        uint16_t *pb = P.pairs ? malloc((size_t)R * (size_t)pb_stride(&P) * sizeof(uint16_t)) : NULL;
        if (!scores || !qrows || !acc || !sums || !rows || (P.pairs && !pb)) failed = 1;
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < items * Hkv; item++) {
            if (failed) continue;
            const int64_t k = item / Hkv, end = starts[group[k] + 1];
            const int64_t t1 = first[k] + per < end ? first[k] + per : end;
            attend_item(&P, first[k], t1, window ? 0 : shared[group[k]], (int)(item % Hkv), scores, qrows, acc, sums,
                        rows, pb);
        }
        free(scores);
        free(qrows);
        free(acc);
        free(sums);
        free(rows);
        free(pb);
    }
    free(first);
    free(group);
    return failed ? -1 : 0;
}

/* spec_attend_variants without a window, soft-cap or sinks. */
int spec_attend(const void *q, const void *k_pool, const void *v_pool, void *out, int bf16, int64_t T, int H,
                int Hkv, int D, const int64_t *kv_index, const int64_t *kv_len, int64_t max_kv,
                const int64_t *starts, const int64_t *shared, int64_t groups, float scale, int threads) {
    return spec_attend_variants(q, k_pool, v_pool, out, bf16, T, H, Hkv, D, kv_index, kv_len, max_kv, starts, shared,
                                groups, scale, 0, 0.0f, NULL, threads);
}
