/* Batched LoRA over per-token adapter slots (punica's shrink and expand, fused per token):
 *
 *   for each token t with slot s = slots[t] >= 0:
 *     h = A[s] x[t]            (shrink: [R, in] x [in] -> [R], float32)
 *     y[t] += scaling[s] * B[s] h   (expand: [out, R] x [R] -> [out])
 *
 * B comes transposed, bt [num_slots, R, out] (the model keeps its adapter slots in that layout on
 * the CPU): the expand then reads each rank's row along the outputs, with no per-call transpose.
 *
 * Tokens with slot -1 are left alone (the base model's rows). Sums are float32; a bf16 y is
 * read, added to and rounded once. Tiles run in parallel (OpenMP); each token's row is written
 * by one tile. Returns 0; 1 when a slot is outside [-1, num_slots) (nothing is written for that
 * token); 2 for a rank outside [1, 4096]; 3 when scratch memory could not be allocated. */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"

#define LORA_MAX_RANK 4096

static inline float load_f32(const void *base, int64_t index, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

/* Tokens are taken in tiles of up to LORA_TILE tokens of one slot (a counting sort by slot
 * first), so each adapter row is read once per tile instead of once per token: reading A and B
 * per token streamed ~15 MB per token through the caches on a 135M model and made the kernel
 * memory-bound. Each token's sums run in the same order whatever its tile, so a token's result
 * does not depend on the batch around it. */
#define LORA_TILE 16

#define LORA_OUT_BLOCK 64

/* One tile: shrink with each A row converted to float once and dotted with every token of the
 * tile, four tokens at a time; expand by blocks of 64 outputs, each token's block summed over the
 * ranks along B^T's rows (the inner loop runs along the outputs: no horizontal sums, no
 * transpose). Scratch: xf [count rounded up to 4][in] (filled by the caller, zero padding rows),
 * h [same][rank], arow [in], bblock [rank][64] (past a last block's width: stale values whose
 * sums are never stored). */
static void lora_tile(void *y, const float *xf, const void *a, const void *bt, const int64_t *tokens,
                      int64_t count, int64_t s, float scale, int64_t in_features, int64_t out_features,
                      int64_t rank, float *h, float *arow, float *bblock, int bf16) {
    for (int64_t r = 0; r < rank; r++) {
        const int64_t ao = (s * rank + r) * in_features;
        for (int64_t k = 0; k < in_features; k++) arow[k] = load_f32(a, ao + k, bf16);
        /* Four tokens per pass over the row, always: the tile is padded to a multiple of four
         * (zero rows), so every token's sum takes the same instructions wherever it sits. */
        for (int64_t i = 0; i < count; i += 4) {
            const float *x0 = xf + i * in_features, *x1 = x0 + in_features, *x2 = x1 + in_features,
                        *x3 = x2 + in_features;
            float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
            for (int64_t k = 0; k < in_features; k++) {
                const float av = arow[k];
                acc0 += x0[k] * av;
                acc1 += x1[k] * av;
                acc2 += x2[k] * av;
                acc3 += x3[k] * av;
            }
            h[i * rank + r] = acc0;
            h[(i + 1) * rank + r] = acc1;
            h[(i + 2) * rank + r] = acc2;
            h[(i + 3) * rank + r] = acc3;
        }
    }
    for (int64_t o0 = 0; o0 < out_features; o0 += LORA_OUT_BLOCK) {
        const int64_t width = out_features - o0 < LORA_OUT_BLOCK ? out_features - o0 : LORA_OUT_BLOCK;
        for (int64_t r = 0; r < rank; r++) { /* B^T's block as float, once for the tile */
            const int64_t bo = (s * rank + r) * out_features + o0;
            for (int64_t oo = 0; oo < width; oo++) bblock[r * LORA_OUT_BLOCK + oo] = load_f32(bt, bo + oo, bf16);
        }
        /* Four tokens per pass over the block (the padding rows' h is zero): each block row is
         * loaded once for four accumulators. A token's sums run over the ranks in order. */
        for (int64_t i = 0; i < count; i += 4) {
            float acc[4][LORA_OUT_BLOCK] = {{0.f}};
            const float *h0 = h + i * rank;
            for (int64_t r = 0; r < rank; r++) {
                const float hv0 = h0[r], hv1 = h0[rank + r], hv2 = h0[2 * rank + r], hv3 = h0[3 * rank + r];
                const float *br = bblock + r * LORA_OUT_BLOCK;
                for (int64_t oo = 0; oo < LORA_OUT_BLOCK; oo++) {
                    const float bv = br[oo];
                    acc[0][oo] += hv0 * bv;
                    acc[1][oo] += hv1 * bv;
                    acc[2][oo] += hv2 * bv;
                    acc[3][oo] += hv3 * bv;
                }
            }
            for (int64_t j = 0; j < 4 && i + j < count; j++) {
                if (bf16) {
                    uint16_t *yr = (uint16_t *)y + tokens[i + j] * out_features + o0;
                    for (int64_t oo = 0; oo < width; oo++)
                        yr[oo] = float_to_bf16(bf16_to_float(yr[oo]) + acc[j][oo] * scale);
                } else {
                    float *yr = (float *)y + tokens[i + j] * out_features + o0;
                    for (int64_t oo = 0; oo < width; oo++) yr[oo] += acc[j][oo] * scale;
                }
            }
        }
    }
}

static int lora_add(void *y, const void *x, const void *a, const void *bt, const int64_t *slots,
                    const float *scalings, int64_t num_tokens, int64_t in_features, int64_t out_features,
                    int64_t rank, int64_t num_slots, int bf16) {
    if (rank > LORA_MAX_RANK || rank < 1) return 2;
    int bad = 0;
    /* Counting sort of the tokens with a valid slot, by slot (stable); then the tiles. */
    int64_t *counts = calloc((size_t)num_slots + 1, sizeof *counts);
    int64_t *order = malloc(((size_t)num_tokens + 1) * sizeof *order);
    int64_t *tile_start = malloc(((size_t)num_tokens + 1) * sizeof *tile_start);
    if (!counts || !order || !tile_start) { free(counts); free(order); free(tile_start); return 3; }
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t s = slots[t];
        if (s < -1 || s >= num_slots) bad = 1;
        else if (s >= 0) counts[s + 1]++;
    }
    for (int64_t s = 0; s < num_slots; s++) counts[s + 1] += counts[s];
    const int64_t num_valid = counts[num_slots];
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t s = slots[t];
        if (s >= 0 && s < num_slots) order[counts[s]++] = t;
    }
    int64_t num_tiles = 0;
    for (int64_t i = 0; i < num_valid;) {
        const int64_t s = slots[order[i]];
        int64_t e = i;
        while (e < num_valid && e - i < LORA_TILE && slots[order[e]] == s) e++;
        tile_start[num_tiles++] = i;
        i = e;
    }
    tile_start[num_tiles] = num_valid;
    int failed = 0;
#pragma omp parallel if (num_tiles > 1) reduction(| : failed)
    {
        float *xf = malloc((size_t)LORA_TILE * (size_t)in_features * sizeof *xf);
        float *h = malloc((size_t)LORA_TILE * (size_t)rank * sizeof *h);
        float *arow = malloc((size_t)in_features * sizeof *arow);
        float *bblock = calloc((size_t)rank * LORA_OUT_BLOCK, sizeof *bblock); /* defined values throughout */
        const int ok = xf && h && arow && bblock;
        if (!ok) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t tile = 0; tile < num_tiles; tile++) {
            if (!ok) continue;
            const int64_t *tokens = order + tile_start[tile];
            const int64_t count = tile_start[tile + 1] - tile_start[tile];
            const int64_t s = slots[tokens[0]];
            for (int64_t i = 0; i < count; i++) {
                const int64_t xo = tokens[i] * in_features;
                for (int64_t k = 0; k < in_features; k++)
                    xf[i * in_features + k] = load_f32(x, xo + k, bf16);
            }
            for (int64_t i = count; i % 4 != 0; i++)  /* the padding rows of the last group of four */
                for (int64_t k = 0; k < in_features; k++) xf[i * in_features + k] = 0.f;
            lora_tile(y, xf, a, bt, tokens, count, s, scalings[s], in_features, out_features, rank, h, arow, bblock,
                      bf16);
        }
        free(xf);
        free(h);
        free(arow);
        free(bblock);
    }
    free(counts);
    free(order);
    free(tile_start);
    if (failed) return 3;
    return bad ? 1 : 0;
}

int lora_add_f32(void *y, const void *x, const void *a, const void *bt, const int64_t *slots, const float *scalings,
                 int64_t num_tokens, int64_t in_features, int64_t out_features, int64_t rank, int64_t num_slots,
                 int64_t reserved) {
    (void)reserved;
    return lora_add(y, x, a, bt, slots, scalings, num_tokens, in_features, out_features, rank, num_slots, 0);
}

int lora_add_bf16(void *y, const void *x, const void *a, const void *bt, const int64_t *slots, const float *scalings,
                  int64_t num_tokens, int64_t in_features, int64_t out_features, int64_t rank, int64_t num_slots,
                  int64_t reserved) {
    (void)reserved;
    return lora_add(y, x, a, bt, slots, scalings, num_tokens, in_features, out_features, rank, num_slots, 1);
}
