/* Linear layers with 4-, 5-, 6- or 8-bit weights and 8-bit activations on the CPU (kernels/cpu_w4a8.py builds
 * and calls it): y = x W^T (+ bias), W [N, K] in groups of 32 weights along K, w = q * scale + min with
 * q in 0..15 (GGUF's Q4_0, Q4_1 and Q4_K blocks are this form) or in 0..255 (a symmetric int8 group,
 * Q8_0's form, stored offset by 128 with min = -128 * scale), scale and min stored as fp16, or for
 * GGUF's Q4_K as it stores them (k_scales): scale = d * sc, min = -(dmin * m), with a uint8 sc and m
 * per group and fp16 d and dmin per 256 (both products exact in fp32; Q5_K: the same with q in 0..31);
 * or q in 0..31 with fp16 scale and min (GGUF's Q5_0, Q5_1 and MXFP4, as gguf_quant.py decodes them);
 * or GGUF's Q6_K as it is:
 * w = d * sc * (q - 32), q in 0..63, an int8 sc per 16 weights, an fp16 d per 256.
 *
 * Each activation row is quantized to int8 in the same groups of 32 (one scale per group, symmetric,
 * as llama.cpp's Q8 blocks), so a group's dot product is an exact integer sum of q * x8, taken by
 * VNNI's u8 x s8 instruction where the CPU has it:
 *   y[m, n] = sum over groups g, in order, of  scale[n, g] * dx[m, g] * sum_i q[n, g, i] x8[m, g, i]
 *                                            + min[n, g] * sx[m, g]
 * with sx[m, g] = dx[m, g] * sum_i x8[m, g, i]. For 6 bits a group is two halves of 16, each
 *   d[n] sc[n, h] * dx[m, g] * (sum_i q[n, h, i] x8[m, h, i] - 32 sum_i x8[m, h, i])
 * with the offset taken in the integer sum (d * sc is exact in fp32). Weights are unpacked once per
 * call for up to 8 rows (one row is bound by memory, 8 by the VNNI instructions, 8 per row, group and
 * block: 8 rows cost little more than one row read from DRAM), and a
 * row's result is a fixed sequence of operations on that row alone: it does not depend on the other
 * rows of the call or on threads, which speculative decoding's losslessness rests on.
 *
 * Weight layout (kernels/cpu_w4a8.py packs it): rows in blocks of 16 (N padded), per block and group
 * 8 vectors of 16 rows x 4 weights (byte 4 n + i of vector j is q[n][4 j + i]), the shape of one VNNI
 * instruction against 4 activation bytes broadcast. 8-bit: the 8 vectors as they are (512 bytes);
 * 4-bit: 4 chunks of 64 bytes, chunk c holding vector c in its low nibbles and vector c + 4 in its
 * high ones (256 bytes); 5-bit: those 4 chunks, then one of the high bits, vector j's in bit j
 * (320 bytes); 6-bit: those 4 chunks of the low 4 bits, then 2 chunks of the high 2 bits,
 * chunk c's bits 2t, 2t + 1 those of vector 4c + t (384 bytes: 0.82 bytes a weight, as Q6_K). Scales
 * and mins: fp16 [blocks][G][16] each. Q4_K and Q5_K: sc and m as uint8 [blocks][G][2][16] in the scales'
 * place,
 * and d and dmin as fp16 [blocks][K / 256][2][16] in the mins' (0.58 bytes a weight). 6 bits: int8
 * scales [blocks][G][2 halves][16] and d [blocks][K / 256][16].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GROUP 32
#define MR 8               /* activation rows per pass over a block of weights */
#define NB 16              /* weight rows per block */

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp != 0) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0) u = sign;
    else {                                  /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* One activation row -> int8 groups: x8 [K], dx [G] (group scale), sx [G] (dx * sum of the group), xh [2 G]
 * (the integer sums of the groups' halves, for 6-bit weights).
 * x8 = round-to-nearest-even(x * (127 / amax)) in both paths, so they give the same bits. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512 bf16x16_to_float(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float_to_bf16 (common.h) on 16 lanes: round to nearest even, NaN stays NaN. */
static inline __m256i float_to_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
    const __m512i rne = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, rne), 16);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(h, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40))));
}

static void quantize_row(const void *x, int bf16, int K, int8_t *x8, float *dx, float *sx, int32_t *xh) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int g = 0; g < K / GROUP; g++) {
        __m512 a, b;
        if (bf16) {
            const uint16_t *h = (const uint16_t *)x + g * GROUP;
            a = bf16x16_to_float(_mm256_loadu_si256((const __m256i *)h));
            b = bf16x16_to_float(_mm256_loadu_si256((const __m256i *)(h + 16)));
        } else {
            a = _mm512_loadu_ps((const float *)x + g * GROUP);
            b = _mm512_loadu_ps((const float *)x + g * GROUP + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(x8 + g * GROUP), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(x8 + g * GROUP + 16), _mm512_cvtepi32_epi8(qb));
        dx[g] = d;
        xh[2 * g] = _mm512_reduce_add_epi32(qa), xh[2 * g + 1] = _mm512_reduce_add_epi32(qb);
        sx[g] = d * (float)(xh[2 * g] + xh[2 * g + 1]);
    }
}
#else
static void quantize_row(const void *x, int bf16, int K, int8_t *x8, float *dx, float *sx, int32_t *xh) {
    float v[GROUP];
    for (int g = 0; g < K / GROUP; g++) {
        float amax = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            v[i] = bf16 ? bf16_to_float(((const uint16_t *)x)[g * GROUP + i]) : ((const float *)x)[g * GROUP + i];
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t half[2] = {0, 0};
        for (int i = 0; i < GROUP; i++) {
            int q = (int)nearbyintf(v[i] * inv);
            x8[g * GROUP + i] = (int8_t)q;
            half[i / 16] += q;
        }
        dx[g] = d;
        xh[2 * g] = half[0], xh[2 * g + 1] = half[1];
        sx[g] = d * (float)(half[0] + half[1]);
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KERNEL "avx512-vnni"
/* s[r] += the VNNI products of vectors j0 <= j < j1 of a group with row r's activation quads, r < ROWS.
 * Interleaved, the rows' dependency chains overlap, where row by row each sum would wait on its previous
 * instruction 8 times a group. Integer sums: the same values in any order. */
static inline __attribute__((always_inline)) void vnni_sums(__m512i *s, const __m512i *q, int j0, int j1,
                                                             const int8_t *x8, int64_t K, int g, const int ROWS) {
#pragma GCC unroll 8
    for (int j = j0; j < j1; j++)
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            int32_t quad;
            memcpy(&quad, x8 + r * K + g * GROUP + 4 * j, 4);
            s[r] = _mm512_dpbusd_epi32(s[r], q[j], _mm512_set1_epi32(quad));
        }
}

/* acc[r] (16 rows of W) += rows r < ROWS of x8 (stride K) against one block of weights, group by group.
 * Inlined with BITS and ROWS constant, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_dot(
        const uint8_t *w, const uint16_t *ws, const uint16_t *wm, int G, const int8_t *x8, int64_t K,
        const float *dx, const float *sx, const int32_t *xh, const int BITS, const int KQ, const int ROWS,
        float *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30), high1 = _mm512_set1_epi8(0x10);
    __m512 acc[MR];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i q[8];
        const uint8_t *wg = w + (int64_t)g * 64 * BITS;
        for (int c = 0; c < BITS; c++)      /* the next block's same lines: a layer's first touch is DRAM's */
            _mm_prefetch((const char *)(wg + 2 * (int64_t)G * 64 * BITS + 64 * c), _MM_HINT_T0);
        if (g % 2 == 0)                     /* and its scales and mins, a line per 2 groups */
            _mm_prefetch((const char *)(ws + (2 * (int64_t)G + g) * NB), _MM_HINT_T0);
        if (BITS != 6 && !KQ && g % 2 == 0)
            _mm_prefetch((const char *)(wm + (2 * (int64_t)G + g) * NB), _MM_HINT_T0);
        if ((BITS == 6 || KQ) && g % 8 == 0)   /* d (and dmin) per 256: a line per 8 groups */
            _mm_prefetch((const char *)(wm + (2 * (int64_t)(G / 8) + g / 8) * NB * (KQ ? 2 : 1)), _MM_HINT_T0);
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wg + 64 * c));
            if (BITS == 8) {
                q[c] = v;
                q[c + 4] = _mm512_loadu_si512((const void *)(wg + 64 * (c + 4)));
            } else {
                q[c] = _mm512_and_si512(v, low4);
                q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
        }
        if (BITS == 5) {                    /* the high bit: vector j's at bit j, moved to bit 4 */
            const __m512i h = _mm512_loadu_si512((const void *)(wg + 64 * 4));
            const __m512i at[8] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 3), _mm512_slli_epi16(h, 2),
                                   _mm512_slli_epi16(h, 1), h, _mm512_srli_epi16(h, 1), _mm512_srli_epi16(h, 2),
                                   _mm512_srli_epi16(h, 3)};
            for (int j = 0; j < 8; j++)     /* q | (at & 0x10) */
                q[j] = _mm512_ternarylogic_epi32(q[j], at[j], high1, 0xf8);
        }
        if (BITS == 6)                      /* the high 2 bits: vector 4 c + t's at bits 2 t, moved to bits 4-5 */
            for (int c = 0; c < 2; c++) {
                const __m512i h = _mm512_loadu_si512((const void *)(wg + 64 * (4 + c)));
                const __m512i at[4] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2), h, _mm512_srli_epi16(h, 2)};
                for (int t = 0; t < 4; t++)     /* q | (at & 0x30) */
                    q[4 * c + t] = _mm512_ternarylogic_epi32(q[4 * c + t], at[t], high2, 0xf8);
            }
        __m512i s[MR];
        if (BITS == 6) {
            const __m256i sc = _mm256_loadu_si256((const __m256i *)(ws + g * 16));
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + g / 8 * 16)));
            const __m512i sc_lo = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(sc));
            const __m512i sc_hi = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(sc, 1));
            const __m512 dh[2] = {_mm512_mul_ps(_mm512_cvtepi32_ps(sc_lo), d),
                                  _mm512_mul_ps(_mm512_cvtepi32_ps(sc_hi), d)};
            /* Both halves' sums first, then their float steps: folded half by half, a row's second sum
             * would wait on its first's float step. */
            __m512i s_hi[MR];
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                s[r] = _mm512_set1_epi32(-32 * xh[r * 2 * G + 2 * g]);
                s_hi[r] = _mm512_set1_epi32(-32 * xh[r * 2 * G + 2 * g + 1]);
            }
            vnni_sums(s, q, 0, 4, x8, K, g, ROWS);
            vnni_sums(s_hi, q, 4, 8, x8, K, g, ROWS);
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const __m512 dxr = _mm512_set1_ps(dx[r * G + g]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(dh[0], dxr), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_hi[r]), _mm512_mul_ps(dh[1], dxr), acc[r]);
            }
            continue;
        }
        __m512 dw, mn;
        if (KQ) {
            const __m256i sm = _mm256_loadu_si256((const __m256i *)(ws + g * 16));
            const uint16_t *dd = wm + g / 8 * 32;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dd));
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dd + 16)));
            dw = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(sm))), d);
            mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(sm, 1))),
                               _mm512_sub_ps(_mm512_setzero_ps(), dmin));
        } else {
            dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ws + g * 16)));
            mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + g * 16)));
        }
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) s[r] = _mm512_setzero_si512();
        vnni_sums(s, q, 0, 8, x8, K, g, ROWS);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * G + g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), d, acc[r]);
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}
#else
#define KERNEL "portable"
static inline __attribute__((always_inline)) void block_dot(
        const uint8_t *w, const uint16_t *ws, const uint16_t *wm, int G, const int8_t *x8, int64_t K,
        const float *dx, const float *sx, const int32_t *xh, const int BITS, const int KQ, const int ROWS,
        float *out) {
    float acc[MR][NB] = {{0}};
    for (int g = 0; g < G; g++) {
        uint8_t q[8][64];
        const uint8_t *wg = w + (int64_t)g * 64 * BITS;
        for (int c = 0; c < 4; c++)
            for (int b = 0; b < 64; b++) {
                q[c][b] = BITS == 8 ? wg[64 * c + b] : wg[64 * c + b] & 0x0f;
                q[c + 4][b] = BITS == 8 ? wg[64 * (c + 4) + b] : wg[64 * c + b] >> 4;
            }
        if (BITS == 5)
            for (int j = 0; j < 8; j++)
                for (int b = 0; b < 64; b++) q[j][b] |= ((wg[64 * 4 + b] >> j) & 1) << 4;
        if (BITS == 6)
            for (int j = 0; j < 8; j++)
                for (int b = 0; b < 64; b++) q[j][b] |= ((wg[64 * (4 + j / 4) + b] >> (2 * (j % 4))) & 3) << 4;
        for (int r = 0; r < ROWS; r++) {
            const int8_t *a = x8 + r * K + g * GROUP;
            for (int h = 0; h < (BITS == 6 ? 2 : 1); h++) {
                int32_t s[NB];
                for (int n = 0; n < NB; n++) s[n] = BITS == 6 ? -32 * xh[r * 2 * G + 2 * g + h] : 0;
                for (int j = 4 * h; j < (BITS == 6 ? 4 * h + 4 : 8); j++)
                    for (int n = 0; n < NB; n++)
                        for (int i = 0; i < 4; i++) s[n] += (int32_t)q[j][4 * n + i] * a[4 * j + i];
                for (int n = 0; n < NB; n++) {
                    if (BITS == 6) {
                        const int8_t sc = ((const int8_t *)(ws + g * 16))[16 * h + n];
                        const float dh = half_to_float(wm[g / 8 * 16 + n]) * (float)sc;
                        acc[r][n] = fmaf((float)s[n], dh * dx[r * G + g], acc[r][n]);
                    } else {
                        const uint8_t *sm = (const uint8_t *)(ws + g * 16);
                        const float scale = KQ ? half_to_float(wm[g / 8 * 32 + n]) * (float)sm[n]
                                               : half_to_float(ws[g * 16 + n]);
                        const float low = KQ ? -half_to_float(wm[g / 8 * 32 + 16 + n]) * (float)sm[16 + n]
                                             : half_to_float(wm[g * 16 + n]);
                        acc[r][n] = fmaf((float)s[n], scale * dx[r * G + g], acc[r][n]);
                        acc[r][n] = fmaf(low, sx[r * G + g], acc[r][n]);
                    }
                }
            }
        }
    }
    memcpy(out, acc, sizeof(float) * NB * ROWS);
}
#endif

const char *spec_w4a8_kernel(void) { return KERNEL; }

/* One pass of `rows` activation rows over a block, with BITS and ROWS constant in each copy. */
static void block_rows(const uint8_t *w, const uint16_t *ws, const uint16_t *wm, int G, const int8_t *a,
                       int64_t K, const float *d, const float *s, const int32_t *xh, int bits, int kq, int rows,
                       float *y) {
#define ROWS_CASES(BITS, KQ)                                                         \
    switch (rows) {                                                                  \
    case 1: block_dot(w, ws, wm, G, a, K, d, s, xh, BITS, KQ, 1, y); break;          \
    case 2: block_dot(w, ws, wm, G, a, K, d, s, xh, BITS, KQ, 2, y); break;          \
    case 3: block_dot(w, ws, wm, G, a, K, d, s, xh, BITS, KQ, 3, y); break;          \
    case 4: block_dot(w, ws, wm, G, a, K, d, s, xh, BITS, KQ, 4, y); break;          \
    case 5: block_dot(w, ws, wm, G, a, K, d, s, xh, BITS, KQ, 5, y); break;          \
    case 6: block_dot(w, ws, wm, G, a, K, d, s, xh, BITS, KQ, 6, y); break;          \
    case 7: block_dot(w, ws, wm, G, a, K, d, s, xh, BITS, KQ, 7, y); break;          \
    default: block_dot(w, ws, wm, G, a, K, d, s, xh, BITS, KQ, 8, y); break;         \
    }
    if (bits == 8) ROWS_CASES(8, 0)
    else if (bits == 6) ROWS_CASES(6, 0)
    else if (bits == 5 && kq) ROWS_CASES(5, 1)
    else if (bits == 5) ROWS_CASES(5, 0)
    else if (kq) ROWS_CASES(4, 1)
    else ROWS_CASES(4, 0)
#undef ROWS_CASES
}

/* out[m0 + r, col0 + b * NB + n] = y[r * NB + n] (+ bias) in x's dtype, as float_to_bf16 rounds, rows of
 * `stride` values; a full block 16 lanes at a time (the same operations: in scalar code this loop took a
 * quarter of a SmolLM2 linear). */
static void store_block(const struct spec_w4a8_layer *L, const float *y, int rows, int64_t b, int64_t m0, int bf16,
                        void *out, int64_t stride, int64_t col0) {
    const int64_t N = L->N, n0 = b * NB;
    const int width = N - n0 < NB ? (int)(N - n0) : NB;
    int from = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (width == NB) {
        __m512 bias = _mm512_setzero_ps();
        if (L->bias)
            bias = L->bias_bf16
                       ? bf16x16_to_float(_mm256_loadu_si256((const __m256i *)((const uint16_t *)L->bias + n0)))
                       : _mm512_loadu_ps((const float *)L->bias + n0);
        for (int r = 0; r < rows; r++) {
            __m512 v = _mm512_loadu_ps(y + r * NB);
            if (L->bias) v = _mm512_add_ps(v, bias);
            const int64_t at = (m0 + r) * stride + col0 + n0;
            if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), float_to_bf16x16(v));
            else _mm512_storeu_ps((float *)out + at, v);
        }
        from = NB;
    }
#endif
    for (int r = 0; r < rows; r++)
        for (int n = from; n < width; n++) {
            float v = y[r * NB + n];
            if (L->bias)
                v += L->bias_bf16 ? bf16_to_float(((const uint16_t *)L->bias)[n0 + n])
                                  : ((const float *)L->bias)[n0 + n];
            const int64_t at = (m0 + r) * stride + col0 + n0 + n;
            if (bf16) ((uint16_t *)out)[at] = float_to_bf16(v);
            else ((float *)out)[at] = v;
        }
}

/* A layer (struct spec_w4a8_layer, kernels.h): `bits` (4, 5, 6 or 8) weights (with k_scales, Q4_K's form),
 * scales and mins as described above for N rows (padded to blocks of 16), bias [N] (fp32, or bf16 when
 * bias_bf16) or NULL, and the layers chained after it by `next`, whose rows follow its own in the output
 * (same K). Set up once per layer by the caller. */

/* Per calling thread: the quantized activations, grown as needed and kept (no allocation per call). */
static _Thread_local void *scratch;
static _Thread_local size_t scratch_bytes;

static int64_t blocks_of(const struct spec_w4a8_layer *L) { return (L->N + NB - 1) / NB; }

/* x [M, K] (fp32, or bf16 when bf16) -> out [M, N] in x's dtype (N: the chain's rows). Returns 0, -1 when
 * out of memory, -2 when K is not a multiple of 32 (of 256 for the K types) or differs in the chain. */
int spec_w4a8_linear(const struct spec_w4a8_layer *L, const void *x, int bf16, int64_t M, void *out, int threads) {
    const int64_t K = L->K;
    const int G = (int)(K / GROUP);
    int64_t N = 0, blocks = 0;
    for (const struct spec_w4a8_layer *s = L; s; s = s->next) {
        const int supers = s->bits == 6 || s->k_scales;    /* per-256 scales */
        if (s->K != K || K % GROUP != 0 || (supers && G % 8 != 0)) return -2;
        N += s->N, blocks += blocks_of(s);
    }
    const size_t need = (size_t)M * K + 2 * sizeof(float) * M * G + 2 * sizeof(int32_t) * M * G;
    if (need > scratch_bytes) {
        void *grown = realloc(scratch, need);
        if (!grown) return -1;
        scratch = grown, scratch_bytes = need;
    }
    float *dx = scratch, *sx = dx + M * G;
    int32_t *xh = (int32_t *)(sx + M * G);
    int8_t *x8 = (int8_t *)(xh + 2 * M * G);
    const size_t item = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 8)
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * item, bf16, (int)K, x8 + m * K, dx + m * G, sx + m * G, xh + 2 * m * G);
    /* A small product runs on this thread: waking the others costs more than it saves. */
#pragma omp parallel for num_threads(threads) schedule(static) if (N * K * M >= (1 << 16))
    for (int64_t i = 0; i < blocks; i++) {
        const struct spec_w4a8_layer *s = L;    /* block i of the chain: block b of s, whose rows start at col0 */
        int64_t b = i, col0 = 0;
        for (; b >= blocks_of(s); s = s->next) b -= blocks_of(s), col0 += s->N;
        const int bits = (int)s->bits, kq = (int)s->k_scales;
        const uint8_t *w = s->weight + b * G * 64 * bits;
        const uint16_t *ws = s->scale + b * G * NB, *wm = s->low + b * (bits == 6 ? G / 8 : kq ? G / 4 : G) * NB;
        float y[MR * NB];
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int rows = M - m0 < MR ? (int)(M - m0) : MR;
            block_rows(w, ws, wm, G, x8 + m0 * K, K, dx + m0 * G, sx + m0 * G, xh + 2 * m0 * G, bits, kq, rows, y);
            store_block(s, y, rows, b, m0, bf16, out, N, col0);
        }
    }
    return 0;
}

/* A mixture's chosen experts in one call: layers[g] (each a layer or chain of one K and N rows) on rows
 * starts[g] .. starts[g + 1] - 1 of x [starts[groups], K], into the same rows of out [starts[groups], N].
 * Each run is spec_w4a8_linear's, so a row's result is what a call on its layer alone gives. Returns its
 * codes, and -2 when a layer's K or N differ from the others'. */
int spec_w4a8_grouped(const struct spec_w4a8_layer *const *layers, const int64_t *starts, int groups,
                      const void *x, int bf16, void *out, int64_t N, int threads) {
    const size_t item = bf16 ? 2 : 4;
    const int64_t K = layers[0]->K;
    for (int g = 0; g < groups; g++) {
        int64_t n = 0;
        for (const struct spec_w4a8_layer *s = layers[g]; s; s = s->next) n += s->N;
        if (n != N || layers[g]->K != K) return -2;
        const int64_t m0 = starts[g];
        const int rc = spec_w4a8_linear(layers[g], (const char *)x + m0 * K * item, bf16, starts[g + 1] - m0,
                                        (char *)out + m0 * N * item, threads);
        if (rc) return rc;
    }
    return 0;
}

/* q [N, K] (one byte a weight, or with `nibbles` two: byte k / 2's low nibble is weight k, its high one
 * weight k + 1, as GGUF's 4-bit groups are stored) -> the weight layout above, [blocks][G][bits][64],
 * rows past N zero. A group's vector j for row n is one 32-bit word (weights 4 j .. 4 j + 3, a byte
 * each), so the layout is 16 x 8 words moved and masked per group: in one pass, where torch's permutes
 * and copies over nibbles unpacked first took a large part of a model's load. */
void spec_w4a8_pack(const uint8_t *q, int nibbles, int64_t N, int64_t K, int bits, uint8_t *out, int threads) {
    const int64_t G = K / GROUP, blocks = (N + NB - 1) / NB, row_bytes = nibbles ? K / 2 : K;
    const uint32_t low4 = 0x0f0f0f0fu;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < G; g++) {
            uint32_t z[NB][8];              /* row n's vector j: its weights 4 j .. 4 j + 3, a byte each */
            for (int n = 0; n < NB; n++) {
                uint8_t w[GROUP] = {0};
                if (b * NB + n < N) {
                    const uint8_t *src = q + (b * NB + n) * row_bytes + g * (nibbles ? GROUP / 2 : GROUP);
                    if (nibbles)
                        for (int m = 0; m < GROUP / 2; m++) w[2 * m] = src[m] & 0x0f, w[2 * m + 1] = src[m] >> 4;
                    else
                        memcpy(w, src, GROUP);
                }
                memcpy(z[n], w, GROUP);
            }
            uint32_t *o = (uint32_t *)(out + (b * G + g) * 64 * bits);     /* vector c, row n: word 16 c + n */
            for (int n = 0; n < NB; n++) {
                if (bits == 8) {
                    for (int j = 0; j < 8; j++) o[16 * j + n] = z[n][j];
                    continue;
                }
                for (int c = 0; c < 4; c++) o[16 * c + n] = (z[n][c] & low4) | (z[n][c + 4] & low4) << 4;
                if (bits == 5) {            /* vector j's high bit at bit j */
                    uint32_t h = 0;
                    for (int j = 0; j < 8; j++) h |= ((z[n][j] >> 4) & 0x01010101u) << j;
                    o[64 + n] = h;
                }
                if (bits == 6)              /* vector 4 c + t's high 2 bits at bits 2 t */
                    for (int c = 0; c < 2; c++) {
                        uint32_t h = 0;
                        for (int t = 0; t < 4; t++) h |= ((z[n][4 * c + t] >> 4) & 0x03030303u) << (2 * t);
                        o[64 + 16 * c + n] = h;
                    }
            }
        }
}
