/* Paged decode attention for the CPU: one query token per request, K/V read in place.
 *
 * The torch path gathers every request's K/V blocks into a padded copy before two batched
 * matmuls; at long contexts that copy is most of a decode step. This kernel walks each
 * request's block table and reads K/V straight from the paged cache, with an online softmax
 * per block, so the cache is read once and nothing is written but the output.
 *
 * Layout: q/out [rows, num_heads * head_dim], each with its own row stride (row token_idx[i]
 * for request i);
 * k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] (block stride given);
 * block_table [num_reqs, block_table_stride] int32; seq_lens [num_reqs] int32.
 * Accumulation is fp32 whatever the element type. Built with -ffast-math so that expf
 * vectorizes (libmvec); nothing here relies on infinities or NaNs.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64
#define MAX_HEADS 64

static inline float bf16_load(const uint16_t *p) { return bf16_to_float(*p); }

static inline float f32_load(const float *p) { return *p; }
static inline float f32_store_value(float value) { return value; }

/* One block of an online softmax for one query head: scores[lo:hi] become exp(s - max) in
 * place, running max/sum move on, and the returned factor rescales what was accumulated. */
static inline float online_softmax_block(float *scores, int lo, int hi, float *running_max,
                                         float *running_sum) {
    float block_max = *running_max;
    for (int t = lo; t < hi; t++) block_max = scores[t] > block_max ? scores[t] : block_max;
    const float correction = expf(*running_max - block_max);
    float block_sum = 0.f;
    _Pragma("omp simd reduction(+:block_sum)")
    for (int t = lo; t < hi; t++) {
        scores[t] = expf(scores[t] - block_max);
        block_sum += scores[t];
    }
    *running_sum = *running_sum * correction + block_sum;
    *running_max = block_max;
    return correction;
}

/* One (request, kv head) task: the G query heads sharing this kv head attend together. */
#define DEFINE_TASK(NAME, T, LOAD, STORE)                                                      \
static void NAME(const T *q_row, const T *k_cache, const T *v_cache, int64_t block_stride,     \
                 const int32_t *blocks, int seq_len, int kv_head, int group, int head_dim,     \
                 int num_kv_heads, int block_size, float scale, int window, float soft_cap,    \
                 T *out_row) {                                                                  \
    float qf[MAX_GROUP][MAX_HEAD_DIM];                                                          \
    float acc[MAX_GROUP][MAX_HEAD_DIM];                                                         \
    float scores[MAX_GROUP][MAX_BLOCK];                                                         \
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];                                      \
    float kf[MAX_HEAD_DIM];                                                                     \
    const int row_stride = num_kv_heads * head_dim; /* elements between tokens in a block */   \
    for (int g = 0; g < group; g++) {                                                           \
        const T *src = q_row + (int64_t)(kv_head * group + g) * head_dim;                       \
        for (int d = 0; d < head_dim; d++) { qf[g][d] = LOAD(src + d) * scale; acc[g][d] = 0.f; } \
        running_max[g] = -FLT_MAX; /* finite: -ffast-math */                              \
        running_sum[g] = 0.f;                                                                   \
    }                                                                                           \
    const int start = (window > 0 && seq_len > window) ? seq_len - window : 0;                  \
    for (int first = (start / block_size) * block_size; first < seq_len; first += block_size) { \
        const int64_t block = blocks[first / block_size];                                       \
        const int lo = first < start ? start - first : 0;                                       \
        const int hi = seq_len - first < block_size ? seq_len - first : block_size;             \
        const T *k_block = k_cache + block * block_stride + (int64_t)kv_head * head_dim;        \
        const T *v_block = v_cache + block * block_stride + (int64_t)kv_head * head_dim;        \
        for (int t = lo; t < hi; t++) {                                                         \
            const T *k = k_block + (int64_t)t * row_stride;                                     \
            for (int d = 0; d < head_dim; d++) kf[d] = LOAD(k + d);                             \
            for (int g = 0; g < group; g++) {                                                   \
                float dot = 0.f;                                                                \
                _Pragma("omp simd reduction(+:dot)")                                            \
                for (int d = 0; d < head_dim; d++) dot += qf[g][d] * kf[d];                     \
                if (soft_cap > 0.f) dot = soft_cap * tanhf(dot / soft_cap);                     \
                scores[g][t] = dot;                                                             \
            }                                                                                   \
        }                                                                                       \
        for (int g = 0; g < group; g++) {                                                       \
            const float correction = online_softmax_block(scores[g], lo, hi, &running_max[g],\
                                                          &running_sum[g]);                 \
            for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;                     \
        }                                                                                       \
        for (int t = lo; t < hi; t++) {                                                         \
            const T *v = v_block + (int64_t)t * row_stride;                                     \
            for (int d = 0; d < head_dim; d++) kf[d] = LOAD(v + d);                             \
            for (int g = 0; g < group; g++) {                                                   \
                const float p = scores[g][t];                                                   \
                _Pragma("omp simd")                                                             \
                for (int d = 0; d < head_dim; d++) acc[g][d] += p * kf[d];                      \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int g = 0; g < group; g++) {                                                           \
        const float inv = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;                    \
        T *dst = out_row + (int64_t)(kv_head * group + g) * head_dim;                           \
        for (int d = 0; d < head_dim; d++) dst[d] = STORE(acc[g][d] * inv);                     \
    }                                                                                           \
}

DEFINE_TASK(task_bf16, uint16_t, bf16_load, float_to_bf16)
DEFINE_TASK(task_f32, float, f32_load, f32_store_value)


#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i half = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

/* The same task with head_dim fixed at 16 * NV: every vector of q, K, V and the accumulators
 * stays in registers, which the generic loops above cannot promise. */
#define DEFINE_TASK_AVX512(NAME, T, LOAD16, STORE, NV)                                         \
static void NAME(const T *q_row, const T *k_cache, const T *v_cache, int64_t block_stride,     \
                 const int32_t *blocks, int seq_len, int kv_head, int group, int head_dim,     \
                 int num_kv_heads, int block_size, float scale, int window, float soft_cap,    \
                 T *out_row) {                                                                  \
    (void)head_dim;                                                                             \
    __m512 qv[MAX_GROUP][NV], acc[MAX_GROUP][NV];                                               \
    float scores[MAX_GROUP][MAX_BLOCK];                                                         \
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];                                      \
    const int row_stride = num_kv_heads * 16 * NV;                                              \
    const __m512 scale_v = _mm512_set1_ps(scale);                                               \
    for (int g = 0; g < group; g++) {                                                           \
        const T *src = q_row + (int64_t)(kv_head * group + g) * 16 * NV;                        \
        for (int j = 0; j < NV; j++) {                                                          \
            qv[g][j] = _mm512_mul_ps(LOAD16(src + 16 * j), scale_v);                            \
            acc[g][j] = _mm512_setzero_ps();                                                    \
        }                                                                                       \
        running_max[g] = -FLT_MAX; /* finite: -ffast-math */                              \
        running_sum[g] = 0.f;                                                                   \
    }                                                                                           \
    const int start = (window > 0 && seq_len > window) ? seq_len - window : 0;                  \
    for (int first = (start / block_size) * block_size; first < seq_len; first += block_size) { \
        const int64_t block = blocks[first / block_size];                                       \
        if (first + block_size < seq_len) { /* blocks are scattered: fetch the next one early */\
            const int64_t next = blocks[first / block_size + 1] * block_stride + (int64_t)kv_head * 16 * NV;\
            for (int t = 0; t < block_size; t++) {                                              \
                for (int off = 0; off < (int)(16 * NV * sizeof(T)); off += 64) {            \
                    __builtin_prefetch((const char *)(k_cache + next + (int64_t)t * row_stride) + off);\
                    __builtin_prefetch((const char *)(v_cache + next + (int64_t)t * row_stride) + off);\
                }                                                                           \
            }                                                                                   \
        }                                                                                       \
        const int lo = first < start ? start - first : 0;                                       \
        const int hi = seq_len - first < block_size ? seq_len - first : block_size;             \
        const T *k_block = k_cache + block * block_stride + (int64_t)kv_head * 16 * NV;         \
        const T *v_block = v_cache + block * block_stride + (int64_t)kv_head * 16 * NV;         \
        for (int t = lo; t < hi; t++) {                                                         \
            const T *k = k_block + (int64_t)t * row_stride;                                     \
            __m512 kv[NV];                                                                      \
            for (int j = 0; j < NV; j++) kv[j] = LOAD16(k + 16 * j);                            \
            for (int g = 0; g < group; g++) {                                                   \
                __m512 sum = _mm512_mul_ps(qv[g][0], kv[0]);                                    \
                for (int j = 1; j < NV; j++) sum = _mm512_fmadd_ps(qv[g][j], kv[j], sum);       \
                float dot = _mm512_reduce_add_ps(sum);                                          \
                if (soft_cap > 0.f) dot = soft_cap * tanhf(dot / soft_cap);                     \
                scores[g][t] = dot;                                                             \
            }                                                                                   \
        }                                                                                       \
        for (int g = 0; g < group; g++) {                                                       \
            const __m512 correction_v = _mm512_set1_ps(                                     \
                online_softmax_block(scores[g], lo, hi, &running_max[g], &running_sum[g])); \
            for (int j = 0; j < NV; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], correction_v);\
        }                                                                                       \
        for (int t = lo; t < hi; t++) {                                                         \
            const T *v = v_block + (int64_t)t * row_stride;                                     \
            __m512 vv[NV];                                                                      \
            for (int j = 0; j < NV; j++) vv[j] = LOAD16(v + 16 * j);                            \
            for (int g = 0; g < group; g++) {                                                   \
                const __m512 p = _mm512_set1_ps(scores[g][t]);                                  \
                for (int j = 0; j < NV; j++) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);  \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int g = 0; g < group; g++) {                                                           \
        const float inv = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;                    \
        T *dst = out_row + (int64_t)(kv_head * group + g) * 16 * NV;                            \
        float tmp[16];                                                                          \
        for (int j = 0; j < NV; j++) {                                                          \
            _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv)));              \
            for (int d = 0; d < 16; d++) dst[16 * j + d] = STORE(tmp[d]);                       \
        }                                                                                       \
    }                                                                                           \
}

DEFINE_TASK_AVX512(task_bf16_d64, uint16_t, load16_bf16, float_to_bf16, 4)
DEFINE_TASK_AVX512(task_bf16_d128, uint16_t, load16_bf16, float_to_bf16, 8)
DEFINE_TASK_AVX512(task_f32_d64, float, load16_f32, f32_store_value, 4)
DEFINE_TASK_AVX512(task_f32_d128, float, load16_f32, f32_store_value, 8)
#define PICK_TASK(GENERIC, D64, D128, head_dim) \
    ((head_dim) == 64 ? D64 : (head_dim) == 128 ? D128 : GENERIC)
#else
#define PICK_TASK(GENERIC, D64, D128, head_dim) GENERIC
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* ---------------------------------------------------------------------------------------
 * bf16 decode with AVX512-BF16, one task per request, head_dim 32 * NB.
 *
 * Decode attention streams every request's K/V from DRAM once per layer, so the kernel must
 * keep up with memory: each block is read whole (all kv heads of a token row are adjacent)
 * while the next block is prefetched, q.k comes from vdpbf16ps on the raw bf16 rows (no
 * conversion), and the 16 partial-sum vectors of 16 keys are reduced together by a transpose
 * tree instead of one horizontal sum per key. p.V stays in fp32 FMAs for accuracy.
 * ------------------------------------------------------------------------------------- */
#define KEYS 16

/* Two vectors -> one whose 128-bit lane l holds (a, b, a, b) partial sums of lane l. */
static inline __m512 pair_sums(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

/* r[i] = sum of v[i]'s 16 lanes, for 16 vectors: a transpose-and-add tree (45 shuffles/adds
 * instead of 16 horizontal reductions). */
static inline __m512 sum16(const __m512 v[KEYS]) {
    __m512 quad[4];
    for (int i = 0; i < 4; i++) {
        const __m512 s01 = pair_sums(v[4 * i], v[4 * i + 1]);     /* lane l: v0 v1 v0 v1 */
        const __m512 s23 = pair_sums(v[4 * i + 2], v[4 * i + 3]); /* lane l: v2 v3 v2 v3 */
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
        quad[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)); /* lane l: v0..v3 */
    }
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88),
                                     _mm512_shuffle_f32x4(quad[0], quad[1], 0xdd));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88),
                                     _mm512_shuffle_f32x4(quad[2], quad[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xdd));
}

/* Prefetches into L2 (T1), a few at a time between the computations: a burst of them fills the
 * core's few miss buffers and stalls it until DRAM answers (measured: most of the kernel's
 * time went to such bursts). PrefetchCursor walks the K and V bytes of one block ahead. */
typedef struct {
    const char *k, *v;
    int64_t offset, end;
} PrefetchCursor;

static inline void prefetch_next(PrefetchCursor *cursor) {
    if (cursor->offset < cursor->end) {
        _mm_prefetch(cursor->k + cursor->offset, _MM_HINT_T1);
        _mm_prefetch(cursor->v + cursor->offset, _MM_HINT_T1);
        cursor->offset += 64;
    }
}

static inline void prefetch_all(PrefetchCursor *cursor) {
    while (cursor->offset < cursor->end) prefetch_next(cursor);
}

/* Blocks ahead of the one being computed whose K/V are fetched: DRAM latency is about one
 * block's worth of compute. */
#define PREFETCH_DISTANCE 2

/* One V row's 16 elements j*16.. as floats: bf16 widened, or int8 converted (its row's scale is
 * folded into the weights, see below). IS_I8 is a constant of the expanding function. */
static inline __m512 load16_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#define LOAD_V16(row, j) (IS_I8 ? load16_i8((const int8_t *)(row) + 16 * (j)) \
                                : load16_bf16((const uint16_t *)(row) + 16 * (j)))

/* p.V for the G query heads of one kv head over n keys, G a constant: each V row is widened
 * once into registers and feeds every head's accumulators, held in registers (the general path
 * below stages the widened rows in memory and reloads them per head). The FMAs run in the same
 * order per head and lane, so the results are the same bits. */
#define PV_KEYS(G)                                                                              \
    {                                                                                           \
        __m512 a[G][NV];                                                                        \
        for (int g = 0; g < G; g++) {                                                           \
            const __m512 c = _mm512_set1_ps(correction[g]);                                     \
            for (int j = 0; j < NV; j++) a[g][j] = _mm512_mul_ps(acc[kv_head * G + g][j], c);  \
        }                                                                                       \
        for (int t = 0; t < n; t++) {                                                           \
            __m512 v[NV];                                                                       \
            for (int j = 0; j < NV; j++) v[j] = LOAD_V16(v0 + t * row_bytes, j);                \
            prefetch_next(&cursor);                                                             \
            for (int g = 0; g < G; g++) {                                                       \
                const __m512 pt = _mm512_set1_ps(probs[g][t]);                                  \
                for (int j = 0; j < NV; j++) a[g][j] = _mm512_fmadd_ps(pt, v[j], a[g][j]);      \
            }                                                                                   \
        }                                                                                       \
        for (int g = 0; g < G; g++)                                                             \
            for (int j = 0; j < NV; j++) acc[kv_head * G + g][j] = a[g][j];                     \
    }

/* I8: the int8 cache (lm_console/kernels/cpu/cache_write.c's layout: each kv head's row is head_dim int8
 * and its float32 scale, row bytes head_dim + 4). A chunk's 16 K rows are converted to bf16
 * once (exact: |q| <= 127) for every head of the group, and each key's score is scaled by its
 * row's scale after the dot product; the V scales are folded into the softmax weights, so p.V
 * runs on the converted integers. The running sums take the weights before that folding. */
#define DEFINE_DECODE_REQUEST_DP(NAME, NB, I8)                                                 \
static void NAME(const uint16_t *q_row, const void *k_cache, const void *v_cache,            \
                 int64_t block_stride, const int32_t *blocks, int seq_len, int num_heads,      \
                 int num_kv_heads, int block_size, float scale, int window, float soft_cap,    \
                 uint16_t *out_row) {                                                           \
    enum { D = 32 * NB, NV = 2 * NB, IS_I8 = I8, HEAD_BYTES = I8 ? D + 4 : 2 * D };            \
    const int group = num_heads / num_kv_heads;                                                 \
    const int64_t row_bytes = (int64_t)num_kv_heads * HEAD_BYTES;                               \
    const int64_t block_bytes = (int64_t)block_size * row_bytes;                                \
    const int64_t stride_bytes = block_stride * (I8 ? 1 : 2);                                   \
    const char *k_base = (const char *)k_cache, *v_base = (const char *)v_cache;                \
    __m512 acc[MAX_HEADS][NV]; /* [head] */                                                     \
    float running_max[MAX_HEADS], running_sum[MAX_HEADS];                                       \
    float probs[MAX_GROUP][KEYS] __attribute__((aligned(64)));                                  \
    float values[KEYS][D] __attribute__((aligned(64)));                                         \
    __m512bh k_bf16[I8 ? KEYS : 1][NB]; /* I8: the chunk's K rows, converted */                 \
    float k_scales[KEYS] __attribute__((aligned(64))), v_scales[KEYS] __attribute__((aligned(64))); \
    for (int h = 0; h < num_heads; h++) {                                                       \
        for (int j = 0; j < NV; j++) acc[h][j] = _mm512_setzero_ps();                           \
        running_max[h] = -FLT_MAX;                                                              \
        running_sum[h] = 0.f;                                                                   \
    }                                                                                           \
    const int start = (window > 0 && seq_len > window) ? seq_len - window : 0;                  \
    const int first_block = start / block_size, last_block = (seq_len - 1) / block_size;       \
    PrefetchCursor cursor = {0};                                                                \
    for (int b = first_block; b <= last_block && b < first_block + PREFETCH_DISTANCE; b++) {    \
        cursor = (PrefetchCursor){k_base + blocks[b] * stride_bytes,                            \
                                  v_base + blocks[b] * stride_bytes, 0, block_bytes};           \
        prefetch_all(&cursor);                                                                  \
    }                                                                                           \
    for (int b = first_block; b <= last_block; b++) {                                           \
        if (b + PREFETCH_DISTANCE <= last_block) {                                              \
            prefetch_all(&cursor); /* whatever the last block left */                          \
            const int64_t ahead = blocks[b + PREFETCH_DISTANCE] * stride_bytes;                 \
            cursor = (PrefetchCursor){k_base + ahead, v_base + ahead, 0, block_bytes};          \
        }                                                                                       \
        const int first = b * block_size;                                                       \
        const int lo = first < start ? start - first : 0;                                       \
        const int hi = seq_len - first < block_size ? seq_len - first : block_size;             \
        const char *k_block = k_base + blocks[b] * stride_bytes;                                \
        const char *v_block = v_base + blocks[b] * stride_bytes;                                \
        for (int key0 = lo; key0 < hi; key0 += KEYS) {                                          \
            const int n = hi - key0 < KEYS ? hi - key0 : KEYS;                                  \
            const __mmask16 valid = (__mmask16)((1u << n) - 1u);                                \
            for (int kv_head = 0; kv_head < num_kv_heads; kv_head++) {                          \
                const char *k0 = k_block + key0 * row_bytes + kv_head * HEAD_BYTES;             \
                const char *v0 = v_block + key0 * row_bytes + kv_head * HEAD_BYTES;             \
                __m512 key_scale = _mm512_set1_ps(scale), v_scale = _mm512_set1_ps(1.f);        \
                if (I8) {                                                                       \
                    for (int t = 0; t < KEYS; t++) {                                            \
                        if (t < n) {                                                            \
                            const int8_t *k = (const int8_t *)(k0 + t * row_bytes);             \
                            for (int j = 0; j < NB; j++)                                        \
                                k_bf16[t][j] = _mm512_cvtne2ps_pbh(load16_i8(k + 32 * j + 16),  \
                                                                   load16_i8(k + 32 * j));      \
                            memcpy(&k_scales[t], k + D, sizeof(float));                         \
                            memcpy(&v_scales[t], v0 + t * row_bytes + D, sizeof(float));        \
                        } else {                                                                \
                            k_scales[t] = v_scales[t] = 0.f;                                    \
                        }                                                                       \
                    }                                                                           \
                    key_scale = _mm512_mul_ps(_mm512_load_ps(k_scales), key_scale);             \
                    v_scale = _mm512_load_ps(v_scales);                                         \
                }                                                                               \
                float correction[MAX_GROUP];                                                    \
                for (int g = 0; g < group; g++) {                                               \
                    const int h = kv_head * group + g;                                          \
                    __m512bh qb[NB];                                                            \
                    for (int j = 0; j < NB; j++)                                                \
                        qb[j] = (__m512bh)_mm512_loadu_si512(q_row + (int64_t)h * D + 32 * j); \
                    __m512 partial[KEYS];                                                       \
                    for (int t = 0; t < KEYS; t++) {                                            \
                        __m512 s = _mm512_setzero_ps();                                         \
                        if (n == KEYS || t < n) {                                               \
                            const uint16_t *k = (const uint16_t *)(k0 + t * row_bytes);         \
                            for (int j = 0; j < NB; j++)                                        \
                                s = _mm512_dpbf16_ps(s, qb[j], I8 ? k_bf16[t][j]                \
                                                     : (__m512bh)_mm512_loadu_si512(k + 32 * j)); \
                            if (!I8 && n == KEYS) prefetch_next(&cursor);                       \
                        }                                                                       \
                        partial[t] = s;                                                         \
                    }                                                                           \
                    __m512 scores = _mm512_mul_ps(sum16(partial), key_scale);                   \
                    if (soft_cap > 0.f) {                                                       \
                        float tmp[KEYS];                                                        \
                        _mm512_storeu_ps(tmp, scores);                                          \
                        for (int t = 0; t < KEYS; t++) tmp[t] = soft_cap * tanhf(tmp[t] / soft_cap); \
                        scores = _mm512_loadu_ps(tmp);                                          \
                    }                                                                           \
                    const float block_max = _mm512_mask_reduce_max_ps(valid, scores);           \
                    const float new_max = block_max > running_max[h] ? block_max : running_max[h]; \
                    const __m512 p = _mm512_maskz_mov_ps(valid, exp_nonpositive_ps(               \
                        _mm512_sub_ps(scores, _mm512_set1_ps(new_max))));                       \
                    correction[g] = expf(running_max[h] - new_max);                             \
                    running_sum[h] = running_sum[h] * correction[g] + _mm512_reduce_add_ps(p);  \
                    running_max[h] = new_max;                                                   \
                    _mm512_store_ps(probs[g], I8 ? _mm512_mul_ps(p, v_scale) : p);              \
                }                                                                               \
                if (I8) for (int t = 0; t < n; t++) prefetch_next(&cursor);                     \
                if (NB == 2 && group <= 6) { /* the group's accumulators fit the registers */   \
                    switch (group) {                                                            \
                    case 1: PV_KEYS(1) break;                                                   \
                    case 2: PV_KEYS(2) break;                                                   \
                    case 3: PV_KEYS(3) break;                                                   \
                    case 4: PV_KEYS(4) break;                                                   \
                    case 5: PV_KEYS(5) break;                                                   \
                    default: PV_KEYS(6) break;                                                  \
                    }                                                                           \
                    continue;                                                                   \
                }                                                                               \
                for (int t = 0; t < n; t++) {                                                   \
                    for (int j = 0; j < NV; j++)                                                \
                        _mm512_store_ps(values[t] + 16 * j, LOAD_V16(v0 + t * row_bytes, j));   \
                    prefetch_next(&cursor);                                                     \
                }                                                                               \
                for (int g = 0; g < group; g++) {                                               \
                    const int h = kv_head * group + g;                                          \
                    const __m512 c = _mm512_set1_ps(correction[g]);                             \
                    __m512 a[NV];                                                               \
                    for (int j = 0; j < NV; j++) a[j] = _mm512_mul_ps(acc[h][j], c);            \
                    for (int t = 0; t < n; t++) {                                               \
                        const __m512 pt = _mm512_set1_ps(probs[g][t]);                          \
                        for (int j = 0; j < NV; j++)                                            \
                            a[j] = _mm512_fmadd_ps(pt, _mm512_load_ps(values[t] + 16 * j), a[j]); \
                    }                                                                           \
                    for (int j = 0; j < NV; j++) acc[h][j] = a[j];                              \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int h = 0; h < num_heads; h++) {                                                       \
        const __m512 inv = _mm512_set1_ps(running_sum[h] > 0.f ? 1.f / running_sum[h] : 0.f);   \
        float tmp[16];                                                                          \
        for (int j = 0; j < NV; j++) {                                                          \
            _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[h][j], inv));                               \
            for (int d = 0; d < 16; d++) out_row[(int64_t)h * D + 16 * j + d] = float_to_bf16(tmp[d]); \
        }                                                                                       \
    }                                                                                           \
}

DEFINE_DECODE_REQUEST_DP(decode_request_bf16_d64, 2, 0)
DEFINE_DECODE_REQUEST_DP(decode_request_bf16_d128, 4, 0)
DEFINE_DECODE_REQUEST_DP(decode_request_int8_d64, 2, 1)
DEFINE_DECODE_REQUEST_DP(decode_request_int8_d128, 4, 1)
#endif

typedef void (*task_bf16_fn)(const uint16_t *, const uint16_t *, const uint16_t *, int64_t,
                             const int32_t *, int, int, int, int, int, int, float, int, float,
                             uint16_t *);
typedef void (*task_f32_fn)(const float *, const float *, const float *, int64_t,
                            const int32_t *, int, int, int, int, int, int, float, int, float,
                            float *);

typedef void (*request_bf16_fn)(const uint16_t *, const void *, const void *, int64_t,
                                const int32_t *, int, int, int, int, float, int, float, uint16_t *);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PICK_REQUEST_BF16(head_dim, num_heads) ((num_heads) > MAX_HEADS ? NULL \
    : (head_dim) == 64 ? decode_request_bf16_d64 : (head_dim) == 128 ? decode_request_bf16_d128 : NULL)
#define PICK_REQUEST_INT8(head_dim, num_heads) ((num_heads) > MAX_HEADS ? NULL \
    : (head_dim) == 64 ? decode_request_int8_d64 : (head_dim) == 128 ? decode_request_int8_d128 : NULL)
#else
#define PICK_REQUEST_BF16(head_dim, num_heads) NULL
#define PICK_REQUEST_INT8(head_dim, num_heads) NULL
#endif
#define PICK_REQUEST_NONE(head_dim, num_heads) NULL

/* REQUEST picks a whole-request kernel (all kv heads per block) where one exists. */
#define DEFINE_ENTRY(NAME, TASK, T, FN, D64, D128, REQUEST)                                    \
int NAME(const T *q, int64_t q_row_stride, T *out, int64_t out_row_stride,                  \
         const int64_t *token_idx,                     \
         const T *k_cache, const T *v_cache, int64_t block_stride,                              \
         const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens,       \
         int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size,           \
         float scale, int window, float soft_cap, int64_t num_blocks, int64_t blocks_per_row) { \
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || num_kv_heads <= 0                  \
        || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP) return -1;    \
    for (int req = 0; req < num_reqs; req++)                                                    \
        if (!block_row_in_cache(block_table + (int64_t)req * block_table_stride, blocks_per_row, \
                                seq_lens[req], block_size, num_blocks)) return -3;              \
    const int group = num_heads / num_kv_heads;                                                 \
    const FN task_fn = PICK_TASK(TASK, D64, D128, head_dim);                                    \
    const request_bf16_fn request_fn = REQUEST(head_dim, num_heads);                            \
    /* One task per request, its kv heads in turn: the heads after the first find the           \
       request's blocks in this core's L2. */                                                   \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                            \
    for (int req = 0; req < num_reqs; req++) {                                                  \
        const int64_t row = token_idx ? token_idx[req] : req;                                   \
        if (request_fn) {                                                                       \
            request_fn((const uint16_t *)(q + row * q_row_stride), (const uint16_t *)k_cache,   \
                       (const uint16_t *)v_cache, block_stride,                                 \
                       block_table + (int64_t)req * block_table_stride, seq_lens[req],          \
                       num_heads, num_kv_heads, block_size, scale, window, soft_cap,            \
                       (uint16_t *)(out + row * out_row_stride));                               \
            continue;                                                                           \
        }                                                                                       \
        for (int kv_head = 0; kv_head < num_kv_heads; kv_head++)                                \
            task_fn(q + row * q_row_stride, k_cache, v_cache, block_stride,                     \
                    block_table + (int64_t)req * block_table_stride, seq_lens[req], kv_head,    \
                    group, head_dim, num_kv_heads, block_size, scale, window, soft_cap,         \
                    out + row * out_row_stride);                                                \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_ENTRY(paged_decode_attention_bf16, task_bf16, uint16_t, task_bf16_fn, task_bf16_d64, task_bf16_d128,
             PICK_REQUEST_BF16)
DEFINE_ENTRY(paged_decode_attention_f32, task_f32, float, task_f32_fn, task_f32_d64, task_f32_d128,
             PICK_REQUEST_NONE)

/* The int8 cache (bf16 q and out): the whole-request kernels only; -1 where none takes the
 * shape (head_dim 64 or 128 with AVX512-BF16: paged_int8_supported), and the caller keeps the
 * torch path. block_stride counts bytes. */
int paged_decode_attention_int8(const uint16_t *q, int64_t q_row_stride, uint16_t *out, int64_t out_row_stride,
                                const int64_t *token_idx, const void *k_cache, const void *v_cache,
                                int64_t block_stride, const int32_t *block_table, int64_t block_table_stride,
                                const int32_t *seq_lens, int num_reqs, int num_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, int window, float soft_cap,
                                int64_t num_blocks, int64_t blocks_per_row) {
    if (block_size > MAX_BLOCK || num_kv_heads <= 0 || num_heads % num_kv_heads != 0
        || num_heads / num_kv_heads > MAX_GROUP) return -1;
    const request_bf16_fn request_fn = PICK_REQUEST_INT8(head_dim, num_heads);
    if (request_fn == NULL) return -1;
    for (int req = 0; req < num_reqs; req++)
        if (!block_row_in_cache(block_table + (int64_t)req * block_table_stride, blocks_per_row,
                                seq_lens[req], block_size, num_blocks)) return -3;
    _Pragma("omp parallel for schedule(dynamic, 1)")
    for (int req = 0; req < num_reqs; req++) {
        const int64_t row = token_idx ? token_idx[req] : req;
        request_fn(q + row * q_row_stride, k_cache, v_cache, block_stride,
                   block_table + (int64_t)req * block_table_stride, seq_lens[req], num_heads,
                   num_kv_heads, block_size, scale, window, soft_cap, out + row * out_row_stride);
    }
    return 0;
}

/* Whether the int8 cache's kernels (decode here, prefill in paged_prefill.c) take this shape. */
int paged_int8_supported(int head_dim, int num_heads, int num_kv_heads, int block_size) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP
        && block_size <= MAX_BLOCK && PICK_REQUEST_INT8(head_dim, num_heads) != NULL;
}

/* Prefill chunks (query_len > 1): paged_prefill.c, compiled into the same library. */
