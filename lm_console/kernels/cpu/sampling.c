/* Sampling for the CPU: the exponential race over a row of logits in one pass (random rows),
 * and the argmax (greedy rows).
 *
 * token = argmax_v exp(l_v - max) / E_v with E_v ~ Exp(1) independent per token: the same law
 * as sampling from softmax(l). torch draws the V uniforms of a row from a Mersenne Twister one
 * at a time, which on a 49k vocabulary cost more than the rest of sampling together; here each
 * uniform is a counter-based hash of (the row's 64-bit key, v), so a row's noise is computed
 * 16 lanes at a time and depends on nothing but its key. Keys are drawn per step by the caller
 * from the row's torch generator, so a seeded request still reproduces whatever the batch.
 *
 * Layout: logits [num_rows, vocab] float32 with a row stride (temperature, top-k/top-p/min-p
 * already applied: removed tokens are -inf); keys [num_rows] uint64; out [num_rows] int64.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

/* Built with -ffast-math, which lets the compiler assume no infinities: test the bits. */
static inline int is_neg_inf(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits == 0xff800000u;
}

/* A 32-bit bijective mixer (good avalanche: each input bit flips each output bit ~1/2). */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352du;
    x ^= x >> 15; x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* u in (0, 1) from 24 bits: never 0 (E finite) nor 1 (E > 0). */
static inline float uniform_of(uint32_t key_lo, uint32_t key_hi, uint32_t v) {
    const uint32_t bits = mix32(mix32(v + key_lo) ^ key_hi);
    return ((float)(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

/* The race over tokens [first, vocab) of a row whose max is `max`: *best / *best_score move to
 * a token that beats them (strictly, so the lower index keeps a tie). */
static void race_range(const float *row, int64_t first, int64_t vocab, float max, uint64_t key,
                       int64_t *best, float *best_score) {
    const uint32_t lo = (uint32_t)key, hi = (uint32_t)(key >> 32);
    for (int64_t v = first; v < vocab; v++) {
        if (is_neg_inf(row[v])) continue; /* removed by a filter: never sampled */
        const float score = expf(row[v] - max) / -logf(uniform_of(lo, hi, (uint32_t)v));
        if (score > *best_score) { *best_score = score; *best = v; }
    }
}

static int64_t race_scalar(const float *row, int64_t vocab, uint64_t key) {
    float max = -INFINITY;
    for (int64_t v = 0; v < vocab; v++) max = row[v] > max ? row[v] : max;
    int64_t best = 0;
    float best_score = -1.f;
    race_range(row, 0, vocab, max, key, &best, &best_score);
    return best;
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512i mix32_v(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* -log(u) for u in (0, 1): u = m * 2^e with m in [0.75, 1.5), log(m) = 2 atanh(s),
 * s = (m - 1) / (m + 1), |s| < 0.2, odd series to s^9 (relative error < 1e-7). */
static inline __m512 neg_log_v(__m512 u) {
    __m512 m = _mm512_getmant_ps(u, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_zero);
    const __m512 e = _mm512_getexp_ps(_mm512_mul_ps(u, _mm512_set1_ps(4.f / 3.f)));
    const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, _mm512_set1_ps(1.f)), _mm512_add_ps(m, _mm512_set1_ps(1.f)));
    const __m512 s2 = _mm512_mul_ps(s, s);
    __m512 p = _mm512_set1_ps(2.f / 9.f);
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f / 7.f));
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f / 5.f));
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f / 3.f));
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f));
    const __m512 log_m = _mm512_mul_ps(p, s);
    return _mm512_sub_ps(_mm512_setzero_ps(),
                         _mm512_fmadd_ps(e, _mm512_set1_ps(0.693147180559945309f), log_m));
}

static int64_t race_avx512(const float *row, int64_t vocab, uint64_t key) {
    const int64_t full = vocab & ~(int64_t)15;
    __m512 max_v = _mm512_set1_ps(-INFINITY);
    for (int64_t v = 0; v < full; v += 16) max_v = _mm512_max_ps(max_v, _mm512_loadu_ps(row + v));
    float max = _mm512_reduce_max_ps(max_v);
    for (int64_t v = full; v < vocab; v++) max = row[v] > max ? row[v] : max;

    const __m512i key_lo = _mm512_set1_epi32((int)(uint32_t)key);
    const __m512i key_hi = _mm512_set1_epi32((int)(uint32_t)(key >> 32));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 max_b = _mm512_set1_ps(max), neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 best_score = _mm512_set1_ps(-1.f);
    __m512i best_index = _mm512_setzero_si512();
    for (int64_t v = 0; v < full; v += 16) {
        const __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int)v), lane);
        const __m512i bits = mix32_v(_mm512_xor_si512(mix32_v(_mm512_add_epi32(index, key_lo)), key_hi));
        const __m512 u = _mm512_mul_ps(
            _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)), _mm512_set1_ps(0.5f)),
            _mm512_set1_ps(1.0f / 16777216.0f));
        const __m512 logit = _mm512_loadu_ps(row + v);
        const __mmask16 live = _mm512_cmp_ps_mask(logit, neg_inf, _CMP_NEQ_OQ);
        const __m512 score = _mm512_div_ps(exp_nonpositive_ps(_mm512_sub_ps(logit, max_b)), neg_log_v(u));
        /* strictly greater: on a tie the lower index (seen first in its lane) stays */
        const __mmask16 better = _mm512_mask_cmp_ps_mask(live, score, best_score, _CMP_GT_OQ);
        best_score = _mm512_mask_mov_ps(best_score, better, score);
        best_index = _mm512_mask_mov_epi32(best_index, better, index);
    }
    float scores[16];
    int32_t indices[16];
    _mm512_storeu_ps(scores, best_score);
    _mm512_storeu_si512(indices, best_index);
    int64_t best = indices[0];
    float top = scores[0];
    for (int i = 1; i < 16; i++)
        if (scores[i] > top || (scores[i] == top && indices[i] < best)) { top = scores[i]; best = indices[i]; }
    race_range(row, full, vocab, max, key, &best, &top);
    return best;
}
#define RACE race_avx512
#else
#define RACE race_scalar
#endif

/* One sampled token per row; rows are independent tasks. */
void exponential_race_f32(const float *logits, int64_t row_stride, int64_t num_rows, int64_t vocab,
                          const uint64_t *keys, int64_t *out) {
    _Pragma("omp parallel for schedule(static)")
    for (int64_t r = 0; r < num_rows; r++) out[r] = RACE(logits + r * row_stride, vocab, keys[r]);
}

/* The scalar reference of the same race (tests check the vector path against it). */
void exponential_race_f32_scalar(const float *logits, int64_t row_stride, int64_t num_rows,
                                 int64_t vocab, const uint64_t *keys, int64_t *out) {
    for (int64_t r = 0; r < num_rows; r++) out[r] = race_scalar(logits + r * row_stride, vocab, keys[r]);
}

/* ---- greedy: each row's argmax, as torch.argmax answers it ---------------------------------
 * The first maximum on ties; a row holding a NaN answers its first NaN (torch ranks NaN above
 * everything). -ffast-math assumes no NaN, so NaNs are found through their bits. */
static inline int is_nan_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

static int64_t argmax_scalar(const float *row, int64_t vocab) {
    int64_t best = 0;
    for (int64_t v = 0; v < vocab; v++) {
        if (is_nan_bits(row[v])) return v;
        if (row[v] > row[best]) best = v;
    }
    return best;
}

#if defined(__AVX512F__)
/* Two passes (the row stays in L2 between them): the maximum, then its first index. */
static int64_t argmax_avx512(const float *row, int64_t vocab) {
    const int64_t full = vocab & ~(int64_t)15;
    __m512 max_v = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t v = 0; v < full; v += 16) {
        const __m512 x = _mm512_loadu_ps(row + v);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        max_v = _mm512_max_ps(max_v, x);
    }
    if (nan) return argmax_scalar(row, vocab);
    float max = _mm512_reduce_max_ps(max_v);
    for (int64_t v = full; v < vocab; v++) {
        if (is_nan_bits(row[v])) return argmax_scalar(row, vocab);
        if (row[v] > max) max = row[v];
    }
    const __m512 max_b = _mm512_set1_ps(max);
    for (int64_t v = 0; v < full; v += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + v), max_b, _CMP_EQ_OQ);
        if (hit) return v + __builtin_ctz((unsigned)hit);
    }
    for (int64_t v = full; v < vocab; v++)
        if (row[v] == max) return v;
    return 0; /* not reached: the maximum is one of the values */
}
#define ARGMAX argmax_avx512
#else
#define ARGMAX argmax_scalar
#endif

/* Rows split over the threads when there are enough (a single row stays on this thread). */
void argmax_f32(const float *logits, int64_t row_stride, int64_t num_rows, int64_t vocab, int64_t *out) {
    _Pragma("omp parallel for schedule(static) if (num_rows > 1)")
    for (int64_t r = 0; r < num_rows; r++) out[r] = ARGMAX(logits + r * row_stride, vocab);
}

void argmax_f32_scalar(const float *logits, int64_t row_stride, int64_t num_rows, int64_t vocab,
                       int64_t *out) {
    for (int64_t r = 0; r < num_rows; r++) out[r] = argmax_scalar(logits + r * row_stride, vocab);
}
