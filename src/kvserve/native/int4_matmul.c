/* y[m, n] = sum_k x[m, k] * w[n, k] for 4-bit weights w = lo + scale * q (q in 0..15, groups of
 * 32 along k, a scale and an offset per group: GGUF Q4_1's grid), f32 activations.
 *
 * Each activation row is split into two int8 digits (as models/linear.py's int8 format does):
 *     u = x * 127 / max|x|,   d1 = round(u),   d2 = round((u - d1) * 254),   u ~ d1 + d2 / 254
 * so a group's dot product is two exact integer sums of u8 x s8 products (simd.h's group dot: 64
 * products an instruction with AVX-512 VNNI, 32 with AVX2, 16 with NEON's sdot), and per group, per output:
 *     acc = fma(scale, S1 + S2 / 254, acc);   acc = fma(lo, sum of d1 + d2 / 254 over the group, acc)
 * then y = acc * max|x| / 127 (+ bias). Every float operation of a row is the same sequence whatever
 * the batch, the tile it lands in, or the thread count: a row's output is the same bits alone,
 * batched, in a decode step or in a prefill chunk (the engine's exactness rule).
 *
 * digits = 1 (``--weights q4-fast``) is llama.cpp's arithmetic instead: one int8 code per activation,
 * q = round(x / a) with a = max|x| / 127 over each group of 32, so half the integer products:
 *     acc = fma(scale, a * S, acc);   acc = fma(lo, a * sum of q over the group, acc);   y = acc (+ bias)
 * ~1.7x faster where the products bound the time (batches, prefill); output error ~5e-3 instead of
 * ~3e-5.
 *
 * Packed weights, for each panel of 16 outputs and each group (320 bytes, the panel's groups
 * contiguous, so a decode step streams the weights once in order):
 *     256 bytes: 4 chunks of 64; chunk c holds k-quads 2c (low nibbles) and 2c+1 (high nibbles),
 *                byte 4 * lane + i = code of output lane, k = 4 * quad + i (the VNNI operand layout)
 *      32 bytes: 16 scales (f16)      32 bytes: 16 offsets (f16)
 * or, with f32_scales (384 bytes a group), 64 bytes of f32 scales and 64 of f32 offsets: the grids whose
 * scales f16 cannot hold (GGUF Q4_K: d * sc and -dmin * m per 32, products of an f16 and a 6-bit
 * integer). models/linear.py's pack_int4 writes this layout.
 *
 * Threads split the panels; rows are taken in blocks (digits stay in L2) and tiles of ROW_TILE rows
 * that share each unpacked weight vector. The digits (and per-group sums and scales) are stored tile by
 * tile, group by group: a tile's rows of a group sit next to each other, so the inner loop addresses
 * them all from one pointer (with a pointer per row GCC ran out of registers and kept the
 * accumulators in memory).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

#define GROUP 32
#define PANEL 16
#define CODE_BYTES 256
#define BLOCK_BYTES 320     /* codes, f16 scales and offsets */
#define BLOCK_BYTES_F32 384 /* codes, f32 scales and offsets */
#if VL == 8 /* 16 vector registers: a tile's accumulators beside a group's 8 code vectors */
#define ROW_TILE 4
#else
#define ROW_TILE 6
#endif
#define TILE_GROUP (ROW_TILE * GROUP) /* bytes of one group of a tile's digits */
#define PREFETCH 4096 /* bytes ahead, into L2: one row streams ~10% faster on 2 threads (measured) */
#define ROW_BLOCK 96 /* a multiple of ROW_TILE */

SIMD_EXPORT_ISA

/* One digit (digits = 1): per group of 32, q = round(x / a) with a = max|x| / 127 into d1, a into
 * gscale, a * (sum of q) into usum; row_scale 1. The offsets' term takes the sum of the rounded
 * activations, not of x: the rounding errors then meet the weights themselves (lo + scale * code,
 * centred), not their all-positive codes alone. With the exact sum SmolLM2's KLD was 0.0141, with
 * this one 0.0036 (both beside a head that re-rounded the Q8_0 weights; with it held exactly: 0.0019,
 * llama.cpp's own on the same file and text: 0.0029). */
static void split_row_groups(const float *x, int K, int8_t *d1, float *usum, float *gscale, float *row_scale) {
    /* d1: the row's first group, the next ROW_TILE * GROUP bytes on; usum, gscale: every ROW_TILE floats */
    for (int g = 0; g < K / GROUP; g++) {
        const float *xg = x + g * GROUP;
        vf vmax = vf_zero();
        for (int h = 0; h < GROUP; h += VL) vmax = vf_max(vmax, vf_abs(vf_load(xg + h)));
        const float amax = vf_reduce_max(vmax);
        const vf inv = vf_set1(amax > 0.0f ? 127.0f / amax : 0.0f);
        vf codes = vf_zero();
        for (int h = 0; h < GROUP; h += VL) {
            const vf code = vf_round(vf_mul(vf_load(xg + h), inv));
            vf_store_i8(d1 + g * TILE_GROUP + h, code);
            codes = vf_add(codes, code);
        }
        gscale[g * ROW_TILE] = amax / 127.0f;
        usum[g * ROW_TILE] = gscale[g * ROW_TILE] * vf_reduce_add(codes); /* the sum: an exact integer */
    }
    *row_scale = 1.0f;
}

/* Digits of one row, the sum of the digits' value d1 + d2 / 254 over each group (see split_row_groups:
 * the rounded activations' sum, not u's), and max|x| / 127. Strides as split_row_groups'. */
static void split_row(const float *x, int K, int8_t *d1, int8_t *d2, float *usum, float *row_scale) {
    vf vmax = vf_zero();
    for (int k = 0; k < K; k += VL) vmax = vf_max(vmax, vf_abs(vf_load(x + k)));
    const float amax = fmaxf(vf_reduce_max(vmax), 1e-30f);
    const vf inv = vf_set1(127.0f / amax), radix = vf_set1(254.0f);
    for (int g = 0; g < K / GROUP; g++) {
        vf sum1 = vf_zero(), sum2 = sum1;
        for (int h = 0; h < GROUP; h += VL) {
            const int k = g * GROUP + h, at = g * TILE_GROUP + h;
            const vf u = vf_mul(vf_load(x + k), inv), r1 = vf_round(u);
            const vf r2 = vf_round(vf_mul(vf_sub(u, r1), radix));
            vf_store_i8(d1 + at, r1);
            vf_store_i8(d2 + at, r2);
            sum1 = vf_add(sum1, r1);
            sum2 = vf_add(sum2, r2);
        }
        usum[g * ROW_TILE] = fmaf(vf_reduce_add(sum2), 1.0f / 254.0f, vf_reduce_add(sum1)); /* exact sums */
    }
    *row_scale = amax / 127.0f;
}

/* Rows [0, nr) of a tile against one panel: out[r][0..16) (before the row scale and bias), VL outputs
 * at a time (a panel's lanes [h VL, h VL + VL) are bytes [4 VL h, 4 VL (h + 1)) of each 64-byte chunk).
 * d1, d2, usum, gscale: the tile's, in the tile layout. */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *panel, int G, const int8_t *d1,
                                                             const int8_t *d2, const float *usum,
                                                             const float *gscale, float *out, const int nr,
                                                             const int digits, const int f32_scales) {
    const vf inv254 = vf_set1(1.0f / 254.0f);
    const int block = f32_scales ? BLOCK_BYTES_F32 : BLOCK_BYTES;
    for (int h = 0; h < PANEL / VL; h++) {
        vf acc[ROW_TILE]; /* locals, stored once at the end (through a pointer GCC stored them every group) */
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) acc[r] = vf_zero();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * block;
            if (h == 0)
                for (int i = 0; i < block; i += 64) simd_prefetch(blk + PREFETCH + i);
            vb c[8];
            for (int i = 0; i < 4; i++) {
                const vb v = vb_load(blk + 64 * i + 4 * VL * h);
                c[2 * i] = vb_low_nibbles(v);
                c[2 * i + 1] = vb_high_nibbles(v);
            }
            const vf scale = f32_scales ? vf_load((const float *)(blk + CODE_BYTES) + VL * h)
                                        : vf_from_half(blk + CODE_BYTES + 2 * VL * h);
            const vf lo = f32_scales ? vf_load((const float *)(blk + CODE_BYTES + 64) + VL * h)
                                     : vf_from_half(blk + CODE_BYTES + 32 + 2 * VL * h);
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) {
                const int64_t at = (int64_t)g * TILE_GROUP + r * GROUP;
                const vf s1 = vf_from_vi(vi_group_dot_u4s8(c, d1 + at));
                const vf t = digits == 2 ? vf_fma(vf_from_vi(vi_group_dot_u4s8(c, d2 + at)), inv254, s1)
                                         : vf_mul(s1, vf_set1(gscale[g * ROW_TILE + r]));
                acc[r] = vf_fma(scale, t, acc[r]);
                acc[r] = vf_fma(lo, vf_set1(usum[g * ROW_TILE + r]), acc[r]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) vf_store(out + r * PANEL + h * VL, acc[r]);
    }
}

/* Rows [0, nr) against one panel, written to y (row stride ldy) with the row scale and bias. */
static void panel_rows(const uint8_t *panel, int G, const int8_t *d1, const int8_t *d2, const float *usum,
                       const float *gscale, int digits, int f32_scales, int nr, const float *row_scale,
                       const float *bias, int width, float *y, int ldy) {
    float out[ROW_TILE][PANEL];
    /* each combination of digits and scale format its own inlined copy: constants in the inner loop */
#define TILE(n, digits, f32) panel_tile(panel, G, d1, d2, usum, gscale, out[0], n, digits, f32)
#if ROW_TILE == 6
#define TILE_6_5(digits, f32) case 6: TILE(6, digits, f32); break; case 5: TILE(5, digits, f32); break;
#else
#define TILE_6_5(digits, f32)
#endif
#define TILES(digits, f32)                                                                               \
    switch (nr) {                                                                                        \
    TILE_6_5(digits, f32)                                                                                \
    case 4: TILE(4, digits, f32); break;                                                                 \
    case 3: TILE(3, digits, f32); break;                                                                 \
    case 2: TILE(2, digits, f32); break;                                                                 \
    default: TILE(1, digits, f32); break;                                                                \
    }
    if (digits == 2) {
        if (f32_scales) {
            TILES(2, 1)
        } else {
            TILES(2, 0)
        }
    } else if (f32_scales) {
        TILES(1, 1)
    } else {
        TILES(1, 0)
    }
#undef TILES
#undef TILE_6_5
#undef TILE
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < width; i++) y[(int64_t)r * ldy + i] = fmaf(out[r][i], row_scale[r], bias ? bias[i] : 0.0f);
}

/* x [M, K] f32, w packed [ceil(N / 16), K / 32, 320 or 384 bytes], bias [N] or NULL, y [M, N] f32;
 * digits 2 (exact group sums) or 1 (llama.cpp's int8 activations); f32_scales: the 384-byte groups.
 * Returns 0, or -1 when the digits could not be allocated. */
int int4_matmul(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                 int num_threads, int digits, int f32_scales) {
    const int G = K / GROUP, panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_bytes = (int64_t)G * (f32_scales ? BLOCK_BYTES_F32 : BLOCK_BYTES);
    const size_t rows = (size_t)(M + ROW_TILE - 1) / ROW_TILE * ROW_TILE; /* whole tiles */
    int8_t *d1 = malloc(rows * K), *d2 = digits == 2 ? malloc(rows * K) : d1;
    float *usum = malloc(sizeof(float) * rows * G), *row_scale = malloc(sizeof(float) * (size_t)M);
    float *gscale = digits == 2 ? usum : malloc(sizeof(float) * rows * G);
    if (!d1 || !d2 || !usum || !row_scale || !gscale) {
        free(d1);
        if (d2 != d1) free(d2);
        free(usum);
        free(row_scale);
        if (gscale != usum) free(gscale);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const int64_t tile = m / ROW_TILE, r = m % ROW_TILE; /* the tile layout (see the top) */
            const int64_t digits_at = tile * ROW_TILE * K + r * GROUP, sums_at = tile * ROW_TILE * G + r;
            if (digits == 2)
                split_row(x + (int64_t)m * K, K, d1 + digits_at, d2 + digits_at, usum + sums_at, row_scale + m);
            else
                split_row_groups(x + (int64_t)m * K, K, d1 + digits_at, usum + sums_at, gscale + sums_at,
                                 row_scale + m);
        }
        /* each thread its own panels; rows in blocks whose digits stay in L2 while the panels pass */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p_begin = (int)((int64_t)panels * t / nt), p_end = (int)((int64_t)panels * (t + 1) / nt);
        for (int mb = 0; mb < M; mb += ROW_BLOCK) {
            const int m_end = M - mb < ROW_BLOCK ? M : mb + ROW_BLOCK;
            for (int p = p_begin; p < p_end; p++) {
                const uint8_t *panel = w + p * panel_bytes;
                const int n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
                for (int m0 = mb; m0 < m_end; m0 += ROW_TILE) {
                    const int nr = m_end - m0 < ROW_TILE ? m_end - m0 : ROW_TILE;
                    panel_rows(panel, G, d1 + (int64_t)m0 * K, d2 + (int64_t)m0 * K, usum + (int64_t)m0 * G,
                               gscale + (int64_t)m0 * G, digits, f32_scales, nr, row_scale + m0, bias ? bias + n0 : NULL,
                               width, y + (int64_t)m0 * N + n0, N);
                }
            }
        }
    }
    free(d1);
    if (d2 != d1) free(d2);
    free(usum);
    free(row_scale);
    if (gscale != usum) free(gscale);
    return 0;
}
