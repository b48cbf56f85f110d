/* Quantized-weight GEMM for CPU inference: out[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * Weights stay quantized in one of three formats, repacked once at load (lm_console/kernels/cpu_quant.py
 * pack_blocks / quantize_int8_per_channel) into one layout: K padded to Kp (a multiple of 64,
 * zero blocks), N padded to a multiple of 16 (zero rows), and the rows in TILES of 16 whose
 * bytes interleave the rows four elements at a time: within tile T, the 64 bytes of (block b,
 * chunk c) hold rows 0..15's elements 4c..4c+3 of block b, row after row. So one 512-bit
 * vector holds 16 rows' next 4 elements, which is what AVX512-VNNI's vpdpbusd wants: its 16
 * int32 lanes become 16 output rows, and an activation dword broadcast from memory feeds them
 * all. Per tile (QT_* are the element offsets):
 *
 *   FMT_B8  (GGUF Q8_0, Q6_K, ...): u8 q, Kp * 16 bytes: [nb][8][16 rows][4];
 *           fp16 d, m [nb][16 rows] (w = d * q + m per block of 32)
 *   FMT_B4  (GGUF Q4_0, Q4_1, Q4_K): Kp * 8 bytes: [nb / 2 pairs][8][16 rows][4], the low
 *           nibble from block 2p, the high one from block 2p + 1; d, m as B8 (Q4_0: m = -8d)
 *   FMT_C8  (quantization="int8"): u8 q = int8 + 128 as B8; one float32 scale per row, [Np]
 *
 * Weights are stored unsigned so that vpdpbusd (u8 x s8) takes them as they are; the
 * activations are quantized to int8 per call (quantize_act): per block of 32 (scale dx, and
 * xs = dx * sum(xq) for the offset term; per-token scales measured +2.9% perplexity on
 * SmolLM2 against +0.9% per block, so every format uses blocks).
 *
 * A tile's 8 vectors of a block accumulate in int32 (two chains of 4), then one conversion, a
 * multiply (d * dx) and two float fmas (the dot, and m * xs) per block, token and 16 rows. The
 * dot products, multiplies and fmas share the same two vector pipes (Zen 5: the conversion, the
 * loads and the nibble unpacking run beside them), so 8 vpdpbusd in 11 pipe slots bound the
 * kernel at ~8/11 of vpdpbusd's peak; it runs within ~7% of that from 16 tokens up. The
 * threads split the tiles; each tile is read once for the whole batch, up to 8 tokens at a time
 * in registers, more in passes of TPASS with the accumulators in L1, so a decode step streams
 * the weights once. Without AVX512-VNNI a portable C path computes the same int32 block sums.
 *
 * With AMX (Sapphire Rapids and later; built where the compiler targets it, used where the kernel
 * grants the tile state and LMC_QUANT_AMX is not 0), a pass of AMX_MIN_ROWS tokens or more takes
 * each block's int32 sums from the tile unit instead: one tdpbsud multiplies up to 16 tokens'
 * 32 int8 activations (A: rows of xq as they lie) by the block's 512 weight bytes (B: the tile
 * layout above is AMX's VNNI layout for 32 x 16, so B8 and C8 blocks load as stored; B4 blocks
 * are unpacked first). The sums are exact integers either way and the float epilogue is the same
 * instructions in the same order, so every output is bit-identical to the VNNI path's.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(LMC_SCALAR)
#define QG_VNNI 1
#include <immintrin.h>
#else
#define QG_VNNI 0
#endif

#if QG_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define QG_AMX 1
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#else
#define QG_AMX 0
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

/* Whether passes of AMX_MIN_ROWS tokens or more use the tile unit: -1 not decided yet, then 0/1.
 * quant_gemm_set_amx(0) turns it off (LMC_QUANT_AMX=0); (1) asks Linux for the tile state (a
 * process-wide permission, once) and keeps AMX off if it is refused. */
static int amx_enabled = -1;
static int64_t amx_calls; /* GEMM calls that took the tile path (tests: the path really ran) */

int64_t quant_gemm_amx_calls(void) { return __atomic_load_n(&amx_calls, __ATOMIC_RELAXED); }

#if QG_AMX
static void amx_probe_ops(void);

/* Whether the tile instructions run here: a forked child runs the path's operations once, so a
 * machine that reports AMX and grants the permission but faults on first use (as llama.cpp's AMX
 * path does on some VMs) loses its child, not this process. */
static int amx_probe(void) {
    const pid_t child = fork();
    if (child < 0) return 0;
    if (child == 0) {
        amx_probe_ops();
        _exit(0);
    }
    int status = 0;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) return 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
#endif

int quant_gemm_set_amx(int on) {
#if QG_AMX
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: without it the first tile instruction faults */
    static int probed = -1;
    if (on && probed < 0) probed = syscall(SYS_arch_prctl, 0x1023, 18) == 0 && amx_probe();
    amx_enabled = on && probed == 1;
#else
    (void)on;
    amx_enabled = 0;
#endif
    return amx_enabled;
}

/* Element i of an activation row (ACT_*: kind; K: the row's width, where up starts in a
 * gate | up row). */
static inline float load_x(const void *x, int kind, int64_t K, int64_t i) {
    if (kind == ACT_SWIGLU_BF16) {
        return silu_f(bf16_to_float(((const uint16_t *)x)[i])) * bf16_to_float(((const uint16_t *)x)[K + i]);
    }
    return kind == ACT_BF16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

#if QG_VNNI
static inline __m512 load_raw16(const void *row, int is_bf16, int64_t k0, __mmask16 mask) {
    if (is_bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + k0);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)row + k0);
}

/* 16 activations k0.. of a row as floats (masked: `valid` of them, the rest zero). */
static inline __m512 load_x16(const void *row, int kind, int64_t K, int64_t k0, int valid) {
    const __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1u);
    if (kind == ACT_SWIGLU_BF16)
        return _mm512_mul_ps(silu_ps(load_raw16(row, 1, k0, mask)), load_raw16(row, 1, K + k0, mask));
    return load_raw16(row, kind == ACT_BF16, k0, mask);
}

/* One block of 32 (k0.., `valid` real values) -> q[32], its scale; returns the sum of q. */
static inline int32_t quantize_block(const void *row, int kind, int64_t K, int64_t k0, int valid, int8_t *q,
                                     float *scale) {
    const __m512 v0 = load_x16(row, kind, K, k0, valid), v1 = load_x16(row, kind, K, k0 + 16, valid - 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    /* cvtps rounds to nearest even, as lrintf in the portable path */
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
    *scale = d;
    return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}
#endif

/* Quantize row m of x (see quantize_act). */
static void quantize_row(const void *x, int64_t ldx, int kind, int64_t m, int64_t K, int64_t Kp,
                         int per_token, int8_t *xq, float *xd, float *xs) {
    const int64_t nb = Kp / QBLOCK;
    const void *row = (const char *)x + m * ldx * (kind == ACT_F32 ? 4 : 2);
    int8_t *q = xq + m * Kp;
    if (per_token) {
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(load_x(row, kind, K, k)));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; k++) {
            const int32_t v = (int32_t)lrintf(load_x(row, kind, K, k) * inv);
            q[k] = (int8_t)v;
            sum += v;
        }
        memset(q + K, 0, (size_t)(Kp - K));
        xd[m] = d;
        xs[m] = (float)sum;
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k0 = b * QBLOCK, k1 = k0 + QBLOCK < K ? k0 + QBLOCK : K;
        float d;
#if QG_VNNI
        const int32_t sum = quantize_block(row, kind, K, k0, (int)(k1 - k0), q + k0, &d);
#else
        float amax = 0.f;
        for (int64_t k = k0; k < k1; k++) amax = fmaxf(amax, fabsf(load_x(row, kind, K, k)));
        d = amax / 127.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int64_t k = k0; k < k0 + QBLOCK; k++) {
            const int32_t v = k < k1 ? (int32_t)lrintf(load_x(row, kind, K, k) * inv) : 0;
            q[k] = (int8_t)v;
            sum += v;
        }
#endif
        xd[m * nb + b] = d;
        xs[m * nb + b] = d * (float)sum;
    }
}

/* Quantize rows x[M, K] (kind: ACT_F32, ACT_BF16, or ACT_SWIGLU_BF16 with x [M, 2K] gate | up;
 * row stride ldx elements) to xq[M, Kp] int8 (zero padded).
 * per_token = 0: per block of 32, xd[M, Kp/32] scales and xs[M, Kp/32] = xd * sum(xq);
 * per_token = 1: xd[M] one scale per row and xs[M] = sum(xq) (an integer, as float). */
void quantize_act(const void *x, int64_t ldx, int kind, int64_t M, int64_t K, int64_t Kp,
                  int per_token, int8_t *xq, float *xd, float *xs) {
    /* vectorized, a row is ~0.1 us a thousand elements: threads only for prefill-sized batches */
#pragma omp parallel for schedule(static) if (M * K > (1 << 16))
    for (int64_t m = 0; m < M; m++) quantize_row(x, ldx, kind, m, K, Kp, per_token, xq, xd, xs);
}

#define NR 16 /* rows a tile */
#define TT 8 /* tokens a register tile (below TT + 1, the accumulators stay in registers) */
/* Tokens a pass over a tile's weights with the accumulators in memory. Longer passes load and
 * unpack the weights less often, but measured 30% slower than 32 where the weights and outputs
 * stream from DRAM (a 49152-row head at 512 tokens), for at most 3% faster where they don't. */
#define TPASS 32
/* Batches of 16 tokens and more run as tasks of (TCHUNK tokens, two tiles): a chunk's int8
 * activations (TCHUNK x Kp bytes, 196 KB at K = 1536) stay in L2 while the threads walk the
 * tiles; a whole 2048-token prefill's (3 MB) would stream from L3 once per tile. */
#define TCHUNK 128

/* Bytes of one tile's quantized values. */
static inline int64_t tile_bytes(int fmt, int64_t Kp) { return fmt == FMT_B4 ? Kp * 8 : Kp * 16; }

/* Unsigned weight element k of row `lane` of the tile at `tw`. */
static inline int32_t weight_q(const uint8_t *tw, int fmt, int lane, int64_t k) {
    const int64_t b = k / QBLOCK, c = (k % QBLOCK) / 4, j = k % 4;
    if (fmt != FMT_B4) return tw[(b * 8 + c) * 64 + lane * 4 + j];
    const uint8_t byte = tw[((b / 2) * 8 + c) * 64 + lane * 4 + j];
    return b % 2 ? byte >> 4 : byte & 0xf;
}

static inline void store_out(void *out, int out_bf16, int64_t i, float v) {
    if (out_bf16) ((uint16_t *)out)[i] = float_to_bf16(v);
    else ((float *)out)[i] = v;
}

/* Block b's scale and offset of row `lane` of tile `tile` (w = d * q + m); FMT_C8: d = s, m = -128 s. */
static inline void block_scale(int fmt, const void *wd_, const void *wm_, int64_t tile, int lane,
                               int64_t nb, int64_t b, float *d, float *m) {
    if (fmt == FMT_C8) {
        *d = ((const float *)wd_)[tile * NR + lane];
        *m = -128.f * *d;
        return;
    }
    *d = half_to_float(((const uint16_t *)wd_)[(tile * nb + b) * NR + lane]);
    *m = half_to_float(((const uint16_t *)wm_)[(tile * nb + b) * NR + lane]);
}

#if QG_VNNI
/* Vector c of block b of a tile: 16 rows x 4 unsigned values. */
static inline __attribute__((always_inline)) __m512i tile_vec(const uint8_t *tw, const int is4, int64_t b,
                                                              int c) {
    if (!is4) return _mm512_loadu_si512((const void *)(tw + (b * 8 + c) * 64));
    __m512i v = _mm512_loadu_si512((const void *)(tw + ((b >> 1) * 8 + c) * 64));
    if (b & 1) v = _mm512_srli_epi32(v, 4);
    return _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
}

/* One tile (16 rows) x T tokens -> acc[T]. T <= TT a compile-time constant where inlined: fully
 * unrolled, the accumulators stay in registers; T a run-time count (up to TPASS): they stay in
 * L1 (a load and a store per token and block, on ports the arithmetic leaves idle) and the
 * tile's weight vectors are loaded, unpacked and their scales converted once per T tokens
 * (16-token register tiles, which spill, measured 3% slower at M = 32 than this).
 * chan: FMT_C8 (one scale per row: d and m the same for every block). pw (NULL: none): a later
 * tile's weights, prefetched to L2 a block's share at a time while this one computes, so that
 * the weights' DRAM stream hides behind the arithmetic (prefetching the scales too measured
 * 10% slower for one token, and no faster for more). */
static inline __attribute__((always_inline)) void tile_tokens(
    const int64_t T, const int is4, const int chan, int64_t nb, int64_t Kp, const uint8_t *tw,
    const void *td, const void *tm, const int8_t *xq, const float *xd, const float *xs,
    const uint8_t *pw, __m512 *acc) {
    for (int64_t t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    __m512 d = _mm512_setzero_ps(), m = d;
    if (chan) {
        d = _mm512_loadu_ps((const float *)td);
        m = _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
    }
    for (int64_t b = 0; b < nb; b++) {
        if (!chan) {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)td + b * NR)));
            m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)tm + b * NR)));
        }
        __m512i w[8];
        for (int c = 0; c < 8; c++) w[c] = tile_vec(tw, is4, b, c);
        if (pw) /* a block's share of the bytes (b4: 256 of a pair's 512), spread evenly */
            for (int c = 0; c < (is4 ? 4 : 8); c++) _mm_prefetch((const char *)pw + b * (is4 ? 256 : 512) + c * 64, _MM_HINT_T1);
        for (int64_t t = 0; t < T; t++) {
            const int32_t *xp = (const int32_t *)(xq + t * Kp + b * QBLOCK);
            /* two chains of 4 (exact int32 sums, added): half the latency of one chain of 8, so
             * the out-of-order window overlaps more tokens */
            __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xp[0]));
            __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], _mm512_set1_epi32(xp[4]));
            for (int c = 1; c < 4; c++) {
                i0 = _mm512_dpbusd_epi32(i0, w[c], _mm512_set1_epi32(xp[c]));
                i1 = _mm512_dpbusd_epi32(i1, w[c + 4], _mm512_set1_epi32(xp[c + 4]));
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
            acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(xd[t * nb + b])), acc[t]);
            acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}

#if QG_AMX
/* Fewer tokens than this keep the VNNI path: a pass's fixed costs (the tile config, the B loads,
 * the stores) outweigh the 8 vpdpbusd per token and block it saves below ~16 tokens (one core of
 * the Sapphire Rapids VM, 1536 x 576 Q4_1: 8 tokens 0.79x, 16 1.09x, 32 to 1024 1.24-1.29x). */
#define AMX_MIN_ROWS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tile_tokens for up to 32 tokens (T <= TPASS) with the tile unit's block sums. Tiles: C tmm0-3
 * (token chunk 0 / 1 x block b / b + 1, 16 int32 a row), A tmm4 / tmm5 (chunk 0 / 1: its tokens'
 * 32 int8 of a block, rows of xq as they lie), B tmm6 / tmm7 (blocks b / b + 1: 8 x 64 weight
 * bytes). Blocks go in pairs (Kp is a whole number of pairs), so four independent dot products
 * are in flight and a B4 pair is unpacked once for all the tokens. */
static void tile_tokens_amx(const int64_t T, const int is4, const int chan, int64_t nb, int64_t Kp,
                            const uint8_t *tw, const void *td, const void *tm, const int8_t *xq,
                            const float *xd, const float *xs, const uint8_t *pw, __m512 *acc) {
    for (int64_t t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    __m512 d[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, m[2] = {d[0], d[0]};
    if (chan) {
        d[0] = d[1] = _mm512_loadu_ps((const float *)td);
        m[0] = m[1] = _mm512_mul_ps(d[0], _mm512_set1_ps(-128.f));
    }
    const int rows0 = T < 16 ? (int)T : 16, rows1 = T > 16 ? (int)(T - 16) : 0;
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 4; i++) cfg.rows[i] = (uint8_t)(i < 2 ? rows0 : rows1), cfg.colsb[i] = 64;
    cfg.rows[4] = (uint8_t)rows0, cfg.colsb[4] = QBLOCK;
    cfg.rows[5] = (uint8_t)rows1, cfg.colsb[5] = QBLOCK;
    cfg.rows[6] = cfg.rows[7] = 8, cfg.colsb[6] = cfg.colsb[7] = 64;
    if (!rows1) cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = 0, cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = 0;
    _tile_loadconfig(&cfg); /* every call: other code on this thread (oneDNN) loads its own */
    int32_t sums[4][16 * 16] __attribute__((aligned(64)));
    uint8_t unpacked[2][512] __attribute__((aligned(64)));
    const int8_t *x1 = xq + 16 * Kp;
    for (int64_t b = 0; b < nb; b += 2) {
        if (!chan)
            for (int j = 0; j < 2; j++) {
                d[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)td + (b + j) * NR)));
                m[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)tm + (b + j) * NR)));
            }
        const uint8_t *w0 = tw + b * 512, *w1 = w0 + 512;
        if (is4) {
            for (int j = 0; j < 2; j++)
                for (int c = 0; c < 8; c++)
                    _mm512_store_si512((void *)(unpacked[j] + c * 64), tile_vec(tw, 1, b + j, c));
            w0 = unpacked[0], w1 = unpacked[1];
        }
        if (pw)
            for (int c = 0; c < (is4 ? 8 : 16); c++) _mm_prefetch((const char *)pw + b * (is4 ? 256 : 512) + c * 64, _MM_HINT_T1);
        _tile_loadd(6, w0, 64);
        _tile_loadd(7, w1, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(4, xq + b * QBLOCK, Kp);
        _tile_dpbsud(0, 4, 6);
        if (rows1) {
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(5, x1 + b * QBLOCK, Kp);
            _tile_dpbsud(2, 5, 6);
        }
        _tile_loadd(4, xq + (b + 1) * QBLOCK, Kp);
        _tile_dpbsud(1, 4, 7);
        if (rows1) {
            _tile_loadd(5, x1 + (b + 1) * QBLOCK, Kp);
            _tile_dpbsud(3, 5, 7);
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        if (rows1) {
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
        }
        /* the VNNI path's epilogue, per token: block b, then b + 1 */
        for (int64_t t = 0; t < T; t++) {
            const int chunk = t < 16 ? 0 : 2, row = (int)(t & 15);
            for (int j = 0; j < 2; j++) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sums[chunk + j] + row * 16)));
                acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d[j], _mm512_set1_ps(xd[t * nb + b + j])), acc[t]);
                acc[t] = _mm512_fmadd_ps(m[j], _mm512_set1_ps(xs[t * nb + b + j]), acc[t]);
            }
        }
    }
    _tile_release();
}

static void amx_probe_ops(void) {
    /* 16 tokens x one pair of blocks of one C8 tile (all zero) */
    static int8_t x[16 * 64] __attribute__((aligned(64)));
    static uint8_t w[1024] __attribute__((aligned(64)));
    static const float xd[16 * 2], xs[16 * 2], d[16];
    __m512 acc[16];
    tile_tokens_amx(16, 0, 1, 2, 64, w, d, NULL, x, xd, xs, NULL, acc);
}
#endif

/* 16 float32 results (+ bias) to out[o + n0 .. o + n0 + nr), as bf16 or float32. */
static inline void store_tile_row(void *out, int out_bf16, int64_t o, int64_t n0, int nr, __m512 v,
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

/* tile_tokens for one format (is4, chan constant): inlined copies for T = 1..TT in registers,
 * and one for more tokens with the accumulators in memory. */
#define TILE_TOKENS_CASE(N_, IS4, CHAN) \
    case N_: tile_tokens(N_, IS4, CHAN, nb, Kp, tw, td, tm, x, dx, sx, pw, acc); break;
#define TILE_TOKENS_SWITCH(IS4, CHAN)                                                              \
    switch (nt) {                                                                                  \
    TILE_TOKENS_CASE(1, IS4, CHAN) TILE_TOKENS_CASE(2, IS4, CHAN) TILE_TOKENS_CASE(3, IS4, CHAN)    \
    TILE_TOKENS_CASE(4, IS4, CHAN) TILE_TOKENS_CASE(5, IS4, CHAN) TILE_TOKENS_CASE(6, IS4, CHAN)    \
    TILE_TOKENS_CASE(7, IS4, CHAN) TILE_TOKENS_CASE(8, IS4, CHAN)                                   \
    default: tile_tokens(nt, IS4, CHAN, nb, Kp, tw, td, tm, x, dx, sx, pw, acc); break;              \
    }

/* Tile `tile` (rows n0 = 16 tile .. + nr) against every token, TPASS tokens at a time. pfd: how
 * many tiles ahead is the one this thread computes next (1, or past the other threads' tasks
 * where they take turns), whose weights are prefetched meanwhile, and its output lines too if
 * pf_out. */
static void tile_gemm(int fmt, int64_t M, int64_t N, int64_t tile, int nr, int64_t Kp, const uint8_t *w,
                      const void *wd_, const void *wm_, const float *bias, const int8_t *xq,
                      const float *xd, const float *xs, void *out, int64_t ldo, int out_bf16, int pfd,
                      int pf_out) {
    const int64_t nb = Kp / QBLOCK, n0 = tile * NR, osize = out_bf16 ? 2 : 4;
    const uint8_t *tw = w + tile * tile_bytes(fmt, Kp);
    const void *td = fmt == FMT_C8 ? (const void *)((const float *)wd_ + n0)
                                   : (const void *)((const uint16_t *)wd_ + tile * nb * NR);
    const void *tm = fmt == FMT_C8 ? NULL : (const void *)((const uint16_t *)wm_ + tile * nb * NR);
    const int64_t next = tile + pfd;
    const int has_next = next * NR < N;
    __m512 acc[TPASS];
    for (int64_t t0 = 0; t0 < M; t0 += TPASS) {
        const int64_t nt = M - t0 < TPASS ? M - t0 : TPASS;
        const int8_t *x = xq + t0 * Kp;
        const float *dx = xd + t0 * nb, *sx = xs + t0 * nb;
        const uint8_t *pw = t0 == 0 && has_next ? w + next * tile_bytes(fmt, Kp) : NULL;
        if (pf_out && has_next)
            for (int64_t t = 0; t < nt; t++) __builtin_prefetch((char *)out + ((t0 + t) * ldo + next * NR) * osize, 1, 3);
#if QG_AMX
        if (amx_enabled == 1 && nt >= AMX_MIN_ROWS) {
            tile_tokens_amx(nt, fmt == FMT_B4, fmt == FMT_C8, nb, Kp, tw, td, tm, x, dx, sx, pw, acc);
        } else
#endif
        if (fmt == FMT_B4) {
            TILE_TOKENS_SWITCH(1, 0)
        } else if (fmt == FMT_B8) {
            TILE_TOKENS_SWITCH(0, 0)
        } else {
            TILE_TOKENS_SWITCH(0, 1)
        }
        for (int64_t t = 0; t < nt; t++) store_tile_row(out, out_bf16, (t0 + t) * ldo, n0, nr, acc[t], bias);
    }
}
#else
/* Portable: the 16 lanes' int32 dots of one block (8 chunks of 16 lanes x 4 bytes); shift and
 * mask are constants at each call, so every format gets its own vectorized loop. */
static inline __attribute__((always_inline)) void block_dots_portable(const uint8_t *blk, const int8_t *x, int shift,
                                                                     int mask, int32_t *dot) {
    for (int lane = 0; lane < NR; lane++) dot[lane] = 0;
    for (int c = 0; c < 8; c++) {
        const uint8_t *p = blk + c * 64;
        const int32_t x0 = x[c * 4], x1 = x[c * 4 + 1], x2 = x[c * 4 + 2], x3 = x[c * 4 + 3];
        for (int lane = 0; lane < NR; lane++)
            dot[lane] += ((p[lane * 4] >> shift) & mask) * x0 + ((p[lane * 4 + 1] >> shift) & mask) * x1
                         + ((p[lane * 4 + 2] >> shift) & mask) * x2 + ((p[lane * 4 + 3] >> shift) & mask) * x3;
    }
}

/* Portable: a tile's 16 rows against every token, the same int32 block sums and float steps as
 * the VNNI path. Written over the tile's own layout, so the compiler vectorizes the 16 lanes
 * (AVX2: 8 int32 a vector); indexing element by element measured ~5x slower than dense bf16 on
 * an AVX2-only CPU. */
static void tile_gemm_portable(int fmt, int64_t M, int64_t tile, int nr, int64_t Kp, const uint8_t *w,
                               const void *wd_, const void *wm_, const float *bias, const int8_t *xq,
                               const float *xd, const float *xs, void *out, int64_t ldo, int out_bf16) {
    const int64_t nb = Kp / QBLOCK;
    const uint8_t *tw = w + tile * tile_bytes(fmt, Kp);
    float d[NR], m[NR];
    for (int64_t t = 0; t < M; t++) {
        const int8_t *x = xq + t * Kp;
        float total[NR] = {0.f};
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot[NR];
            if (fmt != FMT_B4) block_dots_portable(tw + b * 8 * 64, x + b * QBLOCK, 0, 0xff, dot);
            /* FMT_B4: blocks 2i and 2i + 1 share bytes, low and high nibbles */
            else if (b % 2) block_dots_portable(tw + (b / 2) * 8 * 64, x + b * QBLOCK, 4, 0xf, dot);
            else block_dots_portable(tw + (b / 2) * 8 * 64, x + b * QBLOCK, 0, 0xf, dot);
            for (int lane = 0; lane < nr; lane++) block_scale(fmt, wd_, wm_, tile, lane, nb, b, &d[lane], &m[lane]);
            const float dx = xd[t * nb + b], sx = xs[t * nb + b];
            for (int lane = 0; lane < nr; lane++) total[lane] += (float)dot[lane] * (d[lane] * dx) + m[lane] * sx;
        }
        for (int lane = 0; lane < nr; lane++)
            store_out(out, out_bf16, t * ldo + tile * NR + lane, total[lane] + (bias ? bias[tile * NR + lane] : 0.f));
    }
}
#endif

/* One tile of 16 output rows against every token (pfd, pf_out: tile_gemm's). */
static inline void gemm_tile(int fmt, int64_t M, int64_t N, int64_t tile, int64_t Kp, const uint8_t *w,
                             const void *wd_, const void *wm_, const float *bias, const int8_t *xq,
                             const float *xd, const float *xs, void *out, int64_t ldo, int out_bf16,
                             int pfd, int pf_out) {
    const int nr = N - tile * NR < NR ? (int)(N - tile * NR) : NR;
#if QG_VNNI
    tile_gemm(fmt, M, N, tile, nr, Kp, w, wd_, wm_, bias, xq, xd, xs, out, ldo, out_bf16, pfd, pf_out);
#else
    (void)N, (void)pfd, (void)pf_out;
    tile_gemm_portable(fmt, M, tile, nr, Kp, w, wd_, wm_, bias, xq, xd, xs, out, ldo, out_bf16);
#endif
}

/* Whether the output lines are claimed for writing a tile ahead: where they are too many to
 * stay in L2 (the head's, a prefill's), each store would otherwise stall on a read for
 * ownership (the 49152-row head at 32 tokens: +10 to +15%, a 2048-token prefill's linears +3%);
 * smaller outputs are in cache already and the prefetches only cost (-4% at 8 tokens). */
static inline int prefetch_out(int64_t M, int64_t ldo, int out_bf16) {
    return M * ldo * (out_bf16 ? 2 : 4) > (1 << 20);
}

/* The calling thread's team size: the threads take the tasks in turns, so a thread's next task
 * is about this many tasks ahead. */
static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* A task: TCHUNK tokens x TASK_TILES adjacent tiles. Two tiles of bf16 outputs are whole
 * 64-byte lines, so two threads never write the same output line at the same time. */
#define TASK_TILES 2

static inline int64_t gemm_tasks(int64_t M, int64_t tiles) {
    return (M + TCHUNK - 1) / TCHUNK * ((tiles + TASK_TILES - 1) / TASK_TILES);
}

static inline void gemm_task(int fmt, int64_t M, int64_t N, int64_t task, int64_t tiles, int64_t Kp,
                             const uint8_t *w, const void *wd_, const void *wm_, const float *bias,
                             const int8_t *xq, const float *xd, const float *xs, void *out, int64_t ldo,
                             int out_bf16) {
    const int64_t units = (tiles + TASK_TILES - 1) / TASK_TILES;
    const int64_t nb = Kp / QBLOCK, t0 = task / units * TCHUNK, tile0 = task % units * TASK_TILES;
    const int64_t mt = M - t0 < TCHUNK ? M - t0 : TCHUNK;
    const int team = team_size();
    for (int64_t tile = tile0; tile < tile0 + TASK_TILES && tile < tiles; tile++)
        /* the last tile's successor is the thread's next task, about a team of tasks on */
        gemm_tile(fmt, mt, N, tile, Kp, w, wd_, wm_, bias, xq + t0 * Kp, xd + t0 * nb, xs + t0 * nb,
                  (char *)out + t0 * ldo * (out_bf16 ? 2 : 4), ldo, out_bf16,
                  tile + 1 < tile0 + TASK_TILES ? 1 : TASK_TILES * (team - 1) + 1, prefetch_out(M, ldo, out_bf16));
}

/* Count a call of M tokens that takes the tile path (any M >= AMX_MIN_ROWS: its first pass has
 * that many tokens): once per call on the calling thread, not per tile in the threads. */
static inline void count_amx_call(int64_t M) {
#if QG_AMX
    if (amx_enabled == 1 && M >= AMX_MIN_ROWS) __atomic_fetch_add(&amx_calls, 1, __ATOMIC_RELAXED);
#else
    (void)M;
#endif
}

/* out[m, n] (row stride ldo, bf16 or float32) = sum_k x[m, k] w[n, k] + bias[n] (float32 or NULL)
 * for n < N, x given quantized by quantize_act (per block). w, wd, wm in the tiled layout above
 * (wm unused for FMT_C8). The threads split the tiles of 16 rows. */
void quant_gemm(int fmt, int64_t M, int64_t N, int64_t Kp, const uint8_t *w, const void *wd_,
                const void *wm_, const float *bias, const int8_t *xq, const float *xd,
                const float *xs, void *out, int64_t ldo, int out_bf16) {
    const int64_t tiles = (N + NR - 1) / NR;
    count_amx_call(M);
    /* A decode step's tiles are small and even: static halves. From 16 tokens a task (two tiles
     * x up to TCHUNK tokens) is microseconds or more, so they are handed out one by one: a thread
     * the OS descheduled on a busy machine then holds back one task, not half the matrix. */
    if (M >= 16) {
        const int64_t tasks = gemm_tasks(M, tiles);
#pragma omp parallel for schedule(dynamic, 1) if (tiles > 1)
        for (int64_t task = 0; task < tasks; task++)
            gemm_task(fmt, M, N, task, tiles, Kp, w, wd_, wm_, bias, xq, xd, xs, out, ldo, out_bf16);
    } else {
#pragma omp parallel for schedule(static) if (tiles > 1)
        for (int64_t tile = 0; tile < tiles; tile++)
            gemm_tile(fmt, M, N, tile, Kp, w, wd_, wm_, bias, xq, xd, xs, out, ldo, out_bf16, 1,
                      prefetch_out(M, ldo, out_bf16));
    }
}

/* quantize_act (per block) and quant_gemm in one call and one parallel region: x [M, K] (x_kind as
 * quantize_act's: SwiGLU's gate | up rows give the down projection its input unstored) quantized into the caller's xq [M, Kp], xd, xs [M, Kp / 32], then
 * multiplied. A decode batch (< 16 tokens) quantizes on the calling thread (microseconds) and
 * splits the tiles statically; larger batches share one team for both phases, so a busy
 * machine's descheduled thread costs one barrier per linear, not two. */
void quant_linear_act(int fmt, int64_t M, int64_t N, int64_t K, int64_t Kp, const uint8_t *w,
                      const void *wd_, const void *wm_, const float *bias, const void *x, int64_t ldx,
                      int x_kind, int8_t *xq, float *xd, float *xs, void *out, int64_t ldo, int out_bf16) {
    if (M < 16) {
        for (int64_t m = 0; m < M; m++) quantize_row(x, ldx, x_kind, m, K, Kp, 0, xq, xd, xs);
        quant_gemm(fmt, M, N, Kp, w, wd_, wm_, bias, xq, xd, xs, out, ldo, out_bf16);
        return;
    }
    const int64_t tiles = (N + NR - 1) / NR;
    count_amx_call(M);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x, ldx, x_kind, m, K, Kp, 0, xq, xd, xs);
        const int64_t tasks = gemm_tasks(M, tiles);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++)
            gemm_task(fmt, M, N, task, tiles, Kp, w, wd_, wm_, bias, xq, xd, xs, out, ldo, out_bf16);
    }
}

#if QG_VNNI
/* One tile's rows lanes [l0, l1) as dense values out[(n - n0) * K + k] (the dense path). */
static void dequantize_tile(int fmt, int64_t tile, int l0, int l1, int64_t n0, int64_t K, int64_t Kp,
                            const uint8_t *w, const void *wd_, const void *wm_, void *out, int out_bf16) {
    const int64_t nb = Kp / QBLOCK;
    const uint8_t *tw = w + tile * tile_bytes(fmt, Kp);
    float row[64];
    for (int64_t p = 0; p < Kp / 64 && p * 64 < K; p++) {
        __m512i r[16]; /* blocks 2p, 2p + 1: chunk vectors -> after the transpose, row vectors */
        for (int c = 0; c < 8; c++) {
            r[c] = fmt == FMT_B4 ? tile_vec(tw, 1, 2 * p, c) : tile_vec(tw, 0, 2 * p, c);
            r[8 + c] = fmt == FMT_B4 ? tile_vec(tw, 1, 2 * p + 1, c) : tile_vec(tw, 0, 2 * p + 1, c);
        }
        transpose16x16_epi32(r); /* cpu_common.h */
        const int64_t k1 = (p + 1) * 64 < K ? (p + 1) * 64 : K;
        for (int lane = l0; lane < l1; lane++) {
            for (int h = 0; h < 2; h++) {
                float d, m;
                block_scale(fmt, wd_, wm_, tile, lane, nb, 2 * p + h, &d, &m);
                /* 32 bytes h of the row: d * q + m in one rounding (fma), exact for c8's d * (q - 128) */
                const __m256i q = _mm512_extracti64x4_epi64(r[lane], 0);
                const __m256i qh = _mm512_extracti64x4_epi64(r[lane], 1);
                const __m256i half = h ? qh : q;
                for (int j = 0; j < 2; j++) {
                    const __m512i u = _mm512_cvtepu8_epi32(j ? _mm256_extracti128_si256(half, 1)
                                                             : _mm256_castsi256_si128(half));
                    _mm512_storeu_ps(row + h * 32 + j * 16,
                                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_set1_ps(d), _mm512_set1_ps(m)));
                }
            }
            const int64_t o = (tile * NR + lane - n0) * K;
            for (int64_t k = p * 64; k < k1; k++) store_out(out, out_bf16, o + k, row[k - p * 64]);
        }
    }
}
#endif

#if !QG_VNNI
/* Rows [r0, r1) to out[(n - n0) * K + k]. */
static void quant_dequantize_rows_portable(int fmt, int64_t r0, int64_t r1, int64_t n0, int64_t K, int64_t Kp,
                                           const uint8_t *w, const void *wd_, const void *wm_, void *out,
                                           int out_bf16) {
    const int64_t nb = Kp / QBLOCK;
    for (int64_t n = r0; n < r1; n++) {
        const int64_t tile = n / NR;
        const int lane = (int)(n % NR);
        const uint8_t *tw = w + tile * tile_bytes(fmt, Kp);
        for (int64_t b = 0; b < nb && b * QBLOCK < K; b++) {
            float d, m;
            block_scale(fmt, wd_, wm_, tile, lane, nb, b, &d, &m);
            const int64_t k1 = (b + 1) * QBLOCK < K ? (b + 1) * QBLOCK : K;
            for (int64_t k = b * QBLOCK; k < k1; k++) /* c8 exact: d * (q - 128) */
                store_out(out, out_bf16, (n - n0) * K + k,
                          fmt == FMT_C8 ? d * (float)(weight_q(tw, fmt, lane, k) - 128)
                                        : d * (float)weight_q(tw, fmt, lane, k) + m);
        }
    }
}
#endif

/* The weights as a dense matrix out[n1 - n0, K] (bf16 or float32): rows [n0, n1) only. */
void quant_dequantize(int fmt, int64_t n0, int64_t n1, int64_t K, int64_t Kp, const uint8_t *w,
                      const void *wd_, const void *wm_, void *out, int out_bf16) {
#if QG_VNNI
    const int64_t t0 = n0 / NR, t1 = (n1 + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (t1 - t0 > 1)
    for (int64_t tile = t0; tile < t1; tile++) {
        const int l0 = tile == t0 ? (int)(n0 - tile * NR) : 0;
        const int l1 = (tile + 1) * NR > n1 ? (int)(n1 - tile * NR) : NR;
        dequantize_tile(fmt, tile, l0, l1, n0, K, Kp, w, wd_, wm_, out, out_bf16);
    }
#else
#pragma omp parallel for schedule(static) if (n1 - n0 > NR)
    for (int64_t n = n0; n < n1; n++) quant_dequantize_rows_portable(fmt, n, n + 1, n0, K, Kp, w, wd_, wm_, out, out_bf16);
#endif
}

/* Rows ids[0..n) of the weights as dense rows out[i, K] (bf16 or float32): an embedding lookup
 * (the same values as quant_dequantize's, whatever the batch). */
void quant_rows(int fmt, const int64_t *ids, int64_t n, int64_t K, int64_t Kp, const uint8_t *w,
                const void *wd_, const void *wm_, void *out, int out_bf16) {
#pragma omp parallel for schedule(static) if (n > 64)
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = ids[i]; /* n0 = row - i: row `row` lands at out row i */
#if QG_VNNI
        const int lane = (int)(row % NR);
        dequantize_tile(fmt, row / NR, lane, lane + 1, row - i, K, Kp, w, wd_, wm_, out, out_bf16);
#else
        quant_dequantize_rows_portable(fmt, row, row + 1, row - i, K, Kp, w, wd_, wm_, out, out_bf16);
#endif
    }
}
