/* y[m, n] = sum_g d[n, g] * sum_{k in g} x[m, k] * w[n, k] (+ bias[n]): f32 activations against int8
 * weights with an f16 scale per group of 32 inputs (GGUF Q8_0's grid, which SmolLM2's output head
 * is: held exactly).
 *
 * For the output head (the largest single tensor of a small model), applied to the rows that need
 * logits. Each activation is one int16 code, c = round(x * 32258 / max|x|) over its row (32258 =
 * 127 * 254: the two int8 digits d1 + d2 / 254 of int4_matmul.c, joined). A group's dot product is one
 * exact integer sum of s16 x s16 products (simd.h: AVX-512 VNNI's vpdpwssd, 32 products an instruction,
 * AVX2's vpmaddwd, NEON's smull; the int8 weights widened as they load), and per group, per output:
 *     acc = fma(d[n, g], S_g, acc),   y = acc * max|x| / 32258 (+ bias)
 * So beyond the activations' codes (~1e-5 of the output) only the float steps round (a group sum's
 * conversion, the f32 accumulation): SmolLM2's KLD against f32 weights is ~1e-6 (with one weight
 * scale per row, which re-rounded the Q8_0 grid: 0.0016).
 * Every float operation of a row is the same whatever the batch or the thread count: a row's logits
 * are the same bits alone or batched.
 *
 * Packed weights: panels of 16 output rows; per panel, its groups in order, 544 bytes each: the 16
 * outputs' f16 scales, then 16 pairs of 32 bytes, byte 2 * lane + i = w[16 * panel + lane,
 * 32 * g + 2 * pair + i] (vpdpwssd's operand once widened). K is rounded up to 32 with zero weights.
 * A panel is read in address order and no 32-byte load crosses a cache line (scales after each
 * group's codes measured 9% slower decode steps, at the panel's end 40-90% slower head calls).
 * models/linear.py's pack_int8_groups writes it. The activations' codes are stored tile by tile
 * (ROW_TILE rows' pairs side by side), so that the inner loop addresses a tile's rows from one pointer
 * and keeps their accumulators in registers.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PANEL 16
#if VL == 8 /* 16 vector registers: three per row (two integer chains, the sum) */
#define ROW_TILE 4
#else
#define ROW_TILE 8
#endif
#define GROUP 32
#define BLOCK_BYTES 544 /* a panel's group: 32 bytes of scales, 512 of codes (16 outputs x 32 inputs) */
#define RADIX 32258.0f  /* 127 * 254 */

SIMD_EXPORT_ISA

/* The code of input g * 32 + i of output lane in a panel's group block (see the top). */
static inline int8_t code_at(const uint8_t *blk, int lane, int i) {
    return (int8_t)blk[32 + 32 * (i / 2) + 2 * lane + i % 2];
}

/* The int16 codes of one row (zero in the padding up to Kp), pair j at c + 2 * j * ROW_TILE. Returns
 * max|x| / 32258. */
static float code_row(const float *x, int K, int Kp, int16_t *c) {
    float amax = 0.0f;
    for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    amax = fmaxf(amax, 1e-30f);
    const float inv = RADIX / amax;
    for (int k = 0; k < Kp; k++) c[k / 2 * 2 * ROW_TILE + k % 2] = k < K ? (int16_t)nearbyintf(x[k] * inv) : 0;
    return amax / RADIX;
}

/* Rows [0, nr) of a tile against one panel, sum_g d_g * S_g to out[r][0..16), VL outputs at a time
 * (lanes [h VL, h VL + VL) of a pair: its bytes [2 VL h, 2 VL (h + 1))). Two integer chains a row
 * (even and odd pairs: the split of an integer sum is exact) so that one row is not bound by the
 * instruction's latency. */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *panel, int G, const int16_t *c,
                                                             float *out, const int nr) {
    for (int h = 0; h < PANEL / VL; h++) {
        vf acc[ROW_TILE];
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) acc[r] = vf_zero();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * BLOCK_BYTES;
            const int16_t *cg = c + (int64_t)g * GROUP * ROW_TILE;
            const vf d = vf_from_half(blk + 2 * VL * h);
            vi sa[ROW_TILE], sb[ROW_TILE];
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) sa[r] = sb[r] = vi_zero();
            for (int j = 0; j < GROUP / 2; j += 2) {
                const vw wa = vw_widen((const int8_t *)blk + 32 + 32 * j + 2 * VL * h);
                const vw wb = vw_widen((const int8_t *)blk + 64 + 32 * j + 2 * VL * h);
#pragma GCC unroll 8
                for (int r = 0; r < nr; r++) {
                    sa[r] = vi_dot_s16(sa[r], wa, cg + 2 * (j * ROW_TILE + r));
                    sb[r] = vi_dot_s16(sb[r], wb, cg + 2 * ((j + 1) * ROW_TILE + r));
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) acc[r] = vf_fma(d, vf_from_vi(vi_add(sa[r], sb[r])), acc[r]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < nr; r++) vf_store(out + r * PANEL + h * VL, acc[r]);
    }
}

/* x [M, K] f32; w packed [ceil(N / 16), ceil(K / 32), 544] (see the top); bias [N] or NULL; y [M, N].
 * Returns 0, or -1 when the codes could not be allocated. */
int int8_matmul(const float *x, const uint8_t *w, const float *bias, int M, int N, int K, float *y,
                int num_threads) {
    const int Kp = (K + GROUP - 1) / GROUP * GROUP, G = Kp / GROUP, panels = (N + PANEL - 1) / PANEL;
    const size_t rows = (size_t)(M + ROW_TILE - 1) / ROW_TILE * ROW_TILE; /* whole tiles */
    /* one allocation: the codes, then the row scales */
    int16_t *c = malloc(sizeof(int16_t) * rows * Kp + sizeof(float) * (size_t)M);
    if (!c) return -1;
    float *row_scale = (float *)(c + rows * Kp);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            row_scale[m] = code_row(x + (int64_t)m * K, K, Kp, c + (int64_t)(m / ROW_TILE) * ROW_TILE * Kp + 2 * (m % ROW_TILE));
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint8_t *panel = w + (int64_t)p * G * BLOCK_BYTES;
            const int n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
                const int nr = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
                const int16_t *ct = c + (int64_t)m0 * Kp;
                float out[ROW_TILE][PANEL];
#define TILE(n) case n: panel_tile(panel, G, ct, out[0], n); break;
                switch (nr) {
#if ROW_TILE == 8
                    TILE(8) TILE(7) TILE(6) TILE(5)
#endif
                    TILE(4) TILE(3) TILE(2) TILE(1)
                }
#undef TILE
                for (int r = 0; r < nr; r++)
                    for (int i = 0; i < width; i++)
                        y[(int64_t)(m0 + r) * N + n0 + i] = fmaf(out[r][i], row_scale[m0 + r], bias ? bias[n0 + i] : 0.0f);
            }
        }
    }
    free(c);
    return 0;
}

/* Rows ids[0..n) of packed weights with K inputs as f32 out [n][K]: each code times its group's scale
 * (a product exact in f32), a tied model's embedding lookup from its head. */
void int8_rows(const uint8_t *w, const int64_t *ids, int n, int K, float *out) {
    const int G = (K + GROUP - 1) / GROUP;
    for (int r = 0; r < n; r++) {
        const uint8_t *panel = w + ids[r] / PANEL * G * BLOCK_BYTES;
        const int lane = (int)(ids[r] % PANEL);
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = panel + (int64_t)g * BLOCK_BYTES;
            uint16_t h;
            memcpy(&h, blk + 2 * lane, 2);
            const float d = half_to_float(h);
            for (int i = 0; i < GROUP && g * GROUP + i < K; i++)
                out[(int64_t)r * K + g * GROUP + i] = (float)code_at(blk, lane, i) * d;
        }
    }
}
