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
#include <stdint.h>
#include <string.h>

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
