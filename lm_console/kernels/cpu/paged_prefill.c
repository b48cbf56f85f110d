/* Paged prefill attention for the CPU: chunks of query_len > 1 over the paged cache, the
 * chunk's own K/V already written, read through the block table (a chunk after cached
 * context needs no torch-side gather).
 *
 * Layout: q/out [rows, num_heads * head_dim], each with its own row stride; chunk c is rows
 * q_starts[c] .. + q_lens[c], the last q_lens[c] of seq_lens[c] tokens;
 * k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] (block stride given);
 * block_table [num_chunks, block_table_stride] int32. Query at position p sees keys
 * [max(0, p - window + 1), p] (window <= 0: [0, p]); soft_cap > 0 caps the scaled scores with
 * soft_cap * tanh(s / soft_cap). Accumulation is fp32 whatever the element type.
 *
 * Two implementations:
 * - bf16 with an even head_dim on AVX512_BF16 (`vdpbf16ps`, 32 bf16 products per
 *   instruction): see the section below; 3.4-3.9x the portable path on the embedded model's
 *   shapes (9 heads over 3 kv heads, head_dim 64).
 * - everything else (fp32, odd head_dim, machines without AVX512_BF16): 16 queries of one
 *   head per task against fp32 copies of each block, portable vector C.
 * Built with -ffast-math; nothing here relies on infinities or NaNs.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define PF_MAX_HEAD_DIM 256
#define PF_MAX_BLOCK 64

/* ---------------------------------------------------------------------------------------
 * Portable path. A task is one query head and a tile of QUERY_TILE consecutive query tokens
 * of one chunk. Queries are held transposed (qt[d][j]) so that one key's scores for the whole
 * tile come from head_dim broadcast-FMAs over a vector of QUERY_TILE lanes: no horizontal
 * sums, and each K/V block (converted once to fp32) serves QUERY_TILE queries. Softmax is
 * online per block, masked by each query's causal (and sliding-window) range.
 * ------------------------------------------------------------------------------------- */
#define QUERY_TILE 16

/* Element access for the two cache dtypes; `bf16` is a compile-time constant at every call. */
static inline __attribute__((always_inline)) float load_at(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void store_at(void *base, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)base)[i] = float_to_bf16(v);
    else ((float *)base)[i] = v;
}

/* QUERY_TILE floats as one vector (one zmm with AVX-512; GCC splits it elsewhere). */
typedef float tile_vec __attribute__((vector_size(QUERY_TILE * sizeof(float))));

static inline __attribute__((always_inline)) void prefill_task(
        const void *q, int64_t q_row_stride, void *out, int64_t out_row_stride,
        const void *k_cache, const void *v_cache, int64_t block_stride, const int32_t *blocks,
        int first_pos, int num_queries, int head, int group, int head_dim, int num_kv_heads,
        int block_size, float scale, int window, float soft_cap, int bf16) {
    tile_vec qt[PF_MAX_HEAD_DIM], acc[PF_MAX_HEAD_DIM]; /* [d] -> the tile's queries / outputs */
    tile_vec scores[PF_MAX_BLOCK], allowed[PF_MAX_BLOCK]; /* [t] -> the tile's queries */
    float kf[PF_MAX_BLOCK][PF_MAX_HEAD_DIM] __attribute__((aligned(64)));
    tile_vec running_max, running_sum = {0}, block_max, correction;
    int pos[QUERY_TILE], lowest[QUERY_TILE]; /* each query's key range [lowest, pos] */
    const int kv_head = head / group;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;

    for (int j = 0; j < QUERY_TILE; j++) {
        const int valid = j < num_queries;
        const int64_t base = (int64_t)(valid ? j : 0) * q_row_stride + (int64_t)head * head_dim;
        for (int d = 0; d < head_dim; d++) {
            qt[d][j] = valid ? load_at(q, base + d, bf16) * scale : 0.f;
            acc[d][j] = 0.f;
        }
        pos[j] = first_pos + (valid ? j : num_queries - 1);
        lowest[j] = window > 0 ? pos[j] - window + 1 : 0;
        running_max[j] = -FLT_MAX;
    }
    const int last_pos = first_pos + num_queries - 1;
    const int start = lowest[0] > 0 ? lowest[0] : 0;
    for (int first = (start / block_size) * block_size; first <= last_pos; first += block_size) {
        const int64_t block = blocks[first / block_size];
        const int lo = first < start ? start - first : 0;
        const int hi = last_pos + 1 - first < block_size ? last_pos + 1 - first : block_size;
        const int64_t kv_base = block * block_stride + (int64_t)kv_head * head_dim;

        for (int t = lo; t < hi; t++)
            for (int d = 0; d < head_dim; d++) kf[t][d] = load_at(k_cache, kv_base + t * row_stride + d, bf16);
        /* Four keys at a time: independent FMA chains instead of one latency-bound chain. */
        int t = lo;
        for (; t + 4 <= hi; t += 4) {
            tile_vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            for (int d = 0; d < head_dim; d++) {
                const tile_vec qd = qt[d];
                s0 += qd * kf[t][d];
                s1 += qd * kf[t + 1][d];
                s2 += qd * kf[t + 2][d];
                s3 += qd * kf[t + 3][d];
            }
            scores[t] = s0; scores[t + 1] = s1; scores[t + 2] = s2; scores[t + 3] = s3;
        }
        for (; t < hi; t++) {
            tile_vec sum = {0};
            for (int d = 0; d < head_dim; d++) sum += qt[d] * kf[t][d];
            scores[t] = sum;
        }
        for (t = lo; t < hi; t++) {
            const int key_pos = first + t;
            for (int j = 0; j < QUERY_TILE; j++)
                allowed[t][j] = (key_pos <= pos[j] && key_pos >= lowest[j]) ? 1.f : 0.f;
        }
        float *flat = (float *)&scores[lo], *mask = (float *)&allowed[lo];
        const int num_flat = (hi - lo) * QUERY_TILE;
        if (soft_cap > 0.f)
            for (int i = 0; i < num_flat; i++) flat[i] = soft_cap * tanhf(flat[i] / soft_cap);
        for (int i = 0; i < num_flat; i++) flat[i] = mask[i] > 0.f ? flat[i] : -FLT_MAX;
        block_max = running_max;
        for (t = lo; t < hi; t++)
            for (int j = 0; j < QUERY_TILE; j++)
                block_max[j] = scores[t][j] > block_max[j] ? scores[t][j] : block_max[j];
        for (int j = 0; j < QUERY_TILE; j++) correction[j] = expf(running_max[j] - block_max[j]);
        running_max = block_max;
        /* Masked keys get weight 0, also for a query that has seen no key yet (max -FLT_MAX). */
        for (t = lo; t < hi; t++) scores[t] -= block_max;
        for (int i = 0; i < num_flat; i++) flat[i] = expf(flat[i]) * mask[i];
        running_sum *= correction;
        for (t = lo; t < hi; t++) running_sum += scores[t];

        for (t = lo; t < hi; t++)
            for (int e = 0; e < head_dim; e++) kf[t][e] = load_at(v_cache, kv_base + t * row_stride + e, bf16);
        int d = 0;
        for (; d + 4 <= head_dim; d += 4) { /* four output columns: four FMA chains */
            tile_vec a0 = acc[d] * correction, a1 = acc[d + 1] * correction;
            tile_vec a2 = acc[d + 2] * correction, a3 = acc[d + 3] * correction;
            for (int u = lo; u < hi; u++) {
                const tile_vec p = scores[u];
                a0 += p * kf[u][d];
                a1 += p * kf[u][d + 1];
                a2 += p * kf[u][d + 2];
                a3 += p * kf[u][d + 3];
            }
            acc[d] = a0; acc[d + 1] = a1; acc[d + 2] = a2; acc[d + 3] = a3;
        }
        for (; d < head_dim; d++) {
            tile_vec a = acc[d] * correction;
            for (int u = lo; u < hi; u++) a += scores[u] * kf[u][d];
            acc[d] = a;
        }
    }
    for (int j = 0; j < num_queries; j++) {
        const float inv = running_sum[j] > 0.f ? 1.f / running_sum[j] : 0.f;
        const int64_t base = (int64_t)j * out_row_stride + (int64_t)head * head_dim;
        for (int d = 0; d < head_dim; d++) store_at(out, base + d, acc[d][j] * inv, bf16);
    }
}



#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define PF_HAVE_BF16_PATH 1
/* ---------------------------------------------------------------------------------------
 * bf16 on AVX512_BF16. First each chunk's K/V (per kv head) are repacked once from the
 * paged cache into contiguous slabs: K rows as they are, V interleaved by key pairs. Then a
 * task is one (chunk, kv head, tile of PF_TILE queries), the group's query heads in turn over
 * the same slab segment (in L1). Queries sit in the 16 lanes of a vector throughout, so max
 * and sum over keys are lane-wise (no horizontal reductions):
 *   S = Q K^T : `vdpbf16ps` of a query dim-pair vector (qp[p][j] = q_j[2p], q_j[2p+1]) with
 *               a broadcast key dim-pair, 16 keys at a time in 16 accumulators; the scale
 *               (and log2 e, for exp2) applied to the fp32 sums;
 *   softmax   : keys in segments of PF_SEG, scores kept (fp32, base-2 units) so a segment's
 *               max is known before any exponential; an online correction between segments;
 *   O += P V  : P rounded to bf16 and interleaved by key pairs (pp[kp][j] = p_j[2kp],
 *               p_j[2kp+1]), `vdpbf16ps` with a broadcast V key-pair (vp[kp][d]), 16 output
 *               dims in registers per pass. bf16 P is what GPU flash attention does too.
 * Masks (causal, window, the segment's padding) are computed only for key groups that need
 * them; fully visible groups skip the compares.
 * ------------------------------------------------------------------------------------- */
#define PF_TILE 16
#ifndef PF_SEG
#define PF_SEG 128
#endif
#define PF_LOG2E 1.4426950408889634f

typedef struct {
    const uint16_t *q; int64_t q_row_stride; uint16_t *out; int64_t out_row_stride;
    const char *k_cache, *v_cache; int64_t block_stride; /* block stride in bytes */
    int i8; /* the int8 cache (cache_write.c): rows of head_dim int8 and a float32 scale */
    const int32_t *block_table; int64_t block_table_stride;
    const int32_t *q_starts, *q_lens, *seq_lens;
    int num_kv_heads, group, head_dim, block_size, window;
    float scale, soft_cap;
    /* Each (chunk, kv head)'s keys repacked once per call: rows of D (k_all) and key-pair
     * interleaved (v_all), chunk c's slabs starting at key kv_first[c] * num_kv_heads, each
     * pf_padded(seq_len) keys long (zeros past the sequence). */
    uint16_t *k_all;
    uint32_t *v_all;
    const int64_t *kv_first;
} pf_args;

static inline int pf_padded(int seq_len) { return (seq_len + 15) & ~15; }

typedef struct { /* one thread's scratch, every piece 64-byte aligned */
    uint32_t *qp;    /* [group][D/2][PF_TILE] query dim-pairs */
    float *acc;      /* [group][D][PF_TILE] unnormalized outputs */
    float *s;        /* [PF_SEG][PF_TILE] scores, base-2 units */
    uint32_t *pp;    /* [PF_SEG/2][PF_TILE] bf16 weight key-pairs */
    __mmask16 *kmask; /* [PF_SEG] which queries see each key */
} pf_ws;

#define PF_ALIGN(n) (((size_t)(n) + 63) & ~(size_t)63)

static size_t pf_ws_bytes(int group, int D) {
    return PF_ALIGN((size_t)group * D / 2 * PF_TILE * 4) + PF_ALIGN((size_t)group * D * PF_TILE * 4)
        + PF_ALIGN(PF_SEG * PF_TILE * 4) + PF_ALIGN(PF_SEG / 2 * PF_TILE * 4)
        + PF_ALIGN(PF_SEG * sizeof(__mmask16));
}

static pf_ws pf_ws_carve(char *mem, int group, int D) {
    pf_ws w;
    w.qp = (uint32_t *)mem; mem += PF_ALIGN((size_t)group * D / 2 * PF_TILE * 4);
    w.acc = (float *)mem; mem += PF_ALIGN((size_t)group * D * PF_TILE * 4);
    w.s = (float *)mem; mem += PF_ALIGN(PF_SEG * PF_TILE * 4);
    w.pp = (uint32_t *)mem; mem += PF_ALIGN(PF_SEG / 2 * PF_TILE * 4);
    w.kmask = (__mmask16 *)mem;
    return w;
}

/* 2^t for finite t (underflows to 0): 2^frac by a degree-5 fit on [0, 1) (relative error
 * 1.7e-7), scaled by 2^floor(t) with vscalefps. Lanes off in `keep` come out 0. */
static inline __m512 pf_exp2_maskz(__mmask16 keep, __m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); /* t - floor(t) */
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0018775745f), f, _mm512_set1_ps(0.0089893462f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055826314f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24015363f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69315308f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999994f));
    return _mm512_maskz_scalef_ps(keep, p, t);
}

/* cap * tanh(x / cap), in base-2 units like the scores: x is log2(e) * score. */
static inline __m512 pf_soft_cap(__m512 x, float cap) {
    /* e = exp(2 x_nat / cap) = 2^(2 x / cap); tanh = (e - 1) / (e + 1); |2x/cap| <= 40 keeps e finite. */
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(2.f / cap));
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-40.f)), _mm512_set1_ps(40.f));
    const __m512 e = pf_exp2_maskz(0xffff, t);
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 tanh = _mm512_div_ps(_mm512_sub_ps(e, one), _mm512_add_ps(e, one));
    return _mm512_mul_ps(tanh, _mm512_set1_ps(cap * PF_LOG2E));
}

/* 32 elements d.. of a cached K or V row as bf16 (masked by m): as they are, or the int8
 * cache's integers times the row's scale, rounded to bf16. */
static inline __m512i pf_load32(const char *row, int d, __mmask32 m, int i8, int D) {
    if (!i8) return _mm512_maskz_loadu_epi16(m, (const uint16_t *)row + d);
    float scale;
    memcpy(&scale, row + D, sizeof scale);
    const __m512 s = _mm512_set1_ps(scale);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((__mmask16)m, row + d)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((__mmask16)(m >> 16), row + d + 16)));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
}

/* Keys [k0, k1) (k0 even) of chunk c, kv head h, from the paged cache into the call's slabs:
 * K rows as they are, V as key pairs (vp[kp][d] = v[2kp][d], v[2kp+1][d]); zeros past seq_len. */
static void pf_repack(const pf_args *a, int c, int h, int k0, int k1) {
    const int D = a->head_dim, seq_len = a->seq_lens[c], bs = a->block_size;
    const int64_t head_bytes = a->i8 ? D + 4 : 2 * D;
    const int64_t row_bytes = (int64_t)a->num_kv_heads * head_bytes;
    const int64_t slab = a->kv_first[c] * a->num_kv_heads + (int64_t)h * pf_padded(seq_len);
    const int32_t *blocks = a->block_table + (int64_t)c * a->block_table_stride;
    const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
    for (int k = k0; k < k1; k += 2) {
        const char *krow[2] = {NULL, NULL}, *vrow[2] = {NULL, NULL};
        for (int t = 0; t < 2; t++)
            if (k + t < seq_len) {
                const int64_t base = (int64_t)blocks[(k + t) / bs] * a->block_stride
                                   + (int64_t)((k + t) % bs) * row_bytes + (int64_t)h * head_bytes;
                krow[t] = a->k_cache + base;
                vrow[t] = a->v_cache + base;
            }
        uint16_t *kd = a->k_all + (slab + k) * D;
        uint32_t *vd = a->v_all + (slab + k) / 2 * D;
        for (int d = 0; d < D; d += 32) {
            const __mmask32 m = D - d >= 32 ? 0xffffffffu : (1u << (D - d)) - 1;
            const __m512i k0v = krow[0] ? pf_load32(krow[0], d, m, a->i8, D) : _mm512_setzero_si512();
            const __m512i k1v = krow[1] ? pf_load32(krow[1], d, m, a->i8, D) : _mm512_setzero_si512();
            _mm512_mask_storeu_epi16(kd + d, m, k0v);
            _mm512_mask_storeu_epi16(kd + D + d, m, k1v);
            const __m512i v0 = vrow[0] ? pf_load32(vrow[0], d, m, a->i8, D) : _mm512_setzero_si512();
            const __m512i v1 = vrow[1] ? pf_load32(vrow[1], d, m, a->i8, D) : _mm512_setzero_si512();
            const int left = D - d; /* pairs to store: 16 from lo, then the rest from hi */
            const __mmask16 mlo = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 mhi = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            _mm512_mask_storeu_epi32(vd + d, mlo, _mm512_permutex2var_epi16(v0, idx_lo, v1));
            if (mhi) _mm512_mask_storeu_epi32(vd + d + 16, mhi, _mm512_permutex2var_epi16(v0, idx_hi, v1));
        }
    }
}

/* One block of DB output dims: o[d][j] = corr[j] * o[d][j] + sum over key pairs of P V
 * (o starts from 0 on a task's first segment). */
#define PF_DEFINE_PV(DB)                                                                        \
static inline __attribute__((always_inline)) void pf_pv_##DB(                                  \
        float *acc, const uint32_t *pp, const uint32_t *vp, int npairs, __m512 corr, int D,    \
        int first) {                                                                            \
    __m512 o[DB];                                                                               \
    _Pragma("GCC unroll 16")                                                                    \
    for (int i = 0; i < DB; i++)                                                                \
        o[i] = first ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_load_ps(acc + i * PF_TILE), corr); \
    for (int kp = 0; kp < npairs; kp++) {                                                       \
        const __m512bh pv = (__m512bh)_mm512_load_si512(pp + kp * PF_TILE);                    \
        const uint32_t *v = vp + (int64_t)kp * D;                                               \
        _Pragma("GCC unroll 16")                                                                \
        for (int i = 0; i < DB; i++)                                                            \
            o[i] = _mm512_dpbf16_ps(o[i], pv, (__m512bh)_mm512_set1_epi32((int)v[i]));          \
    }                                                                                           \
    _Pragma("GCC unroll 16")                                                                    \
    for (int i = 0; i < DB; i++) _mm512_store_ps(acc + i * PF_TILE, o[i]);                     \
}
PF_DEFINE_PV(16)
PF_DEFINE_PV(2)

static inline __attribute__((always_inline)) void pf_task(
        const pf_args *a, const pf_ws *w, int c, int tile, int kv_head, const int D) {
    const int G = a->group, DP = D / 2;
    const int q_len = a->q_lens[c], j0 = tile * PF_TILE;
    const int n = q_len - j0 < PF_TILE ? q_len - j0 : PF_TILE;
    const int pos0 = a->seq_lens[c] - q_len + j0, posn = pos0 + n - 1;
    const int window = a->window;
    const int low_n = window > 0 ? posn - window + 1 : 0; /* the last query's first key */
    /* From a multiple of 16 (keys before the window are masked), so that segments start
     * on the slabs' key pairs and groups. */
    const int kstart = (window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0) & ~15;
    const int kend = posn + 1;
    const int64_t slab = a->kv_first[c] * a->num_kv_heads + (int64_t)kv_head * pf_padded(a->seq_lens[c]);
    const uint16_t *k_slab = a->k_all + slab * D;
    const uint32_t *v_slab = a->v_all + slab / 2 * D;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* Padding lanes (j >= n) repeat the last query's range; their outputs are not stored. */
    const __m512i posv = _mm512_add_epi32(_mm512_set1_epi32(pos0),
                                          _mm512_min_epi32(lanes, _mm512_set1_epi32(n - 1)));
    const __m512i lowv = window > 0 ? _mm512_sub_epi32(posv, _mm512_set1_epi32(window - 1))
                                    : _mm512_setzero_si512();
    const float score_scale = a->scale * PF_LOG2E, soft_cap = a->soft_cap;
    const uint16_t *q_tile = a->q + ((int64_t)a->q_starts[c] + j0) * a->q_row_stride;
    __m512 run_max[G], run_sum[G];

    for (int g = 0; g < G; g++) {
        uint32_t *qp = w->qp + (int64_t)g * DP * PF_TILE;
        const uint16_t *head = q_tile + (int64_t)(kv_head * G + g) * D;
        for (int p0 = 0; p0 < DP; p0 += 16) { /* 16 dim-pairs of the 16 queries at a time */
            const __mmask16 m = DP - p0 >= 16 ? 0xffff : (__mmask16)((1u << (DP - p0)) - 1);
            __m512i r[16];
            for (int j = 0; j < PF_TILE; j++)
                r[j] = j < n ? _mm512_maskz_loadu_epi32(m, head + (int64_t)j * a->q_row_stride + 2 * p0)
                             : _mm512_setzero_si512();
            transpose16x16_epi32(r);
            for (int p = 0; p < 16 && p0 + p < DP; p++) _mm512_store_si512(qp + (p0 + p) * PF_TILE, r[p]);
        }
        run_max[g] = _mm512_set1_ps(-FLT_MAX);
        run_sum[g] = _mm512_setzero_ps();
    }

    for (int seg0 = kstart; seg0 < kend; seg0 += PF_SEG) {
        const int nk = kend - seg0 < PF_SEG ? kend - seg0 : PF_SEG;
        const int ngroups = (nk + 15) / 16, nkp = ngroups * 16;
        const uint16_t *kbuf = k_slab + (int64_t)seg0 * D;
        const uint32_t *vp = v_slab + (int64_t)seg0 / 2 * D;
        int group_full[PF_SEG / 16];
        for (int gi = 0; gi < ngroups; gi++) {
            const int first = seg0 + gi * 16;
            group_full[gi] = first + 15 <= pos0 && first >= low_n; /* every query sees all 16 */
            if (!group_full[gi])
                for (int i = 0; i < 16; i++) {
                    const __m512i key = _mm512_set1_epi32(first + i);
                    w->kmask[gi * 16 + i] = _mm512_cmple_epi32_mask(key, posv)
                                          & _mm512_cmpge_epi32_mask(key, lowv);
                }
        }
        for (int g = 0; g < G; g++) {
            const uint32_t *qp = w->qp + (int64_t)g * DP * PF_TILE;
            __m512 seg_max = _mm512_set1_ps(-FLT_MAX);
            for (int gi = 0; gi < ngroups; gi++) {
                __m512 s[16];
                const uint32_t *kb = (const uint32_t *)(kbuf + (int64_t)gi * 16 * D);
                _Pragma("GCC unroll 16")
                for (int i = 0; i < 16; i++) s[i] = _mm512_setzero_ps();
                for (int p = 0; p < DP; p++) {
                    const __m512bh qv = (__m512bh)_mm512_load_si512(qp + p * PF_TILE);
                    _Pragma("GCC unroll 16")
                    for (int i = 0; i < 16; i++)
                        s[i] = _mm512_dpbf16_ps(s[i], qv, (__m512bh)_mm512_set1_epi32((int)kb[i * DP + p]));
                }
                float *sd = w->s + gi * 16 * PF_TILE;
                const __m512 sc = _mm512_set1_ps(score_scale);
                _Pragma("GCC unroll 16")
                for (int i = 0; i < 16; i++) {
                    __m512 x = _mm512_mul_ps(s[i], sc);
                    if (soft_cap > 0.f) x = pf_soft_cap(x, soft_cap);
                    _mm512_store_ps(sd + i * PF_TILE, x);
                    seg_max = group_full[gi] ? _mm512_max_ps(seg_max, x)
                                             : _mm512_mask_max_ps(seg_max, w->kmask[gi * 16 + i], seg_max, x);
                }
            }
            const __m512 new_max = _mm512_max_ps(run_max[g], seg_max);
            const __m512 corr = pf_exp2_maskz(0xffff, _mm512_sub_ps(run_max[g], new_max));
            run_max[g] = new_max;
            __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
            const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                        25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19,
                                                        3, 18, 2, 17, 1, 16, 0);
            for (int gi = 0; gi < ngroups; gi++) {
                const int full = group_full[gi];
                for (int k = gi * 16; k < gi * 16 + 16; k += 2) {
                    const __mmask16 m0 = full ? 0xffff : w->kmask[k], m1 = full ? 0xffff : w->kmask[k + 1];
                    const __m512 p0 = pf_exp2_maskz(m0, _mm512_sub_ps(_mm512_load_ps(w->s + k * PF_TILE), new_max));
                    const __m512 p1 = pf_exp2_maskz(m1, _mm512_sub_ps(_mm512_load_ps(w->s + (k + 1) * PF_TILE), new_max));
                    sum0 = _mm512_add_ps(sum0, p0);
                    sum1 = _mm512_add_ps(sum1, p1);
                    _mm512_store_si512(w->pp + (k / 2) * PF_TILE,
                                       _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
                }
            }
            run_sum[g] = _mm512_fmadd_ps(run_sum[g], corr, _mm512_add_ps(sum0, sum1));
            float *acc = w->acc + (int64_t)g * D * PF_TILE;
            int d = 0;
            for (; d + 16 <= D; d += 16) pf_pv_16(acc + d * PF_TILE, w->pp, vp + d, nkp / 2, corr, D, seg0 == kstart);
            for (; d < D; d += 2) pf_pv_2(acc + d * PF_TILE, w->pp, vp + d, nkp / 2, corr, D, seg0 == kstart);
        }
    }

    for (int g = 0; g < G; g++) {
        const __mmask16 seen = _mm512_cmp_ps_mask(run_sum[g], _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 inv = _mm512_maskz_div_ps(seen, _mm512_set1_ps(1.f), run_sum[g]);
        const float *acc = w->acc + (int64_t)g * D * PF_TILE;
        uint16_t *out = a->out + ((int64_t)a->q_starts[c] + j0) * a->out_row_stride + (int64_t)(kv_head * G + g) * D;
        for (int d0 = 0; d0 < D; d0 += 16) { /* 16 dims of the 16 queries at a time */
            const int nd = D - d0 < 16 ? D - d0 : 16;
            __m512i r[16];
            for (int d = 0; d < 16; d++)
                r[d] = d < nd ? _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(acc + (d0 + d) * PF_TILE), inv))
                              : _mm512_setzero_si512();
            transpose16x16_epi32(r);
            for (int j = 0; j < n; j++)
                _mm256_mask_storeu_epi16(out + (int64_t)j * a->out_row_stride + d0, (__mmask16)((1u << nd) - 1),
                                         (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[j])));
        }
    }
}

static void pf_task_d64(const pf_args *a, const pf_ws *w, int c, int tile, int kv_head) {
    pf_task(a, w, c, tile, kv_head, 64);
}
static void pf_task_d128(const pf_args *a, const pf_ws *w, int c, int tile, int kv_head) {
    pf_task(a, w, c, tile, kv_head, 128);
}
static void pf_task_any(const pf_args *a, const pf_ws *w, int c, int tile, int kv_head) {
    pf_task(a, w, c, tile, kv_head, a->head_dim);
}

#define PF_REPACK_KEYS 64 /* keys per repack work item */

/* Returns 0, or -2 when memory could not be allocated. */
static int pf_run_bf16(pf_args *a, int num_chunks) {
    int tiles_before[num_chunks + 1], units_before[num_chunks + 1];
    int64_t kv_first[num_chunks];
    int64_t keys = 0;
    tiles_before[0] = units_before[0] = 0;
    for (int c = 0; c < num_chunks; c++) {
        const int padded = pf_padded(a->seq_lens[c]);
        kv_first[c] = keys;
        keys += padded;
        tiles_before[c + 1] = tiles_before[c] + (a->q_lens[c] + PF_TILE - 1) / PF_TILE;
        units_before[c + 1] = units_before[c]
                            + a->num_kv_heads * ((padded + PF_REPACK_KEYS - 1) / PF_REPACK_KEYS);
    }
    const int D = a->head_dim, num_tasks = tiles_before[num_chunks] * a->num_kv_heads;
    const size_t slab_bytes = PF_ALIGN((size_t)keys * a->num_kv_heads * D * 2);
    char *slabs = aligned_alloc(64, 2 * slab_bytes + 64);
    if (slabs == NULL) return -2;
    a->k_all = (uint16_t *)slabs;
    a->v_all = (uint32_t *)(slabs + slab_bytes);
    a->kv_first = kv_first;
    void (*task_fn)(const pf_args *, const pf_ws *, int, int, int) =
        D == 64 ? pf_task_d64 : D == 128 ? pf_task_d128 : pf_task_any;
    const size_t bytes = pf_ws_bytes(a->group, D);
    int failed = 0;
    _Pragma("omp parallel")
    {
        _Pragma("omp for schedule(dynamic, 4)")
        for (int unit = 0; unit < units_before[num_chunks]; unit++) {
            int c = 0;
            while (units_before[c + 1] <= unit) c++;
            const int per_head = (units_before[c + 1] - units_before[c]) / a->num_kv_heads;
            const int h = (unit - units_before[c]) / per_head;
            const int k0 = (unit - units_before[c]) % per_head * PF_REPACK_KEYS;
            const int padded = pf_padded(a->seq_lens[c]);
            const int k1 = k0 + PF_REPACK_KEYS < padded ? k0 + PF_REPACK_KEYS : padded;
            /* With a window, keys before the chunk's first query's window are never read. */
            const int first_query = a->seq_lens[c] - a->q_lens[c];
            const int needed = (a->window > 0 && first_query - a->window + 1 > 0
                                ? first_query - a->window + 1 : 0) & ~15;
            if (k1 > needed) pf_repack(a, c, h, k0 > needed ? k0 : needed, k1);
        }
        char *mem = aligned_alloc(64, PF_ALIGN(bytes));
        if (mem == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        const pf_ws w = pf_ws_carve(mem, a->group, D);
        /* In reverse: within a chunk the later tiles (more keys) go first, the cheap ones fill
         * gaps. Every thread meets the loop; one without scratch skips its tasks. */
        _Pragma("omp for schedule(dynamic, 1) nowait")
        for (int task = num_tasks - 1; task >= 0; task--) {
            if (mem == NULL) continue;
            const int tile = task / a->num_kv_heads, kv_head = task % a->num_kv_heads;
            int c = 0;
            while (tiles_before[c + 1] <= tile) c++;
            task_fn(a, &w, c, tile - tiles_before[c], kv_head);
        }
        free(mem);
    }
    free(slabs);
    return failed ? -2 : 0;
}
#endif /* AVX512_BF16 */

/* chunk c: query rows q_starts[c] .. + q_lens[c], the last q_lens[c] of seq_lens[c] tokens.
 * Returns 0, -1 for an unsupported shape, -2 when scratch memory could not be allocated, -3
 * for a block-table entry outside the cache (nothing written then). */
#define DEFINE_PREFILL_ENTRY(NAME, BF16, T, FAST)                                               \
int NAME(const T *q, int64_t q_row_stride, T *out, int64_t out_row_stride,                     \
         const T *k_cache, const T *v_cache, int64_t block_stride,                              \
         const int32_t *block_table, int64_t block_table_stride, const int32_t *q_starts,       \
         const int32_t *q_lens, const int32_t *seq_lens, int num_chunks, int num_heads,         \
         int num_kv_heads, int head_dim, int block_size, float scale, int window,               \
         float soft_cap, int64_t num_blocks, int64_t blocks_per_row) {                          \
    if (head_dim > PF_MAX_HEAD_DIM || block_size > PF_MAX_BLOCK || num_kv_heads <= 0            \
        || num_heads % num_kv_heads != 0) return -1;                                            \
    if (num_chunks <= 0) return 0;                                                              \
    for (int c = 0; c < num_chunks; c++)                                                        \
        if (!block_row_in_cache(block_table + (int64_t)c * block_table_stride, blocks_per_row,  \
                                seq_lens[c], block_size, num_blocks)) return -3;                \
    const int group = num_heads / num_kv_heads;                                                 \
    FAST                                                                                        \
    int tiles_before[num_chunks + 1];                                                           \
    tiles_before[0] = 0;                                                                        \
    for (int c = 0; c < num_chunks; c++)                                                        \
        tiles_before[c + 1] = tiles_before[c] + (q_lens[c] + QUERY_TILE - 1) / QUERY_TILE;      \
    const int num_tasks = tiles_before[num_chunks] * num_heads;                                 \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                            \
    for (int task = 0; task < num_tasks; task++) {                                              \
        const int tile = task / num_heads, head = task % num_heads;                             \
        int c = 0;                                                                              \
        while (tiles_before[c + 1] <= tile) c++;                                                \
        const int first = (tile - tiles_before[c]) * QUERY_TILE;                                \
        const int n = q_lens[c] - first < QUERY_TILE ? q_lens[c] - first : QUERY_TILE;         \
        const int64_t row = (int64_t)q_starts[c] + first;                                      \
        prefill_task(q + row * q_row_stride, q_row_stride, out + row * out_row_stride,          \
                     out_row_stride, k_cache, v_cache, block_stride,                            \
                     block_table + (int64_t)c * block_table_stride,                             \
                     seq_lens[c] - q_lens[c] + first, n, head, group, head_dim, num_kv_heads,   \
                     block_size, scale, window, soft_cap, BF16);                                \
    }                                                                                           \
    return 0;                                                                                   \
}

#ifdef PF_HAVE_BF16_PATH
#define PF_BF16_FAST                                                                            \
    if (head_dim % 2 == 0) {                                                                    \
        pf_args args = {q, q_row_stride, out, out_row_stride, (const char *)k_cache,            \
                        (const char *)v_cache, block_stride * 2, 0, block_table,                \
                        block_table_stride, q_starts, q_lens, seq_lens, num_kv_heads, group,    \
                        head_dim, block_size, window, scale, soft_cap, NULL, NULL, NULL};       \
        return pf_run_bf16(&args, num_chunks);                                                  \
    }
#else
#define PF_BF16_FAST
#endif

DEFINE_PREFILL_ENTRY(paged_prefill_attention_bf16, 1, uint16_t, PF_BF16_FAST)
DEFINE_PREFILL_ENTRY(paged_prefill_attention_f32, 0, float, )

/* The int8 cache (bf16 q and out; block_stride in bytes): the AVX512-BF16 path only, its K/V
 * dequantized to bf16 as they are repacked. -1 without it or for an odd head_dim. */
int paged_prefill_attention_int8(const uint16_t *q, int64_t q_row_stride, uint16_t *out, int64_t out_row_stride,
                                 const void *k_cache, const void *v_cache, int64_t block_stride,
                                 const int32_t *block_table, int64_t block_table_stride, const int32_t *q_starts,
                                 const int32_t *q_lens, const int32_t *seq_lens, int num_chunks, int num_heads,
                                 int num_kv_heads, int head_dim, int block_size, float scale, int window,
                                 float soft_cap, int64_t num_blocks, int64_t blocks_per_row) {
    if (head_dim > PF_MAX_HEAD_DIM || head_dim % 2 != 0 || block_size > PF_MAX_BLOCK || num_kv_heads <= 0
        || num_heads % num_kv_heads != 0) return -1;
#ifdef PF_HAVE_BF16_PATH
    if (num_chunks <= 0) return 0;
    for (int c = 0; c < num_chunks; c++)
        if (!block_row_in_cache(block_table + (int64_t)c * block_table_stride, blocks_per_row,
                                seq_lens[c], block_size, num_blocks)) return -3;
    pf_args args = {q, q_row_stride, out, out_row_stride, (const char *)k_cache, (const char *)v_cache,
                    block_stride, 1, block_table, block_table_stride, q_starts, q_lens, seq_lens,
                    num_kv_heads, num_heads / num_kv_heads, head_dim, block_size, window, scale,
                    soft_cap, NULL, NULL, NULL};
    return pf_run_bf16(&args, num_chunks);
#else
    (void)q; (void)q_row_stride; (void)out; (void)out_row_stride; (void)k_cache; (void)v_cache;
    (void)block_stride; (void)block_table; (void)block_table_stride; (void)q_starts; (void)q_lens;
    (void)seq_lens; (void)num_chunks; (void)scale; (void)window; (void)soft_cap; (void)num_blocks;
    (void)blocks_per_row;
    return -1;
#endif
}
