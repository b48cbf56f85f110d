/* A whole decoder stack's decode step in one call: the batch-1 (few rows) forward without the
 * per-layer Python, torch-dispatch and ctypes tax (loaded by lm_console/kernels/cpu_decode.py).
 *
 * The driver owns no arithmetic of its own for the quantized path: it calls the same kernels the
 * layer-by-layer forward calls, in the same order on the same inputs, so its hidden states are
 * bit-identical to that forward's. Their entry points come in a table of function pointers
 * (taken from the already-loaded libraries by the Python side), so this file does not compile
 * or link those sources again:
 *
 *   per layer   h = rms_norm(x)                  (layer 0; later layers: add_rms_norm(x, res))
 *               qkv = quant_gemm(quantize_act(h))   [+ per-head q/k rms_norm (Qwen3)]
 *               rope(q, k) in place; k, v -> paged cache slots (bf16, or the int8 cache's rows)
 *               a = paged_decode_attention(q)
 *               x = quant_gemm(a)  (o_proj); h = add_rms_norm(x, res)
 *               g = quant_gemm(h)  (gate|up); x = quant_gemm(quantize_act(silu(g_gate) * g_up))
 *                 (dense: s = silu(g_gate) * g_up stored, then the GEMV)
 *   end         out = add_rms_norm(x, res) with the final norm's weight
 *
 * With LoRA adapters in the step (a slot per row, -1 for the base model), each linear that has
 * adapter slots adds their delta to its output with the LoRA kernel the layer path calls
 * (lora.c), on the same inputs (the down projection's: silu(gate) * up, stored for it), so a
 * step with adapters stays here and its hidden states stay bit-identical to that forward's.
 *
 * Dense bf16 linears (FMT_DENSE_BF16) run this file's own GEMV (AVX512-BF16 dot products, a
 * portable loop otherwise): oneDNN cannot be called from C here; its results round alike but
 * accumulate in another order, so the dense fast path is close to, not bit-equal with, torch's.
 *
 * Everything is plain C (no intrinsics outside the dense GEMV's guarded path): the portable
 * build is the same driver.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__) && !defined(LMC_SCALAR)
#include <immintrin.h>
#define DS_BF16 1
#else
#define DS_BF16 0
#endif

typedef uint16_t bf16;

/* The kernels' signatures (lm_console/kernels/cpu/quant_gemm.c, fused_ops.c, paged_attention.c, cache_write.c). */
typedef void (*quantize_act_fn)(const void *, int64_t, int, int64_t, int64_t, int64_t, int, int8_t *,
                                float *, float *);
typedef void (*quant_gemm_fn)(int, int64_t, int64_t, int64_t, const uint8_t *, const void *,
                              const void *, const float *, const int8_t *, const float *,
                              const float *, void *, int64_t, int);
typedef void (*rms_norm_fn)(const bf16 *, int64_t, bf16 *, int64_t, const bf16 *, int64_t, int64_t,
                            float);
typedef void (*add_rms_norm_fn)(bf16 *, int64_t, const bf16 *, int64_t, bf16 *, int64_t,
                                const bf16 *, int64_t, int64_t, float);
typedef void (*rms_norm_heads_fn)(bf16 *, int64_t, const bf16 *, int64_t, int64_t, int64_t, float);
typedef void (*rotary_fn)(bf16 *, int64_t, const float *, const float *, int64_t, int64_t, int64_t);
typedef void (*silu_fn)(const bf16 *, int64_t, bf16 *, int64_t, int64_t, int64_t);
typedef int (*decode_attn_fn)(const bf16 *, int64_t, bf16 *, int64_t, const int64_t *,
                              const bf16 *, const bf16 *, int64_t, const int32_t *, int64_t,
                              const int32_t *, int, int, int, int, int, float, int, float, int64_t,
                              int64_t);
typedef int (*cache_write_fn)(const char *, int64_t, const char *, int64_t, char *, char *, int64_t,
                              const int64_t *, int64_t, int64_t, int64_t);
typedef int (*lora_add_fn)(void *, const void *, const void *, const void *, const int64_t *, const float *,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

/* Function table, in this order (lm_console/kernels/cpu_decode.py KERNELS). */
enum { K_QUANTIZE_ACT, K_QUANT_GEMM, K_RMS_NORM, K_ADD_RMS_NORM, K_RMS_NORM_HEADS, K_ROTARY,
       K_SILU, K_DECODE_ATTN, K_CACHE_WRITE, K_LORA_ADD, K_COUNT };

/* Model-wide integers (int64 each), in this order. */
enum { G_LAYERS, G_HIDDEN, G_HEADS, G_KV_HEADS, G_HEAD_DIM, G_INTER, G_BLOCK_SIZE, G_QK_NORM,
       G_MAX_ROWS, G_MAX_POSITION, G_NUM_SLOTS, G_KV_INT8, G_MAX_LORAS, G_COUNT };

/* One linear: L_COUNT int64, in this order. fmt: quant_gemm's (0 b8, 1 b4, 2 c8) or FMT_DENSE_BF16.
 * lora_a [max_loras, rank, K] and lora_b_t [max_loras, rank, N] (B transposed, as lora.c reads
 * it), bf16: its adapter slots (rank 0: none). */
enum { L_FMT, L_N, L_K, L_KP, L_W, L_SCALES, L_OFFSETS, L_BIAS, L_LORA_A, L_LORA_B, L_LORA_RANK, L_COUNT };
#define FMT_DENSE_BF16 16

/* One layer: its four linears, then these (int64 each; pointers as integers). */
enum { Y_QKV = 0, Y_O = L_COUNT, Y_GATE_UP = 2 * L_COUNT, Y_DOWN = 3 * L_COUNT,
       Y_IN_NORM = 4 * L_COUNT, Y_POST_NORM, Y_Q_NORM, Y_K_NORM, Y_K_CACHE, Y_V_CACHE,
       Y_BLOCK_STRIDE, Y_WINDOW, Y_COUNT };

/* Per-step arguments (int64 each), in this order. */
enum { S_ROWS, S_EMBEDS, S_OUT, S_POSITIONS, S_SLOTS, S_BLOCK_TABLE, S_BLOCK_TABLE_STRIDE,
       S_SEQ_LENS, S_BLOCKS_PER_ROW, S_LORA_SLOTS, S_LORA_SCALINGS, S_COUNT };

/* Scratch buffers, in this order (sized for G_MAX_ROWS rows by the caller). */
enum { B_RES_A, B_RES_B, B_NORMED, B_QKV, B_ATTN, B_GATE_UP, B_ACT, B_XQ, B_XD, B_XS, B_COS,
       B_SIN, B_COUNT };

#define PTR(type, v) ((type)(intptr_t)(v))

/* sum_k x[k] w[k] of bf16 vectors, float32 accumulation (portable order: k ascending). */
static inline float dot_bf16(const bf16 *w, const bf16 *x, int64_t K) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; k++) acc += bf16_to_float(w[k]) * bf16_to_float(x[k]);
    return acc;
}

#define DENSE_TILE 4

/* Dense bf16 GEMV/GEMM for a few rows: out[m, n] = sum_k x[m, k] w[n, k] (+ bias), float32
 * accumulation, one bf16 rounding at the store (as torch's bf16 linear rounds its output).
 * Output rows go in tiles of four (independent accumulators keep the dot-product units busy);
 * each tile's weights are read from memory once for all the tokens. */
static void dense_rows(const int64_t *lin, const bf16 *x, int64_t ldx, int64_t rows, bf16 *out,
                       int64_t ldo) {
    const int64_t N = lin[L_N], K = lin[L_K];
    const bf16 *w = PTR(const bf16 *, lin[L_W]);
    const float *bias = PTR(const float *, lin[L_BIAS]);
    const int64_t tiles = (N + DENSE_TILE - 1) / DENSE_TILE;
#pragma omp parallel for schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t n0 = tile * DENSE_TILE, nt = N - n0 < DENSE_TILE ? N - n0 : DENSE_TILE;
        for (int64_t m = 0; m < rows; m++) {
            const bf16 *xrow = x + m * ldx;
            float result[DENSE_TILE];
#if DS_BF16
            if (nt == DENSE_TILE && K % 32 == 0) {
                __m512 acc[DENSE_TILE];
                for (int r = 0; r < DENSE_TILE; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t k = 0; k < K; k += 32) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xrow + k));
                    for (int r = 0; r < DENSE_TILE; r++)
                        acc[r] = _mm512_dpbf16_ps(
                            acc[r], (__m512bh)_mm512_loadu_si512((const void *)(w + (n0 + r) * K + k)), xv);
                }
                for (int r = 0; r < DENSE_TILE; r++) result[r] = _mm512_reduce_add_ps(acc[r]);
            } else
#endif
            {
                for (int64_t r = 0; r < nt; r++) result[r] = dot_bf16(w + (n0 + r) * K, xrow, K);
            }
            for (int64_t r = 0; r < nt; r++)
                out[m * ldo + n0 + r] = float_to_bf16(result[r] + (bias ? bias[n0 + r] : 0.f));
        }
    }
}

/* out[rows, N] (row stride ldo) = linear(x[rows, K], row stride ldx), plus the step's LoRA
 * deltas where it has adapter slots and the step has adapters (lora_slots non-NULL). With kind
 * ACT_SWIGLU_BF16 x is gate | up rows [rows, 2K] and the input is silu(gate) * up: a quantized
 * linear quantizes it straight from gate | up (as the layer path does), a dense one (and the
 * LoRA delta) reads it from the act buffer. Returns 0, or the LoRA kernel's nonzero status. */
static int linear(const void *const *kern, const int64_t *g, const int64_t *lin, const bf16 *x, int64_t ldx,
                  int64_t rows, bf16 *out, int64_t ldo, void *const *buf, int kind, const int64_t *lora_slots,
                  const float *lora_scalings) {
    const int lora = lora_slots != NULL && lin[L_LORA_RANK] > 0;
    if (kind == ACT_SWIGLU_BF16 && (lin[L_FMT] == FMT_DENSE_BF16 || lora)) {
        bf16 *act = (bf16 *)buf[B_ACT];
        ((silu_fn)kern[K_SILU])(x, ldx, act, lin[L_K], rows, lin[L_K]);
        if (lin[L_FMT] == FMT_DENSE_BF16) {
            x = act;
            ldx = lin[L_K];
            kind = ACT_BF16;
        }
    }
    if (lin[L_FMT] == FMT_DENSE_BF16) {
        dense_rows(lin, x, ldx, rows, out, ldo);
    } else {
        const int64_t Kp = lin[L_KP];
        int8_t *xq = (int8_t *)buf[B_XQ];
        float *xd = (float *)buf[B_XD], *xs = (float *)buf[B_XS];
        ((quantize_act_fn)kern[K_QUANTIZE_ACT])(x, ldx, kind, rows, lin[L_K], Kp, 0, xq, xd, xs);
        ((quant_gemm_fn)kern[K_QUANT_GEMM])((int)lin[L_FMT], rows, lin[L_N], Kp, PTR(const uint8_t *, lin[L_W]),
                                            PTR(const void *, lin[L_SCALES]), PTR(const void *, lin[L_OFFSETS]),
                                            PTR(const float *, lin[L_BIAS]), xq, xd, xs, out, ldo, 1);
    }
    if (!lora) return 0;
    /* The kernel takes packed rows: every output and input buffer here is [rows, N] / [rows, K]. */
    const bf16 *lora_x = kind == ACT_SWIGLU_BF16 ? (const bf16 *)buf[B_ACT] : x;
    const int64_t lora_ldx = kind == ACT_SWIGLU_BF16 ? lin[L_K] : ldx;
    if (ldo != lin[L_N] || lora_ldx != lin[L_K]) return 4;
    return ((lora_add_fn)kern[K_LORA_ADD])(out, lora_x, PTR(const void *, lin[L_LORA_A]),
                                           PTR(const void *, lin[L_LORA_B]), lora_slots, lora_scalings, rows,
                                           lin[L_K], lin[L_N], lin[L_LORA_RANK], g[G_MAX_LORAS], 0);
}

/* Returns 0, or -1 when the step does not fit (the caller runs the layer-by-layer forward;
 * nothing was written), or the attention kernel's nonzero status, or 100 + the LoRA kernel's
 * nonzero status (100 + 4: a buffer the LoRA kernel cannot take). */
int decode_stack_run(const void *const *kern, const int64_t *g, const int64_t *layers,
                     const void *final_norm, float eps, float scale, float soft_cap,
                     const float *cos_table, const float *sin_table, void *const *buf,
                     const int64_t *step) {
    const int64_t rows = step[S_ROWS], H = g[G_HIDDEN], heads = g[G_HEADS];
    const int64_t kv_heads = g[G_KV_HEADS], D = g[G_HEAD_DIM], I = g[G_INTER];
    const int64_t q_size = heads * D, kv_size = kv_heads * D, qkv_n = q_size + 2 * kv_size;
    const int64_t *positions = PTR(const int64_t *, step[S_POSITIONS]);
    const int64_t *slots = PTR(const int64_t *, step[S_SLOTS]);
    const int64_t half = D / 2, block_size = g[G_BLOCK_SIZE];
    if (rows <= 0 || rows > g[G_MAX_ROWS]) return -1;
    for (int64_t m = 0; m < rows; m++)
        if (slots[m] < 0 || slots[m] >= g[G_NUM_SLOTS] || positions[m] < 0 || positions[m] >= g[G_MAX_POSITION])
            return -1; /* the usual forward: its reshape_and_cache names a slot past the cache */
    for (int64_t m = 0; m < rows; m++) /* likewise its attention, a block-table entry outside the cache */
        if (!block_row_in_cache(PTR(const int32_t *, step[S_BLOCK_TABLE]) + m * step[S_BLOCK_TABLE_STRIDE],
                                step[S_BLOCKS_PER_ROW], PTR(const int32_t *, step[S_SEQ_LENS])[m], block_size,
                                g[G_NUM_SLOTS] / block_size))
            return -1;

    bf16 *res = (bf16 *)buf[B_RES_A], *x = (bf16 *)buf[B_RES_B];
    bf16 *normed = (bf16 *)buf[B_NORMED], *qkv = (bf16 *)buf[B_QKV], *attn = (bf16 *)buf[B_ATTN];
    bf16 *gate_up = (bf16 *)buf[B_GATE_UP];
    float *cos_rows = (float *)buf[B_COS], *sin_rows = (float *)buf[B_SIN];
    for (int64_t m = 0; m < rows; m++) { /* the step's rope rows (as index_select takes them) */
        memcpy(cos_rows + m * half, cos_table + positions[m] * half, (size_t)half * sizeof(float));
        memcpy(sin_rows + m * half, sin_table + positions[m] * half, (size_t)half * sizeof(float));
    }
    const bf16 *embeds = PTR(const bf16 *, step[S_EMBEDS]);
    for (int64_t m = 0; m < rows; m++) memcpy(res + m * H, embeds + m * H, (size_t)H * sizeof(bf16));

    const rms_norm_fn rms_norm = (rms_norm_fn)kern[K_RMS_NORM];
    const add_rms_norm_fn add_rms_norm = (add_rms_norm_fn)kern[K_ADD_RMS_NORM];
    const int32_t *block_table = PTR(const int32_t *, step[S_BLOCK_TABLE]);
    const int32_t *seq_lens = PTR(const int32_t *, step[S_SEQ_LENS]);
    const int64_t *lora_slots = PTR(const int64_t *, step[S_LORA_SLOTS]);
    const float *lora_scalings = PTR(const float *, step[S_LORA_SCALINGS]);
    if (lora_slots && !kern[K_LORA_ADD]) return -1;
    int lora_status = 0;
#define LINEAR(lin, x, ldx, out, ldo, kind)                                                                    \
    do {                                                                                                     \
        lora_status = linear(kern, g, lin, x, ldx, rows, out, ldo, buf, kind, lora_slots, lora_scalings);    \
        if (lora_status != 0) return 100 + lora_status;                                                      \
    } while (0)
    for (int64_t l = 0; l < g[G_LAYERS]; l++) {
        const int64_t *y = layers + l * Y_COUNT;
        /* pre-attention norm; `res` holds the residual stream, `x` the last sublayer's output */
        if (l == 0) {
            rms_norm(res, H, normed, H, PTR(const bf16 *, y[Y_IN_NORM]), rows, H, eps);
        } else {
            add_rms_norm(x, H, res, H, normed, H, PTR(const bf16 *, y[Y_IN_NORM]), rows, H, eps);
            bf16 *t = res; res = x; x = t; /* the sum (in x) is the stream now */
        }
        LINEAR(y + Y_QKV, normed, H, qkv, qkv_n, ACT_BF16);
        if (g[G_QK_NORM]) {
            const rms_norm_heads_fn norm_heads = (rms_norm_heads_fn)kern[K_RMS_NORM_HEADS];
            norm_heads(qkv, qkv_n, PTR(const bf16 *, y[Y_Q_NORM]), rows, heads, D, eps);
            norm_heads(qkv + q_size, qkv_n, PTR(const bf16 *, y[Y_K_NORM]), rows, kv_heads, D, eps);
        }
        ((rotary_fn)kern[K_ROTARY])(qkv, qkv_n, cos_rows, sin_rows, rows, heads + kv_heads, D);
        bf16 *k_cache = PTR(bf16 *, y[Y_K_CACHE]), *v_cache = PTR(bf16 *, y[Y_V_CACHE]);
        const int64_t block_stride = y[Y_BLOCK_STRIDE]; /* cache elements per block (int8: bytes) */
        /* k, v -> their slots (slots checked above). The bf16 writer's last argument is the
         * element size, the int8 one's the head size (the table holds the cache's writer). */
        ((cache_write_fn)kern[K_CACHE_WRITE])((const char *)(qkv + q_size), qkv_n,
                                              (const char *)(qkv + q_size + kv_size), qkv_n, (char *)k_cache,
                                              (char *)v_cache, g[G_NUM_SLOTS], slots, rows, kv_size,
                                              g[G_KV_INT8] ? D : (int64_t)sizeof(bf16));
#ifdef _OPENMP
        /* The kernel gives each request to one thread: with one row, a parallel region would
         * only add a fork and a join (and a wait for a descheduled thread on a busy machine). */
        const int threads = omp_get_max_threads();
        if (rows == 1) omp_set_num_threads(1);
#endif
        const int status = ((decode_attn_fn)kern[K_DECODE_ATTN])(
            qkv, qkv_n, attn, q_size, NULL, k_cache, v_cache, block_stride, block_table,
            step[S_BLOCK_TABLE_STRIDE], seq_lens, (int)rows, (int)heads, (int)kv_heads, (int)D,
            (int)block_size, scale, (int)y[Y_WINDOW], soft_cap, g[G_NUM_SLOTS] / block_size,
            step[S_BLOCKS_PER_ROW]);
#ifdef _OPENMP
        if (rows == 1) omp_set_num_threads(threads);
#endif
        if (status != 0) return status;
        LINEAR(y + Y_O, attn, q_size, x, H, ACT_BF16);
        add_rms_norm(x, H, res, H, normed, H, PTR(const bf16 *, y[Y_POST_NORM]), rows, H, eps);
        { bf16 *t = res; res = x; x = t; }
        LINEAR(y + Y_GATE_UP, normed, H, gate_up, 2 * I, ACT_BF16);
        LINEAR(y + Y_DOWN, gate_up, 2 * I, x, H, ACT_SWIGLU_BF16);
    }
#undef LINEAR
    bf16 *out = PTR(bf16 *, step[S_OUT]);
    if (g[G_LAYERS] == 0) {
        rms_norm(res, H, out, H, (const bf16 *)final_norm, rows, H, eps);
        return 0;
    }
    add_rms_norm(x, H, res, H, out, H, (const bf16 *)final_norm, rows, H, eps);
    return 0;
}

int decode_stack_has_bf16(void) { return DS_BF16; }

/* One dense linear alone (tests: the driver's only arithmetic of its own). lin: L_COUNT int64. */
void decode_stack_dense_linear(const int64_t *lin, const bf16 *x, int64_t ldx, int64_t rows,
                               bf16 *out, int64_t ldo) {
    dense_rows(lin, x, ldx, rows, out, ldo);
}
