/* Batched LoRA over per-token adapter slots (punica's shrink and expand, fused per token):
 *
 *   for each token t with slot s = slots[t] >= 0:
 *     h = A[s] x[t]            (shrink: [R, in] x [in] -> [R], float32)
 *     y[t] += scaling[s] * B[s] h   (expand: [out, R] x [R] -> [out])
 *
 * Tokens with slot -1 are left alone (the base model's rows). Sums are float32; a bf16 y is
 * read, added to and rounded once. Tokens run in parallel (OpenMP); each writes its own row.
 * Returns 0, or 1 when a slot is outside [-1, num_slots) (nothing is written for that token). */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"

#define LORA_MAX_RANK 4096

static inline float load_f32(const void *base, int64_t index, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

static int lora_add(void *y, const void *x, const void *a, const void *b, const int64_t *slots,
                    const float *scalings, int64_t num_tokens, int64_t in_features, int64_t out_features,
                    int64_t rank, int64_t num_slots, int bf16) {
    if (rank > LORA_MAX_RANK || rank < 1) return 2;
    int bad = 0;
#pragma omp parallel for schedule(static) if (num_tokens > 1) reduction(| : bad)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) { if (s != -1) bad |= 1; continue; }
        if (s >= num_slots) { bad |= 1; continue; }
        float h[LORA_MAX_RANK];
        const int64_t xo = t * in_features;
        for (int64_t r = 0; r < rank; r++) {
            const int64_t ao = (s * rank + r) * in_features;
            float acc = 0.f;
            if (bf16) {
                const uint16_t *xr = (const uint16_t *)x + xo, *ar = (const uint16_t *)a + ao;
                for (int64_t k = 0; k < in_features; k++) acc += bf16_to_float(xr[k]) * bf16_to_float(ar[k]);
            } else {
                const float *xr = (const float *)x + xo, *ar = (const float *)a + ao;
                for (int64_t k = 0; k < in_features; k++) acc += xr[k] * ar[k];
            }
            h[r] = acc;
        }
        const float scale = scalings[s];
        for (int64_t o = 0; o < out_features; o++) {
            const int64_t bo = (s * out_features + o) * rank;
            float acc = 0.f;
            if (bf16) {
                const uint16_t *br = (const uint16_t *)b + bo;
                for (int64_t r = 0; r < rank; r++) acc += h[r] * bf16_to_float(br[r]);
                uint16_t *yr = (uint16_t *)y + t * out_features;
                yr[o] = float_to_bf16(bf16_to_float(yr[o]) + acc * scale);
            } else {
                const float *br = (const float *)b + bo;
                for (int64_t r = 0; r < rank; r++) acc += h[r] * br[r];
                ((float *)y)[t * out_features + o] += acc * scale;
            }
        }
    }
    return bad ? 1 : 0;
}

int lora_add_f32(void *y, const void *x, const void *a, const void *b, const int64_t *slots, const float *scalings,
                 int64_t num_tokens, int64_t in_features, int64_t out_features, int64_t rank, int64_t num_slots,
                 int64_t reserved) {
    (void)reserved;
    return lora_add(y, x, a, b, slots, scalings, num_tokens, in_features, out_features, rank, num_slots, 0);
}

int lora_add_bf16(void *y, const void *x, const void *a, const void *b, const int64_t *slots, const float *scalings,
                  int64_t num_tokens, int64_t in_features, int64_t out_features, int64_t rank, int64_t num_slots,
                  int64_t reserved) {
    (void)reserved;
    return lora_add(y, x, a, b, slots, scalings, num_tokens, in_features, out_features, rank, num_slots, 1);
}
