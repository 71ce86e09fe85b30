/* The entry points of this folder's C kernels, for the one that calls the others (cpu_decoder.c). */
#ifndef SPEC_KERNELS_H
#define SPEC_KERNELS_H
#include <stdint.h>

/* A w4a8 layer (cpu_w4a8.c describes the layout); `next`: the layer of the output's next columns, in
 * another format (a fused projection whose parts a GGUF stores differently), or NULL. */
struct spec_w4a8_layer {
    int64_t K, N, bits, bias_bf16, k_scales;
    const uint8_t *weight;
    const uint16_t *scale, *low;
    const void *bias;
    const struct spec_w4a8_layer *next;
};

int spec_w4a8_linear(const struct spec_w4a8_layer *L, const void *x, int bf16, int64_t M, void *out, int threads);
void spec_rms_norm_bf16(const uint16_t *x, int64_t stride, const uint16_t *w, uint16_t *out, int64_t T, int D,
                        float eps, int offset, int threads);
void spec_rope_bf16(const uint16_t *x, int64_t stride, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                    int64_t T, int heads, int D, int threads);
void spec_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int I, int threads);
int spec_attend(const void *q, const void *k_pool, const void *v_pool, void *out, int bf16, int64_t T, int H,
                int Hkv, int D, const int64_t *kv_index, const int64_t *kv_len, int64_t max_kv,
                const int64_t *starts, const int64_t *shared, int64_t groups, float scale, int threads);
int spec_attend_variants(const void *q, const void *k_pool, const void *v_pool, void *out, int bf16, int64_t T,
                         int H, int Hkv, int D, const int64_t *kv_index, const int64_t *kv_len, int64_t max_kv,
                         const int64_t *starts, const int64_t *shared, int64_t groups, float scale, int64_t window,
                         float softcap, const float *sinks, int threads);
#endif
