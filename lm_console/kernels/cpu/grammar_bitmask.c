/* Structured outputs on the CPU: keep only the tokens a grammar's bitmask allows.
 *
 * Bit t of a bitmask row (word t / 32, bit t % 32, little-endian int32 words) set: token t is
 * allowed; cleared: its logit becomes -inf. Rows of all-ones words (free text inside a JSON
 * string) cost one compare per 32 tokens, all-zero words one 32-float store. Tokens past the
 * bitmask's width (a padded embedding) are never allowed.
 *
 * Layout: logits [*, vocab] float32 with a row stride; rows [num_rows] int64 (the logits row of
 * each bitmask row); bitmask [num_rows, num_words] int32.
 */
#include <stdint.h>
#include <string.h>

/* Built with -ffast-math, which lets the compiler assume no infinities: store -inf by its bits. */
static inline void set_neg_inf(float *dst, int64_t n) {
    const uint32_t bits = 0xFF800000u;
    for (int64_t i = 0; i < n; i++) memcpy(dst + i, &bits, sizeof bits);
}

void apply_token_bitmask_f32(float *logits, int64_t row_stride, const int64_t *rows, int64_t num_rows,
                             int64_t vocab_size, const int32_t *bitmask, int64_t num_words) {
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * row_stride;
        const int32_t *mask = bitmask + i * num_words;
        for (int64_t w = 0; w < num_words && w * 32 < vocab_size; w++) {
            const uint32_t word = (uint32_t)mask[w];
            if (word == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t n = vocab_size - base < 32 ? vocab_size - base : 32;
            if (word == 0) {
                set_neg_inf(row + base, n);
                continue;
            }
            for (int64_t b = 0; b < n; b++)
                if (!((word >> b) & 1u)) set_neg_inf(row + base + b, 1);
        }
        if (num_words * 32 < vocab_size) set_neg_inf(row + num_words * 32, vocab_size - num_words * 32);
    }
}
