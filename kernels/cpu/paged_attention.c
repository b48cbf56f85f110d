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

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64

static inline float bf16_load(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t bf16_store_value(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

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

DEFINE_TASK(task_bf16, uint16_t, bf16_load, bf16_store_value)
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

DEFINE_TASK_AVX512(task_bf16_d64, uint16_t, load16_bf16, bf16_store_value, 4)
DEFINE_TASK_AVX512(task_bf16_d128, uint16_t, load16_bf16, bf16_store_value, 8)
DEFINE_TASK_AVX512(task_f32_d64, float, load16_f32, f32_store_value, 4)
DEFINE_TASK_AVX512(task_f32_d128, float, load16_f32, f32_store_value, 8)
#define PICK_TASK(GENERIC, D64, D128, head_dim) \
    ((head_dim) == 64 ? D64 : (head_dim) == 128 ? D128 : GENERIC)
#else
#define PICK_TASK(GENERIC, D64, D128, head_dim) GENERIC
#endif

typedef void (*task_bf16_fn)(const uint16_t *, const uint16_t *, const uint16_t *, int64_t,
                             const int32_t *, int, int, int, int, int, int, float, int, float,
                             uint16_t *);
typedef void (*task_f32_fn)(const float *, const float *, const float *, int64_t,
                            const int32_t *, int, int, int, int, int, int, float, int, float,
                            float *);

#define DEFINE_ENTRY(NAME, TASK, T, FN, D64, D128)                                                             \
int NAME(const T *q, int64_t q_row_stride, T *out, int64_t out_row_stride,                  \
         const int64_t *token_idx,                     \
         const T *k_cache, const T *v_cache, int64_t block_stride,                              \
         const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens,       \
         int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size,           \
         float scale, int window, float soft_cap) {                                             \
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || num_kv_heads <= 0                  \
        || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP) return -1;    \
    const int group = num_heads / num_kv_heads;                                                 \
    const FN task_fn = PICK_TASK(TASK, D64, D128, head_dim);                                    \
    /* One task per request, its kv heads in turn: the heads after the first find the           \
       request's blocks in this core's L2. */                                                   \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                            \
    for (int req = 0; req < num_reqs; req++) {                                                  \
        const int64_t row = token_idx ? token_idx[req] : req;                                   \
        for (int kv_head = 0; kv_head < num_kv_heads; kv_head++)                                \
            task_fn(q + row * q_row_stride, k_cache, v_cache, block_stride,                     \
                    block_table + (int64_t)req * block_table_stride, seq_lens[req], kv_head,    \
                    group, head_dim, num_kv_heads, block_size, scale, window, soft_cap,         \
                    out + row * out_row_stride);                                                \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_ENTRY(paged_decode_attention_bf16, task_bf16, uint16_t, task_bf16_fn, task_bf16_d64, task_bf16_d128)
DEFINE_ENTRY(paged_decode_attention_f32, task_f32, float, task_f32_fn, task_f32_d64, task_f32_d128)

/* Prefill chunks (query_len > 1): paged_prefill.c, compiled into the same library. */
