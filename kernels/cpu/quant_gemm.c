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
#define TOK_TILE 4

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

#if QG_VNNI
/* Unsigned weights of pair p (64 elements, blocks 2p | 2p+1) as 64 bytes. */
static inline __m512i load_pair(const uint8_t *wrow, int fmt, int64_t p) {
    if (fmt != FMT_B4) return _mm512_loadu_si512((const void *)(wrow + p * 64));
    /* the 32 bytes in both halves; the upper half shifted by 4: low nibbles | high nibbles */
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wrow + p * 32)));
    const __m512i shifted = _mm512_srlv_epi64(both, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0f));
}

/* [a x8, b x8] from two adjacent floats (a block pair's scales). */
static inline __m512 pair_scales(const float *ab) {
    return _mm512_mask_broadcastss_ps(_mm512_set1_ps(ab[0]), 0xFF00, _mm_load_ss(ab + 1));
}

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

/* One output row n against tokens [t0, t0 + nt) of the block formats. */
static void row_block_format(int fmt, int64_t n, int64_t t0, int nt, int64_t Kp,
                             const uint8_t *wrow, const float *wd, const float *wm,
                             const int8_t *xq, const float *xd, const float *xs,
                             float *result) {
    const int64_t nb = Kp / QBLOCK;
    (void)n;
#if QG_VNNI
    const int64_t np = nb / 2;
    __m512 acc[TOK_TILE];
    for (int t = 0; t < TOK_TILE; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const __m512i w = load_pair(wrow, fmt, p);
        const __m512 ws = _mm512_insertf32x8(_mm512_set1_ps(wd[2 * p]),
                                             _mm256_set1_ps(wd[2 * p + 1]), 1);
        for (int t = 0; t < nt; t++) {
            const int64_t m = t0 + t;
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + m * Kp + p * 64));
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
            const __m512 xsc = _mm512_insertf32x8(_mm512_set1_ps(xd[m * nb + 2 * p]),
                                                  _mm256_set1_ps(xd[m * nb + 2 * p + 1]), 1);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xsc), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        const int64_t m = t0 + t;
        __m512 off = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 16 <= nb; b += 16)
            off = _mm512_fmadd_ps(_mm512_loadu_ps(wm + b), _mm512_loadu_ps(xs + m * nb + b), off);
        float o = hsum(off);
        for (; b < nb; b++) o += wm[b] * xs[m * nb + b];
        result[t] = hsum(acc[t]) + o;
    }
#else
    for (int t = 0; t < nt; t++) {
        const int64_t m = t0 + t;
        float total = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot = 0;
            for (int64_t k = b * QBLOCK; k < (b + 1) * QBLOCK; k++)
                dot += weight_q(wrow, fmt, k) * (int32_t)xq[m * Kp + k];
            total += (float)dot * (wd[b] * xd[m * nb + b]) + wm[b] * xs[m * nb + b];
        }
        result[t] = total;
    }
#endif
}

/* FMT_C8, one row: block sums scaled by the activations' block scales, the row scale once. */
static void row_channel_format(int64_t t0, int nt, int64_t Kp, const uint8_t *wrow, float wscale,
                               const int8_t *xq, const float *xd, const float *xs, float *result) {
    const int64_t nb = Kp / QBLOCK;
    for (int t = 0; t < nt; t++) {
        const int64_t m = t0 + t;
        float total = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot = 0;
            for (int64_t k = b * QBLOCK; k < (b + 1) * QBLOCK; k++) dot += (int32_t)wrow[k] * (int32_t)xq[m * Kp + k];
            total += (float)dot * xd[m * nb + b] - 128.f * xs[m * nb + b];
        }
        result[t] = wscale * total;
    }
}

#define ROW_TILE 4

#if QG_VNNI
/* Block formats, rows [n, n + 4) against tokens [t0, t0 + nt): each weight pair is unpacked
 * once for the four tokens, each activation vector loaded once for the four rows. */
static void tile_block_format(int fmt, int64_t t0, int nt, int64_t Kp, const uint8_t *w,
                              int64_t row_bytes, const float *wd, const float *wm,
                              const int8_t *xq, const float *xd, const float *xs,
                              float result[ROW_TILE][TOK_TILE]) {
    const int64_t nb = Kp / QBLOCK, np = nb / 2;
    __m512 acc[ROW_TILE][TOK_TILE];
    for (int r = 0; r < ROW_TILE; r++)
        for (int t = 0; t < TOK_TILE; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        __m512i wv[ROW_TILE];
        __m512 ws[ROW_TILE];
        for (int r = 0; r < ROW_TILE; r++) {
            wv[r] = load_pair(w + r * row_bytes, fmt, p);
            ws[r] = pair_scales(wd + r * nb + 2 * p);
        }
        for (int t = 0; t < nt; t++) {
            const int64_t m = t0 + t;
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + m * Kp + p * 64));
            const __m512 xsc = pair_scales(xd + m * nb + 2 * p);
            for (int r = 0; r < ROW_TILE; r++) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[r], xsc), acc[r][t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        const int64_t m = t0 + t;
        for (int r = 0; r < ROW_TILE; r++) {
            float o = 0.f;
            for (int64_t b = 0; b < nb; b++) o += wm[r * nb + b] * xs[m * nb + b];
            result[r][t] = _mm512_reduce_add_ps(acc[r][t]) + o;
        }
    }
}

/* FMT_C8, rows [n, n + 4) against tokens [t0, t0 + nt): one scale per row, so only the
 * activations' block scales enter the loop; the +128 of the stored weights is taken out once. */
static void tile_channel_format(int64_t t0, int nt, int64_t Kp, const uint8_t *w, const float *wscale,
                                const int8_t *xq, const float *xd, const float *xs,
                                float result[ROW_TILE][TOK_TILE]) {
    const int64_t nb = Kp / QBLOCK;
    __m512 acc[ROW_TILE][TOK_TILE];
    for (int r = 0; r < ROW_TILE; r++)
        for (int t = 0; t < TOK_TILE; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < Kp / 64; p++) {
        __m512i wv[ROW_TILE];
        for (int r = 0; r < ROW_TILE; r++) wv[r] = _mm512_loadu_si512((const void *)(w + r * Kp + p * 64));
        for (int t = 0; t < nt; t++) {
            const int64_t m = t0 + t;
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + m * Kp + p * 64));
            const __m512 xsc = pair_scales(xd + m * nb + 2 * p);
            for (int r = 0; r < ROW_TILE; r++) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), xsc, acc[r][t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        const int64_t m = t0 + t;
        float offset = 0.f;
        for (int64_t b = 0; b < nb; b++) offset += xs[m * nb + b];
        for (int r = 0; r < ROW_TILE; r++)
            result[r][t] = wscale[r] * (_mm512_reduce_add_ps(acc[r][t]) - 128.f * offset);
    }
}
#endif

/* out[m, n] (row stride ldo, bf16 or float32) = sum_k x[m, k] w[n, k] + bias[n] (float32 or NULL),
 * x given quantized by quantize_act (per block). wd/wm: fp16 [N, Kp/32] for the
 * block formats; wd: float32 [N] for FMT_C8 (wm unused). Rows go in tiles of four (one thread
 * each), the tokens in tiles of four inside. */
void quant_gemm(int fmt, int64_t M, int64_t N, int64_t Kp, const uint8_t *w, const void *wd_,
                const void *wm_, const float *bias, const int8_t *xq, const float *xd,
                const float *xs, void *out, int64_t ldo, int out_bf16) {
    const int64_t nb = Kp / QBLOCK;
    const int64_t row_bytes = fmt == FMT_B4 ? Kp / 2 : Kp;
    const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel
    {
        float wd[nb > 0 ? nb : 1], wm[nb > 0 ? nb : 1], result[TOK_TILE];
#if QG_VNNI
        float tile_d[ROW_TILE * (nb > 0 ? nb : 1)], tile_m[ROW_TILE * (nb > 0 ? nb : 1)];
        float tile_result[ROW_TILE][TOK_TILE];
#endif
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * ROW_TILE;
#if QG_VNNI
            if (n0 + ROW_TILE <= N) {
                const uint8_t *wtile = w + n0 * row_bytes;
                if (fmt != FMT_C8) {
                    /* the tile's rows are adjacent: one conversion of 4 * nb scales */
                    halfs_to_floats((const uint16_t *)wd_ + n0 * nb, tile_d, ROW_TILE * nb);
                    halfs_to_floats((const uint16_t *)wm_ + n0 * nb, tile_m, ROW_TILE * nb);
                }
                for (int64_t t0 = 0; t0 < M; t0 += TOK_TILE) {
                    const int nt = M - t0 < TOK_TILE ? (int)(M - t0) : TOK_TILE;
                    if (fmt == FMT_C8)
                        tile_channel_format(t0, nt, Kp, wtile, (const float *)wd_ + n0, xq, xd, xs, tile_result);
                    else
                        tile_block_format(fmt, t0, nt, Kp, wtile, row_bytes, tile_d, tile_m, xq, xd, xs,
                                          tile_result);
                    for (int r = 0; r < ROW_TILE; r++) {
                        const float b = bias ? bias[n0 + r] : 0.f;
                        for (int t = 0; t < nt; t++)
                            store_out(out, out_bf16, (t0 + t) * ldo + n0 + r, tile_result[r][t] + b);
                    }
                }
                continue;
            }
#endif
            for (int64_t n = n0; n < N && n < n0 + ROW_TILE; n++) {
                const uint8_t *wrow = w + n * row_bytes;
                const float b = bias ? bias[n] : 0.f;
                if (fmt != FMT_C8) {
                    halfs_to_floats((const uint16_t *)wd_ + n * nb, wd, nb);
                    halfs_to_floats((const uint16_t *)wm_ + n * nb, wm, nb);
                }
                for (int64_t t0 = 0; t0 < M; t0 += TOK_TILE) {
                    const int nt = M - t0 < TOK_TILE ? (int)(M - t0) : TOK_TILE;
                    if (fmt == FMT_C8)
                        row_channel_format(t0, nt, Kp, wrow, ((const float *)wd_)[n], xq, xd, xs, result);
                    else
                        row_block_format(fmt, n, t0, nt, Kp, wrow, wd, wm, xq, xd, xs, result);
                    for (int t = 0; t < nt; t++) store_out(out, out_bf16, (t0 + t) * ldo + n, result[t] + b);
                }
            }
        }
    }
}

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
