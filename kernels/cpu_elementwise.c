/* The decoder's elementwise steps in bf16 on the CPU (kernels/cpu_elementwise.py builds and calls them):
 * RMSNorm, rotary embedding, SiLU(gate) * up. In eager PyTorch each is 3-7 ops of a few microseconds on
 * vectors of a few hundred values (~90 calls a token on SmolLM2-135M); here each is one call. Arithmetic
 * is fp32, rounded to bf16 once at the end (RMSNorm: also before the weight, as transformers does), and
 * every token's row is computed alone, in a fixed order: the results do not depend on the batch. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define LANES 16

/* out[t] = w * bf16(x[t] / sqrt(mean(x[t]^2) + eps)), x rows `stride` elements apart; with `offset`
 * (Gemma's norms, whose weight is centred on zero) out[t] = bf16(x[t] / sqrt(...) * (1 + w)), scaled in
 * fp32 and rounded once, as transformers' Gemma norms compute it. */
void spec_rms_norm_bf16(const uint16_t *x, int64_t stride, const uint16_t *w, uint16_t *out, int64_t T, int D,
                        float eps, int offset, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T * D >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = x + t * stride;
        float lane[LANES] = {0};
        int d = 0;
        for (; d + LANES <= D; d += LANES)
            for (int l = 0; l < LANES; l++) {
                const float v = bf16_to_float(row[d + l]);
                lane[l] += v * v;
            }
        for (int l = 0; d < D; d++, l++) {
            const float v = bf16_to_float(row[d]);
            lane[l] += v * v;
        }
        for (int half = LANES / 2; half > 0; half /= 2)
            for (int l = 0; l < half; l++) lane[l] += lane[l + half];
        const float r = 1.0f / sqrtf(lane[0] / (float)D + eps);
        if (offset) {
            for (d = 0; d < D; d++)
                out[t * D + d] = float_to_bf16(bf16_to_float(row[d]) * r * (1.0f + bf16_to_float(w[d])));
            continue;
        }
        for (d = 0; d < D; d++) {
            const float normed = bf16_to_float(float_to_bf16(bf16_to_float(row[d]) * r));
            out[t * D + d] = float_to_bf16(bf16_to_float(w[d]) * normed);
        }
    }
}

/* x [T, heads, D] (rows `stride` elements apart, heads contiguous) rotated by the token's cos and
 * signed sin [T, D] (the sin's first half negated): out = x * cos + roll(x, D / 2) * sin. */
void spec_rope_bf16(const uint16_t *x, int64_t stride, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                    int64_t T, int heads, int D, int threads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (T * heads * D >= (1 << 16))
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            const uint16_t *in = x + t * stride + (int64_t)h * D;
            uint16_t *o = out + (t * heads + h) * D;
            for (int d = 0; d < D; d++) {
                const float rolled = bf16_to_float(in[d < half ? d + half : d - half]);
                o[d] = float_to_bf16(bf16_to_float(in[d]) * bf16_to_float(cos[t * D + d])
                                     + rolled * bf16_to_float(sin[t * D + d]));
            }
        }
}

/* gate_up [T, 2 I] -> out [T, I] = silu(gate) * up. */
void spec_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int I, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T * I >= (1 << 16))
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < I; i++) {
            const float g = bf16_to_float(gate_up[t * 2 * I + i]), u = bf16_to_float(gate_up[t * 2 * I + I + i]);
            /* sigmoid from exp(-|g|), which cannot overflow */
            const float e = exp_nonpositive(-fabsf(g)), sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
            out[t * I + i] = float_to_bf16(g * sigmoid * u);
        }
}
