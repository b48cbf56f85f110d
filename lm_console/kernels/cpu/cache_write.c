/* reshape_and_cache for the CPU: each token's key/value row copied into its paged cache slot.
 *
 * torch's index_copy_ moved these rows at a few hundred MB/s (element-wise indexing, one
 * thread), about a tenth of a prefill step's attention time; a row is contiguous in both the
 * input and the cache, so a copy is one memcpy per token and row.
 *
 * Layout: key/value [num_tokens, row] with their own row strides (in elements; they are views
 * into the fused qkv output), k_cache/v_cache [num_slots, row] contiguous, slots [num_tokens]
 * int64; a slot below 0 (a padding token) is skipped, one at num_slots or above refuses the
 * whole call (returns -1, nothing written). Element type does not matter: only its size does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

/* Below this many bytes a step's copy is cheaper than waking the OpenMP team. */
#define PARALLEL_MIN_BYTES (256 * 1024)

int reshape_and_cache_rows(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                           char *k_cache, char *v_cache, int64_t num_slots, const int64_t *slots,
                           int64_t num_tokens, int64_t row, int64_t element_size) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return -1;
    const size_t row_bytes = (size_t)(row * element_size);
    const size_t key_step = (size_t)(key_stride * element_size), value_step = (size_t)(value_stride * element_size);
#pragma omp parallel for schedule(static) if ((size_t)num_tokens * row_bytes * 2 >= PARALLEL_MIN_BYTES)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + (size_t)slot * row_bytes, key + (size_t)t * key_step, row_bytes);
        memcpy(v_cache + (size_t)slot * row_bytes, value + (size_t)t * value_step, row_bytes);
    }
    return 0;
}

/* The int8 cache: each kv head's row of head_dim bf16 values is stored as head_dim int8 values
 * q = round(x * 127 / amax) (to nearest even) and the float32 scale amax * (1 / 127) (row bytes
 * head_dim + 4; amax = max |x| of the row, a zero row stores zeros), so x ~ q * scale.
 * key/value [num_tokens, row] bf16 (row = num_kv_heads * head_dim, own strides in elements),
 * k_cache/v_cache [num_slots, num_kv_heads, head_dim + 4] bytes. Slots as reshape_and_cache_rows. */
static void quantize_head_row(const uint16_t *x, int64_t head_dim, int8_t *dst) {
    float amax = 0.f;
    for (int64_t d = 0; d < head_dim; d++) {
        const float v = fabsf(bf16_to_float(x[d]));
        amax = v > amax ? v : amax;
    }
    /* inv in double, rounded once to float: the correctly rounded float32 quotient, as torch's
     * division gives it (amax has bf16's 8 significant bits, so 127 / amax is never within
     * double's error of a float32 rounding boundary), whatever -ffast-math makes of a float
     * division. The scale is a product (int8_cache.py computes the same one). */
    const float inv = amax > 0.f ? (float)(127.0 / (double)amax) : 0.f, scale = amax * (1.f / 127.f);
    int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; d + 16 <= head_dim; d += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + d)));
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        /* cvtps_epi32 rounds to nearest even (the default MXCSR mode), as rintf below */
        _mm_storeu_si128((__m128i *)(dst + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)))));
    }
#endif
    for (; d < head_dim; d++) dst[d] = (int8_t)rintf(bf16_to_float(x[d]) * inv);
    memcpy(dst + head_dim, &scale, sizeof scale);
}

int reshape_and_cache_int8_rows(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                                char *k_cache, char *v_cache, int64_t num_slots, const int64_t *slots,
                                int64_t num_tokens, int64_t row, int64_t head_dim) {
    if (head_dim <= 0 || row % head_dim != 0) return -2;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return -1;
    const int64_t heads = row / head_dim, head_bytes = head_dim + 4, row_bytes = heads * head_bytes;
#pragma omp parallel for schedule(static) if (num_tokens * row * 4 >= PARALLEL_MIN_BYTES)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const uint16_t *k = (const uint16_t *)key + t * key_stride, *v = (const uint16_t *)value + t * value_stride;
        for (int64_t h = 0; h < heads; h++) {
            quantize_head_row(k + h * head_dim, head_dim, (int8_t *)k_cache + slot * row_bytes + h * head_bytes);
            quantize_head_row(v + h * head_dim, head_dim, (int8_t *)v_cache + slot * row_bytes + h * head_bytes);
        }
    }
    return 0;
}
