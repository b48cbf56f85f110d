/* Quantized-weight GEMM for CPU inference: out[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * Weights stay quantized in one of three layouts of ours (repacked once at load by
 * engine/models/quant/), all padded along K to Kp, a multiple of 64 (zero blocks):
 *
 *   FMT_B8  (GGUF Q8_0, Q6_K, ...): u8 q[N, Kp]; per block of 32: fp16 d, fp16 m; w = d*q + m
 *   FMT_B4  (GGUF Q4_0, Q4_1, Q4_K): 32 bytes per pair of blocks (2j, 2j+1): byte i holds
 *           block 2j's element i in its low nibble and block 2j+1's element i in its high one;
 *           w = d*q + m per block as above (Q4_0: m = -8d)
 *   FMT_C8  (quantization="int8"): u8 q[N, Kp] = int8 + 128; one float32 scale per row (channel)
 *
 * Weights are stored unsigned so that AVX512-VNNI's u8 x s8 dot product (vpdpbusd) takes them
 * as they are; the activations are quantized to int8 per call (quantize_act): per block of 32
 * (scale dx, and xs = dx * sum(xq) for the offset term; per-token scales measured +2.9%
 * perplexity on SmolLM2 against +0.9% per block, so every format uses blocks).
 *
 * The GEMM walks output rows in parallel; each row's weights are read once for the whole batch
 * (the tokens are the inner loop, four at a time), so a decode step streams the weights once.
 * Without AVX512-VNNI a portable C path computes the same sums (in the same int32 arithmetic).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(LMC_SCALAR)
#define QG_VNNI 1
#include <immintrin.h>
#else
#define QG_VNNI 0
#endif

enum { FMT_B8 = 0, FMT_B4 = 1, FMT_C8 = 2 };
#define QBLOCK 32

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

int quant_gemm_has_vnni(void) { return QG_VNNI; }

/* dst[i] = float(src[i]) for n fp16 values (vectorized where AVX512F is there). */
static inline void halfs_to_floats(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if QG_VNNI
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = half_to_float(src[i]);
}

static inline float load_x(const void *x, int is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* Quantize rows x[M, K] (bf16 or float32, row stride ldx) to xq[M, Kp] int8 (zero padded).
 * per_token = 0: per block of 32, xd[M, Kp/32] scales and xs[M, Kp/32] = xd * sum(xq);
 * per_token = 1: xd[M] one scale per row and xs[M] = sum(xq) (an integer, as float). */
void quantize_act(const void *x, int64_t ldx, int is_bf16, int64_t M, int64_t K, int64_t Kp,
                  int per_token, int8_t *xq, float *xd, float *xs) {
    const int64_t nb = Kp / QBLOCK;
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        const void *row = (const char *)x + m * ldx * (is_bf16 ? 2 : 4);
        int8_t *q = xq + m * Kp;
        if (per_token) {
            float amax = 0.f;
            for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(load_x(row, is_bf16, k)));
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            int32_t sum = 0;
            for (int64_t k = 0; k < K; k++) {
                const int32_t v = (int32_t)lrintf(load_x(row, is_bf16, k) * inv);
                q[k] = (int8_t)v;
                sum += v;
            }
            memset(q + K, 0, (size_t)(Kp - K));
            xd[m] = d;
            xs[m] = (float)sum;
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * QBLOCK, k1 = k0 + QBLOCK < K ? k0 + QBLOCK : K;
            float amax = 0.f;
            for (int64_t k = k0; k < k1; k++) amax = fmaxf(amax, fabsf(load_x(row, is_bf16, k)));
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            int32_t sum = 0;
            for (int64_t k = k0; k < k0 + QBLOCK; k++) {
                const int32_t v = k < k1 ? (int32_t)lrintf(load_x(row, is_bf16, k) * inv) : 0;
                q[k] = (int8_t)v;
                sum += v;
            }
            xd[m * nb + b] = d;
            xs[m * nb + b] = d * (float)sum;
        }
    }
}

/* Unsigned weight element k of row `wrow` (the packed bytes of one row). */
static inline int32_t weight_q(const uint8_t *wrow, int fmt, int64_t k) {
    if (fmt != FMT_B4) return wrow[k];
    const int64_t pair = k / 64, within = k % 64;
    const uint8_t byte = wrow[pair * 32 + (within % 32)];
    return within < 32 ? (byte & 0xf) : (byte >> 4);
}

static inline void store_out(void *out, int out_bf16, int64_t i, float v) {
    if (out_bf16) ((uint16_t *)out)[i] = float_to_bf16(v);
    else ((float *)out)[i] = v;
}

/* Block b's scale and offset of row n as floats (w = d * q + m); FMT_C8 as d = s, m = -128 s. */
static inline void row_block_scales(int fmt, const void *wd_, const void *wm_, int64_t n, int64_t nb,
                                    float *d, float *m) {
    if (fmt == FMT_C8) {
        const float s = ((const float *)wd_)[n];
        for (int64_t b = 0; b < nb; b++) { d[b] = s; m[b] = -128.f * s; }
        return;
    }
    halfs_to_floats((const uint16_t *)wd_ + n * nb, d, nb);
    halfs_to_floats((const uint16_t *)wm_ + n * nb, m, nb);
}

#if QG_VNNI
/* ---- AVX512-VNNI: 16 output rows a tile, the tile's weights transposed into a panel ----
 *
 * vpdpbusd multiplies 4 adjacent bytes of each 32-bit lane. The panel puts 16 ROWS in the 16
 * lanes (lane r of vector (b, c) holds row r's elements 4c..4c+3 of block b), so one activation
 * dword, broadcast from memory, feeds 16 rows at once, and the 8 vectors of a block accumulate in
 * int32 before one conversion and one float fma with (row scales x the token's block scale):
 * 8 dot products per 4 float operations, where a row-major layout needs a float scale per
 * dot product. The panel is built once per tile and call (a 16x16 dword transpose per 64
 * elements, the 4-bit nibbles unpacked), and stays in L1/L2 while every token uses it. */
#define NR 16
#define TT 8 /* tokens a register tile */

/* rows[0..15] (16 dwords each) -> cols[j] = dword j of every row. */
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* b[4k + j], 128-bit lane L: column 4L + j of rows 4k..4k+3 */
        const __m512i s0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
        const __m512i s2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
}

/* The panel of rows [n0, n0 + nr) (nr <= 16; missing rows are zero): pw[nb][8] vectors,
 * pd / pm [nb][16] floats. */
static void build_panel(int fmt, const uint8_t *w, int64_t row_bytes, const void *wd_, const void *wm_,
                        int64_t n0, int nr, int64_t Kp, __m512i *pw, float *pd, float *pm, float *tmp) {
    const int64_t nb = Kp / QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t p = 0; p < Kp / 64; p++) {
        __m512i r[NR];
        if (fmt == FMT_B4) { /* 32 bytes a row: dwords 0..7 hold blocks 2p (low) | 2p+1 (high) */
            for (int i = 0; i < NR; i++)
                r[i] = i < nr ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                    (const __m256i *)(w + (n0 + i) * row_bytes + p * 32)))
                              : _mm512_setzero_si512();
            transpose16(r);
            for (int c = 0; c < 8; c++) {
                pw[(2 * p) * 8 + c] = _mm512_and_si512(r[c], low);
                pw[(2 * p + 1) * 8 + c] = _mm512_and_si512(_mm512_srli_epi32(r[c], 4), low);
            }
        } else {
            for (int i = 0; i < NR; i++)
                r[i] = i < nr ? _mm512_loadu_si512((const void *)(w + (n0 + i) * row_bytes + p * 64))
                              : _mm512_setzero_si512();
            transpose16(r);
            for (int c = 0; c < 16; c++) pw[2 * p * 8 + c] = r[c];
        }
    }
    for (int i = 0; i < NR; i++) {
        if (i < nr) {
            row_block_scales(fmt, wd_, wm_, n0 + i, nb, tmp, tmp + nb);
        } else {
            for (int64_t b = 0; b < 2 * nb; b++) tmp[b] = 0.f;
        }
        for (int64_t b = 0; b < nb; b++) {
            pd[b * NR + i] = tmp[b];
            pm[b * NR + i] = tmp[nb + b];
        }
    }
}

/* 16 rows (a panel) x T tokens (T <= TT, a compile-time constant where inlined) -> acc[T]. */
static inline __attribute__((always_inline)) void panel_tokens(
    const int T, int64_t nb, int64_t Kp, const __m512i *pw, const float *pd, const float *pm,
    const int8_t *xq, const float *xd, const float *xs, __m512 acc[TT]) {
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512i *wb = pw + b * 8;
        const __m512 d = _mm512_loadu_ps(pd + b * NR), m = _mm512_loadu_ps(pm + b * NR);
        for (int t = 0; t < T; t++) {
            const int32_t *xp = (const int32_t *)(xq + t * Kp + b * QBLOCK);
            __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb[0], _mm512_set1_epi32(xp[0]));
            __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb[1], _mm512_set1_epi32(xp[1]));
            i0 = _mm512_dpbusd_epi32(i0, wb[2], _mm512_set1_epi32(xp[2]));
            i1 = _mm512_dpbusd_epi32(i1, wb[3], _mm512_set1_epi32(xp[3]));
            i0 = _mm512_dpbusd_epi32(i0, wb[4], _mm512_set1_epi32(xp[4]));
            i1 = _mm512_dpbusd_epi32(i1, wb[5], _mm512_set1_epi32(xp[5]));
            i0 = _mm512_dpbusd_epi32(i0, wb[6], _mm512_set1_epi32(xp[6]));
            i1 = _mm512_dpbusd_epi32(i1, wb[7], _mm512_set1_epi32(xp[7]));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
            acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(xd[t * nb + b])), acc[t]);
            acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}

/* 16 float32 results (+ bias) to out row `o` columns [n0, n0 + nr), as bf16 or float32. */
static inline void store_panel_row(void *out, int out_bf16, int64_t o, int64_t n0, int nr, __m512 v,
                                   const float *bias) {
    const __mmask16 mask = (__mmask16)((1u << nr) - 1u);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0));
    if (!out_bf16) {
        _mm512_mask_storeu_ps((float *)out + o + n0, mask, v);
        return;
    }
    /* round to nearest even as float_to_bf16; a NaN keeps its top bits, made quiet */
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16((uint16_t *)out + o + n0, mask, _mm512_cvtepi32_epi16(r));
}

/* Rows [n0, n0 + nr) against every token: build the panel, then tokens TT at a time. */
static void panel_gemm(int fmt, int64_t M, int64_t n0, int nr, int64_t Kp, const uint8_t *w,
                       int64_t row_bytes, const void *wd_, const void *wm_, const float *bias,
                       const int8_t *xq, const float *xd, const float *xs, void *out, int64_t ldo,
                       int out_bf16, __m512i *pw, float *pd, float *pm, float *tmp) {
    const int64_t nb = Kp / QBLOCK;
    build_panel(fmt, w, row_bytes, wd_, wm_, n0, nr, Kp, pw, pd, pm, tmp);
    __m512 acc[TT];
    for (int64_t t0 = 0; t0 < M; t0 += TT) {
        const int nt = M - t0 < TT ? (int)(M - t0) : TT;
        const int8_t *x = xq + t0 * Kp;
        const float *d = xd + t0 * nb, *s = xs + t0 * nb;
        switch (nt) { /* constant T: the token loop unrolls, acc[] stays in registers */
        case 8: panel_tokens(8, nb, Kp, pw, pd, pm, x, d, s, acc); break;
        case 7: panel_tokens(7, nb, Kp, pw, pd, pm, x, d, s, acc); break;
        case 6: panel_tokens(6, nb, Kp, pw, pd, pm, x, d, s, acc); break;
        case 5: panel_tokens(5, nb, Kp, pw, pd, pm, x, d, s, acc); break;
        case 4: panel_tokens(4, nb, Kp, pw, pd, pm, x, d, s, acc); break;
        case 3: panel_tokens(3, nb, Kp, pw, pd, pm, x, d, s, acc); break;
        case 2: panel_tokens(2, nb, Kp, pw, pd, pm, x, d, s, acc); break;
        default: panel_tokens(1, nb, Kp, pw, pd, pm, x, d, s, acc); break;
        }
        for (int t = 0; t < nt; t++) store_panel_row(out, out_bf16, (t0 + t) * ldo, n0, nr, acc[t], bias);
    }
}
#else
/* Portable: one output row n against every token, in the same int32 block sums. */
static void row_gemm(int fmt, int64_t M, int64_t n, int64_t Kp, const uint8_t *wrow, const float *d,
                     const float *m, const float *bias, const int8_t *xq, const float *xd,
                     const float *xs, void *out, int64_t ldo, int out_bf16) {
    const int64_t nb = Kp / QBLOCK;
    for (int64_t t = 0; t < M; t++) {
        float total = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot = 0;
            for (int64_t k = b * QBLOCK; k < (b + 1) * QBLOCK; k++)
                dot += weight_q(wrow, fmt, k) * (int32_t)xq[t * Kp + k];
            total += (float)dot * (d[b] * xd[t * nb + b]) + m[b] * xs[t * nb + b];
        }
        store_out(out, out_bf16, t * ldo + n, total + (bias ? bias[n] : 0.f));
    }
}
#endif

/* out[m, n] (row stride ldo, bf16 or float32) = sum_k x[m, k] w[n, k] + bias[n] (float32 or NULL),
 * x given quantized by quantize_act (per block). wd/wm: fp16 [N, Kp/32] for the
 * block formats; wd: float32 [N] for FMT_C8 (wm unused). Output rows are split between the
 * threads (16 a tile with VNNI, one at a time in the portable path); every token uses each
 * row's weights while they are in cache, so the weights are read once per call. */
void quant_gemm(int fmt, int64_t M, int64_t N, int64_t Kp, const uint8_t *w, const void *wd_,
                const void *wm_, const float *bias, const int8_t *xq, const float *xd,
                const float *xs, void *out, int64_t ldo, int out_bf16) {
    const int64_t nb = Kp / QBLOCK;
    const int64_t row_bytes = fmt == FMT_B4 ? Kp / 2 : Kp;
#if QG_VNNI
    const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel if (tiles > 1)
    {
        __m512i *pw = (__m512i *)aligned_alloc(64, (size_t)(nb > 0 ? nb : 1) * 8 * 64);
        float *pd = (float *)aligned_alloc(64, (size_t)(nb > 0 ? nb : 1) * NR * 4 * 4);
        float *pm = pd + nb * NR, *tmp = pm + nb * NR;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * NR;
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            panel_gemm(fmt, M, n0, nr, Kp, w, row_bytes, wd_, wm_, bias, xq, xd, xs, out, ldo,
                       out_bf16, pw, pd, pm, tmp);
        }
        free(pw);
        free(pd);
    }
#else
#pragma omp parallel
    {
        float d[nb > 0 ? nb : 1], m[nb > 0 ? nb : 1];
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            row_block_scales(fmt, wd_, wm_, n, nb, d, m);
            row_gemm(fmt, M, n, Kp, w + n * row_bytes, d, m, bias, xq, xd, xs, out, ldo, out_bf16);
        }
    }
#endif
}

#if QG_VNNI
/* Unsigned weights of pair p (64 elements, blocks 2p | 2p+1) of one row as 64 bytes. */
static inline __m512i load_pair(const uint8_t *wrow, int fmt, int64_t p) {
    if (fmt != FMT_B4) return _mm512_loadu_si512((const void *)(wrow + p * 64));
    /* the 32 bytes in both halves; the upper half shifted by 4: low nibbles | high nibbles */
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wrow + p * 32)));
    const __m512i shifted = _mm512_srlv_epi64(both, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0f));
}
#endif

/* The weights as a dense matrix out[N, K] (bf16 or float32): rows [n0, n1) only. */
void quant_dequantize(int fmt, int64_t n0, int64_t n1, int64_t K, int64_t Kp, const uint8_t *w,
                      const void *wd_, const void *wm_, void *out, int out_bf16) {
    const int64_t nb = Kp / QBLOCK;
    const int64_t row_bytes = fmt == FMT_B4 ? Kp / 2 : Kp;
#pragma omp parallel
    {
        float d[nb > 0 ? nb : 1], m[nb > 0 ? nb : 1], row[Kp > 0 ? Kp : 1];
#pragma omp for schedule(static)
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wrow = w + n * row_bytes;
            if (fmt == FMT_C8) {
                const float s = ((const float *)wd_)[n];
                for (int64_t b = 0; b < nb; b++) { d[b] = s; m[b] = -128.f * s; }
            } else {
                halfs_to_floats((const uint16_t *)wd_ + n * nb, d, nb);
                halfs_to_floats((const uint16_t *)wm_ + n * nb, m, nb);
            }
            if (fmt == FMT_C8) { /* exact: d * (q - 128) */
                for (int64_t k = 0; k < K; k++) store_out(out, out_bf16, (n - n0) * K + k, d[0] * (float)((int32_t)wrow[k] - 128));
                continue;
            }
#if QG_VNNI
            for (int64_t p = 0; p < Kp / 64; p++) {
                const __m512i q = load_pair(wrow, fmt, p);
                for (int j = 0; j < 4; j++) {
                    const __m128i bytes = _mm512_extracti32x4_epi32(q, 0);
                    const __m128i part = j == 0 ? bytes : j == 1 ? _mm512_extracti32x4_epi32(q, 1)
                                       : j == 2 ? _mm512_extracti32x4_epi32(q, 2)
                                                : _mm512_extracti32x4_epi32(q, 3);
                    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part));
                    const int64_t b = 2 * p + j / 2;
                    _mm512_storeu_ps(row + p * 64 + j * 16,
                                     _mm512_fmadd_ps(v, _mm512_set1_ps(d[b]), _mm512_set1_ps(m[b])));
                }
            }
#else
            for (int64_t k = 0; k < Kp; k++) row[k] = d[k / QBLOCK] * (float)weight_q(wrow, fmt, k) + m[k / QBLOCK];
#endif
            for (int64_t k = 0; k < K; k++) store_out(out, out_bf16, (n - n0) * K + k, row[k]);
        }
    }
}
