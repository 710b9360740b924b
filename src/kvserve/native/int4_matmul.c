/* y[m, n] = sum_k x[m, k] * w[n, k] for weights held in their GGUF file's bits: codes of 2 to 6 bits
 * with the file's scales, w = scale * q + lo per group of 32 inputs (16 for Q6_K, Q3_K, Q2_K), f32
 * activations.
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
 *
 * Packed weights: panels of 16 outputs, each panel's groups of 32 inputs in order (a decode step
 * streams the weights once, in address order). A group's block, for codes of 4 to 6 bits:
 *     256 bytes: the low 4 bits of the codes, 4 chunks of 64; chunk c holds k-quads 2c (low nibbles) and
 *                2c+1 (high nibbles), byte 4 * lane + i = code of output lane at k = 4 * quad + i (the VNNI
 *                operand layout)
 *     5-bit codes: 64 bytes, bit q of byte 4 * lane + i = bit 4 of the code at k = 4 q + i
 *     6-bit codes: 2 x 64 bytes, plane p's byte 4 * lane + i holds bits 4-5 of the codes at k = 4 q + i,
 *                q = 4 p .. 4 p + 3, at bits 2 (q - 4 p) and up
 * and for codes of 2 or 3 bits (Q2_K, Q3_K), the 6-bit codes' planes holding bits 0-1 (128 bytes), then
 * for 3 bits the 5-bit codes' plane holding bit 2 (64 bytes).
 *     then the scales, by layout (kernels.h's QL_*; 16 lanes each):
 *         F16    scale, offset f16                     Q4_1's grid          320 bytes a group
 *         F32    scale, offset f32                     any 4-bit grid       384
 *         Q4_0   d f16; offset -8 d                    GGUF Q4_0            288 (the file's 18 per 32)
 *         Q5_0   d f16; offset -16 d                   GGUF Q5_0            352 (22 per 32)
 *         Q5_1   d, m f16                              GGUF Q5_1            384 (24 per 32)
 *         Q4_K   sc, m u8 (6-bit); scale d sc, offset -dmin m               288 + 64 per 8 groups (144 per 256)
 *         Q5_K   as Q4_K                                                    352 + 64 per 8 groups (176 per 256)
 *         Q6_K   sc int8 of inputs 0-15, of 16-31; scale d sc, offset -32 d sc   416 + 32 per 8 (210 per 256)
 *         Q2_K   sc | m << 4 u8 of inputs 0-15, of 16-31 (the file's bytes); scale d sc, offset -dmin m
 *                                                                           160 + 64 per 8 (84 per 256)
 *         Q3_K   sc - 32 int8 of inputs 0-15, of 16-31; scale d sc, offset -4 d sc   224 + 32 per 8 (114 per 256,
 *                the file's 110 with its 6-bit scales widened to a byte)
 * The K-quants' super-block scales (d, then dmin, f16 for 16 lanes) open each run of 8 groups. Each
 * scale and offset is computed in f32 exactly as the gguf library's dequantization computes the weight
 * (an f16 times an integer of at most 8 bits is exact in f32), so the grid is the file's, bit for bit,
 * and a Q4_K tensor gives the same bits as its grid in the F32 layout. models/weight_grids.py packs these
 * (pack_int4 from codes and scales, pack_gguf_blocks straight from a file's blocks).
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
#include "ql_layout.h"
#include "simd.h"

#define GROUP 32
#define PANEL 16
#if VL == 8 /* 16 vector registers: a tile's accumulators beside a group's 8 code vectors */
#define ROW_TILE 4
#else
#define ROW_TILE 6
#endif
#define TILE_GROUP (ROW_TILE * GROUP) /* bytes of one group of a tile's digits */
#define PREFETCH 4096 /* bytes ahead, into L2: one row streams ~10% faster on 2 threads (measured) */
#define ROW_BLOCK 96 /* a multiple of ROW_TILE */

SIMD_EXPORT_ISA

/* Whether a layout scales each half of a group (16 inputs) on its own. */
static inline int per_half(int layout) { return layout == QL_Q6_K || layout == QL_Q2_K || layout == QL_Q3_K; }

/* One digit (digits = 1): per group of 32, q = round(x / a) with a = max|x| / 127 into d1, a into
 * gscale, a * (sum of q) into usum; row_scale 1. The offsets' term takes the sum of the rounded
 * activations, not of x: the rounding errors then meet the weights themselves (lo + scale * code,
 * centred), not their all-positive codes alone. With the exact sum SmolLM2's KLD was 0.0141, with
 * this one 0.0036 (both beside a head that re-rounded the Q8_0 weights; with it held exactly: 0.0019,
 * llama.cpp's own on the same file and text: 0.0029). */
static void split_row_groups(const float *x, int K, int8_t *d1, float *usum, float *usum16, float *gscale,
                             float *row_scale) {
    /* d1: the row's first group, the next ROW_TILE * GROUP bytes on; usum, gscale: every ROW_TILE floats;
     * usum16 (or NULL): the sums of each group's halves, likewise */
    for (int g = 0; g < K / GROUP; g++) {
        const float *xg = x + g * GROUP;
        vf vmax = vf_zero();
        for (int h = 0; h < GROUP; h += VL) vmax = vf_max(vmax, vf_abs(vf_load(xg + h)));
        const float amax = vf_reduce_max(vmax);
        const vf inv = vf_set1(amax > 0.0f ? 127.0f / amax : 0.0f);
        vf codes[2] = {vf_zero(), vf_zero()}; /* inputs 0-15, 16-31 */
        for (int h = 0; h < GROUP; h += VL) {
            const vf code = vf_round(vf_mul(vf_load(xg + h), inv));
            vf_store_i8(d1 + g * TILE_GROUP + h, code);
            codes[h / 16] = vf_add(codes[h / 16], code);
        }
        const float a = amax / 127.0f;
        gscale[g * ROW_TILE] = a;
        usum[g * ROW_TILE] = a * vf_reduce_add(vf_add(codes[0], codes[1])); /* the sums: exact integers */
        if (usum16) {
            usum16[2 * g * ROW_TILE] = a * vf_reduce_add(codes[0]);
            usum16[(2 * g + 1) * ROW_TILE] = a * vf_reduce_add(codes[1]);
        }
    }
    *row_scale = 1.0f;
}

/* Digits of one row, the sum of the digits' value d1 + d2 / 254 over each group (see split_row_groups:
 * the rounded activations' sum, not u's), and max|x| / 127. Strides as split_row_groups'. */
static void split_row(const float *x, int K, int8_t *d1, int8_t *d2, float *usum, float *usum16, float *row_scale) {
    vf vmax = vf_zero();
    for (int k = 0; k < K; k += VL) vmax = vf_max(vmax, vf_abs(vf_load(x + k)));
    const float amax = fmaxf(vf_reduce_max(vmax), 1e-30f);
    const vf inv = vf_set1(127.0f / amax), radix = vf_set1(254.0f);
    for (int g = 0; g < K / GROUP; g++) {
        vf sum1[2] = {vf_zero(), vf_zero()}, sum2[2] = {vf_zero(), vf_zero()}; /* inputs 0-15, 16-31 */
        for (int h = 0; h < GROUP; h += VL) {
            const int k = g * GROUP + h, at = g * TILE_GROUP + h;
            const vf u = vf_mul(vf_load(x + k), inv), r1 = vf_round(u);
            const vf r2 = vf_round(vf_mul(vf_sub(u, r1), radix));
            vf_store_i8(d1 + at, r1);
            vf_store_i8(d2 + at, r2);
            sum1[h / 16] = vf_add(sum1[h / 16], r1);
            sum2[h / 16] = vf_add(sum2[h / 16], r2);
        }
        /* integer sums, exact in any order */
        usum[g * ROW_TILE] = fmaf(vf_reduce_add(vf_add(sum2[0], sum2[1])), 1.0f / 254.0f,
                                  vf_reduce_add(vf_add(sum1[0], sum1[1])));
        if (usum16)
            for (int half = 0; half < 2; half++)
                usum16[(2 * g + half) * ROW_TILE] = fmaf(vf_reduce_add(sum2[half]), 1.0f / 254.0f,
                                                         vf_reduce_add(sum1[half]));
    }
    *row_scale = amax / 127.0f;
}

/* The scales of one group's VL lanes (lanes [h VL, h VL + VL)): the group's, or for the per-half layouts
 * its two halves' (scale[1], lo[1]). sd, smin: the super-block's d and -dmin (K-quants). */
static inline __attribute__((always_inline)) void group_scales(const uint8_t *sp, int h, int layout, vf sd, vf smin,
                                                               vf scale[2], vf lo[2]) {
    switch (layout) {
    case QL_F32:
        scale[0] = vf_load((const float *)sp + VL * h);
        lo[0] = vf_load((const float *)(sp + 64) + VL * h);
        break;
    case QL_Q4_0:
    case QL_Q5_0:
        scale[0] = vf_from_half(sp + 2 * VL * h);
        lo[0] = vf_mul(scale[0], vf_set1(layout == QL_Q4_0 ? -8.0f : -16.0f));
        break;
    case QL_Q4_K:
    case QL_Q5_K:
        scale[0] = vf_mul(sd, vf_from_i8((const int8_t *)sp + VL * h));
        lo[0] = vf_mul(smin, vf_from_i8((const int8_t *)sp + 16 + VL * h));
        break;
    case QL_Q6_K:
    case QL_Q3_K:
        for (int half = 0; half < 2; half++) {
            scale[half] = vf_mul(sd, vf_from_i8((const int8_t *)sp + 16 * half + VL * h));
            lo[half] = vf_mul(scale[half], vf_set1(layout == QL_Q6_K ? -32.0f : -4.0f));
        }
        break;
    case QL_Q2_K: /* each byte sc | m << 4; vf_from_nibbles gives a nibble less 8 */
        for (int half = 0; half < 2; half++) {
            const uint8_t *b = sp + 16 * half + VL * h;
            scale[half] = vf_mul(sd, vf_add(vf_from_nibbles(b, 0), vf_set1(8.0f)));
            lo[half] = vf_mul(smin, vf_add(vf_from_nibbles(b, 1), vf_set1(8.0f)));
        }
        break;
    default: /* QL_F16, QL_Q5_1 */
        scale[0] = vf_from_half(sp + 2 * VL * h);
        lo[0] = vf_from_half(sp + 32 + 2 * VL * h);
    }
}

/* Rows [0, nr) of a tile against one panel: out[r][0..16) (before the row scale and bias), VL outputs
 * at a time (a panel's lanes [h VL, h VL + VL) are bytes [4 VL h, 4 VL (h + 1)) of each 64-byte chunk).
 * d1, d2, usum, usum16, gscale: the tile's, in the tile layout. */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *panel, int G, const int8_t *d1,
                                                             const int8_t *d2, const float *usum,
                                                             const float *usum16, const float *gscale, float *out,
                                                             const int nr, const int digits, const int layout) {
    const vf inv254 = vf_set1(1.0f / 254.0f);
    const int bits = code_bits(layout), block = group_bytes(layout), super = super_bytes(layout);
    for (int h = 0; h < PANEL / VL; h++) {
        vf acc[ROW_TILE]; /* locals, stored once at the end (through a pointer GCC stored them every group) */
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) acc[r] = vf_zero();
        vf sd = vf_zero(), smin = vf_zero();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * block;
            if (super) {
                const uint8_t *head = panel + (int64_t)(g / 8) * (super + 8 * block);
                blk = head + super + (g % 8) * block;
                if (g % 8 == 0) {
                    sd = vf_from_half(head + 2 * VL * h);
                    if (super == 64) smin = vf_sub(vf_zero(), vf_from_half(head + 32 + 2 * VL * h));
                }
            }
            if (h == 0)
                for (int i = 0; i < block + super; i += 64) simd_prefetch(blk + PREFETCH + i);
            vb c[8];
            if (bits < 4) { /* bits 0-1 in two planes of crumbs, bit 2 in a plane of bits */
                for (int q = 0; q < 8; q++) {
                    const vb plane = vb_load(blk + 64 * (q / 4) + 4 * VL * h);
                    c[q] = vb_bits(plane, 3 << (2 * (q % 4)), -2 * (q % 4));
                }
                if (bits == 3) {
                    const vb high = vb_load(blk + 128 + 4 * VL * h);
                    for (int q = 0; q < 8; q++) c[q] = vb_or(c[q], vb_bits(high, 1 << q, 2 - q));
                }
            } else
                for (int i = 0; i < 4; i++) {
                    const vb v = vb_load(blk + 64 * i + 4 * VL * h);
                    c[2 * i] = vb_low_nibbles(v);
                    c[2 * i + 1] = vb_high_nibbles(v);
                }
            if (bits == 5) {
                const vb high = vb_load(blk + CODE_BYTES + 4 * VL * h);
                for (int q = 0; q < 8; q++) c[q] = vb_or(c[q], vb_bits(high, 1 << q, 4 - q));
            } else if (bits == 6) {
                for (int q = 0; q < 8; q++) {
                    const vb plane = vb_load(blk + CODE_BYTES + 64 * (q / 4) + 4 * VL * h);
                    c[q] = vb_or(c[q], vb_bits(plane, 3 << (2 * (q % 4)), 4 - 2 * (q % 4)));
                }
            }
            vf scale[2], lo[2];
            group_scales(blk + code_bytes(layout), h, layout, sd, smin, scale, lo);
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) {
                const int64_t at = (int64_t)g * TILE_GROUP + r * GROUP;
                if (per_half(layout)) { /* two halves of 16, each its own scale */
                    for (int half = 0; half < 2; half++) {
                        const vf s1 = vf_from_vi(vi_dot4_u6s8(c + 4 * half, d1 + at + 16 * half));
                        const vf t = digits == 2
                                         ? vf_fma(vf_from_vi(vi_dot4_u6s8(c + 4 * half, d2 + at + 16 * half)), inv254, s1)
                                         : vf_mul(s1, vf_set1(gscale[g * ROW_TILE + r]));
                        acc[r] = vf_fma(scale[half], t, acc[r]);
                        acc[r] = vf_fma(lo[half], vf_set1(usum16[(2 * g + half) * ROW_TILE + r]), acc[r]);
                    }
                    continue;
                }
                const vf s1 = vf_from_vi(bits == 4 ? vi_group_dot_u4s8(c, d1 + at) : vi_group_dot_u6s8(c, d1 + at));
                const vf t = digits == 2
                                 ? vf_fma(vf_from_vi(bits == 4 ? vi_group_dot_u4s8(c, d2 + at) : vi_group_dot_u6s8(c, d2 + at)),
                                          inv254, s1)
                                 : vf_mul(s1, vf_set1(gscale[g * ROW_TILE + r]));
                acc[r] = vf_fma(scale[0], t, acc[r]);
                acc[r] = vf_fma(lo[0], vf_set1(usum[g * ROW_TILE + r]), acc[r]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) vf_store(out + r * PANEL + h * VL, acc[r]);
    }
}

/* Rows [0, nr) against one panel, written to y (row stride ldy) with the row scale and bias. */
static void panel_rows(const uint8_t *panel, int G, const int8_t *d1, const int8_t *d2, const float *usum,
                       const float *usum16, const float *gscale, int digits, int layout, int nr,
                       const float *row_scale, const float *bias, int width, float *y, int ldy) {
    float out[ROW_TILE][PANEL];
    /* each combination of digits and layout its own inlined copy: constants in the inner loop */
#define TILE(n, digits, layout) panel_tile(panel, G, d1, d2, usum, usum16, gscale, out[0], n, digits, layout)
#if ROW_TILE == 6
#define TILE_6_5(digits, layout) case 6: TILE(6, digits, layout); break; case 5: TILE(5, digits, layout); break;
#else
#define TILE_6_5(digits, layout)
#endif
#define TILES(digits, layout)                                                                            \
    switch (nr) {                                                                                        \
    TILE_6_5(digits, layout)                                                                             \
    case 4: TILE(4, digits, layout); break;                                                              \
    case 3: TILE(3, digits, layout); break;                                                              \
    case 2: TILE(2, digits, layout); break;                                                              \
    default: TILE(1, digits, layout); break;                                                             \
    }
#define LAYOUTS(digits)                                                                                  \
    switch (layout) {                                                                                    \
    case QL_F32: TILES(digits, QL_F32) break;                                                            \
    case QL_Q4_0: TILES(digits, QL_Q4_0) break;                                                          \
    case QL_Q5_0: TILES(digits, QL_Q5_0) break;                                                          \
    case QL_Q5_1: TILES(digits, QL_Q5_1) break;                                                          \
    case QL_Q4_K: TILES(digits, QL_Q4_K) break;                                                          \
    case QL_Q5_K: TILES(digits, QL_Q5_K) break;                                                          \
    case QL_Q6_K: TILES(digits, QL_Q6_K) break;                                                          \
    case QL_Q2_K: TILES(digits, QL_Q2_K) break;                                                          \
    case QL_Q3_K: TILES(digits, QL_Q3_K) break;                                                          \
    default: TILES(digits, QL_F16) break;                                                                \
    }
    if (digits == 2) {
        LAYOUTS(2)
    } else {
        LAYOUTS(1)
    }
#undef LAYOUTS
#undef TILES
#undef TILE_6_5
#undef TILE
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < width; i++) y[(int64_t)r * ldy + i] = fmaf(out[r][i], row_scale[r], bias ? bias[i] : 0.0f);
}

/* x [M, K] f32, w packed [ceil(N / 16) panels of panel_bytes_of(layout, K / 32)], bias [N] or NULL,
 * y [M, N] f32 (rows ldy floats apart; ldy <= 0: N); digits 2 (exact group sums) or 1 (llama.cpp's int8 activations); layout: kernels.h's QL_*
 * (K a multiple of 256 for the K-quants'). Returns 0, or -1 when the digits could not be allocated (or the
 * layout is unknown). */
int int4_matmul(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                 int num_threads, int digits, int layout, int ldy) {
    if (layout < QL_F16 || layout > QL_Q3_K) return -1;
    const int64_t ld = ldy > 0 ? ldy : N; /* y's row stride */
    const int G = K / GROUP, panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_bytes = panel_bytes_of(layout, G);
    const size_t rows = (size_t)(M + ROW_TILE - 1) / ROW_TILE * ROW_TILE; /* whole tiles */
    int8_t *d1 = malloc(rows * K), *d2 = digits == 2 ? malloc(rows * K) : d1;
    float *usum = malloc(sizeof(float) * rows * G), *row_scale = malloc(sizeof(float) * (size_t)M);
    float *gscale = digits == 2 ? usum : malloc(sizeof(float) * rows * G);
    float *usum16 = per_half(layout) ? malloc(sizeof(float) * rows * 2 * G) : NULL;
    if (!d1 || !d2 || !usum || !row_scale || !gscale || (per_half(layout) && !usum16)) {
        free(d1);
        if (d2 != d1) free(d2);
        free(usum);
        free(row_scale);
        if (gscale != usum) free(gscale);
        free(usum16);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const int64_t tile = m / ROW_TILE, r = m % ROW_TILE; /* the tile layout (see the top) */
            const int64_t digits_at = tile * ROW_TILE * K + r * GROUP, sums_at = tile * ROW_TILE * G + r;
            float *halves = usum16 ? usum16 + tile * ROW_TILE * 2 * G + r : NULL;
            if (digits == 2)
                split_row(x + (int64_t)m * K, K, d1 + digits_at, d2 + digits_at, usum + sums_at, halves, row_scale + m);
            else
                split_row_groups(x + (int64_t)m * K, K, d1 + digits_at, usum + sums_at, halves, gscale + sums_at,
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
                               usum16 ? usum16 + (int64_t)m0 * 2 * G : NULL, gscale + (int64_t)m0 * G, digits,
                               layout, nr, row_scale + m0, bias ? bias + n0 : NULL, width, y + m0 * ld + n0, (int)ld);
                }
            }
        }
    }
    free(d1);
    if (d2 != d1) free(d2);
    free(usum);
    free(row_scale);
    if (gscale != usum) free(gscale);
    free(usum16);
    return 0;
}
