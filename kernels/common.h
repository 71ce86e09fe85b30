/* Shared by the C kernels of this folder: bf16 <-> fp32 as torch converts, a vectorizable exp. */
#ifndef SPEC_COMMON_H
#define SPEC_COMMON_H
#include <stdint.h>
#include <string.h>

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

/* exp(x) for x <= 0 (attention: scores minus their maximum): 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in
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

#endif
