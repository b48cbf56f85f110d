/* Helpers shared by the CPU kernels in this directory. lm_console/kernels/cpu_build.py hashes the headers
 * here with the sources, so editing one rebuilds every library that includes it. */
#ifndef LMC_CPU_COMMON_H
#define LMC_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* What an activation pointer holds (quantize_act, quant_linear_act): float32 or bf16 rows
 * [M, K], or bf16 rows [M, 2K] of gate | up whose silu(gate) * up is the activation (SwiGLU's,
 * computed in float32 as it is quantized, never stored). */
#define ACT_F32 0
#define ACT_BF16 1
#define ACT_SWIGLU_BF16 2

/* bf16 is the top half of a float32: widening is exact. */
static inline float bf16_to_float(uint16_t value) {
    const uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, sizeof result);
    return result;
}

/* float32 -> bf16, rounding to nearest even as torch does; a NaN stays a (quiet) NaN. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* silu(g) = g * sigmoid(g), the sigmoid from e = exp(-|g|): nothing overflows (the kernels are
 * built with -ffast-math, which assumes no infinities, so exp(-g) must stay finite). */
static inline float silu_f(float g) {
    const float e = expf(-fabsf(g));
    return g * (g >= 0.f ? 1.f : e) / (1.f + e);
}

/* Whether the block-table row of a sequence of seq_len tokens names, in every entry the
 * attention kernels read (0 .. (seq_len - 1) / block_size), a block of the cache: the row has
 * that many entries (blocks_per_row) and each lies in [0, num_blocks). The kernels index the
 * cache with these entries, so a bad table is refused here rather than read out of bounds. */
static inline int block_row_in_cache(const int32_t *row, int64_t blocks_per_row, int64_t seq_len,
                                     int64_t block_size, int64_t num_blocks) {
    if (seq_len <= 0) return 1;
    const int64_t last = (seq_len - 1) / block_size;
    if (last >= blocks_per_row) return 0;
    for (int64_t b = 0; b <= last; b++)
        if (row[b] < 0 || row[b] >= num_blocks) return 0;
    return 1;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* exp(x) for x <= 0 as 2^n * 2^f, |f| <= 1/2, with a degree-7 Taylor polynomial of 2^f
 * (relative error < 1e-8 before rounding); underflows to ~0 below -87. */
static inline __m512 exp_nonpositive_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* silu(g) = g * sigmoid(g), the sigmoid from e = exp(-|g|) so that nothing overflows on either
 * side: 1 / (1 + e) for g >= 0, e / (1 + e) below (reciprocal estimate + one Newton step). */
static inline __m512 silu_ps(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = exp_nonpositive_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 den = _mm512_add_ps(one, e);
    __m512 inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(_mm512_mul_ps(g, _mm512_mask_blend_ps(negative, one, e)), inv);
}

/* In-register transpose of a 16x16 matrix of 32-bit elements: afterwards r[j] holds element j
 * of every input row (rows become columns). The quantized GEMM's dense path transposes weight
 * chunks with it, the prefill kernel its query and output tiles. */
static inline __attribute__((always_inline)) void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + e]: rows i..i+3, element e of each 128-bit lane */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88);
        const __m512i w0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xdd);
        const __m512i v1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xdd);
        r[e] = _mm512_shuffle_i32x4(v0, v1, 0x88);
        r[8 + e] = _mm512_shuffle_i32x4(v0, v1, 0xdd);
        r[4 + e] = _mm512_shuffle_i32x4(w0, w1, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(w0, w1, 0xdd);
    }
}
#endif

#endif
