/* A whole Llama decoder layer in one call, for decode steps in bf16 with w4a8 weights on the CPU
 * (kernels/cpu_decoder.py builds it, with the kernels it calls, into one library).
 *
 * The layer runs the same kernels, in the same order and on the same values, as the model's eager
 * forward does one call at a time (engine/models/llama.py): RMSNorm, the fused q/k/v projection, rotary
 * embedding, the K/V store, attention over the paged pool, o_proj, the residual add, RMSNorm, gate/up,
 * SiLU * up, down and the residual add. So its output is bit for bit the eager forward's. What it saves
 * is what surrounds each kernel there: ~20 torch ops and 6 ctypes calls a layer, each kernel its own
 * OpenMP fork and join: about half of a decode step on a small model (SmolLM2-135M).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* One decoder layer: its weights and its KV pools, set up once. */
struct spec_decoder_layer {
    const struct spec_w4a8_layer *qkv, *o, *gate_up, *down;
    const uint16_t *input_norm, *post_norm;     /* bf16 [hidden] */
    void *k_pool, *v_pool;                      /* bf16 [slots, Hkv, D] */
};

/* What every layer of one forward shares: the model's sizes and the step's tokens. Token t attends over
 * the slots kv_index[t, :kv_len[t]] in groups as spec_attend takes them, after its own K/V are stored at
 * out_slots[t]. */
struct spec_decoder_step {
    int64_t T, hidden, inter;
    int64_t H, Hkv, D;
    float eps, scale;
    const uint16_t *cos, *sin;                  /* [T, D], the sin's first half negated */
    const int64_t *out_slots;
    const int64_t *kv_index, *kv_len, *starts, *shared;
    int64_t max_kv, groups;
    int64_t threads;
};

/* Per calling thread: the layer's intermediate tensors, grown as needed and kept. */
static _Thread_local uint16_t *work;
static _Thread_local size_t work_elements;

/* out[i] = bf16(a[i] + b[i]), as torch adds bf16 tensors. */
static void add_bf16(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

/* h [T, hidden] -> out [T, hidden]. Returns 0, or the first failing kernel's code (-1: out of memory or an
 * unsupported shape; -2: K not a multiple of 32). */
int spec_decoder_layer(const struct spec_decoder_layer *L, const struct spec_decoder_step *S, const uint16_t *h,
                       uint16_t *out) {
    const int64_t T = S->T, E = S->hidden, I = S->inter, H = S->H, Hkv = S->Hkv, D = S->D;
    const int threads = (int)S->threads;
    const int64_t width = (H + 2 * Hkv) * D;    /* the q/k/v projection's row */
    const size_t need = (size_t)(T * (2 * E + width + (H + Hkv) * D + 2 * H * D + 3 * I));
    if (need > work_elements) {
        uint16_t *grown = realloc(work, need * sizeof(uint16_t));
        if (!grown) return -1;
        work = grown, work_elements = need;
    }
    uint16_t *normed = work, *qkv = normed + T * E, *rotated = qkv + T * width, *q = rotated + T * (H + Hkv) * D;
    uint16_t *attn = q + T * H * D, *proj = attn + T * H * D, *gate_up = proj + T * E, *act = gate_up + T * 2 * I;
    int rc;

    spec_rms_norm_bf16(h, E, L->input_norm, normed, T, (int)E, S->eps, 0, threads);
    if ((rc = spec_w4a8_linear(L->qkv, normed, 1, T, qkv, threads))) return rc;
    spec_rope_bf16(qkv, width, S->cos, S->sin, rotated, T, (int)(H + Hkv), (int)D, threads);
    const size_t row = (size_t)(Hkv * D) * sizeof(uint16_t);
    for (int64_t t = 0; t < T; t++) {
        memcpy(q + t * H * D, rotated + t * (H + Hkv) * D, (size_t)(H * D) * sizeof(uint16_t));
        memcpy((uint16_t *)L->k_pool + S->out_slots[t] * Hkv * D, rotated + t * (H + Hkv) * D + H * D, row);
        memcpy((uint16_t *)L->v_pool + S->out_slots[t] * Hkv * D, qkv + t * width + (H + Hkv) * D, row);
    }
    if ((rc = spec_attend(q, L->k_pool, L->v_pool, attn, 1, T, (int)H, (int)Hkv, (int)D, S->kv_index, S->kv_len,
                          S->max_kv, S->starts, S->shared, S->groups, S->scale, threads)))
        return rc;
    if ((rc = spec_w4a8_linear(L->o, attn, 1, T, proj, threads))) return rc;
    add_bf16(h, proj, out, T * E);              /* out holds the residual stream from here on */

    spec_rms_norm_bf16(out, E, L->post_norm, normed, T, (int)E, S->eps, 0, threads);
    if ((rc = spec_w4a8_linear(L->gate_up, normed, 1, T, gate_up, threads))) return rc;
    spec_silu_mul_bf16(gate_up, act, T, (int)I, threads);
    if ((rc = spec_w4a8_linear(L->down, act, 1, T, proj, threads))) return rc;
    add_bf16(out, proj, out, T * E);
    return 0;
}
