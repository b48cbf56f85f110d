/* Fused elementwise kernels for the bf16 CPU forward pass (loaded by lm_console/kernels/cpu_ops.py).
 *
 * Each kernel reads bf16, computes in float32 and rounds once to bf16 when it stores, where the
 * torch op sequence it replaces rounds after every op and makes a full pass over memory per op:
 *   silu_and_mul_bf16     out = silu(gate) * up                      ([T, 2I] -> [T, I])
 *   rms_norm_bf16         out = x / rms(x) * weight
 *   add_rms_norm_bf16     x <- bf16(x + residual); out = x / rms(x) * weight   (one pass over x)
 *   rms_norm_heads_bf16   per-head RMSNorm in place (Qwen3's q/k norm inside the qkv buffer)
 *   rotary_neox_bf16      rotate-halves rope in place on the first heads of each row
 * Rows are contiguous along the last axis; any row stride (in elements) is taken, so views of
 * a fused projection's output need no copy. Large inputs split rows over OpenMP threads
 * (torch's runtime, so torch.set_num_threads governs them); small ones (decode) stay on the
 * calling thread, where a parallel region would cost more than the work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(LMC_SCALAR)
#include <immintrin.h>
#define LMC_AVX512 1
#endif

/* Below this many elements a call runs on one thread. */
#define PAR_MIN_ELEMENTS 65536

typedef uint16_t bf16;


#ifdef LMC_AVX512
static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

/* v rounded to bf16 (nearest even), as 16 packed halves. */
static inline __m256i to_bf16x16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

static inline __m512 from_bf16x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16(const bf16 *p, __mmask16 m) {
    return from_bf16x16(_mm256_maskz_loadu_epi16(m, p));
}

static inline void store16(bf16 *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, to_bf16x16(v));
}

#endif

/* ---- silu(gate) * up ---------------------------------------------------------------------- */

static void silu_and_mul_row(const bf16 *gate, const bf16 *up, bf16 *out, int64_t d) {
    int64_t j = 0;
#ifdef LMC_AVX512
    for (; j < d; j += 16) {
        __mmask16 m = tail_mask(d - j);
        __m512 g = load16(gate + j, m), u = load16(up + j, m);
        store16(out + j, _mm512_mul_ps(silu_ps(g), u), m);
    }
#endif
    for (; j < d; j++) {
        out[j] = float_to_bf16(silu_f(bf16_to_float(gate[j])) * bf16_to_float(up[j]));
    }
}

/* x: [rows, 2d] (gate then up, row stride x_stride) -> out: [rows, d] (row stride out_stride). */
void silu_and_mul_bf16(const bf16 *x, int64_t x_stride, bf16 *out, int64_t out_stride,
                       int64_t rows, int64_t d) {
#pragma omp parallel for schedule(static) if (rows * d >= PAR_MIN_ELEMENTS && rows > 1)
    for (int64_t r = 0; r < rows; r++)
        silu_and_mul_row(x + r * x_stride, x + r * x_stride + d, out + r * out_stride, d);
}

/* ---- RMSNorm (optionally after a residual add) --------------------------------------------- */

/* Sum of squares of x[0:d] (float32 accumulators). */
static float sum_squares(const bf16 *x, int64_t d) {
    int64_t j = 0;
    float total = 0.0f;
#ifdef LMC_AVX512
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; j + 32 <= d; j += 32) {
        __m512 a = load16(x + j, 0xffff), b = load16(x + j + 16, 0xffff);
        acc0 = _mm512_fmadd_ps(a, a, acc0);
        acc1 = _mm512_fmadd_ps(b, b, acc1);
    }
    for (; j < d; j += 16) {
        __m512 a = load16(x + j, tail_mask(d - j));
        acc0 = _mm512_fmadd_ps(a, a, acc0);
    }
    total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
    for (; j < d; j++) {
        float v = bf16_to_float(x[j]);
        total += v * v;
    }
    return total;
}

/* out = x * scale * w, rounded once. */
static void scale_by_weight(const bf16 *x, const bf16 *w, bf16 *out, int64_t d, float scale) {
    int64_t j = 0;
#ifdef LMC_AVX512
    __m512 s = _mm512_set1_ps(scale);
    for (; j < d; j += 16) {
        __mmask16 m = tail_mask(d - j);
        store16(out + j, _mm512_mul_ps(_mm512_mul_ps(load16(x + j, m), s), load16(w + j, m)), m);
    }
#endif
    for (; j < d; j++) out[j] = float_to_bf16(bf16_to_float(x[j]) * scale * bf16_to_float(w[j]));
}

/* x <- bf16(x + residual), the sum the torch add would store; returns its sum of squares. */
static float add_in_place(bf16 *x, const bf16 *residual, int64_t d) {
    int64_t j = 0;
    float total = 0.0f;
#ifdef LMC_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; j < d; j += 16) {
        __mmask16 m = tail_mask(d - j);
        __m256i h = to_bf16x16(_mm512_add_ps(load16(x + j, m), load16(residual + j, m)));
        _mm256_mask_storeu_epi16(x + j, m, h);
        __m512 s = from_bf16x16(h); /* the rounded sum: the norm sees what is stored */
        acc = _mm512_fmadd_ps(s, s, acc);
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; j < d; j++) {
        x[j] = float_to_bf16(bf16_to_float(x[j]) + bf16_to_float(residual[j]));
        float s = bf16_to_float(x[j]);
        total += s * s;
    }
    return total;
}

/* out = x / sqrt(mean(x^2) + eps) * weight over rows of d. */
void rms_norm_bf16(const bf16 *x, int64_t x_stride, bf16 *out, int64_t out_stride,
                   const bf16 *weight, int64_t rows, int64_t d, float eps) {
#pragma omp parallel for schedule(static) if (rows * d >= PAR_MIN_ELEMENTS && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * x_stride;
        float scale = 1.0f / sqrtf(sum_squares(xr, d) / (float)d + eps);
        scale_by_weight(xr, weight, out + r * out_stride, d, scale);
    }
}

/* x <- bf16(x + residual); out = x / sqrt(mean(x^2) + eps) * weight (x now the new residual). */
void add_rms_norm_bf16(bf16 *x, int64_t x_stride, const bf16 *residual, int64_t res_stride,
                       bf16 *out, int64_t out_stride, const bf16 *weight, int64_t rows,
                       int64_t d, float eps) {
#pragma omp parallel for schedule(static) if (rows * d >= PAR_MIN_ELEMENTS && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        bf16 *xr = x + r * x_stride;
        float scale = 1.0f / sqrtf(add_in_place(xr, residual + r * res_stride, d) / (float)d + eps);
        scale_by_weight(xr, weight, out + r * out_stride, d, scale);
    }
}

/* In place, for each token t and head h < num_heads of x[t] (heads of head_dim):
 * x[t, h] <- x[t, h] / sqrt(mean(x[t, h]^2) + eps) * weight, weight [head_dim]. */
void rms_norm_heads_bf16(bf16 *x, int64_t x_stride, const bf16 *weight, int64_t tokens,
                         int64_t num_heads, int64_t head_dim, float eps) {
#pragma omp parallel for schedule(static) if (tokens * num_heads * head_dim >= PAR_MIN_ELEMENTS && tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < num_heads; h++) {
            bf16 *xh = x + t * x_stride + h * head_dim;
            float scale = 1.0f / sqrtf(sum_squares(xh, head_dim) / (float)head_dim + eps);
            scale_by_weight(xh, weight, xh, head_dim, scale); /* element j read before written */
        }
    }
}

/* ---- rotary embedding (neox: rotate halves) ----------------------------------------------- */

/* For each token t and head h < num_heads of x[t] (heads of head_dim, then anything else):
 * (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin), the halves x1 = [0, D/2), x2 = [D/2, D);
 * cos/sin: [tokens, D/2] float32 rows for the tokens' positions. In place. */
void rotary_neox_bf16(bf16 *x, int64_t x_stride, const float *cos_t, const float *sin_t,
                      int64_t tokens, int64_t num_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * num_heads * head_dim >= PAR_MIN_ELEMENTS && tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t h = 0; h < num_heads; h++) {
            bf16 *x1 = x + t * x_stride + h * head_dim, *x2 = x1 + half;
            int64_t i = 0;
#ifdef LMC_AVX512
            for (; i < half; i += 16) {
                __mmask16 m = tail_mask(half - i);
                __m512 a = load16(x1 + i, m), b = load16(x2 + i, m);
                __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
                store16(x1 + i, _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv)), m);
                store16(x2 + i, _mm512_fmadd_ps(b, cv, _mm512_mul_ps(a, sv)), m);
            }
#endif
            for (; i < half; i++) {
                float a = bf16_to_float(x1[i]), b = bf16_to_float(x2[i]);
                x1[i] = float_to_bf16(a * c[i] - b * s[i]);
                x2[i] = float_to_bf16(b * c[i] + a * s[i]);
            }
        }
    }
}
